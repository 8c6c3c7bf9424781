"""LocalIndexService: the primary index, the MainIndex and row-id allocation of one node.

* **Primary index** (LMDB, durable on every write transaction): ``(tableId,
  primary-key bytes) -> rowId``, or a tombstone once the row is deleted.
* **MainIndex**: ``rowId range -> RowLocation(fileId, rgId, rgRowOffset)``.
  Ranges of rows still in the write buffer live in the MainIndexBuffer
  (memory); ``flush_file`` makes a file's ranges durable in SQLite: buffer
  snapshot -> one SQLite transaction (ranges + flush marker) -> commit ->
  drop the buffer entries (C00.2). A retried flush writes the same rows
  again (``INSERT OR REPLACE``), so it is idempotent.
* **Row ids** are reserved in durable blocks (SQLite), never reused.

Every write path (normal writes, replay, Storage GC) goes through the staged
primitives of specification section 5: resolvePrimary, putMainIndexEntries,
putPrimaryEntriesOnly, tombstonePrimaryResolved, updatePrimaryResolved,
restorePrimaryEntries, deleteMainIndexRange.

resolvePrimary answers FOUND / NOT_FOUND_OR_ORPHAN / BACKEND_ERROR against
the *baseline visible file set* supplied by the caller: a key whose row lives
in a file outside it (dropped memtable, unpublished or retired file) is an
orphan, never a match. Only BACKEND_ERROR may fail a request.
"""

from __future__ import annotations

import bisect
import sqlite3
import struct
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path

import lmdb

from retina_common import failpoints as fp
from retina_common.log import get_logger

log = get_logger(component="index")

_KEY_PREFIX = struct.Struct(">q")
_VALUE = struct.Struct(">qq")  # rowId (-1 = tombstone), timestamp
TOMBSTONE = -1


class IndexBackendError(Exception):
    """The index storage failed: the request must fail (BACKEND_ERROR)."""


class Resolution(StrEnum):
    FOUND = "FOUND"
    NOT_FOUND_OR_ORPHAN = "NOT_FOUND_OR_ORPHAN"
    BACKEND_ERROR = "BACKEND_ERROR"


@dataclass(frozen=True)
class RowLocation:
    file_id: int
    rg_id: int
    rg_row_offset: int


@dataclass(frozen=True)
class Resolved:
    status: Resolution
    row_id: int = -1
    location: RowLocation | None = None


@dataclass(frozen=True)
class RowIdRange:
    """Rows ``[row_id_start, row_id_start + count)`` at ``(file, rg, offset...)``."""

    row_id_start: int
    count: int
    file_id: int
    rg_id: int
    rg_row_offset: int

    @property
    def row_id_end(self) -> int:
        return self.row_id_start + self.count


def primary_key(table_id: int, key: bytes) -> bytes:
    return _KEY_PREFIX.pack(table_id) + key


class _RangeMap:
    """Sorted, non-overlapping row-id ranges with O(log n) point lookup."""

    def __init__(self) -> None:
        self._starts: list[int] = []
        self._ranges: list[RowIdRange] = []

    def add(self, r: RowIdRange) -> None:
        i = bisect.bisect_left(self._starts, r.row_id_start)
        if i < len(self._starts) and self._starts[i] == r.row_id_start:
            self._ranges[i] = r  # idempotent re-add
            return
        self._starts.insert(i, r.row_id_start)
        self._ranges.insert(i, r)

    def find(self, row_id: int) -> RowLocation | None:
        i = bisect.bisect_right(self._starts, row_id) - 1
        if i < 0:
            return None
        r = self._ranges[i]
        if row_id >= r.row_id_end:
            return None
        return RowLocation(r.file_id, r.rg_id, r.rg_row_offset + (row_id - r.row_id_start))

    def remove_file(self, file_id: int) -> list[RowIdRange]:
        removed = [r for r in self._ranges if r.file_id == file_id]
        if removed:
            kept = [r for r in self._ranges if r.file_id != file_id]
            self._ranges = kept
            self._starts = [r.row_id_start for r in kept]
        return removed

    def of_file(self, file_id: int) -> list[RowIdRange]:
        return [r for r in self._ranges if r.file_id == file_id]


