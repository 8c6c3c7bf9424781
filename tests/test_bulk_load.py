"""Bulk load (retina_server/bulk_load.py, retina_common/bulk_loader.py) against real
processes: the rows a load publishes equal a model through deletes, replaces, restarts
and kills at every failpoint of the path (docs/write-paths/bulk-load.md)."""

from __future__ import annotations

import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from decimal import Decimal
from pathlib import Path
from typing import Any

import grpc
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from retina_common import file_names
from retina_common.bulk_loader import BulkLoader, LoadFailed, LoadRefused
from retina_common.catalog import Catalog, ColumnSpec, FileType
from retina_common.client import TableWriter
from retina_common.etcd import EtcdStore
from retina_common.pb import retina_pb2_grpc as rpb_grpc

from .dataplane import SCHEMA, DataPlane
from .support import eventually

SMALL_FILES = {"block_rows": 64, "blocks_per_file": 2, "flush_interval_ms": 300}


@pytest.fixture
def make_plane(tmp_path: Path, etcd: EtcdStore, catalog: Catalog,
               catalog_dsn: str) -> Iterator[Callable[..., DataPlane]]:
    planes: list[DataPlane] = []

    def make(nodes: int = 2, failpoints: dict[str, str] | None = None,
             **retina: object) -> DataPlane:
        dp = DataPlane(tmp_path, etcd, catalog, catalog_dsn, nodes=nodes,
                       retina={**SMALL_FILES, **retina})
        planes.append(dp)
        return dp.start(failpoints or {})

    yield make
    for dp in planes:
        dp.stop(kill=True)


def order(i: int) -> dict[str, Any]:
    return {"id": i, "customer": f"c{i}", "amount": Decimal(i) / 100, "note": None}


def orders(ids: range | list[int]) -> pa.Table:
    rows = [order(i) for i in ids]
    return pa.table({"id": pa.array([r["id"] for r in rows], pa.int64()),
                     "customer": [r["customer"] for r in rows],
                     "amount": pa.array([r["amount"] for r in rows], pa.decimal128(12, 2)),
                     "note": pa.array([None] * len(rows), pa.string())})


def loader(plane: DataPlane, chunk_rows: int = 1_000) -> BulkLoader:
    """A loader with channels of its own: a node a test restarts gets a new channel in the
    plane, and the loader's retried commit must reach the new process."""
    nodes = {n: rpb_grpc.RetinaWorkerServiceStub(grpc.insecure_channel(n))
             for n in plane.nodes}
    return BulkLoader(SCHEMA, plane.tables["orders"], plane.topology, plane.trans.stub(),
                      nodes, chunk_rows=chunk_rows, row_group_rows=300, timeout_s=60)


def loaded(plane: DataPlane, ids: range | list[int]) -> None:
    """The model: the loaded rows are in the table."""
    writer = plane.writers["orders"]
    for i in ids:
        plane.model.rows["orders"][writer.key(order(i))] = order(i)


def restart(plane: DataPlane, node: str) -> None:
    proc = plane.retinas[node]
    proc.kill9()
    proc.start()
    plane.recover(node)


def load_files(catalog: Catalog, node: str) -> dict[int, FileType]:
    return {f.file_id: f.type for f in catalog.get_files_by_type(None, list(FileType))
            if file_names.parse(f.name).node_id == node}


@pytest.mark.integration
def test_a_load_equals_the_model_through_writes_and_two_restarts(
        make_plane: Callable[..., DataPlane]) -> None:
    plane = make_plane()
    plane.commit({"orders": {"inserts": [order(i) for i in range(5)]}})
    report = loader(plane).load(orders(range(100, 3_100)))
    loaded(plane, range(100, 3_100))
    assert report.rows == 3_000 and report.chunks == 3
    assert plane.read("orders") == plane.model.rows["orders"]
    # Loaded rows take deletes and replaces like any other.
    plane.commit({"orders": {"deletes": [{"id": 100}, {"id": 2_000}],
                             "replaces": [{**order(101), "note": "changed"}]}})
    assert plane.read("orders") == plane.model.rows["orders"]
    # No checkpoint since the load: both restarts re-apply it from its files.
    for node in plane.nodes:
        restart(plane, node)
    assert plane.read("orders") == plane.model.rows["orders"]
    for node in plane.nodes:
        restart(plane, node)
    assert plane.read("orders") == plane.model.rows["orders"]
    # And the node takes writes on those keys exactly once afterwards.
    plane.commit({"orders": {"deletes": [{"id": 101}], "inserts": [order(100)]}})
    assert plane.read("orders") == plane.model.rows["orders"]


