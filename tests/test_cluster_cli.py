"""``retina-cluster`` as an operator runs it: start, status, refuse a second start, stop."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import grpc

from devtools.cluster import ClusterState, pid_alive
from retina_common.etcd import EtcdStore
from retina_common.pb import trans_pb2_grpc

from .support import ROOT, begin_write


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
