"""Ingest publish: firstBlockId order, and a kill of the real Retina process at every failpoint."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from decimal import Decimal
from pathlib import Path

import grpc
import pytest

from retina_common import failpoints, file_names
from retina_common.catalog import Catalog, CatalogError, FileType
from retina_common.etcd import EtcdStore

from .dataplane import DataPlane
from .support import ROOT, eventually
from .test_sweepers import ranged_files

ONE_FILE_PER_BLOCK = {"block_rows": 8, "blocks_per_file": 1, "flush_interval_ms": 600_000}


@pytest.fixture
def make_plane(tmp_path: Path, etcd: EtcdStore, catalog: Catalog,
               catalog_dsn: str) -> Iterator[Callable[..., DataPlane]]:
    planes: list[DataPlane] = []

    def make(failpoints: str = "", **retina: object) -> DataPlane:
        dp = DataPlane(tmp_path, etcd, catalog, catalog_dsn, nodes=1,
                       retina={**ONE_FILE_PER_BLOCK, **retina})
        planes.append(dp)
        return dp.start({dp.nodes[0]: failpoints})

    yield make
    for dp in planes:
        dp.stop(kill=True)


def order(i: int) -> dict:
    return {"id": i, "customer": f"c{i}", "amount": Decimal(i), "note": None}


def ids_in_vnode(plane: DataPlane, vnode: int, count: int, start: int = 0) -> list[int]:
    out, i = [], start
    while len(out) < count:
        if plane.topology.vnode_of_key(plane.writers["orders"].key({"id": i})) == vnode:
            out.append(i)
        i += 1
    return out


def files(catalog: Catalog) -> dict[int, FileType]:
    return {f.file_id: f.type for f in catalog.get_files_by_type(None, list(FileType))}




@pytest.mark.integration
def test_files_closing_out_of_order_publish_in_first_block_order(
        make_plane: Callable[..., DataPlane], catalog: Catalog, failpoint_dir: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(failpoints.DIR_VAR, str(failpoint_dir))
    plane = make_plane("ingest.close.before=block*1")  # the first file waits at its close
    ids = ids_in_vnode(plane, 0, 24)
    for chunk in (ids[:8], ids[8:16], ids[16:]):  # three full files of one stream
        plane.commit({"orders": {"inserts": [order(i) for i in chunk]}})
    failpoints.wait_hit(failpoint_dir, "ingest.close.before")
    path = catalog.get_paths(plane.tables["orders"].table_id)[0]
    directory = Path(path.uri.removeprefix("file://"))
    # The two later files close (they are on storage) while the first one waits ...
    eventually(lambda: len(list(directory.glob("*.parquet"))) == 2, 20,
               "the second and third files to close")
    # ... and none of them is published before it.
    assert sorted(files(catalog).values()) == [FileType.TEMPORARY_INGEST] * 3
    failpoints.release(failpoint_dir, "ingest.close.before")
    eventually(lambda: sorted(files(catalog).values()) == [FileType.REGULAR] * 3, 20,
               "all three files to be published")
    log = plane.retinas[plane.nodes[0]].log_path.read_text().splitlines()
    published = [json.loads(line)["first_block_id"] for line in log
                 if '"ingest_file_published"' in line]
    assert published == sorted(published) and len(published) == 3
    assert {r["id"] for r in plane.read("orders").values()} == set(ids)


CRASH_POINTS = [
    "update_record.fence.before", "update_record.fence.after",
    "index.primary_commit.before", "index.primary_commit.after",
    "ingest.alloc.catalog.before", "ingest.alloc.catalog.after",
    "ingest.close.before", "ingest.close.after",
    "ingest.index_flush.before", "ingest.index_flush.after",
    "ingest.catalog_regular.before", "ingest.catalog_regular.after",
    "ingest.registry.before", "ingest.registry.after",
    "ingest.cleanup.before", "ingest.cleanup.after",
]


def killed_at_the_second_file(make_plane: Callable[..., DataPlane], catalog: Catalog,
                              point: str) -> tuple[DataPlane, str, list[int]]:
    """Two files of one stream: the first published and checkpointed, the node killed at
    ``point`` while it publishes the second. Returns the plane, the node and the ids."""
    plane = make_plane(f"{point}=exit(137)@2")  # the first file passes, the second dies
    node = plane.nodes[0]
    ids = ids_in_vnode(plane, 3, 16)
    plane.commit({"orders": {"inserts": [order(i) for i in ids[:8]]}})
    eventually(lambda: list(files(catalog).values()).count(FileType.REGULAR) == 1, 15,
               "the first file to be published")
    plane.checkpoint(node)  # the first file is admitted by a checkpoint
    assert {r["id"] for r in plane.read("orders").values()} == set(ids[:8])
    # The crash may beat the reply (an unknown outcome: the transaction is
    # rolled back and not in the changelog); either way the model holds.
    with contextlib.suppress(grpc.RpcError):
        plane.commit({"orders": {"inserts": [order(i) for i in ids[8:]]}})
    assert plane.retinas[node].wait_exit() == 137
    return plane, node, ids


@pytest.mark.integration
@pytest.mark.parametrize("point", CRASH_POINTS)
def test_kill_at_each_publish_failpoint(make_plane: Callable[..., DataPlane], catalog: Catalog,
                                        point: str) -> None:
    plane, node, ids = killed_at_the_second_file(make_plane, catalog, point)
    retina = plane.retinas[node]
    retina.start()
    eventually(lambda: not plane.gate_open(), 15, "queries refused while RECOVERING")
    plane.recover(node)
    eventually(plane.gate_open, 15, "the gate to admit after MarkReady")
    # Nothing lost, nothing duplicated (read() fails on a duplicate key).
    assert plane.read("orders") == plane.model.rows["orders"]
    leftovers = [f for f in catalog.get_files_by_type(None, [FileType.TEMPORARY_INGEST])
                 if file_names.parse(f.name).node_id == node]
    assert leftovers == [], "cleansing drops this node's TEMPORARY_INGEST files"
    # The node takes writes again and they land exactly once.
    plane.commit({"orders": {"replaces": [order(i) for i in ids[:3]]}})
    assert plane.read("orders") == plane.model.rows["orders"]


@pytest.mark.integration
@pytest.mark.parametrize("point", ["ingest.index_flush.after", "ingest.catalog_regular.before"])
def test_an_ingest_file_killed_before_its_regular_step_leaves_no_main_index_ranges(
        make_plane: Callable[..., DataPlane], catalog: Catalog, point: str) -> None:
    """LEFTOVER_RANGES_GO_WITH_THE_FILE: the second file dies with its MainIndex ranges
    durable and its row TEMPORARY_INGEST; the restart's cleansing deletes the ranges
    with the object and the row (they used to stay forever), and reads equal the model
    over one more restart."""
    plane, node, _ids = killed_at_the_second_file(make_plane, catalog, point)
    retina = plane.retinas[node]
    killed = {f for f, kind in files(catalog).items() if kind == FileType.TEMPORARY_INGEST}
    assert killed and killed <= ranged_files(plane, node)  # the kill left durable ranges
    retina.start()
    plane.recover(node)
    assert not killed & ranged_files(plane, node)
    assert not killed & set(files(catalog))
    assert plane.read("orders") == plane.model.rows["orders"]
    retina.kill9()
    retina.start()
    plane.recover(node)
    assert plane.read("orders") == plane.model.rows["orders"]


@pytest.mark.integration
def test_failed_request_is_compensated_and_a_retry_converges(
        make_plane: Callable[..., DataPlane]) -> None:
    # The first primary-index commit after start-up fails (once); the request's
    # inserts must stay invisible, and the same request retried must converge.
    plane = make_plane("index.primary_commit.before=raise(injected)@2*1",
                       flush_interval_ms=200, block_rows=64)
    plane.commit({"orders": {"inserts": [order(i) for i in range(20)]}})
    model_before = dict(plane.model.rows["orders"])
    changes = {"orders": {"deletes": [{"id": 1}, {"id": 2}],
                          "replaces": [order(3)], "inserts": [order(100), order(101)]}}
    with pytest.raises(grpc.RpcError) as err:
        plane.commit(changes)
    assert err.value.code() == grpc.StatusCode.INTERNAL and "injected" in err.value.details()
    got = {r["id"] for r in plane.read("orders").values()}
    assert not {100, 101} & got, "a failed request's inserts are never visible"
    assert got <= {r["id"] for r in model_before.values()}
    plane.model.rows["orders"] = model_before
    plane.commit(changes)  # the CDC side retries the same transaction's effects
    assert plane.read("orders") == plane.model.rows["orders"]
    eventually(lambda: plane.read("orders") == plane.model.rows["orders"] and
               all(f == FileType.REGULAR for f in files(plane.catalog).values()), 15,
               "everything published")


@pytest.mark.integration
def test_shutdown_flush_publishes_through_the_same_publisher(
        make_plane: Callable[..., DataPlane], catalog: Catalog) -> None:
    plane = make_plane(block_rows=64)  # nothing fills a block; only the shutdown flushes
    ids = ids_in_vnode(plane, 5, 5)
    plane.commit({"orders": {"inserts": [order(i) for i in ids]}})
    assert files(catalog) and FileType.REGULAR not in files(catalog).values()
    retina = plane.retinas[plane.nodes[0]]
    retina.stop()  # SIGTERM: stop taking writes, flush, publish, exit
    assert retina.proc is not None and retina.proc.returncode == 0
    assert list(files(catalog).values()) == [FileType.REGULAR]
    retina.start()
    starts = plane.recover(plane.nodes[0])
    assert starts is not None and starts.checkpoint_id > 0  # the shutdown's checkpoint
    assert {r["id"] for r in plane.read("orders").values()} == set(ids)


@pytest.mark.integration
def test_retina_query_prints_the_snapshot(make_plane: Callable[..., DataPlane]) -> None:
    plane = make_plane()
    plane.commit({"orders": {"inserts": [order(i) for i in range(12)]}})
    plane.commit({"orders": {"deletes": [{"id": 4}]}})
    env = {**os.environ, "RETINA__TRANS__LISTEN": plane.trans.address}
    result = subprocess.run([sys.executable, "-m", "retina_common.reader", "shop.orders",
                             "--config", str(plane.config_path), "--format", "json"],
                            cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    rows = [json.loads(line) for line in result.stdout.splitlines()]
    assert sorted(r["id"] for r in rows) == [i for i in range(12) if i != 4]
    assert "11 rows at snapshot" in result.stderr


def test_a_publish_gives_up_on_a_catalog_that_stays_away(tmp_path: Path) -> None:
    """The publisher's catalog retry is bounded: past it the node fails closed instead of
    holding the stream's publish lock (and so every checkpoint) forever."""
    from devtools.cluster import free_port
    from retina_server.index import LocalIndexService
    from retina_server.publisher import StreamPublisher
    from retina_server.registry import IngestFileMetadataRegistry
    from retina_server.visibility import VisibilityIndex
    from retina_server.write_buffer import IngestFile, StreamBuffer

    gone = Catalog(f"host=127.0.0.1 port={free_port()} dbname=none user=postgres",
                   connect_timeout_s=1)
    buffer = StreamBuffer(1, 0, block_rows=4, blocks_per_file=1,
                          allocate_file=lambda _b, _f: pytest.fail("no allocation expected"))
    fatal: list[str] = []
    publisher = StreamPublisher(buffer, gone, LocalIndexService(tmp_path / "index").main,
                                IngestFileMetadataRegistry(), VisibilityIndex(), fatal.append,
                                on_published=lambda _f: None, retry_s=0.05,
                                give_up_after_s=0.5)
    file = IngestFile(7, "n_20260101000000_1_0.parquet", 1, str(tmp_path), 1, 0, 0, 0)
    with pytest.raises(CatalogError):
        publisher._mark_regular(file)
    assert len(fatal) == 1 and "refused the publish" in fatal[0]
