"""The wide table: one Retina table fed by two source tables through ``[[cdc.routes]]``.

Two source tables keyed alike, ``public.wide_orders(id, customer, total)`` and
``public.wide_payments(id, paid, method)``, are routed into the one Retina table
``chaos.wide`` (``workload.WIDE_TABLE``: id, customer, amount, paid, method; every column
nullable but the key). The orders route renames ``total`` to ``amount`` (its columns are a
table in the config), the payments route keeps its names (a list). The connector turns a
routed INSERT or UPDATE into a partial update of the route's columns, a routed DELETE
into a delete of the whole target row and a routed TRUNCATE into a TRUNCATE of the target
(docs/cdc.md, docs/encoding.md "Partial updates").

**The model.** The wide table is not a function of the sources' final state (a payment's
delete removes the whole row, its order's columns too, while the order stays in the
source), so the campaign keeps a model of it (``WideModel``, a ``compare.ModelTable``):
every source transaction that writes these tables records the effects its statements
had, read back with ``RETURNING`` (the rows the statement really wrote or deleted: an
UPDATE or DELETE of a missing key has none, and so sends nothing to the connector), and
the model applies each committed transaction's effects in commit order:

* an **upsert** of a route (an INSERT, or an UPDATE, which pgoutput sends with the whole
  new source row) sets the route's columns of the key's row, on its current row or on an
  all-NULL one;
* a **delete** of either source (also the old key of a primary-key change) removes the row;
* a **TRUNCATE** of either source empties the table.

The campaign's workload runs one statement at a time on one connection, so the commit
order is the order the campaign committed them. A transaction that failed before its
COMMIT was sent committed nothing. One whose COMMIT failed (the PostgreSQL fault's
immediate stop, which runs while ``WideWorkload.burst`` commits one transaction after
another, cuts one off now and then) is **unknown**: the model keeps it, with every later
transaction, in a queue until ``txid_status`` of its transaction id (read before its
first statement) says, once the source answers again, whether it committed; the queue is
resolved before every step and every comparison. A comparison while the source cannot
say is not made (``expected`` raises, ``compare.compare_once`` reports an error and is
polled again); one the source calls still in progress leaves each key the unknown
transactions touch allowed any row one combination of their outcomes gives (``either``).

**Before the connector's first commit** the sources are not written (``WideWorkload.step``
asks ``ready``): a connector killed before its initial snapshot's first chunk committed
takes a new snapshot of the sources, and a snapshot of a wide table fed by two sources
is the two tables joined, not their history (a row a payment's delete removed would come
back with its order's columns). Once a chunk committed, the snapshot's consistent point
is fixed: a resumed snapshot reads newer rows, but the stream from that point applies
every later change again over them, so the table ends as the history says. The rows the
sources hold before the connector first starts are inserts only, so the model starts from
the two tables joined (``joined_rows``).

The workload (``plan_transaction``, its own random stream per episode, ``WIDE_STREAM``):
upserts, inserts and one-column updates of either source, a transaction writing both for
the same id, a payment for an id that has no order, deletes from either (one key or a
range), primary-key changes, a delete and a write of the same id in one transaction, now
and then a large transaction (more upserts than the connector encodes row by row) or a
TRUNCATE of one source, half of the time followed by writes in its transaction.
"""

from __future__ import annotations

import contextlib
import random
import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any

import psycopg2
import psycopg2.extras

from .workload import WIDE_KEYS, WIDE_TABLE, Key, Row, normalise

# The episode's stream for the wide table's transactions: random.Random(seed ^ this).
WIDE_STREAM = 0x71DE
# Rows each source holds before the connector first starts, from a fixed stream.
PRELOADED_ROWS = (30, 70)
TRUNCATE_P = 0.02
LARGE_P = 0.05
# A large transaction's upserts: more than translate.COLUMNAR_MIN_UPSERTS (64), so the
# connector tries its column-wise encoding on rows that name only some of the columns.
LARGE_ROWS = (70, 160)
# A burst of transactions while PostgreSQL is being stopped lasts at most this long.
BURST_S = 15.0
# Unknown transactions left unresolved at a comparison: every combination of their
# outcomes is allowed, up to this many of them (more: the comparison is not made).
MAX_UNRESOLVED = 6
METHODS = ("card", "cash", "wire", "voucher")


