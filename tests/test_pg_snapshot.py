"""PostgreSQL source: the initial snapshot, TRUNCATE and unchanged TOAST values.

First the source alone (PostgresSource against a real PostgreSQL), then end
to end: a real ``retina-cdc`` process between a source database and two
Retina nodes, where the gated snapshot must equal the source tables after a
snapshot with concurrent writes, a connector killed mid-snapshot, TRUNCATEs,
and updates that leave a TOASTed value alone.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import closing
from dataclasses import replace
from pathlib import Path
from typing import Any

import psycopg2
import pytest

from cdc_client.schema_change import UnsupportedSchemaChange
from cdc_client.source import RowChange, SourceError, SourceTransaction
from cdc_client.sources.pg_snapshot import (
    SnapshotPosition,
    is_snapshot_position,
    published_tables,
)
from cdc_client.sources.pgoutput import format_lsn
from cdc_client.sources.postgres import PostgresSource, drop_slot
from cdc_client.translate import TableMap, translate
from devtools.cluster import PostgresInstance
from retina_common.catalog import Catalog, ColumnSpec
from retina_common.catalog.model import ColumnRecord, TableRecord
from retina_common.changelog import REPLACE, TRUNCATE, Changelog
from retina_common.changelog_replay import requests
from retina_common.codec import encode_value
from retina_common.columnar import row_count
from retina_common.etcd import EtcdStore
from retina_common.topology import Topology

from .cdc import CdcPlane
from .cdc import SourceDb as WorkloadDb
from .dataplane import DataPlane
from .support import eventually
from .test_source_postgres import FULL_ROW, SourceDb, collect
from .test_source_postgres import db as db  # the fixture

pytestmark = pytest.mark.integration

Model = dict[str, dict[tuple[Any, ...], dict[str, Any]]]
KEYS = {"public.notes": ("id",), "public.accounts": ("id",)}


def apply(model: Model, txs: list[SourceTransaction]) -> Model:
    """What a consumer ends with after applying ``txs`` in order."""
    for tx in txs:
        for c in tx.changes:
            rows = model.setdefault(c.table, {})
            key = KEYS[c.table]
            if c.op == "truncate":
                rows.clear()
            if c.before is not None:
                rows.pop(tuple(c.before[k] for k in key), None)
            if c.after is not None:
                rows[tuple(c.after[k] for k in key)] = dict(c.after)
    return model


def notes(db: SourceDb) -> dict[tuple[Any, ...], dict[str, Any]]:
    return {(i,): {"id": i, "body": b, "flag": f}
            for i, b, f in db.query("SELECT id, body, flag FROM notes")}


def drain(source: PostgresSource, db: SourceDb, timeout_s: float = 30
          ) -> list[SourceTransaction]:
    """Everything up to a marker committed now (an insert of accounts row -N): the
    snapshot's chunks, then the streamed transactions. The stream starts only once the
    snapshot is done, so the marker is the last thing ``source`` returns."""
    marker = -1 - len(db.query("SELECT id FROM accounts WHERE id < 0"))
    db.execute(f"INSERT INTO accounts (id) VALUES ({marker})")
    got: list[SourceTransaction] = []
    while not got or [(c.table, c.after and c.after["id"]) for c in got[-1].changes] != [
            ("public.accounts", marker)]:
        got += collect(source, 1, timeout_s)
    return got


def confirmed_flush(db: SourceDb) -> str:
    [(lsn,)] = db.query("SELECT confirmed_flush_lsn::text FROM pg_replication_slots "
                        "WHERE slot_name = %s", (db.slot,))
    return lsn


def preload(db: SourceDb) -> None:
    db.execute("INSERT INTO notes SELECT g, 'n' || g, g FROM generate_series(1, 25) g",
               "INSERT INTO accounts (id) VALUES (1), (2)")


def test_snapshot_then_stream_nothing_lost_or_doubled(db: SourceDb) -> None:
    preload(db)
    source = db.open(snapshot_mode="initial", chunk_rows=10)
    # After the slot exists: streamed, not in the snapshot.
    db.execute("UPDATE notes SET flag = -1 WHERE id = 3", "INSERT INTO notes VALUES (100, 'x', 0)",
               "DELETE FROM notes WHERE id = 25")
    txs = collect(source, 5)  # accounts: one chunk; notes: 10 + 10 + 5; the update
    chunks = [t for t in txs if is_snapshot_position(t.position)]
    # A new snapshot empties the tables first (leftovers of an attempt that died).
    assert [(c.op, c.table) for c in chunks[0].changes[:2]] == [
        ("truncate", "public.accounts"), ("truncate", "public.notes")]
    assert [len(t.changes) for t in chunks] == [2 + 2, 10, 10, 5]
    assert all(c.op == "insert" for t in chunks for c in t.changes[2 if t is chunks[0] else 0:])
    assert not is_snapshot_position(txs[-1].position)
    keys = [source.position_key(t.position) for t in txs]
    assert keys == sorted(set(keys))
    model = apply({}, txs)
    assert model["public.notes"] == notes(db)
    assert set(model["public.accounts"]) == {(1,), (2,)}
    # Acknowledging a chunk leaves the slot at its consistent point (the stream
    # starts there); acknowledging a streamed transaction moves it.
    consistent_point = format_lsn(SnapshotPosition.parse(chunks[0].position).consistent_point)
    for t in chunks:
        source.ack(t.position)
    assert confirmed_flush(db) == consistent_point
    source.ack(txs[-1].position)
    eventually(lambda: confirmed_flush(db) == txs[-1].position, 10,
               "the slot to move to the acknowledged transaction")


def test_snapshot_values_equal_streamed_values(db: SourceDb) -> None:
    db.execute(FULL_ROW)
    source = db.open(snapshot_mode="initial")
    db.execute(FULL_ROW.replace("VALUES (1,", "VALUES (2,"))
    snapshot, streamed = collect(source, 2)
    assert is_snapshot_position(snapshot.position)
    [sent] = streamed.changes
    assert snapshot.changes[-1].after == {**sent.after, "id": 1}


def test_snapshot_resumes_after_its_committed_chunk_in_a_fresh_snapshot(db: SourceDb) -> None:
    preload(db)
    first = db.open(snapshot_mode="initial", chunk_rows=10)
    done = collect(first, 2)  # accounts, and notes 1..10
    first.close()
    # While the connector is down: changes in the loaded and the unread range.
    db.execute("UPDATE notes SET body = 'changed' WHERE id IN (2, 20)",
               "DELETE FROM notes WHERE id = 15", "INSERT INTO notes VALUES (200, 'new', 1)")
    resumed = db.open(start_after=done[-1].position, chunk_rows=10)
    rest = drain(resumed, db)
    assert is_snapshot_position(rest[0].position)
    assert rest[0].changes[0].after["id"] == 11  # right after the committed chunk
    assert apply(apply({}, done), rest)["public.notes"] == notes(db)
    keys = [resumed.position_key(t.position) for t in done + rest]
    assert keys == sorted(set(keys))


def test_snapshot_tables_are_in_the_order_a_resume_compares_them(db: SourceDb) -> None:
    """A resumed snapshot finds its table by comparing qualified names in Python; the
    tables must come in that order. Here SQL's (schema, table) order differs from it:
    'a.y' < 'a-b.x' by schema, 'a-b.x' < 'a.y' as strings ('-' sorts before '.')."""
    db.execute('CREATE SCHEMA a', 'CREATE SCHEMA "a-b"',
               "CREATE TABLE a.y (id int8 PRIMARY KEY)",
               'CREATE TABLE "a-b".x (id int8 PRIMARY KEY)',
               f'CREATE PUBLICATION {db.publication} FOR TABLE a.y, "a-b".x')
    with closing(psycopg2.connect(db.dsn)) as conn, conn.cursor() as cur:
        names = [t.relation.table for t in published_tables(cur, db.publication)]
    assert names == ["a-b.x", "a.y"]


def test_a_slot_dropped_mid_snapshot_stops_the_source(db: SourceDb) -> None:
    preload(db)
    source = db.open(snapshot_mode="initial", chunk_rows=10)
    [chunk] = collect(source, 1)
    source.close()
    drop_slot(db.dsn, db.slot)
    with pytest.raises(SourceError, match="is gone while the initial snapshot is incomplete"):
        db.open(start_after=chunk.position)


def test_a_new_snapshot_of_empty_tables_still_empties_them(db: SourceDb) -> None:
    [tx, _marker] = drain(db.open(snapshot_mode="initial"), db)
    assert [(c.op, c.table) for c in tx.changes] == [
        ("truncate", "public.accounts"), ("truncate", "public.notes")]
    assert is_snapshot_position(tx.position)


def test_a_new_connector_recreates_a_leftover_slot(db: SourceDb) -> None:
    preload(db)
    db.open(snapshot_mode="initial").close()  # died before committing a chunk
    db.execute("DELETE FROM notes WHERE id <= 5")  # not streamed by the new slot
    again = drain(db.open(snapshot_mode="initial"), db)
    assert apply({}, again)["public.notes"] == notes(db)
    # "never": the existing slot streams, no snapshot: the next marker is all there is.
    db.sources[-1].ack(again[-1].position)
    eventually(lambda: confirmed_flush(db) == again[-1].position, 10, "the acknowledgement")
    for source in db.sources:
        source.close()
    [marker] = drain(db.open(snapshot_mode="never"), db)
    assert not is_snapshot_position(marker.position)


def test_translate_truncate_supersedes_earlier_rows_and_keeps_later_ones() -> None:
    table = TableRecord(1, 1, "shop", "notes", 7, (
        ColumnRecord(1, "id", "int32", 0, 0), ColumnRecord(2, "body", "string", 1, None)))
    tables = TableMap("shop", lambda _schema, name: table if name == "notes" else None)
    topology = Topology(("a:1", "b:1"), 4)
    changes = (RowChange("public.notes", "insert", None, {"id": 1, "body": "gone"}),
               RowChange("public.notes", "truncate", None, None),
               RowChange("public.notes", "insert", None, {"id": 2, "body": "kept"}),
               RowChange("public.notes", "truncate", None, None),
               RowChange("public.notes", "insert", None, {"id": 3, "body": "kept too"}))
    rows = translate(SourceTransaction("0/1", "9", 0, changes), tables, topology)
    assert [(r.op, r.vnode, r.key) for r in rows[:4]] == [(TRUNCATE, v, b"") for v in range(4)]
    assert [(r.op, r.values) for r in rows[4:]] == [
        (REPLACE, (encode_value("int32", 3), encode_value("string", "kept too")))]
    assert [r.seq for r in rows] == list(range(5))
    # As requests: the flag on the first TableUpdateData of each (ts, table, vnode).
    [request] = requests("shop", {"notes": table}, [replace(r, ts=5) for r in rows])
    assert sorted(t.virtual_node_id for t in request.table_update_data if t.truncate) == \
        [0, 1, 2, 3]
    assert sum(len(t.insert_data) + row_count(t.insert_rows_arrow)
               for t in request.table_update_data if t.truncate) == 1


# --- schema changes during a snapshot ---------------------------------------
ACCOUNTS = [("id", "int64"), ("name", "string"), ("balance", "decimal(12,2)"),
            ("active", "boolean"), ("born", "date32"), ("updated", "timestamp_us"),
            ("blob", "binary"), ("score", "float64"), ("seen", "timestamp_us"),
            ("tag", "string"), ("n", "int32"), ("small", "int32"), ("ratio", "float32"),
            ("code", "string"), ("ref", "string")]
NOTES = [("id", "int32"), ("body", "string"), ("flag", "int32")]


def retina_tables(catalog: Catalog) -> TableMap:
    """The Retina tables of the source's published tables, as created before the snapshot,
    with schema evolution on (as the connector runs)."""
    catalog.create_schema("shop")
    for name, columns in (("accounts", ACCOUNTS), ("notes", NOTES)):
        catalog.create_table("shop", name, [ColumnSpec(n, t) for n, t in columns], ["id"])
    return TableMap("shop", catalog.get_table, add_column=catalog.add_column)


def test_a_resumed_snapshot_adds_columns_added_since(db: SourceDb, catalog: Catalog) -> None:
    """The resumed snapshot reads the tables as they are now: each chunk carries its
    table's columns, and the Retina table follows before the chunk's rows are read."""
    tables, topology = retina_tables(catalog), Topology(("a:1",), 2)
    preload(db)
    first = db.open(snapshot_mode="initial", chunk_rows=10)
    done = collect(first, 2)  # accounts, and notes 1..10
    first.close()
    for tx in done:
        translate(tx, tables, topology)
    [accounts] = done[0].schemas  # as a Relation message has them: numeric(p,s) included
    assert {c.name: c.source_type for c in accounts.columns}["balance"] == "numeric(12,2)"
    db.execute("ALTER TABLE notes ADD COLUMN label text", "UPDATE notes SET label = 'l' || id")
    rest = drain(db.open(start_after=done[-1].position, chunk_rows=10), db)
    assert rest[0].changes[0].after == {"id": 11, "body": "n11", "flag": 11, "label": "l11"}
    for tx in rest:  # without the chunk's columns: "unknown column(s) ['label']"
        translate(tx, tables, topology)
    assert [(c.name, c.type) for c in catalog.get_table("shop", "notes").columns] == [
        *NOTES, ("label", "string")]


def test_a_column_dropped_during_the_snapshot_stops_it(db: SourceDb) -> None:
    """Dropped after the exported snapshot read the table's columns: reading the
    table stops the source with an unsupported schema change (exit 6), not a crash."""
    preload(db)
    source = db.open(snapshot_mode="initial", chunk_rows=10)
    [accounts] = collect(source, 1)
    assert accounts.changes[-1].table == "public.accounts"
    db.execute("ALTER TABLE notes DROP COLUMN flag")
    with pytest.raises(UnsupportedSchemaChange,
                       match=r"public\.notes: column\(s\) \['flag'\] dropped or renamed"):
        collect(source, 1)


def test_a_column_dropped_before_a_resumed_snapshot_stops_it(db: SourceDb,
                                                             catalog: Catalog) -> None:
    tables, topology = retina_tables(catalog), Topology(("a:1",), 2)
    preload(db)
    first = db.open(snapshot_mode="initial", chunk_rows=10)
    done = collect(first, 2)
    first.close()
    db.execute("ALTER TABLE notes DROP COLUMN flag")
    [chunk] = collect(db.open(start_after=done[-1].position, chunk_rows=10), 1)
    with pytest.raises(UnsupportedSchemaChange, match="column flag was dropped or renamed"):
        translate(chunk, tables, topology)


def test_an_unchanged_toast_value_of_a_dropped_column_stops_the_source(db: SourceDb) -> None:
    db.execute("ALTER TABLE notes ALTER COLUMN body SET STORAGE EXTERNAL")
    [(text,)] = db.query("SELECT string_agg(md5(random()::text), '') "
                         "FROM generate_series(1, 3200)")
    db.execute(("INSERT INTO notes VALUES (1, %s, 0)", (text,)))
    # read-source: the unchanged value is read at commit (keep-current reads nothing: the
    # drop then stops the connector at the next Relation, through schema following).
    source = db.open(unchanged_toast="read-source")
    # The update leaves body alone; the column is gone when the source reads it.
    db.execute("UPDATE notes SET flag = 1 WHERE id = 1")
    db.execute("ALTER TABLE notes DROP COLUMN body")
    with pytest.raises(UnsupportedSchemaChange,
                       match=r"public\.notes: column\(s\) \['body'\] dropped or renamed"):
        collect(source, 1)


# --- end to end ------------------------------------------------------------
@pytest.fixture
def make_cdc(tmp_path: Path, etcd: EtcdStore, catalog: Catalog, catalog_dsn: str,
             pg_server: PostgresInstance) -> Iterator[Callable[..., CdcPlane]]:
    made: list[CdcPlane] = []

    def make(retina: dict[str, object] | None = None, **settings: object) -> CdcPlane:
        plane = DataPlane(tmp_path / "plane", etcd, catalog, catalog_dsn, nodes=2,
                          retina={"block_rows": 16, "blocks_per_file": 2,
                                  "flush_interval_ms": 200, **(retina or {})})
        plane.start(recover=False)  # the connector drives both nodes to READY
        made.append(CdcPlane(plane, WorkloadDb(pg_server), tmp_path, **settings))
        return made[-1]

    yield make
    for cdc in made:
        cdc.cdc.kill9()
        cdc.plane.stop(kill=True)
        assert cdc.source is not None
        cdc.source.drop()


def load_orders(source: WorkloadDb, count: int, note: str = "NULL") -> None:
    with source.connect() as conn, conn, conn.cursor() as cur:
        cur.execute(f"INSERT INTO orders SELECT g, 'c' || g %% 50, g / 100.0, {note} "
                    f"FROM generate_series(%s, %s) g", (source.next_id, source.next_id + count - 1))
    source.next_id += count


def sql(source: WorkloadDb, *statements: str) -> None:
    with source.connect() as conn, conn, conn.cursor() as cur:
        for statement in statements:
            cur.execute(statement)


def test_snapshot_with_concurrent_writes_equals_the_source(
        make_cdc: Callable[..., CdcPlane]) -> None:
    cdc = make_cdc(snapshot_chunk_rows=150)
    assert cdc.source is not None
    load_orders(cdc.source, 2000)
    cdc.source.run(30)
    cdc.cdc.start()
    with cdc.source.background(120):  # before, during and after the snapshot
        eventually(lambda: cdc.cdc.logged("cdc_snapshot_done"), 90, "the snapshot to end")
    cdc.converged(timeout_s=90)
    [done] = cdc.cdc.logged("cdc_snapshot_done")
    assert done["rows"] >= 2000


@pytest.mark.parametrize("point", ["cdc.changelog.record.after=exit(137)@1",
                                   "cdc.position.store.after=exit(137)@4",
                                   "cdc.commit.after=exit(137)@4"])
def test_connector_killed_mid_snapshot_then_restarted(make_cdc: Callable[..., CdcPlane],
                                                      point: str) -> None:
    """@1: before any chunk is committed (the restart recreates the slot and
    starts over); @4: after four committed chunks (the restart resumes). A column is
    added while it is down: the restarted snapshot reads it, and the Retina table
    follows (a new snapshot, and a resumed one, read the tables as they are now).
    Chunks after the first go through the bulk load path; ``cdc.commit.after@4`` kills
    the connector after the fourth chunk's timestamp committed (its rows loaded on the
    nodes) and before its position is stored: the resumed snapshot reads that chunk
    again, the nodes refuse its keys (live), and it falls back to the ordinary path,
    landing exactly once."""
    cdc = make_cdc(snapshot_chunk_rows=100, batch_max_transactions=1)
    assert cdc.source is not None
    load_orders(cdc.source, 1500)
    cdc.source.run(20)
    cdc.cdc.start(point)
    assert cdc.cdc.wait_exit(90) == 137, cdc.cdc.log_tail()
    sql(cdc.source, "ALTER TABLE orders ADD COLUMN tag text",
        "UPDATE orders SET tag = 't' || id WHERE id % 3 = 0")
    cdc.source.run(40)  # while it is down: inserts, updates, deletes, key changes
    cdc.cdc.start()
    cdc.source.run(20)
    cdc.converged(timeout_s=90)
    resumed = bool(cdc.cdc.logged("cdc_snapshot_resume"))
    recreated = bool(cdc.cdc.logged("cdc_snapshot_slot_recreated"))
    assert (resumed, recreated) == ((True, False) if point.endswith("@4") else (False, True))
    assert any(r["tag"] for r in cdc.actual()["orders"].values())
    assert any("bulk_files" in e for e in cdc.cdc.logged("cdc_batch_committed")), \
        "snapshot chunks went through the bulk load path"
    if point.startswith("cdc.commit.after"):
        assert cdc.cdc.logged("cdc_snapshot_bulk_fallback"), cdc.cdc.log_tail()


def test_truncate_then_inserts_in_the_same_and_later_transactions(
        make_cdc: Callable[..., CdcPlane]) -> None:
    # No checkpoint while the test runs: the restarted node replays from before the
    # TRUNCATEs.
    cdc = make_cdc(retina={"checkpoint_interval_ms": 3_600_000})
    assert cdc.source is not None
    cdc.cdc.start()
    eventually(cdc.all_ready, 60, "both nodes READY")
    cdc.source.run(40)
    cdc.converged()
    sql(cdc.source, "INSERT INTO orders VALUES (100000, 'gone', 1, NULL)",
        "TRUNCATE orders, events",
        "INSERT INTO orders VALUES (100001, 'kept', 2, 'same tx')",
        "INSERT INTO events VALUES (1, 1, '\\x01', true)")
    sql(cdc.source, "INSERT INTO orders VALUES (100002, 'later', 3, NULL)")
    cdc.source.run(20)
    sql(cdc.source, "TRUNCATE events")
    cdc.source.run(20)
    cdc.converged()
    # A recovering node replays the TRUNCATEs from the changelog.
    victim = cdc.plane.nodes[0]
    cdc.plane.retinas[victim].kill9()
    cdc.plane.retinas[victim].start()
    cdc.source.run(10)
    cdc.converged(timeout_s=90)
    changelog = Changelog(cdc.cdc.settings["changelog_root"])
    vnodes = {ref.vnode for record in changelog.records() for ref in record.segments}
    truncated = [row.ts for row in changelog.read(dict.fromkeys(vnodes, changelog.retained_from()))
                 if row.op == TRUNCATE and row.table == "events"]
    replay_from = cdc.plane.status(victim).node_replay_from_ts
    assert 0 <= replay_from <= min(truncated), (replay_from, sorted(set(truncated)))


def test_unchanged_toast_values_keep_their_value(make_cdc: Callable[..., CdcPlane]) -> None:
    cdc = make_cdc()
    assert cdc.source is not None
    big = ("(SELECT string_agg(md5(g::text || i::text || random()::text), '') "
           "FROM generate_series(1, 3200) AS s(i))")  # ~100 kB, per row (g: the row's id)
    sql(cdc.source, "ALTER TABLE orders ALTER COLUMN note SET STORAGE EXTERNAL")
    load_orders(cdc.source, 3, big)  # read by the snapshot
    cdc.cdc.start()
    eventually(cdc.all_ready, 60, "both nodes READY")
    load_orders(cdc.source, 3, big)  # streamed
    cdc.converged()
    sql(cdc.source, "UPDATE orders SET amount = amount + 1",  # every note left alone
        "UPDATE orders SET customer = 'moved', id = id + 1000 WHERE id = 2")
    sql(cdc.source, "UPDATE orders SET customer = 'x' WHERE id = 5",
        "UPDATE orders SET amount = 0 WHERE id = 5")
    cdc.converged()
    held = [r["note"] for r in cdc.actual()["orders"].values()]  # Retina's gated snapshot
    assert len(held) == 6 and all(len(n) == 3200 * 32 for n in held)
