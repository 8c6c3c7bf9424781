"""Harness for CDC tests: a real source PostgreSQL database, the data plane
(TransServer + Retina nodes) and a real ``retina-cdc`` process between them.

The source database has the data plane's tables (``public.orders``,
``public.events``), mapped by the connector to the Retina schema ``shop``.
``converged`` compares a gated snapshot of every table with the source.
"""

from __future__ import annotations

import random
import threading
import uuid
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from decimal import Decimal
from pathlib import Path
from typing import Any

import psycopg2

from devtools.cluster import PostgresInstance, free_port
from retina_common.log import logged_events
from retina_common.pb import retina_pb2 as rpb

from .dataplane import SCHEMA, DataPlane
from .support import ChildProcess, eventually

SOURCE_DDL = """
CREATE TABLE public.orders (id int8 PRIMARY KEY, customer text, amount numeric(12,2), note text);
CREATE TABLE public.events (tenant int4, seq int8, payload bytea, ok bool,
                            PRIMARY KEY (tenant, seq));
"""


class CdcProcess(ChildProcess):
    module = "cdc_client"

    def __init__(self, config_path: Path, workdir: Path, settings: Mapping[str, str]) -> None:
        super().__init__(config_path, workdir / "cdc.log")
        self.settings = dict(settings)

    def start(self, failpoints: str = "", **overrides: object) -> CdcProcess:
        env = {f"RETINA__CDC__{k.upper()}": str(v) for k, v in
               {**self.settings, **overrides}.items()}
        self.spawn(failpoints, env)
        return self

    def logged(self, event: str) -> list[dict]:
        return logged_events(self.log_path, event)


