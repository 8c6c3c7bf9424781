"""AS OF reads of whole tables against the model's history (docs/history.md), with real
TransServer, Retina nodes, etcd and PostgreSQL: across Storage GC rewrites, visibility
folds, a revert of a rewrite, sweeps, two node restarts in a row and a TransServer
restart. Every past point is either read exactly (the model's table after the last commit
at or before it) or refused FAILED_PRECONDITION snapshot_expired; never a partial, empty
or wrong answer."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import Any

import grpc
import pytest

from retina_common.catalog import Catalog, FileType
from retina_common.pb import retina_pb2 as rpb
from retina_common.pb import trans_pb2 as tpb
from retina_common.refusal import SNAPSHOT_EXPIRED, earliest_readable

from . import gc
from .dataplane import SCHEMA, DataPlane
from .support import eventually, rpc_error
from .test_lineage import lineage, revert
from .test_recovery_protocol import order

TABLES = ("orders", "events")
Rows = dict[bytes, dict[str, Any]]


def step(plane: DataPlane, catalog: Catalog, n: int) -> int:
    """One commit: new orders, replaces and deletes over earlier ones, an event; its rows
    published (a file per step and stream: files to rewrite)."""
    base = 12 * n
    ts, _ = plane.commit({
        "orders": {"replaces": [order(i, note=f"s{n}") for i in
                                [*range(base, base + 12), *range(n % 5, base, 7)]],
                   "deletes": [{"id": i} for i in range(n % 3, base, 5)]},
        "events": {"replaces": [{"tenant": n % 2, "seq": n, "payload": b"e", "ok": True}]}})
    published(plane, catalog)
    return ts


def published(plane: DataPlane, catalog: Catalog) -> None:
    """Every row in a REGULAR file (the flush timer seals open files), no checkpoint
    taken: a test decides where a node's replay starts."""
    paths = [p.path_id for t in plane.tables.values() for p in catalog.get_paths(t.table_id)]
    eventually(lambda: not any(catalog.get_files_by_type(p, [FileType.TEMPORARY_INGEST])
                               for p in paths), 30, "every row to be published")


def model_at(plane: DataPlane, ts: int) -> dict[str, Rows]:
    """The tables after the last commit at or before ``ts``."""
    state: dict[str, Rows] = {t: {} for t in TABLES}
    for committed, snapshot in plane.model.history:
        if committed > ts:
            break
        state = snapshot
    return state


def read_as_of(plane: DataPlane, table: str, **point: Any) -> tuple[int, Rows]:
    assert plane.reader is not None
    snap = plane.reader.read(SCHEMA, table, **point)
    writer = plane.writers[table]
    rows: Rows = {}
    for row in snap.table.to_pylist():
        key = writer.key(row)
        assert key not in rows, f"AS OF {point}: a duplicate row {row}"
        rows[key] = row
    return snap.timestamp, rows


def check(plane: DataPlane, points: Iterable[int], *, readable: Iterable[int] = (),
          refused: Iterable[int] = ()) -> set[int]:
    """Read every table at every point: exact or refused snapshot_expired. ``readable``
    must be answered, ``refused`` refused. Returns the points refused."""
    # A read at the newest snapshot goes through first (after a restart, a node's channel
    # to the TransServer may still be reconnecting: UNAVAILABLE, retried).
    eventually(lambda: read_as_of(plane, "events"), 30, "a read to be answered")
    out = set()
    for ts in points:
        expected = model_at(plane, ts)
        for table in TABLES:
            try:
                snapshot, rows = read_as_of(plane, table, as_of_ts=ts)
            except grpc.RpcError as exc:
                assert exc.code() == grpc.StatusCode.FAILED_PRECONDITION, \
                    (ts, exc.code(), exc.details())
                assert exc.details().startswith(SNAPSHOT_EXPIRED), (ts, exc.details())
                assert earliest_readable(exc.details()) is not None
                out.add(ts)
                break
            assert snapshot == ts
            assert rows == expected[table], f"AS OF {ts}: {table} differs from the model"
    assert not out & set(readable), f"refused though retained: {sorted(out & set(readable))}"
    assert set(refused) <= out, f"answered though gone: {sorted(set(refused) - out)}"
    return out


