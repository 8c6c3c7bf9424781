"""The Storage GC rewrite task (spark_jobs/storage_gc.py, step 4): one prepared group's
new file, written on a Spark executor and registered TEMPORARY_GC before its bytes
exist (:func:`rewrite_group`), and the driver's loop that runs one task per group and
hands each result back as it finishes (:func:`run_rewrites`). What a task gets and
returns is plain, picklable data.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import grpc
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from retina_common import failpoints as fp
from retina_common.catalog import (
    AlreadyExists,
    Catalog,
    CatalogError,
    CatalogOutcomeUnknown,
    CatalogUnavailable,
    FileRecord,
    FileType,
    FileTypeMismatch,
)
from retina_common.client import channel
from retina_common.codec import COMMIT_TS
from retina_common.pb import retina_pb2 as rpb
from retina_common.pb import retina_pb2_grpc
from retina_common.retry import RETRYABLE_CODES
from retina_common.schema_evolution import conform, table_schema
from retina_common.storage import open_parquet, write_durably
from spark_jobs.common import (
    REFUSED_MARK,
    UNAVAILABLE_MARK,
    FileRef,
    TaskError,
    call_with_retry,
    run_reported,
    short_reason,
)
from spark_jobs.storage_gc_arrow import (
    RewriteError,
    encode_parquet,
    new_file_schema,
    surviving_rows,
)

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

RPC_TIMEOUT_S = 60.0
VISIBILITY_THREADS = 8


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
        except (AlreadyExists, CatalogOutcomeUnknown):
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
    return UNAVAILABLE_MARK if exc.code() in RETRYABLE_CODES else REFUSED_MARK


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
    by_id = {t.rewrite_id: t for t in tasks}
    seen: set[str] = set()

    def done(rewrite_id: Any, result: Any) -> None:
        seen.add(rewrite_id)
        on_done(by_id[rewrite_id], result)

    def work(task: RewriteTask) -> tuple[str, RewriteResult]:
        return task.rewrite_id, rewrite_group(spec, task)

    failure = run_reported(spark, tasks, work, done, "spark-gc-job")
    for task in tasks:
        if task.rewrite_id not in seen:
            reason = short_reason(failure) if failure else "the Spark task never reported"
            on_done(task, RewriteResult(task.rewrite_id, error=f"Spark: {reason}"))


