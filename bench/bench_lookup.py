"""Primary-key lookup benchmark: LookupRows latency and batched throughput of one node.

Starts a private cluster (etcd, PostgreSQL, TransServer) and one Retina node owning every
virtual node, over loopback gRPC, and loads a table of ``--rows`` rows (int64 key, a
string, a decimal, a string) in published files, then ``--buffered`` more rows that stay
in the write buffer (the flush timer is off; only full files are published). Keys are
drawn at random (seeded) from the whole table, inside one read transaction, after one
pass over every key has decoded the row groups into the node's row-group cache:

* one key per call: p50 / p99 through the client helper (retina_common/lookup.py,
  routing, a future per node, merging) and directly through the stub; and through the
  helper without a transaction (it begins and ends one per call: the newest snapshot);
* batches of ``--batch`` keys: keys/s through the stub and through the helper, for keys
  of the first ``--rows`` rows (mostly in published files: each stream's last, partial
  file stays buffered) and of the last ``--buffered`` rows (all in the write buffer).

    .venv/bin/python bench/bench_lookup.py --rows 1000000 --batch 1000
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import one_node
from one_node import machine, row

from devtools.cluster import ANONYMOUS_WRITES_ENV, wait_for
from retina_common.catalog import FileType, TableRecord
from retina_common.client import TableWriter, requests_by_node
from retina_common.log import configure_logging
from retina_common.lookup import KeyLookup, encode_keys
from retina_common.pb import retina_pb2 as rpb
from retina_common.pb import retina_pb2_grpc, trans_pb2_grpc
from retina_common.pb import trans_pb2 as tpb
from retina_common.reader import SnapshotReader

LOAD_BATCH = 20_000  # rows per load transaction
Stub = retina_pb2_grpc.RetinaWorkerServiceStub


def percentiles(samples_s: list[float]) -> str:
    ms = sorted(s * 1000 for s in samples_s)
    return f"p50 {statistics.median(ms):.3f} ms, p99 {ms[int(0.99 * len(ms))]:.3f} ms"


def timed(calls: int, call: Callable[[], object]) -> list[float]:
    out = []
    for _ in range(calls):
        t0 = time.perf_counter()
        call()
        out.append(time.perf_counter() - t0)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=1_000_000, help="rows in published files")
    parser.add_argument("--buffered", type=int, default=20_000,
                        help="rows left in the write buffer")
    parser.add_argument("--batch", type=int, default=1000, help="keys per batched call")
    parser.add_argument("--batches", type=int, default=50)
    parser.add_argument("--singles", type=int, default=2000, help="one-key calls per figure")
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    configure_logging("bench", "warning")
    rng = random.Random(args.seed)
    print(f"{machine()}; {args.rows:,} rows in published files + {args.buffered:,} in the "
          "write buffer (int64 key, 4 columns); block 4096 rows, 4 blocks per file; batches "
          f"of {args.batch} keys")
    one = one_node.start("retina-bench-lookup-")
    node, topology, table, catalog = one.node, one.topology, one.table, one.catalog
    try:
        # The flush timer off: only full files are published, the rest stays buffered.
        stub = one.ready_node({**ANONYMOUS_WRITES_ENV,
                               "RETINA__RETINA__FLUSH_INTERVAL_MS": "86400000"})
        trans = one.trans()
        writer = TableWriter(table, topology)
        t0 = time.perf_counter()
        load(trans, stub, writer, node, range(args.rows))
        path = catalog.get_paths(table.table_id)[0]

        def published() -> int:
            return sum(f.num_row_group for f in catalog.get_files_by_type(
                path.path_id, [FileType.REGULAR]))
        # Every full file published (8 streams: at most one partial file each buffered).
        full = (args.rows // 8) // (4 * 4096) * 8 * 4
        wait_for(lambda: published() >= full, 600, "the full files to be published")
        load(trans, stub, writer, node, range(args.rows, args.rows + args.buffered))
        in_files = published() * 4096  # full files only: every row group has 4096 rows
        print(f"load: {args.rows + args.buffered:,} rows in {time.perf_counter() - t0:.0f} s; "
              f"{in_files:,} of the first {args.rows:,} in published files, the rest and the "
              f"last {args.buffered:,} in the write buffer")
        reader = SnapshotReader(one.state.trans_listen, topology)
        lookup = reader.key_lookup()
        with reader.transaction() as snap:
            warm_s = warm(lookup, table, args.rows + args.buffered, snap)
            print(f"warm-up: every key once in batches of 10,000 (row groups decoded into the "
                  f"cache): {warm_s:.1f} s")
            pid = one.state.retina_pids[node]
            singles(args, rng, lookup, stub, pid, table, snap)
            batched(args, rng, lookup, stub, pid, table, snap, "the first rows", 0, args.rows)
            batched(args, rng, lookup, stub, pid, table, snap, "the buffered rows", args.rows,
                    args.rows + args.buffered)
        newest = timed(args.singles // 4, lambda: lookup.get(
            "bench", "orders", encode_keys(table, [rng.randrange(args.rows)])))
        print(f"{'one key, helper, newest':<34} {percentiles(newest)} (BeginTrans + "
              "LookupRows + CommitTrans per call)")
        reader.close()
    finally:
        one.stop()


def load(trans: trans_pb2_grpc.TransServiceStub, stub: Stub, writer: TableWriter, node: str,
         ids: range) -> None:
    for start in range(ids.start, ids.stop, LOAD_BATCH):
        t = trans.BeginTrans(tpb.BeginTransRequest(), timeout=10)
        request = requests_by_node("bench", [writer.updates(
            t.timestamp, inserts=[row(i) for i in range(start, min(start + LOAD_BATCH,
                                                                    ids.stop))])])[node]
        stub.UpdateRecord(request, timeout=120)
        trans.CommitTrans(tpb.CommitTransRequest(trans_id=t.trans_id), timeout=10)


def warm(lookup: KeyLookup, table: TableRecord, rows: int,
         snap: tpb.BeginTransResponse) -> float:
    t0 = time.perf_counter()
    for start in range(0, rows, 10_000):
        got = lookup.get("bench", "orders", encode_keys(table, range(start, min(start + 10_000,
                                                                                 rows))),
                         trans=snap)
        assert got.found.all()
    return time.perf_counter() - t0


def singles(args: argparse.Namespace, rng: random.Random, lookup: KeyLookup, stub: Stub,
            pid: int, table: TableRecord, snap: tpb.BeginTransResponse) -> None:
    keys = [encode_keys(table, [rng.randrange(args.rows)]) for _ in range(args.singles)]
    it = iter(keys)
    helper = timed(args.singles, lambda: lookup.get("bench", "orders", next(it), trans=snap))
    it = iter(keys)
    cpu = node_cpu_s(pid)
    direct = timed(args.singles, lambda: stub.LookupRows(rpb.LookupRowsRequest(
        schema_name="bench", table_name="orders", keys=next(it), trans_id=snap.trans_id,
        timestamp=snap.timestamp), timeout=10))
    cpu = node_cpu_s(pid) - cpu
    print(f"{'one key, client helper':<34} {percentiles(helper)}")
    print(f"{'one key, stub':<34} {percentiles(direct)}; node CPU "
          f"{cpu / args.singles * 1e6:.0f} us per call")


def batched(args: argparse.Namespace, rng: random.Random, lookup: KeyLookup, stub: Stub,
            pid: int, table: TableRecord, snap: tpb.BeginTransResponse, what: str, lo: int,
            hi: int) -> None:
    batches = [encode_keys(table, [rng.randrange(lo, hi) for _ in range(args.batch)])
               for _ in range(args.batches)]
    it = iter(batches)
    cpu = node_cpu_s(pid)
    direct = timed(args.batches, lambda: stub.LookupRows(rpb.LookupRowsRequest(
        schema_name="bench", table_name="orders", keys=next(it), trans_id=snap.trans_id,
        timestamp=snap.timestamp), timeout=30))
    cpu = node_cpu_s(pid) - cpu
    it = iter(batches)
    helper = timed(args.batches, lambda: lookup.get("bench", "orders", next(it), trans=snap))
    keys = args.batch * args.batches
    for how, samples in (("stub", direct), ("helper", helper)):
        p50 = statistics.median(samples)
        print(f"{'batched, ' + what + ', ' + how:<34} {keys / sum(samples):>9,.0f} keys/s "
              f"overall, {args.batch / p50:>9,.0f} at the p50 batch ({p50 * 1000:.1f} ms)")
    # What the node itself spent (its process's CPU time, gRPC included): what one core of
    # this machine answers, whatever else runs on it.
    print(f"{'  node CPU, ' + what:<34} {cpu / keys * 1e6:>9.1f} us per key: "
          f"{keys / cpu:,.0f} keys/s per core")


def node_cpu_s(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


if __name__ == "__main__":
    main()
