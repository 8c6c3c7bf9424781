"""Schema evolution: a source ``ALTER TABLE ... ADD COLUMN`` (nullable) evolves the Retina
table end to end; any other schema change stops the connector (exit 6) having applied
nothing of the offending transaction.

The catalog operation and the connector's comparison are pinned by pure tests; the data
plane's handling of rows of several schema versions, readers, Storage GC rewrites and
restarts by tests against real processes (etcd, PostgreSQL, TransServer, Retina, and a
real ``retina-cdc`` on a real pgoutput slot).
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pyarrow as pa
import pytest

from cdc_client.schema_change import (
    NUMERIC,
    ColumnFacts,
    SourceColumn,
    SourceSchema,
    UnsupportedSchemaChange,
    pg_column_facts,
    pg_column_fits,
    plan,
)
from devtools.cluster import PostgresInstance
from retina_common import exit_codes
from retina_common.catalog import (
    AlreadyExists,
    Catalog,
    ColumnSpec,
    InvalidCatalogArgument,
    NotFound,
    TableRecord,
)
from retina_common.client import TableWriter
from retina_common.codec import COMMIT_TS
from retina_common.etcd import EtcdStore
from retina_common.pb import retina_pb2 as rpb
from retina_common.pb import trans_pb2 as tpb
from retina_common.storage import open_parquet
from retina_common.topology import Topology
from retina_server.index import LocalIndexService
from retina_server.node import BufferSettings, RetinaNode
from retina_server.write_buffer import SettleMode
from spark_jobs import storage_gc_task as spark_gc
from spark_jobs.common import FileRef

from . import gc
from .cdc import CdcPlane, SourceDb
from .dataplane import SCHEMA, DataPlane
from .support import ROOT, eventually


# --- the catalog operation ---------------------------------------------------------------------
@pytest.mark.integration
def test_add_column_appends_a_nullable_column_once(catalog: Catalog) -> None:
    catalog.create_schema("evo")
    created = catalog.create_table("evo", "t", [ColumnSpec("id", "int64"),
                                                ColumnSpec("v", "string")], ["id"])
    assert created.schema_version == 1 and created.original_width == 2

    table = catalog.add_column("evo", "t", "note", "String")
    assert [(c.name, c.type, c.since_version, c.pk_position) for c in table.columns] == [
        ("id", "int64", 1, 0), ("v", "string", 1, None), ("note", "string", 2, None)]
    assert table.schema_version == 2 and table.primary_key == ("id",)
    assert catalog.get_table("evo", "t") == table
    # Idempotent: a retry after a lost COMMIT, or a restarted connector, changes nothing.
    assert catalog.add_column("evo", "t", "note", "string") == table
    table = catalog.add_column("evo", "t", "amount", "decimal(12,2)")
    assert table.schema_version == 3 and [c.name for c in table.columns][-1] == "amount"
    assert table.accepts_width(2) and table.accepts_width(3) and table.accepts_width(4)
    assert not table.accepts_width(1) and not table.accepts_width(5)

    refusals: list[tuple[Callable[[], Any], type[Exception], str]] = [
        (lambda: catalog.add_column("evo", "t", "flag", "boolean", nullable=False),
         InvalidCatalogArgument, "only a nullable column"),
        (lambda: catalog.add_column("evo", "t", "note", "int64"), AlreadyExists,
         "already has a column note of type string, not int64"),
        (lambda: catalog.add_column("evo", "t", "x", "uuid"), InvalidCatalogArgument,
         "unknown column type"),
        (lambda: catalog.add_column("evo", "t", "bad name", "string"), InvalidCatalogArgument,
         "bad column name"),
        (lambda: catalog.add_column("evo", "nope", "x", "string"), NotFound,
         "does not exist"),
    ]
    for call, error, message in refusals:
        with pytest.raises(error, match=message):
            call()
    assert catalog.get_table("evo", "t") == table  # every refusal changed nothing


@pytest.mark.integration
def test_add_column_command(catalog: Catalog, catalog_dsn: str, tmp_path: Path) -> None:
    catalog.create_schema("evo")
    catalog.create_table("evo", "t", [ColumnSpec("id", "int64")], ["id"])
    config = tmp_path / "retina.toml"
    config.write_text(f'[catalog]\ndsn = "{catalog_dsn}"\n')

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "retina_common.catalog.cli", "--config",
                               str(config), *args], capture_output=True, text=True, cwd=ROOT,
                              timeout=60, check=False)

    added = run("add-column", "evo", "t", "note", "string")
    assert added.returncode == 0, added.stderr
    assert json.loads(added.stdout)["schema_version"] == 2
    refused = run("add-column", "evo", "t", "note", "int32")
    assert refused.returncode == 1 and "already has a column note" in refused.stderr
    shown = json.loads(run("show-table", "evo", "t").stdout)
    assert [c["name"] for c in shown["columns"]] == ["id", "note"]


# --- the connector's comparison (pure) ---------------------------------------------------------
def _table(*columns: tuple[str, str, int], pk: tuple[str, ...] = ("id",)) -> TableRecord:
    from retina_common.catalog.model import ColumnRecord

    return TableRecord(1, 1, "shop", "orders", 1, tuple(
        ColumnRecord(i, name, type_name, i, pk.index(name) if name in pk else None, since)
        for i, (name, type_name, since) in enumerate(columns)),
        schema_version=max(c[2] for c in columns))


def _source(*columns: tuple[str, str, tuple[str, ...], bool],
            facts: dict[str, ColumnFacts] | None = None, full: bool = False) -> SourceSchema:
    return SourceSchema("public.orders", tuple(SourceColumn(*c) for c in columns), not full,
                        lambda: facts or {})


ID = ("id", "bigint", ("int64",), True)
NOTE = ("note", "text", ("string",), False)
RETINA = _table(("id", "int64", 1), ("note", "string", 1))
NULLABLE = ColumnFacts(nullable=True, has_default=False)


def test_plan_adds_new_nullable_columns_and_accepts_unchanged_tables() -> None:
    assert plan(_source(ID, NOTE), RETINA) == []
    tag = ("tag", "numeric(10,2)", ("decimal(10,2)",), False)
    facts = {"id": ColumnFacts(False, False), "note": NULLABLE, "tag": NULLABLE}
    assert plan(_source(ID, NOTE, tag, facts=facts), RETINA) == [("tag", "decimal(10,2)")]
    # An int4 source column fits an int64 Retina column; a wider decimal holds numeric(10,2).
    assert plan(_source(("id", "integer", ("int32", "int64"), True), NOTE), RETINA) == []
    evolved = _table(("id", "int64", 1), ("note", "string", 1), ("tag", "decimal(12,2)", 2))
    assert plan(_source(ID, NOTE, tag, facts=facts), evolved) == []
    # A re-delivered transaction decoded with the relation from before the ADD COLUMN.
    assert plan(_source(ID, NOTE, facts=facts), evolved) == []


@pytest.mark.parametrize(("source", "table", "message"), [
    (_source(ID), RETINA, "column note was dropped or renamed"),
    (_source(ID, ("note", "integer", ("int32", "int64"), False)), RETINA,
     "column note changed type: the source sends integer"),
    (_source(ID, ("note", "text", ("string",), True)), RETINA, "primary key changed"),
    (_source(ID, NOTE, ("flag", "boolean", ("boolean",), False),
             facts={"flag": ColumnFacts(False, False)}), RETINA, "flag is NOT NULL"),
    (_source(ID, NOTE, ("flag", "boolean", ("boolean",), False),
             facts={"flag": ColumnFacts(True, True)}), RETINA, "flag has a default"),
    (_source(ID, NOTE, ("n", "numeric", (), False), facts={"n": NULLABLE}), RETINA,
     "has no Retina column type"),
    (_source(ID, NOTE, ("gone", "text", ("string",), False)), RETINA,
     "no longer in the source table"),
    # Names the catalog refuses: a quoted source identifier, a space, non-ASCII.
    (_source(ID, NOTE, ("order-date", "text", ("string",), False),
             facts={"order-date": NULLABLE}), RETINA, "'order-date' cannot be a Retina column"),
    (_source(ID, NOTE, ("due at", "text", ("string",), False), facts={"due at": NULLABLE}),
     RETINA, "'due at' cannot be a Retina column"),
    (_source(ID, NOTE, ("größe", "text", ("string",), False), facts={"größe": NULLABLE}),
     RETINA, "cannot be a Retina column"),
    # Added by evolution, and gone from the source now: dropped after it was added.
    (_source(ID, NOTE), _table(("id", "int64", 1), ("note", "string", 1), ("t", "string", 2)),
     "column t was dropped or renamed"),
])
def test_plan_refuses_every_other_change(source: SourceSchema, table: TableRecord,
                                         message: str) -> None:
    with pytest.raises(UnsupportedSchemaChange, match=message) as err:
        plan(source, table)
    assert "public.orders" in str(err.value) and "shop.orders" in str(err.value)


def _numeric_typmod(precision: int, scale: int) -> int:
    """PostgreSQL 15's atttypmod of numeric(precision, scale): scale as 11 signed bits."""
    return ((precision << 16) | (scale & 0x7FF)) + 4


