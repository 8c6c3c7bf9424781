"""translate's partial updates and routes, pure logic.

A transaction's rows, applied the way a node applies one timestamp (TRUNCATEs first,
then every key's net effect, a partial update merged with the key's row from before the
timestamp: PARTIAL_BASE_IS_BEFORE_T), must leave the tables exactly as the source's
changes do applied one by one: a row lacking columns keeps the others, a delete or a
TRUNCATE removes whole rows, and a later change in the transaction wins. Routes rewrite
source tables onto targets; their configuration is refused when it cannot work."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest

from cdc_client.routes import RouteError, Routes
from cdc_client.source import RowChange, SourceTransaction
from cdc_client.translate import MalformedChange, TableMap, translate
from retina_common.catalog.model import ColumnRecord, TableRecord
from retina_common.changelog import DELETE, PARTIAL, REPLACE, TRUNCATE, ChangeRow
from retina_common.codec import encode_primary_key, value_encoder
from retina_common.config import CdcRoute, ConfigError, load_config
from retina_common.topology import Topology

TOPOLOGY = Topology(("127.0.0.1:1",), 4)
COLUMNS = [("id", "int64"), ("customer", "string"), ("amount", "int64"), ("paid", "int64"),
           ("method", "string")]
WIDE = TableRecord(1, 1, "s", "wide", 1, tuple(
    ColumnRecord(i + 1, n, t, i, 0 if n == "id" else None) for i, (n, t) in enumerate(COLUMNS)))
NAMES = [n for n, _t in COLUMNS]
ENCODE = {n: value_encoder(t) for n, t in COLUMNS}
Model = dict[bytes, dict[str, bytes]]


def key(i: int) -> bytes:
    return encode_primary_key(["int64"], [i])


def encoded(row: dict[str, Any]) -> dict[str, bytes]:
    return {n: b"" if v is None else ENCODE[n](v) for n, v in row.items()}


def apply_changes(model: Model, changes: list[tuple[str, dict[str, Any] | None]]) -> None:
    """The source's changes one by one: what a reader must see after the transaction."""
    for op, row in changes:
        if op == "truncate":
            model.clear()
        elif op == "delete":
            assert row is not None
            model.pop(key(row["id"]), None)
        else:
            assert row is not None
            k = key(row["id"])
            model[k] = {**model.get(k, dict.fromkeys(NAMES, b"")), **encoded(row)}


def apply_rows(model: Model, rows: list[ChangeRow]) -> None:
    """A node applying one timestamp's rows (the same order every node uses)."""
    before = {k: dict(v) for k, v in model.items()}
    truncated = any(r.op == TRUNCATE for r in rows)
    if truncated:
        model.clear()
    seen: set[bytes] = set()
    for r in rows:
        if r.op == TRUNCATE:
            continue
        assert r.key not in seen, "one net effect per key and timestamp"
        seen.add(r.key)
        if r.op == DELETE:
            model.pop(r.key, None)
        elif r.op == REPLACE:
            assert r.values is not None and r.targets is None
            model[r.key] = dict(zip(NAMES, r.values, strict=True))
        else:
            assert r.op == PARTIAL and r.values is not None and r.targets is not None
            assert "id" in r.targets and list(r.targets) == [n for n in NAMES if n in r.targets]
            base = None if truncated else before.get(r.key)
            merged = dict(base) if base is not None else dict.fromkeys(NAMES, b"")
            merged.update(zip(r.targets, r.values, strict=True))
            model[r.key] = merged


def random_change(rng: random.Random) -> tuple[str, dict[str, Any] | None]:
    i = rng.randint(1, 6)
    kind = rng.choices(["full", "partial", "delete", "truncate"], [3, 5, 2, 0.2])[0]
    if kind == "truncate":
        return "truncate", None
    if kind == "delete":
        return "delete", {"id": i}
    row: dict[str, Any] = {"id": i, "customer": rng.choice([None, "a", "b"]),
                           "amount": rng.choice([None, 1, 2, 3]), "paid": rng.randint(0, 9),
                           "method": rng.choice([None, "card", "cash"])}
    if kind == "partial":
        for name in rng.sample(NAMES[1:], rng.randint(1, len(NAMES) - 2)):
            del row[name]
    return "upsert", row


