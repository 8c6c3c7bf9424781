"""Partial updates (docs/encoding.md, "Partial updates"; retina_server/partial_update.py)
against a model, on real nodes: merged with the key's row, NULL as a value, a key with
no row inserted with NULL outside the targets, several timestamps of one key in one
request, both wire forms, kills and replays (the merge of a replayed update is the
same row), and the refusals, each with nothing applied.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping
from decimal import Decimal
from pathlib import Path
from typing import Any

import grpc
import pytest

from retina_common.catalog import Catalog, ColumnSpec
from retina_common.changelog import DELETE, PARTIAL, Changelog, ChangeRow, LoggedTransaction
from retina_common.changelog_replay import PartialUpdatesRefused, requests
from retina_common.client import TableWriter, requests_by_node
from retina_common.codec import value_encoder
from retina_common.pb import retina_pb2 as rpb
from retina_common.pb import trans_pb2 as tpb

from .dataplane import SCHEMA, DataPlane
from .support import begin_write, rpc_error
from .test_recovery_sequences import restart_and_recover

pytestmark = pytest.mark.integration

ORDER_COLUMNS = ("id", "customer", "amount", "note")
Parts = list[dict[str, list[rpb.TableUpdateData]]]


def order(i: int, rng: random.Random) -> dict[str, Any]:
    return {"id": i, "customer": f"c{rng.randrange(1000)}",
            "amount": Decimal(rng.randrange(1, 100_000)) / 100,
            "note": None if rng.random() < 0.3 else f"n{rng.randrange(1000)}"}


def partial(i: int, rng: random.Random, targets: tuple[str, ...] | None = None
            ) -> dict[str, Any]:
    """A partial update of order ``i``: some of its value columns (NULL 25 % of the time,
    a value like any other)."""
    if targets is None:
        targets = tuple(c for c in ORDER_COLUMNS[1:] if rng.random() < 0.5) or ("note",)
    values = order(i, rng)
    return {"id": i, **{c: None if rng.random() < 0.25 else values[c] for c in targets}}


def transaction(rng: random.Random, live: set[int], keys: range) -> dict[str, list]:
    """One source transaction of the orders table: one change per key (its net effect),
    a third of them partial updates, of live keys and of keys with no row."""
    ops: dict[str, list] = {"replaces": [], "deletes": [], "partials": []}
    uniform = None  # half the transactions: one target list (the columnar form holds one)
    if rng.random() < 0.5:
        uniform = tuple(c for c in ORDER_COLUMNS[1:] if rng.random() < 0.5) or ("amount",)
    for i in rng.sample(keys, 8):
        draw = rng.random()
        if draw < 0.35:
            ops["partials"].append(partial(i, rng, uniform))
        elif draw < 0.5 and i in live:
            ops["deletes"].append({"id": i})
        else:
            ops["replaces"].append(order(i, rng))
    return {k: v for k, v in ops.items() if v}


def live_ids(plane: DataPlane) -> set[int]:
    return {row["id"] for row in plane.model.rows["orders"].values()}


def test_partial_updates_equal_the_model_through_kills_and_two_restarts_in_a_row(
        make_plane: Callable[..., DataPlane]) -> None:
    """A random history of replaces, deletes and partial updates (targets at random, NULL
    among the values, keys with and without a row, both wire forms) equals the model
    after every few transactions, after a SIGKILL of each node (its replay merges every
    partial update again, over the rows the replay rebuilt), after two restarts in a
    row, and at older snapshots."""
    plane = make_plane(nodes=2)
    rng = random.Random(30)
    keys = range(40)
    stamps = []
    for step in range(36):
        ts, _ = plane.commit({"orders": transaction(rng, live_ids(plane), keys)})
        stamps.append(ts)
        if step % 6 == 5:
            assert plane.read("orders") == plane.model.rows["orders"], f"after step {step}"
        if step == 11:
            restart_and_recover(plane, plane.nodes[0])
        if step == 23:
            plane.checkpoint(plane.nodes[1])
            restart_and_recover(plane, plane.nodes[1])
            restart_and_recover(plane, plane.nodes[1])
    history = dict(plane.model.history)
    for ts in stamps[-8::3]:  # written after the last restart: still readable
        assert plane.read_at("orders", ts) == history[ts]["orders"], f"at {ts}"
    restart_and_recover(plane, plane.nodes[0])
    assert plane.read("orders") == plane.model.rows["orders"]
    merged = sum(len(ops.get("partials", ())) for _ts, c in plane.changelog
                 for ops in c.values())
    assert merged > 80  # the history is mostly about them


def send_at(plane: DataPlane, trans: list[tpb.BeginTransResponse], parts: Parts) -> None:
    """One request per node carrying ``parts`` (of several transactions), then every
    transaction committed; rolled back if a node refuses."""
    stub = plane.trans.stub()
    try:
        for node, request in requests_by_node(SCHEMA, parts).items():
            plane.retinas[node].stub.UpdateRecord(request, timeout=30)
    except grpc.RpcError:
        for t in trans:
            stub.RollbackTrans(tpb.RollbackTransRequest(trans_id=t.trans_id), timeout=10)
        raise
    for t in trans:
        stub.CommitTrans(tpb.CommitTransRequest(trans_id=t.trans_id), timeout=10)


def record(plane: DataPlane, ts: int, ops: Mapping[str, list]) -> None:
    """The model and the plane's changelog (its replay source) take one transaction of
    the orders table."""
    plane.record(ts, {"orders": ops})


def test_one_request_merges_each_timestamp_over_the_ones_before_it(
        make_plane: Callable[..., DataPlane]) -> None:
    """A micro-batch of four transactions in one request (as the connector sends them):
    a partial update merges with the row an earlier timestamp of the same request left
    (a replace, a merged partial update; none after a delete), every snapshot in
    between equals the model, and the replay after a SIGKILL merges the same rows."""
    plane = make_plane(nodes=1)
    rng = random.Random(7)
    plane.commit({"orders": {"replaces": [order(i, rng) for i in range(6)]}})
    stub = plane.trans.stub()
    trans = [begin_write(stub) for _ in range(4)]
    stamps = [t.timestamp for t in trans]
    history = [
        {"replaces": [order(1, rng)], "deletes": [{"id": 2}]},
        {"partials": [{"id": 1, "note": "first"}, {"id": 2, "customer": "back"},
                      {"id": 3, "amount": None}, {"id": 9, "note": "new"}]},
        {"partials": [{"id": 1, "amount": Decimal("9.99")}, {"id": 2, "note": "again"}],
         "deletes": [{"id": 3}]},
        {"partials": [{"id": 3, "customer": "after-delete"},
                      {"id": 1, "customer": "last", "note": None}]},
    ]
    writer = plane.writers["orders"]
    parts = [writer.updates(ts, **ops) for ts, ops in zip(stamps, history, strict=True)]
    send_at(plane, trans, parts)
    for ts, ops in zip(stamps, history, strict=True):
        record(plane, ts, ops)
    expected = plane.model.rows["orders"]
    assert expected[writer.key({"id": 1})] == {
        "id": 1, "customer": "last", "amount": Decimal("9.99"), "note": None}
    assert expected[writer.key({"id": 2})] == {
        "id": 2, "customer": "back", "amount": None, "note": "again"}
    assert plane.read("orders") == expected
    snapshots = dict(plane.model.history)
    for ts in stamps:
        assert plane.read_at("orders", ts) == snapshots[ts]["orders"], f"at {ts}"
    restart_and_recover(plane, plane.nodes[0])
    assert plane.read("orders") == expected


@pytest.fixture
def wide(make_plane: Callable[..., DataPlane], catalog: Catalog) -> DataPlane:
    """A plane with a table of a NOT NULL column: wide(id, a NOT NULL, b, c)."""
    plane = make_plane(nodes=1)
    table = catalog.create_table(SCHEMA, "wide", [
        ColumnSpec("id", "int64"), ColumnSpec("a", "string", nullable=False),
        ColumnSpec("b", "int64"), ColumnSpec("c", "string")], ["id"])
    plane.tables["wide"] = table
    plane.writers["wide"] = TableWriter(table, plane.topology, min_columnar_rows=1)
    return plane


def write(plane: DataPlane, table: str, **ops: list[dict[str, Any]]) -> int:
    """One transaction of ``ops`` on ``table``; returns its timestamp."""
    trans = begin_write(plane.trans.stub())
    send_at(plane, [trans], [plane.writers[table].updates(trans.timestamp, **ops)])
    return trans.timestamp


def refused(plane: DataPlane, table: str, build: Callable[[int], Parts]) -> grpc.RpcError:
    """``build``'s request refused, with nothing of it applied."""
    before = plane.read(table)
    trans = begin_write(plane.trans.stub())
    error = rpc_error(lambda: send_at(plane, [trans], build(trans.timestamp)))
    assert plane.read(table) == before
    return error


