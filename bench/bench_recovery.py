"""Recovery benchmark: checkpoint size and write time, and start -> replayTsReady.

Builds the durable state of one Retina node directly, at the size the issue
names (default 1,000 published files, 10 million rows):

* 1,000 real Parquet ingest files (one row group of 10,000 rows each), with
  REGULAR catalog rows and MainIndex flush markers;
* a checkpoint that admits them, with 1% of the rows deleted, installed
  through the real store (body + etcd two-slot swap).

Then it starts a real ``retina-server`` and measures the time from process
start to ``replayTsReady`` (load, validate, cleanse every entry against the
catalog, footer checks, rewind). With ``--runs N`` it installs the checkpoint
and starts the node N times over the same state (a new checkpoint id each
time, the node stopped in between) and prints min / median / max. Figures are
printed; nothing is asserted.

Both instants are taken by one GetRetinaStatus poller started with the
process: "listening" is its first answer, replayTsReady the first answer that
says so (every 5 ms, on a channel that reconnects every 10-20 ms; the default
reconnect back-off would add up to seconds).

    .venv/bin/python bench/bench_recovery.py --files 10000 --rows-per-file 10000 --runs 3
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import shutil
import statistics
import tempfile
import threading
import time
from datetime import UTC, datetime
from pathlib import Path

import grpc
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from pyroaring import BitMap

from devtools.cluster import (
    free_port,
    start_cluster,
    start_retina_server,
    stop_cluster,
    terminate,
)
from retina_common import file_names
from retina_common.catalog import Catalog, ColumnSpec, FileType
from retina_common.checkpoint_store import (
    CheckpointBody,
    CheckpointHeader,
    CheckpointStore,
    FileEntry,
    RGEntry,
)
from retina_common.etcd import EtcdStore
from retina_common.log import configure_logging
from retina_common.pb import retina_pb2, retina_pb2_grpc
from retina_common.replay_ts import IngestSegment, SegmentKind
from retina_common.storage import write_durably
from retina_common.topology import Topology
from retina_server.index import LocalIndexService
from retina_server.main_index import RowIdRange

# Reconnect every 10-20 ms: with the default back-off (1 s, growing) a channel probed
# before the server listens answers up to seconds after it does.
_FAST_RECONNECT = [("grpc.initial_reconnect_backoff_ms", 10),
                   ("grpc.min_reconnect_backoff_ms", 10), ("grpc.max_reconnect_backoff_ms", 20)]


def watch_start(node: str, started: float, out: dict, stop: threading.Event) -> None:
    """From the moment the process is started: seconds to the first GetRetinaStatus
    answered (``listening``), then to replayTsReady (``ready``, with ``status``)."""
    with grpc.insecure_channel(node, options=_FAST_RECONNECT) as channel:
        stub = retina_pb2_grpc.RetinaWorkerServiceStub(channel)
        while not stop.is_set():
            try:
                status = stub.GetRetinaStatus(retina_pb2.GetRetinaStatusRequest(), timeout=0.5,
                                              wait_for_ready=True)
            except grpc.RpcError:
                continue  # not serving yet
            now = time.perf_counter() - started
            out.setdefault("listening", now)
            if status.replay_ts_ready or status.state in (retina_pb2.READY, retina_pb2.FAILED):
                out["ready"], out["status"] = now, status
                return
            time.sleep(0.005)


def timed_start(state, node: str) -> tuple[float, float, retina_pb2.GetRetinaStatusResponse]:
    """(process start -> listening, -> replayTsReady, the status then)."""
    seen: dict = {}
    stop = threading.Event()
    t0 = time.perf_counter()
    watcher = threading.Thread(target=watch_start, args=(node, t0, seen, stop))
    watcher.start()
    try:
        start_retina_server(state, node, timeout_s=120)
        watcher.join(600)
    finally:
        stop.set()
        watcher.join()
    if "status" not in seen:
        raise TimeoutError(f"{node} not replayTsReady within 600 s")
    if seen["status"].state == retina_pb2.FAILED:  # not a start to time: say why
        raise SystemExit(f"{node} FAILED at start: {seen['status'].failure_reason}")
    return seen["listening"], seen["ready"], seen["status"]


def spread(values: list[float], unit: str, scale: float = 1.0) -> str:
    if len(values) == 1:
        return f"{values[0] * scale:.2f} {unit}"
    return (f"min {min(values) * scale:.2f} / median {statistics.median(values) * scale:.2f} / "
            f"max {max(values) * scale:.2f} {unit} ({len(values)} runs)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--files", type=int, default=1000)
    parser.add_argument("--rows-per-file", type=int, default=10_000)
    parser.add_argument("--deleted", type=float, default=0.01, help="fraction of rows deleted")
    parser.add_argument("--runs", type=int, default=1,
                        help="checkpoint installs and node starts over the same state")
    args = parser.parse_args()
    configure_logging("bench", "warning")
    work = Path(tempfile.mkdtemp(prefix="retina-bench-rec-"))
    os.chmod(work, 0o755)
    node = f"127.0.0.1:{free_port()}"
    total = args.files * args.rows_per_file
    print(f"setup: {platform.platform()}, {os.cpu_count()} cores, Python "
          f"{platform.python_version()}; {args.files} files x {args.rows_per_file} rows = "
          f"{total:,} rows, {args.deleted:.0%} deleted; local storage, etcd and PostgreSQL "
          "on this machine")
    state = start_cluster(work, nodes=[node], virtual_nodes=8, log=lambda _m: None)
    topology = Topology((node,), 8)
    try:
        catalog = Catalog(state.postgres.dsn())
        catalog.create_schema("bench")
        table = catalog.create_table("bench", "orders", [
            ColumnSpec("id", "int64"), ColumnSpec("note", "string")], ["id"])
        storage = "file://" + str(work / "storage")
        path = catalog.add_path(table.table_id, f"{storage}/bench/orders")
        # Where start_retina_server puts the node's state (RETINA__RETINA__STATE_DIR).
        index = LocalIndexService(work / "retina-state" / node.replace(":", "-") / "index")
        rng = random.Random(1)
        files, segments, rgs = [], [], []
        built = time.perf_counter()
        now = datetime.now(UTC)
        for i in range(args.files):
            vnode = i % 8
            first_row = index.sequences.allocate_row_ids(args.rows_per_file)
            lo_ts, hi_ts = 10 + i * 10, 10 + i * 10 + 9
            ids = np.arange(first_row, first_row + args.rows_per_file, dtype=np.int64)
            data = pa.table({"id": ids, "note": pa.array(["x"] * args.rows_per_file),
                             "_commit_ts": np.full(args.rows_per_file, hi_ts, dtype=np.int64)})
            data = data.set_column(2, "_commit_ts", pa.array(
                np.linspace(lo_ts, hi_ts, args.rows_per_file).astype(np.int64)))
            name = file_names.make(node, now, i, vnode)
            sink = pa.BufferOutputStream()
            pq.write_table(data, sink, row_group_size=args.rows_per_file)
            write_durably(path.uri, name, sink.getvalue().to_pybytes())
            record = catalog.add_file(name, FileType.TEMPORARY_INGEST, 0, path.path_id)
            catalog.update_file(record.file_id, file_type=FileType.REGULAR, num_row_group=1,
                                min_row_id=first_row,
                                max_row_id=first_row + args.rows_per_file - 1)
            index.main.put_main_index_entries([RowIdRange(first_row, args.rows_per_file,
                                                     record.file_id, 0, 0)])
            index.main.flush_file(record.file_id)
            files.append(FileEntry(record.file_id, table.table_id, vnode, i * 4, lo_ts, hi_ts,
                                   args.rows_per_file, first_row,
                                   first_row + args.rows_per_file - 1, 1))
            segments.append(IngestSegment(table.table_id, vnode, SegmentKind.ADMITTED,
                                          record.file_id, i * 4, 1, args.rows_per_file,
                                          lo_ts, hi_ts))
            deleted = BitMap(rng.sample(range(args.rows_per_file),
                                        int(args.rows_per_file * args.deleted)))
            rgs.append(RGEntry(record.file_id, 0, args.rows_per_file, 10 + args.files * 10,
                               deleted))
        index.close()
        print(f"state built in {time.perf_counter() - built:.1f}s")
        store = CheckpointStore(EtcdStore([state.etcd.endpoint]), node, storage,
                                topology.topology_hash)
        installs, listening, ready = [], [], []
        for run in range(1, args.runs + 1):
            body = CheckpointBody(CheckpointHeader(node, run, 1, int(time.time() * 1000),
                                                   10 + args.files * 10, topology.topology_hash),
                                  files, segments, rgs)
            t0 = time.perf_counter()
            pointer = store.install(body)
            installs.append(time.perf_counter() - t0)
            listening_s, ready_s, status = timed_start(state, node)
            listening.append(listening_s)
            ready.append(ready_s)
            print(f"run {run}: checkpoint install {installs[-1] * 1000:.0f} ms; process start ->"
                  f" listening {listening_s:.2f} s -> replayTsReady {ready_s:.2f} s (state "
                  f"{status.phase}, checkpoint {status.checkpoint_id})")
            terminate(state.retina_pids.pop(node), timeout_s=60)
        print(f"checkpoint body: {pointer.length:,} bytes = {pointer.length * 8 / total:.3f} "
              f"bits per row ({pointer.length / args.files:,.0f} bytes per row group of "
              f"{args.rows_per_file} rows); encode + write + fsync + etcd swap "
              f"{spread(installs, 'ms', 1000)}")
        print(f"process start -> gRPC listening {spread(listening, 's')} -> replayTsReady "
              f"{spread(ready, 's')} (includes Python start-up and imports)")
        catalog.close()
    finally:
        stop_cluster(state, log=lambda _m: None)
        if os.environ.get("RETINA_BENCH_KEEP"):
            print(f"kept {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
