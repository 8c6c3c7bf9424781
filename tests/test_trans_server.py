"""The TransServer process over gRPC with real etcd and PostgreSQL."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import psycopg2
import pytest
import requests
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from devtools.cluster import EtcdInstance, PostgresInstance, free_port, start_etcd, terminate
from retina_common.catalog import Catalog, ColumnSpec, FileType
from retina_common.etcd import EtcdStore
from retina_common.keys import lifecycle_key
from retina_common.lifecycle_record import LifecycleState
from retina_common.pb import retina_pb2 as rpb
from retina_common.pb import trans_pb2 as tpb

from .dataplane import SCHEMA, DataPlane
from .support import (
    TransServerProcess,
    begin_read,
    begin_write,
    eventually,
    now_ms,
    put_lifecycle,
    rpc_error,
)

pytestmark = pytest.mark.integration

NODE_A, NODE_B = "127.0.0.1:41001", "127.0.0.1:41002"
NODES = [NODE_A, NODE_B]


@pytest.fixture
def trans_factory(tmp_path: Path, etcd_server: EtcdInstance, etcd: EtcdStore, catalog: Catalog,
                  catalog_dsn: str) -> Iterator[Callable[..., TransServerProcess]]:
    started: list[TransServerProcess] = []

    def make(**kwargs: object) -> TransServerProcess:
        endpoint = kwargs.pop("etcd_endpoint", etcd_server.endpoint)
        proc = TransServerProcess(tmp_path / f"trans{len(started)}", str(endpoint), catalog_dsn,
                                  NODES, **kwargs)  # type: ignore[arg-type]
        started.append(proc)
        return proc

    yield make
    for proc in started:
        proc.stop()


@pytest.fixture
def trans(trans_factory: Callable[..., TransServerProcess]) -> TransServerProcess:
    return trans_factory(gate={"stale_after_ms": 3000}).start()


def all_ready(etcd: EtcdStore) -> None:
    for node in NODES:
        put_lifecycle(etcd, node, LifecycleState.READY)


def gate_admits(trans: TransServerProcess) -> bool:
    """Probe the gate with a read-only transaction, ended at once so that it
    holds back neither the safe GC timestamp nor anything else."""
    try:
        probe = begin_read(trans.stub())
    except grpc.RpcError as exc:
        if exc.code() == grpc.StatusCode.UNAVAILABLE:
            return False
        raise
    trans.stub().CommitTrans(tpb.CommitTransRequest(trans_id=probe.trans_id), timeout=5)
    return True


# --- timestamps ---
def test_timestamps_survive_kill9_restart(trans_factory: Callable[..., TransServerProcess],
                                          etcd: EtcdStore) -> None:
    server = trans_factory(trans={"ts_block_size": 5}).start()
    before = []
    for _ in range(12):  # several blocks
        w = begin_write(server.stub())
        before.append(w.timestamp)
        server.stub().CommitTrans(tpb.CommitTransRequest(trans_id=w.trans_id), timeout=5)
    batch = server.stub().BeginTransBatch(tpb.BeginTransBatchRequest(count=7), timeout=5)
    before += [t.timestamp for t in batch.transactions]
    assert before == sorted(set(before))
    assert server.kill9() == -9
    server.start()
    after = [begin_write(server.reconnect()).timestamp for _ in range(12)]
    assert after == sorted(set(after))
    assert min(after) > max(before)
    hwm = server.stub().GetHighWatermark(tpb.GetHighWatermarkRequest(), timeout=5).high_watermark
    assert hwm >= max(before)  # everything of the previous incarnation has ended


@pytest.mark.parametrize("counter", ["ts_block", "txid_block"])
@pytest.mark.parametrize("point", ["persist.before", "persist.after"])
def test_kill_at_block_failpoints(trans_factory: Callable[..., TransServerProcess],
                                  etcd: EtcdStore, counter: str, point: str) -> None:
    server = trans_factory(trans={"ts_block_size": 4})
    # Hit 1 is the reservation at start-up; hit 2 is the first block taken while serving.
    server.start(failpoints=f"trans.{counter}.{point}=exit(137)@2")
    issued = []
    with pytest.raises(grpc.RpcError):
        for _ in range(10):
            issued.append(begin_write(server.stub()))
    assert server.wait_exit() == 137
    assert len(issued) == 4  # the first block, then the crash while taking the second
    server.start()
    stub = server.reconnect()
    later = [begin_write(stub) for _ in range(6)]
    for field in ("timestamp", "trans_id"):
        before = [getattr(t, field) for t in issued]
        after = [getattr(t, field) for t in later]
        assert min(after) > max(before), field
        assert after == sorted(set(after)), field
    err = rpc_error(lambda: stub.CommitTrans(tpb.CommitTransRequest(trans_id=issued[0].trans_id)))
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION and "restart" in err.details()


def test_an_etcd_outage_at_a_block_boundary_is_unavailable_then_heals(
        trans_factory: Callable[..., TransServerProcess], tmp_path: Path) -> None:
    """A new timestamp block needs etcd: while it is away the answer is UNAVAILABLE
    (retry), never UNKNOWN (which a client reads as a refusal), and the same server
    serves again once etcd is back."""
    from devtools.cluster import start_etcd, terminate

    private = start_etcd(tmp_path / "etcd", tmp_path / "etcd.log")
    try:
        server = trans_factory(trans={"ts_block_size": 4}, etcd_endpoint=private.endpoint)
        server.start()
        stub = server.stub()
        issued = [begin_write(stub) for _ in range(2)]
        terminate(private.pid)
        errors = []
        for _ in range(8):  # runs past the end of the current block
            try:
                issued.append(begin_write(stub))
            except grpc.RpcError as exc:
                errors.append(exc.code())
        assert errors and set(errors) == {grpc.StatusCode.UNAVAILABLE}, errors
        restarted = start_etcd(tmp_path / "etcd", tmp_path / "etcd.log",
                               ports=(private.client_port, private.peer_port))
        private.pid = restarted.pid
        later = eventually(lambda: begin_write(stub), 30, "a write transaction after etcd returns")
        assert later.timestamp > max(t.timestamp for t in issued)
    finally:
        terminate(private.pid)


# --- transactions and the HWM ---
def test_hwm_with_out_of_order_commits_and_rollbacks(trans: TransServerProcess) -> None:
    stub = trans.stub()
    w1, w2, w3, w4 = (begin_write(stub) for _ in range(4))
    assert w1.timestamp < w2.timestamp < w3.timestamp < w4.timestamp

    def hwm() -> int:
        return stub.GetHighWatermark(tpb.GetHighWatermarkRequest(), timeout=5).high_watermark

    assert hwm() == w1.timestamp - 1
    assert stub.CommitTrans(tpb.CommitTransRequest(trans_id=w3.trans_id)).high_watermark \
        == w1.timestamp - 1
    assert stub.RollbackTrans(tpb.RollbackTransRequest(trans_id=w1.trans_id)).high_watermark \
        == w2.timestamp - 1
    stub.CommitTrans(tpb.CommitTransRequest(trans_id=w2.trans_id))
    assert hwm() == w4.timestamp - 1  # w3 already ended, so the prefix reaches w4
    stub.RollbackTrans(tpb.RollbackTransRequest(trans_id=w4.trans_id))
    assert hwm() == w4.timestamp


def test_the_status_of_a_write_by_its_timestamp_is_live_until_it_ends(
        trans: TransServerProcess) -> None:
    """GetTransStatus(timestamp): what a recovery replay asks (APPLIED_OR_LIVE)."""
    stub = trans.stub()
    w1, w2 = begin_write(stub), begin_write(stub)

    def live(ts: int) -> bool:
        return stub.GetTransStatus(tpb.GetTransStatusRequest(timestamp=ts), timeout=5).live

    status = stub.GetTransStatus(tpb.GetTransStatusRequest(timestamp=w1.timestamp))
    assert status.live and not status.read_only and status.timestamp == w1.timestamp
    assert live(w2.timestamp) and not live(w2.timestamp + 1000)  # never issued
    stub.CommitTrans(tpb.CommitTransRequest(trans_id=w1.trans_id))
    stub.RollbackTrans(tpb.RollbackTransRequest(trans_id=w2.trans_id))
    assert not live(w1.timestamp) and not live(w2.timestamp)
    err = rpc_error(lambda: stub.GetTransStatus(
        tpb.GetTransStatusRequest(trans_id=w2.trans_id, timestamp=w1.timestamp)))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_ending_unknown_or_ended_transactions_is_refused(trans: TransServerProcess) -> None:
    stub = trans.stub()
    w, other = begin_write(stub), begin_write(stub)
    stub.CommitTrans(tpb.CommitTransRequest(trans_id=w.trans_id))
    err = rpc_error(lambda: stub.CommitTrans(tpb.CommitTransRequest(trans_id=w.trans_id)))
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION and "committed" in err.details()
    err = rpc_error(lambda: stub.RollbackTrans(tpb.RollbackTransRequest(trans_id=w.trans_id)))
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION
    err = rpc_error(lambda: stub.CommitTrans(tpb.CommitTransRequest(trans_id=10**12)))
    assert err.code() == grpc.StatusCode.NOT_FOUND
    err = rpc_error(lambda: stub.RollbackTrans(tpb.RollbackTransRequest(trans_id=0)))
    assert err.code() == grpc.StatusCode.NOT_FOUND
    # A batch with one ended id commits nothing.
    err = rpc_error(lambda: stub.CommitTransBatch(
        tpb.CommitTransBatchRequest(trans_ids=[other.trans_id, w.trans_id])))
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION
    hwm = stub.GetHighWatermark(tpb.GetHighWatermarkRequest()).high_watermark
    assert hwm == other.timestamp - 1  # `other` is still live
    assert stub.CommitTransBatch(tpb.CommitTransBatchRequest(trans_ids=[other.trans_id])) \
        .high_watermark == other.timestamp
    err = rpc_error(lambda: stub.BeginTransBatch(tpb.BeginTransBatchRequest(count=0)))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_expired_write_lease_is_rolled_back(trans: TransServerProcess) -> None:
    stub = trans.stub()
    w = begin_write(stub, lease_ms=300)
    assert stub.GetHighWatermark(tpb.GetHighWatermarkRequest()).high_watermark < w.timestamp
    eventually(lambda: stub.GetHighWatermark(tpb.GetHighWatermarkRequest()).high_watermark
               >= w.timestamp, 10, "the HWM to pass the expired transaction")
    err = rpc_error(lambda: stub.CommitTrans(tpb.CommitTransRequest(trans_id=w.trans_id)))
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "lease expired" in err.details()


def test_extended_lease_keeps_a_transaction_alive(trans: TransServerProcess) -> None:
    stub = trans.stub()
    w = begin_write(stub, lease_ms=400)
    for _ in range(4):
        stub.ExtendTransLease(tpb.ExtendTransLeaseRequest(trans_id=w.trans_id, lease_ms=400))
        time.sleep(0.2)  # pacing the client's own renewals, not synchronisation
    stub.CommitTrans(tpb.CommitTransRequest(trans_id=w.trans_id), timeout=5)


def test_transactions_from_before_a_restart_are_ended(trans: TransServerProcess) -> None:
    w = begin_write(trans.stub())
    trans.kill9()
    trans.start()
    err = rpc_error(lambda: trans.reconnect().CommitTrans(
        tpb.CommitTransRequest(trans_id=w.trans_id)))
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION and "restart" in err.details()


# --- the query gate ---
def test_write_transactions_are_not_gated(trans: TransServerProcess) -> None:
    assert begin_write(trans.stub()).timestamp > 0
    assert not gate_admits(trans)


def test_gate_refuses_missing_nodes_and_names_them(trans: TransServerProcess) -> None:
    err = rpc_error(lambda: begin_read(trans.stub()))
    assert err.code() == grpc.StatusCode.UNAVAILABLE
    assert f"{NODE_A} is missing" in err.details() and f"{NODE_B} is missing" in err.details()
    err = rpc_error(lambda: trans.stub().BeginTransBatch(
        tpb.BeginTransBatchRequest(read_only=True, count=3)))
    assert err.code() == grpc.StatusCode.UNAVAILABLE


@pytest.mark.parametrize("write_b, expected", [
    (lambda s: put_lifecycle(s, NODE_B, LifecycleState.RECOVERING), f"{NODE_B} is RECOVERING"),
    (lambda s: put_lifecycle(s, NODE_B, LifecycleState.FAILED), f"{NODE_B} is FAILED"),
    (lambda s: put_lifecycle(s, NODE_B, LifecycleState.READY, updated_at_ms=now_ms() - 60_000),
     f"{NODE_B} is stale"),
    (lambda s: s.put(lifecycle_key(NODE_B), b"{not json"), f"{NODE_B} is malformed"),
    (lambda s: s.put(lifecycle_key(NODE_B), b'{"state": "READY", "node": "' + NODE_A.encode()
                     + b'", "checkpointId": 1, "recoveryEpoch": 1, "tokenHash": "",'
                     b' "updatedAtMs": 1}'), f"{NODE_B} is malformed"),
    (lambda s: s.delete(lifecycle_key(NODE_B)), f"{NODE_B} is missing"),
])
def test_gate_refuses_each_bad_case_then_admits_when_ready(
        trans: TransServerProcess, etcd: EtcdStore, write_b: Callable[[EtcdStore], None],
        expected: str) -> None:
    all_ready(etcd)
    eventually(lambda: gate_admits(trans), 10, "the gate to admit with every node READY")
    write_b(etcd)
    eventually(lambda: not gate_admits(trans), 10, "the gate to close")
    err = rpc_error(lambda: begin_read(trans.stub()))
    assert err.code() == grpc.StatusCode.UNAVAILABLE
    assert expected in err.details() and f"{NODE_A} is" not in err.details()
    put_lifecycle(etcd, NODE_B, LifecycleState.READY)
    eventually(lambda: gate_admits(trans), 10, "the gate to reopen")


def test_read_only_snapshot_is_the_hwm(trans: TransServerProcess, etcd: EtcdStore) -> None:
    stub = trans.stub()
    all_ready(etcd)
    eventually(lambda: gate_admits(trans), 10, "the gate to admit")
    live = begin_write(stub)
    r = begin_read(stub)
    assert r.timestamp == live.timestamp - 1
    stub.CommitTrans(tpb.CommitTransRequest(trans_id=live.trans_id))
    assert begin_read(stub).timestamp == live.timestamp


def test_gate_closes_within_the_lease_ttl_after_a_key_expires(
        trans: TransServerProcess, etcd: EtcdStore) -> None:
    ttl = 2
    put_lifecycle(etcd, NODE_A, LifecycleState.READY)
    lease = etcd.grant_lease(ttl)
    put_lifecycle(etcd, NODE_B, LifecycleState.READY, lease_id=lease)
    eventually(lambda: gate_admits(trans), 10, "the gate to admit")
    # No keepalive from here on: node B "crashes". The staleness bound (3 s)
    # is longer than the TTL, so only the key's expiry can close the gate in time.
    started = time.monotonic()
    eventually(lambda: not gate_admits(trans), ttl + 2, "the gate to close after the lease ran out")
    assert time.monotonic() - started <= ttl + 2
    assert etcd.get(lifecycle_key(NODE_B)) is None
    assert f"{NODE_B} is missing" in rpc_error(lambda: begin_read(trans.stub())).details()


def test_heartbeats_keep_the_gate_open_and_their_absence_closes_it(
        trans: TransServerProcess, etcd: EtcdStore) -> None:
    all_ready(etcd)
    deadline = time.monotonic() + 4  # longer than stale_after_ms = 3 s
    while time.monotonic() < deadline:
        all_ready(etcd)  # what a live Retina node does
        assert gate_admits(trans)
        time.sleep(0.5)
    eventually(lambda: not gate_admits(trans), 6, "stale values to close the gate")
    assert "stale" in rpc_error(lambda: begin_read(trans.stub())).details()


def test_gate_fails_closed_while_etcd_is_down_and_recovers(
        trans_factory: Callable[..., TransServerProcess], base_dir: Path, etcd: EtcdStore) -> None:
    own = start_etcd(base_dir / f"etcd-own-{free_port()}", base_dir / "etcd-own.log")
    store = EtcdStore([own.endpoint])
    try:
        server = trans_factory(etcd_endpoint=own.endpoint, gate={"watch_retry_ms": 200}).start()
        for node in NODES:
            put_lifecycle(store, node, LifecycleState.READY)
        eventually(lambda: gate_admits(server), 10, "the gate to admit")
        terminate(own.pid)
        eventually(lambda: not gate_admits(server), 10, "the gate to close when etcd goes away")
        assert "lifecycle" in rpc_error(lambda: begin_read(server.stub())).details()
        restarted = start_etcd(Path(own.data_dir), base_dir / "etcd-own.log",
                               ports=(own.client_port, own.peer_port))
        own = restarted
        for node in NODES:
            put_lifecycle(store, node, LifecycleState.READY)
        eventually(lambda: gate_admits(server), 20, "the gate to reopen after etcd came back")
    finally:
        terminate(own.pid)


def test_disabled_retina_means_no_gate(trans_factory: Callable[..., TransServerProcess]) -> None:
    server = trans_factory(gate={"retina_enabled": False}).start()
    assert gate_admits(server)


# --- ListQueryFiles and the safe GC timestamp ---
@pytest.fixture
def orders(catalog: Catalog) -> dict[str, int]:
    catalog.create_schema("shop")
    table = catalog.create_table("shop", "orders", [ColumnSpec("id", "int64")], ["id"])
    p = catalog.add_path(table.table_id, "file:///data/orders").path_id
    ids = {
        "regular": catalog.add_file("h-1_20260101000000_1_0.parquet", FileType.REGULAR, 2, p,
                                    0, 99).file_id,
        "ingest": catalog.add_file("h-1_20260101000000_2_0.parquet", FileType.TEMPORARY_INGEST,
                                   0, p).file_id,
        "gc": catalog.add_file("h-1_20260101000000_3_0.parquet", FileType.TEMPORARY_GC, 1, p,
                               100, 150).file_id,
        "retired": catalog.add_file("h-1_20260101000000_4_0.parquet", FileType.RETIRED, 1, p,
                                    200, 250, cleanup_at=1).file_id,
    }
    return ids


def list_files(trans: TransServerProcess, trans_id: int, table: str = "orders"
               ) -> tpb.ListQueryFilesResponse:
    return trans.stub().ListQueryFiles(
        tpb.ListQueryFilesRequest(trans_id=trans_id, schema_name="shop", table_name=table),
        timeout=5)


def test_list_query_files_returns_regular_files_for_a_gated_read(
        trans: TransServerProcess, etcd: EtcdStore, orders: dict[str, int]) -> None:
    all_ready(etcd)
    eventually(lambda: gate_admits(trans), 10, "the gate to admit")
    r = begin_read(trans.stub())
    reply = list_files(trans, r.trans_id)
    assert [f.file_id for f in reply.files] == [orders["regular"]]
    assert reply.files[0].path_uri == "file:///data/orders"
    assert (reply.files[0].min_row_id, reply.files[0].max_row_id) == (0, 99)
    assert reply.snapshot_ts == r.timestamp
    err = rpc_error(lambda: list_files(trans, r.trans_id, table="nope"))
    assert err.code() == grpc.StatusCode.NOT_FOUND


def test_list_query_files_refusals(trans: TransServerProcess, etcd: EtcdStore,
                                   orders: dict[str, int]) -> None:
    stub = trans.stub()
    all_ready(etcd)
    eventually(lambda: gate_admits(trans), 10, "the gate to admit")
    w = begin_write(stub)
    assert rpc_error(lambda: list_files(trans, w.trans_id)).code() == \
        grpc.StatusCode.FAILED_PRECONDITION
    assert rpc_error(lambda: list_files(trans, 10**12)).code() == grpc.StatusCode.NOT_FOUND
    ended = begin_read(stub)
    stub.CommitTrans(tpb.CommitTransRequest(trans_id=ended.trans_id))
    assert rpc_error(lambda: list_files(trans, ended.trans_id)).code() == \
        grpc.StatusCode.FAILED_PRECONDITION
    err = rpc_error(lambda: stub.ListQueryFiles(tpb.ListQueryFilesRequest(trans_id=1)))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    # A read admitted earlier is ungated once a node leaves READY.
    live = begin_read(stub)
    put_lifecycle(etcd, NODE_A, LifecycleState.RECOVERING)
    eventually(lambda: not gate_admits(trans), 10, "the gate to close")
    err = rpc_error(lambda: list_files(trans, live.trans_id))
    assert err.code() == grpc.StatusCode.UNAVAILABLE and f"{NODE_A} is RECOVERING" in err.details()


def test_safe_gc_ts_stays_below_live_reads(trans: TransServerProcess, etcd: EtcdStore) -> None:
    stub = trans.stub()
    all_ready(etcd)
    eventually(lambda: gate_admits(trans), 10, "the gate to admit")

    def safe() -> int:
        return stub.GetSafeGcTimestamp(tpb.GetSafeGcTimestampRequest()).safe_gc_ts

    w = begin_write(stub)
    stub.CommitTrans(tpb.CommitTransRequest(trans_id=w.trans_id))
    old_read = begin_read(stub)
    for _ in range(3):
        x = begin_write(stub)
        stub.CommitTrans(tpb.CommitTransRequest(trans_id=x.trans_id))
    new_read = begin_read(stub)
    assert safe() == old_read.timestamp - 1
    stub.MarkTransOffloaded(tpb.MarkTransOffloadedRequest(trans_id=old_read.trans_id))
    assert safe() == new_read.timestamp - 1
    stub.CommitTrans(tpb.CommitTransRequest(trans_id=new_read.trans_id))
    hwm = stub.GetHighWatermark(tpb.GetHighWatermarkRequest()).high_watermark
    assert safe() == hwm - 1
    err = rpc_error(lambda: stub.MarkTransOffloaded(
        tpb.MarkTransOffloadedRequest(trans_id=begin_write(stub).trans_id)))
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION


# --- one error path: a catalog condition answers as on a node ---
def set_catalog_connections(pg_server: PostgresInstance, dsn: str, allowed: bool) -> None:
    """Let PostgreSQL take connections to the catalog's database, or refuse them all (the
    open ones are ended): the catalog is down for every process, nothing else is."""
    dbname = dict(part.split("=", 1) for part in dsn.split())["dbname"]
    conn = psycopg2.connect(pg_server.dsn("postgres"), connect_timeout=5)
    try:
        conn.autocommit = True
        with conn.cursor() as cur:
            cur.execute(f'ALTER DATABASE "{dbname}" ALLOW_CONNECTIONS {str(allowed).lower()}')
            if not allowed:
                cur.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                            "WHERE datname = %s", (dbname,))
    finally:
        conn.close()


def unknown_table_answers(plane: DataPlane, read: tpb.BeginTransResponse
                          ) -> list[tuple[grpc.StatusCode, str]]:
    """What the TransServer (ListQueryFiles) and the node (GetWriteBuffer) answer for a
    table the catalog must be asked about: the status and the details."""
    table = "no_such_table"
    listed = rpc_error(lambda: plane.trans.stub().ListQueryFiles(tpb.ListQueryFilesRequest(
        trans_id=read.trans_id, schema_name=SCHEMA, table_name=table), timeout=10))
    buffered = rpc_error(lambda: plane.retinas[plane.nodes[0]].stub.GetWriteBuffer(
        rpb.GetWriteBufferRequest(trans_id=read.trans_id, timestamp=read.timestamp,
                                  schema_name=SCHEMA, table_name=table), timeout=10))
    return [(err.code(), err.details() or "") for err in (listed, buffered)]


def test_a_catalog_outage_answers_as_on_a_node(make_plane: Callable[..., DataPlane],
                                               pg_server: PostgresInstance,
                                               catalog_dsn: str) -> None:
    """Both servers map catalog failures through retina_common/refusal.py: for the same
    catalog condition (a table it does not know; then the catalog refusing connections;
    then the catalog back) the TransServer answers the status and the words a node does."""
    plane = make_plane()
    read = begin_read(plane.trans.stub())
    before = unknown_table_answers(plane, read)
    assert [code for code, _ in before] == [grpc.StatusCode.NOT_FOUND] * 2, before
    assert before[0][1] == before[1][1]
    set_catalog_connections(pg_server, catalog_dsn, allowed=False)
    try:
        during = unknown_table_answers(plane, read)
    finally:
        set_catalog_connections(pg_server, catalog_dsn, allowed=True)
    assert [code for code, _ in during] == [grpc.StatusCode.UNAVAILABLE] * 2, during
    assert all(details.startswith("CatalogUnavailable: ") for _, details in during), during
    assert unknown_table_answers(plane, read) == before


# --- operability: health, reflection, metrics ---
def test_health_reflection_and_metrics(trans: TransServerProcess) -> None:
    with grpc.insecure_channel(trans.address) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        status = health.Check(health_pb2.HealthCheckRequest(service="retina.trans.v1.TransService"))
        assert status.status == health_pb2.HealthCheckResponse.SERVING
        reflect = reflection_pb2_grpc.ServerReflectionStub(channel)
        replies = reflect.ServerReflectionInfo(iter([
            reflection_pb2.ServerReflectionRequest(list_services="")]))
        names = {s.name for r in replies for s in r.list_services_response.service}
        assert "retina.trans.v1.TransService" in names
    rpc_error(lambda: begin_read(trans.stub()))
    text = requests.get(f"http://{trans.metrics}/metrics", timeout=5).text
    assert 'trans_gate_refusals_total{reason="missing"}' in text
    assert "trans_gate_decision_seconds_bucket" in text
    assert "trans_high_watermark" in text
