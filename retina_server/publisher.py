"""Ingest publish: close a sealed file, then publish it in its stream's firstBlockId order.

``finish`` (C02.1) only writes and checks: Parquet bytes (one row group per
block, a hidden ``_commit_ts`` column) → temporary object + fsync → rename →
directory fsync → re-read and check the footer (row groups, row counts),
the length, the CRC32C, and that the footer's ``_commit_ts`` statistics equal
the append-order ``fileMinCommitTs``/``fileMaxCommitTs`` (C02.3). It never
touches the catalog.

``StreamPublisher`` (C02.5/C02.6) publishes strictly in firstBlockId order
while closes complete in any order:

1. durable MainIndex flush of the file's row-id ranges;
2. one catalog update: TEMPORARY_INGEST → REGULAR with the row-id hull;
3. registry register (synchronously after the catalog commit returned);
4. object cleanup: the file's blocks leave the write buffer.

Each step has a failpoint before and after it; docs/write-paths/ingest-publish.md
says what a crash at each one leaves and what the restart does.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import crc32c
import pyarrow as pa
import pyarrow.parquet as pq
from prometheus_client import Counter, Histogram

from retina_common import failpoints as fp
from retina_common.catalog import (
    Catalog,
    CatalogError,
    CatalogOutcomeUnknown,
    ConstraintViolation,
    FileType,
    FileTypeMismatch,
    InvalidCatalogArgument,
    NotFound,
)
from retina_common.codec import COMMIT_TS, PARQUET_COMPRESSION
from retina_common.log import get_logger
from retina_common.schema_evolution import conform
from retina_common.storage import file_uri, read_bytes, write_durably
from retina_server.main_index import MainIndex
from retina_server.registry import IngestFileMeta, IngestFileMetadataRegistry
from retina_server.visibility import VisibilityIndex
from retina_server.write_buffer import FileState, IngestFile, StreamBuffer

log = get_logger(component="publisher")

PUBLISHED = Counter("retina_ingest_files_published_total", "Ingest files published REGULAR")
PUBLISH_SECONDS = Histogram("retina_ingest_publish_seconds",
                            "Seal to REGULAR latency of an ingest file",
                            buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30))
PUBLISH_RETRIES = Counter("retina_ingest_publish_retries_total",
                          "Publish attempts retried after a catalog failure")
META_PREFIX = "retina."


class IngestCheckError(Exception):
    """A closed file does not match what was written: it is never published."""


def finish(file: IngestFile, schema: pa.Schema, node_id: str) -> None:
    """Write, fsync, rename and check one sealed file (no catalog change)."""
    if any(b.pending for b in file.blocks):
        raise IngestCheckError(f"file {file.file_id} still has unsettled appends")
    metadata = {
        "table_id": file.table_id, "vnode": file.vnode, "first_block_id": file.first_block_id,
        "node": node_id, "min_commit_ts": file.min_commit_ts, "max_commit_ts": file.max_commit_ts,
    }
    full_schema = schema.with_metadata({f"{META_PREFIX}{k}": str(v) for k, v in metadata.items()})
    sink = pa.BufferOutputStream()
    with pq.ParquetWriter(sink, full_schema, compression=PARQUET_COMPRESSION) as writer:
        for block in file.blocks:
            # conform: a file sealed before a schema change may be written with the new
            # columns (NULL in its rows); see RetinaNode._evolve.
            rows = conform(block.visible_rows(), schema)
            writer.write_table(pa.Table.from_batches(rows.to_batches(), full_schema),
                               row_group_size=max(block.size, 1))
    data = sink.getvalue().to_pybytes()
    file.length, file.crc32c = len(data), crc32c.crc32c(data)
    fp.INGEST_CLOSE_BEFORE.hit()
    write_durably(file.path_uri, file.name, data)
    fp.INGEST_CLOSE_AFTER.hit()
    check_closed_file(file)
    file.state = FileState.CLOSED


def check_closed_file(file: IngestFile) -> None:
    """The footer, length and checksum of what is on storage match what was written."""
    uri = file_uri(file.path_uri, file.name)
    data = read_bytes(file.path_uri, file.name)
    if len(data) != file.length or crc32c.crc32c(data) != file.crc32c:
        raise IngestCheckError(f"{uri}: length/CRC32C differ from what was written")
    meta = pq.ParquetFile(pa.BufferReader(data)).metadata
    if meta.num_row_groups != len(file.blocks):
        raise IngestCheckError(f"{uri}: {meta.num_row_groups} row groups, "
                               f"expected {len(file.blocks)}")
    ts_index = meta.schema.to_arrow_schema().get_field_index(COMMIT_TS)
    lo, hi = None, None
    for rg, block in enumerate(file.blocks):
        group = meta.row_group(rg)
        if group.num_rows != block.size:
            raise IngestCheckError(f"{uri}: row group {rg} has {group.num_rows} rows, "
                                   f"expected {block.size}")
        stats = group.column(ts_index).statistics
        if stats is not None and stats.has_min_max and group.num_rows:
            lo = stats.min if lo is None else min(lo, stats.min)
            hi = stats.max if hi is None else max(hi, stats.max)
    if (lo, hi) != (file.min_commit_ts, file.max_commit_ts):
        raise IngestCheckError(f"{uri}: footer commit-ts range [{lo}, {hi}] differs from the "
                               f"append-order range [{file.min_commit_ts}, {file.max_commit_ts}]")


class StreamPublisher:
    """Publishes one stream's closed files strictly in firstBlockId order."""

    def __init__(self, stream: StreamBuffer, catalog: Catalog, main_index: MainIndex,
                 registry: IngestFileMetadataRegistry, visibility: VisibilityIndex,
                 on_fatal: Callable[[str], None],
                 on_published: Callable[[IngestFile], None], retry_s: float = 0.5,
                 give_up_after_s: float = 300.0) -> None:
        self._stream = stream
        self._catalog = catalog
        self._main_index = main_index
        self._registry = registry
        self._visibility = visibility
        self._on_fatal = on_fatal
        self._on_published = on_published
        self._retry_s = retry_s
        self._give_up_after_s = give_up_after_s
        self.lock = threading.Lock()  # held for a whole publish; checkpoints take it
        self._closed: dict[int, IngestFile] = {}

    def closed(self, file: IngestFile) -> None:
        """A file finished closing; publish it and any successors now in order."""
        with self.lock:
            self._closed[file.first_block_id] = file
            while self._stream.files and \
                    self._stream.files[0].first_block_id in self._closed:
                head = self._closed.pop(self._stream.files[0].first_block_id)
                self._publish(head)

    def _publish(self, file: IngestFile) -> None:
        started = time.monotonic()
        fp.INGEST_INDEX_FLUSH_BEFORE.hit()
        self._main_index.flush_file(file.file_id)
        fp.INGEST_INDEX_FLUSH_AFTER.hit()
        fp.INGEST_CATALOG_REGULAR_BEFORE.hit()
        self._mark_regular(file)
        fp.INGEST_CATALOG_REGULAR_AFTER.hit()
        fp.INGEST_REGISTRY_BEFORE.hit()
        self._registry.register(IngestFileMeta(
            file.file_id, file.table_id, file.vnode, file.first_block_id,
            file.min_commit_ts or 0, file.max_commit_ts or 0, file.row_count,
            file.min_row_id or 0, file.max_row_id or 0, len(file.blocks), len(file.blocks)))
        for block in file.blocks:  # the same RGVisibility objects move over
            self._visibility.adopt(file.file_id, block.rg_id, block.visibility)
        fp.INGEST_REGISTRY_AFTER.hit()
        fp.INGEST_CLEANUP_BEFORE.hit()
        with self._stream.lock:
            self._stream.drop_file(file)
        self._on_published(file)
        file.state = FileState.PUBLISHED
        fp.INGEST_CLEANUP_AFTER.hit()
        PUBLISHED.inc()
        PUBLISH_SECONDS.observe(time.monotonic() - started)
        log.info("ingest_file_published", file_id=file.file_id, table=file.table_id,
                 vnode=file.vnode, first_block_id=file.first_block_id, rows=file.row_count,
                 row_groups=len(file.blocks))

    def _mark_regular(self, file: IngestFile) -> None:
        """One catalog update; retried until it is known to have happened, for at most
        ``give_up_after_s``: a catalog that stays away that long is not a blip, and the
        node fails closed (a restart recovers the file) instead of holding the stream's
        publish lock, and so its checkpoints, forever."""
        try:
            mark_regular(self._catalog, file.file_id, len(file.blocks), file.min_row_id,
                         file.max_row_id, self._give_up_after_s, self._retry_s)
        except FileTypeMismatch as exc:
            self._on_fatal(f"file {file.file_id} became {exc.actual} before publish")
            raise
        except (NotFound, ConstraintViolation, InvalidCatalogArgument) as exc:
            # Not transient: the row vanished or the update breaks a catalog rule.
            self._on_fatal(f"file {file.file_id} cannot be published: {exc}")
            raise
        except CatalogError as exc:
            self._on_fatal(f"file {file.file_id}: the catalog refused the publish for "
                           f"{self._give_up_after_s:.0f}s: {exc}")
            raise


