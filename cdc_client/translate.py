"""A source transaction as changelog rows: CDC replace encoding, validated first.

INSERT, UPDATE and upsert become a CDC replace (DELETE + INSERT of the same
key); DELETE stays a DELETE; an UPDATE that changes the primary key becomes a
DELETE of the old key and a replace of the new one. A row that lacks columns the
table was created with (an unchanged TOAST value left out, a Debezium ``after``
with some columns, a route naming some of its target's columns) is a partial
update of the columns it has (docs/encoding.md, "Partial updates"). Several
changes of one key inside a transaction collapse to their net effect (``_net``),
since Retina applies a request's DELETEs before its INSERTs at one timestamp.
Routed source tables (``[[cdc.routes]]``, cdc_client/routes.py) are rewritten as
changes of their targets first.

The whole transaction is checked against the Retina catalog before anything
is allocated, logged or sent: an unknown table, a missing or NULL key column,
a column the table does not have, or a value its type
cannot hold exactly (``encode_value`` raises ``EncodingError``: a Python type
that contradicts the column type, an out-of-range integer, a decimal that
does not fit the column's precision and scale) raises
:class:`MalformedChange`, and nothing is applied.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from cdc_client.routes import Routes
from cdc_client.schema_change import SourceSchema, UnsupportedSchemaChange, evolve, plan
from cdc_client.source import MalformedChange, RowChange, SourceTransaction
from retina_common.catalog import TableRecord
from retina_common.changelog import DELETE, PARTIAL, REPLACE, TRUNCATE, ChangeRow
from retina_common.codec import (
    EncodingError,
    column_encoder,
    encode_primary_key,
    value_encoder,
)
from retina_common.topology import Topology


@dataclass(frozen=True)
class TableMap:
    """Source ``schema.table`` → the Retina table of the same name in ``schema``."""

    schema: str
    lookup: Callable[[str, str], TableRecord | None]  # (schema, table) -> record or None
    # Schema evolution (schema, table, column, type) -> the table as committed; None: a
    # source schema change that needs a column is refused (cdc_client/schema_change.py).
    add_column: Callable[[str, str, str, str], TableRecord] | None = None
    # [[cdc.routes]] (cdc_client/routes.py): routed source tables' changes are rewritten
    # as changes of their targets before anything else.
    routes: Routes | None = None

    def forget(self) -> None:
        """Drop cached table records (a table gained a column)."""
        clear = getattr(self.lookup, "cache_clear", None)
        if clear is not None:
            clear()

    def follow(self, schema: SourceSchema, where: str) -> None:
        """Compare a source table schema with the Retina table: add the source's new
        nullable columns, or raise UnsupportedSchemaChange."""
        table = self.table(schema.table, where)
        wanted = plan(schema, table)
        if not wanted:
            return
        if self.add_column is None:
            raise UnsupportedSchemaChange(f"{where}: {schema.table} has new columns "
                                          f"{[n for n, _t in wanted]}; adding them is off")
        evolve(schema, table, self.add_column)
        self.forget()

    def table(self, source_table: str, where: object) -> TableRecord:
        name = source_table.rsplit(".", 1)[-1]
        record = self.lookup(self.schema, name)
        if record is None:
            raise MalformedChange(f"{where}: unknown table {source_table!r} "
                                  f"(no table {self.schema}.{name} in the Retina catalog)")
        return record


_OPERATIONS = frozenset(("insert", "update", "delete", "truncate"))


class _Where:
    """Where a change is, for an error message: formatted only when one is raised (a
    transaction of thousands of rows raises none)."""

    __slots__ = ("index", "origin", "trans")

    def __init__(self, trans: SourceTransaction, index: int, origin: str) -> None:
        self.trans, self.index, self.origin = trans, index, origin

    def __str__(self) -> str:
        text = (f"source transaction {self.trans.source_txid} at {self.trans.position}, "
                f"change {self.index}")
        return f"{text} (event at {self.origin})" if self.origin else text


class _Shape:
    """What translating rows of one table needs, worked out once per table record."""

    def __init__(self, table: TableRecord) -> None:
        types = {c.name: c.type for c in table.columns}
        self.key_columns = table.primary_key
        self.key_types = [types[c] for c in table.primary_key]
        self.names = frozenset(types)
        # A column added by schema evolution is NULL in a row the source decoded with its
        # older relation (a transaction re-delivered after a restart that followed the
        # change); the columns the table was created with must be there.
        self.required = frozenset(c.name for c in table.columns if c.since_version == 1)
        self.encoders = [(c, value_encoder(c.type)) for c in table.columns]
        self.named_encoders = [(c.name, encode) for c, encode in self.encoders]
        self.encode_key = _key_encoder(self.key_types)
        # The usual one-column key, looked up without a list per row.
        self.single_key = self.key_columns[0] if len(self.key_columns) == 1 else None
        # Column-wise (_encoded_upserts): each column's encoder, and where the one-column
        # key is among the values (its key bytes are its value's, behind their length).
        self.column_encoders = [(c.name, column_encoder(c.type)) for c in table.columns]
        self.single_key_at = ([c.name for c in table.columns].index(self.single_key)
                              if self.single_key is not None else None)


def _key_encoder(types: list[str]) -> Callable[[list[Any]], bytes]:
    """``encode_primary_key`` for one table's key types; a one-column key (the usual
    case) without the general function's per-row lookups."""
    if len(types) != 1:
        return functools.partial(encode_primary_key, types)
    encode = value_encoder(types[0])

    def one_column(values: list[Any]) -> bytes:
        encoded = encode(values[0])
        return len(encoded).to_bytes(4, "big") + encoded
    return one_column


