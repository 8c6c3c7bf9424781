"""One wide table fed by two source tables, end to end: a real source PostgreSQL, a real
``retina-cdc`` with two ``[[cdc.routes]]`` and two Retina nodes.

``orders_src`` fills a row's order columns and ``payments_src`` its payment columns, as
partial updates of one ``order_wide`` row per order id; a delete from either removes the
whole row. The source's final state cannot say what the wide table holds (a payment's
delete removes a row whose order still exists), so a model applies every committed
source transaction in commit order, and the gated snapshot must equal it: through a
SIGKILL of a node (replayed from the changelog, partial updates and all) and of the
connector mid-stream, and two restarts of the node in a row. The order's note is a
TOASTed value most updates leave alone: the connector sends those rows without it and
the node keeps the value (``cdc.unchanged_toast = "keep-current"``)."""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Iterator
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest

from devtools.cluster import PostgresInstance
from retina_common import exit_codes
from retina_common.catalog import Catalog, ColumnSpec
from retina_common.client import TableWriter
from retina_common.etcd import EtcdStore

from .cdc import CdcPlane, CdcProcess, SourceDb
from .dataplane import SCHEMA, DataPlane
from .support import eventually

pytestmark = pytest.mark.integration

SOURCE_DDL = """
CREATE TABLE public.orders_src (id int8 PRIMARY KEY, customer text, amount numeric(12,2),
                                note text);
ALTER TABLE public.orders_src ALTER COLUMN note SET STORAGE EXTERNAL;
CREATE TABLE public.payments_src (order_id int8 PRIMARY KEY, paid numeric(12,2), method text);
"""
WIDE = [ColumnSpec("id", "int64"), ColumnSpec("customer", "string"),
        ColumnSpec("amount", "decimal(12,2)"), ColumnSpec("note", "string"),
        ColumnSpec("paid", "decimal(12,2)"), ColumnSpec("method", "string")]
ROUTES = """
[[cdc.routes]]
source = "public.orders_src"
target = "order_wide"
columns = ["id", "customer", "amount", "note"]

[[cdc.routes]]
source = "public.payments_src"
target = "order_wide"
columns = { order_id = "id", paid = "paid", method = "method" }
"""
ORDER_COLUMNS = ("customer", "amount", "note")
PAYMENT_COLUMNS = ("paid", "method")
NULL_ROW = {c.name: None for c in WIDE}


