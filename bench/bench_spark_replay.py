"""Spark CDC replay benchmark: ``spark_jobs.cdc_replay --recover`` over a durable changelog.

Starts a private cluster (etcd, PostgreSQL, TransServer) with one Retina node owning all
virtual nodes (default 8), then writes a changelog of ``--rows`` rows (default 200,000) in
transactions of ``--rows-per-txn`` rows, each with a real timestamp from a committed
write transaction: mostly new keys, some replaces and deletes of earlier ones. The rows are
never sent, and the Retina node is started only afterwards: it is a fresh node, RECOVERING
with nothing applied, so its recovery replays the whole changelog (a node rebuilt from
the changelog). Then:

* ``cdc_replay --recover NODE`` runs in a subprocess (``--master``: local mode, or a
  standalone cluster's ``spark://`` URL, e.g. from ``bench/spark_standalone.sh``);
  the end-to-end time includes Python and JVM start-up, Spark start-up, the replay and
  MarkReady; the replay phase alone is the Spark job, as the job's JSON summary reports;
* the node is READY and a gated snapshot count is checked against the expected live rows;
* with ``--baseline`` (default on) the same data goes through the connector's own,
  sequential replay path (``Changelog.read`` → ``requests`` → UpdateRecord, in this
  process) against a second fresh cluster, for comparison.

Figures are printed; nothing is asserted about time.

    .venv/bin/python bench/bench_spark_replay.py --rows 200000 --master 'local[2]'
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
from collections.abc import Iterator
from contextlib import contextmanager
from decimal import Decimal
from pathlib import Path

import grpc
import pyspark

from devtools.cluster import (
    ClusterState,
    free_port,
    start_cluster,
    start_retina_server,
    stop_cluster,
)
from retina_common.catalog import Catalog, ColumnSpec, TableRecord
from retina_common.changelog import DELETE, REPLACE, Changelog, ChangeRow, LoggedTransaction
from retina_common.changelog_replay import changelog_rows, node_starts, requests
from retina_common.client import TableWriter
from retina_common.codec import encode_value
from retina_common.config import CdcConfig
from retina_common.log import configure_logging
from retina_common.pb import retina_pb2 as rpb
from retina_common.pb import retina_pb2_grpc, trans_pb2_grpc
from retina_common.pb import trans_pb2 as tpb
from retina_common.reader import SnapshotReader
from retina_common.recovery_driver import drive_recovery
from retina_common.topology import Topology

ROOT = Path(__file__).resolve().parent.parent
SCHEMA, TABLE = "bench", "orders"
COLUMNS = [ColumnSpec("id", "int64"), ColumnSpec("customer", "string"),
           ColumnSpec("amount", "decimal(12,2)"), ColumnSpec("note", "string")]
TXNS_PER_BATCH = 20  # source transactions per changelog batch (one record, one segment/vnode)


def row(i: int, version: int) -> dict:
    return {"id": i, "customer": f"customer-{i % 997}", "amount": Decimal(i % 100000) / 100,
            "note": f"v{version}"}


@contextmanager
def cluster(work: Path, vnodes: int) -> Iterator[tuple[ClusterState, str, TableRecord]]:
    node = f"127.0.0.1:{free_port()}"
    state = start_cluster(work, nodes=[node], virtual_nodes=vnodes, log=lambda _m: None)
    catalog = Catalog(state.postgres.dsn())
    try:
        catalog.create_schema(SCHEMA)
        table = catalog.create_table(SCHEMA, TABLE, COLUMNS, ["id"])
        yield state, node, table
    finally:
        catalog.close()
        stop_cluster(state, log=lambda _m: None)


def build_changelog(state: ClusterState, table: TableRecord, topology: Topology, root: Path,
                    rows: int, per_txn: int) -> int:
    """Log ``rows`` rows at real, committed timestamps; returns the live key count."""
    rng = random.Random(1)
    writer = TableWriter(table, topology)
    trans = trans_pb2_grpc.TransServiceStub(grpc.insecure_channel(state.trans_listen))
    changelog = Changelog(str(root))
    live: set[int] = set()
    next_id, written, batch = 0, 0, []
    while written < rows:
        t = trans.BeginTrans(tpb.BeginTransRequest(), timeout=10)
        changes: list[ChangeRow] = []
        count = min(per_txn, rows - written)
        old = [i for i in rng.sample(range(next_id), min(next_id, count // 10)) if i in live]
        deleted = set(old[: len(old) // 5])  # ~2% deletes, ~8% replaces, the rest new keys
        ids = old + list(range(next_id, next_id + count - len(old)))
        next_id += count - len(old)
        for seq, i in enumerate(ids):
            key = writer.key({"id": i})
            vnode = topology.vnode_of_key(key)
            if i in deleted:
                changes.append(ChangeRow(t.timestamp, seq, vnode, TABLE, DELETE, key, None))
                live.discard(i)
            else:
                values = row(i, seq)
                changes.append(ChangeRow(t.timestamp, seq, vnode, TABLE, REPLACE, key, tuple(
                    encode_value(c.type, values[c.name]) for c in table.columns)))
                live.add(i)
        trans.CommitTrans(tpb.CommitTransRequest(trans_id=t.trans_id), timeout=10)
        batch.append(LoggedTransaction(t.timestamp, f"bench-{t.timestamp}", str(t.timestamp),
                                       int(time.time() * 1000), changes))
        written += count
        if len(batch) == TXNS_PER_BATCH:
            changelog.append(batch)
            batch = []
    if batch:
        changelog.append(batch)
    return len(live)


def write_config(state: ClusterState, root: Path) -> Path:
    path = Path(state.state_dir, "spark-replay.toml")
    path.write_text(Path(state.config_path).read_text() +
                    f'\n[cdc]\nschema = "{SCHEMA}"\nchangelog_root = "{root}"\n')
    return path


def live_rows(state: ClusterState, topology: Topology) -> int:
    """A gated snapshot count, once the write buffer has been published: the
    reader's GetWriteBuffer reply is capped at gRPC's default 4 MiB."""
    reader = SnapshotReader(state.trans_listen, topology)
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                return reader.read(SCHEMA, TABLE).table.num_rows
            except grpc.RpcError as exc:
                if exc.code() != grpc.StatusCode.RESOURCE_EXHAUSTED or \
                        time.monotonic() > deadline:
                    raise
            time.sleep(0.5)  # the flush timer publishes the buffer within ~1 s
    finally:
        reader.close()


def prepare(state: ClusterState, node: str, table: TableRecord, args: argparse.Namespace
            ) -> tuple[Topology, Path, int]:
    topology = Topology((node,), args.vnodes)
    root = Path(state.state_dir, "changelog")
    t0 = time.perf_counter()
    expected = build_changelog(state, table, topology, root, args.rows, args.rows_per_txn)
    print(f"  changelog: {args.rows:,} rows in {-(-args.rows // args.rows_per_txn):,} "
          f"transactions, {expected:,} live keys, built in {time.perf_counter() - t0:.1f} s")
    start_retina_server(state, node)  # fresh: RECOVERING, nothing applied
    return topology, root, expected


def run_spark(args: argparse.Namespace) -> None:
    work = Path(tempfile.mkdtemp(prefix="retina-bench-spark-"))
    print(f"Spark replay (cdc_replay --recover, --master {args.master})")
    try:
        with cluster(work, args.vnodes) as (state, node, table):
            topology, root, expected = prepare(state, node, table, args)
            config = write_config(state, root)
            argv = [sys.executable, "-m", "spark_jobs.cdc_replay", "--config", str(config),
                    "--recover", node, "--json", "--master", args.master,
                    "--conf", "spark.ui.enabled=false", "--conf", "spark.driver.memory=1g"]
            t0 = time.perf_counter()
            result = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True,
                                    env={**os.environ, "PYSPARK_PYTHON": sys.executable})
            end_to_end = time.perf_counter() - t0
            if result.returncode != 0:
                raise SystemExit(f"cdc_replay exited {result.returncode}:\n{result.stderr[-3000:]}")
            summary = json.loads(result.stdout.strip().splitlines()[-1])
            got = live_rows(state, topology)
            print(f"  end to end {end_to_end:.1f} s = {summary['rows'] / end_to_end:,.0f} rows/s "
                  f"(Spark start-up {summary['spark_start_s']:.1f} s)")
            print(f"  replay phase {summary['seconds']:.2f} s = {summary['rows_per_s']:,.0f} "
                  f"rows/s ({summary['rows']:,} rows, {summary['requests']:,} requests, "
                  f"{summary['vnodes']} tasks)")
            print(f"  snapshot after READY: {got:,} rows (expected {expected:,}: "
                  f"{'ok' if got == expected else 'MISMATCH'})")
    finally:
        shutil.rmtree(work, ignore_errors=True)


def run_sequential(args: argparse.Namespace) -> None:
    work = Path(tempfile.mkdtemp(prefix="retina-bench-seq-"))
    print("Baseline: the connector's sequential replay, in this process")
    try:
        with cluster(work, args.vnodes) as (state, node, table):
            topology, root, expected = prepare(state, node, table, args)
            changelog = Changelog(str(root))
            counted = {"rows": 0}

            def replay(starts: rpb.GetRecoveryReplayTsResponse,
                       context: rpb.RecoveryReplayContext) -> Iterator[rpb.UpdateRecordRequest]:
                rows = changelog.read(node_starts(node, topology, starts, rpb.VNODE))
                # As the connector sends them: its request size, the columnar form (this
                # node says it accepts it).
                for request in requests(SCHEMA, {TABLE: table}, rows,
                                        CdcConfig().request_max_rows):
                    request.recovery_replay_context.CopyFrom(context)
                    counted["rows"] += changelog_rows(request)
                    yield request

            with grpc.insecure_channel(node) as channel:
                t0 = time.perf_counter()
                drive_recovery(retina_pb2_grpc.RetinaWorkerServiceStub(channel), replay=replay,
                               timeout_s=120)
                elapsed = time.perf_counter() - t0
            got = live_rows(state, topology)
            print(f"  replay + MarkReady {elapsed:.2f} s = {counted['rows'] / elapsed:,.0f} rows/s"
                  f" ({counted['rows']:,} rows)")
            print(f"  snapshot after READY: {got:,} rows (expected {expected:,}: "
                  f"{'ok' if got == expected else 'MISMATCH'})")
    finally:
        shutil.rmtree(work, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=200_000)
    parser.add_argument("--rows-per-txn", type=int, default=1000)
    parser.add_argument("--vnodes", type=int, default=8)
    parser.add_argument("--master", default="local[2]")
    parser.add_argument("--no-baseline", dest="baseline", action="store_false",
                        help="skip the sequential in-process replay")
    args = parser.parse_args()
    configure_logging("bench", "warning")
    print(f"setup: {platform.platform()}, {os.cpu_count()} cores, Python "
          f"{platform.python_version()}, PySpark {pyspark.__version__} (--master "
          f"{args.master}); one Retina node owning {args.vnodes} virtual nodes, TransServer, "
          "etcd and PostgreSQL on this "
          "machine; loopback gRPC; local changelog storage")
    run_spark(args)
    if args.baseline:
        run_sequential(args)


if __name__ == "__main__":
    main()