def test_refusals_name_what_is_wrong_and_apply_nothing(wide: DataPlane) -> None:
    plane = wide
    writer = plane.writers["wide"]
    status = plane.status(plane.nodes[0])
    assert status.accepts_partial
    write(plane, "wide", replaces=[{"id": 1, "a": "x", "b": 1, "c": "y"}])
    others = [{"id": i, "a": f"a{i}", "b": i, "c": None} for i in range(10, 20)]
    write(plane, "wide", replaces=others)
    # NULL is a value; a column outside the targets keeps its value.
    write(plane, "wide", partials=[{"id": 1, "b": 2}])
    write(plane, "wide", partials=[{"id": 1, "c": None}])
    assert plane.read("wide")[writer.key({"id": 1})] == {"id": 1, "a": "x", "b": 2, "c": None}
    # NOT_NULL_HOLDS: a key with no row, inserted without its NOT NULL column a: refused,
    # and the other parts of the request (full rows, replaces of live keys in the other
    # virtual nodes, another key's merge) with it.
    error = refused(plane, "wide", lambda ts: [writer.updates(
        ts, replaces=[{"id": 5, "a": "five", "b": 5, "c": None},
                      *({**r, "c": "changed"} for r in others)],
        partials=[{"id": 1, "b": 3}, {"id": 7, "b": 7}])])
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "NOT NULL column a" in error.details() and "nothing was applied" in error.details()
    # The same key with a among its targets is inserted, NULL elsewhere.
    write(plane, "wide", partials=[{"id": 7, "a": "seven"}])
    assert plane.read("wide")[writer.key({"id": 7})] == {"id": 7, "a": "seven", "b": None,
                                                         "c": None}
    for label, build, code, words in [
        ("NULL into a NOT NULL target", lambda ts: [writer.updates(
            ts, partials=[{"id": 1, "a": None}])],
         grpc.StatusCode.INVALID_ARGUMENT, "NOT NULL column a"),
        ("a full row with NULL in a NOT NULL column", lambda ts: [writer.updates(
            ts, replaces=[{"id": 2, "a": None, "b": 1, "c": "z"}])],
         grpc.StatusCode.INVALID_ARGUMENT, "NOT NULL column a"),
        ("an unknown target column", lambda ts: crafted(plane, ts, ["id", "zz"], [1, 4]),
         grpc.StatusCode.INVALID_ARGUMENT, "'zz'"),
        ("targets without the key column", lambda ts: crafted(plane, ts, ["b"], [4]),
         grpc.StatusCode.INVALID_ARGUMENT, "primary-key column id"),
        ("a target named twice", lambda ts: crafted(plane, ts, ["id", "b", "b"], [1, 4, 5]),
         grpc.StatusCode.INVALID_ARGUMENT, "twice"),
        ("a value short", lambda ts: crafted(plane, ts, ["id", "b"], [1]),
         grpc.StatusCode.INVALID_ARGUMENT, "1 values for 2 target columns"),
        ("a partial update and a delete of one key", lambda ts: [writer.updates(
            ts, deletes=[{"id": 1}], partials=[{"id": 1, "b": 9}])],
         grpc.StatusCode.INVALID_ARGUMENT, "also deleted or inserted"),
    ]:
        error = refused(plane, "wide", build)
        assert (error.code(), words in error.details()) == (code, True), \
            f"{label}: {error.code()} {error.details()}"


