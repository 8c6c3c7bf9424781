"""LocalIndexService: the primary index, the MainIndex and row-id allocation of one node.

* **Primary index** (LMDB, durable on every write transaction), multi-version:
  ``(tableId, primary-key bytes, ts) -> rowId`` or a tombstone. resolvePrimary
  at T reads the latest version at or before T. Versions are what makes
  recovery exact: cleansing drops every version written at or after its
  scope's replay start (``truncate_versions``), so the index is back at the
  state the replay starts from, however far ahead of the checkpoint it was
  when the process died.
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

import grpc
import lmdb
import numpy as np
from prometheus_client import Counter

from retina_common import failpoints as fp
from retina_common.log import get_logger

log = get_logger(component="index")
ORPHANS = Counter("retina_index_orphans_total",
                  "Primary-index versions resolved to a row outside the baseline file set")

_TABLE = struct.Struct(">q")
_LEN = struct.Struct(">I")
_TS = struct.Struct(">Q")  # big-endian, so versions of a key sort by timestamp
_ROW = struct.Struct(">q")  # rowId, or TOMBSTONE
TOMBSTONE = -1
# LMDB's largest key is 511 bytes; a version key adds the table id, the key's length
# and the timestamp (20 bytes) to the primary-key bytes. UpdateRecord refuses a longer
# key (INVALID_ARGUMENT) instead of failing in the index (a retryable UNAVAILABLE that
# would be retried forever).
MAX_KEY_BYTES = 511 - 20


class IndexBackendError(Exception):
    """The index storage failed: the request must fail (BACKEND_ERROR)."""

    grpc_status = grpc.StatusCode.UNAVAILABLE


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
class DeleteTargets:
    """What a DELETE of many keys removes, grouped for the visibility update."""

    found_keys: list[bytes]  # keys with at least one row removed, in request order
    rows_by_rg: dict[tuple[int, int], list[int]]  # (fileId, rgId) -> row offsets


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


def _version_prefix(table_id: int, key: bytes) -> bytes:
    """tableId | len(key) | key: unambiguous, so no key's versions mix with another's."""
    return _TABLE.pack(table_id) + _LEN.pack(len(key)) + key


def _version_prefixes(table_id: int, keys: Iterable[bytes]) -> list[bytes]:
    """``_version_prefix`` of many keys of one table."""
    table, pack_len = _TABLE.pack(table_id), _LEN.pack
    return [table + pack_len(len(key)) + key for key in keys]


def _split_prefix(prefix: bytes) -> tuple[int, bytes]:
    (table_id,) = _TABLE.unpack(prefix[:8])
    (length,) = _LEN.unpack(prefix[8:12])
    return table_id, prefix[12:12 + length]


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

    def add(self, r: RowIdRange) -> None:
        i = bisect.bisect_left(self._starts, r.row_id_start)
        self._built = min(self._built, i)
        if i < len(self._starts) and self._starts[i] == r.row_id_start:
            self._ranges[i] = r  # idempotent re-add
            return
        self._starts.insert(i, r.row_id_start)
        self._ranges.insert(i, r)

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
        removed = [r for r in self._ranges if r.file_id == file_id]
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
        return [r for r in self._ranges if r.file_id == file_id]


class LocalIndexService:
    def __init__(self, directory: Path, *, row_id_block: int = 100_000,
                 map_size: int = 8 << 30) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        self._env = lmdb.open(str(directory / "primary.lmdb"), map_size=map_size, sync=True,
                              metasync=True, max_dbs=2)
        # Versions: tableId|len|key|ts -> rowId or TOMBSTONE; and ts|tableId|len|key -> ''
        # so that recovery can drop everything written after a replay start.
        self._primary = self._env.open_db(b"primary_versions")
        self._by_ts = self._env.open_db(b"primary_by_ts")
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

    def locate(self, row_ids: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray,
                                                   np.ndarray]:
        """``locations_of`` as arrays (found mask, file ids, rg ids, offsets), for
        row ids that are all real (no TOMBSTONE): the buffer first, then flushed files."""
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

    def switch_primary(self, table_id: int, keys: Sequence[bytes], from_rows: Sequence[int],
                       to_rows: Sequence[int]) -> int:
        """Storage GC's primary switch (updatePrimaryResolved over every version): each
        version of ``keys[i]`` that points at ``from_rows[i]`` is pointed at
        ``to_rows[i]``, at its own timestamp; a version that points elsewhere (the key
        was replaced or deleted since) is left alone. One durable LMDB transaction;
        idempotent, and the reverse call undoes it. Returns versions switched."""
        switched = 0
        try:
            with self._env.begin(write=True, db=self._primary) as txn:
                cursor = txn.cursor(db=self._primary)
                for key, old, new in zip(keys, from_rows, to_rows, strict=True):
                    prefix = _version_prefix(table_id, key)
                    want = _ROW.pack(old)
                    if not cursor.set_range(prefix):
                        continue
                    hits = []
                    for version, value in cursor:
                        if not version.startswith(prefix) or len(version) != len(prefix) + 8:
                            break
                        if value == want:
                            hits.append(version)
                    for version in hits:
                        txn.put(version, _ROW.pack(new), db=self._primary)
                    switched += len(hits)
        except lmdb.Error as exc:
            raise IndexBackendError(f"primary switch failed: {exc}") from exc
        return switched

    def versions_pointing_into(self, ranges: Sequence[tuple[int, int]],
                               limit: int = 5) -> list[tuple[int, bytes, int, int]]:
        """Versions (table, key, ts, rowId) whose rowId lies in one of the half-open
        ``ranges``; a full scan, used only when recovery finds row ids no journal
        explains."""
        found: list[tuple[int, bytes, int, int]] = []
        spans = sorted(ranges)
        starts = [a for a, _ in spans]
        with self._env.begin(db=self._primary) as txn:
            for version, value in txn.cursor(db=self._primary):
                (row_id,) = _ROW.unpack(value)
                i = bisect.bisect_right(starts, row_id) - 1
                if i >= 0 and row_id < spans[i][1]:
                    table_id, key = _split_prefix(version[:-8])
                    found.append((table_id, key, _TS.unpack(version[-8:])[0], row_id))
                    if len(found) >= limit:
                        break
        return found

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
        txn = self._env.begin(write=True, db=self._primary)
        self._batch.txn = txn
        try:
            yield
        except BaseException:
            txn.abort()
            raise
        else:
            try:
                fp.INDEX_PRIMARY_COMMIT_BEFORE.hit()
            except BaseException:
                txn.abort()
                raise
            try:
                txn.commit()
            except lmdb.Error as exc:
                raise IndexBackendError(f"primary index commit failed: {exc}") from exc
            fp.INDEX_PRIMARY_COMMIT_AFTER.hit()
        finally:
            self._batch.txn = None

    def resolve_primary(self, table_id: int, keys: Sequence[bytes],
                        baseline: Callable[[int], bool], ts: int) -> list[Resolved]:
        """resolvePrimary at ``ts``: each key's latest version at or before ``ts``
        (a tombstone at exactly ``ts`` is looked past), against the baseline set."""
        if not keys:
            return []
        pairs = self._candidates(table_id, keys, ts)
        if pairs is None:
            return [Resolved(Resolution.BACKEND_ERROR)] * len(keys)
        latest = [at if at is not None and at != TOMBSTONE else before for at, before in pairs]
        return self._classify(latest, baseline)

    def resolve_for_delete(self, table_id: int, keys: Sequence[bytes],
                           baseline: Callable[[int], bool], ts: int
                           ) -> list[list[Resolved]] | None:
        """The rows a DELETE at ``ts`` removes, per key (None on a backend error).

        DELETE_TARGETS: the key's predecessor (its latest version before
        ``ts``) and a row at exactly ``ts`` if there is one. A row at exactly
        ``ts`` can only be a stale copy of this same event, left by a retry or
        applied before a crash that a replay now redoes; the replayed INSERT
        puts a fresh copy back. A tombstone at exactly ``ts`` is looked past.
        In normal operation there is no version at ``ts`` and this is exactly
        resolvePrimary.
        """
        pairs = self._candidates(table_id, keys, ts)
        if pairs is None:
            return None
        return self._resolve_for_delete(pairs, baseline)

    def _resolve_for_delete(self, pairs: list[tuple[int | None, int | None]],
                            baseline: Callable[[int], bool]) -> list[list[Resolved]]:
        at_rows = [at if at != TOMBSTONE else None for at, _ in pairs]
        before = self._classify([b for _, b in pairs], baseline)
        found = Resolution.FOUND
        if all(r is None for r in at_rows):  # the normal case: nothing at exactly ts
            return [[b] if b.status == found else [] for b in before]
        at_ts = self._classify(at_rows, baseline)
        return [[r for r in (a, b) if r.status == found]
                for a, b in zip(at_ts, before, strict=True)]

    def delete_targets(self, table_id: int, keys: Sequence[bytes],
                       baseline: Callable[[int], bool], ts: int) -> DeleteTargets | None:
        """resolve_for_delete, grouped by row group for the visibility update (None on
        a backend error). The normal case (no version at exactly ``ts``) is resolved a
        batch at a time: one array lookup of every predecessor in the MainIndex instead
        of an object per key. The rare case takes resolve_for_delete's path."""
        pairs = self._candidates(table_id, keys, ts)
        if pairs is None:
            return None
        if any(at is not None and at != TOMBSTONE for at, _ in pairs):
            resolved = self._resolve_for_delete(pairs, baseline)
            by_rg: dict[tuple[int, int], list[int]] = {}
            found_keys = []
            for key, rows in zip(keys, resolved, strict=True):
                for r in rows:
                    assert r.location is not None
                    by_rg.setdefault((r.location.file_id, r.location.rg_id), []).append(
                        r.location.rg_row_offset)
                if rows:
                    found_keys.append(key)
            return DeleteTargets(found_keys, by_rg)
        positions = [i for i, (_, before) in enumerate(pairs)
                     if before is not None and before != TOMBSTONE]
        row_ids = np.fromiter((pairs[i][1] for i in positions), np.int64, len(positions))
        located, files, rgs, offsets = self.locate(row_ids)
        in_baseline = {f: baseline(f) for f in np.unique(files[located]).tolist()}
        found_keys = []
        by_rg = {}
        orphans = 0
        for i, ok, f, g, o in zip(positions, located.tolist(), files.tolist(), rgs.tolist(),
                                  offsets.tolist(), strict=True):
            if not ok or not in_baseline[f]:
                orphans += 1
                continue
            found_keys.append(keys[i])
            rg_rows = by_rg.get((f, g))
            if rg_rows is None:
                by_rg[(f, g)] = [o]
            else:
                rg_rows.append(o)
        if orphans:
            ORPHANS.inc(orphans)
        return DeleteTargets(found_keys, by_rg)

    def _classify(self, row_ids: Sequence[int | None],
                  baseline: Callable[[int], bool]) -> list[Resolved]:
        locations = self.locations_of([TOMBSTONE if r is None else r for r in row_ids])
        in_baseline = {f: baseline(f) for f in {loc.file_id for loc in locations if loc}}
        missing = Resolved(Resolution.NOT_FOUND_OR_ORPHAN)
        out = []
        for row_id, location in zip(row_ids, locations, strict=True):
            if row_id is None or row_id == TOMBSTONE:
                out.append(missing)
            elif location is None or not in_baseline[location.file_id]:
                ORPHANS.inc()
                out.append(Resolved(Resolution.NOT_FOUND_OR_ORPHAN, row_id))
            else:
                out.append(Resolved(Resolution.FOUND, row_id, location))
        return out

    def _candidates(self, table_id: int, keys: Sequence[bytes],
                    ts: int) -> list[tuple[int | None, int | None]] | None:
        """Per key: (the version at exactly ts, the latest version before ts); each a
        rowId, TOMBSTONE or None. None on a backend error."""
        try:
            batch = getattr(self._batch, "txn", None)
            if batch is not None:
                return self._scan(batch, table_id, keys, ts)
            with self._env.begin(db=self._primary) as txn:
                return self._scan(txn, table_id, keys, ts)
        except lmdb.Error as exc:
            log.error("primary_index_read_failed", table=table_id, error=str(exc))
            return None

    def _scan(self, txn: lmdb.Transaction[bytes], table_id: int, keys: Sequence[bytes],
              ts: int) -> list[tuple[int | None, int | None]]:
        cursor = txn.cursor(db=self._primary)
        bound, own = _TS.pack(ts + 1), _TS.pack(ts)
        unpack = _ROW.unpack
        set_range, prev, last = cursor.set_range, cursor.prev, cursor.last
        key_at, value_at = cursor.key, cursor.value
        out: list[tuple[int | None, int | None]] = []
        for prefix in _version_prefixes(table_id, keys):
            at: int | None = None
            before: int | None = None
            moved = prev() if set_range(prefix + bound) else last()
            if moved and (found := key_at()).startswith(prefix):
                if found == prefix + own:
                    at = unpack(value_at())[0]
                    moved = prev() and key_at().startswith(prefix)
                if moved:
                    before = unpack(value_at())[0]
            out.append((at, before))
        return out

    def _write(self, table_id: int, items: Iterable[tuple[bytes, int, int]],
               what: str, keep_previous: bool = True) -> list[tuple[bytes, int, bytes | None]]:
        """Write versions (key, rowId, ts) in the open batch (or a transaction of their
        own); returns what each (key, ts) held before, for restorePrimaryEntries
        (skipped with ``keep_previous=False``: inside a batch, the abort is the undo)."""
        previous = []
        pack_ts, pack_row = _TS.pack, _ROW.pack
        items = list(items)
        prefixes = _version_prefixes(table_id, (key for key, _, _ in items))
        stamps = [pack_ts(ts) for _, _, ts in items]
        versions = [p + t for p, t in zip(prefixes, stamps, strict=True)]
        try:
            with self._txn() as txn:
                if keep_previous:
                    get = txn.get
                    previous = [(key, ts, get(v, db=self._primary))
                                for (key, _, ts), v in zip(items, versions, strict=True)]
                # putmulti: the puts of a request in one call (LMDB's loop, not ours)
                txn.cursor(db=self._primary).putmulti(
                    [(v, pack_row(row_id)) for v, (_, row_id, _) in
                     zip(versions, items, strict=True)])
                txn.cursor(db=self._by_ts).putmulti(
                    [(t + p, b"") for p, t in zip(prefixes, stamps, strict=True)])
        except lmdb.Error as exc:
            raise IndexBackendError(f"{what} failed: {exc}") from exc
        return previous

    @contextmanager
    def _txn(self, write: bool = True) -> Iterator[lmdb.Transaction[bytes]]:
        """The open batch (its own writes included) if there is one, else a transaction
        of its own (read-only unless ``write``)."""
        batch = getattr(self._batch, "txn", None)
        if batch is not None:
            yield batch
            return
        with self._env.begin(write=write, db=self._primary) as txn:
            yield txn

    def put_primary_entries_only(self, table_id: int, keys: Sequence[bytes],
                                 row_ids: Sequence[int], ts: int, *, keep_previous: bool = True
                                 ) -> list[tuple[bytes, int, bytes | None]]:
        """putPrimaryEntriesOnly: a version key@ts -> new rowId; returns what was there
        (for restorePrimaryEntries)."""
        return self._write(table_id, ((k, r, ts) for k, r in zip(keys, row_ids, strict=True)),
                           "putPrimaryEntriesOnly", keep_previous)

    def truncate_targets(self, table_id: int, ts: int,
                         vnode_of: Callable[[bytes], int]) -> dict[int, list[bytes]]:
        """The keys of ``table_id`` a TRUNCATE at ``ts`` has to delete, by virtual node,
        in key order: those whose latest version at or before ``ts`` is a row id (live,
        or an orphan that resolution sorts out). A key whose latest version before
        ``ts`` is a tombstone is dead already, and a key first written after ``ts``
        cannot be touched by it.

        A tombstone at exactly ``ts`` is this TRUNCATE (or a DELETE of the same
        update) applied before: a retry, or a replay over it. It does not make the
        key dead, so the version before ``ts`` decides, as for a DELETE
        (``delete_targets``): a replay that re-inserted the key at an earlier
        timestamp put a live row under that tombstone, and the TRUNCATE applied
        again must delete it (invariant REAPPLY_CONVERGES; the fault campaign found
        a phantom row here, seed 1132 episode 49). Re-applied over nothing new, it
        rewrites its own tombstones and deletes nothing.

        One sequential scan of the table's versions (inside the open batch, its own
        writes included) serves every virtual node of a request."""
        table = _TABLE.pack(table_id)
        bound = _TS.pack(ts)
        tombstone = _ROW.pack(TOMBSTONE)
        targets: dict[int, list[bytes]] = {}

        def settle(prefix: bytes | None, before: bytes | None, at: bytes | None) -> None:
            deciding = at if at is not None and at != tombstone else before
            if prefix is not None and deciding is not None and deciding != tombstone:
                key = _split_prefix(prefix)[1]
                targets.setdefault(vnode_of(key), []).append(key)

        try:
            with self._txn(write=False) as txn:
                cursor = txn.cursor(db=self._primary)
                prefix: bytes | None = None
                before: bytes | None = None  # the latest version before ts
                at: bytes | None = None  # the version at exactly ts
                if cursor.set_range(table):
                    for version, value in cursor:
                        if not version.startswith(table):
                            break
                        if version[:-8] != prefix:
                            settle(prefix, before, at)
                            prefix, before, at = version[:-8], None, None
                        stamp = version[-8:]  # big-endian: byte order is ts order
                        if stamp < bound:
                            before = value
                        elif stamp == bound:
                            at = value
                settle(prefix, before, at)
        except lmdb.Error as exc:
            raise IndexBackendError(f"primary index scan failed: {exc}") from exc
        return targets

    def tombstone_primary_resolved(self, table_id: int, keys: Sequence[bytes], ts: int) -> None:
        """tombstonePrimaryResolved: the keys' rows were deleted at ``ts``."""
        self._write(table_id, ((k, TOMBSTONE, ts) for k in keys), "tombstonePrimaryResolved",
                    keep_previous=False)

    def restore_primary_entries(self, table_id: int,
                                previous: Sequence[tuple[bytes, int, bytes | None]]) -> None:
        """restorePrimaryEntries: undo a putPrimaryEntriesOnly (compensation)."""
        try:
            with self._txn() as txn:
                for key, ts, value in previous:
                    prefix = _version_prefix(table_id, key)
                    version = prefix + _TS.pack(ts)
                    if value is None:
                        txn.delete(version, db=self._primary)
                        txn.delete(_TS.pack(ts) + prefix, db=self._by_ts)
                    else:
                        txn.put(version, value, db=self._primary)
        except lmdb.Error as exc:
            raise IndexBackendError(f"restorePrimaryEntries failed: {exc}") from exc

    def truncate_versions(self, min_ts: int, start_of: Callable[[int, bytes], int],
                          kept: Callable[[int, bytes, int, int], None] | None = None) -> int:
        """Remove every version written at or after its scope's replay start.

        ``start_of(table_id, key)`` gives the scope's start; only versions at or
        after ``min_ts`` (the smallest start) are looked at, through the
        by-timestamp index. Recovery calls this during cleansing so that the
        index holds exactly the state as of each replay start; replay redoes
        the rest. ``kept(table_id, key, ts, row_id)`` is told every version of
        that range that stays (in the same scan: the rewind checks them).
        Returns the number of versions removed.
        """
        removed = 0
        try:
            with self._env.begin(write=True) as txn:
                cursor = txn.cursor(db=self._by_ts)
                if not cursor.set_range(_TS.pack(min_ts)):
                    return 0
                doomed = []
                for entry in cursor.iternext(keys=True, values=False):
                    ts = _TS.unpack(entry[:8])[0]
                    table_id, key = _split_prefix(entry[8:])
                    if ts >= start_of(table_id, key):
                        doomed.append((entry, entry[8:] + entry[:8]))
                    elif kept is not None:
                        value = txn.get(entry[8:] + entry[:8], db=self._primary)
                        if value is not None:
                            kept(table_id, key, ts, _ROW.unpack(value)[0])
                for by_ts, version in doomed:
                    txn.delete(by_ts, db=self._by_ts)
                    txn.delete(version, db=self._primary)
                    removed += 1
        except lmdb.Error as exc:
            raise IndexBackendError(f"primary index truncation failed: {exc}") from exc
        return removed

    # --- version pruning (the GC scheduler: retina_server/gc/gc_scheduler.py) ---
    def prune_versions(self, horizon: int, since: int = 0, *, keys_per_txn: int = 5_000,
                       entries_per_txn: int = 50_000) -> int:
        """Remove the primary-index versions no resolution at or above ``horizon`` reads.

        Rule, per key: of its versions with ``ts < horizon`` only the latest one
        (call it L) stays, and L goes too when it is a TOMBSTONE. Versions at or
        above ``horizon`` are never touched; ``horizon <= 0`` removes nothing.

        Invariant PRUNE_KEEPS_ANSWERS_ABOVE_HORIZON: resolvePrimary and
        resolve_for_delete answer exactly as before at every ``T >= horizon``.
        Proof: per key both read only (a) the version at exactly ``T`` and (b) the
        latest version with ``ts < T``, and both give "no version" and a TOMBSTONE
        the same answer (nothing found). (a) has ``ts = T >= horizon``: untouched.
        (b): if the key has a version in ``[horizon, T)``, the latest of them is (b)
        before and after, untouched. Otherwise (b) was L: it is still there when it
        is a row id; when it was a TOMBSTONE, no version below ``horizon`` is left,
        so (b) is "no version", the same answer as the tombstone gave. QED.

        It holds through a rewind too: ``truncate_versions`` from a start
        ``s >= horizon`` keeps exactly the versions below ``s``, whose part below
        ``horizon`` is the same with or without the truncation, so pruning and
        truncation commute and the replay's resolutions (at ``T >= s``) are exact.
        That is why the scheduler's horizon is at most the replay floor (the lowest
        replay start any restart can use). Precondition: nothing writes a version
        below ``horizon`` afterwards (the scheduler's horizon is at most safeGcTs,
        below the HWM, so every write transaction below it has ended; a replay
        writes at or above its start).

        Incremental: after a prune at ``h1`` every key has at most one version below
        ``h1``, a row id, so at ``h2 > h1`` only keys with a version in ``[h1, h2)``
        can have anything to remove. They are found by scanning ``primary_by_ts``
        from ``since`` (the previous horizon; 0 for every key) up to ``horizon``.
        Bounded work: keys are pruned in LMDB write transactions of at most
        ``keys_per_txn`` keys (found within ``entries_per_txn`` by-timestamp
        entries), so a concurrent UpdateRecord waits for one short transaction at
        most. A key's versions and their ``primary_by_ts`` entries go in the same
        transaction: a crash leaves both dbs consistent and some keys not yet
        pruned (the next process prunes from ``since = 0`` and finds them).

        Never call it inside a ``write_batch`` (one LMDB writer per thread:
        RuntimeError). Returns the number of versions removed; IndexBackendError on
        a storage failure (the transactions committed before it stay).
        """
        if getattr(self._batch, "txn", None) is not None:
            raise RuntimeError("prune_versions inside a write_batch would deadlock LMDB")
        if horizon <= 0 or since >= horizon:
            return 0
        end = _TS.pack(horizon)
        position: bytes | None = _TS.pack(max(since, 0))
        removed = 0
        try:
            while position is not None:
                prefixes, position = self._keys_written(position, end, keys_per_txn,
                                                        entries_per_txn)
                if prefixes:
                    removed += self._prune_keys(sorted(prefixes), end)
        except lmdb.Error as exc:
            raise IndexBackendError(f"primary index pruning failed: {exc}") from exc
        return removed

    def _keys_written(self, start: bytes, end: bytes, max_keys: int,
                      max_entries: int) -> tuple[set[bytes], bytes | None]:
        """Distinct key prefixes of the ``primary_by_ts`` entries in ``[start, end)``,
        from ``start`` on, and the entry the next chunk starts at (None: done)."""
        found: set[bytes] = set()
        with self._env.begin(db=self._by_ts) as txn:
            cursor = txn.cursor(db=self._by_ts)
            if not cursor.set_range(start):
                return found, None
            for scanned, entry in enumerate(cursor.iternext(keys=True, values=False)):
                if entry[:8] >= end:
                    return found, None
                if len(found) >= max_keys or scanned >= max_entries:
                    return found, entry  # not consumed: the next chunk starts here
                found.add(entry[8:])
        return found, None

    def _prune_keys(self, prefixes: Sequence[bytes], end: bytes) -> int:
        """Apply the pruning rule to each key (``tableId|len|key``) in one write txn."""
        doomed: list[bytes] = []
        with self._env.begin(write=True, db=self._primary) as txn:
            cursor = txn.cursor(db=self._primary)
            for prefix in prefixes:
                width = len(prefix) + 8
                below: list[bytes] = []
                last = b""
                moved = cursor.set_range(prefix)
                while moved:
                    version = cursor.key()
                    if (len(version) != width or not version.startswith(prefix)
                            or version[-8:] >= end):
                        break
                    below.append(version)
                    last = cursor.value()
                    moved = cursor.next()
                if not below:
                    continue
                doomed.extend(below[:-1])
                if _ROW.unpack(last)[0] == TOMBSTONE:
                    doomed.append(below[-1])
            for version in doomed:
                txn.delete(version, db=self._primary)
                txn.delete(version[-8:] + version[:-8], db=self._by_ts)
        return len(doomed)

    def primary_version_count(self) -> int:
        """Versions in the primary index (LMDB's entry count: O(1))."""
        try:
            with self._env.begin() as txn:
                return int(txn.stat(self._primary)["entries"])
        except lmdb.Error as exc:
            raise IndexBackendError(f"primary index stat failed: {exc}") from exc

    def versions(self) -> list[tuple[int, bytes, int, int]]:
        """Every version as (tableId, key, ts, rowId or TOMBSTONE), in key then ts
        order. A full scan: for tests and diagnostics only."""
        with self._env.begin(db=self._primary) as txn:
            return [(*_split_prefix(version[:-8]), _TS.unpack(version[-8:])[0],
                     _ROW.unpack(value)[0])
                    for version, value in txn.cursor(db=self._primary)]

    def version_index_mismatches(self, limit: int = 10) -> list[str]:
        """Diagnostics (a full scan of both dbs): versions without their
        ``primary_by_ts`` entry and entries without their version; [] when they agree."""
        problems: list[str] = []
        with self._env.begin(db=self._primary) as txn:
            for version in txn.cursor(db=self._primary).iternext(values=False):
                if txn.get(version[-8:] + version[:-8], db=self._by_ts) is None:
                    problems.append(f"version {version.hex()} has no by-ts entry")
                    if len(problems) >= limit:
                        return problems
            for entry in txn.cursor(db=self._by_ts).iternext(values=False):
                if txn.get(entry[8:] + entry[:8], db=self._primary) is None:
                    problems.append(f"by-ts entry {entry.hex()} has no version")
                    if len(problems) >= limit:
                        return problems
        return problems
