"""Bulk load: rows for keys with no live version, written as Parquet files by the loader
and published here without passing through the write buffer (docs/write-paths/bulk-load.md).

A loader (retina_common/bulk_loader.py: ``retina-load``, the CDC connector's initial
snapshot, a Spark backfill) holds a write transaction at timestamp T and, per node:

**PrepareBulkLoad** names one new file per virtual node of the load (this node's
naming scheme) and registers each TEMPORARY_INGEST in the catalog, before any byte
is written, so every object on storage has a row the sweepers can find. The loader
writes the files itself (Arrow batches, every row's ``_commit_ts`` = T, the load id
in the footer), durably.

**CommitBulkLoad** checks every file (the table's columns, T in every row, each key
routed to the file's virtual node, no key twice), then per stream: reserves the
file's block span (sealing the stream's open file) and waits until no unpublished
ingest file of the stream lies before it, so the replay chain stays trustworthy
(LOAD_FOLLOWS_PUBLISHED_FILES). Then, under the streams' publisher and buffer locks
and admitted by the write fence at T (LATE_WRITES_FENCED, write_fence.py), each step
between two failpoints:

1. LOAD_KEYS_HAVE_NO_LIVE_VERSION: no key has a live version at T or any version
   after it (ALREADY_EXISTS otherwise, nothing changed; such rows go through
   UpdateRecord);
2. row ids reserved; the journal record COMMITTED (load_journal.py): the commit
   point. From here on a failure fails the node closed and recovery re-applies;
3. MainIndex ranges (durable) and the primary versions key@T of every file, sorted,
   in one LMDB transaction;
4. the files REGULAR in the catalog with their row-id hulls;
5. the registry and visibility: the rows are visible at T to readers whose
   snapshot reaches T, once the loader commits T at the TransServer.

Recovery (:meth:`BulkLoads.reapply`, after the rewind): a journaled load whose file
the loaded checkpoint kept below its stream's replay start is already whole; every
other one is re-applied at T from its files through the ordinary apply path
(LOADS_REAPPLIED_FROM_THEIR_FILES). Promotion (:meth:`BulkLoads.observe_checkpoint`):
once both checkpoint slots start above T in each of its streams, the record goes.
"""

from __future__ import annotations

import contextlib
import itertools
import re
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime

import grpc
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from prometheus_client import Counter, Gauge, Histogram

from retina_common import failpoints as fp
from retina_common import file_names
from retina_common.catalog import (
    Catalog,
    FileType,
    NotFound,
    TableRecord,
)
from retina_common.codec import COMMIT_TS, LOAD_ID_KEY, EncodingError, encode_primary_keys
from retina_common.log import get_logger
from retina_common.refusal import Refusal
from retina_common.replay_ts import ReplayStarts
from retina_common.schema_evolution import conform, table_schema
from retina_common.storage import open_parquet
from retina_server.load_journal import LoadedFile, LoadEntry, LoadJournal
from retina_server.main_index import RowIdRange
from retina_server.node import RetinaNode, Stream
from retina_server.primary_index import MAX_KEY_BYTES
from retina_server.publisher import mark_regular
from retina_server.registry import IngestFileMeta
from retina_server.update_record import PreparedUpdate, apply
from retina_server.visibility import RGVisibility
from retina_server.write_fence import Fenced

log = get_logger(component="bulk_load")

# A loader's own load id (PrepareBulkLoadRequest.load_id): also a journal file name.
LOAD_ID = re.compile(r"[A-Za-z0-9_.-]{1,128}")

LOADS = Counter("retina_bulk_loads_total", "Bulk loads by outcome", ["outcome"])
LOADED_ROWS = Counter("retina_bulk_load_rows_total", "Rows published by bulk loads")
COMMIT_SECONDS = Histogram("retina_bulk_load_commit_seconds",
                           "CommitBulkLoad, from the first check to the registry",
                           buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60))
PHASE_SECONDS = Histogram("retina_bulk_load_phase_seconds",
                          "CommitBulkLoad time by phase (check, wait, conflicts, journal, "
                          "index, publish)", ["phase"],
                          buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30))
REAPPLIED_ROWS = Counter("retina_bulk_load_reapplied_rows_total",
                         "Rows recovery re-applied from journaled loads' files")
