"""RetinaWorkerService over gRPC: maps calls onto the node, the apply path and recovery.

Every RPC asks the lifecycle table (lifecycle.py, ``admit``) whether its kind
of request is admitted in the current phase; every failure is answered
through the one mapping of retina_common/refusal.py. Reads also refuse a
snapshot the node can no longer answer exactly (below the read floor MarkReady
set: ABORTED, begin a new query), answer only reads of a live read-only
transaction at or before its snapshot (read_guard.py), and raise the write
fence to their timestamp (write_fence.py), so every read at S returns the same
rows (SNAPSHOT_IS_IMMUTABLE). Ordinary writes pass the fence, recovery replays
do not. The Storage GC RPCs
(gc/rewrites.py) are admitted only while READY. AddVisibility (superseded by
CommitGcRewrite, which installs the new file's visibility itself) and
Register/UnregisterOffload (query offload) answer UNIMPLEMENTED.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from functools import partial
from typing import Any

import grpc
import pyarrow as pa
from prometheus_client import Counter, Histogram

from retina_common.log import get_logger
from retina_common.pb import retina_pb2 as pb
from retina_common.pb import retina_pb2_grpc as pb_grpc
from retina_common.refusal import Refusal, abort, status_of
from retina_server import change_feed
from retina_server.bulk_load import BulkLoads, LoadResult
from retina_server.change_feed import ChangeFeed
from retina_server.gc.gc_scheduler import GcScheduler
from retina_server.gc.lineage import Lineage, LineageRecord
from retina_server.gc.rewrites import StorageGc
from retina_server.gc.sweeper import PASSES, Sweeper, check_orphan_grace
from retina_server.lifecycle import LifecycleStateMachine, Request
from retina_server.node import RetinaNode
from retina_server.read_guard import ReadTransactionGuard
from retina_server.recovery import replay_admission
from retina_server.recovery.coordinator import RecoveryCoordinator
from retina_server.recovery.mark_ready import MarkReadyBarrier
from retina_server.recovery.registered_writers import RegisteredWriters
from retina_server.row_lookup import RowLookup
from retina_server.row_lookup import prepare as prepare_lookup
from retina_server.update_record import apply, prepare
from retina_server.visibility import bitmap_to_bytes

log = get_logger(component="retina_service")

APPLIED_ROWS = Counter("retina_applied_rows_total", "Rows applied by UpdateRecord", ["op"])
REFUSED = Counter("retina_update_refused_total", "UpdateRecord requests refused", ["code"])
APPLY_SECONDS = Histogram("retina_update_record_seconds", "UpdateRecord latency",
                          buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.5, 1))

MODES = {pb.VNODE: "VNODE", pb.NODE: "NODE"}
IPC_OPTIONS = pa.ipc.IpcWriteOptions()  # made once: the default reads the environment


class RetinaService(pb_grpc.RetinaWorkerServiceServicer):
    def __init__(self, node: RetinaNode, recovery: RecoveryCoordinator,
                 barrier: MarkReadyBarrier, machine: LifecycleStateMachine,
                 reads: ReadTransactionGuard, max_rows_per_request: int,
                 gc: StorageGc, scheduler: GcScheduler, sweeper: Sweeper,
                 lineage: Lineage, writers: RegisteredWriters, lookup: RowLookup,
                 feed: ChangeFeed, write_live_at: Callable[[int], bool],
                 loads: BulkLoads | None = None) -> None:
        self._node = node
        self._loads = loads
        self._write_live_at = write_live_at  # APPLIED_OR_LIVE (replay_admission.py)
        self._lookup = lookup
        self._feed = feed
        self._writers = writers
        self._gc = gc
        self._sweeper = sweeper
        self._lineage = lineage
        self._scheduler = scheduler
        self._recovery = recovery
        self._barrier = barrier
        self._machine = machine
        self._reads = reads
        self._max_rows = max_rows_per_request

    def _guard(self, context: grpc.ServicerContext, fn: Callable[[], Any],
               counted: bool = False) -> Any:
        try:
            return fn()
        except Exception as exc:
            code, _message = status_of(exc)
            if code == grpc.StatusCode.INTERNAL:  # a bug or an injected fault: say so
                log.error("rpc_internal_error", error=str(exc), error_type=type(exc).__name__)
            if counted:
                REFUSED.labels(code=code.name).inc()
            abort(context, exc)

    def _update(self, request: pb.UpdateRecordRequest) -> pb.UpdateRecordResponse:
        started = time.perf_counter()
        if request.HasField("recovery_replay_context"):
            response = self._replay(request)
        else:
            self._machine.admit(Request.WRITE)
            # Validation first: a malformed request is INVALID_ARGUMENT whoever sent it.
            updates = prepare(self._node, request, self._max_rows)
            self._writers.admit(request.writer_id)  # WRITES_HAVE_A_REPLAY_SOURCE
            self._node.check_writable()
            response = apply(self._node, updates, writer_id=request.writer_id,
                             base_rows=self._lookup)
        response.request_id = request.request_id
        APPLIED_ROWS.labels(op="delete").inc(response.deleted_rows)
        APPLIED_ROWS.labels(op="insert").inc(response.inserted_rows)
        APPLY_SECONDS.observe(time.perf_counter() - started)
        return response

    def _replay(self, request: pb.UpdateRecordRequest) -> pb.UpdateRecordResponse:
        """A recovery-replay write (replay_admission.py): admitted for this attempt,
        counted in flight, applied only at or above each scope's own start."""
        ctx = request.recovery_replay_context
        mode = MODES.get(ctx.replay_mode)
        with self._recovery.replay_request(ctx.recovery_attempt_token,
                                           ctx.checkpoint_id) as starts:
            if mode is None:
                raise Refusal(grpc.StatusCode.INVALID_ARGUMENT,
                              "replay_mode must be VNODE or NODE")
            updates = prepare(self._node, request, self._max_rows)
            admitted = replay_admission.to_apply(updates, starts, mode, self._node.refused,
                                                 self._node.applied, self._write_live_at)
            self._node.check_writable()
            if admitted.inexact_from is not None:  # read_history.py
                self._node.history.rebuilt_inexactly(admitted.inexact_from)
            return apply(self._node, admitted.apply, fenced=False,
                         writer_id=request.writer_id, base_rows=self._lookup)

    def _admit_read(self, ts: int, trans_id: int, snapshot_read: bool) -> int:
        """READY, a live read transaction whose snapshot is not below ``ts`` and that this
        node still answers after its restarts (read_history.py: the read floor applies to
        ``ts`` too for a ``snapshot_read``, GetWriteBuffer); then
        LATE_WRITES_FENCED at ``ts`` (and every write admitted at or below it has
        finished). Returns the transaction's snapshot."""
        self._machine.admit(Request.READ)
        read = self._reads.check(trans_id, ts)
        self._node.history.check(read.timestamp, ts if snapshot_read else None, trans_id,
                                 read.as_of)
        self._node.fence.raise_to(ts, f"read transaction {trans_id} at {ts}")
        return read.timestamp

    def UpdateRecord(self, request: pb.UpdateRecordRequest,
                     context: grpc.ServicerContext) -> pb.UpdateRecordResponse:
        return self._guard(context, lambda: self._update(request), counted=True)

    def StreamUpdateRecord(self, request_iterator: Iterator[pb.UpdateRecordRequest],
                           context: grpc.ServicerContext) -> Iterator[pb.UpdateRecordResponse]:
        for request in request_iterator:
            yield self._guard(context, partial(self._update, request), counted=True)

    def GetWriteBuffer(self, request: pb.GetWriteBufferRequest,
                       context: grpc.ServicerContext) -> pb.GetWriteBufferResponse:
        def run() -> pb.GetWriteBufferResponse:
            snapshot = self._admit_read(request.timestamp, request.trans_id,
                                        snapshot_read=True)
            table = self._node.table(request.schema_name, request.table_name)
            rows = self._node.write_buffer_rows(table, request.timestamp,
                                                reader=(request.trans_id, snapshot))
            sink = pa.BufferOutputStream()
            with pa.ipc.new_stream(sink, rows.schema) as writer:
                writer.write_table(rows)
            return pb.GetWriteBufferResponse(arrow_ipc_stream=sink.getvalue().to_pybytes(),
                                             row_count=rows.num_rows)
        return self._guard(context, run)

    def LookupRows(self, request: pb.LookupRowsRequest,
                   context: grpc.ServicerContext) -> pb.LookupRowsResponse:
        def run() -> pb.LookupRowsResponse:
            self._machine.admit(Request.READ)
            # Validation before the read is admitted: a malformed request changes nothing
            # (admitting raises the write fence).
            lookup = prepare_lookup(self._node, request, self._max_rows)
            self._admit_read(request.timestamp, request.trans_id, snapshot_read=True)
            answer = self._lookup.lookup(lookup)
            # An answer read while the node stopped being READY (it failed closed) is
            # not given: its structures may be half-way through a change.
            self._machine.admit(Request.READ)
            sink = pa.BufferOutputStream()
            with pa.ipc.new_stream(sink, answer.rows.schema, options=IPC_OPTIONS) as writer:
                writer.write_table(answer.rows)
            return pb.LookupRowsResponse(
                found=answer.found.tolist(), commit_ts=answer.commit_ts.tolist(),
                rows_arrow=sink.getvalue().to_pybytes(), timestamp=request.timestamp)
        return self._guard(context, run)

    def ReadChanges(self, request: pb.ReadChangesRequest,
                    context: grpc.ServicerContext) -> Iterator[pb.ReadChangesResponse]:
        def run() -> tuple[pa.Table, int]:
            self._machine.admit(Request.READ)
            # Validation before the read is admitted (admitting raises the write fence).
            changes = change_feed.prepare(self._node, request)
            self._admit_changes(request)
            table = self._feed.read(changes)
            self._machine.admit(Request.READ)  # not READY any more: not answered
            return table, changes.page_changes

        table, page_changes = self._guard(context, run)
        for page, through in change_feed.pages(table, page_changes, request.to_ts):
            sink = pa.BufferOutputStream()
            with pa.ipc.new_stream(sink, page.schema, options=IPC_OPTIONS) as writer:
                writer.write_table(page)
            yield pb.ReadChangesResponse(changes_arrow=sink.getvalue().to_pybytes(),
                                         change_count=page.num_rows, through_ts=through)

    def _admit_changes(self, request: pb.ReadChangesRequest) -> None:
        """A live read transaction whose snapshot is at or after ``to_ts``, another whose
        snapshot is at or below ``from_ts + 1`` holding the range (FEED_READS_ABOVE_BASE), a
        range whose history this node has exactly (read_history.py); then
        LATE_WRITES_FENCED at ``to_ts``."""
        read = self._reads.check(request.trans_id, request.to_ts)
        if request.hold_trans_id <= 0:
            raise Refusal(grpc.StatusCode.INVALID_ARGUMENT,
                          "hold_trans_id: a live read transaction whose snapshot is at or "
                          "below from_ts must hold the range's history while it is read")
        hold = self._reads.check(request.hold_trans_id)
        # A live snapshot h keeps safeGcTs at or below h - 1 (SAFE_GC_BELOW_READERS), so an
        # AS OF transaction at from_ts + 1 holds every delete above from_ts.
        if hold.timestamp > request.from_ts + 1:
            raise Refusal(grpc.StatusCode.INVALID_ARGUMENT,
                          f"hold transaction {request.hold_trans_id}'s snapshot "
                          f"{hold.timestamp} is above from_ts + 1 = {request.from_ts + 1}: "
                          "it does not hold the range's history")
        self._node.history.check(read.timestamp, None, request.trans_id, read.as_of)
        self._node.history.check_changes(request.from_ts, request.to_ts)
        self._node.fence.raise_to(request.to_ts, f"read transaction {request.trans_id} "
                                                 f"reading changes to {request.to_ts}")

    def QueryVisibility(self, request: pb.QueryVisibilityRequest,
                        context: grpc.ServicerContext) -> pb.QueryVisibilityResponse:
        def run() -> pb.QueryVisibilityResponse:
            self._admit_read(request.timestamp, request.trans_id, snapshot_read=False)
            groups = self._node.query_visibility(request.file_id, list(request.rg_ids),
                                                 request.timestamp)
            return pb.QueryVisibilityResponse(
                file_id=request.file_id,
                first_block_id=self._node.stream_position(request.file_id),
                gc_hold=self._gc.hold_of(request.file_id) if request.want_gc_hold else "",
                row_groups=[
                pb.RowGroupVisibility(rg_id=rg, row_count=count,
                                      deleted_bitmap=bitmap_to_bytes(bits, count))
                for rg, count, bits in groups])
        return self._guard(context, run)

    def GetRetinaStatus(self, request: pb.GetRetinaStatusRequest,
                        context: grpc.ServicerContext) -> pb.GetRetinaStatusResponse:
        s = self._recovery.status()
        return pb.GetRetinaStatusResponse(
            state=pb.LifecycleState.Value(str(s["state"])),
            recovery_attempt_token=str(s["token"]), checkpoint_id=int(s["checkpoint_id"]),
            recovery_epoch=int(s["recovery_epoch"]), replay_ts_ready=bool(s["replay_ts_ready"]),
            node_id=self._node.node_id, phase=str(s["phase"]),
            failure_reason=str(s["failure_reason"]), accepts_columnar=True, accepts_partial=True,
            rebuilt_history=[pb.RebuiltHistory(from_ts=a, to_ts=b)
                             for a, b in self._node.history.gaps()],
            **self._checkpoint_status())

    def _checkpoint_status(self) -> dict[str, int]:
        last = self._recovery.last_checkpoint
        starts = self._recovery.attempt.starts
        return {
            "last_checkpoint_id": last.checkpoint_id if last else 0,
            "last_checkpoint_applied_ts": last.checkpoint_applied_ts if last else 0,
            "last_checkpoint_write_time_ms": self._recovery.last_checkpoint_write_time_ms,
            "node_replay_from_ts": starts.node_replay_from_ts if starts else -1}

    def GetRecoveryReplayTs(self, request: pb.GetRecoveryReplayTsRequest,
                            context: grpc.ServicerContext) -> pb.GetRecoveryReplayTsResponse:
        def run() -> pb.GetRecoveryReplayTsResponse:
            self._machine.admit(Request.REPLAY_TS)
            self._recovery.check_attempt(request.recovery_attempt_token, request.checkpoint_id)
            if MODES.get(request.replay_mode) is None:
                raise Refusal(grpc.StatusCode.INVALID_ARGUMENT, "replay_mode must be VNODE or NODE")
            starts = self._recovery.starts
            return pb.GetRecoveryReplayTsResponse(
                replay_mode=request.replay_mode, checkpoint_id=request.checkpoint_id,
                checkpoint_applied_ts=starts.checkpoint_applied_ts,
                vnode_replay_from_ts=starts.vnode_replay_from_ts,
                node_replay_from_ts=starts.node_replay_from_ts,
                scopes=[pb.ScopeReplayTs(
                    table_id=s.table_id, virtual_node_id=s.vnode,
                    scope_replay_from_ts=s.scope_replay_from_ts,
                    earliest_unsafe_insert_ts=s.earliest_unsafe_insert_ts)
                    for s in starts.scopes])
        return self._guard(context, run)

    def MarkReady(self, request: pb.MarkReadyRequest,
                  context: grpc.ServicerContext) -> pb.MarkReadyResponse:
        def run() -> pb.MarkReadyResponse:
            self._barrier.mark_ready(request.recovery_attempt_token, request.checkpoint_id,
                                     request.replayed_writers)
            return pb.MarkReadyResponse(state=pb.READY)
        return self._guard(context, run)

    def CreateCheckpoint(self, request: pb.CreateCheckpointRequest,
                         context: grpc.ServicerContext) -> pb.CreateCheckpointResponse:
        def run() -> pb.CreateCheckpointResponse:
            pointer = self._recovery.create_checkpoint()
            return pb.CreateCheckpointResponse(
                checkpoint_id=pointer.checkpoint_id,
                checkpoint_applied_ts=pointer.checkpoint_applied_ts, body_length=pointer.length)
        return self._guard(context, run)

    # --- Storage GC ------------------------------------------------------------------------
    def PrepareGcRewrite(self, request: pb.PrepareGcRewriteRequest,
                         context: grpc.ServicerContext) -> pb.PrepareGcRewriteResponse:
        def run() -> pb.PrepareGcRewriteResponse:
            self._machine.admit(Request.GC)
            self._reads.check(request.trans_id)
            p = self._gc.prepare(request.schema_name, request.table_name,
                                 request.virtual_node_id, list(request.old_file_ids),
                                 request.safe_gc_ts, request.trans_id)
            return pb.PrepareGcRewriteResponse(
                rewrite_id=p.rewrite_id, file_name=p.file_name, path_id=p.stream.path_id,
                path_uri=p.stream.path_uri, cutoff_ts=p.cutoff, expires_at_ms=p.expires_at_ms,
                expected_rows=p.expected_rows, schema_version=p.table.schema_version)
        return self._guard(context, run)

    def CommitGcRewrite(self, request: pb.CommitGcRewriteRequest,
                        context: grpc.ServicerContext) -> pb.CommitGcRewriteResponse:
        def run() -> pb.CommitGcRewriteResponse:
            self._machine.admit(Request.GC)
            r = self._gc.commit(request.rewrite_id, request.new_file_id)
            return pb.CommitGcRewriteResponse(
                rewrite_id=r.rewrite_id, outcome=r.outcome, new_file_id=r.new_file_id,
                retired_file_ids=list(r.retired_file_ids), rows_kept=r.rows_kept,
                rows_dropped=r.rows_dropped, chain_items=r.chain_items,
                journal_state=r.journal_state)
        return self._guard(context, run)

    def AbortGcRewrite(self, request: pb.AbortGcRewriteRequest,
                       context: grpc.ServicerContext) -> pb.AbortGcRewriteResponse:
        def run() -> pb.AbortGcRewriteResponse:
            self._machine.admit(Request.GC)
            self._gc.abort(request.rewrite_id)
            return pb.AbortGcRewriteResponse()
        return self._guard(context, run)

    # --- Bulk load (bulk_load.py) ------------------------------------------------------------
    def _bulk_loads(self) -> BulkLoads:
        self._machine.admit(Request.WRITE)
        if self._loads is None:
            raise Refusal(grpc.StatusCode.UNIMPLEMENTED, "bulk load is not wired on this node")
        return self._loads

    def PrepareBulkLoad(self, request: pb.PrepareBulkLoadRequest,
                        context: grpc.ServicerContext) -> pb.PrepareBulkLoadResponse:
        def run() -> pb.PrepareBulkLoadResponse:
            p = self._bulk_loads().prepare(request.schema_name, request.table_name,
                                           request.timestamp, list(request.virtual_node_ids),
                                           request.load_id)
            if isinstance(p, LoadResult):  # a loader's load id that committed already
                return pb.PrepareBulkLoadResponse(load_id=p.load_id, committed_ts=p.ts)
            return pb.PrepareBulkLoadResponse(
                load_id=p.load_id, path_uri=p.path_uri, expires_at_ms=p.expires_at_ms,
                files=[pb.BulkLoadFile(virtual_node_id=f.vnode, file_id=f.file_id,
                                       file_name=f.name) for f in p.files])
        return self._guard(context, run)

    def CommitBulkLoad(self, request: pb.CommitBulkLoadRequest,
                       context: grpc.ServicerContext) -> pb.CommitBulkLoadResponse:
        def run() -> pb.CommitBulkLoadResponse:
            r = self._bulk_loads().commit(request.load_id, request.timestamp)
            APPLIED_ROWS.labels(op="load").inc(r.rows)
            return pb.CommitBulkLoadResponse(load_id=r.load_id, timestamp=r.ts, rows=r.rows,
                                             file_ids=list(r.file_ids))
        return self._guard(context, run, counted=True)

    def AbortBulkLoad(self, request: pb.AbortBulkLoadRequest,
                      context: grpc.ServicerContext) -> pb.AbortBulkLoadResponse:
        def run() -> pb.AbortBulkLoadResponse:
            self._bulk_loads().abort(request.load_id)
            return pb.AbortBulkLoadResponse()
        return self._guard(context, run)

    def GetGcStatus(self, request: pb.GetGcStatusRequest,
                    context: grpc.ServicerContext) -> pb.GetGcStatusResponse:
        def run() -> pb.GetGcStatusResponse:
            entries = [pb.GcJournalEntry(
                rewrite_id=e.rewrite_id, state=e.state.value, table_id=e.table_id,
                virtual_node_id=e.vnode, new_file_id=e.new_file_id,
                old_file_ids=e.old_file_ids, cutoff_ts=e.cutoff_ts, rows_kept=e.rows_kept,
                created_at_ms=e.created_at_ms, updated_at_ms=e.updated_at_ms, reason=e.reason)
                for e in self._gc.journal.entries()]
            floor = self._gc.gc_floor(drop_orphaned=False)
            status = self._scheduler.status()
            return pb.GetGcStatusResponse(
                entries=entries, pending_rewrites=self._gc.pending_count(),
                fold_floor_ts=-1 if floor is None else floor,
                last_fold_ts=int(status.get("last_fold_ts") or 0),
                last_prune_horizon_ts=int(status.get("last_prune_horizon_ts") or 0))
        return self._guard(context, run)

    def RunGcMaintenance(self, request: pb.RunGcMaintenanceRequest,
                         context: grpc.ServicerContext) -> pb.RunGcMaintenanceResponse:
        def run() -> pb.RunGcMaintenanceResponse:
            self._machine.admit(Request.GC)
            r = self._scheduler.run_once()
            if r.skipped in ("safe_gc_ts_unavailable", "floor_unavailable"):
                raise Refusal(grpc.StatusCode.UNAVAILABLE,
                              f"maintenance skipped: {r.skipped}; retry")
            return pb.RunGcMaintenanceResponse(
                folded_items=r.folded_items, pruned_versions=r.pruned_versions,
                fold_ts=r.fold_ts, prune_horizon_ts=r.prune_horizon_ts)
        return self._guard(context, run)

    # --- Sweepers, lineage and revert ------------------------------------------------------
    def RunSweeper(self, request: pb.RunSweeperRequest,
                   context: grpc.ServicerContext) -> pb.RunSweeperResponse:
        def run() -> pb.RunSweeperResponse:
            self._machine.admit(Request.GC)
            unknown = sorted(set(request.passes) - set(PASSES))
            if unknown:
                raise Refusal(grpc.StatusCode.INVALID_ARGUMENT,
                              f"unknown sweeper passes {unknown}; known: {list(PASSES)}")
            if request.orphan_grace_ms:  # 0: the configured retina.orphan_grace_ms
                try:
                    check_orphan_grace(request.orphan_grace_ms)
                except ValueError as exc:
                    raise Refusal(grpc.StatusCode.INVALID_ARGUMENT,
                                  f"orphan_grace_ms: {exc}") from exc
            swept = self._sweeper.run(list(request.passes), request.dry_run,
                                      request.orphan_grace_ms or None)
            removed = [s for s in swept if s.action == "removed"]
            return pb.RunSweeperResponse(
                objects=[pb.SweptObject(pass_name=s.pass_name, file_id=s.file_id, name=s.name,
                                        path_uri=s.path_uri, action=s.action, reason=s.reason,
                                        bytes=s.bytes) for s in swept],
                removed=len(removed), bytes_removed=sum(s.bytes for s in removed),
                held=sum(s.action == "held" for s in swept))
        return self._guard(context, run)

    def ListGcLineage(self, request: pb.ListGcLineageRequest,
                      context: grpc.ServicerContext) -> pb.ListGcLineageResponse:
        def run() -> pb.ListGcLineageResponse:
            return pb.ListGcLineageResponse(
                records=[_lineage_record(r) for r in self._lineage.records()])
        return self._guard(context, run)

    def RevertGcRewrite(self, request: pb.RevertGcRewriteRequest,
                        context: grpc.ServicerContext) -> pb.RevertGcRewriteResponse:
        def run() -> pb.RevertGcRewriteResponse:
            self._machine.admit(Request.GC)
            if not request.rewrite_id:
                raise Refusal(grpc.StatusCode.INVALID_ARGUMENT, "rewrite_id is required")
            return pb.RevertGcRewriteResponse(
                record=_lineage_record(self._lineage.revert(request.rewrite_id)))
        return self._guard(context, run)


def _lineage_record(r: LineageRecord) -> pb.GcLineageRecord:
    e = r.entry
    return pb.GcLineageRecord(
        rewrite_id=e.rewrite_id, status=r.status.value, journal_state=e.state.value,
        schema_name=e.schema_name, table_name=e.table_name, virtual_node_id=e.vnode,
        new_file_id=e.new_file_id, old_file_ids=e.old_file_ids, cutoff_ts=e.cutoff_ts,
        created_at_ms=e.created_at_ms, completed_at_ms=e.completed_at_ms,
        reverted_at_ms=e.reverted_at_ms, revertible=r.revertible,
        not_revertible_reason=r.not_revertible_reason, reason=e.reason)