def source_change(op: str, row: dict[str, Any] | None, rng: random.Random) -> RowChange:
    if op == "truncate":
        return RowChange("s.wide", "truncate", None, None)
    if op == "delete":
        return RowChange("s.wide", "delete", row, None)
    return RowChange("s.wide", rng.choice(["insert", "update"]), None, row)


@pytest.mark.parametrize("seed", range(60))
def test_a_transactions_rows_leave_what_its_changes_leave(seed: int) -> None:
    rng = random.Random(seed)
    tables = TableMap("s", lambda _s, name: WIDE if name == "wide" else None)
    expected: Model = {}
    actual: Model = {}
    for t in range(12):
        changes = [random_change(rng) for _ in range(rng.randint(1, 7))]
        trans = SourceTransaction(str(t), str(t), 0,
                                  tuple(source_change(op, row, rng) for op, row in changes))
        apply_changes(expected, changes)
        apply_rows(actual, translate(trans, tables, TOPOLOGY))
        assert actual == expected, f"transaction {t}: {changes}"


def test_merges_over_a_replace_a_delete_and_another_partial_update() -> None:
    tables = TableMap("s", lambda _s, name: WIDE if name == "wide" else None)

    def rows(*changes: RowChange) -> list[tuple[int, tuple[bytes, ...] | None,
                                                tuple[str, ...] | None]]:
        out = translate(SourceTransaction("1", "1", 0, changes), tables, TOPOLOGY)
        return [(r.op, r.values, r.targets) for r in out]

    full = {"id": 1, "customer": "a", "amount": 1, "paid": None, "method": None}
    e = encoded
    assert rows(RowChange("s.wide", "insert", None, full),
                RowChange("s.wide", "update", None, {"id": 1, "paid": 5})) == \
        [(REPLACE, tuple(e({**full, "paid": 5}).values()), None)]
    assert rows(RowChange("s.wide", "delete", {"id": 1}, None),
                RowChange("s.wide", "update", None, {"id": 1, "paid": 5})) == \
        [(REPLACE, tuple(e({**dict.fromkeys(NAMES), "id": 1, "paid": 5}).values()), None)]
    assert rows(RowChange("s.wide", "update", None, {"id": 1, "method": "card", "paid": 2}),
                RowChange("s.wide", "update", None, {"id": 1, "amount": 7, "paid": 5})) == \
        [(PARTIAL, tuple(e({"id": 1, "amount": 7, "paid": 5, "method": "card"}).values()),
          ("id", "amount", "paid", "method"))]
    # An unknown column is still refused, and so is a row without its key.
    with pytest.raises(MalformedChange, match=r"unknown column\(s\) \['colour'\]"):
        rows(RowChange("s.wide", "update", None, {"id": 1, "colour": "red"}))
    with pytest.raises(MalformedChange, match=r"missing primary-key column\(s\) \['id'\]"):
        rows(RowChange("s.wide", "update", None, {"paid": 1}))


ORDERS = CdcRoute("src.orders", "wide", (("order_id", "id"), ("who", "customer"),
                                         ("total", "amount")))
PAYMENTS = CdcRoute("src.payments", "wide", (("order_id", "id"), ("paid", "paid"),
                                             ("method", "method")))


def routed_map() -> TableMap:
    return TableMap("s", lambda _s, name: WIDE if name == "wide" else None,
                    routes=Routes("s", [ORDERS, PAYMENTS]))


