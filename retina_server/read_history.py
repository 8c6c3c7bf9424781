"""Which past snapshots a node answers after restarts (docs/history.md, "Restarts").

A recovery rebuilds what the node applied since its checkpoint from the writers'
changelogs: every replay scope restarts at its ``scopeReplayFromTs``, and the node-wide
lowest start E (``nodeReplayFromTs``) bounds all of it. Below E the node's state is the
checkpoint's, history included (visibility.py), and equal to what it was before the
crash. From E on it is what the replay rebuilt. A changelog also holds transactions a
writer gave up and redid at a new timestamp; the timestamps this node's fence refused
are skipped (refused_writes.py, REFUSED_IS_NOT_REPLAYED), but a given-up transaction
that never reached this node is applied by the replay although no reader of this node
saw it (docs/history.md, "Restarts"), and the node cannot tell it from a committed one.
So the rebuilt history may differ from what readers saw from the lowest timestamp R the
replay applied on; below R it is the checkpoint's plus nothing the node had applied
(everything it applied is in a changelog and would have been replayed, or was a refused
write that changed nothing). MarkReady then takes a fresh timestamp X, above every
snapshot granted before.

REPLAY_IS_COMPLETE is the premise of that "below R": it fails when the node took
anonymous writes (``retina.anonymous_writes``: no changelog holds them) or a writer was
declared GONE (its changelog is not replayed). Then the range starts at E, as before.

* SNAPSHOTS_END_AT_RESTART (as before): a read transaction begun before this process's
  fence (its id at or below the fence transaction's), or an ordinary read, whose
  snapshot is below X is refused ABORTED: begin a new read transaction.
* HISTORY_REBUILT_IS_REFUSED: an AS OF read transaction begun after the fence is
  answered below X only outside every inexact range ``[R, X)`` (``[E, X)`` without
  REPLAY_IS_COMPLETE) this node ever had (they are kept in its checkpoints and dropped
  once a fold passed them); inside one it is refused snapshot_expired. Below R it is
  answered from the checkpoint's history (the replay applied nothing there). A replay
  that applied nothing leaves no range.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable

import grpc

from retina_common.refusal import Refusal, changes_expired, snapshot_expired


class ReadHistory:
    def __init__(self, node_id: str) -> None:
        self._node_id = node_id
        self._lock = threading.Lock()
        # SNAPSHOTS_END_AT_RESTART: snapshots below it are not answered to ordinary reads.
        # MarkReady sets it to a timestamp the TransServer issued after this process
        # started (mark_ready.py); recovery sets it to checkpointAppliedTs before that.
        self.read_floor_ts = 0
        self._fence_trans_id = 0  # the transaction MarkReady's fence began and ended
        self._rebuilt_from: int | None = None  # E of this process's recovery
        self._first_replayed: int | None = None  # R: the lowest timestamp replay applied
        self._gaps: list[tuple[int, int]] = []  # [R, X) of every recovery, oldest first

    def restored(self, gaps: Iterable[tuple[int, int]], rebuilt_from: int,
                 applied_ts: int) -> None:
        """Recovery: the ranges the loaded checkpoint names, and this recovery's E."""
        with self._lock:
            self._gaps = sorted(gaps)
            self._rebuilt_from = rebuilt_from
            self._first_replayed = None
            self.read_floor_ts = applied_ts

    def replayed(self, ts: int) -> None:
        """The replay applied a write at ``ts`` (replay_admission.py: not skipped)."""
        with self._lock:
            if self._first_replayed is None or ts < self._first_replayed:
                self._first_replayed = ts

    def fence(self, floor_ts: int, trans_id: int, replay_complete: bool = False) -> None:
        """MarkReady's restart fence: X and its transaction; [R, X) becomes an inexact
        range, [E, X) unless ``replay_complete`` (REPLAY_IS_COMPLETE)."""
        with self._lock:
            self.read_floor_ts = max(self.read_floor_ts, floor_ts)
            self._fence_trans_id = max(self._fence_trans_id, trans_id)
            low = self._rebuilt_from
            if low is not None and replay_complete:
                low = None if self._first_replayed is None else max(low, self._first_replayed)
            if low is not None and low < self.read_floor_ts:
                self._gaps = _merged([*self._gaps, (low, self.read_floor_ts)])
            self._rebuilt_from = self._first_replayed = None

    def gaps(self) -> tuple[tuple[int, int], ...]:
        """The inexact ranges [lo, hi) (kept in checkpoints, shown in status)."""
        with self._lock:
            return tuple(self._gaps)

    def inexact_ranges(self) -> tuple[tuple[int, int], ...]:
        """Where history this node rebuilt after its restarts may differ from what its
        readers saw before (HISTORY_REBUILT_IS_REFUSED): a change feed derived from the
        node's stored state refuses these ranges and serves the rest (below a range the
        checkpoint and the replay rebuilt it exactly; from its end on, nothing was ever
        read before the restart)."""
        return self.gaps()

    def forget_below(self, fold_ts: int) -> None:
        """A fold passed these ranges: nothing below it is read any more."""
        with self._lock:
            self._gaps = [g for g in self._gaps if g[1] > fold_ts]

    def check(self, snapshot: int, ts: int | None, trans_id: int, as_of: bool) -> None:
        """Refuse a read this node cannot answer exactly (the module docstring).
        ``ts``: the timestamp read when it is below the snapshot (GetWriteBuffer);
        QueryVisibility passes None: it may look below the floor for a transaction
        begun since (the Storage GC job reads visibility at its cutoff)."""
        low = snapshot if ts is None else min(snapshot, ts)
        with self._lock:
            if low >= self.read_floor_ts:
                return
            if not as_of or trans_id <= self._fence_trans_id:
                raise Refusal(grpc.StatusCode.ABORTED,
                              f"snapshot {low} is below {self._node_id}'s read floor "
                              f"{self.read_floor_ts} (the node restarted after the snapshot "
                              "may have been taken); begin a new read transaction")
            gap = next((g for g in self._gaps if g[0] <= low < g[1]), None)
        if gap is not None:
            raise snapshot_expired(
                f"snapshot {low} is in [{gap[0]}, {gap[1]}), history {self._node_id} rebuilt "
                "from the changelogs when it recovered from a restart (HISTORY_REBUILT_IS_"
                "REFUSED); read below it or at or above it", gap[1])


    def check_changes(self, from_ts: int, to_ts: int) -> None:
        """The change feed over ``(from_ts, to_ts]`` (change_feed.py): refused
        changes_expired when the range reaches into history a recovery rebuilt."""
        with self._lock:
            # The commits read are (from_ts, to_ts]; a rebuilt range [E, X) holds
            # the commits at E .. X - 1.
            gap = next((g for g in self._gaps if from_ts + 1 < g[1] and g[0] <= to_ts),
                       None)
        if gap is not None:
            raise changes_expired(
                f"changes in ({from_ts}, {to_ts}] reach into [{gap[0]}, {gap[1]}), history "
                f"{self._node_id} rebuilt from the changelogs when it recovered from a "
                "restart (HISTORY_REBUILT_IS_REFUSED)", gap[1])


def _merged(gaps: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for lo, hi in sorted(gaps):
        if out and lo <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], hi))
        else:
            out.append((lo, hi))
    return out