@dataclass(frozen=True)
class Route:
    """One ``[[cdc.routes]]`` entry: a source table onto ``WIDE_TABLE``."""

    source: str  # in schema public
    columns: tuple[tuple[str, str], ...]  # (source column, target column), the key first
    pg_types: tuple[str, ...]  # of the source columns
    values: Callable[[random.Random], tuple[Any, ...]]  # the non-key source values

    @property
    def source_columns(self) -> tuple[str, ...]:
        return tuple(s for s, _t in self.columns)

    @property
    def value_columns(self) -> tuple[str, ...]:
        return self.source_columns[1:]

    @property
    def targets(self) -> tuple[str, ...]:
        """The target columns it sets besides the key."""
        return tuple(t for _s, t in self.columns[1:])

    def ddl(self) -> str:
        cols = ", ".join(f"{c} {t}" for c, t in zip(self.source_columns, self.pg_types,
                                                     strict=True))
        return f"CREATE TABLE public.{self.source} ({cols}, PRIMARY KEY (id))"

    def toml(self, target: str) -> str:
        """The route as the connector's config file holds it: a list of column names
        when they are the same on both sides, else a table source = target."""
        if all(s == t for s, t in self.columns):
            columns = "[" + ", ".join(f'"{s}"' for s in self.source_columns) + "]"
        else:
            columns = "{ " + ", ".join(f'{s} = "{t}"' for s, t in self.columns) + " }"
        return (f'[[cdc.routes]]\nsource = "public.{self.source}"\ntarget = "{target}"\n'
                f"columns = {columns}\n")

    def row(self, rng: random.Random, key: int | None = None) -> tuple[Any, ...]:
        return (wide_key(rng) if key is None else key, *self.values(rng))


def wide_key(rng: random.Random) -> int:
    return rng.randint(*WIDE_KEYS)


def _money(rng: random.Random) -> Decimal | None:
    return None if rng.random() < 0.1 else Decimal(rng.randint(-10**8, 10**8)).scaleb(-2)


def _customer(rng: random.Random) -> str | None:
    return None if rng.random() < 0.1 else f"c{rng.randint(0, 10**6)}"


def _method(rng: random.Random) -> str | None:
    return None if rng.random() < 0.1 else rng.choice(METHODS)


ORDERS = Route("wide_orders", (("id", "id"), ("customer", "customer"), ("total", "amount")),
               ("int8", "text", "numeric(12,2)"), lambda r: (_customer(r), _money(r)))
PAYMENTS = Route("wide_payments", (("id", "id"), ("paid", "paid"), ("method", "method")),
                 ("int8", "numeric(12,2)", "text"), lambda r: (_money(r), _method(r)))
ROUTES = (ORDERS, PAYMENTS)
BY_SOURCE = {r.source: r for r in ROUTES}
SOURCE_TABLES = tuple(f"public.{r.source}" for r in ROUTES)
# Where each route's target columns are in a row of WIDE_TABLE.
_COLUMNS = tuple(c.name for c in WIDE_TABLE.columns)
_AT = {r.source: tuple(_COLUMNS.index(t) for t in r.targets) for r in ROUTES}


def routes_toml() -> str:
    """The ``[[cdc.routes]]`` entries of the connector's config file (routes cannot be
    set through RETINA__ environment overrides)."""
    return "\n" + "\n".join(r.toml(WIDE_TABLE.name) for r in ROUTES)


# --- effects and the model ------------------------------------------------------------------
@dataclass(frozen=True)
class Upsert:
    """A route's row written (inserted or updated): ``values`` are its target columns'."""

    route: str
    key: int
    values: tuple[Any, ...]


@dataclass(frozen=True)
class Delete:
    """A row of ``route`` deleted (or moved off ``key`` by a primary-key change)."""

    route: str
    key: int


@dataclass(frozen=True)
class Truncate:
    route: str


Effect = Upsert | Delete | Truncate


