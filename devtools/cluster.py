"""A private local cluster: etcd, PostgreSQL and the TransServer on free loopback ports.

Used by ``retina-cluster`` (and so ``make demo``) and by the test fixtures,
so the tests start exactly what an operator starts. Every instance has its
own data directory; nothing touches a system-wide etcd or PostgreSQL.

PostgreSQL's ``initdb`` refuses to run as root, so as root the server runs as
the ``postgres`` user; its data directory is placed where that user can
reach it.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import pwd
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import psycopg2
import requests

from retina_common.config import TlsConfig
from retina_common.log import logged_events
from retina_common.tls import open_channel
from retina_common.topology import Topology

if TYPE_CHECKING:
    from retina_common.pb.retina_pb2 import GetRetinaStatusResponse


class ClusterError(Exception):
    """A component of the local cluster could not be started or stopped."""


def free_port() -> int:
    return free_ports(1)[0]


# Ports are drawn below the kernel's ephemeral range: a node keeps its address across
# restarts (it is its identity), and while it is down any outgoing connection of any
# process could take an ephemeral port as its local port, so the restart would fail
# with "address already in use" (seen in CI: a node restarted by a recovery test). A
# port is never handed out twice by one process, and each pytest-xdist worker draws from
# its own slice of the range: a port one worker's stopped server will bind again is
# otherwise free for another worker to take (seen in CI: a TransServer restarted on a
# new port that never came up).
_PORT_FLOOR = 20000
_MIN_SLICE = 256  # a test holds ~10 ports at once: room for a few dozen in flight
_handed_out: dict[int, None] = {}  # in the order handed out: the oldest is forgotten first
_ports_lock = threading.Lock()
_random = random.SystemRandom()


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def _port_range() -> tuple[int, int]:
    """[low, high) this process draws from: this xdist worker's slice, else all of it."""
    low, high = _PORT_FLOOR, _ephemeral_low()
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    count = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0") or 0)
    if worker.startswith("gw") and worker[2:].isdigit() and count > 1:
        # A worker xdist starts in place of a crashed one gets a new id (gwN for N workers)
        # and shares a slice with a live one: as before slices, for that run only.
        width = (high - low) // count
        if width >= _MIN_SLICE:
            low += int(worker[2:]) % count * width
            high = low + width
        else:
            warnings.warn(f"{count} test workers share {high - low} ports: fewer than "
                          f"{_MIN_SLICE} each, so they draw from all of them, and two may "
                          "hand out the same port", stacklevel=3)
    return low, high


def free_ports(count: int) -> list[int]:
    """``count`` distinct free loopback ports outside the ephemeral range: every socket
    stays bound until all are chosen, so the same port is never handed out twice."""
    low, high = _port_range()
    socks: list[socket.socket] = []
    chosen: list[int] = []
    try:
        with _ports_lock:
            for _ in range(count * 200):
                if len(chosen) == count:
                    break
                port = (_random.randrange(low, high) if high - low >= _MIN_SLICE
                        else 0)  # an odd range: let the kernel choose
                if port in _handed_out:
                    continue
                sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                try:
                    sock.bind(("127.0.0.1", port))
                except OSError:
                    sock.close()
                    continue
                socks.append(sock)
                chosen.append(int(sock.getsockname()[1]))
            if len(chosen) < count:
                raise ClusterError(f"no {count} free loopback ports in "
                                   f"[{low}, {high})")
            _handed_out.update(dict.fromkeys(chosen))
            # A long run hands out more ports than a worker's slice holds: forget the oldest
            # (their tests are long over) once half of the slice has been handed out.
            while len(_handed_out) > max(64, (high - low) // 2):
                del _handed_out[next(iter(_handed_out))]
        return chosen
    finally:
        for sock in socks:
            sock.close()


def wait_for(condition: Callable[[], bool], timeout_s: float, what: str,
             interval_s: float = 0.05) -> None:
    """Poll ``condition`` until it holds; raise ClusterError at the deadline."""
    deadline = time.monotonic() + timeout_s
    last_error: Exception | None = None
    while time.monotonic() < deadline:
        try:
            if condition():
                return
        except Exception as exc:  # the component is still coming up
            last_error = exc
        time.sleep(interval_s)
    raise ClusterError(f"timed out after {timeout_s:.0f}s waiting for {what}"
                       + (f" (last error: {last_error})" if last_error else ""))


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie child is dead for our purposes
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split(") ", 1)[1][0] != "Z"
    except (OSError, IndexError):
        return True


def terminate(pid: int, timeout_s: float = 10.0, sig: int = signal.SIGTERM) -> None:
    """Send ``sig`` and wait for the process to go; SIGKILL after the timeout."""
    if not pid_alive(pid):
        return
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        _reap(pid)
        if not pid_alive(pid):
            return
        time.sleep(0.05)
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        return
    wait_for(lambda: (_reap(pid), not pid_alive(pid))[1], 10, f"pid {pid} to die")


def _reap(pid: int) -> None:
    with contextlib.suppress(ChildProcessError):
        os.waitpid(pid, os.WNOHANG)


# --- etcd ---
@dataclass
class EtcdInstance:
    data_dir: str
    client_port: int
    peer_port: int
    pid: int = 0

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.client_port}"

    def healthy(self) -> bool:
        response = requests.get(f"http://{self.endpoint}/health", timeout=1)
        return response.status_code == 200 and response.json().get("health") == "true"


