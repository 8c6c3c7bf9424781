"""CDC end-to-end benchmark: source PostgreSQL → retina-cdc → two Retina nodes.

Two phases on a private local cluster (everything on this one machine):

* **steady**: a paced source workload at ``--rate`` rows/s (default 5,000: 500
  transactions/s of 10 rows) for ``--seconds``. A probe commits one marker row
  every 50 ms. A watcher begins a gated read-only transaction every ~5 ms and
  records its snapshot timestamp; at the end one gated read gives each
  marker's commit timestamp (the hidden ``_commit_ts`` column). A marker is
  visible from the first snapshot whose timestamp covers it (every node
  applied it before its commit raised the HWM). Freshness = the time that
  snapshot was begun - the source commit, p50 / p99, with the sample before
  it as a lower bound. A full read of the probe table (~100 ms) is reported
  separately and is not part of the figure.
* **burst**: ``--burst-rows`` rows committed as fast as the source takes them
  (4 writer connections), then one marker row; end-to-end throughput = rows /
  (first commit → the first gated snapshot that holds the marker, found the way
  the steady phase finds its markers' snapshots). One full read then checks every
  burst row is there.

Prints figures and the setup; asserts nothing.

    .venv/bin/python bench/bench_cdc.py --rate 5000 --seconds 20
"""

from __future__ import annotations

import argparse
import bisect
import functools
import os
import platform
import random
import shutil
import statistics
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import grpc
import psycopg2

from devtools.cluster import (
    ClusterState,
    free_port,
    node_state,
    start_cdc,
    start_cluster,
    start_retina_servers,
    stop_cluster,
    wait_for,
)
from retina_common.catalog import Catalog, ColumnSpec
from retina_common.codec import COMMIT_TS
from retina_common.log import configure_logging
from retina_common.pb import retina_pb2 as rpb
from retina_common.pb import trans_pb2_grpc
from retina_common.reader import SnapshotReader
from retina_common.recovery_driver import await_gate_ready
from retina_common.topology import load_topology

SCHEMA = "bench"
DDL = """
CREATE TABLE readings (id int8 PRIMARY KEY, sensor int4, value float8, note text);
CREATE TABLE probe (id int8 PRIMARY KEY, sent_ns int8);
"""


def setup(state: ClusterState) -> str:
    return start_pipeline(state, DDL, {
        "readings": [ColumnSpec("id", "int64"), ColumnSpec("sensor", "int32"),
                     ColumnSpec("value", "float64"), ColumnSpec("note", "string")],
        "probe": [ColumnSpec("id", "int64"), ColumnSpec("sent_ns", "int64")]})


def start_pipeline(state: ClusterState, ddl: str, tables: dict[str, list[ColumnSpec]],
                   node_env: dict[str, str] | None = None) -> str:
    """The source database made with ``ddl``, its ``public`` tables in the catalog (keyed
    by ``id``, in schema bench), both Retina nodes and retina-cdc following those tables;
    the source's DSN once the query gate sees both nodes READY (bench_change_feed.py too)."""
    state.postgres.create_database("bench_source")
    dsn = state.postgres.dsn("bench_source")
    with psycopg2.connect(dsn) as conn, conn.cursor() as cur:
        cur.execute(ddl)
    conn.close()
    catalog = Catalog(state.postgres.dsn())
    catalog.create_schema(SCHEMA)
    for name, columns in tables.items():
        catalog.create_table(SCHEMA, name, columns, ["id"])
    catalog.close()
    start_retina_servers(state, node_env)
    start_cdc(state, {
        "RETINA__CDC__SOURCE": "postgres", "RETINA__CDC__SOURCE_DSN": dsn,
        "RETINA__CDC__SCHEMA": SCHEMA,
        "RETINA__CDC__SOURCE_TABLES": ",".join(f"public.{name}" for name in tables),
        "RETINA__CDC__METRICS_LISTEN": f"127.0.0.1:{free_port()}"})
    wait_for(lambda: all(node_state(n) == rpb.READY for n in state.nodes), 60,
             "both nodes READY")
    # The gate learns READY through its etcd watch a moment after MarkReady.
    with grpc.insecure_channel(state.trans_listen) as channel:
        late = await_gate_ready(trans_pb2_grpc.TransServiceStub(channel), state.nodes)
    if late:
        raise SystemExit(f"the query gate does not see every node READY: {late}")
    return dsn


class Writer:
    def __init__(self, dsn: str, first_id: int, step: int) -> None:
        self.conn = psycopg2.connect(dsn)
        self.next_id = first_id
        self.step = step
        self.rng = random.Random(first_id)

    def transaction(self, rows: int) -> None:
        values = []
        for _ in range(rows):
            values.append((self.next_id, self.rng.randint(1, 100), self.rng.random(), "r"))
            self.next_id += self.step
        with self.conn, self.conn.cursor() as cur:
            cur.execute("INSERT INTO readings VALUES " + ",".join(["(%s,%s,%s,%s)"] * rows),
                        [v for row in values for v in row])


