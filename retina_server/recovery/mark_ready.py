"""What happens on MarkReady: the barrier and the READY hooks (specification C06.6, section 6).

``MarkReadyBarrier.mark_ready(token, checkpointId)``:

1. the lifecycle admits MARK_READY (AWAITING_REPLAY; READY for a repeat) and
   the token and checkpointId are this attempt's; from AWAITING_REPLAY, the
   request names every ACTIVE replay source (EVERY_SOURCE_REPLAYED,
   registered_writers.py), else FAILED_PRECONDITION and nothing changes;
2. the replay entry closes and the phase moves to BARRIER (still RECOVERING
   outside: nothing is written to etcd, so an etcd error cannot strand the
   node here);
3. in-flight replay requests drain;
4. the restart fence (:class:`RestartFence`, SNAPSHOTS_END_AT_RESTART): a fresh
   timestamp X from the TransServer becomes the read floor, and the write fence
   rises to the HWM;
5. the phase moves to READY inside the node: CDC writes are admitted, the
   query gate still refuses, because etcd still says RECOVERING;
6. the READY hooks run, once: the GC scheduler starts (gc_scheduler.py), table
   caches are dropped, the flush timer starts,
   the READY checkpoint is taken (it captures everything replayed), periodic
   checkpoints start;
7. queries are unblocked last (invariant READY_HOOKS_BEFORE_QUERIES): READY is
   announced on the lifecycle key; health says SERVING from the moment a put of
   READY succeeds (the lifecycle announcer tells the server).

If step 4 cannot reach the TransServer, MarkReady answers UNAVAILABLE and a retry
finishes the barrier. If step 7 cannot reach etcd, MarkReady answers UNAVAILABLE;
the node is READY with its hooks run, the heartbeat keeps re-putting the READY
record (and health turns SERVING when one lands), and a retried MarkReady with the
same token announces it again. A node is never
READY without its hooks, and a transient etcd error never wedges it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable

import grpc
from prometheus_client import Gauge

from retina_common import failpoints as fp
from retina_common.etcd import EtcdError
from retina_common.log import get_logger
from retina_common.refusal import Refusal
from retina_server.lifecycle import LifecycleStateMachine, Phase, Request
from retina_server.node import RetinaNode
from retina_server.recovery.replay_admission import ReplayEntry

log = get_logger(component="mark_ready")
# Exported so that the checkpoint-age alert scales with the configured interval.
CHECKPOINT_INTERVAL = Gauge("retina_checkpoint_interval_seconds",
                            "Configured interval between periodic checkpoints")
READ_FLOOR = Gauge("retina_read_floor_ts",
                   "Lowest snapshot this process answers (a timestamp issued at its MarkReady)")


class RestartFence:
    """SNAPSHOTS_END_AT_RESTART: a recovered node answers no snapshot that may have been
    taken before it started.

    Recovery rebuilds the node's state from the checkpoint and the replay, and the replay
    may apply what the process before the crash never did (a changelog batch whose
    transaction was aborted and redone at a new timestamp, a write the fence refused),
    and its write buffer no longer holds what a read before the crash fetched from it.
    So a read at a snapshot from before the restart could differ from one taken before
    it. At MarkReady the node begins a write transaction at the TransServer and ends it
    at once (TransClient.fresh_timestamp): its timestamp X is above every snapshot granted
    so far, and becomes the read floor (a read transaction with an older snapshot, and a
    snapshot read below X: ABORTED, begin a new read transaction; an AS OF read begun
    since is answered below X only outside what the replay may have rebuilt differently:
    read_history.py).
    No snapshot at or
    above X was ever read before this process, so none changes. Reads at X or later are
    granted as soon as the HWM reaches X (at once in a quiet cluster; once the writes
    live at this moment end otherwise). The write fence rises to the HWM too: every
    write transaction at or below it has ended."""

    def __init__(self, node: RetinaNode,
                 fresh_timestamp: Callable[[], tuple[int, int, int]],
                 replay_complete: Callable[[], bool] = lambda: False) -> None:
        self._node = node
        self._fresh_timestamp = fresh_timestamp
        self._replay_complete = replay_complete  # REPLAY_IS_COMPLETE (read_history.py)

    def __call__(self) -> None:
        floor, hwm, trans_id = self._fresh_timestamp()
        self._node.fence.raise_to(hwm, f"MarkReady: the HWM was {hwm}")
        history = self._node.history
        # HISTORY_REBUILT_IS_REFUSED: [R, X) (or [E, X)) becomes an inexact range.
        history.fence(floor, trans_id, self._replay_complete())
        READ_FLOOR.set(history.read_floor_ts)
        log.info("restart_fence_set", node=self._node.node_id, read_floor_ts=floor,
                 write_fence_ts=self._node.fence.floor, history_gaps=history.gaps())


class ReadyHooks:
    """What starts when the node becomes READY; :meth:`run` is idempotent."""

    def __init__(self, node: RetinaNode, checkpoint: Callable[[], object],
                 checkpoint_interval_s: float, stop: threading.Event,
                 start_gc: Callable[[], None] = lambda: None) -> None:
        self._node = node
        self._start_gc = start_gc
        self._checkpoint = checkpoint
        self._interval = checkpoint_interval_s
        CHECKPOINT_INTERVAL.set(checkpoint_interval_s)
        self._stop = stop
        self._done = False
        self._lock = threading.Lock()

    def run(self) -> None:
        with self._lock:
            if self._done:
                return
            self._start_gc()  # the spec's order: GC scheduler, then caches
            self._node.invalidate_caches()
            self._node.start()
            # So that every later restart has a pointer, and the replayed state is in it.
            self._take_checkpoint()
            threading.Thread(target=self._periodic, name="checkpoints", daemon=True).start()
            self._done = True

    def _take_checkpoint(self) -> None:
        try:
            self._checkpoint()
        except Exception as exc:  # retried by the periodic checkpoints
            log.error("checkpoint_failed", error=str(exc), error_type=type(exc).__name__)

    def _periodic(self) -> None:
        while not self._stop.wait(self._interval):
            self._take_checkpoint()


class MarkReadyBarrier:
    def __init__(self, machine: LifecycleStateMachine, entry: ReplayEntry,
                 check_attempt: Callable[[str, int], None], hooks: ReadyHooks,
                 announce_ready: Callable[[], None],
                 restart_fence: Callable[[], None] = lambda: None,
                 check_sources: Callable[[Iterable[str]], None] = lambda _replayed: None
                 ) -> None:
        self._machine = machine
        self._check_sources = check_sources
        self._restart_fence = restart_fence
        self._entry = entry
        self._check_attempt = check_attempt
        self._hooks = hooks
        self._announce_ready = announce_ready
        self._lock = threading.Lock()  # one MarkReady at a time

    def mark_ready(self, token: str, checkpoint_id: int,
                   replayed_writers: Iterable[str] = ()) -> None:
        if not self._lock.acquire(blocking=False):
            raise Refusal(grpc.StatusCode.UNAVAILABLE, "MarkReady is in progress; retry")
        try:
            phase = self._machine.admit(Request.MARK_READY)
            self._check_attempt(token, checkpoint_id)
            if phase == Phase.AWAITING_REPLAY:
                # EVERY_SOURCE_REPLAYED, before the entry closes: a refusal leaves the
                # node AWAITING_REPLAY, so the missing replays can still be sent.
                self._check_sources(replayed_writers)
            if phase in (Phase.AWAITING_REPLAY, Phase.BARRIER):
                # BARRIER with the lock free: an earlier MarkReady was interrupted
                # after closing the entry; finish its barrier instead of wedging.
                self._barrier(phase)
            # READY: run (or finish) the hooks, then unblock queries. A repeat after
            # READY with the same token lands here and changes nothing else.
            self._hooks.run()
            self._unblock_queries()
        finally:
            self._lock.release()

    def _barrier(self, phase: Phase) -> None:
        self._entry.close()
        if phase == Phase.AWAITING_REPLAY:
            self._machine.transition(Phase.BARRIER, "MarkReady")
        fp.RECOVERY_MARK_READY_BARRIER_AFTER.hit()
        self._entry.drain()
        fp.RECOVERY_MARK_READY_DRAIN_AFTER.hit()
        self._restart_fence()  # before any ordinary write is admitted
        self._machine.transition(Phase.READY, "MarkReady barrier passed")

    def _unblock_queries(self) -> None:
        fp.RECOVERY_MARK_READY_ANNOUNCE_BEFORE.hit()
        try:
            self._announce_ready()
        except EtcdError as exc:
            log.warning("ready_announce_failed", error=str(exc))
            raise Refusal(grpc.StatusCode.UNAVAILABLE,
                          f"the node is READY but READY is not yet announced ({exc}); "
                          "retry MarkReady") from exc
        fp.RECOVERY_MARK_READY_ANNOUNCE_AFTER.hit()
        log.info("node_ready")
