"""Lineage and revert of Storage GC rewrites (Apache Pinot's consistent push and rollback).

Every rewrite is a lineage record, read from its GC journal entry:

| journal state | lineage status |
|---|---|
| INDEX_SWITCHING | IN_PROGRESS |
| SWAPPED_NOT_CHECKPOINTED, CHECKPOINTED | COMPLETED |
| REVERTING | IN_PROGRESS (a revert under way) |
| REVERTED | REVERTED |
| ABORTED | ABORTED (rolled back before it completed) |

An operator can revert a COMPLETED rewrite while its old files are still
retained (RETIRED in the catalog, their objects and MainIndex ranges there):
one atomic swap back, journaled like the forward commit.

**Revert**, each durable step between two failpoints:

1. check (COMPLETED; the new file REGULAR and served here, in no other rewrite;
   every old file RETIRED, readable, its MainIndex ranges whole); read the
   survivors (keys and old row ids, in new-file order) from the old files;
2. journal REVERTING (write-ahead: recovery finishes the revert from here);
3. under the stream's publisher and buffer locks: the old files' visibility is
   rebuilt from the new file's (the rows the rewrite dropped, plus every delete
   of a new row mapped back to its old row, chain items keeping their
   timestamps); primary entries still on new rows move back to their old rows;
   ``revert_swap`` (old files REGULAR, new file RETIRED, one transaction);
   journal REVERTED; registry and visibility index switch to the old files
   (the new file's visibility stays, frozen, for readers that listed it).

A query lists either the old or the new file set (one catalog transaction
flips both), never a mix. A failure after REVERTING fails the node closed;
recovery (:func:`recover_reverts`) finishes the revert. When the loaded
checkpoint still holds the new file (REVERTING, or REVERTED before the next
checkpoint), the loaded baseline is rewritten to the old files exactly as the
live revert does it (RGEntries mapped back), so cleansing and the replay
starts see the old files.
"""

from __future__ import annotations

import threading
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, replace
from enum import StrEnum

import grpc
import numpy as np
import pyarrow.compute as pc
from pyroaring import BitMap

from retina_common import failpoints as fp
from retina_common.catalog import (
    Catalog,
    CatalogOutcomeUnknown,
    CatalogUnavailable,
    FileRecord,
    FileType,
)
from retina_common.checkpoint_store import CheckpointBody, FileEntry, RGEntry
from retina_common.codec import COMMIT_TS
from retina_common.log import get_logger
from retina_common.refusal import Refusal
from retina_common.replay_ts import IngestSegment, SegmentKind
from retina_common.retry import until_deadline
from retina_common.storage import object_size, open_parquet
from retina_server.gc.gc_journal import GcJournal, JournalEntry, JournalState
from retina_server.gc.rewrites import (
    StorageGc,
    Survivors,
    entry_survivors,
    kept_mask,
    switch_primary_back,
)
from retina_server.node import RetinaNode
from retina_server.registry import IngestFileMeta
from retina_server.visibility import RGVisibility

log = get_logger(component="lineage")


class LineageStatus(StrEnum):
    IN_PROGRESS = "IN_PROGRESS"
    COMPLETED = "COMPLETED"
    REVERTED = "REVERTED"
    ABORTED = "ABORTED"


STATUS: dict[JournalState, LineageStatus] = {
    JournalState.INDEX_SWITCHING: LineageStatus.IN_PROGRESS,
    JournalState.SWAPPED_NOT_CHECKPOINTED: LineageStatus.COMPLETED,
    JournalState.CHECKPOINTED: LineageStatus.COMPLETED,
    JournalState.REVERTING: LineageStatus.IN_PROGRESS,
    JournalState.REVERTED: LineageStatus.REVERTED,
    JournalState.ABORTED: LineageStatus.ABORTED,
}


class RevertAnchorsGone(Exception):
    """What a revert needs (old rows, objects, ranges) is no longer there."""


@dataclass(frozen=True)
class LineageRecord:
    entry: JournalEntry
    status: LineageStatus
    revertible: bool
    not_revertible_reason: str


