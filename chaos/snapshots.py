"""SNAPSHOT_IS_IMMUTABLE's check: a snapshot read, kept as row digests, and read again.

The invariant (issue 25): every read at timestamp S returns the same rows, whenever it
runs, for as long as S is readable at all; when S can no longer be read exactly, the read
is refused with a clear status, never answered differently.

A snapshot is every compared table at one timestamp S, read by one of two readers:

- **gated**: ``retina_common.reader.SnapshotReader``'s steps (the campaign's parallel
  ``FastSnapshotReader``) under a gated read-only transaction;
- **spark**: the Spark snapshot query's own code path without a JVM: its driver steps
  (``spark_jobs.snapshot_query.plan_snapshot``) and its task function ``read_files``,
  as the job runs them, in the campaign's process (as chaos/gc_driver.py runs the Storage GC
  job's ``rewrite_group``).

Either reads at any S at or below its transaction's own snapshot (a read may look at an
older point, never a newer one). A snapshot is kept as each key's row digests over every
column (``TableImage``); a second read of the same S must hold exactly the same rows
(``diff_images``, ``compare_taken``): a difference is the anomaly ``snapshot_changed``,
a key read more often than before (or twice in one read) ``snapshot_duplicates``. A read
refused with one of ``REFUSALS`` (``is_refusal``: a NOT_FOUND only for a forgotten
transaction) is counted by code, never an anomaly; any other answer is
``snapshot_read_error``. chaos/repeatable_reads.py decides when snapshots are taken
and read again; chaos/split_reads.py and chaos/stalls.py take their own.
"""

from __future__ import annotations

import contextlib
import hashlib
import re
import time
from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import grpc

from retina_common import tls as tls_mod
from retina_common.client import channel
from retina_common.pb import trans_pb2 as tpb
from retina_common.pb import trans_pb2_grpc
from retina_common.reader import SnapshotReader
from retina_common.topology import Topology
from spark_jobs.common import TaskError
from spark_jobs.snapshot_query import plan_snapshot, read_files

from .workload import APP_TABLE, BY_NAME, LOADED_TABLE, SCHEMA, TABLES, WIDE_TABLE, Key

SNAPSHOT_IS_IMMUTABLE = "SNAPSHOT_IS_IMMUTABLE"
# Codes that refuse a read: S is no longer readable exactly (ABORTED: below a node's
# restart floor or a visibility base), the transaction ended (FAILED_PRECONDITION, and
# NOT_FOUND once a TransServer restart forgot it: see is_refusal), a node or the gate away
# (UNAVAILABLE, DEADLINE_EXCEEDED, CANCELLED). Counted by code; any other answer is an
# anomaly.
REFUSALS = frozenset({"ABORTED", "UNAVAILABLE", "FAILED_PRECONDITION", "NOT_FOUND",
                      "DEADLINE_EXCEEDED", "CANCELLED"})
# The TransServer's NOT_FOUND for a transaction it does not know (trans_gate).
_UNKNOWN_TRANSACTION = re.compile(r"transaction \d+ does not exist")
VIAS = ("gated", "spark")
# Spark tasks run at once by the in-process Spark path.
TASKS = 8
# A read transaction's lease: it pins safeGcTs while its snapshot waits to be read again
# (an episode, or a held one's few episodes, which extend it); a campaign killed
# meanwhile pins it no longer than this.
READ_LEASE_MS = 120_000
# A refusal's details as kept: long enough for a snapshot_expired's earliest readable point.
DETAIL_CHARS = 400
_CODE_IN_TEXT = re.compile(r": ([A-Z_]+): ")
SPECS = {**BY_NAME, WIDE_TABLE.name: WIDE_TABLE, APP_TABLE.name: APP_TABLE,
         LOADED_TABLE.name: LOADED_TABLE}


# --- images: a snapshot as row digests ------------------------------------------------------
def row_digest(record: dict[str, Any]) -> bytes:
    """A row's digest over its non-NULL columns, by name: a column added after S reads
    NULL in every row at S, so a read before the column existed and one after agree."""
    items = sorted((k, v) for k, v in record.items() if v is not None)
    return hashlib.blake2b(repr(items).encode(), digest_size=12).digest()


