"""Partial updates against full replaces: rows/s of updating 2 of 20 columns of the same
rows, one way and then the other, in one run (docs/performance.md, "Partial updates").

Starts a private cluster (etcd, PostgreSQL, the TransServer) and one Retina node owning
all 8 virtual nodes over loopback gRPC, creates a 20-column table (an int64 key, then
int64, float64 and string columns in turn), loads ``--rows`` rows, then updates
``--updates`` rows drawn at random (seeded) in transactions of ``--batch`` rows, one
UpdateRecord request each (the columnar form): as full replaces (every column sent) and
as partial updates of 2 columns (the node merges each with the key's row: a read of the
row from the write buffer or its published file, in the apply). The two alternate
``--rounds`` times over the same keys; each prints rows/s, the request's bytes and the
median latency of a transaction (BeginTrans, UpdateRecord, CommitTrans).

    .venv/bin/python bench/bench_partial_updates.py --rows 200000 --updates 50000
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections.abc import Callable

import one_node
from one_node import machine

from devtools.cluster import ANONYMOUS_WRITES_ENV
from retina_common.catalog import ColumnSpec, TableRecord
from retina_common.client import TableWriter, requests_by_node
from retina_common.log import configure_logging
from retina_common.pb import retina_pb2 as rpb
from retina_common.pb import retina_pb2_grpc, trans_pb2_grpc
from retina_common.pb import trans_pb2 as tpb

TYPES = ("int64", "float64", "string")
COLUMNS = [ColumnSpec("id", "int64")] + [ColumnSpec(f"c{i:02d}", TYPES[i % 3])
                                         for i in range(1, 20)]
TARGETS = ("c01", "c02")  # an int64 and a float64 column


def value(column: ColumnSpec, i: int, version: int) -> object:
    if column.type == "int64":
        return i * 31 + version
    if column.type == "float64":
        return i / 7 + version
    return f"{column.name}-{i % 1013}-v{version}"


def full_row(i: int, version: int) -> dict[str, object]:
    return {c.name: i if c.name == "id" else value(c, i, version) for c in COLUMNS}


def partial_row(i: int, version: int) -> dict[str, object]:
    by_name = {c.name: c for c in COLUMNS}
    return {"id": i, **{t: value(by_name[t], i, version) for t in TARGETS}}


class Run:
    def __init__(self, trans: trans_pb2_grpc.TransServiceStub,
                 stub: retina_pb2_grpc.RetinaWorkerServiceStub, writer: TableWriter,
                 node: str) -> None:
        self.trans, self.stub, self.writer, self.node = trans, stub, writer, node

    def transaction(self, build: Callable[[int], dict[str, list[rpb.TableUpdateData]]]
                    ) -> tuple[float, int]:
        """One transaction of ``build``'s parts; its seconds and its request's bytes."""
        t0 = time.perf_counter()
        began = self.trans.BeginTrans(tpb.BeginTransRequest(), timeout=30)
        request = requests_by_node("bench", [build(began.timestamp)])[self.node]
        self.stub.UpdateRecord(request, timeout=120)
        self.trans.CommitTrans(tpb.CommitTransRequest(trans_id=began.trans_id), timeout=30)
        return time.perf_counter() - t0, request.ByteSize()

    def updates(self, keys: list[int], batch: int, version: int, partial: bool
                ) -> tuple[float, float, float]:
        """rows/s, bytes per request (mean) and the median transaction in ms."""
        seconds, sizes = [], []
        t0 = time.perf_counter()
        for start in range(0, len(keys), batch):
            chunk = keys[start:start + batch]
            if partial:
                rows = [partial_row(i, version) for i in chunk]
                s, n = self.transaction(lambda ts, rows=rows: self.writer.updates(
                    ts, partials=rows))
            else:
                rows = [full_row(i, version) for i in chunk]
                s, n = self.transaction(lambda ts, rows=rows: self.writer.updates(
                    ts, replaces=rows))
            seconds.append(s)
            sizes.append(n)
        elapsed = time.perf_counter() - t0
        return len(keys) / elapsed, statistics.mean(sizes), statistics.median(seconds) * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=200_000, help="rows loaded first")
    parser.add_argument("--updates", type=int, default=50_000, help="rows updated per round")
    parser.add_argument("--batch", type=int, default=1000, help="rows per transaction")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seed", type=int, default=30)
    args = parser.parse_args()
    configure_logging("bench", "warning")
    rng = random.Random(args.seed)
    print(f"{machine()}; a 20-column table (int64 key; int64, float64, string columns), "
          f"{args.rows:,} rows; {args.updates:,} rows updated per round in transactions of "
          f"{args.batch} rows (one request each, the columnar form); partial updates set "
          f"{len(TARGETS)} of the 20 columns")
    one = one_node.start("retina-bench-partial-")
    try:
        stub = one.ready_node(ANONYMOUS_WRITES_ENV)
        table: TableRecord = one.catalog.create_table("bench", "wide20", COLUMNS, ["id"])
        run = Run(one.trans(), stub, TableWriter(table, one.topology), one.node)
        t0 = time.perf_counter()
        loaded = list(range(args.rows))
        run.updates(loaded, 5000, 0, partial=False)
        print(f"load: {args.rows:,} rows in {time.perf_counter() - t0:.1f} s")
        keys = rng.sample(loaded, args.updates)
        print(f"{'round':<6} {'form':<22} {'rows/s':>10} {'bytes/request':>14} "
              f"{'p50 ms':>8}")
        figures: dict[bool, list[float]] = {False: [], True: []}
        version = 0
        for r in range(args.rounds):
            for partial in (False, True):
                version += 1
                rate, size, p50 = run.updates(keys, args.batch, version, partial)
                figures[partial].append(rate)
                label = f"partial ({len(TARGETS)} of 20)" if partial else "full replace (20)"
                print(f"{r + 1:<6} {label:<22} {rate:>10,.0f} {size:>14,.0f} {p50:>8.1f}")
        full, part = (statistics.median(figures[p]) for p in (False, True))
        print(f"median rows/s: full replace {full:,.0f}, partial {part:,.0f} "
              f"({part / full:.2f}x)")
    finally:
        one.stop()


if __name__ == "__main__":
    main()
