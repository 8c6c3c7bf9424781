"""Where UpdateRecord time goes, stage by stage, in one process (no gRPC).

Per phase (insert, replace, delete) and ``--batch`` rows per request: the client
building the request (``TableWriter.updates``), protobuf serialise and parse,
the node's ``prepare`` (validation and decoding) and ``apply`` (index,
visibility, write buffer; one LMDB fsync per request), each as rows/s. A
private etcd and PostgreSQL are started for the catalog; the node runs in
this process. Prints figures; asserts nothing.

``--positions``: every request carries a source position (as the CDC connector's do,
source_positions.py: stored in the request's LMDB transaction), and the time to drop
``--prune-positions`` stored positions below a prune horizon is printed too. Run it
with and without to see what positions cost.

    .venv/bin/python bench/bench_apply_stages.py --batch 5000 --requests 20
    .venv/bin/python bench/bench_apply_stages.py --batch 50 --requests 400 --positions
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import tempfile
import time
from pathlib import Path

from devtools.cluster import free_port, start_cluster, stop_cluster
from retina_common.catalog import Catalog, ColumnSpec
from retina_common.client import TableWriter, requests_by_node
from retina_common.log import configure_logging
from retina_common.pb import retina_pb2 as pb
from retina_common.topology import Topology
from retina_server.index import LocalIndexService
from retina_server.node import BufferSettings, RetinaNode
from retina_server.update_record import apply, prepare

COLUMNS = [ColumnSpec("id", "int64"), ColumnSpec("a", "int64"), ColumnSpec("b", "float64"),
           ColumnSpec("c", "string"), ColumnSpec("d", "int64"), ColumnSpec("e", "string")]


def row(i: int, version: int) -> dict:
    return {"id": i, "a": i * 3 + version, "b": i * 0.5, "c": f"name-{i % 997}-{version}",
            "d": version, "e": "x" * 20}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=5000, help="rows per request")
    parser.add_argument("--requests", type=int, default=20, help="requests per phase")
    parser.add_argument("--positions", action="store_true",
                        help="a source position on every request (as CDC sends)")
    parser.add_argument("--prune-positions", type=int, default=200_000,
                        help="with --positions: positions stored, then dropped below a "
                             "horizon in one transaction (timed)")
    args = parser.parse_args()
    configure_logging("bench", "warning")
    work = Path(tempfile.mkdtemp(prefix="retina-bench-stages-"))
    os.chmod(work, 0o755)  # PostgreSQL runs as its own user and writes its log below
    node_id = f"127.0.0.1:{free_port()}"
    print(f"setup: {platform.platform()}, {os.cpu_count()} cores, Python "
          f"{platform.python_version()}; one node (8 virtual nodes) in this process, "
          f"{args.requests} requests of {args.batch} rows per phase, 6 columns, "
          f"{'a' if args.positions else 'no'} source position per request")
    state = start_cluster(work / "cluster", nodes=[node_id], virtual_nodes=8,
                          log=lambda _m: None)
    catalog = Catalog(state.postgres.dsn())
    try:
        catalog.create_schema("b")
        table = catalog.create_table("b", "t", COLUMNS, ["id"])
        topology = Topology((node_id,), 8)
        node = RetinaNode(node_id, topology, catalog, LocalIndexService(work / "index"),
                          "file://" + str(work / "storage"), BufferSettings(),
                          lambda: int(time.time() * 1000))
        writer = TableWriter(table, topology)
        ts = 10**9
        for phase, kind in (("insert", "inserts"), ("replace", "replaces"),
                            ("delete", "deletes")):
            spent = dict.fromkeys(("client encode", "serialize", "parse", "prepare", "apply"),
                                  0.0)
            for b in range(args.requests):
                ts += 1
                rows = [row(b * args.batch + i, 1) for i in range(args.batch)]
                t0 = time.perf_counter()
                request = requests_by_node("b", [writer.updates(ts, **{kind: rows})])[node_id]
                if args.positions:  # a PostgreSQL LSN, as the connector sends it
                    for tud in request.table_update_data:
                        tud.source_position = f"0/{ts:X}"
                t1 = time.perf_counter()
                data = request.SerializeToString()
                t2 = time.perf_counter()
                parsed = pb.UpdateRecordRequest.FromString(data)
                t3 = time.perf_counter()
                prepared = prepare(node, parsed, 10**7)
                t4 = time.perf_counter()
                apply(node, prepared)
                t5 = time.perf_counter()
                for name, seconds in zip(spent, (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t5 - t4),
                                         strict=True):
                    spent[name] += seconds
            total = args.requests * args.batch
            server = spent["parse"] + spent["prepare"] + spent["apply"]
            print(f"{phase:<8} " + " | ".join(f"{name} {total / s:>10,.0f}"
                                               for name, s in spent.items())
                  + f" | server total {total / server:>9,.0f} rows/s, "
                  f"{args.requests / server:,.0f} requests/s")
        if args.positions:
            prune_positions(node, args.prune_positions)
        node.shutdown()
    finally:
        catalog.close()
        stop_cluster(state, log=lambda _m: None)
        shutil.rmtree(work, ignore_errors=True)


def prune_positions(node: RetinaNode, count: int) -> None:
    """Store ``count`` positions (below every timestamp above), one ``put`` per request
    as UpdateRecord does (timed: its cost in a request, the shared commit aside), then
    time dropping them in one transaction, as a GC round's prune does
    (PrimaryIndex.prune_versions)."""
    put = node.source_positions.put
    spent = 0.0
    for start in range(1, count + 1, 10_000):
        with node.index.primary.write_batch():
            t0 = time.perf_counter()
            for ts in range(start, min(start + 10_000, count + 1)):
                put("bench", {ts: f"0/{ts:X}"})
            spent += time.perf_counter() - t0
    print(f"put      {spent / count * 1e6:.1f} µs per request's position (in its write "
          "batch, before the batch's one commit)")
    t0 = time.perf_counter()
    with node.index.primary.transaction() as txn:
        dropped = node.source_positions.drop_below(txn, count + 1)
    seconds = time.perf_counter() - t0
    print(f"prune    {dropped:,} source positions dropped in one transaction in "
          f"{seconds * 1000:,.0f} ms ({dropped / seconds:,.0f}/s, commit included)")


if __name__ == "__main__":
    main()