def apply_effects(rows: dict[Key, Row], effects: Iterable[Effect],
                  counts: Counter[str] | None = None) -> None:
    """The wide table's semantics (module docstring), in order, onto ``rows``."""
    for effect in effects:
        if isinstance(effect, Truncate):
            rows.clear()
            continue
        key = (effect.key,)
        row = rows.get(key)
        if isinstance(effect, Delete):
            if row is not None and counts is not None:
                # The row held the other source's columns too: all of them go.
                other = [i for r, at in _AT.items() if r != effect.route for i in at]
                if any(row[i] is not None for i in other):
                    counts["deleted_with_other_columns"] += 1
            rows.pop(key, None)
            continue
        values = list(row) if row is not None else [effect.key, *([None] * (len(_COLUMNS) - 1))]
        if counts is not None:
            counts["rows_created" if row is None else "rows_merged"] += 1
        for i, value in zip(_AT[effect.route], effect.values, strict=True):
            values[i] = value
        rows[key] = normalise(tuple(values))


@dataclass(frozen=True)
class WideTxn:
    """A source transaction's effects; ``known`` False: its commit's outcome is not known
    yet (its transaction id ``xid`` tells, through txid_status)."""

    effects: tuple[Effect, ...]
    xid: int = 0
    known: bool = True


class WideModel:
    """The expected rows of the wide table (module docstring); a ``compare.ModelTable``.
    ``status``: txid_status of a transaction id at the source ("committed", "aborted",
    "in progress", None), raising psycopg2.Error when the source does not answer."""

    table = WIDE_TABLE

    def __init__(self, status: Callable[[int], str | None] | None = None,
                 counts: Counter[str] | None = None) -> None:
        self.status = status
        self.counts: Counter[str] = counts if counts is not None else Counter()
        self.rows: dict[Key, Row] = {}
        # Transactions from the oldest unknown one on, in commit order.
        self.queue: list[WideTxn] = []

    def start(self, rows: dict[Key, Row]) -> None:
        """The rows the sources held before anything else wrote them (their join)."""
        self.rows = dict(rows)
        self.queue = []

    def committed(self, effects: Sequence[Effect]) -> None:
        if self.queue:  # after an unknown one: applied once that one is resolved
            self.queue.append(WideTxn(tuple(effects)))
        else:
            apply_effects(self.rows, effects, self.counts)

    def unknown(self, xid: int, effects: Sequence[Effect]) -> None:
        self.counts["commit_unknown"] += 1
        self.queue.append(WideTxn(tuple(effects), xid, known=False))

    def resolve(self, status: Callable[[int], str | None] | None = None) -> bool:
        """Apply the queue from its head while each unknown transaction's outcome is
        known; True when nothing is left undecided. Raises what ``status`` raises."""
        status = status or self.status
        while self.queue:
            head = self.queue[0]
            if not head.known:
                if status is None:
                    return False
                outcome = status(head.xid)
                if outcome not in ("committed", "aborted"):
                    self.counts["status_" + str(outcome).replace(" ", "_")] += 1
                    return False
                self.counts[f"unknown_{outcome}"] += 1
                if outcome == "committed":
                    apply_effects(self.rows, head.effects, self.counts)
            else:
                apply_effects(self.rows, head.effects, self.counts)
            self.queue.pop(0)
        return True

    @property
    def unresolved(self) -> int:
        return sum(not t.known for t in self.queue)

    def expected(self) -> tuple[dict[Key, Row], dict[Key, frozenset[Row | None]]]:
        """The rows expected exactly, and the keys that may hold any one of several rows
        (None: absent): those an unknown transaction left unresolved decides. Raises
        psycopg2.Error when an unknown transaction's outcome cannot be read now, and
        ValueError when too many are unresolved to compare."""
        if self.resolve():
            return dict(self.rows), {}
        unknown = [i for i, t in enumerate(self.queue) if not t.known]
        if len(unknown) > MAX_UNRESOLVED:
            raise ValueError(f"{len(unknown)} wide-table transactions of unknown outcome")
        outcomes = []
        for mask in range(1 << len(unknown)):
            chosen = {i for bit, i in enumerate(unknown) if mask >> bit & 1}
            rows = dict(self.rows)
            for i, txn in enumerate(self.queue):
                if txn.known or i in chosen:
                    apply_effects(rows, txn.effects)
            outcomes.append(rows)
        want = outcomes[-1]
        keys = {k for rows in outcomes for k in rows}
        either = {k: frozenset(rows.get(k) for rows in outcomes) for k in keys}
        return want, {k: v for k, v in either.items() if len(v) > 1}


