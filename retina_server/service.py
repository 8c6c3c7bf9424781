"""RetinaWorkerService over gRPC: maps calls onto the node and the UpdateRecord apply path.

Built here: UpdateRecord, StreamUpdateRecord, QueryVisibility, GetWriteBuffer,
AddWriteBuffer. The lifecycle and recovery RPCs (GetRetinaStatus,
GetRecoveryReplayTs, MarkReady, CreateCheckpoint), AddVisibility and
Register/UnregisterOffload answer UNIMPLEMENTED until their server side exists.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any, NoReturn

import grpc
import pyarrow as pa
from prometheus_client import Counter, Histogram

from retina_common.catalog import CatalogError, CatalogUnavailable, NotFoundError
from retina_common.log import get_logger
from retina_common.pb import retina_pb2 as pb
from retina_common.pb import retina_pb2_grpc as pb_grpc
from retina_server.index import IndexBackendError
from retina_server.node import NodeFailedClosed, RetinaNode
from retina_server.update_record import ApplyError, apply, prepare
from retina_server.visibility import VisibilityError, bitmap_to_bytes

log = get_logger(component="retina_service")

APPLIED_ROWS = Counter("retina_applied_rows_total", "Rows applied by UpdateRecord", ["op"])
REFUSED = Counter("retina_update_refused_total", "UpdateRecord requests refused", ["code"])
APPLY_SECONDS = Histogram("retina_update_record_seconds", "UpdateRecord latency",
                          buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.5, 1))


def _abort(context: grpc.ServicerContext, code: grpc.StatusCode, message: str) -> NoReturn:
    context.abort(code, message)
    raise AssertionError("unreachable")


class RetinaService(pb_grpc.RetinaWorkerServiceServicer):
    def __init__(self, node: RetinaNode, max_rows_per_request: int) -> None:
        self._node = node
        self._max_rows = max_rows_per_request

    def _guard(self, context: grpc.ServicerContext, fn: Callable[[], Any]) -> Any:
        try:
            return fn()
        except ApplyError as exc:
            REFUSED.labels(code=exc.code).inc()
            _abort(context, grpc.StatusCode[exc.code], str(exc))
        except NodeFailedClosed as exc:
            REFUSED.labels(code="FAILED_PRECONDITION").inc()
            _abort(context, grpc.StatusCode.FAILED_PRECONDITION, str(exc))
        except (CatalogUnavailable, IndexBackendError) as exc:
            REFUSED.labels(code="UNAVAILABLE").inc()
            _abort(context, grpc.StatusCode.UNAVAILABLE, str(exc))
        except NotFoundError as exc:
            _abort(context, grpc.StatusCode.NOT_FOUND, str(exc))
        except VisibilityError as exc:
            _abort(context, grpc.StatusCode.NOT_FOUND, str(exc))
        except CatalogError as exc:
            log.error("catalog_error", error=str(exc))
            _abort(context, grpc.StatusCode.INTERNAL, str(exc))
        except Exception as exc:  # a bug or an injected fault: fail closed, say so
            log.error("rpc_internal_error", error=str(exc), error_type=type(exc).__name__)
            _abort(context, grpc.StatusCode.INTERNAL, f"{type(exc).__name__}: {exc}")

    def _update(self, request: pb.UpdateRecordRequest) -> pb.UpdateRecordResponse:
        started = time.perf_counter()
        self._node.check_writable()
        if request.HasField("recovery_replay_context"):
            raise ApplyError("FAILED_PRECONDITION",
                             "no recovery attempt is in progress on this node")
        response = apply(self._node, prepare(self._node, request, self._max_rows))
        response.request_id = request.request_id
        APPLIED_ROWS.labels(op="delete").inc(response.deleted_rows)
        APPLIED_ROWS.labels(op="insert").inc(response.inserted_rows)
        APPLY_SECONDS.observe(time.perf_counter() - started)
        return response

    def UpdateRecord(self, request: pb.UpdateRecordRequest,
                     context: grpc.ServicerContext) -> pb.UpdateRecordResponse:
        return self._guard(context, lambda: self._update(request))

    def StreamUpdateRecord(self, request_iterator: Iterator[pb.UpdateRecordRequest],
                           context: grpc.ServicerContext) -> Iterator[pb.UpdateRecordResponse]:
        for request in request_iterator:
            yield self._guard(context, lambda r=request: self._update(r))

    def GetWriteBuffer(self, request: pb.GetWriteBufferRequest,
                       context: grpc.ServicerContext) -> pb.GetWriteBufferResponse:
        def run() -> pb.GetWriteBufferResponse:
            table = self._node.table(request.schema_name, request.table_name)
            rows = self._node.write_buffer_rows(table, request.timestamp)
            sink = pa.BufferOutputStream()
            with pa.ipc.new_stream(sink, rows.schema) as writer:
                writer.write_table(rows)
            return pb.GetWriteBufferResponse(arrow_ipc_stream=sink.getvalue().to_pybytes(),
                                             row_count=rows.num_rows)
        return self._guard(context, run)

    def QueryVisibility(self, request: pb.QueryVisibilityRequest,
                        context: grpc.ServicerContext) -> pb.QueryVisibilityResponse:
        def run() -> pb.QueryVisibilityResponse:
            groups = self._node.query_visibility(request.file_id, list(request.rg_ids),
                                                 request.timestamp)
            return pb.QueryVisibilityResponse(file_id=request.file_id, row_groups=[
                pb.RowGroupVisibility(rg_id=rg, row_count=count,
                                      deleted_bitmap=bitmap_to_bytes(bits, count))
                for rg, count, bits in groups])
        return self._guard(context, run)

    def AddWriteBuffer(self, request: pb.AddWriteBufferRequest,
                       context: grpc.ServicerContext) -> pb.AddWriteBufferResponse:
        def run() -> pb.AddWriteBufferResponse:
            table = self._node.table(request.schema_name, request.table_name)
            for vnode in sorted(self._node.owned_vnodes):
                self._node.stream(table, vnode)
            return pb.AddWriteBufferResponse()
        return self._guard(context, run)
