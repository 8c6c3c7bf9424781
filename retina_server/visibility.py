"""Row-group visibility: which rows of a row group are deleted at a snapshot.

Per ``(fileId, rgId)`` an :class:`RGVisibility` holds a base timestamp, a base
bitmap of rows deleted at or before it (a compressed roaring bitmap: close to
one bit per row, far less when deletes are sparse), and a deletion chain of
``(row, ts)`` items newer than the base. ``deleted_at(ts)`` is the base plus
every chain item with ``ts <= snapshot``.

Invariants (specification C03.7, section 5):

* DELETE_FORK: a DELETE at ``T <= baseTimestamp`` is folded copy-on-write
  into the base bitmap (no chain item); ``T > baseTimestamp`` appends a chain
  item at ``T``. Readers holding the old base never see it change.
* FOLD_SAFE: folding up to ``safe_ts`` moves chain items with ``ts <= safe_ts``
  into the base and sets ``baseTimestamp = safe_ts``; callers pass a
  ``safe_ts`` below every live snapshot, so no snapshot's answer changes.
* DELETE_IDEMPOTENT: deleting a row that is already deleted at or before
  ``T`` changes nothing, so a retried request converges.
* NO_READ_BELOW_FOLD: ``deleted_at(ts)`` with ``ts`` below the base timestamp
  raises the snapshot_expired refusal (retina_common/refusal.py): the base no
  longer tells which of its rows were deleted after ``ts``, so an answer would be
  wrong. Every read (QueryVisibility, GetWriteBuffer, a Storage GC prepare) goes
  through it, and a Storage GC output's base is its cutoff, so a rewritten file
  refuses what it dropped too.

A checkpoint keeps the base and the chain up to its ``checkpointAppliedTs``
(:func:`checkpoint_entry`, :func:`restore`), so a restarted node answers the same
history (docs/history.md).
"""

from __future__ import annotations

import bisect
import threading
from collections.abc import Iterable
from typing import NamedTuple

import grpc
import numpy as np
from pyroaring import BitMap

from retina_common.checkpoint_store import RGEntry
from retina_common.refusal import snapshot_expired


class VisibilityError(Exception):
    """An operation names a row group or row that does not exist."""

    grpc_status = grpc.StatusCode.NOT_FOUND


_ABOVE_EVERY_ROW = float("inf")  # (ts, _ABOVE_EVERY_ROW) sorts after every (ts, row)


