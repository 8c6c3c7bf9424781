"""Retina beside Delta Lake, Apache Iceberg and Apache Paimon on one CDC stream.

One generated workload (fixed seed): ``--rows`` keyed changes to a 6-column
table keyed by an int64, 70% inserts of new keys, 20% updates of every value
column of a live key, 10% deletes of a live key. It is cut into micro-batches
of each ``--batch`` size; a micro-batch is collapsed to its net effect per key
(the last change of each key: an upsert or a delete; MERGE and upsert APIs
refuse a key twice in one source) and applied as one commit:

* **retina-direct**: a client builds the UpdateRecord request (a replace per
  upsert, a delete per delete), BeginTrans, UpdateRecord, CommitTrans, against
  one Retina node (all 8 virtual nodes) of a private local cluster;
* **retina-changelog**: the CDC connector (`cdc_client.connector.Connector`,
  in this process) takes each micro-batch as one source transaction: timestamp,
  the durable changelog (fsynced), UpdateRecord, CommitTransBatch, the
  committed position in etcd, then the source's ack;
* **delta** (deltalake, one MERGE), **iceberg** (pyiceberg with a SQL catalog,
  upsert + delete), **paimon** (pypaimon primary-key table, deletes as -D rows):
  each through its own API in its own virtual environment (``--peers-python``;
  `make bench-peers` makes it: pypaimon pins pyarrow below Retina's).

Per system and batch size: rows/s (original changes / time), per-batch latency
(start of the apply to the return of its commit, when a new reader sees it:
Retina's gated snapshot after CommitTrans, a peer's new reader after its
commit) p50 / p99 and the p50 of the first and the last tenth of the batches,
files and bytes on disk. Every final table is read by a new reader and compared
with the model of the batches applied; a mismatch is printed loudly and the
run exits 1. A configuration stops at ``--budget-s`` (at a batch boundary);
its rows then say how far it got.

    .venv/bin/python bench/bench_peers.py --peers-python .venv-peers/bin/python
    make bench-peers PEERS_ARGS="--rows 50000 --budget-s 60 --json peers.json"
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import queue
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import pyarrow as pa
import pyarrow.parquet as pq

from cdc_client.connector import Connector
from cdc_client.connector_main import settings_of, table_map
from cdc_client.positions import CommittedPosition, PositionStore
from cdc_client.source import RowChange, SourceTransaction
from devtools.cluster import (
    ANONYMOUS_WRITES_ENV,
    free_port,
    start_cluster,
    start_retina_server,
    stop_cluster,
)
from retina_common import replay_sources
from retina_common.catalog import Catalog, ColumnSpec
from retina_common.changelog import Changelog
from retina_common.client import TableWriter, requests_by_node
from retina_common.config import load_config
from retina_common.etcd import EtcdStore
from retina_common.log import configure_logging
from retina_common.pb import retina_pb2_grpc, trans_pb2_grpc
from retina_common.pb import trans_pb2 as tpb
from retina_common.reader import SnapshotReader
from retina_common.recovery_driver import drive_recovery
from retina_common.topology import Topology

ROOT = Path(__file__).resolve().parent.parent
PEER_DRIVER = ROOT / "bench" / "peers" / "peer_driver.py"
VALUES = ["c1", "c2", "c3", "c4", "c5"]
COLUMNS = [ColumnSpec("id", "int64"), ColumnSpec("c1", "int64"), ColumnSpec("c2", "float64"),
           ColumnSpec("c3", "string"), ColumnSpec("c4", "int64"), ColumnSpec("c5", "string")]
ARROW = pa.schema([("id", pa.int64()), ("c1", pa.int64()), ("c2", pa.float64()),
                   ("c3", pa.string()), ("c4", pa.int64()), ("c5", pa.string())])
SCHEMA = "peers"
Row = dict[str, Any]
Model = dict[int, tuple[Any, ...]]


# --- the workload ---------------------------------------------------------------------------
def generate(rows: int, seed: int) -> list[tuple[int, Row | None]]:
    """(key, new row) per change; None for a delete."""
    rng = random.Random(seed)
    live: list[int] = []
    where: dict[int, int] = {}
    changes: list[tuple[int, Row | None]] = []
    next_id = 1

    def values(key: int) -> Row:
        return {"id": key, "c1": rng.randrange(1 << 40), "c2": rng.random() * 1e6,
                "c3": f"customer-{rng.randrange(100_000):05d}", "c4": rng.randrange(1000),
                "c5": rng.choice(("new", "paid", "shipped", "returned")) * 3}

    for _ in range(rows):
        r = rng.random()
        if r < 0.7 or not live:
            key, next_id = next_id, next_id + 1
            where[key] = len(live)
            live.append(key)
            changes.append((key, values(key)))
        elif r < 0.9:
            key = live[rng.randrange(len(live))]
            changes.append((key, values(key)))
        else:
            i = rng.randrange(len(live))
            key = live[i]
            live[i] = live[-1]  # swap-remove: O(1)
            where[live[i]] = i
            live.pop()
            del where[key]
            changes.append((key, None))
    return changes


@dataclass
class Batch:
    changes: int  # original changes it stands for
    upserts: list[Row]
    deletes: list[int]


def micro_batches(changes: list[tuple[int, Row | None]], size: int) -> list[Batch]:
    out = []
    for lo in range(0, len(changes), size):
        net: dict[int, Row | None] = {}
        for key, row in changes[lo:lo + size]:
            net.pop(key, None)  # the key's last change, in the order of last changes
            net[key] = row
        out.append(Batch(min(size, len(changes) - lo),
                         [r for r in net.values() if r is not None],
                         [k for k, r in net.items() if r is None]))
    return out


def model(batches: list[Batch]) -> Model:
    rows: Model = {}
    for b in batches:
        for key in b.deletes:
            rows.pop(key, None)
        for r in b.upserts:
            rows[r["id"]] = tuple(r[c] for c in VALUES)
    return rows


def workload_file(batches: list[Batch], path: Path) -> None:
    """The collapsed micro-batches for the peer driver (bench/peers/peer_driver.py)."""
    cols: dict[str, list[Any]] = {"batch": [], "deleted": [], **{f.name: [] for f in ARROW}}
    for i, b in enumerate(batches):
        for r in b.upserts:
            cols["batch"].append(i)
            cols["deleted"].append(False)
            for f in ARROW:
                cols[f.name].append(r[f.name])
        for key in b.deletes:
            cols["batch"].append(i)
            cols["deleted"].append(True)
            cols["id"].append(key)
            for c in VALUES:
                cols[c].append(None)
    schema = pa.schema([("batch", pa.int64()), ("deleted", pa.bool_()), *ARROW])
    pq.write_table(pa.table(cols, schema=schema), path)


class DuplicateKeys(Exception):
    """A final table with two rows of one key: never equal to the model."""


def as_model(table: pa.Table) -> Model:
    ids = table.column("id").to_pylist()
    if len(set(ids)) != len(ids):
        seen: set[int] = set()
        twice = sorted({k for k in ids if k in seen or seen.add(k)})
        raise DuplicateKeys(f"{len(twice)} key(s) with more than one row (e.g. {twice[:3]})")
    values = list(zip(*(table.column(c).to_pylist() for c in VALUES), strict=True))
    return dict(zip(ids, values, strict=True))


# --- results --------------------------------------------------------------------------------
@dataclass
class Result:
    system: str
    batch: int
    changes: int = 0
    seconds: float = 0.0
    latencies_s: list[float] = field(default_factory=list)
    files: int | None = None
    bytes: int | None = None
    equal: bool | None = None
    detail: str = ""
    complete: bool = True
    live_rows: int = 0  # in the final table (the model's)

    def summary(self) -> dict[str, Any]:
        lat = sorted(self.latencies_s)
        tenth = max(1, len(self.latencies_s) // 10)
        ms = 1000
        return {
            "system": self.system, "batch": self.batch, "changes": self.changes,
            "complete": self.complete, "rows_per_s": self.changes / self.seconds
            if self.seconds else 0.0,
            "p50_ms": statistics.median(lat) * ms if lat else None,
            "p99_ms": lat[min(len(lat) - 1, int(0.99 * len(lat)))] * ms if lat else None,
            "first_tenth_p50_ms": statistics.median(self.latencies_s[:tenth]) * ms
            if lat else None,
            "last_tenth_p50_ms": statistics.median(self.latencies_s[-tenth:]) * ms
            if lat else None,
            "files": self.files, "bytes": self.bytes, "equal": self.equal,
            "live_rows": self.live_rows, "detail": self.detail}


def compare(result: Result, content: Callable[[], Model], batches: list[Batch]) -> None:
    try:
        got = content()
    except DuplicateKeys as exc:
        result.equal, result.detail = False, str(exc)
        return
    want = model(batches)
    result.live_rows = len(want)
    missing = [k for k in want if k not in got]
    extra = [k for k in got if k not in want]
    changed = [k for k in want if k in got and got[k] != want[k]]
    result.equal = not (missing or extra or changed)
    if not result.equal:
        result.detail = (f"{len(missing)} missing (e.g. {missing[:3]}), {len(extra)} extra "
                         f"(e.g. {extra[:3]}), {len(changed)} different (e.g. {changed[:3]})")


def disk_usage(root: Path) -> tuple[int, int]:
    files = [Path(d) / f for d, _, names in os.walk(root) for f in names]
    return len(files), sum(f.stat().st_size for f in files if f.exists())


def timed_batches(result: Result, batches: list[Batch], budget_s: float,
                  apply_one: Callable[[int, Batch], None]) -> int:
    """Apply micro-batches (numbered from 1) one after another, timing each, until done
    or past the budget; returns how many were applied."""
    applied = 0
    started = time.perf_counter()
    for i, b in enumerate(batches, start=1):
        t0 = time.perf_counter()
        apply_one(i, b)
        result.latencies_s.append(time.perf_counter() - t0)
        result.changes += b.changes
        applied += 1
        if time.perf_counter() - started > budget_s:
            break
    result.seconds = time.perf_counter() - started
    result.complete = applied == len(batches)
    return applied


# --- Retina ---------------------------------------------------------------------------------
class FeedSource:
    """A CDC source the benchmark feeds: one source transaction per micro-batch."""

    name = "bench"

    def __init__(self) -> None:
        self.queue: queue.Queue[SourceTransaction] = queue.Queue()

    def poll(self, timeout_s: float) -> SourceTransaction | None:
        try:
            return self.queue.get(timeout=timeout_s)
        except queue.Empty:
            return None

    def ack(self, position: str) -> None:
        pass  # sent by the intake thread between polls: later than the commit readers see

    def position_key(self, position: str) -> tuple[Any, ...]:
        return (int(position),)

    def close(self) -> None:
        pass


class CommitWatch(PositionStore):
    """The connector's committed position store, telling the benchmark when a micro-batch
    is committed: the position is stored right after CommitTransBatch, when a new gated
    reader sees the batch (the source's ack comes later, from the intake thread)."""

    def __init__(self, etcd: EtcdStore, connector: str) -> None:
        super().__init__(etcd, connector)
        self.committed = 0
        self._cv = threading.Condition()

    def store(self, committed: CommittedPosition) -> None:
        super().store(committed)
        with self._cv:
            self.committed = int(committed.position)
            self._cv.notify_all()

    def wait(self, position: int, timeout_s: float) -> None:
        with self._cv:
            if not self._cv.wait_for(lambda: self.committed >= position, timeout_s):
                raise RuntimeError(f"the connector did not commit micro-batch {position} "
                                   f"within {timeout_s:.0f} s")


@dataclass
class RetinaCluster:
    work: Path
    state: Any
    node: str
    topology: Topology
    catalog: Catalog
    stub: retina_pb2_grpc.RetinaWorkerServiceStub
    trans: trans_pb2_grpc.TransServiceStub


def start_retina(work: Path) -> RetinaCluster:
    node = f"127.0.0.1:{free_port()}"
    state = start_cluster(work, nodes=[node], virtual_nodes=8, log=lambda _m: None)
    # retina-direct writes without a changelog (the apply path alone, not crash-safe):
    # the node's development mode lets those writes through.
    start_retina_server(state, node, ANONYMOUS_WRITES_ENV)
    channel = grpc.insecure_channel(node)
    grpc.channel_ready_future(channel).result(timeout=60)
    stub = retina_pb2_grpc.RetinaWorkerServiceStub(channel)
    drive_recovery(stub)  # a fresh node: nothing to replay, then MarkReady
    catalog = Catalog(state.postgres.dsn())
    catalog.create_schema(SCHEMA)
    trans = trans_pb2_grpc.TransServiceStub(grpc.insecure_channel(state.trans_listen))
    return RetinaCluster(work, state, node, Topology((node,), 8), catalog, stub, trans)


def retina_content(cluster: RetinaCluster, table: str) -> Model:
    reader = SnapshotReader(cluster.state.trans_listen, cluster.topology)
    try:
        return as_model(reader.read(SCHEMA, table).table)
    finally:
        reader.close()


def retina_direct(cluster: RetinaCluster, batches: list[Batch], size: int,
                  budget_s: float) -> Result:
    table = cluster.catalog.create_table(SCHEMA, f"direct_{size}", COLUMNS, ["id"])
    writer = TableWriter(table, cluster.topology)

    def apply_one(_i: int, b: Batch) -> None:
        t = cluster.trans.BeginTrans(tpb.BeginTransRequest(), timeout=30)
        updates = writer.updates(t.timestamp, deletes=[{"id": k} for k in b.deletes],
                                 replaces=b.upserts)
        cluster.stub.UpdateRecord(requests_by_node(SCHEMA, [updates])[cluster.node],
                                  timeout=120)
        cluster.trans.CommitTrans(tpb.CommitTransRequest(trans_id=t.trans_id), timeout=30)

    result = Result("retina-direct", size)
    applied = timed_batches(result, batches, budget_s, apply_one)
    compare(result, lambda: retina_content(cluster, table.name), batches[:applied])
    return result


def retina_changelog(cluster: RetinaCluster, batches: list[Batch], size: int,
                     budget_s: float) -> Result:
    name = f"changelog_{size}"
    cluster.catalog.create_table(SCHEMA, name, COLUMNS, ["id"])
    config = load_config(cluster.state.config_path)
    source = FeedSource()
    changelog_dir = cluster.work / f"changelog-{size}"
    etcd = EtcdStore.from_config(config.etcd)
    writer_id = f"bench-peers-{size}"
    positions = CommitWatch(etcd, writer_id)
    # WRITES_HAVE_A_REPLAY_SOURCE: a node takes the connector's writes only once its
    # changelog is registered (one writer id per changelog, as retina-cdc does).
    replay_sources.register(etcd, writer_id, kind="cdc", changelog_root="file://" +
                            str(changelog_dir), schema=SCHEMA)
    connector = Connector(
        source=source, changelog=Changelog("file://" + str(changelog_dir)),
        positions=positions, trans=cluster.trans,
        nodes={cluster.node: cluster.stub}, tables=table_map(cluster.catalog, SCHEMA),
        topology=cluster.topology,
        settings=dataclasses.replace(settings_of(config.cdc, config.retina.max_rows_per_request),
                                     schema=SCHEMA, writer_id=writer_id))
    worker = threading.Thread(target=connector.run, name="bench-connector", daemon=True)
    worker.start()

    def apply_one(i: int, b: Batch) -> None:
        changes = [RowChange(f"public.{name}", "delete", {"id": k}, None) for k in b.deletes]
        changes += [RowChange(f"public.{name}", "update", None, r) for r in b.upserts]
        source.queue.put(SourceTransaction(str(i), str(i), int(time.time() * 1000),
                                           tuple(changes)))
        positions.wait(i, 300)

    result = Result("retina-changelog", size)
    try:
        applied = timed_batches(result, batches, budget_s, apply_one)
    finally:
        connector.stop()
        worker.join(timeout=30)
    result.files, result.bytes = disk_usage(changelog_dir)
    result.detail = "files and bytes: the changelog only"
    compare(result, lambda: retina_content(cluster, name), batches[:applied])
    return result


def retina_footprint(cluster: RetinaCluster) -> dict[str, tuple[int, int]]:
    """(files, bytes) of the whole node (every Retina table): data files, and the index
    and node state (primary index, MainIndex, checkpoints)."""
    return {"data": disk_usage(cluster.work / "storage"),
            "index and state": disk_usage(cluster.work / "retina-state")}


def print_footprint(parts: dict[str, tuple[int, int]], results: list[Result]) -> None:
    """The node's footprint, and per live row of the Retina tables (the changelog's
    files are each changelog result's own)."""
    live = sum(r.live_rows for r in results if r.system.startswith("retina"))
    changelog = sum(r.bytes or 0 for r in results if r.system == "retina-changelog")
    total = sum(b for _f, b in parts.values())
    print("Retina node footprint (every Retina table): "
          + ", ".join(f"{name} {f} files {b / 2**20:.2f} MiB" for name, (f, b) in parts.items())
          + f"; {live} live rows in all")
    if live:
        print("bytes per live row: " + ", ".join(
            f"{name} {b / live:,.0f}" for name, (_f, b) in parts.items())
            + f", changelog {changelog / live:,.0f}; total {(total + changelog) / live:,.0f}"
            " (the Storage GC job off, its default: replaced and deleted rows stay in their "
            "files)")


# --- peers ----------------------------------------------------------------------------------
def peer(system: str, python: str, batches: list[Batch], size: int, budget_s: float,
         work: Path) -> Result:
    root = work / f"{system}-{size}"
    workload = work / f"workload-{size}.parquet"
    if not workload.exists():
        workload_file(batches, workload)
    out = work / f"{system}-{size}.json"
    done = subprocess.run([python, str(PEER_DRIVER), "--system", system, "--workload",
                           str(workload), "--budget-s", str(budget_s), "--dir", str(root),
                           "--out", str(out)], capture_output=True, text=True,
                          timeout=budget_s * 4 + 600)
    result = Result(system, size)
    if done.returncode != 0:
        result.equal = False
        result.detail = f"driver exited {done.returncode}: {done.stderr.strip()[-600:]}"
        return result
    answer = json.loads(out.read_text())
    applied = int(answer["batches_applied"])
    result.latencies_s = answer["latencies_s"]
    result.seconds = answer["seconds"]
    result.changes = sum(b.changes for b in batches[:applied])
    result.files, result.bytes = answer["files"], answer["bytes"]
    result.complete = applied == len(batches)
    compare(result, lambda: as_model(pq.read_table(answer["final"])), batches[:applied])
    shutil.rmtree(root, ignore_errors=True)
    return result


def peer_versions(python: str) -> str:
    code = ("import importlib.metadata as m; print(', '.join(f'{p} ' + m.version(p) for p in "
            "('deltalake', 'pyiceberg', 'pypaimon', 'pyarrow')))")
    done = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=60)
    return done.stdout.strip() if done.returncode == 0 else f"unknown ({done.stderr[-200:]})"