@dataclass(frozen=True)
class TableImage:
    """One table's rows at one snapshot: each key's row digests (two: a duplicate)."""

    rows: dict[Key, tuple[bytes, ...]]

    @classmethod
    def of(cls, records: Iterable[dict[str, Any]], pk: Sequence[str]) -> TableImage:
        rows: dict[Key, list[bytes]] = {}
        for record in records:
            rows.setdefault(tuple(record[c] for c in pk), []).append(row_digest(record))
        return cls({k: tuple(sorted(v)) for k, v in rows.items()})

    @property
    def count(self) -> int:
        return sum(len(v) for v in self.rows.values())

    def duplicated(self) -> list[Key]:
        return [k for k, v in self.rows.items() if len(v) > 1]


@dataclass
class ImageDiff:
    """How a second read of a table at S differs from the first (rows, by key)."""

    lost: list[Key] = field(default_factory=list)  # in the first read only
    extra: list[Key] = field(default_factory=list)  # in the second read only
    changed: list[Key] = field(default_factory=list)  # in both, other values
    duplicated: list[Key] = field(default_factory=list)  # more copies than the first had

    @property
    def same(self) -> bool:
        return not (self.lost or self.extra or self.changed or self.duplicated)

    def describe(self) -> str:
        parts = []
        for name in ("lost", "extra", "changed", "duplicated"):
            keys: list[Key] = getattr(self, name)
            if keys:
                parts.append(f"{len(keys)} {name} (e.g. {sorted(keys, key=repr)[:3]})")
        return ", ".join(parts)


def diff_images(first: TableImage, again: TableImage) -> ImageDiff:
    """SNAPSHOT_IS_IMMUTABLE for one table: ``again`` must hold exactly ``first``'s rows."""
    diff = ImageDiff()
    for key in first.rows.keys() | again.rows.keys():
        a, b = first.rows.get(key, ()), again.rows.get(key, ())
        if a == b:
            continue
        if len(b) > max(1, len(a)):
            diff.duplicated.append(key)
        if not b:
            diff.lost.append(key)
        elif not a:
            diff.extra.append(key)
        elif set(a) != set(b):
            diff.changed.append(key)
    return diff


# What a snapshot must hold: table -> the source's (or a model's) image, and the keys the
# model leaves undecided (chaos/app_model.py), which are not compared.
Expected = dict[str, tuple[TableImage, frozenset[Key]]]


def differences_from(expected: Expected, images: dict[str, TableImage]) -> list[str]:
    """Per table of ``images`` that ``expected`` knows, how it differs from it (lost: in
    the source only, extra: in the snapshot only), undecided keys left out."""
    problems = []
    for table, (want, undecided) in sorted(expected.items()):
        got = images.get(table)
        if got is None:
            continue
        diff = diff_images(
            TableImage({k: v for k, v in want.rows.items() if k not in undecided}),
            TableImage({k: v for k, v in got.rows.items() if k not in undecided}))
        if not diff.same:
            problems.append(f"{table}: {diff.describe()}")
    return problems


# --- reading a snapshot ---------------------------------------------------------------------
class ReadRefused(Exception):
    """A read answered with a status instead of rows; ``code`` is its gRPC name (or
    ``ERROR`` for a failure that is not a status)."""

    def __init__(self, code: str, detail: str) -> None:
        super().__init__(f"{code}: {detail}")
        self.code = code
        self.detail = detail


def is_refusal(exc: ReadRefused) -> bool:
    """Whether ``exc`` refuses the read (S no longer readable) rather than answering it
    wrongly. A NOT_FOUND counts only for a transaction a TransServer restart forgot: a
    node's NOT_FOUND for a file or its visibility, under a live reader, means a file was
    removed while a snapshot could still read it, which is a defect."""
    if exc.code == "NOT_FOUND":
        return bool(_UNKNOWN_TRANSACTION.search(exc.detail))
    return exc.code in REFUSALS


def refusal_of(exc: BaseException) -> ReadRefused:
    if isinstance(exc, ReadRefused):
        return exc
    if isinstance(exc, grpc.RpcError):
        return ReadRefused(exc.code().name, (exc.details() or "")[:DETAIL_CHARS])
    if isinstance(exc, TaskError):  # the Spark task's wrapped status
        text = str(exc)
        found = _CODE_IN_TEXT.search(text)
        if found is None:
            return ReadRefused("ERROR", text[:DETAIL_CHARS])
        # The status's own details first (a snapshot_expired starts them), then the task's.
        return ReadRefused(found.group(1), f"{text[found.end():]} [{text[:found.start()]}]"
                                           [:DETAIL_CHARS])
    return ReadRefused("ERROR", f"{type(exc).__name__}: {exc}"[:DETAIL_CHARS])


