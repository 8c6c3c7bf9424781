"""What the durable write path costs an application (retina_common/writer.py).

Starts a private cluster (etcd, PostgreSQL, TransServer) and one Retina node owning
every virtual node (in the development mode, so the raw path below is admitted too),
over loopback gRPC, and writes the same upserts two ways, one transaction at a time:

* ``durable``: ``DurableWriter.write`` (BeginTrans, the changelog append: a segment and
  a batch record, each fsynced, UpdateRecord naming the writer, CommitTrans, the
  acknowledged mark, fsynced): crash-safe;
* ``raw``: BeginTrans, UpdateRecord without a writer id (``TableWriter``), CommitTrans:
  what a program did before issue 26; a node crash loses its rows.

Prints, per transaction size, rows/s and the median / p99 transaction latency of each,
and the setup. Storage is the local disk (its fsync is most of the difference).

    .venv/bin/python bench/bench_writer.py --transactions 200 --sizes 1,100,1000
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import grpc

from devtools.cluster import (
    ANONYMOUS_WRITES_ENV,
    free_port,
    start_cluster,
    start_retina_server,
    stop_cluster,
)
from retina_common.catalog import Catalog, ColumnSpec
from retina_common.client import TableWriter, requests_by_node
from retina_common.config import load_config
from retina_common.log import configure_logging
from retina_common.pb import retina_pb2_grpc, trans_pb2_grpc
from retina_common.pb import trans_pb2 as tpb
from retina_common.recovery_driver import drive_recovery
from retina_common.topology import Topology
from retina_common.writer import DurableWriter

SCHEMA, TABLE = "bench", "events"


def rows(start: int, count: int) -> list[dict]:
    return [{"id": i, "name": f"event-{i}", "value": i * 7} for i in range(start, start + count)]


def measure(name: str, size: int, transactions: int,
            write: Callable[[list[dict]], object]) -> None:
    latencies = []
    t0 = time.perf_counter()
    for n in range(transactions):
        batch = rows(n * size, size)
        s = time.perf_counter()
        write(batch)
        latencies.append(time.perf_counter() - s)
    total = time.perf_counter() - t0
    latencies.sort()
    p50, p99 = statistics.median(latencies), latencies[int(0.99 * (len(latencies) - 1))]
    print(f"{name:<8} {size:>5} rows/txn  {transactions * size / total:>10,.0f} rows/s  "
          f"p50 {p50 * 1000:7.2f} ms  p99 {p99 * 1000:7.2f} ms", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--transactions", type=int, default=200, help="per size and path")
    parser.add_argument("--sizes", default="1,100,1000", help="rows per transaction")
    args = parser.parse_args()
    configure_logging("bench", "warning")
    work = Path(tempfile.mkdtemp(prefix="retina-bench-writer-"))
    node = f"127.0.0.1:{free_port()}"
    print(f"setup: {platform.platform()}, {os.cpu_count()} cores, Python "
          f"{platform.python_version()}; one Retina node (all 8 vnodes), TransServer, etcd and "
          f"PostgreSQL on this machine; loopback gRPC; the changelog on the local disk "
          f"({work}); {args.transactions} transactions per size and path, one at a time")
    state = start_cluster(work, nodes=[node], virtual_nodes=8, log=lambda _m: None)
    try:
        catalog = Catalog(state.postgres.dsn())
        catalog.create_schema(SCHEMA)
        table = catalog.create_table(SCHEMA, TABLE, [
            ColumnSpec("id", "int64"), ColumnSpec("name", "string"),
            ColumnSpec("value", "int64")], ["id"])
        catalog.close()
        start_retina_server(state, node, ANONYMOUS_WRITES_ENV)
        channel = grpc.insecure_channel(node)
        grpc.channel_ready_future(channel).result(timeout=60)
        stub = retina_pb2_grpc.RetinaWorkerServiceStub(channel)
        drive_recovery(stub)
        trans = trans_pb2_grpc.TransServiceStub(grpc.insecure_channel(state.trans_listen))
        raw_writer = TableWriter(table, Topology((node,), 8), min_columnar_rows=1 << 30)

        def raw(batch: list[dict]) -> None:
            begun = trans.BeginTrans(tpb.BeginTransRequest(), timeout=10)
            request = requests_by_node(SCHEMA, [raw_writer.updates(
                begun.timestamp, replaces=batch)])[node]
            stub.UpdateRecord(request, timeout=60)
            trans.CommitTrans(tpb.CommitTransRequest(trans_id=begun.trans_id), timeout=10)

        with DurableWriter.connect(load_config(state.config_path), "bench-app",
                                   SCHEMA) as durable:
            for size in (int(s) for s in args.sizes.split(",")):
                measure("raw", size, args.transactions, raw)
                measure("durable", size, args.transactions,
                        lambda batch: durable.write(TABLE, upserts=batch))
        channel.close()
    finally:
        stop_cluster(state, log=lambda _m: None)
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