OPEN_ENTRIES = Gauge("retina_bulk_load_journal_entries",
                     "Load journal records not yet promoted")
PREPARED = Gauge("retina_bulk_loads_prepared", "Loads prepared, not committed or expired")


@dataclass(frozen=True)
class LoadSettings:
    # A prepared load must commit within this; its TEMPORARY_INGEST files are kept
    # from the sweepers meanwhile.
    prepare_ttl_ms: int = 1_800_000
    # How long a commit waits for the stream's older ingest files to publish.
    publish_wait_s: float = 60.0
    # How long a catalog that is away is retried (under the streams' locks) before the
    # node fails closed (its restart re-applies the load from the journal).
    catalog_deadline_s: float = 60.0
    # A journal record stays at least this long, whatever the checkpoints: a loader that
    # retries a commit whose answer was lost (for up to its deadline, across a restart of
    # the node) is answered from it, not told the load is unknown.
    record_min_age_ms: int = 600_000


@dataclass
class PreparedFile:
    vnode: int
    file_id: int
    name: str


@dataclass
class PreparedLoad:
    load_id: str
    table: TableRecord
    ts: int
    path_id: int
    path_uri: str
    files: list[PreparedFile]
    expires_at_ms: int
    lock: threading.Lock = field(default_factory=threading.Lock)


@dataclass(frozen=True)
class LoadResult:
    load_id: str
    ts: int
    rows: int
    file_ids: tuple[int, ...]


@dataclass
class _Checked:
    """One loader file, checked: what the commit writes from it."""

    prepared: PreparedFile
    stream: Stream
    keys: list[bytes]  # in the primary index's order (PrimaryIndex.index_order)
    positions: np.ndarray  # each key's row in the file
    rg_row_counts: tuple[int, ...]
    first_block_id: int = 0
    row_id_start: int = 0

    @property
    def rows(self) -> int:
        return sum(self.rg_row_counts)


def _refuse(code: grpc.StatusCode, message: str) -> Refusal:
    return Refusal(code, message)


