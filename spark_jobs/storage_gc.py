"""Storage GC, the heavy part: rewrite files of a table without the rows deleted at or
below ``safeGcTs``, and merge runs of small files, with Spark; the owning Retina node
commits each rewrite (ARCHITECTURE.md, "Storage GC and sweepers: who does what").

The job never makes a file REGULAR and never touches an index or visibility. Per run:

1. begin a read-only transaction at the TransServer: the query gate grants it only while
   every Retina node is READY (refused: exit 4, nothing done). Its lease is kept alive
   while the job runs, and it is ended at the end. Inside its lifetime: GetSafeGcTimestamp,
   then ListQueryFiles(trans_id, schema, table): the only way candidates are enumerated
   (never an admin enumeration of the catalog);
2. plan, on the driver: every listed file belongs to one stream, ``(table, vnode)`` of
   the node that created it (both from its name). QueryVisibility at safeGcTs gives each
   file's row count, deleted rows and place in the stream (the node's firstBlockId: a GC
   output takes the place of the files it replaced, which its name does not show); its
   size comes from storage. A group is a run of files of ONE stream, CONSECUTIVE in that
   order (the node refuses anything else): a file whose deleted fraction is at least
   ``--deleted-threshold`` alone, or a run of at least two small files
   (``< --small-file-bytes``) merged up to ``--target-file-bytes``. A file whose
   visibility the node cannot answer at safeGcTs (FAILED_PRECONDITION snapshot_expired:
   its visibility base is above it), or that was replaced since the listing, is skipped
   for this run and reported, and its stream is left alone (its place is unknown);
3. per group, the owning node's PrepareGcRewrite names the rewrite, the new file, where it
   goes, the cutoff (the visibility the task reads is at exactly that cutoff) and the rows
   the node expects to survive;
4. one Spark task per prepared group (:func:`rewrite_group`): each old file in the given
   order, its QueryVisibility at the cutoff, the Parquet rows minus the deleted ones
   (an Arrow filter on a NumPy mask), concatenated in order and written as ONE new Parquet
   file with the same schema (``_commit_ts`` carried unchanged). The catalog row
   (TEMPORARY_GC) is registered BEFORE the bytes are written, so that bytes on storage
   always have a catalog row the TTL sweeper can find; the bytes go through
   ``write_durably`` (temp + fsync + rename + directory fsync);
5. the driver sends CommitGcRewrite(rewrite_id, new_file_id) to the owning node as each
   task finishes, or AbortGcRewrite (best effort) when the task failed or the node refused.

A killed driver leaves at most prepared rewrites (the node forgets them when they expire)
and TEMPORARY_GC files (the sweeper removes them); a second run plans from what is REGULAR
then. Exit codes (spark_jobs.common): 0 every group committed, or nothing to do; 1 a group
failed otherwise; 2 bad arguments or configuration, a schema or table the catalog does not
know; 3 a group was refused; 4 unavailable (gate closed, a node or the catalog away).
Per-group failures never stop the other groups.

    python -m spark_jobs.storage_gc --config retina.toml --schema shop --table orders
    spark-submit spark_jobs/storage_gc.py --config retina.toml --schema shop --all-tables --json
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field, replace
from typing import TYPE_CHECKING, Any, TypeVar

import grpc
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from retina_common import failpoints as fp
from retina_common import file_names, progress
from retina_common.catalog import (
    AlreadyExistsError,
    Catalog,
    CatalogError,
    CatalogOutcomeUnknown,
    CatalogUnavailable,
    FileRecord,
    FileType,
    FileTypeMismatch,
)
from retina_common.client import channel
from retina_common.codec import COMMIT_TS, PARQUET_COMPRESSION
from retina_common.config import Config, ConfigError
from retina_common.log import configure_logging
from retina_common.pb import retina_pb2 as rpb
from retina_common.pb import retina_pb2_grpc, trans_pb2_grpc
from retina_common.pb import trans_pb2 as tpb
from retina_common.refusal import HELD_BY_BUFFER_READ, ROLLED_BACK_FOR_BUFFER_READ
from retina_common.schema_evolution import conform, table_schema
from retina_common.storage import object_size, open_parquet, write_durably
from retina_common.topology import Topology
from spark_jobs.common import (
    EXIT_FAILED,
    EXIT_OK,
    EXIT_REFUSED,
    EXIT_UNAVAILABLE,
    EXIT_USAGE,
    REFUSED_MARK,
    RETRYABLE,
    UNAVAILABLE_MARK,
    TaskError,
    add_spark_arguments,
    call_with_retry,
    fail,
    load,
    parse_conf,
    short_reason,
    spark_session,
)

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

PROG = "storage_gc"
RPC_TIMEOUT_S = 60.0
MiB = 1 << 20
DEFAULT_DELETED_THRESHOLD = 0.2
DEFAULT_SMALL_FILE_BYTES = 8 * MiB
DEFAULT_TARGET_FILE_BYTES = 128 * MiB
DEFAULT_ROW_GROUP_ROWS = 65_536
DEFAULT_LEASE_MS = 60_000
DEFAULT_GROUPS_PER_WAVE = 32
STATS_THREADS = 8
VISIBILITY_THREADS = 8
META_PREFIX = "retina."  # the publisher's prefix for our own footer keys

# Outcomes of a group, as printed and in --json.
PLANNED, COMMITTED, REFUSED, FAILED = "PLANNED", "COMMITTED", "REFUSED", "FAILED"
# The node said "not now" (ABORTED: its files are in another rewrite that no checkpoint
# pair holds yet, or the cutoff is below a fold under way, or a read holds an old file
# through its write-buffer fetch): left for the next run.
BUSY = "BUSY"
# How long a commit held for a write-buffer reader is asked again before the group is BUSY.
HELD_RETRY_S = 10.0
# Codes after which a node has said no for a reason of its own: reported, not fatal.
_NOT_OURS = (grpc.StatusCode.UNIMPLEMENTED, grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN)

T = TypeVar("T")


# --- what the plan is made of: plain, picklable data ------------------------------------------
@dataclass(frozen=True)
class FileRef:
    file_id: int
    name: str
    path_uri: str


@dataclass(frozen=True)
class FileStats:
    """One listed file with what the plan needs: its stream, order, size and deletions."""

    ref: FileRef
    node: str
    vnode: int
    # Its place in the stream: the node's firstBlockId (QueryVisibility). Not the name's
    # sequence number: a GC output takes the place of the files it replaced.
    position: int
    size_bytes: int
    rows: int  # every row of the file (QueryVisibility's row counts)
    deleted: int  # rows deleted at safeGcTs

    @property
    def deleted_fraction(self) -> float:
        return self.deleted / self.rows if self.rows else 0.0


@dataclass(frozen=True)
class Skipped:
    """A listed file the plan leaves alone this run, and why."""

    table: str
    file_id: int
    name: str
    reason: str


@dataclass(frozen=True)
class Thresholds:
    deleted_threshold: float = DEFAULT_DELETED_THRESHOLD
    small_file_bytes: int = DEFAULT_SMALL_FILE_BYTES
    target_file_bytes: int = DEFAULT_TARGET_FILE_BYTES


@dataclass(frozen=True)
class Group:
    """Files of one stream, consecutive in its order, rewritten into one new file."""

    schema: str
    table: str
    node: str
    vnode: int
    files: tuple[FileStats, ...]
    kind: str  # "deleted" (one file over the threshold) or "small" (a merged run)

    @property
    def bytes_before(self) -> int:
        return sum(f.size_bytes for f in self.files)

    @property
    def rows(self) -> int:
        return sum(f.rows for f in self.files)

    @property
    def deleted(self) -> int:
        return sum(f.deleted for f in self.files)


# --- planning: pure -------------------------------------------------------------------------
def _estimated_bytes(f: FileStats) -> float:
    """What a file contributes to a merged file: its share of surviving rows."""
    return f.size_bytes * (1.0 - f.deleted_fraction)


def plan_stream(schema: str, table: str, files: Sequence[FileStats],
                thresholds: Thresholds) -> list[Group]:
    """The groups of ONE stream. ``files`` are every listed, usable file of the stream;
    a file that is neither small nor over the threshold separates runs, so every group
    is consecutive in the stream's order."""
    ordered = sorted(files, key=lambda f: f.position)
    if len({(f.node, f.vnode) for f in ordered}) > 1:
        raise ValueError("plan_stream expects the files of one stream")
    groups: list[Group] = []
    run: list[FileStats] = []

    def dirty(f: FileStats) -> bool:
        # A file with nothing deleted is never rewritten for its deletions, even at a
        # threshold of 0: the rewrite would reclaim nothing.
        return f.deleted > 0 and f.deleted_fraction >= thresholds.deleted_threshold

    def close_run() -> None:
        if len(run) >= 2:
            groups.append(Group(schema, table, run[0].node, run[0].vnode, tuple(run), "small"))
        elif len(run) == 1 and dirty(run[0]):
            groups.append(Group(schema, table, run[0].node, run[0].vnode, tuple(run), "deleted"))
        run.clear()

    previous: int | None = None
    for f in ordered:
        if previous is not None and f.position == previous:
            raise ValueError(f"two files of stream ({f.node}, {f.vnode}) share position "
                             f"{f.position}")
        previous = f.position
        if f.size_bytes < thresholds.small_file_bytes:
            if run and sum(map(_estimated_bytes, run)) + _estimated_bytes(f) \
                    > thresholds.target_file_bytes:
                close_run()
            run.append(f)
            continue
        close_run()
        if dirty(f):
            groups.append(Group(schema, table, f.node, f.vnode, (f,), "deleted"))
    close_run()
    return groups


