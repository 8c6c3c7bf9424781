"""Source schema changes: evolve the Retina table, or stop the connector.

A source that knows its tables' columns attaches a :class:`SourceSchema` to
the transaction in which it learnt them (pgoutput sends a Relation message
before the first change of a table in a session and again after its schema
changed). Before that transaction is translated, each schema is compared with
the Retina catalog table (:func:`evolve`):

* the same columns: nothing to do;
* the source has new columns that are nullable, have no default and read NULL
  in the rows that existed before them: they are added to the Retina table
  (``Catalog.add_column``, committed and durable before any row carrying them
  is translated, logged or sent). Files written before read them as NULL;
* anything else (a column dropped or renamed, a changed type the Retina column
  cannot hold exactly, a new NOT NULL column, one with a default now or whose
  older rows read a stored value (``atthasmissing``), a changed primary key, a
  new column of a type without a Retina counterpart) raises
  :class:`UnsupportedSchemaChange`: the connector commits the transactions
  before it and stops with exit code 6, having applied nothing of the
  offending transaction. docs/cdc.md, "Schema changes", is the procedure.

The comparison is done again after every restart (the source sends the
Relation again), and adding a column that is already there changes nothing,
so a crash anywhere in between is harmless. A transaction re-delivered after a
restart may carry the *older* relation (without a column the catalog already
gained): that is told apart from a dropped column by asking the source whether
the column exists now.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from contextlib import closing
from dataclasses import dataclass, field
from typing import Any

import psycopg2
import structlog
from prometheus_client import Counter

from retina_common.catalog import InvalidCatalogArgument, TableRecord
from retina_common.catalog.model import check_column_type, check_name

log = structlog.get_logger("cdc")
COLUMNS_ADDED = Counter("cdc_schema_columns_added_total",
                        "Columns added to Retina tables by source schema changes")


class UnsupportedSchemaChange(Exception):
    """A source schema change Retina cannot follow by itself; the connector stops."""


@dataclass(frozen=True)
class ColumnFacts:
    """What a source says about one of its columns now (not at the change's position)."""

    nullable: bool
    has_default: bool  # a default, identity or generated value: old rows are not NULL
    # Rows stored before the column was added read a non-NULL value kept in the source's
    # catalog (PostgreSQL's atthasmissing: ADD COLUMN with a non-volatile default). It
    # outlives a later DROP DEFAULT, which is why it is asked and not only the default.
    has_missing: bool = False


@dataclass(frozen=True)
class SourceColumn:
    name: str
    source_type: str  # as the source names it, for messages
    fits: tuple[str, ...]  # Retina types holding its values exactly; the first for a new column
    key: bool


@dataclass(frozen=True)
class SourceSchema:
    table: str  # schema.table
    columns: tuple[SourceColumn, ...]
    key_is_primary_key: bool  # the key flags name the primary key (not REPLICA IDENTITY FULL)
    # The source's current facts about the table's columns; asked only when they differ.
    facts: Callable[[], Mapping[str, ColumnFacts]] = field(compare=False,
                                                           default=lambda: {})


# --- PostgreSQL (pgoutput) ----------------------------------------------------------------------
_PG_FITS: dict[int, tuple[str, ...]] = {
    16: ("boolean",),
    21: ("int32", "int64"), 23: ("int32", "int64"), 20: ("int64",),
    700: ("float32", "float64"), 701: ("float64",),
    1082: ("date32",), 1114: ("timestamp_us",), 1184: ("timestamp_us",),
    17: ("binary",),
    25: ("string",), 1043: ("string",), 1042: ("string",), 19: ("string",),
}
_PG_NAMES = {16: "boolean", 21: "smallint", 23: "integer", 20: "bigint", 700: "real",
             701: "double precision", 1082: "date", 1114: "timestamp", 1184: "timestamptz",
             17: "bytea", 25: "text", 1043: "varchar", 1042: "char", 19: "name"}
NUMERIC = 1700


def _numeric_fits(type_modifier: int) -> tuple[str, ...]:
    if type_modifier < 4:  # unconstrained numeric: any decimal column took it before
        return ()
    # PostgreSQL 15 stores the scale as a signed 11-bit field (numeric(5,-2) is legal
    # there) and allows a scale above the precision (numeric(2,4)); a Retina decimal
    # has neither, so such a column has no Retina type.
    precision = ((type_modifier - 4) >> 16) & 0xFFFF
    scale = (type_modifier - 4) & 0x7FF
    if scale & 0x400:
        scale -= 0x800
    fits = 0 < precision <= 38 and 0 <= scale <= precision
    return (f"decimal({precision},{scale})",) if fits else ()


def pg_column_fits(type_oid: int, type_modifier: int) -> tuple[str, ...]:
    """The Retina column types a pgoutput column's values encode into exactly. Types the
    source decodes as text (uuid, json, ...) fit a string column."""
    if type_oid == NUMERIC:
        return _numeric_fits(type_modifier)
    return _PG_FITS.get(type_oid, ("string",))


def pg_type_name(type_oid: int, type_modifier: int) -> str:
    if type_oid == NUMERIC:
        fits = _numeric_fits(type_modifier)
        return f"numeric{fits[0][7:]}" if fits else "numeric"
    return _PG_NAMES.get(type_oid, f"type OID {type_oid}")


def pg_column_facts(dsn: str, relation_oid: int) -> dict[str, ColumnFacts]:
    """The live columns of a PostgreSQL table now, by name (empty if it is gone).

    A table rewrite (VACUUM FULL, CLUSTER, an ALTER that rewrites, an ADD COLUMN with a
    volatile default) stores every value in the rows and clears ``atthasmissing``: what
    older rows read is then no longer in the catalog (docs/cdc.md, "Schema changes")."""
    with closing(psycopg2.connect(dsn, connect_timeout=10)) as conn, conn.cursor() as cur:
        cur.execute("SELECT attname, NOT attnotnull, atthasdef OR attidentity <> '' "
                    "OR attgenerated <> '', atthasmissing FROM pg_attribute "
                    "WHERE attrelid = %s AND attnum > 0 AND NOT attisdropped",
                    (relation_oid,))
        return {name: ColumnFacts(bool(nullable), bool(default), bool(missing))
                for name, nullable, default, missing in cur.fetchall()}


# --- the comparison -----------------------------------------------------------------------------
def _fits(column: SourceColumn, retina_type: str) -> bool:
    if column.source_type == "numeric" and not column.fits:
        return retina_type.startswith("decimal(")  # unconstrained: accepted as before
    if retina_type in column.fits:
        return True
    # A constrained numeric also fits a wider decimal (as many digits either side).
    if column.fits and column.fits[0].startswith("decimal(") and retina_type.startswith(
            "decimal("):
        p, s = _decimal(column.fits[0])
        rp, rs = _decimal(retina_type)
        return s <= rs and p - s <= rp - rs
    return False


def _decimal(type_name: str) -> tuple[int, int]:
    p, s = type_name[len("decimal("):-1].split(",")
    return int(p), int(s)


def plan(schema: SourceSchema, table: TableRecord) -> list[tuple[str, str]]:
    """The columns ``(name, Retina type)`` to add so that ``table`` follows ``schema``;
    raises UnsupportedSchemaChange for any other difference."""
    where = f"source table {schema.table} (Retina table {table.schema_name}.{table.name})"
    source = {c.name: c for c in schema.columns}
    retina = {c.name: c for c in table.columns}
    facts: dict[str, ColumnFacts] | None = None

    def current() -> dict[str, ColumnFacts]:
        nonlocal facts
        if facts is None:
            facts = dict(schema.facts())
        return facts

    for name, known in retina.items():
        if name in source and not _fits(source[name], known.type):
            raise UnsupportedSchemaChange(
                f"{where}: column {name} changed type: the source sends "
                f"{source[name].source_type}, which Retina's {known.type} column cannot hold "
                "exactly")
    if schema.key_is_primary_key:
        keys = sorted(c.name for c in schema.columns if c.key)
        if keys != sorted(table.primary_key):
            raise UnsupportedSchemaChange(
                f"{where}: primary key changed: the source's is {keys}, Retina's "
                f"{list(table.primary_key)}")
    for name, known in retina.items():
        # A relation older than the catalog (a transaction re-delivered after a restart
        # that followed the change) lacks an added column the source still has.
        if name not in source and not (known.since_version > 1 and name in current()):
            raise UnsupportedSchemaChange(
                f"{where}: column {name} was dropped or renamed in the source")
    added = [c for c in schema.columns if c.name not in retina]
    for col in added:
        fact = current().get(col.name)
        if fact is None:
            raise UnsupportedSchemaChange(
                f"{where}: new column {col.name} is no longer in the source table (changed "
                "again since), so whether it may be added cannot be told")
        if not fact.nullable:
            raise UnsupportedSchemaChange(f"{where}: new column {col.name} is NOT NULL; only "
                                          "nullable columns without a default are added")
        if fact.has_missing:
            raise UnsupportedSchemaChange(
                f"{where}: new column {col.name} was added with a default: the source's "
                "rows from before it read that value (even if the default was dropped "
                "since), Retina's would read NULL; only nullable columns without a default "
                "are added")
        if fact.has_default:
            raise UnsupportedSchemaChange(
                f"{where}: new column {col.name} has a default (or is an identity or "
                "generated column): the source's existing rows hold a value Retina's would "
                "not; only nullable columns without a default are added")
        if not col.fits:
            raise UnsupportedSchemaChange(
                f"{where}: new column {col.name} of type {col.source_type} has no Retina "
                "column type (a numeric needs a precision of at most 38 and a scale "
                "between 0 and the precision)")
        # The catalog would refuse it (InvalidCatalogArgument), and the connector would
        # then retry the same transaction forever: stop here, with the reason, instead.
        try:
            check_name("column", col.name)
            check_column_type(col.fits[0])
        except InvalidCatalogArgument as e:
            raise UnsupportedSchemaChange(
                f"{where}: new column {col.name!r} cannot be a Retina column: {e}") from None
    return [(c.name, c.fits[0]) for c in added]


def evolve(schema: SourceSchema, table: TableRecord,
           add_column: Callable[[str, str, str, str], TableRecord]) -> TableRecord:
    """Bring ``table`` to ``schema`` (see :func:`plan`); returns the table as committed."""
    for name, type_name in plan(schema, table):
        table = add_column(table.schema_name, table.name, name, type_name)
        COLUMNS_ADDED.inc()
        log.info("cdc_schema_column_added", table=f"{table.schema_name}.{table.name}",
                 source_table=schema.table, column=name, type=type_name,
                 schema_version=table.schema_version)
    return table


def pg_source_schema(relation: Any, dsn: str) -> SourceSchema:
    """A pgoutput Relation message (cdc_client.sources.postgres.Relation) as a SourceSchema.
    With REPLICA IDENTITY FULL or USING INDEX the key flags are not the primary key."""
    columns = tuple(SourceColumn(c.name, pg_type_name(c.type_oid, c.type_modifier),
                                 pg_column_fits(c.type_oid, c.type_modifier), c.is_key)
                    for c in relation.columns)
    return SourceSchema(relation.table, columns, relation.replica_identity == "d",
                        functools.partial(pg_column_facts, dsn, relation.oid))
