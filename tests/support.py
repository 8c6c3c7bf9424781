"""Test helpers: real processes started the way an operator starts them."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import grpc

from devtools.cluster import free_port, grpc_serving, started_count, write_config
from retina_common.etcd import EtcdStore
from retina_common.keys import lifecycle_key
from retina_common.lifecycle_record import LifecycleRecord, LifecycleState
from retina_common.pb import trans_pb2 as tpb
from retina_common.pb import trans_pb2_grpc
from retina_common.topology import Topology

ROOT = Path(__file__).resolve().parent.parent


def eventually(condition: Callable[[], Any], timeout_s: float, what: str | Callable[[], str],
               interval_s: float = 0.05) -> Any:
    """Poll until ``condition()`` is truthy and return it; fail the test at the deadline.
    ``what`` may be a callable: it is asked at the deadline (a process's log then, not at
    the call, when it is still empty)."""
    deadline = time.monotonic() + timeout_s
    last: Any = None
    while time.monotonic() < deadline:
        try:
            last = condition()
        except Exception as exc:
            last = exc
        else:
            if last:
                return last
        time.sleep(interval_s)
    described = what() if callable(what) else what
    raise AssertionError(f"timed out after {timeout_s}s waiting for {described}; last: {last!r}")


def delete_prefix(store: EtcdStore, prefix: str) -> int:
    """Delete every key under ``prefix``: a test's clean-up (Retina itself never does)."""
    keys, _revision = store.get_prefix(prefix)
    return sum(store.delete(kv.key) for kv in keys)


def now_ms() -> int:
    return int(time.time() * 1000)


def put_lifecycle(store: EtcdStore, node: str, state: LifecycleState | str, *,
                  updated_at_ms: int | None = None, lease_id: int = 0) -> None:
    record = LifecycleRecord(state=LifecycleState(state), node=node, checkpoint_id=7,
                             recovery_epoch=1, token_hash="0123abcd",
                             updated_at_ms=now_ms() if updated_at_ms is None else updated_at_ms)
    store.put(lifecycle_key(node), record.to_json(), lease_id=lease_id)


class ChildProcess:
    """A real process of ours (``python -m MODULE --config ...``) logging to a file."""

    module = ""
    stop_timeout_s = 15.0

    def __init__(self, config_path: Path, log_path: Path) -> None:
        self.config_path = config_path
        self.log_path = log_path
        self.proc: subprocess.Popen[bytes] | None = None

    def spawn(self, failpoints: str, env: Mapping[str, str] | None = None) -> None:
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", self.module, "--config", str(self.config_path)],
                stdout=log, stderr=subprocess.STDOUT, cwd=ROOT,
                env={**os.environ, "RETINA_FAILPOINTS": failpoints, **(env or {})})

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def describe(self) -> str:
        """Whether it runs (or how it exited) and its log's tail: what a failed start shows."""
        state = ("not started" if self.proc is None else
                 "running" if self.alive() else f"exited with {self.proc.returncode}")
        return f"{state}; log: {self.log_tail()}"

    def kill9(self) -> int | None:
        """SIGKILL (if it still runs); returns the exit status."""
        if self.proc is None:
            return None
        if self.alive():
            self.proc.send_signal(signal.SIGKILL)
        return self.proc.wait(timeout=10)

    def wait_exit(self, timeout_s: float = 60) -> int:
        assert self.proc is not None
        return self.proc.wait(timeout=timeout_s)

    def terminate(self) -> None:
        """SIGTERM, then SIGKILL if it has not gone within ``stop_timeout_s``."""
        if not self.alive():
            return
        assert self.proc is not None
        self.proc.terminate()
        try:
            self.proc.wait(timeout=self.stop_timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)

    def log_tail(self, chars: int = 4000) -> str:
        return self.log_path.read_text()[-chars:] if self.log_path.exists() else ""


class TransServerProcess(ChildProcess):
    """A real ``retina-trans`` process with its own config and topology files."""

    module = "trans_gate"

    def __init__(self, workdir: Path, etcd_endpoint: str, dsn: str, nodes: list[str], *,
                 trans: Mapping[str, object] | None = None,
                 gate: Mapping[str, object] | None = None) -> None:
        workdir.mkdir(parents=True, exist_ok=True)
        self.workdir = workdir
        self.nodes = nodes
        self.address = f"127.0.0.1:{free_port()}"
        self.metrics = f"127.0.0.1:{free_port()}"
        topology = workdir / "topology.toml"
        topology.write_text(Topology(tuple(nodes), max(len(nodes), 4)).to_toml())
        super().__init__(workdir / "retina.toml", workdir / "trans.log")
        write_config(self.config_path, etcd_endpoint=etcd_endpoint, dsn=dsn,
                     topology_file=topology, storage_root=workdir / "storage",
                     trans_listen=self.address, trans_metrics=self.metrics,
                     extra={"trans": dict(trans or {}), "gate": dict(gate or {})})
        self._channel: grpc.Channel | None = None

    def start(self, failpoints: str = "", wait: bool = True) -> TransServerProcess:
        before = started_count(self.log_path, "trans_server_started")
        self.spawn(failpoints)
        if wait:
            # Its own start event first: see RetinaProcess.start (tests/dataplane.py).
            eventually(lambda: self.alive() and grpc_serving(self.address)
                       and started_count(self.log_path, "trans_server_started") > before,
                       30, lambda: f"TransServer {self.address} SERVING ({self.describe()})")
        return self

    def stop(self) -> None:
        if self._channel is not None:
            self._channel.close()
            self._channel = None
        self.terminate()

    def stub(self) -> trans_pb2_grpc.TransServiceStub:
        if self._channel is None:
            self._channel = grpc.insecure_channel(self.address)
        return trans_pb2_grpc.TransServiceStub(self._channel)

    def reconnect(self) -> trans_pb2_grpc.TransServiceStub:
        if self._channel is not None:
            self._channel.close()
            self._channel = None
        return self.stub()



def rpc_error(call: Callable[[], Any]) -> grpc.RpcError:
    """Run ``call``, which must fail with a gRPC status; return the error."""
    try:
        call()
    except grpc.RpcError as exc:
        return exc
    raise AssertionError("the call succeeded but was expected to be refused")


def begin_write(stub: trans_pb2_grpc.TransServiceStub, lease_ms: int = 0) -> tpb.BeginTransResponse:
    return stub.BeginTrans(tpb.BeginTransRequest(read_only=False, lease_ms=lease_ms), timeout=10)


def begin_read(stub: trans_pb2_grpc.TransServiceStub) -> tpb.BeginTransResponse:
    return stub.BeginTrans(tpb.BeginTransRequest(read_only=True), timeout=10)
