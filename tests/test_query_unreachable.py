"""A query whose node (or TransServer) is down answers in our words (issue 26): in the
first seconds after a Retina node dies the gate still admits reads, and the read's call
to the node used to fail with gRPC's raw "failed to connect to all addresses". Now it
names the node, says the query was not answered and when to retry; the status stays
UNAVAILABLE, so exit codes are those of any other refusal (retina-query 1, the Spark
snapshot 4)."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest

from devtools.cluster import free_port
from retina_common import exit_codes
from retina_common.config import TlsConfig
from retina_common.refusal import transport_lost
from spark_jobs.common import exit_code_of, short_reason
from spark_jobs.snapshot_query import plan_snapshot

from .dataplane import SCHEMA, DataPlane
from .support import ROOT
from .test_recovery_protocol import order

pytestmark = pytest.mark.integration

RAW = "failed to connect to all addresses"


def unreachable_node(node: str) -> str:
    return (f"node {node} is unreachable (it may be restarting); the query was not answered; "
            "retry when `retina-admin status` shows it READY")


def query(plane: DataPlane, env: dict[str, str] | None = None
          ) -> subprocess.CompletedProcess[str]:
    """``retina-query shop.orders`` as an operator runs it."""
    return subprocess.run([sys.executable, "-m", "retina_common.reader", f"{SCHEMA}.orders",
                           "--config", str(plane.config_path)], cwd=ROOT, capture_output=True,
                          text=True, timeout=120, env={**os.environ, **(env or {})})


def test_a_read_admitted_before_its_node_died_names_the_node(
        make_plane: Callable[..., DataPlane]) -> None:
    plane = make_plane(nodes=2)
    plane.commit({"orders": {"inserts": [order(i) for i in range(40)]}})
    assert plane.reader is not None
    dead = plane.nodes[1]
    with plane.reader.transaction() as trans:  # admitted: every node READY
        plane.retinas[dead].kill9()
        with pytest.raises(grpc.RpcError) as read:
            plane.reader.read_in(trans, SCHEMA, "orders")
        # The Spark snapshot's driver step goes the same way, to exit code 4.
        with pytest.raises(grpc.RpcError) as planned:
            plan_snapshot(trans, plane.trans.address, plane.topology, SCHEMA, "orders",
                          TlsConfig())
    for lost in (read.value, planned.value):
        assert lost.code() == grpc.StatusCode.UNAVAILABLE and transport_lost(lost)
        assert lost.details() == unreachable_node(dead)
    assert exit_code_of(planned.value) == exit_codes.UNAVAILABLE
    assert short_reason(planned.value) == f"UNAVAILABLE: {unreachable_node(dead)}"


def test_retina_query_says_which_node_did_not_answer(
        make_plane: Callable[..., DataPlane], tmp_path: Path) -> None:
    """The gate admits (the TransServer's topology is the cluster's) while a node of the
    query's topology has nothing listening: the state of the first seconds after a node
    died, held still."""
    plane = make_plane()
    plane.commit({"orders": {"inserts": [order(i) for i in range(10)]}})
    down = f"127.0.0.1:{free_port()}"
    topology = tmp_path / "topology.toml"
    topology.write_text(f'virtual_nodes = {plane.topology.virtual_nodes}\n'
                        f'nodes = ["{plane.nodes[0]}", "{down}"]\n')
    done = query(plane, {"RETINA__TOPOLOGY_FILE": str(topology)})
    assert done.returncode == 1, done.stdout + done.stderr
    assert done.stderr.strip() == f"retina-query: UNAVAILABLE: {unreachable_node(down)}"
    assert RAW not in done.stderr
    assert query(plane).returncode == 0  # the cluster itself answers


def test_retina_query_says_the_trans_server_did_not_answer(
        make_plane: Callable[..., DataPlane]) -> None:
    plane = make_plane()
    plane.trans.stop()
    done = query(plane)
    assert done.returncode == 1, done.stdout + done.stderr
    assert done.stderr.strip() == (
        f"retina-query: UNAVAILABLE: TransServer {plane.trans.address} is unreachable (it may "
        "be restarting); the query was not answered; retry when `retina-admin status` "
        "shows it answering")