def plan_table(schema: str, table: str, files: Sequence[FileStats], listed: Sequence[FileRef],
               thresholds: Thresholds) -> list[Group]:
    """Every group of one table. ``listed`` is the whole ListQueryFiles answer. A stream
    with a listed file that has no stats (skipped) is left alone this run: the skipped
    file's place in the stream is unknown, so no run around it is sure to be
    consecutive (the node would refuse it)."""
    usable = {f.ref.file_id for f in files}
    blocked: set[tuple[str, int]] = set()
    for ref in listed:
        if ref.file_id in usable:
            continue
        try:
            parsed = file_names.parse(ref.name)
        except ValueError:
            continue  # no stream: it cannot sit between files of one
        blocked.add((parsed.node_id, parsed.vnode))
    streams: dict[tuple[str, int], list[FileStats]] = {}
    for f in files:
        streams.setdefault((f.node, f.vnode), []).append(f)
    groups: list[Group] = []
    for key in sorted(streams):
        if key not in blocked:
            groups.extend(plan_stream(schema, table, streams[key], thresholds))
    return groups


# --- the Arrow part: pure -------------------------------------------------------------------
def deleted_mask(bitmap: bytes, rows: int) -> np.ndarray:
    """RowGroupVisibility.deleted_bitmap (bit i, little-endian in each byte, set = row i
    deleted) as a boolean array of ``rows`` entries; missing trailing bytes are zeros."""
    bits = np.unpackbits(np.frombuffer(bitmap, dtype=np.uint8), bitorder="little")
    if bits.size < rows:
        bits = np.concatenate([bits, np.zeros(rows - bits.size, dtype=np.uint8)])
    return bits[:rows].astype(bool)


def deleted_count(visibility: rpb.QueryVisibilityResponse) -> tuple[int, int]:
    """(rows, deleted rows) of a file from its QueryVisibility answer."""
    rows = deleted = 0
    for g in visibility.row_groups:
        rows += g.row_count
        deleted += int(deleted_mask(g.deleted_bitmap, g.row_count).sum())
    return rows, deleted


class RewriteError(Exception):
    """A file does not match what its owner's visibility describes: the group fails."""


def surviving_rows(parquet: pq.ParquetFile, visibility: rpb.QueryVisibilityResponse,
                   what: str) -> tuple[pa.Table, int]:
    """The rows of one file its visibility does not report deleted, in file order
    (row group by row group, row by row), and how many were dropped."""
    by_rg = {g.rg_id: g for g in visibility.row_groups}
    count = parquet.metadata.num_row_groups
    if sorted(by_rg) != list(range(count)):
        raise RewriteError(f"{what}: {count} row groups, visibility for {sorted(by_rg)}")
    schema = parquet.schema_arrow
    parts, dropped = [], 0
    for rg in range(count):
        rows = parquet.read_row_group(rg)
        vis = by_rg[rg]
        if vis.row_count != rows.num_rows:
            raise RewriteError(f"{what}: row group {rg} has {rows.num_rows} rows, its "
                               f"visibility {vis.row_count}")
        deleted = deleted_mask(vis.deleted_bitmap, rows.num_rows)
        dropped += int(deleted.sum())
        parts.append(rows.filter(pa.array(~deleted)))
    table = pa.concat_tables(parts) if parts else schema.empty_table()
    return table, dropped


def new_file_schema(schema: pa.Schema, metadata: dict[str, str]) -> pa.Schema:
    """The old files' columns, ``_commit_ts`` included, with this rewrite's own footer keys
    (an old file's keys, such as its first block id, would be wrong for the new one)."""
    if COMMIT_TS not in schema.names:
        raise RewriteError(f"the files have no {COMMIT_TS} column")
    return schema.remove_metadata().with_metadata(
        {f"{META_PREFIX}{k}": v for k, v in metadata.items()})