def mark_regular(catalog: Catalog, file_id: int, num_row_group: int, min_row_id: int | None,
                 max_row_id: int | None, give_up_after_s: float, retry_s: float) -> None:
    """TEMPORARY_INGEST -> REGULAR with the row-id hull (an ingest publish, a bulk load):
    a retry that finds the file REGULAR already (an unknown outcome) is done; a catalog
    that is away is retried for ``give_up_after_s``, then its error is raised; anything
    not transient (another type, the row gone, a rule broken) is raised at once."""
    deadline = time.monotonic() + give_up_after_s
    while True:
        try:
            catalog.update_file(file_id, file_type=FileType.REGULAR, num_row_group=num_row_group,
                                min_row_id=min_row_id, max_row_id=max_row_id,
                                expected_type=FileType.TEMPORARY_INGEST)
            return
        except FileTypeMismatch as exc:
            if exc.actual == FileType.REGULAR.name:
                return  # an earlier attempt committed (outcome was unknown)
            raise
        except (NotFound, ConstraintViolation, InvalidCatalogArgument):
            raise
        except (CatalogOutcomeUnknown, CatalogError) as exc:
            if time.monotonic() > deadline:
                raise
            PUBLISH_RETRIES.inc()
            log.warning("ingest_publish_retry", file_id=file_id, error=str(exc))
            time.sleep(retry_s)