def crafted(plane: DataPlane, ts: int, targets: list[str], values: list[int]) -> Parts:
    """A row-form partial update of key id 1 of wide, with these targets and values (each
    encoded as an int64)."""
    table = plane.tables["wide"]
    key = plane.writers["wide"].key({"id": 1})
    data = rpb.TableUpdateData(table_name="wide", primary_index_id=table.primary_index_id,
                               timestamp=ts, virtual_node_id=plane.topology.vnode_of_key(key))
    encode = value_encoder("int64")
    item = data.partial_data.add(target_columns=targets, col_values=[encode(v) for v in values])
    item.index_keys.add(table_id=table.table_id, index_id=table.primary_index_id, key=key,
                        timestamp=ts)
    return [{plane.nodes[0]: [data]}]


def test_a_partial_update_below_a_later_write_of_its_key_is_refused(wide: DataPlane) -> None:
    """PARTIAL_UPDATES_IN_TIMESTAMP_ORDER: merged below a write the key already has, a
    partial update would never reach the later row; it is refused FAILED_PRECONDITION
    and nothing of its request applies. Below a later write of another key it applies."""
    plane = wide
    writer = plane.writers["wide"]
    write(plane, "wide", replaces=[{"id": 1, "a": "x", "b": 1, "c": None},
                                   {"id": 2, "a": "y", "b": 2, "c": None}])
    stub = plane.trans.stub()
    early, late = begin_write(stub), begin_write(stub)
    send_at(plane, [late], [writer.updates(late.timestamp,
                                            replaces=[{"id": 1, "a": "late", "b": 10,
                                                       "c": None}])])
    # No read in between: a read would raise the write fence past the early timestamp.
    error = rpc_error(lambda: send_at(plane, [early], [writer.updates(
        early.timestamp, partials=[{"id": 2, "b": 20}, {"id": 1, "c": "early"}])]))
    assert error.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "PARTIAL_UPDATES_IN_TIMESTAMP_ORDER" in error.details()
    assert sorted(plane.read("wide").values(), key=lambda r: r["id"]) == [
        {"id": 1, "a": "late", "b": 10, "c": None}, {"id": 2, "a": "y", "b": 2, "c": None}]
    write(plane, "wide", partials=[{"id": 2, "b": 20}])
    assert plane.read("wide")[writer.key({"id": 2})]["b"] == 20


