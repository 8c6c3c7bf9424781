"""Malformed and out-of-protocol UpdateRecord requests: the documented status, nothing applied."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from decimal import Decimal

import grpc
import numpy as np
import pyarrow as pa
import pytest

from retina_common.client import TableWriter, requests_by_node
from retina_common.columnar import row_count
from retina_common.pb import retina_pb2 as rpb
from retina_common.pb import trans_pb2 as tpb

from .dataplane import SCHEMA, DataPlane, module_plane
from .support import rpc_error

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def plane(tmp_path_factory: pytest.TempPathFactory, etcd_server, pg_server) -> Iterator[DataPlane]:
    # One cluster for the module: every refused case leaves it unchanged.
    with module_plane(tmp_path_factory.mktemp("refusals"), etcd_server.endpoint, pg_server,
                      {"orders": {"inserts": [order(i) for i in range(20)]}}) as dp:
        yield dp


def order(i: int) -> dict:
    return {"id": i, "customer": "c", "amount": Decimal("1.50"), "note": None}


def one_node_request(plane: DataPlane, ts: int, *, columnar: bool = False,
                     **ops) -> tuple[str, rpb.UpdateRecordRequest]:
    """A request for the node owning the first key's vnode, with valid inserts for contrast,
    in the row form (or the columnar form)."""
    writer = TableWriter(plane.writers["orders"].table, plane.topology, columnar=columnar,
                         min_columnar_rows=1)
    per_node = writer.updates(ts, **ops)
    node, datas = max(per_node.items(), key=lambda kv: max(inserted(d) for d in kv[1]))
    datas = sorted(datas, key=lambda d: -inserted(d))  # one with inserts first
    request = rpb.UpdateRecordRequest(schema_name=SCHEMA)
    request.table_update_data.extend(datas)
    return node, request


def inserted(tud: rpb.TableUpdateData) -> int:
    return len(tud.insert_data) + row_count(tud.insert_rows_arrow)


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


def decimal_beyond_precision(r: rpb.UpdateRecordRequest) -> None:
    # 16 bytes hold more than decimal(12,2) does: 10^15 is 16 digits.
    r.table_update_data[0].insert_data[0].col_values[2] = (10**15).to_bytes(16, "little",
                                                                            signed=True)


def routed_key(plane: DataPlane, vnode: int, length: int) -> bytes:
    """A key of ``length`` bytes that routes to ``vnode`` (only its length is wrong)."""
    return next(k for i in range(10_000)
                if plane.topology.vnode_of_key(k := i.to_bytes(4, "big") + b"k" * (length - 4))
                == vnode)


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
    (decimal_beyond_precision, grpc.StatusCode.INVALID_ARGUMENT),
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


# --- the columnar form (Arrow IPC): the same rules, and its own malformations ------

def _rows_of(tud: rpb.TableUpdateData) -> pa.Table:
    return pa.ipc.open_stream(tud.insert_rows_arrow).read_all()


def _set_rows(tud: rpb.TableUpdateData, rows: pa.Table) -> None:
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, rows.schema) as writer:
        writer.write_table(rows)
    tud.insert_rows_arrow = sink.getvalue().to_pybytes()


def _set_column(tud: rpb.TableUpdateData, name: str, column: pa.Array,
                field: pa.Field | None = None) -> None:
    rows = _rows_of(tud)
    i = rows.schema.get_field_index(name)
    _set_rows(tud, rows.set_column(i, field or pa.field(name, column.type), column))


def _set_keys(tud: rpb.TableUpdateData, keys: pa.Array, name: str = "key") -> None:
    sink = pa.BufferOutputStream()
    batch = pa.record_batch([keys], names=[name])
    with pa.ipc.new_stream(sink, batch.schema) as writer:
        writer.write_batch(batch)
    tud.delete_keys_arrow = sink.getvalue().to_pybytes()


def col_not_arrow(r: rpb.UpdateRecordRequest) -> None:
    r.table_update_data[0].insert_rows_arrow = b"these are not Arrow bytes"


def col_truncated_stream(r: rpb.UpdateRecordRequest) -> None:
    tud = r.table_update_data[0]
    tud.insert_rows_arrow = tud.insert_rows_arrow[:len(tud.insert_rows_arrow) // 2]


def col_wrong_type(r: rpb.UpdateRecordRequest) -> None:
    _wrong_type(r.table_update_data[0])


def _wrong_type(tud: rpb.TableUpdateData) -> None:
    _set_column(tud, "amount", _rows_of(tud).column("amount").cast(pa.float64()))


def col_renamed(r: rpb.UpdateRecordRequest) -> None:
    tud = r.table_update_data[0]
    rows = _rows_of(tud)
    _set_rows(tud, rows.rename_columns(["id", "client", "amount", "note"]))


def col_extra_column(r: rpb.UpdateRecordRequest) -> None:
    tud = r.table_update_data[0]
    rows = _rows_of(tud)
    _set_rows(tud, rows.append_column("surprise", pa.array([1] * rows.num_rows)))


def col_too_narrow(r: rpb.UpdateRecordRequest) -> None:
    tud = r.table_update_data[0]
    _set_rows(tud, _rows_of(tud).select(["id", "customer"]))


def col_null_key(r: rpb.UpdateRecordRequest) -> None:
    tud = r.table_update_data[0]
    ids = _rows_of(tud).column("id").to_pylist()
    _set_column(tud, "id", pa.array([ids[0], None, *ids[2:]], pa.int64()))


def col_bad_utf8(r: rpb.UpdateRecordRequest) -> None:
    # Written without validation, as a faulty client could: the node validates in full.
    tud = r.table_update_data[0]
    n = _rows_of(tud).num_rows
    offsets = pa.py_buffer(np.arange(n + 1, dtype=np.int32).tobytes())
    bad = pa.Array.from_buffers(pa.string(), n, [None, offsets, pa.py_buffer(b"\xff" * n)])
    _set_column(tud, "customer", bad)


def col_duplicate_insert(r: rpb.UpdateRecordRequest) -> None:
    tud = r.table_update_data[0]
    rows = _rows_of(tud)
    _set_rows(tud, pa.concat_tables([rows, rows.slice(0, 1)]))


def col_compressed(r: rpb.UpdateRecordRequest) -> None:
    tud = r.table_update_data[0]
    rows = _rows_of(tud)
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, rows.schema,
                           options=pa.ipc.IpcWriteOptions(compression="zstd")) as writer:
        writer.write_table(rows)
    tud.insert_rows_arrow = sink.getvalue().to_pybytes()


def col_dictionary(r: rpb.UpdateRecordRequest) -> None:
    tud = r.table_update_data[0]
    _set_column(tud, "customer", _rows_of(tud).column("customer").dictionary_encode())


def col_timestamp_for_string(r: rpb.UpdateRecordRequest) -> None:
    tud = r.table_update_data[0]
    n = _rows_of(tud).num_rows
    _set_column(tud, "note", pa.array([0] * n, pa.timestamp("us", "+00:00")))


def col_decimal_beyond_precision(r: rpb.UpdateRecordRequest) -> None:
    # decimal(12,2) holding 10^13: the type is right, the value is not.
    tud = r.table_update_data[0]
    amounts = _rows_of(tud).column("amount").combine_chunks()
    raw = bytearray(amounts.buffers()[1].to_pybytes())
    raw[16:32] = (10**15).to_bytes(16, "little", signed=True)
    bad = pa.Array.from_buffers(amounts.type, len(amounts), [None, pa.py_buffer(bytes(raw))])
    _set_column(tud, "amount", bad)


def col_bad_later_batch(r: rpb.UpdateRecordRequest) -> None:
    # A valid first record batch, then one with a NULL key.
    tud = r.table_update_data[0]
    rows = _rows_of(tud)
    ids = rows.column("id").to_pylist()
    later = rows.set_column(0, pa.field("id", pa.int64()),
                            pa.array([ids[0], None, *ids[2:]], pa.int64()))
    _set_rows(tud, pa.concat_tables([rows.slice(0, 1), later.slice(1)]))


def col_both_forms(r: rpb.UpdateRecordRequest) -> None:
    tud = r.table_update_data[0]
    item = tud.delete_data.add()
    item.index_keys.add(table_id=1, index_id=tud.primary_index_id, key=b"k",
                        timestamp=tud.timestamp)


def col_delete_keys_wrong_schema(r: rpb.UpdateRecordRequest) -> None:
    tud = next(t for t in r.table_update_data if t.delete_keys_arrow)
    _set_keys(tud, pa.array([1, 2], pa.int64()), name="id")


def col_null_delete_key(r: rpb.UpdateRecordRequest) -> None:
    tud = next(t for t in r.table_update_data if t.delete_keys_arrow)
    _set_keys(tud, pa.array([None], pa.binary()))


def col_empty_delete_key(r: rpb.UpdateRecordRequest) -> None:
    tud = next(t for t in r.table_update_data if t.delete_keys_arrow)
    _set_keys(tud, pa.array([b""], pa.binary()))


def col_second_part_bad(r: rpb.UpdateRecordRequest) -> None:
    # A valid first TableUpdateData followed by a broken one: neither applies.
    bad = r.table_update_data.add()
    bad.CopyFrom(r.table_update_data[0])
    _wrong_type(bad)


@pytest.mark.parametrize("mutate", [
    col_not_arrow, col_truncated_stream, col_wrong_type, col_renamed, col_extra_column,
    col_too_narrow, col_null_key, col_bad_utf8, col_duplicate_insert, col_both_forms,
    col_compressed, col_dictionary, col_timestamp_for_string, col_decimal_beyond_precision,
    col_bad_later_batch,
    col_delete_keys_wrong_schema, col_null_delete_key, col_empty_delete_key,
    misrouted_vnode, col_second_part_bad,
])
def test_malformed_columnar_request_is_refused_and_changes_nothing(
        plane: DataPlane, mutate: Callable[[rpb.UpdateRecordRequest], None]) -> None:
    before = plane.read("orders")
    trans = plane.trans.stub().BeginTrans(tpb.BeginTransRequest(), timeout=5)
    try:
        # Deletes of keys that route to the same node as the inserts' first vnode.
        node, request = one_node_request(plane, trans.timestamp, columnar=True,
                                         inserts=fresh_rows(1000 + 100 * trans.timestamp, 24),
                                         deletes=[order(i) for i in range(20)])
        request.table_update_data.sort(key=lambda t: -inserted(t))
        assert inserted(request.table_update_data[0]) >= 2  # a row to break besides row 0
        mutate(request)
        err = rpc_error(lambda: plane.retinas[node].stub.UpdateRecord(request, timeout=10))
    finally:
        plane.trans.stub().RollbackTrans(tpb.RollbackTransRequest(trans_id=trans.trans_id))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, err.details()
    assert "orders" in err.details()
    assert plane.read("orders") == before


@pytest.mark.parametrize("columnar", [False, True])
def test_a_primary_key_longer_than_the_index_holds_is_refused(plane: DataPlane,
                                                              columnar: bool) -> None:
    """491 bytes is the longest key the primary index holds (LMDB's 511 less the version
    key's table id, length and timestamp): a DELETE of such a key is taken (it deletes
    nothing), one byte more is INVALID_ARGUMENT naming the limit, in either form."""
    before = plane.read("orders")
    node = plane.nodes[0]
    vnode = plane.topology.vnodes_of(node)[0]
    table = plane.tables["orders"]
    for length, refused in ((491, False), (492, True)):
        key = routed_key(plane, vnode, length)
        tud = rpb.TableUpdateData(table_name="orders", primary_index_id=table.primary_index_id,
                                  timestamp=10**9, virtual_node_id=vnode)
        if columnar:
            _set_keys(tud, pa.array([key], pa.binary()))
        else:
            tud.delete_data.add().index_keys.add(table_id=table.table_id,
                                                 index_id=table.primary_index_id, key=key,
                                                 timestamp=10**9)
        request = rpb.UpdateRecordRequest(schema_name=SCHEMA, table_update_data=[tud])
        if refused:
            err = rpc_error(lambda r=request: plane.retinas[node].stub.UpdateRecord(r,
                                                                                  timeout=10))
            assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "492 bytes; the limit is 491" in err.details(), err.details()
        else:
            reply = plane.retinas[node].stub.UpdateRecord(request, timeout=10)
            assert reply.deleted_rows == 0
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