def steady(dsn: str, reader: SnapshotReader, rate: int, seconds: float,
           write: Callable[[], None] | None = None) -> dict:
    """``write`` commits one 10-row source transaction (default: 10 inserts into
    readings); bench_gc_writers.py brings updates and deletes."""
    rows_per_txn = 10
    if write is None:
        writer = Writer(dsn, 1, 1)
        write = functools.partial(writer.transaction, rows_per_txn)
    stop = threading.Event()
    sent: dict[int, int] = {}
    seen: dict[int, int] = {}
    not_before: dict[int, int] = {}

    def probe() -> None:
        conn = psycopg2.connect(dsn)
        n = 0
        while not stop.wait(0.05):
            n += 1
            with conn, conn.cursor() as cur:
                cur.execute("INSERT INTO probe VALUES (%s, 0)", (n,))
            sent[n] = time.monotonic_ns()
        conn.close()

    # (monotonic ns, snapshot ts) of gated read-only BeginTrans calls a few ms apart: a
    # marker is visible from the first snapshot whose timestamp covers its commit
    # timestamp (every node applied it before CommitTransBatch made it part of the
    # HWM). Sampling the snapshot timestamp costs a fraction of a millisecond, where a
    # full probe read takes around 100 ms and would blur what is measured; the
    # markers' commit timestamps come from one read at the end.
    samples: list[tuple[int, int]] = []

    def watch() -> None:
        while not stop.is_set() or time.monotonic() < deadline:
            taken = time.monotonic_ns()
            try:
                with reader.transaction() as trans:
                    samples.append((taken, trans.timestamp))
            except grpc.RpcError:
                pass
            if stop.is_set() and time.monotonic() > settle:
                break
            time.sleep(0.005)

    deadline = settle = float("inf")
    threads = [threading.Thread(target=probe, daemon=True),
               threading.Thread(target=watch, daemon=True)]
    for t in threads:
        t.start()
    started = time.monotonic()
    n = 0
    while time.monotonic() - started < seconds:
        due = started + n * rows_per_txn / rate
        delay = due - time.monotonic()
        if delay > 0:
            time.sleep(delay)  # pacing the load, not synchronisation
        write()
        n += 1
    achieved = n * rows_per_txn / (time.monotonic() - started)
    stop.set()
    threads[0].join()
    # Sample until every marker is committed, and a little after (the sampler stops
    # however the wait ends).
    try:
        wait_for(lambda: reader.read(SCHEMA, "probe").table.num_rows == len(sent), 60,
                 "every probe marker to be visible")
    finally:
        settle = time.monotonic() + 0.2
        deadline = settle + 30
        threads[1].join()
    read_ms = []
    for _ in range(5):  # what one full gated read of the probe table costs
        t0 = time.monotonic_ns()
        probe_rows = reader.read(SCHEMA, "probe", keep_hidden=True).table
        read_ms.append((time.monotonic_ns() - t0) / 1e6)
    commit_ts = dict(zip(probe_rows.column("id").to_pylist(),
                         probe_rows.column(COMMIT_TS).to_pylist(), strict=True))
    stamps = [ts for _t, ts in samples]
    for i, ts in commit_ts.items():
        k = bisect.bisect_left(stamps, ts)  # snapshot timestamps only grow
        if k < len(samples):
            seen[i] = samples[k][0]
            not_before[i] = samples[k - 1][0] if k else sent[i]
    fresh = sorted((seen[i] - sent[i]) / 1e6 for i in sent if i in seen)
    low = sorted(max(0, not_before[i] - sent[i]) / 1e6 for i in sent if i in seen)
    return {"offered_rows_s": rate, "achieved_rows_s": achieved, "probes": len(sent),
            "probes_seen": len(fresh), "p50_ms": statistics.median(fresh),
            "p99_ms": fresh[min(len(fresh) - 1, int(len(fresh) * 0.99))], "max_ms": fresh[-1],
            "rows": n * rows_per_txn, "read_p50_ms": statistics.median(read_ms),
            "samples": len(samples),
            "low_p50_ms": statistics.median(low), "low_p99_ms": low[int(len(low) * 0.99)]}


BURST_MARKER = -1  # a probe row committed after the whole burst


def burst(dsn: str, reader: SnapshotReader, rows: int, base_count: int) -> dict:
    writers = [Writer(dsn, 10_000_000 + i, 4) for i in range(4)]
    per_writer = rows // 4 // 50
    started = time.monotonic()

    def run(w: Writer) -> None:
        for _ in range(per_writer):
            w.transaction(50)

    threads = [threading.Thread(target=run, args=(w,)) for w in writers]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    committed_s = time.monotonic() - started
    # The connector applies source transactions in commit order and a snapshot holds
    # every timestamp up to its own, so the first snapshot that holds this marker (committed
    # after every burst transaction) holds every burst row.
    with psycopg2.connect(dsn) as conn, conn.cursor() as cur:
        cur.execute("INSERT INTO probe VALUES (%s, 0)", (BURST_MARKER,))
    conn.close()
    visible_s = (marker_visible(reader) - started)
    total = base_count + per_writer * 50 * 4
    got = reader.read(SCHEMA, "readings").table.num_rows
    if got != total:
        raise SystemExit(f"burst: {got} rows visible after the marker, expected {total}")
    return {"rows": per_writer * 200, "source_commit_s": committed_s, "visible_s": visible_s,
            "rows_s": per_writer * 200 / visible_s}


