"""The recovery coordinator: start-up, cleansing, replay admission, the MarkReady barrier,
and checkpoint generation (specification sections 2-4, 6; C04-C06).

What happens on start (``run_startup``):

1. LOADING_CHECKPOINT: load ``current``, else ``previous``. Both unusable →
   FAILED. No pointer and no REGULAR file of this node in the catalog → a
   fresh start (checkpointId 0). No pointer but REGULAR files → FAILED.
2. CLEANSING (section 4): keep a FileEntry only if the catalog row exists, is
   REGULAR, and matches: row-id hull, row groups, path → table, file name →
   node and vnode, the MainIndex flush marker's row count, and the footer's
   commit-ts range (best effort). Kept files are re-registered and get their
   visibility from the body (base = checkpointAppliedTs, empty chain). A
   discarded admitted segment counts as unsafe, so its rows are replayed.
   This node's REGULAR files that no kept entry covers, and no GC journal
   protects, become RETIRED (cleanupAt = now). Its TEMPORARY_INGEST files are
   deleted. Write buffers start empty.
3. The replay starts are derived (replay_ts.py). Then the node is put back
   exactly at the state the replay starts from: every primary-index version
   written at or after its scope's start is dropped, and every row of a kept
   file committed at or after that start is hidden (folded into the
   visibility base). Replay redoes all of it; what it does not redo (a
   transaction that never committed) stays gone. → AWAITING_REPLAY, with
   ``replayTsReady``.

Replay writes (UpdateRecord with a RecoveryReplayContext) are admitted only
in AWAITING_REPLAY, with this attempt's token and checkpointId, a timestamp
at or above the replay start of the chosen mode, and no standalone INSERT.
They are counted while in flight.

``mark_ready`` (the barrier, C06.6): validate token and checkpointId → close
the replay entry (BARRIER) → drain in-flight replay requests → READY → the
READY hooks (flush timer, periodic checkpoints, cache invalidation) → publish
READY. The same token after READY is harmless; any other is refused. There
is no other way to READY.
"""

from __future__ import annotations

import contextlib
import hmac
import secrets
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace

import pyarrow as pa
import pyarrow.parquet as pq
from prometheus_client import Counter, Gauge

from retina_common import failpoints as fp
from retina_common import file_names
from retina_common.catalog import Catalog, CatalogError, FileRecord, FileType
from retina_common.log import get_logger, token_hash
from retina_common.storage import delete_quietly, read_bytes
from retina_server.checkpoint import (
    CheckpointBody,
    CheckpointHeader,
    CheckpointStore,
    CheckpointUnusable,
    FileEntry,
    LoadedCheckpoint,
    Pointer,
    RGEntry,
)
from retina_server.lifecycle import LifecyclePublisher, LifecycleStateMachine, Phase
from retina_server.node import RetinaNode
from retina_server.registry import IngestFileMeta
from retina_server.replay_ts import (
    IngestSegment,
    ReplayStarts,
    SegmentKind,
    derive,
)
from retina_server.visibility import RGVisibility
from retina_server.write_buffer import COMMIT_TS, FileState

log = get_logger(component="recovery")

DISCARDS = Counter("retina_cleansing_discards_total", "Checkpoint entries discarded", ["reason"])
RETIRED = Counter("retina_cleansing_retired_total", "Catalog-only REGULAR files retired")
STATE = Gauge("retina_lifecycle_state", "1 for the node's current lifecycle phase", ["phase"])
CHECKPOINT_AGE = Gauge("retina_checkpoint_applied_ts", "checkpointAppliedTs of the last checkpoint")
CHECKPOINT_BYTES = Gauge("retina_checkpoint_bytes", "Size of the last checkpoint body")
REPLAY_START = Gauge("retina_replay_from_ts", "Derived replay start", ["scope"])


