"""Retina data-plane benchmark: UpdateRecord throughput, snapshot reads, QueryVisibility.

Starts a private cluster (etcd, PostgreSQL, TransServer) and one Retina
node owning every virtual node, over loopback gRPC. Requests are built
before the clock starts; each batch is one write transaction (BeginTrans,
UpdateRecord, CommitTrans) and the figures count UpdateRecord time only,
then the whole transaction. ``--profile`` also runs the replace apply path
in this process under cProfile and prints where the time goes.

    .venv/bin/python bench/bench_dataplane.py --batches 40 --profile
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import time
from pathlib import Path

import one_node
from one_node import machine, row

from devtools.cluster import ANONYMOUS_WRITES_ENV, wait_for
from retina_common.catalog import Catalog
from retina_common.client import TableWriter, requests_by_node
from retina_common.log import configure_logging
from retina_common.pb import retina_pb2 as rpb
from retina_common.pb import trans_pb2 as tpb
from retina_common.reader import SnapshotReader
from retina_common.topology import Topology

BATCH = 1000  # rows per batch of the profile


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", type=int, default=40, help="batches per phase")
    parser.add_argument("--batch", type=int, default=BATCH, help="rows per batch")
    parser.add_argument("--form", choices=("columnar", "row"), default="columnar",
                        help="UpdateRecord's wire form (docs/encoding.md)")
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args()
    configure_logging("bench", "warning")
    print(f"{machine()}; batches of {args.batch} rows ({args.form} form), {args.batches} per "
          "phase; block 4096 rows, 4 blocks per file")
    one = one_node.start("retina-bench-dp-")
    node, state, topology, table = one.node, one.state, one.topology, one.table
    try:
        stub = one.ready_node(ANONYMOUS_WRITES_ENV)  # the apply path alone
        trans = one.trans()
        writer = TableWriter(table, topology, columnar=args.form == "columnar")
        n, size = args.batches, args.batch

        def phase(name: str, build) -> None:
            stamps = [trans.BeginTrans(tpb.BeginTransRequest(), timeout=10) for _ in range(n)]
            requests = [requests_by_node("bench", [writer.updates(t.timestamp, **build(b))])[node]
                        for b, t in enumerate(stamps)]
            apply_s = []
            t0 = time.perf_counter()
            for t, request in zip(stamps, requests, strict=True):
                a0 = time.perf_counter()
                stub.UpdateRecord(request, timeout=60)
                apply_s.append(time.perf_counter() - a0)
                trans.CommitTrans(tpb.CommitTransRequest(trans_id=t.trans_id), timeout=10)
            total = time.perf_counter() - t0
            rows = n * size
            p50 = statistics.median(apply_s)
            print(f"{name:<28} {rows / sum(apply_s):>10,.0f} rows/s UpdateRecord mean, "
                  f"{size / p50:,.0f} at the p50 batch ({p50 * 1000:.1f} ms); "
                  f"{rows / total:,.0f} rows/s with Begin/Commit")

        phase("insert-only", lambda b: {"inserts": [row(b * size + i) for i in range(size)]})
        phase("replace (DELETE+INSERT)",
              lambda b: {"replaces": [row(b * size + i, 1) for i in range(size)]})
        phase("delete-only", lambda b: {"deletes": [{"id": b * size + i}
                                                    for i in range(0, size, 2)] +
                                        [{"id": b * size + i} for i in range(1, size, 2)]})
        phase("insert-only (refill)",
              lambda b: {"inserts": [row(n * size + b * size + i) for i in range(size)]})

        reader = SnapshotReader(state.trans_listen, topology)
        wait_for(lambda: reader.read("bench", "orders").buffer_rows == 0, 60, "publish")
        t0 = time.perf_counter()
        snap = reader.read("bench", "orders")
        elapsed = time.perf_counter() - t0
        print(f"{'snapshot read':<28} {snap.table.num_rows / elapsed:>10,.0f} rows/s "
              f"({snap.table.num_rows} rows from {snap.files_read} files in {elapsed:.2f} s)")
        listing = None
        with reader.transaction() as r:
            listing = trans.ListQueryFiles(tpb.ListQueryFilesRequest(
                trans_id=r.trans_id, schema_name="bench", table_name="orders"), timeout=10)
            latencies = []
            for i in range(500):
                f = listing.files[i % len(listing.files)]
                q0 = time.perf_counter()
                stub.QueryVisibility(rpb.QueryVisibilityRequest(
                    file_id=f.file_id, timestamp=r.timestamp, trans_id=r.trans_id))
                latencies.append((time.perf_counter() - q0) * 1000)
        latencies.sort()
        print(f"{'QueryVisibility (whole file)':<28} p50 {statistics.median(latencies):.3f} ms, "
              f"p99 {latencies[int(0.99 * len(latencies))]:.3f} ms "
              f"({listing.files[0].num_row_group} row groups of 4096 rows)")
        reader.close()
        if args.profile:
            profile_apply(state.postgres.dsn(), one.work, topology, node, table)
    finally:
        one.stop()


def profile_apply(dsn: str, work: Path, topology: Topology, node_id: str, table) -> None:
    """Replace batches applied in-process (no gRPC) under cProfile."""
    from retina_server.index import LocalIndexService
    from retina_server.node import BufferSettings, RetinaNode
    from retina_server.update_record import apply, prepare

    catalog = Catalog(dsn)
    node = RetinaNode(node_id, topology, catalog, LocalIndexService(work / "profile-index"),
                      "file://" + str(work / "profile-storage"), BufferSettings(),
                      lambda: int(time.time() * 1000))
    writer = TableWriter(table, topology)
    inserts = [requests_by_node("bench", [writer.updates(
        10**9 + b, inserts=[row(10**7 + b * BATCH + i) for i in range(BATCH)])])[node_id]
        for b in range(10)]
    replaces = [requests_by_node("bench", [writer.updates(
        10**9 + 100 + b, replaces=[row(10**7 + b * BATCH + i, 2) for i in range(BATCH)])])[node_id]
        for b in range(10)]
    for request in inserts:
        apply(node, prepare(node, request, 10**6))
    profiler = cProfile.Profile()
    t0 = time.perf_counter()
    profiler.enable()
    for request in replaces:
        apply(node, prepare(node, request, 10**6))
    profiler.disable()
    elapsed = time.perf_counter() - t0
    print(f"\nin-process replace apply (no gRPC, profiled): {10 * BATCH / elapsed:,.0f} rows/s")
    stats = pstats.Stats(profiler)
    stats.sort_stats("tottime").print_stats(22)
    node.shutdown()
    catalog.close()


if __name__ == "__main__":
    main()