def hand_out_safe_gc_ts(plane: DataPlane) -> int:
    return plane.trans.stub().GetSafeGcTimestamp(tpb.GetSafeGcTimestampRequest(),
                                                 timeout=10).safe_gc_ts


def maintenance(plane: DataPlane) -> list[int]:
    """A fold round on every node now; their fold timestamps."""
    return [plane.retinas[node].stub.RunGcMaintenance(rpb.RunGcMaintenanceRequest(),
                                                      timeout=60).fold_ts
            for node in plane.nodes]


def rewrite_every_stream(plane: DataPlane) -> list[tuple[str, rpb.CommitGcRewriteResponse]]:
    done = []
    for (node, vnode), files in gc.streams(plane, "orders").items():
        if len(files) > 1:
            reply = gc.rewrite(plane, node, "orders", vnode, files)
            assert reply.outcome == "COMMITTED", reply
            done.append((node, reply))
    return done


def sweep_replaced(plane: DataPlane, catalog: Catalog) -> None:
    """Sweep every file a rewrite replaced (two checkpoints first on every node: neither
    slot names a replaced file any more)."""
    path = catalog.get_paths(plane.tables["orders"].table_id)[0]

    def swept() -> bool:
        for n in plane.nodes:
            plane.checkpoint(n)
            plane.checkpoint(n)
            plane.retinas[n].stub.RunSweeper(rpb.RunSweeperRequest(passes=["retired"]),
                                             timeout=60)
        return not catalog.get_files_by_type(path.path_id, [FileType.RETIRED])

    eventually(swept, 60, "the replaced files to be swept", interval_s=1)


def restart_after(plane: DataPlane, catalog: Catalog, node: str,
                  steps: range) -> tuple[list[int], int]:
    """A checkpoint of ``node``, ``steps`` committed after it, then a kill and a recovery:
    the steps' points and the node's replay start (nodeReplayFromTs)."""
    plane.checkpoint(node)
    points = [step(plane, catalog, n) for n in steps]
    plane.retinas[node].kill9()
    plane.retinas[node].start()
    starts = plane.recover(node)
    assert starts is not None
    return points, starts.node_replay_from_ts


