"""The MainIndex and the durable sequences (row ids among them) of one node, on SQLite.

* **MainIndex**: ``rowId range -> RowLocation(fileId, rgId, rgRowOffset)``.
  Ranges of rows still in the write buffer live in the MainIndexBuffer
  (memory); ``flush_file`` makes a file's ranges durable in SQLite: buffer
  snapshot -> one SQLite transaction (ranges + flush marker) -> commit ->
  drop the buffer entries (C00.2). A retried flush writes the same rows
  again (``INSERT OR REPLACE``), so it is idempotent.
* **Sequences** (row ids, file sequence numbers, block ids, ...) are reserved in
  durable blocks in the same SQLite database, never reused.

Both share one SQLite connection (autocommit; every transaction is explicit) and
one lock, so no two threads interleave statements of two transactions on it.
"""

from __future__ import annotations

import bisect
import sqlite3
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from retina_server.index_errors import IndexBackendError


@dataclass(frozen=True)
class RowLocation:
    file_id: int
    rg_id: int
    rg_row_offset: int


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


_FEW = 8  # MainIndex.locate: up to this many row ids, one bisect each


class _RangeMap:
    """Sorted, non-overlapping row-id ranges with O(log n) point lookup."""

    def __init__(self) -> None:
        self._starts: list[int] = []
        self._ranges: list[RowIdRange] = []
        # The ranges as five arrays for ``locate`` (start, end, file, rg, offset), with room
        # to grow: entries [0, _built) mirror _ranges. A change marks the entries from its
        # position on as stale; ``_arrays`` refills only those, so the usual add (new row
        # ids, near the end) costs what it adds, not the whole map (which holds every range
        # ever flushed on this node).
        self._columns = [np.empty(0, np.int64) for _ in range(5)]
        self._built = 0
        # file id -> row-id start -> its range: a file's ranges without a scan of the map
        # (a Storage GC commit reads those of every old file it replaces).
        self._by_file: dict[int, dict[int, RowIdRange]] = {}

    def add(self, r: RowIdRange) -> None:
        i = bisect.bisect_left(self._starts, r.row_id_start)
        self._built = min(self._built, i)
        if i < len(self._starts) and self._starts[i] == r.row_id_start:
            self._unindex(self._ranges[i])
            self._ranges[i] = r  # idempotent re-add
        else:
            self._starts.insert(i, r.row_id_start)
            self._ranges.insert(i, r)
        self._by_file.setdefault(r.file_id, {})[r.row_id_start] = r

    def _unindex(self, r: RowIdRange) -> None:
        of_file = self._by_file.get(r.file_id)
        if of_file is not None:
            of_file.pop(r.row_id_start, None)
            if not of_file:
                del self._by_file[r.file_id]

    def _arrays(self) -> list[np.ndarray]:
        n = len(self._ranges)
        if self._built < n:
            if len(self._columns[0]) < n:
                capacity = max(n, 2 * len(self._columns[0]), 64)
                grown = [np.empty(capacity, np.int64) for _ in range(5)]
                for new, old in zip(grown, self._columns, strict=True):
                    new[:self._built] = old[:self._built]
                self._columns = grown
            tail = np.array([(r.row_id_start, r.row_id_start + r.count, r.file_id, r.rg_id,
                              r.rg_row_offset) for r in self._ranges[self._built:]],
                            np.int64).reshape(-1, 5)
            for k, column in enumerate(self._columns):
                column[self._built:n] = tail[:, k]
            self._built = n
        return [column[:n] for column in self._columns]

    def locate(self, row_ids: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray,
                                                   np.ndarray]:
        """``find`` of many row ids at once: (found mask, file ids, rg ids, offsets);
        the last three are meaningful only where the mask is set."""
        if not len(row_ids) or not self._ranges:
            zero = np.zeros(len(row_ids), np.int64)
            return np.zeros(len(row_ids), bool), zero, zero, zero
        starts, ends, files, rgs, offsets = self._arrays()
        i = np.searchsorted(starts, row_ids, side="right") - 1
        found = i >= 0
        i[~found] = 0
        found &= row_ids < ends[i]
        return found, files[i], rgs[i], offsets[i] + (row_ids - starts[i])

    def find(self, row_id: int) -> RowLocation | None:
        i = bisect.bisect_right(self._starts, row_id) - 1
        if i < 0:
            return None
        r = self._ranges[i]
        if row_id >= r.row_id_end:
            return None
        return RowLocation(r.file_id, r.rg_id, r.rg_row_offset + (row_id - r.row_id_start))

    def remove_file(self, file_id: int) -> list[RowIdRange]:
        removed = self.of_file(file_id)
        self._by_file.pop(file_id, None)
        if removed:
            kept = [r for r in self._ranges if r.file_id != file_id]
            # The current prefix of the arrays is compacted the same way (in C); the rest
            # stays stale until a lookup needs it.
            keep = self._columns[2][:self._built] != file_id
            current = int(keep.sum())
            for column in self._columns:
                column[:current] = column[:self._built][keep]
            self._built = current
            self._ranges = kept
            self._starts = [r.row_id_start for r in kept]
        return removed

    def of_file(self, file_id: int) -> list[RowIdRange]:
        """The file's ranges in row-id order."""
        of_file = self._by_file.get(file_id, {})
        return [of_file[start] for start in sorted(of_file)]



