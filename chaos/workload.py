"""The random source workload. The source PostgreSQL database is the model: the
campaign never keeps its own copy of these tables' expected rows, it compares with the
source. (The wide table two routed source tables fill is the exception: chaos/wide.py
keeps its model, since a delete from one source removes the other's columns too.)

Every statement is derived from the episode's ``random.Random`` and the source's current
columns only (keys are drawn from small bounded key spaces, so deletes, key reuse and
primary-key changes happen naturally, without reading the source's rows first): one
episode replayed alone runs the same statements, though on a source whose earlier history
(its rows, the columns added so far) may differ.

Besides row changes, the workload exercises the connector's other write paths: a rare
TRUNCATE, a rare nullable ``ALTER TABLE ... ADD COLUMN`` (the connector evolves the Retina
table), a TOASTed column that most updates leave unchanged, and rows that exist before
the connector first starts (its initial snapshot).
"""

from __future__ import annotations

import dataclasses
import datetime
import random
from collections import Counter, defaultdict
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

# Types of the columns the workload adds (nullable, no default: the only kind the connector
# follows), by their format_type() name, with the values it writes into them.
ADDED_TYPES: dict[str, Callable[[random.Random], Any]] = {
    "integer": lambda r: r.randint(-10**6, 10**6),
    "bigint": lambda r: r.randint(-10**15, 10**15),
    "text": lambda r: f"a{r.randint(0, 10**6)}",
    "boolean": lambda r: r.random() < 0.5,
    # eighths: exact in binary, so the text pgoutput sends parses back to the same float
    "double precision": lambda r: r.randint(-10**6, 10**6) / 8,
    "date": lambda r: datetime.date(2000, 1, 1) + datetime.timedelta(days=r.randint(0, 20000)),
}
# Added columns per table and cluster: a few schema versions, not a table that keeps growing.
MAX_ADDED = 3
# Per source transaction of a step: a TRUNCATE, an ADD COLUMN (both rare: a TRUNCATE empties
# a table the comparison then checks, a column stays for the cluster's lifetime).
TRUNCATE_P = 0.005
ADD_COLUMN_P = 0.005
# TOASTed values: > 2 kB, stored out of line without compression (SET STORAGE EXTERNAL).
TOAST_BYTES = (4096, 8192)


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
    # A large text column stored out of line (TOAST); ``values`` does not produce it: some
    # writes set it, most updates leave it unchanged (pgoutput then omits it).
    toast: str = ""
    # Columns added at the source (name, format_type), in order: read from the source by
    # ``current_tables``; the Retina table gets them from the connector, not from here.
    added: tuple[tuple[str, str], ...] = ()

    @property
    def value_columns(self) -> tuple[str, ...]:
        """The non-key columns ``values`` produces."""
        return tuple(c.name for c in self.columns if c.name not in self.pk
                     and c.name != self.toast)

    @property
    def written_columns(self) -> tuple[str, ...]:
        return (*self.pk, *self.value_columns)

    @property
    def optional_columns(self) -> tuple[str, ...]:
        """Columns only some writes set: the TOAST column and the added ones."""
        return ((self.toast,) if self.toast else ()) + tuple(n for n, _ in self.added)

    @property
    def all_columns(self) -> tuple[str, ...]:
        """Every column the source table has now, in order (what the comparison reads)."""
        return (*(c.name for c in self.columns), *(n for n, _ in self.added))

    def optional_value(self, column: str, rng: random.Random) -> Any:
        if rng.random() < 0.1:
            return None
        if column == self.toast:
            size = rng.randint(*TOAST_BYTES)
            return (f"doc{rng.randint(0, 10**6)}:" * (size // 4))[:size]
        return ADDED_TYPES[dict(self.added)[column]](rng)

    def ddl(self) -> list[str]:
        cols = ", ".join(f"{c.name} {t}" for c, t in zip(self.columns, self.pg_types,
                                                         strict=True))
        statements = [f"CREATE TABLE public.{self.name} ({cols}, "
                      f"PRIMARY KEY ({', '.join(self.pk)}))"]
        if self.toast:  # out of line and uncompressed: every value > 2 kB is TOASTed
            statements.append(f"ALTER TABLE public.{self.name} ALTER COLUMN {self.toast} "
                              "SET STORAGE EXTERNAL")
        return statements

    def hot(self, episode: int) -> bool:
        return not self.cold_period or (episode // self.cold_period) % 3 == 0


def _text(rng: random.Random) -> str | None:
    return None if rng.random() < 0.1 else f"v{rng.randint(0, 10**6)}"


TABLES: tuple[TableSpec, ...] = (
    TableSpec("accounts", (ColumnSpec("id", "int64"), ColumnSpec("owner", "string"),
                           ColumnSpec("balance", "int64"), ColumnSpec("vip", "boolean"),
                           ColumnSpec("doc", "string")),
              ("int8", "text", "int8", "bool", "text"), ("id",),
              lambda r: (r.randint(1, 3000),),
              lambda r: (_text(r), r.randint(-10**9, 10**9), r.random() < 0.3),
              toast="doc"),
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
# The application writer's table (chaos/app_workload.py): written only by the campaign's
# own DurableWriter process, never by the connector (no source table), and compared with
# that writer's model instead of the source. Upserts and deletes of keys drawn from a
# small key space, so keys are reused after deletes.
APP_TABLE = TableSpec("app_items", (ColumnSpec("tenant", "int32"), ColumnSpec("item", "int64"),
                                    ColumnSpec("label", "string"), ColumnSpec("amount", "int64"),
                                    ColumnSpec("ok", "boolean")),
                      ("int4", "int8", "text", "int8", "bool"), ("tenant", "item"),
                      lambda r: (r.randint(1, 3), r.randint(1, 200)),
                      lambda r: (_text(r), r.randint(-10**9, 10**9), r.random() < 0.5))
# The bulk loader's table (chaos/bulk_loads.py): chunks of new keys loaded through
# retina_common.bulk_loader, compared with the loader's model instead of the source.
LOADED_TABLE = TableSpec("loaded_items", (ColumnSpec("id", "int64"),
                                          ColumnSpec("label", "string"),
                                          ColumnSpec("amount", "int64")),
                         ("int8", "text", "int8"), ("id",),
                         lambda r: (r.randint(1, 10**12),),
                         lambda r: (f"l{r.randint(0, 10**6)}", r.randint(-10**9, 10**9)))
# The wide table (chaos/wide.py): one Retina table fed by two source tables through the
# connector's [[cdc.routes]] (public.wide_orders sets customer, and amount from its column
# total; public.wide_payments sets paid and method), compared with a model of their
# committed transactions instead of a source table of its own. Its ``values`` are not
# used: chaos/wide.py draws each source's own.
WIDE_KEYS = (1, 240)
WIDE_TABLE = TableSpec("wide", (ColumnSpec("id", "int64"), ColumnSpec("customer", "string"),
                                ColumnSpec("amount", "decimal(12,2)"),
                                ColumnSpec("paid", "decimal(12,2)"),
                                ColumnSpec("method", "string")),
                       ("int8", "text", "numeric(12,2)", "numeric(12,2)", "text"), ("id",),
                       lambda r: (r.randint(*WIDE_KEYS),),
                       lambda r: (_text(r), None, None, _text(r)))
# The last source transaction of every episode writes this table (replicated, never
# compared): its commit LSN tells when the connector has caught up with the source.
MARKER = TableSpec("marker", (ColumnSpec("id", "int32"), ColumnSpec("episode", "int64")),
                   ("int4", "int8"), ("id",), lambda r: (1,), lambda r: (0,))
REPLICATED = (*TABLES, MARKER)


# Rows each table holds before the connector first starts (its initial snapshot loads
# them), from a fixed stream: the campaign's seeded draws do not depend on them.
PRELOADED_ROWS = (20, 120)


def create_source(pg: PostgresInstance) -> str:
    """Create the source database and its tables, with some rows already in them (the
    connector's initial snapshot loads those); returns its DSN."""
    pg.create_database(SOURCE_DB)
    dsn = pg.dsn(SOURCE_DB)
    populate_source(dsn)
    return dsn


def populate_source(dsn: str) -> None:
    """The source tables (and the TOAST column's storage), with their preloaded rows."""
    conn = psycopg2.connect(dsn)
    rng = random.Random(0x5EED)
    try:
        with conn, conn.cursor() as cur:
            for table in REPLICATED:
                for statement in table.ddl():
                    cur.execute(statement)
            for table in TABLES:
                rows = [_full_row(table, rng) for _ in range(rng.randint(*PRELOADED_ROWS))]
                upsert(cur, table, rows, table.written_columns + table.optional_columns)
    finally:
        conn.close()


def _full_row(table: TableSpec, rng: random.Random) -> Row:
    return (table.key(rng) + table.values(rng)
            + tuple(table.optional_value(c, rng) for c in table.optional_columns))


def current_tables(conn: Any) -> tuple[TableSpec, ...]:
    """The compared tables with the columns the source has added to them since (the source
    is the model: a column whose ALTER committed although the client saw an error, in a
    source outage, is there all the same)."""
    with conn, conn.cursor() as cur:
        cur.execute("SELECT c.relname, a.attname, format_type(a.atttypid, a.atttypmod) "
                    "FROM pg_attribute a JOIN pg_class c ON c.oid = a.attrelid "
                    "JOIN pg_namespace n ON n.oid = c.relnamespace "
                    "WHERE n.nspname = 'public' AND c.relname = ANY(%s) AND a.attnum > 0 "
                    "AND NOT a.attisdropped ORDER BY c.relname, a.attnum",
                    ([t.name for t in TABLES],))
        found = cur.fetchall()
    added: dict[str, list[tuple[str, str]]] = defaultdict(list)
    for relname, column, type_name in found:
        if column not in {c.name for c in BY_NAME[relname].columns}:
            added[relname].append((column, type_name))
    return tuple(dataclasses.replace(t, added=tuple(added[t.name])) for t in TABLES)


def create_tables(catalog: Catalog, topology: Topology) -> None:
    """The Retina schema: one table per source table, the wide table the two routed
    source tables fill, the application writer's table and the probe table."""
    del topology  # routing needs no catalog state; kept for symmetry with the callers
    catalog.create_schema(SCHEMA)
    for table in (*REPLICATED, WIDE_TABLE, APP_TABLE, LOADED_TABLE):
        catalog.create_table(SCHEMA, table.name, table.columns, table.pk)
    catalog.create_table(SCHEMA, PROBE_TABLE, [ColumnSpec("id", "int64"),
                                               ColumnSpec("v", "string")], ["id"])


def _where(table: TableSpec, prefix: str = "") -> str:
    return " AND ".join(f"{prefix}{c} = %s" for c in table.pk)


def upsert(cur: Any, table: TableSpec, rows: list[Row],
           cols: tuple[str, ...] | None = None) -> None:
    """INSERT ... ON CONFLICT DO UPDATE: an insert, or an update of an existing key. Rows
    hold ``cols`` (default: the key and ``values``' columns); a column left out keeps its
    value on an update (a TOASTed one is then not in the WAL) and is NULL on an insert."""
    unique = list({row[:len(table.pk)]: row for row in rows}.values())
    cols = cols or table.written_columns
    sets = ", ".join(f"{c} = EXCLUDED.{c}" for c in cols if c not in table.pk)
    psycopg2.extras.execute_values(
        cur, f"INSERT INTO public.{table.name} ({', '.join(cols)}) VALUES %s "
             f"ON CONFLICT ({', '.join(table.pk)}) DO UPDATE SET {sets}", unique)


def one_change(cur: Any, table: TableSpec, rng: random.Random) -> str:
    """One random change of ``table``; returns its kind (for the statistics)."""
    choice = rng.random()
    key = table.key(rng)
    if choice < 0.4:
        # The optional columns (TOAST, added) each half of the time: left out, an existing
        # row keeps its value.
        extra = tuple(c for c in table.optional_columns if rng.random() < 0.5)
        row = key + table.values(rng) + tuple(table.optional_value(c, rng) for c in extra)
        upsert(cur, table, [row], table.written_columns + extra)
        return "upsert" if not table.toast or table.toast in extra else "upsert_toast_kept"
    if choice < 0.6:
        col = rng.choice(table.value_columns + table.optional_columns)
        if col in table.value_columns:
            value = table.values(rng)[table.value_columns.index(col)]
        else:
            value = table.optional_value(col, rng)
        cur.execute(f"UPDATE public.{table.name} SET {col} = %s WHERE {_where(table)}",
                    (value, *key))
        return "update" if not table.toast or col == table.toast else "update_toast_kept"
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


def transaction(conn: Any, rng: random.Random, episode: int,
                tables: tuple[TableSpec, ...] = TABLES, counts: Counter[str] | None = None,
                ) -> int:
    """One source transaction over one to three hot tables; returns statements run."""
    hot = [t for t in tables if t.hot(episode)]
    chosen = rng.sample(hot, k=min(len(hot), rng.choice([1, 1, 2, 3])))
    statements = 0
    kinds: Counter[str] = Counter()
    with conn, conn.cursor() as cur:
        if rng.random() < 0.08:  # a large transaction: hundreds of rows
            big = rng.choice(chosen)
            # The key and values columns only: existing rows keep their TOASTed and added
            # values (a TOASTed one is then missing from each of those WAL records).
            upsert(cur, big, [big.key(rng) + big.values(rng)
                              for _ in range(rng.randint(150, 400))])
            statements += 1
        for table in chosen:
            for _ in range(rng.choice([1, 1, 2, 4, 8])):
                kinds[one_change(cur, table, rng)] += 1
                statements += 1
    if counts is not None:  # committed
        counts.update(k for k in kinds.elements() if k.endswith("_toast_kept"))
    return statements


def truncate(conn: Any, rng: random.Random, episode: int, tables: tuple[TableSpec, ...],
             counts: Counter[str] | None = None) -> str:
    """A TRUNCATE of one table (a cold one when there is one: it stays empty for a
    while), in its own transaction, half of the time followed there by inserts."""
    cold = [t for t in tables if not t.hot(episode)]
    table = rng.choice(cold or list(tables))
    refill = rng.random() < 0.5
    with conn, conn.cursor() as cur:
        cur.execute(f"TRUNCATE public.{table.name}")
        if refill:  # rows written after the TRUNCATE, at its timestamp, must survive it
            upsert(cur, table, [table.key(rng) + table.values(rng)
                                for _ in range(rng.randint(1, 20))])
    if counts is not None:
        counts["truncates" if not refill else "truncates_refilled"] += 1
    return table.name


def add_column(conn: Any, rng: random.Random, episode: int,
               tables: tuple[TableSpec, ...] | None = None,
               counts: Counter[str] | None = None) -> str:
    """``ALTER TABLE ... ADD COLUMN`` (nullable, no default) on a table with fewer than
    MAX_ADDED added columns (a hot one if any), then a write that sets the new column, in
    the same transaction or the next: the connector sees the new column in the Relation
    message of that write and adds it to the Retina table. Returns "table.column", or ""
    when every table has its MAX_ADDED columns already."""
    tables = tables if tables is not None else current_tables(conn)
    open_ = [t for t in tables if len(t.added) < MAX_ADDED]
    if not open_:
        return ""
    table = rng.choice([t for t in open_ if t.hot(episode)] or open_)
    column, type_name = f"x{len(table.added) + 1}", rng.choice(sorted(ADDED_TYPES))
    widened = dataclasses.replace(table, added=(*table.added, (column, type_name)))
    same = rng.random() < 0.5
    with conn, conn.cursor() as cur:
        cur.execute(f"ALTER TABLE public.{table.name} ADD COLUMN {column} {type_name}")
        if same:
            _write_new_column(cur, widened, column, rng)
    if not same:
        with conn, conn.cursor() as cur:
            _write_new_column(cur, widened, column, rng)
    if counts is not None:
        counts["columns_added"] += 1
    return f"{table.name}.{column} {type_name}"


def _write_new_column(cur: Any, table: TableSpec, column: str, rng: random.Random) -> None:
    # An upsert always writes a row, so the connector gets the new Relation now.
    row = table.key(rng) + table.values(rng) + (ADDED_TYPES[dict(table.added)[column]](rng),)
    upsert(cur, table, [row], (*table.written_columns, column))
    for _ in range(rng.randint(0, 4)):
        one_change(cur, table, rng)


def step(conn: Any, rng: random.Random, episode: int,
         counts: Counter[str] | None = None) -> int:
    """A small burst of source transactions; returns how many were committed. Now and
    then one of them is a TRUNCATE or an ADD COLUMN instead."""
    tables = current_tables(conn)
    count = rng.randint(1, 5)
    for _ in range(count):
        draw = rng.random()
        if draw < TRUNCATE_P:
            truncate(conn, rng, episode, tables, counts)
        elif draw < TRUNCATE_P + ADD_COLUMN_P and add_column(conn, rng, episode, tables,
                                                             counts):
            tables = current_tables(conn)
        else:
            transaction(conn, rng, episode, tables, counts)
    return count


def mark(conn: Any, episode: int) -> int:
    """Write the marker; returns the WAL insert position read before its commit."""
    with conn, conn.cursor() as cur:
        upsert(cur, MARKER, [(1, episode)])
        cur.execute("SELECT pg_current_wal_insert_lsn() - '0/0'::pg_lsn")
        return int(cur.fetchone()[0])


def source_rows(conn: Any, table: TableSpec) -> dict[Key, Row]:
    """The model: the source table, keyed by primary key, values normalised; ``table``
    from ``current_tables`` (every column, the added ones too)."""
    with conn, conn.cursor() as cur:
        cur.execute(f"SELECT {', '.join(table.all_columns)} FROM public.{table.name}")
        rows = [normalise(r) for r in cur.fetchall()]
    width = len(table.pk)
    return {r[:width]: r for r in rows}


def normalise(row: tuple[Any, ...]) -> Row:
    return tuple(bytes(v) if isinstance(v, memoryview | bytearray) else v for v in row)