@pytest.mark.integration
def test_as_of_reads_equal_the_models_history_across_gc_a_revert_sweeps_and_restarts(
        make_plane: Callable[..., DataPlane], catalog: Catalog) -> None:
    plane = make_plane(nodes=2, gc_retired_retention_ms=0, sweeper_interval_ms=0,
                       gc_interval_ms=1000)
    stub = plane.trans.stub()
    points = [step(plane, catalog, n) for n in range(4)]
    # At once: the nodes' GC rounds hand safeGcTs out every second, but never past the HWM.
    pinned = points[3]
    stub.CreatePin(tpb.CreatePinRequest(name="before-batch", ts=pinned), timeout=10)
    points += [step(plane, catalog, n) for n in range(4, 10)]
    # The pin holds safeGcTs: points from it on are retained, the older ones are not.
    assert hand_out_safe_gc_ts(plane) == pinned - 1
    retained = [p for p in points if p >= pinned]
    check(plane, points, readable=retained, refused=points[:3])

    # Storage GC rewrites every stream at the cutoff the pin allows, then folds.
    rewrites = rewrite_every_stream(plane)
    assert rewrites
    assert maintenance(plane) == [pinned - 1] * len(plane.nodes)
    check(plane, points, readable=retained)
    # A revert of one rewrite, then a sweep of what the others replaced.
    node, reply = rewrites[0]
    assert revert(plane, node, reply.rewrite_id).record.status == "REVERTED"
    check(plane, points, readable=retained)
    sweep_replaced(plane, catalog)
    assert lineage(plane, node)[reply.rewrite_id].status == "REVERTED"
    points += [step(plane, catalog, n) for n in range(10, 12)]
    retained = [p for p in points if p >= pinned]
    check(plane, points, readable=retained)

    # Two node restarts in a row. Below the replay start the restored checkpoint answers
    # (history included); what the recovery rebuilt, up to MarkReady's fresh timestamp,
    # is refused; later points read again.
    node = plane.nodes[0]
    gap, replay_from = restart_after(plane, catalog, node, range(12, 14))
    points += gap
    below = [p for p in retained if p < replay_from]
    assert below  # the checkpoint's history
    rebuilt = [(r.from_ts, r.to_ts) for r in plane.status(node).rebuilt_history]
    assert rebuilt[0][0] == replay_from
    assert all(any(lo <= p < hi for lo, hi in rebuilt) for p in gap)
    check(plane, points, readable=below, refused=gap)
    after = [step(plane, catalog, n) for n in range(14, 16)]
    points += after
    plane.retinas[node].kill9()  # again, without a checkpoint of its own since READY
    plane.retinas[node].start()
    plane.recover(node)
    check(plane, points, readable=below, refused=gap)
    later = [step(plane, catalog, n) for n in range(16, 18)]
    points += later
    check(plane, points, readable=[*below, *later], refused=gap)

    # Two TransServer restarts keep the pin and the horizon: the same answers.
    for _ in range(2):
        plane.trans.kill9()
        plane.trans.start()
        stub = plane.trans.reconnect()
        assert [p.name for p in stub.ListPins(tpb.ListPinsRequest(), timeout=10).pins] == \
            ["before-batch"]
        check(plane, points, readable=[*below, *later], refused=[*points[:3], *gap])

    # Dropping the pin releases what it held: the next safeGcTs passes it.
    assert stub.DropPin(tpb.DropPinRequest(name="before-batch"), timeout=10).dropped
    last = step(plane, catalog, 18)
    assert hand_out_safe_gc_ts(plane) == last - 1
    maintenance(plane)
    check(plane, [*points, last], readable=[last], refused=points)


@pytest.mark.integration
def test_as_of_a_wall_clock_time_and_a_pin_by_name_read_the_models_table(
        make_plane: Callable[..., DataPlane], catalog: Catalog) -> None:
    plane = make_plane(nodes=1, trans={"history_retention_ms": 600_000})
    stub = plane.trans.stub()
    times = []
    for n in range(4):
        ts = step(plane, catalog, n)
        time.sleep(0.3)  # the time map samples every 100 ms: this commit is in it
        times.append((int(time.time() * 1000), ts))
        time.sleep(0.2)
    for time_ms, ts in times:
        snapshot, rows = read_as_of(plane, "orders", as_of_time_ms=time_ms)
        assert snapshot == ts  # the newest commit at or before the time
        assert rows == model_at(plane, ts)["orders"]
    stub.CreatePin(tpb.CreatePinRequest(name="eod", at_time_ms=times[1][0]), timeout=10)
    snapshot, rows = read_as_of(plane, "orders", as_of_pin="eod")
    assert rows == model_at(plane, times[1][1])["orders"]
    # Retention keeps every point of the last ten minutes: GC passes none of them.
    assert hand_out_safe_gc_ts(plane) < times[0][1]
    check(plane, [ts for _t, ts in times], readable=[ts for _t, ts in times])