def encode_parquet(rows: pa.Table, schema: pa.Schema, row_group_rows: int) -> bytes:
    """One Parquet file of ``rows``. No rows at all (every row deleted) make a file with
    no row group: the node refuses an empty row group."""
    sink = pa.BufferOutputStream()
    # The ingest publisher's codec: a rewrite never stores the same rows in more bytes.
    with pq.ParquetWriter(sink, schema, compression=PARQUET_COMPRESSION) as writer:
        if rows.num_rows:
            writer.write_table(rows.cast(schema), row_group_size=row_group_rows)
    return sink.getvalue().to_pybytes()


# --- the task -------------------------------------------------------------------------------
@dataclass(frozen=True)
class TaskSpec:
    """What every rewrite task shares."""

    catalog_dsn: str
    catalog_connect_timeout_s: int
    trans_id: int  # the job's live read transaction
    row_group_rows: int
    rpc_timeout_s: float = RPC_TIMEOUT_S


@dataclass(frozen=True)
class RewriteTask:
    """One prepared group: the node's answer to PrepareGcRewrite and the old files."""

    index: int  # position in the plan (report order)
    rewrite_id: str
    node: str
    table: str
    vnode: int
    files: tuple[FileRef, ...]
    bytes_before: int
    file_name: str
    path_id: int
    path_uri: str
    cutoff_ts: int
    expected_rows: int
    # The prepare's schema version: the new file's columns (0: the table's current ones).
    schema_version: int = 0


@dataclass(frozen=True)
class RewriteResult:
    rewrite_id: str
    new_file_id: int = 0
    rows_kept: int = 0
    rows_dropped: int = 0
    bytes_before: int = 0
    bytes_after: int = 0
    seconds: float = 0.0  # the task's own time (reads, filter, encode, catalog, write)
    error: str = ""  # empty: the new file is registered and written


def register_temporary_gc(catalog: Catalog, name: str, num_row_group: int,
                          path_id: int) -> FileRecord:
    """The new file's TEMPORARY_GC row, created or, for a retried task, reused.

    A row of that name may exist already: an earlier attempt of this task, or an
    add_file whose COMMIT outcome was lost. Reused only if it is still TEMPORARY_GC:
    anything else (a committed rewrite made it REGULAR) must not be overwritten."""
    for attempt in range(3):
        try:
            return catalog.add_file(name, FileType.TEMPORARY_GC, num_row_group, path_id)
        except (AlreadyExistsError, CatalogOutcomeUnknown):
            pass
        except CatalogUnavailable:
            if attempt == 2:
                raise
            time.sleep(0.5 * (attempt + 1))  # backoff between attempts
            continue
        existing = next((f for f in catalog.get_files_by_type(path_id, list(FileType))
                         if f.name == name), None)
        if existing is None:
            continue  # the lost COMMIT did not happen after all: insert again
        if existing.type != FileType.TEMPORARY_GC:
            raise RewriteError(f"catalog row {existing.file_id} for {name} is "
                               f"{existing.type.name}, not TEMPORARY_GC; not touching it")
        if existing.num_row_group == num_row_group:
            return existing
        try:
            return catalog.update_file(existing.file_id, num_row_group=num_row_group,
                                       expected_type=FileType.TEMPORARY_GC)
        except FileTypeMismatch as exc:
            raise RewriteError(f"catalog row {existing.file_id} for {name}: {exc}") from None
    raise RewriteError(f"could not register {name} in the catalog")


def _rpc_mark(exc: grpc.RpcError) -> str:
    return UNAVAILABLE_MARK if exc.code() in RETRYABLE else REFUSED_MARK


def rewrite_group(spec: TaskSpec, task: RewriteTask) -> RewriteResult:
    """Write one group's new file and register it TEMPORARY_GC; runs inside a Spark task.

    Never raises for a failure of the group itself: the result carries the reason (with
    a [retina:...] marker), so one bad group does not fail the Spark job of the others.
    """
    started = time.monotonic()
    try:
        return replace(_rewrite(spec, task), seconds=time.monotonic() - started)
    except TaskError as exc:
        return RewriteResult(task.rewrite_id, error=str(exc))
    except grpc.RpcError as exc:
        return RewriteResult(task.rewrite_id, error=f"{_rpc_mark(exc)} {exc.code().name}: "
                                                    f"{exc.details()}")
    except CatalogUnavailable as exc:
        return RewriteResult(task.rewrite_id, error=f"{UNAVAILABLE_MARK} catalog: {exc}")
    except (RewriteError, CatalogError, OSError, pa.ArrowException) as exc:
        return RewriteResult(task.rewrite_id, error=f"{type(exc).__name__}: {exc}")


def current_columns(spec: TaskSpec, table: str, version: int = 0) -> pa.Schema:
    """The table's data-file schema at the prepare's schema version ``version`` (0: the
    current one): a rewrite writes those columns, the node's commit holds the file to
    exactly them (a column added after the prepare is left out, it reads as NULL like in
    any older file), and files written before a column was added read it as NULL."""
    schema_name, _dot, table_name = table.partition(".")
    catalog = Catalog(spec.catalog_dsn, pool_max=1,
                      connect_timeout_s=spec.catalog_connect_timeout_s)
    try:
        record = catalog.get_table(schema_name, table_name)
    finally:
        catalog.close()
    if version > record.schema_version:
        raise RewriteError(f"table {table} is at schema version {record.schema_version} in "
                           f"the catalog, below the prepare's {version}")
    return table_schema(record, version)