class LocalIndexService:
    def __init__(self, directory: Path, *, row_id_block: int = 100_000,
                 map_size: int = 8 << 30) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        self._env = lmdb.open(str(directory / "primary.lmdb"), map_size=map_size, sync=True,
                              metasync=True, max_dbs=1)
        self._sqlite = sqlite3.connect(str(directory / "main_index.sqlite"),
                                       check_same_thread=False, isolation_level=None)
        self._sqlite.execute("PRAGMA journal_mode=WAL")
        self._sqlite.execute("PRAGMA synchronous=FULL")
        self._sqlite.executescript("""
            CREATE TABLE IF NOT EXISTS row_id_ranges (
                row_id_start INTEGER PRIMARY KEY, row_count INTEGER NOT NULL,
                file_id INTEGER NOT NULL, rg_id INTEGER NOT NULL,
                rg_row_offset INTEGER NOT NULL);
            CREATE INDEX IF NOT EXISTS row_id_ranges_by_file ON row_id_ranges (file_id);
            CREATE TABLE IF NOT EXISTS row_id_range_flush_markers (
                file_id INTEGER PRIMARY KEY, row_count INTEGER NOT NULL);
            CREATE TABLE IF NOT EXISTS sequences (
                name TEXT PRIMARY KEY, next_unreserved INTEGER NOT NULL);
        """)
        self._lock = threading.RLock()
        self._batch = threading.local()  # the request's open LMDB write transaction
        self._flushed = _RangeMap()
        self._buffer = _RangeMap()
        for row in self._sqlite.execute("SELECT row_id_start, row_count, file_id, rg_id, "
                                        "rg_row_offset FROM row_id_ranges"):
            self._flushed.add(RowIdRange(*row))
        self._block = row_id_block
        # name -> [next, reserved_to]
        self._sequences: dict[str, list[int]] = {
            name: [value, value] for name, value in
            self._sqlite.execute("SELECT name, next_unreserved FROM sequences")}

    def close(self) -> None:
        with self._lock:
            self._env.close()
            self._sqlite.close()

    # --- durable sequences: row ids, file sequence numbers, block ids ---
    def allocate(self, name: str, count: int = 1) -> int:
        """Reserve ``count`` consecutive values of sequence ``name``; returns the first.

        Values are reserved in durable blocks, so none is ever reused, even
        after a crash (a crash skips the rest of a block).
        """
        with self._lock:
            state = self._sequences.setdefault(name, [0, 0])
            if state[0] + count > state[1]:
                new_bound = state[0] + max(count, self._block)
                try:
                    self._sqlite.execute(
                        "INSERT INTO sequences (name, next_unreserved) VALUES (?, ?) "
                        "ON CONFLICT (name) DO UPDATE "
                        "SET next_unreserved = excluded.next_unreserved",
                        (name, new_bound))
                except sqlite3.Error as exc:
                    raise IndexBackendError(f"sequence {name} reservation failed: {exc}") \
                        from exc
                state[1] = new_bound
            first = state[0]
            state[0] += count
            return first

    def allocate_row_ids(self, count: int) -> int:
        """Reserve ``count`` consecutive row ids; returns the first. Never reused."""
        return self.allocate("row_id", count)

    # --- MainIndex ---
    def put_main_index_entries(self, ranges: Iterable[RowIdRange]) -> None:
        """putMainIndexEntries: rows now in the write buffer (MainIndexBuffer)."""
        with self._lock:
            for r in ranges:
                self._buffer.add(r)

    def location_of(self, row_id: int) -> RowLocation | None:
        with self._lock:
            return self._buffer.find(row_id) or self._flushed.find(row_id)

    def locations_of(self, row_ids: Sequence[int]) -> list[RowLocation | None]:
        """location_of for a batch, under one lock acquisition."""
        buffer_find, flushed_find = self._buffer.find, self._flushed.find
        with self._lock:
            return [None if r == TOMBSTONE else (buffer_find(r) or flushed_find(r))
                    for r in row_ids]

    def flush_file(self, file_id: int) -> int:
        """flushIndexEntriesOfFile: make a file's ranges durable; returns rows flushed."""
        with self._lock:
            ranges = self._buffer.of_file(file_id)  # snapshot; dropped only after commit
            if not ranges:
                done = self.flushed_row_count(file_id)
                if done is not None:
                    return done  # a retry after a successful flush: nothing to redo
            rows = sum(r.count for r in ranges)
            try:
                self._sqlite.execute("BEGIN IMMEDIATE")
                self._sqlite.executemany(
                    "INSERT OR REPLACE INTO row_id_ranges VALUES (?, ?, ?, ?, ?)",
                    [(r.row_id_start, r.count, r.file_id, r.rg_id, r.rg_row_offset)
                     for r in ranges])
                self._sqlite.execute(
                    "INSERT OR REPLACE INTO row_id_range_flush_markers VALUES (?, ?)",
                    (file_id, rows))
                self._sqlite.execute("COMMIT")
            except sqlite3.Error as exc:
                if self._sqlite.in_transaction:
                    self._sqlite.execute("ROLLBACK")
                raise IndexBackendError(f"MainIndex flush of file {file_id} failed: {exc}") \
                    from exc
            for r in ranges:
                self._flushed.add(r)
            self._buffer.remove_file(file_id)
            return rows

    def flushed_row_count(self, file_id: int) -> int | None:
        found = self._sqlite.execute(
            "SELECT row_count FROM row_id_range_flush_markers WHERE file_id = ?",
            (file_id,)).fetchone()
        return None if found is None else int(found[0])

    def ranges_of_file(self, file_id: int) -> list[RowIdRange]:
        with self._lock:
            return self._flushed.of_file(file_id) + self._buffer.of_file(file_id)

    def delete_main_index_range(self, file_id: int) -> None:
        """deleteMainIndexRange: forget every range of a file (after it is retired)."""
        with self._lock:
            try:
                self._sqlite.execute("BEGIN IMMEDIATE")
                self._sqlite.execute("DELETE FROM row_id_ranges WHERE file_id = ?", (file_id,))
                self._sqlite.execute("DELETE FROM row_id_range_flush_markers WHERE file_id = ?",
                                     (file_id,))
                self._sqlite.execute("COMMIT")
            except sqlite3.Error as exc:
                if self._sqlite.in_transaction:
                    self._sqlite.execute("ROLLBACK")
                raise IndexBackendError(f"deleteMainIndexRange({file_id}) failed: {exc}") from exc
            self._flushed.remove_file(file_id)
            self._buffer.remove_file(file_id)

    def drop_buffer_of_file(self, file_id: int) -> None:
        with self._lock:
            self._buffer.remove_file(file_id)

    # --- primary index ---
    @contextmanager
    def write_batch(self) -> Iterator[None]:
        """Every primary-index write inside the block is one durable LMDB transaction.

        One fsync per request instead of one per step. Reads inside the block
        see the block's own writes. If the commit fails nothing of the block
        is durable and IndexBackendError is raised.
        """
        if getattr(self._batch, "txn", None) is not None:
            yield  # already inside a batch
            return
        txn = self._env.begin(write=True)
        self._batch.txn = txn
        try:
            yield
        except BaseException:
            txn.abort()
            raise
        else:
            try:
                fp.PRIMARY_COMMIT_BEFORE.hit()
            except BaseException:
                txn.abort()
                raise
            try:
                txn.commit()
            except lmdb.Error as exc:
                raise IndexBackendError(f"primary index commit failed: {exc}") from exc
            fp.PRIMARY_COMMIT_AFTER.hit()
        finally:
            self._batch.txn = None

    def resolve_primary(self, table_id: int, keys: Sequence[bytes],
                        baseline: Callable[[int], bool]) -> list[Resolved]:
        """resolvePrimary for each key against the baseline visible file set."""
        prefix = _KEY_PREFIX.pack(table_id)
        full = [prefix + k for k in keys]
        try:
            batch = getattr(self._batch, "txn", None)
            if batch is not None:
                values = [batch.get(k) for k in full]
            else:
                with self._env.begin() as txn:
                    found = dict(txn.cursor().getmulti(full))
                values = [found.get(k) for k in full]
        except lmdb.Error as exc:
            log.error("primary_index_read_failed", table=table_id, error=str(exc))
            return [Resolved(Resolution.BACKEND_ERROR)] * len(keys)
        unpack = _VALUE.unpack
        row_ids = [TOMBSTONE if v is None else unpack(v)[0] for v in values]
        locations = self.locations_of(row_ids)
        in_baseline = {f: baseline(f) for f in {loc.file_id for loc in locations if loc}}
        missing = Resolved(Resolution.NOT_FOUND_OR_ORPHAN)
        out = []
        for value, row_id, location in zip(values, row_ids, locations, strict=True):
            if value is None:
                out.append(missing)
            elif location is None or not in_baseline[location.file_id]:
                out.append(Resolved(Resolution.NOT_FOUND_OR_ORPHAN, row_id))
            else:
                out.append(Resolved(Resolution.FOUND, row_id, location))
        return out

    def _write(self, table_id: int, items: Iterable[tuple[bytes, int, int]],
               what: str) -> list[tuple[bytes, bytes | None]]:
        """Put (key, rowId, ts) items in one durable LMDB transaction; returns old values."""
        previous = []
        prefix, pack = _KEY_PREFIX.pack(table_id), _VALUE.pack
        try:
            with self._txn() as txn:
                get, put = txn.get, txn.put
                for key, row_id, ts in items:
                    full = prefix + key
                    previous.append((key, get(full)))
                    put(full, pack(row_id, ts))
        except lmdb.Error as exc:
            raise IndexBackendError(f"{what} failed: {exc}") from exc
        return previous

    @contextmanager
    def _txn(self) -> Iterator[lmdb.Transaction]:
        """The open batch if there is one, else a transaction of its own."""
        batch = getattr(self._batch, "txn", None)
        if batch is not None:
            yield batch
            return
        with self._env.begin(write=True) as txn:
            yield txn

    def put_primary_entries_only(self, table_id: int, keys: Sequence[bytes],
                                 row_ids: Sequence[int], ts: int
                                 ) -> list[tuple[bytes, bytes | None]]:
        """putPrimaryEntriesOnly: key -> new rowId; returns the previous values
        (for restorePrimaryEntries)."""
        return self._write(table_id, ((k, r, ts) for k, r in zip(keys, row_ids, strict=True)),
                           "putPrimaryEntriesOnly")

    def tombstone_primary_resolved(self, table_id: int, keys: Sequence[bytes], ts: int) -> None:
        """tombstonePrimaryResolved: the keys' rows were deleted at ``ts``."""
        self._write(table_id, ((k, TOMBSTONE, ts) for k in keys), "tombstonePrimaryResolved")

    def update_primary_resolved(self, table_id: int, keys: Sequence[bytes],
                                row_ids: Sequence[int], ts: int) -> None:
        """updatePrimaryResolved: point resolved keys at their new rows."""
        self._write(table_id, ((k, r, ts) for k, r in zip(keys, row_ids, strict=True)),
                    "updatePrimaryResolved")

    def restore_primary_entries(self, table_id: int,
                                previous: Sequence[tuple[bytes, bytes | None]]) -> None:
        """restorePrimaryEntries: undo a putPrimaryEntriesOnly (compensation)."""
        try:
            with self._txn() as txn:
                for key, value in previous:
                    full = primary_key(table_id, key)
                    if value is None:
                        txn.delete(full)
                    else:
                        txn.put(full, value)
        except lmdb.Error as exc:
            raise IndexBackendError(f"restorePrimaryEntries failed: {exc}") from exc
