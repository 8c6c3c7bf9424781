"""A source transaction as changelog rows: CDC replace encoding, validated first.

INSERT, UPDATE and upsert become a CDC replace (DELETE + INSERT of the same
key); DELETE stays a DELETE; an UPDATE that changes the primary key becomes a
DELETE of the old key and a replace of the new one. Several changes of one
key inside a transaction collapse to their net effect, since Retina applies a
request's DELETEs before its INSERTs at one timestamp.

The whole transaction is checked against the Retina catalog before anything
is allocated, logged or sent: an unknown table, a missing or NULL key column,
a column the table does not have, a missing column, or a value its type
cannot encode raises :class:`MalformedChange`, and nothing is applied.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from cdc_client.changelog import DELETE, REPLACE, ChangeRow
from cdc_client.source import RowChange, SourceTransaction
from retina_common.catalog import TableRecord
from retina_common.codec import EncodingError, encode_primary_key, encode_value
from retina_common.topology import Topology


class MalformedChange(Exception):
    """A source change that does not fit the Retina table; the connector stops."""


@dataclass(frozen=True)
class TableMap:
    """Source ``schema.table`` → the Retina table of the same name in ``schema``."""

    schema: str
    lookup: Callable[[str, str], TableRecord | None]  # (schema, table) -> record or None

    def table(self, source_table: str, where: str) -> TableRecord:
        name = source_table.rsplit(".", 1)[-1]
        record = self.lookup(self.schema, name)
        if record is None:
            raise MalformedChange(f"{where}: unknown table {source_table!r} "
                                  f"(no table {self.schema}.{name} in the Retina catalog)")
        return record


def _key(table: TableRecord, row: Mapping[str, Any], where: str) -> bytes:
    types = {c.name: c.type for c in table.columns}
    missing = [c for c in table.primary_key if row.get(c) is None]
    if missing:
        raise MalformedChange(f"{where}: missing primary-key column(s) {missing} "
                              f"for {table.name}")
    try:
        return encode_primary_key([types[c] for c in table.primary_key],
                                  [row[c] for c in table.primary_key])
    except (EncodingError, ValueError, TypeError, OverflowError) as exc:
        raise MalformedChange(f"{where}: primary key of {table.name}: {exc}") from None


def _values(table: TableRecord, row: Mapping[str, Any], where: str) -> tuple[bytes, ...]:
    names = [c.name for c in table.columns]
    extra = sorted(set(row) - set(names))
    absent = [n for n in names if n not in row]
    if extra or absent:
        raise MalformedChange(f"{where}: schema mismatch for {table.name}: "
                              f"unknown column(s) {extra}, missing column(s) {absent}")
    out = []
    for col in table.columns:
        try:
            out.append(encode_value(col.type, row[col.name]))
        except (EncodingError, ValueError, TypeError, OverflowError, ArithmeticError) as exc:
            raise MalformedChange(f"{where}: column {table.name}.{col.name} ({col.type}): "
                                  f"cannot encode {row[col.name]!r}: {exc}") from None
    return tuple(out)


def _effects(change: RowChange, table: TableRecord, where: str
             ) -> list[tuple[bytes, int, tuple[bytes, ...] | None]]:
    if change.op == "delete":
        if change.before is None:
            raise MalformedChange(f"{where}: delete without a before image")
        return [(_key(table, change.before, where), DELETE, None)]
    if change.after is None:
        raise MalformedChange(f"{where}: {change.op} without an after image")
    key = _key(table, change.after, where)
    effects: list[tuple[bytes, int, tuple[bytes, ...] | None]] = []
    if change.op == "update" and change.before is not None:
        old = _key(table, change.before, where)
        if old != key:  # a primary-key change
            effects.append((old, DELETE, None))
    effects.append((key, REPLACE, _values(table, change.after, where)))
    return effects


def translate(trans: SourceTransaction, tables: TableMap, topology: Topology
              ) -> list[ChangeRow]:
    """The transaction's net effects, in first-touch order, with ts 0: the
    timestamp is allocated only once the whole batch has been validated."""
    net: dict[tuple[str, bytes], tuple[int, tuple[bytes, ...] | None]] = {}
    for i, change in enumerate(trans.changes):
        where = f"source transaction {trans.source_txid} at {trans.position}, change {i}"
        if change.op not in ("insert", "update", "delete"):
            raise MalformedChange(f"{where}: unknown operation {change.op!r}")
        table = tables.table(change.table, where)
        for key, op, values in _effects(change, table, where):
            net[(table.name, key)] = (op, values)
    return [ChangeRow(0, seq, topology.vnode_of_key(key), table, op, key, values)
            for seq, ((table, key), (op, values)) in enumerate(net.items())]
