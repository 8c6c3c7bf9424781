"""Storage GC, the commit side on the owning Retina node (specification C07, section 5).

A Spark job (spark_jobs/storage_gc.py) rewrites old REGULAR files of one
stream into one new file that holds their rows not deleted at or below the
cutoff (safeGcTs, lowered below the replay floor), registers it TEMPORARY_GC
and asks this node to commit it.

**PrepareGcRewrite** checks the group (READY; REGULAR files of this node's
stream, consecutive in firstBlockId order, none in another rewrite; a requested
cutoff at or below the TransServer's safeGcTs), lowers the cutoff below the
replay floor (GC_CUTOFF_BELOW_REPLAY_FLOOR, :func:`bounded_cutoff`: a replay
after a crash finds every row a partial update merges with), checks it is at
or above every old row group's visibility base, pins the cutoff (the GC
scheduler folds no visibility above a pinned cutoff, so the job can read
visibility at exactly it), raises the write fence to the cutoff
(write_fence.py: no delete at or below it can arrive any more, so the rows it
drops are final), and names the new file with this node's naming scheme.
Nothing durable happens. The answer's ``cutoff_ts`` is the cutoff, which the
job then uses.

**CommitGcRewrite**, in this order, each durable step between two failpoints
(docs/write-paths/storage-gc.md names every window and recovery's answer):

0. BUFFER_FETCH_HOLDS_FILE: refuse (ABORTED, nothing changed, retry later) while
   a read transaction that got rows of an old file from its write buffer can
   still list files: it would find the new file and keep the buffered rows too;
1. verify the new file against the survivors the node computes itself (row
   count, primary keys and commit timestamps, row by row, in Arrow);
2. reserve row ids; journal INDEX_SWITCHING (write-ahead: everything below can
   be undone); set the new file's row-id hull (it is still TEMPORARY_GC); the
   MainIndex ranges of the new file (durable; its row ids are new, so nothing
   reaches them before the switch, and the stream's writers do not wait for them);
3. under the stream's publisher and buffer locks (the switch only): check
   CUTOFF_UNCHANGED_SINCE_PREPARE (the rows deleted at or below the cutoff are
   those prepare took; otherwise roll back, ABORTED) and step 0 again;
   new-file visibility, ``baseTimestamp = cutoff`` and one chain item per
   delete after the cutoff, including deletes that arrived while Spark
   rewrote; the primary switch (every version still on an old row moves to its
   new row, in the index's key order);
   ``atomicSwapFiles(new, olds, cleanupAt)``; journal SWAPPED_NOT_CHECKPOINTED;
   the registry and visibility index move to the new file (the old files'
   visibility stays, frozen, for readers whose file list predates the swap);
4. once both checkpoint slots hold the new file (the second checkpoint after the
   commit), the entry is promoted to CHECKPOINTED (:meth:`StorageGc.promote`).

A failure before the swap committed rolls back in place (primary switched
back, MainIndex ranges and the new file dropped, journal ABORTED) and the
call is refused with nothing changed; a failure after it, or a rollback that
fails, fails the node closed, and recovery decides from the journal
(gc_recovery.py).
"""

from __future__ import annotations

import contextlib
import functools
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
from prometheus_client import Counter, Gauge, Histogram
from pyroaring import BitMap

from retina_common import failpoints as fp
from retina_common import file_names
from retina_common.catalog import (
    Catalog,
    CatalogError,
    CatalogOutcomeUnknown,
    CatalogUnavailable,
    FileRecord,
    FileType,
    TableRecord,
)
from retina_common.catalog.errors import SwapPreconditionFailed
from retina_common.codec import COMMIT_TS, GC_REWRITE_ID_KEY, EncodingError, encode_primary_keys
from retina_common.log import get_logger
from retina_common.refusal import (
    AWAITING_CHECKPOINT,
    HELD_BY_BUFFER_READ,
    ROLLED_BACK_FOR_BUFFER_READ,
    Refusal,
)
from retina_common.retry import until_deadline
from retina_common.storage import delete_quietly, object_size, open_parquet
from retina_server.gc.gc_journal import (
    OPEN_STATES,
    GcJournal,
    JournalConflict,
    JournalEntry,
    JournalState,
    OldFile,
)
from retina_server.main_index import RowIdRange
from retina_server.node import RetinaNode, Stream, table_schema
from retina_server.registry import IngestFileMeta
from retina_server.visibility import RGVisibility

log = get_logger(component="storage_gc")

REWRITES = Counter("retina_gc_rewrites_total", "Storage GC rewrites by outcome", ["outcome"])
ROWS_RECLAIMED = Counter("retina_gc_rows_reclaimed_total",
                         "Deleted rows removed from storage by committed rewrites")
ROWS_REWRITTEN = Counter("retina_gc_rows_rewritten_total", "Rows moved into new files")
BYTES_BEFORE = Counter("retina_gc_bytes_before_total", "Bytes of old files replaced")
BYTES_AFTER = Counter("retina_gc_bytes_after_total", "Bytes of the new files replacing them")
JOURNAL_ENTRIES = Gauge("retina_gc_journal_entries", "GC journal entries by state", ["state"])
JOURNAL_OLDEST_OPEN = Gauge("retina_gc_journal_oldest_open_age_seconds",
                            "Age of the oldest journal entry not CHECKPOINTED or ABORTED")
PENDING = Gauge("retina_gc_pending_rewrites", "Rewrites prepared, not committed or aborted")
CUTOFFS_LOWERED = Counter("retina_gc_cutoffs_lowered_total",
                          "Prepared rewrites whose cutoff the replay floor lowered below the "
                          "requested safeGcTs (GC_CUTOFF_BELOW_REPLAY_FLOOR)")
HELD_BY_READERS = Counter("retina_gc_commits_held_by_readers_total",
                          "Commits refused because a live read got rows of an old file from "
                          "a write buffer (BUFFER_FETCH_HOLDS_FILE)")
# Where a commit's time goes; "locked" is the time the stream's writers wait for (the switch
# under the publisher and buffer locks), "lock_wait" the time the commit waited for them.
COMMIT_SECONDS = Histogram("retina_gc_commit_seconds", "CommitGcRewrite time by phase",
                           ["phase"], buckets=(.005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5))
# Computed at scrape time (the gauges above change only when the journal does, so an entry
# that is stuck would look frozen): the "GC journal stuck" alert reads this one.
JOURNAL_STATE_AGE = Gauge("retina_gc_journal_state_age_seconds",
                          "Time the longest-waiting entry has spent in each open state (0: none)",
                          ["state"])


_LAST_TS = (1 << 63) - 1  # above every timestamp
# Answers to repeated commits kept in memory; older ones are rebuilt from the journal.
DONE_KEPT = 1000


class GcRolledBack(Exception):
    """The commit failed before the swap and was undone: nothing changed."""


@dataclass(frozen=True)
class GcSettings:
    # How long replaced files stay (cleanupAt - swap time): readers whose file list
    # predates the swap keep reading them until then (the sweepers delete later).
    retired_retention_ms: int = 600_000
    # A prepared rewrite must commit within this; it pins the fold floor meanwhile.
    prepare_ttl_ms: int = 1_800_000
    # How long an unknown swap outcome is re-read before the node fails closed.
    swap_outcome_deadline_s: float = 60.0