def start_etcd(data_dir: Path, log_path: Path, timeout_s: float = 30,
               ports: tuple[int, int] | None = None) -> EtcdInstance:
    """Start etcd; ``ports`` (client, peer) restarts it where it was before."""
    binary = shutil.which("etcd")
    if binary is None:
        raise ClusterError("etcd is not installed (run `make setup`)")
    data_dir.mkdir(parents=True, exist_ok=True)
    for _attempt in range(1 if ports else 3):
        client_port, peer_port = ports or (free_port(), free_port())
        inst = EtcdInstance(str(data_dir), client_port, peer_port)
        peer = f"http://127.0.0.1:{inst.peer_port}"
        client = f"http://127.0.0.1:{inst.client_port}"
        with open(log_path, "ab") as log:
            proc = subprocess.Popen(
                [binary, "--name", "retina-local", "--data-dir", str(data_dir / "member-data"),
                 "--listen-client-urls", client, "--advertise-client-urls", client,
                 "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
                 "--initial-cluster", f"retina-local={peer}",
                 "--initial-cluster-state", "new", "--log-level", "warn"],
                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        inst.pid = proc.pid
        try:
            wait_for(inst.healthy, timeout_s, f"etcd on {inst.endpoint}")
            return inst
        except ClusterError:
            if proc.poll() is None:
                raise
            # lost a port race or a stale data dir: try again with new ports
    raise ClusterError(f"etcd did not start; see {log_path}")


# --- PostgreSQL ---
def _pg_bin(name: str) -> str:
    found = shutil.which(name)
    if found:
        return found
    candidates = sorted(Path("/usr/lib/postgresql").glob(f"*/bin/{name}"))
    if not candidates:
        raise ClusterError(f"PostgreSQL's {name} is not installed (run `make setup`)")
    return str(candidates[-1])


def _as_postgres(argv: list[str]) -> list[str]:
    if os.geteuid() != 0:
        return argv
    return ["runuser", "-u", "postgres", "--", *argv]


def _reachable_by_postgres(path: Path) -> bool:
    if os.geteuid() != 0:
        return True
    pw = pwd.getpwnam("postgres")
    for parent in [path, *path.parents]:
        if not parent.exists():
            continue
        st = parent.stat()
        if st.st_uid != pw.pw_uid and not st.st_mode & 0o001:
            return False
    return True


def pg_data_dir_for(state_dir: Path) -> Path:
    """``state_dir/pg`` if the postgres user can reach it, else a private /tmp directory."""
    preferred = state_dir.resolve() / "pg"
    if _reachable_by_postgres(preferred.parent):
        return preferred
    digest = hashlib.sha256(str(state_dir.resolve()).encode()).hexdigest()[:12]
    return Path(tempfile.gettempdir()) / f"retina-pg-{digest}"


@dataclass
class PostgresInstance:
    data_dir: str
    port: int
    user: str = "retina"

    def dsn(self, dbname: str = "retina") -> str:
        return f"host=127.0.0.1 port={self.port} dbname={dbname} user={self.user}"

    def create_database(self, name: str) -> None:
        conn = psycopg2.connect(self.dsn("postgres"), connect_timeout=5)
        try:
            conn.autocommit = True
            with conn.cursor() as cur:
                cur.execute("SELECT 1 FROM pg_database WHERE datname = %s", (name,))
                if cur.fetchone() is None:
                    cur.execute(f'CREATE DATABASE "{name}"')
        finally:
            conn.close()

    def drop_database(self, name: str) -> None:
        conn = psycopg2.connect(self.dsn("postgres"), connect_timeout=5)
        try:
            conn.autocommit = True
            with conn.cursor() as cur:
                cur.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        finally:
            conn.close()

    def accepting(self) -> bool:
        conn = psycopg2.connect(self.dsn("postgres"), connect_timeout=2)
        conn.close()
        return True


def start_postgres(data_dir: Path, log_path: Path, *, durable: bool = True,
                   timeout_s: float = 60, settings: Mapping[str, str] | None = None
                   ) -> PostgresInstance:
    """initdb (first time only) and start a private server on a free port;
    ``settings``: more server settings (``-c name=value``), e.g. ssl."""
    data_dir.parent.mkdir(parents=True, exist_ok=True)
    if os.geteuid() == 0:
        pw = pwd.getpwnam("postgres")
        data_dir.mkdir(mode=0o700, exist_ok=True)
        os.chown(data_dir, pw.pw_uid, pw.pw_gid)
        log_path.touch()
        os.chown(log_path, pw.pw_uid, pw.pw_gid)
    if not (data_dir / "PG_VERSION").exists():
        result = subprocess.run(
            _as_postgres([_pg_bin("initdb"), "-D", str(data_dir), "-U", "retina",
                          "--auth=trust", "-E", "UTF8", "--no-instructions"]),
            capture_output=True, text=True, check=False)
        if result.returncode != 0:
            raise ClusterError(f"initdb failed: {result.stderr.strip() or result.stdout.strip()}")
    options = ["-c listen_addresses=127.0.0.1", f"-c unix_socket_directories={data_dir}",
               "-c max_connections=200",
               # The same server hosts the demo's source database, which the
               # CDC connector reads by logical replication (pgoutput).
               "-c wal_level=logical", "-c max_wal_senders=20", "-c max_replication_slots=20"]
    if not durable:  # test fixtures: a real server, but without waiting on the disk
        options += ["-c fsync=off", "-c synchronous_commit=off", "-c full_page_writes=off"]
    options += [f"-c {name}={value}" for name, value in (settings or {}).items()]
    for _attempt in range(3):
        inst = PostgresInstance(str(data_dir), free_port())
        result = subprocess.run(
            _as_postgres([_pg_bin("pg_ctl"), "-D", str(data_dir), "-l", str(log_path), "-w",
                          "-t", str(int(timeout_s)), "-o",
                          " ".join([f"-p {inst.port}", *options]), "start"]),
            capture_output=True, text=True, check=False)
        if result.returncode == 0:
            wait_for(inst.accepting, timeout_s, f"PostgreSQL on port {inst.port}")
            return inst
    raise ClusterError(f"PostgreSQL did not start: {result.stderr.strip()}; see {log_path}")


def stop_postgres(data_dir: str) -> None:
    if not (Path(data_dir) / "postmaster.pid").exists():
        return
    subprocess.run(_as_postgres([_pg_bin("pg_ctl"), "-D", data_dir, "-m", "fast", "-w",
                                 "stop"]), capture_output=True, check=False)


# --- configuration and the TransServer ---
def write_config(path: Path, *, etcd_endpoint: str, dsn: str, topology_file: Path,
                 storage_root: Path, trans_listen: str, trans_metrics: str,
                 extra: Mapping[str, Mapping[str, object]] | None = None) -> None:
    """Write a retina.toml every process of the local cluster reads.

    A development and test cluster keeps no history beyond live reads and pins
    (``trans.history_retention_ms = 0``): Storage GC and folding act at once, as the
    tests and demos expect. The production default is an hour (docs/history.md);
    ``RETINA__TRANS__HISTORY_RETENTION_MS`` or ``extra`` sets another."""
    sections: dict[str, dict[str, object]] = {
        "etcd": {"endpoints": [etcd_endpoint]},
        "catalog": {"dsn": dsn},
        "storage": {"root": str(storage_root)},
        "trans": {"listen": trans_listen, "metrics_listen": trans_metrics,
                  "history_retention_ms": 0},
    }
    for name, values in (extra or {}).items():
        sections.setdefault(name, {}).update(values)
    lines = [f"topology_file = {json.dumps(str(topology_file))}", 'log_level = "info"', ""]
    for name, values in sections.items():
        lines.append(f"[{name}]")
        lines.extend(f"{key} = {json.dumps(value)}" for key, value in values.items())
        lines.append("")
    path.write_text("\n".join(lines))


def started_count(log_path: Path, event: str) -> int:
    """How many times a process logged its start event ``event`` in ``log_path``."""
    return len(logged_events(log_path, event))


def start_process(argv: list[str], log_path: Path, env: Mapping[str, str] | None = None) -> int:
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT,
                                env={**os.environ, **(env or {})}, start_new_session=True)
    return proc.pid