@pytest.mark.parametrize(("precision", "scale", "fits"), [
    (10, 2, ("decimal(10,2)",)),
    (38, 0, ("decimal(38,0)",)),
    (5, 5, ("decimal(5,5)",)),
    (39, 2, ()),  # wider than a Retina decimal
    (5, -2, ()),  # PostgreSQL 15: rounds to hundreds
    (2, 4, ()),  # PostgreSQL 15: scale above precision
])
def test_numeric_columns_fit_only_a_decimal_retina_can_hold(
        precision: int, scale: int, fits: tuple[str, ...]) -> None:
    assert pg_column_fits(NUMERIC, _numeric_typmod(precision, scale)) == fits
    assert pg_column_fits(NUMERIC, -1) == ()  # unconstrained numeric


def test_replica_identity_full_does_not_read_as_a_key_change() -> None:
    full = _source(("id", "bigint", ("int64",), True), ("note", "text", ("string",), True),
                   full=True)
    assert plan(full, RETINA) == []


@pytest.mark.integration
def test_a_column_whose_old_rows_read_a_dropped_default_is_refused(
        pg_server: PostgresInstance) -> None:
    """ADD COLUMN ... DEFAULT 5 then DROP DEFAULT before the connector gets there: the
    source's older rows still read 5 (attmissingval); Retina's would read NULL."""
    source = SourceDb(pg_server)
    try:
        _sql(source, "INSERT INTO orders (id, customer) VALUES (1, 'before')")
        _sql(source, "ALTER TABLE orders ADD COLUMN five int DEFAULT 5",
             "ALTER TABLE orders ALTER COLUMN five DROP DEFAULT",
             "ALTER TABLE orders ADD COLUMN plain int",
             "ALTER TABLE orders ADD COLUMN later int",  # old rows NULL, default set after
             "ALTER TABLE orders ALTER COLUMN later SET DEFAULT 7")
        assert [r["five"] for r in source.rows("orders")] == [5]
        with source.connect() as conn, conn.cursor() as cur:
            cur.execute("SELECT 'public.orders'::regclass::oid")
            oid = cur.fetchone()[0]
        facts = pg_column_facts(source.dsn, oid)
        assert facts["five"] == ColumnFacts(nullable=True, has_default=False, has_missing=True)

        def schema(column: str) -> SourceSchema:
            return SourceSchema("public.orders", (SourceColumn(*ID), SourceColumn(*NOTE),
                                                  SourceColumn(column, "integer",
                                                               ("int32", "int64"), False)),
                                True, lambda: facts)

        with pytest.raises(UnsupportedSchemaChange, match="five was added with a default"):
            plan(schema("five"), RETINA)
        # Conservative: a default set after the ADD leaves old rows NULL, but is refused.
        with pytest.raises(UnsupportedSchemaChange, match="later has a default"):
            plan(schema("later"), RETINA)
        assert plan(schema("plain"), RETINA) == [("plain", "int32")]
    finally:
        source.drop()


