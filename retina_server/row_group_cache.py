"""RowGroupCache: decoded row groups of published files, for point reads (LookupRows).

A published file is cached in spans of consecutive row groups (row_lookup.py,
SPAN_ROWS); a write-buffer block that can take no more rows is cached too.

A published file never changes under its file id (a Storage GC rewrite writes a
new file with a new id; a revert brings the old ids back with their old,
unchanged objects), so a cached row group is never stale: what decides which
file a key's row is in is the index, read afresh on every lookup, never the
cache. Entries go when the cache needs room (least recently used first, bounded
by the decoded bytes) or when their file is gone for good (RowMoves tells:
a sweep removed it, a rolled-back rewrite dropped it).

Loading runs outside the lock, so two lookups that miss the same row group at
once may both decode it; the second result replaces the first. The lock only
guards the map.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable

from prometheus_client import Counter, Gauge

from retina_server.row_gather import RowGroupRows

HITS = Counter("retina_lookup_cache_hits_total", "Row-group cache hits of LookupRows")
MISSES = Counter("retina_lookup_cache_misses_total",
                 "Row-group cache misses of LookupRows (a row group read and decoded)")
BYTES = Gauge("retina_lookup_cache_bytes", "Decoded bytes held by the row-group cache")


class RowGroupCache:
    def __init__(self, max_bytes: int) -> None:
        self._max_bytes = max_bytes
        # (file id, first rg id) -> a published file's decode span; (file id, rg id, -1)
        # -> a write-buffer block that can take no more rows.
        self._entries: OrderedDict[tuple[int, ...], RowGroupRows] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def get(self, key: tuple[int, ...], load: Callable[[], RowGroupRows]) -> RowGroupRows:
        """The rows cached under ``key`` (its file id first), decoded by ``load`` on a
        miss."""
        with self._lock:
            rows = self._entries.get(key)
            if rows is not None:
                self._entries.move_to_end(key)
        if rows is not None:
            HITS.inc()
            return rows
        MISSES.inc()
        rows = load()
        self._put(key, rows)
        return rows

    def _put(self, key: tuple[int, ...], rows: RowGroupRows) -> None:
        size = rows.nbytes
        if size > self._max_bytes:
            return  # larger than the whole cache: served, not kept
        with self._lock:
            old = self._entries.pop(key, None)
            if old is not None:
                self._bytes -= old.nbytes
            self._entries[key] = rows
            self._bytes += size
            while self._bytes > self._max_bytes:
                _key, evicted = self._entries.popitem(last=False)
                self._bytes -= evicted.nbytes
            BYTES.set(self._bytes)

    def forget_files(self, file_ids: Iterable[int]) -> None:
        gone = set(file_ids)
        with self._lock:
            for key in [k for k in self._entries if k[0] in gone]:
                self._bytes -= self._entries.pop(key).nbytes
            BYTES.set(self._bytes)

    @property
    def bytes_held(self) -> int:
        return self._bytes
