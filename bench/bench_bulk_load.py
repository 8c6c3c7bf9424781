"""Bulk load: rows/s of ``retina_common.bulk_loader`` into one node, beside Delta Lake's and
Paimon's batch writes of the same rows (docs/performance.md, "Bulk load").

The rows: ``--rows`` of the bench_peers table (a 6-column table keyed by an int64: id, c1
int64, c2 float64, c3 string, c4 int64, c5 string), made with Arrow compute (no Python
rows), ids 1..N. Retina: a private cluster (etcd, PostgreSQL, the TransServer, one node
owning all 8 virtual nodes), one ``BulkLoader`` in this process, ``--chunk-rows`` rows per
commit; the time runs from the first BeginTrans to the last CommitTrans. Then the table is
read back at a new gated snapshot, file by file (count, sum of ids, the number of distinct
ids for runs of up to 20M rows), and a mismatch exits 1. The peers (``--peers-python``,
the virtual environment `make bench-peers` makes) write the same rows from one Parquet
file through ``bench/peers/bulk_driver.py``: ``deltalake.write_deltalake`` (append), a
pypaimon append-only table and a pypaimon primary-key table, each checked by a new reader.

    .venv/bin/python bench/bench_bulk_load.py --rows 5000000
    .venv/bin/python bench/bench_bulk_load.py --rows 5000000 --peers-python .venv-peers/bin/python
    make bench-load LOAD_ARGS="--rows 100000000 --no-peers"
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from one_node import machine  # bench/ is the script's directory: on sys.path

from devtools.cluster import (
    free_port,
    retina_log_path,
    start_cluster,
    start_retina_server,
    stop_cluster,
)
from retina_common.bulk_loader import BulkLoader
from retina_common.catalog import Catalog, ColumnSpec
from retina_common.pb import retina_pb2_grpc
from retina_common.reader import SnapshotReader
from retina_common.recovery_driver import drive_recovery
from retina_common.topology import Topology

ROOT = Path(__file__).resolve().parent.parent
DRIVER = ROOT / "bench" / "peers" / "bulk_driver.py"
COLUMNS = [ColumnSpec("id", "int64"), ColumnSpec("c1", "int64"), ColumnSpec("c2", "float64"),
           ColumnSpec("c3", "string"), ColumnSpec("c4", "int64"), ColumnSpec("c5", "string")]
STATUSES = pa.array(["newnewnew", "paidpaidpaid", "shippedshippedshipped",
                     "returnedreturnedreturned"])


def rows(first: int, count: int, seed: int) -> pa.Table:
    """``count`` rows with ids ``first..first+count-1`` (Arrow compute, no Python rows)."""
    rng = np.random.default_rng(seed + first)
    ids = np.arange(first, first + count, dtype=np.int64)
    customer = pc.binary_join_element_wise(
        "customer-", pc.utf8_lpad(pc.cast(pa.array(ids % 100_000), pa.string()), 5, "0"), "")
    return pa.table({
        "id": ids, "c1": rng.integers(0, 1 << 40, count), "c2": rng.random(count) * 1e6,
        "c3": customer, "c4": rng.integers(0, 1000, count),
        "c5": STATUSES.take(pa.array(rng.integers(0, 4, count)))})


def batches(total: int, step: int, seed: int) -> Any:
    for first in range(1, total + 1, step):
        yield rows(first, min(step, total + 1 - first), seed)


def verify(reader: SnapshotReader, total: int) -> dict[str, Any]:
    """The table at a new gated snapshot, file by file: rows, sum of ids, distinct ids."""
    started = time.perf_counter()
    count, id_sum = 0, 0
    ids: list[np.ndarray] = []
    with reader.transaction() as trans:
        buffered = reader.fetch_buffers(trans, "bench", "rows")
        files = reader.list_files(trans, "bench", "rows")
        regular = {f.file_id for f in files}
        for f in files:
            part = reader.read_file(f, trans).column("id").to_numpy()
            count, id_sum = count + len(part), id_sum + int(part.sum())
            if total <= 20_000_000:
                ids.append(part)
        for table in buffered.values():
            keep = pc.invert(pc.is_in(table.column("_file_id"), pa.array(sorted(regular))))
            part = table.filter(keep).column("id").to_numpy()
            count, id_sum = count + len(part), id_sum + int(part.sum())
            if total <= 20_000_000:
                ids.append(part)
    distinct = len(np.unique(np.concatenate(ids))) if ids else None
    return {"rows": count, "id_sum": id_sum, "distinct": distinct, "files": len(files),
            "seconds": round(time.perf_counter() - started, 2)}


def run_retina(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    node = f"127.0.0.1:{free_port()}"
    state = start_cluster(work / "cluster", nodes=[node], virtual_nodes=8, log=lambda _m: None)
    channels: list[grpc.Channel] = []
    try:
        catalog = Catalog(state.postgres.dsn())
        catalog.create_schema("bench")
        table = catalog.create_table("bench", "rows", COLUMNS, ["id"])
        start_retina_server(state, node, {"RETINA__RETINA__CHECKPOINT_INTERVAL_MS": "60000"})
        channels.append(grpc.insecure_channel(node))
        stub = retina_pb2_grpc.RetinaWorkerServiceStub(channels[-1])
        grpc.channel_ready_future(channels[-1]).result(timeout=60)
        drive_recovery(stub)
        reader = SnapshotReader(state.trans_listen, Topology((node,), 8))
        loader = BulkLoader("bench", table, Topology((node,), 8), reader.trans, {node: stub},
                            chunk_rows=args.chunk_rows)
        cpu_before = resource.getrusage(resource.RUSAGE_SELF)
        report = loader.load(batches(args.rows, args.chunk_rows, args.seed))
        cpu_after = resource.getrusage(resource.RUSAGE_SELF)
        phases = _commit_phases(retina_log_path(state, node))
        check = verify(reader, args.rows)
        reader.close()
        expected_sum = args.rows * (args.rows + 1) // 2
        ok = check["rows"] == args.rows and check["id_sum"] == expected_sum and \
            check["distinct"] in (None, args.rows)
        loader_cpu = (cpu_after.ru_utime - cpu_before.ru_utime +
                      cpu_after.ru_stime - cpu_before.ru_stime)
        return {"system": "retina-bulk-load", "rows": report.rows, "seconds": report.seconds,
                "rows_per_s": report.rows_per_s, "chunks": report.chunks, "files": report.files,
                "bytes_on_disk": _bytes(work / "cluster"), "verified": ok, "check": check,
                "loader_cpu_s": round(loader_cpu, 2), "node_phases_s": phases}
    finally:
        for channel in channels:
            channel.close()
        stop_cluster(state, log=lambda _m: None)


def _commit_phases(log_path: Path) -> dict[str, float]:
    """The node's CommitBulkLoad time by phase, summed over the run (its log lines)."""
    total: dict[str, float] = {}
    for line in log_path.read_text().splitlines():
        if '"bulk_load_committed"' in line:
            for phase, seconds in json.loads(line).get("seconds", {}).items():
                total[phase] = round(total.get(phase, 0.0) + seconds, 2)
    return total