# --- the node's table cache and streams --------------------------------------------------------
class HeldCatalog:
    """A real catalog whose next get_table, once armed, reads and then waits for
    release: a lookup that read the table before a change and returns after it."""

    def __init__(self, catalog: Catalog) -> None:
        self._catalog = catalog
        self.armed = False
        self.reached = threading.Event()
        self.release = threading.Event()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._catalog, name)

    def get_table(self, schema_name: str, table_name: str) -> TableRecord:
        table = self._catalog.get_table(schema_name, table_name)
        if self.armed:
            self.armed = False
            self.reached.set()
            assert self.release.wait(30)
        return table


class FirstLookupMisses(dict):
    """The node's stream map, whose first get() answers None: the stream was created
    by a concurrent request between a lookup and the next."""

    def __init__(self, streams: dict) -> None:
        super().__init__(streams)
        self.missed = False

    def get(self, key: Any, default: Any = None) -> Any:
        if not self.missed:
            self.missed = True
            return default
        return super().get(key, default)


@pytest.mark.integration
def test_the_node_never_goes_back_to_an_older_schema_version(
        tmp_path: Path, catalog: Catalog) -> None:
    catalog.create_schema("evo")
    v1 = catalog.create_table("evo", "t", [ColumnSpec("id", "int64")], ["id"])
    held = HeldCatalog(catalog)
    node = RetinaNode("127.0.0.1:1", Topology(("127.0.0.1:1",), 4),
                      held,  # type: ignore[arg-type]
                      LocalIndexService(tmp_path / "index"), f"file://{tmp_path}/data",
                      BufferSettings(block_rows=8, blocks_per_file=2), lambda: 0)
    try:
        # A lookup reads v1; the column is added and a wider row caches v2; then the slow
        # lookup returns: it must not put v1 back.
        held.armed = True
        slow = threading.Thread(target=node.table, args=("evo", "t"))
        slow.start()
        assert held.reached.wait(30)
        v2 = catalog.add_column("evo", "t", "note", "string")
        assert node.refresh_table("evo", "t") == v2
        held.release.set()
        slow.join(30)
        assert node.table("evo", "t") == v2

        # Rows buffered at v2 read with their new column (the reader's record is v2).
        stream = node.stream(v2, 0)
        batch = pa.RecordBatch.from_arrays(
            [pa.array([1], pa.int64()), pa.array(["n"]), pa.array([1], pa.int64())],
            schema=stream.schema)
        with stream.buffer.lock:
            stream.buffer.settle(stream.buffer.append_pending(
                batch, 1, node.index.allocate_row_ids(1)), SettleMode.VISIBLE)
        assert node.write_buffer_rows(node.table("evo", "t"), 1).column(
            "note").to_pylist() == ["n"]

        # A v2 request looks for the stream and finds none; a v1 request creates it right
        # then (modelled by a first lookup that misses a stream created just before):
        # the v2 request must still get the stream at v2, as it builds rows of v2.
        node.stream(v1, 1)
        node._streams = FirstLookupMisses(node._streams)
        assert node.stream(v2, 1).schema.names == ["id", "note", COMMIT_TS]
        assert node.stream(v1, 1).table == v2  # and an older request never takes it back
    finally:
        node.pipeline.shutdown()
        node.index.close()