def normalise(table: str, row: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(row)
    if table == "orders" and out.get("amount") is not None:
        out["amount"] = Decimal(out["amount"]).quantize(Decimal("0.01"))
    if table == "events" and out.get("payload") is not None:
        out["payload"] = bytes(out["payload"])
    return out


class SourceDb:
    """The source PostgreSQL database and a random change workload on it."""

    def __init__(self, pg: PostgresInstance) -> None:
        self.pg = pg
        self.name = f"src_{uuid.uuid4().hex[:10]}"
        pg.create_database(self.name)
        self.dsn = pg.dsn(self.name)
        with self.connect() as conn, conn, conn.cursor() as cur:
            cur.execute(SOURCE_DDL)
        self.rng = random.Random(7)
        self.next_id = 1
        self.committed = 0

    @contextmanager
    def connect(self) -> Iterator[Any]:
        """A connection; each ``with conn:`` block inside is one transaction."""
        conn = psycopg2.connect(self.dsn)
        try:
            yield conn
        finally:
            conn.close()

    def rows(self, table: str) -> list[dict[str, Any]]:
        with self.connect() as conn, conn, conn.cursor() as cur:
            cur.execute(f"SELECT * FROM public.{table}")
            names = [d.name for d in cur.description]
            return [normalise(table, dict(zip(names, r, strict=True))) for r in cur.fetchall()]

    def transaction(self, cur: Any) -> None:
        """One random source transaction of 1-6 statements."""
        rng = self.rng
        for _ in range(rng.randint(1, 6)):
            choice = rng.random()
            if choice < 0.45:
                cur.execute("INSERT INTO orders VALUES (%s, %s, %s, %s)",
                            (self.next_id, f"c{rng.randint(1, 50)}",
                             Decimal(rng.randint(0, 10**6)) / 100, rng.choice([None, "x"])))
                self.next_id += 1
            elif choice < 0.6:
                cur.execute("UPDATE orders SET amount = amount + 1, note = %s "
                            "WHERE id = (SELECT id FROM orders ORDER BY random() LIMIT 1)",
                            (f"u{rng.randint(1, 9)}",))
            elif choice < 0.7:
                cur.execute("DELETE FROM orders WHERE id = "
                            "(SELECT id FROM orders ORDER BY random() LIMIT 1)")
            elif choice < 0.75:  # a primary-key change
                cur.execute("UPDATE orders SET id = %s WHERE id = "
                            "(SELECT id FROM orders ORDER BY random() LIMIT 1)", (self.next_id,))
                self.next_id += 1
            else:
                tenant = rng.randint(1, 4)
                cur.execute("INSERT INTO events VALUES (%s, %s, %s, %s) ON CONFLICT (tenant, seq) "
                            "DO UPDATE SET payload = EXCLUDED.payload, ok = NOT events.ok",
                            (tenant, rng.randint(1, 40), rng.randbytes(rng.randint(0, 12)),
                             rng.random() < 0.5))

    def run(self, transactions: int) -> None:
        with self.connect() as conn:
            for _ in range(transactions):
                with conn, conn.cursor() as cur:
                    self.transaction(cur)
                self.committed += 1

    @contextmanager
    def background(self, transactions: int) -> Iterator[threading.Thread]:
        """Run the workload on a thread; joined when the block exits."""
        worker = threading.Thread(target=self.run, args=(transactions,), daemon=True)
        worker.start()
        try:
            yield worker
        finally:
            worker.join(120)

    def drop(self) -> None:
        """Drop the database and its replication slots (DROP DATABASE refuses while a slot
        names it). A killed connector's walsender lets its slot go a moment later."""
        conn = psycopg2.connect(self.pg.dsn("postgres"))
        conn.autocommit = True
        try:
            with conn.cursor() as cur:
                def all_dropped() -> bool:
                    cur.execute("SELECT pg_drop_replication_slot(slot_name) FROM "
                                "pg_replication_slots WHERE database = %s AND NOT active",
                                (self.name,))
                    cur.execute("SELECT count(*) FROM pg_replication_slots WHERE database = %s",
                                (self.name,))
                    row = cur.fetchone()
                    return row is not None and row[0] == 0
                eventually(all_dropped, 30, f"the replication slots of {self.name} to go")
        finally:
            conn.close()
        self.pg.drop_database(self.name)


class CdcPlane:
    """Source database + data plane + connector."""

    def __init__(self, plane: DataPlane, source_db: SourceDb | None, workdir: Path,
                 **settings: object) -> None:
        self.plane = plane
        self.source = source_db
        base: dict[str, object] = {
            "name": f"cdc-{uuid.uuid4().hex[:6]}", "schema": SCHEMA,
            "metrics_listen": f"127.0.0.1:{free_port()}",
            "changelog_root": str(workdir / "changelog"),
            "write_lease_ms": 3000, "node_check_interval_ms": 300,
        }
        if source_db is not None:
            base.update(source="postgres", source_dsn=source_db.dsn,
                        slot=f"s_{uuid.uuid4().hex[:10]}", publication="retina_cdc",
                        source_tables="public.orders,public.events")
        base.update(settings)
        self.cdc = CdcProcess(plane.config_path, workdir, {k: str(v) for k, v in base.items()})

    def expected(self) -> dict[str, dict[bytes, dict[str, Any]]]:
        assert self.source is not None
        return {t: {self.plane.writers[t].key(r): r for r in self.source.rows(t)}
                for t in self.plane.tables}

    def actual(self) -> dict[str, dict[bytes, dict[str, Any]]]:
        return {t: {k: normalise(t, r) for k, r in self.plane.read(t).items()}
                for t in self.plane.tables}

    def converged(self, expected: Mapping[str, Mapping[bytes, Mapping[str, Any]]] | None = None,
                  timeout_s: float = 60) -> None:
        """Poll until the gated snapshot equals ``expected`` (default: the source)."""
        want = expected if expected is not None else self.expected()
        last: dict = {}

        def same() -> bool:
            last["actual"] = self.actual()
            return last["actual"] == want

        try:
            eventually(same, timeout_s, "the gated snapshot to equal the source", 0.25)
        except AssertionError:
            got = last.get("actual", {})
            diff = {t: {"missing": len(set(want[t]) - set(got.get(t, {}))),
                        "extra": len(set(got.get(t, {})) - set(want[t])),
                        "different": sum(1 for k in want[t] if k in got.get(t, {})
                                         and got[t][k] != want[t][k])} for t in want}
            raise AssertionError(f"snapshot != source: {diff}\n{self.cdc.log_tail()}") from None

    def all_ready(self) -> bool:
        return all(self.plane.status(n).state == rpb.READY for n in self.plane.nodes)