class BulkLoads:
    """The node's side of the bulk load: prepare, commit, re-apply, promote."""

    def __init__(self, node: RetinaNode, catalog: Catalog, journal: LoadJournal,
                 settings: LoadSettings = LoadSettings(),
                 clock_ms: Callable[[], int] = lambda: int(time.time() * 1000)) -> None:
        self._node = node
        self._catalog = catalog
        self.journal = journal
        self._settings = settings
        self._clock_ms = clock_ms
        self._pending: dict[str, PreparedLoad] = {}
        self._done: dict[str, LoadResult] = {}
        self._lock = threading.Lock()
        # The replay starts of the two newest checkpoints this process installed.
        self._recent: deque[ReplayStarts] = deque(maxlen=2)

    # --- prepare ---------------------------------------------------------------------------
    def prepare(self, schema_name: str, table_name: str, ts: int, vnodes: list[int],
                load_id: str = "") -> PreparedLoad | LoadResult:
        """A new prepared load; or, for a ``load_id`` the loader chose that committed
        already (a retried loader), its result (LOADER_IDS_ARE_IDEMPOTENT). A load id
        prepared and not committed is prepared anew (its old files lapse)."""
        node = self._node
        node.check_writable()
        if load_id and not LOAD_ID.fullmatch(load_id):
            raise _refuse(grpc.StatusCode.INVALID_ARGUMENT,
                          f"load_id {load_id!r}: letters, digits, '_', '.', '-', at most 128")
        if load_id:
            done = self._committed(load_id)
            if done is not None:
                return done
            with self._lock:
                stale = self._pending.get(load_id)
                if stale is not None and stale.lock.locked():
                    raise _refuse(grpc.StatusCode.UNAVAILABLE,
                                  f"load {load_id} is committing; ask again")
            self.abort(load_id)
        if ts <= 0:
            raise _refuse(grpc.StatusCode.INVALID_ARGUMENT, "timestamp is required")
        if not vnodes or len(set(vnodes)) != len(vnodes):
            raise _refuse(grpc.StatusCode.INVALID_ARGUMENT,
                          f"virtual_node_ids must be non-empty and distinct: {vnodes}")
        foreign = sorted(set(vnodes) - node.owned_vnodes)
        if foreign:
            raise _refuse(grpc.StatusCode.FAILED_PRECONDITION,
                          f"virtual nodes {foreign} are not served by {node.node_id}")
        try:
            table = node.refresh_table(schema_name, table_name)
        except NotFound as exc:  # a catalog that is away answers UNAVAILABLE (refusal.py)
            raise _refuse(grpc.StatusCode.INVALID_ARGUMENT,
                          f"unknown table {schema_name}.{table_name}: {exc}") from None
        if ts <= node.fence.floor:  # checked again at the commit, under the stream locks
            raise Fenced(f"write fence: load timestamp {ts} is at or below "
                         f"{node.node_id}'s write floor {node.fence.floor}; begin a new "
                         "write transaction", node.fence.floor)
        stream = node.stream(table, vnodes[0])
        files = []
        fp.LOAD_PREPARE_CATALOG_BEFORE.hit()
        for vnode in sorted(vnodes):
            seq = node.index.sequences.allocate("file_seq")
            name = file_names.make(node.node_id, datetime.now(UTC), seq, vnode)
            record = self._catalog.add_file(name, FileType.TEMPORARY_INGEST, 0, stream.path_id)
            files.append(PreparedFile(vnode, record.file_id, name))
        fp.LOAD_PREPARE_CATALOG_AFTER.hit()
        load = PreparedLoad(load_id or uuid.uuid4().hex, table, ts, stream.path_id,
                            stream.path_uri, files,
                            self._clock_ms() + self._settings.prepare_ttl_ms)
        with self._lock:
            self._expire()
            self._pending[load.load_id] = load
            PREPARED.set(len(self._pending))
        log.info("bulk_load_prepared", node=node.node_id, table=table.name, load_id=load.load_id,
                 ts=ts, files=[f.file_id for f in files])
        return load

    def _expire(self) -> None:
        now = self._clock_ms()
        for lid in [k for k, p in self._pending.items()
                    if p.expires_at_ms <= now and not p.lock.locked()]:
            LOADS.labels(outcome="expired").inc()
            log.warning("bulk_load_expired", load_id=lid)
            del self._pending[lid]
        PREPARED.set(len(self._pending))

    def protected_files(self) -> set[int]:
        """Files no sweeper may remove: those of prepared loads (a loader may be writing
        them) and of journaled ones (LOAD_FILES_OUTLIVE_THEIR_ENTRY)."""
        with self._lock:
            self._expire()
            prepared = {f.file_id for p in self._pending.values() for f in p.files}
        return prepared | self.journal.protected_files()

    def abort(self, load_id: str) -> None:
        with self._lock:
            load = self._pending.get(load_id)
            if load is not None and not load.lock.locked():
                del self._pending[load_id]
                LOADS.labels(outcome="aborted").inc()
            PREPARED.set(len(self._pending))

    # --- commit ----------------------------------------------------------------------------
    def commit(self, load_id: str, ts: int) -> LoadResult:
        done = self._finished(load_id, ts)
        if done is not None:
            return done
        with self._lock:
            self._expire()
            load = self._pending.get(load_id)
        if load is None:
            raise _refuse(grpc.StatusCode.NOT_FOUND,
                          f"load {load_id} is unknown here: never committed (expired, "
                          "aborted, or prepared before the node restarted); prepare the "
                          "load again")
        if ts != load.ts:
            raise _refuse(grpc.StatusCode.INVALID_ARGUMENT,
                          f"load {load_id} was prepared at timestamp {load.ts}, not {ts}")
        if not load.lock.acquire(blocking=False):
            raise _refuse(grpc.StatusCode.UNAVAILABLE, f"load {load_id} is committing")
        try:
            done = self._finished(load_id, ts)
            if done is not None:
                return done
            with self._lock:
                if self._pending.get(load_id) is not load:  # aborted or lapsed meanwhile
                    raise _refuse(grpc.StatusCode.NOT_FOUND,
                                  f"load {load_id} was aborted or expired; prepare it again")
            self._node.check_writable()
            started = time.perf_counter()
            result = self._commit(load)
            COMMIT_SECONDS.observe(time.perf_counter() - started)
        finally:
            load.lock.release()
        with self._lock:
            self._pending.pop(load_id, None)
            self._done[load_id] = result
            while len(self._done) > 1000:
                del self._done[next(iter(self._done))]
            PREPARED.set(len(self._pending))
        return result

    def _committed(self, load_id: str) -> LoadResult | None:
        with self._lock:
            done = self._done.get(load_id)
        if done is None:
            entry = self.journal.get(load_id)
            if entry is None:
                return None
            done = LoadResult(load_id, entry.ts, entry.row_count, entry.file_ids)
        return done

    def _finished(self, load_id: str, ts: int) -> LoadResult | None:
        """The answer to a repeated commit (the first answer was lost)."""
        done = self._committed(load_id)
        if done is None:
            return None
        if done.ts != ts:
            raise _refuse(grpc.StatusCode.INVALID_ARGUMENT,
                          f"load {load_id} committed at timestamp {done.ts}, not {ts}")
        return done

    def _commit(self, load: PreparedLoad) -> LoadResult:
        phases = _Phases()
        checked = [self._check_file(load, f) for f in load.files]
        phases.done("check")
        streams = sorted({id(c.stream): c.stream for c in checked}.values(),
                         key=lambda s: (s.table.table_id, s.vnode))
        for c in checked:
            c.first_block_id = self._reserve_blocks(c)
        self._wait_published(checked)
        while True:
            with contextlib.ExitStack() as locks:
                # The publisher locks, then the buffer locks, each in one order: as a
                # checkpoint and a request take them (no deadlock).
                for stream in streams:
                    locks.enter_context(stream.publisher.lock)
                for stream in streams:
                    locks.enter_context(stream.buffer.lock)
                if not self._older_unpublished(checked):
                    phases.done("wait")
                    return self._apply(load, checked, phases)
            self._wait_published(checked)

    def _check_file(self, load: PreparedLoad, f: PreparedFile) -> _Checked:
        """The loader's file holds the table's columns, T in every row, each key once and
        routed to the file's virtual node (INVALID_ARGUMENT otherwise, nothing changed)."""
        bad = grpc.StatusCode.INVALID_ARGUMENT
        table = load.table
        try:
            parquet = open_parquet(load.path_uri, f.name)
        except (OSError, ValueError) as exc:
            raise _refuse(bad, f"load file {f.name} cannot be read: {exc}") from exc
        expected = table_schema(table)
        if parquet.schema_arrow.names != expected.names:
            raise _refuse(bad, f"load file {f.name} has columns {parquet.schema_arrow.names}, "
                               f"not the table's {expected.names}")
        wrong_types = [f"{a.name} {a.type} (not {b.type})" for a, b in
                       zip(parquet.schema_arrow, expected, strict=True) if a.type != b.type]
        if wrong_types:
            raise _refuse(bad, f"load file {f.name}: columns of other types: {wrong_types}")
        named = (parquet.metadata.metadata or {}).get(LOAD_ID_KEY, b"").decode()
        if named != load.load_id:
            raise _refuse(bad, f"load file {f.name} names load {named or 'none'} in its footer "
                               f"({LOAD_ID_KEY.decode()}), not {load.load_id}")
        counts = tuple(parquet.metadata.row_group(i).num_rows
                       for i in range(parquet.metadata.num_row_groups))
        if not counts or any(c == 0 for c in counts):
            raise _refuse(bad, f"load file {f.name} is empty or has an empty row group")
        _check_not_null(table, f.name, parquet)
        by_name = {c.name: c for c in table.columns}
        names = list(table.primary_key)
        try:
            part = parquet.read(columns=[*names, COMMIT_TS])
            stamps = part.column(COMMIT_TS)
            if stamps.null_count or pc.min(stamps).as_py() != load.ts or \
                    pc.max(stamps).as_py() != load.ts:
                raise _refuse(bad, f"load file {f.name}: every row's {COMMIT_TS} must be the "
                                   f"load's timestamp {load.ts}")
            encoded = encode_primary_keys([by_name[n].type for n in names],
                                          [part.column(n).combine_chunks() for n in names])
        except (OSError, ValueError, EncodingError, pa.ArrowInvalid) as exc:
            raise _refuse(bad, f"load file {f.name} cannot be checked: {exc}") from exc
        longest = pc.max(pc.binary_length(encoded)).as_py() or 0
        if longest > MAX_KEY_BYTES:
            raise _refuse(bad, f"load file {f.name}: a primary key of {longest} bytes; the "
                               f"index takes at most {MAX_KEY_BYTES}")
        every = encoded.to_pylist()
        order = self._node.index.primary.index_order(every)  # the index's own order
        keys = [every[i] for i in order]
        if any(a == b for a, b in itertools.pairwise(keys)):  # sorted: a repeat is a neighbour
            raise _refuse(bad, f"load file {f.name} holds a key twice")
        vnodes = self._node.topology.vnodes_of_keys(keys)
        wrong = np.flatnonzero(vnodes != f.vnode)
        if len(wrong):
            key = keys[int(wrong[0])]
            raise _refuse(bad, f"load file {f.name} is for virtual node {f.vnode}, but key "
                               f"{key.hex()} routes to {int(vnodes[wrong[0]])}")
        return _Checked(f, self._node.stream(table, f.vnode), keys, order.astype(np.int64),
                        counts)

    def _reserve_blocks(self, c: _Checked) -> int:
        """The file's block span, after every block the stream has handed out; the open
        file is sealed, so no later block of it lands after the span."""
        buffer = c.stream.buffer
        with buffer.lock:
            first = self._node.index.sequences.allocate(
                f"block:{buffer.table_id}:{buffer.vnode}", len(c.rg_row_counts))
            buffer.seal_open_file()
        self._node.submit_sealed(c.stream)
        return first

    @staticmethod
    def _older_unpublished(checked: list[_Checked]) -> list[int]:
        """LOAD_FOLLOWS_PUBLISHED_FILES: unpublished ingest files of a load's stream that
        lie before its span. Registered with them around, the load would be an admitted
        file after an unpublished one, and a checkpoint's chain for the stream would not
        be trusted (a replay from 0)."""
        return [f.file_id for c in checked for f in c.stream.buffer.files
                if f.first_block_id < c.first_block_id]

    def _wait_published(self, checked: list[_Checked]) -> None:
        deadline = time.monotonic() + self._settings.publish_wait_s
        while older := self._older_unpublished(checked):
            for c in checked:
                with c.stream.buffer.lock:
                    c.stream.buffer.seal_open_file()
                self._node.submit_sealed(c.stream)
            if time.monotonic() > deadline:
                raise _refuse(grpc.StatusCode.UNAVAILABLE,
                              f"ingest files {older[:5]} were not published within "
                              f"{self._settings.publish_wait_s:.0f}s; retry the commit")
            self._node.check_writable()
            time.sleep(0.01)

    def _apply(self, load: PreparedLoad, checked: list[_Checked],
               phases: _Phases) -> LoadResult:
        node = self._node
        table = load.table
        with node.fence.admit(load.ts):
            self._check_no_live_keys(table, load.ts, checked)
            phases.done("conflicts")
            for c in checked:
                c.row_id_start = node.index.sequences.allocate_row_ids(c.rows)
            entry = LoadEntry(load.load_id, node.node_id, table.schema_name, table.name,
                              table.table_id, load.ts, self._clock_ms(),
                              tuple(LoadedFile(c.prepared.vnode, c.prepared.file_id,
                                               c.prepared.name, load.path_id, load.path_uri,
                                               c.rows, c.row_id_start, c.first_block_id,
                                               c.rg_row_counts) for c in checked))
            try:
                self.journal.write(entry, fp.LOAD_JOURNAL_BEFORE, fp.LOAD_JOURNAL_AFTER)
            except OSError as exc:
                if self.journal.get(load.load_id) is None:  # never renamed into place
                    raise _refuse(grpc.StatusCode.UNAVAILABLE,
                                  f"load journal write failed, nothing changed: {exc}") from exc
                # In place, but its directory not synced: committed for all we know.
                node.fail_closed(f"bulk load {load.load_id}: journal record written, then "
                                 f"{exc}")
                raise
            OPEN_ENTRIES.set(len(self.journal.entries()))
            phases.done("journal")
            try:
                self._publish(entry, checked, phases)
            except Exception as exc:
                # The record is the commit point: the restart re-applies the load.
                node.fail_closed(f"bulk load {load.load_id} failed after its journal record: "
                                 f"{exc}")
                raise
        LOADS.labels(outcome="committed").inc()
        LOADED_ROWS.inc(entry.row_count)
        log.info("bulk_load_committed", node=node.node_id, table=table.name,
                 load_id=load.load_id, ts=load.ts, rows=entry.row_count,
                 files=list(entry.file_ids), seconds=phases.seconds)
        return LoadResult(load.load_id, load.ts, entry.row_count, entry.file_ids)

    def _check_no_live_keys(self, table: TableRecord, ts: int, checked: list[_Checked]) -> None:
        for c in checked:
            clash = self._node.index.primary.load_conflicts(table.table_id, c.keys, ts)
            if clash:
                LOADS.labels(outcome="refused_live_keys").inc()
                raise _refuse(grpc.StatusCode.ALREADY_EXISTS,
                              f"{table.name}: {len(clash)} key(s) of load file "
                              f"{c.prepared.name} already have a live version at or after "
                              f"timestamp {ts} (first: {c.keys[clash[0]].hex()}); a bulk "
                              "load inserts only keys with none: send these through "
                              "UpdateRecord (a replace); nothing changed")

    def _publish(self, entry: LoadEntry, checked: list[_Checked], phases: _Phases) -> None:
        node = self._node
        fp.LOAD_INDEX_BEFORE.hit()
        for f in entry.files:
            node.index.main.put_main_index_entries(_ranges(f))
            node.index.main.flush_file(f.file_id)
        # Every file's versions in one LMDB transaction: one fsync for the load.
        node.index.primary.put_load_versions(
            entry.table_id, [k for c in checked for k in c.keys],
            np.concatenate([f.row_id_start + c.positions
                            for c, f in zip(checked, entry.files, strict=True)]), entry.ts)
        fp.LOAD_INDEX_AFTER.hit()
        phases.done("index")
        fp.LOAD_CATALOG_REGULAR_BEFORE.hit()
        for f in entry.files:
            mark_regular(self._catalog, f.file_id, len(f.rg_row_counts), f.row_id_start,
                         f.row_id_start + f.row_count - 1, self._settings.catalog_deadline_s,
                         retry_s=0.5)
        fp.LOAD_CATALOG_REGULAR_AFTER.hit()
        fp.LOAD_REGISTRY_BEFORE.hit()
        for f in entry.files:
            node.registry.register(IngestFileMeta(
                f.file_id, entry.table_id, f.vnode, f.first_block_id, entry.ts, entry.ts,
                f.row_count, f.row_id_start, f.row_id_start + f.row_count - 1,
                len(f.rg_row_counts), len(f.rg_row_counts)))
            for rg, count in enumerate(f.rg_row_counts):
                node.visibility.adopt(f.file_id, rg, RGVisibility(count))
        fp.LOAD_REGISTRY_AFTER.hit()
        phases.done("publish")

    # --- recovery ----------------------------------------------------------------------------
    def load_journal(self) -> set[int]:
        """Start-up, before cleansing: read the journal (CorruptLoadJournal if a record
        does not check); returns the files cleansing must not delete."""
        entries = self.journal.load()
        OPEN_ENTRIES.set(len(entries))
        return {f for e in entries for f in e.file_ids}

    def reapply(self, starts: ReplayStarts) -> int:
        """LOADS_REAPPLIED_FROM_THEIR_FILES, after the rewind and before any replay. A load
        below its stream's replay start is whole in the loaded checkpoint: a start above T
        means a checkpoint taken after the commit (its fence waited for it) with no
        unpublished row at or below T, so every row at T is in a kept file (the load's
        own, or the copies an earlier recovery re-applied). At or above the start, the
        rewind hid the rows and dropped their versions, or the file was retired or never
        published: its rows are applied again at T through the ordinary apply path.
        Returns rows re-applied."""
        total = 0
        entries = self.journal.entries()
        for entry in entries:
            table = self._node.refresh_table(entry.schema_name, entry.table_name)
            if table.table_id != entry.table_id:
                raise LoadJournalMismatch(f"load {entry.load_id}: table {entry.table_name} is "
                                          f"now table {table.table_id}, not {entry.table_id}")
            for f in entry.files:
                if entry.ts < starts.scope_start(entry.table_id, f.vnode):
                    continue
                fp.LOAD_REAPPLY_BEFORE.hit()
                total += self._reapply_file(table, entry, f)
                fp.LOAD_REAPPLY_AFTER.hit()
        REAPPLIED_ROWS.inc(total)
        if entries:
            log.info("bulk_loads_reapplied", node=self._node.node_id, loads=len(entries),
                     rows=total)
        return total

    def _reapply_file(self, table: TableRecord, entry: LoadEntry, f: LoadedFile) -> int:
        try:
            rows = open_parquet(f.path_uri, f.name).read()
        except (OSError, ValueError) as exc:
            raise LoadJournalMismatch(f"load {entry.load_id}: file {f.name} cannot be read "
                                      f"({exc}); LOAD_FILES_OUTLIVE_THEIR_ENTRY") from exc
        if rows.num_rows != f.row_count:
            raise LoadJournalMismatch(f"load {entry.load_id}: file {f.name} holds "
                                      f"{rows.num_rows} rows, the journal {f.row_count}")
        data = conform(rows, table_schema(table)).drop_columns([COMMIT_TS])
        by_name = {c.name: c for c in table.columns}
        names = list(table.primary_key)
        keys = encode_primary_keys([by_name[n].type for n in names],
                                   [data.column(n).combine_chunks() for n in names]).to_pylist()
        columns = [data.column(i).combine_chunks() for i in range(data.num_columns)]
        apply(self._node, [PreparedUpdate(table, f.vnode, entry.ts, [], keys, columns)],
              fenced=False, check_live=False)
        log.info("bulk_load_reapplied", load_id=entry.load_id, file_id=f.file_id,
                 vnode=f.vnode, rows=f.row_count, ts=entry.ts)
        return f.row_count

    # --- promotion ---------------------------------------------------------------------------
    def observe_checkpoint(self, starts: ReplayStarts) -> int:
        """A checkpoint was installed (``starts``: its replay starts, derived by the
        wiring once for every listener): promote every load both slots start above (the
        newest two this process installed: a start that falls back to ``previous``
        must still find the rows) and whose record is ``record_min_age_ms`` old.
        Returns loads promoted."""
        self._recent.append(starts)
        if len(self._recent) < 2:
            return 0
        promoted = 0
        old_enough = self._clock_ms() - self._settings.record_min_age_ms
        try:
            for entry in self.journal.entries():
                if entry.created_at_ms <= old_enough and \
                        all(entry.ts < s.scope_start(entry.table_id, f.vnode)
                            for s in self._recent for f in entry.files):
                    self.journal.promote(entry.load_id, fp.LOAD_PROMOTE_BEFORE,
                                         fp.LOAD_PROMOTE_AFTER)
                    promoted += 1
                    log.info("bulk_load_promoted", load_id=entry.load_id, ts=entry.ts)
        finally:
            OPEN_ENTRIES.set(len(self.journal.entries()))
        return promoted