@dataclass
class PendingRewrite:
    rewrite_id: str
    table: TableRecord
    stream: Stream
    old: list[IngestFileMeta]
    old_names: list[str]
    rg_row_counts: list[tuple[int, ...]]
    cutoff: int
    file_name: str
    expires_at_ms: int
    dropped: dict[tuple[int, int], BitMap]
    trans_id: int = 0  # the job's read transaction: a rewrite whose job died lapses with it
    lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def expected_rows(self) -> int:
        total = sum(sum(c) for c in self.rg_row_counts)
        return total - sum(len(b) for b in self.dropped.values())


@dataclass(frozen=True)
class Survivors:
    """The rows a rewrite keeps, in new-file order."""

    keys: list[bytes]
    commit_ts: np.ndarray
    old_row_ids: np.ndarray


@dataclass(frozen=True)
class CommitResult:
    rewrite_id: str
    new_file_id: int
    retired_file_ids: tuple[int, ...]
    rows_kept: int
    rows_dropped: int
    chain_items: int
    journal_state: str
    outcome: str = "COMMITTED"


class _PhaseTimer:
    """The phases of one commit, in milliseconds (a log line) and into COMMIT_SECONDS."""

    def __init__(self) -> None:
        self._start = self._last = time.perf_counter()
        self.phases: dict[str, float] = {}

    def lap(self, phase: str) -> None:
        now = time.perf_counter()
        self.phases[phase] = now - self._last
        self._last = now

    def span(self, phase: str, since: float) -> None:
        """A phase that holds laps of its own (the time under the stream locks)."""
        self.phases[phase] = time.perf_counter() - since

    def observe(self) -> None:
        for phase, seconds in self.phases.items():
            COMMIT_SECONDS.labels(phase=phase).observe(seconds)
        COMMIT_SECONDS.labels(phase="total").observe(self._last - self._start)

    def fields(self) -> dict[str, float]:
        out = {f"{p}_ms": round(s * 1000, 1) for p, s in self.phases.items()}
        out["commit_ms"] = round((self._last - self._start) * 1000, 1)
        return out


def _refuse(code: grpc.StatusCode, message: str) -> Refusal:
    return Refusal(code, message)


def bounded_cutoff(requested: int, replay_floor: int, visibility_base: int = 0) -> int:
    """The cutoff a rewrite uses for a requested one (the job's safeGcTs, already checked
    against the TransServer's), or a refusal, ABORTED, nothing changed: a later run.

    GC_CUTOFF_BELOW_REPLAY_FLOOR: ``cutoff = min(requested, replay_floor - 1)``. After a
    crash, recovery rewinds to the replay start and replays the changelog from it, and
    a partial update at T >= the start merges with the key's row just below T
    (PARTIAL_BASE_IS_BEFORE_T, partial_update.py): a row its own replace deleted at T.
    A rewrite drops the rows deleted at or below its cutoff, so a cutoff at or above
    such a T leaves that row in no file the node serves, and the replay is refused
    (orphan base) and the recovery cannot finish. ``replay_floor`` is the lowest start
    any crash-restart could use (gc_scheduler.ReplayFloor: both checkpoint slots), so
    every row deleted at or after it stays. 0 is unknown (not both slots known yet).
    The cutoff must also be at or above ``visibility_base`` (the highest base of the
    old row groups): visibility answers at or above a base only."""
    if replay_floor <= 1:  # unknown, or no cutoff in (0, replay_floor)
        known = "no replay floor yet (the replay starts of both checkpoint slots are not " \
            "known)" if replay_floor <= 0 else f"no cutoff below the replay floor {replay_floor}"
        raise _refuse(grpc.StatusCode.ABORTED,
                      f"{known}, GC_CUTOFF_BELOW_REPLAY_FLOOR; nothing changed, take a later run")
    cutoff = min(requested, replay_floor - 1)
    if cutoff < visibility_base:
        lowered = "" if cutoff == requested else \
            f" (safeGcTs {requested} lowered below the replay floor {replay_floor})"
        raise _refuse(grpc.StatusCode.ABORTED,
                      f"cutoff {cutoff}{lowered} is below the visibility base "
                      f"{visibility_base} of these files; nothing changed, take a later run "
                      "(a newer safe GC timestamp, or a later checkpoint)")
    return cutoff


# --- the survivors: shared by the commit (verification) and recovery (rollback) -------------
def old_row_ids(ranges: list[RowIdRange], rg_row_counts: tuple[int, ...],
                file_id: int) -> list[np.ndarray]:
    """Per row group, the row id of every row, from the file's MainIndex ranges.
    Raises LookupError if the ranges do not cover the file (an anchor is gone)."""
    out = [np.full(n, -1, dtype=np.int64) for n in rg_row_counts]
    for r in ranges:
        if r.rg_id >= len(out) or r.rg_row_offset + r.count > len(out[r.rg_id]):
            raise LookupError(f"file {file_id}: MainIndex range outside the file's row groups")
        out[r.rg_id][r.rg_row_offset:r.rg_row_offset + r.count] = \
            np.arange(r.row_id_start, r.row_id_end, dtype=np.int64)
    for rg, ids in enumerate(out):
        if len(ids) and ids.min() < 0:
            raise LookupError(f"file {file_id} row group {rg}: MainIndex ranges do not cover it")
    return out


def kept_mask(row_count: int, dropped: BitMap) -> np.ndarray:
    keep = np.ones(row_count, dtype=bool)
    if len(dropped):
        idx = np.frombuffer(dropped.to_array(), dtype=np.uint32)
        keep[idx[idx < row_count]] = False
    return keep


def key_columns(table: TableRecord) -> tuple[list[str], list[str]]:
    by_name = {c.name: c for c in table.columns}
    names = list(table.primary_key)
    return names, [by_name[n].type for n in names]


def survivors(node: RetinaNode, table: TableRecord, path_uri: str,
              files: list[tuple[int, str, tuple[int, ...]]],
              dropped: dict[tuple[int, int], BitMap]) -> Survivors:
    """Keys, commit timestamps and old row ids of the rows the rewrite keeps, read
    from the old files (only the key and commit-ts columns) and their MainIndex
    ranges. Raises LookupError / OSError / ValueError if an anchor is unreadable."""
    names, types = key_columns(table)
    keys: list[pa.Array] = []
    stamps: list[np.ndarray] = []
    ids: list[np.ndarray] = []
    for file_id, name, counts in files:
        per_rg = old_row_ids(node.index.main.ranges_of_file(file_id), counts, file_id)
        parquet = open_parquet(path_uri, name)
        if parquet.metadata.num_row_groups != len(counts):
            raise LookupError(f"file {file_id} has {parquet.metadata.num_row_groups} row "
                              f"groups, {len(counts)} expected")
        for rg, count in enumerate(counts):
            part = parquet.read_row_group(rg, columns=[*names, COMMIT_TS])
            if part.num_rows != count:
                raise LookupError(f"file {file_id} rg {rg} has {part.num_rows} rows, "
                                  f"{count} expected")
            keep = kept_mask(count, dropped.get((file_id, rg), BitMap()))
            part = part.filter(pa.array(keep))
            keys.append(encode_primary_keys(
                types, [part.column(n).combine_chunks() for n in names]))
            stamps.append(part.column(COMMIT_TS).to_numpy())
            ids.append(per_rg[rg][keep])
    flat = pa.concat_arrays(keys) if keys else pa.array([], pa.binary())
    return Survivors(flat.to_pylist(),
                     np.concatenate(stamps) if stamps else np.array([], np.int64),
                     np.concatenate(ids) if ids else np.array([], np.int64))


