"""The GC scheduler: folds visibility chains and prunes primary-index versions while READY.

Every ``interval_s`` (and on demand, ``run_once``: the admin RPC
RunGcMaintenance) one round does two things, so that memory and the index stop
growing with the history:

1. **Fold** every deletion-chain item at or below ``fold_ts`` into its row
   group's base (``RGVisibility.fold``), for the published files of the node
   and for the write-buffer blocks::

       fold_ts = min(safeGcTs, gcFloor, replayFloor - 1)   (:func:`fold_target`)

   FOLD_SAFE needs ``fold_ts`` below every live read snapshot: safeGcTs is.
   A pending Storage GC rewrite reads visibility at exactly its cutoff, so no
   fold passes the lowest pending cutoff (``gcFloor``; None when none is
   pending). A rewrite's cutoff is below ``replayFloor`` (rewrites.py,
   GC_CUTOFF_BELOW_REPLAY_FLOOR) and visibility answers only at or above a
   row group's base, so no fold passes ``replayFloor - 1`` either (once the
   floor is known: with a short history retention safeGcTs is above the floor,
   and a fold up to it would leave no file a rewrite can read).
   Files a Storage GC swap retired are frozen and left alone. The
   write fence rises to ``fold_ts`` first (write_fence.py): a delete at or below
   it that arrived later would be folded into a base without its timestamp.
2. **Prune** primary-index versions below the horizon
   (``PrimaryIndex.prune_versions``, invariant
   PRUNE_KEEPS_ANSWERS_ABOVE_HORIZON: every resolution at ``T >= horizon``
   answers as before)::

       horizon = min(safeGcTs, gcFloor, replayFloor)

   The source positions below the horizon (source_positions.py) and the
   applied-write records (applied_writes.py) are dropped in the transaction that
   records it.

   ``replayFloor`` (:class:`ReplayFloor`) is the lowest replay start any
   crash-restart could use: the derived nodeReplayFromTs of both checkpoint
   slots. After a crash the rewind drops every version at or above a scope's
   start and the replay resolves keys at timestamps at or above it; pruning
   below the floor keeps those resolutions exact (pruning and the rewind's
   truncation commute). Until both slots are known the floor is 0 and nothing
   is pruned (a node's first checkpoint, installed with the other slot empty, is
   known alone). Pruning is incremental: the scheduler remembers the last
   horizon and the next round only looks at keys written since (from 0 after
   each process start); the horizon never moves down. The write fence's refusal
   records (refused_writes.py) below ``replayFloor`` go too: no replay asks for
   them. A Storage GC rewrite's cutoff stays below the same floor (rewrites.py,
   GC_CUTOFF_BELOW_REPLAY_FLOOR).

FOLD_FENCE (a pin racing a round): the round announces the highest timestamp
it may fold to (``min(safeGcTs, replayFloor - 1)``) *before* it reads
``gcFloor``, lowers the announcement to ``fold_ts`` once it knows it, and
replaces it by ``last_fold_ts`` when done; :meth:`GcScheduler.fold_fence` answers the maximum
of the announcement and ``last_fold_ts``. PrepareGcRewrite pins its cutoff
first and reads the fence after, and refuses (unpinning) a cutoff below it.
Whichever comes first, the other sees it: either the round reads the pin and
folds no higher than the cutoff, or the prepare sees a fence at least the
round's ``fold_ts`` and refuses. Prunes run at ``horizon <= fold_ts + 1`` in
the same round (``fold_ts`` is at most ``replayFloor - 1``, the horizon at most
``replayFloor``): a version a prune removes is of a row deleted below the
horizon, so at or below any cutoff at or above ``fold_ts``: never of a row a
rewrite keeps.

A round is skipped (nothing changes) when the node is not READY or has failed
closed, or when an input cannot be read (safeGcTs from the TransServer, the GC
floor, the replay floor): a warning is logged and the next round tries again.
Rounds are serialised: the timer and the RPC never run one concurrently.

What if the process dies during a round: a fold only changes memory (the next
checkpoint captures whatever state it reached; a restart rebuilds visibility
from the checkpoint). A prune commits bounded LMDB transactions, each removing
whole keys' versions with their by-timestamp entries; a crash leaves some keys
unpruned, and the next process prunes from ``since = 0``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import lmdb
from prometheus_client import Counter, Gauge

from retina_common.log import get_logger
from retina_server.node import RetinaNode
from retina_server.visibility import RGVisibility, VisibilityError

log = get_logger(component="gc_scheduler")

FOLDED = Counter("retina_gc_folded_items_total",
                 "Deletion-chain items folded into row-group bases")
PRUNED = Counter("retina_gc_pruned_versions_total", "Primary-index versions pruned")
ROUNDS = Counter("retina_gc_rounds_total", "GC maintenance rounds", ["outcome"])
FOLD_TS = Gauge("retina_gc_fold_ts", "Timestamp of the last visibility fold")
HORIZON_TS = Gauge("retina_gc_prune_horizon_ts", "Horizon of the last primary-index prune")
CHAIN_ITEMS = Gauge("retina_gc_chain_items", "Deletion-chain items left after the last fold")
PRIMARY_VERSIONS = Gauge("retina_gc_primary_versions", "Versions in the primary index")


def fold_target(safe: int, pinned: int | None, replay: int) -> int:
    """``fold_ts = min(safeGcTs, gcFloor, replayFloor - 1)``; the replay floor only once
    known (> 0): no rewrite is prepared before, and the floor passes a base folded
    meanwhile as checkpoints follow. Below 1: nothing to fold."""
    fold_ts = safe if pinned is None else min(safe, pinned)
    return fold_ts if replay <= 0 else min(fold_ts, replay - 1)


@dataclass(frozen=True)
class MaintenanceResult:
    """What one round did. ``skipped`` names why nothing was done (None: it ran)."""

    folded_items: int = 0
    pruned_versions: int = 0
    fold_ts: int = 0
    prune_horizon_ts: int = 0
    chain_items: int = 0
    skipped: str | None = None


class ReplayFloor:
    """The lowest replay start a crash-restart could use: the minimum of the derived
    nodeReplayFromTs of the two newest checkpoints observed (the current and the
    previous slot: a restart falls back to the previous one when the current body is
    unreadable).

    0 (unknown: nothing is pruned, no Storage GC rewrite is prepared) until both slots
    are known. A process that loaded only its current slot does not know the previous
    slot's start, and that slot stays the fallback until this process installs a
    checkpoint (the READY checkpoint, or a later one if that fails). A checkpoint
    installed while the other slot was empty (``only_slot``: a node's first-ever
    checkpoint, whose install moved no ``current`` to ``previous``) is the one slot a
    restart can load, so it alone is the floor until the next one; without it a new
    node would wait a checkpoint interval for its second checkpoint.

    Feed it the checkpoint loaded at start-up (or both slots, if both bodies are
    read) and every checkpoint whose pointer swap is known to have committed; on an
    unknown outcome observe nothing (the floor stays lower, never higher: a newer
    checkpoint never starts below an older one). ``only_slot`` only when the previous
    slot was read empty after the install; when in doubt, leave it out. Thread-safe."""

    def __init__(self) -> None:
        self._slots: dict[int, int] = {}  # checkpointId -> nodeReplayFromTs
        self._only: int | None = None  # a checkpoint installed with the other slot empty
        self._lock = threading.Lock()

    def observe(self, checkpoint_id: int, node_replay_from_ts: int, *,
                only_slot: bool = False) -> None:
        with self._lock:
            known = self._slots.get(checkpoint_id)
            self._slots[checkpoint_id] = node_replay_from_ts if known is None else \
                min(known, node_replay_from_ts)
            if only_slot:  # nothing older can be loaded any more
                for old in [c for c in self._slots if c < checkpoint_id]:
                    del self._slots[old]
                self._only = checkpoint_id
            for old in sorted(self._slots)[:-2]:  # keep the two newest checkpoints
                del self._slots[old]

    def floor(self) -> int:
        with self._lock:
            if len(self._slots) == 2:
                return max(min(self._slots.values()), 0)
            if len(self._slots) == 1 and self._only in self._slots:
                return max(self._slots[self._only], 0)
            return 0


def _below_horizon(node: RetinaNode) -> Callable[[lmdb.Transaction[bytes], int], None]:
    """What the node's stores sharing the index's environment drop below a new prune
    horizon, in the transaction that records it."""
    def drop(txn: lmdb.Transaction[bytes], horizon: int) -> None:
        node.source_positions.drop_below(txn, horizon)
        node.applied.drop_below(txn, horizon)
    return drop


class GcScheduler:
    """Runs maintenance rounds inside a READY node (see the module docstring)."""

    def __init__(self, node: RetinaNode, safe_gc_ts: Callable[[], int],
                 gc_floor: Callable[[], int | None], replay_floor: Callable[[], int],
                 interval_s: float, stop: threading.Event, *,
                 is_ready: Callable[[], bool] = lambda: True) -> None:
        self._node = node
        self._safe_gc_ts = safe_gc_ts
        self._gc_floor = gc_floor
        self._replay_floor = replay_floor
        self._interval = interval_s
        self._stop = stop
        self._is_ready = is_ready
        self._round_lock = threading.Lock()  # one round at a time (timer and RPC)
        self._state_lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._since = 0  # the last prune horizon: the next prune starts there
        self._last_fold_ts = 0
        self._fold_intent = 0  # FOLD_FENCE: the highest ts the round in progress may reach
        self._rounds = 0
        self._skipped = 0
        self._last: MaintenanceResult | None = None

    # --- the timer ---
    def start(self) -> None:
        """Start the daemon thread (idempotent): a round every interval until ``stop``."""
        with self._state_lock:
            if self._thread is not None:
                return
            self._thread = threading.Thread(target=self._loop, name="gc-scheduler",
                                            daemon=True)
            self._thread.start()

    def join(self, timeout_s: float | None = None) -> bool:
        """Wait for the thread after ``stop`` was set; True when it has ended."""
        thread = self._thread
        if thread is None:
            return True
        thread.join(timeout_s)
        return not thread.is_alive()

    def _loop(self) -> None:
        while not self._stop.wait(self._interval):
            try:
                self.run_once()
            except Exception as exc:  # a bug or a storage error: the next round retries
                ROUNDS.labels(outcome="failed").inc()
                log.error("gc_maintenance_failed", node=self._node.node_id, error=str(exc),
                          error_type=type(exc).__name__)

    # --- one round ---
    def run_once(self) -> MaintenanceResult:
        """One round now (waits for a round in progress). IndexBackendError from the
        prune propagates, after the fold of the round took effect."""
        with self._round_lock:
            result = self._round()
        with self._state_lock:
            self._last = result
            if result.skipped is None:
                self._rounds += 1
            else:
                self._skipped += 1
        ROUNDS.labels(outcome="skipped" if result.skipped else "ok").inc()
        return result

    def _skip(self, reason: str, **fields: object) -> MaintenanceResult:
        log.warning("gc_maintenance_skipped", node=self._node.node_id, reason=reason, **fields)
        return MaintenanceResult(skipped=reason)

    def _round(self) -> MaintenanceResult:
        node = self._node
        if node.failure is not None or not self._is_ready():
            log.debug("gc_maintenance_skipped", node=node.node_id, reason="not_ready")
            return MaintenanceResult(skipped="not_ready")
        started = time.monotonic()
        try:
            safe = int(self._safe_gc_ts())
        except Exception as exc:
            return self._skip("safe_gc_ts_unavailable", error=str(exc),
                              error_type=type(exc).__name__)
        # Reads at or below safeGcTs can list no more files: they hold nothing now. First,
        # so a round that fails later (a floor, the fence, a prune) still lets them go.
        node.forget_buffer_reads_at_or_below(safe)
        try:
            # Before the announcement, which it bounds: the round folds with this value.
            replay = int(self._replay_floor())
        except Exception as exc:
            return self._skip("floor_unavailable", error=str(exc),
                              error_type=type(exc).__name__)
        with self._state_lock:  # FOLD_FENCE: announce before reading the pins
            self._fold_intent = fold_target(safe, None, replay)
        fold_ts = 0  # set once folding may start
        try:
            try:
                pinned = self._gc_floor()
            except Exception as exc:
                return self._skip("floor_unavailable", error=str(exc),
                                  error_type=type(exc).__name__)
            with self._state_lock:
                fold_ts = self._fold_intent = fold_target(
                    safe, None if pinned is None else int(pinned), replay)
            return self._fold_and_prune(started, safe, pinned, replay, fold_ts)
        finally:
            with self._state_lock:  # what the fold reached, at most: now the fence
                self._last_fold_ts = max(self._last_fold_ts, fold_ts)
                self._fold_intent = 0

    def _fold_and_prune(self, started: float, safe: int, pinned: int | None, replay: int,
                        fold_ts: int) -> MaintenanceResult:
        node = self._node
        # PRUNE_KEEPS_ANSWERS_ABOVE_HORIZON below every replay start and every pinned
        # cutoff; at most fold_ts + 1 (see FOLD_FENCE in the module docstring).
        horizon = min(safe if pinned is None else min(safe, int(pinned)), replay)

        folded = chain = 0
        if fold_ts > 0:
            # LATE_WRITES_FENCED: a delete at or below fold_ts arriving after the fold
            # would land in a base that no longer tells its timestamp.
            node.fence.raise_to(fold_ts, f"GC maintenance fold at {fold_ts}")
            folded, chain = self._fold_all(fold_ts)
            node.history.forget_below(fold_ts)  # no read below the fold is answered
            FOLDED.inc(folded)
            FOLD_TS.set(fold_ts)
            CHAIN_ITEMS.set(chain)
        pruned = 0
        since = self._since
        if horizon > since:
            # POSITIONS_BOUNDED: the source positions below the horizon go with it, and
            # so do the applied-write records (no replay asks below the replay floor).
            pruned = node.index.primary.prune_versions(horizon, since,
                                                       below_horizon=_below_horizon(node))
            with self._state_lock:
                self._since = horizon
            PRUNED.inc(pruned)
            HORIZON_TS.set(horizon)
        # No replay starts below the replay floor: the refusals below it are never asked.
        node.refused.prune_below(replay)
        versions = node.index.primary.primary_version_count()
        PRIMARY_VERSIONS.set(versions)
        emit = log.info if folded or pruned else log.debug
        emit("gc_maintenance", node=node.node_id, folded_items=folded, pruned_versions=pruned,
             fold_ts=fold_ts, prune_horizon_ts=self._since, prune_since_ts=since,
             safe_gc_ts=safe, gc_floor_ts=pinned, replay_floor_ts=replay, chain_items=chain,
             primary_versions=versions,
             duration_ms=round((time.monotonic() - started) * 1000, 1))
        return MaintenanceResult(folded, pruned, fold_ts, self._since, chain)

    def _fold_all(self, fold_ts: int) -> tuple[int, int]:
        """Fold every row group of the node at ``fold_ts``; (items folded, chain items
        left). A block adopted by a publish during the scan is seen once."""
        entries: dict[int, RGVisibility] = {}
        visibility = self._node.visibility
        for file_id in visibility.files():
            # Row groups are numbered 0..n-1; probing is O(n) where row_groups() would
            # scan the whole index once per file.
            rg = 0
            while True:
                try:
                    entry = visibility.get(file_id, rg)
                except VisibilityError:
                    break
                entries[id(entry)] = entry
                rg += 1
            if rg == 0:  # no row group 0 (not expected): ask for the ids
                for rg_id in visibility.row_groups(file_id):
                    try:
                        entry = visibility.get(file_id, rg_id)
                    except VisibilityError:  # removed meanwhile
                        continue
                    entries[id(entry)] = entry
        for stream in self._node.all_streams():
            with stream.buffer.lock:  # only to read the block lists; folds run outside
                for file in stream.buffer.files:
                    for block in file.blocks:
                        entries[id(block.visibility)] = block.visibility
        folded = chain = 0
        for entry in entries.values():
            folded += entry.fold(fold_ts)
            chain += len(entry.snapshot()[2])
        return folded, chain

    def fold_fence(self) -> int:
        """FOLD_FENCE: no visibility of this node is, or is about to be, folded above
        this timestamp. A Storage GC prepare pins its cutoff, then refuses it if it is
        below the fence (see the module docstring)."""
        with self._state_lock:
            return max(self._last_fold_ts, self._fold_intent)

    # --- status ---
    def status(self) -> dict[str, Any]:
        """last_fold_ts, last_prune_horizon_ts, rounds (run), skipped_rounds, and what the
        last round did (``last``: a MaintenanceResult or None)."""
        with self._state_lock:
            return {"last_fold_ts": self._last_fold_ts,
                    "last_prune_horizon_ts": self._since,
                    "rounds": self._rounds,
                    "skipped_rounds": self._skipped,
                    "last": self._last,
                    "running": self._thread is not None and self._thread.is_alive()}
