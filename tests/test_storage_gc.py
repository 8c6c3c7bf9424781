"""Storage GC, the commit side on a real Retina node (issue 10): a rewrite reclaims deleted
rows and compacts files while reads stay exact; a kill at every GC failpoint is followed by
recovery's decision from the journal and a whole-snapshot comparison with the model;
deletes racing the rewrite are never lost; a read transaction older than the rewrite keeps
reading its snapshot; refusals change nothing."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import grpc
import pyarrow as pa
import pytest

from retina_common.catalog import Catalog, FileType
from retina_common.codec import COMMIT_TS, GC_REWRITE_ID_KEY
from retina_common.pb import retina_pb2 as rpb
from retina_common.pb import trans_pb2 as tpb
from retina_common.reader import HIDDEN
from retina_common.refusal import AWAITING_CHECKPOINT
from spark_jobs.storage_gc_arrow import new_file_schema

from . import gc
from .dataplane import SCHEMA, DataPlane
from .support import eventually, rpc_error
from .test_recovery_protocol import order
from .test_recovery_sequences import restart_and_recover


def settle(plane: DataPlane, catalog: Catalog, table: str = "orders") -> None:
    """Wait until every row of ``table`` is in a published file (nothing buffered)."""
    path = catalog.get_paths(plane.tables[table].table_id)[0]

    def published() -> bool:
        plane.retinas[plane.nodes[0]].stub.CreateCheckpoint(rpb.CreateCheckpointRequest(),
                                                            timeout=30)
        pending = [f for f in catalog.get_files_by_type(path.path_id,
                                                        [FileType.TEMPORARY_INGEST])]
        return not pending
    eventually(published, 30, f"every {table} row to be published")


def load(plane: DataPlane, catalog: Catalog, rows: int = 120, batch: int = 20,
         delete_every: int = 3) -> None:
    """``rows`` orders in several small files, then every ``delete_every``-th deleted."""
    for start in range(0, rows, batch):
        plane.commit({"orders": {"replaces": [order(i) for i in range(start, start + batch)]}})
        settle(plane, catalog)  # a file per batch and stream: small files to compact
    plane.commit({"orders": {"deletes": [{"id": i} for i in range(0, rows, delete_every)]}})
    advance(plane)
    settle(plane, catalog)


def advance(plane: DataPlane) -> None:
    """One more write elsewhere: safeGcTs (below every read snapshot, and a snapshot is
    the HWM) passes the deletes only once a later transaction has committed."""
    plane.commit({"events": {"replaces": [{"tenant": 0, "seq": len(plane.changelog),
                                           "payload": b"x", "ok": True}]}})


def biggest_stream(plane: DataPlane) -> tuple[str, int, list]:
    streams = gc.streams(plane, "orders")
    (node, vnode), files = max(streams.items(), key=lambda kv: len(kv[1]))
    return node, vnode, files


def all_streams_rewritten(plane: DataPlane) -> list[rpb.CommitGcRewriteResponse]:
    return [gc.rewrite(plane, node, "orders", vnode, files)
            for (node, vnode), files in gc.streams(plane, "orders").items()]


@pytest.mark.integration
def test_a_rewrite_reclaims_deleted_rows_and_reads_stay_exact(
        make_plane: Callable[..., DataPlane], catalog: Catalog) -> None:
    plane = make_plane()
    load(plane, catalog)
    node = plane.nodes[0]
    before = plane.read("orders")
    assert before == plane.model.rows["orders"]
    files_before = sum(len(f) for f in gc.streams(plane, "orders").values())
    assert gc.regular_rows(plane, "orders") > len(before)  # deleted rows still stored
    results = all_streams_rewritten(plane)
    assert all(r.outcome == "COMMITTED" for r in results)
    assert sum(r.rows_dropped for r in results) == 40
    assert sum(r.rows_kept for r in results) == len(before)
    assert plane.read("orders") == before
    assert gc.regular_rows(plane, "orders") == len(before)  # only live rows stored
    assert sum(len(f) for f in gc.streams(plane, "orders").values()) < files_before
    states = {e.state for e in gc.journal(plane, node).values()}
    assert states == {"SWAPPED_NOT_CHECKPOINTED"}
    plane.checkpoint(node)  # current holds the new files, previous does not
    assert {e.state for e in gc.journal(plane, node).values()} == {"SWAPPED_NOT_CHECKPOINTED"}
    plane.checkpoint(node)  # both slots hold them
    assert {e.state for e in gc.journal(plane, node).values()} == {"CHECKPOINTED"}
    # Writes after the rewrite find the moved rows: replace and delete some of them.
    plane.commit({"orders": {"replaces": [order(i, note="7") for i in range(1, 60, 4)],
                             "deletes": [{"id": i} for i in range(2, 60, 4)]}})
    assert plane.read("orders") == plane.model.rows["orders"]
    for _ in range(2):  # two restarts in a row
        restart_and_recover(plane, node)
        assert plane.read("orders") == plane.model.rows["orders"]


@pytest.mark.integration
def test_a_rewritten_file_keeps_its_place_in_the_stream_over_restarts(
        make_plane: Callable[..., DataPlane], catalog: Catalog) -> None:
    """A GC output with more row groups than the blocks it spans (row groups of 1 row,
    blocks of 16) keeps its block span after a restart, so it never overlaps the next
    file: the replay chain stays trustworthy and the replay start is not degraded to 0
    (found by the fault campaign: a wrong span failed the node closed)."""
    plane = make_plane(checkpoint_interval_ms=3_600_000)
    load(plane, catalog)
    node, vnode, files = biggest_stream(plane)
    reply = gc.rewrite(plane, node, "orders", vnode, files, row_group_rows=1)
    assert reply.outcome == "COMMITTED"
    plane.commit({"orders": {"replaces": [order(i) for i in range(300, 360)]}})
    advance(plane)
    settle(plane, catalog)  # files after the GC output in every stream
    for _ in range(2):
        plane.checkpoint(node)
    for _ in range(2):  # two restarts in a row
        plane.retinas[node].kill9()
        plane.retinas[node].start()
        starts = plane.recover(node)
        assert starts is not None and starts.node_replay_from_ts > 0, starts
        assert plane.read("orders") == plane.model.rows["orders"]
    plane.commit({"orders": {"deletes": [{"id": i} for i in range(1, 360, 4)]}})
    assert plane.read("orders") == plane.model.rows["orders"]


@pytest.mark.integration
def test_a_second_pass_compacts_the_rewritten_files_again(
        make_plane: Callable[..., DataPlane], catalog: Catalog) -> None:
    plane = make_plane()
    load(plane, catalog)
    all_streams_rewritten(plane)
    plane.commit({"orders": {"deletes": [{"id": i} for i in range(1, 120, 5)]}})
    plane.commit({"orders": {"replaces": [order(i) for i in range(200, 240)]}})
    advance(plane)
    settle(plane, catalog)
    all_streams_rewritten(plane)
    assert plane.read("orders") == plane.model.rows["orders"]
    assert gc.regular_rows(plane, "orders") == len(plane.model.rows["orders"])
    assert all(len(f) == 1 for f in gc.streams(plane, "orders").values())


@pytest.mark.integration
def test_deletes_racing_the_rewrite_are_never_lost(
        make_plane: Callable[..., DataPlane], catalog: Catalog) -> None:
    plane = make_plane()
    load(plane, catalog)
    node, vnode, files = biggest_stream(plane)
    prepared = gc.prepare(plane, node, "orders", vnode, files)
    new_file = gc.write_new_file(plane, prepared)
    # While "Spark" rewrote: deletes and replaces of rows of exactly these files.
    live = [k for k in plane.model.rows["orders"]]
    ids = sorted(plane.model.rows["orders"][k]["id"] for k in live)
    plane.commit({"orders": {"deletes": [{"id": i} for i in ids[:10]],
                             "replaces": [order(i, note="9") for i in ids[10:20]]}})
    reply = gc.commit(plane, prepared, new_file)
    gc.end(plane, prepared.trans_id)
    assert reply.chain_items > 0
    assert plane.read("orders") == plane.model.rows["orders"]
    plane.commit({"orders": {"deletes": [{"id": i} for i in ids[20:30]]}})
    assert plane.read("orders") == plane.model.rows["orders"]
    restart_and_recover(plane, node)
    assert plane.read("orders") == plane.model.rows["orders"]


@pytest.mark.integration
def test_a_read_transaction_older_than_the_rewrite_reads_its_snapshot(
        make_plane: Callable[..., DataPlane], catalog: Catalog) -> None:
    plane = make_plane()
    load(plane, catalog)
    assert plane.reader is not None
    expected = plane.model.snapshot()["orders"]
    with plane.reader.transaction() as old:
        listing = plane.trans.stub().ListQueryFiles(tpb.ListQueryFilesRequest(
            trans_id=old.trans_id, schema_name=SCHEMA, table_name="orders"), timeout=10)
        plane.commit({"orders": {"deletes": [{"id": i} for i in range(1, 120, 3)]}})
        advance(plane)
        all_streams_rewritten(plane)  # replaces exactly the files listed above
        # The files it listed before the swap still read right (retired visibility) ...
        rows = [{k: v for k, v in r.items() if k not in HIDDEN}
                for f in listing.files for r in plane.reader.read_file(f, old).to_pylist()]
        writer = plane.writers["orders"]
        assert {writer.key(r): r for r in rows} == expected
        # ... and a listing taken now (the new files) gives the same snapshot.
        again = plane.reader.read_in(old, SCHEMA, "orders").table.to_pylist()
        assert {writer.key(r): r for r in again} == expected
    assert plane.read("orders") == plane.model.rows["orders"]


# --- kills at every GC failpoint ---------------------------------------------------------------
PRE_SWAP = ["gc.journal.switching.before", "gc.journal.switching.after", "gc.visibility.before",
            "gc.visibility.after",
            "gc.main_index.before", "gc.main_index.after", "gc.primary_switch.before",
            "gc.primary_switch.after", "gc.swap.before", "catalog.swap.commit.before"]
POST_SWAP = ["catalog.swap.commit.after", "gc.swap.after", "gc.journal.swapped.before",
             "gc.journal.swapped.after", "gc.registry.before", "gc.registry.after"]


@pytest.mark.integration
@pytest.mark.parametrize("point", PRE_SWAP + POST_SWAP)
def test_a_kill_during_the_commit_recovers_to_the_model(
        point: str, make_plane: Callable[..., DataPlane], catalog: Catalog) -> None:
    plane = make_plane()
    load(plane, catalog)
    node, vnode, files = biggest_stream(plane)
    retina = plane.retinas[node]
    retina.stop()
    retina.start(f"{point}=exit(137)")
    plane.recover(node)
    prepared = gc.prepare(plane, node, "orders", vnode, files)
    new_file = gc.write_new_file(plane, prepared)
    err = rpc_error(lambda: gc.commit(plane, prepared, new_file))
    gc.end(plane, prepared.trans_id)  # the job ends its read (its lease would)
    assert err.code() == grpc.StatusCode.UNAVAILABLE
    assert retina.wait_exit() == 137
    retina.start()
    plane.recover(node)
    entries = list(gc.journal(plane, node).values())
    if point == "gc.journal.switching.before":
        assert entries == []
    else:
        # No checkpoint holds the new file: every open entry is rolled back.
        assert [e.state for e in entries] == ["ABORTED"], entries
    assert plane.read("orders") == plane.model.rows["orders"]
    regular = gc.regular_ids(plane, "orders")
    assert {f.file_id for f in files} <= regular and new_file not in regular
    # The old rows are found again: delete and replace some; restart once more.
    plane.commit({"orders": {"deletes": [{"id": i} for i in range(1, 120, 7)],
                             "replaces": [order(i, note="3") for i in range(2, 120, 7)]}})
    assert plane.read("orders") == plane.model.rows["orders"]
    retina.kill9()
    retina.start()
    plane.recover(node)
    assert plane.read("orders") == plane.model.rows["orders"]
    # And GC of the same files works after the rollback.
    node, vnode, files = biggest_stream(plane)
    assert gc.rewrite(plane, node, "orders", vnode, files).outcome == "COMMITTED"
    assert plane.read("orders") == plane.model.rows["orders"]


@pytest.mark.integration
@pytest.mark.parametrize("point", ["gc.journal.checkpointed.before",
                                   "gc.journal.checkpointed.after"])
def test_a_kill_during_promotion_keeps_the_new_file(
        point: str, make_plane: Callable[..., DataPlane], catalog: Catalog) -> None:
    plane = make_plane(checkpoint_interval_ms=3_600_000)
    load(plane, catalog)
    node, vnode, files = biggest_stream(plane)
    retina = plane.retinas[node]
    retina.stop()
    retina.start(f"{point}=exit(137)")
    plane.recover(node)  # its READY checkpoint holds no GC file: nothing promoted
    reply = gc.rewrite(plane, node, "orders", vnode, files)
    plane.checkpoint(node)  # current holds the new file
    rpc_error(lambda: plane.checkpoint(node))  # both slots do: promotion dies
    assert retina.wait_exit() == 137
    retina.start()
    plane.recover(node)
    assert [e.state for e in gc.journal(plane, node).values()] == ["CHECKPOINTED"]
    regular = gc.regular_ids(plane, "orders")
    assert reply.new_file_id in regular and not regular & {f.file_id for f in files}
    assert plane.read("orders") == plane.model.rows["orders"]
    plane.commit({"orders": {"deletes": [{"id": i} for i in range(1, 120, 5)]}})
    assert plane.read("orders") == plane.model.rows["orders"]


def swapped_then_killed(plane: DataPlane, catalog: Catalog, delete_every: int
                        ) -> tuple[str, list, rpb.CommitGcRewriteResponse]:
    """Load, rewrite the biggest stream, delete every ``delete_every``-th row, kill -9:
    the rewrite is SWAPPED_NOT_CHECKPOINTED and the loaded checkpoint has the old files
    (the plane checkpoints only on demand). Returns the node, old files and the reply."""
    load(plane, catalog)
    node, vnode, files = biggest_stream(plane)
    reply = gc.rewrite(plane, node, "orders", vnode, files)
    plane.commit({"orders": {"deletes": [{"id": i} for i in range(1, 120, delete_every)]}})
    plane.retinas[node].kill9()
    return node, files, reply


@pytest.mark.integration
def test_a_swapped_rewrite_without_a_checkpoint_rolls_back_and_a_kill_in_the_rollback_is_finished(
        make_plane: Callable[..., DataPlane], catalog: Catalog) -> None:
    plane = make_plane(checkpoint_interval_ms=3_600_000)
    node, files, reply = swapped_then_killed(plane, catalog, 4)
    retina = plane.retinas[node]
    # Crashes in the middle of recovery's rollback, one start after another; each
    # start redoes the idempotent steps and gets one further.
    for point in ("gc.rollback.primary.after", "catalog.revert_swap.commit.after",
                  "gc.rollback.main_index.after", "gc.journal.aborted.before"):
        retina.start(f"{point}=exit(137)", wait=False)
        assert retina.wait_exit() == 137, point
    retina.start()
    plane.recover(node)
    assert [e.state for e in gc.journal(plane, node).values()] == ["ABORTED"]
    regular = gc.regular_ids(plane, "orders")
    assert {f.file_id for f in files} <= regular and reply.new_file_id not in regular
    assert plane.read("orders") == plane.model.rows["orders"]
    plane.commit({"orders": {"replaces": [order(i, note="1") for i in range(0, 120, 2)]}})
    assert plane.read("orders") == plane.model.rows["orders"]


ROLLBACK = ["gc.rollback.primary.before", "gc.rollback.primary.after",
            "gc.rollback.catalog.before", "catalog.revert_swap.commit.before",
            "catalog.revert_swap.commit.after", "catalog.delete_files.commit.after",
            "gc.rollback.catalog.after", "gc.rollback.main_index.before",
            "gc.rollback.main_index.after", "gc.journal.aborted.before",
            "gc.journal.aborted.after"]


@pytest.mark.integration
@pytest.mark.parametrize("point", ROLLBACK)
def test_a_kill_during_an_in_place_rollback_is_finished_by_recovery(
        point: str, make_plane: Callable[..., DataPlane], catalog: Catalog) -> None:
    plane = make_plane()
    load(plane, catalog)
    node, vnode, files = biggest_stream(plane)
    retina = plane.retinas[node]
    retina.stop()
    retina.start(f"gc.swap.before=raise*1;{point}=exit(137)")  # fail, then die rolling back
    plane.recover(node)
    prepared = gc.prepare(plane, node, "orders", vnode, files)
    new_file = gc.write_new_file(plane, prepared)
    assert rpc_error(lambda: gc.commit(plane, prepared, new_file)).code() == \
        grpc.StatusCode.UNAVAILABLE
    gc.end(plane, prepared.trans_id)  # the job ends its read (its lease would)
    assert retina.wait_exit() == 137
    retina.start()
    plane.recover(node)
    assert [e.state for e in gc.journal(plane, node).values()] == ["ABORTED"]
    regular = gc.regular_ids(plane, "orders")
    assert {f.file_id for f in files} <= regular
    assert catalog.get_file(new_file) is None  # never swapped: discarded
    assert plane.read("orders") == plane.model.rows["orders"]
    plane.commit({"orders": {"deletes": [{"id": i} for i in range(1, 120, 5)],
                             "replaces": [order(i, note="x") for i in range(2, 120, 5)]}})
    assert plane.read("orders") == plane.model.rows["orders"]


@pytest.mark.integration
def test_a_journal_error_after_its_record_is_durable_closes_the_record(
        make_plane: Callable[..., DataPlane], catalog: Catalog) -> None:
    """The INDEX_SWITCHING record is on disk when the write reports an error: the entry is
    closed (ABORTED) at once, so its files are not held until a restart."""
    plane = make_plane(failpoints="gc.journal.switching.after=raise*1")
    load(plane, catalog)
    node, vnode, files = biggest_stream(plane)
    prepared = gc.prepare(plane, node, "orders", vnode, files)
    new_file = gc.write_new_file(plane, prepared)
    err = rpc_error(lambda: gc.commit(plane, prepared, new_file))
    gc.end(plane, prepared.trans_id)  # the job ends its read (its lease would)
    assert err.code() == grpc.StatusCode.ABORTED, err.details()
    assert [e.state for e in gc.journal(plane, node).values()] == ["ABORTED"]
    assert catalog.get_file(new_file) is None
    assert gc.rewrite(plane, node, "orders", vnode, files).outcome == "COMMITTED"
    assert plane.read("orders") == plane.model.rows["orders"]


@pytest.mark.integration
def test_a_swap_whose_answer_was_lost_is_read_back_and_goes_forward(
        make_plane: Callable[..., DataPlane], catalog: Catalog) -> None:
    """atomicSwapFiles committed but its answer was lost (outcome unknown): the node
    re-reads the catalog, finds the swap done and completes the commit."""
    plane = make_plane(failpoints="catalog.swap.commit.after=raise*1")
    load(plane, catalog)
    node, vnode, files = biggest_stream(plane)
    reply = gc.rewrite(plane, node, "orders", vnode, files)
    assert reply.outcome == "COMMITTED" and reply.journal_state == "SWAPPED_NOT_CHECKPOINTED"
    regular = gc.regular_ids(plane, "orders")
    assert reply.new_file_id in regular and not regular & {f.file_id for f in files}
    assert plane.read("orders") == plane.model.rows["orders"]
    restart_and_recover(plane, node)
    assert plane.read("orders") == plane.model.rows["orders"]


@pytest.mark.integration
def test_a_swap_that_failed_before_its_commit_rolls_back_and_changes_nothing(
        make_plane: Callable[..., DataPlane], catalog: Catalog) -> None:
    plane = make_plane(failpoints="catalog.swap.commit.before=raise*1")
    load(plane, catalog)
    node, vnode, files = biggest_stream(plane)
    prepared = gc.prepare(plane, node, "orders", vnode, files)
    new_file = gc.write_new_file(plane, prepared)
    err = rpc_error(lambda: gc.commit(plane, prepared, new_file))
    gc.end(plane, prepared.trans_id)  # the job ends its read (its lease would)
    assert err.code() == grpc.StatusCode.ABORTED, err.details()
    assert [e.state for e in gc.journal(plane, node).values()] == ["ABORTED"]
    regular = gc.regular_ids(plane, "orders")
    assert {f.file_id for f in files} <= regular and catalog.get_file(new_file) is None
    assert plane.read("orders") == plane.model.rows["orders"]
    assert gc.rewrite(plane, node, "orders", vnode, files).outcome == "COMMITTED"
    assert plane.read("orders") == plane.model.rows["orders"]


@pytest.mark.integration
def test_a_failure_before_the_swap_rolls_back_in_place(
        make_plane: Callable[..., DataPlane], catalog: Catalog) -> None:
    plane = make_plane(failpoints="gc.swap.before=raise*1")
    load(plane, catalog)
    node, vnode, files = biggest_stream(plane)
    prepared = gc.prepare(plane, node, "orders", vnode, files)
    new_file = gc.write_new_file(plane, prepared)
    err = rpc_error(lambda: gc.commit(plane, prepared, new_file))
    assert err.code() == grpc.StatusCode.ABORTED, err.details()
    assert plane.status(node).state == rpb.READY
    assert [e.state for e in gc.journal(plane, node).values()] == ["ABORTED"]
    assert catalog.get_file(new_file) is None  # the new file is discarded
    assert plane.read("orders") == plane.model.rows["orders"]
    plane.commit({"orders": {"deletes": [{"id": i} for i in range(1, 120, 3)]}})
    assert plane.read("orders") == plane.model.rows["orders"]
    # A commit of the rolled-back rewrite is refused; a new one succeeds.
    again = rpc_error(lambda: gc.commit(plane, prepared, new_file))
    assert again.code() == grpc.StatusCode.FAILED_PRECONDITION
    gc.end(plane, prepared.trans_id)  # the job ends its read (its lease would)
    assert gc.rewrite(plane, node, "orders", vnode, files).outcome == "COMMITTED"
    assert plane.read("orders") == plane.model.rows["orders"]


# --- refusals --------------------------------------------------------------------------------
@pytest.mark.integration
def test_gc_rpcs_outside_ready_are_unavailable(make_plane: Callable[..., DataPlane]) -> None:
    plane = make_plane(recover=False)
    stub = plane.retinas[plane.nodes[0]].stub
    plane.wait_replay_ready(plane.nodes[0])
    for call in (lambda: stub.PrepareGcRewrite(rpb.PrepareGcRewriteRequest(), timeout=10),
                 lambda: stub.CommitGcRewrite(rpb.CommitGcRewriteRequest(), timeout=10),
                 lambda: stub.RunGcMaintenance(rpb.RunGcMaintenanceRequest(), timeout=10)):
        assert rpc_error(call).code() == grpc.StatusCode.UNAVAILABLE


@pytest.mark.integration
def test_malformed_and_out_of_protocol_rewrites_are_refused_and_change_nothing(
        make_plane: Callable[..., DataPlane], catalog: Catalog) -> None:
    plane = make_plane()
    load(plane, catalog, rows=160)
    node, vnode, files = biggest_stream(plane)
    assert len(files) >= 3
    stub = plane.retinas[node].stub
    trans_id = gc.begin_read(plane)
    safe = plane.trans.stub().GetSafeGcTimestamp(tpb.GetSafeGcTimestampRequest(),
                                                 timeout=10).safe_gc_ts

    def prepare(ids: list[int], ts: int = safe, t: int = trans_id) -> grpc.RpcError:
        return rpc_error(lambda: stub.PrepareGcRewrite(rpb.PrepareGcRewriteRequest(
            schema_name=SCHEMA, table_name="orders", virtual_node_id=vnode, old_file_ids=ids,
            safe_gc_ts=ts, trans_id=t), timeout=10))

    ids = [f.file_id for f in files]
    assert prepare([]).code() == grpc.StatusCode.INVALID_ARGUMENT
    assert prepare([ids[0], ids[0]]).code() == grpc.StatusCode.INVALID_ARGUMENT
    assert prepare([ids[0], ids[2]]).code() == grpc.StatusCode.FAILED_PRECONDITION
    assert prepare([ids[0]], ts=safe + 1000).code() == grpc.StatusCode.INVALID_ARGUMENT
    assert prepare([ids[0]], t=0).code() == grpc.StatusCode.INVALID_ARGUMENT
    assert prepare([10**9]).code() == grpc.StatusCode.FAILED_PRECONDITION
    unknown = rpc_error(lambda: stub.CommitGcRewrite(rpb.CommitGcRewriteRequest(
        rewrite_id="nope", new_file_id=1), timeout=10))
    assert unknown.code() == grpc.StatusCode.FAILED_PRECONDITION
    # A new file that is not the survivors (here: one row short) is refused.
    prepared = gc.prepare(plane, node, "orders", vnode, files[:1], trans_id)
    other = gc.prepare(plane, node, "orders", vnode, files[1:2], trans_id)
    wrong = gc.write_new_file(plane, other)  # the survivors of another file
    err = rpc_error(lambda: gc.commit(plane, prepared, wrong))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, err.details()
    # The right rows, but a footer that names another rewrite (recovery finds a committed
    # output whose journal record is lost by that key): refused too.
    unnamed = gc.write_new_file(plane, prepared, footer_rewrite_id="another")
    err = rpc_error(lambda: gc.commit(plane, prepared, unnamed))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, err.details()
    assert "names rewrite another in its footer" in err.details()
    assert gc.journal(plane, node) == {}
    assert {f.file_id for f in gc.streams(plane, "orders")[(node, vnode)]} == set(ids)
    assert plane.read("orders") == plane.model.rows["orders"]
    gc.end(plane, trans_id)


@pytest.mark.integration
def test_a_busy_prepare_says_which_rewrite_holds_the_files_and_why(
        make_plane: Callable[..., DataPlane], catalog: Catalog) -> None:
    """ABORTED, nothing changed, and the details say what the files wait for: a rewrite
    prepared and not committed, or a committed output both checkpoint slots do not hold
    yet (AWAITING_CHECKPOINT, which the job's report counts apart)."""
    plane = make_plane(checkpoint_interval_ms=3_600_000)
    load(plane, catalog, rows=160, delete_every=10**6)  # every file keeps rows
    node, vnode, files = biggest_stream(plane)
    assert len(files) >= 4
    held = gc.prepare(plane, node, "orders", vnode, files[:2])
    err = rpc_error(lambda: gc.prepare(plane, node, "orders", vnode, files[1:3],
                                       held.trans_id))
    assert err.code() == grpc.StatusCode.ABORTED, err.details()
    assert f"in rewrite {held.reply.rewrite_id}, not committed yet" in err.details()
    done = gc.commit(plane, held, gc.write_new_file(plane, held))
    gc.end(plane, held.trans_id)
    stream = gc.streams(plane, "orders")[(node, vnode)]
    assert stream[0].file_id == done.new_file_id
    trans_id = gc.begin_read(plane)
    err = rpc_error(lambda: gc.prepare(plane, node, "orders", vnode, stream[:2], trans_id))
    gc.end(plane, trans_id)
    assert err.code() == grpc.StatusCode.ABORTED, err.details()
    assert AWAITING_CHECKPOINT in err.details() and held.reply.rewrite_id in err.details()
    assert gc.streams(plane, "orders")[(node, vnode)] == stream
    assert plane.read("orders") == plane.model.rows["orders"]


# --- the journal is never read as absent -------------------------------------------------------
def _journal_dir(plane: DataPlane, node: str) -> Path:
    return plane.workdir / "state" / node.replace(":", "-") / "gc_journal"


@pytest.mark.integration
def test_a_corrupt_journal_record_fails_the_node_closed(
        make_plane: Callable[..., DataPlane], catalog: Catalog) -> None:
    plane = make_plane()
    load(plane, catalog)
    node, vnode, files = biggest_stream(plane)
    gc.rewrite(plane, node, "orders", vnode, files)
    plane.retinas[node].kill9()
    record = next(_journal_dir(plane, node).glob("*.gcj"))
    data = bytearray(record.read_bytes())
    data[len(data) // 2] ^= 0xFF
    record.write_bytes(bytes(data))
    plane.retinas[node].start()
    eventually(lambda: plane.status(node).state == rpb.FAILED, 30, "the node to fail closed")
    assert "GC journal" in plane.status(node).failure_reason
    assert not plane.gate_open()


@pytest.mark.integration
def test_a_rollback_without_its_anchors_fails_closed(
        make_plane: Callable[..., DataPlane], catalog: Catalog) -> None:
    plane = make_plane(checkpoint_interval_ms=3_600_000)
    load(plane, catalog)
    node, vnode, files = biggest_stream(plane)
    gc.rewrite(plane, node, "orders", vnode, files)
    plane.retinas[node].kill9()  # SWAPPED_NOT_CHECKPOINTED: recovery must roll back
    path = catalog.get_paths(plane.tables["orders"].table_id)[0]
    (Path(path.uri.removeprefix("file://")) / files[0].name).unlink()  # an old file is gone
    plane.retinas[node].start()
    eventually(lambda: plane.status(node).state == rpb.FAILED, 30, "the node to fail closed")
    assert "anchor" in plane.status(node).failure_reason


@pytest.mark.integration
def test_gc_rows_without_a_journal_fail_the_node_closed(
        make_plane: Callable[..., DataPlane], catalog: Catalog) -> None:
    plane = make_plane()
    load(plane, catalog)
    node, vnode, files = biggest_stream(plane)
    retina = plane.retinas[node]
    retina.stop()
    retina.start("gc.primary_switch.after=exit(137)")
    plane.recover(node)
    prepared = gc.prepare(plane, node, "orders", vnode, files)
    new_file = gc.write_new_file(plane, prepared)
    rpc_error(lambda: gc.commit(plane, prepared, new_file))
    gc.end(plane, prepared.trans_id)  # the job ends its read (its lease would)
    assert retina.wait_exit() == 137
    for record in _journal_dir(plane, node).glob("*.gcj"):
        record.unlink()  # the journal is lost: its switched primary entries are not
    retina.start()
    eventually(lambda: plane.status(node).state == rpb.FAILED, 30, "the node to fail closed")
    assert "GC_ROWS_HAVE_A_JOURNAL" in plane.status(node).failure_reason


def _damage_current_checkpoint(plane: DataPlane, node: str, checkpoint_id: int) -> None:
    body = plane.workdir / "storage" / "_checkpoints" / node.replace(":", "-") / \
        f"ckpt-{checkpoint_id:020d}.bin"
    data = bytearray(body.read_bytes())
    data[100] ^= 0x04
    body.write_bytes(bytes(data))


def test_the_jobs_footer_names_its_rewrite_under_the_key_recovery_reads() -> None:
    """REWRITE_OUTPUTS_HAVE_A_JOURNAL reads what the Spark job writes (its _rewrite puts
    ``gc_rewrite_id`` through new_file_schema)."""
    schema = pa.schema([("id", pa.int64()), (COMMIT_TS, pa.int64())])
    footer = new_file_schema(schema, {"gc_rewrite_id": "r-1", "node": "n"}).metadata
    assert footer[GC_REWRITE_ID_KEY] == b"r-1"


@pytest.mark.integration
def test_a_swapped_rewrite_whose_journal_record_is_lost_fails_the_node_closed(
        make_plane: Callable[..., DataPlane], catalog: Catalog) -> None:
    """REWRITE_OUTPUTS_HAVE_A_JOURNAL. A rewrite is swapped (new file REGULAR, old files
    RETIRED), its record is lost before any checkpoint holds the new file, and the node
    restarts: it must fail closed, the catalog untouched, instead of retiring the new
    file and replaying from the old files' oldest rows (what it did). With the record
    restored it rolls back. Then the healthy cases that look alike: GC outputs whose
    records were promoted and swept, loaded from the ``previous`` slot (``current``
    damaged), are no sign of a lost record."""
    plane = make_plane(checkpoint_interval_ms=3_600_000, gc_retired_retention_ms=0,
                       sweeper_interval_ms=0, gc_lineage_retention_ms=0)
    node, files, reply = swapped_then_killed(plane, catalog, 7)
    retina = plane.retinas[node]
    (record,) = _journal_dir(plane, node).glob("*.gcj")
    saved = record.read_bytes()
    record.unlink()  # lost
    retina.start()
    eventually(lambda: plane.status(node).state == rpb.FAILED, 30, "the node to fail closed")
    reason = plane.status(node).failure_reason
    assert reason.startswith("GC journal mismatch: REWRITE_OUTPUTS_HAVE_A_JOURNAL"), reason
    assert f"file {reply.new_file_id} " in reason
    assert reply.new_file_id in gc.regular_ids(plane, "orders")  # start-up changed nothing
    retired = {f.file_id for f in catalog.get_files_by_type(None, [FileType.RETIRED])}
    assert {f.file_id for f in files} <= retired
    assert not plane.gate_open()
    retina.stop()  # the runbook: restore the record, restart
    record.write_bytes(saved)
    retina.start()
    plane.recover(node)
    assert [e.state for e in gc.journal(plane, node).values()] == ["ABORTED"]
    assert plane.read("orders") == plane.model.rows["orders"]

    all_streams_rewritten(plane)
    plane.checkpoint(node)
    newest = plane.checkpoint(node).checkpoint_id  # both slots hold the outputs: promoted
    for kind in ("retired", "journal"):  # the old files, then the final records, go
        retina.stub.RunSweeper(rpb.RunSweeperRequest(passes=[kind]), timeout=60)
    assert gc.journal(plane, node) == {}
    retina.kill9()
    _damage_current_checkpoint(plane, node, newest)
    retina.start()
    plane.recover(node)  # from ``previous``: it holds every output, no record names them
    started = [json.loads(line) for line in retina.log_path.read_text().splitlines()
               if '"replay_ts_ready"' in line]
    assert started[-1]["slot"] == "previous"
    assert plane.read("orders") == plane.model.rows["orders"]
    plane.commit({"orders": {"replaces": [order(i, note="2") for i in range(0, 120, 3)]}})
    assert plane.read("orders") == plane.model.rows["orders"]


# --- the GC scheduler inside a real node --------------------------------------------------------
@pytest.mark.integration
def test_maintenance_folds_and_prunes_and_recovery_still_converges(
        make_plane: Callable[..., DataPlane], catalog: Catalog) -> None:
    plane = make_plane(checkpoint_interval_ms=3_600_000, gc_interval_ms=3_600_000)
    node = plane.nodes[0]
    stub = plane.retinas[node].stub
    for round_ in range(4):  # many versions per key, and deletes to fold
        plane.commit({"orders": {"replaces": [order(i, note=str(round_)) for i in range(60)]}})
        plane.commit({"orders": {"deletes": [{"id": i} for i in range(round_, 60, 9)]}})
    advance(plane)
    settle(plane, catalog)  # published: the checkpoints' replay starts move up
    for _ in range(2):  # the prune horizon waits for two checkpoints after READY
        plane.checkpoint(node)
    advance(plane)
    done = stub.RunGcMaintenance(rpb.RunGcMaintenanceRequest(), timeout=60)
    assert done.folded_items > 0 and done.pruned_versions > 0, done
    assert plane.read("orders") == plane.model.rows["orders"]
    for cycle in range(2):  # writes after the prune, a crash, a replay over pruned keys
        plane.commit({"orders": {"replaces": [order(i, note=f"r{cycle}") for i in range(0, 60, 2)],
                                 "deletes": [{"id": i} for i in range(1, 60, 6)]}})
        restart_and_recover(plane, node)
        assert plane.read("orders") == plane.model.rows["orders"]
        plane.checkpoint(node)
        advance(plane)
        stub = plane.retinas[node].stub
        stub.RunGcMaintenance(rpb.RunGcMaintenanceRequest(), timeout=60)
        assert plane.read("orders") == plane.model.rows["orders"]
    status = stub.GetGcStatus(rpb.GetGcStatusRequest(), timeout=10)
    assert status.last_fold_ts > 0
