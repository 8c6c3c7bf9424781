"""Which read transactions a node answers (QueryVisibility, GetWriteBuffer).

A read carries the id of the read-only transaction it belongs to. The node
answers only while that transaction is live at the TransServer: a query
whose transaction committed, rolled back or expired may have been passed by
the safe GC timestamp, and its snapshot is no longer protected
(invariant READS_OF_LIVE_TRANSACTIONS_ONLY). Liveness is asked once and kept
for at most ``ttl_s`` (never past the transaction's lease), so a query that
reads many files costs one TransServer call per node per second.

A read looks at its transaction's snapshot or an older point (the Storage GC job reads
visibility at its cutoff), never at a newer one: a later timestamp would be a snapshot
the TransServer never granted, and the read would raise the node's write floor above
live writes (write_fence.py).

Refusals: no transaction id, or a timestamp above the transaction's snapshot →
INVALID_ARGUMENT; a write transaction or one that is not live → FAILED_PRECONDITION
(begin a new read transaction); the TransServer unreachable → UNAVAILABLE.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import grpc
from prometheus_client import Counter

from retina_common.refusal import Refusal

REFUSED = Counter("retina_reads_refused_total", "Reads refused by the read-transaction guard",
                  ["reason"])


@dataclass(frozen=True)
class TransStatus:
    live: bool
    read_only: bool = False
    lease_expires_at_ms: int = 0
    timestamp: int = 0  # a read transaction's snapshot
    as_of: bool = False  # begun AS OF a past point


@dataclass(frozen=True)
class LiveRead:
    timestamp: int  # the snapshot
    as_of: bool


class ReadTransactionGuard:
    def __init__(self, lookup: Callable[[int], TransStatus], ttl_s: float = 1.0,
                 clock: Callable[[], float] = time.time) -> None:
        self._lookup = lookup
        self._ttl_s = ttl_s
        self._clock = clock
        self._live_until: dict[int, tuple[float, LiveRead | None]] = {}  # id -> (until, read)
        self._lock = threading.Lock()

    def check(self, trans_id: int, ts: int | None = None) -> LiveRead:
        """The snapshot of ``trans_id`` if it is a live read-only transaction (and ``ts``,
        when given, is not above it); raise Refusal if not."""
        if trans_id <= 0:
            REFUSED.labels(reason="no_transaction").inc()
            raise Refusal(grpc.StatusCode.INVALID_ARGUMENT,
                          "a read needs the trans_id of a live read-only transaction")
        read = self._live_read(trans_id)
        snapshot = read.timestamp
        if ts is not None and ts > snapshot:
            REFUSED.labels(reason="after_snapshot").inc()
            raise Refusal(grpc.StatusCode.INVALID_ARGUMENT,
                          f"timestamp {ts} is after read transaction {trans_id}'s snapshot "
                          f"{snapshot}; a read may look at its snapshot or earlier")
        return read

    def _live_read(self, trans_id: int) -> LiveRead:
        now = self._clock()
        with self._lock:
            until, read = self._live_until.get(trans_id, (0.0, None))
            if until > now and read is not None:
                return read
        status = self._lookup(trans_id)
        if not status.live:
            REFUSED.labels(reason="not_live").inc()
            raise Refusal(grpc.StatusCode.FAILED_PRECONDITION,
                          f"read transaction {trans_id} is no longer live; begin a new one")
        if not status.read_only:
            REFUSED.labels(reason="write_transaction").inc()
            raise Refusal(grpc.StatusCode.FAILED_PRECONDITION,
                          f"transaction {trans_id} is a write transaction, not a read")
        until = min(now + self._ttl_s, status.lease_expires_at_ms / 1000)
        read = LiveRead(status.timestamp, status.as_of)
        with self._lock:
            if len(self._live_until) > 10_000:  # ended transactions age out
                self._live_until = {t: v for t, v in self._live_until.items() if v[0] > now}
            self._live_until[trans_id] = (until, read)
        return read
