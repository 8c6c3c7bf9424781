"""The recovery coordinator: it orchestrates start-up, replay and checkpoints; each step lives
in its own module (specification sections 2-4, 6; C04-C06).

Start-up (``run_startup``), in this order:

1. LOADING_CHECKPOINT (retina_common/checkpoint_store.py): load ``current``, else ``previous``.
   Both unusable → FAILED. No pointer and no REGULAR file of this node in the
   catalog → a fresh start (checkpointId 0). No pointer but REGULAR files →
   FAILED.
2. CLEANSING (cleansing.py): keep the entries the catalog confirms, retire
   catalog-only REGULAR files, delete leftover TEMPORARY_INGEST files (not those of
   journaled bulk loads: the load journal is read first, ../bulk_load.py).
3. Replay starts (retina_common/replay_ts.py), then the rewind (cleansing.py) back to
   exactly the state they start from, and the INDEX_POINTS_AT_DURABLE_ROWS
   check; then every journaled bulk load at or above its stream's start is
   re-applied from its files (LOADS_REAPPLIED_FROM_THEIR_FILES). → AWAITING_REPLAY,
   with ``replayTsReady``, the replay entry open.

Replay writes are admitted by replay_admission.py; MarkReady is
mark_ready.py; checkpoint bodies come from checkpoint.build_body. Phase
admission is the lifecycle table (lifecycle.py), and refusals are one type
(retina_common/refusal.py).

Lifecycle announcements: the leased key changes only when the external state
changes (RECOVERING → READY or FAILED). Internal phases are announced on a
best-effort basis: an etcd error there is logged and the heartbeat retries.
Start-up steps that read or write etcd or the catalog are retried while those
are briefly away (``startup_retry_s``), so a transient outage never fails a
start-up; a longer one fails the node closed with the dependency named.
"""

from __future__ import annotations

import contextlib
import hmac
import secrets
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import grpc
from prometheus_client import Gauge

from retina_common import failpoints as fp
from retina_common.catalog import (
    Catalog,
    CatalogOutcomeUnknown,
    CatalogUnavailable,
    FileRecord,
    FileType,
)
from retina_common.checkpoint_store import (
    CheckpointBody,
    CheckpointError,
    CheckpointStore,
    CheckpointUnusable,
    LoadedCheckpoint,
    Pointer,
)
from retina_common.etcd import EtcdError
from retina_common.lifecycle_record import LifecycleState
from retina_common.log import get_logger, token_hash
from retina_common.refusal import Refusal
from retina_common.replay_ts import ReplayStarts, derive
from retina_common.retry import until_deadline
from retina_server.bulk_load import BulkLoads, LoadJournalMismatch
from retina_server.gc.gc_journal import CorruptJournal, GcJournal
from retina_server.gc.gc_recovery import (
    GcJournalMismatch,
    check_rewrite_outputs,
    check_unjournaled,
    decide,
)
from retina_server.gc.lineage import RevertAnchorsGone, recover_reverts
from retina_server.lifecycle import LifecycleAnnouncer, LifecycleStateMachine, Phase, Request
from retina_server.load_journal import CorruptLoadJournal
from retina_server.node import RetinaNode
from retina_server.recovery.checkpoint import build_body
from retina_server.recovery.cleansing import RewindFailed, cleanse, my_files, rewind
from retina_server.recovery.replay_admission import ReplayEntry

log = get_logger(component="recovery")
T = TypeVar("T")

CHECKPOINT_AGE = Gauge("retina_checkpoint_applied_ts", "checkpointAppliedTs of the last checkpoint")
CHECKPOINT_BYTES = Gauge("retina_checkpoint_bytes", "Size of the last checkpoint body")
# Wall-clock time of the last installed checkpoint: applied_ts is a logical timestamp, so
# "checkpoint too old" (deploy/prometheus/alerts.yml) needs this one. 0: none since start.
CHECKPOINT_INSTALLED = Gauge("retina_checkpoint_last_success_timestamp_seconds",
                             "Unix time the last checkpoint was installed (0: none yet)")
REPLAY_START = Gauge("retina_replay_from_ts", "Derived replay start", ["scope"])