def _rewrite(spec: TaskSpec, task: RewriteTask) -> RewriteResult:
    parts: list[pa.Table] = []
    schema = current_columns(spec, task.table, task.schema_version)
    dropped = 0
    with channel(task.node) as ch:
        stub = retina_pb2_grpc.RetinaWorkerServiceStub(ch)

        def visibility_of(ref: FileRef) -> rpb.QueryVisibilityResponse:
            request = rpb.QueryVisibilityRequest(file_id=ref.file_id, timestamp=task.cutoff_ts,
                                                 trans_id=spec.trans_id)
            return call_with_retry(
                lambda: stub.QueryVisibility(request, timeout=spec.rpc_timeout_s),
                f"QueryVisibility of file {ref.file_id} at {task.cutoff_ts} on {task.node}")

        # A group of many small files waits mostly on these round trips: overlap them.
        with ThreadPoolExecutor(VISIBILITY_THREADS) as pool:
            answers = list(pool.map(visibility_of, task.files))
        for ref, visibility in zip(task.files, answers, strict=True):
            # The given order is the new file's row order.
            parquet = open_parquet(ref.path_uri, ref.name)
            unknown = sorted(set(parquet.schema_arrow.names) - set(schema.names))
            if unknown:
                raise RewriteError(f"{ref.name} has columns {unknown} that table {task.table} "
                                   "does not have")
            rows, gone = surviving_rows(parquet, visibility, ref.name)
            parts.append(conform(rows, schema))
            dropped += gone
    kept = pa.concat_tables(parts)
    if kept.num_rows != task.expected_rows:
        raise RewriteError(f"{kept.num_rows} rows survive the cutoff {task.cutoff_ts}, the "
                           f"node expects {task.expected_rows}")
    stamps = kept.column(COMMIT_TS)
    metadata = {"node": task.node, "vnode": str(task.vnode), "gc_rewrite_id": task.rewrite_id,
                "gc_cutoff_ts": str(task.cutoff_ts),
                "gc_old_file_ids": ",".join(str(f.file_id) for f in task.files)}
    if kept.num_rows:
        metadata["min_commit_ts"] = str(pc.min(stamps).as_py())
        metadata["max_commit_ts"] = str(pc.max(stamps).as_py())
    data = encode_parquet(kept, new_file_schema(schema, metadata), spec.row_group_rows)
    num_row_group = pq.ParquetFile(pa.BufferReader(data)).metadata.num_row_groups
    catalog = Catalog(spec.catalog_dsn, pool_max=1,
                      connect_timeout_s=spec.catalog_connect_timeout_s)
    try:
        # The row first: bytes on storage always have a catalog row, which the TTL sweeper
        # finds if this rewrite is never committed.
        record = register_temporary_gc(catalog, task.file_name, num_row_group, task.path_id)
    finally:
        catalog.close()
    fp.GC_REWRITE_WRITE_BEFORE.hit()
    write_durably(task.path_uri, task.file_name, data)
    fp.GC_REWRITE_WRITE_AFTER.hit()
    return RewriteResult(task.rewrite_id, record.file_id, kept.num_rows, dropped,
                         task.bytes_before, len(data))


def run_rewrites(spark: SparkSession, spec: TaskSpec, tasks: Sequence[RewriteTask],
                 on_done: Callable[[RewriteTask, RewriteResult], None]) -> None:
    """One Spark task per group; ``on_done`` runs on the driver as each one finishes (the
    commit goes out while the other tasks still run). A group whose task never reported
    (the Spark job itself failed) gets a result with the Spark failure as its error."""
    from spark_jobs.accumulators import KeyedResults  # needs pyspark: the driver only

    sc = spark.sparkContext
    progress = sc.accumulator({}, KeyedResults())
    by_id = {t.rewrite_id: t for t in tasks}

    def run_partition(items: Iterable[RewriteTask]) -> Iterator[RewriteResult]:
        for task in items:
            result = rewrite_group(spec, task)
            progress.add({result.rewrite_id: result})
            yield result

    rdd = sc.parallelize(list(tasks), max(1, len(tasks)))
    failure: list[BaseException] = []

    def job() -> None:
        try:
            rdd.mapPartitions(run_partition).collect()
        except BaseException as exc:
            failure.append(exc)

    runner = threading.Thread(target=job, name="spark-gc-job", daemon=True)
    runner.start()
    seen: set[str] = set()
    try:
        while True:
            finished = not runner.is_alive()  # read before the value: nothing is missed
            for rewrite_id, result in dict(progress.value).items():
                if rewrite_id not in seen:
                    seen.add(rewrite_id)
                    on_done(by_id[rewrite_id], result)
            if finished:
                break
            runner.join(0.2)
    except KeyboardInterrupt:
        sc.cancelAllJobs()
        raise
    for task in tasks:
        if task.rewrite_id not in seen:
            reason = short_reason(failure[0]) if failure else "the Spark task never reported"
            on_done(task, RewriteResult(task.rewrite_id, error=f"Spark: {reason}"))


# --- the driver -----------------------------------------------------------------------------
@dataclass
class GroupReport:
    table: str
    vnode: int
    node: str
    kind: str
    old_files: list[dict[str, Any]]
    rows_before: int
    deleted_at_safe_gc_ts: int
    bytes_before: int
    outcome: str = PLANNED
    status: str = ""  # the gRPC status of a refusal or failure
    reason: str = ""
    rewrite_id: str = ""
    cutoff_ts: int = 0
    new_file: dict[str, Any] | None = None
    rows_kept: int = 0
    rows_dropped: int = 0
    bytes_after: int = 0
    task_seconds: float = 0.0
    prepare_seconds: float = 0.0  # the node's PrepareGcRewrite, as the driver saw it
    commit_seconds: float = 0.0  # the node's CommitGcRewrite, as the driver saw it
    chain_items: int = 0
    journal_state: str = ""
    exit_code: int = EXIT_OK  # what this group alone would make the job exit with


def _report_of(group: Group) -> GroupReport:
    return GroupReport(
        table=f"{group.schema}.{group.table}", vnode=group.vnode, node=group.node,
        kind=group.kind,
        old_files=[{"file_id": f.ref.file_id, "name": f.ref.name, "rows": f.rows,
                    "deleted": f.deleted, "bytes": f.size_bytes} for f in group.files],
        rows_before=group.rows, deleted_at_safe_gc_ts=group.deleted,
        bytes_before=group.bytes_before)


def _code_exit(code: grpc.StatusCode) -> int:
    if code in RETRYABLE:
        return EXIT_UNAVAILABLE
    if code in _NOT_OURS:
        return EXIT_FAILED
    return EXIT_REFUSED


def _held_by_reader(exc: grpc.RpcError) -> bool:
    """The commit waits for a reader; the rewrite stays prepared (ask again)."""
    return exc.code() == grpc.StatusCode.ABORTED and HELD_BY_BUFFER_READ in (exc.details() or "")


def _rolled_back_for_reader(exc: grpc.RpcError) -> bool:
    """The commit met a reader too late and rolled back: the group is for the next run."""
    return (exc.code() == grpc.StatusCode.ABORTED
            and ROLLED_BACK_FOR_BUFFER_READ in (exc.details() or ""))


def _rpc(call: Callable[[], T], retry_on: tuple[grpc.StatusCode, ...] = RETRYABLE,
         attempts: int = 5) -> T:
    """``call()``, sent again with backoff on ``retry_on``; the last error propagates."""
    delay = 0.2
    for attempt in range(1, attempts + 1):
        try:
            return call()
        except grpc.RpcError as exc:
            if exc.code() not in retry_on or attempt == attempts:
                raise
        time.sleep(delay)  # backoff between attempts, not synchronisation
        delay = min(delay * 2, 5.0)
    raise AssertionError("unreachable")