class SqliteStore:
    """The node's SQLite database of MainIndex ranges, flush markers and sequences."""

    def __init__(self, path: Path) -> None:
        self.connection = sqlite3.connect(str(path), check_same_thread=False,
                                          isolation_level=None)
        self.connection.execute("PRAGMA journal_mode=WAL")
        self.connection.execute("PRAGMA synchronous=FULL")
        self.connection.executescript("""
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
        self.lock = threading.RLock()

    def close(self) -> None:
        with self.lock:
            self.connection.close()


class Sequences:
    """Durable sequences: row ids, file sequence numbers, block ids, ..."""

    def __init__(self, store: SqliteStore, block: int) -> None:
        self._sqlite = store.connection
        self._lock = store.lock
        self._block = block
        # name -> [next, reserved_to]
        self._sequences: dict[str, list[int]] = {
            name: [value, value] for name, value in
            self._sqlite.execute("SELECT name, next_unreserved FROM sequences")}

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



class MainIndex:
    """``rowId range -> RowLocation``: buffered ranges in memory, flushed ones in SQLite."""

    def __init__(self, store: SqliteStore) -> None:
        self._sqlite = store.connection
        self._lock = store.lock
        self._flushed = _RangeMap()
        self._buffer = _RangeMap()
        for row in self._sqlite.execute("SELECT row_id_start, row_count, file_id, rg_id, "
                                        "rg_row_offset FROM row_id_ranges"):
            self._flushed.add(RowIdRange(*row))

    def put_main_index_entries(self, ranges: Iterable[RowIdRange]) -> None:
        """putMainIndexEntries: rows now in the write buffer (MainIndexBuffer)."""
        with self._lock:
            for r in ranges:
                self._buffer.add(r)

    def location_of(self, row_id: int) -> RowLocation | None:
        with self._lock:
            return self._buffer.find(row_id) or self._flushed.find(row_id)

    def locations_of(self, row_ids: Sequence[int]) -> list[RowLocation | None]:
        """location_of for a batch, under one lock acquisition. A negative id (the
        primary index's TOMBSTONE) is no row: None."""
        buffer_find, flushed_find = self._buffer.find, self._flushed.find
        with self._lock:
            return [None if r < 0 else (buffer_find(r) or flushed_find(r)) for r in row_ids]

    def locate(self, row_ids: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray,
                                                   np.ndarray]:
        """``locations_of`` as arrays (found mask, file ids, rg ids, offsets), for
        row ids that are all real (none negative): the buffer first, then flushed files."""
        if len(row_ids) <= _FEW:  # a few point lookups cost less than the array machinery
            located = self.locations_of(row_ids.tolist())
            hits = [(loc.file_id, loc.rg_id, loc.rg_row_offset) if loc else (0, 0, 0)
                    for loc in located]
            columns = np.array(hits, np.int64).reshape(-1, 3).T
            return (np.array([loc is not None for loc in located], bool), *columns)
        with self._lock:
            found, files, rgs, offsets = self._buffer.locate(row_ids)
            if not found.all():
                flushed, f_files, f_rgs, f_offsets = self._flushed.locate(row_ids)
                take = ~found & flushed
                files = np.where(take, f_files, files)
                rgs = np.where(take, f_rgs, rgs)
                offsets = np.where(take, f_offsets, offsets)
                found = found | flushed
        return found, files, rgs, offsets

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

    def ranges_of_file(self, file_id: int) -> list[RowIdRange]:
        """Every durable or buffered MainIndex range of a file, in row-id order."""
        with self._lock:
            return sorted(self._flushed.of_file(file_id) + self._buffer.of_file(file_id),
                          key=lambda r: r.row_id_start)

    def files_with_ranges(self) -> set[int]:
        """Files that have durable MainIndex ranges."""
        with self._lock:
            return {int(f) for (f,) in self._sqlite.execute(
                "SELECT DISTINCT file_id FROM row_id_ranges")}