# By the record's identity (hashing a record hashes every column): the entry keeps the
# record alive, so its id cannot be reused for another one while cached.
_shapes: dict[int, tuple[TableRecord, _Shape]] = {}


def _shape(table: TableRecord) -> _Shape:
    entry = _shapes.get(id(table))
    if entry is None or entry[0] is not table:
        if len(_shapes) > 1024:  # table records of many schema versions over a long run
            _shapes.clear()
        entry = _shapes[id(table)] = (table, _Shape(table))
    return entry[1]


def _key(table: TableRecord, shape: _Shape, row: Mapping[str, Any], where: object) -> bytes:
    if shape.single_key is not None:
        value = row.get(shape.single_key)
        missing = [] if value is not None else [shape.single_key]
        values = [value]
    else:
        missing = [c for c in shape.key_columns if row.get(c) is None]
        values = [row.get(c) for c in shape.key_columns]
    if missing:
        raise MalformedChange(f"{where}: missing primary-key column(s) {missing} "
                              f"for {table.name}")
    try:
        return shape.encode_key(values)
    except EncodingError as exc:  # the codec's only error for a value that does not fit
        raise MalformedChange(f"{where}: primary key of {table.name}: {exc}") from None


def _values(table: TableRecord, shape: _Shape, row: Mapping[str, Any], where: object,
            partial: bool = False) -> tuple[tuple[bytes, ...], tuple[str, ...] | None]:
    """The row's encoded values and, for a partial update, its target columns (the
    columns left out keep their current values); targets None for a whole row. A row
    is a partial update when its change says so (``RowChange.partial``) and it lacks
    any column, or when it lacks a column the table was created with; a row lacking
    only columns added later is whole (NULL there: see RowChange)."""
    keys = row.keys()
    if not shape.names.issuperset(keys):
        extra = sorted(set(row) - shape.names)
        raise MalformedChange(f"{where}: schema mismatch for {table.name}: "
                              f"unknown column(s) {extra}")
    if not keys >= (shape.names if partial else shape.required):
        return _partial_values(table, shape, row, where)
    get = row.get
    try:  # every value at once; a value that does not fit is looked for again below
        return tuple([b"" if (v := get(name)) is None else encode(v)
                      for name, encode in shape.named_encoders]), None
    except EncodingError:
        pass
    return tuple(_encoded(table, col, encode, row.get(col.name), where)
                 for col, encode in shape.encoders), None


def _partial_values(table: TableRecord, shape: _Shape, row: Mapping[str, Any],
                    where: object) -> tuple[tuple[bytes, ...], tuple[str, ...]]:
    present = [(col, encode) for col, encode in shape.encoders if col.name in row]
    return (tuple(_encoded(table, col, encode, row[col.name], where) for col, encode in present),
            tuple(col.name for col, _encode in present))


def _encoded(table: TableRecord, col: Any, encode: Callable[[Any], bytes], value: Any,
             where: object) -> bytes:
    try:
        return b"" if value is None else encode(value)
    except EncodingError as exc:  # the codec's only error for a value that does not fit
        raise MalformedChange(f"{where}: column {table.name}.{col.name} ({col.type}): "
                              f"cannot encode {_shown(value)}: {exc}") from None


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 120 else text[:117] + "..."