class LeaseKeeper:
    """Extends the job's read transaction while the job runs: a long job must not lose
    it, and a killed job's transaction must not pin safeGcTs for long (a short lease,
    renewed every third of it)."""

    def __init__(self, trans: trans_pb2_grpc.TransServiceStub, trans_id: int,
                 lease_ms: int) -> None:
        self._trans = trans
        self._trans_id = trans_id
        self._lease_ms = lease_ms
        self._stop = threading.Event()
        self.lost = ""  # why the transaction is gone, if it is
        self._thread = threading.Thread(target=self._run, name="gc-lease", daemon=True)

    def start(self) -> LeaseKeeper:
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self._lease_ms / 3000):
            try:
                _rpc(lambda: self._trans.ExtendTransLease(tpb.ExtendTransLeaseRequest(
                    trans_id=self._trans_id, lease_ms=self._lease_ms), timeout=10), attempts=3)
            except grpc.RpcError as exc:
                if exc.code() not in RETRYABLE:
                    self.lost = f"{exc.code().name}: {exc.details()}"
                    return

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=15)


@dataclass
class JobState:
    """Everything the driver learns on its way; becomes the report."""

    safe_gc_ts: int = 0
    snapshot_ts: int = 0
    tables: list[str] = field(default_factory=list)
    files_listed: int = 0
    skipped: list[Skipped] = field(default_factory=list)
    groups: list[GroupReport] = field(default_factory=list)
    spark_start_s: float = 0.0
    task_seconds: float = 0.0
    stopped: str = ""  # why the job stopped early, if it did

    def exit_code(self) -> int:
        codes = {g.exit_code for g in self.groups}
        if self.stopped and not codes - {EXIT_OK}:
            codes.add(EXIT_UNAVAILABLE)
        for code in (EXIT_FAILED, EXIT_UNAVAILABLE, EXIT_REFUSED):
            if code in codes:
                return code
        return EXIT_OK


class UnknownSchema(Exception):
    """--schema names no schema of the catalog: a usage error (exit 2)."""

    def __init__(self, schema: str, known: Sequence[str]) -> None:
        super().__init__(f"schema {schema!r} is not in the catalog (its schemas: "
                         f"{', '.join(known) or 'none'}); nothing done")