# --- the row map: new row <-> old row, from the journal alone ----------------------------------
class RowMap:
    """Where each row of the new file came from: new row ``g`` (counted across its row
    groups) is the ``g``-th survivor, i.e. the ``g``-th row not dropped, old files and
    row groups in journal order. Needs nothing but the journal entry."""

    def __init__(self, entry: JournalEntry) -> None:
        self.keys: list[tuple[int, int]] = []
        self.counts: dict[tuple[int, int], int] = {}
        kept: list[np.ndarray] = []
        for old in entry.old_files:
            for rg, n in enumerate(old.rg_row_counts):
                key = (old.file_id, rg)
                self.keys.append(key)
                self.counts[key] = n
                kept.append(np.flatnonzero(kept_mask(n, entry.dropped.get(key, BitMap()))))
        self._kept = kept
        self._seg_end = np.cumsum([len(k) for k in kept]) if kept else np.array([], int)
        self._new_start = np.concatenate([[0], np.cumsum(entry.new_rg_row_counts)]).astype(int)
        total = int(self._seg_end[-1]) if len(self._seg_end) else 0
        if total != int(self._new_start[-1]):
            raise RevertAnchorsGone(f"rewrite {entry.rewrite_id}: {total} survivors, the new "
                                    f"file has {int(self._new_start[-1])} rows")

    def to_old(self, new_rg: int, rows: np.ndarray) -> dict[tuple[int, int], np.ndarray]:
        """Old (file, rg) -> row offsets, for rows of one new row group."""
        if not len(rows):
            return {}
        g = self._new_start[new_rg] + rows.astype(np.int64)
        seg = np.searchsorted(self._seg_end, g, side="right")
        out: dict[tuple[int, int], np.ndarray] = {}
        for s in np.unique(seg):
            mask = seg == s
            before = int(self._seg_end[s - 1]) if s else 0
            out[self.keys[s]] = self._kept[s][g[mask] - before]
        return out


def _rows(bitmap: BitMap) -> np.ndarray:
    return np.frombuffer(bitmap.to_array(), dtype=np.uint32).astype(np.int64) \
        if len(bitmap) else np.array([], np.int64)


def mapped_deleted(entry: JournalEntry, rowmap: RowMap,
                   new_deleted: list[BitMap]) -> dict[tuple[int, int], BitMap]:
    """Per old row group: the rows the rewrite dropped plus the new file's deleted rows
    mapped back."""
    out = {key: BitMap(entry.dropped.get(key, BitMap())) for key in rowmap.keys}
    for new_rg, bits in enumerate(new_deleted):
        for key, offsets in rowmap.to_old(new_rg, _rows(bits)).items():
            out[key].update(offsets.tolist())
    return out


def old_visibility(entry: JournalEntry, rowmap: RowMap,
                   new_vis: list[RGVisibility]) -> dict[tuple[int, int], RGVisibility]:
    """The old files' visibility rebuilt from the new file's, exact for every snapshot at
    or above the returned base (the highest base of the new row groups). Each new row
    group is read once, atomically (a concurrent fold cannot move an item between a
    base read and a chain read)."""
    snaps = [v.snapshot() for v in new_vis]
    base_ts = max([entry.cutoff_ts] + [b for b, _base, _chain in snaps])
    deleted = []
    for _b, base, chain in snaps:
        bits = BitMap(base)
        bits.update(row for ts, row in chain if ts <= base_ts)
        deleted.append(bits)
    bases = mapped_deleted(entry, rowmap, deleted)
    out = {key: RGVisibility(rowmap.counts[key], base_ts, bases[key]) for key in rowmap.keys}
    items: dict[tuple[tuple[int, int], int], list[int]] = defaultdict(list)
    for new_rg, (_b, _base, chain) in enumerate(snaps):
        by_ts: dict[int, list[int]] = defaultdict(list)
        for ts, row in chain:
            if ts > base_ts:
                by_ts[ts].append(row)
        for ts, rows in by_ts.items():
            for key, offsets in rowmap.to_old(new_rg, np.array(rows, np.int64)).items():
                items[(key, ts)].extend(offsets.tolist())
    for (key, ts), rows in sorted(items.items(), key=lambda kv: kv[0][1]):
        out[key].delete(rows, ts)
    return out


