"""Lineage and revert of Storage GC rewrites (issue 11, after Apache Pinot's consistent push
and rollback): a completed rewrite is
swapped back in one catalog transaction with the same crash safety as the forward commit;
deletes that reached the new file's rows land on the old rows; queries list the old or the
new file set, never a mix; a kill at every revert step is finished by recovery, including
when the loaded checkpoint still holds the new file. Every outcome is compared with the
model."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable

import grpc
import pytest

from retina_common.catalog import Catalog, FileType
from retina_common.pb import retina_pb2 as rpb
from retina_common.pb import trans_pb2 as tpb

from . import gc
from .dataplane import SCHEMA, DataPlane
from .support import eventually, rpc_error
from .test_recovery_protocol import order
from .test_recovery_sequences import restart_and_recover
from .test_storage_gc import advance, biggest_stream, load

pytestmark = pytest.mark.integration

KEEP = 3_600_000  # old files stay retained (revertible) for the whole test


def lineage(plane: DataPlane, node: str) -> dict[str, rpb.GcLineageRecord]:
    reply = plane.retinas[node].stub.ListGcLineage(rpb.ListGcLineageRequest(), timeout=10)
    return {r.rewrite_id: r for r in reply.records}


def revert(plane: DataPlane, node: str, rewrite_id: str) -> rpb.RevertGcRewriteResponse:
    return plane.retinas[node].stub.RevertGcRewrite(
        rpb.RevertGcRewriteRequest(rewrite_id=rewrite_id), timeout=60)


def types(catalog: Catalog, ids: list[int]) -> list[str]:
    out = []
    for file_id in ids:
        record = catalog.get_file(file_id)
        out.append("missing" if record is None else record.type.name)
    return out


def churn(plane: DataPlane, note: str) -> None:
    """Deletes and replaces over the whole key range (many land on rewritten rows)."""
    plane.commit({"orders": {"deletes": [{"id": i} for i in range(1, 120, 6)],
                             "replaces": [order(i, note=note) for i in range(2, 120, 6)]}})
    advance(plane)


def rewritten(plane: DataPlane, catalog: Catalog) -> tuple[str, list, rpb.CommitGcRewriteResponse]:
    load(plane, catalog)
    node, vnode, files = biggest_stream(plane)
    reply = gc.rewrite(plane, node, "orders", vnode, files)
    assert reply.outcome == "COMMITTED"
    return node, files, reply


def test_a_completed_rewrite_is_reverted_and_every_later_delete_lands_on_the_old_rows(
        make_plane: Callable[..., DataPlane], catalog: Catalog) -> None:
    plane = make_plane(gc_retired_retention_ms=KEEP, sweeper_interval_ms=0)
    node, files, reply = rewritten(plane, catalog)
    old_ids = [f.file_id for f in files]
    record = lineage(plane, node)[reply.rewrite_id]
    assert (record.status, record.revertible, record.new_file_id) == \
        ("COMPLETED", True, reply.new_file_id)
    assert list(record.old_file_ids) == old_ids and record.completed_at_ms > 0
    plane.checkpoint(node)
    plane.checkpoint(node)  # CHECKPOINTED: both slots hold the new file
    assert lineage(plane, node)[reply.rewrite_id].journal_state == "CHECKPOINTED"
    churn(plane, "before-revert")  # deletes reach the new file's rows
    assert plane.read("orders") == plane.model.rows["orders"]
    done = revert(plane, node, reply.rewrite_id).record
    assert (done.status, done.journal_state, done.revertible) == \
        ("REVERTED", "REVERTED", False)
    assert types(catalog, old_ids) == ["REGULAR"] * len(old_ids)
    assert types(catalog, [reply.new_file_id]) == ["RETIRED"]
    assert plane.read("orders") == plane.model.rows["orders"]
    churn(plane, "after-revert")  # the moved-back rows are found
    assert plane.read("orders") == plane.model.rows["orders"]
    # No checkpoint since the revert: the loaded one still holds the new file, and
    # recovery maps its baseline back to the old files. Then twice more.
    for _ in range(3):
        restart_and_recover(plane, node)
        assert plane.read("orders") == plane.model.rows["orders"]
        churn(plane, "restart")
        assert plane.read("orders") == plane.model.rows["orders"]
    assert lineage(plane, node)[reply.rewrite_id].status == "REVERTED"
    assert revert(plane, node, reply.rewrite_id).record.status == "REVERTED"  # a retry
    # The reverted files can be rewritten again.
    node, vnode, files = biggest_stream(plane)
    assert gc.rewrite(plane, node, "orders", vnode, files).outcome == "COMMITTED"
    assert plane.read("orders") == plane.model.rows["orders"]


REVERT_POINTS = ["gc.revert.journal_reverting.before", "gc.revert.journal_reverting.after",
                 "gc.revert.primary.before", "gc.revert.primary.after",
                 "gc.revert.catalog.before", "gc.revert.catalog.after",
                 "gc.revert.journal_reverted.before", "gc.revert.journal_reverted.after"]


@pytest.mark.parametrize("point", REVERT_POINTS)
def test_a_kill_at_every_revert_step_is_finished_by_recovery(
        point: str, make_plane: Callable[..., DataPlane], catalog: Catalog) -> None:
    plane = make_plane(gc_retired_retention_ms=KEEP, sweeper_interval_ms=0)
    node, files, reply = rewritten(plane, catalog)
    old_ids = [f.file_id for f in files]
    plane.checkpoint(node)
    plane.checkpoint(node)
    retina = plane.retinas[node]
    retina.stop()
    retina.start(f"{point}=exit(137)")
    plane.recover(node)
    churn(plane, "before-revert")
    err = rpc_error(lambda: revert(plane, node, reply.rewrite_id))
    assert err.code() == grpc.StatusCode.UNAVAILABLE
    assert retina.wait_exit() == 137
    retina.start()
    plane.recover(node)
    record = lineage(plane, node)[reply.rewrite_id]
    if point == "gc.revert.journal_reverting.before":  # nothing had started
        assert record.status == "COMPLETED"
        assert types(catalog, [reply.new_file_id]) == ["REGULAR"]
    else:  # REVERTING is durable: recovery finishes the revert
        assert record.status == "REVERTED", record
        assert types(catalog, old_ids) == ["REGULAR"] * len(old_ids)
        assert types(catalog, [reply.new_file_id]) == ["RETIRED"]
    assert plane.read("orders") == plane.model.rows["orders"]
    churn(plane, "after")
    assert plane.read("orders") == plane.model.rows["orders"]
    restart_and_recover(plane, node)
    assert plane.read("orders") == plane.model.rows["orders"]


def settled_types(catalog: Catalog, ids: Iterable[int] | None = None
                  ) -> dict[int, FileType | None]:
    """Every file's type but the write buffers' TEMPORARY_INGEST files (the ingest path
    publishes those whenever their blocks fill, revert or not); with ``ids``, just those."""
    found = {f.file_id: f.type for f in catalog.get_files_by_type(None, list(FileType))}
    if ids is not None:
        return {i: found.get(i) for i in ids}
    return {i: t for i, t in found.items() if t != FileType.TEMPORARY_INGEST}


def test_reverts_that_cannot_be_done_are_refused_and_change_nothing(
        make_plane: Callable[..., DataPlane], catalog: Catalog) -> None:
    plane = make_plane(gc_retired_retention_ms=0, sweeper_interval_ms=0)
    node, _files, first = rewritten(plane, catalog)
    # A later rewrite replaced the new file (once promoted: an open entry's files are
    # busy): the first one cannot be reverted.
    plane.checkpoint(node)
    plane.checkpoint(node)
    (node, vnode), stream = next((k, v) for k, v in gc.streams(plane, "orders").items()
                                 if first.new_file_id in {f.file_id for f in v})
    second = gc.rewrite(plane, node, "orders", vnode, stream)
    record = lineage(plane, node)[first.rewrite_id]
    assert not record.revertible and "later rewrite" in record.not_revertible_reason
    before = settled_types(catalog)
    err = rpc_error(lambda: revert(plane, node, first.rewrite_id))
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert settled_types(catalog, before.keys()) == before
    # The second one's old files are swept: not revertible any more.
    for _ in range(2):
        plane.checkpoint(node)
    plane.retinas[node].stub.RunSweeper(rpb.RunSweeperRequest(passes=["retired"]), timeout=60)
    record = lineage(plane, node)[second.rewrite_id]
    assert not record.revertible and "no longer retained" in record.not_revertible_reason
    before = settled_types(catalog)
    err = rpc_error(lambda: revert(plane, node, second.rewrite_id))
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert settled_types(catalog, before.keys()) == before
    assert plane.read("orders") == plane.model.rows["orders"]


def test_queries_list_the_old_or_the_new_files_never_a_mix(
        make_plane: Callable[..., DataPlane], catalog: Catalog) -> None:
    plane = make_plane(gc_retired_retention_ms=KEEP, sweeper_interval_ms=0)
    node, files, reply = rewritten(plane, catalog)
    old, new = {f.file_id for f in files}, {reply.new_file_id}
    seen: list[set[int]] = []
    stop = threading.Event()
    stub = plane.trans.stub()

    def list_files() -> None:
        while not stop.is_set():
            trans = stub.BeginTrans(tpb.BeginTransRequest(read_only=True), timeout=10)
            listing = stub.ListQueryFiles(tpb.ListQueryFilesRequest(
                trans_id=trans.trans_id, schema_name=SCHEMA, table_name="orders"), timeout=10)
            stub.CommitTrans(tpb.CommitTransRequest(trans_id=trans.trans_id), timeout=10)
            seen.append({f.file_id for f in listing.files} & (old | new))

    lister = threading.Thread(target=list_files)
    lister.start()
    try:
        # The first listing before the revert (the test once saw the revert finish
        # first: then no listing showed the new files).
        eventually(lambda: seen, 30, "a listing before the revert")
        revert(plane, node, reply.rewrite_id)
        n = len(seen)
        eventually(lambda: len(seen) >= n + 5, 30, "a few listings after the revert")
    finally:
        stop.set()
        lister.join(30)
    assert seen and all(s in (old, new) for s in seen), [s for s in seen if s not in (old, new)]
    assert seen[0] == new and seen[-1] == old
    assert plane.read("orders") == plane.model.rows["orders"]