class StorageGcJob:
    def __init__(self, args: argparse.Namespace, config: Config, topology: Topology,
                 log: Any) -> None:
        self.args = args
        self.config = config
        self.topology = topology
        self.log = log
        self.thresholds = Thresholds(args.deleted_threshold, args.small_file_bytes,
                                     args.target_file_bytes)
        self.state = JobState()
        # The driver's bar over the groups while rewrites run (stderr, terminals only).
        self._bar: Any = None
        self._trans_channel = channel(config.trans.listen)
        self.trans = trans_pb2_grpc.TransServiceStub(self._trans_channel)
        self._node_channels = {n: channel(n) for n in topology.nodes}
        self.nodes = {n: retina_pb2_grpc.RetinaWorkerServiceStub(c)
                      for n, c in self._node_channels.items()}

    def close(self) -> None:
        self._trans_channel.close()
        for ch in self._node_channels.values():
            ch.close()

    # --- step 2: stats and the plan ---
    def file_stats(self, trans: tpb.BeginTransResponse, table: str, f: tpb.QueryFile
                   ) -> FileStats | Skipped:
        ref = FileRef(f.file_id, f.name, f.path_uri)
        try:
            parsed = file_names.parse(f.name)
        except ValueError as exc:
            return Skipped(table, f.file_id, f.name, f"unparsable name: {exc}")
        stub = self.nodes.get(parsed.node_id)
        if stub is None:
            return Skipped(table, f.file_id, f.name,
                           f"its node {parsed.node_id} is not in the topology")
        try:
            visibility = _rpc(lambda: stub.QueryVisibility(rpb.QueryVisibilityRequest(
                file_id=f.file_id, timestamp=self.state.safe_gc_ts, trans_id=trans.trans_id),
                timeout=RPC_TIMEOUT_S))
        except grpc.RpcError as exc:
            if exc.code() in RETRYABLE:
                raise  # the node is away: the whole run is unavailable
            # snapshot_expired: its visibility base is above safeGcTs (a base a version-1
            # checkpoint restored at its checkpointAppliedTs); try again in a later run.
            return Skipped(table, f.file_id, f.name,
                           f"QueryVisibility at {self.state.safe_gc_ts}: "
                           f"{exc.code().name}: {exc.details()}")
        if visibility.first_block_id < 0:  # replaced by another rewrite since the listing
            return Skipped(table, f.file_id, f.name, "no longer a published file of "
                           f"{parsed.node_id} (replaced since it was listed)")
        rows, deleted = deleted_count(visibility)
        try:
            size = object_size(f.path_uri, f.name)
        except OSError as exc:
            return Skipped(table, f.file_id, f.name, f"size from storage: {exc}")
        return FileStats(ref, parsed.node_id, parsed.vnode, visibility.first_block_id, size,
                         rows, deleted)

    def plan(self, trans: tpb.BeginTransResponse, schema: str, table: str) -> list[Group]:
        listing = _rpc(lambda: self.trans.ListQueryFiles(tpb.ListQueryFilesRequest(
            trans_id=trans.trans_id, schema_name=schema, table_name=table),
            timeout=RPC_TIMEOUT_S))
        name = f"{schema}.{table}"
        files = [f for f in listing.files if self._ours(f.name)]
        self.state.files_listed += len(files)
        with ThreadPoolExecutor(STATS_THREADS) as pool:
            stats = list(pool.map(lambda f: self.file_stats(trans, name, f), files))
        usable = [s for s in stats if isinstance(s, FileStats)]
        for s in stats:
            if isinstance(s, Skipped):
                self.state.skipped.append(s)
                self.log.warning("gc_file_skipped", table=name, file_id=s.file_id,
                                 file=s.name, reason=s.reason)
        listed = [FileRef(f.file_id, f.name, f.path_uri) for f in files]
        return plan_table(schema, table, usable, listed, self.thresholds)

    def _ours(self, name: str) -> bool:
        """--node: only the files that node created (streams never span nodes)."""
        if not self.args.node:
            return True
        try:
            return file_names.parse(name).node_id == self.args.node
        except ValueError:
            return False  # reported by a run without --node

    # --- steps 3-5 ---
    def prepare(self, trans: tpb.BeginTransResponse, index: int, group: Group,
                report: GroupReport) -> RewriteTask | None:
        request = rpb.PrepareGcRewriteRequest(
            schema_name=group.schema, table_name=group.table, virtual_node_id=group.vnode,
            old_file_ids=[f.ref.file_id for f in group.files],
            safe_gc_ts=self.state.safe_gc_ts, trans_id=trans.trans_id)
        started = time.monotonic()
        try:
            # Only UNAVAILABLE is sent again: a lost answer (deadline) may have prepared
            # a rewrite that pins these files until it expires, and a second one would
            # be refused for them.
            prepared = _rpc(lambda: self.nodes[group.node].PrepareGcRewrite(
                request, timeout=RPC_TIMEOUT_S), retry_on=(grpc.StatusCode.UNAVAILABLE,))
        except grpc.RpcError as exc:
            if exc.code() == grpc.StatusCode.ABORTED:
                self._settle(report, BUSY, exc.code(), f"PrepareGcRewrite: {exc.details()}",
                             exit_code=EXIT_OK)
                return None
            self._settle(report, REFUSED if _code_exit(exc.code()) == EXIT_REFUSED else FAILED,
                         exc.code(), f"PrepareGcRewrite: {exc.details()}")
            return None
        report.rewrite_id, report.cutoff_ts = prepared.rewrite_id, prepared.cutoff_ts
        report.prepare_seconds = round(time.monotonic() - started, 3)
        report.new_file = {"file_id": 0, "name": prepared.file_name}
        return RewriteTask(index, prepared.rewrite_id, group.node, report.table, group.vnode,
                           tuple(f.ref for f in group.files), group.bytes_before,
                           prepared.file_name, prepared.path_id, prepared.path_uri,
                           prepared.cutoff_ts, prepared.expected_rows,
                           prepared.schema_version)

    def _settle(self, report: GroupReport, outcome: str, code: grpc.StatusCode | None,
                reason: str, exit_code: int | None = None) -> None:
        report.outcome, report.reason = outcome, reason
        report.status = code.name if code is not None else ""
        if exit_code is not None:
            report.exit_code = exit_code
        elif code is not None:
            report.exit_code = _code_exit(code)
        else:
            report.exit_code = EXIT_FAILED if outcome == FAILED else EXIT_OK
        self.log.info("gc_group_done", table=report.table, vnode=report.vnode,
                      node=report.node, outcome=outcome, status=report.status, reason=reason,
                      old_files=[f["file_id"] for f in report.old_files],
                      new_file=report.new_file, rows_kept=report.rows_kept,
                      rows_dropped=report.rows_dropped, bytes_before=report.bytes_before,
                      bytes_after=report.bytes_after)
        with progress.printing():
            print_group(report)
        if self._bar is not None:
            self._bar.update(1)

    def abort(self, task: RewriteTask) -> None:
        """Best effort: a rewrite the node is not told about expires there anyway."""
        try:
            _rpc(lambda: self.nodes[task.node].AbortGcRewrite(
                rpb.AbortGcRewriteRequest(rewrite_id=task.rewrite_id), timeout=RPC_TIMEOUT_S),
                attempts=3)
        except grpc.RpcError as exc:
            self.log.warning("gc_abort_failed", rewrite_id=task.rewrite_id, node=task.node,
                             status=exc.code().name, reason=exc.details())

    def finish(self, task: RewriteTask, result: RewriteResult, report: GroupReport,
               keeper: LeaseKeeper) -> None:
        """The driver's side of one finished task: commit it, or abort it."""
        report.rows_kept, report.rows_dropped = result.rows_kept, result.rows_dropped
        report.bytes_after, report.task_seconds = result.bytes_after, round(result.seconds, 3)
        if result.error:
            self.abort(task)
            code = (EXIT_UNAVAILABLE if UNAVAILABLE_MARK in result.error else
                    EXIT_REFUSED if REFUSED_MARK in result.error else EXIT_FAILED)
            self._settle(report, FAILED, None, f"rewrite task: {result.error}", code)
            return
        report.new_file = {"file_id": result.new_file_id, "name": task.file_name}
        if keeper.lost:
            # The node checks the rewrite itself; the job just does not start a commit
            # on behalf of a transaction that is gone.
            self.abort(task)
            self._settle(report, FAILED, None, f"the job's read transaction ended: "
                         f"{keeper.lost}", EXIT_UNAVAILABLE)
            return
        started = time.monotonic()
        try:
            reply = self._commit(task, result)
        except grpc.RpcError as exc:
            report.commit_seconds = round(time.monotonic() - started, 3)
            if _held_by_reader(exc) or _rolled_back_for_reader(exc):
                # Nothing changed; the next run rewrites them.
                self.abort(task)
                self._settle(report, BUSY, exc.code(), f"CommitGcRewrite: {exc.details()}",
                             exit_code=EXIT_OK)
                return
            if exc.code() in RETRYABLE:
                # Outcome unknown: the rewrite may have committed. No abort; the node
                # decides (journal) and the next run plans from what is REGULAR.
                self._settle(report, FAILED, exc.code(),
                             f"CommitGcRewrite, outcome unknown: {exc.details()}")
                return
            self.abort(task)
            self._settle(report, REFUSED if _code_exit(exc.code()) == EXIT_REFUSED else FAILED,
                         exc.code(), f"CommitGcRewrite: {exc.details()}")
            return
        report.commit_seconds = round(time.monotonic() - started, 3)
        report.chain_items, report.journal_state = reply.chain_items, reply.journal_state
        self._settle(report, COMMITTED, None, reply.outcome)

    def _commit(self, task: RewriteTask,
                result: RewriteResult) -> rpb.CommitGcRewriteResponse:
        """CommitGcRewrite. A repeated commit of a committed rewrite answers the same, so a
        lost answer (deadline) is simply asked again; a commit held for a reader that got
        rows of an old file from a write buffer (BUFFER_FETCH_HOLDS_FILE: reads are short)
        is asked again for up to HELD_RETRY_S before the group is left for the next run."""
        request = rpb.CommitGcRewriteRequest(rewrite_id=task.rewrite_id,
                                             new_file_id=result.new_file_id)
        deadline = time.monotonic() + HELD_RETRY_S
        delay = 0.2
        while True:
            try:
                return _rpc(lambda: self.nodes[task.node].CommitGcRewrite(
                    request, timeout=RPC_TIMEOUT_S))
            except grpc.RpcError as exc:
                if not _held_by_reader(exc) or time.monotonic() + delay > deadline:
                    raise
            time.sleep(delay)  # backoff between attempts, not synchronisation
            delay = min(delay * 2, 2.0)

    def run(self) -> int:
        args = self.args
        try:
            # Through the gate first, exactly like snapshot_query: a refusal must not
            # even start Spark.
            trans = self.trans.BeginTrans(tpb.BeginTransRequest(
                read_only=True, lease_ms=args.lease_ms), timeout=RPC_TIMEOUT_S)
        except grpc.RpcError as exc:
            if exc.code() == grpc.StatusCode.UNAVAILABLE:
                return fail(PROG, "the query gate refused the job's read transaction (a "
                                  "Retina node is not READY, or the TransServer is down): "
                                  f"{exc.details()}", EXIT_UNAVAILABLE)
            return fail(PROG, f"BeginTrans: {short_reason(exc)}", _code_exit(exc.code()))
        keeper = LeaseKeeper(self.trans, trans.trans_id, args.lease_ms).start()
        try:
            return self._run_in(trans, keeper)
        finally:
            keeper.stop()
            try:
                self.trans.CommitTrans(tpb.CommitTransRequest(trans_id=trans.trans_id),
                                       timeout=RPC_TIMEOUT_S)
            except grpc.RpcError as exc:  # an expired lease ended it already
                self.log.warning("gc_trans_end_failed", trans_id=trans.trans_id,
                                 status=exc.code().name, reason=exc.details())

    def _tables(self) -> list[str]:
        """--all-tables: the schema's tables. A schema the catalog does not know is an
        error (UnknownSchema), not an empty run: a typo must not look like 'nothing to
        do' (an existing schema without tables is one)."""
        if not self.args.all_tables:
            return [self.args.table]
        catalog = Catalog(self.config.catalog.dsn, pool_max=1,
                          connect_timeout_s=self.config.catalog.connect_timeout_s)
        try:
            tables = catalog.list_tables(self.args.schema)
            if not tables:
                schemas = catalog.list_schemas()
                if self.args.schema not in schemas:
                    raise UnknownSchema(self.args.schema, schemas)
            return tables
        finally:
            catalog.close()

    def _run_in(self, trans: tpb.BeginTransResponse, keeper: LeaseKeeper) -> int:
        args, state = self.args, self.state
        started = time.monotonic()
        state.snapshot_ts = trans.timestamp
        try:
            state.safe_gc_ts = _rpc(lambda: self.trans.GetSafeGcTimestamp(
                tpb.GetSafeGcTimestampRequest(), timeout=RPC_TIMEOUT_S)).safe_gc_ts
            state.tables = [f"{args.schema}.{t}" for t in self._tables()]
            self.log.info("gc_job_started", trans_id=trans.trans_id,
                          snapshot_ts=trans.timestamp, safe_gc_ts=state.safe_gc_ts,
                          tables=state.tables, dry_run=args.dry_run)
            groups: list[Group] = []
            for name in progress.track(state.tables, desc="plan", unit="table",
                                       disabled=args.no_progress):
                groups.extend(self.plan(trans, args.schema, name.split(".", 1)[1]))
        except grpc.RpcError as exc:
            if exc.code() == grpc.StatusCode.NOT_FOUND:  # a table that does not exist
                return fail(PROG, f"{exc.details()}; nothing done (check --schema and "
                                  "--table)", EXIT_USAGE)
            return fail(PROG, f"planning: {short_reason(exc)}", _code_exit(exc.code()))
        except UnknownSchema as exc:
            return fail(PROG, str(exc), EXIT_USAGE)
        except CatalogError as exc:
            return fail(PROG, f"catalog: {exc}", EXIT_UNAVAILABLE)
        if args.max_groups:
            groups = groups[:args.max_groups]
        reports = [_report_of(g) for g in groups]
        state.groups = reports
        print(f"{PROG}: safeGcTs {state.safe_gc_ts}, snapshot {trans.timestamp}: "
              f"{state.files_listed} files listed in {len(state.tables)} table(s), "
              f"{len(state.skipped)} skipped, {len(groups)} group(s) planned", flush=True)
        for s in state.skipped:
            print(f"  skipped {s.table} file {s.file_id} ({s.name}): {s.reason}", flush=True)
        if args.dry_run or not groups:
            for report in reports:
                print_group(report)
            return self.done(started)
        spark_started = time.monotonic()
        spark = spark_session(f"retina-storage-gc-{args.schema}", args.master,
                              parse_conf(args.conf))
        state.spark_start_s = time.monotonic() - spark_started
        self._bar = progress.bar(len(groups), desc="rewrite", unit="group",
                                 disabled=args.no_progress)
        try:
            spec = TaskSpec(self.config.catalog.dsn, self.config.catalog.connect_timeout_s,
                            trans.trans_id, args.row_group_rows)
            # Waves: a prepared rewrite expires at its node, so prepare only what Spark
            # gets to soon.
            for first in range(0, len(groups), args.groups_per_wave):
                if keeper.lost:
                    state.stopped = f"the job's read transaction ended: {keeper.lost}"
                    break
                wave = range(first, min(first + args.groups_per_wave, len(groups)))
                tasks = [t for t in (self.prepare(trans, i, groups[i], reports[i])
                                     for i in wave) if t is not None]
                if not tasks:
                    continue
                task_started = time.monotonic()
                run_rewrites(spark, spec, tasks, lambda task, result: self.finish(
                    task, result, reports[task.index], keeper))
                state.task_seconds += time.monotonic() - task_started
        finally:
            spark.stop()
            self._bar.close()
            self._bar = None
        for report in reports:  # groups the job never got to
            if report.outcome == PLANNED:
                self._settle(report, FAILED, None, f"not attempted: {state.stopped}",
                             EXIT_UNAVAILABLE)
        return self.done(started)

    def done(self, started: float) -> int:
        state, args = self.state, self.args
        totals = totals_of(state)
        totals["seconds"] = round(time.monotonic() - started, 3)
        totals["spark_start_s"] = round(state.spark_start_s, 3)
        totals["task_seconds"] = round(state.task_seconds, 3)
        code = state.exit_code()
        print(summary_line(totals, args.dry_run), flush=True)
        if state.stopped:
            print(f"{PROG}: stopped early: {state.stopped}", file=sys.stderr, flush=True)
        self.log.info("gc_job_done", exit_code=code, dry_run=args.dry_run,
                      safe_gc_ts=state.safe_gc_ts, **totals)
        if args.json:
            print(json.dumps({"safe_gc_ts": state.safe_gc_ts, "snapshot_ts": state.snapshot_ts,
                              "dry_run": args.dry_run, "tables": state.tables,
                              "files_listed": state.files_listed, "exit_code": code,
                              "totals": totals,
                              "skipped": [asdict(s) for s in state.skipped],
                              "groups": [asdict(g) for g in state.groups]}), flush=True)
        return code


