"""LocalIndexService: the primary index, the MainIndex and the sequences of one node.

A thin facade over three stores with their own modules:

* ``primary``: the multi-version primary index on LMDB (primary_index.py),
  ``(tableId, key, ts) -> rowId`` or a tombstone;
* ``main``: the MainIndex (main_index.py), ``rowId range -> RowLocation``,
  buffered in memory and flushed to SQLite per file;
* ``sequences``: durable row-id (and other) sequences in the same SQLite database.

What needs both stores is here: resolvePrimary, resolve_for_delete and
delete_targets read a key's versions and locate the row they name. Every other
staged primitive of specification section 5 is called on its store
(putMainIndexEntries and deleteMainIndexRange on ``main``;
putPrimaryEntriesOnly, tombstonePrimaryResolved, restorePrimaryEntries and the
primary switch on ``primary``). Every write path (normal writes, replay,
Storage GC) goes through them.

resolvePrimary answers FOUND / NOT_FOUND_OR_ORPHAN / BACKEND_ERROR against
the *baseline visible file set* supplied by the caller: a key whose row lives
in a file outside it (dropped memtable, unpublished or retired file) is an
orphan, never a match. Only BACKEND_ERROR may fail a request.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path

import numpy as np
from prometheus_client import Counter

from retina_server.main_index import MainIndex, RowLocation, Sequences, SqliteStore
from retina_server.primary_index import MAP_SIZE, TOMBSTONE, PrimaryIndex

# Up to this many keys, delete_targets looks each up by itself (_few_delete_targets).
_FEW_KEYS = 16

ORPHANS = Counter("retina_index_orphans_total",
                  "Primary-index versions resolved to a row outside the baseline file set")


class Resolution(StrEnum):
    FOUND = "FOUND"
    NOT_FOUND_OR_ORPHAN = "NOT_FOUND_OR_ORPHAN"
    BACKEND_ERROR = "BACKEND_ERROR"


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


class LocalIndexService:
    def __init__(self, directory: Path, *, row_id_block: int = 100_000,
                 map_size: int = MAP_SIZE) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        self.primary = PrimaryIndex(directory / "primary.lmdb", map_size=map_size)
        self._sqlite = SqliteStore(directory / "main_index.sqlite")
        self.main = MainIndex(self._sqlite)
        self.sequences = Sequences(self._sqlite, row_id_block)

    def close(self) -> None:
        self.primary.close()
        self._sqlite.close()

    def resolve_primary(self, table_id: int, keys: Sequence[bytes],
                        baseline: Callable[[int], bool], ts: int) -> list[Resolved]:
        """resolvePrimary at ``ts``: each key's latest version at or before ``ts``
        (a tombstone at exactly ``ts`` is looked past), against the baseline set."""
        if not keys:
            return []
        pairs = self.primary.candidates(table_id, keys, ts)
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
        pairs = self.primary.candidates(table_id, keys, ts)
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
                       baseline: Callable[[int], bool], ts: int,
                       later: dict[int, int] | None = None) -> DeleteTargets | None:
        """resolve_for_delete, grouped by row group for the visibility update (None on
        a backend error). The normal case (no version at exactly ``ts``) is resolved a
        batch at a time: one array lookup of every predecessor in the MainIndex instead
        of an object per key. The rare case takes resolve_for_delete's path. ``later``:
        as for ``PrimaryIndex.candidates``."""
        pairs = self.primary.candidates(table_id, keys, ts, later)
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
        if len(positions) <= _FEW_KEYS:
            return self._few_delete_targets(keys, pairs, positions, baseline)
        row_ids = np.fromiter((pairs[i][1] for i in positions), np.int64, len(positions))
        located, files, rgs, offsets = self.main.locate(row_ids)
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

    def _few_delete_targets(self, keys: Sequence[bytes],
                            pairs: list[tuple[int | None, int | None]],
                            positions: list[int], baseline: Callable[[int], bool]
                            ) -> DeleteTargets:
        """delete_targets' normal case for a few keys (a CDC source transaction's part of
        a virtual node: a key or two), by point lookups: the arrays' fixed cost is most
        of such a call. The same answer: a predecessor the MainIndex does not place, or
        places outside the baseline, is an orphan."""
        locations = self.main.locations_of([pairs[i][1] or 0 for i in positions])
        in_baseline: dict[int, bool] = {}
        found_keys: list[bytes] = []
        by_rg: dict[tuple[int, int], list[int]] = {}
        orphans = 0
        for i, location in zip(positions, locations, strict=True):
            if location is None:
                orphans += 1
                continue
            ok = in_baseline.get(location.file_id)
            if ok is None:
                ok = in_baseline[location.file_id] = baseline(location.file_id)
            if not ok:
                orphans += 1
                continue
            found_keys.append(keys[i])
            by_rg.setdefault((location.file_id, location.rg_id), []).append(
                location.rg_row_offset)
        if orphans:
            ORPHANS.inc(orphans)
        return DeleteTargets(found_keys, by_rg)

    def _classify(self, row_ids: Sequence[int | None],
                  baseline: Callable[[int], bool]) -> list[Resolved]:
        locations = self.main.locations_of([TOMBSTONE if r is None else r for r in row_ids])
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