class _Phases:
    """Seconds per commit phase, for the commit's log line and the phase histogram."""

    def __init__(self) -> None:
        self._last = time.perf_counter()
        self.seconds: dict[str, float] = {}

    def done(self, phase: str) -> None:
        now = time.perf_counter()
        self.seconds[phase] = round(self.seconds.get(phase, 0.0) + now - self._last, 4)
        PHASE_SECONDS.labels(phase=phase).observe(now - self._last)
        self._last = now


class LoadJournalMismatch(Exception):
    """A journaled load cannot be re-applied (its file or table is gone): fail closed."""


def _check_not_null(table: TableRecord, name: str, parquet: pq.ParquetFile) -> None:
    """NOT_NULL_HOLDS for a load file: no NULL in a NOT NULL column (INVALID_ARGUMENT),
    from the row groups' statistics, or the column itself where a row group has none.
    The key columns are checked with the keys."""
    meta = parquet.metadata
    for i, column in enumerate(table.columns):
        if column.accepts_null or column.pk_position is not None:
            continue
        nulls = 0
        for rg in range(meta.num_row_groups):
            stats = meta.row_group(rg).column(i).statistics
            if stats is not None and stats.has_null_count:
                nulls += stats.null_count
            else:
                nulls += parquet.read_row_group(rg, columns=[column.name]).column(0).null_count
        if nulls:
            raise _refuse(grpc.StatusCode.INVALID_ARGUMENT,
                          f"load file {name}: {nulls} NULL(s) in NOT NULL column {column.name}")


def _ranges(f: LoadedFile) -> list[RowIdRange]:
    out, start = [], f.row_id_start
    for rg, count in enumerate(f.rg_row_counts):
        out.append(RowIdRange(start, count, f.file_id, rg, 0))
        start += count
    return out