@pytest.mark.integration
def test_a_load_of_a_live_key_is_refused_and_changes_nothing(
        make_plane: Callable[..., DataPlane], catalog: Catalog) -> None:
    plane = make_plane(nodes=1)
    plane.commit({"orders": {"inserts": [order(7)]}})
    with pytest.raises(LoadRefused) as err:
        loader(plane).load(orders(range(0, 20)))
    assert "ALREADY_EXISTS" in str(err.value) and "live version" in str(err.value)
    assert plane.read("orders") == plane.model.rows["orders"]
    # A deleted key is free again.
    plane.commit({"orders": {"deletes": [{"id": 7}]}})
    loader(plane).load(orders(range(0, 20)))
    loaded(plane, range(0, 20))
    assert plane.read("orders") == plane.model.rows["orders"]
    del catalog


@pytest.mark.integration
def test_a_load_with_null_in_a_not_null_column_is_refused_and_changes_nothing(
        make_plane: Callable[..., DataPlane], catalog: Catalog) -> None:
    """NOT_NULL_HOLDS for the loader's files: checked from their statistics at the
    commit, INVALID_ARGUMENT, nothing loaded; the same rows with a value load."""
    plane = make_plane(nodes=1)
    table = catalog.create_table(SCHEMA, "strict", [
        ColumnSpec("id", "int64"), ColumnSpec("name", "string", nullable=False)], ["id"])
    plane.tables["strict"] = table
    plane.writers["strict"] = TableWriter(table, plane.topology)
    nodes = {n: rpb_grpc.RetinaWorkerServiceStub(grpc.insecure_channel(n))
             for n in plane.nodes}
    load = BulkLoader(SCHEMA, table, plane.topology, plane.trans.stub(), nodes,
                      chunk_rows=1_000, row_group_rows=300, timeout_s=60)
    names = [f"n{i}" for i in range(50)]
    names[17] = None
    with pytest.raises(LoadRefused) as err:
        load.load(pa.table({"id": pa.array(range(50), pa.int64()), "name": names}))
    assert "NOT NULL column name" in str(err.value)
    assert plane.read("strict") == {}
    names[17] = "n17"
    load.load(pa.table({"id": pa.array(range(50), pa.int64()), "name": names}))
    assert sorted(r["name"] for r in plane.read("strict").values()) == sorted(names)


# A node killed in PrepareBulkLoad is asked again once it is back (the loader retries
# UNAVAILABLE), so the chunk loads; one killed before its journal record forgets the
# prepared load, and the retried commit is refused (NOT_FOUND).
IN_THE_PREPARE = ["load.prepare.catalog.before", "load.prepare.catalog.after"]
BEFORE_THE_JOURNAL = ["load.journal.before"]
AFTER_THE_JOURNAL = ["load.journal.after", "load.index.before", "load.index.after",
                     "load.catalog_regular.before", "load.catalog_regular.after",
                     "load.registry.before", "load.registry.after"]


def load_in_background(plane: DataPlane, ids: range) -> tuple[threading.Thread, list[Any]]:
    """The loader runs in a thread (it retries a commit whose node went away); the
    outcome list gets the report or the error."""
    outcome: list[Any] = []

    def run() -> None:
        try:
            outcome.append(loader(plane, chunk_rows=len(ids)).load(orders(ids)))
        except (LoadFailed, grpc.RpcError) as exc:
            outcome.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, outcome


