"""An INSERT's key bytes and its key columns agree, and key columns are never NULL.

Otherwise the whole request is refused (INVALID_ARGUMENT naming the table, the
row and the column) and nothing of it applies, over UpdateRecord and
StreamUpdateRecord alike."""

from __future__ import annotations

import datetime
from collections.abc import Callable, Iterator
from decimal import Decimal
from typing import Any

import grpc
import pytest

from retina_common.client import TableWriter
from retina_common.codec import (
    decode_column,
    encode_primary_key,
    encode_primary_keys,
    encode_value,
)
from retina_common.pb import retina_pb2 as rpb
from retina_common.pb import trans_pb2 as tpb

from .dataplane import SCHEMA, TABLES, DataPlane, module_plane
from .support import rpc_error

SAMPLES: dict[str, list[Any]] = {
    "boolean": [True, False, True],
    "int32": [3, -1, 2**31 - 1],
    "int64": [1, -5, 2**40],
    "date32": [datetime.date(2020, 1, 1), datetime.date(1969, 12, 31), 0],
    "timestamp_us": [0, 1, -1],
    "float32": [1.5, -0.0, 2.0],
    "float64": [1.5, -2.25, 1e300],
    "decimal(12,2)": [Decimal("1.50"), Decimal("-3.25"), Decimal(0)],
    "string": ["a", "", "héllo"],
    "binary": [b"", b"\x00x", b"z"],
}


@pytest.mark.parametrize("type_name", sorted(SAMPLES))
def test_batch_key_encoding_equals_the_row_encoding(type_name: str) -> None:
    values = SAMPLES[type_name]
    column = decode_column(type_name, [encode_value(type_name, v) for v in values])
    other = decode_column("string", [encode_value("string", s) for s in ["x", "yz", ""]])
    for types, columns, rows in [
        ([type_name], [column], [[v] for v in values]),
        # sliced columns (a non-zero Arrow offset) in a composite key
        ([type_name, "string"], [column.slice(1), other.slice(1)],
         [[v, s] for v, s in zip(values[1:], ["yz", ""], strict=True)]),
    ]:
        expected = [encode_primary_key(types, row) for row in rows]
        assert encode_primary_keys(types, columns).to_pylist() == expected


@pytest.mark.parametrize("type_name", sorted(SAMPLES))
def test_a_key_is_its_row_values_with_their_lengths(type_name: str) -> None:
    # What UpdateRecord's check of small inserts relies on (INSERT_KEY_IS_ROW_KEY): a key
    # is, per key column, the 4-byte big-endian length of the row's value bytes, then them.
    for value in SAMPLES[type_name]:
        row = [encode_value(type_name, value), encode_value("string", "k")]
        assert encode_primary_key([type_name, "string"], [value, "k"]) == b"".join(
            len(v).to_bytes(4, "big") + v for v in row)


@pytest.fixture(scope="module")
def plane(tmp_path_factory: pytest.TempPathFactory, etcd_server, pg_server) -> Iterator[DataPlane]:
    # One cluster for the module: every refused case leaves it unchanged.
    with module_plane(tmp_path_factory.mktemp("keys"), etcd_server.endpoint, pg_server,
                      {"orders": {"inserts": [order(i) for i in range(10)]}}) as dp:
        yield dp


def order(i: int) -> dict:
    return {"id": i, "customer": f"c{i}", "amount": Decimal("1.50"), "note": None}


def event(i: int) -> dict:
    return {"tenant": i % 3, "seq": i, "payload": b"p", "ok": True}


def column_index(table: str, column: str) -> int:
    return [c.name for c in TABLES[table][0]].index(column)


def set_value(row: rpb.InsertData, table: str, column: str, value: Any) -> None:
    pos = column_index(table, column)
    row.col_values[pos] = encode_value(TABLES[table][0][pos].type, value)


Mutation = Callable[[rpb.InsertData, dict], None]


class Case:
    """Which table's insert to break, how, and the column the refusal must name."""

    def __init__(self, what: str, table: str, column: str, mutate: Mutation) -> None:
        self.what, self.table, self.column, self.mutate = what, table, column, mutate

    def __repr__(self) -> str:
        return self.what


