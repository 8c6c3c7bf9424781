"""The recovery protocol end to end: real Retina processes, SIGKILL and failpoint crashes,
replay from the reported starts, MarkReady, and the query gate."""

from __future__ import annotations

import random
import subprocess
import sys
from collections.abc import Callable
from decimal import Decimal
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from retina_common import failpoints
from retina_common.catalog import Catalog, FileType
from retina_common.etcd import EtcdStore
from retina_common.keys import checkpoint_slot_key, lifecycle_key
from retina_common.lifecycle_record import LifecycleRecord
from retina_common.pb import retina_pb2 as rpb
from retina_common.topology import Topology

from .dataplane import SCHEMA, DataPlane
from .support import ROOT, delete_prefix, eventually, rpc_error

pytestmark = pytest.mark.integration


def order(i: int, note: str = "") -> dict:
    return {"id": i, "customer": f"c{i % 5}", "amount": Decimal(i) / 4, "note": note or None}


def lifecycle_state(etcd: EtcdStore, node: str) -> str | None:
    kv = etcd.get(lifecycle_key(node))
    return None if kv is None else LifecycleRecord.parse(node, kv.value).state.value


def health(node: str) -> int:
    with grpc.insecure_channel(node) as channel:
        return health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(), timeout=5).status


def workload(plane: DataPlane, rng: random.Random, steps: int, start_id: int) -> int:
    """Mixed inserts, deletes and replaces over both tables; returns the next free id."""
    next_id = start_id
    for step in range(steps):
        live = sorted(plane.model.rows["orders"].values(), key=lambda r: r["id"])
        picked = rng.sample(live, min(len(live), rng.randint(0, 6)))
        changes: dict = {"orders": {
            "inserts": [order(next_id + i) for i in range(rng.randint(1, 12))],
            "deletes": [{"id": r["id"]} for r in picked[: len(picked) // 2]],
            "replaces": [order(r["id"], f"s{step}") for r in picked[len(picked) // 2:]],
        }}
        next_id += len(changes["orders"]["inserts"])
        if rng.random() < 0.5:
            changes["events"] = {"replaces": [{"tenant": next_id % 3, "seq": next_id + j,
                                               "payload": b"x", "ok": True} for j in range(3)]}
        plane.commit(changes)
    return next_id


def crash_after_checkpoint(plane: DataPlane, seed: int, steps: int = 10) -> str:
    """Workload, checkpoint, more workload, SIGKILL, restart: returns the node."""
    node = plane.nodes[0]
    workload(plane, random.Random(seed), steps, 0)
    plane.checkpoint(node)
    workload(plane, random.Random(seed + 1), steps, 10_000)
    plane.retinas[node].kill9()
    plane.retinas[node].start()
    return node


def open_attempt(plane: DataPlane, node: str
                 ) -> tuple[rpb.GetRetinaStatusResponse, rpb.GetRecoveryReplayTsResponse,
                            rpb.RecoveryReplayContext]:
    """GetRetinaStatus and GetRecoveryReplayTs (VNODE) of the node's recovery attempt."""
    status = plane.wait_replay_ready(node)
    starts = plane.retinas[node].stub.GetRecoveryReplayTs(rpb.GetRecoveryReplayTsRequest(
        recovery_attempt_token=status.recovery_attempt_token,
        checkpoint_id=status.checkpoint_id, replay_mode=rpb.VNODE))
    context = rpb.RecoveryReplayContext(recovery_attempt_token=status.recovery_attempt_token,
                                        checkpoint_id=status.checkpoint_id, replay_mode=rpb.VNODE)
    return status, starts, context


# --- a fresh node and the MarkReady barrier ------------------------------------------------------
def test_a_fresh_node_is_recovering_until_mark_ready(make_plane: Callable[..., DataPlane],
                                                     etcd: EtcdStore) -> None:
    plane = make_plane(recover=False)
    node = plane.nodes[0]
    stub = plane.retinas[node].stub
    status = plane.wait_replay_ready(node)
    assert (status.state, status.phase, status.checkpoint_id) == (rpb.RECOVERING,
                                                                  "AWAITING_REPLAY", 0)
    assert status.replay_ts_ready and len(status.recovery_attempt_token) >= 32
    assert lifecycle_state(etcd, node) == "RECOVERING"
    assert health(node) == health_pb2.HealthCheckResponse.NOT_SERVING
    assert not plane.gate_open()
    # Nothing but replay and recovery RPCs is served while RECOVERING.
    write = plane.writers["orders"].updates(10**9, inserts=[order(1)])
    request = rpb.UpdateRecordRequest(schema_name=SCHEMA, table_update_data=write[node])
    assert rpc_error(lambda: stub.UpdateRecord(request)).code() == grpc.StatusCode.UNAVAILABLE
    for call in (lambda: stub.GetWriteBuffer(rpb.GetWriteBufferRequest(
                     schema_name=SCHEMA, table_name="orders", timestamp=1)),
                 lambda: stub.QueryVisibility(rpb.QueryVisibilityRequest(file_id=1)),
                 lambda: stub.CreateCheckpoint(rpb.CreateCheckpointRequest())):
        assert rpc_error(call).code() == grpc.StatusCode.UNAVAILABLE
    token, cp = status.recovery_attempt_token, status.checkpoint_id
    for bad in (rpb.MarkReadyRequest(recovery_attempt_token="x" * 43, checkpoint_id=cp),
                rpb.MarkReadyRequest(recovery_attempt_token=token, checkpoint_id=cp + 1)):
        assert rpc_error(lambda b=bad: stub.MarkReady(b)).code() == \
            grpc.StatusCode.FAILED_PRECONDITION
    assert rpc_error(lambda: stub.GetRecoveryReplayTs(rpb.GetRecoveryReplayTsRequest(
        recovery_attempt_token="nope", checkpoint_id=cp, replay_mode=rpb.VNODE))).code() == \
        grpc.StatusCode.FAILED_PRECONDITION
    assert plane.status(node).state == rpb.RECOVERING  # refusals changed nothing
    stub.MarkReady(rpb.MarkReadyRequest(recovery_attempt_token=token, checkpoint_id=cp))
    assert plane.status(node).state == rpb.READY
    eventually(plane.gate_open, 15, "the gate to admit after MarkReady")
    assert lifecycle_state(etcd, node) == "READY"
    assert health(node) == health_pb2.HealthCheckResponse.SERVING
    stub.MarkReady(rpb.MarkReadyRequest(recovery_attempt_token=token, checkpoint_id=cp))
    assert rpc_error(lambda: stub.MarkReady(rpb.MarkReadyRequest(
        recovery_attempt_token="another-token", checkpoint_id=cp))).code() == \
        grpc.StatusCode.FAILED_PRECONDITION
    assert token not in plane.retinas[node].log_path.read_text()  # only its hash is logged


def test_writes_before_cleansing_completes_are_refused(
        make_plane: Callable[..., DataPlane], failpoint_dir: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(failpoints.DIR_VAR, str(failpoint_dir))
    plane = make_plane(failpoints="recovery.cleansing.before=block", recover=False)
    node = plane.nodes[0]
    stub = plane.retinas[node].stub
    failpoints.wait_hit(failpoint_dir, "recovery.cleansing.before")
    status = plane.status(node)
    assert status.phase == "LOADING_CHECKPOINT"
    assert not status.replay_ts_ready and status.recovery_attempt_token == ""
    write = plane.writers["orders"].updates(10**9, replaces=[order(1)])
    request = rpb.UpdateRecordRequest(schema_name=SCHEMA, table_update_data=write[node])
    assert rpc_error(lambda: stub.UpdateRecord(request)).code() == grpc.StatusCode.UNAVAILABLE
    request.recovery_replay_context.recovery_attempt_token = "guess"
    request.recovery_replay_context.replay_mode = rpb.VNODE
    assert rpc_error(lambda: stub.UpdateRecord(request)).code() == \
        grpc.StatusCode.FAILED_PRECONDITION
    assert rpc_error(lambda: stub.MarkReady(rpb.MarkReadyRequest(
        recovery_attempt_token="guess"))).code() == grpc.StatusCode.UNAVAILABLE
    failpoints.release(failpoint_dir, "recovery.cleansing.before")
    plane.recover(node)
    assert plane.read("orders") == {}


# --- crash, replay, MarkReady ---------------------------------------------------------------------
@pytest.mark.parametrize("seed", [1, 2, 3])
@pytest.mark.parametrize("mode", [rpb.VNODE, rpb.NODE], ids=["VNODE", "NODE"])
def test_recovery_equals_a_run_that_never_crashed(make_plane: Callable[..., DataPlane],
                                                  catalog: Catalog, mode: int,
                                                  seed: int) -> None:
    plane = make_plane(nodes=2)
    rng = random.Random(1000 * seed + mode)
    next_id = workload(plane, rng, 25, 0)
    eventually(lambda: len(catalog.get_files_by_type(None, [FileType.REGULAR])) >= 2, 20,
               "files published before the checkpoint")
    for node in plane.nodes:
        plane.checkpoint(node)
    next_id = workload(plane, rng, 25, next_id)  # files published after the checkpoint too
    eventually(lambda: len(catalog.get_files_by_type(None, [FileType.REGULAR])) >= 4, 20,
               "files published after the checkpoint")
    workload(plane, rng, 5, next_id)  # and rows still in write buffers
    victim = plane.nodes[0]
    plane.retinas[victim].kill9()
    plane.retinas[victim].start()
    assert plane.status(victim).state == rpb.RECOVERING
    eventually(lambda: not plane.gate_open(), 15, "queries refused while RECOVERING")
    starts = plane.recover(victim, mode)
    assert starts is not None and starts.checkpoint_id > 0
    assert 0 < starts.node_replay_from_ts <= starts.checkpoint_applied_ts
    eventually(plane.gate_open, 15, "the gate to admit")
    for table in ("orders", "events"):
        assert plane.read(table) == plane.model.rows[table]


def test_replay_protocol_violations_change_nothing(make_plane: Callable[..., DataPlane]) -> None:
    plane = make_plane()
    node = crash_after_checkpoint(plane, 5)
    _status, starts, good = open_attempt(plane, node)
    stub = plane.retinas[node].stub
    vnode = plane.topology.vnodes_of(node)[0]
    start = starts.vnode_replay_from_ts[vnode]
    key_row = next(order(i) for i in range(10**6, 10**7)
                   if plane.topology.vnode_of_key(plane.writers["orders"].key({"id": i})) == vnode)

    def request(ts: int, **ops) -> rpb.UpdateRecordRequest:
        datas = plane.writers["orders"].updates(ts, **ops)[node]
        return rpb.UpdateRecordRequest(schema_name=SCHEMA, table_update_data=datas)

    cases = []
    r = request(start, replaces=[key_row])
    r.recovery_replay_context.CopyFrom(good)
    r.recovery_replay_context.recovery_attempt_token = "stale"
    cases.append(r)
    r = request(start, replaces=[key_row])
    r.recovery_replay_context.CopyFrom(good)
    r.recovery_replay_context.checkpoint_id += 1
    cases.append(r)
    r = request(start, inserts=[key_row])  # standalone INSERT
    r.recovery_replay_context.CopyFrom(good)
    cases.append(r)
    if start > 1:
        r = request(start - 1, replaces=[key_row])  # below the replay start
        r.recovery_replay_context.CopyFrom(good)
        cases.append(r)
    for bad in cases:
        assert rpc_error(lambda b=bad: stub.UpdateRecord(b)).code() == \
            grpc.StatusCode.FAILED_PRECONDITION
    plain = request(start, replaces=[key_row])  # an ordinary write while RECOVERING
    assert rpc_error(lambda: stub.UpdateRecord(plain)).code() == grpc.StatusCode.UNAVAILABLE
    plane.recover(node)
    assert plane.read("orders") == plane.model.rows["orders"]  # no refused write landed


def test_a_second_crash_during_recovery_recovers_again(
        make_plane: Callable[..., DataPlane]) -> None:
    plane = make_plane()
    node = crash_after_checkpoint(plane, 9, steps=12)
    status, starts, context = open_attempt(plane, node)
    stub = plane.retinas[node].stub
    requests = plane.replay_requests(node, starts, rpb.VNODE, context)
    for request in requests[: len(requests) // 2]:  # half the replay, then a crash
        stub.UpdateRecord(request)
    plane.retinas[node].kill9()
    plane.retinas[node].start()
    again = plane.wait_replay_ready(node)
    assert again.state == rpb.RECOVERING
    assert again.recovery_attempt_token != status.recovery_attempt_token
    assert again.recovery_epoch > status.recovery_epoch
    plane.recover(node)
    assert plane.read("orders") == plane.model.rows["orders"]


# --- checkpoints: crashes and damage ---
@pytest.mark.parametrize("point, swapped", [
    ("checkpoint.body_write.before", False), ("checkpoint.body_write.after", False),
    ("checkpoint.pointer_swap.before", False), ("checkpoint.pointer_swap.after", True),
    ("checkpoint.cleanup.before", True),
])
def test_a_crash_at_each_checkpoint_failpoint_leaves_a_usable_checkpoint(
        make_plane: Callable[..., DataPlane], point: str, swapped: bool) -> None:
    # Hit 1 is the checkpoint taken on READY; hit 2 the explicit one below; hit 3 dies.
    plane = make_plane(failpoints=f"{point}=exit(137)@3")
    node = plane.nodes[0]
    workload(plane, random.Random(11), 10, 0)
    kept = plane.checkpoint(node).checkpoint_id
    workload(plane, random.Random(12), 10, 10_000)
    with pytest.raises(grpc.RpcError):
        plane.checkpoint(node)
    assert plane.retinas[node].wait_exit() == 137
    plane.retinas[node].start()
    # Before the swap the previous checkpoint is current; after it, the new one.
    assert plane.wait_replay_ready(node).checkpoint_id == (kept + 1 if swapped else kept)
    plane.recover(node)
    assert plane.read("orders") == plane.model.rows["orders"]


def _body(plane: DataPlane, etcd: EtcdStore, node: str, slot: str) -> Path:
    from retina_common.checkpoint_store import Pointer

    pointer = Pointer.parse(etcd.get(checkpoint_slot_key(node, slot)).value)
    return Path(pointer.path.removeprefix("file://"))


def test_damaged_checkpoints_fall_back_or_fail_closed(make_plane: Callable[..., DataPlane],
                                                      etcd: EtcdStore) -> None:
    plane = make_plane()
    node = plane.nodes[0]
    workload(plane, random.Random(13), 8, 0)
    first = plane.checkpoint(node).checkpoint_id
    workload(plane, random.Random(14), 8, 10_000)
    plane.checkpoint(node)
    workload(plane, random.Random(15), 4, 20_000)
    plane.retinas[node].kill9()
    current = _body(plane, etcd, node, "current")
    data = bytearray(current.read_bytes())
    data[len(data) // 2] ^= 0x10  # a bit flip
    current.write_bytes(bytes(data))
    plane.retinas[node].start()
    status = plane.wait_replay_ready(node)
    assert status.state == rpb.RECOVERING and status.checkpoint_id == first
    plane.recover(node)
    assert plane.read("orders") == plane.model.rows["orders"]
    # Now both slots are damaged: the node fails closed and says why.
    plane.retinas[node].kill9()
    for slot in ("current", "previous"):
        body = _body(plane, etcd, node, slot)
        body.write_bytes(body.read_bytes()[:-7])  # truncated
    plane.retinas[node].start()
    failed = eventually(lambda: (s := plane.status(node)).state == rpb.FAILED and s, 30,
                        "the node to fail closed")
    assert "checkpoint" in failed.failure_reason
    eventually(lambda: lifecycle_state(etcd, node) == "FAILED", 10, "FAILED in etcd")
    eventually(lambda: not plane.gate_open(), 15, "the gate to refuse a FAILED node")


def test_no_checkpoint_but_regular_files_fails_closed(make_plane: Callable[..., DataPlane],
                                                      etcd: EtcdStore, catalog: Catalog) -> None:
    plane = make_plane()
    node = plane.nodes[0]
    workload(plane, random.Random(16), 10, 0)
    eventually(lambda: catalog.get_files_by_type(None, [FileType.REGULAR]), 20, "a publish")
    plane.retinas[node].kill9()
    delete_prefix(etcd, "/pixels/retina/recovery/checkpoint/")
    plane.retinas[node].start()
    failed = eventually(lambda: (s := plane.status(node)).state == rpb.FAILED and s, 30,
                        "the node to fail closed")
    assert "no checkpoint" in failed.failure_reason


# --- process shell ------------------------------------------------------------------------------
def test_unbuilt_rpcs_answer_unimplemented(make_plane: Callable[..., DataPlane]) -> None:
    plane = make_plane()
    stub = plane.retinas[plane.nodes[0]].stub
    for call in (lambda: stub.AddVisibility(rpb.AddVisibilityRequest(), timeout=5),
                 lambda: stub.RegisterOffload(rpb.RegisterOffloadRequest(), timeout=5),
                 lambda: stub.UnregisterOffload(rpb.UnregisterOffloadRequest(), timeout=5)):
        assert rpc_error(call).code() == grpc.StatusCode.UNIMPLEMENTED


def test_a_node_outside_the_topology_refuses_to_start(tmp_path: Path) -> None:
    (tmp_path / "topology.toml").write_text(Topology(("127.0.0.1:1",), 4).to_toml())
    config = tmp_path / "retina.toml"
    config.write_text('[retina]\nlisten = "127.0.0.1:2"\n')
    result = subprocess.run([sys.executable, "-m", "retina_server", "--config", str(config)],
                            cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and "is not in the topology" in result.stderr


@pytest.mark.parametrize("point", ["recovery.cleansing.after", "recovery.mark_ready.barrier.after"])
def test_a_crash_inside_recovery_recovers_again(make_plane: Callable[..., DataPlane],
                                                point: str) -> None:
    plane = make_plane()
    node = plane.nodes[0]
    workload(plane, random.Random(17), 10, 0)
    plane.checkpoint(node)
    workload(plane, random.Random(18), 8, 10_000)
    retina = plane.retinas[node]
    retina.kill9()
    in_barrier = point == "recovery.mark_ready.barrier.after"
    retina.start(failpoints=f"{point}=exit(137)", wait=in_barrier)
    if in_barrier:
        with pytest.raises(grpc.RpcError):
            plane.recover(node)  # the process dies inside the barrier
    assert retina.wait_exit() == 137
    retina.start()
    plane.recover(node)
    assert plane.read("orders") == plane.model.rows["orders"]


def test_a_crash_before_any_later_checkpoint_recovers(
        make_plane: Callable[..., DataPlane]) -> None:
    # The only checkpoint is the one taken on READY, when nothing had been written
    # yet (HWM 0): recovery must still work from it.
    plane = make_plane()
    node = plane.nodes[0]
    workload(plane, random.Random(21), 8, 0)
    plane.retinas[node].kill9()
    plane.retinas[node].start()
    status = plane.wait_replay_ready(node)
    assert status.state == rpb.RECOVERING, status.failure_reason
    plane.recover(node)
    assert plane.read("orders") == plane.model.rows["orders"]


def test_checkpoint_without_a_transserver_is_unavailable(
        make_plane: Callable[..., DataPlane]) -> None:
    plane = make_plane()
    plane.trans.stop()
    err = rpc_error(lambda: plane.checkpoint(plane.nodes[0]))
    assert err.code() == grpc.StatusCode.UNAVAILABLE and "TransServer" in err.details()
