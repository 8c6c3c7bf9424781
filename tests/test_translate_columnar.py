"""translate's column-wise encoding of a transaction's upserts (``_encoded_upserts``) gives
exactly the changelog rows of the row-by-row path, and a transaction the row path refuses
is refused with the same message. Pure logic: random transactions, both paths."""

from __future__ import annotations

import math
import random
from datetime import time
from decimal import Decimal
from types import MappingProxyType
from typing import Any

import numpy as np
import pytest

import cdc_client.translate as translate_module
from cdc_client.source import RowChange, SourceTransaction
from cdc_client.translate import MalformedChange, TableMap, translate
from retina_common.catalog.model import ColumnRecord, TableRecord
from retina_common.codec import column_encoder, value_encoder
from retina_common.topology import Topology

TOPOLOGY = Topology(("127.0.0.1:1",), 8)
ROW_BY_ROW = 10**9  # no table reaches it: the row-by-row path only


def record(table_id: int, name: str, columns: list[tuple[str, str]], key: list[str]
           ) -> TableRecord:
    return TableRecord(table_id, 1, "s", name, table_id, tuple(
        ColumnRecord(i + 1, n, t, i, key.index(n) if n in key else None)
        for i, (n, t) in enumerate(columns)))


TABLES = {
    "orders": record(1, "orders", [("id", "int64"), ("qty", "int64"), ("price", "float64"),
                                   ("note", "string"), ("small", "int32"),
                                   ("amount", "decimal(10,2)"), ("added", "int64")], ["id"]),
    "lines": record(2, "lines", [("order_id", "int64"), ("line", "int32"),
                                 ("sku", "string"), ("weight", "float64")],
                    ["order_id", "line"]),
    "tags": record(3, "tags", [("tag", "string"), ("hits", "int64")], ["tag"]),
}
# "added" came with the table's second schema version: a source row may lack it.
TABLES["orders"] = TableRecord(1, 1, "s", "orders", 1, tuple(
    ColumnRecord(c.column_id, c.name, c.type, c.ordinal, c.pk_position,
                 2 if c.name == "added" else 1) for c in TABLES["orders"].columns), 2)
TABLE_MAP = TableMap("s", lambda _schema, name: TABLES.get(name))


def odd(rng: random.Random, kind: str) -> Any:
    """A value the column-wise path must hand to the row encoder, or that no path takes."""
    return rng.choice({
        "int": [True, 2**63, -2**63 - 1, 1.5, np.int64(7), "12", None, time(1, 2, 3),
                Decimal(4)],
        "float": [3, float("nan"), -0.0, math.inf, "x", np.float64(2.5), None, Decimal("1.5"),
                  Decimal("sNaN"), False],
        "str": ["\ud800", b"bytes", 5, "", None],
    }[kind])


def value(rng: random.Random, col_type: str, weird: float) -> Any:
    kind = {"int64": "int", "int32": "int", "float64": "float", "string": "str"}.get(col_type)
    if kind and rng.random() < weird:
        return odd(rng, kind)
    if rng.random() < 0.05:
        return None
    if col_type in ("int64", "int32"):
        return rng.randint(-1000, 1000)
    if col_type == "float64":
        return rng.uniform(-1e6, 1e6)
    if col_type == "string":
        return rng.choice(["", "a", "é", "x" * 40, f"s{rng.randint(0, 99)}"])
    return Decimal(rng.randint(-10**6, 10**6)) / 100


def row(rng: random.Random, table: TableRecord, weird: float) -> dict[str, Any]:
    out = {c.name: value(rng, c.type, weird) for c in table.columns}
    for c in table.columns:
        if c.pk_position is not None and (out[c.name] is None or rng.random() > weird):
            out[c.name] = rng.randint(1, 40) if c.type != "string" else f"k{rng.randint(1, 40)}"
    if rng.random() < weird:
        out.pop(rng.choice(list(out)))  # a missing column, key or not
    if rng.random() < weird / 2:
        out["unknown"] = 1
    if "added" in out and rng.random() < 0.3:
        del out["added"]  # decoded with the source's older relation: NULL, not refused
    return out