def totals_of(state: JobState) -> dict[str, Any]:
    committed = [g for g in state.groups if g.outcome == COMMITTED]
    return {
        "groups": len(state.groups),
        "committed": len(committed),
        "refused": sum(g.outcome == REFUSED for g in state.groups),
        "busy": sum(g.outcome == BUSY for g in state.groups),
        "failed": sum(g.outcome == FAILED for g in state.groups),
        "skipped_files": len(state.skipped),
        "files_before": sum(len(g.old_files) for g in committed),
        "files_after": len(committed),
        "rows_kept": sum(g.rows_kept for g in committed),
        "rows_dropped": sum(g.rows_dropped for g in committed),
        "bytes_before": sum(g.bytes_before for g in committed),
        "bytes_after": sum(g.bytes_after for g in committed),
        # Summed over tasks (they overlap): rows per task-second is the per-core rate.
        "task_busy_seconds": round(sum(g.task_seconds for g in state.groups), 3),
        "prepare_seconds": round(sum(g.prepare_seconds for g in state.groups), 3),
        "commit_seconds": round(sum(g.commit_seconds for g in state.groups), 3),
    }


def _mib(n: int) -> str:
    return f"{n / MiB:,.2f} MiB"


def print_group(g: GroupReport) -> None:
    old = ", ".join(str(f["file_id"]) for f in g.old_files)
    head = f"{g.outcome} {g.table} vnode {g.vnode} ({g.node}, {g.kind}): files [{old}]"
    if g.outcome == PLANNED:
        print(f"{head}: {g.rows_before:,} rows, {g.deleted_at_safe_gc_ts:,} deleted at "
              f"safeGcTs, {_mib(g.bytes_before)}", flush=True)
    elif g.outcome == COMMITTED:
        new = g.new_file or {}
        print(f"{head} -> {new.get('file_id')} ({new.get('name')}): rows kept "
              f"{g.rows_kept:,} dropped {g.rows_dropped:,}, {_mib(g.bytes_before)} -> "
              f"{_mib(g.bytes_after)} (cutoff {g.cutoff_ts}, {g.journal_state})", flush=True)
    else:
        status = f" {g.status}" if g.status else ""
        print(f"{head}:{status} {g.reason}", flush=True)