# --- the source tables ----------------------------------------------------------------------
def create_sources(dsn: str) -> None:
    """The two source tables, with rows in them before the connector first starts (its
    initial snapshot loads them through the routes): inserts only, from a fixed stream."""
    rng = random.Random(0x71DE5EED)
    conn = psycopg2.connect(dsn)
    try:
        with conn, conn.cursor() as cur:
            for route in ROUTES:
                cur.execute(route.ddl())
            for route in ROUTES:
                rows = {r[0]: r for r in (route.row(rng)
                                          for _ in range(rng.randint(*PRELOADED_ROWS)))}
                _upsert(cur, route, list(rows.values()), "insert")
    finally:
        conn.close()


def joined_rows(conn: Any) -> dict[Key, Row]:
    """The two source tables joined on their key as rows of WIDE_TABLE: what the wide
    table holds when the sources were only ever inserted into."""
    rows: dict[Key, Row] = {}
    effects: list[Effect] = []
    with conn, conn.cursor() as cur:
        for route in ROUTES:
            cur.execute(f"SELECT {', '.join(route.source_columns)} FROM public.{route.source}")
            effects += [Upsert(route.source, r[0], tuple(r[1:])) for r in cur.fetchall()]
    apply_effects(rows, effects)
    return rows


def txid_status(conn: Any, xid: int) -> str | None:
    """Whether the source transaction ``xid`` committed (committed, aborted, in progress;
    None once it is too old to tell)."""
    with conn, conn.cursor() as cur:
        cur.execute("SELECT txid_status(%s)", (xid,))
        found = cur.fetchone()
    return None if found is None else found[0]


# --- the workload ---------------------------------------------------------------------------
@dataclass(frozen=True)
class Op:
    """One statement on a source table. ``kind``: upsert, insert (no change on a
    conflict), update (one ``column`` set to ``values[0]``), orphan_payment (a payment
    upsert only where no order has the id), delete, delete_range (keys ``key`` to
    ``other``), pk_change (``key`` moved to ``other`` when that is free), truncate,
    bulk (an upsert of ``rows``)."""

    kind: str
    route: str
    key: int = 0
    values: tuple[Any, ...] = ()
    column: str = ""
    other: int = 0
    rows: tuple[tuple[Any, ...], ...] = ()
    group: str = ""  # what the op is part of, for the counts (both, delete_then_write)


def _write_op(rng: random.Random, route: Route, key: int, group: str = "") -> Op:
    """An upsert, or now and then a one-column update, of ``key``."""
    if rng.random() < 0.3:
        column = rng.choice(route.value_columns)
        value = route.values(rng)[route.value_columns.index(column)]
        return Op("update", route.source, key, (value,), column=column, group=group)
    return Op("upsert", route.source, key, route.values(rng), group=group)


def _group(rng: random.Random) -> list[Op]:
    """One to two statements of a transaction."""
    draw = rng.random()
    key = wide_key(rng)
    route = rng.choice(ROUTES)
    if draw < 0.22:  # both sources, one id, in either order
        first, second = (ORDERS, PAYMENTS) if rng.random() < 0.5 else (PAYMENTS, ORDERS)
        return [_write_op(rng, first, key, "both"), _write_op(rng, second, key, "both")]
    if draw < 0.44:
        return [Op("upsert", route.source, key, route.values(rng))]
    if draw < 0.48:
        return [Op("insert", route.source, key, route.values(rng))]
    if draw < 0.60:  # one column of a row (pgoutput sends the whole new row)
        column = rng.choice(route.value_columns)
        value = route.values(rng)[route.value_columns.index(column)]
        return [Op("update", route.source, key, (value,), column=column)]
    if draw < 0.66:
        return [Op("orphan_payment", PAYMENTS.source, key, PAYMENTS.values(rng))]
    if draw < 0.80:
        return [Op("delete", route.source, key)]
    if draw < 0.83:
        return [Op("delete_range", route.source, key, other=key + rng.randint(1, 12))]
    if draw < 0.89:
        return [Op("pk_change", route.source, key, other=wide_key(rng))]
    other = rng.choice(ROUTES)  # the same id deleted, then written, in one transaction
    return [Op("delete", route.source, key, group="delete_then_write"),
            _write_op(rng, other, key, "delete_then_write")]