# --- the data plane: rows of several schema versions -------------------------------------------
def _order(i: int, tag: str | None = None, *, evolved: bool = False) -> dict[str, Any]:
    row: dict[str, Any] = {"id": i, "customer": f"c{i}", "amount": None, "note": None}
    if evolved:
        row["tag"] = tag
    return row


@pytest.mark.integration
def test_retina_takes_rows_of_every_schema_version(
        make_plane: Callable[..., DataPlane], catalog_dsn: str) -> None:
    dp = make_plane(nodes=1, block_rows=2, blocks_per_file=1)  # streams of several files
    dp.commit({"orders": {"inserts": [_order(i) for i in range(1, 21)]}})
    old_writer = dp.writers["orders"]
    evolved = dp.catalog.add_column(SCHEMA, "orders", "tag", "string")
    # The node learns the column from the first row that carries it; no restart.
    dp.writers["orders"] = TableWriter(evolved, dp.topology, min_columnar_rows=1)
    dp.commit({"orders": {"inserts": [_order(i, f"t{i}" if i % 2 else None, evolved=True)
                                      for i in range(21, 41)],
                          "replaces": [_order(3, "set later", evolved=True)]}})
    # A row encoded for the old version (a changelog entry replayed across the change).
    dp.writers["orders"] = old_writer
    dp.commit({"orders": {"replaces": [_order(22)]}})
    dp.writers["orders"] = TableWriter(evolved, dp.topology, min_columnar_rows=1)

    def expected() -> dict[int, str | None]:
        out: dict[int, str | None] = {i: None for i in range(1, 41)}
        out.update({i: f"t{i}" for i in range(21, 41) if i % 2})
        out[3], out[22] = "set later", None
        return out

    def tags() -> dict[int, str | None]:
        rows = dp.read("orders")
        assert all(set(r) == {"id", "customer", "amount", "note", "tag"} for r in rows.values())
        return {r["id"]: r["tag"] for r in rows.values()}

    assert tags() == expected()
    # 42 physical rows: 40 inserts and two replacing versions (of ids 3 and 22).
    eventually(lambda: gc.regular_rows(dp, "orders") == 42, 30,
               "every row to be published in files")
    assert tags() == expected()  # old files (no tag column) and new ones

    # A row narrower than any schema version, or wider than the catalog's, is refused.
    request = TableWriter(evolved, dp.topology, columnar=False).updates(
        10**12, inserts=[_order(99, "x", evolved=True)])
    tud = next(iter(request.values()))[0]
    for width in (3, 6):
        del tud.insert_data[0].col_values[:]
        tud.insert_data[0].col_values.extend([b"\x00" * 8] + [b""] * (width - 1))
        with pytest.raises(grpc.RpcError) as err:
            dp.retinas[dp.nodes[0]].stub.UpdateRecord(
                rpb.UpdateRecordRequest(schema_name=SCHEMA, table_update_data=[tud]),
                timeout=10)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert f"has {width} values for 4 to 5 columns" in err.value.details()

    # A restart reads the catalog afresh; old and new files read the same.
    node = dp.nodes[0]
    dp.retinas[node].kill9()
    dp.retinas[node].start()
    dp.recover(node)
    assert tags() == expected()

    # A column added between a Storage GC prepare and its rewrite task: the task writes
    # the columns of the prepare's schema version, which the commit holds it to.
    (vnode, files), *_ = [(v, f) for (_n, v), f in gc.streams(dp, "orders").items()
                          if len(f) >= 2]
    prepared = gc.prepare(dp, node, "orders", vnode, files)
    try:
        assert prepared.reply.schema_version == 2
        dp.catalog.add_column(SCHEMA, "orders", "late", "int64")
        reply = prepared.reply
        result = spark_gc.rewrite_group(
            spark_gc.TaskSpec(catalog_dsn, 5, prepared.trans_id, 16),
            spark_gc.RewriteTask(0, reply.rewrite_id, node, f"{SCHEMA}.orders", vnode,
                                 tuple(FileRef(f.file_id, f.name, reply.path_uri)
                                       for f in files), 0, reply.file_name, reply.path_id,
                                 reply.path_uri, reply.cutoff_ts, reply.expected_rows,
                                 reply.schema_version))
        assert not result.error, result.error
        assert open_parquet(reply.path_uri, reply.file_name).schema_arrow.names[-2:] == [
            "tag", COMMIT_TS]
        assert gc.commit(dp, prepared, result.new_file_id).outcome
    finally:
        gc.end(dp, prepared.trans_id)
    assert {r["id"]: r["tag"] for r in dp.read("orders").values()} == expected()


