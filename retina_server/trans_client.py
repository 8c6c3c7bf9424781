"""What a Retina node asks the TransServer, in one client.

Every call maps a failed RPC to Refusal(UNAVAILABLE) ("a dependency is down: retry"),
never to INTERNAL: the node's callers (checkpoints, the GC scheduler, the read guard,
the sweepers, MarkReady) retry or refuse their own request with it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import grpc

from retina_common.pb import trans_pb2 as pb
from retina_common.pb import trans_pb2_grpc as pb_grpc
from retina_common.refusal import Refusal
from retina_server.gc.sweeper import ReaderHolds
from retina_server.read_guard import TransStatus

T = TypeVar("T")
TIMEOUT_S = 10.0
# The lease of the transaction MarkReady begins and ends at once: short, so that a node
# killed between the two holds the HWM back for moments only.
FRESH_LEASE_MS = 2000


class TransClient:
    def __init__(self, stub: pb_grpc.TransServiceStub) -> None:
        self._stub = stub

    @staticmethod
    def _call(fn: Callable[[], T]) -> T:
        try:
            return fn()
        except grpc.RpcError as exc:
            raise Refusal(grpc.StatusCode.UNAVAILABLE,
                          f"TransServer unreachable: {exc.code().name}") from exc

    def high_watermark(self) -> int:
        return self._call(lambda: self._stub.GetHighWatermark(
            pb.GetHighWatermarkRequest(), timeout=TIMEOUT_S).high_watermark)

    def safe_gc_ts(self) -> int:
        return self._call(lambda: self._stub.GetSafeGcTimestamp(
            pb.GetSafeGcTimestampRequest(), timeout=TIMEOUT_S).safe_gc_ts)

    def trans_status(self, trans_id: int) -> TransStatus:
        reply = self._call(lambda: self._stub.GetTransStatus(
            pb.GetTransStatusRequest(trans_id=trans_id), timeout=TIMEOUT_S))
        return TransStatus(reply.live, reply.read_only, reply.lease_expires_at_ms,
                           reply.timestamp, reply.as_of)

    def trans_live(self, trans_id: int) -> bool:
        """Whether the transaction is live (not ended, its lease not run out)."""
        return self.trans_status(trans_id).live

    def write_live_at(self, ts: int) -> bool:
        """Whether the write transaction with timestamp ``ts`` is live (not ended): then no
        snapshot at or above ``ts`` has been granted yet (HWM_PREFIX). Recovery replay
        asks it for a timestamp its applied-writes log does not hold (applied_writes.py)."""
        return self._call(lambda: self._stub.GetTransStatus(
            pb.GetTransStatusRequest(timestamp=ts), timeout=TIMEOUT_S)).live

    def read_holds(self) -> ReaderHolds:
        reply = self._call(lambda: self._stub.GetReadHolds(pb.GetReadHoldsRequest(),
                                                           timeout=TIMEOUT_S))
        return ReaderHolds(frozenset(reply.file_ids), reply.listings_in_flight)

    def fresh_timestamp(self) -> tuple[int, int, int]:
        """A write timestamp X issued now, whose transaction is ended at once, the HWM
        after it ended, and its transaction id (every transaction begun before this call
        has a smaller id). Every snapshot granted before this call is below X."""
        began = self._call(lambda: self._stub.BeginTrans(
            pb.BeginTransRequest(read_only=False, lease_ms=FRESH_LEASE_MS),
            timeout=TIMEOUT_S))
        try:
            hwm = self._stub.CommitTrans(pb.CommitTransRequest(trans_id=began.trans_id),
                                         timeout=TIMEOUT_S).high_watermark
        except grpc.RpcError as exc:
            if exc.code() != grpc.StatusCode.FAILED_PRECONDITION:
                raise Refusal(grpc.StatusCode.UNAVAILABLE,
                              f"TransServer unreachable: {exc.code().name}") from exc
            hwm = self.high_watermark()  # its lease ran out first: ended all the same
        return began.timestamp, hwm, began.trans_id