class IngestPipeline:
    """Closes sealed files on worker threads and hands them to their stream publisher."""

    def __init__(self, node_id: str, workers: int, on_fatal: Callable[[str], None]) -> None:
        self._node_id = node_id
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="ingest-close")
        self._on_fatal = on_fatal
        self._inflight = 0
        self._idle = threading.Condition()

    def submit(self, file: IngestFile, schema: pa.Schema, publisher: StreamPublisher) -> None:
        with self._idle:
            self._inflight += 1
        self._pool.submit(self._run, file, schema, publisher)

    def _run(self, file: IngestFile, schema: pa.Schema, publisher: StreamPublisher) -> None:
        try:
            finish(file, schema, self._node_id)
            publisher.closed(file)
        except Exception as exc:
            file.state = FileState.FAILED
            log.error("ingest_file_failed", file_id=file.file_id, error=str(exc),
                      error_type=type(exc).__name__)
            self._on_fatal(f"ingest file {file.file_id}: {exc}")
        finally:
            with self._idle:
                self._inflight -= 1
                self._idle.notify_all()

    def wait_idle(self, timeout_s: float) -> bool:
        with self._idle:
            return self._idle.wait_for(lambda: self._inflight == 0, timeout_s)

    def shutdown(self) -> None:
        with contextlib.suppress(Exception):
            self._pool.shutdown(wait=True)