@pytest.mark.integration
def test_retention_moves_the_horizon_past_old_points_and_keeps_recent_ones(
        make_plane: Callable[..., DataPlane], catalog: Catalog) -> None:
    plane = make_plane(nodes=1, trans={"history_retention_ms": 3000})
    old = step(plane, catalog, 0)
    time.sleep(0.5)
    assert hand_out_safe_gc_ts(plane) < old  # within the retention: kept
    check(plane, [old], readable=[old])

    def past_old() -> bool:
        step(plane, catalog, 1)
        return hand_out_safe_gc_ts(plane) >= old

    eventually(past_old, 30, "the retention to pass the old point")
    recent = step(plane, catalog, 2)
    status = plane.trans.stub().GetHistoryStatus(tpb.GetHistoryStatusRequest(), timeout=10)
    assert old < status.earliest_readable_ts <= recent
    assert status.history_retention_ms == 3000
    check(plane, [old, recent], readable=[recent], refused=[old])
    err = rpc_error(lambda: read_as_of(plane, "orders", as_of_ts=old))
    found = earliest_readable(err.details())
    assert found is not None and found[0] >= status.earliest_readable_ts


@pytest.mark.integration
def test_history_a_recovery_rebuilt_is_refused_never_answered_differently(
        make_plane: Callable[..., DataPlane], catalog: Catalog) -> None:
    """A write the write fence refused is still in its writer's changelog (a durable
    writer logs before it sends); the node recorded the refusal, so the recovery skips it
    at its old timestamp T (REFUSED_IS_NOT_REPLAYED, retina_server/refused_writes.py).
    This plane writes anonymously (retina.anonymous_writes: no changelog but its own
    holds its rows), so the node cannot know its replay is complete: the whole rebuilt
    range is refused (HISTORY_REBUILT_IS_REFUSED); the checkpoint's history below the
    replay start still reads exactly. tests/test_refused_replay.py: the same with
    registered writers, where the node answers up to the first timestamp it replayed."""
    from retina_common.client import requests_by_node

    plane = make_plane(nodes=1)
    node = plane.nodes[0]
    stub = plane.trans.stub()
    kept = [step(plane, catalog, n) for n in range(3)]
    # A checkpoint covers up to the HWM - 1, and the replay redoes that timestamp too:
    # two commits more, and `kept` lies below the replay start.
    step(plane, catalog, 8)
    step(plane, catalog, 9)
    plane.checkpoint(node)
    refused_write = stub.BeginTrans(tpb.BeginTransRequest(), timeout=10)
    stub.RollbackTrans(tpb.RollbackTransRequest(trans_id=refused_write.trans_id), timeout=10)
    late = order(999, note="fenced")
    plane.changelog.append((refused_write.timestamp, {"orders": {"replaces": [late]}}))
    after = step(plane, catalog, 3)  # a read at it raises the node's write fence past T
    before_crash = read_as_of(plane, "orders", as_of_ts=after)[1]
    assert before_crash == model_at(plane, after)["orders"]
    update = plane.writers["orders"].updates(refused_write.timestamp, replaces=[late])
    for request in requests_by_node(SCHEMA, [update]).values():
        fenced = rpc_error(lambda r=request: plane.retinas[node].stub.UpdateRecord(r,
                                                                                timeout=30))
        assert fenced.code() == grpc.StatusCode.ABORTED, fenced.details()
    assert read_as_of(plane, "orders", as_of_ts=after)[1] == before_crash

    plane.retinas[node].kill9()
    plane.retinas[node].start()
    starts = plane.recover(node)
    assert starts is not None and kept[-1] < starts.node_replay_from_ts <= after
    # The replay skipped the logged write at T: no version of it, hidden or not.
    assert plane.read("orders") == plane.model.rows["orders"]
    assert plane.reader is not None
    newest = plane.reader.read(SCHEMA, "orders", keep_hidden=True).table.to_pylist()
    assert [r for r in newest if r["id"] == 999] == []
    assert '"replay_refused_write_skipped"' in plane.retinas[node].log_path.read_text()
    # Anonymous writes: the replay may lack what the node had applied; refused from E.
    check(plane, [*kept, after], readable=kept, refused=[after])