def plan_transaction(rng: random.Random) -> tuple[str, list[Op]]:
    """One source transaction on the wide table's sources: (its kind, its statements)."""
    draw = rng.random()
    if draw < TRUNCATE_P:  # in a transaction of its own, half of the time refilled there
        ops = [Op("truncate", rng.choice(ROUTES).source)]
        if rng.random() < 0.5:
            refill = rng.choice(ROUTES)
            ops.append(Op("bulk", refill.source, rows=tuple(
                refill.row(rng) for _ in range(rng.randint(1, 10))), group="refill"))
        return "truncate", ops
    if draw < TRUNCATE_P + LARGE_P:
        route = rng.choice(ROUTES)
        ops = [Op("bulk", route.source, rows=tuple(
            route.row(rng) for _ in range(rng.randint(*LARGE_ROWS))), group="large")]
        for _ in range(rng.randint(0, 2)):
            ops += _group(rng)
        return "large", ops
    ops = []
    for _ in range(rng.choice((1, 1, 2, 3, 4))):
        ops += _group(rng)
    return "small", ops


def _returning(route: Route) -> str:
    return f"RETURNING {', '.join(route.source_columns)}"


def _upserts(route: Route, rows: Iterable[tuple[Any, ...]]) -> list[Effect]:
    return [Upsert(route.source, r[0], tuple(r[1:])) for r in rows]


def _upsert(cur: Any, route: Route, rows: list[tuple[Any, ...]], kind: str = "upsert"
            ) -> list[Effect]:
    unique = list({r[0]: r for r in rows}.values())
    conflict = ("DO NOTHING" if kind == "insert" else "DO UPDATE SET " + ", ".join(
        f"{c} = EXCLUDED.{c}" for c in route.value_columns))
    got = psycopg2.extras.execute_values(
        cur, f"INSERT INTO public.{route.source} ({', '.join(route.source_columns)}) "
             f"VALUES %s ON CONFLICT (id) {conflict} {_returning(route)}",
        unique, fetch=True)
    return _upserts(route, got)


def run_op(cur: Any, op: Op) -> list[Effect]:
    """Run one statement; the effects it had, as the source saw them (RETURNING)."""
    route = BY_SOURCE[op.route]
    table = f"public.{route.source}"
    if op.kind in ("upsert", "insert"):
        return _upsert(cur, route, [(op.key, *op.values)], op.kind)
    if op.kind == "bulk":
        return _upsert(cur, route, list(op.rows))
    if op.kind == "update":
        cur.execute(f"UPDATE {table} SET {op.column} = %s WHERE id = %s {_returning(route)}",
                    (op.values[0], op.key))
        return _upserts(route, cur.fetchall())
    if op.kind == "orphan_payment":  # a payment only where no order has the id
        casts = ", ".join(f"%s::{t}" for t in route.pg_types)
        sets = ", ".join(f"{c} = EXCLUDED.{c}" for c in route.value_columns)
        cur.execute(f"INSERT INTO {table} ({', '.join(route.source_columns)}) "
                    f"SELECT {casts} WHERE NOT EXISTS (SELECT 1 FROM public.{ORDERS.source} "
                    f"WHERE id = %s) ON CONFLICT (id) DO UPDATE SET {sets} "
                    f"{_returning(route)}", (op.key, *op.values, op.key))
        return _upserts(route, cur.fetchall())
    if op.kind == "delete":
        cur.execute(f"DELETE FROM {table} WHERE id = %s RETURNING id", (op.key,))
        return [Delete(route.source, r[0]) for r in cur.fetchall()]
    if op.kind == "delete_range":
        cur.execute(f"DELETE FROM {table} WHERE id BETWEEN %s AND %s RETURNING id",
                    (op.key, op.other))
        return [Delete(route.source, r[0]) for r in sorted(cur.fetchall())]
    if op.kind == "pk_change":  # onto a free key of this source only
        cur.execute(f"UPDATE {table} SET id = %s WHERE id = %s AND NOT EXISTS (SELECT 1 "
                    f"FROM {table} WHERE id = %s) {_returning(route)}",
                    (op.other, op.key, op.other))
        moved = cur.fetchall()
        return [e for r in moved for e in (Delete(route.source, op.key),
                                           Upsert(route.source, r[0], tuple(r[1:])))]
    if op.kind == "truncate":
        cur.execute(f"TRUNCATE {table}")
        return [Truncate(route.source)]
    raise ValueError(f"unknown wide-table operation {op.kind!r}")