@pytest.mark.integration
@pytest.mark.parametrize("point", IN_THE_PREPARE + BEFORE_THE_JOURNAL + AFTER_THE_JOURNAL)
def test_a_kill_at_each_load_failpoint(make_plane: Callable[..., DataPlane], catalog: Catalog,
                                       point: str) -> None:
    """The node dies at ``point`` while it loads 500 rows. In the prepare, the loader asks
    again once the node is back and the chunk loads; before the journal record the load
    is gone (the loader's retried commit is refused, its timestamp rolled back, its files
    deleted by cleansing); from the record on it is committed: the restarted node
    re-applies it from its files, and the loader's retried commit is answered from the
    journal. Either way the table equals the model, over one more restart."""
    plane = make_plane(nodes=1)
    node = plane.nodes[0]
    plane.commit({"orders": {"inserts": [order(i) for i in range(10)]}})
    proc = plane.retinas[node]
    proc.kill9()
    proc.start(f"{point}=exit(137)")
    plane.recover(node)
    thread, outcome = load_in_background(plane, range(1_000, 1_500))
    eventually(lambda: not proc.alive(), 60, f"the node to die at {point}")
    proc.start()
    plane.recover(node)
    thread.join(120)
    assert outcome, "the loader finished"
    if point in AFTER_THE_JOURNAL + IN_THE_PREPARE:
        assert not isinstance(outcome[0], Exception), outcome[0]
        loaded(plane, range(1_000, 1_500))
    else:
        assert isinstance(outcome[0], LoadRefused | grpc.RpcError), outcome[0]
        # Cleansing deleted the load's files (it never journaled them); the write
        # buffer's own files publish within the flush interval.
        eventually(lambda: FileType.TEMPORARY_INGEST not in load_files(catalog, node).values(),
                   30, "no TEMPORARY_INGEST file left")
    assert plane.read("orders") == plane.model.rows["orders"]
    restart(plane, node)
    assert plane.read("orders") == plane.model.rows["orders"]
    plane.commit({"orders": {"deletes": [{"id": 1_000}, {"id": 3}],
                             "inserts": [order(1_000)]}})
    assert plane.read("orders") == plane.model.rows["orders"]


@pytest.mark.integration
@pytest.mark.parametrize("point", ["load.reapply.before", "load.reapply.after"])
def test_a_kill_while_recovery_reapplies_a_load(make_plane: Callable[..., DataPlane],
                                                point: str) -> None:
    """A crash while recovery re-applies a load (a crash during another recovery): the
    next start re-applies it again, exactly once."""
    plane = make_plane(nodes=1)
    node = plane.nodes[0]
    loader(plane).load(orders(range(0, 2_000)))
    loaded(plane, range(0, 2_000))
    plane.commit({"orders": {"deletes": [{"id": 5}], "replaces": [{**order(6), "note": "x"}]}})
    proc = plane.retinas[node]
    proc.kill9()
    proc.start(f"{point}=exit(137)@2", wait=False)
    eventually(lambda: not proc.alive(), 60, f"the node to die at {point}")
    proc.start()
    plane.recover(node)
    assert plane.read("orders") == plane.model.rows["orders"]
    restart(plane, node)
    assert plane.read("orders") == plane.model.rows["orders"]


def journal_records(plane: DataPlane, node: str) -> list[Path]:
    directory = Path(plane.workdir, "state", node.replace(":", "-"), "load_journal")
    return sorted(directory.glob("*.ldj"))


@pytest.mark.integration
@pytest.mark.parametrize("point", ["load.promote.before", "load.promote.after"])
def test_a_load_is_promoted_once_both_slots_hold_it(make_plane: Callable[..., DataPlane],
                                                    point: str) -> None:
    """The record stays through one checkpoint (the previous slot does not hold the load)
    and goes at the second; a kill around the removal loses nothing, and the rows come
    from the checkpointed files afterwards, with no record left."""
    plane = make_plane(nodes=1, load_record_min_age_ms=0)
    node = plane.nodes[0]
    proc = plane.retinas[node]
    proc.kill9()
    proc.start(f"{point}=exit(137)")
    plane.recover(node)
    loader(plane).load(orders(range(0, 1_500)))
    loaded(plane, range(0, 1_500))
    assert len(journal_records(plane, node)) == 2
    # A checkpoint at exactly T replays T (starts are inclusive): a later commit moves the
    # high watermark past the load.
    plane.commit({"orders": {"inserts": [order(5_000)]}})
    plane.checkpoint(node)
    assert len(journal_records(plane, node)) == 2, "one slot only: the record stays"
    with pytest.raises(grpc.RpcError):
        plane.checkpoint(node)  # the node dies promoting
    eventually(lambda: not proc.alive(), 30, "the node to die")
    proc.start()
    plane.recover(node)
    assert plane.read("orders") == plane.model.rows["orders"]
    plane.commit({"orders": {"inserts": [order(5_001)]}})
    # The restart re-applied what the crash left unpromoted into the write buffer: its
    # files publish within the flush interval, then two checkpoints hold them.
    eventually(lambda: plane.checkpoint(node) and journal_records(plane, node) == [], 30,
               "the journal records to be promoted")
    restart(plane, node)
    assert plane.read("orders") == plane.model.rows["orders"]


