"""Storage GC benchmark: ``spark_jobs.storage_gc`` over many small files with deleted rows.

Starts a private cluster (etcd, PostgreSQL, TransServer) and one Retina node owning every
virtual node, with small ingest files (``--rows`` / ``--files`` rows each), writes
``--rows`` rows through UpdateRecord (real write transactions), then deletes a random
``--deleted`` fraction of them, so every file has about that fraction deleted. Once every
file is published and a checkpoint holds them:

* a gated snapshot read (``SnapshotReader``, the reader the tests use) is timed;
* the node is stopped and started again: process start → replayTsReady is timed (then it
  is made READY; nothing was written since the checkpoint, so nothing is replayed);
* ``storage_gc`` runs in a subprocess (Spark local mode, ``--master``); end to end (Python,
  JVM and Spark start-up included) and the Spark task phase are timed; rows/s counts every
  row the tasks read (kept + dropped);
* files and bytes of the table's REGULAR files before and after, the snapshot read and the
  restart again (after a checkpoint that holds the new files).

The snapshot is compared with the expected live rows before and after (printed, not
asserted). Figures are printed; nothing is asserted.

    .venv/bin/python bench/bench_gc.py --rows 200000 --files 500 --deleted 0.3
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import shutil
import subprocess
import sys
import tempfile
import time
from decimal import Decimal
from pathlib import Path

import grpc
import pyspark

from devtools.cluster import (
    ANONYMOUS_WRITES_ENV,
    ClusterState,
    free_port,
    start_cluster,
    start_retina_server,
    stop_cluster,
    terminate,
    wait_for,
)
from retina_common.catalog import Catalog, ColumnSpec, TableRecord
from retina_common.client import TableWriter, requests_by_node
from retina_common.log import configure_logging
from retina_common.pb import retina_pb2 as rpb
from retina_common.pb import retina_pb2_grpc, trans_pb2_grpc
from retina_common.pb import trans_pb2 as tpb
from retina_common.reader import SnapshotReader
from retina_common.recovery_driver import drive_recovery, wait_replay_ready
from retina_common.storage import local_dir
from retina_common.topology import Topology

ROOT = Path(__file__).resolve().parent.parent
SCHEMA, TABLE = "bench", "orders"
COLUMNS = [ColumnSpec("id", "int64"), ColumnSpec("customer", "string"),
           ColumnSpec("amount", "decimal(12,2)"), ColumnSpec("note", "string")]
BATCH = 2000  # rows per write transaction


def row(i: int) -> dict:
    return {"id": i, "customer": f"customer-{i % 997}", "amount": Decimal(i % 100000) / 100,
            "note": f"note-{i}"}


class Bench:
    def __init__(self, state: ClusterState, node: str, table: TableRecord,
                 topology: Topology, node_env: dict[str, str]) -> None:
        self.state = state
        self.node = node
        self.table = table
        self.topology = topology
        self.node_env = node_env
        self.catalog = Catalog(state.postgres.dsn(), pool_max=2)
        self.trans = trans_pb2_grpc.TransServiceStub(grpc.insecure_channel(state.trans_listen))
        self.writer = TableWriter(table, topology)

    def stub(self, channel: grpc.Channel) -> retina_pb2_grpc.RetinaWorkerServiceStub:
        return retina_pb2_grpc.RetinaWorkerServiceStub(channel)

    def write(self, **changes: list[dict]) -> None:
        t = self.trans.BeginTrans(tpb.BeginTransRequest(), timeout=10)
        request = requests_by_node(SCHEMA, [self.writer.updates(t.timestamp, **changes)])
        with grpc.insecure_channel(self.node) as channel:
            self.stub(channel).UpdateRecord(request[self.node], timeout=120)
        self.trans.CommitTrans(tpb.CommitTransRequest(trans_id=t.trans_id), timeout=10)

    def regular(self) -> tuple[int, int]:
        """(REGULAR files, their bytes) of the table."""
        files = bytes_ = 0
        for path in self.catalog.get_paths(self.table.table_id):
            directory = local_dir(path.uri)
            for f in self.catalog.get_regular_files(path.path_id):
                files += 1
                bytes_ += (directory / f.name).stat().st_size if directory else 0
        return files, bytes_

    def read(self) -> tuple[int, float, int]:
        """(rows, seconds, files read) of one gated snapshot read."""
        reader = SnapshotReader(self.state.trans_listen, self.topology)
        try:
            t0 = time.perf_counter()
            snap = reader.read(SCHEMA, TABLE)
            return snap.table.num_rows, time.perf_counter() - t0, snap.files_read
        finally:
            reader.close()

    def buffered_rows(self) -> int:
        reader = SnapshotReader(self.state.trans_listen, self.topology)
        try:
            return reader.read(SCHEMA, TABLE).buffer_rows
        finally:
            reader.close()

    def checkpoint(self) -> None:
        with grpc.insecure_channel(self.node) as channel:
            self.stub(channel).CreateCheckpoint(rpb.CreateCheckpointRequest(), timeout=120)

    def restart(self) -> float:
        """SIGTERM, start again; seconds from process start to replayTsReady. Then
        MarkReady (nothing was written after the checkpoint: nothing to replay)."""
        terminate(self.state.retina_pids[self.node], timeout_s=120)
        t0 = time.perf_counter()
        start_retina_server(self.state, self.node, self.node_env, timeout_s=300)
        with grpc.insecure_channel(self.node) as channel:
            wait_replay_ready(self.stub(channel), 600)
            elapsed = time.perf_counter() - t0
            drive_recovery(self.stub(channel), timeout_s=600)
        wait_for(self.gate_open, 60, "the query gate")
        return elapsed

    def gate_open(self) -> bool:
        try:
            t = self.trans.BeginTrans(tpb.BeginTransRequest(read_only=True), timeout=5)
        except grpc.RpcError:
            return False
        self.trans.CommitTrans(tpb.CommitTransRequest(trans_id=t.trans_id), timeout=5)
        return True


def figures(bench: Bench, expected: int, when: str) -> None:
    files, size = bench.regular()
    rows, seconds, read = bench.read()
    print(f"  {when}: {files} REGULAR files, {size / (1 << 20):,.2f} MiB; snapshot read "
          f"{rows:,} rows in {seconds:.2f} s = {rows / seconds:,.0f} rows/s ({read} files; "
          f"expected {expected:,} rows: {'ok' if rows == expected else 'MISMATCH'})")
    bench.checkpoint()
    print(f"  {when}: process start -> replayTsReady {bench.restart():.2f} s (after a "
          "checkpoint; includes Python start-up and imports)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=200_000)
    parser.add_argument("--files", type=int, default=500, help="ingest files to spread them over")
    parser.add_argument("--deleted", type=float, default=0.3, help="fraction of rows deleted")
    parser.add_argument("--vnodes", type=int, default=8)
    parser.add_argument("--master", default="local[2]")
    parser.add_argument("--job-args", default="",
                        help="extra storage_gc arguments, e.g. '--target-file-bytes 4194304'")
    args = parser.parse_args()
    configure_logging("bench", "warning")
    rows_per_file = max(1, args.rows // args.files)
    # One block per file: a file is sealed as soon as its stream has that many rows.
    node_env = {**ANONYMOUS_WRITES_ENV,  # rows sent straight with TableWriter
                "RETINA__RETINA__BLOCK_ROWS": str(rows_per_file),
                "RETINA__RETINA__BLOCKS_PER_FILE": "1",
                "RETINA__RETINA__FLUSH_INTERVAL_MS": "1000",
                "RETINA__RETINA__CHECKPOINT_INTERVAL_MS": "3600000",
                "RETINA__RETINA__MAX_ROWS_PER_REQUEST": str(4 * BATCH)}
    print(f"setup: {platform.platform()}, {os.cpu_count()} cores, Python "
          f"{platform.python_version()}, PySpark {pyspark.__version__} (local mode, "
          f"{args.master}); one Retina node owning {args.vnodes} virtual nodes, TransServer, "
          "etcd and PostgreSQL on this machine; loopback gRPC; local storage; "
          f"{args.rows:,} rows in files of {rows_per_file} rows (~{args.files} files), "
          f"{args.deleted:.0%} deleted")
    work = Path(tempfile.mkdtemp(prefix="retina-bench-gc-"))
    node = f"127.0.0.1:{free_port()}"
    state = start_cluster(work, nodes=[node], virtual_nodes=args.vnodes, log=lambda _m: None)
    topology = Topology((node,), args.vnodes)
    bench: Bench | None = None
    try:
        catalog = Catalog(state.postgres.dsn())
        catalog.create_schema(SCHEMA)
        table = catalog.create_table(SCHEMA, TABLE, COLUMNS, ["id"])
        catalog.close()
        start_retina_server(state, node, node_env)
        bench = Bench(state, node, table, topology, node_env)
        with grpc.insecure_channel(node) as channel:
            drive_recovery(bench.stub(channel))  # fresh: nothing to replay, then MarkReady
        wait_for(bench.gate_open, 60, "the query gate")
        t0 = time.perf_counter()
        for first in range(0, args.rows, BATCH):
            bench.write(inserts=[row(i) for i in range(first, min(first + BATCH, args.rows))])
        doomed = random.Random(1).sample(range(args.rows), int(args.rows * args.deleted))
        for first in range(0, len(doomed), BATCH):
            bench.write(deletes=[{"id": i} for i in doomed[first:first + BATCH]])
        expected = args.rows - len(doomed)
        # Two empty write transactions: the HWM passes the last delete, so the checkpoint
        # (appliedTs = HWM - 1) holds every write (the bench logs no changelog to replay
        # after a restart) and safeGcTs reaches every delete.
        for _ in range(2):
            t = bench.trans.BeginTrans(tpb.BeginTransRequest(), timeout=10)
            bench.trans.CommitTrans(tpb.CommitTransRequest(trans_id=t.trans_id), timeout=10)
        wait_for(lambda: bench.buffered_rows() == 0, 120, "every file published")
        print(f"  {args.rows:,} rows written and {len(doomed):,} deleted in "
              f"{time.perf_counter() - t0:.1f} s")
        figures(bench, expected, "before GC")

        argv = [sys.executable, "-m", "spark_jobs.storage_gc", "--config", state.config_path,
                "--schema", SCHEMA, "--table", TABLE, "--json", "--master", args.master,
                "--conf", "spark.ui.enabled=false", "--conf", "spark.driver.memory=1g",
                *args.job_args.split()]
        t0 = time.perf_counter()
        result = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True,
                                env={**os.environ, "PYSPARK_PYTHON": sys.executable})
        end_to_end = time.perf_counter() - t0
        Path(work, "storage_gc.out").write_text(result.stdout + result.stderr)
        lines = [line for line in result.stdout.splitlines() if line.startswith('{"safe_gc_ts"')]
        if not lines:
            raise SystemExit(f"storage_gc exited {result.returncode}:\n"
                             f"{result.stdout[-3000:]}\n{result.stderr[-3000:]}")
        report = json.loads(lines[-1])
        t = report["totals"]
        moved = t["rows_kept"] + t["rows_dropped"]
        print(f"  storage_gc exit {result.returncode}: {t['committed']} of {t['groups']} groups "
              f"committed ({t['refused']} refused, {t['failed']} failed), files "
              f"{t['files_before']} -> {t['files_after']}, rows kept {t['rows_kept']:,} "
              f"dropped {t['rows_dropped']:,}, {t['bytes_before'] / (1 << 20):,.2f} MiB -> "
              f"{t['bytes_after'] / (1 << 20):,.2f} MiB")
        print(f"  rewrite, end to end {end_to_end:.1f} s = {moved / end_to_end:,.0f} rows/s "
              f"(Spark start-up {t['spark_start_s']:.1f} s); Spark phase "
              f"{t['task_seconds']:.2f} s = {moved / max(t['task_seconds'], 1e-9):,.0f} rows/s "
              f"(prepares, {t['groups']} tasks, commits)")
        print(f"  tasks alone: {t['task_busy_seconds']:.2f} s summed over {t['groups']} tasks = "
              f"{moved / max(t['task_busy_seconds'], 1e-9):,.0f} rows per task-second (read, "
              "QueryVisibility, filter, encode, catalog row, durable write)")
        print(f"  the node's side, sequential from the driver: PrepareGcRewrite "
              f"{t['prepare_seconds']:.2f} s, CommitGcRewrite {t['commit_seconds']:.2f} s "
              f"({moved / max(t['commit_seconds'], 1e-9):,.0f} rows/s committed)")
        figures(bench, expected, "after GC")
    finally:
        if bench is not None:
            bench.catalog.close()
        stop_cluster(state, log=lambda _m: None)
        if os.environ.get("RETINA_BENCH_KEEP"):
            print(f"kept {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