def entry_survivors(node: RetinaNode, entry: JournalEntry) -> Survivors:
    """The survivors of a journaled rewrite, read from its old files (for a rollback or
    a revert). Raises LookupError / OSError / ValueError if an anchor is unreadable."""
    table = node.table(entry.schema_name, entry.table_name)
    if table.table_id != entry.table_id:
        raise LookupError(f"table {entry.table_name} is now table {table.table_id}")
    return survivors(node, table, entry.path_uri,
                     [(o.file_id, o.name, o.rg_row_counts) for o in entry.old_files],
                     entry.dropped)


def switch_primary_back(node: RetinaNode, entry: JournalEntry, plan: Survivors) -> None:
    """Every primary version still on a new row moves back to its old row (idempotent)."""
    start = entry.new_row_id_start
    node.index.primary.switch_primary(entry.table_id, plan.keys,
                              (start + np.arange(len(plan.keys))).tolist(),
                              plan.old_row_ids.tolist())


# --- the commit side ---------------------------------------------------------------------------
class StorageGc:
    def __init__(self, node: RetinaNode, catalog: Catalog, journal: GcJournal,
                 safe_gc_ts: Callable[[], int], settings: GcSettings = GcSettings(),
                 clock_ms: Callable[[], int] = lambda: int(time.time() * 1000),
                 trans_live: Callable[[int], bool] = lambda _trans_id: True,
                 replay_floor: Callable[[], int] = lambda: 0) -> None:
        self._node = node
        self._trans_live = trans_live
        # The lowest replay start a crash-restart could use (gc_scheduler.ReplayFloor.floor;
        # 0: unknown, and every prepare is refused): GC_CUTOFF_BELOW_REPLAY_FLOOR.
        self._replay_floor = replay_floor
        self._catalog = catalog
        self._journal = journal
        self._safe_gc_ts = safe_gc_ts
        self._settings = settings
        self._clock_ms = clock_ms
        self._pending: dict[str, PendingRewrite] = {}
        # The GC scheduler's fold target (gc_scheduler.GcScheduler.fold_fence), set by the
        # server once both exist.
        self.fold_fence: Callable[[], int] = lambda: 0
        # Files of journaled bulk loads (bulk_load.py), set by the wiring: not rewritten
        # while recovery may still re-apply them.
        self.load_files: Callable[[], set[int]] = set
        self._done: dict[str, CommitResult] = {}
        # File ids of the two newest checkpoints (the current and the previous slot).
        self._recent: deque[frozenset[int]] = deque(maxlen=2)
        self._lock = threading.Lock()
        self.update_gauges()
        for state in OPEN_STATES:
            JOURNAL_STATE_AGE.labels(state=state.value).set_function(
                functools.partial(self._state_age_s, state))

    @property
    def journal(self) -> GcJournal:
        return self._journal

    # --- prepare ---------------------------------------------------------------------------
    def prepare(self, schema_name: str, table_name: str, vnode: int, old_ids: list[int],
                safe_gc_ts: int, trans_id: int = 0) -> PendingRewrite:
        node = self._node
        node.check_writable()
        if not old_ids:
            raise _refuse(grpc.StatusCode.INVALID_ARGUMENT, "old_file_ids is empty")
        if len(set(old_ids)) != len(old_ids):
            raise _refuse(grpc.StatusCode.INVALID_ARGUMENT, f"old_file_ids repeat: {old_ids}")
        if vnode not in node.owned_vnodes:
            raise _refuse(grpc.StatusCode.FAILED_PRECONDITION,
                          f"virtual node {vnode} is not served by {node.node_id}")
        try:
            # Re-read, not cached: the rewrite writes the table's current columns (schema
            # evolution), and _verify holds the new file to exactly these.
            table = node.refresh_table(schema_name, table_name)
        except CatalogError as exc:
            raise _refuse(grpc.StatusCode.INVALID_ARGUMENT,
                          f"unknown table {schema_name}.{table_name}: {exc}") from None
        stream = node.stream(table, vnode)
        old = self._stream_run(table, vnode, old_ids)
        # From here on the cutoff, never the requested safeGcTs: the pin, the fence, the
        # dropped rows and the answer (the job reads visibility at exactly this cutoff).
        cutoff, replay_floor = self._check_cutoff(old, safe_gc_ts)
        # LATE_WRITES_FENCED: no delete at or below the cutoff can arrive from now on, and
        # every one admitted before has finished, so the dropped rows read below are final.
        node.fence.raise_to(cutoff, f"Storage GC prepare at cutoff {cutoff}")
        self._drop_orphaned(set(old_ids))
        with self._lock:
            self._expire()
            busy = self._why_busy(set(old_ids))
            if busy:
                raise _refuse(grpc.StatusCode.ABORTED, f"{busy}; nothing changed, a later run "
                                                       "can rewrite them")
            if self._stream_run(table, vnode, old_ids) != old:  # a commit landed meanwhile
                raise _refuse(grpc.StatusCode.ABORTED,
                              "the stream changed while the rewrite was prepared; try again")
            regular = {f.file_id: f.name for f in
                       self._catalog.get_files_by_type(stream.path_id, [FileType.REGULAR])}
            missing = [m.file_id for m in old if m.file_id not in regular]
            if missing:
                raise _refuse(grpc.StatusCode.FAILED_PRECONDITION,
                              f"files {missing} are not REGULAR files in the catalog")
            names = [regular[m.file_id] for m in old]
            counts = [tuple(node.visibility.get(m.file_id, rg).row_count
                            for rg in range(m.num_row_group)) for m in old]
            dropped = {(m.file_id, rg): node.visibility.get(m.file_id, rg).deleted_at(cutoff)
                       for m in old for rg in range(m.num_row_group)}
            seq = node.index.sequences.allocate("file_seq")
            name = file_names.make(node.node_id, datetime.now(UTC), seq, vnode)
            pending = PendingRewrite(uuid.uuid4().hex, table, stream, old, names, counts,
                                     cutoff, name,
                                     self._clock_ms() + self._settings.prepare_ttl_ms, dropped,
                                     trans_id)
            self._pending[pending.rewrite_id] = pending
            # FOLD_FENCE: pinned first, fence read after; a maintenance round that read
            # the pins before this one may already fold up to its fence.
            if cutoff < self.fold_fence():
                del self._pending[pending.rewrite_id]
                raise _refuse(grpc.StatusCode.ABORTED,
                              f"cutoff {cutoff} is below the visibility fold under way; "
                              "take a newer safe GC timestamp")
        PENDING.set(len(self._pending))
        if cutoff < safe_gc_ts:
            CUTOFFS_LOWERED.inc()
        log.info("gc_rewrite_prepared", node=node.node_id, table=table.name, vnode=vnode,
                 rewrite_id=pending.rewrite_id, old_files=old_ids, cutoff_ts=cutoff,
                 requested_cutoff_ts=safe_gc_ts, replay_floor_ts=replay_floor,
                 expected_rows=pending.expected_rows, file_name=name)
        return pending

    def hold_of(self, file_id: int) -> str:
        """Why a rewrite of ``file_id`` would be refused now for a reason that lasts (an
        open journal entry, a bulk load; empty: none); the job's plan leaves such a file
        out (QueryVisibility's ``gc_hold``). A rewrite only prepared is not reported: its
        job may have died, and the prepare that names the file drops it then."""
        return self._why_held({file_id})

    def _why_busy(self, wanted: set[int]) -> str:
        """Why some of ``wanted`` cannot be rewritten now (empty: they can). Under _lock."""
        for p in self._pending.values():
            clash = wanted & {m.file_id for m in p.old}
            if clash:
                return f"files {sorted(clash)} are in rewrite {p.rewrite_id}, not committed yet"
        return self._why_held(wanted)

    def _why_held(self, wanted: set[int]) -> str:
        """The journal's and the bulk loads' holds on ``wanted`` (their own locks only)."""
        for e in self._journal.open_entries():
            if e.new_file_id in wanted and e.state == JournalState.SWAPPED_NOT_CHECKPOINTED:
                return (f"file {e.new_file_id} is the output of rewrite {e.rewrite_id}, "
                        f"{AWAITING_CHECKPOINT} (both checkpoint slots must hold it before it "
                        "is rewritten again: the second checkpoint after its commit, see "
                        "retina.checkpoint_interval_ms)")
            clash = wanted & {e.new_file_id, *e.old_file_ids}
            if clash:
                return f"files {sorted(clash)} are in rewrite {e.rewrite_id} ({e.state.value})"
        clash = wanted & self.load_files()
        if clash:
            return (f"files {sorted(clash)} belong to a bulk load whose journal record no "
                    "checkpoint has promoted yet")
        return ""

    def _stream_run(self, table: TableRecord, vnode: int,
                    old_ids: list[int]) -> list[IngestFileMeta]:
        """The old files as registry entries: REGULAR files of this stream, consecutive
        in firstBlockId order (so the new file's block span overlaps no other file's,
        and the replay-start chain stays trustworthy), in that order."""
        files = self._node.registry.stream_files(table.table_id, vnode)
        position = {m.file_id: i for i, m in enumerate(files)}
        unknown = [f for f in old_ids if f not in position]
        if unknown:
            raise _refuse(grpc.StatusCode.FAILED_PRECONDITION,
                          f"files {unknown} are not published files of {table.name} "
                          f"vnode {vnode} on {self._node.node_id}")
        first = position[old_ids[0]]
        if [position[f] for f in old_ids] != list(range(first, first + len(old_ids))):
            raise _refuse(grpc.StatusCode.FAILED_PRECONDITION,
                          f"files {old_ids} are not consecutive in the stream's firstBlockId "
                          "order; a rewrite replaces a run of neighbouring files")
        return [files[position[f]] for f in old_ids]

    def _check_cutoff(self, old: list[IngestFileMeta], requested: int) -> tuple[int, int]:
        """The cutoff for the requested one (:func:`bounded_cutoff`) and the replay floor
        that bounded it; a refusal if the request is out of range or no cutoff fits."""
        try:
            safe = self._safe_gc_ts()
        except Refusal:
            raise
        except Exception as exc:
            raise _refuse(grpc.StatusCode.UNAVAILABLE,
                          f"safe GC timestamp unavailable: {exc}") from exc
        if requested <= 0 or requested > safe:
            raise _refuse(grpc.StatusCode.INVALID_ARGUMENT,
                          f"cutoff {requested} is not in (0, safeGcTs {safe}]")
        try:
            replay_floor = int(self._replay_floor())
        except Exception as exc:
            raise _refuse(grpc.StatusCode.UNAVAILABLE,
                          f"replay floor unavailable: {exc}") from exc
        # Visibility answers at or above a row group's base only (a restart restores the
        # checkpoint's at checkpointAppliedTs). The read floor is no bound here: the cutoff
        # is below every live snapshot, and a reader older than the restart is refused.
        base = max([0] + [self._node.visibility.get(m.file_id, rg).base_timestamp
                          for m in old for rg in range(m.num_row_group)])
        return bounded_cutoff(requested, replay_floor, base), replay_floor

    def _drop_orphaned(self, files: set[int] | None = None) -> None:
        """Forget prepared rewrites whose job is gone (its read transaction ended: the
        driver was killed), so they neither keep their files busy nor pin the fold
        floor until they expire. Only those over ``files`` when given (a conflict)."""
        with self._lock:
            candidates = [p for p in self._pending.values()
                          if p.trans_id and not p.lock.locked() and
                          (files is None or files & {m.file_id for m in p.old})]
        for p in candidates:
            try:
                alive = self._trans_live(p.trans_id)
            except Exception as exc:  # the TransServer is away: keep the pin (safe side)
                log.warning("gc_trans_status_unavailable", error=str(exc))
                return
            if not alive:
                with self._lock:
                    if self._pending.get(p.rewrite_id) is p and not p.lock.locked():
                        del self._pending[p.rewrite_id]
                REWRITES.labels(outcome="orphaned").inc()
                log.info("gc_rewrite_orphaned", rewrite_id=p.rewrite_id, trans_id=p.trans_id)
        PENDING.set(len(self._pending))

    def gc_floor(self, drop_orphaned: bool = True) -> int | None:
        """The lowest pinned cutoff: no visibility may be folded above it. (A status
        read passes ``drop_orphaned=False``: it must not wait on the TransServer.)"""
        if drop_orphaned:
            self._drop_orphaned()
        with self._lock:
            self._expire()
            return min((p.cutoff for p in self._pending.values()), default=None)

    def _expire(self) -> None:
        """Forget lapsed rewrites; never one that is committing (its pin must hold until
        the new visibility is built)."""
        now = self._clock_ms()
        for rid in [r for r, p in self._pending.items()
                    if p.expires_at_ms <= now and not p.lock.locked()]:
            log.warning("gc_rewrite_expired", rewrite_id=rid)
            REWRITES.labels(outcome="expired").inc()
            del self._pending[rid]

    def abort(self, rewrite_id: str) -> None:
        with self._lock:
            pending = self._pending.pop(rewrite_id, None)
        if pending is not None:
            REWRITES.labels(outcome="aborted_by_job").inc()
            log.info("gc_rewrite_abandoned", rewrite_id=rewrite_id)
        PENDING.set(len(self._pending))

    # --- commit ------------------------------------------------------------------------------
    def commit(self, rewrite_id: str, new_file_id: int) -> CommitResult:
        done = self._finished(rewrite_id, new_file_id)
        if done is not None:
            return done
        with self._lock:
            self._expire()
            pending = self._pending.get(rewrite_id)
        if pending is None:
            raise _refuse(grpc.StatusCode.FAILED_PRECONDITION,
                          f"rewrite {rewrite_id} is unknown or expired here (the node may have "
                          "restarted); prepare the rewrite again")
        if not pending.lock.acquire(blocking=False):
            raise _refuse(grpc.StatusCode.UNAVAILABLE, f"rewrite {rewrite_id} is committing")
        try:
            done = self._finished(rewrite_id, new_file_id)
            if done is not None:
                return done
            with self._lock:
                if self._pending.get(rewrite_id) is not pending:  # lapsed meanwhile
                    raise _refuse(grpc.StatusCode.FAILED_PRECONDITION,
                                  f"rewrite {rewrite_id} lapsed; prepare it again")
            self._node.check_writable()
            if pending.expires_at_ms <= self._clock_ms():  # its pin lapsed: folds passed it
                raise _refuse(grpc.StatusCode.FAILED_PRECONDITION,
                              f"rewrite {rewrite_id} expired; prepare it again")
            result = self._commit(pending, new_file_id)
        except GcRolledBack as exc:
            REWRITES.labels(outcome="rolled_back").inc()
            self._forget(rewrite_id)
            if isinstance(exc.__cause__, Refusal):  # e.g. the swap's precondition failed
                raise exc.__cause__ from None
            raise _refuse(grpc.StatusCode.ABORTED, f"{exc}; nothing changed, prepare the "
                                                   "rewrite again") from None
        finally:
            pending.lock.release()
            self.update_gauges()
        self._forget(rewrite_id)
        with self._lock:
            self._done[rewrite_id] = result
            while len(self._done) > DONE_KEPT:  # older answers come from the journal
                del self._done[next(iter(self._done))]
        return result

    def _forget(self, rewrite_id: str) -> None:
        with self._lock:
            self._pending.pop(rewrite_id, None)
        PENDING.set(len(self._pending))

    def _finished(self, rewrite_id: str, new_file_id: int) -> CommitResult | None:
        """The answer to a repeated commit (the first answer was lost)."""
        with self._lock:
            done = self._done.get(rewrite_id)
        entry = self._journal.get(rewrite_id)
        if done is None and entry is None:
            return None
        if entry is not None and entry.state == JournalState.ABORTED:
            raise _refuse(grpc.StatusCode.FAILED_PRECONDITION,
                          f"rewrite {rewrite_id} was rolled back: {entry.reason}")
        if entry is not None and entry.new_file_id != new_file_id:
            raise _refuse(grpc.StatusCode.INVALID_ARGUMENT,
                          f"rewrite {rewrite_id} committed file {entry.new_file_id}, "
                          f"not {new_file_id}")
        if done is not None:
            state = entry.state.value if entry else done.journal_state
            return CommitResult(done.rewrite_id, done.new_file_id, done.retired_file_ids,
                                done.rows_kept, done.rows_dropped, done.chain_items, state)
        if entry is not None and entry.state == JournalState.INDEX_SWITCHING:
            raise _refuse(grpc.StatusCode.UNAVAILABLE, f"rewrite {rewrite_id} is committing")
        assert entry is not None
        return CommitResult(rewrite_id, entry.new_file_id, tuple(entry.old_file_ids),
                            entry.rows_kept, sum(len(b) for b in entry.dropped.values()), 0,
                            entry.state.value)

    def _commit(self, pending: PendingRewrite, new_file_id: int) -> CommitResult:
        node = self._node
        timer = _PhaseTimer()
        readers = self._check_buffer_holds(pending)
        record, new_counts, plan = self._verify(pending, new_file_id)
        timer.lap("verify")
        kept = len(plan.keys)
        start = node.index.sequences.allocate_row_ids(max(kept, 1))
        now = self._clock_ms()
        entry = JournalEntry(
            pending.rewrite_id, JournalState.INDEX_SWITCHING, node.node_id,
            pending.table.schema_name, pending.table.name, pending.table.table_id,
            pending.stream.vnode, pending.stream.path_id, pending.stream.path_uri, new_file_id,
            record.name, start, tuple(new_counts),
            tuple(OldFile(m.file_id, n, c, m.first_block_id, m.block_count)
                  for m, n, c in zip(pending.old, pending.old_names, pending.rg_row_counts,
                                     strict=True)),
            pending.cutoff, now + self._settings.retired_retention_ms, now, now, "",
            dropped=pending.dropped)
        stream = pending.stream
        progress = _Progress()
        try:
            self._journal.write(entry, fp.GC_JOURNAL_SWITCHING_BEFORE,
                                fp.GC_JOURNAL_SWITCHING_AFTER)
        except Exception as exc:
            if self._journal.get(entry.rewrite_id) is None:  # no record: nothing to undo
                raise _refuse(grpc.StatusCode.UNAVAILABLE,
                              f"GC journal write failed, nothing changed: {exc}") from exc
            # The record is durable: close it (ABORTED) so its files are free again.
            self._roll_back_live(entry, plan, progress, exc)
            raise GcRolledBack(f"rewrite {pending.rewrite_id} rolled back: {exc}") from exc
        # ROW_READS_SEE_NO_MOVE: the switch (and a rollback of it) moves rows between
        # files; a point read that overlaps any of it reads again.
        with node.row_moves.moving():
            try:
                self._catalog.update_file(new_file_id, min_row_id=start,
                                          max_row_id=start + max(kept, 1) - 1,
                                          num_row_group=len(new_counts),
                                          expected_type=FileType.TEMPORARY_GC)
                timer.lap("journal")
                self._put_main_index(entry, progress)
                timer.lap("main_index")
                with stream.publisher.lock, stream.buffer.lock:
                    timer.lap("lock_wait")
                    locked_at = time.perf_counter()
                    self._check_cutoff_unchanged(pending)
                    self._check_no_new_buffer_readers(pending, readers)
                    chain_items = self._switch(pending, entry, plan, progress, timer)
                    timer.span("locked", locked_at)
            except Exception as exc:
                if progress.swapped:
                    node.fail_closed(f"GC rewrite {pending.rewrite_id} failed after its swap "
                                     f"committed: {exc}")
                    raise
                self._roll_back_live(entry, plan, progress, exc)
                raise GcRolledBack(f"rewrite {pending.rewrite_id} rolled back: {exc}") from exc
        node.forget_buffer_files(entry.old_file_ids)
        timer.lap("after")
        timer.observe()
        result = CommitResult(pending.rewrite_id, new_file_id, tuple(entry.old_file_ids), kept,
                              sum(len(b) for b in pending.dropped.values()), chain_items,
                              JournalState.SWAPPED_NOT_CHECKPOINTED.value)
        REWRITES.labels(outcome="committed").inc()
        ROWS_RECLAIMED.inc(result.rows_dropped)
        ROWS_REWRITTEN.inc(kept)
        self._count_bytes(pending, record)
        log.info("gc_rewrite_committed", node=node.node_id, table=pending.table.name,
                 vnode=stream.vnode, rewrite_id=pending.rewrite_id, new_file_id=new_file_id,
                 old_files=entry.old_file_ids, rows_kept=kept, rows_dropped=result.rows_dropped,
                 chain_items=chain_items, cutoff_ts=pending.cutoff, **timer.fields())
        return result

    def _check_buffer_holds(self, pending: PendingRewrite) -> frozenset[int]:
        """BUFFER_FETCH_HOLDS_FILE: a file whose rows GetWriteBuffer handed to a read
        transaction that can still list files is not replaced. Such a reader lists after
        the swap, finds the new file and not the old one, and would keep the old file's
        rows from its buffer fetch while reading them again from the new file. Refused
        ABORTED (nothing changed; retry later). Returns the readers checked."""
        old_ids = [m.file_id for m in pending.old]
        readers = self._node.buffer_readers(old_ids)
        if not readers:
            return frozenset()
        safe = self._safe_gc_ts()  # no live, not offloaded read has a snapshot at or below
        done = set()  # readers that can list no more files
        for trans_id, snapshot in sorted(readers.items()):
            if snapshot <= safe:
                done.add(trans_id)
            elif self._trans_live(trans_id):
                HELD_BY_READERS.inc()
                raise _refuse(grpc.StatusCode.ABORTED,
                              f"files {old_ids} are {HELD_BY_BUFFER_READ}: read "
                              f"transaction {trans_id} (snapshot {snapshot}) got rows of them "
                              "from a write buffer and may still list the table's files; "
                              "retry once it has ended")
            else:
                done.add(trans_id)
        self._node.forget_buffer_readers(done)
        return frozenset(readers)

    def _check_no_new_buffer_readers(self, pending: PendingRewrite,
                                     checked: frozenset[int]) -> None:
        """BUFFER_FETCH_HOLDS_FILE under the stream locks: an old file published after the
        prepare may have been read from its write buffer after the check above. The commit
        has journaled by now, so it rolls back (the caller's rollback) and the rewrite is
        gone: the answer says so, and is not the hold above, whose rewrite stays prepared."""
        new = set(self._node.buffer_readers([m.file_id for m in pending.old])) - checked
        if new:
            HELD_BY_READERS.inc()
            raise _refuse(grpc.StatusCode.ABORTED,
                          f"rewrite {pending.rewrite_id} {ROLLED_BACK_FOR_BUFFER_READ}: read "
                          f"transactions {sorted(new)} got rows of the old files from a write "
                          "buffer while the rewrite committed; nothing changed, prepare it "
                          "again once they ended")

    def _check_cutoff_unchanged(self, pending: PendingRewrite) -> None:
        """CUTOFF_UNCHANGED_SINCE_PREPARE, under the stream locks: the rows deleted at or
        below the cutoff are exactly those the prepare took (and the new file left out).
        The write fence makes a difference impossible; if one shows, the new file would
        bring a deleted row back for good, so the commit rolls back."""
        for meta, counts in zip(pending.old, pending.rg_row_counts, strict=True):
            for rg in range(len(counts)):
                now = self._node.visibility.get(meta.file_id, rg).deleted_at(pending.cutoff)
                if now != pending.dropped[(meta.file_id, rg)]:
                    raise _refuse(grpc.StatusCode.ABORTED,
                                  f"rows of file {meta.file_id} row group {rg} were deleted at "
                                  f"or below the cutoff {pending.cutoff} after the rewrite was "
                                  "prepared; prepare it again")

    def _count_bytes(self, pending: PendingRewrite, record: FileRecord) -> None:
        with contextlib.suppress(OSError, ValueError):  # a metric: never fails a commit
            path = pending.stream.path_uri
            BYTES_BEFORE.inc(sum(object_size(path, n) for n in pending.old_names))
            BYTES_AFTER.inc(object_size(path, record.name))

    def _verify(self, pending: PendingRewrite,
                new_file_id: int) -> tuple[FileRecord, list[int], Survivors]:
        """The new file holds exactly the survivors, in order (refused otherwise)."""
        record = self._catalog.get_file(new_file_id)
        bad = grpc.StatusCode.INVALID_ARGUMENT
        if record is None:
            raise _refuse(bad, f"new file {new_file_id} is not in the catalog")
        if record.type != FileType.TEMPORARY_GC:
            raise _refuse(grpc.StatusCode.FAILED_PRECONDITION,
                          f"new file {new_file_id} is {record.type.name}, not TEMPORARY_GC")
        if record.name != pending.file_name or record.path_id != pending.stream.path_id:
            raise _refuse(bad, f"new file {new_file_id} ({record.name}) is not the file this "
                               f"rewrite named ({pending.file_name})")
        try:
            parquet = open_parquet(pending.stream.path_uri, record.name)
            expected = table_schema(pending.table)
            if parquet.schema_arrow.names != expected.names:
                raise _refuse(bad, f"new file columns {parquet.schema_arrow.names} are not the "
                                   f"table's {expected.names}")
            # REWRITE_OUTPUTS_HAVE_A_JOURNAL (gc_recovery.py) finds a committed output whose
            # journal record is lost by this footer key: every committed file carries it.
            named = (parquet.metadata.metadata or {}).get(GC_REWRITE_ID_KEY, b"").decode()
            if named != pending.rewrite_id:
                raise _refuse(bad, f"new file {record.name} names rewrite {named or 'none'} in "
                                   f"its footer ({GC_REWRITE_ID_KEY.decode()}), not "
                                   f"{pending.rewrite_id}")
            counts = [parquet.metadata.row_group(i).num_rows
                      for i in range(parquet.metadata.num_row_groups)]
            if sum(counts) != pending.expected_rows:
                raise _refuse(bad, f"new file holds {sum(counts)} rows; {pending.expected_rows} "
                                   "survive the cutoff")
            if any(c == 0 for c in counts):
                raise _refuse(bad, "new file has an empty row group")
            names, types = key_columns(pending.table)
            written = parquet.read(columns=[*names, COMMIT_TS])
            new_keys = encode_primary_keys(types, [written.column(n).combine_chunks()
                                                   for n in names])
            plan = survivors(self._node, pending.table, pending.stream.path_uri,
                             list(zip([m.file_id for m in pending.old], pending.old_names,
                                      pending.rg_row_counts, strict=True)), pending.dropped)
        except (OSError, ValueError, EncodingError, LookupError, KeyError) as exc:
            raise _refuse(bad, f"new file {record.name} cannot be checked: {exc}") from exc
        if not np.array_equal(written.column(COMMIT_TS).to_numpy(), plan.commit_ts):
            raise _refuse(bad, "new file rows are not the survivors in order (commit "
                               "timestamps differ)")
        if new_keys.to_pylist() != plan.keys:
            raise _refuse(bad, "new file rows are not the survivors in order (primary keys "
                               "differ)")
        return record, counts, plan

    def _switch(self, pending: PendingRewrite, entry: JournalEntry, plan: Survivors,
                progress: _Progress, timer: _PhaseTimer) -> int:
        """Step 3 of the module docstring, under the stream's locks. Returns chain items."""
        node, index = self._node, self._node.index
        new_id, start = entry.new_file_id, entry.new_row_id_start
        counts = list(entry.new_rg_row_counts)
        fp.GC_VISIBILITY_BEFORE.hit()
        visibility, chain_items = self._new_visibility(pending, counts)
        node.visibility.stage_file(new_id, visibility)  # readable from the swap on
        fp.GC_VISIBILITY_AFTER.hit()
        timer.lap("visibility")
        fp.GC_PRIMARY_SWITCH_BEFORE.hit()
        progress.primary = True
        new_rows = (start + np.arange(len(plan.keys), dtype=np.int64)).tolist()
        index.primary.switch_primary(pending.table.table_id, plan.keys,
                                     plan.old_row_ids.tolist(), new_rows)
        fp.GC_PRIMARY_SWITCH_AFTER.hit()
        timer.lap("primary_switch")
        fp.GC_SWAP_BEFORE.hit()
        self._swap(entry, progress)
        fp.GC_SWAP_AFTER.hit()
        timer.lap("swap")
        self._journal.write(entry.moved(JournalState.SWAPPED_NOT_CHECKPOINTED,
                                        self._clock_ms()),
                            fp.GC_JOURNAL_SWAPPED_BEFORE, fp.GC_JOURNAL_SWAPPED_AFTER)
        timer.lap("journal_swapped")
        fp.GC_REGISTRY_BEFORE.hit()
        first, last = pending.old[0], pending.old[-1]
        stamps = plan.commit_ts
        node.registry.register(IngestFileMeta(
            new_id, pending.table.table_id, pending.stream.vnode, first.first_block_id,
            int(stamps.min()) if len(stamps) else 0, int(stamps.max()) if len(stamps) else 0,
            len(plan.keys), start, start + max(len(plan.keys), 1) - 1, len(counts),
            last.first_block_id + last.block_count - first.first_block_id))
        for rg, vis in enumerate(visibility):
            node.visibility.adopt(new_id, rg, vis)
        node.visibility.unstage_file(new_id)
        for m in pending.old:  # REGISTRY_COVERS_VISIBILITY holds at every point
            node.visibility.retire_file(m.file_id)
            node.registry.unregister(m.file_id)
        fp.GC_REGISTRY_AFTER.hit()
        timer.lap("registry")
        return chain_items

    def _put_main_index(self, entry: JournalEntry, progress: _Progress) -> None:
        """The new file's MainIndex ranges (durable), before the stream locks: its row ids
        are new, so no writer or reader can reach them until the primary switch."""
        fp.GC_MAIN_INDEX_BEFORE.hit()
        progress.main_index = True
        counts = entry.new_rg_row_counts
        offsets = np.concatenate([[0], np.cumsum(counts)]).astype(int)
        self._node.index.main.put_main_index_entries(
            [RowIdRange(entry.new_row_id_start + int(offsets[rg]), n, entry.new_file_id, rg, 0)
             for rg, n in enumerate(counts)])
        self._node.index.main.flush_file(entry.new_file_id)
        fp.GC_MAIN_INDEX_AFTER.hit()

    def _new_visibility(self, pending: PendingRewrite,
                        counts: list[int]) -> tuple[list[RGVisibility], int]:
        """New-file visibility: base = cutoff, empty base bitmap (the rows deleted at or
        below the cutoff are gone), and a chain item for every delete after it, read
        now under the stream lock, so deletes that raced the rewrite are carried."""
        cutoff = pending.cutoff
        bounds = np.cumsum(counts)
        starts = bounds - np.asarray(counts, dtype=bounds.dtype)  # each new rg's first row
        # new rg -> row -> its delete's timestamp (each row once: the chain keeps a row's
        # earliest delete), built into each RGVisibility at once, not a delete() per ts.
        chains: list[dict[int, int]] = [{} for _ in counts]
        before = 0  # survivors in earlier old row groups
        for meta, rg_counts in zip(pending.old, pending.rg_row_counts, strict=True):
            for rg, n in enumerate(rg_counts):
                vis = self._node.visibility.get(meta.file_id, rg)
                if vis.base_timestamp > cutoff:  # FOLD_FENCE broke: deletes would be lost
                    raise RuntimeError(f"file {meta.file_id} rg {rg} was folded to "
                                       f"{vis.base_timestamp}, above the cutoff {cutoff}")
                dropped = pending.dropped[(meta.file_id, rg)]
                keep = np.flatnonzero(kept_mask(n, dropped))
                # Only the deletes after the cutoff (those at or below it are dropped rows),
                # mapped to the new file's rows in numpy: this runs under the stream locks.
                later = vis.deletes_between(cutoff, _LAST_TS)
                if later is None:
                    raise RuntimeError(f"file {meta.file_id} rg {rg} was folded above the "
                                       f"cutoff {cutoff}")
                if later:
                    rows = np.fromiter((r for r, _t in later), np.int64, len(later))
                    stamps = [t for _r, t in later]
                    pos = np.searchsorted(keep, rows)
                    found = pos < len(keep)
                    found[found] = keep[pos[found]] == rows[found]
                    if not found.all():
                        bad = int(np.flatnonzero(~found)[0])
                        raise RuntimeError(f"delete of dropped row {int(rows[bad])} at "
                                           f"{stamps[bad]} > cutoff")
                    g = before + pos
                    new_rgs = np.searchsorted(bounds, g, side="right")
                    offsets = g - starts[new_rgs]
                    for new_rg, ts, offset in zip(new_rgs.tolist(), stamps, offsets.tolist(),
                                                  strict=True):
                        chains[new_rg][offset] = ts
                before += len(keep)
        out = [RGVisibility(n, cutoff, BitMap(), chain) for n, chain in zip(counts, chains,
                                                                             strict=True)]
        return out, sum(len(chain) for chain in chains)

    def _swap(self, entry: JournalEntry, progress: _Progress) -> None:
        cleanup_at = entry.cleanup_at_ms
        try:
            self._catalog.atomic_swap_files(entry.new_file_id, entry.old_file_ids, cleanup_at)
        except CatalogOutcomeUnknown:
            progress.swapped = None  # unknown until re-read
            state = until_deadline(
                lambda: swap_state(self._catalog, entry),
                transient=(CatalogUnavailable, CatalogOutcomeUnknown),
                deadline_s=self._settings.swap_outcome_deadline_s,
                on_retry=lambda exc: log.warning("gc_swap_outcome_retry", error=str(exc)))
            log.info("gc_swap_outcome_read_back", rewrite_id=entry.rewrite_id, state=state)
            if state != "swapped":
                progress.swapped = False
                raise RuntimeError("atomicSwapFiles did not commit (re-read)") from None
        except SwapPreconditionFailed as exc:
            raise _refuse(grpc.StatusCode.FAILED_PRECONDITION, str(exc)) from exc
        except CatalogUnavailable as exc:
            raise _refuse(grpc.StatusCode.UNAVAILABLE, f"catalog unavailable: {exc}") from exc
        progress.swapped = True

    def _roll_back_live(self, entry: JournalEntry, plan: Survivors, progress: _Progress,
                        cause: BaseException) -> None:
        """Undo a commit that failed before its swap; the node fails closed if it cannot."""
        reason = f"commit failed: {cause}"
        self._node.visibility.unstage_file(entry.new_file_id)
        log.warning("gc_rewrite_rolling_back", rewrite_id=entry.rewrite_id, reason=reason)
        try:
            if progress.swapped is None:
                raise RuntimeError("swap outcome unknown")
            roll_back(self._node, self._catalog, self._journal, entry,
                      plan if progress.primary else None, reason,
                      main_index=progress.main_index)
        except Exception as exc:
            self._node.fail_closed(f"GC rewrite {entry.rewrite_id} could not be rolled back "
                                   f"({exc}); recovery decides from the journal")
            raise

    # --- promotion ---------------------------------------------------------------------------
    def observe_loaded(self, checkpointed_files: set[int]) -> None:
        """The checkpoint this process started from (it is ``previous`` after the next
        publish)."""
        with self._lock:
            self._recent.append(frozenset(checkpointed_files))

    def promote(self, checkpointed_files: set[int]) -> int:
        """A checkpoint was published holding these files. An entry becomes CHECKPOINTED
        once *both* slots hold its new file (PROMOTE_WHEN_BOTH_SLOTS_HOLD): a start that
        falls back to ``previous`` must still find a checkpoint with the new file,
        because after promotion nothing rolls the rewrite back."""
        with self._lock:
            self._recent.append(frozenset(checkpointed_files))
            both = frozenset.intersection(*self._recent) if len(self._recent) == 2 \
                else frozenset()
        promoted = 0
        for entry in self._journal.open_entries():
            if entry.state == JournalState.SWAPPED_NOT_CHECKPOINTED and \
                    entry.new_file_id in both:
                try:
                    self._journal.write(entry.moved(JournalState.CHECKPOINTED,
                                                    self._clock_ms()),
                                        fp.GC_JOURNAL_CHECKPOINTED_BEFORE,
                                        fp.GC_JOURNAL_CHECKPOINTED_AFTER)
                except JournalConflict as exc:  # a revert took it since open_entries()
                    log.info("gc_journal_promotion_skipped", rewrite_id=entry.rewrite_id,
                             reason=str(exc))
                    continue
                promoted += 1
                log.info("gc_journal_promoted", rewrite_id=entry.rewrite_id,
                         new_file_id=entry.new_file_id)
        if promoted:
            self.update_gauges()
        return promoted

    # --- status ------------------------------------------------------------------------------
    def busy_files(self) -> set[int]:
        """Files a prepared (not yet committed) rewrite replaces."""
        with self._lock:
            return {m.file_id for p in self._pending.values() for m in p.old}

    def pending_file_names(self) -> set[str]:
        """Names prepared rewrites gave their new files (the temporary-file sweeper keeps
        them: the job may still be writing one)."""
        with self._lock:
            return {p.file_name for p in self._pending.values()}

    def pending_count(self) -> int:
        with self._lock:
            return len(self._pending)

    def _state_age_s(self, state: JournalState) -> float:
        now = self._clock_ms()
        ages = [now - e.updated_at_ms for e in self._journal.entries() if e.state == state]
        return max(ages, default=0) / 1000

    def update_gauges(self) -> None:
        entries = self._journal.entries()
        for state in JournalState:
            JOURNAL_ENTRIES.labels(state=state.value).set(
                sum(e.state == state for e in entries))
        open_ages = [self._clock_ms() - e.created_at_ms for e in entries
                     if e.state in OPEN_STATES]
        JOURNAL_OLDEST_OPEN.set(max(open_ages, default=0) / 1000)
        PENDING.set(len(self._pending))