@dataclass
class Attempt:
    token: str
    checkpoint_id: int
    checkpoint_applied_ts: int
    starts: ReplayStarts | None = None

    @property
    def token_hash(self) -> str:
        return token_hash(self.token)


class RecoveryCoordinator:
    def __init__(self, node: RetinaNode, catalog: Catalog, store: CheckpointStore,
                 machine: LifecycleStateMachine, announcer: LifecycleAnnouncer,
                 high_watermark: Callable[[], int], recovery_epoch: int,
                 gc_journal: GcJournal, *, retired_retention_ms: int = 600_000,
                 checkpoint_listeners: Sequence[Callable[[CheckpointBody], object]] = (),
                 loaded_listeners: Sequence[Callable[[set[int]], None]] = (),
                 loads: BulkLoads | None = None) -> None:
        self._node = node
        # Journaled bulk loads: their files survive cleansing, their rows are re-applied
        # after the rewind (bulk_load.py).
        self._loads = loads
        self._gc_journal = gc_journal
        # Told every checkpoint this process publishes (GC promotion, the replay floor).
        self._checkpoint_listeners = list(checkpoint_listeners)
        # Told the file ids of the checkpoint the start-up loaded (GC promotion).
        self._loaded_listeners = list(loaded_listeners)
        self._catalog = catalog
        self._store = store
        self._machine = machine
        self._announcer = announcer
        self._hwm = high_watermark
        self.recovery_epoch = recovery_epoch
        self.attempt = Attempt(secrets.token_urlsafe(32), 0, 0)
        self.entry = ReplayEntry()
        self._checkpoint_lock = threading.Lock()
        self.last_checkpoint: Pointer | None = None
        # Its header's write time: operators read the checkpoint's age (GetRetinaStatus).
        self.last_checkpoint_write_time_ms = 0
        self.startup_retry_s = 120.0
        # cleanupAt of a new file a recovered revert retires (retina.gc_retired_retention_ms).
        self._retired_retention_ms = retired_retention_ms

    # --- lifecycle plumbing -----------------------------------------------------------
    def _move(self, phase: Phase, reason: str = "") -> None:
        before = self._machine.state
        self._machine.transition(phase, reason)
        if self._machine.state != before or phase == Phase.AWAITING_REPLAY:
            self._announce_quietly()

    def _announce(self) -> None:
        """Put the lifecycle record; raises EtcdError (the heartbeat keeps retrying)."""
        self._announcer.announce(self._machine.state, checkpoint_id=self.attempt.checkpoint_id,
                                 recovery_epoch=self.recovery_epoch,
                                 token_hash=self.attempt.token_hash
                                 if self._machine.state != LifecycleState.READY else "")

    def _announce_quietly(self) -> None:
        try:
            self._announce()
        except EtcdError as exc:
            log.warning("lifecycle_announce_deferred", node=self._node.node_id,
                        state=self._machine.state.value, error=str(exc))

    def announce_ready(self) -> None:
        """MarkReady's last step: READY in etcd (raises EtcdError; see mark_ready.py)."""
        if self._machine.phase != Phase.READY:
            raise Refusal(grpc.StatusCode.INTERNAL, "READY announced outside READY")
        self._announce()

    def announce(self) -> None:
        """Announce the current (RECOVERING) state at once, before start-up work."""
        self._announce()

    def fail(self, reason: str) -> None:
        self.entry.close()
        if self._machine.fail(reason):
            self._announce_quietly()

    # --- start-up ------------------------------------------------------------------------
    def _retry(self, fn: Callable[[], T], what: str) -> T:
        """Run a start-up step that reads or writes etcd or the catalog, retrying while
        they are briefly away (every step is idempotent). Past ``startup_retry_s``
        the error propagates and the node fails closed."""
        def retrying(exc: BaseException) -> None:
            log.warning("recovery_dependency_retry", node=self._node.node_id, step=what,
                        error=str(exc), error_type=type(exc).__name__)

        return until_deadline(fn, transient=(CatalogUnavailable, CatalogOutcomeUnknown,
                                             EtcdError),
                              deadline_s=self.startup_retry_s, on_retry=retrying)

    def run_startup(self) -> None:
        self._move(Phase.LOADING_CHECKPOINT)
        try:
            loaded = self._retry(self._store.load, "load checkpoint")
        except CheckpointUnusable as exc:
            self.fail(f"no usable checkpoint: {exc}")
            return
        files = self._retry(lambda: self._catalog.get_files_by_type(None, list(FileType)),
                            "enumerate files")
        try:
            files = self._gc_decisions(loaded, files)
        except (CorruptJournal, GcJournalMismatch, RevertAnchorsGone) as exc:
            self.fail(f"GC journal mismatch: {exc}")
            return
        try:
            load_files = frozenset(self._loads.load_journal()) if self._loads else frozenset()
        except (CorruptLoadJournal, OSError) as exc:
            self.fail(f"load journal mismatch: {exc}")
            return
        mine = my_files(self._node.node_id, files)
        regular = [f for f in mine if f.type == FileType.REGULAR]
        if loaded is None and regular:
            self.fail(f"no checkpoint, but the catalog holds {len(regular)} REGULAR files of "
                      f"{self._node.node_id}")
            return
        fp.RECOVERY_CLEANSING_BEFORE.hit()
        self._move(Phase.CLEANSING)
        applied = loaded.body.header.checkpoint_applied_ts if loaded else 0
        if loaded is not None:
            self.last_checkpoint = loaded.pointer
            self.last_checkpoint_write_time_ms = loaded.body.header.write_time_ms
        self.attempt = Attempt(self.attempt.token,
                               loaded.body.header.checkpoint_id if loaded else 0, applied)
        result = cleanse(self._node, self._catalog, loaded, files, mine, self._retry,
                         frozenset(self._gc_journal.protected_files()), load_files=load_files)
        fp.RECOVERY_CLEANSING_AFTER.hit()
        paths = self._retry(self._catalog.list_paths, "list paths")
        starts = derive(applied, result.segments, self._node.owned_vnodes,
                        sorted({p.table_id for p in paths}))
        fp.RECOVERY_REWIND_BEFORE.hit()
        try:
            rewind(self._node, starts, result.kept)
        except RewindFailed as exc:
            self.fail(str(exc))
            return
        fp.RECOVERY_REWIND_AFTER.hit()
        # Below the lowest replay start the state is the checkpoint's, history included;
        # from it on the replay rebuilds it. MarkReady raises the floor to a fresh
        # timestamp X and refuses AS OF reads in [start, X) (read_history.py).
        self._node.history.restored(loaded.body.header.history_gaps if loaded else (),
                                    starts.node_replay_from_ts, applied)
        if self._loads is not None:
            try:
                self._loads.reapply(starts)
            except (LoadJournalMismatch, Refusal, OSError) as exc:
                self.fail(f"load journal mismatch: a journaled bulk load cannot be "
                          f"re-applied: {exc}")
                return
        self.attempt.starts = starts
        REPLAY_START.labels(scope="node").set(starts.node_replay_from_ts)
        log.info("replay_ts_ready", node=self._node.node_id,
                 checkpoint_id=self.attempt.checkpoint_id, checkpoint_applied_ts=applied,
                 node_replay_from_ts=starts.node_replay_from_ts,
                 vnode_replay_from_ts=starts.vnode_replay_from_ts,
                 slot=loaded.slot if loaded else None, token_hash=self.attempt.token_hash)
        self.entry.open()
        self._move(Phase.AWAITING_REPLAY)

    def _gc_decisions(self, loaded: LoadedCheckpoint | None,
                      files: list[FileRecord]) -> list[FileRecord]:
        """Storage GC journal decisions (gc_recovery.py), before cleansing reads the
        catalog; returns the catalog's files as they are afterwards."""
        self._gc_journal.load()
        checkpointed = {f.file_id for f in loaded.body.files} if loaded else set()
        for listener in self._loaded_listeners:
            listener(checkpointed)
        decisions = self._retry(lambda: decide(self._node, self._catalog, self._gc_journal,
                                               checkpointed, files), "GC journal decisions")
        reverts = self._retry(lambda: recover_reverts(
            self._node, self._catalog, self._gc_journal, loaded.body if loaded else None,
            self._retired_retention_ms), "GC reverts")
        if decisions or reverts:
            log.info("gc_recovery_decided", node=self._node.node_id,
                     decisions=[(d.rewrite_id, d.state_before, d.decision) for d in decisions],
                     reverts=reverts)
            files = self._retry(
                lambda: self._catalog.get_files_by_type(None, list(FileType)), "enumerate files")
        self._retry(lambda: check_unjournaled(self._node, self._catalog, self._gc_journal, files),
                    "unjournaled GC files")
        if loaded is not None:  # no checkpoint: REGULAR files fail the start anyway
            check_rewrite_outputs(self._node, self._gc_journal, loaded.body, files,
                                  self._retry(self._catalog.list_paths, "list paths"))
        return files

    # --- replay -----------------------------------------------------------------------------
    def check_attempt(self, token: str, checkpoint_id: int) -> None:
        if not hmac.compare_digest(token.encode(), self.attempt.token.encode()):
            raise Refusal(grpc.StatusCode.FAILED_PRECONDITION,
                          "stale or unknown recovery attempt token")
        if checkpoint_id != self.attempt.checkpoint_id:
            raise Refusal(grpc.StatusCode.FAILED_PRECONDITION,
                          f"checkpointId {checkpoint_id} is not this attempt's "
                          f"({self.attempt.checkpoint_id})")

    @property
    def starts(self) -> ReplayStarts:
        starts = self.attempt.starts
        if starts is None:
            raise Refusal(grpc.StatusCode.UNAVAILABLE, "replay starts are not derived yet")
        return starts

    @contextlib.contextmanager
    def replay_request(self, token: str, checkpoint_id: int) -> Iterator[ReplayStarts]:
        """Admit one replay write and count it in flight until it finishes."""
        self._machine.admit(Request.REPLAY_WRITE)
        self.check_attempt(token, checkpoint_id)
        with self.entry.request():
            yield self.starts

    # --- checkpoints -----------------------------------------------------------------------------
    def create_checkpoint(self) -> Pointer:
        """Generate and install a checkpoint (READY only)."""
        self._machine.admit(Request.CHECKPOINT)
        with self._checkpoint_lock:
            # HWM - 1 (every write at or below it has been applied), but never
            # below 0: before the first commit there is nothing to have applied. The fence
            # first: a late write at or below the HWM applied after the cut would be in no
            # checkpoint and no replay start (LATE_WRITES_FENCED).
            hwm = self._hwm()
            self._node.fence.raise_to(hwm, f"checkpoint: the HWM was {hwm}")
            applied = max(hwm - 1, 0)
            try:
                body = build_body(self._node, applied,
                                  self._node.index.sequences.allocate("checkpoint_id") + 1,
                                  self.recovery_epoch)
            except CheckpointError as exc:  # an invariant broke: never install, fail closed
                self._node.fail_closed(str(exc))
                raise Refusal(grpc.StatusCode.INTERNAL, str(exc)) from exc
            self._node.check_registry_covers_visibility()
            if self._node.failure:
                raise Refusal(grpc.StatusCode.INTERNAL, self._node.failure)
            pointer = self._store.install(body)
            self.last_checkpoint = pointer
            self.last_checkpoint_write_time_ms = body.header.write_time_ms
            for listener in self._checkpoint_listeners:
                try:
                    listener(body)
                except Exception as exc:  # the checkpoint stands; the next one retries
                    log.error("checkpoint_listener_failed", error=str(exc),
                              error_type=type(exc).__name__)
            CHECKPOINT_AGE.set(pointer.checkpoint_applied_ts)
            CHECKPOINT_BYTES.set(pointer.length)
            CHECKPOINT_INSTALLED.set(time.time())
            return pointer

    def status(self) -> dict[str, Any]:
        phase = self._machine.phase
        return {
            "state": self._machine.state.value,
            "phase": phase.value,
            # Shown only once the replay starts exist: before that it is of no use.
            "token": self.attempt.token if phase in (Phase.AWAITING_REPLAY, Phase.BARRIER)
            else "",
            "checkpoint_id": self.attempt.checkpoint_id,
            "recovery_epoch": self.recovery_epoch,
            # Only once the entry is open: GetRecoveryReplayTs answers from then on.
            "replay_ts_ready": self.attempt.starts is not None and phase in (
                Phase.AWAITING_REPLAY, Phase.BARRIER, Phase.READY),
            "failure_reason": self._machine.reason if phase == Phase.FAILED else "",
        }
