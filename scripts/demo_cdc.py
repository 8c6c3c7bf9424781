"""The demo's main act: a source PostgreSQL database → ``retina-cdc`` → two
Retina nodes, beside them an application writing a table of its own through
``DurableWriter``, a SIGKILL of one node mid-stream, replay (the connector's
changelog and the application's) and MarkReady driven by the connector, and a gated
snapshot of every table compared with the source and the application's model."""

from __future__ import annotations

import contextlib
import os
import random
import signal
import threading
import time
from collections.abc import Callable
from decimal import Decimal
from pathlib import Path
from typing import Any

import psycopg2

from devtools.cluster import (
    ClusterError,
    ClusterState,
    free_port,
    node_state,
    start_cdc,
    start_retina_server,
    start_retina_servers,
    wait_for,
)
from retina_common.catalog import Catalog, ColumnSpec
from retina_common.client import TableWriter
from retina_common.config import load_config
from retina_common.log import logged_events
from retina_common.pb import retina_pb2 as rpb
from retina_common.reader import SnapshotReader
from retina_common.topology import load_topology
from retina_common.writer import DurableWriter

SOURCE_DB = "shop_source"
SCHEMA = "retail"
DDL = """
CREATE TABLE customers (id int8 PRIMARY KEY, name text, city text, credit numeric(12,2));
CREATE TABLE orders (id int8 PRIMARY KEY, customer_id int8, amount numeric(12,2),
                     status text, placed timestamptz);
CREATE TABLE items (order_id int8, line int4, sku text, qty int4, PRIMARY KEY (order_id, line));
"""
TABLES = {
    "customers": ([ColumnSpec("id", "int64"), ColumnSpec("name", "string"),
                   ColumnSpec("city", "string"), ColumnSpec("credit", "decimal(12,2)")], ["id"]),
    "orders": ([ColumnSpec("id", "int64"), ColumnSpec("customer_id", "int64"),
                ColumnSpec("amount", "decimal(12,2)"), ColumnSpec("status", "string"),
                ColumnSpec("placed", "timestamp_us")], ["id"]),
    "items": ([ColumnSpec("order_id", "int64"), ColumnSpec("line", "int32"),
               ColumnSpec("sku", "string"), ColumnSpec("qty", "int32")], ["order_id", "line"]),
}


class Workload:
    """A shop: customers sign up and move, orders are placed, paid, re-keyed, cancelled."""

    def __init__(self, dsn: str, seed: int = 11) -> None:
        self.conn = psycopg2.connect(dsn)
        self.rng = random.Random(seed)
        self.next_customer = 1
        self.next_order = 1
        self.committed = 0
        self.last_commit = 0.0

    def one(self, cur: Any) -> None:
        rng = self.rng
        if self.next_customer < 20 or rng.random() < 0.15:
            cur.execute("INSERT INTO customers VALUES (%s, %s, %s, %s)",
                        (self.next_customer, f"customer {self.next_customer}",
                         rng.choice(["Lyon", "Oslo", "Lima", "Pune"]), Decimal("100.00")))
            self.next_customer += 1
        customer = rng.randrange(1, self.next_customer)
        cur.execute("INSERT INTO orders VALUES (%s, %s, %s, 'new', now())",
                    (self.next_order, customer, Decimal(rng.randint(100, 99999)) / 100))
        cur.executemany("INSERT INTO items VALUES (%s, %s, %s, %s)",
                        [(self.next_order, line, f"sku-{rng.randint(1, 500)}", rng.randint(1, 5))
                         for line in range(1, rng.randint(2, 5))])
        self.next_order += 1
        choice = rng.random()
        if choice < 0.4:
            cur.execute("UPDATE orders SET status = 'paid' WHERE id = %s",
                        (rng.randrange(1, self.next_order),))
        elif choice < 0.5:
            victim = rng.randrange(1, self.next_order)
            cur.execute("DELETE FROM items WHERE order_id = %s", (victim,))
            cur.execute("DELETE FROM orders WHERE id = %s", (victim,))
        elif choice < 0.55:  # a primary-key change
            cur.execute("UPDATE orders SET id = %s WHERE id = %s",
                        (self.next_order + 1_000_000, rng.randrange(1, self.next_order)))
        elif choice < 0.7:
            cur.execute("UPDATE customers SET city = %s, credit = credit - 1 WHERE id = %s",
                        (rng.choice(["Kyiv", "Quito", "Accra"]), customer))

    def run(self, transactions: int, rate_per_s: float,
            on_progress: Callable[[int], None]) -> None:
        started = time.monotonic()
        for n in range(transactions):
            delay = started + n / rate_per_s - time.monotonic()
            if delay > 0:
                time.sleep(delay)  # pacing the workload, not synchronisation
            with self.conn, self.conn.cursor() as cur:
                self.one(cur)
            self.committed += 1
            self.last_commit = time.monotonic()
            on_progress(self.committed)

    def rows(self, table: str) -> list[dict[str, Any]]:
        with self.conn, self.conn.cursor() as cur:
            cur.execute(f"SELECT * FROM {table}")
            names = [d.name for d in cur.description]
            return [dict(zip(names, r, strict=True)) for r in cur.fetchall()]


