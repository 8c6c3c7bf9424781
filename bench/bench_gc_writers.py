"""Storage GC beside a steady write load: what GC costs writers, and what each run rewrites.

A private local cluster (etcd, PostgreSQL, TransServer, two Retina nodes, retina-cdc; every
process on this machine), checkpoints every ``--checkpoint-interval-s`` (10 s, as the issue
measured). The same steady load runs twice in one run, ``--seconds`` each:

* **no GC**, then **with GC**: ``--gc-runs`` Storage GC runs (``spark_jobs.storage_gc``,
  Spark ``--master``, ``--deleted-threshold``) one after the other from ``--gc-delay-s``
  into the phase;
* the load: 10-row source transactions (7 inserts, 2 updates, 1 delete: updates and deletes
  leave deleted rows in older files) at ``--rate`` rows/s into the source PostgreSQL, through
  retina-cdc; freshness is bench_cdc.py's (a probe marker every 50 ms, the first gated
  snapshot that holds it);
* a direct writer: a client of its own (``TableWriter``, BeginTrans / UpdateRecord /
  CommitTrans) commits ``--direct-rows`` rows (inserts and replaces) every
  ``--direct-interval-ms`` into a table of its own; every UpdateRecord call is timed at the
  client (the writer latency GC must not stall).

Printed per phase: freshness p50 / p99 / max, UpdateRecord p50 / p99 / max, the achieved
rate; per GC run: groups committed / busy (with the node's reasons) / refused, rows
rewritten, CommitGcRewrite at the driver (median / max), and from the nodes' logs the time
each commit held the stream's locks (what writers wait for) and its largest phase. Then the
ratios with GC / without for the two p99s (the issue's target: at most 1.2). A final gated
snapshot of the direct table is checked against what the writer committed. Figures are
printed; nothing is asserted.

    .venv/bin/python bench/bench_gc_writers.py --rate 2500 --seconds 90
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import threading
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import grpc
import psycopg2
import pyspark
from bench_cdc import private_cluster, release_cluster, start_pipeline, steady
from bench_change_feed import DDL as READINGS_DDL
from bench_change_feed import SourceWriter

from devtools.cluster import (
    ANONYMOUS_WRITES_ENV,
    ClusterState,
    retina_log_path,
    wait_for,
)
from retina_common.catalog import Catalog, ColumnSpec
from retina_common.client import TableWriter, requests_by_node
from retina_common.pb import retina_pb2_grpc, trans_pb2_grpc
from retina_common.pb import trans_pb2 as tpb
from retina_common.reader import SnapshotReader
from retina_common.topology import load_topology

ROOT = Path(__file__).resolve().parent.parent
SCHEMA = "bench"
READINGS = [ColumnSpec("id", "int64"), ColumnSpec("sensor", "int32"),
            ColumnSpec("value", "float64"), ColumnSpec("sent_ns", "int64")]
PROBE = [ColumnSpec("id", "int64"), ColumnSpec("sent_ns", "int64")]
DDL = READINGS_DDL + "CREATE TABLE probe (id int8 PRIMARY KEY, sent_ns int8);"
DIRECT = [ColumnSpec("id", "int64"), ColumnSpec("n", "int64"), ColumnSpec("note", "string")]


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(len(ordered) * q))] if ordered else float("nan")


class DirectWriter:
    """Commits ``rows`` rows every ``interval_s`` into bench.direct (half new keys, half
    replaces of earlier ones) and times every UpdateRecord call at the client."""

    def __init__(self, state: ClusterState, rows: int, interval_s: float) -> None:
        catalog = Catalog(state.postgres.dsn())
        self.table = catalog.get_table(SCHEMA, "direct")
        catalog.close()
        self.topology = load_topology(state.topology_path)
        self.writer = TableWriter(self.table, self.topology)
        self.trans = trans_pb2_grpc.TransServiceStub(grpc.insecure_channel(state.trans_listen))
        self.stubs = {n: retina_pb2_grpc.RetinaWorkerServiceStub(grpc.insecure_channel(n))
                      for n in state.nodes}
        self.rows, self.interval_s = rows, interval_s
        self.next_id = 1
        self.rows_now: dict[int, int] = {}  # id -> n, what a snapshot must hold
        # (node, wall start, wall end, ms) of every UpdateRecord call, one list: the phase
        # takes it whole while the writer goes on
        self.calls: list[tuple[str, float, float, float]] = []
        self.failures = 0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _batch(self) -> tuple[list[dict], list[dict]]:
        fresh = [{"id": i, "n": 0, "note": f"d{i}"}
                 for i in range(self.next_id, self.next_id + self.rows // 2)]
        self.next_id += len(fresh)
        again = [{"id": i, "n": self.rows_now[i] + 1, "note": f"d{i}"}
                 for i in list(self.rows_now)[-(self.rows // 2):]] if self.rows_now else []
        return fresh, again

    def _commit(self) -> None:
        fresh, again = self._batch()
        t = self.trans.BeginTrans(tpb.BeginTransRequest(), timeout=10)
        updates = self.writer.updates(t.timestamp, inserts=fresh, replaces=again)
        for node, request in requests_by_node(SCHEMA, [updates]).items():
            started, wall = time.perf_counter(), time.time()
            self.stubs[node].UpdateRecord(request, timeout=60)
            self.calls.append((node, wall, time.time(),
                               (time.perf_counter() - started) * 1000))
        self.trans.CommitTrans(tpb.CommitTransRequest(trans_id=t.trans_id), timeout=10)
        for r in fresh + again:
            self.rows_now[r["id"]] = r["n"]

    def _run(self) -> None:
        due = time.monotonic()
        while not self.stop.is_set():
            try:
                self._commit()
            except grpc.RpcError:
                self.failures += 1
            due += self.interval_s
            self.stop.wait(max(0.0, due - time.monotonic()))  # pacing, not synchronisation

    def take(self) -> list[tuple[str, float, float, float]]:
        calls, self.calls = self.calls, []  # one rebinding: no call is lost or split
        return calls


def gc_runs(state: ClusterState, args: argparse.Namespace, stop: threading.Event,
            out: list[dict[str, Any]]) -> None:
    argv = ["chrt", "--idle", "0"] if args.gc_idle else []
    argv += ["nice", "-n", str(args.gc_nice)] if args.gc_nice else []
    argv += [sys.executable, "-m", "spark_jobs.storage_gc", "--config", state.config_path,
            "--schema", SCHEMA, "--all-tables", "--json", "--master", args.master,
            "--deleted-threshold", str(args.deleted_threshold),
            "--conf", "spark.ui.enabled=false", "--conf", "spark.driver.memory=1g",
            *args.job_args.split()]
    if stop.wait(args.gc_delay_s):
        return
    for _ in range(args.gc_runs):
        if stop.is_set():
            return
        started = time.monotonic()
        done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True,
                              env={**os.environ, "PYSPARK_PYTHON": sys.executable})
        lines = [x for x in done.stdout.splitlines() if x.startswith('{"safe_gc_ts"')]
        report = json.loads(lines[-1]) if lines else {"totals": {}, "groups": []}
        report.update(exit=done.returncode, seconds=time.monotonic() - started,
                      stderr=done.stderr[-2000:] if not lines else "")
        out.append(report)


def commit_phases(state: ClusterState) -> list[dict[str, Any]]:
    """Every gc_rewrite_committed log line of every node (with its phase timings)."""
    found = []
    for node in state.nodes:
        path = retina_log_path(state, node)
        for line in path.read_text(errors="replace").splitlines():
            if '"gc_rewrite_committed"' in line:
                try:
                    found.append(json.loads(line))
                except ValueError:
                    continue
    return found


CATEGORIES = (("spark_jobs.storage_gc", "GC job driver (Python)"),
              ("pyspark", "Spark Python workers"), ("java", "Spark JVM"),
              ("retina_server", "Retina nodes"), ("cdc_client", "retina-cdc"),
              ("trans_gate", "TransServer"), ("postgres", "PostgreSQL"), ("etcd", "etcd"),
              ("bench_gc_writers", "this load generator"))


class CpuMeter:
    """CPU seconds per kind of process over a phase: /proc sampled every 0.5 s (a process
    that ends between samples loses at most its last half second)."""

    def __init__(self) -> None:
        self.first: dict[int, float] = {}
        self.last: dict[int, float] = {}
        self.kind: dict[int, str] = {}
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.tick = os.sysconf("SC_CLK_TCK")

    def _sample(self) -> None:
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            pid = int(entry.name)
            try:
                cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            kind = next((name for needle, name in CATEGORIES if needle in cmd), None)
            if kind is None:
                continue
            cpu = (int(fields[11]) + int(fields[12])) / self.tick
            # Running at the start: counted from then; started later: from zero.
            self.first.setdefault(pid, 0.0 if self.thread.is_alive() else cpu)
            self.kind[pid] = kind
            self.last[pid] = cpu

    def _run(self) -> None:
        while not self.stop.wait(0.5):
            self._sample()

    def start(self) -> None:
        self._sample()  # what runs already counts from now; what starts later from zero
        self.thread.start()

    def finish(self) -> dict[str, float]:
        self.stop.set()
        self.thread.join()
        self._sample()
        out: dict[str, float] = {}
        for pid, kind in self.kind.items():
            out[kind] = out.get(kind, 0.0) + self.last[pid] - self.first[pid]
        return out


class FsyncProbe:
    """A 4 KiB write and fsync every 20 ms into a file beside the cluster's state: what a
    durable step (an LMDB commit, a journal record) waits for on this disk, GC or not."""

    def __init__(self, directory: Path) -> None:
        self.path = directory / "fsync-probe"
        self.latencies_ms: list[float] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        fd = os.open(self.path, os.O_WRONLY | os.O_CREAT, 0o644)
        try:
            block = os.urandom(4096)
            n = 0
            while not self.stop.wait(0.02):  # pacing, not synchronisation
                started = time.perf_counter()
                os.pwrite(fd, block, (n % 256) * 4096)
                os.fsync(fd)
                self.latencies_ms.append((time.perf_counter() - started) * 1000)
                n += 1
        finally:
            os.close(fd)

    def finish(self) -> list[float]:
        self.stop.set()
        self.thread.join()
        return self.latencies_ms


def phase(dsn: str, reader: SnapshotReader, direct: DirectWriter, args: argparse.Namespace,
          state: ClusterState, with_gc: bool, first_id: int) -> dict[str, Any]:
    # Each phase numbers its probe markers from 1: the last phase's go first.
    with psycopg2.connect(dsn) as conn, conn.cursor() as cur:
        cur.execute("DELETE FROM probe")
    conn.close()
    wait_for(lambda: reader.read(SCHEMA, "probe").table.num_rows == 0, 60, "an empty probe")
    source = SourceWriter(dsn, first_id)
    runs: list[dict[str, Any]] = []
    stop = threading.Event()
    gc = threading.Thread(target=gc_runs, args=(state, args, stop, runs), daemon=True)
    direct.take()
    cpu = CpuMeter()
    cpu.start()
    fsync = FsyncProbe(Path(state.state_dir))
    fsync.thread.start()
    started = time.monotonic()
    if with_gc:
        gc.start()
    fresh = steady(dsn, reader, args.rate, args.seconds, source.transaction)
    stop.set()
    calls = direct.take()
    if with_gc:
        gc.join()
    return {"fresh": fresh, "update_ms": [ms for *_call, ms in calls], "calls": calls,
            "runs": runs,
            "cpu": cpu.finish(), "fsync_ms": fsync.finish(),
            "seconds": time.monotonic() - started}


def print_phase(name: str, p: dict[str, Any]) -> None:
    f, u = p["fresh"], p["update_ms"]
    print(f"{name}: achieved {f['achieved_rows_s']:,.0f} rows/s; freshness p50 "
          f"{f['p50_ms']:.0f} / p99 {f['p99_ms']:.0f} / max {f['max_ms']:.0f} ms "
          f"({f['probes_seen']} probes); UpdateRecord p50 {pct(u, 0.5):.1f} / p99 "
          f"{pct(u, 0.99):.1f} / max {max(u, default=float('nan')):.1f} ms ({len(u)} calls)")
    fs = p["fsync_ms"]
    print(f"  4 KiB write + fsync beside it: p50 {pct(fs, 0.5):.1f} / p99 {pct(fs, 0.99):.1f} / "
          f"max {max(fs, default=float('nan')):.1f} ms ({len(fs)} probes)")
    used = sorted(p["cpu"].items(), key=lambda kv: -kv[1])
    print(f"  CPU over {p['seconds']:.0f} s (2 cores = {2 * p['seconds']:.0f} CPU-s): " +
          ", ".join(f"{kind} {seconds:.1f}" for kind, seconds in used))


def print_runs(runs: list[dict[str, Any]], commits: list[dict[str, Any]]) -> None:
    for i, r in enumerate(runs, 1):
        t, groups = r["totals"], r["groups"]
        seconds = [g["commit_seconds"] * 1000 for g in groups if g["outcome"] == "COMMITTED"]
        ids = {g["rewrite_id"] for g in groups if g["outcome"] == "COMMITTED"}
        mine = [c for c in commits if c.get("rewrite_id") in ids]
        locked = [c.get("locked_ms", 0.0) for c in mine]
        reasons: dict[str, int] = {}
        for g in groups:
            if g["outcome"] not in ("COMMITTED", "PLANNED"):
                key = f"{g['outcome']}: {g['reason'][:110]}"
                reasons[key] = reasons.get(key, 0) + 1
        print(f"  GC run {i}: exit {r['exit']} in {r['seconds']:.1f} s; "
              f"{t.get('committed', 0)} of {t.get('groups', 0)} groups committed, "
              f"{t.get('busy', 0)} busy, {t.get('refused', 0)} refused; rows rewritten "
              f"{t.get('rows_kept', 0):,}, dropped {t.get('rows_dropped', 0):,}; "
              f"CommitGcRewrite median {statistics.median(seconds) if seconds else 0:.0f} / "
              f"max {max(seconds, default=0):.0f} ms; under the stream locks median "
              f"{statistics.median(locked) if locked else 0:.1f} / max "
              f"{max(locked, default=0):.1f} ms")
        if mine:
            worst = max(mine, key=lambda c: c.get("commit_ms", 0))
            parts = {k[:-3]: v for k, v in worst.items() if k.endswith("_ms")}
            print(f"    slowest commit's phases (ms): {parts}")
        for reason, n in sorted(reasons.items()):
            print(f"    {n} x {reason}")
        if r.get("stderr"):
            print(f"    job stderr: {r['stderr'][-500:]}")


def commit_windows(commits: list[dict[str, Any]], whole: bool = False
                   ) -> dict[str, list[tuple[float, float]]]:
    """node -> (start, end) wall times each commit held its stream's locks (``whole``: ran
    at all, its verification included), from its log line (written at the commit's end,
    after its "after" phase)."""
    out: dict[str, list[tuple[float, float]]] = {}
    for c in commits:
        if "locked_ms" not in c:
            continue
        logged = datetime.fromisoformat(c["timestamp"].replace("Z", "+00:00")).timestamp()
        if whole:
            out.setdefault(c["node"], []).append((logged - c["commit_ms"] / 1000, logged))
            continue
        end = logged - c.get("after_ms", 0.0) / 1000
        out.setdefault(c["node"], []).append((end - c["locked_ms"] / 1000, end))
    return out


def slow_calls_beside_commits(p: dict[str, Any], slow_ms: float,
                              commits: list[dict[str, Any]]) -> str:
    """How many UpdateRecord calls slower than ``slow_ms`` overlapped a GC commit's locked
    section on their node, and a commit at all: what the commits explain."""
    slow = [(n, a, b) for n, a, b, ms in p["calls"] if ms > slow_ms]

    def beside(windows: dict[str, list[tuple[float, float]]]) -> int:
        return sum(any(a < end and b > start for start, end in windows.get(n, []))
                   for n, a, b in slow)
    return (f"{len(slow)} calls over {slow_ms:.0f} ms, {beside(commit_windows(commits))} of "
            f"them beside a commit's locked section, {beside(commit_windows(commits, True))} "
            "beside a commit at all")


def check_direct(reader: SnapshotReader, direct: DirectWriter) -> str:
    table = reader.read(SCHEMA, "direct").table
    got = dict(zip(table.column("id").to_pylist(), table.column("n").to_pylist(), strict=True))
    if got != direct.rows_now:
        missing = len(set(direct.rows_now) - set(got))
        wrong = sum(1 for k, v in got.items() if direct.rows_now.get(k) != v)
        return f"MISMATCH: {missing} rows missing, {wrong} rows differ"
    return f"equal ({len(got):,} rows)"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rate", type=int, default=2500, help="source rows/s through CDC")
    parser.add_argument("--seconds", type=float, default=90, help="length of each phase")
    parser.add_argument("--checkpoint-interval-s", type=float, default=10)
    parser.add_argument("--gc-runs", type=int, default=3)
    parser.add_argument("--gc-delay-s", type=float, default=5)
    parser.add_argument("--deleted-threshold", type=float, default=0.05)
    parser.add_argument("--master", default="local[2]")
    parser.add_argument("--gc-nice", type=int, default=10,
                        help="run the GC job under nice -n this (default 10, as a node's own "
                             "GC scheduler does: retina.gc_job_nice; 0: not niced)")
    parser.add_argument("--gc-idle", action="store_true",
                        help="run the GC job under SCHED_IDLE (chrt --idle 0)")
    parser.add_argument("--job-args", default="", help="extra storage_gc arguments")
    parser.add_argument("--direct-rows", type=int, default=20)
    parser.add_argument("--direct-interval-ms", type=float, default=50)
    parser.add_argument("--keep-logs", help="copy the cluster's logs to this directory")
    args = parser.parse_args()
    state_dir, state = private_cluster("retina-bench-gcw-")
    node_env = {**ANONYMOUS_WRITES_ENV, "RETINA__RETINA__CHECKPOINT_INTERVAL_MS":
                str(int(args.checkpoint_interval_s * 1000))}
    try:
        dsn = start_pipeline(state, DDL, {"readings": READINGS, "probe": PROBE}, node_env)
        catalog = Catalog(state.postgres.dsn())
        catalog.create_table(SCHEMA, "direct", DIRECT, ["id"])
        catalog.close()
        reader = SnapshotReader(state.trans_listen, load_topology(state.topology_path))
        direct = DirectWriter(state, args.direct_rows, args.direct_interval_ms / 1000)
        direct.thread.start()
        without = phase(dsn, reader, direct, args, state, with_gc=False, first_id=1)
        with_gc = phase(dsn, reader, direct, args, state, with_gc=True, first_id=10**9)
        direct.stop.set()
        direct.thread.join()
        verdict = check_direct(reader, direct)
        commits = commit_phases(state)
        reader.close()
    finally:
        release_cluster(state, state_dir, args.keep_logs)
    print(f"setup: {os.cpu_count()} cores, Python {platform.python_version()}, "
          f"{platform.platform()}, PySpark {pyspark.__version__}; etcd, PostgreSQL (source + "
          "catalog), TransServer, 2 Retina nodes (8 virtual nodes), retina-cdc, Spark "
          f"({args.master}) and this load generator on one machine; {args.rate:,} source rows/s "
          f"(7 inserts, 2 updates, 1 delete per transaction) for {args.seconds:.0f} s per "
          f"phase; a direct writer of {args.direct_rows} rows every "
          f"{args.direct_interval_ms:.0f} ms; checkpoints every {args.checkpoint_interval_s:g} s; "
          f"{args.gc_runs} GC runs (--deleted-threshold {args.deleted_threshold} "
          f"{args.job_args}, nice {args.gc_nice}) from {args.gc_delay_s:g} s into the second "
          "phase")
    print_phase("no GC  ", without)
    print_phase("with GC", with_gc)
    print_runs(with_gc["runs"], commits)
    ratio_w = pct(with_gc["update_ms"], 0.99) / pct(without["update_ms"], 0.99)
    ratio_f = with_gc["fresh"]["p99_ms"] / without["fresh"]["p99_ms"]
    print(f"  without GC p99 = {pct(without['update_ms'], 0.99):.0f} ms; with GC: "
          f"{slow_calls_beside_commits(with_gc, pct(without['update_ms'], 0.99), commits)}")
    print(f"with GC / without: UpdateRecord p99 {ratio_w:.2f}x, freshness p99 {ratio_f:.2f}x "
          f"(target: at most 1.2x each); direct writer failures {direct.failures}; the direct "
          f"table at a new gated snapshot: {verdict}")


if __name__ == "__main__":
    main()