@pytest.mark.integration
def test_retina_load_loads_parquet_files_and_refuses_them_again(
        make_plane: Callable[..., DataPlane], tmp_path: Path) -> None:
    plane = make_plane()
    first, second = tmp_path / "a.parquet", tmp_path / "b.parquet"
    pq.write_table(orders(range(0, 700)), first)
    pq.write_table(orders(range(700, 1_000)).select(["note", "id", "customer", "amount"]),
                   second)  # columns by name, in any order
    cli = [sys.executable, "-m", "retina_common.load_cli", "--config", str(plane.config_path)]
    done = subprocess.run([*cli, "shop.orders", str(first), str(second), "--chunk-rows", "400"],
                          capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    assert "loaded 1000 row(s) into shop.orders in 3 commit(s)" in done.stdout
    loaded(plane, range(0, 1_000))
    assert plane.read("orders") == plane.model.rows["orders"]
    again = subprocess.run([*cli, "shop.orders", str(first)], capture_output=True, text=True,
                           timeout=120, check=False)
    assert again.returncode == 1 and "live version" in again.stderr, again.stderr
    assert plane.read("orders") == plane.model.rows["orders"]
    usage = subprocess.run([*cli, "shop.nope", str(first)], capture_output=True, text=True,
                           timeout=60, check=False)
    assert usage.returncode == 2 and "no table shop.nope" in usage.stderr


@pytest.mark.integration
def test_a_load_of_keys_deleted_since_the_checkpoint_is_reapplied_exactly(
        make_plane: Callable[..., DataPlane], catalog: Catalog) -> None:
    """Keys live in the checkpoint, deleted after it, then loaded; and keys loaded,
    deleted and loaded again. The rewind drops the deletes (they are replayed), so at
    re-application the older rows look live again: the load is re-applied all the same,
    and the replayed deletes land below it. Two restarts in a row, against the model."""
    plane = make_plane(nodes=1)
    node = plane.nodes[0]
    t0, _ = plane.commit({"orders": {"inserts": [order(i) for i in range(0, 40)]}})
    eventually(lambda: FileType.TEMPORARY_INGEST not in load_files(catalog, node).values(),
               30, "the inserts published")
    # Checkpoints apply up to HWM - 1: two commits move it past t0.
    plane.commit({"orders": {"inserts": [order(10_000)]}})
    plane.commit({"orders": {"inserts": [order(10_001)]}})
    assert plane.checkpoint(node).checkpoint_applied_ts > t0
    plane.commit({"orders": {"deletes": [{"id": i} for i in range(0, 40)]}})
    loader(plane).load(orders(range(0, 40)))  # keys deleted since the checkpoint
    loader(plane).load(orders(range(100, 140)))
    plane.commit({"orders": {"deletes": [{"id": i} for i in range(100, 140)]}})
    loader(plane).load(orders(range(100, 140)))  # loaded, deleted, loaded again
    loaded(plane, [*range(0, 40), *range(100, 140)])
    assert plane.read("orders") == plane.model.rows["orders"]
    for _ in range(2):
        proc = plane.retinas[node]
        proc.kill9()
        proc.start()
        starts = plane.recover(node)
        assert starts is not None and starts.node_replay_from_ts > t0, \
            "the inserts are below the replay start: their rows come from the checkpoint"
        assert plane.read("orders") == plane.model.rows["orders"]