@dataclass(frozen=True)
class OldFacts:
    file_id: int
    first_block_id: int
    block_count: int
    rg_row_counts: tuple[int, ...]
    min_commit_ts: int
    max_commit_ts: int
    min_row_id: int
    max_row_id: int

    def meta(self, entry: JournalEntry) -> IngestFileMeta:
        return IngestFileMeta(self.file_id, entry.table_id, entry.vnode, self.first_block_id,
                              self.min_commit_ts, self.max_commit_ts, sum(self.rg_row_counts),
                              self.min_row_id, self.max_row_id, len(self.rg_row_counts),
                              self.block_count)


def old_facts(entry: JournalEntry, records: dict[int, FileRecord | None]) -> list[OldFacts]:
    """What the registry and a checkpoint need of each old file: its place (journal), its
    row-id hull (catalog) and its commit-ts range (the file's commit-ts column)."""
    out = []
    for old in entry.old_files:
        record = records.get(old.file_id)
        if record is None or record.min_row_id is None or record.max_row_id is None:
            raise RevertAnchorsGone(f"old file {old.file_id} has no catalog row-id hull")
        stamps = open_parquet(entry.path_uri, old.name).read(columns=[COMMIT_TS]) \
            .column(COMMIT_TS)
        lo, hi = (0, 0) if len(stamps) == 0 else (int(pc.min(stamps).as_py()),
                                                  int(pc.max(stamps).as_py()))
        out.append(OldFacts(old.file_id, old.first_block_id, old.block_count,
                            old.rg_row_counts, lo, hi, record.min_row_id, record.max_row_id))
    return out


def _swap_back(catalog: Catalog, entry: JournalEntry, cleanup_at: int,
               deadline_s: float = 60.0) -> str:
    return until_deadline(
        lambda: catalog.revert_swap(entry.new_file_id, entry.old_file_ids, cleanup_at),
        transient=(CatalogUnavailable, CatalogOutcomeUnknown), deadline_s=deadline_s,
        on_retry=lambda exc: log.warning("gc_revert_catalog_retry", error=str(exc)))


