"""Malformed and out-of-protocol UpdateRecord requests: the documented status, nothing applied."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from decimal import Decimal

import grpc
import pytest

from retina_common.client import requests_by_node
from retina_common.pb import retina_pb2 as rpb
from retina_common.pb import trans_pb2 as tpb

from .dataplane import SCHEMA, DataPlane, module_plane
from .support import rpc_error


@pytest.fixture(scope="module")
def plane(tmp_path_factory: pytest.TempPathFactory, etcd_server, pg_server) -> Iterator[DataPlane]:
    # One cluster for the module: every refused case leaves it unchanged.
    with module_plane(tmp_path_factory.mktemp("refusals"), etcd_server.endpoint, pg_server,
                      {"orders": {"inserts": [order(i) for i in range(20)]}}) as dp:
        yield dp


def order(i: int) -> dict:
    return {"id": i, "customer": "c", "amount": Decimal("1.50"), "note": None}


def one_node_request(plane: DataPlane, ts: int, **ops) -> tuple[str, rpb.UpdateRecordRequest]:
    """A request for the node owning the first key's vnode, with valid inserts for contrast."""
    per_node = plane.writers["orders"].updates(ts, **ops)
    node, datas = max(per_node.items(), key=lambda kv: max(len(d.insert_data) for d in kv[1]))
    datas = sorted(datas, key=lambda d: -len(d.insert_data))  # one with inserts first
    request = rpb.UpdateRecordRequest(schema_name=SCHEMA)
    request.table_update_data.extend(datas)
    return node, request


def fresh_rows(start: int, n: int = 5) -> list[dict]:
    return [order(start + i) for i in range(n)]


def mutate_key_ts(r: rpb.UpdateRecordRequest) -> None:
    r.table_update_data[0].insert_data[0].index_keys[0].timestamp += 1


def drop_key(r: rpb.UpdateRecordRequest) -> None:
    del r.table_update_data[0].insert_data[0].index_keys[:]


def extra_key(r: rpb.UpdateRecordRequest) -> None:
    item = r.table_update_data[0].insert_data[0]
    item.index_keys.append(item.index_keys[0])


def unknown_table(r: rpb.UpdateRecordRequest) -> None:
    r.table_update_data[0].table_name = "no_such_table"


def wrong_index(r: rpb.UpdateRecordRequest) -> None:
    r.table_update_data[0].primary_index_id += 1000


def short_row(r: rpb.UpdateRecordRequest) -> None:
    del r.table_update_data[0].insert_data[0].col_values[-1]


def bad_value(r: rpb.UpdateRecordRequest) -> None:
    r.table_update_data[0].insert_data[0].col_values[0] = b"\x01\x02\x03"


def duplicate_insert(r: rpb.UpdateRecordRequest) -> None:
    tud = r.table_update_data[0]
    tud.insert_data.append(tud.insert_data[0])


def misrouted_vnode(r: rpb.UpdateRecordRequest) -> None:
    # Another vnode of the same node: the keys do not route there.
    tud = r.table_update_data[0]
    node_vnodes = [v for v in range(8) if v % 2 == tud.virtual_node_id % 2]
    tud.virtual_node_id = next(v for v in node_vnodes if v != tud.virtual_node_id)


def recovery_context(r: rpb.UpdateRecordRequest) -> None:
    r.recovery_replay_context.recovery_attempt_token = "not-recovering"
    r.recovery_replay_context.checkpoint_id = 1


def second_part_bad(r: rpb.UpdateRecordRequest) -> None:
    # A valid first TableUpdateData followed by a broken one: neither applies.
    bad = r.table_update_data.add()
    bad.CopyFrom(r.table_update_data[0])
    bad.insert_data[0].index_keys[0].timestamp += 1


