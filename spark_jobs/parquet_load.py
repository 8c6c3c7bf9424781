"""Load Parquet files into a Retina table with Spark, through the bulk load path: one task
per group of input files, each loading its files with ``retina_common.bulk_loader`` (Arrow
batches in, one Parquet file per virtual node and chunk written by the task, published by
the owning nodes at the chunk's commit timestamp; docs/write-paths/bulk-load.md).

    python -m spark_jobs.parquet_load --config retina.toml --table shop.orders A.parquet B.parquet
    spark-submit spark_jobs/parquet_load.py --config retina.toml --table shop.orders \\
        --files-per-task 4 /data/export/*.parquet

Every row must be for a key without a live version (a new table, a backfill of keys the
table never had): a chunk with a live key is refused (ALREADY_EXISTS) and the job fails
naming it (exit 3); the chunks committed before stay, each exactly once.

**A retried task** (Spark runs a failed task again, ``spark.task.maxFailures``) loads the
same files with the same load ids (``<job id>.<task>.<chunk>.<node>``,
LOADER_IDS_ARE_IDEMPOTENT): a node answers a part an earlier attempt committed as
committed, and only the rest is loaded, so every row lands exactly once. A chunk whose
parts were committed by two attempts is visible at two timestamps, each part at one.

The input files must be readable from every executor (a shared file system or an object
store URI Arrow reads). Exit codes: see spark_jobs.common (0 loaded; 3 refused; 4 a node or
the TransServer unreachable; 1 anything else).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import uuid
from dataclasses import dataclass
from typing import Any

import grpc

from retina_common import exit_codes
from retina_common.bulk_loader import (
    DEFAULT_CHUNK_ROWS,
    BulkLoader,
    LoadFailed,
    parquet_batches,
)
from retina_common.catalog import Catalog, CatalogError, NotFound, TableRecord
from retina_common.client import channel
from retina_common.config import Config, ConfigError
from retina_common.pb import retina_pb2_grpc, trans_pb2_grpc
from retina_common.topology import Topology
from spark_jobs.common import (
    REFUSED_MARK,
    TaskError,
    add_spark_arguments,
    exit_code_of,
    fail,
    load,
    parse_conf,
    run_reported,
    short_reason,
    spark_session,
)

PROG = "spark_jobs.parquet_load"


@dataclass(frozen=True)
class LoadTask:
    index: int
    files: tuple[str, ...]


@dataclass(frozen=True)
class LoadSpec:
    """What every task needs: plain, picklable data."""

    job_id: str
    schema: str
    table: TableRecord
    topology: Topology
    trans_address: str
    chunk_rows: int
    rpc_timeout_s: float
    lease_ms: int


def load_files(spec: LoadSpec, task: LoadTask) -> tuple[int, int, int]:
    """One task: its files through a BulkLoader whose load ids are the task's own (a
    retry is answered for what an earlier attempt committed); (rows, chunks, files)."""
    channels = [channel(spec.trans_address)]
    nodes = {}
    for node in spec.topology.nodes:
        channels.append(channel(node))
        nodes[node] = retina_pb2_grpc.RetinaWorkerServiceStub(channels[-1])
    try:
        loader = BulkLoader(spec.schema, spec.table, spec.topology,
                            trans_pb2_grpc.TransServiceStub(channels[0]), nodes,
                            chunk_rows=spec.chunk_rows, timeout_s=spec.rpc_timeout_s,
                            lease_ms=spec.lease_ms, id_prefix=f"{spec.job_id}.{task.index}")
        try:
            report = loader.load(parquet_batches(task.files))
        except LoadFailed as exc:
            raise TaskError(f"{REFUSED_MARK} task {task.index}: {exc}") from None
        except grpc.RpcError as exc:
            raise TaskError.of(exc, f"task {task.index}") from None
        except (OSError, ValueError) as exc:
            raise TaskError(f"{REFUSED_MARK} task {task.index}: {exc}") from None
    finally:
        for ch in channels:
            ch.close()
    return report.rows, report.chunks, report.files


def tasks_of(files: list[str], per_task: int) -> list[LoadTask]:
    return [LoadTask(i, tuple(files[at:at + per_task]))
            for i, at in enumerate(range(0, len(files), per_task))]


def run(args: argparse.Namespace, config: Config, topology: Topology,
        table: TableRecord) -> int:
    spec = LoadSpec(uuid.uuid4().hex[:12], table.schema_name, table, topology,
                    config.trans.listen, args.chunk_rows, args.rpc_timeout_s, args.lease_ms)
    tasks = tasks_of(list(args.files), args.files_per_task)
    done: dict[int, tuple[int, int, int]] = {}

    def on_result(key: Any, value: Any) -> None:
        done[key] = value
        rows, chunks, files = value
        if not args.json:
            print(f"task {key}: {rows} rows in {chunks} commit(s), {files} file(s)",
                  flush=True)

    spark = spark_session(f"retina-bulk-load-{spec.job_id}", args.master,
                          parse_conf(args.conf))
    started = time.monotonic()
    try:
        failure = run_reported(spark, tasks, lambda t: (t.index, load_files(spec, t)),
                               on_result, "spark-bulk-load-job")
    finally:
        spark.stop()
    seconds = time.monotonic() - started
    rows = sum(v[0] for v in done.values())
    summary = {"job_id": spec.job_id, "table": f"{spec.schema}.{table.name}",
               "tasks": len(tasks), "tasks_done": len(done), "rows": rows,
               "commits": sum(v[1] for v in done.values()),
               "files": sum(v[2] for v in done.values()), "seconds": round(seconds, 3),
               "rows_per_s": round(rows / seconds, 1) if seconds > 0 else 0.0}
    if failure is not None:
        summary["failure"] = short_reason(failure)
    print(json.dumps(summary) if args.json else
          f"loaded {rows} row(s) into {summary['table']}: {summary['commits']} commit(s), "
          f"{summary['files']} file(s), {seconds:.2f} s; job {spec.job_id}", flush=True)
    if failure is not None:
        return fail(PROG, f"load failed: {short_reason(failure)}", exit_code_of(failure))
    return exit_codes.OK


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", help="TOML config file (default: $RETINA_CONFIG)")
    p.add_argument("--table", required=True, help="SCHEMA.TABLE")
    p.add_argument("files", nargs="+", help="Parquet files with the table's columns")
    p.add_argument("--files-per-task", type=int, default=1)
    p.add_argument("--chunk-rows", type=int, default=DEFAULT_CHUNK_ROWS,
                   help="rows per commit (default %(default)s)")
    p.add_argument("--rpc-timeout-s", type=float, default=300.0)
    p.add_argument("--lease-ms", type=int, default=30_000,
                   help="each chunk's write transaction lease (default %(default)s): a task "
                        "that dies holds the high-water mark back at most this long; a "
                        "chunk must load within it")
    p.add_argument("--json", action="store_true", help="one JSON summary line")
    add_spark_arguments(p)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    schema, _, name = args.table.partition(".")
    if not schema or not name or args.files_per_task <= 0 or args.chunk_rows <= 0:
        return fail(PROG, "--table SCHEMA.TABLE, a positive --files-per-task and "
                          "--chunk-rows are required", exit_codes.USAGE)
    try:
        config, topology = load(args.config)
        catalog = Catalog(config.catalog.dsn, pool_max=1)
        try:
            table = catalog.get_table(schema, name)
        finally:
            catalog.close()
    except NotFound:
        return fail(PROG, f"no table {args.table} in the catalog", exit_codes.USAGE)
    except (ConfigError, CatalogError) as exc:
        return fail(PROG, str(exc), exit_codes.USAGE)
    return run(args, config, topology, table)


if __name__ == "__main__":
    sys.exit(main())