def trans_server_argv(config_path: Path) -> list[str]:
    return [sys.executable, "-m", "trans_gate", "--config", str(config_path)]


def grpc_serving(address: str, service: str = "", tls: TlsConfig | None = None) -> bool:
    """The health service's answer; ``tls``: default the process's settings."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with open_channel(address, tls) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=1)
        return reply.status == health_pb2.HealthCheckResponse.SERVING


# --- the whole local cluster ---
@dataclass
class ClusterState:
    state_dir: str
    etcd: EtcdInstance
    postgres: PostgresInstance
    config_path: str
    topology_path: str
    trans_listen: str
    trans_metrics: str
    trans_pid: int = 0
    nodes: list[str] = field(default_factory=list)
    retina_pids: dict[str, int] = field(default_factory=dict)
    # Each node's Prometheus endpoint, drawn at its first start and kept across restarts
    # (like its listen address), so a scrape target stays valid.
    retina_metrics: dict[str, str] = field(default_factory=dict)
    cdc_pid: int = 0

    def save(self) -> None:
        Path(self.state_dir, "cluster.json").write_text(json.dumps(asdict(self), indent=2))

    @classmethod
    def load(cls, state_dir: Path) -> ClusterState | None:
        path = state_dir / "cluster.json"
        if not path.exists():
            return None
        data = json.loads(path.read_text())
        data["etcd"] = EtcdInstance(**data["etcd"])
        data["postgres"] = PostgresInstance(**data["postgres"])
        return cls(**data)


def start_cluster(state_dir: Path, *, nodes: list[str] | None = None, virtual_nodes: int = 8,
                  durable: bool = True, start_trans: bool = True,
                  log: Callable[[str], None] = print) -> ClusterState:
    """Start etcd, PostgreSQL (catalog bootstrapped) and the TransServer under ``state_dir``."""
    state_dir = state_dir.resolve()
    state_dir.mkdir(parents=True, exist_ok=True)
    os.chmod(state_dir, 0o755)
    logs = state_dir / "logs"
    logs.mkdir(exist_ok=True)
    etcd = start_etcd(state_dir / "etcd", logs / "etcd.log")
    log(f"etcd        http://{etcd.endpoint}  (data {state_dir / 'etcd'})")
    pg_dir = pg_data_dir_for(state_dir)
    try:
        return _start_rest(state_dir, etcd, pg_dir, nodes=nodes, virtual_nodes=virtual_nodes,
                           durable=durable, start_trans=start_trans, log=log)
    except BaseException:
        # Leave nothing half-started behind a failed start.
        stop_postgres(str(pg_dir))
        terminate(etcd.pid)
        raise


def _start_rest(state_dir: Path, etcd: EtcdInstance, pg_dir: Path, *, nodes: list[str] | None,
                virtual_nodes: int, durable: bool, start_trans: bool,
                log: Callable[[str], None]) -> ClusterState:
    from retina_common.catalog import Catalog

    logs = state_dir / "logs"
    pg = start_postgres(pg_dir, logs / "postgres.log", durable=durable)
    pg.create_database("retina")
    catalog = Catalog(pg.dsn())
    try:
        catalog.bootstrap()
    finally:
        catalog.close()
    log(f"postgresql  {pg.dsn()}  (data {pg.data_dir})")
    nodes = nodes or [f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"]
    topology = Topology(tuple(nodes), virtual_nodes)
    topology_path = state_dir / "topology.toml"
    topology_path.write_text(topology.to_toml())
    storage = state_dir / "storage"
    storage.mkdir(exist_ok=True)
    config_path = state_dir / "retina.toml"
    state = ClusterState(str(state_dir), etcd, pg, str(config_path), str(topology_path),
                         trans_listen=f"127.0.0.1:{free_port()}",
                         trans_metrics=f"127.0.0.1:{free_port()}", nodes=list(topology.nodes))
    write_config(config_path, etcd_endpoint=etcd.endpoint, dsn=pg.dsn(),
                 topology_file=topology_path, storage_root=storage,
                 trans_listen=state.trans_listen, trans_metrics=state.trans_metrics)
    state.save()
    if start_trans:
        try:
            start_trans_server(state)
        except BaseException:
            if state.trans_pid:
                terminate(state.trans_pid)
            raise
        log(f"transserver {state.trans_listen}  (metrics http://{state.trans_metrics}/metrics)")
    log(f"topology    {', '.join(topology.nodes)} / {virtual_nodes} virtual nodes "
        f"(hash {topology.topology_hash[:12]})")
    log(f"config      {config_path}")
    return state


def start_trans_server(state: ClusterState, env: Mapping[str, str] | None = None,
                       timeout_s: float = 30) -> int:
    log_path = Path(state.state_dir, "logs", "trans.log")
    before = started_count(log_path, "trans_server_started")
    pid = start_process(trans_server_argv(Path(state.config_path)), log_path, env)
    state.trans_pid = pid
    state.save()

    def serving() -> bool:
        # Its own start event first: another cluster's server that drew the same free
        # port would answer the health check too (then this one exits: cannot listen).
        return (pid_alive(pid) and started_count(log_path, "trans_server_started") > before
                and grpc_serving(state.trans_listen))
    try:
        wait_for(serving, timeout_s, f"the TransServer on {state.trans_listen}")
    except ClusterError:
        tail = log_path.read_text()[-2000:] if log_path.exists() else ""
        raise ClusterError(f"TransServer did not become SERVING; log tail:\n{tail}") from None
    return pid


# For benchmarks of the node's own apply path, which send UpdateRecord straight from a
# client (TableWriter) with no writer id: the development mode (retina.anonymous_writes),
# not the crash-safe write path (retina_common/writer.py). Pass as ``env`` of
# start_retina_server.
ANONYMOUS_WRITES_ENV = {"RETINA__RETINA__ANONYMOUS_WRITES": "true"}


def retina_server_argv(config_path: Path) -> list[str]:
    return [sys.executable, "-m", "retina_server", "--config", str(config_path)]


def start_retina_servers(state: ClusterState, env: Mapping[str, str] | None = None,
                         timeout_s: float = 60) -> None:
    """Start one ``retina-server`` per topology node and wait until each listens.

    A node starts RECOVERING; something must drive it to READY
    (``retina_common.recovery_driver``), as the CDC connector does."""
    for node in state.nodes:
        start_retina_server(state, node, env, timeout_s)


def retina_log_path(state: ClusterState, node: str) -> Path:
    host, port = node.rsplit(":", 1)
    return Path(state.state_dir, "logs", f"retina-{host}-{port}.log")


def retina_state_dir(state: ClusterState, node: str) -> Path:
    """The node's own state directory: every node of the cluster is given
    ``retina-state`` and the server keeps its files under ``<host>-<port>`` there."""
    host, port = node.rsplit(":", 1)
    return Path(state.state_dir, "retina-state", f"{host}-{port}")


def retina_metrics_listen(state: ClusterState, node: str) -> str:
    """The node's metrics address: drawn once, then the same at every restart."""
    if node not in state.retina_metrics:
        state.retina_metrics[node] = f"127.0.0.1:{free_port()}"
        state.save()
    return state.retina_metrics[node]