class RecoveryRefusal(Exception):
    """A recovery RPC or replay write refused; ``code`` is a gRPC status name."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


@dataclass
class Attempt:
    token: str
    checkpoint_id: int
    checkpoint_applied_ts: int
    starts: ReplayStarts | None = None

    @property
    def token_hash(self) -> str:
        return token_hash(self.token)


def gc_journal_protected_files(_catalog: Catalog) -> set[int]:
    """Hook for the Storage GC journal (a later issue): REGULAR files a GC task in
    INDEX_SWITCHING / SWAPPED_NOT_CHECKPOINTED protects from cleansing. None yet."""
    return set()


class RecoveryCoordinator:
    def __init__(self, node: RetinaNode, catalog: Catalog, store: CheckpointStore,
                 machine: LifecycleStateMachine, publisher: LifecyclePublisher,
                 high_watermark: Callable[[], int], recovery_epoch: int,
                 on_ready: Callable[[], None]) -> None:
        self._node = node
        self._catalog = catalog
        self._store = store
        self._machine = machine
        self._publisher = publisher
        self._hwm = high_watermark
        self.recovery_epoch = recovery_epoch
        self._on_ready = on_ready
        self.attempt = Attempt(secrets.token_urlsafe(32), 0, 0)
        self._cond = threading.Condition()
        self._inflight = 0
        self._replay_open = False
        self._checkpoint_lock = threading.Lock()
        self.last_checkpoint: Pointer | None = None

    # --- lifecycle plumbing -----------------------------------------------------------
    def _move(self, phase: Phase, reason: str = "") -> None:
        self._machine.transition(phase, reason)
        for p in Phase:
            STATE.labels(phase=p.value).set(1 if p == phase else 0)
        self._publish()

    def _publish(self) -> None:
        self._publisher.publish(self._machine.state, checkpoint_id=self.attempt.checkpoint_id,
                                recovery_epoch=self.recovery_epoch,
                                token_hash=self.attempt.token_hash
                                if self._machine.phase != Phase.READY else "")

    def announce(self) -> None:
        """Publish the current (RECOVERING) state at once, before start-up work."""
        self._publish()

    def fail(self, reason: str) -> None:
        with self._cond:
            self._replay_open = False
        self._machine.fail(reason)
        self._publish()

    # --- start-up ------------------------------------------------------------------------
    def run_startup(self) -> None:
        self._move(Phase.LOADING_CHECKPOINT)
        try:
            loaded = self._store.load()
        except CheckpointUnusable as exc:
            self.fail(f"no usable checkpoint: {exc}")
            return
        files = self._catalog.get_files_by_type(None, list(FileType))
        mine = self._my_files(files)
        regular = [f for f in mine if f.type == FileType.REGULAR]
        if loaded is None and regular:
            self.fail(f"no checkpoint, but the catalog holds {len(regular)} REGULAR files of "
                      f"{self._node.node_id}")
            return
        fp.RECOVERY_CLEANSING_BEFORE.hit()
        self._move(Phase.CLEANSING)
        applied = loaded.body.header.checkpoint_applied_ts if loaded else 0
        self.attempt = Attempt(self.attempt.token,
                               loaded.body.header.checkpoint_id if loaded else 0, applied)
        segments, kept = self.cleanse(loaded, files, mine)
        starts = derive(applied, segments, self._node.owned_vnodes, self._all_table_ids())
        self._rewind_to_starts(starts, kept)
        fp.RECOVERY_CLEANSING_AFTER.hit()
        self.attempt.starts = starts
        REPLAY_START.labels(scope="node").set(starts.node_replay_from_ts)
        log.info("replay_ts_ready", node=self._node.node_id,
                 checkpoint_id=self.attempt.checkpoint_id, checkpoint_applied_ts=applied,
                 node_replay_from_ts=starts.node_replay_from_ts,
                 vnode_replay_from_ts=starts.vnode_replay_from_ts,
                 slot=loaded.slot if loaded else None, token_hash=self.attempt.token_hash)
        with self._cond:
            self._replay_open = True
        self._move(Phase.AWAITING_REPLAY)

    def _my_files(self, files: list[FileRecord]) -> list[FileRecord]:
        """This node's REGULAR and TEMPORARY_INGEST files (by the name's node id)."""
        mine = []
        for f in files:
            if f.type not in (FileType.REGULAR, FileType.TEMPORARY_INGEST):
                continue
            with contextlib.suppress(ValueError):
                if file_names.parse(f.name).node_id == self._node.node_id:
                    mine.append(f)
        return mine

    def _all_table_ids(self) -> list[int]:
        return sorted({p.table_id for p in self._catalog.list_paths()})

    def _rewind_to_starts(self, starts: ReplayStarts,
                          kept: list[tuple[FileEntry, str, str]]) -> None:
        """Back to the state as of each scope's replay start (see the module docstring)."""
        scope = {(s.table_id, s.vnode): s.scope_replay_from_ts for s in starts.scopes}
        vnode_of = self._node.topology.vnode_of_key

        def start_of(table_id: int, key: bytes) -> int:
            return scope.get((table_id, vnode_of(key)), starts.checkpoint_applied_ts)

        removed = self._node.index.truncate_versions(
            min(scope.values(), default=starts.checkpoint_applied_ts), start_of)
        hidden = 0
        for entry, path_uri, name in kept:
            start = scope.get((entry.table_id, entry.vnode), starts.checkpoint_applied_ts)
            if entry.max_commit_ts < start:
                continue  # the whole file predates the replay start: nothing to hide
            parquet = pq.ParquetFile(pa.BufferReader(read_bytes(path_uri, name)))
            for rg in range(parquet.metadata.num_row_groups):
                stamps = parquet.read_row_group(rg, columns=[COMMIT_TS]).column(0).to_pylist()
                rows = [i for i, ts in enumerate(stamps) if ts >= start]
                if rows:
                    entry_vis = self._node.visibility.get(entry.file_id, rg)
                    hidden += entry_vis.delete(rows, entry_vis.base_timestamp)
        log.info("recovery_rewound", node=self._node.node_id, index_versions_removed=removed,
                 rows_hidden=hidden)

    def cleanse(self, loaded: LoadedCheckpoint | None, files: list[FileRecord],
                mine: list[FileRecord]
                ) -> tuple[list[IngestSegment], list[tuple[FileEntry, str, str]]]:
        """Cleansing (section 4); returns the segment chain replay starts derive from and
        the kept entries with their path URI and file name."""
        body = loaded.body if loaded else None
        catalog = {f.file_id: f for f in files}
        paths = {p.path_id: p for p in self._catalog.list_paths()}
        rgs: dict[int, list[RGEntry]] = defaultdict(list)
        for rg in body.row_groups if body else []:
            rgs[rg.file_id].append(rg)
        kept: set[int] = set()
        kept_entries: list[tuple[FileEntry, str, str]] = []
        discarded: set[int] = set()
        for entry in body.files if body else []:
            reason = self._entry_problem(entry, catalog.get(entry.file_id), paths, rgs)
            if reason:
                discarded.add(entry.file_id)
                DISCARDS.labels(reason=reason.split(":")[0]).inc()
                log.warning("cleansing_discard", node=self._node.node_id, file_id=entry.file_id,
                            reason=reason)
                continue
            self._admit(entry, rgs[entry.file_id])
            kept.add(entry.file_id)
            record = catalog[entry.file_id]
            kept_entries.append((entry, paths[record.path_id].uri, record.name))
        segments = [replace(s, kind=SegmentKind.PENDING)
                    if s.kind == SegmentKind.ADMITTED and s.file_id in discarded else s
                    for s in (body.segments if body else [])]
        protected = gc_journal_protected_files(self._catalog)
        now = int(time.time() * 1000)
        for f in mine:
            if f.type == FileType.REGULAR and f.file_id not in kept | protected:
                self._catalog.update_file(f.file_id, file_type=FileType.RETIRED, cleanup_at=now,
                                          expected_type=FileType.REGULAR)
                RETIRED.inc()
                log.info("cleansing_retired", node=self._node.node_id, file_id=f.file_id)
            elif f.type == FileType.TEMPORARY_INGEST:
                delete_quietly(paths[f.path_id].uri, f.name)
                with contextlib.suppress(CatalogError):
                    self._catalog.delete_files([f.file_id])
        log.info("cleansing_done", node=self._node.node_id, kept=len(kept),
                 discarded=len(discarded))
        return segments, kept_entries

    def _entry_problem(self, e: FileEntry, f: FileRecord | None, paths: dict,
                       rgs: dict[int, list[RGEntry]]) -> str:
        if f is None:
            return "not in catalog"
        if f.type != FileType.REGULAR:
            return f"not REGULAR: catalog says {f.type.name}"
        if (f.min_row_id, f.max_row_id, f.num_row_group) != (e.min_row_id, e.max_row_id,
                                                              e.num_row_group):
            return "hull mismatch: row-id hull or row groups differ from the catalog"
        path = paths.get(f.path_id)
        if path is None or path.table_id != e.table_id:
            return "table mismatch: the file's path belongs to another table"
        try:
            name = file_names.parse(f.name)
        except ValueError:
            return "name unparsable"
        if name.node_id != self._node.node_id or name.vnode != e.vnode:
            return "vnode mismatch: the file name names another node or vnode"
        if self._node.index.flushed_row_count(e.file_id) != e.record_num:
            return "index mismatch: the MainIndex flush marker disagrees with recordNum"
        entries = sorted(rgs.get(e.file_id, []), key=lambda r: r.rg_id)
        if [r.rg_id for r in entries] != list(range(e.num_row_group)) or \
                sum(r.row_count for r in entries) != e.record_num:
            return "visibility mismatch: row-group entries do not cover the file"
        try:  # best effort: a footer that cannot be read only warns
            meta = pq.ParquetFile(pa.BufferReader(read_bytes(path.uri, f.name))).metadata
            column = meta.schema.to_arrow_schema().get_field_index(COMMIT_TS)
            for i in range(meta.num_row_groups):
                stats = meta.row_group(i).column(column).statistics
                if stats is not None and stats.has_min_max and \
                        not e.min_commit_ts <= stats.min <= stats.max <= e.max_commit_ts:
                    return "footer mismatch: commit-ts statistics outside the entry's range"
        except (OSError, ValueError) as exc:
            log.warning("cleansing_footer_unreadable", file_id=e.file_id, error=str(exc))
        return ""

    def _admit(self, e: FileEntry, rgs: list[RGEntry]) -> None:
        self._node.registry.register(IngestFileMeta(
            e.file_id, e.table_id, e.vnode, e.first_block_id, e.min_commit_ts, e.max_commit_ts,
            e.record_num, e.min_row_id, e.max_row_id, e.num_row_group, e.num_row_group))
        for rg in sorted(rgs, key=lambda r: r.rg_id):
            self._node.visibility.adopt(e.file_id, rg.rg_id, RGVisibility(
                rg.row_count, rg.base_timestamp, rg.deleted))

    # --- replay -----------------------------------------------------------------------------
    def check_attempt(self, token: str, checkpoint_id: int) -> None:
        if not hmac.compare_digest(token.encode(), self.attempt.token.encode()):
            raise RecoveryRefusal("FAILED_PRECONDITION", "stale or unknown recovery attempt token")
        if checkpoint_id != self.attempt.checkpoint_id:
            raise RecoveryRefusal("FAILED_PRECONDITION",
                                  f"checkpointId {checkpoint_id} is not this attempt's "
                                  f"({self.attempt.checkpoint_id})")

    def replay_start(self, mode: str, vnode: int) -> int:
        starts = self.attempt.starts
        assert starts is not None
        if mode == "NODE":
            return starts.node_replay_from_ts
        return starts.vnode_replay_from_ts.get(vnode, starts.checkpoint_applied_ts)

    @contextlib.contextmanager
    def replay_request(self, token: str, checkpoint_id: int) -> Iterator[None]:
        """Admit one replay write and count it in flight until it finishes."""
        with self._cond:
            if self._machine.phase == Phase.FAILED:
                raise RecoveryRefusal("FAILED_PRECONDITION", "the node is FAILED")
            if self._machine.phase != Phase.AWAITING_REPLAY or not self._replay_open:
                raise RecoveryRefusal("FAILED_PRECONDITION",
                                      f"replay writes are not accepted in {self._machine.phase}")
            self.check_attempt(token, checkpoint_id)
            self._inflight += 1
        try:
            yield
        finally:
            with self._cond:
                self._inflight -= 1
                self._cond.notify_all()

    # --- the MarkReady barrier ------------------------------------------------------------------
    def mark_ready(self, token: str, checkpoint_id: int) -> None:
        with self._cond:
            phase = self._machine.phase
            if phase == Phase.READY:
                self.check_attempt(token, checkpoint_id)  # the same token again: harmless
                return
            if phase == Phase.FAILED:
                raise RecoveryRefusal("FAILED_PRECONDITION",
                                      f"the node is FAILED: {self._machine.reason}")
            if phase != Phase.AWAITING_REPLAY:
                raise RecoveryRefusal("UNAVAILABLE", f"not ready for MarkReady yet ({phase})")
            self.check_attempt(token, checkpoint_id)
            self._replay_open = False  # close the replay write entry
        self._move(Phase.BARRIER, "MarkReady")
        fp.MARK_READY_BARRIER.hit()
        with self._cond:
            self._cond.wait_for(lambda: self._inflight == 0)
        self._move(Phase.READY, "MarkReady barrier passed")
        self._on_ready()
        log.info("node_ready", node=self._node.node_id, checkpoint_id=checkpoint_id,
                 token_hash=self.attempt.token_hash)

    # --- checkpoints -----------------------------------------------------------------------------
    def create_checkpoint(self) -> Pointer:
        """Generate and publish a checkpoint (READY only)."""
        if self._machine.phase != Phase.READY:
            raise RecoveryRefusal("UNAVAILABLE", "checkpoints are taken only while READY")
        with self._checkpoint_lock:
            # HWM - 1 (every write at or below it has been applied), but never
            # below 0: before the first commit there is nothing to have applied.
            applied = max(self._hwm() - 1, 0)
            body = self.build_body(applied)
            self._node.check_registry_covers_visibility()
            if self._node.failure:
                raise RecoveryRefusal("INTERNAL", self._node.failure)
            pointer = self._store.publish(body)
            self.last_checkpoint = pointer
            CHECKPOINT_AGE.set(pointer.checkpoint_applied_ts)
            CHECKPOINT_BYTES.set(pointer.length)
            return pointer

    def build_body(self, applied_ts: int) -> CheckpointBody:
        node = self._node
        files: list[FileEntry] = []
        segments: list[IngestSegment] = []
        rgs: list[RGEntry] = []
        for stream in node.all_streams():
            # One consistent cut per stream: a file moving from the write
            # buffer to the registry is in exactly one of them.
            with stream.publisher.lock, stream.buffer.lock:
                admitted = node.registry.stream_files(stream.table.table_id, stream.vnode)
                buffered = [f for f in stream.buffer.files if f.file_id not in node.registry]
                for meta in admitted:
                    files.append(FileEntry(meta.file_id, meta.table_id, meta.virtual_node_id,
                                           meta.first_block_id, meta.file_min_commit_ts,
                                           meta.file_max_commit_ts, meta.record_num,
                                           meta.min_row_id, meta.max_row_id, meta.num_row_group))
                    segments.append(IngestSegment(
                        meta.table_id, meta.virtual_node_id, SegmentKind.ADMITTED, meta.file_id,
                        meta.first_block_id, meta.block_count, meta.record_num,
                        meta.file_min_commit_ts, meta.file_max_commit_ts))
                    for rg_id in range(meta.num_row_group):
                        entry = node.visibility.get(meta.file_id, rg_id)
                        rgs.append(RGEntry(meta.file_id, rg_id, entry.row_count, applied_ts,
                                           entry.deleted_at(applied_ts)))
                for f in buffered:
                    kind = SegmentKind.OPEN if f.state == FileState.OPEN else SegmentKind.PENDING
                    segments.append(IngestSegment(
                        f.table_id, f.vnode, kind, f.file_id, f.first_block_id, len(f.blocks),
                        f.row_count, f.min_commit_ts or 0, f.max_commit_ts or 0))
        header = CheckpointHeader(node.node_id, node.index.allocate("checkpoint_id") + 1,
                                  self.recovery_epoch, int(time.time() * 1000), applied_ts,
                                  node.topology.topology_hash)
        return CheckpointBody(header, files, segments, rgs)

    def status(self) -> dict[str, object]:
        phase = self._machine.phase
        return {
            "state": self._machine.state.value,
            "phase": phase.value,
            # Shown only once the replay starts exist: before that it is of no use.
            "token": self.attempt.token if phase in (Phase.AWAITING_REPLAY, Phase.BARRIER)
            else "",
            "checkpoint_id": self.attempt.checkpoint_id,
            "recovery_epoch": self.recovery_epoch,
            "replay_ts_ready": self.attempt.starts is not None and phase != Phase.FAILED,
            "failure_reason": self._machine.reason if phase == Phase.FAILED else "",
        }
