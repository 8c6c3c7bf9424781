"""The campaign's long-lived cluster: etcd, PostgreSQL (source + catalog), TransServer,
Retina nodes, ``retina-cdc`` and the application writer (``chaos/app_writer.py``), each
process supervised through its own ``Popen``.

``devtools.cluster`` starts the infrastructure; the Retina, TransServer and
connector processes are spawned here instead of through ``start_process`` because the
campaign must read their exit codes (137 means "died at the failpoint"), and a ``Popen``
object that is dropped lets ``subprocess`` reap the child behind our back.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import psycopg2

from devtools.cluster import (
    ClusterError,
    ClusterState,
    _as_postgres,
    _pg_bin,
    free_port,
    grpc_serving,
    node_state,
    retina_server_argv,
    start_cluster,
    start_etcd,
    stop_cluster,
    terminate,
    trans_server_argv,
    wait_for,
    write_config,
)
from retina_common.catalog import Catalog
from retina_common.pb import retina_pb2 as rpb
from retina_common.topology import load_topology

from . import wide
from .workload import APP_TABLE, REPLICATED, SCHEMA, SOURCE_DB, create_source, create_tables

TRANS = "trans"
CDC = "cdc"
CDC_NAME = "chaos-cdc"
# The application writer: its process name here, and its writer id (a replay source).
WRITER = "writer"
APP_WRITER_ID = "chaos-app"
# Few virtual nodes: every (table, vnode) stream written in an episode makes its own
# small file, and the comparison reads every file of every table.
VIRTUAL_NODES = 4
# Small buffers and short intervals so publishes, file boundaries, checkpoints and
# changelog retention happen all the time, not once per campaign.
# The GC maintenance round (fold + prune) every 5 s instead of 30 s: folds race the GC
# passes' prepares (FOLD_FENCE) and prunes race the recoveries within an episode or two.
# Sweepers on, with short settings, so that sweeping happens under load in every episode
# (issue 11): a round every 2 s while READY; a retired file falls due 8 s after its GC swap
# (two checkpoints, 3 s, release the slots before that), so a rewrite stays revertible for
# a few seconds and is then swept; final GC journal records go 10 s after their last
# change once their files are settled; temporary files after 2 min (it must exceed the GC
# prepare TTL, 60 s here: a campaign's GC pass lasts seconds).
RETINA_SETTINGS = {"block_rows": 32, "blocks_per_file": 2, "flush_interval_ms": 400,
                   "checkpoint_interval_ms": 1500, "lifecycle_ttl_s": 5,
                   "gc_interval_ms": 5000, "sweeper_interval_ms": 2000,
                   "gc_retired_retention_ms": 8000, "gc_lineage_retention_ms": 10_000,
                   "gc_prepare_ttl_ms": 60_000, "temporary_file_ttl_ms": 120_000,
                   # A bulk load's record (and the files it holds from the sweepers) goes
                   # 20 s after its commit (and two checkpoints past it), not after the
                   # default 10 min: the storage audit's 90 s for a retired file applies
                   # to load files too. 20 s outlasts the loader's commit retries
                   # (bulk_loads.DEADLINE_S), so a retried commit is answered from it.
                   "load_record_min_age_ms": 20_000}
# History (docs/history.md): AS OF reads reach back 20 s beyond live reads and pins. An
# episode takes 10 to 20 s, and the campaign reads snapshots of the last five episodes
# again AS OF their point (chaos/repeatable_reads.py): the previous episode's are mostly
# still readable (answered exactly), older ones expired (refused snapshot_expired), so
# both outcomes come up in every few episodes; the sweepers' retired files wait 20 s
# longer, well inside the storage audit's 90 s.
HISTORY_RETENTION_MS = 20_000
TRANS_SETTINGS = {"ts_block_size": 32, "write_lease_ms": 5000,
                  "history_retention_ms": HISTORY_RETENTION_MS}
# snapshot_chunk_rows: the rows the source holds before the connector first starts
# (workload.PRELOADED_ROWS per table) are loaded by its initial snapshot in many chunks.
CDC_SETTINGS = {"retention_interval_s": 2, "node_check_interval_ms": 250,
                "write_lease_ms": 2000, "batch_max_rows": 400, "snapshot_mode": "initial",
                "snapshot_chunk_rows": 40}


@dataclass
class Proc:
    """One supervised process: its ``Popen`` and the failpoints it was started with."""

    popen: subprocess.Popen[bytes]
    failpoints: str = ""
    started_at: float = field(default_factory=time.monotonic)

    @property
    def pid(self) -> int:
        return self.popen.pid

    def exit_code(self) -> int | None:
        return self.popen.poll()


class ChaosCluster:
    """Everything the campaign starts, kills and restarts."""

    def __init__(self, state_dir: Path, nodes: int = 2, log: Callable[[str], None] = print,
                 ) -> None:
        self.state_dir = state_dir.resolve()
        self.log = log
        self.node_count = nodes
        self.procs: dict[str, Proc] = {}
        self.lock = threading.Lock()
        self.state: ClusterState | None = None
        self.source_dsn = ""
        self.etcd_ports: tuple[int, int] = (0, 0)
        # Told of every status observation (node, send time, state): the readiness
        # tracker needs the send time of each "not READY" answer.
        self.observer: Callable[[str, float, int | None, int], None] | None = None
        self.on_node_start: Callable[[str, int], None] | None = None

    # --- start / stop ---------------------------------------------------------------
    def boot(self) -> None:
        """Start the whole cluster and wait until every node is READY."""
        quiet: Callable[[str], None] = lambda _m: None  # noqa: E731
        nodes = [f"127.0.0.1:{free_port()}" for _ in range(self.node_count)]
        # durable=True: the campaign crashes PostgreSQL (pg_ctl stop -m immediate), and with
        # synchronous_commit=off that loses commits the catalog's clients were told about.
        self.state = start_cluster(self.state_dir, nodes=nodes, virtual_nodes=VIRTUAL_NODES,
                                   durable=True, start_trans=False, log=quiet)
        st = self.state
        self.etcd_ports = (st.etcd.client_port, st.etcd.peer_port)
        write_config(Path(st.config_path), etcd_endpoint=st.etcd.endpoint,
                     dsn=st.postgres.dsn(), topology_file=Path(st.topology_path),
                     storage_root=self.state_dir / "storage", trans_listen=st.trans_listen,
                     trans_metrics=st.trans_metrics,
                     extra={"retina": RETINA_SETTINGS, "trans": TRANS_SETTINGS,
                            "cdc": self._cdc_settings()})
        # The wide table's routes: [[cdc.routes]] tables, only in the config file (no
        # environment override sets them); every process reads them, the connector uses them.
        with open(st.config_path, "a") as config:
            config.write(wide.routes_toml())
        self.source_dsn = create_source(st.postgres)
        wide.create_sources(self.source_dsn)
        catalog = Catalog(st.postgres.dsn())
        try:
            create_tables(catalog, load_topology(st.topology_path))
        finally:
            catalog.close()
        self.start_trans()
        self.wait_trans()
        self._parallel([lambda n=n: self.start_node(n) for n in st.nodes])
        self.start_cdc()
        self._wait_booted(120)

    def _wait_booted(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while not self.all_ready():
            for name, proc in self.procs.items():
                if proc.exit_code() is not None:  # fail fast, with the reason
                    raise ClusterError(f"{name} exited {proc.exit_code()} at start:\n"
                                       f"{self.log_tail(name, 12)}")
            if time.monotonic() >= deadline:
                raise ClusterError(f"not every Retina node READY after {timeout_s:.0f}s: "
                                   f"{self.node_states()}")
            time.sleep(0.1)  # polling interval, bounded by the deadline

    def _cdc_settings(self) -> dict[str, object]:
        return {**CDC_SETTINGS, "name": CDC_NAME, "source": "postgres", "schema": SCHEMA,
                "slot": "chaos_slot", "publication": "chaos_pub",
                "metrics_listen": f"127.0.0.1:{free_port()}",
                "changelog_root": str(self.state_dir / "changelog"),
                # The routed sources too: published, so the connector receives them.
                "source_tables": ",".join([*(f"public.{t.name}" for t in REPLICATED),
                                           *wide.SOURCE_TABLES])}

    def _parallel(self, actions: list[Callable[[], None]]) -> None:
        errors: list[BaseException] = []

        def run(action: Callable[[], None]) -> None:
            try:
                action()
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=run, args=(a,)) for a in actions]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]

    def stop(self) -> None:
        for name in list(self.procs):
            self.kill(name, signal.SIGKILL)
        if self.state is not None:
            self.state.retina_pids.clear()
            self.state.cdc_pid = self.state.trans_pid = 0
            stop_cluster(self.state, log=lambda _m: None)

    def remove(self) -> None:
        """Delete the state directory, and PostgreSQL's if it had to live elsewhere."""
        if self.state is not None and not Path(self.state.postgres.data_dir).is_relative_to(
                self.state_dir):
            shutil.rmtree(self.state.postgres.data_dir, ignore_errors=True)
        shutil.rmtree(self.state_dir, ignore_errors=True)

    # --- supervised processes -----------------------------------------------------------
    @property
    def nodes(self) -> list[str]:
        assert self.state is not None
        return list(self.state.nodes)

    def log_tail(self, name: str, lines: int = 25) -> str:
        path = self.log_path(name)
        if not path.exists():
            return ""
        with open(path, "rb") as f:
            f.seek(max(0, path.stat().st_size - 20000))
            text = f.read().decode(errors="replace")
        return "\n".join(text.splitlines()[-lines:])

    def log_path(self, name: str) -> Path:
        file = name.replace(":", "-").replace(".", "_")
        return self.state_dir / "logs" / f"{file}.log"

    def _spawn(self, name: str, argv: list[str], env: Mapping[str, str], failpoints: str,
               pipes: bool = False) -> Proc:
        """Start ``name``, its output into its log file; with ``pipes``, its standard input
        and output are pipes to the campaign instead (its standard error is the log)."""
        with open(self.log_path(name), "ab") as log:
            log.write(f"\n--- chaos: start {name} failpoints={failpoints!r}\n".encode())
            log.flush()
            # RETINA_FAILPOINT_DIR: where a ``block`` point announces its hit and waits
            # for its release (the stalled-write fault, chaos/stalls.py).
            popen = subprocess.Popen(argv, stdin=subprocess.PIPE if pipes else None,
                                     stdout=subprocess.PIPE if pipes else log,
                                     stderr=log if pipes else subprocess.STDOUT,
                                     env={**os.environ, **env, "RETINA_FAILPOINTS": failpoints,
                                          "RETINA_FAILPOINT_DIR": str(self.failpoint_dir(name))},
                                     start_new_session=True)
        proc = Proc(popen, failpoints)
        with self.lock:
            self.procs[name] = proc
        return proc

    def failpoint_dir(self, name: str) -> Path:
        """The process's RETINA_FAILPOINT_DIR (created on first use)."""
        path = self.state_dir / "failpoints" / name.replace(":", "-")
        path.mkdir(parents=True, exist_ok=True)
        return path

    def start_node(self, node: str, failpoints: str = "") -> Proc:
        assert self.state is not None
        env = {"RETINA__RETINA__LISTEN": node, "RETINA__RETINA__METRICS_LISTEN": "off",
               "RETINA__RETINA__STATE_DIR": str(self.state_dir / "retina-state")}
        proc = self._spawn(node, retina_server_argv(Path(self.state.config_path)), env,
                           failpoints)
        if self.on_node_start is not None:
            self.on_node_start(node, proc.pid)
        return proc

    def start_trans(self, failpoints: str = "") -> Proc:
        assert self.state is not None
        return self._spawn(TRANS, trans_server_argv(Path(self.state.config_path)), {},
                           failpoints)

    def wait_trans(self, timeout_s: float = 30) -> None:
        assert self.state is not None
        listen = self.state.trans_listen
        wait_for(lambda: self.alive(TRANS) and grpc_serving(listen), timeout_s,
                 "the TransServer to serve")

    def start_cdc(self, failpoints: str = "", drive_recovery: bool = True) -> Proc:
        """The connector; ``drive_recovery=False`` is the operator's setting while the
        Spark replay job recovers a node (docs/spark.md): it only waits for READY."""
        assert self.state is not None
        argv = [sys.executable, "-m", "cdc_client", "--config", self.state.config_path]
        env = {"RETINA__CDC__SOURCE_DSN": self.source_dsn,
               "RETINA__CDC__DRIVE_RECOVERY": str(drive_recovery).lower()}
        return self._spawn(CDC, argv, env, failpoints)

    def start_writer(self, failpoints: str = "") -> Proc:
        """The application writer (``chaos/app_writer.py``), its standard input and output
        pipes to the campaign (``chaos/app_workload.py`` drives it)."""
        assert self.state is not None
        argv = [sys.executable, "-m", "chaos.app_writer", "--config", self.state.config_path,
                "--writer", APP_WRITER_ID, "--table", f"{SCHEMA}.{APP_TABLE.name}"]
        return self._spawn(WRITER, argv, {}, failpoints, pipes=True)

    def start(self, name: str, failpoints: str = "") -> Proc:
        """(Re)start the process ``name`` (a node id, ``trans`` or ``cdc``)."""
        if name == TRANS:
            return self.start_trans(failpoints)
        if name == CDC:
            return self.start_cdc(failpoints)
        return self.start_node(name, failpoints)

    def alive(self, name: str) -> bool:
        proc = self.procs.get(name)
        return proc is not None and proc.exit_code() is None

    def exit_code(self, name: str) -> int | None:
        proc = self.procs.get(name)
        return None if proc is None else proc.exit_code()

    def kill(self, name: str, sig: int = signal.SIGKILL, timeout_s: float = 20) -> None:
        """Send ``sig`` and wait until the process is gone (SIGKILL after the timeout)."""
        proc = self.procs.get(name)
        if proc is None or proc.exit_code() is not None:
            return
        try:
            proc.popen.send_signal(sig)
            proc.popen.wait(timeout_s)
        except subprocess.TimeoutExpired:
            proc.popen.kill()
            proc.popen.wait(20)

    def wait_exit(self, name: str, timeout_s: float) -> int | None:
        proc = self.procs.get(name)
        if proc is None:
            return None
        try:
            return proc.popen.wait(timeout_s)
        except subprocess.TimeoutExpired:
            return None

    # --- lifecycle ----------------------------------------------------------------------
    def node_states(self) -> dict[str, int | None]:
        states: dict[str, int | None] = {}
        for node in self.nodes:
            sent_at = time.monotonic()
            states[node] = node_state(node)
            if self.observer is not None:
                proc = self.procs.get(node)
                pid = proc.pid if proc is not None and proc.exit_code() is None else 0
                self.observer(node, sent_at, states[node], pid)
        return states

    def all_ready(self) -> bool:
        return all(s == rpb.READY for s in self.node_states().values())

    # --- infrastructure restarts -----------------------------------------------------------
    def restart_etcd(self, down_s: float = 0.5) -> None:
        assert self.state is not None
        terminate(self.state.etcd.pid)
        time.sleep(down_s)  # the outage itself, not synchronisation
        etcd = start_etcd(Path(self.state.etcd.data_dir), self.state_dir / "logs" / "etcd.log",
                          ports=self.etcd_ports)
        self.state.etcd = etcd
        self.state.save()

    def restart_postgres(self, down_s: float = 0.5, mode: str = "immediate") -> str:
        """Stop the one server holding the source and the catalog, then start it on its
        port. Returns a note if a fast shutdown had to be escalated to immediate."""
        assert self.state is not None
        pg = self.state.postgres
        note = ""
        if not self._pg_ctl_stop(pg.data_dir, mode, 8):
            # A fast shutdown waits for each walsender to have its WAL confirmed, and the
            # connector confirms only what Retina committed, which needs the catalog.
            note = f"pg_ctl stop -m {mode} did not finish in 8s: escalated to immediate"
            self._pg_ctl_stop(pg.data_dir, "immediate", 30)
        time.sleep(down_s)  # the outage itself, not synchronisation
        self.start_postgres()
        return note

    def _pg_ctl_stop(self, data_dir: str, mode: str, timeout_s: int) -> bool:
        result = subprocess.run(_as_postgres([_pg_bin("pg_ctl"), "-D", data_dir, "-m", mode,
                                              "-w", "-t", str(timeout_s), "stop"]),
                                capture_output=True, check=False)
        return result.returncode == 0

    def start_postgres(self) -> None:
        assert self.state is not None
        pg = self.state.postgres
        options = [f"-p {pg.port}", "-c listen_addresses=127.0.0.1",
                   f"-c unix_socket_directories={pg.data_dir}", "-c max_connections=200",
                   "-c wal_level=logical", "-c max_wal_senders=20",
                   "-c max_replication_slots=20"]  # durable, as at the first start
        log_path = self.state_dir / "logs" / "postgres.log"
        result = subprocess.run(_as_postgres([_pg_bin("pg_ctl"), "-D", pg.data_dir, "-l",
                                              str(log_path), "-w", "-t", "60", "-o",
                                              " ".join(options), "start"]),
                                capture_output=True, text=True, check=False)
        if result.returncode != 0:
            raise ClusterError(f"PostgreSQL did not restart: {result.stderr.strip()}")
        wait_for(pg.accepting, 60, "PostgreSQL to accept connections again")

    def postgres_up(self) -> bool:
        assert self.state is not None
        try:
            return self.state.postgres.accepting()
        except psycopg2.Error:
            return False

    def source_connect(self) -> psycopg2.extensions.connection:
        return psycopg2.connect(self.source_dsn, connect_timeout=5)


__all__ = ["APP_WRITER_ID", "CDC", "CDC_NAME", "SOURCE_DB", "TRANS", "WRITER", "ChaosCluster",
           "Proc"]
