"""SNAPSHOT_IS_IMMUTABLE (issue 25): every read at a timestamp S returns the same rows for as
long as S is readable, and is refused otherwise, never answered differently.

Each test is one way a reader used to get a wrong or a changing answer, reproduced through the
public RPCs on real processes, with the model beside them:

1. a write applied after its transaction ended (a lease ran out; a request stalled before or
   inside its apply) changed what an earlier read at S had seen: the write fence;
2. a delete at or below a Storage GC cutoff, acknowledged while the commit ran, was lost for
   good: the fence raised at prepare (and the commit's re-check);
3. a rewrite between a reader's GetWriteBuffer and its ListQueryFiles returned rows twice:
   BUFFER_FETCH_HOLDS_FILE;
4. a read transaction begun before a node restart, answered after it, returned rows twice:
   SNAPSHOTS_END_AT_RESTART.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import grpc
import pyarrow as pa
import pytest

from retina_common import failpoints
from retina_common.catalog import Catalog, FileType
from retina_common.client import requests_by_node
from retina_common.pb import retina_pb2 as rpb
from retina_common.pb import trans_pb2 as tpb
from retina_common.reader import FILE_ID
from retina_common.storage import open_parquet

from . import gc
from .dataplane import SCHEMA, DataPlane
from .support import begin_read, begin_write, eventually, rpc_error
from .test_recovery_protocol import order
from .test_storage_gc import advance, biggest_stream, load

pytestmark = pytest.mark.integration

Rows = dict[bytes, dict[str, Any]]


# --- reading by hand, so a test can stop between the reader's steps ---------------------------
def keyed(plane: DataPlane, table: str, rows: pa.Table) -> Rows:
    """``rows`` by primary key; a key twice is a wrong answer, never merged away."""
    writer = plane.writers[table]
    out: Rows = {}
    for row in rows.to_pylist():
        key = writer.key(row)
        assert key not in out, f"row {row} returned twice"
        out[key] = row
    return out


def fetch_buffers(plane: DataPlane, trans: tpb.BeginTransResponse, table: str) -> list[pa.Table]:
    """The reader's step 2: GetWriteBuffer from every node."""
    assert plane.reader is not None
    return list(plane.reader.fetch_buffers(trans, SCHEMA, table).values())


def list_and_read(plane: DataPlane, trans: tpb.BeginTransResponse, table: str,
                  buffers: list[pa.Table]) -> Rows:
    """The reader's steps 3 to 5: ListQueryFiles, every file at the snapshot, and the
    buffered rows of files not listed."""
    assert plane.reader is not None
    files = plane.reader.list_files(trans, SCHEMA, table)
    return keyed(plane, table, plane.reader.assemble(trans, buffers, files).table)


def read_in(plane: DataPlane, trans: tpb.BeginTransResponse, table: str = "orders") -> Rows:
    return list_and_read(plane, trans, table, fetch_buffers(plane, trans, table))


def end(plane: DataPlane, trans: tpb.BeginTransResponse) -> None:
    plane.trans.stub().CommitTrans(tpb.CommitTransRequest(trans_id=trans.trans_id), timeout=10)


def model_rows(plane: DataPlane, table: str = "orders") -> Rows:
    """The model in the reader's shape (the key columns' values, no hidden columns)."""
    return {k: dict(v) for k, v in plane.model.rows[table].items()}


# --- writing at a timestamp whose transaction we control ----------------------------------------
def request_at(plane: DataPlane, ts: int, *, deletes: list[dict] = (),
               replaces: list[dict] = ()) -> rpb.UpdateRecordRequest:
    (request,) = requests_by_node(SCHEMA, [plane.writers["orders"].updates(
        ts, deletes=list(deletes), replaces=list(replaces))]).values()
    return request


def expire(plane: DataPlane, lease_ms: int = 300) -> tpb.BeginTransResponse:
    """A write transaction whose lease runs out: ended, and the HWM passes it once a later
    transaction commits."""
    stub = plane.trans.stub()
    trans = begin_write(stub, lease_ms=lease_ms)
    lease_runs_out(plane, trans)
    commit = stub.CommitTrans
    assert rpc_error(lambda: commit(tpb.CommitTransRequest(trans_id=trans.trans_id),
                                    timeout=10)).code() == grpc.StatusCode.FAILED_PRECONDITION
    return trans


def send(plane: DataPlane, node: str, request: rpb.UpdateRecordRequest) -> grpc.RpcError | None:
    """UpdateRecord; its refusal, or None when it was acknowledged."""
    try:
        plane.retinas[node].stub.UpdateRecord(request, timeout=30)
    except grpc.RpcError as exc:
        return exc
    return None