def start_retina_server(state: ClusterState, node: str, env: Mapping[str, str] | None = None,
                        timeout_s: float = 60) -> None:
    import grpc

    log_path = retina_log_path(state, node)
    before = started_count(log_path, "retina_server_started")
    pid = start_process(retina_server_argv(Path(state.config_path)), log_path, {
        "RETINA__RETINA__LISTEN": node,
        "RETINA__RETINA__METRICS_LISTEN": retina_metrics_listen(state, node),
        "RETINA__RETINA__STATE_DIR": str(Path(state.state_dir, "retina-state")),
        **(env or {})})
    state.retina_pids[node] = pid
    state.save()

    def listening() -> bool:
        if not pid_alive(pid):
            raise ClusterError(f"retina-server {node} exited; see {log_path}")
        if started_count(log_path, "retina_server_started") <= before:
            return False  # not bound yet: whatever answers on the port is not this one
        with open_channel(node) as channel:
            future = grpc.channel_ready_future(channel)
            try:
                future.result(timeout=1)
            finally:
                future.cancel()
        return True

    wait_for(listening, timeout_s, f"retina-server {node}")


def stop_retina_server(state: ClusterState, node: str, sig: int = signal.SIGTERM,
                       timeout_s: float = 60) -> bool:
    """Send ``sig`` to the node's process and wait until it is gone (SIGKILL after
    ``timeout_s``); forget its pid. False if no process of it was running."""
    pid = state.retina_pids.pop(node, 0)
    state.save()
    # A pid of 0 would signal our own process group.
    if not pid or not pid_alive(pid):
        return False
    terminate(pid, timeout_s=timeout_s, sig=sig)
    return True


