"""The random source workload. The source PostgreSQL database is the model: the
campaign never keeps its own copy of the expected rows, it compares with the source.

Every statement is derived from the episode's ``random.Random`` only (keys are drawn
from small bounded key spaces, so deletes, key reuse and primary-key changes happen
naturally, without reading the source first): one episode replayed alone runs the
same statements, though on a source whose earlier history may differ.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import psycopg2
import psycopg2.extras

from devtools.cluster import PostgresInstance
from retina_common.catalog import Catalog, ColumnSpec
from retina_common.topology import Topology

SOURCE_DB = "chaos_source"
SCHEMA = "chaos"
# A Retina-only table for malformed-key probes: the connector never writes it and the
# comparison never reads it, so a malformed request that is wrongly accepted cannot
# disturb the tables the campaign compares.
PROBE_TABLE = "probe"

Key = tuple[Any, ...]
Row = tuple[Any, ...]


@dataclass(frozen=True)
class TableSpec:
    name: str
    columns: tuple[ColumnSpec, ...]
    pg_types: tuple[str, ...]
    pk: tuple[str, ...]
    key: Callable[[random.Random], Key]
    values: Callable[[random.Random], Row]  # the non-key columns
    # Cold tables are not written for long stretches: cold while (episode // period) % 3
    # is not 0, so for 2 * period episodes in a row, then hot again for period episodes.
    cold_period: int = 0

    @property
    def value_columns(self) -> tuple[str, ...]:
        return tuple(c.name for c in self.columns if c.name not in self.pk)

    def ddl(self) -> str:
        cols = ", ".join(f"{c.name} {t}" for c, t in zip(self.columns, self.pg_types,
                                                         strict=True))
        return f"CREATE TABLE public.{self.name} ({cols}, PRIMARY KEY ({', '.join(self.pk)}))"

    def hot(self, episode: int) -> bool:
        return not self.cold_period or (episode // self.cold_period) % 3 == 0


def _text(rng: random.Random) -> str | None:
    return None if rng.random() < 0.1 else f"v{rng.randint(0, 10**6)}"


TABLES: tuple[TableSpec, ...] = (
    TableSpec("accounts", (ColumnSpec("id", "int64"), ColumnSpec("owner", "string"),
                           ColumnSpec("balance", "int64"), ColumnSpec("vip", "boolean")),
              ("int8", "text", "int8", "bool"), ("id",),
              lambda r: (r.randint(1, 3000),),
              lambda r: (_text(r), r.randint(-10**9, 10**9), r.random() < 0.3)),
    TableSpec("lines", (ColumnSpec("order_id", "int64"), ColumnSpec("line", "int32"),
                        ColumnSpec("sku", "string"), ColumnSpec("qty", "int32")),
              ("int8", "int4", "text", "int4"), ("order_id", "line"),
              lambda r: (r.randint(1, 400), r.randint(1, 8)),
              lambda r: (f"sku-{r.randint(1, 999)}", r.randint(1, 50))),
    TableSpec("tags", (ColumnSpec("name", "string"), ColumnSpec("weight", "int32"),
                       ColumnSpec("note", "string")),
              ("text", "int4", "text"), ("name",),
              lambda r: (f"tag-{r.randint(1, 600)}",),
              lambda r: (r.randint(0, 1000), _text(r)), cold_period=5),
    TableSpec("ledger", (ColumnSpec("id", "int64"), ColumnSpec("amount", "int64"),
                         ColumnSpec("memo", "string")),
              ("int8", "int8", "text"), ("id",),
              lambda r: (r.randint(1, 2000),),
              lambda r: (r.randint(0, 10**7), _text(r)), cold_period=7),
    TableSpec("kv", (ColumnSpec("tenant", "int32"), ColumnSpec("k", "string"),
                     ColumnSpec("payload", "binary")),
              ("int4", "text", "bytea"), ("tenant", "k"),
              lambda r: (r.randint(1, 4), f"k{r.randint(1, 250)}"),
              lambda r: (None if r.random() < 0.1 else r.randbytes(r.randint(0, 16)),),
              cold_period=11),
)
BY_NAME = {t.name: t for t in TABLES}
# The last source transaction of every episode writes this table (replicated, never
# compared): its commit LSN tells when the connector has caught up with the source.
MARKER = TableSpec("marker", (ColumnSpec("id", "int32"), ColumnSpec("episode", "int64")),
                   ("int4", "int8"), ("id",), lambda r: (1,), lambda r: (0,))
REPLICATED = (*TABLES, MARKER)


def create_source(pg: PostgresInstance) -> str:
    """Create the source database and its tables; returns its DSN."""
    pg.create_database(SOURCE_DB)
    dsn = pg.dsn(SOURCE_DB)
    conn = psycopg2.connect(dsn)
    try:
        with conn, conn.cursor() as cur:
            for table in REPLICATED:
                cur.execute(table.ddl())
    finally:
        conn.close()
    return dsn


def create_tables(catalog: Catalog, topology: Topology) -> None:
    """The Retina schema: one table per source table, plus the probe table."""
    del topology  # routing needs no catalog state; kept for symmetry with the callers
    catalog.create_schema(SCHEMA)
    for table in REPLICATED:
        catalog.create_table(SCHEMA, table.name, table.columns, table.pk)
    catalog.create_table(SCHEMA, PROBE_TABLE, [ColumnSpec("id", "int64"),
                                               ColumnSpec("v", "string")], ["id"])


def _where(table: TableSpec, prefix: str = "") -> str:
    return " AND ".join(f"{prefix}{c} = %s" for c in table.pk)


def upsert(cur: Any, table: TableSpec, rows: list[Row]) -> None:
    """INSERT ... ON CONFLICT DO UPDATE: an insert, or an update of an existing key."""
    unique = list({row[:len(table.pk)]: row for row in rows}.values())
    cols = [c.name for c in table.columns]
    sets = ", ".join(f"{c} = EXCLUDED.{c}" for c in table.value_columns)
    psycopg2.extras.execute_values(
        cur, f"INSERT INTO public.{table.name} ({', '.join(cols)}) VALUES %s "
             f"ON CONFLICT ({', '.join(table.pk)}) DO UPDATE SET {sets}", unique)


def one_change(cur: Any, table: TableSpec, rng: random.Random) -> str:
    """One random change of ``table``; returns its kind (for the statistics)."""
    choice = rng.random()
    key = table.key(rng)
    if choice < 0.4:
        upsert(cur, table, [key + table.values(rng) for _ in range(1)])
        return "upsert"
    if choice < 0.6:
        col = rng.choice(table.value_columns)
        value = table.values(rng)[table.value_columns.index(col)]
        cur.execute(f"UPDATE public.{table.name} SET {col} = %s WHERE {_where(table)}",
                    (value, *key))
        return "update"
    if choice < 0.72:  # a primary-key change, only onto a free key
        new = table.key(rng)
        sets = ", ".join(f"{c} = %s" for c in table.pk)
        cur.execute(f"UPDATE public.{table.name} SET {sets} WHERE {_where(table)} AND NOT "
                    f"EXISTS (SELECT 1 FROM public.{table.name} WHERE {_where(table)})",
                    (*new, *key, *new))
        return "pk_change"
    if choice < 0.95:
        cur.execute(f"DELETE FROM public.{table.name} WHERE {_where(table)}", key)
        return "delete"
    # several rows at once: every row sharing the first key column
    cur.execute(f"DELETE FROM public.{table.name} WHERE {table.pk[0]} = %s", key[:1])
    return "delete_many"


def change_key(cur: Any, table: TableSpec, key: Key, rng: random.Random) -> str:
    """A change of one given key (a row a GC rewrite is moving): mostly a delete, else an
    update of a value column or a replace. The row may be gone already: then a no-op or
    a re-insert, both fine (the source stays the model)."""
    choice = rng.random()
    if choice < 0.6:
        cur.execute(f"DELETE FROM public.{table.name} WHERE {_where(table)}", key)
        return "delete"
    if choice < 0.85:
        col = rng.choice(table.value_columns)
        value = table.values(rng)[table.value_columns.index(col)]
        cur.execute(f"UPDATE public.{table.name} SET {col} = %s WHERE {_where(table)}",
                    (value, *key))
        return "update"
    upsert(cur, table, [tuple(key) + table.values(rng)])
    return "upsert"


def transaction(conn: Any, rng: random.Random, episode: int) -> int:
    """One source transaction over one to three hot tables; returns statements run."""
    hot = [t for t in TABLES if t.hot(episode)]
    tables = rng.sample(hot, k=min(len(hot), rng.choice([1, 1, 2, 3])))
    statements = 0
    with conn, conn.cursor() as cur:
        if rng.random() < 0.08:  # a large transaction: hundreds of rows
            big = rng.choice(tables)
            upsert(cur, big, [big.key(rng) + big.values(rng)
                              for _ in range(rng.randint(150, 400))])
            statements += 1
        for table in tables:
            for _ in range(rng.choice([1, 1, 2, 4, 8])):
                one_change(cur, table, rng)
                statements += 1
    return statements


def step(conn: Any, rng: random.Random, episode: int) -> int:
    """A small burst of source transactions; returns how many were committed."""
    count = rng.randint(1, 5)
    for _ in range(count):
        transaction(conn, rng, episode)
    return count


def mark(conn: Any, episode: int) -> int:
    """Write the marker; returns the WAL insert position read before its commit."""
    with conn, conn.cursor() as cur:
        upsert(cur, MARKER, [(1, episode)])
        cur.execute("SELECT pg_current_wal_insert_lsn() - '0/0'::pg_lsn")
        return int(cur.fetchone()[0])


def source_rows(conn: Any, table: TableSpec) -> dict[Key, Row]:
    """The model: the source table, keyed by primary key, values normalised."""
    cols = [c.name for c in table.columns]
    with conn, conn.cursor() as cur:
        cur.execute(f"SELECT {', '.join(cols)} FROM public.{table.name}")
        rows = [normalise(r) for r in cur.fetchall()]
    width = len(table.pk)
    return {r[:width]: r for r in rows}


def normalise(row: tuple[Any, ...]) -> Row:
    return tuple(bytes(v) if isinstance(v, memoryview | bytearray) else v for v in row)