CASES = [
    # The key says one id, the row the next one (say the key 7, the row 8).
    Case("id-mismatch", "orders", "id",
         lambda row, sent: set_value(row, "orders", "id", sent["id"] + 1)),
    Case("null-key-column", "orders", "id",
         lambda row, _sent: set_value(row, "orders", "id", None)),
    Case("composite-second-column-mismatch", "events", "seq",
         lambda row, sent: set_value(row, "events", "seq", sent["seq"] + 1)),
    Case("composite-null-first-column", "events", "tenant",
         lambda row, _sent: set_value(row, "events", "tenant", None)),
]


def requests(plane: DataPlane, ts: int, start: int
             ) -> tuple[str, rpb.UpdateRecordRequest, dict[str, list[dict]]]:
    """One node's request carrying inserts into both tables, and the rows it inserts."""
    rows = {"orders": [order(start + i) for i in range(40)],
            "events": [event(start + i) for i in range(40)]}
    # The row form: its key bytes are sent beside the row (the columnar form has the
    # node compute them, so they cannot disagree).
    per_table = {t: TableWriter(plane.writers[t].table, plane.topology, columnar=False)
                 .updates(ts, inserts=r) for t, r in rows.items()}
    node = plane.nodes[0]
    # One vnode per table, so the request's rows are easy to follow.
    datas = {t: per_table[t][node][0] for t in rows}
    request = rpb.UpdateRecordRequest(schema_name=SCHEMA)
    request.table_update_data.extend([datas["events"], datas["orders"]])
    key = {t: plane.writers[t].key for t in rows}
    sent = {t: [r for r in rows[t] if key[t](r) in {d.index_keys[0].key
                                                     for d in datas[t].insert_data}]
            for t in rows}
    return node, request, sent


def break_row(request: rpb.UpdateRecordRequest, case: Case,
              sent: dict[str, list[dict]]) -> int:
    """Break one row (not the first) of ``case.table``; returns its index in its data."""
    tud = next(t for t in request.table_update_data if t.table_name == case.table)
    i = min(2, len(tud.insert_data) - 1)
    case.mutate(tud.insert_data[i], sent[case.table][i])
    return i


def unary(plane: DataPlane, node: str, request: rpb.UpdateRecordRequest) -> None:
    plane.retinas[node].stub.UpdateRecord(request, timeout=10)


def streamed(plane: DataPlane, node: str, request: rpb.UpdateRecordRequest) -> None:
    list(plane.retinas[node].stub.StreamUpdateRecord(iter([request]), timeout=10))


def unchanged(plane: DataPlane) -> bool:
    return all(plane.read(t) == plane.model.rows[t] for t in ("orders", "events"))


@pytest.mark.integration
@pytest.mark.parametrize("send", [unary, streamed], ids=["UpdateRecord", "StreamUpdateRecord"])
@pytest.mark.parametrize("case", CASES, ids=repr)
def test_key_disagreeing_with_its_row_refuses_the_whole_request(
        plane: DataPlane, case: Case,
        send: Callable[[DataPlane, str, rpb.UpdateRecordRequest], None]) -> None:
    stub = plane.trans.stub()
    trans = stub.BeginTrans(tpb.BeginTransRequest(), timeout=5)
    start = 10_000 * trans.timestamp
    try:
        node, request, sent = requests(plane, trans.timestamp, start)
        i = break_row(request, case, sent)
        err = rpc_error(lambda: send(plane, node, request))
    finally:  # an open write transaction would hold back every snapshot
        stub.RollbackTrans(tpb.RollbackTransRequest(trans_id=trans.trans_id), timeout=5)
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, err.details()
    assert f"{case.table}: insert {i}" in err.details(), err.details()
    assert f"key column {case.column}" in err.details(), err.details()
    assert unchanged(plane), "nothing of a refused request applies, in either table"

    # The same rows, correctly encoded, apply normally afterwards.
    plane.commit({t: {"inserts": rows} for t, rows in sent.items()})
    assert unchanged(plane)