def start_cdc(state: ClusterState, env: Mapping[str, str], timeout_s: float = 30) -> int:
    """Start ``retina-cdc`` (settings as ``RETINA__CDC__*`` overrides in ``env``)."""
    log_path = Path(state.state_dir, "logs", "cdc.log")
    pid = start_process([sys.executable, "-m", "cdc_client", "--config", state.config_path],
                        log_path, env)
    state.cdc_pid = pid
    state.save()
    wait_for(lambda: logged_events(log_path, "cdc_start") or not pid_alive(pid), timeout_s,
             "the CDC connector")
    if not pid_alive(pid):
        raise ClusterError(f"retina-cdc exited at start; see {log_path}")
    return pid


def node_status(node: str) -> GetRetinaStatusResponse | None:
    """A Retina node's GetRetinaStatus answer, or None if it does not answer."""
    import grpc

    from retina_common.pb import retina_pb2, retina_pb2_grpc

    with open_channel(node) as channel:
        try:
            return retina_pb2_grpc.RetinaWorkerServiceStub(channel).GetRetinaStatus(
                retina_pb2.GetRetinaStatusRequest(), timeout=2)
        except grpc.RpcError:
            return None


def node_state(node: str) -> int | None:
    """A Retina node's lifecycle state (GetRetinaStatus), or None if it does not answer."""
    status = node_status(node)
    return None if status is None else status.state


def stop_cluster(state: ClusterState, log: Callable[[str], None] = print) -> None:
    if state.cdc_pid:
        terminate(state.cdc_pid)
        log("cdc         stopped")
        state.cdc_pid = 0
    for node in list(state.retina_pids):
        if stop_retina_server(state, node):
            log(f"retina      {node} stopped")
    if state.trans_pid:
        terminate(state.trans_pid)
        log("transserver stopped")
    stop_postgres(state.postgres.data_dir)
    log("postgresql  stopped")
    if state.etcd.pid:
        terminate(state.etcd.pid)
        log("etcd        stopped")
    state.trans_pid = 0
    state.etcd.pid = 0
    state.save()
