"""Primary-key lookups (LookupRows, retina_common/lookup.py, ``retina-query get``) against a
model of every table's history and against the full snapshot read of the same transaction:
present, deleted, replaced and never-written keys, rows in write buffers and in published
files, under concurrent writes, across Storage GC, a revert, a sweep and two restarts in a
row; refusals while a node is not READY, below what folding and pruning left, and of
malformed requests (which change nothing). Real processes throughout (tests/dataplane.py).
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterable
from decimal import Decimal
from typing import Any

import grpc
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pytest

from retina_common.as_of_point import AsOf
from retina_common.catalog import Catalog
from retina_common.codec import arrow_type
from retina_common.lookup import Lookup, encode_keys, merge_answers
from retina_common.pb import retina_pb2 as rpb
from retina_common.pb import trans_pb2 as tpb
from retina_common.reader import main as query_main
from retina_common.refusal import SNAPSHOT_EXPIRED, earliest_readable
from retina_server.row_gather import RowGroupRows, assemble, assemble_few
from retina_server.row_group_cache import RowGroupCache
from retina_server.row_lookup import spans_of
from retina_server.row_moves import MovesInProgress, RowMoves

from .dataplane import SCHEMA, DataPlane
from .support import begin_write, eventually, rpc_error
from .test_as_of_reads import (
    maintenance,
    restart_after,
    rewrite_every_stream,
    step,
    sweep_replaced,
)
from .test_lineage import revert
from .test_recovery_protocol import order
from .test_recovery_sequences import restart_and_recover
from .test_storage_gc import advance, all_streams_rewritten, load, settle
from .test_sweepers import sweep

NEVER = 10_000  # ids from here on are never written


def event(i: int, ok: bool = True) -> dict[str, Any]:
    return {"tenant": i % 3, "seq": i, "payload": f"p{i}".encode(), "ok": ok}


def model_at(plane: DataPlane, ts: int) -> dict[str, dict[bytes, dict[str, Any]]]:
    """The model's tables at snapshot ``ts``: after every transaction committed at or
    before it."""
    current: dict[str, dict[bytes, dict[str, Any]]] = {t: {} for t in plane.tables}
    for committed, tables in plane.model.history:
        if committed > ts:
            break
        current = tables
    return current


def commit_stamps(plane: DataPlane, table: str, ts: int) -> dict[bytes, int]:
    """Each key's last insert or replace at or before ``ts`` (its row's commit ts)."""
    writer = plane.writers[table]
    out: dict[bytes, int] = {}
    for committed, changes in plane.changelog:
        if committed > ts:
            break
        ops = changes.get(table, {})
        for row in [*ops.get("inserts", ()), *ops.get("replaces", ())]:
            out[writer.key(row)] = committed
    return out


def keys_of(plane: DataPlane, table: str) -> list[bytes]:
    """Every key the table ever had, and some it never had."""
    writer = plane.writers[table]
    keys = {writer.key(row) for _ts, changes in plane.changelog
            for rows in changes.get(table, {}).values() for row in rows}
    never = [order(i) if table == "orders" else event(i) for i in range(NEVER, NEVER + 5)]
    return sorted(keys) + [writer.key(row) for row in never]


def assert_exact(plane: DataPlane, got: Lookup, table: str, trans: tpb.BeginTransResponse,
                 ts: int | None = None) -> None:
    """``got`` (a lookup at ``ts``, default the transaction's snapshot) equals the model at
    that snapshot and the full snapshot read of the same transaction, key by key."""
    ts = trans.timestamp if ts is None else ts
    assert plane.reader is not None
    pinned = tpb.BeginTransResponse(trans_id=trans.trans_id, timestamp=ts)
    writer = plane.writers[table]
    snapshot = {writer.key(r): r for r in
                plane.reader.read_in(pinned, SCHEMA, table).table.to_pylist()}
    model = model_at(plane, ts)[table]
    assert snapshot == model
    stamps = commit_stamps(plane, table, ts)
    rows = got.by_key()
    for key, row, stamp in zip(got.keys, rows, got.commit_ts.tolist(), strict=True):
        assert row == model.get(key), (key, row, model.get(key))
        assert stamp == (stamps[key] if key in model else 0), key


def check(plane: DataPlane, tables: Iterable[str] = ("orders", "events")) -> int:
    """Every key of ``tables`` looked up in one new read transaction equals the model and
    the snapshot read; returns the keys found."""
    assert plane.reader is not None
    lookup = plane.reader.key_lookup()
    found = 0
    with plane.reader.transaction() as trans:
        for table in tables:
            got = lookup.get(SCHEMA, table, keys_of(plane, table), trans=trans)
            assert_exact(plane, got, table, trans)
            found += int(got.found.sum())
    return found


def history(plane: DataPlane) -> None:
    """Inserts, replaces, deletes, a delete and re-insert, on both tables."""
    plane.commit({"orders": {"inserts": [order(i) for i in range(60)]},
                  "events": {"inserts": [event(i) for i in range(30)]}})
    plane.commit({"orders": {"replaces": [order(i, note="v2") for i in range(0, 60, 3)],
                             "deletes": [{"id": i} for i in range(1, 60, 5)]},
                  "events": {"deletes": [{"tenant": i % 3, "seq": i} for i in range(0, 30, 4)]}})
    plane.commit({"orders": {"inserts": [order(i, note="back") for i in (1, 11, 31, 41)]},
                  "events": {"replaces": [event(i, ok=False) for i in range(1, 30, 7)]}})


def lookup_request(trans: tpb.BeginTransResponse, **fields: Any) -> rpb.LookupRowsRequest:
    return rpb.LookupRowsRequest(schema_name=SCHEMA, trans_id=trans.trans_id,
                                 timestamp=trans.timestamp, **fields)


def rows_of(reply: rpb.LookupRowsResponse) -> pa.Table:
    return pa.ipc.open_stream(reply.rows_arrow).read_all()


# --- exact answers ---------------------------------------------------------------------------
@pytest.mark.integration
def test_lookups_equal_the_model_and_the_snapshot_read(
        make_plane: Callable[..., DataPlane], catalog: Catalog) -> None:
    plane = make_plane(nodes=2)
    history(plane)
    assert check(plane) > 0  # at once: most rows still in write buffers
    settle(plane, catalog)
    settle(plane, catalog, "events")
    plane.commit({"orders": {"replaces": [order(i, note="v3") for i in range(0, 60, 7)]}})
    assert check(plane) > 0  # published files and a write buffer over them
    # Older snapshots inside one live transaction equal the model's history.
    assert plane.reader is not None
    lookup = plane.reader.key_lookup()
    keys = keys_of(plane, "orders")
    with plane.reader.transaction() as trans:
        for ts, _tables in plane.model.history:
            pinned = tpb.BeginTransResponse(trans_id=trans.trans_id, timestamp=ts)
            assert_exact(plane, lookup.get(SCHEMA, "orders", keys, trans=pinned), "orders",
                         trans, ts)
        # Columns by name in the order asked; a key asked twice is answered twice.
        table = plane.tables["orders"]
        asked = encode_keys(table, [7, 1_000_000, 7, {"id": 3}])
        got = lookup.get(SCHEMA, "orders", asked, columns=["note", "id"], trans=trans)
        model = plane.model.rows["orders"]
        assert got.rows.column_names == ["note", "id"]
        assert got.by_key() == [None if k not in model else
                                {"note": model[k]["note"], "id": model[k]["id"]} for k in asked]
        # The Arrow form of the keys (key columns, cast to the key's types) answers the same.
        node = plane.nodes[0]
        mine = [i for i in range(60) if plane.topology.node_of_vnode(
            plane.topology.vnode_of_key(plane.writers["orders"].key({"id": i}))) == node]
        sink = pa.BufferOutputStream()
        ids = pa.table({"id": pa.array(mine, pa.int32())})  # int32: cast to the int64 key
        with pa.ipc.new_stream(sink, ids.schema) as w:
            w.write_table(ids)
        arrow = plane.retinas[node].stub.LookupRows(lookup_request(
            trans, table_name="orders", key_columns_arrow=sink.getvalue().to_pybytes()),
            timeout=30)
        by_bytes = plane.retinas[node].stub.LookupRows(lookup_request(
            trans, table_name="orders", keys=encode_keys(table, mine)), timeout=30)
        assert list(arrow.found) == list(by_bytes.found)
        assert list(arrow.commit_ts) == list(by_bytes.commit_ts)
        assert rows_of(arrow).equals(rows_of(by_bytes))
        assert rows_of(arrow).num_rows == sum(
            1 for i in mine if plane.writers["orders"].key({"id": i}) in model)


@pytest.mark.integration
def test_one_transaction_answers_the_same_under_concurrent_writes(
        make_plane: Callable[..., DataPlane]) -> None:
    plane = make_plane(nodes=2)
    history(plane)
    assert plane.reader is not None
    lookup = plane.reader.key_lookup()
    keys = keys_of(plane, "orders")
    stop = threading.Event()
    failures: list[BaseException] = []

    def write() -> None:
        n = 0
        try:
            while not stop.is_set():
                n += 1
                plane.commit({"orders": {"replaces": [order(i, note=f"w{n}")
                                                      for i in range(n % 5, 60, 5)],
                                         "deletes": [{"id": (7 * n) % 60}]}})
        except BaseException as exc:  # surfaced below
            failures.append(exc)

    writer = threading.Thread(target=write)
    newest: list[Lookup] = []
    written = len(plane.model.history)
    deadline = time.monotonic() + 120
    with plane.reader.transaction() as held:
        writer.start()
        try:
            first = lookup.get(SCHEMA, "orders", keys, trans=held)
            # Until six more transactions committed (and at least four rounds): the held
            # snapshot never moves while they do.
            while len(newest) < 4 or len(plane.model.history) < written + 6:
                assert time.monotonic() < deadline, "the writer did not commit six times"
                assert not failures, failures
                again = lookup.get(SCHEMA, "orders", keys, trans=held)
                assert again.by_key() == first.by_key()
                assert again.commit_ts.tolist() == first.commit_ts.tolist()
                newest.append(lookup.get(SCHEMA, "orders", keys))  # a new snapshot each
        finally:
            stop.set()
            writer.join(60)
        assert not failures, failures
        assert_exact(plane, first, "orders", held)
    stamps = [got.timestamp for got in newest]
    assert stamps == sorted(stamps) and stamps[-1] > held.timestamp
    for got in newest:  # each newest snapshot is the model at its own timestamp
        model = model_at(plane, got.timestamp)["orders"]
        assert got.by_key() == [model.get(k) for k in keys]


@pytest.mark.integration
def test_lookups_stay_exact_across_gc_a_revert_a_sweep_and_two_restarts(
        make_plane: Callable[..., DataPlane], catalog: Catalog) -> None:
    plane = make_plane(gc_retired_retention_ms=0, sweeper_interval_ms=0,
                       gc_interval_ms=3_600_000, checkpoint_interval_ms=3_600_000)
    node = plane.nodes[0]
    load(plane, catalog)  # published files, every third row deleted
    assert check(plane) > 0  # every published row group read: the row-group cache holds them
    assert plane.reader is not None
    lookup = plane.reader.key_lookup()
    keys = keys_of(plane, "orders")
    with plane.reader.transaction() as before_gc:
        held = lookup.get(SCHEMA, "orders", keys, trans=before_gc)
        results = all_streams_rewritten(plane)  # the cached files are replaced
        assert all(r.outcome == "COMMITTED" for r in results)
        assert sum(r.rows_dropped for r in results) > 0
        again = lookup.get(SCHEMA, "orders", keys, trans=before_gc)
        assert again.by_key() == held.by_key()  # a snapshot taken before the rewrite
        assert_exact(plane, again, "orders", before_gc)
    assert check(plane) > 0  # new snapshots: the rows in the new files
    plane.commit({"orders": {"replaces": [order(i, note="after") for i in range(1, 120, 4)],
                             "deletes": [{"id": i} for i in range(2, 120, 4)]}})
    advance(plane)
    assert check(plane) > 0  # deletes and replaces of moved rows
    reverted = results[0]
    assert revert(plane, node, reverted.rewrite_id).record.status == "REVERTED"
    assert check(plane) > 0  # the rows moved back to the old files
    for _ in range(2):  # both checkpoint slots hold the files: the old ones are unheld
        plane.checkpoint(node)
    assert sweep(plane, node, "retired").removed > 0
    assert check(plane) > 0
    for _ in range(2):  # two restarts in a row
        restart_and_recover(plane, node)
        assert check(plane) > 0
    plane.commit({"orders": {"deletes": [{"id": i} for i in range(3, 120, 4)]}})
    assert check(plane) > 0


def check_as_of(plane: DataPlane, points: Iterable[int], *, readable: Iterable[int] = (),
                refused: Iterable[int] = ()) -> set[int]:
    """Every key of orders looked up in an AS OF transaction at every point: the model's
    table then (and the AS OF snapshot read, at a point that must be readable), or refused
    snapshot_expired. Returns the points refused."""
    assert plane.reader is not None
    lookup = plane.reader.key_lookup()
    keys = keys_of(plane, "orders")
    must = set(readable)
    out = set()
    for ts in points:
        try:
            with plane.reader.transaction(AsOf(ts=ts)) as trans:
                got = lookup.get(SCHEMA, "orders", keys, trans=trans)
                if ts in must:
                    assert_exact(plane, got, "orders", trans)
        except grpc.RpcError as exc:
            assert exc.code() == grpc.StatusCode.FAILED_PRECONDITION, (ts, exc.details())
            assert (exc.details() or "").startswith(SNAPSHOT_EXPIRED), (ts, exc.details())
            out.add(ts)
            continue
        assert got.timestamp == ts
        model = model_at(plane, ts)["orders"]
        assert got.by_key() == [model.get(k) for k in keys], f"AS OF {ts}"
    assert not out & must, f"refused though retained: {sorted(out & must)}"
    assert set(refused) <= out, f"answered though gone: {sorted(set(refused) - out)}"
    return out


@pytest.mark.integration
def test_as_of_lookups_equal_the_models_history_across_gc_a_sweep_and_two_restarts(
        make_plane: Callable[..., DataPlane], catalog: Catalog) -> None:
    """A lookup takes any live read transaction: in an AS OF one it reads the keys as
    they were (docs/history.md says how far back), exactly or refused."""
    plane = make_plane(nodes=2, gc_retired_retention_ms=0, sweeper_interval_ms=0,
                       gc_interval_ms=1000)
    stub = plane.trans.stub()
    # A pin before the first point holds every later one (the nodes' GC rounds would
    # otherwise move the horizon past them within a second).
    first = stub.GetHighWatermark(tpb.GetHighWatermarkRequest(), timeout=10).high_watermark
    stub.CreatePin(tpb.CreatePinRequest(name="all", ts=first), timeout=10)
    points = [step(plane, catalog, n) for n in range(7)]
    check_as_of(plane, points, readable=points)
    assert rewrite_every_stream(plane)
    maintenance(plane)
    check_as_of(plane, points, readable=points)  # the rows in the rewritten files
    sweep_replaced(plane, catalog)
    check_as_of(plane, points, readable=points)
    # Two restarts in a row: below the replay start the checkpoint's history answers,
    # what the recovery rebuilt is refused, later points read again.
    node = plane.nodes[0]
    gap, replay_from = restart_after(plane, catalog, node, range(7, 9))
    below = [p for p in points if p < replay_from]
    points += gap
    assert below
    check_as_of(plane, points, readable=below, refused=gap)
    restart_and_recover(plane, node)
    later = [step(plane, catalog, n) for n in range(9, 11)]
    points += later
    check_as_of(plane, points, readable=[*below, *later], refused=gap)


# --- refusals --------------------------------------------------------------------------------
@pytest.mark.integration
def test_a_node_that_is_not_ready_refuses_and_a_restart_ends_old_snapshots(
        make_plane: Callable[..., DataPlane]) -> None:
    plane = make_plane(recover=False)
    node = plane.nodes[0]
    stub = plane.retinas[node].stub
    key = plane.writers["orders"].key({"id": 1})
    recovering = rpc_error(lambda: stub.LookupRows(rpb.LookupRowsRequest(
        schema_name=SCHEMA, table_name="orders", keys=[key], trans_id=1, timestamp=1),
        timeout=10))
    assert recovering.code() == grpc.StatusCode.UNAVAILABLE
    plane.recover(node)
    eventually(plane.gate_open, 15, "the query gate to admit")
    plane.commit({"orders": {"inserts": [order(i) for i in range(10)]}})
    assert check(plane, ["orders"]) == 10
    assert plane.reader is not None
    lookup = plane.reader.key_lookup()
    with plane.reader.transaction() as old:
        assert lookup.get(SCHEMA, "orders", [key], trans=old).found.tolist() == [True]
        plane.retinas[node].kill9()
        plane.retinas[node].start()  # RECOVERING until the replay ends
        during = rpc_error(lambda: lookup.get(SCHEMA, "orders", [key], trans=old))
        assert during.code() == grpc.StatusCode.UNAVAILABLE
        plane.recover(node)
        # SNAPSHOTS_END_AT_RESTART: a snapshot from before the restart is not answered.
        after = rpc_error(lambda: lookup.get(SCHEMA, "orders", [key], trans=old))
        assert after.code() == grpc.StatusCode.ABORTED
    assert check(plane, ["orders"]) == 10


def ended_write(plane: DataPlane) -> tpb.BeginTransResponse:
    """A write transaction rolled back, and the HWM past it (an empty commit after it): a
    read snapshot now covers its timestamp, and a write at it arrives late."""
    stub = plane.trans.stub()
    ended = begin_write(stub)
    stub.RollbackTrans(tpb.RollbackTransRequest(trans_id=ended.trans_id), timeout=10)
    tick = begin_write(stub)
    stub.CommitTrans(tpb.CommitTransRequest(trans_id=tick.trans_id), timeout=10)
    return ended


def send_at(plane: DataPlane, ts: int, rows: list[dict[str, Any]]) -> None:
    """UpdateRecord of ``rows`` at ``ts`` to their nodes (no transaction of ours)."""
    for node, datas in plane.writers["orders"].updates(ts, inserts=rows).items():
        plane.retinas[node].stub.UpdateRecord(rpb.UpdateRecordRequest(
            schema_name=SCHEMA, table_update_data=datas), timeout=30)


@pytest.mark.integration
def test_malformed_lookups_are_refused_and_change_nothing(
        make_plane: Callable[..., DataPlane]) -> None:
    # No checkpoint or GC round raises the write fence behind the test's back.
    plane = make_plane(nodes=2, checkpoint_interval_ms=3_600_000, gc_interval_ms=3_600_000)
    plane.commit({"orders": {"inserts": [order(i) for i in range(20)]},
                  "events": {"inserts": [event(i) for i in range(6)]}})
    node, other = plane.nodes
    stub = plane.retinas[node].stub

    def owned_by(owner: str, start: int = 0) -> int:
        return next(i for i in range(start, start + 100)
                    if plane.topology.node_of_vnode(plane.topology.vnode_of_key(
                        plane.writers["orders"].key({"id": i}))) == owner)

    mine, theirs = (plane.writers["orders"].key({"id": owned_by(n)}) for n in (node, other))
    events_key = plane.writers["events"].key(event(1))
    # A read that is answered raises the node's write fence to its snapshot, so a write
    # at a timestamp below it that arrives later is refused (LATE_WRITES_FENCED). A
    # refused lookup must change nothing, the fence included: a late write at the
    # timestamp of this ended transaction is still admitted after the refusals below.
    late = ended_write(plane)
    assert plane.reader is not None
    with plane.reader.transaction() as trans:
        assert trans.timestamp > late.timestamp
        write = begin_write(plane.trans.stub())
        bad: list[tuple[rpb.LookupRowsRequest, grpc.StatusCode, str]] = [
            (lookup_request(trans, table_name="nope", keys=[mine]),
             grpc.StatusCode.NOT_FOUND, "nope"),
            (lookup_request(trans, keys=[mine]), grpc.StatusCode.INVALID_ARGUMENT,
             "table_name"),
            (lookup_request(trans, table_name="orders", keys=[events_key]),
             grpc.StatusCode.INVALID_ARGUMENT, "not a primary key"),  # another key's arity
            (lookup_request(trans, table_name="orders", keys=[mine + b"\x00"]),
             grpc.StatusCode.INVALID_ARGUMENT, "bytes follow"),
            (lookup_request(trans, table_name="orders", keys=[mine[:-1]]),
             grpc.StatusCode.INVALID_ARGUMENT, "not a primary key"),
            (lookup_request(trans, table_name="orders", keys=[b""]),
             grpc.StatusCode.INVALID_ARGUMENT, "not a primary key"),
            (lookup_request(trans, table_name="orders", keys=[mine], columns=["id", "nope"]),
             grpc.StatusCode.INVALID_ARGUMENT, "no column"),
            (lookup_request(trans, table_name="orders", keys=[mine], columns=["id", "id"]),
             grpc.StatusCode.INVALID_ARGUMENT, "twice"),
            (lookup_request(trans, table_name="orders", keys=[mine],
                            key_columns_arrow=b"\x00"), grpc.StatusCode.INVALID_ARGUMENT,
             "not both"),
            (lookup_request(trans, table_name="orders", key_columns_arrow=b"junk"),
             grpc.StatusCode.INVALID_ARGUMENT, "key_columns_arrow"),
            (lookup_request(trans, table_name="orders", keys=[mine] * 501),
             grpc.StatusCode.INVALID_ARGUMENT, "limit"),
            (lookup_request(trans, table_name="orders", keys=[theirs]),
             grpc.StatusCode.FAILED_PRECONDITION, other),  # routed to the wrong node
            (rpb.LookupRowsRequest(schema_name=SCHEMA, table_name="orders", keys=[mine],
                                   trans_id=trans.trans_id, timestamp=0),
             grpc.StatusCode.INVALID_ARGUMENT, "timestamp"),
            (rpb.LookupRowsRequest(schema_name=SCHEMA, table_name="orders", keys=[mine],
                                   trans_id=trans.trans_id, timestamp=trans.timestamp + 10),
             grpc.StatusCode.INVALID_ARGUMENT, "after read transaction"),
            (rpb.LookupRowsRequest(schema_name=SCHEMA, table_name="orders", keys=[mine],
                                   timestamp=trans.timestamp),
             grpc.StatusCode.INVALID_ARGUMENT, "trans_id"),
            (rpb.LookupRowsRequest(schema_name=SCHEMA, table_name="orders", keys=[mine],
                                   trans_id=write.trans_id, timestamp=write.timestamp),
             grpc.StatusCode.FAILED_PRECONDITION, "write transaction"),
        ]
        for request, code, words in bad:
            err = rpc_error(lambda r=request: stub.LookupRows(r, timeout=10))
            assert (err.code(), words in (err.details() or "")) == (code, True), \
                (request, err.code(), err.details())
        plane.trans.stub().RollbackTrans(tpb.RollbackTransRequest(trans_id=write.trans_id),
                                         timeout=10)
    # Nothing changed: the late write is still admitted (the fence did not move) ...
    late_rows = [order(100 + i) for i in range(3)]
    send_at(plane, late.timestamp, late_rows)
    for row in late_rows:  # the oracle follows (no commit came after the late one)
        plane.model.rows["orders"][plane.writers["orders"].key(row)] = row
    plane.model.history.append((late.timestamp, plane.model.snapshot()))
    plane.changelog.append((late.timestamp, {"orders": {"inserts": late_rows}}))
    # ... and every table reads and looks up as the model says.
    assert plane.read("orders") == plane.model.rows["orders"]
    assert check(plane) == 29
    # An answered lookup does raise the fence: a late write below it is refused.
    later = ended_write(plane)
    with plane.reader.transaction() as trans:
        answered = stub.LookupRows(lookup_request(trans, table_name="orders", keys=[mine]),
                                   timeout=10)
        assert list(answered.found) == [True]
    fenced = rpc_error(lambda: send_at(plane, later.timestamp, [order(owned_by(node, 200))]))
    assert fenced.code() == grpc.StatusCode.ABORTED, fenced.details()
    assert check(plane) == 29


def prunable(plane: DataPlane, catalog: Catalog) -> None:
    """Versions to prune on the node: published files, two checkpoints since READY (the
    prune horizon waits for them), and a commit after them."""
    for round_ in range(3):
        plane.commit({"orders": {"replaces": [order(i, note=str(round_)) for i in range(30)],
                                 "deletes": [{"id": i} for i in range(round_, 30, 5)]}})
    advance(plane)
    settle(plane, catalog)
    for _ in range(2):
        plane.checkpoint(plane.nodes[0])
    advance(plane)


@pytest.mark.integration
def test_snapshots_below_folded_visibility_or_pruned_versions_are_refused(
        make_plane: Callable[..., DataPlane], catalog: Catalog) -> None:
    plane = make_plane(checkpoint_interval_ms=3_600_000, gc_interval_ms=3_600_000)
    node = plane.nodes[0]
    stub = plane.retinas[node].stub
    first, _ = plane.commit({"orders": {"inserts": [order(i) for i in range(40)]}})
    prunable(plane, catalog)
    done = stub.RunGcMaintenance(rpb.RunGcMaintenanceRequest(), timeout=60)
    assert done.folded_items > 0 and done.pruned_versions > 0, done
    assert plane.reader is not None
    keys = keys_of(plane, "orders")
    mine = [k for k in keys if plane.topology.node_of_vnode(
        plane.topology.vnode_of_key(k)) == node]
    with plane.reader.transaction() as trans:
        old = tpb.BeginTransResponse(trans_id=trans.trans_id, timestamp=first)
        err = rpc_error(lambda: plane.reader.key_lookup().get(SCHEMA, "orders", mine,
                                                              trans=old))
        assert err.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert (err.details() or "").startswith(SNAPSHOT_EXPIRED), err.details()
        named = earliest_readable(err.details() or "")
        assert named is not None, err.details()
        earliest = named[0]
        assert first < earliest <= trans.timestamp
        at = tpb.BeginTransResponse(trans_id=trans.trans_id, timestamp=max(
            earliest, done.fold_ts, done.prune_horizon_ts))
        got = plane.reader.key_lookup().get(SCHEMA, "orders", keys, trans=at)
        assert_exact(plane, got, "orders", trans, at.timestamp)


@pytest.mark.integration
def test_a_kill_after_the_prune_horizon_is_recorded_recovers_to_the_model(
        make_plane: Callable[..., DataPlane], catalog: Catalog) -> None:
    plane = make_plane(checkpoint_interval_ms=3_600_000, gc_interval_ms=3_600_000,
                       failpoints="index.prune_horizon.after=exit(137)")
    node = plane.nodes[0]
    proc = plane.retinas[node]
    prunable(plane, catalog)
    rpc_error(lambda: proc.stub.RunGcMaintenance(rpb.RunGcMaintenanceRequest(), timeout=60))
    assert proc.wait_exit(30) == 137  # the horizon is durable, no version pruned yet
    proc.start()
    plane.recover(node)
    assert check(plane) > 0
    restart_and_recover(plane, node)  # the second restart in a row
    assert check(plane) > 0
    prunable(plane, catalog)
    done = plane.retinas[node].stub.RunGcMaintenance(rpb.RunGcMaintenanceRequest(),
                                                     timeout=60)
    assert done.pruned_versions > 0, done
    assert check(plane) > 0


# --- the command line ------------------------------------------------------------------------
@pytest.mark.integration
def test_retina_query_get_prints_the_rows_of_keys_in_their_order(
        make_plane: Callable[..., DataPlane], capsys: pytest.CaptureFixture[str]) -> None:
    plane = make_plane(nodes=2)
    first, _ = plane.commit({"orders": {"inserts": [order(i) for i in range(10)]},
                             "events": {"inserts": [event(i) for i in range(6)]}})
    plane.trans.stub().CreatePin(tpb.CreatePinRequest(name="before", ts=first), timeout=10)
    plane.commit({"orders": {"deletes": [{"id": 4}]}})
    config = ["--config", str(plane.config_path)]
    assert query_main(["get", f"{SCHEMA}.orders", "4", "--pin", "before", *config]) == 0
    past = capsys.readouterr()  # the row as it was before its delete
    assert past.out.splitlines()[2].split()[0] == "4" and "as of pin before" in past.err
    assert query_main(["get", f"{SCHEMA}.orders", "3", "4", "99", '{"id": 1}', "--format",
                       "json", *config]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [(x["key"], x["found"]) for x in lines] == [
        ("3", True), ("4", False), ("99", False), ('{"id": 1}', True)]
    assert lines[0]["row"]["id"] == 3 and Decimal(lines[0]["row"]["amount"]) == Decimal("0.75")
    assert lines[0]["commit_ts"] == plane.changelog[0][0]
    keys_file = plane.workdir / "keys.txt"
    keys_file.write_text("[1, 1]\n\n[2, 5]\n[0, 77]\n")
    assert query_main(["get", f"{SCHEMA}.events", "--keys-file", str(keys_file),
                       "--columns", "seq,ok", *config]) == 0
    out = capsys.readouterr()
    assert out.out.split("\n")[0].split() == ["seq", "ok"]
    assert [line.split() for line in out.out.splitlines()[2:]] == [["1", "True"],
                                                                    ["5", "True"]]
    assert "2 of 3 keys found" in out.err and "not found: [0, 77]" in out.err
    assert query_main(["get", f"{SCHEMA}.orders", "x", *config]) == 2  # not an int64 key
    assert query_main(["get", f"{SCHEMA}.nope", "1", *config]) == 2
    assert query_main(["get", f"{SCHEMA}.orders", "1", "--columns", "nope", *config]) == 1
    assert "INVALID_ARGUMENT" in capsys.readouterr().err


# --- pure logic ------------------------------------------------------------------------------
def test_the_client_merges_answers_into_the_callers_key_order() -> None:
    def reply(found: list[bool], ids: list[int]) -> rpb.LookupRowsResponse:
        rows = pa.table({"id": pa.array(ids, pa.int64())})
        sink = pa.BufferOutputStream()
        with pa.ipc.new_stream(sink, rows.schema) as w:
            w.write_table(rows)
        return rpb.LookupRowsResponse(found=found, commit_ts=[7 if f else 0 for f in found],
                                      rows_arrow=sink.getvalue().to_pybytes())

    keys = [b"a", b"b", b"c", b"d", b"e"]
    got = merge_answers(keys, [(np.array([4, 0, 2]), reply([True, False, True], [40, 20])),
                               (np.array([1, 3]), reply([True, True], [10, 30]))], 9)
    assert got.found.tolist() == [False, True, True, True, True]
    assert got.commit_ts.tolist() == [0, 7, 7, 7, 7]
    assert got.by_key() == [None, {"id": 10}, {"id": 20}, {"id": 30}, {"id": 40}]


def test_the_row_group_cache_is_bounded_by_bytes_and_forgets_gone_files() -> None:
    group = RowGroupRows(pa.table({"v": pa.array(np.arange(1000), pa.int64())}))  # 8,000 bytes
    cache = RowGroupCache(max_bytes=3 * group.nbytes)
    loads: list[tuple[int, int]] = []

    def get(file_id: int, rg: int) -> RowGroupRows:
        def load() -> RowGroupRows:
            loads.append((file_id, rg))
            return group
        return cache.get((file_id, rg), load)

    for key in [(1, 0), (1, 1), (2, 0), (1, 0), (3, 0), (1, 0), (1, 1)]:
        get(*key)
    # (1, 1) was the least recently used when (3, 0) came: evicted, then loaded again.
    assert loads == [(1, 0), (1, 1), (2, 0), (3, 0), (1, 1)]
    assert cache.bytes_held == 3 * group.nbytes
    cache.forget_files([1])
    assert cache.bytes_held == group.nbytes
    get(1, 0)
    assert loads[-1] == (1, 0)
    too_big = RowGroupRows(pa.table({"v": pa.array(np.arange(4000), pa.int64())}))
    assert cache.get((9, 0), lambda: too_big) is too_big  # served, not kept
    assert cache.bytes_held == 2 * group.nbytes


def test_row_moves_tell_a_reader_that_rows_moved_under_it() -> None:
    moves = RowMoves()
    gone: list[list[int]] = []
    moves.on_files_gone = gone.append
    before = moves.settled()
    assert moves.unchanged_since(before)
    with moves.moving(files_gone=[4]):
        assert not moves.unchanged_since(before)
        with pytest.raises(MovesInProgress):
            moves.settled(timeout_s=0.05)
        with moves.moving():  # overlapping changes: settled only once both ended
            pass
        with pytest.raises(MovesInProgress):
            moves.settled(timeout_s=0.05)
    after = moves.settled()
    assert after != before and moves.unchanged_since(after) and gone == [[4]]
    waiting: list[int] = []
    with moves.moving():
        reader = threading.Thread(target=lambda: waiting.append(moves.settled()))
        reader.start()
        reader.join(0.1)
        assert reader.is_alive()  # a reader waits for the change to end
    reader.join(5)
    assert waiting and moves.unchanged_since(waiting[0])


def test_gathers_of_every_column_type_equal_arrows_take() -> None:
    """assemble (numpy gathers, LookupRows' rows) equals Arrow's take and concat, for every
    codec type, NULLs, sliced and multi-chunk inputs, and a column a row group lacks."""
    rng = np.random.default_rng(5)
    types = {"b": "boolean", "i": "int32", "l": "int64", "f": "float32", "d": "float64",
             "s": "string", "y": "binary", "t": "date32", "u": "timestamp_us",
             "m": "decimal(12,2)"}
    schema = pa.schema([pa.field(n, arrow_type(t)) for n, t in types.items()])

    def group(n: int) -> pa.Table:
        values = {"b": rng.random(n) < 0.5, "i": rng.integers(-9, 9, n).astype(np.int32),
                  "l": rng.integers(-10**12, 10**12, n), "f": rng.random(n).astype(np.float32),
                  "d": rng.random(n), "s": [f"s{v}" * int(v % 4) for v in range(n)],
                  "y": [bytes([v % 256]) * int(v % 3) for v in range(n)],
                  "t": rng.integers(0, 20000, n).astype(np.int32),
                  "u": rng.integers(0, 10**15, n), "m": [Decimal(int(v)) / 100 for v in
                                                        rng.integers(-10**9, 10**9, n)]}
        columns = []
        for field in schema:
            column = pa.array(values[field.name]).cast(field.type) \
                if field.name not in "sym" else pa.array(values[field.name], field.type)
            nulls = pa.array(rng.random(n) < 0.2)
            columns.append(pc.if_else(nulls, pa.nulls(n, field.type), column))
        return pa.Table.from_arrays(columns, schema=schema)

    tables = [group(50), group(80).slice(10, 60),
              pa.concat_tables([group(30), group(40)]), group(20).drop_columns(["s", "m"])]
    picks = [np.sort(rng.choice(t.num_rows, 7, replace=False)) for t in tables]
    got = assemble(schema, [(RowGroupRows(t), p) for t, p in zip(tables, picks, strict=True)])
    expected = pa.concat_tables([
        t.take(pa.array(p)) if t.num_columns == len(schema) else
        pa.Table.from_arrays([t.column(f.name).take(pa.array(p)) if f.name in t.column_names
                              else pa.nulls(len(p), f.type) for f in schema], schema=schema)
        for t, p in zip(tables, picks, strict=True)])
    assert got.equals(expected.combine_chunks())
    few = assemble_few(schema, [(RowGroupRows(t), int(p[0])) for t, p in
                                zip(tables, picks, strict=True)])
    assert few.combine_chunks().equals(expected.take(pa.array([0, 7, 14, 21])).combine_chunks())


def test_spans_group_consecutive_row_groups_up_to_the_span_size() -> None:
    assert spans_of([4096] * 4) == ({0: 4096, 1: 4096, 2: 4096, 3: 4096},)
    assert spans_of([4096] * 5) == ({0: 4096, 1: 4096, 2: 4096, 3: 4096}, {4: 4096})
    assert spans_of([50_000, 10, 20_000]) == ({0: 50_000}, {1: 10}, {2: 20_000})
    assert spans_of([]) == ()
    rows = RowGroupRows(pa.table({"v": pa.array(np.arange(30), pa.int64())}), {4: 10, 5: 20})
    assert rows.start(4) == (0, 10) and rows.start(5) == (10, 20)