def summary_line(t: dict[str, Any], dry_run: bool) -> str:
    if dry_run:
        return f"dry run: {t['groups']} group(s) planned, nothing changed"
    return (f"done: {t['committed']} of {t['groups']} group(s) committed, {t['refused']} "
            f"refused, {t['busy']} busy (next run), {t['failed']} failed, "
            f"{t['skipped_files']} file(s) skipped; files "
            f"{t['files_before']} -> {t['files_after']}, rows kept {t['rows_kept']:,} dropped "
            f"{t['rows_dropped']:,}, {_mib(t['bytes_before'])} -> {_mib(t['bytes_after'])} "
            f"in {t['seconds']:.2f} s (Spark start-up {t['spark_start_s']:.1f} s, Spark phase "
            f"{t['task_seconds']:.2f} s)")


# --- the command ------------------------------------------------------------------------------
def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=PROG, formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Storage GC rewrites with Spark: drop rows deleted at or below safeGcTs "
                    "and merge small files, one task per group; the owning Retina node "
                    "commits each rewrite.",
        epilog="Exit codes: 0 every group committed (or nothing to do), 1 a group failed "
               "otherwise, 2 bad arguments or configuration (also a schema or table the "
               "catalog does not know), 3 a group was refused by its "
               "node, 4 unavailable (the query gate refused, a node or the catalog away).")
    p.add_argument("--config", help="TOML config file (default: $RETINA_CONFIG)")
    p.add_argument("--schema", help="the schema (default: cdc.schema of the config)")
    which = p.add_mutually_exclusive_group(required=True)
    which.add_argument("--table", help="one table (TABLE, or SCHEMA.TABLE)")
    which.add_argument("--all-tables", action="store_true",
                       help="every table of the schema (the catalog's table list)")
    p.add_argument("--deleted-threshold", type=float, default=DEFAULT_DELETED_THRESHOLD,
                   help="rewrite a file whose deleted fraction at safeGcTs is at least this "
                        f"(default {DEFAULT_DELETED_THRESHOLD})")
    p.add_argument("--small-file-bytes", type=int, default=DEFAULT_SMALL_FILE_BYTES,
                   help=f"files below this size are merged (default {DEFAULT_SMALL_FILE_BYTES})")
    p.add_argument("--target-file-bytes", type=int, default=DEFAULT_TARGET_FILE_BYTES,
                   help="a merged file grows up to about this size "
                        f"(default {DEFAULT_TARGET_FILE_BYTES})")
    p.add_argument("--row-group-rows", type=int, default=DEFAULT_ROW_GROUP_ROWS,
                   help=f"rows per row group of a new file (default {DEFAULT_ROW_GROUP_ROWS})")
    p.add_argument("--max-groups", type=int, default=0,
                   help="rewrite at most this many groups, in plan order (default 0: all)")
    p.add_argument("--groups-per-wave", type=int, default=DEFAULT_GROUPS_PER_WAVE,
                   help="groups prepared and handed to Spark at a time "
                        f"(default {DEFAULT_GROUPS_PER_WAVE})")
    p.add_argument("--lease-ms", type=int, default=DEFAULT_LEASE_MS,
                   help="lease of the job's read transaction, renewed every third of it "
                        f"(default {DEFAULT_LEASE_MS})")
    p.add_argument("--node", help="only the streams of this Retina node (host:port); the "
                                  "node's own GC scheduler runs the job this way")
    p.add_argument("--dry-run", action="store_true", help="print the plan only; change nothing")
    p.add_argument("--json", action="store_true", help="also print the report as JSON")
    add_spark_arguments(p)
    return p


def check_args(args: argparse.Namespace, config: Config) -> str | None:
    """Normalises schema/table; returns what is wrong, if anything."""
    if args.table and "." in args.table:
        schema, _dot, table = args.table.partition(".")
        if args.schema and args.schema != schema:
            return f"--table {args.table} disagrees with --schema {args.schema}"
        args.schema, args.table = schema, table
    args.schema = args.schema or config.cdc.schema
    if not args.schema or (args.table is not None and not args.table):
        return "give the table as --table TABLE (with --schema) or SCHEMA.TABLE"
    if not 0.0 <= args.deleted_threshold <= 1.0:
        return "--deleted-threshold must be between 0 and 1"
    if args.small_file_bytes < 0 or args.target_file_bytes < 1:
        return "--small-file-bytes must not be negative, --target-file-bytes must be positive"
    if args.row_group_rows < 1 or args.max_groups < 0 or args.groups_per_wave < 1:
        return "--row-group-rows and --groups-per-wave must be positive, --max-groups >= 0"
    if args.lease_ms < 3000:
        return "--lease-ms must be at least 3000"
    return None


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        config, topology = load(args.config)
        parse_conf(args.conf)
    except ConfigError as exc:
        return fail(PROG, str(exc), EXIT_USAGE)
    problem = check_args(args, config)
    if args.node and args.node not in topology.nodes:
        problem = f"--node {args.node} is not in the topology {list(topology.nodes)}"
    if problem:
        return fail(PROG, problem, EXIT_USAGE)
    log = configure_logging(PROG, config.log_level)
    job = StorageGcJob(args, config, topology, log)
    try:
        return job.run()
    except grpc.RpcError as exc:
        return fail(PROG, short_reason(exc), _code_exit(exc.code()))
    finally:
        job.close()


if __name__ == "__main__":
    # The package's copy of main: tasks then pickle references to spark_jobs.storage_gc,
    # which executors import, rather than copies of __main__'s functions.
    from spark_jobs.storage_gc import main as package_main

    sys.exit(package_main())