class RGVisibility:
    __slots__ = ("_base", "_base_ts", "_by_ts", "_chain", "_chain_max", "_lock", "row_count")

    def __init__(self, row_count: int = 0, base_ts: int = 0,
                 base: BitMap | None = None, chain: dict[int, int] | None = None) -> None:
        self.row_count = row_count
        self._base_ts = base_ts
        self._base = BitMap() if base is None else base
        # The deletion chain: row -> the earliest timestamp it was deleted at.
        self._chain: dict[int, int] = {} if chain is None else chain
        # The newest chain item's timestamp (0: none): a change-feed read of a range above
        # it skips the row group without walking its chain.
        self._chain_max = max(self._chain.values(), default=0)
        # The chain in timestamp order, (ts, row): a change-feed read of (low, high] takes
        # the items of its range by bisection, not by walking the chain. An item whose row
        # was deleted again at an earlier timestamp since (the chain keeps the earliest)
        # is stale: left here, skipped where read, dropped by the next fold.
        self._by_ts: list[tuple[int, int]] = sorted((t, r) for r, t in self._chain.items())
        self._lock = threading.Lock()

    @property
    def base_timestamp(self) -> int:
        return self._base_ts

    def grow(self, row_count: int) -> None:
        """An open write-buffer row group gained rows."""
        with self._lock:
            self.row_count = max(self.row_count, row_count)

    def delete(self, rows: Iterable[int], ts: int) -> int:
        """Delete ``rows`` at ``ts``; returns how many were not deleted before."""
        rows = list(rows)
        for row in rows:
            if not 0 <= row < self.row_count:
                raise VisibilityError(f"row {row} outside [0, {self.row_count})")
        with self._lock:
            base, chain = self._base, self._chain
            # O(1) per row: deleted at or before ts already means nothing to do.
            fresh = [r for r in dict.fromkeys(rows)
                     if r not in base and chain.get(r, ts + 1) > ts]
            if not fresh:
                return 0
            if ts <= self._base_ts:
                base = BitMap(base)  # copy-on-write: readers keep the old base
                base.update(fresh)
                self._base = base
                for r in fresh:  # an older chain item of the row is now covered
                    chain.pop(r, None)
            else:
                for r in fresh:  # an out-of-order earlier delete lowers the row's ts
                    chain[r] = ts
                self._index(fresh, ts)
            return len(fresh)

    def _index(self, rows: list[int], ts: int) -> None:
        """Add chain items at ``ts`` to the timestamp order (deletes arrive in timestamp
        order but for a replay's or a second writer's interleaving: then inserted)."""
        log = self._by_ts
        if ts >= self._chain_max:
            log.extend((ts, r) for r in rows)
            self._chain_max = ts
        else:
            for r in rows:
                bisect.insort(log, (ts, r))

    def _deleted_locked(self, ts: int) -> BitMap:
        result = BitMap(self._base)
        result.update(row for row, t in self._chain.items() if t <= ts)
        return result

    def deleted_at(self, ts: int) -> BitMap:
        """Rows deleted at snapshot ``ts`` (a new bitmap the caller owns); refuses a ``ts``
        below the base (NO_READ_BELOW_FOLD)."""
        with self._lock:
            if ts < self._base_ts:
                raise snapshot_expired(
                    f"snapshot {ts} is below a visibility base {self._base_ts} (deletes up to "
                    "it are folded together)", self._base_ts)
            return self._deleted_locked(ts)

    def deleted_among(self, rows: np.ndarray, ts: int) -> np.ndarray | None:
        """Which of ``rows`` are deleted at snapshot ``ts``: a bool per row, without
        building the whole bitmap (a point read). None when ``ts`` is below the base
        timestamp: the deletes up to the base are folded in, and which of them came
        after ``ts`` is no longer known."""
        with self._lock:
            if ts < self._base_ts:
                return None
            base, chain = self._base, self._chain
            if not base and not chain:  # the usual row group: nothing deleted
                return np.zeros(len(rows), bool)
            after = ts + 1
            return np.fromiter((r in base or chain.get(r, after) <= ts for r in rows.tolist()),
                               bool, len(rows))

    def deletes_between(self, low: int, high: int) -> list[tuple[int, int]] | None:
        """The chain items ``(row, ts)`` with ``low < ts <= high`` (the change feed's deletes);
        None when ``low`` is below the base timestamp: which of the folded deletes came
        after ``low`` is no longer known (NO_READ_BELOW_FOLD)."""
        with self._lock:
            if low < self._base_ts:
                return None
            if self._chain_max <= low:
                return []
            log, chain = self._by_ts, self._chain
            first = bisect.bisect_right(log, (low, _ABOVE_EVERY_ROW))
            end = bisect.bisect_right(log, (high, _ABOVE_EVERY_ROW), first)
            return [(row, ts) for ts, row in log[first:end] if chain.get(row) == ts]

    def in_base(self, rows: np.ndarray) -> np.ndarray:
        """Which of ``rows`` are in the base bitmap (deleted at or before the base
        timestamp). A row committed after the base timestamp is there only when the
        recovery's rewind hid it (its replayed copy took its place): it was in no
        snapshot."""
        with self._lock:
            base = self._base
        if not base:
            return np.zeros(len(rows), bool)
        return np.fromiter((r in base for r in rows.tolist()), bool, len(rows))

    def fold(self, safe_ts: int) -> int:
        """Fold chain items with ``ts <= safe_ts`` into the base; returns items folded."""
        with self._lock:
            if safe_ts <= self._base_ts:
                return 0
            folded = [row for row, t in self._chain.items() if t <= safe_ts]
            if folded:
                base = BitMap(self._base)
                base.update(folded)
                self._base = base
                chain = {r: t for r, t in self._chain.items() if t > safe_ts}
                self._chain = chain
                self._chain_max = max(chain.values(), default=0)
                kept = self._by_ts[bisect.bisect_right(self._by_ts,
                                                       (safe_ts, _ABOVE_EVERY_ROW)):]
                self._by_ts = [(t, r) for t, r in kept if chain.get(r) == t]
            self._base_ts = safe_ts
            return len(folded)

    def snapshot(self) -> tuple[int, BitMap, list[tuple[int, int]]]:
        """(base_ts, base bitmap, chain as (ts, row) in ts order) for a checkpoint."""
        with self._lock:
            chain = self._chain  # the timestamp order, without its stale items
            items = [(t, r) for t, r in self._by_ts if chain.get(r) == t]
            return self._base_ts, BitMap(self._base), items


def checkpoint_entry(file_id: int, rg_id: int, vis: RGVisibility, applied_ts: int) -> RGEntry:
    """A row group as a checkpoint keeps it: its base and the chain items at or below
    ``applied_ts`` (later ones are replayed)."""
    base_ts, base, chain = vis.snapshot()
    return RGEntry(file_id, rg_id, vis.row_count, base_ts, base,
                   [(ts, row) for ts, row in chain if ts <= applied_ts])


def restore(entry: RGEntry) -> RGVisibility:
    """The row group a checkpoint entry holds, history included."""
    return RGVisibility(entry.row_count, entry.base_timestamp, BitMap(entry.deleted),
                        {row: ts for ts, row in entry.chain})


class RGKey(NamedTuple):
    """A tuple: hashed in C (point reads look one up per row group)."""

    file_id: int
    rg_id: int