def test_two_routed_sources_fill_one_row_and_a_delete_from_either_removes_it() -> None:
    tables = routed_map()
    model: Model = {}
    trans = SourceTransaction("1", "1", 0, (
        RowChange("src.orders", "insert", None,
                  {"order_id": 1, "who": "a", "total": 3, "unmapped": "x"}),
        RowChange("src.payments", "insert", None, {"order_id": 1, "paid": 3, "method": "card"}),
        RowChange("src.payments", "insert", None, {"order_id": 2, "paid": 9, "method": None})))
    apply_rows(model, translate(trans, tables, TOPOLOGY))
    assert model == {key(1): encoded({"id": 1, "customer": "a", "amount": 3, "paid": 3,
                                      "method": "card"}),
                     key(2): encoded({"id": 2, "customer": None, "amount": None, "paid": 9,
                                      "method": None})}
    later = SourceTransaction("2", "2", 0, (
        RowChange("src.orders", "update", None, {"order_id": 2, "who": "b", "total": 9}),
        RowChange("src.payments", "delete", {"order_id": 1}, None)))
    rows = translate(later, tables, TOPOLOGY)
    assert sorted(r.op for r in rows) == [DELETE, PARTIAL]
    apply_rows(model, rows)
    assert model == {key(2): encoded({"id": 2, "customer": "b", "amount": 9, "paid": 9,
                                      "method": None})}
    # A TRUNCATE of a routed source truncates its target, every row of it.
    rows = translate(SourceTransaction("3", "3", 0, (
        RowChange("src.payments", "truncate", None, None),)), tables, TOPOLOGY)
    assert {(r.table, r.op) for r in rows} == {("wide", TRUNCATE)}


def test_a_route_is_checked_against_the_catalog() -> None:
    lookup = {"wide": WIDE}.get
    Routes("s", [ORDERS, PAYMENTS]).check(lambda _s, name: lookup(name))
    cases = {
        CdcRoute("src.x", "nope", (("a", "id"),)): "no table s.nope",
        CdcRoute("src.x", "wide", (("a", "id"), ("b", "colour"))): "no column(s) ['colour']",
        CdcRoute("src.x", "wide", (("a", "paid"),)): "ROUTES_NAME_THE_TARGET_KEY",
    }
    for route, problem in cases.items():
        with pytest.raises(RouteError, match=problem.replace("(", r"\(").replace(")", r"\)")
                           .replace("[", r"\[").replace("]", r"\]")):
            Routes("s", [route]).check(lambda _s, name: lookup(name))
    assert Routes("s", [ORDERS]).source_key("src.orders", lambda _s, n: lookup(n)) == \
        ("order_id",)


def write_config(tmp_path: Path, routes: str) -> Path:
    path = tmp_path / "retina.toml"
    path.write_text("[cdc]\nschema = \"s\"\n" + routes)
    return path


def test_routes_are_read_from_the_config_file(tmp_path: Path) -> None:
    config = load_config(write_config(tmp_path, """
[[cdc.routes]]
source = "src.orders"
target = "wide"
columns = { order_id = "id", who = "customer", total = "amount" }

[[cdc.routes]]
source = "src.payments"
target = "wide"
columns = ["order_id", "paid", "method"]
"""), env={})
    assert config.cdc.routes == (
        ORDERS, CdcRoute("src.payments", "wide", (("order_id", "order_id"), ("paid", "paid"),
                                                  ("method", "method"))))


@pytest.mark.parametrize(("routes", "problem"), [
    ('[[cdc.routes]]\nsource = "orders"\ntarget = "wide"\ncolumns = ["id"]\n',
     "source: expected schema.table"),
    ('[[cdc.routes]]\nsource = "s.o"\ntarget = "x.wide"\ncolumns = ["id"]\n',
     "target: expected a table name"),
    ('[[cdc.routes]]\nsource = "s.o"\ntarget = "wide"\ncolumns = []\n',
     "columns: expected a non-empty list"),
    ('[[cdc.routes]]\nsource = "s.o"\ntarget = "wide"\ncolumns = { a = "id", b = "id" }\n',
     "a target column is named twice"),
    ('[[cdc.routes]]\nsource = "s.o"\ntarget = "wide"\ncolumns = ["id"]\nfilter = 1\n',
     r"unknown setting\(s\) \['filter'\]"),
    ('[[cdc.routes]]\nsource = "s.o"\ntarget = "wide"\ncolumns = ["id"]\n'
     '[[cdc.routes]]\nsource = "s.o"\ntarget = "wide"\ncolumns = ["x"]\n',
     "a second route from s.o to wide"),
])
def test_a_malformed_route_is_a_configuration_error(tmp_path: Path, routes: str,
                                                    problem: str) -> None:
    with pytest.raises(ConfigError, match=problem):
        load_config(write_config(tmp_path, routes), env={})


