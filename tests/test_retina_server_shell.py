"""The Retina server process shell and the RetinaWorkerService contract (spec section 6)."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from retina_common.cluster import free_port, grpc_serving
from retina_common.etcd import EtcdStore
from retina_common.keys import LIFECYCLE_PREFIX
from retina_common.pb import retina_pb2 as rpb
from retina_common.pb import retina_pb2_grpc
from retina_common.topology import Topology

from .support import ROOT, eventually, rpc_error


def fields(message: type) -> set[str]:
    return set(message.DESCRIPTOR.fields_by_name)


def test_proto_carries_every_field_of_the_recovery_protocol() -> None:
    assert set(rpb.LifecycleState.keys()) >= {"RECOVERING", "READY", "FAILED"}
    assert set(rpb.ReplayMode.keys()) >= {"VNODE", "NODE"}
    assert fields(rpb.RecoveryReplayContext) == {"recovery_attempt_token", "checkpoint_id",
                                                 "replay_mode"}
    assert "recovery_replay_context" in fields(rpb.UpdateRecordRequest)
    assert {"state", "recovery_attempt_token", "checkpoint_id", "recovery_epoch",
            "replay_ts_ready"} <= fields(rpb.GetRetinaStatusResponse)
    assert {"recovery_attempt_token", "checkpoint_id", "replay_mode"} <= fields(
        rpb.GetRecoveryReplayTsRequest)
    assert {"vnode_replay_from_ts", "node_replay_from_ts"} <= fields(
        rpb.GetRecoveryReplayTsResponse)
    assert fields(rpb.MarkReadyRequest) == {"recovery_attempt_token", "checkpoint_id"}
    assert {"timestamp", "virtual_node_id", "delete_data", "insert_data"} <= fields(
        rpb.TableUpdateData)
    assert "timestamp" in fields(rpb.IndexKey)
    service = rpb.DESCRIPTOR.services_by_name["RetinaWorkerService"]
    assert {m.name for m in service.methods} >= {
        "UpdateRecord", "StreamUpdateRecord", "GetRetinaStatus", "GetRecoveryReplayTs",
        "MarkReady", "QueryVisibility", "GetWriteBuffer", "AddWriteBuffer", "AddVisibility",
        "RegisterOffload", "UnregisterOffload"}


@pytest.fixture
def retina(tmp_path: Path, etcd: EtcdStore, catalog_dsn: str) -> Iterator[str]:
    node = f"127.0.0.1:{free_port()}"
    (tmp_path / "topology.toml").write_text(Topology((node, "127.0.0.1:1"), 4).to_toml())
    config = tmp_path / "retina.toml"
    config.write_text(f'[retina]\nlisten = "{node}"\nmetrics_listen = "off"\n'
                      f'state_dir = "{tmp_path / "state"}"\n'
                      f'[storage]\nroot = "{tmp_path / "storage"}"\n'
                      f'[catalog]\ndsn = "{catalog_dsn}"\n'
                      f'[etcd]\nendpoints = ["{etcd.endpoint}"]\n')
    proc = subprocess.Popen([sys.executable, "-m", "retina_server", "--config", str(config)],
                            cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        eventually(lambda: grpc_serving(node) is False, 30, "the Retina server to answer health")
        yield node
    finally:
        proc.terminate()
        proc.wait(timeout=15)


def test_unbuilt_rpcs_answer_unimplemented_and_health_is_not_serving(
        retina: str, etcd: EtcdStore) -> None:
    with grpc.insecure_channel(retina) as channel:
        stub = retina_pb2_grpc.RetinaWorkerServiceStub(channel)
        for call in (lambda: stub.GetRetinaStatus(rpb.GetRetinaStatusRequest(), timeout=5),
                     lambda: stub.GetRecoveryReplayTs(rpb.GetRecoveryReplayTsRequest(), timeout=5),
                     lambda: stub.MarkReady(rpb.MarkReadyRequest(), timeout=5),
                     lambda: stub.AddVisibility(rpb.AddVisibilityRequest(), timeout=5)):
            assert rpc_error(call).code() == grpc.StatusCode.UNIMPLEMENTED
        health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest())
        assert health.status == health_pb2.HealthCheckResponse.NOT_SERVING
    # Never a made-up READY: the shell publishes no lifecycle key at all.
    assert etcd.get_prefix(LIFECYCLE_PREFIX)[0] == []


def test_a_node_outside_the_topology_refuses_to_start(tmp_path: Path) -> None:
    (tmp_path / "topology.toml").write_text(Topology(("127.0.0.1:1",), 4).to_toml())
    config = tmp_path / "retina.toml"
    config.write_text('[retina]\nlisten = "127.0.0.1:2"\n')
    result = subprocess.run([sys.executable, "-m", "retina_server", "--config", str(config)],
                            cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert "is not in the topology" in result.stderr


def test_cdc_connector_refuses_to_pretend() -> None:
    result = subprocess.run([sys.executable, "-m", "cdc_client.main"], cwd=ROOT,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and "not available" in result.stderr