def _bytes(root: Path) -> int:
    return sum(p.stat().st_size for p in root.rglob("*.parquet"))


def run_peer(args: argparse.Namespace, work: Path, system: str, data: Path) -> dict[str, Any]:
    out = work / f"{system}.json"
    done = subprocess.run([args.peers_python, str(DRIVER), "--system", system, "--data",
                           str(data), "--dir", str(work / system), "--out", str(out)],
                          check=False, capture_output=True, text=True)
    if done.returncode != 0:
        return {"system": system, "error": (done.stderr or done.stdout)[-2000:],
                "verified": False}
    result: dict[str, Any] = json.loads(out.read_text())
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=2_000_000)
    parser.add_argument("--chunk-rows", type=int, default=1_000_000)
    parser.add_argument("--seed", type=int, default=29)
    parser.add_argument("--peers-python", default=str(ROOT / ".venv-peers" / "bin" / "python"))
    parser.add_argument("--no-peers", action="store_true", help="Retina only")
    parser.add_argument("--pk-rows", type=int, default=2_000_000,
                        help="rows for the pypaimon primary-key table, which writes ~50k "
                             "rows/s (its rows/s is for these rows; default %(default)s)")
    parser.add_argument("--json", help="write every result here")
    args = parser.parse_args(argv)
    print(machine().replace("; one Retina node", f"; {args.rows:,} rows, chunks of "
                            f"{args.chunk_rows:,}; one Retina node"))
    results = []
    work = Path(tempfile.mkdtemp(prefix="bench-load-"))
    os.chmod(work, 0o755)  # PostgreSQL runs as its own user and writes below it
    try:
        results.append(run_retina(args, work))
        if not args.no_peers and Path(args.peers_python).exists():
            data, fewer = work / "rows.parquet", work / "pk-rows.parquet"
            for path, count in ((data, args.rows), (fewer, min(args.rows, args.pk_rows))):
                with pq.ParquetWriter(path, rows(1, 1, args.seed).schema) as writer:
                    for part in batches(count, args.chunk_rows, args.seed):
                        writer.write_table(part)
            for system in ("delta", "paimon-append", "paimon-pk"):
                results.append(run_peer(args, work, system,
                                        fewer if system == "paimon-pk" else data))
        elif not args.no_peers:
            print(f"peers skipped: {args.peers_python} not found (make bench-peers makes it)")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"{'system':<18} {'rows':>12} {'seconds':>9} {'rows/s':>12} {'files':>7} "
          f"{'MB on disk':>10}  verified")
    for r in results:
        if "error" in r:
            print(f"{r['system']:<18} failed: {r['error']}")
            continue
        print(f"{r['system']:<18} {r['rows']:>12,} {r['seconds']:>9.2f} {r['rows_per_s']:>12,.0f} "
              f"{r.get('files', 0):>7} {r.get('bytes_on_disk', 0) / 1e6:>10.1f}  {r['verified']}")
    retina = results[0]
    print(f"retina: {retina['chunks']} commits; node commit phases (s) "
          f"{retina['node_phases_s']}; loader CPU {retina['loader_cpu_s']} s; "
          f"read back {retina['check']}; python {platform.python_version()}, "
          f"{os.cpu_count()} cores")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0 if all(r.get("verified") for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