def test_routes_cannot_come_from_the_environment(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="routes cannot be set from the environment"):
        load_config(write_config(tmp_path, ""), env={"RETINA__CDC__ROUTES": "a,b"})


# "note" came with the table's second schema version.
NOTES = TableRecord(2, 1, "s", "notes", 2, (
    ColumnRecord(1, "id", "int64", 0, 0), ColumnRecord(2, "flag", "int64", 1, None),
    ColumnRecord(3, "note", "string", 2, None, 2)), 2)


def one(change: RowChange, tables: TableMap | None = None) -> list[tuple[Any, ...]]:
    tables = tables or TableMap("s", lambda _s, n: {"notes": NOTES, "wide": WIDE}.get(n))
    return [(r.table, r.op, r.targets) for r in
            translate(SourceTransaction("1", "1", 0, (change,)), tables, TOPOLOGY)]


def test_a_column_added_later_is_kept_only_when_the_source_left_it_out() -> None:
    """A row decoded with the source's older relation lacks the added column: whole,
    NULL there. A row the source left it out of (an unchanged TOAST value, a route) is a
    partial update: the node keeps the value."""
    row = {"id": 1, "flag": 1}
    assert one(RowChange("s.notes", "update", None, row)) == [("notes", REPLACE, None)]
    assert one(RowChange("s.notes", "update", None, row, partial=True)) == \
        [("notes", PARTIAL, ("id", "flag"))]
    whole = {**row, "note": "n"}
    assert one(RowChange("s.notes", "update", None, whole, partial=True)) == \
        [("notes", REPLACE, None)]


def test_a_key_change_without_every_column_is_refused_unless_routed() -> None:
    """The columns a key-changing row leaves out are not "keep current" for the new key
    (its row, if any, is another row): refused; a route's key change writes the new key's
    row with the route's columns by design."""
    with pytest.raises(MalformedChange, match="changes the primary key lacks column"):
        one(RowChange("s.wide", "update", {"id": 1}, {"id": 2, "paid": 3}))
    assert one(RowChange("src.payments", "update", {"order_id": 1},
                         {"order_id": 2, "paid": 3, "method": None}), routed_map()) == \
        [("wide", DELETE, None), ("wide", PARTIAL, ("id", "paid", "method"))]


def test_a_routed_old_row_without_the_mapped_key_is_refused_by_name() -> None:
    """Keyed otherwise at the source (a payment id), the old row of a DELETE carries no
    order id under REPLICA IDENTITY DEFAULT: which target row is meant is unknown."""
    with pytest.raises(MalformedChange, match=r"lacks column\(s\) \['order_id'\].*REPLICA "
                                              "IDENTITY FULL"):
        one(RowChange("src.payments", "delete", {"payment_id": 9}, None), routed_map())


def test_a_mapped_source_column_dropped_at_the_source_stops_the_connector() -> None:
    from cdc_client.schema_change import SourceColumn, SourceSchema, UnsupportedSchemaChange
    columns = (SourceColumn("order_id", "int8", ("int64",), True),
               SourceColumn("paid", "int8", ("int64",), False))  # "method" is gone
    trans = SourceTransaction("1", "1", 0, (
        RowChange("src.payments", "insert", None, {"order_id": 1, "paid": 2}),),
        (SourceSchema("src.payments", columns, True),))
    with pytest.raises(UnsupportedSchemaChange, match=r"no column\(s\) \['method'\]"):
        translate(trans, routed_map(), TOPOLOGY)
