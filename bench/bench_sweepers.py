"""Sweepers benchmark: a long-running cluster under CDC load with Storage GC keeps its
footprint flat, while a gated read transaction held open for the whole run still reads
its snapshot exactly (issue 11, "Done when").

A private local cluster (etcd, PostgreSQL, TransServer, ``--nodes`` Retina nodes,
retina-cdc), every Retina node with Storage GC on: the node launches the Spark rewrite
job for its own streams every ``--gc-job-interval-s`` (``retina.gc_job_interval_ms``,
Spark local mode), folds visibility / prunes the primary index every ``--gc-interval-s``,
checkpoints every ``--checkpoint-interval-s``, and runs a sweeper round every
``--sweeper-interval-s``; retired files are kept ``--retired-retention-s`` and final
GC journal records ``--lineage-retention-s``.

1. ``--keys`` rows are loaded into the source PostgreSQL table and arrive through CDC;
2. a steady workload runs in the source for the whole run at ``--rate`` row changes/s
   over that fixed key set: updates, replacements (delete + insert of the same key) and
   swaps (delete a present key, insert an absent one), so the live row count is constant;
3. a gated read-only transaction begins: GetWriteBuffer from every node, ListQueryFiles,
   QueryVisibility at its snapshot for every listed file (SnapshotReader's steps), its
   snapshot assembled and kept; then MarkTransOffloaded (it no longer holds back
   safeGcTs) and its lease is renewed for the whole run;
4. every ``--sample-s`` a row of figures: catalog files by type, bytes on storage (data
   files; checkpoint bodies; the CDC changelog), the primary index (versions, LMDB bytes
   in use) and MainIndex ranges of every node, GC journal entries, RSS of every
   retina-server, GC rewrites committed and files removed by the sweepers so far (the
   nodes' Prometheus endpoints), the achieved source rate and the CDC slot's lag;
5. at the end the held transaction reads its listed files from storage again (every one
   must still exist) with the visibility and write-buffer rows it materialised, and the
   result must equal the snapshot it assembled at the start, row for row (``_commit_ts``
   included); then the load stops, and a fresh gated snapshot must equal the source table
   once CDC caught up. Either mismatch is printed loudly and the exit code is 1.

The summary compares the first and the last quarter of the samples taken after the
warm-up (``--warmup-s``) for each series and gives its least-squares slope: a series is
"flat" when its last-quarter mean is at most ``--flat-tolerance`` above the first-quarter
mean (plus a small absolute allowance per series, printed). Timings and sizes are
reported, not asserted.

    .venv/bin/python bench/bench_sweepers.py --minutes 10 --sample-s 15
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import random
import shutil
import sqlite3
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import lmdb
import numpy as np
import psycopg2
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pyspark
import requests
from prometheus_client.parser import text_string_to_metric_families

from devtools.cluster import (
    ClusterState,
    free_port,
    node_state,
    pid_alive,
    start_cdc,
    start_cluster,
    start_retina_server,
    stop_cluster,
    wait_for,
)
from retina_common import file_names
from retina_common.catalog import Catalog, ColumnSpec, FileType
from retina_common.codec import COMMIT_TS
from retina_common.log import configure_logging
from retina_common.pb import retina_pb2 as rpb
from retina_common.pb import retina_pb2_grpc, trans_pb2_grpc
from retina_common.pb import trans_pb2 as tpb
from retina_common.reader import FILE_ID, SnapshotReader
from retina_common.storage import local_dir, read_bytes
from retina_common.topology import load_topology

SCHEMA, TABLE = "bench", "readings"
DDL = "CREATE TABLE readings (id int8 PRIMARY KEY, version int8, value float8, note text)"
COLUMNS = [ColumnSpec("id", "int64"), ColumnSpec("version", "int64"),
           ColumnSpec("value", "float64"), ColumnSpec("note", "string")]
SLOT = "retina_cdc"
MiB = 1 << 20


def note(key: int, version: int) -> str:
    return f"key-{key:09d}/v{version:09d}/" + "abcdefghij"[key % 10] * 24


# --- the source workload ------------------------------------------------------------------------
class Workload:
    """Paced transactions over a fixed key set in the source table (one connection)."""

    def __init__(self, dsn: str, keys: int, rate: float, ops_per_txn: int, seed: int) -> None:
        self.dsn = dsn
        self.rate = rate
        self.ops_per_txn = ops_per_txn
        self.rng = random.Random(seed)
        universe = int(keys * 1.25)
        self.present = list(range(keys))
        self.absent = list(range(keys, universe))
        self.version = keys  # inserted rows get a fresh version
        self.ops = 0
        self.txns = 0
        self.errors = 0
        self.stop = threading.Event()
        self.thread: threading.Thread | None = None
        self.started = self.stopped = 0.0

    def load(self) -> None:
        with psycopg2.connect(self.dsn) as conn, conn.cursor() as cur:
            for first in range(0, len(self.present), 2000):
                chunk = self.present[first:first + 2000]
                cur.execute("INSERT INTO readings VALUES "
                            + ",".join(["(%s,%s,%s,%s)"] * len(chunk)),
                            [v for k in chunk for v in (k, 0, k / 7, note(k, 0))])
                conn.commit()
        conn.close()

    def start(self) -> None:
        self.thread = threading.Thread(target=self._run, name="workload", daemon=True)
        self.thread.start()

    def finish(self) -> None:
        self.stop.set()
        if self.thread is not None:
            self.thread.join()
            self.stopped = self.stopped or time.monotonic()

    @property
    def achieved_rate(self) -> float:
        end = self.stopped or time.monotonic()
        return self.ops / max(end - self.started, 1e-9) if self.started else 0.0

    def _statements(self) -> tuple[str, list[Any]]:
        """One transaction: distinct keys, each updated, replaced, or swapped out for an
        absent one; the live row count does not change."""
        rng = self.rng
        sql: list[str] = []
        params: list[Any] = []
        swap_slots = rng.sample(range(len(self.present)), self.ops_per_txn)
        for slot in swap_slots:
            key = self.present[slot]
            self.version += 1
            v = self.version
            dice = rng.random()
            if dice < 0.6:
                sql.append("UPDATE readings SET version = %s, value = %s, note = %s "
                           "WHERE id = %s")
                params += [v, rng.random(), note(key, v), key]
            elif dice < 0.8:
                sql.append("DELETE FROM readings WHERE id = %s")
                sql.append("INSERT INTO readings VALUES (%s, %s, %s, %s)")
                params += [key, key, v, rng.random(), note(key, v)]
            else:
                j = rng.randrange(len(self.absent))
                new = self.absent[j]
                self.absent[j] = key
                self.present[slot] = new
                sql.append("DELETE FROM readings WHERE id = %s")
                sql.append("INSERT INTO readings VALUES (%s, %s, %s, %s)")
                params += [key, new, v, rng.random(), note(new, v)]
        return "; ".join(sql), params

    def _run(self) -> None:
        conn = psycopg2.connect(self.dsn)
        started = self.started = time.monotonic()
        n = 0
        try:
            while not self.stop.is_set():
                due = started + n * self.ops_per_txn / self.rate
                delay = due - time.monotonic()
                if delay > 0:
                    time.sleep(delay)  # pacing the offered load
                statement, params = self._statements()
                try:
                    with conn, conn.cursor() as cur:
                        cur.execute(statement, params)
                except psycopg2.Error:
                    # Not expected; counted and shown. The key lists stay as they are
                    # (the transaction rolled back), a swap's slots were already moved:
                    # reconnect and carry on with a fresh reading of the table.
                    self.errors += 1
                    conn.close()
                    conn = psycopg2.connect(self.dsn)
                    self._resync(conn)
                    continue
                n += 1
                self.txns += 1
                self.ops += self.ops_per_txn
        finally:
            conn.close()

    def _resync(self, conn: Any) -> None:
        with conn, conn.cursor() as cur:
            cur.execute("SELECT id FROM readings")
            present = {r[0] for r in cur.fetchall()}
        universe = set(self.present) | set(self.absent)
        self.present = sorted(present)
        self.absent = sorted(universe - present)


# --- the held read transaction ------------------------------------------------------------------
@dataclass
class HeldReader:
    """A gated read-only transaction that materialises what its snapshot needs at the
    start, is then offloaded, and reads its listed files again at the end."""

    trans: trans_pb2_grpc.TransServiceStub
    nodes: dict[str, retina_pb2_grpc.RetinaWorkerServiceStub]
    lease_ms: int = 120_000
    trans_id: int = 0
    timestamp: int = 0
    files: list[tpb.QueryFile] = field(default_factory=list)
    visibility: dict[int, dict[int, bytes]] = field(default_factory=dict)
    buffer_rows: pa.Table | None = None
    snapshot: pa.Table | None = None
    renewals: int = 0
    renewal_errors: list[str] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)
    thread: threading.Thread | None = None

    def begin(self) -> None:
        t = self.trans.BeginTrans(tpb.BeginTransRequest(read_only=True, lease_ms=self.lease_ms),
                                  timeout=30)
        self.trans_id, self.timestamp = t.trans_id, t.timestamp
        buffered = []
        for stub in self.nodes.values():
            reply = stub.GetWriteBuffer(rpb.GetWriteBufferRequest(
                schema_name=SCHEMA, table_name=TABLE, timestamp=self.timestamp,
                trans_id=self.trans_id), timeout=60)
            buffered.append(pa.ipc.open_stream(reply.arrow_ipc_stream).read_all())
        listing = self.trans.ListQueryFiles(tpb.ListQueryFilesRequest(
            trans_id=self.trans_id, schema_name=SCHEMA, table_name=TABLE), timeout=60)
        self.files = list(listing.files)
        listed = pa.array(sorted(f.file_id for f in self.files), pa.int64())
        parts = []
        for rows in buffered:
            rows = rows.filter(pc.invert(pc.is_in(rows.column(FILE_ID), listed)))
            parts.append(rows.drop_columns([FILE_ID]))
        non_empty = [p for p in parts if p.num_rows]
        self.buffer_rows = (pa.concat_tables(non_empty, promote_options="default") if non_empty
                            else parts[0])
        for f in self.files:
            node = file_names.parse(f.name).node_id
            reply = self.nodes[node].QueryVisibility(rpb.QueryVisibilityRequest(
                file_id=f.file_id, timestamp=self.timestamp, trans_id=self.trans_id),
                timeout=60)
            self.visibility[f.file_id] = {g.rg_id: bytes(g.deleted_bitmap)
                                          for g in reply.row_groups}
        self.snapshot = self.assemble()
        # Everything the snapshot needs is in hand: stop holding back safeGcTs.
        self.trans.MarkTransOffloaded(tpb.MarkTransOffloadedRequest(trans_id=self.trans_id),
                                      timeout=30)
        self.thread = threading.Thread(target=self._renew, name="lease", daemon=True)
        self.thread.start()

    def _renew(self) -> None:
        while not self.stop.wait(self.lease_ms / 4000):
            try:
                self.trans.ExtendTransLease(tpb.ExtendTransLeaseRequest(
                    trans_id=self.trans_id, lease_ms=self.lease_ms), timeout=30)
                self.renewals += 1
            except grpc.RpcError as exc:
                self.renewal_errors.append(f"{exc.code().name}: {exc.details()}")

    def missing_files(self) -> list[str]:
        out = []
        for f in self.files:
            directory = local_dir(f.path_uri)
            if directory is not None and not (directory / f.name).exists():
                out.append(f.name)
        return out

    def assemble(self) -> pa.Table:
        """The snapshot from the listed files (read from storage now) with the
        materialised visibility, plus the materialised write-buffer rows."""
        assert self.buffer_rows is not None
        parts = []
        for f in self.files:
            parquet = pq.ParquetFile(pa.BufferReader(read_bytes(f.path_uri, f.name)))
            deleted = self.visibility[f.file_id]
            for rg in range(parquet.metadata.num_row_groups):
                rows = parquet.read_row_group(rg)
                keep = pc.less_equal(rows.column(COMMIT_TS), pa.scalar(self.timestamp,
                                                                       pa.int64()))
                bits = np.unpackbits(np.frombuffer(deleted[rg], dtype=np.uint8),
                                     bitorder="little")[: rows.num_rows].astype(bool)
                rows = rows.filter(pc.and_(keep, pa.array(~bits)))
                parts.append(rows.cast(parquet.schema_arrow.remove_metadata()))
        parts.append(self.buffer_rows)
        parts = [p for p in parts if p.num_rows] or parts[-1:]
        table = pa.concat_tables(parts, promote_options="default")
        return table.select(sorted(table.column_names)).sort_by([("id", "ascending")])

    def end(self) -> None:
        self.stop.set()
        if self.thread is not None:
            self.thread.join()
        with contextlib.suppress(grpc.RpcError):
            self.trans.CommitTrans(tpb.CommitTransRequest(trans_id=self.trans_id), timeout=30)


def diff_rows(expected: list[tuple], actual: list[tuple], limit: int = 5) -> dict:
    """Rows keyed by their first element (id): missing, extra, different."""
    e = {r[0]: r for r in expected}
    a = {r[0]: r for r in actual}
    missing = sorted(set(e) - set(a))
    extra = sorted(set(a) - set(e))
    different = sorted(k for k in set(e) & set(a) if e[k] != a[k])
    dup = len(actual) - len(a)
    return {"expected": len(expected), "actual": len(actual), "missing": len(missing),
            "extra": len(extra), "different": len(different), "duplicate_ids": dup,
            "examples": {"missing": [e[k] for k in missing[:limit]],
                         "extra": [a[k] for k in extra[:limit]],
                         "different": [(e[k], a[k]) for k in different[:limit]]}}


# --- sampling ------------------------------------------------------------------------------------
def scrape(address: str) -> dict[tuple[str, tuple], float]:
    text = requests.get(f"http://{address}/metrics", timeout=5).text
    out: dict[tuple[str, tuple], float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def metric(samples: dict[tuple[str, tuple], float], name: str, **labels: str) -> float:
    """Sum of ``name``'s samples whose labels include ``labels``."""
    want = set(labels.items())
    return sum(v for (n, lbl), v in samples.items() if n == name and want <= set(lbl))


