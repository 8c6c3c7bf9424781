"""``retina-cluster`` as an operator runs it: start, status, refuse a second start, stop;
the Makefile targets a newcomer runs; Retina nodes started, inspected and restarted one by
one."""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
from pathlib import Path

import grpc
import pytest
import requests

from devtools.cluster import ClusterState, pid_alive, started_count
from retina_common.etcd import EtcdStore
from retina_common.pb import retina_pb2 as rpb
from retina_common.pb import retina_pb2_grpc, trans_pb2_grpc

from .support import ROOT, begin_write, eventually

pytestmark = pytest.mark.integration


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "devtools.cluster_cli", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=180)


def test_start_status_stop(base_dir: Path) -> None:
    state_dir = base_dir / "cli-cluster"
    started = cli("start", "--state-dir", str(state_dir), "--virtual-nodes", "4")
    try:
        assert started.returncode == 0, started.stderr
        for component in ("etcd", "postgresql", "transserver", "topology"):
            assert component in started.stdout
        state = ClusterState.load(state_dir)
        assert state is not None and pid_alive(state.trans_pid)
        assert cli("status", "--state-dir", str(state_dir)).returncode == 0
        again = cli("start", "--state-dir", str(state_dir))
        assert again.returncode == 1 and "already running" in again.stderr
        # The cluster works: the TransServer issues timestamps and the etcd
        # key of the durable allocator exists.
        with grpc.insecure_channel(state.trans_listen) as channel:
            assert begin_write(trans_pb2_grpc.TransServiceStub(channel)).timestamp >= 1
        kv = EtcdStore([state.etcd.endpoint]).get("/pixels/trans/timestamp/upper")
        assert kv is not None and int(kv.value) > 1
        config = (state_dir / "retina.toml").read_text()
        assert json.dumps(state.postgres.dsn()) in config
    finally:
        stopped = cli("stop", "--state-dir", str(state_dir))
    assert stopped.returncode == 0
    assert cli("status", "--state-dir", str(state_dir)).returncode == 1
    assert not pid_alive(state.trans_pid) and not pid_alive(state.etcd.pid)


def make(target: str, *variables: str) -> subprocess.CompletedProcess[str]:
    """A Makefile target as a newcomer runs it (``make cluster-up RETINA=2``)."""
    return subprocess.run(["make", "--no-print-directory", target, *variables], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)


def node_line(output: str, node: str) -> str:
    """The first line of ``node``'s entry: address, state/phase, pid, metrics."""
    return next(line for line in output.splitlines()
                if line.startswith(f"retina      {node}  "))


def node_status(node: str) -> rpb.GetRetinaStatusResponse:
    with grpc.insecure_channel(node) as channel:
        return retina_pb2_grpc.RetinaWorkerServiceStub(channel).GetRetinaStatus(
            rpb.GetRetinaStatusRequest(), timeout=5)