# --- end to end: a real source, a real connector -----------------------------------------------
@pytest.fixture
def cdc_plane(tmp_path: Path, etcd: EtcdStore, catalog: Catalog, catalog_dsn: str,
              pg_server: PostgresInstance) -> Iterator[CdcPlane]:
    # No periodic checkpoint: a recovered node replays from the checkpoint taken when it
    # went READY, before any row, so its replay spans every schema version.
    plane = DataPlane(tmp_path / "plane", etcd, catalog, catalog_dsn, nodes=2,
                      retina={"block_rows": 16, "blocks_per_file": 2, "flush_interval_ms": 200,
                              "checkpoint_interval_ms": 3_600_000})
    plane.start(recover=False)  # the connector drives both nodes to READY
    source = SourceDb(pg_server)
    cdc = CdcPlane(plane, source, tmp_path)
    yield cdc
    cdc.cdc.terminate()
    plane.stop()
    source.drop()


def _sql(source: SourceDb, *statements: str) -> None:
    """One source transaction."""
    with source.connect() as conn, conn, conn.cursor() as cur:
        for statement in statements:
            cur.execute(statement)


def _spark_rewrite(cdc: CdcPlane, catalog_dsn: str) -> int:
    """Storage GC of every orders stream with two or more files, with the Spark job's own
    rewrite task run in-process (no JVM): rows of files from before the ADD COLUMN are
    written with the current columns. Returns how many rewrites committed."""
    done = 0
    spec = spark_gc.TaskSpec(catalog_dsn, 5, trans_id=0, row_group_rows=16)
    for (node, vnode), files in gc.streams(cdc.plane, "orders").items():
        if len(files) < 2:
            continue
        prepared = gc.prepare(cdc.plane, node, "orders", vnode, files)
        try:
            reply = prepared.reply
            task = spark_gc.RewriteTask(
                0, reply.rewrite_id, node, f"{SCHEMA}.orders", vnode,
                tuple(FileRef(f.file_id, f.name, reply.path_uri) for f in files), 0,
                reply.file_name, reply.path_id, reply.path_uri, reply.cutoff_ts,
                reply.expected_rows, reply.schema_version)
            result = spark_gc.rewrite_group(
                spark_gc.TaskSpec(spec.catalog_dsn, 5, prepared.trans_id, 16), task)
            assert not result.error, result.error
            names = open_parquet(reply.path_uri, reply.file_name).schema_arrow.names
            assert "tag" in names
            assert gc.commit(cdc.plane, prepared, result.new_file_id).outcome
            done += 1
        finally:
            gc.end(cdc.plane, prepared.trans_id)
    return done


