"""The write fence: a write that arrives after its transaction ended never changes history.

An UpdateRecord request carries only its commit timestamp T, not whether the write
transaction behind T is still live. A request stalled past its lease (behind a stream
lock, in a long fsync, in a paused process) would otherwise be applied after the
TransServer ended T and the HWM passed it, so a read at S >= T taken before it and one
taken after it would differ, and a Storage GC rewrite prepared in between would make the
difference permanent. The rule is the timestamp cache of serializable MVCC stores
(CockroachDB's timestamp cache, Spanner's safe time): reads raise a per-node write floor.

Invariants (docs/write-paths/ingest-publish.md, "The write fence"):

* LATE_WRITES_FENCED: once this node has answered a read at S, or has learned that every
  write transaction at or below S has ended (the HWM, a safe GC timestamp), it refuses
  every ordinary write at a timestamp at or below S (ABORTED: the writer redoes its batch
  at a new timestamp). Recovery replays are not fenced: they rebuild what was applied.
* FENCE_WAITS_FOR_ADMITTED: a write the fence admitted before the floor rose is applied
  whole, and the floor's riser (a read, a GC prepare, a fold, a checkpoint) waits until
  every admitted write at or below the new floor has finished before it reads anything.

Together they give SNAPSHOT_IS_IMMUTABLE on this node: the writes at or below S that a
read at S sees are fixed from the first read at S on. The floor lives in memory; after a
restart MarkReady raises it to the HWM before any ordinary write is admitted, and the
node answers no snapshot taken before the restart (SNAPSHOTS_END_AT_RESTART, mark_ready.py).
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager

import grpc
from prometheus_client import Counter as MetricCounter
from prometheus_client import Gauge

from retina_common.log import get_logger
from retina_common.refusal import Refusal

log = get_logger(component="write_fence")

FENCE_TS = Gauge("retina_write_fence_ts",
                 "The write floor: ordinary writes at or below it are refused (ABORTED)")
FENCED = MetricCounter("retina_writes_fenced_total",
                       "Ordinary writes refused because their timestamp is at or below the "
                       "write floor (their transaction had ended)")
FENCE_WAITS = MetricCounter("retina_write_fence_waits_total",
                            "Floor raises that waited for admitted writes to finish")

# How long a floor raise waits for admitted writes before the riser is told to retry: an
# admitted write holds its stream locks and only applies, so this is a stuck node.
DEFAULT_WAIT_S = 30.0


class Fenced(Refusal):
    """ABORTED by LATE_WRITES_FENCED: nothing of the write was applied (update_record.py
    records the refusal before it answers: refused_writes.py). ``floor``: the write floor
    that refused it; no timestamp at or below it is ever admitted on this node again."""

    def __init__(self, message: str, floor: int) -> None:
        super().__init__(grpc.StatusCode.ABORTED, message)
        self.floor = floor


class WriteFence:
    """The node's write floor and the writes it admitted. Thread-safe."""

    def __init__(self, node_id: str, wait_s: float = DEFAULT_WAIT_S) -> None:
        self._node_id = node_id
        self._wait_s = wait_s
        self._cond = threading.Condition()
        self._floor = 0
        self._why = "nothing read yet"
        # Lowest timestamp of each admitted request still applying (a multiset).
        self._admitted: Counter[int] = Counter()
        self._waiters = 0  # risers waiting for admitted writes: only then is anyone woken

    @property
    def floor(self) -> int:
        return self._floor

    def raise_to(self, ts: int, why: str) -> None:
        """LATE_WRITES_FENCED from now on for every timestamp at or below ``ts``, then
        FENCE_WAITS_FOR_ADMITTED. Raises Refusal(UNAVAILABLE) if an admitted write at or
        below ``ts`` does not finish in time (nothing may be read past it)."""
        with self._cond:
            if ts > self._floor:
                self._floor = ts
                self._why = why
                FENCE_TS.set(ts)
        self.wait_admitted(ts, why)

    def wait_admitted(self, ts: int, why: str) -> None:
        """Wait until every admitted write whose lowest timestamp is at or below ``ts`` has
        finished (FENCE_WAITS_FOR_ADMITTED); Refusal(UNAVAILABLE) if one does not in time."""
        with self._cond:
            if not self._pending_at_or_below(ts):
                return
            FENCE_WAITS.inc()
            log.info("write_fence_waiting", node=self._node_id, ts=ts, why=why,
                     admitted=sorted(self._admitted))
            self._waiters += 1
            try:
                done = self._cond.wait_for(lambda: not self._pending_at_or_below(ts),
                                           self._wait_s)
            finally:
                self._waiters -= 1
        if not done:
            raise Refusal(grpc.StatusCode.UNAVAILABLE,
                          f"a write at or below {ts} is still being applied on "
                          f"{self._node_id} after {self._wait_s:.0f}s; retry")

    def _pending_at_or_below(self, ts: int) -> bool:
        return any(t <= ts for t in self._admitted)

    @contextmanager
    def admit(self, ts: int) -> Iterator[None]:
        """Admit an ordinary write whose lowest timestamp is ``ts`` for as long as the
        block runs (the caller holds its stream locks and applies it there); refuse it,
        changing nothing, if ``ts`` is at or below the floor."""
        with self._cond:
            floor, why = self._floor, self._why
            if ts > floor:
                self._admitted[ts] += 1
        if ts <= floor:
            FENCED.inc()
            log.warning("write_fenced", node=self._node_id, ts=ts, floor=floor, why=why)
            raise Fenced(f"write fence: timestamp {ts} is at or below {self._node_id}'s "
                         f"write floor {floor} ({why}): its transaction has ended; redo "
                         "the batch at a new timestamp", floor)
        try:
            yield
        finally:
            with self._cond:
                self._admitted[ts] -= 1
                if not self._admitted[ts]:
                    del self._admitted[ts]
                if self._waiters:
                    self._cond.notify_all()