@pytest.mark.parametrize("mutate, code", [
    (mutate_key_ts, grpc.StatusCode.INVALID_ARGUMENT),
    (drop_key, grpc.StatusCode.INVALID_ARGUMENT),
    (extra_key, grpc.StatusCode.INVALID_ARGUMENT),
    (unknown_table, grpc.StatusCode.INVALID_ARGUMENT),
    (wrong_index, grpc.StatusCode.INVALID_ARGUMENT),
    (short_row, grpc.StatusCode.INVALID_ARGUMENT),
    (bad_value, grpc.StatusCode.INVALID_ARGUMENT),
    (duplicate_insert, grpc.StatusCode.INVALID_ARGUMENT),
    (misrouted_vnode, grpc.StatusCode.INVALID_ARGUMENT),
    (recovery_context, grpc.StatusCode.FAILED_PRECONDITION),
    (second_part_bad, grpc.StatusCode.INVALID_ARGUMENT),
])
def test_malformed_request_is_refused_and_changes_nothing(
        plane: DataPlane, mutate: Callable[[rpb.UpdateRecordRequest], None],
        code: grpc.StatusCode) -> None:
    before = plane.read("orders")
    trans = plane.trans.stub().BeginTrans(tpb.BeginTransRequest(), timeout=5)
    try:
        node, request = one_node_request(plane, trans.timestamp,
                                         inserts=fresh_rows(1000 + 10 * trans.timestamp),
                                         deletes=[{"id": 1}, {"id": 2}])
        mutate(request)
        err = rpc_error(lambda: plane.retinas[node].stub.UpdateRecord(request, timeout=10))
    finally:  # an open write transaction would hold the HWM (and every snapshot) back
        plane.trans.stub().RollbackTrans(tpb.RollbackTransRequest(trans_id=trans.trans_id))
    assert err.code() == code, err.details()
    assert plane.read("orders") == before


def test_a_vnode_owned_by_another_node_is_refused(plane: DataPlane) -> None:
    before = plane.read("orders")
    node, request = one_node_request(plane, 10**9, inserts=fresh_rows(5000))
    other = next(n for n in plane.nodes if n != node)
    err = rpc_error(lambda: plane.retinas[other].stub.UpdateRecord(request, timeout=10))
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "belongs to" in err.details()
    assert plane.read("orders") == before


def test_oversized_request_is_refused(plane: DataPlane) -> None:
    before = plane.read("orders")
    per_node = plane.writers["orders"].updates(10**9, inserts=fresh_rows(6000, 600))
    for node, request in requests_by_node(SCHEMA, [per_node]).items():
        request.table_update_data.extend(list(request.table_update_data) * 2)
        err = rpc_error(lambda n=node, r=request: plane.retinas[n].stub.UpdateRecord(r,
                                                                                   timeout=10))
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "limit" in err.details()
    assert plane.read("orders") == before


def test_standalone_insert_of_a_live_key_is_refused(plane: DataPlane) -> None:
    before = plane.read("orders")
    node, request = one_node_request(plane, 10**9, inserts=[order(5)])
    err = rpc_error(lambda: plane.retinas[node].stub.UpdateRecord(request, timeout=10))
    assert err.code() == grpc.StatusCode.ALREADY_EXISTS
    assert plane.read("orders") == before


def test_counts_are_exact_for_missing_and_repeated_deletes(plane: DataPlane) -> None:
    ts, responses = plane.commit({"orders": {
        "deletes": [{"id": 7}, {"id": 7}, {"id": 10**8}],
        "replaces": [order(8)],
    }})
    assert sum(r.deleted_rows for r in responses.values()) == 2  # 7 once, 8 by the replace
    assert sum(r.inserted_rows for r in responses.values()) == 1
    assert plane.read("orders") == plane.model.rows["orders"]
    # Deleting the same row again changes nothing and counts nothing.
    _ts, responses = plane.commit({"orders": {"deletes": [{"id": 7}]}})
    assert sum(r.deleted_rows for r in responses.values()) == 0
    del ts


def test_stream_update_record_applies_in_order(plane: DataPlane) -> None:
    stub = plane.trans.stub()
    t1 = stub.BeginTrans(tpb.BeginTransRequest(), timeout=5)
    t2 = stub.BeginTrans(tpb.BeginTransRequest(), timeout=5)
    rows = [order(7000 + i) for i in range(4)]
    first = plane.writers["orders"].updates(t1.timestamp, inserts=rows)
    second = plane.writers["orders"].updates(t2.timestamp, deletes=rows[:2])
    for node in set(first) | set(second):
        reqs = [r for r in (requests_by_node(SCHEMA, [first]).get(node),
                            requests_by_node(SCHEMA, [second]).get(node)) if r is not None]
        replies = list(plane.retinas[node].stub.StreamUpdateRecord(iter(reqs), timeout=10))
        assert len(replies) == len(reqs)
    for t in (t1, t2):
        stub.CommitTrans(tpb.CommitTransRequest(trans_id=t.trans_id), timeout=5)
    got = plane.read("orders")
    assert {r["id"] for r in got.values()} >= {7002, 7003}
    assert not {7000, 7001} & {r["id"] for r in got.values()}