def transaction(rng: random.Random, weird: float) -> SourceTransaction:
    changes = []
    for _ in range(rng.choice([1, 5, 70, 200, 400])):
        name = rng.choice(["orders", "orders", "lines", "tags"] +
                          (["missing"] if rng.random() < weird else []))
        table = TABLES.get(name, TABLES["orders"])
        op = rng.choices(["insert", "update", "delete", "truncate"], [6, 4, 2, 0.1])[0]
        if op == "delete":
            changes.append(RowChange(f"public.{name}", "delete", row(rng, table, weird), None))
        elif op == "truncate":
            changes.append(RowChange(f"public.{name}", "truncate", None, None))
        else:
            before = row(rng, table, weird) if op == "update" and rng.random() < 0.2 else None
            after: Any = row(rng, table, weird)
            if rng.random() < 0.1:
                after = MappingProxyType(after)  # a decoder's own mapping, not a dict
            changes.append(RowChange(f"public.{name}", op, before, after))
    return SourceTransaction("7", "0/7", 0, tuple(changes))


def outcome(trans: SourceTransaction, min_upserts: int) -> Any:
    try:
        return translate(trans, TABLE_MAP, TOPOLOGY, columnar_min_upserts=min_upserts)
    except MalformedChange as exc:
        return f"MalformedChange: {exc}"


@pytest.mark.parametrize("weird", [0.0, 0.002, 0.02])
@pytest.mark.parametrize("seed", range(40))
def test_columnwise_and_row_by_row_give_the_same_rows_or_the_same_refusal(
        seed: int, weird: float) -> None:
    trans = transaction(random.Random(seed * 1000 + int(weird * 1000)), weird)
    expected = outcome(trans, ROW_BY_ROW)
    assert outcome(trans, 1) == expected
    assert outcome(trans, 64) == expected


def test_the_random_transactions_take_both_paths_at_the_default_threshold(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The comparison above is only worth something if the column-wise path is taken, and
    declined, often at the threshold the connector uses."""
    taken = declined = 0
    original = translate_module._encode_upserts

    def counted(shape: Any, afters: Any) -> Any:
        nonlocal taken, declined
        out = original(shape, afters)
        taken, declined = taken + (out is not None), declined + (out is None)
        return out
    monkeypatch.setattr(translate_module, "_encode_upserts", counted)
    for weird in (0.0, 0.002, 0.02):
        for seed in range(40):
            outcome(transaction(random.Random(seed * 1000 + int(weird * 1000)), weird), 64)
    assert taken >= 40 and declined >= 10, (taken, declined)


def test_a_table_is_looked_up_once_per_transaction() -> None:
    """The column-wise pass does not look a table up ahead of the row path (an unreachable
    catalog would be waited for twice, and a record read twice could differ)."""
    looked: list[str] = []

    def lookup(_schema: str, name: str) -> TableRecord | None:
        looked.append(name)
        return TABLES.get(name)
    rng = random.Random(5)
    changes = tuple(RowChange("public.orders", "insert", None, row(rng, TABLES["orders"], 0.0))
                    for _ in range(200))
    translate(SourceTransaction("1", "0/1", 0, changes), TableMap("s", lookup), TOPOLOGY)
    assert looked == ["orders"]


def test_a_clean_large_transaction_takes_the_columnwise_path_and_keeps_last_writes() -> None:
    """Not only equal: the column-wise path is the one taken, and a key written twice keeps
    its last values (the net effect per key)."""
    rng = random.Random(3)
    afters = [row(rng, TABLES["orders"], 0.0) for _ in range(500)]
    changes = tuple(RowChange("public.orders", "insert", None, a) for a in afters)
    rows = translate(SourceTransaction("1", "0/1", 0, changes), TABLE_MAP, TOPOLOGY)
    last = {a["id"]: a for a in afters}
    assert len(rows) == len(last)
    encode = {c.name: value_encoder(c.type) for c in TABLES["orders"].columns}
    for r in rows:
        a = last[int.from_bytes(r.key[4:], "little", signed=True)]
        assert r.values == tuple(b"" if a.get(n) is None else encode[n](a[n]) for n in encode)
        assert r.vnode == TOPOLOGY.vnode_of_key(r.key)


@pytest.mark.parametrize("col_type", ["int64", "float64", "string", "int32", "decimal(10,2)"])
def test_a_column_encodes_as_its_values_do_and_refuses_the_first_that_does_not_fit(
        col_type: str) -> None:
    rng = random.Random(col_type)
    encode = value_encoder(col_type)
    for weird in (0.0, 0.1):
        values = [value(rng, col_type, weird) for _ in range(300)]
        try:
            expected: Any = [b"" if v is None else encode(v) for v in values]
        except ValueError as exc:
            expected = str(exc)
        try:
            got: Any = column_encoder(col_type)(values)
        except ValueError as exc:
            got = str(exc)
        assert got == expected