def tables_taken() -> tuple[str, ...]:
    """The connector's tables: what the campaign's snapshots read (the source tables
    and the wide table their routed sources fill, chaos/wide.py)."""
    return (*(t.name for t in TABLES), WIDE_TABLE.name)


def tables_imaged() -> tuple[str, ...]:
    """The episode's image (chaos/repeatable_reads.py): the source tables, the
    application writer's and the bulk loader's."""
    return (*tables_taken(), APP_TABLE.name, LOADED_TABLE.name)


class SnapshotReaders:
    """The campaign's readers of one cluster: gated (FastSnapshotReader's steps) and the
    Spark query's path; both read at any S at or below the transaction's snapshot."""

    def __init__(self, reader: SnapshotReader, trans_address: str, topology: Topology,
                 timeout_s: float = 10) -> None:
        self.reader = reader
        self.trans_address = trans_address
        self.topology = topology
        self.timeout_s = timeout_s
        # Milliseconds spent reading snapshots, by reader (the checks' cost).
        self.read_ms: Counter[str] = Counter()
        self.channel = channel(trans_address)
        self.trans = trans_pb2_grpc.TransServiceStub(self.channel)
        self._tasks = ThreadPoolExecutor(TASKS, thread_name_prefix="chaos-spark-task")
        self._tables = ThreadPoolExecutor(len(tables_taken()), thread_name_prefix="chaos-table")

    def close(self) -> None:
        self._tables.shutdown(wait=True)
        self._tasks.shutdown(wait=True)
        self.channel.close()

    @contextmanager
    def transaction(self, lease_ms: int = READ_LEASE_MS) -> Iterator[tpb.BeginTransResponse]:
        """A gated read-only transaction, ended when the block exits (a refusal to end
        it, e.g. after a TransServer restart, changes nothing)."""
        trans = self.begin(lease_ms)
        try:
            yield trans
        finally:
            self.end(trans.trans_id)

    def begin(self, lease_ms: int = READ_LEASE_MS, *, as_of_ts: int = 0,
              as_of_time_ms: int = 0, as_of_pin: str = "") -> tpb.BeginTransResponse:
        """A gated read-only transaction, at the newest snapshot or AS OF a past point
        (docs/history.md); ReadRefused if the gate (or anything) says no."""
        try:
            return self.trans.BeginTrans(tpb.BeginTransRequest(
                read_only=True, lease_ms=lease_ms, as_of_ts=as_of_ts,
                as_of_time_ms=as_of_time_ms, as_of_pin=as_of_pin), timeout=self.timeout_s)
        except grpc.RpcError as exc:
            raise refusal_of(exc) from None

    def end(self, trans_id: int) -> bool:
        """CommitTrans; False if the TransServer refused (ended already) or is away."""
        try:
            self.trans.CommitTrans(tpb.CommitTransRequest(trans_id=trans_id),
                                   timeout=self.timeout_s)
        except grpc.RpcError:
            return False
        return True

    def extend(self, trans_id: int, lease_ms: int = READ_LEASE_MS) -> None:
        # Ended (a TransServer restart) or away: the re-read will say which.
        with contextlib.suppress(grpc.RpcError):
            self.trans.ExtendTransLease(tpb.ExtendTransLeaseRequest(
                trans_id=trans_id, lease_ms=lease_ms), timeout=self.timeout_s)

    def high_watermark(self) -> int | None:
        """The TransServer's HWM now (None if it does not answer)."""
        try:
            return self.trans.GetHighWatermark(tpb.GetHighWatermarkRequest(),
                                               timeout=self.timeout_s).high_watermark
        except grpc.RpcError:
            return None

    def live(self, trans_id: int) -> bool:
        try:
            return self.trans.GetTransStatus(tpb.GetTransStatusRequest(trans_id=trans_id),
                                             timeout=self.timeout_s).live
        except grpc.RpcError:
            return False

    def read(self, via: str, trans: tpb.BeginTransResponse,
             tables: Sequence[str]) -> dict[str, TableImage]:
        """Every table at ``trans.timestamp`` (which may lie below the snapshot of the
        transaction ``trans.trans_id``). Raises ReadRefused."""
        read = self._gated if via == "gated" else self._spark
        started = time.monotonic()
        # The tables side by side (a query per table, as a client would run them): most
        # of a read is waiting for QueryVisibility answers.
        futures = {t: self._tables.submit(read, trans, t) for t in tables}
        try:
            return {t: TableImage.of(f.result(), SPECS[t].pk) for t, f in futures.items()}
        except Exception as exc:  # a status, a task's error, a file unreadable
            for f in futures.values():
                f.cancel()
            raise refusal_of(exc) from None
        finally:
            self.read_ms[f"read_ms_{via}"] += int((time.monotonic() - started) * 1000)

    def _gated(self, trans: tpb.BeginTransResponse, table: str) -> list[dict[str, Any]]:
        snap = self.reader.read_in(trans, SCHEMA, table)
        return list(snap.table.to_pylist())

    def _spark(self, trans: tpb.BeginTransResponse, table: str) -> list[dict[str, Any]]:
        plan = plan_snapshot(trans, self.trans_address, self.topology, SCHEMA, table,
                             tls_mod.current())
        names = plan.spec.schema.names
        # The job's tasks, TASKS at a time, each over a share of the files (the job runs
        # one per file; a task's reader opens its own channels, so fewer are cheaper here).
        shares = [plan.refs[i::TASKS] for i in range(TASKS)]
        parts = self._tasks.map(lambda refs: list(read_files(plan.spec, refs)), shares)
        rows = [*plan.buffer_rows, *(row for part in parts for row in part)]
        return [dict(zip(names, row, strict=True)) for row in rows]


