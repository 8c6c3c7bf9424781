"""The Storage GC Spark job (spark_jobs/storage_gc.py).

Unit part, no cluster: the plan (candidates, groups of consecutive files of one stream),
the bitmap → mask → Arrow filter, and the rewrite task run by Spark in local mode against
a stand-in node that answers QueryVisibility and the real catalog (PostgreSQL).

Integration part: the job as an operator runs it (``python -m spark_jobs.storage_gc``,
Spark local mode, a subprocess) against real TransServer and Retina processes, compared
with the model of the data plane (tests/dataplane.py).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import random
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from concurrent import futures
from datetime import UTC, datetime
from decimal import Decimal
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from devtools.cluster import free_port
from retina_common import failpoints, file_names
from retina_common.catalog import Catalog, ColumnSpec, FileRecord, FileType
from retina_common.codec import COMMIT_TS
from retina_common.pb import retina_pb2 as rpb
from retina_common.pb import retina_pb2_grpc
from retina_common.pb import trans_pb2 as tpb
from retina_common.refusal import AWAITING_CHECKPOINT
from retina_common.storage import open_parquet, root_uri, write_durably
from spark_jobs import storage_gc_arrow as gc_arrow
from spark_jobs import storage_gc_plan as gc_plan
from spark_jobs import storage_gc_task as gc_task
from spark_jobs.common import REFUSED_MARK, FileRef

from . import gc
from .dataplane import SCHEMA, DataPlane
from .support import ROOT, eventually

NODE = "127.0.0.1:18890"
MiB = 1 << 20


# --- the plan -------------------------------------------------------------------------------
def stats(seq: int, size: int = MiB, rows: int = 100, deleted: int = 0, vnode: int = 0,
          node: str = NODE) -> gc_plan.FileStats:
    name = file_names.make(node, datetime(2024, 1, 2, 3, 4, 5, tzinfo=UTC), seq, vnode)
    return gc_plan.FileStats(FileRef(1000 * vnode + seq, name, "file:///x"), node, vnode, seq,
                             size, rows, deleted)


def seqs(groups: list[gc_plan.Group]) -> list[tuple[str, list[int]]]:
    return [(g.kind, [f.position for f in g.files]) for g in groups]


LIMITS = gc_plan.Thresholds(deleted_threshold=0.2, small_file_bytes=8 * MiB,
                            target_file_bytes=20 * MiB)


def test_a_file_over_the_deleted_threshold_is_a_group_of_one() -> None:
    files = [stats(1, 50 * MiB, deleted=20), stats(2, 50 * MiB, deleted=19),
             stats(3, 50 * MiB, deleted=100)]
    assert seqs(gc_plan.plan_stream("s", "t", files, LIMITS)) == [("deleted", [1]),
                                                                  ("deleted", [3])]


def test_nothing_deleted_is_never_a_candidate_even_at_threshold_zero() -> None:
    limits = gc_plan.Thresholds(0.0, 8 * MiB, 20 * MiB)
    assert gc_plan.plan_stream("s", "t", [stats(1, 50 * MiB), stats(2, 50 * MiB)], limits) == []


def test_runs_of_small_files_merge_up_to_the_target_in_seq_order() -> None:
    # 6 small files of 6 MiB: 3 fit in 20 MiB; listed out of order.
    files = [stats(s, 6 * MiB) for s in (5, 1, 3, 2, 6, 4)]
    assert seqs(gc_plan.plan_stream("s", "t", files, LIMITS)) == [("small", [1, 2, 3]),
                                                                  ("small", [4, 5, 6])]
    # Deleted rows make a file count for less in the merged size.
    files = [stats(s, 6 * MiB, deleted=75 if s == 2 else 0) for s in (1, 2, 3, 4)]
    assert seqs(gc_plan.plan_stream("s", "t", files, LIMITS)) == [("small", [1, 2, 3, 4])]


def test_a_large_clean_file_separates_runs_and_a_lone_small_file_stays() -> None:
    files = [stats(1, MiB), stats(2, MiB), stats(3, 50 * MiB), stats(4, MiB),
             stats(5, 50 * MiB), stats(6, MiB, deleted=30), stats(7, 50 * MiB, deleted=40)]
    assert seqs(gc_plan.plan_stream("s", "t", files, LIMITS)) == [
        ("small", [1, 2]), ("deleted", [6]), ("deleted", [7])]


def test_a_merged_file_waits_until_as_much_again_arrived_beside_it() -> None:
    # MERGES_ONLY_COMPARABLE_SIZES: a 4 MiB merged file and three new 0.5 MiB files: the
    # new files merge with each other, the big one stays; once 4 MiB arrived it joins.
    few = [stats(1, 4 * MiB)] + [stats(s, MiB // 2) for s in (2, 3, 4)]
    assert seqs(gc_plan.plan_stream("s", "t", few, LIMITS)) == [("small", [2, 3, 4])]
    enough = [stats(1, 4 * MiB)] + [stats(s, MiB // 2) for s in range(2, 10)]
    assert seqs(gc_plan.plan_stream("s", "t", enough, LIMITS)) == [
        ("small", list(range(1, 10)))]
    # A larger ratio lets it join earlier; a lone big file over the threshold still goes.
    eager = gc_plan.Thresholds(0.2, 8 * MiB, 20 * MiB, size_ratio=3.0)
    assert seqs(gc_plan.plan_stream("s", "t", few, eager)) == [("small", [1, 2, 3, 4])]
    dirty = [stats(1, 4 * MiB, deleted=30)] + [stats(s, MiB // 2) for s in (2, 3)]
    assert seqs(gc_plan.plan_stream("s", "t", dirty, LIMITS)) == [("deleted", [1]),
                                                                  ("small", [2, 3])]
    # A file its node holds (gc_hold) is in no group, even over the threshold, and
    # separates the files around it.
    held = [stats(1, MiB // 2), stats(2, MiB // 2), dataclasses.replace(
        stats(3, MiB // 2, deleted=90), hold="awaiting"), stats(4, MiB // 2),
        stats(5, MiB // 2)]
    assert seqs(gc_plan.plan_stream("s", "t", held, LIMITS)) == [("small", [1, 2]),
                                                                 ("small", [4, 5])]


def test_runs_of_the_plan_rewrite_what_arrived_not_the_whole_stream() -> None:
    """300 GC runs over one stream, each after 25 new files of 4 KiB arrived, merging every
    planned group into one file (the old plan merged every small file again each run, so
    run k rewrote k times what arrived). Under MERGES_ONLY_COMPARABLE_SIZES a byte is
    rewritten about 256 KiB / 100 KiB times below the tier floor, then once per doubling
    of its file (log2(8 MiB / 256 KiB) + 1), a run rewrites on average at most that many
    times what arrived, and no run more than the small files can hold, however large the
    stream grew (30 MB by the end)."""
    unit, arrivals, runs, small, floor = 4096, 25, 300, 8 * MiB, 256 * 1024
    limits = gc_plan.Thresholds(0.2, small, 128 * MiB, min_tier_bytes=floor)
    files: list[tuple[int, int, int]] = []  # (position, bytes, times its bytes were rewritten)
    position, per_run, most = 0, [], 0
    for _run in range(runs):
        for _ in range(arrivals):
            position += 1
            files.append((position, unit, 0))
        listed = [stats(p, size, rows=max(1, size // 64)) for p, size, _n in files]
        groups = gc_plan.plan_stream("s", "t", listed, limits)
        by_position = {p: (size, n) for p, size, n in files}
        merged = {f.position for g in groups for f in g.files}
        files = [f for f in files if f[0] not in merged]
        rewritten = 0
        for g in groups:
            size = sum(by_position[f.position][0] for f in g.files)
            times = max(by_position[f.position][1] for f in g.files) + 1
            most = max(most, times)
            rewritten += size
            files.append((g.files[0].position, size, times))
        files.sort()
        per_run.append(rewritten)
    arrived = arrivals * unit
    levels = -(-floor // arrived) + (small // floor).bit_length()
    assert sum(size for _p, size, _n in files) == runs * arrived  # nothing lost or doubled
    assert most <= levels, most
    assert sum(per_run) <= levels * runs * arrived, sum(per_run) / (runs * arrived)
    assert max(per_run) <= 2 * small + arrived, max(per_run)
    assert max(per_run[-100:]) <= max(per_run[:200])  # flat: not growing with the stream


def test_no_file_of_a_merged_group_is_larger_than_the_rest_of_it() -> None:
    """MERGES_ONLY_COMPARABLE_SIZES on random streams (sizes from bytes to the small-file
    size, deleted rows, held files): every file of a merged group is at most size_ratio
    times the rest of the group (both floored), groups are consecutive runs of unheld
    files, and no file is in two groups."""
    rng = random.Random(29)
    for ratio in (0.5, 1.0, 3.0):
        limits = gc_plan.Thresholds(0.2, 8 * MiB, 20 * MiB, size_ratio=ratio,
                                    min_tier_bytes=64 * 1024)
        floor = limits.min_tier_bytes
        for _ in range(300):
            files = []
            for p in range(1, rng.randint(2, 30)):
                rows = rng.randint(1, 1000)
                f = stats(p, int(rng.choice([1e3, 5e4, 3e5, 2e6, 7e6]) * rng.uniform(0.5, 1.5)),
                          rows=rows, deleted=rng.choice([0, 0, rows // 10, rows // 2]))
                files.append(dataclasses.replace(f, hold="held") if rng.random() < 0.1 else f)
            groups = gc_plan.plan_stream("s", "t", files, limits)
            seen: set[int] = set()
            for g in groups:
                positions = [f.position for f in g.files]
                assert positions == list(range(positions[0], positions[0] + len(positions)))
                assert not any(f.hold for f in g.files) and not seen & set(positions)
                seen |= set(positions)
                if g.kind != "small":
                    continue
                sizes = [f.size_bytes * (1 - f.deleted_fraction) for f in g.files]
                for s in sizes:
                    assert max(s, floor) <= ratio * max(sum(sizes) - s, floor) + 1e-6, sizes


def test_plan_table_keeps_streams_apart_and_leaves_a_stream_with_a_skipped_file_alone(
        ) -> None:
    a = [stats(s, MiB, vnode=0) for s in (1, 2, 3, 4, 5)]
    b = [stats(s, MiB, vnode=1) for s in (1, 2)]
    other = [stats(s, MiB, vnode=0, node="127.0.0.1:18891") for s in (1, 2)]
    listed = [f.ref for f in a + b + other]
    usable = [f for f in a + b + other
              if not (f.vnode == 0 and f.position == 3 and f.node == NODE)]
    groups = gc_plan.plan_table("s", "t", usable, listed, LIMITS)
    assert [(g.node, g.vnode, [f.position for f in g.files]) for g in groups] == [
        (NODE, 1, [1, 2]), ("127.0.0.1:18891", 0, [1, 2])]
    for g in groups:  # one stream per group
        assert {(f.node, f.vnode) for f in g.files} == {(g.node, g.vnode)}


# --- the Arrow filter -----------------------------------------------------------------------
def bitmap(deleted: list[int], rows: int) -> bytes:
    out = bytearray((rows + 7) // 8)
    for i in deleted:
        out[i >> 3] |= 1 << (i & 7)
    return bytes(out)


def test_deleted_mask_reads_little_endian_bits_and_pads_a_short_bitmap() -> None:
    mask = gc_arrow.deleted_mask(bitmap([0, 3, 9], 12), 12)
    assert list(np.flatnonzero(mask)) == [0, 3, 9]
    assert list(np.flatnonzero(gc_arrow.deleted_mask(b"\x02", 20))) == [1]
    assert gc_arrow.deleted_mask(b"", 5).tolist() == [False] * 5


def parquet_file(path: Path, ids: list[int], row_group: int) -> pq.ParquetFile:
    table = pa.table({"id": pa.array(ids, pa.int64()),
                      "note": pa.array([f"n{i}" for i in ids]),
                      COMMIT_TS: pa.array([100 + i for i in ids], pa.int64())})
    pq.write_table(table, path, row_group_size=row_group)
    return pq.ParquetFile(path)


def visibility(deleted_by_rg: dict[int, list[int]], rows_by_rg: dict[int, int]
               ) -> rpb.QueryVisibilityResponse:
    return rpb.QueryVisibilityResponse(row_groups=[
        rpb.RowGroupVisibility(rg_id=rg, row_count=rows_by_rg[rg],
                               deleted_bitmap=bitmap(deleted_by_rg.get(rg, []), rows_by_rg[rg]))
        for rg in sorted(rows_by_rg)])


def test_surviving_rows_keep_file_order_and_the_commit_ts(tmp_path: Path) -> None:
    parquet = parquet_file(tmp_path / "a.parquet", list(range(10)), row_group=4)  # 4, 4, 2
    vis = visibility({0: [1, 2], 2: [1]}, {0: 4, 1: 4, 2: 2})
    rows, dropped = gc_arrow.surviving_rows(parquet, vis, "a")
    assert dropped == 3
    assert rows.column("id").to_pylist() == [0, 3, 4, 5, 6, 7, 8]
    assert rows.column(COMMIT_TS).to_pylist() == [100, 103, 104, 105, 106, 107, 108]
    assert gc_arrow.deleted_count(vis) == (10, 3)


def test_surviving_rows_refuse_a_file_its_visibility_does_not_describe(tmp_path: Path) -> None:
    parquet = parquet_file(tmp_path / "a.parquet", list(range(10)), row_group=5)
    with pytest.raises(gc_arrow.RewriteError, match="row group 1 has 5 rows"):
        gc_arrow.surviving_rows(parquet, visibility({}, {0: 5, 1: 6}), "a")
    with pytest.raises(gc_arrow.RewriteError, match="visibility for"):
        gc_arrow.surviving_rows(parquet, visibility({}, {0: 5}), "a")


def test_encode_parquet_writes_row_groups_of_the_asked_size_and_none_for_no_rows() -> None:
    rows = pa.table({"id": pa.array(range(10), pa.int64()),
                     COMMIT_TS: pa.array(range(10), pa.int64())})
    schema = gc_arrow.new_file_schema(rows.schema, {"gc_rewrite_id": "r1"})
    meta = pq.ParquetFile(pa.BufferReader(gc_arrow.encode_parquet(rows, schema, 4))).metadata
    assert [meta.row_group(i).num_rows for i in range(meta.num_row_groups)] == [4, 4, 2]
    assert meta.schema.to_arrow_schema().metadata[b"retina.gc_rewrite_id"] == b"r1"
    empty = gc_arrow.encode_parquet(rows.slice(0, 0), schema, 4)
    assert pq.ParquetFile(pa.BufferReader(empty)).metadata.num_row_groups == 0
    with pytest.raises(gc_arrow.RewriteError):
        gc_arrow.new_file_schema(pa.schema([("id", pa.int64())]), {})


# --- the rewrite task in Spark local mode, against a stand-in node ---------------------------
class StandInNode(retina_pb2_grpc.RetinaWorkerServiceServicer):
    """Answers QueryVisibility from a table of bitmaps (what a real node derives from its
    visibility index) and remembers the timestamps it was asked at."""

    def __init__(self) -> None:
        self.files: dict[int, rpb.QueryVisibilityResponse] = {}
        self.asked: list[tuple[int, int, int]] = []

    def QueryVisibility(self, request: rpb.QueryVisibilityRequest,
                        context: grpc.ServicerContext) -> rpb.QueryVisibilityResponse:
        self.asked.append((request.file_id, request.timestamp, request.trans_id))
        if request.file_id not in self.files:
            context.abort(grpc.StatusCode.NOT_FOUND, f"file {request.file_id} is not served")
        return self.files[request.file_id]


@pytest.fixture
def stand_in() -> Iterator[tuple[str, StandInNode]]:
    address = f"127.0.0.1:{free_port()}"
    node = StandInNode()
    server = grpc.server(futures.ThreadPoolExecutor(4))
    retina_pb2_grpc.add_RetinaWorkerServiceServicer_to_server(node, server)
    server.add_insecure_port(address)
    server.start()
    yield address, node
    server.stop(0)


@pytest.mark.integration
def test_rewrite_tasks_write_one_file_per_group_and_register_it_temporary_gc(
        spark: object, stand_in: tuple[str, StandInNode], catalog: Catalog,
        catalog_dsn: str, tmp_path: Path) -> None:
    address, node = stand_in
    catalog.create_schema("s")
    table = catalog.create_table("s", "t", [ColumnSpec("id", "int64"),
                                            ColumnSpec("note", "string")], ["id"])
    path = catalog.add_path(table.table_id, root_uri(str(tmp_path / "data")))
    stamp = datetime.now(UTC)
    refs, expected_ids = [], []
    for seq in range(3):  # 3 old files of 20 rows, 2 row groups each; every 3rd row deleted
        name = file_names.make(address, stamp, seq, 0)
        ids = list(range(seq * 100, seq * 100 + 20))
        local = tmp_path / name
        parquet_file(local, ids, row_group=10)
        write_durably(path.uri, name, local.read_bytes())
        record = catalog.add_file(name, FileType.REGULAR, 2, path.path_id, 0, 19)
        deleted = {0: [i for i in range(10) if i % 3 == 0], 1: [i for i in range(10)
                                                                 if (i + 10) % 3 == 0]}
        node.files[record.file_id] = visibility(deleted, {0: 10, 1: 10})
        refs.append(FileRef(record.file_id, name, path.uri))
        expected_ids += [x for i, x in enumerate(ids) if i % 3 != 0]
    spec = gc_task.TaskSpec(catalog_dsn, 5, trans_id=77, row_group_rows=16)

    def task(rewrite_id: str, files: tuple[FileRef, ...], seq: int, expected: int
             ) -> gc_task.RewriteTask:
        return gc_task.RewriteTask(0, rewrite_id, address, "s.t", 0, files, 123,
                                   file_names.make(address, stamp, seq, 0), path.path_id,
                                   path.uri, cutoff_ts=555, expected_rows=expected)

    # Reversed order on purpose: the new file follows the order it is given.
    good = task("r-good", tuple(reversed(refs)), 50, len(expected_ids))
    short = task("r-short", (refs[0],), 51, 999)  # the node expects other figures
    unknown = task("r-unknown", (FileRef(424242, refs[0].name, path.uri),), 52, 0)
    results: dict[str, gc_task.RewriteResult] = {}
    gc_task.run_rewrites(spark, spec, [good, short, unknown],
                         lambda t, r: results.setdefault(t.rewrite_id, r))

    assert set(results) == {"r-good", "r-short", "r-unknown"}
    ok = results["r-good"]
    assert not ok.error and ok.rows_kept == len(expected_ids) and ok.rows_dropped == 21
    record = catalog.get_file(ok.new_file_id)
    assert record is not None and record.type == FileType.TEMPORARY_GC
    assert record.name == good.file_name and record.path_id == path.path_id
    new = pq.ParquetFile(tmp_path / "data" / good.file_name)
    assert record.num_row_group == new.metadata.num_row_groups == math.ceil(len(expected_ids) / 16)
    data = new.read()
    per_file = len(expected_ids) // 3
    by_file = [expected_ids[i * per_file:(i + 1) * per_file] for i in range(3)]
    assert data.column("id").to_pylist() == by_file[2] + by_file[1] + by_file[0]
    assert data.column(COMMIT_TS).to_pylist() == [100 + i for i in data.column("id").to_pylist()]
    assert ok.bytes_after == (tmp_path / "data" / good.file_name).stat().st_size
    # Every visibility was read at the cutoff, under the job's transaction.
    assert {(ts, trans) for _f, ts, trans in node.asked} == {(555, 77)}

    assert "expects 999" in results["r-short"].error
    assert REFUSED_MARK in results["r-unknown"].error and "NOT_FOUND" in results["r-unknown"].error
    for failed in (short, unknown):  # nothing registered, nothing written
        assert not (tmp_path / "data" / failed.file_name).exists()
    names = {f.name for f in catalog.get_files_by_type(path.path_id, list(FileType))}
    assert short.file_name not in names and unknown.file_name not in names

    # A retried task (same rewrite) reuses its TEMPORARY_GC row and writes the same file.
    again = gc_task.rewrite_group(spec, good)
    assert again.new_file_id == ok.new_file_id and not again.error
    assert len([f for f in catalog.get_files_by_type(path.path_id, list(FileType))
                if f.name == good.file_name]) == 1
    # Once the row is REGULAR (a committed rewrite), a late task never touches it.
    catalog.update_file(ok.new_file_id, file_type=FileType.REGULAR, min_row_id=0,
                        max_row_id=100)
    (tmp_path / "data" / good.file_name).write_bytes(b"committed bytes")
    late = gc_task.rewrite_group(spec, good)
    assert "not TEMPORARY_GC" in late.error
    assert (tmp_path / "data" / good.file_name).read_bytes() == b"committed bytes"


# --- the job end to end, against real processes ----------------------------------------------
SPARK_ARGS = ("--conf", "spark.ui.enabled=false", "--conf", "spark.driver.memory=1g")
SWITCHING = "gc.journal.switching.before"  # the node's commit, before its journal record


def order(i: int, note: str = "") -> dict[str, Any]:
    return {"id": i, "customer": f"c{i % 5}", "amount": Decimal(i) / 4, "note": note or None}


def job_argv(plane: DataPlane, *args: str, table: str | None = "orders",
             master: str = "local[2]", schema: str = SCHEMA) -> list[str]:
    which = ["--table", table] if table else ["--all-tables"]
    return [sys.executable, "-m", "spark_jobs.storage_gc", "--config", str(plane.config_path),
            "--schema", schema, *which, "--json", *args, "--master", master, *SPARK_ARGS]


# run_gc's ``failpoints`` argument hides the module inside it.
FAILPOINTS_ENV, FAILPOINT_DIR_ENV = failpoints.ENV_VAR, failpoints.DIR_VAR


def run_gc(plane: DataPlane, *args: str, table: str | None = "orders", failpoints: str = "",
           master: str = "local[2]", failpoint_dir: Path | None = None, schema: str = SCHEMA,
           ) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYSPARK_PYTHON": sys.executable, FAILPOINTS_ENV: failpoints}
    if failpoint_dir is not None:
        env[FAILPOINT_DIR_ENV] = str(failpoint_dir)
    return subprocess.run(job_argv(plane, *args, table=table, master=master, schema=schema),
                          cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)



def report_of(stdout: str) -> dict[str, Any]:
    lines = [line for line in stdout.splitlines() if line.startswith('{"safe_gc_ts"')]
    assert lines, f"no JSON report in:\n{stdout[-3000:]}"
    return json.loads(lines[-1])


def files_of(plane: DataPlane, *types: FileType) -> list[FileRecord]:
    path = plane.catalog.get_paths(plane.tables["orders"].table_id)[0]
    return plane.catalog.get_files_by_type(path.path_id, list(types))


def streams(plane: DataPlane) -> dict[tuple[str, int], int]:
    """REGULAR files per (node, vnode)."""
    out: dict[tuple[str, int], int] = {}
    for f in files_of(plane, FileType.REGULAR):
        name = file_names.parse(f.name)
        out[(name.node_id, name.vnode)] = out.get((name.node_id, name.vnode), 0) + 1
    return out


def stored_rows(plane: DataPlane) -> int:
    """Rows in the Parquet files of the REGULAR files: deleted rows count until GC."""
    path = plane.catalog.get_paths(plane.tables["orders"].table_id)[0]
    return sum(open_parquet(path.uri, f.name).metadata.num_rows
               for f in files_of(plane, FileType.REGULAR))


def settle(plane: DataPlane) -> None:
    """Every row published: no ingest file open, nothing left in a write buffer."""
    assert plane.reader is not None

    def published() -> bool:
        return not files_of(plane, FileType.TEMPORARY_INGEST) and \
            plane.reader.read(SCHEMA, "orders").buffer_rows == 0
    eventually(published, 30, "every orders row published")


def advance(plane: DataPlane) -> None:
    """A later write elsewhere: safeGcTs (below every snapshot, and a snapshot is the
    HWM) passes the deletes only once a later transaction committed."""
    plane.commit({"events": {"replaces": [{"tenant": 0, "seq": len(plane.changelog),
                                           "payload": b"x", "ok": True}]}})


def load(plane: DataPlane, rows: int = 160, batch: int = 20, delete_every: int = 3) -> int:
    """``rows`` orders over many small files (a file per batch and stream), then every
    ``delete_every``-th deleted; returns the number deleted. Every node's replay floor
    ends above the deletes: the job's cutoff is not lowered below them
    (GC_CUTOFF_BELOW_REPLAY_FLOOR)."""
    for first in range(0, rows, batch):
        plane.commit({"orders": {"inserts": [order(i) for i in range(first, first + batch)]}})
        settle(plane)
    doomed = list(range(0, rows, delete_every))
    plane.commit({"orders": {"deletes": [{"id": i} for i in doomed]}})
    advance(plane)
    settle(plane)
    gc.raise_replay_floor(plane)
    return len(doomed)


def descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (from /proc): what a job started."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            children.setdefault(ppid, []).append(int(entry.name))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def pending_rewrites(plane: DataPlane) -> int:
    return sum(plane.retinas[n].stub.GetGcStatus(rpb.GetGcStatusRequest(),
                                                 timeout=10).pending_rewrites
               for n in plane.nodes)


@pytest.mark.integration
def test_the_job_reclaims_deleted_rows_and_compacts_while_reads_stay_exact(
        make_plane: Callable[..., DataPlane]) -> None:
    plane = make_plane()
    deleted = load(plane)
    model = plane.model.rows["orders"]
    assert plane.read("orders") == model
    before = streams(plane)
    assert stored_rows(plane) == len(model) + deleted  # deleted rows still in storage
    assert max(before.values()) >= 4  # many small files per stream

    result = run_gc(plane)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report = report_of(result.stdout)
    totals = report["totals"]
    assert totals["groups"] == totals["committed"] == len(before)  # one merged run per stream
    assert totals["rows_dropped"] == deleted and totals["rows_kept"] == len(model)
    assert totals["files_before"] == sum(before.values()) and totals["files_after"] == len(before)
    assert all(g["outcome"] == "COMMITTED" and g["new_file"]["file_id"] for g in report["groups"])
    assert "gc_job_done" in result.stdout and "done: " in result.stdout

    assert plane.read("orders") == model
    after = streams(plane)
    assert set(after) == set(before) and all(n == 1 for n in after.values())
    assert stored_rows(plane) == len(model)  # the deleted rows are gone from storage
    assert not files_of(plane, FileType.TEMPORARY_GC)
    # Nothing left to do: the next run plans nothing and starts no Spark.
    again = run_gc(plane)
    assert again.returncode == 0, again.stdout + again.stderr
    assert report_of(again.stdout)["totals"]["groups"] == 0
    assert plane.read("orders") == model


@pytest.mark.integration
def test_a_run_right_after_another_plans_around_outputs_awaiting_their_checkpoint(
        make_plane: Callable[..., DataPlane]) -> None:
    """Back-to-back runs closer than two checkpoints: the last run's outputs are held by
    their node (QueryVisibility's gc_hold), so the plan leaves them out and merges the new
    files beside them; the report lists them and why, and nothing is BUSY."""
    plane = make_plane(checkpoint_interval_ms=3_600_000)
    load(plane)
    first = run_gc(plane)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    outputs = {g["new_file"]["file_id"] for g in report_of(first.stdout)["groups"]
               if g["outcome"] == "COMMITTED"}
    assert outputs
    for start in (1000, 1020, 1040):  # new small files beside every output
        plane.commit({"orders": {"inserts": [order(i) for i in range(start, start + 20)]}})
        settle(plane)
    advance(plane)
    settle(plane)
    # A ratio that would let every output join the new files beside it.
    second = run_gc(plane, "--size-ratio", "1000")
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    report = report_of(second.stdout)
    totals = report["totals"]
    assert {h["file_id"] for h in report["held"]} == outputs
    assert all(AWAITING_CHECKPOINT in h["reason"] for h in report["held"])
    assert totals["held_files"] == totals["held_awaiting_checkpoint"] == len(outputs)
    assert f"{len(outputs)} held by their node ({len(outputs)} awaiting their second " \
        "checkpoint)" in second.stdout
    assert totals["busy"] == 0 and totals["committed"] == totals["groups"] > 0
    assert not outputs & {f["file_id"] for g in report["groups"] for f in g["old_files"]}
    assert outputs <= {f.file_id for f in files_of(plane, FileType.REGULAR)}
    assert plane.read("orders") == plane.model.rows["orders"]


@pytest.mark.integration
@pytest.mark.parametrize("point", ["gc.rewrite.write.before", "gc.rewrite.write.after"])
def test_a_task_killed_around_its_write_leaves_the_table_exact_and_a_rerun_finishes(
        point: str, make_plane: Callable[..., DataPlane]) -> None:
    """A Spark task dies (its Python worker exits) after registering its TEMPORARY_GC file,
    before or after writing the bytes, with other groups done or not: nothing of its group
    is committed, the table reads exactly, and the next run finishes the work."""
    plane = make_plane()
    deleted = load(plane)
    model = plane.model.rows["orders"]
    crashed = run_gc(plane, failpoints=f"{point}=exit(137)@2")
    assert crashed.returncode != 0, crashed.stdout[-2000:]
    assert plane.read("orders") == model
    # The dead group's prepared rewrite lapses with the job's read transaction, so the
    # rerun is not refused for its files (no waiting for the prepare TTL).
    again = run_gc(plane)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert plane.read("orders") == model
    assert stored_rows(plane) == len(model), deleted
    assert all(n == 1 for n in streams(plane).values())


@pytest.mark.integration
@pytest.mark.parametrize("point", ["gc.rewrite.write.before", "gc.rewrite.write.after"])
def test_spark_retries_a_task_killed_around_its_write_and_every_group_commits(
        point: str, make_plane: Callable[..., DataPlane], failpoint_dir: Path) -> None:
    """A rewrite task dies after registering its TEMPORARY_GC file, before or after its
    bytes (its Python worker exits); ``local[2,2]`` lets Spark run it again in a new worker
    (the point acts once across processes). The retry reuses the row, writes the file,
    and the group commits like the others: the deleted rows are gone from storage, no
    TEMPORARY_GC row is left, and both tables read exactly as the model."""
    plane = make_plane()
    deleted = load(plane)
    model = plane.model.snapshot()
    before = streams(plane)
    result = run_gc(plane, failpoints=f"{point}=exit(137)@1+once", master="local[2,2]",
                    failpoint_dir=failpoint_dir)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert failpoints.acted_once(failpoint_dir, point) is not None  # a task died there
    assert "Python worker exited unexpectedly" in result.stderr  # and Spark saw it
    report = report_of(result.stdout)
    assert report["totals"]["groups"] == report["totals"]["committed"] == len(before)
    assert report["totals"]["rows_dropped"] == deleted
    new_files = {g["new_file"]["file_id"] for g in report["groups"]}
    regular = {f.file_id for f in files_of(plane, FileType.REGULAR)}
    assert new_files == regular  # one file per stream, each the one its task registered
    assert not files_of(plane, FileType.TEMPORARY_GC)  # the retry reused the dead row
    for table in ("orders", "events"):
        assert plane.read(table) == model[table]
    assert stored_rows(plane) == len(model["orders"])


@pytest.mark.integration
def test_deletes_racing_the_job_are_never_lost(
        make_plane: Callable[..., DataPlane], failpoint_dir: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(failpoints.DIR_VAR, str(failpoint_dir))
    # Every commit of a rewrite waits in the node before its journal record, after the
    # Spark task read the old files at the cutoff: the window the deletes go into.
    plane = make_plane(failpoints=f"{SWITCHING}=block")
    load(plane)
    log = failpoint_dir / "job.log"
    with open(log, "w") as out:
        job = subprocess.Popen(job_argv(plane), cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
                               env={**os.environ, "PYSPARK_PYTHON": sys.executable})
    try:
        failpoints.wait_hit(failpoint_dir, SWITCHING, timeout_s=180)
        live = sorted(r["id"] for r in plane.model.rows["orders"].values())
        # Rows of the files being rewritten: every published row is in one of them.
        plane.commit({"orders": {"deletes": [{"id": i} for i in live[:12]],
                                 "replaces": [order(i, "raced") for i in live[12:20]]}})
        plane.commit({"orders": {"deletes": [{"id": i} for i in live[20:26]]}})
        failpoints.release(failpoint_dir, SWITCHING)
        racing = iter(live[26:60])
        while job.poll() is None:  # more deletes while the remaining commits go through
            victim = next(racing, None)
            if victim is None:
                break
            plane.commit({"orders": {"deletes": [{"id": victim}]}})
        assert job.wait(timeout=240) == 0, log.read_text()[-4000:]
    finally:
        if job.poll() is None:
            job.kill()
            job.wait(timeout=30)
    report = report_of(log.read_text())
    assert report["totals"]["committed"] == report["totals"]["groups"] > 0
    assert sum(g["chain_items"] for g in report["groups"]) >= 26  # carried, not lost
    assert plane.read("orders") == plane.model.rows["orders"]
    # ... and still after a crash of the node and its recovery.
    node = plane.nodes[0]
    plane.retinas[node].kill9()
    plane.retinas[node].start()
    plane.recover(node)
    assert plane.read("orders") == plane.model.rows["orders"]


@pytest.mark.integration
def test_a_killed_driver_leaves_the_snapshot_exact_and_a_second_run_completes(
        make_plane: Callable[..., DataPlane], failpoint_dir: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(failpoints.DIR_VAR, str(failpoint_dir))
    # The first commit goes through, the second waits in the node: the driver is
    # certainly mid-job (one group committed, others prepared, written or running)
    # when it is killed. Prepared rewrites the dead driver never ends lapse with its read
    # transaction, whose short lease the live driver renews: a TTL alone (20 s once) also
    # lapsed the rewrites of a live driver slowed by a loaded machine.
    plane = make_plane(failpoints=f"{SWITCHING}=block@2", gc_prepare_ttl_ms=600_000,
                       gc_interval_ms=2_000)
    deleted = load(plane)
    model = plane.model.snapshot()["orders"]
    log = failpoint_dir / "job.log"
    with open(log, "w") as out:
        job = subprocess.Popen(job_argv(plane, "--lease-ms", "10000"), cwd=ROOT, stdout=out,
                               stderr=subprocess.STDOUT,
                               env={**os.environ, "PYSPARK_PYTHON": sys.executable})
    spark_processes: list[int] = []
    try:
        eventually(lambda: "\nCOMMITTED " in log.read_text() or job.poll() is not None, 180,
                   "the first COMMITTED line")
        assert job.poll() is None, log.read_text()[-4000:]
        failpoints.wait_hit(failpoint_dir, SWITCHING, timeout_s=60)
        spark_processes = descendants(job.pid)  # its JVM and Python workers
        job.send_signal(signal.SIGKILL)
        assert job.wait(timeout=30) == -signal.SIGKILL
    finally:
        if job.poll() is None:
            job.kill()
            job.wait(timeout=30)
        # The JVM exits once its driver's pipe closes, and its workers with it.
        for pid in spark_processes:
            try:
                eventually(lambda p=pid: not alive(p), 60, f"Spark process {pid} to exit")
            except AssertionError:
                os.kill(pid, signal.SIGKILL)
    failpoints.release(failpoint_dir, SWITCHING)
    assert plane.read("orders") == model  # exact, whatever the kill interrupted
    # Its lease ends 10 s after the kill; the next maintenance round (every 2 s) drops them.
    eventually(lambda: pending_rewrites(plane) == 0, 120,
               "the dead driver's prepared rewrites to lapse with its lease", interval_s=0.5)
    assert plane.read("orders") == model

    second = run_gc(plane)
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    report = report_of(second.stdout)
    assert report["totals"]["committed"] == report["totals"]["groups"] > 0
    assert plane.read("orders") == model
    assert stored_rows(plane) == len(model) == 160 - deleted
    assert all(n == 1 for n in streams(plane).values())
    # Leftovers of the killed run are TEMPORARY_GC only: never visible, the TTL
    # sweeper's to delete.
    leftovers = files_of(plane, FileType.TEMPORARY_GC)
    assert all(f.type == FileType.TEMPORARY_GC for f in leftovers)


@pytest.mark.integration
def test_a_dry_run_changes_nothing(make_plane: Callable[..., DataPlane]) -> None:
    plane = make_plane()
    load(plane)
    files = {f.file_id for f in files_of(plane, *FileType)}
    result = run_gc(plane, "--dry-run", table=None)  # --all-tables
    assert result.returncode == 0, result.stdout + result.stderr
    report = report_of(result.stdout)
    assert report["tables"] == [f"{SCHEMA}.events", f"{SCHEMA}.orders"]
    assert report["dry_run"] and report["totals"]["groups"] == len(streams(plane)) > 0
    assert {g["table"] for g in report["groups"]} == {f"{SCHEMA}.orders"}
    assert {g["outcome"] for g in report["groups"]} == {"PLANNED"}
    assert "dry run: " in result.stdout and "SparkContext" not in result.stderr
    assert {f.file_id for f in files_of(plane, *FileType)} == files
    assert pending_rewrites(plane) == 0
    node = plane.nodes[0]
    assert not plane.retinas[node].stub.GetGcStatus(rpb.GetGcStatusRequest(),
                                                   timeout=10).entries
    assert plane.read("orders") == plane.model.rows["orders"]


@pytest.mark.integration
def test_files_restored_from_a_checkpoint_are_rewritten_at_a_cutoff_below_the_restart(
        make_plane: Callable[..., DataPlane]) -> None:
    """An old read transaction holds safeGcTs below the restart of a node. Before
    checkpoints kept the deletion chains, the restored files answered only at or above
    their checkpointAppliedTs and the job skipped them all (their visibility started
    above safeGcTs); the restored history now answers at the cutoff, so they are
    rewritten, and the table reads the same."""
    plane = make_plane()
    load(plane)
    stub = plane.trans.stub()
    old = stub.BeginTrans(tpb.BeginTransRequest(read_only=True), timeout=10)
    try:
        advance(plane)
        node = plane.nodes[0]
        plane.checkpoint(node)
        plane.retinas[node].kill9()
        plane.retinas[node].start()
        plane.recover(node)
        result = run_gc(plane)
        assert result.returncode == 0, result.stdout + result.stderr
        report = report_of(result.stdout)
        assert report["skipped"] == []
        assert report["safe_gc_ts"] == old.timestamp - 1
        assert report["totals"]["groups"] > 0
    finally:
        stub.CommitTrans(tpb.CommitTransRequest(trans_id=old.trans_id), timeout=10)
    assert plane.read("orders") == plane.model.rows["orders"]


@pytest.mark.integration
def test_the_job_decides_without_spark_when_it_cannot_run(
        make_plane: Callable[..., DataPlane]) -> None:
    plane = make_plane()
    load(plane, rows=40)
    unknown = run_gc(plane, table="nope")
    assert unknown.returncode == 2, unknown.stdout + unknown.stderr
    assert f"table {SCHEMA}.nope does not exist; nothing done" in unknown.stderr
    # A typo in the schema is an error, not "0 tables, nothing to do" (issue 26).
    typo = run_gc(plane, table=None, schema=SCHEMA + "p")
    assert typo.returncode == 2, typo.stdout + typo.stderr
    assert f"schema '{SCHEMA}p' is not in the catalog (its schemas: " in typo.stderr
    assert SCHEMA in typo.stderr.rsplit("its schemas: ", 1)[1]
    node = plane.nodes[0]
    plane.retinas[node].kill9()
    plane.retinas[node].start()  # RECOVERING: the gate refuses the job's transaction
    eventually(lambda: not plane.gate_open(), 15, "the gate to refuse")
    closed = run_gc(plane)
    assert closed.returncode == 4, closed.stdout + closed.stderr
    assert "query gate refused" in closed.stderr
    assert not files_of(plane, FileType.TEMPORARY_GC)


@pytest.mark.integration
def test_a_stream_whose_rows_are_all_deleted_is_rewritten_to_an_empty_file(
        make_plane: Callable[..., DataPlane]) -> None:
    plane = make_plane()
    load(plane, rows=80, delete_every=4)
    writer, topology = plane.writers["orders"], plane.topology
    gone = [r["id"] for r in plane.model.rows["orders"].values()
            if topology.vnode_of_key(writer.key(r)) == 0]
    plane.commit({"orders": {"deletes": [{"id": i} for i in gone]}})
    advance(plane)
    settle(plane)
    gc.raise_replay_floor(plane)
    result = run_gc(plane)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report = report_of(result.stdout)
    emptied = [g for g in report["groups"] if g["vnode"] == 0]
    assert len(emptied) == 1 and emptied[0]["rows_kept"] == 0
    assert emptied[0]["outcome"] == "COMMITTED"
    assert plane.read("orders") == plane.model.rows["orders"]
    assert stored_rows(plane) == len(plane.model.rows["orders"])


@pytest.mark.integration
def test_a_node_runs_the_job_for_its_own_streams_when_configured(
        make_plane: Callable[..., DataPlane]) -> None:
    """retina.gc_job_interval_ms: the READY node launches the Spark job itself (``--node``
    itself) and the deleted rows disappear from storage with no operator action.

    The node is loaded first and restarted with the job on: jobs launched every interval
    while the small files were still being written would compete with the load for the
    two cores and take several runs, where one run over the loaded table does it."""
    plane = make_plane()
    load(plane)
    model = plane.model.rows["orders"]
    (node,) = plane.nodes
    plane.retinas[node].stop()
    plane.retinas[node].env = {"RETINA__RETINA__GC_JOB_INTERVAL_MS": "2000",
                               "RETINA__RETINA__GC_JOB_ARGS": "--schema shop --master local[1] "
                                                              "--json"}
    plane.retinas[node].start()
    plane.recover(node)
    assert stored_rows(plane) > len(model)  # the deleted rows are still stored
    eventually(lambda: stored_rows(plane) == len(model), 180,
               "the node's own GC job to reclaim the deleted rows")
    assert plane.read("orders") == model
    assert all(n == 1 for n in streams(plane).values())


@pytest.mark.integration
def test_a_commit_held_by_a_write_buffer_read_leaves_its_group_busy_and_the_run_succeeds(
        make_plane: Callable[..., DataPlane], failpoint_dir: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """BUFFER_FETCH_HOLDS_FILE as the job sees it: a live read got rows of a file from its
    write buffer before the file was published. The commit of that file's group is refused
    ABORTED (held), asked again within the run's one HELD_RETRY_S window, then the group is
    left BUSY for the next run: the run exits 0, nothing changed, reads exact. Once the
    reader has ended, the next run commits every group."""
    monkeypatch.setenv(failpoints.DIR_VAR, str(failpoint_dir))
    plane = make_plane(failpoints="ingest.close.before=block")  # files stay in the buffers
    assert plane.reader is not None
    plane.commit({"orders": {"inserts": [order(i) for i in range(20)]}})
    failpoints.wait_hit(failpoint_dir, "ingest.close.before")
    stub = plane.trans.stub()
    reader = stub.BeginTrans(tpb.BeginTransRequest(read_only=True), timeout=10)
    try:
        buffered = plane.reader.fetch_buffers(reader, SCHEMA, "orders")
        assert sum(t.num_rows for t in buffered.values()) == 20
        failpoints.release(failpoint_dir, "ingest.close.before")
        settle(plane)
        for first in range(100, 220, 20):  # more small files behind the held ones
            plane.commit({"orders": {"inserts": [order(i) for i in range(first, first + 20)]}})
            settle(plane)
        advance(plane)
        gc.raise_replay_floor(plane)
        held = run_gc(plane)
        assert held.returncode == 0, held.stdout[-3000:] + held.stderr[-3000:]
        groups = report_of(held.stdout)["groups"]
        assert {g["outcome"] for g in groups} <= {"BUSY", "COMMITTED"}
        busy = [g for g in groups if g["outcome"] == "BUSY"]
        assert busy and all("write-buffer read" in g["reason"] for g in busy)
        assert plane.read("orders") == plane.model.rows["orders"]
        regular = {f.file_id for f in files_of(plane, FileType.REGULAR)}
        assert all(f["file_id"] in regular for g in busy for f in g["old_files"])
    finally:
        stub.CommitTrans(tpb.CommitTransRequest(trans_id=reader.trans_id), timeout=10)
    done = run_gc(plane)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert {g["outcome"] for g in report_of(done.stdout)["groups"]} == {"COMMITTED"}
    assert plane.read("orders") == plane.model.rows["orders"]
    assert all(n == 1 for n in streams(plane).values())