def test_a_kill_after_the_index_commit_of_a_merge_replays_and_a_retry_converge(
        make_plane: Callable[..., DataPlane]) -> None:
    """The node dies right after the primary-index commit of a micro-batch of partial
    updates (index.primary_commit.after: versions and applied-write records durable, the
    merged rows lost with the write buffer). The replay merges them again over the
    rewound index, the writer's retry of the same request merges over its own copies at
    their timestamps, and the table equals the model."""
    # The first index commit is the seed's; the node dies after the second.
    plane = make_plane(nodes=1, failpoints="index.primary_commit.after=exit(137)@2*1")
    rng = random.Random(11)
    plane.commit({"orders": {"replaces": [order(i, rng) for i in range(10)]}})
    node = plane.nodes[0]
    proc = plane.retinas[node]
    stub = plane.trans.stub()
    trans = [begin_write(stub) for _ in range(2)]
    batch = [{"replaces": [order(1, rng)], "partials": [{"id": 2, "note": None}]},
             {"partials": [{"id": 1, "customer": "merged"}, {"id": 2, "amount": None},
                           {"id": 99, "note": "new"}]}]
    writer = plane.writers["orders"]
    requests = requests_by_node(SCHEMA, [writer.updates(t.timestamp, **ops)
                                         for t, ops in zip(trans, batch, strict=True)])
    for t, ops in zip(trans, batch, strict=True):  # logged before it is sent
        record(plane, t.timestamp, ops)
    error = rpc_error(lambda: proc.stub.UpdateRecord(requests[node], timeout=30))
    assert error.code() == grpc.StatusCode.UNAVAILABLE
    assert proc.kill9() == 137  # it died at the failpoint
    proc.start()
    plane.recover(node)  # replays both timestamps (their applied-write records)
    proc.stub.UpdateRecord(requests[node], timeout=30)  # the writer's retry
    for t in trans:
        stub.CommitTrans(tpb.CommitTransRequest(trans_id=t.trans_id), timeout=10)
    expected = plane.model.rows["orders"]
    assert expected[writer.key({"id": 1})]["customer"] == "merged"
    assert expected[writer.key({"id": 99})] == {"id": 99, "customer": None, "amount": None,
                                                "note": "new"}
    assert plane.read("orders") == expected