# One net effect of a key: (op, values, targets); targets only for a PARTIAL.
Effect = tuple[int, tuple[bytes, ...] | None, tuple[str, ...] | None]


def _effects(change: RowChange, table: TableRecord, shape: _Shape, where: object
             ) -> list[tuple[bytes, Effect]]:
    if change.op == "delete":
        if change.before is None:
            raise MalformedChange(f"{where}: delete without a before image")
        return [(_key(table, shape, change.before, where), (DELETE, None, None))]
    if change.after is None:
        raise MalformedChange(f"{where}: {change.op} without an after image")
    key = _key(table, shape, change.after, where)
    effects: list[tuple[bytes, Effect]] = []
    values, targets = _values(table, shape, change.after, where, change.partial)
    if change.op == "update" and change.before is not None:
        old = _key(table, shape, change.before, where)
        if old != key:  # a primary-key change
            if targets is not None and not change.partial:
                # The new key's row would take NULL where the old row had values: the
                # columns left out are not "keep current" for another key.
                raise MalformedChange(f"{where}: an update of {table.name} that changes the "
                                      f"primary key lacks column(s) "
                                      f"{[c for c in shape.names if c not in change.after]}")
            effects.append((old, (DELETE, None, None)))
    effects.append((key, (REPLACE, values, None) if targets is None
                    else (PARTIAL, values, targets)))
    return effects


def _net(prior: Effect | None, effect: Effect, table: TableRecord) -> Effect:
    """A key's net effect in a transaction after ``prior`` (None: the key has none yet).
    A partial update merges with what the transaction wrote before it
    (PARTIAL_BASE_IS_BEFORE_T at the node would otherwise take the row from before the
    transaction): over a replace it is a replace of the merged row; over a delete, a
    replace with NULL outside its targets (the node refuses it for a NOT NULL column:
    NOT_NULL_HOLDS); over a partial update, one partial update of both targets, the
    later value winning. After a TRUNCATE of its table in the transaction it stays a
    partial update: the node gives a key no base row at a timestamp whose TRUNCATE
    covers it."""
    op, values, targets = effect
    if op != PARTIAL:
        return effect
    assert values is not None and targets is not None
    if prior is None:
        return effect
    names = [c.name for c in table.columns]
    if prior[0] == DELETE:
        row = dict.fromkeys(names, b"")
    elif prior[0] == REPLACE:
        row = dict(zip(names, prior[1] or (), strict=True))
    else:  # an earlier partial update: both targets, in the table's column order
        row = dict(zip(prior[2] or (), prior[1] or (), strict=True))
        row.update(zip(targets, values, strict=True))
        merged = [n for n in names if n in row]
        return PARTIAL, tuple(row[n] for n in merged), tuple(merged)
    row.update(zip(targets, values, strict=True))
    return REPLACE, tuple(row[n] for n in names), None


# Below this many upserts of one table in a transaction, the column-wise encoding's fixed
# cost is more than it saves (a CDC source's typical transaction: a row or two).
COLUMNAR_MIN_UPSERTS = 64

Encoded = tuple[str, bytes, tuple[bytes, ...]]  # (Retina table, key, values) of one upsert


def _is_upsert(change: RowChange) -> bool:
    """An INSERT, or an UPDATE without a before image (it cannot change the key), of a
    whole row (a partial one goes row by row)."""
    return change.after is not None and not change.partial and (
        change.op == "insert" or (change.op == "update" and change.before is None))


def _upserts_by_table(trans: SourceTransaction) -> dict[str, list[int]]:
    by_table: dict[str, list[int]] = {}
    for i, change in enumerate(trans.changes):
        if _is_upsert(change):
            by_table.setdefault(change.table, []).append(i)
    return by_table