def marker_visible(reader: SnapshotReader, timeout_s: float = 300) -> float:
    """The monotonic time of the first gated snapshot that holds the burst marker.

    Snapshot timestamps are sampled every ~5 ms (a gated BeginTrans each); the probe
    table (a few hundred rows) is read every ~250 ms until the marker is in it, and its
    commit timestamp then says which sample first held it. Reading the 200,000-row
    table until it is complete would take CPU from the pipeline it measures."""
    samples: list[tuple[float, int]] = []
    deadline = time.monotonic() + timeout_s
    next_read = 0.0
    marker_ts: int | None = None
    while time.monotonic() < deadline:
        taken = time.monotonic()
        with reader.transaction() as trans:
            samples.append((taken, trans.timestamp))
        if marker_ts is None and taken >= next_read:
            next_read = taken + 0.25
            probe = reader.read(SCHEMA, "probe", keep_hidden=True).table
            ids = probe.column("id").to_pylist()
            if BURST_MARKER in ids:
                marker_ts = probe.column(COMMIT_TS)[ids.index(BURST_MARKER)].as_py()
        # Snapshots only grow: once the latest sample covers the marker, the first
        # sample that does is when it became visible (a read that found it while no
        # sample covered it yet waits for the next sample).
        if marker_ts is not None and samples[-1][1] >= marker_ts:
            return next(t for t, ts in samples if ts >= marker_ts)
        time.sleep(0.005)
    raise SystemExit(f"burst: the marker was not visible within {timeout_s:.0f} s")


def private_cluster(prefix: str) -> tuple[Path, ClusterState]:
    """Quiet logging and a private local cluster in a new directory (the bench's own)."""
    configure_logging("bench", "warning")
    state_dir = Path(tempfile.mkdtemp(prefix=prefix))
    os.chmod(state_dir, 0o755)
    return state_dir, start_cluster(state_dir, log=lambda _m: None)


def release_cluster(state: ClusterState, state_dir: Path, keep_logs: str | None) -> None:
    """Stop the private cluster, keep its logs where asked, and remove its directory."""
    stop_cluster(state, log=lambda _m: None)
    if keep_logs:
        shutil.copytree(state_dir / "logs", keep_logs, dirs_exist_ok=True)
    shutil.rmtree(state_dir, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rate", type=int, default=5000)
    parser.add_argument("--seconds", type=float, default=20)
    parser.add_argument("--burst-rows", type=int, default=200_000)
    parser.add_argument("--keep-logs", help="copy the cluster's logs to this directory")
    args = parser.parse_args()
    state_dir, state = private_cluster("retina-bench-cdc-")
    try:
        dsn = setup(state)
        reader = SnapshotReader(state.trans_listen, load_topology(state.topology_path))
        s = steady(dsn, reader, args.rate, args.seconds)
        b = burst(dsn, reader, args.burst_rows, s["rows"])
        reader.close()
    finally:
        release_cluster(state, state_dir, args.keep_logs)
    print(f"setup: {os.cpu_count()} cores, Python {platform.python_version()}, "
          f"{platform.platform()}; etcd, PostgreSQL (source + catalog, durable), TransServer, "
          "2 Retina nodes, retina-cdc and this load generator on one machine")
    print(f"steady: offered {s['offered_rows_s']:,} rows/s, achieved {s['achieved_rows_s']:,.0f} "
          f"rows/s over {args.seconds:.0f}s ({s['rows']:,} rows)")
    print(f"freshness (source commit -> visible in a gated snapshot), {s['probes_seen']} of "
          f"{s['probes']} probes: p50 {s['p50_ms']:.0f} ms, p99 {s['p99_ms']:.0f} ms, "
          f"max {s['max_ms']:.0f} ms; lower bound (the snapshot before did not hold it) "
          f"p50 {s['low_p50_ms']:.0f} ms, p99 {s['low_p99_ms']:.0f} ms; snapshot timestamps "
          f"sampled {s['samples']:,} times. A full gated read of the probe table takes p50 "
          f"{s['read_p50_ms']:.0f} ms (not part of the figure).")
    print(f"burst: {b['rows']:,} rows, source commits took {b['source_commit_s']:.1f}s, all "
          f"visible after {b['visible_s']:.1f}s: {b['rows_s']:,.0f} rows/s end to end")


if __name__ == "__main__":
    main()