@pytest.mark.parametrize("resent", ["all", "first"])
def test_a_micro_batch_sent_again_from_its_first_request_converges(
        make_plane: Callable[..., DataPlane], resent: str) -> None:
    """A micro-batch split into requests, one per transaction, whose answers were lost:
    the writer sends all of them again from the first (as the connector does), or only
    the first. The keys already have versions after the first request's timestamp (the
    later parts): nothing is refused, each resent row is visible only until its key's
    next version (SUPERSEDED_COPIES_END_AT_THE_NEXT_VERSION: no key twice, for replaces
    and partial updates alike), and every snapshot equals the model, also after a
    restart."""
    plane = make_plane(nodes=1)
    rng = random.Random(5)
    plane.commit({"orders": {"replaces": [order(i, rng) for i in range(1, 4)]}})
    stub = plane.trans.stub()
    trans = [begin_write(stub) for _ in range(3)]
    batch = [{"partials": [{"id": 1, "note": "p1"}], "replaces": [order(2, rng)]},
             {"partials": [{"id": 1, "customer": "p2"}], "replaces": [order(2, rng)],
              "deletes": [{"id": 3}]},
             {"partials": [{"id": 3, "note": "back"}, {"id": 1, "amount": None}]}]
    writer = plane.writers["orders"]
    node = plane.nodes[0]
    requests = [requests_by_node(SCHEMA, [writer.updates(t.timestamp, **ops)])[node]
                for t, ops in zip(trans, batch, strict=True)]
    for t, ops in zip(trans, batch, strict=True):
        record(plane, t.timestamp, ops)
    for request in requests + (requests if resent == "all" else requests[:1]):
        plane.retinas[node].stub.UpdateRecord(request, timeout=30)
    for t in trans:
        stub.CommitTrans(tpb.CommitTransRequest(trans_id=t.trans_id), timeout=10)
    assert plane.read("orders") == plane.model.rows["orders"]
    snapshots = dict(plane.model.history)
    for t in trans:
        assert plane.read_at("orders", t.timestamp) == snapshots[t.timestamp]["orders"]
    restart_and_recover(plane, node)
    assert plane.read("orders") == plane.model.rows["orders"]


def test_replaces_applied_out_of_timestamp_order_keep_one_row_per_key(
        make_plane: Callable[..., DataPlane]) -> None:
    """Two writers' replaces of one key, the later timestamp applied first: the earlier
    row is visible exactly until the later version (SUPERSEDED_COPIES_END_AT_THE_NEXT_
    VERSION), so every snapshot holds the key once, with the row of its timestamp; a
    standalone INSERT (no DELETE scanned the key) too."""
    plane = make_plane(nodes=1)
    rng = random.Random(3)
    plane.commit({"orders": {"replaces": [order(i, rng) for i in range(4)]}})
    stub = plane.trans.stub()
    early, late = begin_write(stub), begin_write(stub)
    writer = plane.writers["orders"]
    first, second = ({"replaces": [order(1, rng), order(2, rng)], "inserts": [order(50, rng)]},
                     {"replaces": [order(1, rng), order(50, rng)], "deletes": [{"id": 2}]})
    send_at(plane, [late], [writer.updates(late.timestamp, **second)])
    send_at(plane, [early], [writer.updates(early.timestamp, **first)])
    record(plane, early.timestamp, first)
    record(plane, late.timestamp, second)
    assert plane.read("orders") == plane.model.rows["orders"]
    snapshots = dict(plane.model.history)
    assert plane.read_at("orders", early.timestamp) == snapshots[early.timestamp]["orders"]