@dataclass
class WideWorkload:
    """The wide table's source transactions and its model, one cluster's (counts go to
    the report's ``wide`` counter)."""

    model: WideModel
    counts: Counter[str] = field(default_factory=Counter)

    def step(self, source: Callable[[], Any], rng: random.Random,
             ready: Callable[[], bool]) -> int:
        """Zero to two transactions; returns how many committed (or may have). Raises
        psycopg2.Error when the source fails (the campaign then reconnects)."""
        if not ready():
            self.counts["steps_before_first_commit"] += 1
            return 0
        conn = source()
        self.model.resolve(lambda xid: txid_status(conn, xid))
        done = 0
        for _ in range(rng.choice((0, 1, 1, 2))):
            kind, ops = plan_transaction(rng)
            self.transaction(conn, kind, ops)
            done += 1
        return done

    def burst(self, source: Callable[[], Any], rng: random.Random, ready: Callable[[], bool],
              going: Callable[[], bool], limit_s: float = BURST_S) -> int:
        """Transactions one after another while ``going()`` (PostgreSQL is being stopped:
        one of them usually has its COMMIT cut off, an unknown outcome) and for at most
        ``limit_s``; returns how many committed. Raises psycopg2.Error when the source
        fails, which is what the burst waits for."""
        if not ready():
            return 0
        conn = source()
        self.model.resolve(lambda xid: txid_status(conn, xid))
        self.counts["bursts"] += 1
        done = 0
        deadline = time.monotonic() + limit_s
        while going() and time.monotonic() < deadline:
            kind, ops = plan_transaction(rng)
            self.transaction(conn, kind, ops)
            self.counts["burst_transactions"] += 1
            done += 1
        return done

    def transaction(self, conn: Any, kind: str, ops: Sequence[Op]) -> list[Effect]:
        """Run ``ops`` in one transaction and tell the model what it did: committed, or
        unknown when its COMMIT failed. Raises psycopg2.Error on a failure (nothing is
        recorded when it came before the COMMIT: nothing committed)."""
        effects: list[Effect] = []
        kinds: Counter[str] = Counter()
        try:
            with conn.cursor() as cur:
                cur.execute("SELECT txid_current()")
                xid = int(cur.fetchone()[0])
                for op in ops:
                    done = run_op(cur, op)
                    kinds[op.kind if done else f"{op.kind}_noop"] += 1
                    if op.group and done:
                        kinds[f"in_{op.group}"] += 1
                    effects += done
        except psycopg2.Error:
            with contextlib.suppress(psycopg2.Error):
                conn.rollback()
            self.counts["failed_before_commit"] += 1
            raise
        try:
            conn.commit()
        except psycopg2.Error:
            self.model.unknown(xid, effects)
            raise
        self.counts["transactions"] += 1
        self.counts[f"transactions_{kind}"] += 1
        self.counts.update(kinds)
        if _both_for_one_id(effects):
            self.counts["transactions_both_sources_one_id"] += 1
        self.model.committed(effects)
        return effects


def _both_for_one_id(effects: Sequence[Effect]) -> bool:
    routes: dict[int, set[str]] = {}
    for e in effects:
        if isinstance(e, Upsert):
            routes.setdefault(e.key, set()).add(e.route)
    return any(len(r) == len(ROUTES) for r in routes.values())