def tick(plane: DataPlane) -> None:
    """A write transaction committed with nothing in it: the HWM passes every ended one."""
    stub = plane.trans.stub()
    trans = begin_write(stub)
    stub.CommitTrans(tpb.CommitTransRequest(trans_id=trans.trans_id), timeout=10)


def lease_runs_out(plane: DataPlane, trans: tpb.BeginTransResponse) -> None:
    stub = plane.trans.stub()
    eventually(lambda: not stub.GetTransStatus(tpb.GetTransStatusRequest(
        trans_id=trans.trans_id), timeout=10).live, 30, "the write lease to run out")


def parking_plane(make_plane: Callable[..., DataPlane], point: str
                  ) -> tuple[DataPlane, str, tpb.BeginTransResponse]:
    """A node whose second ordinary write parks at ``point``, its first write done, and a
    write transaction with a short lease for the write that will park."""
    plane = make_plane(failpoints=f"{point}=block@2*1")
    plane.commit({"orders": {"replaces": [order(i) for i in range(20)]}})  # hit 1
    return plane, plane.nodes[0], begin_write(plane.trans.stub(), lease_ms=500)


def gated_read(plane: DataPlane) -> tpb.BeginTransResponse:
    eventually(plane.gate_open, 15, "the query gate to admit")
    return begin_read(plane.trans.stub())


def log_has(plane: DataPlane, node: str, event: str) -> bool:
    return f'"{event}"' in plane.retinas[node].log_path.read_text()


@contextmanager
def parked(failpoint_dir: Path, point: str) -> Iterator[None]:
    """Wait until a thread of the node is parked at ``point``; release it when the block
    ends, however it ends (a failed assertion must not leave a call hanging)."""
    try:
        failpoints.wait_hit(failpoint_dir, point)
        yield
    finally:
        failpoints.release(failpoint_dir, point)


# --- 1. writes after their transaction ended ------------------------------------------------------
def test_a_write_whose_lease_ran_out_is_refused_and_the_snapshot_stays(
        make_plane: Callable[..., DataPlane]) -> None:
    plane = make_plane()
    node = plane.nodes[0]
    plane.commit({"orders": {"replaces": [order(i) for i in range(20)]}})
    late = expire(plane)
    plane.commit({"orders": {"replaces": [order(100)]}})  # the HWM passes the expired one
    trans = gated_read(plane)
    assert trans.timestamp >= late.timestamp
    first = read_in(plane, trans)
    assert first == model_rows(plane)
    # The expired transaction's writer sends its batch now: a DELETE of a live key and a
    # replace of a fresh one, at its old timestamp.
    outcome = send(plane, node, request_at(plane, late.timestamp, deletes=[{"id": 3}],
                                           replaces=[order(500)]))
    assert read_in(plane, trans) == first  # the same snapshot, read again
    assert outcome.code() == grpc.StatusCode.ABORTED, outcome.details()
    assert "write fence" in outcome.details()
    end(plane, trans)
    assert plane.read("orders") == plane.model.rows["orders"]  # nothing of it applied
    # The writer's designed answer, a redo at a new timestamp, is applied.
    plane.commit({"orders": {"deletes": [{"id": 3}], "replaces": [order(500)]}})
    assert plane.read("orders") == plane.model.rows["orders"]