def _encoded_upserts(trans: SourceTransaction, record: TableRecord, shape: _Shape,
                     positions: list[int]) -> dict[int, Encoded]:
    """Change index -> (table, key, values) for a table's upserts (at ``positions``),
    encoded a column at a time: the same bytes as ``_key`` and ``_values`` give row by
    row. None of them if any holds something those would refuse (an unknown column, a
    missing or NULL key, a value that does not fit): the row-by-row path then meets it
    in order and raises exactly as before."""
    afters = [trans.changes[i].after for i in positions]
    try:
        encoded = _encode_upserts(shape, afters)  # type: ignore[arg-type]
    except Exception:  # EncodingError, or an encoder outside its contract: the row path
        return {}      # meets the value again and raises, in order
    if encoded is None:
        return {}
    return dict(zip(positions, ((record.name, key, values) for key, values in encoded),
                    strict=True))


def _encode_upserts(shape: _Shape, afters: list[Mapping[str, Any]]
                    ) -> list[tuple[bytes, tuple[bytes, ...]]] | None:
    names, required = shape.names, shape.required
    for row in afters:
        present = row.keys()
        if not (names.issuperset(present) and present >= required):
            return None
    columns = [encode([row.get(name) for row in afters])
               for name, encode in shape.column_encoders]
    if shape.single_key_at is not None:
        key_values = columns[shape.single_key_at]
        if not all(key_values):  # a NULL key
            return None
        keys = [len(v).to_bytes(4, "big") + v for v in key_values]
    else:
        rows = [[row.get(c) for c in shape.key_columns] for row in afters]
        if any(v is None for values in rows for v in values):
            return None
        keys = [shape.encode_key(values) for values in rows]
    return list(zip(keys, zip(*columns, strict=True), strict=True))


def translate(trans: SourceTransaction, tables: TableMap, topology: Topology, *,
              columnar_min_upserts: int = COLUMNAR_MIN_UPSERTS) -> list[ChangeRow]:
    """The transaction's net effects, in first-touch order, with ts 0: the
    timestamp is allocated only once the whole batch has been validated.

    A TRUNCATE supersedes the table's earlier effects in the transaction and
    becomes one TRUNCATE row per virtual node (every node holding a part of
    the table deletes its rows), placed before all other rows: Retina applies
    it before the DELETEs and INSERTs of the same timestamp, so rows written
    after it in the transaction survive."""
    if tables.routes is not None:
        trans = tables.routes.rewrite(trans, tables.lookup)
    for schema in trans.schemas:  # the catalog follows the source before any row is read
        tables.follow(schema, f"source transaction {trans.source_txid} at {trans.position}")
    net: dict[tuple[str, bytes], Effect] = {}
    truncated: dict[str, None] = {}
    # Source table -> (record, shape), once per transaction: the catalog is followed
    # before any row is read, so a table's record cannot change inside one.
    seen: dict[str, tuple[TableRecord, _Shape]] = {}
    # A table's upserts are encoded a column at a time (when it has many) once its record
    # is looked up, at its first change: one lookup per table, and in order.
    upserts = _upserts_by_table(trans)
    encoded: dict[int, Encoded] = {}
    for i, change in enumerate(trans.changes):
        if i not in encoded:
            where = _Where(trans, i, change.origin)
            if change.op not in _OPERATIONS:
                raise MalformedChange(f"{where}: unknown operation {change.op!r}")
            if change.table not in seen:
                record = tables.table(change.table, where)
                seen[change.table] = (record, _shape(record))
                positions = upserts.get(change.table, [])
                if len(positions) >= columnar_min_upserts:
                    encoded.update(_encoded_upserts(trans, record, seen[change.table][1],
                                                    positions))
        done = encoded.get(i)
        if done is not None:  # a valid upsert of a known table, encoded with its column
            net[(done[0], done[1])] = (REPLACE, done[2], None)
            continue
        table, shape = seen[change.table]
        if change.op == "truncate":
            truncated[table.name] = None
            net = {k: v for k, v in net.items() if k[0] != table.name}
            continue
        for key, effect in _effects(change, table, shape, where):
            net[(table.name, key)] = _net(net.get((table.name, key)), effect, table)
    truncates = [(table, vnode) for table in truncated for vnode in range(topology.virtual_nodes)]
    rows = [ChangeRow(0, seq, vnode, table, TRUNCATE, b"", None)
            for seq, (table, vnode) in enumerate(truncates)]
    first = len(rows)
    vnodes = topology.vnodes_of_keys([key for _table, key in net]).tolist() if net else []
    rows += [ChangeRow(0, seq, vnode, table, op, key, values, targets)
             for seq, ((table, key), (op, values, targets)), vnode
             in zip(itertools.count(first), net.items(), vnodes)]
    return rows