# --- the live revert -------------------------------------------------------------------------
class Lineage:
    def __init__(self, node: RetinaNode, catalog: Catalog, journal: GcJournal, gc: StorageGc,
                 retired_retention_ms: int,
                 clock_ms: Callable[[], int] = lambda: int(time.time() * 1000)) -> None:
        self._node = node
        self._catalog = catalog
        self._journal = journal
        self._gc = gc
        self._retention_ms = retired_retention_ms
        self._clock_ms = clock_ms
        # One revert at a time per node; the retired-file sweeper takes it too, so a
        # revert and the removal of one of its old files never interleave.
        self.lock = threading.Lock()

    def records(self) -> list[LineageRecord]:
        entries = self._journal.entries()
        ids = {f for e in entries for f in (e.new_file_id, *e.old_file_ids)}
        files = {f.file_id: f for f in self._catalog.get_files_by_type(None, list(FileType))
                 if f.file_id in ids}
        out = []
        for e in entries:
            problem = self.not_revertible(e, files)
            out.append(LineageRecord(e, STATUS[e.state], problem is None, problem or ""))
        return out

    def not_revertible(self, entry: JournalEntry,
                       files: dict[int, FileRecord]) -> str | None:
        """Why ``entry`` cannot be reverted now, or None (cheap checks: catalog and node
        state; the old objects and ranges are checked when the revert runs)."""
        if STATUS[entry.state] != LineageStatus.COMPLETED:
            return f"the rewrite is {STATUS[entry.state].value} ({entry.state.value})"
        new = files.get(entry.new_file_id)
        if new is None or new.type != FileType.REGULAR:
            return (f"new file {entry.new_file_id} is "
                    f"{'gone' if new is None else new.type.name}: a later rewrite replaced it "
                    "(revert that one first)")
        gone = [f for f in entry.old_file_ids
                if f not in files or files[f].type != FileType.RETIRED]
        if gone:
            return f"old files {gone} are no longer retained (swept)"
        if entry.new_file_id not in self._node.registry:
            return f"new file {entry.new_file_id} is not served by {self._node.node_id}"
        busy = self._gc.busy_files() | {
            f for e in self._journal.open_entries() if e.rewrite_id != entry.rewrite_id
            for f in (e.new_file_id, *e.old_file_ids)}
        if entry.new_file_id in busy:
            return f"new file {entry.new_file_id} is in another rewrite"
        return None

    def revert(self, rewrite_id: str) -> LineageRecord:
        node = self._node
        node.check_writable()
        with self.lock:
            entry = self._journal.get(rewrite_id)
            if entry is None:
                raise Refusal(grpc.StatusCode.NOT_FOUND, f"no rewrite {rewrite_id} on "
                                                         f"{node.node_id}")
            if entry.state == JournalState.REVERTED:  # a retried call whose answer was lost
                return LineageRecord(entry, LineageStatus.REVERTED, False, "already reverted")
            ids = [entry.new_file_id, *entry.old_file_ids]
            records = {f: self._catalog.get_file(f) for f in ids}
            problem = self.not_revertible(
                entry, {f: r for f, r in records.items() if r is not None})
            if problem:
                raise Refusal(grpc.StatusCode.FAILED_PRECONDITION,
                              f"rewrite {rewrite_id} cannot be reverted: {problem}")
            try:
                for old in entry.old_files:
                    object_size(entry.path_uri, old.name)
                plan = entry_survivors(node, entry)
                facts = old_facts(entry, records)
                rowmap = RowMap(entry)
            except (OSError, LookupError, ValueError, RevertAnchorsGone) as exc:
                raise Refusal(grpc.StatusCode.FAILED_PRECONDITION,
                              f"rewrite {rewrite_id} cannot be reverted: {exc}") from exc
            stream = node.stream(node.table(entry.schema_name, entry.table_name), entry.vnode)
            reverting = self._journal.write(
                entry.moved(JournalState.REVERTING, self._clock_ms(), "revert requested"),
                fp.GC_REVERT_JOURNAL_REVERTING_BEFORE, fp.GC_REVERT_JOURNAL_REVERTING_AFTER)
            try:
                with stream.publisher.lock, stream.buffer.lock:
                    done = self._switch_back(reverting, plan, facts, rowmap)
            except Exception as exc:
                node.fail_closed(f"GC revert {rewrite_id} failed after REVERTING ({exc}); "
                                 "recovery finishes it")
                raise Refusal(grpc.StatusCode.UNAVAILABLE,
                              f"revert of {rewrite_id} failed ({exc}); the node failed "
                              "closed and its recovery finishes the revert") from exc
        self._gc.update_gauges()
        log.info("gc_rewrite_reverted", node=node.node_id, rewrite_id=rewrite_id,
                 new_file_id=entry.new_file_id, old_files=entry.old_file_ids)
        return LineageRecord(done, LineageStatus.REVERTED, False, "already reverted")

    def _switch_back(self, entry: JournalEntry, plan: Survivors, facts: list[OldFacts],
                     rowmap: RowMap) -> JournalEntry:
        node, new_id = self._node, entry.new_file_id
        new_vis = [node.visibility.get(new_id, rg)
                   for rg in range(len(entry.new_rg_row_counts))]
        olds = old_visibility(entry, rowmap, new_vis)
        fp.GC_REVERT_PRIMARY_BEFORE.hit()
        switch_primary_back(node, entry, plan)
        fp.GC_REVERT_PRIMARY_AFTER.hit()
        fp.GC_REVERT_CATALOG_BEFORE.hit()
        _swap_back(self._catalog, entry, self._clock_ms() + self._retention_ms)
        fp.GC_REVERT_CATALOG_AFTER.hit()
        done = self._journal.write(entry.moved(JournalState.REVERTED, self._clock_ms()),
                                   fp.GC_REVERT_JOURNAL_REVERTED_BEFORE,
                                   fp.GC_REVERT_JOURNAL_REVERTED_AFTER)
        for f in facts:  # REGISTRY_COVERS_VISIBILITY holds at every point
            node.registry.register(f.meta(entry))
            node.visibility.forget_retired(f.file_id)
            for rg in range(len(f.rg_row_counts)):
                node.visibility.adopt(f.file_id, rg, olds[(f.file_id, rg)])
        node.visibility.retire_file(new_id)
        node.registry.unregister(new_id)
        return done


