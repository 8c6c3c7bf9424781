"""TransService over gRPC: maps calls onto the transaction table, the gate and the catalog.

Every RPC runs inside :meth:`TransService._guard`, so every failure, a refusal of ours, a
catalog or etcd error, or a bug, is answered through the one mapping of
retina_common/refusal.py, with the status a Retina node gives the same condition.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import grpc
from prometheus_client import Counter, Gauge, Histogram

from retina_common.catalog import Catalog, CatalogError
from retina_common.log import get_logger
from retina_common.pb import trans_pb2 as pb
from retina_common.pb import trans_pb2_grpc as pb_grpc
from retina_common.refusal import Refusal, abort, status_of
from trans_gate.as_of import AsOfPoints
from trans_gate.consumers import Consumer, Consumers, Lag
from trans_gate.gate import GateDecision, QueryAvailabilityGate
from trans_gate.pins import Pin, Pins
from trans_gate.time_map import TimeMap
from trans_gate.timestamps import CounterFenced
from trans_gate.transactions import Transaction, TransactionTable, TransKind

log = get_logger(component="trans_service")

BEGIN_TOTAL = Counter("trans_begin_total", "Transactions begun", ["kind"])
END_TOTAL = Counter("trans_end_total", "Transactions ended", ["kind", "outcome"])
GATE_REFUSALS = Counter("trans_gate_refusals_total",
                        "Read-only transactions refused by the query gate", ["reason"])
GATE_DECISION_SECONDS = Histogram(
    "trans_gate_decision_seconds", "Time to decide a read-only BeginTrans at the gate",
    buckets=(0.00002, 0.00005, 0.0001, 0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01))
HWM_GAUGE = Gauge("trans_high_watermark", "Current high watermark")
LIST_FILES_TOTAL = Counter("trans_list_query_files_total", "ListQueryFiles calls", ["outcome"])
AS_OF_TOTAL = Counter("trans_as_of_begin_total", "AS OF read transactions asked for",
                      ["outcome"])
# The ListQueryFiles outcome label of a catalog failure, by the status it answers.
_CATALOG_OUTCOMES = {grpc.StatusCode.NOT_FOUND: "not_found",
                     grpc.StatusCode.UNAVAILABLE: "catalog_unavailable"}


class TransService(pb_grpc.TransServiceServicer):
    def __init__(self, table: TransactionTable, gate: QueryAvailabilityGate, catalog: Catalog,
                 on_fenced: Callable[[], None], *, as_of: AsOfPoints, pins: Pins,
                 consumers: Consumers, time_map: TimeMap, history_retention_ms: int) -> None:
        self._table = table
        self._gate = gate
        self._catalog = catalog
        self._on_fenced = on_fenced
        self._as_of = as_of
        self._pins = pins
        self._consumers = consumers
        self._time_map = time_map
        self._retention_ms = history_retention_ms

    # --- helpers ---------------------------------------------------------------------
    def _guard(self, context: grpc.ServicerContext, fn: Callable[[], Any]) -> Any:
        """``fn()``, the body of an RPC; any failure answers with its status (refusal.py)."""
        try:
            return fn()
        except CounterFenced as exc:
            self._on_fenced()
            abort(context, Refusal(grpc.StatusCode.UNAVAILABLE,
                                   f"this TransServer was fenced by another instance: {exc}"))
        except Exception as exc:
            code, _message = status_of(exc)
            if code == grpc.StatusCode.INTERNAL:  # a bug or an injected fault: say so
                log.error("rpc_internal_error", error=str(exc), error_type=type(exc).__name__)
            abort(context, exc)

    def _gate_check(self) -> GateDecision:
        started = time.perf_counter()
        decision = self._gate.check()
        GATE_DECISION_SECONDS.observe(time.perf_counter() - started)
        if not decision.admitted:
            for reason in {str(r) for r in decision.refusal_reasons.values()} or {"watch"}:
                GATE_REFUSALS.labels(reason=reason).inc()
            raise Refusal(grpc.StatusCode.UNAVAILABLE, decision.message)
        return decision

    def _begin(self, read_only: bool, count: int, lease_ms: int) -> list[Transaction]:
        kind = TransKind.READ if read_only else TransKind.WRITE
        if read_only:
            self._gate_check()
        created = self._table.begin(kind, count, lease_ms)
        BEGIN_TOTAL.labels(kind=kind.value).inc(len(created))
        return created

    @staticmethod
    def _response(trans: Transaction) -> pb.BeginTransResponse:
        return pb.BeginTransResponse(trans_id=trans.trans_id, timestamp=trans.timestamp,
                                     lease_expires_at_ms=trans.lease_expires_at_ms)

    def _commit(self, trans_ids: list[int]) -> int:
        hwm = self._table.commit(trans_ids)
        END_TOTAL.labels(kind="any", outcome="committed").inc(len(trans_ids))
        HWM_GAUGE.set(hwm)
        return hwm

    def _rollback(self, trans_id: int) -> int:
        hwm = self._table.rollback(trans_id)
        END_TOTAL.labels(kind="any", outcome="rolled_back").inc()
        HWM_GAUGE.set(hwm)
        return hwm

    # --- RPCs -----------------------------------------------------------------------------
    def BeginTrans(self, request: pb.BeginTransRequest,
                   context: grpc.ServicerContext) -> pb.BeginTransResponse:
        def run() -> pb.BeginTransResponse:
            point = self._as_of.of_begin(request.read_only, request.as_of_ts,
                                         request.as_of_time_ms, request.as_of_pin)
            if point is None:
                (trans,) = self._begin(request.read_only, 1, request.lease_ms)
            else:
                trans = self._begin_as_of(point, request.lease_ms)
            return self._response(trans)
        return self._guard(context, run)

    def _begin_as_of(self, ts: int, lease_ms: int) -> Transaction:
        """A read at a past snapshot: gated like any read, admitted only if still readable."""
        self._gate_check()
        try:
            trans = self._table.begin_as_of(ts, lease_ms)
        except Exception:
            AS_OF_TOTAL.labels(outcome="refused").inc()
            raise
        AS_OF_TOTAL.labels(outcome="begun").inc()
        BEGIN_TOTAL.labels(kind=TransKind.READ.value).inc()
        return trans

    def BeginTransBatch(self, request: pb.BeginTransBatchRequest,
                        context: grpc.ServicerContext) -> pb.BeginTransBatchResponse:
        def run() -> pb.BeginTransBatchResponse:
            created = self._begin(request.read_only, request.count, request.lease_ms)
            return pb.BeginTransBatchResponse(transactions=[self._response(t) for t in created])
        return self._guard(context, run)

    def CommitTrans(self, request: pb.CommitTransRequest,
                    context: grpc.ServicerContext) -> pb.CommitTransResponse:
        return self._guard(context, lambda: pb.CommitTransResponse(
            high_watermark=self._commit([request.trans_id])))

    def CommitTransBatch(self, request: pb.CommitTransBatchRequest,
                         context: grpc.ServicerContext) -> pb.CommitTransBatchResponse:
        return self._guard(context, lambda: pb.CommitTransBatchResponse(
            high_watermark=self._commit(list(request.trans_ids))))

    def RollbackTrans(self, request: pb.RollbackTransRequest,
                      context: grpc.ServicerContext) -> pb.RollbackTransResponse:
        return self._guard(context, lambda: pb.RollbackTransResponse(
            high_watermark=self._rollback(request.trans_id)))

    def ExtendTransLease(self, request: pb.ExtendTransLeaseRequest,
                         context: grpc.ServicerContext) -> pb.ExtendTransLeaseResponse:
        return self._guard(context, lambda: pb.ExtendTransLeaseResponse(
            lease_expires_at_ms=self._table.extend_lease(request.trans_id, request.lease_ms)))

    def MarkTransOffloaded(self, request: pb.MarkTransOffloadedRequest,
                           context: grpc.ServicerContext) -> pb.MarkTransOffloadedResponse:
        def run() -> pb.MarkTransOffloadedResponse:
            self._table.mark_offloaded(request.trans_id)
            return pb.MarkTransOffloadedResponse()
        return self._guard(context, run)

    def GetHighWatermark(self, request: pb.GetHighWatermarkRequest,
                         context: grpc.ServicerContext) -> pb.GetHighWatermarkResponse:
        return self._guard(context, lambda: pb.GetHighWatermarkResponse(
            high_watermark=self._table.high_watermark()))

    def GetSafeGcTimestamp(self, request: pb.GetSafeGcTimestampRequest,
                           context: grpc.ServicerContext) -> pb.GetSafeGcTimestampResponse:
        return self._guard(context, lambda: pb.GetSafeGcTimestampResponse(
            safe_gc_ts=self._table.safe_gc_ts()))

    def GetTransStatus(self, request: pb.GetTransStatusRequest,
                       context: grpc.ServicerContext) -> pb.GetTransStatusResponse:
        def run() -> pb.GetTransStatusResponse:
            trans = self._table.status(request.trans_id)
            if trans is None:
                return pb.GetTransStatusResponse(live=False)
            return pb.GetTransStatusResponse(live=True, read_only=trans.kind == TransKind.READ,
                                             timestamp=trans.timestamp,
                                             lease_expires_at_ms=trans.lease_expires_at_ms,
                                             as_of=trans.as_of)
        return self._guard(context, run)

    def ListQueryFiles(self, request: pb.ListQueryFilesRequest,
                       context: grpc.ServicerContext) -> pb.ListQueryFilesResponse:
        return self._guard(context, lambda: self._list_query_files(request))

    def _list_query_files(self, request: pb.ListQueryFilesRequest) -> pb.ListQueryFilesResponse:
        """REGULAR files of a table, only for a live read-only transaction, and only
        while the gate is still open (a node that left READY closes planning too)."""
        if not request.schema_name or not request.table_name:
            LIST_FILES_TOTAL.labels(outcome="invalid").inc()
            raise Refusal(grpc.StatusCode.INVALID_ARGUMENT,
                          "schema_name and table_name are required")
        try:
            trans = self._table.live_read(request.trans_id)
        except Exception:
            LIST_FILES_TOTAL.labels(outcome="refused").inc()
            raise
        decision = self._gate.check()
        if not decision.admitted:
            LIST_FILES_TOTAL.labels(outcome="gate_closed").inc()
            raise Refusal(grpc.StatusCode.UNAVAILABLE, decision.message)
        # LISTED_FILES_HELD: in flight from before the catalog read until the files
        # are recorded on the transaction, so no sweeper removes one in between.
        self._table.listing_started(request.trans_id)
        files: list[pb.QueryFile] = []
        try:
            return self._list_files(request, trans.timestamp, files)
        finally:
            self._table.listing_done(request.trans_id, [f.file_id for f in files])

    def _list_files(self, request: pb.ListQueryFilesRequest, snapshot_ts: int,
                    files: list[pb.QueryFile]) -> pb.ListQueryFilesResponse:
        try:
            table = self._catalog.get_table(request.schema_name, request.table_name)
            for path in self._catalog.get_paths(table.table_id):
                for f in self._catalog.get_regular_files(path.path_id):
                    files.append(pb.QueryFile(
                        file_id=f.file_id, name=f.name, path_id=path.path_id, path_uri=path.uri,
                        num_row_group=f.num_row_group, min_row_id=f.min_row_id or 0,
                        max_row_id=f.max_row_id or 0))
        except CatalogError as exc:
            code, _message = status_of(exc)
            LIST_FILES_TOTAL.labels(outcome=_CATALOG_OUTCOMES.get(code, "catalog_error")).inc()
            raise
        LIST_FILES_TOTAL.labels(outcome="ok").inc()
        return pb.ListQueryFilesResponse(snapshot_ts=snapshot_ts, files=files)

    def GetReadHolds(self, request: pb.GetReadHoldsRequest,
                     context: grpc.ServicerContext) -> pb.GetReadHoldsResponse:
        def run() -> pb.GetReadHoldsResponse:
            holds = self._table.read_holds()
            return pb.GetReadHoldsResponse(
                file_ids=sorted(holds.file_ids), listings_in_flight=holds.listings_in_flight,
                live_read_transactions=holds.live_reads,
                oldest_read_snapshot_ts=-1 if holds.oldest_snapshot_ts is None
                else holds.oldest_snapshot_ts)
        return self._guard(context, run)

    def GetQueryGateStatus(self, request: pb.GetQueryGateStatusRequest,
                           context: grpc.ServicerContext) -> pb.GetQueryGateStatusResponse:
        def run() -> pb.GetQueryGateStatusResponse:
            # The decision itself, not a re-derivation: an operator sees what BeginTrans sees.
            snapshot = self._gate.snapshot
            decision = self._gate.check(snapshot)
            return pb.GetQueryGateStatusResponse(
                admitted=decision.admitted, message=decision.message,
                nodes={n: str(a) for n, a in decision.nodes.items()},
                watch_healthy=snapshot.watch_healthy, revision=snapshot.revision)
        return self._guard(context, run)

    # --- history (docs/history.md) ----------------------------------------------------------
    @staticmethod
    def _pin(pin: Pin) -> pb.Pin:
        return pb.Pin(name=pin.name, ts=pin.ts, created_ms=pin.created_ms,
                      at_time_ms=pin.at_time_ms)

    def CreatePin(self, request: pb.CreatePinRequest,
                  context: grpc.ServicerContext) -> pb.CreatePinResponse:
        def run() -> pb.CreatePinResponse:
            ts = self._as_of.of_point(request.ts, request.at_time_ms)
            return pb.CreatePinResponse(pin=self._pin(
                self._pins.create(request.name, ts, request.at_time_ms)))
        return self._guard(context, run)

    def DropPin(self, request: pb.DropPinRequest,
                context: grpc.ServicerContext) -> pb.DropPinResponse:
        return self._guard(context, lambda: pb.DropPinResponse(
            dropped=self._pins.drop(request.name)))

    def ListPins(self, request: pb.ListPinsRequest,
                 context: grpc.ServicerContext) -> pb.ListPinsResponse:
        return self._guard(context, lambda: pb.ListPinsResponse(
            pins=[self._pin(p) for p in self._pins.all()]))

    def GetHistoryStatus(self, request: pb.GetHistoryStatusRequest,
                         context: grpc.ServicerContext) -> pb.GetHistoryStatusResponse:
        def run() -> pb.GetHistoryStatusResponse:
            horizon = self._table.horizon()
            return pb.GetHistoryStatusResponse(
                horizon_ts=horizon, earliest_readable_ts=horizon + 1,
                earliest_readable_time_ms=self._time_map.earliest_time_at_or_above(horizon + 1),
                high_watermark=self._table.high_watermark(),
                history_retention_ms=self._retention_ms, pins=len(self._pins.all()),
                time_gaps=[pb.TimeGap(from_ms=a, to_ms=b) for a, b in self._time_map.gaps()],
                time_map_from_ms=self._time_map.first_ms(),
                next_safe_gc_ts=self._table.peek_safe_gc_ts())
        return self._guard(context, run)

    # --- change-feed consumers (docs/change-feed.md) ----------------------------------------
    @staticmethod
    def _consumer(consumer: Consumer, lag: Lag | None = None) -> pb.Consumer:
        return pb.Consumer(name=consumer.name, cursor_ts=consumer.cursor_ts,
                           table=consumer.table, created_ms=consumer.created_ms,
                           renewed_ms=consumer.renewed_ms, lag_ms=lag.ms if lag else 0,
                           lag_commits=lag.commits if lag else 0)

    def _answer(self, consumer: Consumer) -> pb.Consumer:
        return self._consumer(consumer, self._consumers.lag(consumer))

    def RegisterConsumer(self, request: pb.RegisterConsumerRequest,
                         context: grpc.ServicerContext) -> pb.RegisterConsumerResponse:
        return self._guard(context, lambda: pb.RegisterConsumerResponse(
            consumer=self._answer(self._consumers.register(
                request.name, request.cursor_ts, request.table))))

    def CommitConsumer(self, request: pb.CommitConsumerRequest,
                       context: grpc.ServicerContext) -> pb.CommitConsumerResponse:
        return self._guard(context, lambda: pb.CommitConsumerResponse(
            consumer=self._answer(self._consumers.commit(request.name, request.cursor_ts))))

    def DropConsumer(self, request: pb.DropConsumerRequest,
                     context: grpc.ServicerContext) -> pb.DropConsumerResponse:
        return self._guard(context, lambda: pb.DropConsumerResponse(
            dropped=self._consumers.drop(request.name)))

    def ListConsumers(self, request: pb.ListConsumersRequest,
                      context: grpc.ServicerContext) -> pb.ListConsumersResponse:
        return self._guard(context, lambda: pb.ListConsumersResponse(
            consumers=[self._consumer(c, lag) for c, lag in self._consumers.all()],
            max_consumer_lag_ms=self._consumers.max_lag_ms))