def test_a_write_stalled_before_the_fence_past_its_lease_is_refused(
        make_plane: Callable[..., DataPlane], failpoint_dir: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A request held up on its way in (here: parked before the fence, as behind a GC
    commit's stream lock or in a paused process) reaches the node after its lease ran out
    and a read at a later snapshot was answered: refused, and the read stands."""
    monkeypatch.setenv(failpoints.DIR_VAR, str(failpoint_dir))
    plane, node, late = parking_plane(make_plane, "update_record.fence.before")
    with ThreadPoolExecutor(1) as pool:
        sent: Future = pool.submit(plane.retinas[node].stub.UpdateRecord, request_at(
            plane, late.timestamp, deletes=[{"id": 4}], replaces=[order(501)]), timeout=60)
        with parked(failpoint_dir, "update_record.fence.before"):  # hit 2
            lease_runs_out(plane, late)
            plane.commit({"orders": {"replaces": [order(101)]}})
            trans = gated_read(plane)
            assert trans.timestamp >= late.timestamp
            first = read_in(plane, trans)
            assert first == model_rows(plane)
        with pytest.raises(grpc.RpcError) as refused:
            sent.result(timeout=60)
    assert refused.value.code() == grpc.StatusCode.ABORTED, refused.value.details()
    assert read_in(plane, trans) == first
    end(plane, trans)
    assert plane.read("orders") == plane.model.rows["orders"]


def test_a_read_waits_for_a_write_admitted_before_it(
        make_plane: Callable[..., DataPlane], failpoint_dir: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """FENCE_WAITS_FOR_ADMITTED: a write the fence admitted (parked inside its apply, its
    delete already in visibility, its insert not yet visible) is applied whole before a read
    at a later snapshot looks, so the read sees all of it or none, and every later read at
    that snapshot the same. (Before the fence, GetWriteBuffer waited the same way on the
    write's stream lock; the fence makes it hold for every read and every riser.)"""
    monkeypatch.setenv(failpoints.DIR_VAR, str(failpoint_dir))
    plane, node, late = parking_plane(make_plane, "index.primary_commit.before")
    with ThreadPoolExecutor(2) as pool:
        sent: Future = pool.submit(plane.retinas[node].stub.UpdateRecord, request_at(
            plane, late.timestamp, deletes=[{"id": 5}], replaces=[order(502)]), timeout=60)
        with parked(failpoint_dir, "index.primary_commit.before"):  # admitted, parked
            lease_runs_out(plane, late)
            tick(plane)  # the parked write holds the index's write transaction
            trans = gated_read(plane)
            reading: Future = pool.submit(read_in, plane, trans)
            eventually(lambda: log_has(plane, node, "write_fence_waiting"), 30,
                       "the read to wait for the admitted write")
        sent.result(timeout=60)  # applied: it was admitted before any read passed it
        first = reading.result(timeout=60)
    ids = {r["id"] for r in first.values()}
    assert 5 not in ids and 502 in ids  # the whole write, not half of it
    assert read_in(plane, trans) == first
    end(plane, trans)


# --- 2. a delete at or below a GC cutoff -------------------------------------------------------
def test_a_delete_at_or_below_the_cutoff_during_a_commit_is_refused_never_lost(
        make_plane: Callable[..., DataPlane], catalog: Catalog, failpoint_dir: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Reproduced on the tree before the fence: the DELETE was acknowledged while the commit
    was held, the new file kept the row alive, and the row was back in every later snapshot,
    across restarts."""
    monkeypatch.setenv(failpoints.DIR_VAR, str(failpoint_dir))
    plane = make_plane(failpoints="gc.journal.switching.before=block")
    load(plane, catalog)
    node, vnode, files = biggest_stream(plane)
    late = expire(plane)  # a writer whose lease ran out before the rewrite
    advance(plane)
    prepared = gc.prepare(plane, node, "orders", vnode, files)
    assert prepared.reply.cutoff_ts >= late.timestamp
    new_file = gc.write_new_file(plane, prepared)
    victim = next(iter(gc_rows(plane, prepared)))
    with ThreadPoolExecutor(1) as pool:
        committing: Future = pool.submit(gc.commit, plane, prepared, new_file)
        with parked(failpoint_dir, "gc.journal.switching.before"):
            refused = send(plane, node, request_at(plane, late.timestamp,
                                                   deletes=[{"id": victim}]))
        assert committing.result(timeout=60).outcome == "COMMITTED"
    gc.end(plane, prepared.trans_id)
    if refused is None:  # acknowledged: the user was told the row is gone
        plane.model.rows["orders"].pop(plane.writers["orders"].key({"id": victim}))
    assert plane.read("orders") == plane.model.rows["orders"]
    assert refused is not None and refused.code() == grpc.StatusCode.ABORTED
    # The writer redoes its batch at a new timestamp: the row goes, and stays gone.
    plane.commit({"orders": {"deletes": [{"id": victim}]}})
    assert plane.read("orders") == plane.model.rows["orders"]
    for _ in range(2):
        plane.retinas[node].kill9()
        plane.retinas[node].start()
        plane.recover(node)
        assert plane.read("orders") == plane.model.rows["orders"]
    plane.commit({"orders": {"replaces": [order(victim, note="back")]}})
    assert plane.read("orders") == plane.model.rows["orders"]  # one row, not two


def gc_rows(plane: DataPlane, prepared: gc.Prepared) -> list[int]:
    """Ids of live rows that are in the rewrite's old files."""
    ids = set()
    for f in prepared.old:
        parquet = open_parquet(prepared.reply.path_uri, f.name)
        ids |= set(parquet.read(columns=["id"]).column("id").to_pylist())
    live = {r["id"] for r in plane.model.rows["orders"].values()}
    return sorted(ids & live)


# --- 3. a rewrite between the buffer fetch and the listing --------------------------------------
def test_a_rewrite_between_a_buffer_fetch_and_its_listing_waits_for_the_reader(
        make_plane: Callable[..., DataPlane], catalog: Catalog, failpoint_dir: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Reproduced on the tree before BUFFER_FETCH_HOLDS_FILE: GetWriteBuffer returned a file's
    rows, the file was published and rewritten, ListQueryFiles listed only the new file, and
    the read returned the buffered rows and the new file's rows: every one of them twice."""
    monkeypatch.setenv(failpoints.DIR_VAR, str(failpoint_dir))
    plane = make_plane(failpoints="ingest.close.before=block")  # files stay in the buffers
    node = plane.nodes[0]
    tick(plane)  # so that safeGcTs, below the read's snapshot, is above 0
    plane.commit({"orders": {"replaces": [order(i) for i in range(40)]}})
    with parked(failpoint_dir, "ingest.close.before"):
        trans = gated_read(plane)
        buffers = fetch_buffers(plane, trans, "orders")
        assert sum(b.num_rows for b in buffers) == 40  # every row is still buffered
    path = catalog.get_paths(plane.tables["orders"].table_id)[0]
    eventually(lambda: not catalog.get_files_by_type(path.path_id,
                                                     [FileType.TEMPORARY_INGEST]), 30,
               "every buffered file to be published")
    advance(plane)
    node_, vnode, files = biggest_stream(plane)
    assert node_ == node
    prepared = gc.prepare(plane, node, "orders", vnode, files)
    new_file = gc.write_new_file(plane, prepared)
    try:
        held: grpc.RpcError | None = None
        gc.commit(plane, prepared, new_file)
    except grpc.RpcError as exc:
        held = exc
    assert list_and_read(plane, trans, "orders", buffers) == model_rows(plane)
    assert held is not None and held.code() == grpc.StatusCode.ABORTED
    assert "write-buffer read" in held.details()
    end(plane, trans)
    # The reader has ended: the same prepared rewrite commits now, and reads stay exact.
    assert gc.commit(plane, prepared, new_file).outcome == "COMMITTED"
    gc.end(plane, prepared.trans_id)
    assert plane.read("orders") == plane.model.rows["orders"]


def test_a_buffer_read_met_only_under_the_commits_locks_rolls_the_rewrite_back(
        make_plane: Callable[..., DataPlane], catalog: Catalog, failpoint_dir: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The last window of BUFFER_FETCH_HOLDS_FILE: an old file already REGULAR but not yet
    out of its write buffer (its publish between the registry and the cleanup) is read from
    the buffer after the commit's first check and journal record. The check under the
    stream locks finds the reader: the commit rolls back in place (journal ABORTED), the
    answer says the rewrite is gone, the reader's answer stays exact, and a new rewrite of
    the same files commits once the reader has ended."""
    monkeypatch.setenv(failpoints.DIR_VAR, str(failpoint_dir))
    plane = make_plane(failpoints="ingest.cleanup.before=block;"
                                  "gc.journal.switching.after=block")
    node = plane.nodes[0]
    tick(plane)
    # A replay floor first (GC_CUTOFF_BELOW_REPLAY_FLOOR): a checkpoint waits for the
    # stream locks the parked publish below holds.
    gc.raise_replay_floor(plane)
    plane.commit({"orders": {"replaces": [order(i) for i in range(40)]}})
    path = catalog.get_paths(plane.tables["orders"].table_id)[0]
    # A publish parks with its stream's locks held (and the files behind it wait).
    failpoints.wait_hit(failpoint_dir, "ingest.cleanup.before")
    eventually(lambda: catalog.get_regular_files(path.path_id), 30,
               "the parked file to be REGULAR (and still buffered)")
    advance(plane)
    node_, vnode, files = biggest_stream(plane)  # a stream whose publish is parked
    assert node_ == node
    prepared = gc.prepare(plane, node, "orders", vnode, files, raise_floor=False)
    new_file = gc.write_new_file(plane, prepared)
    with ThreadPoolExecutor(1) as pool:
        try:
            committing: Future = pool.submit(gc.commit, plane, prepared, new_file)
            failpoints.wait_hit(failpoint_dir, "gc.journal.switching.after")
            trans = gated_read(plane)  # after the first check: it saw no reader
            buffers = fetch_buffers(plane, trans, "orders")
            assert sum(b.num_rows for b in buffers) == 40  # from the buffers, every one
            fetched = {i for b in buffers for i in b.column(FILE_ID).to_pylist()}
            assert {f.file_id for f in files} <= fetched  # the old files among them
        finally:
            failpoints.release(failpoint_dir, "gc.journal.switching.after")
            failpoints.release(failpoint_dir, "ingest.cleanup.before")
        refused = rpc_error(lambda: committing.result(timeout=60))
    assert refused.code() == grpc.StatusCode.ABORTED, refused.details()
    assert "rolled back for a write-buffer read" in refused.details()
    assert "held by a write-buffer read" not in refused.details()  # nothing to ask again
    assert gc.journal(plane, node)[prepared.reply.rewrite_id].state == "ABORTED"
    assert {f.file_id for f in gc.streams(plane, "orders")[(node, vnode)]} == \
        {f.file_id for f in files}  # the old files stay, as they were
    assert list_and_read(plane, trans, "orders", buffers) == model_rows(plane)
    again = rpc_error(lambda: gc.commit(plane, prepared, new_file))
    assert again.code() == grpc.StatusCode.FAILED_PRECONDITION  # the rewrite is gone
    gc.end(plane, prepared.trans_id)
    end(plane, trans)
    assert gc.rewrite(plane, node, "orders", vnode, files).outcome == "COMMITTED"
    assert plane.read("orders") == plane.model.rows["orders"]


# --- 4. a read transaction that spans a node restart --------------------------------------------
def test_a_read_begun_before_a_restart_is_refused_after_it(
        make_plane: Callable[..., DataPlane], catalog: Catalog, failpoint_dir: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Reproduced on the tree before SNAPSHOTS_END_AT_RESTART: a read transaction at S fetched
    11 buffered rows, the node was killed and recovered, the replayed rows were published as a
    new file, and the same transaction listed it and returned the 11 rows twice."""
    monkeypatch.setenv(failpoints.DIR_VAR, str(failpoint_dir))
    plane = make_plane(failpoints="ingest.close.before=block")
    node = plane.nodes[0]
    plane.commit({"orders": {"replaces": [order(i) for i in range(30)]}})
    plane.checkpoint(node)
    plane.commit({"orders": {"replaces": [order(i) for i in range(30, 41)],
                             "deletes": [{"id": 7}]}})
    trans = gated_read(plane)
    buffers = fetch_buffers(plane, trans, "orders")
    assert sum(b.num_rows for b in buffers) == len(plane.model.rows["orders"])
    plane.retinas[node].kill9()
    plane.retinas[node].start()  # without the failpoint: the replayed rows publish
    plane.recover(node)
    path = catalog.get_paths(plane.tables["orders"].table_id)[0]
    eventually(lambda: catalog.get_regular_files(path.path_id) and not
               catalog.get_files_by_type(path.path_id, [FileType.TEMPORARY_INGEST]), 30,
               "the replayed rows to be published")
    refused = rpc_error(lambda: list_and_read(plane, trans, "orders", buffers))
    assert refused.code() == grpc.StatusCode.ABORTED, refused.details()
    # A whole new read of the same transaction is refused too, never answered differently.
    again = rpc_error(lambda: read_in(plane, trans))
    assert again.code() == grpc.StatusCode.ABORTED, again.details()
    end(plane, trans)
    assert plane.read("orders") == plane.model.rows["orders"]


def test_a_read_after_a_timestamp_it_was_not_granted_is_refused(
        make_plane: Callable[..., DataPlane]) -> None:
    """A read names its transaction and a timestamp; one after the transaction's snapshot
    would read a snapshot nobody granted and raise the write fence above live writes."""
    plane = make_plane()
    node = plane.nodes[0]
    plane.commit({"orders": {"replaces": [order(1)]}})
    trans = gated_read(plane)
    live = begin_write(plane.trans.stub())
    ahead = tpb.BeginTransResponse(trans_id=trans.trans_id, timestamp=live.timestamp + 10)
    error = rpc_error(lambda: fetch_buffers(plane, ahead, "orders"))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, error.details()
    # The live write is not fenced by it.
    plane.retinas[node].stub.UpdateRecord(request_at(plane, live.timestamp,
                                                     replaces=[order(2)]), timeout=30)
    plane.trans.stub().CommitTrans(tpb.CommitTransRequest(trans_id=live.trans_id), timeout=10)
    end(plane, trans)
    assert {r["id"] for r in plane.read("orders").values()} == {1, 2}

