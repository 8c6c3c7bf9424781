"""The write buffer of one stream ``(tableId, virtualNodeId)``.

Inserted rows land in *blocks* (memtables); each block becomes one row group
of an ingest file, and a file holds up to ``blocks_per_file`` blocks. A file
is registered TEMPORARY_INGEST in the catalog when its first block opens, so
every row has its final ``RowLocation(fileId, rgId, rgRowOffset)`` from the
moment it is appended.

AppendSegmentState (C02.4): a block separates its physical size from a
query-visible ``visible_size`` that only grows. An append reserves rows as a
pending *handle*; ``settle(handles, visible|hidden)`` settles it (the
specification's publishPendingAppend), and
``visible_size`` advances over the longest prefix of settled handles.
Hidden rows were compensated (deleted in visibility, primary restored)
before they were settled, so they stay invisible at every snapshot.
Invariant VISIBLE_PREFIX: GetWriteBuffer and flushes read only
``[0, visible_size)``.

Every block carries its own RGVisibility while the file is unpublished; on
publish the same objects move into the node's visibility index, so a delete
racing the publish is never lost.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum

import pyarrow as pa

from retina_server.visibility import RGVisibility


class FileState(StrEnum):
    OPEN = "OPEN"  # taking appends
    SEALED = "SEALED"  # full or flushed by the timer; waiting to be closed
    CLOSED = "CLOSED"  # physically written and checked
    PUBLISHED = "PUBLISHED"  # REGULAR in the catalog and registered
    FAILED = "FAILED"


class SettleMode(StrEnum):
    VISIBLE = "visible"
    HIDDEN = "hidden"


@dataclass
class Block:
    block_id: int  # per-stream sequence: the file's firstBlockId + rgId
    rg_id: int
    capacity: int
    visibility: RGVisibility
    batches: list[pa.RecordBatch] = field(default_factory=list)
    size: int = 0
    visible_size: int = 0
    # start offset -> (count, settled?)
    pending: dict[int, tuple[int, bool]] = field(default_factory=dict)

    @property
    def free(self) -> int:
        return self.capacity - self.size

    def visible_rows(self) -> pa.Table:
        table = pa.Table.from_batches(self.batches) if self.batches else None
        if table is None:
            return pa.table({})
        return table.slice(0, self.visible_size)


@dataclass
class IngestFile:
    file_id: int
    name: str
    path_id: int
    path_uri: str
    table_id: int
    vnode: int
    first_block_id: int
    created_ms: int
    blocks: list[Block] = field(default_factory=list)
    state: FileState = FileState.OPEN
    min_commit_ts: int | None = None
    max_commit_ts: int | None = None
    min_row_id: int | None = None
    max_row_id: int | None = None
    length: int = 0
    crc32c: int = 0

    @property
    def row_count(self) -> int:
        return sum(b.size for b in self.blocks)

    def note_append(self, ts: int, row_id_first: int, row_id_last: int) -> None:
        """Append-order commit-ts and row-id range, kept at the write boundary (C02.3)."""
        self.min_commit_ts = ts if self.min_commit_ts is None else min(self.min_commit_ts, ts)
        self.max_commit_ts = ts if self.max_commit_ts is None else max(self.max_commit_ts, ts)
        self.min_row_id = row_id_first if self.min_row_id is None else \
            min(self.min_row_id, row_id_first)
        self.max_row_id = row_id_last if self.max_row_id is None else \
            max(self.max_row_id, row_id_last)


@dataclass(frozen=True)
class AppendHandle:
    file: IngestFile
    block: Block
    start: int
    count: int
    row_id_start: int


class StreamBuffer:
    """One stream's blocks and files. The caller serialises appends with ``lock``."""

    def __init__(self, table_id: int, vnode: int, *, block_rows: int, blocks_per_file: int,
                 allocate_file: Callable[[StreamBuffer, int], IngestFile],
                 next_block_id: int = 0) -> None:
        self.table_id = table_id
        self.vnode = vnode
        self.block_rows = block_rows
        self.blocks_per_file = blocks_per_file
        self._allocate_file = allocate_file
        self.next_block_id = next_block_id
        self.lock = threading.RLock()
        self.files: list[IngestFile] = []  # unpublished, in firstBlockId order
        self._sealed: list[IngestFile] = []

    @property
    def open_file(self) -> IngestFile | None:
        if self.files and self.files[-1].state == FileState.OPEN:
            return self.files[-1]
        return None

    def _open_block(self) -> tuple[IngestFile, Block]:
        file = self.open_file
        if file is None or len(file.blocks) >= self.blocks_per_file:
            if file is not None:
                self._seal(file)
            file = self._allocate_file(self, self.next_block_id)
            self.files.append(file)
        block = Block(block_id=self.next_block_id, rg_id=len(file.blocks),
                      capacity=self.block_rows, visibility=RGVisibility(0))
        self.next_block_id += 1
        file.blocks.append(block)
        return file, block

    def _seal(self, file: IngestFile) -> None:
        if file.state == FileState.OPEN:
            file.state = FileState.SEALED
            self._sealed.append(file)

    def append_pending(self, batch: pa.RecordBatch, ts: int, row_id_start: int,
                       handles: list[AppendHandle] | None = None) -> list[AppendHandle]:
        """Reserve rows for ``batch`` (split across blocks as needed); not yet visible.

        Each handle is added to ``handles`` the moment its rows are reserved:
        opening the next file can fail (catalog down) after earlier chunks were
        appended, and the caller must still see those handles to settle them,
        or their file could never close."""
        handles = [] if handles is None else handles
        offset = 0
        while offset < batch.num_rows:
            file = self.open_file
            block = file.blocks[-1] if file is not None and file.blocks else None
            if block is None or block.free == 0:
                file, block = self._open_block()
            assert file is not None
            take = min(block.free, batch.num_rows - offset)
            chunk = batch.slice(offset, take)
            start = block.size
            block.batches.append(chunk)
            block.size += take
            block.pending[start] = (take, False)
            block.visibility.grow(block.size)
            first_row = row_id_start + offset
            file.note_append(ts, first_row, first_row + take - 1)
            handles.append(AppendHandle(file, block, start, take, first_row))
            offset += take
        return handles

    def settle(self, handles: list[AppendHandle], mode: SettleMode) -> None:
        """publishPendingAppend: settle handles; advance visible_size over the settled prefix.

        Not called "publish": that word is the ingest file publish (publisher.py)."""
        del mode  # hidden rows are already deleted in visibility; both modes settle
        for h in handles:
            count, _ = h.block.pending[h.start]
            h.block.pending[h.start] = (count, True)
        for block in {id(h.block): h.block for h in handles}.values():
            while block.visible_size in block.pending and block.pending[block.visible_size][1]:
                count, _ = block.pending.pop(block.visible_size)
                block.visible_size += count
        for h in handles:  # a full last block seals its file once everything is settled
            if (len(h.file.blocks) >= self.blocks_per_file and h.file.blocks[-1].free == 0
                    and not h.file.blocks[-1].pending):
                self._seal(h.file)

    def seal_open_file(self) -> None:
        """Timer or shutdown flush: seal the open file if it has rows."""
        file = self.open_file
        if file is not None and file.row_count and not any(b.pending for b in file.blocks):
            self._seal(file)

    def take_sealed(self) -> list[IngestFile]:
        sealed, self._sealed = self._sealed, []
        return sealed

    def drop_file(self, file: IngestFile) -> None:
        """Object cleanup after publish: the file's rows are now read from the file."""
        self.files = [f for f in self.files if f.file_id != file.file_id]
