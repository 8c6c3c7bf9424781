"""Change-feed benchmark (docs/change-feed.md): changes/s read from one node, and the lag
from a source commit to a consumer following the feed.

* **read** (``--changes``, default 200,000 writes): one Retina node owning all 8 virtual
  nodes, a 6-column table keyed by int64, written in commits of ``--batch`` writes (70 %
  inserts, 20 % updates of live rows, 10 % deletes of live rows; an update is two changes,
  its before and after images). Then ``ChangeFeedReader.read`` of the whole range
  (``--repeat`` times, the median) and of consecutive ranges of about ``--poll-changes``
  changes (a follower's typical poll): changes/s, ms per poll p50/p99, and the node's own
  time (``retina_changes_read_seconds``, its mean per ReadChanges) and CPU.
* **lag** (``--rate``, default 5,000 rows/s for ``--seconds``): source PostgreSQL ->
  ``retina-cdc`` -> two Retina nodes (bench_cdc.py's cluster), 10-row source transactions
  (7 inserts, 2 updates, 1 delete); every insert and update writes the wall time taken just
  before its transaction's INSERT/UPDATE/COMMIT into the row (``sent_ns``). A follower in
  its own process (``ChangeFeedReader.follow``) stamps each commit as it arrives: lag =
  arrival - ``sent_ns`` for every insert and update_after (an upper bound on commit ->
  consumer by the statement's own time, a millisecond or two), p50/p99/max over the whole
  run and over the changes sent after ``--warmup`` seconds (the first commits wait for
  the pipeline's and the follower's start: streams, files and connections created).

Prints figures and the setup; asserts nothing (it stops if the feed misses changes).

    .venv/bin/python bench/bench_change_feed.py
    .venv/bin/python bench/bench_change_feed.py --changes 200000 --rate 5000 --seconds 30
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
from decimal import Decimal
from pathlib import Path

import one_node
import psycopg2
import requests
from bench_cdc import start_pipeline
from one_node import machine
from prometheus_client.parser import text_string_to_metric_families

from devtools.cluster import (
    ANONYMOUS_WRITES_ENV,
    start_cluster,
    start_trans_server,
    stop_cluster,
)
from retina_common.catalog import ColumnSpec
from retina_common.change_reader import ChangeFeedReader
from retina_common.client import TableWriter, requests_by_node
from retina_common.log import configure_logging
from retina_common.pb import trans_pb2 as tpb
from retina_common.reader import SnapshotReader
from retina_common.topology import load_topology

SCHEMA = "bench"
FEED_COLUMNS = [ColumnSpec("id", "int64"), ColumnSpec("customer", "string"),
                ColumnSpec("amount", "decimal(12,2)"), ColumnSpec("note", "string"),
                ColumnSpec("qty", "int32"), ColumnSpec("price", "float64")]
NODE_SECONDS = "retina_changes_read_seconds"
HISTORY_MS = 600_000  # trans.history_retention_ms of the lag phase


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def node_cpu_s(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def node_read_seconds(metrics: str) -> tuple[float, float]:
    """(sum, count) of the node's ``retina_changes_read_seconds`` histogram."""
    text = requests.get(f"http://{metrics}/metrics", timeout=5).text
    total = count = 0.0
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == NODE_SECONDS + "_sum":
                total = s.value
            elif s.name == NODE_SECONDS + "_count":
                count = s.value
    return total, count


# --- read: changes/s from one node ---------------------------------------------------------------
def feed_row(i: int, version: int) -> dict:
    return {"id": i, "customer": f"customer-{i % 997}", "amount": Decimal(i % 100000) / 100,
            "note": f"v{version}", "qty": i % 1000, "price": i * 0.25 + version}