@dataclass
class _Progress:
    """How far a commit got: what a rollback has to undo."""

    main_index: bool = False
    primary: bool = False
    swapped: bool | None = False  # None: the swap's outcome is unknown


def swap_state(catalog: Catalog, entry: JournalEntry) -> str:
    """"swapped", "not_swapped" or "mismatch", from the catalog rows."""
    new = catalog.get_file(entry.new_file_id)
    olds = [catalog.get_file(f) for f in entry.old_file_ids]
    old_types = {o.type if o else None for o in olds}
    if new is not None and new.type == FileType.REGULAR and old_types == {FileType.RETIRED}:
        return "swapped"
    if new is not None and new.type == FileType.TEMPORARY_GC and \
            old_types == {FileType.REGULAR}:
        return "not_swapped"
    return "mismatch"


def roll_back(node: RetinaNode, catalog: Catalog, journal: GcJournal, entry: JournalEntry,
              plan: Survivors | None, reason: str, *, main_index: bool = True,
              catalog_deadline_s: float = 60.0) -> None:
    """Undo a rewrite, every step idempotent (safe to repeat after a crash in it):
    primary entries back on the old rows → catalog reverted (old REGULAR; the new
    file RETIRED if the swap had committed, else deleted with its object) → the
    new file's MainIndex ranges deleted → journal ABORTED. ``plan`` None: the
    primary switch never started."""
    if plan is not None:
        fp.GC_ROLLBACK_PRIMARY_BEFORE.hit()
        switch_primary_back(node, entry, plan)
        fp.GC_ROLLBACK_PRIMARY_AFTER.hit()
    fp.GC_ROLLBACK_CATALOG_BEFORE.hit()
    # Retried while the catalog is briefly away: giving up here fails the node closed.
    outcome = until_deadline(
        lambda: catalog.revert_swap(entry.new_file_id, entry.old_file_ids,
                                    int(time.time() * 1000)),
        transient=(CatalogUnavailable, CatalogOutcomeUnknown), deadline_s=catalog_deadline_s,
        on_retry=lambda exc: log.warning("gc_rollback_catalog_retry", error=str(exc)))
    if outcome == "not_swapped":
        # Never visible to anyone: no reader can hold it. (A row already gone was
        # deleted by an earlier attempt of this same rollback.)
        delete_quietly(entry.path_uri, entry.new_file_name)
        with contextlib.suppress(CatalogError):
            catalog.delete_files([entry.new_file_id])
    fp.GC_ROLLBACK_CATALOG_AFTER.hit()
    if main_index:
        fp.GC_ROLLBACK_MAIN_INDEX_BEFORE.hit()
        node.index.main.delete_main_index_range(entry.new_file_id)
        fp.GC_ROLLBACK_MAIN_INDEX_AFTER.hit()
    journal.write(entry.moved(JournalState.ABORTED, int(time.time() * 1000), reason),
                  fp.GC_JOURNAL_ABORTED_BEFORE, fp.GC_JOURNAL_ABORTED_AFTER)
    log.warning("gc_rewrite_rolled_back", rewrite_id=entry.rewrite_id,
                new_file_id=entry.new_file_id, old_files=entry.old_file_ids, reason=reason,
                catalog=outcome)
