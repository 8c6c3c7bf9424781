"""``spark_jobs.parquet_load`` in Spark local mode against real nodes: Parquet files loaded
through the bulk load path, one task per file, a task killed after half its chunks and
run again by Spark (its committed chunks answered by their load ids, the rest loaded),
and a live key refused; the table against the model every time."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from retina_common import failpoints
from retina_common.failpoints import DIR_VAR, ENV_VAR

from .dataplane import DataPlane
from .support import ROOT, eventually
from .test_bulk_load import loaded, make_plane, order, orders

pytestmark = pytest.mark.integration
__all__ = ["make_plane"]  # the fixture, used by name


def run_job(plane: DataPlane, files: list[Path], failpoint: str = "",
            failpoint_dir: Path | None = None) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYSPARK_PYTHON": sys.executable, ENV_VAR: failpoint}
    if failpoint_dir is not None:
        env[DIR_VAR] = str(failpoint_dir)
    argv = [sys.executable, "-m", "spark_jobs.parquet_load", "--config", str(plane.config_path),
            "--table", "shop.orders", "--master", "local[2,2]", "--chunk-rows", "250",
            "--lease-ms", "5000",
            "--json", "--no-progress", *map(str, files)]
    return subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env=env, check=False)


def summary(stdout: str) -> dict:
    lines = [line for line in stdout.splitlines() if line.startswith('{"job_id"')]
    assert lines, stdout[-3000:]
    return json.loads(lines[-1])


def write_files(tmp_path: Path, ranges: list[range]) -> list[Path]:
    out = []
    for i, ids in enumerate(ranges):
        path = tmp_path / f"part-{i}.parquet"
        pq.write_table(orders(ids), path)
        out.append(path)
    return out


def test_a_task_killed_after_half_its_chunks_is_run_again_and_every_row_lands_once(
        make_plane: Callable[..., DataPlane], tmp_path: Path, failpoint_dir: Path) -> None:
    plane = make_plane()
    plane.commit({"orders": {"inserts": [order(i) for i in range(5)]}})
    files = write_files(tmp_path, [range(1_000, 2_000), range(2_000, 3_000)])
    point = "loader.commit_trans.after"
    done = run_job(plane, files, f"{point}=exit(137)@2+once", failpoint_dir)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert failpoints.acted_once(failpoint_dir, point) is not None  # a task died there
    assert "Python worker exited unexpectedly" in done.stderr  # and Spark ran it again
    report = summary(done.stdout)
    assert report["rows"] == 2_000 and report["tasks_done"] == 2
    loaded(plane, range(1_000, 3_000))
    # The dead attempt's last write transactions (its chunks' parts journaled on a node,
    # never committed at the TransServer) hold the high-water mark until their leases
    # end; then every row reads exactly once.
    eventually(lambda: plane.read("orders") == plane.model.rows["orders"], 60,
               "the table to equal the model once the dead attempt's leases ended")


def test_a_file_with_a_live_key_fails_the_job_and_loads_nothing_of_its_chunk(
        make_plane: Callable[..., DataPlane], tmp_path: Path) -> None:
    """One node: the chunk is refused whole (over several nodes, another node may commit
    its part first: a partial chunk, docs/write-paths/bulk-load.md)."""
    plane = make_plane(nodes=1)
    plane.commit({"orders": {"inserts": [order(1_100)]}})
    files = write_files(tmp_path, [range(1_000, 1_200)])
    done = run_job(plane, files)
    assert done.returncode == 3, done.stdout[-2000:] + done.stderr[-2000:]
    assert "ALREADY_EXISTS" in done.stderr
    assert plane.read("orders") == plane.model.rows["orders"]