def _setup(state: ClusterState) -> tuple[Catalog, dict[str, TableWriter], str]:
    state.postgres.create_database(SOURCE_DB)
    dsn = state.postgres.dsn(SOURCE_DB)
    with psycopg2.connect(dsn) as conn, conn.cursor() as cur:
        cur.execute(DDL)
    conn.close()
    catalog = Catalog(state.postgres.dsn())
    catalog.create_schema(SCHEMA)
    topology = load_topology(state.topology_path)
    writers = {name: TableWriter(catalog.create_table(SCHEMA, name, cols, pk), topology)
               for name, (cols, pk) in TABLES.items()}
    return catalog, writers, dsn


def cdc_pipeline(state: ClusterState, check: Callable[[bool, str], None],
                 transactions: int = 600, rate_per_s: float = 150) -> dict[str, Any]:
    catalog, writers, dsn = _setup(state)
    start_retina_servers(state)
    start_cdc(state, {
        "RETINA__CDC__SOURCE": "postgres", "RETINA__CDC__SOURCE_DSN": dsn,
        "RETINA__CDC__SCHEMA": SCHEMA, "RETINA__CDC__SOURCE_TABLES":
            "public.customers,public.orders,public.items",
        "RETINA__CDC__METRICS_LISTEN": f"127.0.0.1:{free_port()}",
        "RETINA__CDC__WRITE_LEASE_MS": "5000"})
    wait_for(lambda: all(node_state(n) == rpb.READY for n in state.nodes), 60,
             "the connector to take both nodes through MarkReady")
    check(True, f"retina-cdc reads {SOURCE_DB} by logical replication (pgoutput) and took "
                f"{len(state.nodes)} fresh Retina nodes through MarkReady")
    points = application_writes(state, catalog)
    check(True, f"application writer {APP_WRITER} committed {len(points)} rows of "
                f"{SCHEMA}.{APP_TABLE} through DurableWriter (logged before sent)")
    workload = Workload(dsn)
    victim = state.nodes[1]
    crash: dict[str, float] = {}

    def on_progress(committed: int) -> None:
        if committed == transactions // 3:
            os.kill(state.retina_pids[victim], signal.SIGKILL)
            crash["killed_at"] = time.monotonic()
            crash["at_txn"] = committed

    t0 = time.monotonic()
    worker = threading.Thread(target=workload.run, args=(transactions, rate_per_s, on_progress))
    worker.start()
    wait_for(lambda: "killed_at" in crash, 120, "the crash point")
    start_retina_server(state, victim)
    restarted = time.monotonic()
    wait_for(lambda: node_state(victim) == rpb.READY, 120, "the restarted node to be READY")
    ready_s = time.monotonic() - restarted
    worker.join()
    workload_s = time.monotonic() - t0
    cdc_log = Path(state.state_dir, "logs", "cdc.log")
    replay = [e for e in logged_events(cdc_log, "cdc_replay_done") if e["node"] == victim][-1]
    replay_start = [e for e in logged_events(cdc_log, "cdc_replay_start")
                    if e["node"] == victim][-1]
    check(True, f"SIGKILL {victim} after {crash['at_txn']} of {transactions} source "
                f"transactions; restarted: RECOVERING -> replay -> MarkReady -> READY in "
                f"{ready_s:.2f}s while the stream kept flowing")
    result: dict[str, Any] = {}

    def converged() -> bool:
        return snapshot_equals_source(state, writers, workload, result)

    with contextlib.suppress(ClusterError):  # the checks below name the table that differs
        wait_for(converged, 60, "the gated snapshot to equal the source")
    caught_up_s = time.monotonic() - workload.last_commit
    for name, (rows, same) in result.items():
        check(same, f"{SCHEMA}.{name}: gated snapshot = source table ({rows} rows)")
    check(application_rows(state) == points,
          f"{SCHEMA}.{APP_TABLE}: gated snapshot = the application's {len(points)} "
          f"acknowledged rows after {victim}'s crash (replayed from its changelog)")
    catalog.close()
    return {"transactions": transactions, "workload_s": workload_s, "ready_s": ready_s,
            "caught_up_s": caught_up_s, "replay": replay, "replay_start": replay_start,
            "rows": {n: r for n, (r, _s) in result.items()},
            # For the acts that follow on the same cluster (demo_gc.py).
            "more_writes": lambda n: workload.run(n, rate_per_s, lambda _c: None),
            "converged": converged}


