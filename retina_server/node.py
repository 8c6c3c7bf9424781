"""RetinaNode: the data plane of one Retina node, wired from parts passed in.

It owns the node's virtual nodes of the topology, one StreamBuffer and one
StreamPublisher per stream ``(tableId, virtualNodeId)``, the visibility
index, the ingest registry, the LocalIndexService and the source positions
(source_positions.py). The gRPC layer
(``worker_service.py``) and the UpdateRecord apply path (``update_record.py``) call
into it; nothing here knows about gRPC.

Start-up is the recovery coordinator's (recovery/coordinator.py): it rebuilds the
registry and the visibility index from the checkpoint during cleansing; the
write buffers always start empty.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime

import grpc
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from prometheus_client import Gauge
from pyroaring import BitMap

from retina_common import failpoints as fp
from retina_common import file_names
from retina_common.catalog import (
    AlreadyExists,
    Catalog,
    FileType,
    TableRecord,
)
from retina_common.codec import COMMIT_TS
from retina_common.log import get_logger
from retina_common.schema_evolution import conform, table_schema
from retina_common.storage import file_uri
from retina_common.topology import Topology
from retina_server.index import LocalIndexService
from retina_server.publisher import IngestPipeline, StreamPublisher
from retina_server.read_history import ReadHistory
from retina_server.refused_writes import RefusedWrites
from retina_server.registry import IngestFileMetadataRegistry, RegistryError
from retina_server.row_moves import RowMoves
from retina_server.source_positions import SourcePositions
from retina_server.visibility import RGVisibility, VisibilityError, VisibilityIndex
from retina_server.write_buffer import IngestFile, StreamBuffer
from retina_server.write_fence import WriteFence

log = get_logger(component="node")

FILE_ID = "_file_id"
MEMTABLE_ROWS = Gauge("retina_write_buffer_rows", "Rows held in write buffers (all streams)")
FILES = Gauge("retina_files", "This node's files by catalog type", ["type"])


class NodeFailedClosed(Exception):
    """The node hit an unrecoverable write error and refuses every further write."""

    grpc_status = grpc.StatusCode.FAILED_PRECONDITION


@dataclass(frozen=True)
class BufferSettings:
    block_rows: int = 4096
    blocks_per_file: int = 4
    flush_interval_ms: int = 1000
    close_workers: int = 2


@dataclass
class Stream:
    table: TableRecord
    vnode: int
    path_id: int
    path_uri: str
    schema: pa.Schema
    buffer: StreamBuffer
    publisher: StreamPublisher


class RetinaNode:
    def __init__(self, node_id: str, topology: Topology, catalog: Catalog,
                 index: LocalIndexService, storage_root: str, settings: BufferSettings,
                 clock_ms: Callable[[], int], fence: WriteFence | None = None,
                 source_positions: SourcePositions | None = None) -> None:
        self.node_id = node_id
        # LATE_WRITES_FENCED: reads raise it, ordinary writes pass it (write_fence.py).
        self.fence = fence or WriteFence(node_id)
        self.topology = topology
        self.owned_vnodes = frozenset(topology.vnodes_of(node_id))
        self.catalog = catalog
        self.index = index
        # ts -> the commit's source position, in the index's LMDB environment (the change
        # feed reads it; UpdateRecord writes it in the request's index transaction).
        self.source_positions = source_positions or SourcePositions(index.primary)
        self.visibility = VisibilityIndex()
        # ROW_READS_SEE_NO_MOVE: Storage GC commits, rollbacks, reverts and sweeps run
        # inside it; point reads (row_lookup.py) read again when rows moved under them.
        self.row_moves = RowMoves()
        self.registry = IngestFileMetadataRegistry()
        self._storage_root = storage_root.rstrip("/")
        self._settings = settings
        self._clock_ms = clock_ms
        self._streams: dict[tuple[int, int], Stream] = {}
        self._tables: dict[tuple[str, str], TableRecord] = {}
        self._lock = threading.Lock()
        self._buffer_files: dict[int, IngestFile] = {}
        self.failure: str | None = None
        # Which past snapshots this process answers after its recovery
        # (SNAPSHOTS_END_AT_RESTART, HISTORY_REBUILT_IS_REFUSED: read_history.py).
        self.history = ReadHistory(node_id)
        # What the write fence refused, durably: recovery replay skips it (refused_writes.py).
        self.refused = RefusedWrites(index.primary)
        # BUFFER_FETCH_HOLDS_FILE: file id -> {read transaction: its snapshot} for every
        # write-buffer file a GetWriteBuffer read (gc/rewrites.py).
        self._buffer_reads: dict[int, dict[int, int]] = {}
        self._failure_lock = threading.Lock()
        # Called once when the node fails closed (the lifecycle goes FAILED).
        self.on_fail_closed: Callable[[str], None] = lambda _reason: None
        self.pipeline = IngestPipeline(node_id, settings.close_workers, self.fail_closed)
        self._stop = threading.Event()
        self._flusher = threading.Thread(target=self._flush_loop, name="flush-timer", daemon=True)

    # --- failure ---
    def fail_closed(self, reason: str) -> None:
        with self._failure_lock:  # check and set in one step: the first reason wins
            if self.failure is not None:
                return
            self.failure = reason
        log.critical("node_failed_closed", node=self.node_id, reason=reason)
        self.on_fail_closed(reason)

    def check_writable(self) -> None:
        if self.failure is not None:
            raise NodeFailedClosed(f"writer failed closed: {self.failure}")

    # --- tables and streams ---
    def table(self, schema_name: str, table_name: str) -> TableRecord:
        table = self._tables.get((schema_name, table_name))
        if table is None:
            table = self.refresh_table(schema_name, table_name)
        return table

    def refresh_table(self, schema_name: str, table_name: str) -> TableRecord:
        """Re-read a table from the catalog (its schema evolved: a column was added).

        The cache only moves forward: a read that raced a newer one (a lookup that
        started before a column was added and finished after it was cached) never
        replaces the newer schema version, or buffered rows would be read without it."""
        fresh = self.catalog.get_table(schema_name, table_name)  # NotFound propagates
        key = (schema_name, table_name)
        with self._lock:
            cached = self._tables.get(key)
            if cached is None or cached.schema_version <= fresh.schema_version:
                self._tables[key] = fresh
            return self._tables[key]

    def _evolve(self, stream: Stream, table: TableRecord) -> None:
        """Give a stream the table's newer columns. The open file is sealed first, so
        every file holds rows of one schema version and files opened from now on carry
        the new columns; files written before lack them and read them as NULL."""
        with stream.buffer.lock:
            if stream.table.schema_version >= table.schema_version:
                return  # another request evolved it meanwhile
            stream.buffer.seal_open_file()
            self.submit_sealed(stream)
            log.info("stream_schema_evolved", node=self.node_id, table=table.name,
                     vnode=stream.vnode, schema_version=table.schema_version,
                     columns=[c.name for c in table.columns])
            stream.schema = table_schema(table)
            stream.table = table

    def _path_of(self, table: TableRecord) -> tuple[int, str]:
        paths = self.catalog.get_paths(table.table_id)
        if not paths:
            uri = file_uri(self._storage_root, f"{table.schema_name}/{table.name}")
            with contextlib.suppress(AlreadyExists):  # another node created it
                self.catalog.add_path(table.table_id, uri)
            paths = self.catalog.get_paths(table.table_id)
        return paths[0].path_id, paths[0].uri

    def stream(self, table: TableRecord, vnode: int) -> Stream:
        """The stream of (table, vnode), created on first use, at ``table``'s schema
        version or newer (never older: the caller builds rows of its version)."""
        key = (table.table_id, vnode)
        with self._lock:
            stream = self._streams.get(key)
        if stream is None:
            # Possibly created meanwhile by a request of an older version: evolved below.
            stream = self._create_stream(table, vnode)
        if stream.table.schema_version < table.schema_version:
            # Not under self._lock: _evolve takes the buffer lock, and the buffer lock is
            # taken before self._lock elsewhere (_allocate_file).
            self._evolve(stream, table)
        return stream

    def _create_stream(self, table: TableRecord, vnode: int) -> Stream:
        """The stream of (table, vnode): the existing one (of any version) or a new one."""
        key = (table.table_id, vnode)
        with self._lock:
            stream = self._streams.get(key)
            if stream is not None:
                return stream
            path_id, path_uri = self._path_of(table)
            schema = table_schema(table)
            buffer = StreamBuffer(
                table.table_id, vnode, block_rows=self._settings.block_rows,
                blocks_per_file=self._settings.blocks_per_file,
                allocate_file=lambda buf, first: self._allocate_file(buf, first, path_id,
                                                                     path_uri))
            publisher = StreamPublisher(buffer, self.catalog, self.index.main, self.registry,
                                        self.visibility, self.fail_closed,
                                        on_published=self._forget_published)
            stream = Stream(table, vnode, path_id, path_uri, schema, buffer, publisher)
            self._streams[key] = stream
            return stream

    def all_streams(self) -> list[Stream]:
        with self._lock:
            return [s for _k, s in sorted(self._streams.items())]

    def invalidate_caches(self) -> None:
        """READY hook: forget cached table metadata (it may have changed while recovering)."""
        with self._lock:
            self._tables.clear()

    def streams_of_table(self, table_id: int) -> list[Stream]:
        with self._lock:
            return [s for (t, _v), s in sorted(self._streams.items()) if t == table_id]

    def _allocate_file(self, buffer: StreamBuffer, _first_hint: int, path_id: int,
                       path_uri: str) -> IngestFile:
        """Register a new TEMPORARY_INGEST file for a stream (called under its lock)."""
        seq = self.index.sequences.allocate("file_seq")
        first_block = self.index.sequences.allocate(f"block:{buffer.table_id}:{buffer.vnode}",
                                          self._settings.blocks_per_file)
        buffer.next_block_id = first_block
        now = datetime.now(UTC)
        name = file_names.make(self.node_id, now, seq, buffer.vnode)
        fp.INGEST_ALLOC_CATALOG_BEFORE.hit()
        record = self.catalog.add_file(name, FileType.TEMPORARY_INGEST, 0, path_id)
        fp.INGEST_ALLOC_CATALOG_AFTER.hit()
        file = IngestFile(record.file_id, name, path_id, path_uri, buffer.table_id,
                          buffer.vnode, first_block, int(now.timestamp() * 1000))
        with self._lock:
            self._buffer_files[file.file_id] = file
        return file

    # --- baseline and visibility lookups ---
    def in_baseline(self, file_id: int) -> bool:
        """The baseline visible file set: registered files and live write-buffer files."""
        return file_id in self.registry or file_id in self._buffer_files

    def buffer_file(self, file_id: int) -> IngestFile | None:
        """The write-buffer file ``file_id`` while it is unpublished (its rows in memory)."""
        return self._buffer_files.get(file_id)

    def stream_position(self, file_id: int) -> int:
        """A published file's firstBlockId (its place in its stream); -1 for any other
        file (replaced, staged or still in a write buffer): block ids start at 0."""
        try:
            return self.registry.get(file_id).first_block_id
        except RegistryError:
            return -1

    def rg_visibility(self, file_id: int, rg_id: int) -> RGVisibility:
        try:
            return self.visibility.get(file_id, rg_id)
        except VisibilityError:
            file = self._buffer_files.get(file_id)
            if file is None or rg_id >= len(file.blocks):
                raise
            return file.blocks[rg_id].visibility

    def query_visibility(self, file_id: int, rg_ids: list[int],
                         ts: int) -> list[tuple[int, int, BitMap]]:
        """(rgId, rowCount, deleted bitmap at ts) of a published or buffered file."""
        # Replaced (frozen as of its swap) or staged (a GC file between its swap and its
        # adoption): looked up first, so no moment of the registry switch answers empty.
        retired = self.visibility.retired(file_id)
        if retired is None and not self.in_baseline(file_id):
            raise VisibilityError(f"file {file_id} is not served by {self.node_id}")
        if retired is not None:  # replaced by Storage GC (or staged): as of the swap
            wanted = rg_ids or list(range(len(retired)))
        elif file_id in self.registry:  # a GC output with no row left has no row group
            wanted = rg_ids or self.visibility.row_groups(file_id)
        else:
            wanted = rg_ids or list(range(len(self._buffer_files[file_id].blocks)))
        out = []
        for rg in wanted:
            if retired is not None:
                if not 0 <= rg < len(retired):
                    raise VisibilityError(f"no visibility for file {file_id} rg {rg}")
                entry = retired[rg]
            else:
                entry = self.rg_visibility(file_id, rg)
            # NO_READ_BELOW_FOLD: below its base, deleted_at refuses (snapshot_expired).
            out.append((rg, entry.row_count, entry.deleted_at(ts)))
        return out

    # --- sealing and publishing ---
    def submit_sealed(self, stream: Stream) -> None:
        # Under the stream lock, stream.schema is the schema of every sealed file's rows
        # (a schema change seals and submits first); finish() conforms rows regardless.
        for file in stream.buffer.take_sealed():
            self.pipeline.submit(file, stream.schema, stream.publisher)

    def _flush_loop(self) -> None:
        interval = self._settings.flush_interval_ms / 1000
        while not self._stop.wait(interval / 4):
            self.flush(older_than_ms=self._settings.flush_interval_ms)

    def flush(self, older_than_ms: int = 0) -> None:
        """Seal open files older than ``older_than_ms`` and hand sealed files to the pipeline."""
        now = self._clock_ms()
        with self._lock:
            streams = list(self._streams.values())
        for stream in streams:
            with stream.buffer.lock:
                file = stream.buffer.open_file
                if file is not None and now - file.created_ms >= older_than_ms:
                    stream.buffer.seal_open_file()
                self.submit_sealed(stream)
        self.check_registry_covers_visibility()
        self._update_gauges()

    def _forget_published(self, file: IngestFile) -> None:
        with self._lock:
            self._buffer_files.pop(file.file_id, None)

    def _update_gauges(self) -> None:
        with self._lock:
            files = list(self._buffer_files.values())
        MEMTABLE_ROWS.set(sum(f.row_count for f in files))
        FILES.labels(type="TEMPORARY_INGEST").set(len(files))
        FILES.labels(type="REGULAR").set(len(self.registry.all()))

    def check_registry_covers_visibility(self) -> None:
        """REGISTRY_COVERS_VISIBILITY: every file in the visibility index is registered.

        A miss means a publish/retire ordering bug; the node fails closed."""
        missing = sorted(f for f in self.visibility.files() if f not in self.registry)
        if missing:
            self.fail_closed(f"files {missing[:5]} are in the visibility index but not in the "
                             "ingest registry")

    def start(self) -> None:
        self._flusher.start()

    def shutdown(self, timeout_s: float = 30) -> None:
        """Shutdown flush: everything appended goes through the same publisher."""
        self._stop.set()
        if self._flusher.is_alive():
            self._flusher.join(timeout=5)
        if self.failure is None:
            self.flush(older_than_ms=0)
            self.pipeline.wait_idle(timeout_s)
        self.pipeline.shutdown()

    # --- reads ---
    def write_buffer_rows(self, table: TableRecord, ts: int,
                          reader: tuple[int, int] | None = None) -> pa.Table:
        """Rows of this node's unpublished files visible at ``ts``, with ``_file_id``.
        ``reader``: (read transaction id, its snapshot), recorded for every file whose
        rows are taken (BUFFER_FETCH_HOLDS_FILE)."""
        schema = table_schema(table).append(pa.field(FILE_ID, pa.int64(), nullable=False))
        parts = []
        for stream in self.streams_of_table(table.table_id):
            with stream.buffer.lock:
                snapshot = [(f.file_id, b.visibility, list(b.batches), b.visible_size)
                            for f in stream.buffer.files for b in f.blocks if b.visible_size]
                if reader is not None and snapshot:
                    # Under the buffer lock a Storage GC commit's switch also takes: the
                    # commit either sees this read or runs after the files left the buffer.
                    self._record_buffer_reads({s[0] for s in snapshot}, *reader)
            for file_id, visibility, batches, visible in snapshot:
                rows = pa.Table.from_batches(batches).slice(0, visible)
                keep = visible_mask(rows, visibility.deleted_at(ts), ts)
                # Rows of an older (or newer) schema version than the reader's table.
                rows = conform(rows.filter(keep), schema.remove(len(schema) - 1))
                if rows.num_rows:
                    rows = rows.append_column(FILE_ID, pa.array([file_id] * rows.num_rows,
                                                                pa.int64()))
                    parts.append(rows)
        return pa.concat_tables(parts) if parts else schema.empty_table()

    # --- BUFFER_FETCH_HOLDS_FILE ---
    def _record_buffer_reads(self, file_ids: set[int], trans_id: int, snapshot: int) -> None:
        with self._lock:
            for file_id in file_ids:
                self._buffer_reads.setdefault(file_id, {})[trans_id] = snapshot

    def buffer_readers(self, file_ids: list[int]) -> dict[int, int]:
        """{read transaction: snapshot} of every read that got rows of these files from a
        write buffer."""
        with self._lock:
            return {t: s for f in file_ids for t, s in self._buffer_reads.get(f, {}).items()}

    def forget_buffer_readers(self, trans_ids: set[int]) -> None:
        """These read transactions have ended: they hold no file any more."""
        with self._lock:
            for file_id in list(self._buffer_reads):
                readers = self._buffer_reads[file_id]
                for trans_id in trans_ids & readers.keys():
                    del readers[trans_id]
                if not readers:
                    del self._buffer_reads[file_id]

    def forget_buffer_reads_at_or_below(self, safe_ts: int) -> int:
        """Drop the reads whose snapshot is at or below ``safe_ts`` (safeGcTs: no live,
        not offloaded read transaction has such a snapshot, and only those may still list
        files); returns how many were dropped."""
        dropped = 0
        with self._lock:
            for file_id in list(self._buffer_reads):
                readers = self._buffer_reads[file_id]
                for trans_id in [t for t, s in readers.items() if s <= safe_ts]:
                    del readers[trans_id]
                    dropped += 1
                if not readers:
                    del self._buffer_reads[file_id]
        return dropped

    def forget_buffer_files(self, file_ids: list[int]) -> None:
        with self._lock:
            for file_id in file_ids:
                self._buffer_reads.pop(file_id, None)


def visible_mask(rows: pa.Table, deleted: BitMap, ts: int) -> pa.Array:
    """Rows committed at or before ``ts`` and not deleted at ``ts``."""
    keep = pc.less_equal(rows.column(COMMIT_TS), pa.scalar(ts, pa.int64()))
    if len(deleted):
        alive = np.ones(rows.num_rows, dtype=bool)
        idx = np.frombuffer(deleted.to_array(), dtype=np.uint32)
        alive[idx[idx < rows.num_rows]] = False
        keep = pc.and_(keep, pa.array(alive))
    return keep