class WideWorkload:
    """Random source transactions on both tables, and the model of the wide table they
    make: a transaction counts once its commit returned."""

    def __init__(self, source: SourceDb, seed: int) -> None:
        self.source = source
        self.rng = random.Random(seed)
        self.orders: dict[int, dict[str, Any]] = {}  # the source's rows (to pick from)
        self.payments: set[int] = set()
        self.wide: dict[int, dict[str, Any]] = {}
        self.committed = 0
        self.lock = threading.Lock()

    def long_note(self) -> str:
        return "".join(self.rng.choice("0123456789abcdef") for _ in range(5000))

    def statement(self, cur: Any, orders: dict[int, dict[str, Any]], payments: set[int],
                  wide: dict[int, dict[str, Any]], written: set[int]) -> None:
        """One statement, and its effect on copies of the source and the model."""
        rng = self.rng
        i = rng.randint(1, 30)
        choice = rng.random()
        if choice < 0.3:  # an order: inserted, or updated with every column it has
            row = {"customer": f"c{rng.randint(1, 9)}",
                   "amount": Decimal(rng.randint(0, 10**5)) / 100,
                   "note": rng.choice([None, "short", self.long_note()])}
            cur.execute("INSERT INTO orders_src VALUES (%s, %s, %s, %s) ON CONFLICT (id) DO "
                        "UPDATE SET customer = EXCLUDED.customer, amount = EXCLUDED.amount, "
                        "note = EXCLUDED.note", (i, row["customer"], row["amount"], row["note"]))
            orders[i] = row
            wide[i] = {**wide.get(i, {**NULL_ROW, "id": i}), **row}
            written.add(i)
        elif choice < 0.5 and orders:  # an order's amount alone: its TOASTed note is left
            i = rng.choice(sorted(orders))
            amount = Decimal(rng.randint(0, 10**5)) / 100
            cur.execute("UPDATE orders_src SET amount = %s WHERE id = %s", (amount, i))
            orders[i] = {**orders[i], "amount": amount}
            note = orders[i]["note"]
            # Sent without the note when it is TOASTed (and not written earlier in this
            # transaction): the wide row keeps its own, NULL if it has no row.
            kept = note is not None and len(note) > 1000 and i not in written
            base = wide.get(i, {**NULL_ROW, "id": i})
            sent = {"customer": orders[i]["customer"], "amount": amount}
            if kept:  # the source's row of this transaction now lacks the note too
                written.discard(i)
            else:
                sent["note"] = note
                written.add(i)
            wide[i] = {**base, **sent}
        elif choice < 0.75:  # a payment, for an order that may not exist yet
            paid = Decimal(rng.randint(0, 10**5)) / 100
            method = rng.choice([None, "card", "cash"])
            cur.execute("INSERT INTO payments_src VALUES (%s, %s, %s) ON CONFLICT (order_id) "
                        "DO UPDATE SET paid = EXCLUDED.paid, method = EXCLUDED.method",
                        (i, paid, method))
            payments.add(i)
            wide[i] = {**wide.get(i, {**NULL_ROW, "id": i}), "paid": paid, "method": method}
        elif choice < 0.88 and orders:
            i = rng.choice(sorted(orders))
            cur.execute("DELETE FROM orders_src WHERE id = %s", (i,))
            del orders[i]
            wide.pop(i, None)
            written.discard(i)
        elif payments:
            i = rng.choice(sorted(payments))
            cur.execute("DELETE FROM payments_src WHERE order_id = %s", (i,))
            payments.discard(i)
            wide.pop(i, None)

    def run(self, transactions: int, pace_s: float = 0.0) -> None:
        """``pace_s``: a pause between transactions (a source's rate, not a wait for
        anything), so that kills land while batches are flowing."""
        with self.source.connect() as conn:
            for _ in range(transactions):
                time.sleep(pace_s)
                orders = {k: dict(v) for k, v in self.orders.items()}
                payments, wide = set(self.payments), {k: dict(v) for k, v in self.wide.items()}
                written: set[int] = set()
                with conn, conn.cursor() as cur:
                    for _ in range(self.rng.randint(1, 5)):
                        self.statement(cur, orders, payments, wide, written)
                with self.lock:  # committed: the model moves
                    self.orders, self.payments, self.wide = orders, payments, wide
                    self.committed += 1

    def expected(self, plane: DataPlane) -> dict[str, dict[bytes, dict[str, Any]]]:
        writer = plane.writers["order_wide"]
        with self.lock:
            rows = [dict(r) for r in self.wide.values()]
        return {"orders": {}, "events": {}, "order_wide": {writer.key(r): r for r in rows}}


@pytest.fixture
def wide_cdc(tmp_path: Path, etcd: EtcdStore, catalog: Catalog, catalog_dsn: str,
             pg_server: PostgresInstance) -> Iterator[CdcPlane]:
    plane = DataPlane(tmp_path / "plane", etcd, catalog, catalog_dsn, nodes=2,
                      retina={"block_rows": 16, "blocks_per_file": 2, "flush_interval_ms": 200})
    record = catalog.create_table(SCHEMA, "order_wide", WIDE, ["id"])
    plane.tables["order_wide"] = record
    plane.writers["order_wide"] = TableWriter(record, plane.topology)
    plane.start(recover=False)
    source = SourceDb(pg_server)
    with source.connect() as conn, conn, conn.cursor() as cur:
        cur.execute(SOURCE_DDL)
    cdc = CdcPlane(plane, source, tmp_path,
                   source_tables="public.orders_src,public.payments_src")
    # Routes live in the config file only (not in environment overrides).
    config = plane.config_path.with_name("cdc-routes.toml")
    config.write_text(plane.config_path.read_text() + ROUTES)
    cdc.cdc = CdcProcess(config, tmp_path, cdc.cdc.settings)
    try:
        yield cdc
    finally:
        cdc.cdc.kill9()
        plane.stop(kill=True)
        source.drop()


