"""A small typed client of the TransServer's change-feed consumer RPCs (docs/change-feed.md).

A consumer registers by name at a cursor (every change committed at or below it was
delivered), commits its cursor forward as it delivers, and is dropped by name. While it
is registered, the TransServer keeps the changes above its cursor readable, until it lags
more than ``trans.max_consumer_lag_ms``. Refusals pass as ``grpc.RpcError``:
``changes_expired`` (refusal.py, :func:`retina_common.refusal.earliest_cursor` reads the
lowest cursor still accepted), NOT_FOUND for a consumer not (or no longer) registered.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from retina_common.pb import trans_pb2 as tpb
from retina_common.pb import trans_pb2_grpc


@dataclass(frozen=True)
class ConsumerState:
    name: str
    cursor_ts: int
    table: str
    created_ms: int
    renewed_ms: int
    lag_ms: int  # how long ago the high watermark passed the cursor (0: it has not)
    lag_commits: int  # write transactions committed above it (since the TransServer's start)

    @classmethod
    def from_pb(cls, c: tpb.Consumer) -> ConsumerState:
        return cls(c.name, c.cursor_ts, c.table, c.created_ms, c.renewed_ms, c.lag_ms,
                   c.lag_commits)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class ConsumerList:
    consumers: list[ConsumerState]
    max_consumer_lag_ms: int


class ConsumerClient:
    def __init__(self, trans: trans_pb2_grpc.TransServiceStub, timeout_s: float = 10.0) -> None:
        self._trans = trans
        self._timeout_s = timeout_s

    def high_watermark(self) -> int:
        return self._trans.GetHighWatermark(tpb.GetHighWatermarkRequest(),
                                            timeout=self._timeout_s).high_watermark

    def register(self, name: str, cursor_ts: int, table: str = "") -> ConsumerState:
        """Register at ``cursor_ts`` (the same name again: its record, unchanged)."""
        reply = self._trans.RegisterConsumer(tpb.RegisterConsumerRequest(
            name=name, cursor_ts=cursor_ts, table=table), timeout=self._timeout_s)
        return ConsumerState.from_pb(reply.consumer)

    def commit(self, name: str, cursor_ts: int) -> ConsumerState:
        """Move the cursor forward (the same cursor again renews it). UNAVAILABLE may have
        landed: retry the same call."""
        reply = self._trans.CommitConsumer(tpb.CommitConsumerRequest(
            name=name, cursor_ts=cursor_ts), timeout=self._timeout_s)
        return ConsumerState.from_pb(reply.consumer)

    def drop(self, name: str) -> bool:
        """False: no consumer of that name (nothing changed)."""
        return self._trans.DropConsumer(tpb.DropConsumerRequest(name=name),
                                        timeout=self._timeout_s).dropped

    def list(self) -> ConsumerList:
        reply = self._trans.ListConsumers(tpb.ListConsumersRequest(), timeout=self._timeout_s)
        return ConsumerList([ConsumerState.from_pb(c) for c in reply.consumers],
                            reply.max_consumer_lag_ms)