APP_WRITER = "loyalty-app"
APP_TABLE = "points"


def application_writes(state: ClusterState, catalog: Catalog) -> dict[int, dict[str, Any]]:
    """Four transactions of a program of its own (upserts, then a delete) through the
    durable client library; returns the rows it was acknowledged."""
    catalog.create_table(SCHEMA, APP_TABLE, [ColumnSpec("customer", "int64"),
                                             ColumnSpec("points", "int64")], ["customer"])
    model: dict[int, dict[str, Any]] = {}
    with DurableWriter.connect(load_config(state.config_path), APP_WRITER, SCHEMA) as writer:
        for start in range(0, 40, 10):
            rows = [{"customer": c, "points": c * 10 + start} for c in range(start, start + 10)]
            writer.write(APP_TABLE, upserts=rows)
            model.update({r["customer"]: r for r in rows})
        writer.write(APP_TABLE, deletes=[{"customer": 0}, {"customer": 17}])
        for customer in (0, 17):
            del model[customer]
    return model


def application_rows(state: ClusterState) -> dict[int, dict[str, Any]]:
    reader = SnapshotReader(state.trans_listen, load_topology(state.topology_path))
    try:
        return {r["customer"]: r for r in reader.read(SCHEMA, APP_TABLE).table.to_pylist()}
    finally:
        reader.close()


def snapshot_equals_source(state: ClusterState, writers: dict[str, TableWriter],
                           workload: Workload, result: dict[str, Any]) -> bool:
    """One gated snapshot of every table against the source; ``result[table]`` is
    (source rows, equal)."""
    result.clear()
    reader = SnapshotReader(state.trans_listen, load_topology(state.topology_path))
    try:
        for name, writer in writers.items():
            want = {writer.key(r): _norm(r) for r in workload.rows(name)}
            got = {writer.key(r): _norm(r) for r in reader.read(SCHEMA, name).table.to_pylist()}
            result[name] = (len(want), want == got)
    finally:
        reader.close()
    return all(same for _n, same in result.values())


def _norm(row: dict[str, Any]) -> dict[str, Any]:
    return {k: (v.quantize(Decimal("0.01")) if isinstance(v, Decimal) else v)
            for k, v in row.items()}