class Workload:
    """Commits of ``batch`` writes: 70 % inserts of new keys, 20 % updates and 10 % deletes
    of live keys (distinct keys within a commit)."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.live: list[int] = []
        self.version: dict[int, int] = {}
        self.next_id = 0
        self.counts = {"insert": 0, "update": 0, "delete": 0}

    def commit(self, batch: int) -> tuple[list[dict], list[dict], list[dict]]:
        updates = min(batch // 5, len(self.live))
        deletes = min(batch // 10, len(self.live) - updates)
        inserts = batch - updates - deletes
        touched = self.rng.sample(range(len(self.live)), updates + deletes)
        ids = [self.live[k] for k in touched]
        for k in sorted(touched[updates:], reverse=True):  # swap-remove the deleted
            self.live[k] = self.live[-1]
            self.live.pop()
        replaced = []
        for i in ids[:updates]:
            self.version[i] += 1
            replaced.append(feed_row(i, self.version[i]))
        new = []
        for i in range(self.next_id, self.next_id + inserts):
            self.version[i] = 0
            self.live.append(i)
            new.append(feed_row(i, 0))
        self.next_id += inserts
        for kind, n in (("insert", inserts), ("update", updates), ("delete", deletes)):
            self.counts[kind] += n
        return new, replaced, [{"id": i} for i in ids[updates:]]


def load_feed_table(one: one_node.OneNode, stub, writes: int, batch: int,
                    seed: int) -> tuple[list[int], Workload]:
    table = one.catalog.create_table(SCHEMA, "feed", FEED_COLUMNS, ["id"])
    writer = TableWriter(table, one.topology)
    trans = one.trans()
    work = Workload(seed)
    stamps = []
    for _ in range(writes // batch):
        inserts, replaces, deletes = work.commit(batch)
        t = trans.BeginTrans(tpb.BeginTransRequest(), timeout=10)
        request = requests_by_node(SCHEMA, [writer.updates(
            t.timestamp, inserts=inserts, replaces=replaces, deletes=deletes)])[one.node]
        stub.UpdateRecord(request, timeout=120)
        trans.CommitTrans(tpb.CommitTransRequest(trans_id=t.trans_id), timeout=10)
        stamps.append(t.timestamp)
    return stamps, work


def polls(sizes: list[tuple[int, int]], start: int, per_poll: int) -> list[tuple[int, int]]:
    """(from_ts, to_ts) ranges of whole commits of at least ``per_poll`` changes each."""
    out, low, count = [], start, 0
    for ts, n in sizes:
        count += n
        if count >= per_poll:
            out.append((low, ts))
            low, count = ts, 0
    if count:
        out.append((low, sizes[-1][0]))
    return out


def read_bench(args: argparse.Namespace) -> None:
    one = one_node.start("retina-bench-feed-")
    try:
        stub = one.ready_node(ANONYMOUS_WRITES_ENV)
        t0 = time.perf_counter()
        stamps, work = load_feed_table(one, stub, args.changes, args.batch, args.seed)
        c = work.counts
        expected = c["insert"] + 2 * c["update"] + c["delete"]
        print(f"{machine()}; table bench.feed (int64 key + 5 columns: string, decimal, string, "
              f"int32, float64); {len(stamps)} commits of {args.batch:,} writes: "
              f"{c['insert']:,} inserts, {c['update']:,} updates, {c['delete']:,} deletes "
              f"= {expected:,} changes (an update is 2); loaded in "
              f"{time.perf_counter() - t0:.0f} s; page_changes default (10,000)", flush=True)
        reader = SnapshotReader(one.state.trans_listen, one.topology)
        feed = reader.change_feed()
        metrics = one.state.retina_metrics[one.node]
        pid = one.state.retina_pids[one.node]
        start, end = stamps[0] - 1, stamps[-1]
        whole = [timed_read(feed, metrics, pid, [(start, end)]) for _ in range(args.repeat)]
        sizes = whole[0]["sizes"]
        got = sum(n for _ts, n in sizes)
        if got != expected:
            raise SystemExit(f"read: the feed gave {got:,} changes, the workload made "
                             f"{expected:,}")
        best = sorted(whole, key=lambda r: r["seconds"])[len(whole) // 2]
        report("whole range, one read", got, best, 1)
        ranges = polls(sizes, start, args.poll_changes)
        result = timed_read(feed, metrics, pid, ranges)
        report(f"ranges of ~{args.poll_changes:,} changes", got, result, len(ranges))
        reader.close()
    finally:
        one.stop()


def timed_read(feed: ChangeFeedReader, metrics: str, pid: int,
               ranges: list[tuple[int, int]]) -> dict:
    node_before, cpu_before = node_read_seconds(metrics), node_cpu_s(pid)
    per_read, sizes = [], []
    for low, high in ranges:
        t0 = time.perf_counter()
        commits = list(feed.read(SCHEMA, "feed", low, to_ts=high))
        per_read.append(time.perf_counter() - t0)
        sizes.extend((c.ts, c.changes.num_rows) for c in commits)
    node_after = node_read_seconds(metrics)
    return {"seconds": sum(per_read), "per_read": per_read, "sizes": sizes,
            "node_s": node_after[0] - node_before[0],
            "node_reads": node_after[1] - node_before[1],
            "node_cpu_s": node_cpu_s(pid) - cpu_before}


def report(what: str, changes: int, r: dict, reads: int) -> None:
    ms = [s * 1000 for s in r["per_read"]]
    line = (f"{what:<30} {changes / r['seconds']:>9,.0f} changes/s ({reads} read(s), "
            f"{r['seconds']:.2f} s)")
    if reads > 1:
        line += (f"; per poll p50 {statistics.median(ms):.1f} ms, p99 {percentile(ms, 0.99):.1f} "
                 f"ms, max {max(ms):.1f} ms")
    node_reads = max(r["node_reads"], 1)
    line += (f"; node side (retina_changes_read_seconds) {r['node_s'] / node_reads * 1000:.1f} "
             f"ms per ReadChanges, {r['node_s'] / r['seconds']:.0%} of the time; node CPU "
             f"{r['node_cpu_s']:.2f} s: {changes / r['node_cpu_s']:,.0f} changes/s per core "
             "(what the node answers whatever else runs here)")
    print(line, flush=True)


# --- lag: source commit -> a follower ----------------------------------------------------------
DDL = "CREATE TABLE readings (id int8 PRIMARY KEY, sensor int4, value float8, sent_ns int8);"


class SourceWriter:
    """10-row source transactions: 7 inserts, 2 updates and 1 delete of earlier rows."""

    def __init__(self, dsn: str, first_id: int = 1) -> None:
        self.conn = psycopg2.connect(dsn)
        self.rng = random.Random(first_id)
        self.next_id = first_id
        self.live: list[int] = []
        self.timed = 0  # inserts + updates: the changes that carry sent_ns

    def transaction(self) -> None:
        """One round trip: the three statements and the commit."""
        sent = time.time_ns()
        new = range(self.next_id, self.next_id + 7)
        self.next_id += 7
        sql = "INSERT INTO readings VALUES " + ",".join(["(%s,%s,%s,%s)"] * 7)
        params = [v for i in new for v in (i, i % 100, self.rng.random(), sent)]
        touched = len(self.live) >= 50
        if touched:
            picks = self.rng.sample(range(len(self.live)), 3)
            ids = [self.live[k] for k in picks]
            sql += (";UPDATE readings SET value = value + 1, sent_ns = %s WHERE id IN (%s, %s)"
                    ";DELETE FROM readings WHERE id = %s")
            params += [sent, *ids]
            self.live[picks[2]] = self.live[-1]  # swap-remove the deleted
            self.live.pop()
        with self.conn, self.conn.cursor() as cur:
            cur.execute(sql, params)
        self.live.extend(new)
        self.timed += 7 + (2 if touched else 0)


def follower(trans_address: str, topology_path: str, from_ts: int, expect: mp.Value,
             results: mp.Queue, deadline_s: float) -> None:
    """Follows bench.readings from ``from_ts`` until ``expect`` timed changes arrived (or
    the deadline); puts the lags (ms) and the commits seen."""
    configure_logging("bench", "warning")
    reader = SnapshotReader(trans_address, load_topology(topology_path))
    feed = reader.change_feed()
    lags: list[float] = []
    sent_at: list[int] = []  # per lag, the source time of its change (ns)
    commits = heartbeats = 0
    deadline = time.monotonic() + deadline_s

    def done() -> bool:
        return (expect.value and len(lags) >= expect.value) or time.monotonic() > deadline

    for commit in feed.follow(SCHEMA, "readings", from_ts, stop=done, columns=["sent_ns"]):
        now = time.time_ns()
        if commit.heartbeat:
            heartbeats += 1
            continue
        commits += 1
        kinds = commit.changes.column("_change_type").to_pylist()
        sent = commit.changes.column("sent_ns").to_pylist()
        timed = [s for k, s in zip(kinds, sent, strict=True) if k in ("insert", "update_after")]
        lags.extend((now - s) / 1e6 for s in timed)
        sent_at.extend(timed)
    reader.close()
    results.put({"lags": lags, "sent_at": sent_at, "commits": commits,
                 "heartbeats": heartbeats})


def lag_bench(args: argparse.Namespace) -> None:
    state_dir = Path(tempfile.mkdtemp(prefix="retina-bench-feedlag-"))
    os.chmod(state_dir, 0o755)
    # History kept as in production (the dev cluster keeps none): a follower's cursor
    # stays readable between its polls without a registered consumer's pin.
    state = start_cluster(state_dir, start_trans=False, log=lambda _m: None)
    start_trans_server(state, {"RETINA__TRANS__HISTORY_RETENTION_MS": str(HISTORY_MS)})
    try:
        dsn = start_pipeline(state, DDL, {"readings": [
            ColumnSpec("id", "int64"), ColumnSpec("sensor", "int32"),
            ColumnSpec("value", "float64"), ColumnSpec("sent_ns", "int64")]})
        reader = SnapshotReader(state.trans_listen, load_topology(state.topology_path))
        with reader.transaction() as trans:
            cursor = trans.timestamp
        reader.close()
        ctx = mp.get_context("spawn")
        expect, results = ctx.Value("q", 0), ctx.Queue()
        follow = ctx.Process(target=follower, args=(
            state.trans_listen, str(state.topology_path), cursor, expect, results,
            args.seconds + 120))
        follow.start()
        writer = SourceWriter(dsn)
        load_before = os.getloadavg()[0]
        started = time.monotonic()
        steady_from_ns = time.time_ns() + int(args.warmup * 1e9)
        n = 0
        while time.monotonic() - started < args.seconds:
            delay = started + n * 10 / args.rate - time.monotonic()
            if delay > 0:
                time.sleep(delay)  # pacing the load, not synchronisation
            writer.transaction()
            n += 1
        achieved = n * 10 / (time.monotonic() - started)
        expect.value = writer.timed
        got = results.get(timeout=180)
        follow.join(timeout=30)
        load_after = os.getloadavg()[0]
        node_s, reads = (sum(x) for x in zip(*(node_read_seconds(state.retina_metrics[n])
                                                for n in state.nodes), strict=True))
    finally:
        stop_cluster(state, log=lambda _m: None)
        shutil.rmtree(state_dir, ignore_errors=True)
    lags = got["lags"]
    print(f"setup: {os.cpu_count()} cores, Python {sys.version.split()[0]}; etcd, PostgreSQL "
          "(source + catalog), TransServer, 2 Retina nodes, retina-cdc, this load generator "
          f"and a follower process on one machine; history kept {HISTORY_MS // 60_000} min; "
          "load average "
          f"{load_before:.1f} before, {load_after:.1f} after")
    print(f"lag: offered {args.rate:,} rows/s (10-row transactions: 7 inserts, 2 updates, "
          f"1 delete), achieved {achieved:,.0f} rows/s over {args.seconds:.0f} s; the follower "
          f"got {len(lags):,} of {writer.timed:,} timed changes in {got['commits']:,} commits "
          f"({got['heartbeats']:,} heartbeats); {reads:,.0f} ReadChanges over the 2 nodes, "
          f"{node_s / max(reads, 1) * 1000:.1f} ms each node side (retina_changes_read_seconds)")
    if lags:
        print(f"lag (source commit -> follower), inserts and update_afters, the whole run: "
              f"p50 {statistics.median(lags):.0f} ms, p99 {percentile(lags, 0.99):.0f} ms, "
              f"max {max(lags):.0f} ms", flush=True)
        steady = [lag for lag, at in zip(lags, got["sent_at"], strict=True)
                  if at >= steady_from_ns]
        if steady:
            print(f"lag after the first {args.warmup:.0f} s (the pipeline's and the "
                  f"follower's start left out; {len(steady):,} changes): p50 "
                  f"{statistics.median(steady):.0f} ms, p99 {percentile(steady, 0.99):.0f} "
                  f"ms, max {max(steady):.0f} ms", flush=True)
    if len(lags) < writer.timed:
        raise SystemExit(f"lag: the follower got {len(lags):,} of {writer.timed:,} changes")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--changes", type=int, default=200_000, help="writes in the read phase")
    parser.add_argument("--batch", type=int, default=1000, help="writes per commit")
    parser.add_argument("--poll-changes", type=int, default=5000)
    parser.add_argument("--repeat", type=int, default=3, help="whole-range reads (median)")
    parser.add_argument("--rate", type=int, default=5000, help="source rows/s in the lag phase")
    parser.add_argument("--seconds", type=float, default=30)
    parser.add_argument("--warmup", type=float, default=5,
                        help="lag phase: also report the lags of changes sent after this "
                             "many seconds (the steady state)")
    parser.add_argument("--phase", choices=("read", "lag", "both"), default="both")
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    configure_logging("bench", "warning")
    if args.phase in ("read", "both"):
        read_bench(args)
    if args.phase in ("lag", "both"):
        lag_bench(args)


if __name__ == "__main__":
    main()