# --- main -----------------------------------------------------------------------------------
def _num(value: float | None, spec: str = ".1f") -> str:
    return "-" if value is None else format(value, spec)


def print_table(results: list[Result]) -> None:
    print(f"\n{'system':<18}{'batch':>6}{'changes':>9}{'rows/s':>10}{'p50 ms':>9}"
          f"{'p99 ms':>9}{'1st/10 p50':>12}{'last/10 p50':>13}{'files':>8}{'MiB':>9}  equal")
    for r in results:
        s = r.summary()
        mib = None if r.bytes is None else r.bytes / 2**20
        print(f"{r.system:<18}{r.batch:>6}{r.changes:>9}{s['rows_per_s']:>10,.0f}"
              f"{_num(s['p50_ms']):>9}{_num(s['p99_ms']):>9}"
              f"{_num(s['first_tenth_p50_ms']):>12}{_num(s['last_tenth_p50_ms']):>13}"
              f"{_num(r.files, 'd'):>8}{_num(mib, '.2f'):>9}  {'yes' if r.equal else 'NO'}"
              f"{'' if r.complete else ' (stopped at the budget)'}")
        if not r.equal:
            print(f"  !!! {r.system} B={r.batch}: FINAL CONTENT DIFFERS FROM THE MODEL: "
                  f"{r.detail}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=200_000)
    parser.add_argument("--batch", type=int, action="append",
                        help="micro-batch size (repeatable; default 100 and 5000)")
    parser.add_argument("--seed", type=int, default=15)
    parser.add_argument("--budget-s", type=float, default=120.0,
                        help="per system and batch size; stops at a batch boundary")
    parser.add_argument("--systems", default="retina-direct,retina-changelog,delta,iceberg,"
                                             "paimon")
    parser.add_argument("--peers-python", default=str(ROOT / ".venv-peers" / "bin" / "python"),
                        help="the peers' virtual environment (make bench-peers makes it)")
    parser.add_argument("--json", type=Path, help="write every figure here")
    args = parser.parse_args()
    sizes = args.batch or [100, 5000]
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    configure_logging("bench", os.environ.get("BENCH_LOG_LEVEL", "warning"))
    peers = [s for s in systems if not s.startswith("retina")]
    versions = peer_versions(args.peers_python) if peers else "-"
    print(f"setup: {platform.platform()}, {os.cpu_count()} cores, Python "
          f"{platform.python_version()}, pyarrow {pa.__version__}; peers: {versions}; "
          f"{args.rows} changes (70% inserts, 20% updates, 10% deletes; seed {args.seed}); "
          f"batches {sizes}; budget {args.budget_s:.0f} s per configuration; Retina: one node "
          "(8 virtual nodes), TransServer, etcd, PostgreSQL on this machine, loopback gRPC")
    changes = generate(args.rows, args.seed)
    work = Path(tempfile.mkdtemp(prefix="retina-bench-peers-"))
    os.chmod(work, 0o755)  # PostgreSQL runs as its own user and writes its log below
    results: list[Result] = []
    cluster = start_retina(work / "retina") if any(s.startswith("retina") for s in systems) \
        else None
    runners: dict[str, Callable[[list[Batch], int], Result]] = {
        "retina-direct": lambda b, n: retina_direct(cluster, b, n, args.budget_s),
        "retina-changelog": lambda b, n: retina_changelog(cluster, b, n, args.budget_s),
    }
    try:
        for size in sizes:
            batches = micro_batches(changes, size)
            for system in systems:
                run = runners.get(system) or (lambda b, n, s=system: peer(
                    s, args.peers_python, b, n, args.budget_s, work))
                print(f"running {system} B={size} ...", flush=True)
                results.append(run(batches, size))
        if cluster is not None:
            print_footprint(retina_footprint(cluster), results)
    finally:
        if cluster is not None:
            cluster.catalog.close()
            stop_cluster(cluster.state, log=lambda _m: None)
        shutil.rmtree(work, ignore_errors=True)
    print_table(results)
    if args.json:
        args.json.write_text(json.dumps({"setup": {"platform": platform.platform(),
                                                   "cores": os.cpu_count(), "rows": args.rows,
                                                   "seed": args.seed, "peers": versions,
                                                   "budget_s": args.budget_s},
                                         "results": [r.summary() for r in results]}, indent=2))
    bad = [r for r in results if not r.equal]
    if bad:
        print(f"\n!!! {len(bad)} configuration(s) ended with content that differs from the "
              "model: see above", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
