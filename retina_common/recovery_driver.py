"""Driving a Retina node through recovery, as the CDC side does (specification section 6).

``drive_recovery``: GetRetinaStatus until the replay starts are ready →
GetRecoveryReplayTs (VNODE or NODE mode) → replay from those starts,
inclusive, DELETE + INSERT only, with the RecoveryReplayContext → MarkReady.
A fresh node goes through exactly the same steps, with nothing to replay.

``replay_requests`` turns an in-memory changelog into one node's replay
requests (tests and benchmarks). The CDC connector feeds the same driver
from its durable changelog (``cdc_client/connector.py``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import grpc

from retina_common.client import TableWriter, requests_by_node
from retina_common.pb import retina_pb2 as pb
from retina_common.pb import retina_pb2_grpc, trans_pb2, trans_pb2_grpc

# One committed source transaction: (timestamp, {table: {"deletes"|"inserts"|"replaces": rows}})
ChangelogEntry = tuple[int, Mapping[str, Mapping[str, Iterable[Mapping[str, Any]]]]]


class RecoveryFailed(Exception):
    """The node is FAILED; the reason is the node's own."""


def wait_replay_ready(stub: retina_pb2_grpc.RetinaWorkerServiceStub,
                      timeout_s: float = 60) -> pb.GetRetinaStatusResponse:
    deadline = time.monotonic() + timeout_s
    while True:
        status = stub.GetRetinaStatus(pb.GetRetinaStatusRequest(), timeout=10)
        if status.replay_ts_ready or status.state in (pb.READY, pb.FAILED):
            return status
        if time.monotonic() > deadline:
            raise TimeoutError(f"{status.node_id} did not derive its replay starts "
                               f"within {timeout_s}s (phase {status.phase})")
        time.sleep(0.05)


# How long a driver waits, after MarkReady, for the query gate to see the node READY.
GATE_WAIT_S = 15.0


def await_gate_ready(trans: trans_pb2_grpc.TransServiceStub, nodes: Iterable[str],
                     wait_s: float = GATE_WAIT_S, rpc_timeout_s: float = 10
                     ) -> dict[str, str]:
    """MarkReady has answered; the TransServer's query gate learns READY through its etcd
    watch a moment later and refuses reads (UNAVAILABLE) until then. Wait for it, so a
    query run right after a recovery is admitted. Returns what the gate still says of
    each node it does not see READY by ``wait_s`` (empty: all seen; a node the gate
    does not watch counts as seen)."""
    deadline = time.monotonic() + wait_s
    pending = set(nodes)
    seen: dict[str, str] = {}
    while pending:
        try:
            status = trans.GetQueryGateStatus(trans_pb2.GetQueryGateStatusRequest(),
                                              timeout=rpc_timeout_s)
            seen = dict(status.nodes)
            pending = {n for n in pending if seen.get(n, "READY") != "READY"}
        except grpc.RpcError as exc:
            seen = {n: f"unknown (TransServer {exc.code().name})" for n in pending}
        if not pending or time.monotonic() >= deadline:
            break
        time.sleep(0.05)  # polling interval, bounded by the deadline
    return {n: seen.get(n, "unknown") for n in sorted(pending)}


def replay_requests(node: str, schema: str, writers: Mapping[str, TableWriter],
                    changelog: Iterable[ChangelogEntry], starts: pb.GetRecoveryReplayTsResponse,
                    context: pb.RecoveryReplayContext) -> Iterator[pb.UpdateRecordRequest]:
    """The changelog from the replay starts as ``node``'s replay requests: every
    insert and replace as DELETE + INSERT, every delete as DELETE, every partial update
    as itself."""
    for ts, changes in changelog:
        per_table = [writers[t].updates(
            ts, deletes=ops.get("deletes", ()),
            replaces=[*ops.get("inserts", ()), *ops.get("replaces", ())],
            partials=ops.get("partials", ()))
            for t, ops in changes.items()]
        request = requests_by_node(schema, per_table).get(node)
        if request is None:
            continue
        keep = [tud for tud in request.table_update_data if tud.timestamp >= (
            starts.node_replay_from_ts if context.replay_mode == pb.NODE
            else starts.vnode_replay_from_ts[tud.virtual_node_id])]
        if keep:
            del request.table_update_data[:]
            request.table_update_data.extend(keep)
            request.recovery_replay_context.CopyFrom(context)
            yield request


def drive_recovery(stub: retina_pb2_grpc.RetinaWorkerServiceStub, *,
                   replay: Callable[[pb.GetRecoveryReplayTsResponse, pb.RecoveryReplayContext],
                                    Iterable[pb.UpdateRecordRequest]] | None = None,
                   mode: pb.ReplayMode = pb.VNODE, timeout_s: float = 60,
                   replayed_writers: Sequence[str] | Callable[[], Sequence[str]] = ()
                   ) -> pb.GetRecoveryReplayTsResponse | None:
    """Take one node from RECOVERING to READY; returns the replay starts used
    (None if it was READY already). ``replayed_writers``: the replay sources whose
    changelogs ``replay`` sent (EVERY_SOURCE_REPLAYED; a callable is asked once the
    replay is done, when the driver knows which it read)."""
    status = wait_replay_ready(stub, timeout_s)
    if status.state == pb.READY:
        return None
    if status.state == pb.FAILED:
        raise RecoveryFailed(f"{status.node_id}: {status.failure_reason}")
    token, checkpoint_id = status.recovery_attempt_token, status.checkpoint_id
    starts = stub.GetRecoveryReplayTs(pb.GetRecoveryReplayTsRequest(
        recovery_attempt_token=token, checkpoint_id=checkpoint_id, replay_mode=mode), timeout=10)
    context = pb.RecoveryReplayContext(recovery_attempt_token=token,
                                       checkpoint_id=checkpoint_id, replay_mode=mode)
    for request in (replay(starts, context) if replay else ()):
        stub.UpdateRecord(request, timeout=60)
    writers = replayed_writers() if callable(replayed_writers) else replayed_writers
    stub.MarkReady(pb.MarkReadyRequest(recovery_attempt_token=token,
                                       checkpoint_id=checkpoint_id,
                                       replayed_writers=list(writers)), timeout=timeout_s)
    return starts