def run_printed(command: str) -> subprocess.CompletedProcess[str]:
    """A ``retina-admin ...`` line the cluster printed, run as printed."""
    name, *args = shlex.split(command)
    assert name == "retina-admin"
    return subprocess.run([sys.executable, "-m", "retina_common.admin_cli", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)


def test_cluster_up_starts_nodes_and_says_how_they_become_ready(base_dir: Path) -> None:
    state_dir = base_dir / "make-cluster"
    up = make("cluster-up", "RETINA=2", f"STATE={state_dir}")
    try:
        assert up.returncode == 0, up.stdout + up.stderr
        state = ClusterState.load(state_dir)
        assert state is not None and len(state.nodes) == 2
        for node in state.nodes:
            line = node_line(up.stdout, node)
            assert "RECOVERING/AWAITING_REPLAY" in line
            assert f"pid {state.retina_pids[node]}" in line
        # One line says why the nodes wait and what drives them; then the commands.
        note = next(line for line in up.stdout.splitlines() if line.startswith("note"))
        assert "AWAITING_REPLAY" in note and "retina-cdc" in note
        commands = [line.strip() for line in up.stdout.splitlines()
                    if line.strip().startswith("retina-admin ")]
        assert len(commands) == 2
        first, second = state.nodes
        marked = run_printed(next(c for c in commands if c.endswith(f" {first}")))
        assert marked.returncode == 0, marked.stderr
        assert node_status(first).state == rpb.READY

        status = make("cluster-status", f"STATE={state_dir}")
        assert status.returncode == 0, status.stdout + status.stderr
        assert "READY/READY" in node_line(status.stdout, first)
        assert "RECOVERING/AWAITING_REPLAY" in node_line(status.stdout, second)
        for node in state.nodes:
            assert f"pid {state.retina_pids[node]}" in node_line(status.stdout, node)
            host, port = node.rsplit(":", 1)
            node_dir = state_dir.resolve() / "retina-state" / f"{host}-{port}"
            log = state_dir.resolve() / "logs" / f"retina-{host}-{port}.log"
            assert f"state {node_dir}  log {log}" in status.stdout
            assert (node_dir / "index").is_dir() and log.is_file()
            # Metrics are on, on a port of their own, and answer with the node's metrics.
            metrics = state.retina_metrics[node]
            assert f"metrics http://{metrics}/metrics" in node_line(status.stdout, node)
            scraped = requests.get(f"http://{metrics}/metrics", timeout=5)
            assert scraped.status_code == 200 and "retina_" in scraped.text
        assert len({*state.retina_metrics.values(), *state.nodes}) == 4
    finally:
        down = make("cluster-down", f"STATE={state_dir}")
    assert down.returncode == 0, down.stderr
    assert not any(pid_alive(pid) for pid in state.retina_pids.values())


def test_one_node_is_stopped_killed_and_restarted_in_place(base_dir: Path) -> None:
    state_dir = base_dir / "node-commands"
    started = cli("start", "--state-dir", str(state_dir), "--retina", "1",
                  "--virtual-nodes", "4")
    try:
        assert started.returncode == 0, started.stderr
        state = ClusterState.load(state_dir)
        assert state is not None and len(state.nodes) == 1
        node = state.nodes[0]
        metrics = state.retina_metrics[node]
        first_epoch = node_status(node).recovery_epoch
        log = state_dir.resolve() / "logs" / f"retina-{node.replace(':', '-')}.log"

        # A crash the node did not ask for: status fails until it is back.
        os.kill(state.retina_pids[node], signal.SIGKILL)
        eventually(lambda: "  down  " in node_line(cli("status", "--state-dir",
                                                       str(state_dir)).stdout, node),
                   30, "status to see the node down")
        assert cli("status", "--state-dir", str(state_dir)).returncode == 1

        restarted = make("cluster-restart-node", f"NODE={node}", f"STATE={state_dir}")
        assert restarted.returncode == 0, restarted.stdout + restarted.stderr
        assert "RECOVERING/AWAITING_REPLAY" in node_line(restarted.stdout, node)
        assert f"metrics http://{metrics}/metrics" in node_line(restarted.stdout, node)
        assert f"recover --node {node}" in restarted.stdout
        # The same state directory (its recovery epoch counts on) and the same log file.
        assert node_status(node).recovery_epoch > first_epoch
        assert started_count(log, "retina_server_started") == 2

        killed = cli("kill-node", node, "--signal", "KILL", "--state-dir", str(state_dir))
        assert killed.returncode == 0, killed.stderr
        assert "stopped (SIGKILL)" in killed.stdout
        status = cli("status", "--state-dir", str(state_dir))
        # Killed on purpose: shown down, not counted as a failure.
        assert status.returncode == 0 and "  down  pid -" in node_line(status.stdout, node)

        assert cli("start-node", node, "--state-dir", str(state_dir)).returncode == 0
        again = cli("start-node", node, "--state-dir", str(state_dir))
        assert again.returncode == 1 and "already running" in again.stderr
        stopped = cli("stop-node", node, "--state-dir", str(state_dir))
        assert stopped.returncode == 0 and "stopped (SIGTERM)" in stopped.stdout
        # A clean stop: the node logged its shutdown.
        assert started_count(log, "retina_server_stopping") == 1
        assert node_status_or_none(node) is None

        unknown = cli("restart-node", "127.0.0.1:1", "--state-dir", str(state_dir))
        assert unknown.returncode == 1 and "not a node of this cluster" in unknown.stderr
    finally:
        stopped = cli("stop", "--state-dir", str(state_dir))
    assert stopped.returncode == 0


def node_status_or_none(node: str) -> rpb.GetRetinaStatusResponse | None:
    try:
        return node_status(node)
    except grpc.RpcError:
        return None