def wide_rows(cdc: CdcPlane) -> dict[bytes, dict[str, Any]]:
    return cdc.plane.read("order_wide")


def test_two_sources_fill_one_wide_table_through_crashes(wide_cdc: CdcPlane) -> None:
    cdc = wide_cdc
    assert cdc.source is not None
    workload = WideWorkload(cdc.source, seed=30)
    cdc.cdc.start()
    eventually(cdc.all_ready, 60, "both nodes READY")
    workload.run(25)
    cdc.converged(workload.expected(cdc.plane))
    assert any(r["paid"] is not None and r["customer"] is not None
               for r in wide_rows(cdc).values()), "no row was filled by both sources"
    # An order with a TOASTed note and a payment; the payment's delete removes the whole
    # row; an update of the order's amount alone then makes a row without the note (the
    # update does not carry it, and the key has no row to keep it from): the documented
    # semantics, and what reading the value from the source would get wrong.
    note = workload.long_note()
    with cdc.source.connect() as conn:
        for statements in (
                [("INSERT INTO orders_src VALUES (100, 'c100', 5.00, %s)", (note,)),
                 ("INSERT INTO payments_src VALUES (100, 5.00, 'card')", ())],
                [("DELETE FROM payments_src WHERE order_id = 100", ())],
                [("UPDATE orders_src SET amount = 6.00 WHERE id = 100", ())]):
            with conn, conn.cursor() as cur:
                for sql, args in statements:
                    cur.execute(sql, args)
    with workload.lock:
        workload.orders[100] = {"customer": "c100", "amount": Decimal("6.00"), "note": note}
        workload.wide[100] = {**NULL_ROW, "id": 100, "customer": "c100",
                              "amount": Decimal("6.00")}
    cdc.converged(workload.expected(cdc.plane))

    victim = cdc.plane.nodes[1]
    worker = threading.Thread(target=workload.run, args=(90, 0.04), daemon=True)
    worker.start()
    eventually(lambda: workload.committed >= 45, 60, "the workload to get going")
    cdc.plane.retinas[victim].kill9()  # replayed from the changelog: partial updates too
    eventually(lambda: workload.committed >= 65, 60, "more source commits")
    cdc.plane.retinas[victim].start(wait=False)
    eventually(lambda: workload.committed >= 80, 60, "more source commits")
    cdc.cdc.kill9()  # the connector mid-stream: it resumes from its committed position
    cdc.cdc.start()
    worker.join(120)
    assert not worker.is_alive()
    cdc.converged(workload.expected(cdc.plane), timeout_s=90)
    assert any(d["node"] == victim for d in cdc.cdc.logged("cdc_replay_done")), \
        cdc.cdc.log_tail()

    # Two restarts of a node in a row, then an old row read again: nothing changes.
    before = wide_rows(cdc)
    for _ in range(2):
        cdc.plane.retinas[victim].kill9()
        cdc.plane.retinas[victim].start(wait=False)
        eventually(cdc.all_ready, 90, "the node READY again")
    assert wide_rows(cdc) == before
    workload.run(10)
    cdc.converged(workload.expected(cdc.plane))


def test_a_route_that_misses_the_target_key_stops_the_connector_at_start(
        wide_cdc: CdcPlane) -> None:
    config = wide_cdc.plane.config_path.with_name("cdc-bad.toml")
    config.write_text(wide_cdc.plane.config_path.read_text() + ROUTES.replace(
        'columns = { order_id = "id", paid = "paid", method = "method" }',
        'columns = { paid = "paid", method = "method" }'))
    bad = CdcProcess(config, wide_cdc.plane.config_path.parent, wide_cdc.cdc.settings)
    bad.start()
    assert bad.wait_exit(60) == exit_codes.USAGE
    assert "ROUTES_NAME_THE_TARGET_KEY" in bad.log_tail()
