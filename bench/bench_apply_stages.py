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

``--txn-rows N``: then a mixed phase shaped as the CDC connector sends a micro-batch:
requests of ``--batch`` rows made of N-row source transactions, each at its own
timestamp (one TableUpdateData per transaction and virtual node: a row or two each),
with the node's time per transaction and per TableUpdateData.

    .venv/bin/python bench/bench_apply_stages.py --batch 5000 --requests 20
    .venv/bin/python bench/bench_apply_stages.py --batch 50 --requests 400 --positions
    .venv/bin/python bench/bench_apply_stages.py --batch 1000 --requests 20 --txn-rows 10
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
    parser.add_argument("--txn-rows", type=int, default=0,
                        help="a mixed phase as CDC sends it: requests of --batch rows in "
                             "source transactions of this many rows each, every one at its "
                             "own timestamp (7 inserts, 2 replaces, 1 delete in 10)")
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
        if args.txn_rows:
            mixed_phase(node, writer, args, ts)
        if args.positions:
            prune_positions(node, args.prune_positions)
        node.shutdown()
    finally:
        catalog.close()
        stop_cluster(state, log=lambda _m: None)
        shutil.rmtree(work, ignore_errors=True)


def mixed_phase(node: RetinaNode, writer: TableWriter, args: argparse.Namespace,
                ts: int) -> None:
    """Requests of ``--batch`` rows made of ``--txn-rows``-row transactions, each at its
    own timestamp (one TableUpdateData per transaction and virtual node, as the CDC
    connector sends a micro-batch of source transactions): prepare and apply, rows/s and
    the node's time per transaction."""
    per_txn = args.txn_rows
    inserts_n = max(1, per_txn * 7 // 10)
    replaces_n = per_txn * 2 // 10
    deletes_n = per_txn - inserts_n - replaces_n
    live: list[int] = []  # keys this phase inserted and did not delete
    next_id = 10 * args.requests * args.batch  # above every key the other phases wrote
    spent = {"prepare": 0.0, "apply": 0.0}
    rows_sent = txns = tuds = 0
    for _ in range(args.requests):
        updates = []
        for _t in range(max(1, args.batch // per_txn)):
            ts += 1
            new = [row(next_id + i, 2) for i in range(inserts_n)]
            next_id += inserts_n
            old = len(live) >= replaces_n + deletes_n
            changed = [row(live[-1 - i], 3) for i in range(replaces_n)] if old else []
            gone = [{"id": live.pop(0)} for _d in range(deletes_n)] if old else []
            live.extend(r["id"] for r in new)
            updates.append(writer.updates(ts, inserts=new, replaces=changed, deletes=gone))
            rows_sent += per_txn
            txns += 1
        request = requests_by_node("b", updates)[node.node_id]
        tuds += len(request.table_update_data)
        parsed = pb.UpdateRecordRequest.FromString(request.SerializeToString())
        t0 = time.perf_counter()
        prepared = prepare(node, parsed, 10**7)
        t1 = time.perf_counter()
        apply(node, prepared)
        t2 = time.perf_counter()
        spent["prepare"] += t1 - t0
        spent["apply"] += t2 - t1
    server = sum(spent.values())
    print(f"mixed    {per_txn}-row transactions ({inserts_n} inserts, {replaces_n} replaces, "
          f"{deletes_n} deletes), {tuds / args.requests:,.0f} TableUpdateData per request: "
          f"prepare {rows_sent / spent['prepare']:,.0f} | apply "
          f"{rows_sent / spent['apply']:,.0f} | server total {rows_sent / server:,.0f} "
          f"rows/s; {server / txns * 1e6:,.0f} µs per transaction "
          f"({spent['prepare'] / tuds * 1e6:,.1f} + {spent['apply'] / tuds * 1e6:,.1f} µs "
          "per TableUpdateData)")


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