@pytest.mark.parametrize("min_columnar_rows", [1, 1 << 30])
def test_partial_updates_logged_in_a_changelog_replay_as_themselves(
        make_plane: Callable[..., DataPlane], tmp_path: Path, min_columnar_rows: int) -> None:
    """Partial updates written to a changelog (op 3 with their targets) and sent from it
    as a connector's send and a replay build them (changelog_replay.requests), in the
    columnar form and in the row form: the table equals the model."""
    plane = make_plane(nodes=1)
    rng = random.Random(21)
    plane.commit({"orders": {"replaces": [order(i, rng) for i in range(6)]}})
    writer, table = plane.writers["orders"], plane.tables["orders"]
    stub = plane.trans.stub()
    trans = [begin_write(stub) for _ in range(2)]
    batch = [{"deletes": [{"id": 3}],
              "partials": [{"id": 1, "note": "a"}, {"id": 2, "note": "b"},
                           {"id": 7, "customer": "new"}]},
             {"partials": [{"id": 1, "amount": Decimal("1.25")}, {"id": 3, "note": "again"}]}]
    logged = []
    for t, ops in zip(trans, batch, strict=True):
        rows = []
        for row in ops.get("deletes", ()):
            key = writer.key(row)
            rows.append(ChangeRow(t.timestamp, len(rows), plane.topology.vnode_of_key(key),
                                  "orders", DELETE, key, None))
        for row in ops["partials"]:
            key = writer.key(row)
            targets, values = writer.partial_values(row)
            rows.append(ChangeRow(t.timestamp, len(rows), plane.topology.vnode_of_key(key),
                                  "orders", PARTIAL, key, tuple(values), targets))
        logged.append(LoggedTransaction(t.timestamp, f"p{t.timestamp}", "x", 0, rows))
        record(plane, t.timestamp, ops)
    log = Changelog(str(tmp_path / "changelog"))
    log.append(logged)
    node = plane.nodes[0]
    read = list(log.read(dict.fromkeys(range(plane.topology.virtual_nodes), 0)))
    assert sum(r.op == PARTIAL for r in read) == 5
    with pytest.raises(PartialUpdatesRefused, match="accepts_partial"):  # an older node
        list(requests(SCHEMA, {"orders": table}, read, 500, min_columnar_rows))
    for request in requests(SCHEMA, {"orders": table}, read, 500, min_columnar_rows,
                            accepts_partial=plane.status(node).accepts_partial):
        parts = request.table_update_data
        assert any(t.partial_rows_arrow if min_columnar_rows == 1 else t.partial_data
                   for t in parts)
        plane.retinas[node].stub.UpdateRecord(request, timeout=30)
    for t in trans:
        stub.CommitTrans(tpb.CommitTransRequest(trans_id=t.trans_id), timeout=10)
    assert plane.read("orders") == plane.model.rows["orders"]


def test_a_partial_update_sent_apart_from_its_truncate_starts_from_no_row(
        make_plane: Callable[..., DataPlane]) -> None:
    """A transaction's TRUNCATE and its partial update of a key at the same T in two
    requests (a changelog replay cuts requests inside a timestamp): the TRUNCATE's
    tombstone at T means the key has no row, so the partial update inserts one with
    NULL outside its targets, not the truncated row's values."""
    from .test_truncate_apply import truncate

    plane = make_plane(nodes=1)
    rng = random.Random(9)
    plane.commit({"orders": {"replaces": [order(i, rng) for i in range(5)]}})
    stub = plane.trans.stub()
    trans = begin_write(stub)
    node = plane.nodes[0]
    for request in (truncate(plane, trans.timestamp)[node], requests_by_node(SCHEMA, [
            plane.writers["orders"].updates(trans.timestamp,
                                            partials=[{"id": 1, "note": "after"}])])[node]):
        plane.retinas[node].stub.UpdateRecord(request, timeout=30)
    stub.CommitTrans(tpb.CommitTransRequest(trans_id=trans.trans_id), timeout=10)
    assert list(plane.read("orders").values()) == [
        {"id": 1, "customer": None, "amount": None, "note": "after"}]