class VisibilityIndex:
    """The RGVisibilityIndex of one node: ``(fileId, rgId) -> RGVisibility``."""

    def __init__(self) -> None:
        self._entries: dict[RGKey, RGVisibility] = {}
        # file id -> the row-group ids it has in _entries: a file's row groups are found
        # without a scan of every entry (a change-feed poll lists every file of a stream).
        self._rg_ids: dict[int, set[int]] = {}
        # Files a Storage GC swap replaced: frozen (no delete reaches them any more),
        # still answering reads whose file list predates the swap, until the sweeper.
        self._retired: dict[int, list[RGVisibility]] = {}
        # A Storage GC file between its catalog swap and its registration: readers that
        # list it in that moment get its visibility (nothing can delete from it yet).
        self._staged: dict[int, list[RGVisibility]] = {}
        self._lock = threading.Lock()

    def add_file(self, file_id: int, row_counts: Iterable[int], base_ts: int = 0) -> None:
        with self._lock:
            for rg_id, count in enumerate(row_counts):
                key = RGKey(file_id, rg_id)
                if key in self._entries:
                    raise VisibilityError(f"visibility of file {file_id} rg {rg_id} exists")
                self._entries[key] = RGVisibility(count, base_ts)
                self._rg_ids.setdefault(file_id, set()).add(rg_id)

    def adopt(self, file_id: int, rg_id: int, entry: RGVisibility) -> None:
        """Take over a write-buffer block's visibility object when its file is published."""
        with self._lock:
            key = RGKey(file_id, rg_id)
            current = self._entries.get(key)
            if current is not None and current is not entry:
                raise VisibilityError(f"visibility of file {file_id} rg {rg_id} exists")
            self._entries[key] = entry
            self._rg_ids.setdefault(file_id, set()).add(rg_id)

    def get(self, file_id: int, rg_id: int) -> RGVisibility:
        entry = self._entries.get(RGKey(file_id, rg_id))
        if entry is None:
            raise VisibilityError(f"no visibility for file {file_id} rg {rg_id}")
        return entry

    def row_groups(self, file_id: int) -> list[int]:
        with self._lock:
            return sorted(self._rg_ids.get(file_id, ()))

    def remove_file(self, file_id: int) -> None:
        with self._lock:
            for rg_id in self._rg_ids.pop(file_id, ()):
                del self._entries[RGKey(file_id, rg_id)]

    def files(self) -> set[int]:
        with self._lock:
            return set(self._rg_ids)

    def retire_file(self, file_id: int) -> None:
        """Move a replaced file's row groups aside (they keep answering old readers)."""
        with self._lock:
            rg_ids = sorted(self._rg_ids.pop(file_id, ()))
            self._retired[file_id] = [self._entries.pop(RGKey(file_id, rg)) for rg in rg_ids]

    def readable(self, file_id: int, rg_id: int) -> RGVisibility | None:
        """The visibility of a row group any read may still reach: a replaced or staged
        file's (frozen, looked up first, as QueryVisibility does), else a registered
        file's; None for a row group of no such file."""
        with self._lock:
            frozen = self._retired.get(file_id)
            if frozen is None:
                frozen = self._staged.get(file_id)
        if frozen is not None:
            return frozen[rg_id] if 0 <= rg_id < len(frozen) else None
        return self._entries.get(RGKey(file_id, rg_id))

    def retired(self, file_id: int) -> list[RGVisibility] | None:
        """A replaced file's row groups, else a staged GC file's (read-only views)."""
        with self._lock:
            if file_id in self._retired:
                return self._retired[file_id]
            return self._staged.get(file_id)

    def stage_file(self, file_id: int, entries: list[RGVisibility]) -> None:
        with self._lock:
            self._staged[file_id] = list(entries)

    def unstage_file(self, file_id: int) -> None:
        with self._lock:
            self._staged.pop(file_id, None)

    def forget_retired(self, file_id: int) -> None:
        with self._lock:
            self._retired.pop(file_id, None)

    def retired_files(self) -> set[int]:
        with self._lock:
            return set(self._retired)

def bitmap_to_bytes(bitmap: BitMap, row_count: int) -> bytes:
    """Dense little-endian bitset of ``row_count`` bits (bit i = row i deleted), built
    with numpy: a row group with many deletes costs no Python loop."""
    bits = np.zeros(row_count, dtype=bool)
    if len(bitmap):
        rows = np.frombuffer(bitmap.to_array(), dtype=np.uint32)
        bits[rows[rows < row_count]] = True
    return np.packbits(bits, bitorder="little").tobytes()


def bytes_to_rows(data: bytes, row_count: int) -> list[int]:
    bits = np.unpackbits(np.frombuffer(data, dtype=np.uint8), bitorder="little")[:row_count]
    return np.flatnonzero(bits).tolist()