def rss_bytes(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def tree_bytes(root: Path) -> tuple[int, int]:
    files = size = 0
    for dirpath, _dirs, names in os.walk(root):
        for name in names:
            with contextlib.suppress(OSError):
                size += os.stat(os.path.join(dirpath, name)).st_size
                files += 1
    return files, size


class IndexProbe:
    """Read-only views of one node's primary index (LMDB) and MainIndex (SQLite)."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory

    def lmdb_stats(self) -> tuple[int, int]:
        """(entries of primary_versions, bytes of pages in use over both databases). The
        environment is opened for each sample: the server grows its map as it writes."""
        env = lmdb.open(str(self.directory / "primary.lmdb"), readonly=True, max_dbs=2,
                        create=False, map_size=8 << 30)
        try:
            with env.begin() as txn:
                entries = pages = 0
                for name in (b"primary_versions", b"primary_by_ts"):
                    st = txn.stat(env.open_db(name, txn=txn, create=False))
                    pages += st["branch_pages"] + st["leaf_pages"] + st["overflow_pages"]
                    if name == b"primary_versions":
                        entries = st["entries"]
                return entries, pages * env.stat()["psize"]
        finally:
            env.close()

    def main_index_rows(self) -> int:
        conn = sqlite3.connect(f"file:{self.directory / 'main_index.sqlite'}?mode=ro",
                               uri=True, timeout=10)
        try:
            return conn.execute("SELECT count(*) FROM row_id_ranges").fetchone()[0]
        finally:
            conn.close()



@dataclass
class Sample:
    t_s: float
    values: dict[str, float]


class Sampler:
    def __init__(self, state: ClusterState, catalog: Catalog, metrics: dict[str, str],
                 stubs: dict[str, retina_pb2_grpc.RetinaWorkerServiceStub],
                 source_dsn: str, workload: Workload) -> None:
        self.state = state
        self.catalog = catalog
        self.metrics = metrics
        self.stubs = stubs
        self.workload = workload
        self.storage = Path(state.state_dir, "storage")
        self.probes = {n: IndexProbe(Path(state.state_dir, "retina-state",
                                          n.replace(":", "-"), "index"))
                       for n in state.nodes}
        self.source = psycopg2.connect(source_dsn)
        self.source.autocommit = True
        self.t0 = time.monotonic()
        self.last = (self.t0, workload.ops)

    def close(self) -> None:
        self.source.close()

    def take(self) -> Sample:
        v: dict[str, float] = {}
        for t in FileType:
            v[f"files_{t.name}"] = len(self.catalog.get_files_by_type(None, [t]))
        v["files_total"] = sum(v[f"files_{t.name}"] for t in FileType)
        data_files = data_bytes = 0
        for entry in self.storage.iterdir():
            if entry.name == "_checkpoints":
                v["checkpoint_objects"], v["checkpoint_bytes"] = tree_bytes(entry)
            elif entry.name == "_changelog":
                v["changelog_objects"], v["changelog_bytes"] = tree_bytes(entry)
            elif entry.is_dir():
                files, size = tree_bytes(entry)
                data_files += files
                data_bytes += size
            else:
                data_files += 1
                data_bytes += entry.stat().st_size
        v["data_objects"], v["data_bytes"] = data_files, data_bytes
        v.setdefault("checkpoint_bytes", 0)
        v.setdefault("changelog_bytes", 0)
        v["index_versions"] = v["index_bytes"] = v["main_index_rows"] = 0
        v["journal_entries"] = v["rewrites_committed"] = v["swept_retired"] = 0
        v["swept_total"] = v["gc_job_runs"] = v["gc_job_failed"] = v["write_buffer_rows"] = 0
        v["held_live_reader"] = v["gc_bytes_reclaimed"] = 0
        for i, node in enumerate(self.state.nodes):
            entries, used = self.probes[node].lmdb_stats()
            v["index_versions"] += entries
            v["index_bytes"] += used
            v["main_index_rows"] += self.probes[node].main_index_rows()
            status = self.stubs[node].GetGcStatus(rpb.GetGcStatusRequest(), timeout=30)
            v["journal_entries"] += len(status.entries)
            v[f"rss_node{i}"] = rss_bytes(self.state.retina_pids[node])
            m = scrape(self.metrics[node])
            v["rewrites_committed"] += metric(m, "retina_gc_rewrites_total", outcome="committed")
            v["swept_retired"] += metric(m, "retina_sweeper_files_removed_total", **{
                "pass": "retired"})
            v["swept_total"] += metric(m, "retina_sweeper_files_removed_total")
            runs = metric(m, "retina_gc_job_runs_total")
            v["gc_job_runs"] += runs
            v["gc_job_failed"] += runs - metric(m, "retina_gc_job_runs_total", exit_code="0")
            v["write_buffer_rows"] += metric(m, "retina_write_buffer_rows")
            v["held_live_reader"] += metric(m, "retina_sweeper_held_files", reason="live_reader")
            v["gc_bytes_reclaimed"] += (metric(m, "retina_gc_bytes_before_total")
                                        - metric(m, "retina_gc_bytes_after_total"))
        v["rss_nodes"] = sum(v[f"rss_node{i}"] for i in range(len(self.state.nodes)))
        v["rss_trans"] = rss_bytes(self.state.trans_pid)
        v["rss_cdc"] = rss_bytes(self.state.cdc_pid)
        with self.source.cursor() as cur:
            cur.execute("SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), confirmed_flush_lsn) "
                        "FROM pg_replication_slots WHERE slot_name = %s", (SLOT,))
            row = cur.fetchone()
        v["cdc_lag_bytes"] = float(row[0]) if row and row[0] is not None else -1
        now = time.monotonic()
        ops = self.workload.ops
        v["source_rate"] = (ops - self.last[1]) / max(now - self.last[0], 1e-9)
        self.last = (now, ops)
        return Sample(now - self.t0, v)


COLUMNS_SHOWN = [  # (key, header, scale, format)
    ("files_REGULAR", "REG", 1, "{:>5.0f}"),
    ("files_RETIRED", "RET", 1, "{:>4.0f}"),
    ("files_TEMPORARY_INGEST", "T_IN", 1, "{:>4.0f}"),
    ("files_TEMPORARY_GC", "T_GC", 1, "{:>4.0f}"),
    ("data_objects", "objs", 1, "{:>5.0f}"),
    ("data_bytes", "dataMiB", MiB, "{:>7.2f}"),
    ("checkpoint_bytes", "ckptMiB", MiB, "{:>7.2f}"),
    ("changelog_bytes", "clogMiB", MiB, "{:>7.2f}"),
    ("index_versions", "idxVer", 1, "{:>7.0f}"),
    ("index_bytes", "idxMiB", MiB, "{:>6.2f}"),
    ("main_index_rows", "MIrows", 1, "{:>6.0f}"),
    ("journal_entries", "jrnl", 1, "{:>4.0f}"),
    ("write_buffer_rows", "wbRows", 1, "{:>6.0f}"),
    ("rss_nodes", "rssMiB", MiB, "{:>6.1f}"),
    ("rewrites_committed", "rewr", 1, "{:>5.0f}"),
    ("swept_retired", "swept", 1, "{:>5.0f}"),
    ("gc_job_runs", "jobs", 1, "{:>4.0f}"),
    ("held_live_reader", "held", 1, "{:>4.0f}"),
    ("source_rate", "src/s", 1, "{:>6.0f}"),
    ("cdc_lag_bytes", "lagKiB", 1024, "{:>7.1f}"),
]

# Series judged for flatness, with the absolute allowance added to the tolerance (a
# series near zero is judged by it): (key, label, allowance in raw units, unit scale, unit).
SERIES = [
    ("files_total", "catalog files (all types)", 10, 1, ""),
    ("files_REGULAR", "REGULAR files", 10, 1, ""),
    ("files_RETIRED", "RETIRED files", 10, 1, ""),
    ("files_TEMPORARY_INGEST", "TEMPORARY_INGEST files", 10, 1, ""),
    ("files_TEMPORARY_GC", "TEMPORARY_GC files", 4, 1, ""),
    ("data_objects", "data objects on storage", 10, 1, ""),
    ("data_bytes", "data bytes on storage", 1 * MiB, MiB, "MiB"),
    ("checkpoint_bytes", "checkpoint bodies", 1 * MiB, MiB, "MiB"),
    ("changelog_bytes", "CDC changelog", 4 * MiB, MiB, "MiB"),
    ("index_versions", "primary-index versions", 2000, 1, ""),
    ("index_bytes", "primary-index LMDB in use", 1 * MiB, MiB, "MiB"),
    ("main_index_rows", "MainIndex ranges", 50, 1, ""),
    ("journal_entries", "GC journal entries", 10, 1, ""),
    ("write_buffer_rows", "write-buffer rows", 2000, 1, ""),
    ("rss_trans", "RSS TransServer", 16 * MiB, MiB, "MiB"),
    ("rss_cdc", "RSS retina-cdc", 16 * MiB, MiB, "MiB"),
]
RATES = [("rewrites_committed", "GC rewrites committed"), ("swept_retired",
         "RETIRED files swept"), ("swept_total", "files/objects swept (all passes)"),
         ("gc_job_runs", "GC job runs")]


def slope_per_min(ts: list[float], ys: list[float]) -> float:
    if len(ts) < 2:
        return 0.0
    mt, my = statistics.fmean(ts), statistics.fmean(ys)
    den = sum((t - mt) ** 2 for t in ts)
    return 60 * sum((t - mt) * (y - my) for t, y in zip(ts, ys, strict=True)) / den if den \
        else 0.0


def summarise(samples: list[Sample], warmup_s: float, tolerance: float,
              nodes: int) -> dict[str, Any]:
    kept = [s for s in samples if s.t_s >= warmup_s]
    if len(kept) < 4:
        return {"error": f"only {len(kept)} samples after the {warmup_s:.0f} s warm-up; "
                         "run longer or sample more often"}
    q = max(1, len(kept) // 4)
    first, last = kept[:q], kept[-q:]
    series = SERIES + [(f"rss_node{i}", f"RSS retina-server #{i}", 32 * MiB, MiB, "MiB")
                       for i in range(nodes)]
    out: dict[str, Any] = {"samples_after_warmup": len(kept), "quarter_samples": q,
                           "window_s": [kept[0].t_s, kept[-1].t_s], "series": {}, "rates": {},
                           "gc_job_runs_at_window_start": kept[0].values["gc_job_runs"]}
    for key, label, allowance, scale, unit in series:
        a = statistics.fmean(s.values.get(key, 0) for s in first)
        b = statistics.fmean(s.values.get(key, 0) for s in last)
        slope = slope_per_min([s.t_s for s in kept], [s.values.get(key, 0) for s in kept])
        flat = b <= a * (1 + tolerance) + allowance
        out["series"][key] = {"label": label, "first_quarter": a, "last_quarter": b,
                              "slope_per_min": slope, "flat": flat, "scale": scale,
                              "unit": unit, "allowance": allowance,
                              "max": max(s.values.get(key, 0) for s in kept)}
    for key, label in RATES:
        def rate(part: list[Sample], key: str = key) -> float:
            dt = part[-1].t_s - part[0].t_s
            return 60 * (part[-1].values[key] - part[0].values[key]) / dt if dt else 0.0
        out["rates"][key] = {"label": label, "first_quarter_per_min": rate(first),
                             "last_quarter_per_min": rate(last), "total": kept[-1].values[key]}
    return out


# --- the run -------------------------------------------------------------------------------------
def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=4.0, help="length of the measured run")
    parser.add_argument("--sample-s", type=float, default=10.0, help="seconds between samples")
    parser.add_argument("--json", action="store_true", help="also print the samples, the "
                        "summary and the checks as one JSON document at the end")
    parser.add_argument("--keys", type=int, default=20_000)
    parser.add_argument("--rate", type=float, default=500, help="offered row changes/s")
    parser.add_argument("--ops-per-txn", type=int, default=10)
    parser.add_argument("--nodes", type=int, default=1, help="Retina nodes")
    parser.add_argument("--vnodes", type=int, default=4)
    parser.add_argument("--gc-job-interval-s", type=float, default=20)
    parser.add_argument("--gc-interval-s", type=float, default=3)
    parser.add_argument("--retired-retention-s", type=float, default=8)
    parser.add_argument("--sweeper-interval-s", type=float, default=4)
    parser.add_argument("--checkpoint-interval-s", type=float, default=5)
    parser.add_argument("--lineage-retention-s", type=float, default=60)
    parser.add_argument("--master", default="local[1]", help="Spark master of the GC job")
    parser.add_argument("--job-args", default="", help="extra storage_gc arguments")
    parser.add_argument("--warmup-s", type=float, default=None,
                        help="samples before this are left out of the summary (default: "
                             "a quarter of the run, at least 60 s)")
    parser.add_argument("--flat-tolerance", type=float, default=0.25)
    parser.add_argument("--keep", action="store_true",
                        help="keep the cluster's state directory (logs, storage)")
    args = parser.parse_args()
    configure_logging("bench", "warning")
    duration_s = args.minutes * 60
    warmup_s = args.warmup_s if args.warmup_s is not None else max(60.0, duration_s / 4)

    work = Path(tempfile.mkdtemp(prefix="retina-bench-sweepers-"))
    os.chmod(work, 0o755)
    nodes = [f"127.0.0.1:{free_port()}" for _ in range(args.nodes)]
    setup_line = (f"setup: {platform.platform()}, {os.cpu_count()} cores, Python "
                  f"{platform.python_version()}, PySpark {pyspark.__version__} (GC job "
                  f"{args.master}), lmdb {lmdb.version()}; etcd, PostgreSQL (source + "
                  f"catalog), TransServer, {args.nodes} Retina node(s) / {args.vnodes} vnodes, "
                  "retina-cdc and this load generator on one machine; local storage")
    print(setup_line, flush=True)
    print(f"GC: job every {args.gc_job_interval_s:g} s per node, fold/prune every "
          f"{args.gc_interval_s:g} s, retired kept {args.retired_retention_s:g} s, sweeper "
          f"every {args.sweeper_interval_s:g} s, checkpoint every "
          f"{args.checkpoint_interval_s:g} s, lineage kept {args.lineage_retention_s:g} s; "
          f"load: {args.keys:,} keys, {args.rate:g} row changes/s offered "
          f"({args.ops_per_txn} per transaction); run {args.minutes:g} min, a sample every "
          f"{args.sample_s:g} s, warm-up {warmup_s:.0f} s", flush=True)
    state = start_cluster(work, nodes=nodes, virtual_nodes=args.vnodes, log=lambda _m: None)
    failures: list[str] = []
    report: dict[str, Any] = {"setup": setup_line, "args": vars(args)}
    workload: Workload | None = None
    held: HeldReader | None = None
    sampler: Sampler | None = None
    catalog: Catalog | None = None
    try:
        state.postgres.create_database("bench_source")
        dsn = state.postgres.dsn("bench_source")
        with psycopg2.connect(dsn) as conn, conn.cursor() as cur:
            cur.execute(DDL)
        conn.close()
        catalog = Catalog(state.postgres.dsn(), pool_max=2)
        catalog.create_schema(SCHEMA)
        catalog.create_table(SCHEMA, TABLE, COLUMNS, ["id"])
        metrics = {n: f"127.0.0.1:{free_port()}" for n in nodes}
        job_args = (f"--schema {SCHEMA} --master {args.master} --conf spark.ui.enabled=false "
                    f"--conf spark.driver.memory=512m {args.job_args}")
        node_env = {
            "RETINA__RETINA__GC_JOB_INTERVAL_MS": str(int(args.gc_job_interval_s * 1000)),
            "RETINA__RETINA__GC_JOB_ARGS": job_args,
            "RETINA__RETINA__GC_INTERVAL_MS": str(int(args.gc_interval_s * 1000)),
            "RETINA__RETINA__GC_RETIRED_RETENTION_MS": str(int(args.retired_retention_s * 1000)),
            "RETINA__RETINA__SWEEPER_INTERVAL_MS": str(int(args.sweeper_interval_s * 1000)),
            "RETINA__RETINA__CHECKPOINT_INTERVAL_MS":
                str(int(args.checkpoint_interval_s * 1000)),
            "RETINA__RETINA__GC_LINEAGE_RETENTION_MS":
                str(int(args.lineage_retention_s * 1000)),
            "PYSPARK_PYTHON": sys.executable,
        }
        # One process per node, each with its own metrics port.
        for node in nodes:
            start_retina_server(state, node, {**node_env,
                                              "RETINA__RETINA__METRICS_LISTEN": metrics[node]},
                                timeout_s=120)
        start_cdc(state, {
            "RETINA__CDC__SOURCE": "postgres", "RETINA__CDC__SOURCE_DSN": dsn,
            "RETINA__CDC__SLOT": SLOT, "RETINA__CDC__SCHEMA": SCHEMA,
            "RETINA__CDC__SOURCE_TABLES": f"public.{TABLE}",
            "RETINA__CDC__METRICS_LISTEN": f"127.0.0.1:{free_port()}"})
        wait_for(lambda: all(node_state(n) == rpb.READY for n in nodes), 120,
                 "every node READY")
        topology = load_topology(state.topology_path)
        reader = SnapshotReader(state.trans_listen, topology, timeout_s=120)
        trans = trans_pb2_grpc.TransServiceStub(grpc.insecure_channel(state.trans_listen))
        stubs = {n: retina_pb2_grpc.RetinaWorkerServiceStub(grpc.insecure_channel(n))
                 for n in nodes}

        workload = Workload(dsn, args.keys, args.rate, args.ops_per_txn, seed=11)
        t0 = time.monotonic()
        workload.load()
        wait_for(lambda: reader.read(SCHEMA, TABLE).table.num_rows == args.keys, 300,
                 f"the {args.keys:,} loaded rows to arrive through CDC", interval_s=1)
        print(f"loaded {args.keys:,} rows through CDC in {time.monotonic() - t0:.1f} s",
              flush=True)
        workload.start()
        time.sleep(min(10.0, args.sample_s))  # some deletes and unpublished rows to hold

        held = HeldReader(trans, stubs)
        t0 = time.monotonic()
        held.begin()
        assert held.snapshot is not None and held.buffer_rows is not None
        print(f"held read transaction {held.trans_id} at snapshot {held.timestamp}: "
              f"{len(held.files)} files listed, {held.snapshot.num_rows:,} rows "
              f"({held.buffer_rows.num_rows:,} from write buffers), materialised in "
              f"{time.monotonic() - t0:.1f} s; offloaded, lease renewed every "
              f"{held.lease_ms / 4000:.0f} s", flush=True)

        sampler = Sampler(state, catalog, metrics, stubs, dsn, workload)
        header = f"{'t(s)':>5}    " + "  ".join(
            f"{h:>{len(fmt.format(0))}}" for _k, h, _s, fmt in COLUMNS_SHOWN)
        print("\n" + header, flush=True)
        samples: list[Sample] = []
        deadline = time.monotonic() + duration_s
        next_at = time.monotonic()
        while True:
            sample = sampler.take()
            samples.append(sample)
            print(f"{sample.t_s:>5.0f}    " + "  ".join(
                fmt.format(sample.values.get(k, 0) / scale)
                for k, _h, scale, fmt in COLUMNS_SHOWN), flush=True)
            for node, pid in state.retina_pids.items():
                if not pid_alive(pid):
                    raise RuntimeError(f"retina-server {node} died; see {work}/logs")
            if not pid_alive(state.cdc_pid):
                raise RuntimeError(f"retina-cdc died; see {work}/logs")
            next_at += args.sample_s
            if next_at > deadline:
                break
            time.sleep(max(0.0, next_at - time.monotonic()))
        print("columns: catalog files REGULAR / RETIRED / TEMPORARY_INGEST / TEMPORARY_GC; "
              "data objects and MiB under the storage root (not _checkpoints, _changelog); "
              "checkpoint bodies MiB; CDC changelog MiB; primary-index versions and LMDB "
              "MiB in use (both databases, pages x page size); MainIndex ranges (SQLite "
              "rows); GC journal entries; write-buffer rows; RSS of the retina-server "
              "process(es); GC rewrites committed, RETIRED files swept and GC job runs so "
              "far; files the sweeper held for a live reader in its last round; achieved "
              "source row changes/s since the previous sample; CDC slot lag", flush=True)

        # --- the held reader, at the end of the run ---
        missing = held.missing_files()
        listed_now = {f.file_id: catalog.get_file(f.file_id) for f in held.files}
        by_type: dict[str, int] = {}
        for rec in listed_now.values():
            name = "gone from the catalog" if rec is None else rec.type.name
            by_type[name] = by_type.get(name, 0) + 1
        held_check: dict[str, Any] = {
            "trans_id": held.trans_id, "snapshot_ts": held.timestamp,
            "files_listed": len(held.files), "listed_files_now": by_type,
            "missing_on_storage": missing, "lease_renewals": held.renewals,
            "lease_renewal_errors": held.renewal_errors[:5]}
        if missing:
            failures.append(f"held reader: {len(missing)} of its {len(held.files)} listed "
                            f"files are gone from storage (e.g. {missing[:3]})")
            held_check["equal"] = False
        else:
            again = held.assemble()
            equal = again.equals(held.snapshot)
            held_check["equal"] = equal
            held_check["rows"] = again.num_rows
            if not equal:
                d = diff_rows([tuple(r.values()) for r in held.snapshot.to_pylist()],
                              [tuple(r.values()) for r in again.to_pylist()])
                held_check["diff"] = d
                failures.append(f"held reader: its snapshot read again differs: {d}")
        print(f"\nheld read transaction {held.trans_id} (snapshot {held.timestamp}) after "
              f"{(time.monotonic() - sampler.t0) / 60:.1f} min: {len(held.files)} listed "
              f"files, now {by_type}; {len(missing)} missing on storage; lease renewed "
              f"{held.renewals} times ({len(held.renewal_errors)} errors); read again: "
              + ("EQUAL to its snapshot at the start, row for row "
                 f"({held_check['rows']:,} rows, _commit_ts included)"
                 if held_check.get("equal") else "*** MISMATCH ***"), flush=True)
        held.end()
        report["held_reader"] = held_check
        # The held files are free now: one sweeper round takes them.
        after: dict[str, int] = {"removed": 0, "bytes": 0}
        if held.files:
            time.sleep(1)
            for stub in stubs.values():
                reply = stub.RunSweeper(rpb.RunSweeperRequest(passes=["retired"]), timeout=120)
                after["removed"] += reply.removed
                after["bytes"] += reply.bytes_removed
            print(f"held transaction ended; a sweeper round then removed {after['removed']} "
                  f"RETIRED files ({after['bytes'] / MiB:.2f} MiB)", flush=True)
        report["sweep_after_release"] = after

        # --- a fresh gated snapshot against the source, once CDC caught up ---
        workload.finish()
        t0 = time.monotonic()
        with psycopg2.connect(dsn) as conn, conn.cursor() as cur:
            cur.execute("SELECT id, version, value, note FROM readings ORDER BY id")
            source_rows = [tuple(r) for r in cur.fetchall()]
        conn.close()
        fresh: list[tuple] = []

        def caught_up() -> bool:
            nonlocal fresh
            table = reader.read(SCHEMA, TABLE).table.sort_by([("id", "ascending")])
            fresh = list(zip(*(table.column(c).to_pylist()
                               for c in ("id", "version", "value", "note")), strict=True))
            return fresh == source_rows

        try:
            wait_for(caught_up, 180, "a gated snapshot equal to the source table",
                     interval_s=1)
            fresh_check: dict[str, Any] = {"equal": True, "rows": len(source_rows),
                                           "caught_up_s": time.monotonic() - t0}
            print(f"fresh gated snapshot after the load stopped: EQUAL to the source table "
                  f"({len(source_rows):,} rows; caught up {fresh_check['caught_up_s']:.1f} s "
                  "after the last source commit)", flush=True)
        except Exception:
            d = diff_rows(source_rows, fresh)
            fresh_check = {"equal": False, "diff": d}
            failures.append(f"fresh snapshot differs from the source table: {d}")
            print(f"fresh gated snapshot: *** MISMATCH *** with the source table: {d}",
                  flush=True)
        report["fresh_snapshot"] = fresh_check
        report["workload"] = {"txns": workload.txns, "row_changes": workload.ops,
                              "errors": workload.errors,
                              "achieved_rate": workload.achieved_rate}
        reader.close()

        summary = summarise(samples, warmup_s, args.flat_tolerance, len(nodes))
        report["summary"] = summary
        report["samples"] = [{"t_s": s.t_s, **s.values} for s in samples]
        print_summary(summary, args.flat_tolerance, workload, samples)
    except Exception as exc:
        failures.append(f"{type(exc).__name__}: {exc}")
        raise
    finally:
        if workload is not None:
            workload.finish()
        if held is not None:
            held.stop.set()
        if sampler is not None:
            sampler.close()
        if catalog is not None:
            catalog.close()
        stop_cluster(state, log=lambda _m: None)
        if failures or args.keep or os.environ.get("RETINA_BENCH_KEEP"):
            print(f"kept {work} (logs, storage, state)")
        else:
            shutil.rmtree(work, ignore_errors=True)
        if args.json and "summary" in report:
            print(json.dumps(report, default=str))
    if failures:
        print("\n*** FAILED ***")
        for f in failures:
            print(f"  {f}")
        return 1
    return 0


def verdict(s: dict[str, Any]) -> str:
    if not s["flat"]:
        return "GROWING"
    if s["slope_per_min"] > 0 and s["last_quarter"] > 1.05 * s["first_quarter"] + 1e-9:
        return "flat (within tolerance, but rising)"
    return "flat"


def print_summary(summary: dict[str, Any], tolerance: float, workload: Workload,
                  samples: list[Sample]) -> None:
    if "error" in summary:
        print(f"\nsummary: {summary['error']}")
        return
    w0, w1 = summary["window_s"]
    q = summary["quarter_samples"]
    print(f"\nsummary over {w0:.0f}-{w1:.0f} s ({summary['samples_after_warmup']} samples after "
          f"the warm-up; first vs last {q} samples); flat = last-quarter mean <= first-quarter "
          f"mean x {1 + tolerance:g} + allowance")
    print(f"  {'series':<28} {'first q':>10} {'last q':>10} {'slope/min':>10} {'max':>10}  "
          f"{'allowance':>9}  verdict")
    for s in summary["series"].values():
        scale, unit = s["scale"], s["unit"]
        print(f"  {s['label'] + (f' ({unit})' if unit else ''):<28} "
              f"{s['first_quarter'] / scale:>10.2f} {s['last_quarter'] / scale:>10.2f} "
              f"{s['slope_per_min'] / scale:>+10.2f} {s['max'] / scale:>10.2f}  "
              f"{s['allowance'] / scale:>9g}  {verdict(s)}")
    for r in summary["rates"].values():
        print(f"  {r['label']:<34} {r['first_quarter_per_min']:>8.1f}/min first quarter, "
              f"{r['last_quarter_per_min']:>8.1f}/min last quarter, {r['total']:.0f} in all")
    runs = summary["rates"]["gc_job_runs"]
    in_window = runs["total"] - summary["gc_job_runs_at_window_start"]
    if in_window < 4:
        print(f"  note: only {in_window:.0f} GC job run(s) in the window: file counts rise "
              "between runs and drop at each (a sawtooth), so quarter means of a window this "
              "short mostly show where the sawtooth was; run longer for a verdict")
    growing = [s["label"] for s in summary["series"].values() if not s["flat"]]
    print(f"  source: {workload.ops:,} row changes in {workload.txns:,} transactions "
          f"({workload.errors} errors); achieved {workload.achieved_rate:,.0f} row changes/s "
          "on average")
    rising = [s["label"] for s in summary["series"].values() if verdict(s).startswith("flat (")]
    print("  verdict: " + ("every series stayed flat" if not growing
                           else f"GROWING: {', '.join(growing)}")
          + (f"; rising within the tolerance: {', '.join(rising)}" if rising else ""))


if __name__ == "__main__":
    sys.exit(main())
