"""Recovery in sequences: cold streams over two restarts, a crash between replay and
MarkReady, MarkReady against an etcd outage, the order of READY and its hooks, and a
read transaction that spans a restart. Real processes throughout; every check compares a
gated snapshot with the model."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2

from devtools.cluster import EtcdInstance, start_etcd, terminate
from retina_common import failpoints
from retina_common.catalog import Catalog, FileType
from retina_common.etcd import EtcdStore
from retina_common.keys import checkpoint_slot_key
from retina_common.pb import retina_pb2 as rpb
from retina_common.pb import trans_pb2 as tpb

from .dataplane import DataPlane
from .support import eventually, rpc_error
from .test_recovery_protocol import health, lifecycle_state, open_attempt, order

pytestmark = pytest.mark.integration


def event(i: int) -> dict:
    return {"tenant": i % 3, "seq": i, "payload": bytes([i % 251]), "ok": i % 2 == 0}


def restart_and_recover(plane: DataPlane, node: str) -> None:
    plane.retinas[node].kill9()
    plane.retinas[node].start()
    plane.recover(node)


def files_of(catalog: Catalog, plane: DataPlane, table: str, kind: FileType) -> set[int]:
    paths = {p.path_id for p in catalog.get_paths(plane.tables[table].table_id)}
    return {f.file_id for f in catalog.get_files_by_type(None, [kind]) if f.path_id in paths}


# --- issue 9, defect 1: a cold stream survives any number of restarts ------------------------
def test_a_table_not_written_since_the_restart_survives_two_more_restarts(
        make_plane: Callable[..., DataPlane], catalog: Catalog) -> None:
    plane = make_plane()
    node = plane.nodes[0]
    for t in range(3):
        plane.commit({"events": {"replaces": [event(100 * t + i) for i in range(20)]}})
    for t in range(5):
        plane.commit({"orders": {"replaces": [order(100 * t + i) for i in range(15)]}})
    # Wait for the flush: every events file published, none left in a write buffer.
    eventually(lambda: files_of(catalog, plane, "events", FileType.REGULAR) and
               not files_of(catalog, plane, "events", FileType.TEMPORARY_INGEST), 30,
               "the events files to be published")
    plane.checkpoint(node)
    published = files_of(catalog, plane, "events", FileType.REGULAR)
    for _round in range(3):
        restart_and_recover(plane, node)  # each READY takes a checkpoint of its own
        assert plane.read("events") == plane.model.rows["events"]
        assert plane.read("orders") == plane.model.rows["orders"]
    assert published <= files_of(catalog, plane, "events", FileType.REGULAR)
    assert not published & files_of(catalog, plane, "events", FileType.RETIRED)
    # The table is still writable after all that, and reads back exactly.
    plane.commit({"events": {"deletes": [event(0)], "replaces": [event(7000)]}})
    assert plane.read("events") == plane.model.rows["events"]


# --- issue 14.1 / issue 9 defect 2: replay, crash before MarkReady, replay again -------------
def keys_in_vnode(plane: DataPlane, table: str, vnode: int, make: Callable[[int], dict],
                  count: int, start: int) -> list[dict]:
    rows, i = [], start
    writer = plane.writers[table]
    while len(rows) < count:
        row = make(i)
        if plane.topology.vnode_of_key(writer.key(row)) == vnode:
            rows.append(row)
        i += 1
    return rows


@pytest.mark.parametrize("second_crash", ["sigkill", "barrier"])
def test_a_crash_between_replay_and_mark_ready_duplicates_nothing(
        make_plane: Callable[..., DataPlane], catalog: Catalog, second_crash: str) -> None:
    # Small blocks and files, and no timer flush: table A keeps rows in the write
    # buffer at the checkpoint, table B has two full (published) files, one vnode.
    plane = make_plane(block_rows=8, blocks_per_file=2, flush_interval_ms=600_000)
    node = plane.nodes[0]
    vnode = plane.topology.vnodes_of(node)[0]
    buffered = keys_in_vnode(plane, "events", vnode, event, 3, 0)
    plane.commit({"events": {"replaces": buffered}})  # A: the vnode's earliest unsafe insert
    b_rows = keys_in_vnode(plane, "orders", vnode, order, 32, 0)
    for i in range(0, 32, 8):
        plane.commit({"orders": {"replaces": b_rows[i:i + 8]}})
    eventually(lambda: len(files_of(catalog, plane, "orders", FileType.REGULAR)) == 2, 20,
               "table B's two full files to be published")
    plane.commit({"orders": {"replaces": [b_rows[0]]}})  # raise the HWM past B
    plane.checkpoint(node)
    retina = plane.retinas[node]
    retina.kill9()
    retina.start()
    _status, starts, context = open_attempt(plane, node)
    assert starts.vnode_replay_from_ts[vnode] < starts.checkpoint_applied_ts
    for request in plane.replay_requests(node, starts, rpb.VNODE, context):
        retina.stub.UpdateRecord(request)  # the whole replay...
    if second_crash == "sigkill":
        retina.kill9()  # ...and a crash before MarkReady
    else:
        retina.kill9()
        retina.start(failpoints="recovery.mark_ready.barrier.after=exit(137)")
        with pytest.raises(grpc.RpcError):
            plane.recover(node)  # the process dies inside the barrier
        assert retina.wait_exit() == 137
    retina.start()
    plane.recover(node)
    for table in ("orders", "events"):
        assert plane.read(table) == plane.model.rows[table]  # read() fails on a duplicate
    # A DELETE of every key of B after all this leaves nothing behind (no phantom).
    plane.commit({"orders": {"deletes": [{"id": r["id"]} for r in b_rows]}})
    assert plane.read("orders") == plane.model.rows["orders"]


# --- issue 9, defects 4 and 5: MarkReady, etcd, and the order of READY and its hooks ---------
@pytest.fixture
def private_etcd(tmp_path: Path) -> Iterator[tuple[EtcdInstance, Path]]:
    inst = start_etcd(tmp_path / "etcd", tmp_path / "etcd.log")
    yield inst, tmp_path
    terminate(inst.pid)


def test_mark_ready_survives_an_etcd_outage(private_etcd: tuple[EtcdInstance, Path],
                                            catalog: Catalog, catalog_dsn: str,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """etcd away at MarkReady's first step (the replay-source registry,
    EVERY_SOURCE_REPLAYED): nothing changes, a retry passes. etcd away at its last
    (announcing READY): the node is READY inside with its hooks run, the heartbeat
    announces it once etcd is back, a retried MarkReady is harmless."""
    inst, workdir = private_etcd
    gate_dir = workdir / "failpoints"
    gate_dir.mkdir()
    monkeypatch.setenv(failpoints.DIR_VAR, str(gate_dir))
    point = "recovery.mark_ready.announce.before"
    store = EtcdStore([inst.endpoint], timeout_s=3)
    plane = DataPlane(workdir / "plane", store, catalog, catalog_dsn, nodes=1,
                      retina={"flush_interval_ms": 200, "lifecycle_ttl_s": 3})

    def restart_etcd() -> None:
        inst.pid = start_etcd(Path(inst.data_dir), workdir / "etcd.log",
                              ports=(inst.client_port, inst.peer_port)).pid

    try:
        node = plane.nodes[0]
        plane.start(failpoints={node: f"{point}=block*1"}, recover=False)
        status = plane.wait_replay_ready(node)
        request = rpb.MarkReadyRequest(recovery_attempt_token=status.recovery_attempt_token,
                                       checkpoint_id=status.checkpoint_id)
        stub = plane.retinas[node].stub
        terminate(inst.pid)  # etcd goes away just as MarkReady arrives
        err = rpc_error(lambda: stub.MarkReady(request, timeout=60))
        assert err.code() == grpc.StatusCode.UNAVAILABLE, err.details()
        assert "replay-source registry" in (err.details() or "")
        assert plane.status(node).phase == "AWAITING_REPLAY"  # nothing changed
        restart_etcd()
        answered: list[grpc.RpcError | None] = []
        retried = threading.Thread(target=lambda: answered.append(
            rpc_error(lambda: stub.MarkReady(request, timeout=60))), daemon=True)
        retried.start()
        failpoints.wait_hit(gate_dir, point)
        terminate(inst.pid)  # and again, just before READY is announced
        failpoints.release(gate_dir, point)
        retried.join(60)
        assert answered and answered[0] is not None
        assert answered[0].code() == grpc.StatusCode.UNAVAILABLE, answered[0].details()
        assert plane.status(node).state == rpb.READY  # READY inside, hooks done
        assert health(node) == health_pb2.HealthCheckResponse.NOT_SERVING
        restart_etcd()
        # The heartbeat announces READY by itself; a retried MarkReady is harmless.
        eventually(lambda: lifecycle_state(store, node) == "READY", 30, "READY in etcd")
        eventually(lambda: health(node) == health_pb2.HealthCheckResponse.SERVING, 10,
                   "health to follow the READY the heartbeat announced")
        stub.MarkReady(request, timeout=60)
        assert health(node) == health_pb2.HealthCheckResponse.SERVING
        eventually(plane.gate_open, 15, "the gate to admit")
        plane.commit({"orders": {"replaces": [order(i) for i in range(40)]}})
        assert plane.read("orders") == plane.model.rows["orders"]
        # The hooks ran: the flush timer publishes, checkpoints are taken.
        eventually(lambda: catalog.get_files_by_type(None, [FileType.REGULAR]), 20,
                   "the flush timer to publish the rows")
        assert plane.checkpoint(node).checkpoint_id > 0
        restart_and_recover(plane, node)
        assert plane.read("orders") == plane.model.rows["orders"]
    finally:
        plane.stop()


def test_ready_is_announced_only_after_its_hooks(make_plane: Callable[..., DataPlane],
                                                 etcd: EtcdStore, tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    gate_dir = tmp_path / "failpoints"
    gate_dir.mkdir()
    monkeypatch.setenv(failpoints.DIR_VAR, str(gate_dir))
    point = "recovery.mark_ready.announce.before"
    plane = make_plane(failpoints=f"{point}=block", recover=False)
    node = plane.nodes[0]
    retina = plane.retinas[node]
    status = plane.wait_replay_ready(node)
    done = threading.Event()
    errors: list[Exception] = []

    def mark_ready() -> None:
        try:
            retina.stub.MarkReady(rpb.MarkReadyRequest(
                recovery_attempt_token=status.recovery_attempt_token,
                checkpoint_id=status.checkpoint_id), timeout=60)
        except Exception as exc:
            errors.append(exc)
        done.set()

    threading.Thread(target=mark_ready, daemon=True).start()
    failpoints.wait_hit(gate_dir, point)
    # Inside: READY with its hooks run (the READY checkpoint exists) ...
    assert plane.status(node).state == rpb.READY
    assert etcd.get(checkpoint_slot_key(node, "current")) is not None
    # ... but queries are still refused everywhere.
    assert lifecycle_state(etcd, node) == "RECOVERING"
    assert not plane.gate_open()
    assert health(node) == health_pb2.HealthCheckResponse.NOT_SERVING
    failpoints.release(gate_dir, point)
    assert done.wait(30) and not errors
    assert lifecycle_state(etcd, node) == "READY"
    eventually(plane.gate_open, 15, "the gate to admit")


# --- issue 9, defect 6: a read transaction that spans a restart -------------------------------
def test_a_read_transaction_spanning_a_restart_is_refused(
        make_plane: Callable[..., DataPlane], catalog: Catalog) -> None:
    plane = make_plane()
    node = plane.nodes[0]
    plane.commit({"orders": {"replaces": [order(i) for i in range(60)]}})
    eventually(lambda: catalog.get_files_by_type(None, [FileType.REGULAR]), 20, "a publish")
    assert plane.reader is not None
    stub = plane.trans.stub()
    old = stub.BeginTrans(tpb.BeginTransRequest(read_only=True, lease_ms=120_000), timeout=10)
    before = plane.read("orders")
    plane.commit({"orders": {"deletes": [{"id": i} for i in range(0, 60, 2)]}})
    for i in range(2):  # the HWM moves past the deletes
        plane.commit({"events": {"replaces": [event(i)]}})
    plane.checkpoint(node)  # its base folds the deletes, which the old snapshot must not see
    restart_and_recover(plane, node)
    err = rpc_error(lambda: plane.reader.read_in(old, "shop", "orders"))
    assert err.code() == grpc.StatusCode.ABORTED, err.details()
    assert "begin a new read transaction" in err.details()
    # A new transaction reads the current state; the old snapshot's rows were not lost.
    assert plane.read("orders") == plane.model.rows["orders"]
    assert len(before) == 60 and len(plane.model.rows["orders"]) == 30


# --- outcome unknown: the catalog and etcd applied a change, the caller heard nothing -------
def test_outcome_unknown_from_the_catalog_and_etcd_converges(
        make_plane: Callable[..., DataPlane], catalog: Catalog, etcd: EtcdStore) -> None:
    # The first REGULAR publish and the first etcd transaction after start (the READY
    # checkpoint's slot swap) both commit and then lose their answer.
    plane = make_plane(failpoints="catalog.update_file.commit.after=raise*1;"
                                  "etcd.txn.commit.after=raise*1")
    node = plane.nodes[0]
    plane.commit({"orders": {"replaces": [order(i) for i in range(50)]}})
    eventually(lambda: len(catalog.get_files_by_type(None, [FileType.REGULAR])) >= 2, 20,
               "files published past the unknown outcome")
    assert plane.status(node).state == rpb.READY, plane.retinas[node].log_tail()
    pointer = plane.checkpoint(node)
    assert pointer.checkpoint_id > 0
    log = plane.retinas[node].log_path.read_text()
    # The lost catalog answer was retried, and a checkpoint was installed past the lost
    # etcd answer (the READY checkpoint's swap or this one).
    assert "ingest_publish_retry" in log, plane.retinas[node].log_tail()
    assert "checkpoint_installed" in log, plane.retinas[node].log_tail()
    assert plane.read("orders") == plane.model.rows["orders"]
    restart_and_recover(plane, node)
    assert plane.read("orders") == plane.model.rows["orders"]


def test_reads_of_a_transaction_that_is_not_live_are_refused(
        make_plane: Callable[..., DataPlane], catalog: Catalog) -> None:
    plane = make_plane()
    node = plane.nodes[0]
    plane.commit({"orders": {"replaces": [order(i) for i in range(40)]}})
    eventually(lambda: catalog.get_files_by_type(None, [FileType.REGULAR]), 20, "a publish")
    file_id = catalog.get_files_by_type(None, [FileType.REGULAR])[0].file_id
    stub, trans = plane.retinas[node].stub, plane.trans.stub()
    read = trans.BeginTrans(tpb.BeginTransRequest(read_only=True), timeout=10)
    write = trans.BeginTrans(tpb.BeginTransRequest(read_only=False), timeout=10)

    def visibility(trans_id: int) -> rpb.QueryVisibilityResponse:
        return stub.QueryVisibility(rpb.QueryVisibilityRequest(
            file_id=file_id, timestamp=read.timestamp, trans_id=trans_id), timeout=10)

    def write_buffer(trans_id: int) -> rpb.GetWriteBufferResponse:
        return stub.GetWriteBuffer(rpb.GetWriteBufferRequest(
            schema_name="shop", table_name="orders", timestamp=read.timestamp,
            trans_id=trans_id), timeout=10)

    assert visibility(read.trans_id).row_groups  # live: answered
    for call in (visibility, write_buffer):
        assert rpc_error(lambda c=call: c(0)).code() == grpc.StatusCode.INVALID_ARGUMENT
        assert rpc_error(lambda c=call: c(write.trans_id)).code() == \
            grpc.StatusCode.FAILED_PRECONDITION
    trans.RollbackTrans(tpb.RollbackTransRequest(trans_id=write.trans_id), timeout=10)
    trans.CommitTrans(tpb.CommitTransRequest(trans_id=read.trans_id), timeout=10)
    for call in (visibility, write_buffer):  # ended: refused once the cached answer lapses
        err = eventually(lambda c=call: rpc_error(lambda: c(read.trans_id)), 10,
                         "the ended transaction to be refused")
        assert err.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "no longer live" in err.details()


def test_an_interrupted_barrier_is_finished_by_the_next_mark_ready(
        make_plane: Callable[..., DataPlane]) -> None:
    # The first MarkReady fails after it closed the replay entry (BARRIER); the node
    # must not stay there: the retried MarkReady finishes the barrier.
    plane = make_plane(failpoints="recovery.mark_ready.drain.after=raise*1", recover=False)
    node = plane.nodes[0]
    status = plane.wait_replay_ready(node)
    request = rpb.MarkReadyRequest(recovery_attempt_token=status.recovery_attempt_token,
                                   checkpoint_id=status.checkpoint_id)
    stub = plane.retinas[node].stub
    assert rpc_error(lambda: stub.MarkReady(request, timeout=30)).code() == \
        grpc.StatusCode.INTERNAL
    assert plane.status(node).phase == "BARRIER"
    stub.MarkReady(request, timeout=30)
    assert plane.status(node).state == rpb.READY
    eventually(plane.gate_open, 15, "the gate to admit")
    plane.commit({"orders": {"replaces": [order(i) for i in range(10)]}})
    assert plane.read("orders") == plane.model.rows["orders"]