def _hwm(cdc: CdcPlane) -> int:
    """The TransServer's high-water mark now (a read-only transaction's snapshot)."""
    stub = cdc.plane.trans.stub()
    began = stub.BeginTrans(tpb.BeginTransRequest(read_only=True), timeout=10)
    stub.CommitTrans(tpb.CommitTransRequest(trans_id=began.trans_id), timeout=10)
    return began.timestamp


@pytest.mark.integration
def test_add_column_flows_from_the_source_through_restarts_and_gc(
        cdc_plane: CdcPlane, catalog: Catalog, catalog_dsn: str) -> None:
    cdc, source = cdc_plane, cdc_plane.source
    assert source is not None
    # Killed just before the add_column commit: the restarted connector must add it.
    cdc.cdc.start("catalog.add_column.commit.before=exit(137)")
    eventually(cdc.all_ready, 60, "the connector to drive both nodes to READY")
    # A node answers READY before etcd (and so the gate) has it: the read below is gated.
    eventually(cdc.plane.gate_open, 15, "the query gate to admit")
    before_rows = _hwm(cdc)  # every row of the test commits above it
    source.run(30)  # rows before the ALTER
    cdc.converged()
    _sql(source, "ALTER TABLE orders ADD COLUMN tag text")
    _sql(source, "INSERT INTO orders (id, customer, tag) VALUES (100001, 'new', 'tagged')",
         "INSERT INTO orders (id, customer) VALUES (100002, 'new')")
    assert cdc.cdc.wait_exit(60) == 137, cdc.cdc.log_tail()
    assert "tag" not in [c.name for c in catalog.get_table(SCHEMA, "orders").columns]
    # This run adds it, then is killed right after its second add_column commit: the
    # restart must find that column there and go on (the change is idempotent).
    cdc.cdc.start("catalog.add_column.commit.after=exit(137)@2")
    _sql(source, "UPDATE orders SET tag = 'old row, tagged' WHERE id IN "
                 "(SELECT id FROM orders WHERE tag IS NULL ORDER BY id LIMIT 5)")
    cdc.converged()
    rows = cdc.actual()["orders"].values()
    assert sum(r["tag"] is not None for r in rows) == 6 and len(rows) > 20
    _sql(source, "ALTER TABLE orders ADD COLUMN rank int")
    _sql(source, "INSERT INTO orders (id, customer, rank) VALUES (100003, 'ranked', 3)")
    assert cdc.cdc.wait_exit(60) == 137, cdc.cdc.log_tail()
    cdc.cdc.start()
    cdc.converged()
    table = catalog.get_table(SCHEMA, "orders")
    assert [(c.name, c.type, c.since_version) for c in table.columns][-2:] == [
        ("tag", "string", 2), ("rank", "int32", 3)]
    assert table.schema_version == 3
    source.run(20)  # more of the workload (its INSERTs leave tag and rank unset)
    cdc.converged()
    # tag was added (and logged) by the second run; rank by the third, which died before
    # logging it, and the fourth found it there: no second add.
    assert [e["column"] for e in cdc.cdc.logged("cdc_schema_column_added")] == ["tag"]

    # A Retina node killed and recovered: the connector replays changelog entries from
    # every side of the changes (the older ones have a column or two fewer).
    victim = cdc.plane.nodes[1]
    cdc.plane.retinas[victim].kill9()
    source.run(10)
    cdc.plane.retinas[victim].start()
    cdc.converged(timeout_s=90)
    replay_from = cdc.plane.status(victim).node_replay_from_ts
    assert 0 <= replay_from <= before_rows, (replay_from, before_rows)

    # Storage GC rewrites old files (no tag column) into files with the current columns.
    eventually(lambda: any(len(f) >= 2 for f in gc.streams(cdc.plane, "orders").values()), 30,
               "a stream with two published files")
    assert _spark_rewrite(cdc, catalog_dsn) >= 1
    cdc.converged()
    for node in cdc.plane.nodes:  # and a restart of every node after all that
        cdc.plane.retinas[node].kill9()
        cdc.plane.retinas[node].start()
    cdc.converged(timeout_s=90)


@pytest.mark.integration
def test_a_dropped_column_stops_the_connector_before_its_transaction(
        cdc_plane: CdcPlane) -> None:
    cdc, source = cdc_plane, cdc_plane.source
    assert source is not None
    cdc.cdc.start()
    eventually(cdc.all_ready, 60, "the connector to drive both nodes to READY")
    source.run(20)
    cdc.converged()
    before = cdc.expected()
    _sql(source, "ALTER TABLE orders DROP COLUMN note")
    _sql(source, "INSERT INTO orders (id, customer) VALUES (200001, 'after the drop')",
         "DELETE FROM orders WHERE id = (SELECT min(id) FROM orders)")
    assert cdc.cdc.wait_exit(60) == exit_codes.SCHEMA_CHANGE, cdc.cdc.log_tail()
    stopped = cdc.cdc.logged("cdc_stopped_schema_change")
    assert stopped and "public.orders" in stopped[0]["error"]
    assert "column note was dropped or renamed" in stopped[0]["error"]
    cdc.converged(before)  # nothing of the offending transaction was applied