# --- recovery ------------------------------------------------------------------------------------
def recover_reverts(node: RetinaNode, catalog: Catalog, journal: GcJournal,
                    body: CheckpointBody | None, retention_ms: int) -> list[str]:
    """Finish every REVERTING entry, and rewrite the loaded baseline to the old files
    wherever it still holds a reverted rewrite's new file. Returns the rewrite ids
    touched. Raises RevertAnchorsGone (the node fails closed) if what is needed is gone."""
    held = {f.file_id for f in body.files} if body else set()
    touched = []
    for entry in journal.entries():
        if entry.state not in (JournalState.REVERTING, JournalState.REVERTED):
            continue
        holds_new = entry.new_file_id in held
        if entry.state == JournalState.REVERTED and not holds_new:
            continue
        records = {f: catalog.get_file(f) for f in (entry.new_file_id, *entry.old_file_ids)}
        try:
            rowmap = RowMap(entry)
            facts = old_facts(entry, records) if holds_new else []
            if entry.state == JournalState.REVERTING:
                plan = entry_survivors(node, entry)
                switch_primary_back(node, entry, plan)
                _swap_back(catalog, entry, int(time.time() * 1000) + retention_ms)
                entry = journal.write(
                    entry.moved(JournalState.REVERTED, int(time.time() * 1000),
                                "revert finished by recovery"),
                    fp.GC_REVERT_JOURNAL_REVERTED_BEFORE, fp.GC_REVERT_JOURNAL_REVERTED_AFTER)
        except (CatalogUnavailable, CatalogOutcomeUnknown):
            raise  # start-up retries
        except RevertAnchorsGone:
            raise
        except Exception as exc:
            raise RevertAnchorsGone(f"rewrite {entry.rewrite_id}: revert cannot be finished: "
                                    f"{exc}") from exc
        if holds_new and body is not None:
            _rebase(body, entry, rowmap, facts)
        touched.append(entry.rewrite_id)
        log.info("gc_revert_recovered", node=node.node_id, rewrite_id=entry.rewrite_id,
                 baseline_rewritten=holds_new)
    return touched


def _rebase(body: CheckpointBody, entry: JournalEntry, rowmap: RowMap,
            facts: list[OldFacts]) -> None:
    """The loaded baseline as if it had been taken after the revert: the new file's
    entries become the old files' (row groups mapped back at the same base)."""
    new_id = entry.new_file_id
    new_rgs = sorted((r for r in body.row_groups if r.file_id == new_id), key=lambda r: r.rg_id)
    if len(new_rgs) != len(entry.new_rg_row_counts):
        raise RevertAnchorsGone(f"rewrite {entry.rewrite_id}: the checkpoint holds "
                                f"{len(new_rgs)} row groups of file {new_id}, the journal "
                                f"{len(entry.new_rg_row_counts)}")
    base_ts = max([entry.cutoff_ts] + [r.base_timestamp for r in new_rgs])
    deleted = mapped_deleted(entry, rowmap, [r.deleted for r in new_rgs])
    files: list[FileEntry] = []
    for f in body.files:
        if f.file_id != new_id:
            files.append(f)
            continue
        files += [FileEntry(o.file_id, entry.table_id, entry.vnode, o.first_block_id,
                            o.min_commit_ts, o.max_commit_ts, sum(o.rg_row_counts),
                            o.min_row_id, o.max_row_id, len(o.rg_row_counts)) for o in facts]
    segments: list[IngestSegment] = []
    for s in body.segments:
        if s.file_id != new_id:
            segments.append(s)
            continue
        segments += [replace(s, kind=SegmentKind.ADMITTED, file_id=o.file_id,
                             first_block_id=o.first_block_id, block_count=o.block_count,
                             row_count=sum(o.rg_row_counts), min_commit_ts=o.min_commit_ts,
                             max_commit_ts=o.max_commit_ts) for o in facts]
    rgs = [r for r in body.row_groups if r.file_id != new_id]
    rgs += [RGEntry(key[0], key[1], rowmap.counts[key], base_ts, deleted[key])
            for key in rowmap.keys]
    body.files, body.segments, body.row_groups = files, segments, rgs