# --- a snapshot as first read, and a second read of it -------------------------------------
@dataclass
class Taken:
    """A snapshot as first read."""

    sid: int
    via: str  # gated, spark (or split: a split read's reference)
    ts: int
    episode: int
    phase: str  # when in the episode: before the fault, during the fault, ...
    images: dict[str, TableImage]
    # Its transaction while still open (pinning S against folds and rewrites), until the
    # re-reads after healing episode ``until_episode``; None once ended.
    trans: tpb.BeginTransResponse | None = None
    until_episode: int = 0
    held: bool = False  # open for the next episodes too
    begun_at: float = field(default_factory=time.monotonic)
    # Taken AS OF this wall-clock time (ms since epoch; 0: at the newest snapshot): it
    # names S, and is read again by it (chaos/as_of_reads.py).
    time_ms: int = 0
    pin: str = ""  # a pin the campaign created at S while it holds it (pinned_snapshots.py)
    # An anomaly was reported about it (read differently, refused wrongly): not read
    # again, as later reads would only repeat it.
    reported: bool = False

    def label(self) -> str:
        held = f", held to episode {self.until_episode}" if self.held else ""
        at = f" AS OF time {self.time_ms}" if self.time_ms else ""
        return (f"S={self.ts} ({self.via} #{self.sid}{at}, first read in episode "
                f"{self.episode} {self.phase}{held})")


def compare_taken(first: Taken, again: dict[str, TableImage], how: str,
                  history: str) -> str:
    """SNAPSHOT_IS_IMMUTABLE over every table ``first`` took: "" if ``again`` holds
    exactly its rows, else the anomaly's text (``snapshot_duplicates`` when the only
    difference is keys read more often than at first, else ``snapshot_changed``)."""
    diffs = {t: diff_images(image, again[t]) for t, image in first.images.items()}
    differ = {t: d for t, d in diffs.items() if not d.same}
    if not differ:
        return ""
    only_copies = all(d.duplicated and not (d.lost or d.extra or d.changed)
                      for d in differ.values())
    tables = "; ".join(f"{t}: {first.images[t].count} rows first, {again[t].count} then: "
                       f"{d.describe()}" for t, d in differ.items())
    return (f"{'snapshot_duplicates' if only_copies else 'snapshot_changed'}: "
            f"{SNAPSHOT_IS_IMMUTABLE} broken: {first.label()}, {how}: {tables}; between: "
            f"{history or 'nothing recorded'}")


def duplicates_in(images: dict[str, TableImage], what: str) -> str:
    """A read that holds a key twice is wrong whatever came before it: "" or the text."""
    found = {t: dup for t, im in images.items() if (dup := im.duplicated())}
    return "snapshot_duplicates: " + ", ".join(
        f"{what}: table {t} holds {len(dup)} keys twice (e.g. {dup[:3]})"
        for t, dup in found.items()) if found else ""
