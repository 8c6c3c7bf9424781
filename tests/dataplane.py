"""Harness for data-plane and recovery tests: a TransServer, Retina nodes, tables,
a writer, a changelog, a model, and a recovery driver standing in for the CDC side.

Every process is real (``retina-trans``, ``retina-server``), with real etcd,
PostgreSQL and storage. A Retina node starts RECOVERING; ``recover`` drives it
the way the CDC connector does: GetRetinaStatus → GetRecoveryReplayTs →
replay the changelog from the reported starts (inclusive, DELETE + INSERT,
with the RecoveryReplayContext) → MarkReady.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from devtools.cluster import PostgresInstance, free_ports, started_count, write_config
from retina_common.catalog import Catalog, ColumnSpec, TableRecord
from retina_common.client import CHANNEL_OPTIONS, TableWriter, requests_by_node
from retina_common.etcd import EtcdStore
from retina_common.pb import retina_pb2 as rpb
from retina_common.pb import retina_pb2_grpc, trans_pb2_grpc
from retina_common.pb import trans_pb2 as tpb
from retina_common.reader import SnapshotReader
from retina_common.recovery_driver import (
    await_gate_ready,
    drive_recovery,
    replay_requests,
    wait_replay_ready,
)
from retina_common.refusal import transport_lost
from retina_common.retry import until_deadline
from retina_common.topology import Topology
from retina_common.writer import DurableWriter, WriterSettings

from .support import ChildProcess, TransServerProcess, delete_prefix, eventually

SCHEMA = "shop"
TABLES: dict[str, tuple[list[ColumnSpec], list[str]]] = {
    "orders": ([ColumnSpec("id", "int64"), ColumnSpec("customer", "string"),
                ColumnSpec("amount", "decimal(12,2)"), ColumnSpec("note", "string")], ["id"]),
    "events": ([ColumnSpec("tenant", "int32"), ColumnSpec("seq", "int64"),
                ColumnSpec("payload", "binary"), ColumnSpec("ok", "boolean")], ["tenant", "seq"]),
}


class RetinaProcess(ChildProcess):
    module = "retina_server"
    stop_timeout_s = 60.0

    def __init__(self, node: str, config_path: Path, workdir: Path) -> None:
        super().__init__(config_path, workdir / f"retina-{node.replace(':', '-')}.log")
        self.node = node
        self.channel: grpc.Channel | None = None
        # "host:port" to serve /metrics on (tests that scrape set it before start).
        self.metrics_listen = "off"
        # RETINA__SECTION__KEY overrides of the plane's config for this node's next starts.
        self.env: dict[str, str] = {}

    def start(self, failpoints: str = "", wait: bool = True) -> RetinaProcess:
        before = started_count(self.log_path, "retina_server_started")
        self.spawn(failpoints, {**self.env, "RETINA__RETINA__LISTEN": self.node,
                                "RETINA__RETINA__METRICS_LISTEN": self.metrics_listen})
        if self.channel is not None:
            self.channel.close()
        # A channel of its own subchannels: gRPC shares subchannels between channels to
        # the same address, and the one of the crashed predecessor may still be in its
        # failure backoff, failing the new process's first calls fast.
        self.channel = grpc.insecure_channel(
            self.node, options=[*CHANNEL_OPTIONS, ("grpc.use_local_subchannel_pool", 1)])
        if wait:
            def up() -> bool:
                if not self.alive():
                    raise AssertionError(f"retina {self.node} exited: {self.log_tail()}")
                if started_count(self.log_path, "retina_server_started") <= before:
                    # Not bound yet: a server of another cluster on this machine that drew
                    # the same free port would answer (then this one exits, cannot listen).
                    return False
                future = grpc.channel_ready_future(self.channel)
                try:
                    future.result(timeout=1)
                    return True
                finally:  # a pending future would keep polling a closed channel
                    future.cancel()
            eventually(up, 60, f"Retina {self.node} to listen")
        return self

    @property
    def stub(self) -> retina_pb2_grpc.RetinaWorkerServiceStub:
        assert self.channel is not None
        return retina_pb2_grpc.RetinaWorkerServiceStub(self.channel)

    def stop(self) -> None:
        if self.channel is not None:
            self.channel.close()
        self.terminate()


@dataclass
class Model:
    """What every table must contain after each committed transaction."""

    rows: dict[str, dict[bytes, dict[str, Any]]] = field(default_factory=dict)
    history: list[tuple[int, dict[str, dict[bytes, dict[str, Any]]]]] = field(default_factory=list)

    def snapshot(self) -> dict[str, dict[bytes, dict[str, Any]]]:
        return {t: dict(r) for t, r in self.rows.items()}


class DataPlane:
    def __init__(self, workdir: Path, etcd: EtcdStore, catalog: Catalog, dsn: str,
                 nodes: int = 2, virtual_nodes: int = 8,
                 retina: Mapping[str, object] | None = None,
                 trans: Mapping[str, object] | None = None) -> None:
        self.workdir = workdir
        self.etcd = etcd
        self.catalog = catalog
        self.nodes = [f"127.0.0.1:{port}" for port in free_ports(nodes)]
        self.topology = Topology(tuple(self.nodes), virtual_nodes)
        # trans: TransServer settings (the history retention is 0 unless a test sets it:
        # devtools/cluster.py write_config).
        self.trans = TransServerProcess(workdir / "trans", etcd.endpoint, dsn, self.nodes,
                                        gate={"stale_after_ms": 5000}, trans=trans)
        self.trans.workdir.joinpath("topology.toml").write_text(self.topology.to_toml())
        self.config_path = workdir / "retina.toml"
        # anonymous_writes: the plane is its own replay source (self.changelog, an
        # in-memory model it replays through drive_recovery) and writes without a
        # registered writer id; tests of WRITES_HAVE_A_REPLAY_SOURCE turn it off.
        settings = {"state_dir": str(workdir / "state"), "block_rows": 64, "blocks_per_file": 2,
                    "flush_interval_ms": 300, "max_rows_per_request": 500,
                    "anonymous_writes": True, **(retina or {})}
        write_config(self.config_path, etcd_endpoint=etcd.endpoint, dsn=dsn,
                     topology_file=self.trans.workdir / "topology.toml",
                     storage_root=workdir / "storage", trans_listen=self.trans.address,
                     trans_metrics="off", extra={"retina": settings})
        catalog.create_schema(SCHEMA)
        self.tables: dict[str, TableRecord] = {
            name: catalog.create_table(SCHEMA, name, cols, pk) for name, (cols, pk) in
            TABLES.items()}
        # The columnar form for every part, however small (the default sends small parts
        # in the row form), so the recovery tests drive the form the connector sends.
        self.writers = {n: TableWriter(t, self.topology, min_columnar_rows=1)
                        for n, t in self.tables.items()}
        self.retinas = {n: RetinaProcess(n, self.config_path, workdir) for n in self.nodes}
        self.reader: SnapshotReader | None = None
        self._writer_channels: list[grpc.Channel] = []
        self.model = Model({name: {} for name in self.tables})
        # Every committed source transaction: (timestamp, changes), in commit order.
        self.changelog: list[tuple[int, dict]] = []

    def start(self, failpoints: Mapping[str, str] | None = None,
              recover: bool = True) -> DataPlane:
        self.trans.start()
        for node, proc in self.retinas.items():
            proc.start((failpoints or {}).get(node, ""))
        self.reader = SnapshotReader(self.trans.address, self.topology)
        if recover:
            for node in self.nodes:
                self.recover(node)
            eventually(self.gate_open, 15, "the query gate to admit")
        return self

    def status(self, node: str) -> rpb.GetRetinaStatusResponse:
        return self.retinas[node].stub.GetRetinaStatus(rpb.GetRetinaStatusRequest(), timeout=10)

    def wait_replay_ready(self, node: str, timeout_s: float = 60) -> rpb.GetRetinaStatusResponse:
        return wait_replay_ready(self.retinas[node].stub, timeout_s)

    def replay_requests(self, node: str, starts: rpb.GetRecoveryReplayTsResponse,
                        mode: int, context: rpb.RecoveryReplayContext
                        ) -> list[rpb.UpdateRecordRequest]:
        """The changelog from the replay starts, as this node's replay requests."""
        del mode  # carried by the context
        return list(replay_requests(node, SCHEMA, self.writers, self.changelog, starts, context))

    def recover(self, node: str, mode: int = rpb.VNODE) -> rpb.GetRecoveryReplayTsResponse | None:
        """Drive one node from RECOVERING to READY; returns the replay starts used.

        Like the connector, a node that answers UNAVAILABLE while its process runs
        (a connection lost under load) is driven again from the start; the error of
        a process that is gone is raised with its log attached."""
        proc = self.retinas[node]

        def give_up_unless_transport_lost(exc: BaseException) -> None:
            assert isinstance(exc, grpc.RpcError)
            if not proc.alive():
                exc.add_note(f"retina {node} exited during recovery: {proc.log_tail()}")
                raise exc
            if not transport_lost(exc):
                raise exc

        starts = until_deadline(
            lambda: drive_recovery(proc.stub, mode=mode, replay=lambda starts, ctx:
                                   self.replay_requests(node, starts, mode, ctx)),
            transient=(grpc.RpcError,), deadline_s=60, on_retry=give_up_unless_transport_lost)
        # MarkReady has answered; the TransServer's gate learns READY through its etcd
        # watch a moment later. Until then a read is refused UNAVAILABLE (clients retry):
        # callers that read next wait for it here, as `retina-admin recover` does.
        unseen = await_gate_ready(self.trans.stub(), [node])
        assert not unseen, f"the query gate does not see {node} READY: {unseen}"
        return starts

    def checkpoint(self, node: str) -> rpb.CreateCheckpointResponse:
        return self.retinas[node].stub.CreateCheckpoint(rpb.CreateCheckpointRequest(), timeout=30)

    def gate_open(self) -> bool:
        stub = self.trans.stub()
        try:
            r = stub.BeginTrans(tpb.BeginTransRequest(read_only=True), timeout=5)
        except grpc.RpcError:
            return False
        stub.CommitTrans(tpb.CommitTransRequest(trans_id=r.trans_id), timeout=5)
        return True

    def durable_writer(self, writer_id: str, root: Path,
                       settings: WriterSettings | None = None) -> DurableWriter:
        """An application writer (retina_common/writer.py), opened, with channels of its
        own: a node restarted by a test gets a new channel in the plane, and the writer
        must keep working across that. Its changelog is ``root / writer_id``."""
        nodes = {}
        for node in self.nodes:
            self._writer_channels.append(grpc.insecure_channel(node, options=CHANNEL_OPTIONS))
            nodes[node] = retina_pb2_grpc.RetinaWorkerServiceStub(self._writer_channels[-1])
        self._writer_channels.append(grpc.insecure_channel(self.trans.address))
        return DurableWriter(writer_id, SCHEMA, etcd=self.etcd, catalog=self.catalog,
                             topology=self.topology,
                             trans=trans_pb2_grpc.TransServiceStub(self._writer_channels[-1]),
                             nodes=nodes, changelog_root=str(root / writer_id),
                             settings=settings).open()

    def stop(self, kill: bool = False) -> None:
        """Stop every process: gracefully (SIGTERM, a node checkpoints on its way out), or
        with SIGKILL when the plane is discarded (a fixture's teardown: its state is
        thrown away, so nothing waits for a last checkpoint)."""
        for channel in self._writer_channels:
            channel.close()
        if self.reader is not None:
            self.reader.close()
        for proc in [*self.retinas.values(), self.trans]:
            if kill:
                proc.kill9()
            proc.stop()  # closes its channel (a killed process: nothing left to stop)

    # --- writing -------------------------------------------------------------------
    def commit(self, changes: Mapping[str, Mapping[str, Iterable[Mapping[str, Any]]]],
               writer_id: str = "") -> tuple[int, dict[str, rpb.UpdateRecordResponse]]:
        """One source transaction: ``{table: {"deletes"|"inserts"|"replaces"|"partials":
        rows}}`` (a partial update's row holds its target columns only).

        Sends one request per node (naming ``writer_id``; none: an anonymous write),
        commits after every node acknowledged, and updates the model. Returns the
        timestamp and the responses.
        """
        stub = self.trans.stub()
        trans = stub.BeginTrans(tpb.BeginTransRequest(), timeout=10)
        ts = trans.timestamp
        per_table = []
        for table, ops in changes.items():
            per_table.append(self.writers[table].updates(ts, **{k: list(v) for k, v in
                                                                ops.items()}))
        responses = {}
        try:
            for node, request in requests_by_node(SCHEMA, per_table).items():
                request.writer_id = writer_id
                responses[node] = self.retinas[node].stub.UpdateRecord(request, timeout=30)
        except grpc.RpcError:
            stub.RollbackTrans(tpb.RollbackTransRequest(trans_id=trans.trans_id), timeout=10)
            raise
        stub.CommitTrans(tpb.CommitTransRequest(trans_id=trans.trans_id), timeout=10)
        self.record(ts, changes)
        return ts, responses

    def record(self, ts: int, changes: Mapping[str, Mapping[str, Iterable[Mapping[str, Any]]]]
               ) -> None:
        """One committed source transaction at ``ts`` into the model, its history and the
        plane's changelog (its replay source), as ``commit`` takes it."""
        for table, ops in changes.items():
            rows = self.model.rows[table]
            writer = self.writers[table]
            for row in ops.get("deletes", ()):
                rows.pop(writer.key(row), None)
            for row in [*ops.get("inserts", ()), *ops.get("replaces", ())]:
                rows[writer.key(row)] = dict(row)
            columns = [c.name for c in self.tables[table].columns]
            for row in ops.get("partials", ()):
                key = writer.key(row)
                rows[key] = {**(rows.get(key) or dict.fromkeys(columns)), **row}
        self.model.history.append((ts, self.model.snapshot()))
        self.changelog.append((ts, {t: {k: list(v) for k, v in ops.items()}
                                    for t, ops in changes.items()}))

    # --- reading -------------------------------------------------------------------
    def read(self, table: str) -> dict[bytes, dict[str, Any]]:
        assert self.reader is not None
        # MarkReady returns once READY is in etcd; the gate learns it through its
        # watch a moment later. Wait for that, then read one gated snapshot.
        eventually(self.gate_open, 15, "the query gate to admit a read")
        snap = self.reader.read(SCHEMA, table)
        writer = self.writers[table]
        out = {}
        for row in snap.table.to_pylist():
            key = writer.key(row)
            assert key not in out, f"duplicate row for key {row}"
            out[key] = row
        return out

    def read_at(self, table: str, ts: int) -> dict[bytes, dict[str, Any]]:
        """Read at an older snapshot ``ts`` under a live gated read transaction.

        Valid while nothing folds visibility (no GC runs in these tests)."""
        assert self.reader is not None
        with self.reader.transaction() as live:
            pinned = tpb.BeginTransResponse(trans_id=live.trans_id, timestamp=ts)
            snap = self.reader.read_in(pinned, SCHEMA, table)
        writer = self.writers[table]
        return {writer.key(r): r for r in snap.table.to_pylist()}


@contextmanager
def module_plane(workdir: Path, etcd_endpoint: str, pg_server: PostgresInstance,
                 seed: Mapping[str, Mapping[str, Iterable[Mapping[str, Any]]]]
                 ) -> Iterator[DataPlane]:
    """One data plane for a whole test module (cases that leave it unchanged share it),
    with a catalog database of its own and ``seed`` committed."""
    store = EtcdStore([etcd_endpoint])
    delete_prefix(store, "/pixels/")
    name = f"t_{uuid.uuid4().hex[:12]}"
    pg_server.create_database(name)
    catalog = Catalog(pg_server.dsn(name))
    catalog.bootstrap()
    dp = DataPlane(workdir, store, catalog, pg_server.dsn(name))
    dp.start()
    try:
        dp.commit(seed)
        yield dp
    finally:
        dp.stop(kill=True)
        catalog.close()
        pg_server.drop_database(name)
        delete_prefix(store, "/pixels/")
