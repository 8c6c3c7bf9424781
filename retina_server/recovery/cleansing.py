"""Cleansing and the rewind: the node's durable state made exactly the state replay starts
from (specification section 4).

**Cleansing** keeps a checkpoint FileEntry only if the catalog row exists, is
REGULAR, and matches: row-id hull, row groups, path → table, file name → node
and vnode, the MainIndex flush marker's row count, and the footer's commit-ts
range (best effort: a footer that cannot be read only warns). Kept files are
re-registered and get their visibility from the body (its base and its deletion
chain up to checkpointAppliedTs: the history AS OF reads need). A discarded
admitted segment becomes PENDING, so its rows are replayed. This node's REGULAR files that no kept
entry covers, and no open GC journal entry protects, become RETIRED (cleanupAt = now);
its TEMPORARY_INGEST files are deleted, MainIndex ranges first, then the object,
then the row (LEFTOVER_RANGES_GO_WITH_THE_FILE). Write buffers start empty.

**The rewind** runs once the replay starts are derived: every primary-index
version written at or after its scope's start is dropped, and every row of a
kept file committed at or after that start is hidden (folded into the
visibility base, where no readable snapshot sees it: its replayed copy takes
its place). Replay redoes exactly that part (it applies nothing below a
scope's own start: REWIND_MATCHES_REPLAY), so what a replay writes is always
what the next rewind removes.

Invariant INDEX_POINTS_AT_DURABLE_ROWS, checked after every rewind: no
primary-index version a replay could have written (timestamp at or above the
node's replay start) points at a row that is not durable, that is at a row
outside the kept files. A violation fails the node closed instead of letting a
replayed DELETE miss the row the version hides.

Only Parquet footers and the hidden commit-ts column of the row groups that
can hold rows at or above a start are read: start-up cost follows the data
written since the checkpoint, not the data size.
"""

from __future__ import annotations

import contextlib
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import partial
from typing import TypeVar

from prometheus_client import Counter

from retina_common import file_names
from retina_common.catalog import (
    Catalog,
    CatalogError,
    FileRecord,
    FileType,
    FileTypeMismatch,
    PathRecord,
)
from retina_common.checkpoint_store import FileEntry, LoadedCheckpoint, RGEntry
from retina_common.codec import COMMIT_TS
from retina_common.log import get_logger
from retina_common.replay_ts import IngestSegment, ReplayStarts, SegmentKind
from retina_common.storage import delete_quietly, open_parquet
from retina_server.node import RetinaNode
from retina_server.primary_index import TOMBSTONE
from retina_server.registry import IngestFileMeta
from retina_server.visibility import restore

log = get_logger(component="cleansing")
T = TypeVar("T")

DISCARDS = Counter("retina_cleansing_discards_total", "Checkpoint entries discarded", ["reason"])
RETIRED = Counter("retina_cleansing_retired_total", "Catalog-only REGULAR files retired")
FOOTERS_UNREADABLE = Counter("retina_cleansing_footer_unreadable_total",
                             "Kept files whose footer could not be read (warned, kept)")


class RewindFailed(Exception):
    """The rewind cannot put the node at its replay starts: fail closed."""


class RewindInvariantBroken(RewindFailed):
    """INDEX_POINTS_AT_DURABLE_ROWS does not hold after the rewind: fail closed."""


Retry = Callable[[Callable[[], T], str], T]


def _once(fn: Callable[[], T], _what: str) -> T:
    return fn()


@dataclass(frozen=True)
class KeptFile:
    entry: FileEntry
    path_uri: str
    name: str


@dataclass(frozen=True)
class CleansingResult:
    segments: list[IngestSegment]  # the chain replay starts derive from
    kept: list[KeptFile]
    discarded: int
    retired: int


def my_files(node_id: str, files: list[FileRecord]) -> list[FileRecord]:
    """This node's REGULAR and TEMPORARY_INGEST files (by the name's node id)."""
    mine = []
    for f in files:
        if f.type not in (FileType.REGULAR, FileType.TEMPORARY_INGEST):
            continue
        with contextlib.suppress(ValueError):
            if file_names.parse(f.name).node_id == node_id:
                mine.append(f)
    return mine


def cleanse(node: RetinaNode, catalog: Catalog, loaded: LoadedCheckpoint | None,
            files: list[FileRecord], mine: list[FileRecord],
            retry: Retry = _once, protected: frozenset[int] = frozenset(),
            load_files: frozenset[int] = frozenset()) -> CleansingResult:
    """``retry(fn, what)`` runs each catalog call (the recovery coordinator retries a
    catalog that is briefly away; every step here is idempotent). ``protected``: files
    an open Storage GC journal entry holds (GcJournal.protected_files); they are never
    retired here, whatever the checkpoint says. ``load_files``: files of journaled bulk
    loads (LOAD_FILES_OUTLIVE_THEIR_ENTRY): retired like any REGULAR file no checkpoint
    holds, but never deleted while TEMPORARY_INGEST: recovery re-applies their rows."""
    body = loaded.body if loaded else None
    by_id = {f.file_id: f for f in files}
    paths = {p.path_id: p for p in retry(catalog.list_paths, "list paths")}
    rgs: dict[int, list[RGEntry]] = defaultdict(list)
    for rg in body.row_groups if body else []:
        rgs[rg.file_id].append(rg)
    # A file's block span is its admitted segment's: one block per row group for an
    # ingest file, but a GC output spans the blocks of the files it replaced whatever
    # its row groups (a wrong span would overlap the next file in the replay chain).
    spans = {seg.file_id: seg.block_count for seg in (body.segments if body else [])
             if seg.kind == SegmentKind.ADMITTED}
    kept: list[KeptFile] = []
    discarded: set[int] = set()
    for entry in body.files if body else []:
        reason = entry_problem(node, entry, by_id.get(entry.file_id), paths, rgs)
        if reason:
            discarded.add(entry.file_id)
            DISCARDS.labels(reason=reason.split(":")[0]).inc()
            log.warning("cleansing_discard", node=node.node_id, file_id=entry.file_id,
                        reason=reason)
            continue
        _admit(node, entry, rgs[entry.file_id], spans.get(entry.file_id, entry.num_row_group))
        record = by_id[entry.file_id]
        kept.append(KeptFile(entry, paths[record.path_id].uri, record.name))
    segments = [replace(s, kind=SegmentKind.PENDING)
                if s.kind == SegmentKind.ADMITTED and s.file_id in discarded else s
                for s in (body.segments if body else [])]
    retired = _retire_leftovers(node, catalog, mine, {k.entry.file_id for k in kept}, paths,
                                retry, protected, load_files)
    log.info("cleansing_done", node=node.node_id, kept=len(kept), discarded=len(discarded),
             retired=retired)
    return CleansingResult(segments, kept, len(discarded), retired)


def _retire_leftovers(node: RetinaNode, catalog: Catalog, mine: list[FileRecord],
                      kept: set[int], paths: dict[int, PathRecord], retry: Retry,
                      protected: frozenset[int], load_files: frozenset[int]) -> int:
    now = int(time.time() * 1000)
    retired = 0
    keep = kept | protected
    for f in mine:
        if f.type == FileType.REGULAR and f.file_id not in keep:
            retry(partial(_retire, catalog, f.file_id, now), f"retire file {f.file_id}")
            RETIRED.inc()
            retired += 1
            log.info("cleansing_retired", node=node.node_id, file_id=f.file_id)
        elif f.type == FileType.TEMPORARY_INGEST and f.file_id in load_files:
            log.info("cleansing_kept_load_file", node=node.node_id, file_id=f.file_id)
        elif f.type == FileType.TEMPORARY_INGEST:
            _delete_ingest_leftover(node, catalog, f, paths[f.path_id].uri)
    return retired


def _delete_ingest_leftover(node: RetinaNode, catalog: Catalog, f: FileRecord,
                            path_uri: str) -> None:
    """LEFTOVER_RANGES_GO_WITH_THE_FILE: a TEMPORARY_INGEST file killed between its
    MainIndex flush and its REGULAR step has durable ranges; they go first, then the
    object, then the row, so a crash anywhere in between leaves the row and the next
    start deletes again (each step is idempotent). No index version can point into
    the ranges after the rewind: the file's rows are at or above every replay start."""
    node.index.main.delete_main_index_range(f.file_id)
    delete_quietly(path_uri, f.name)
    with contextlib.suppress(CatalogError):
        catalog.delete_files([f.file_id])


def _retire(catalog: Catalog, file_id: int, now: int) -> None:
    try:
        catalog.update_file(file_id, file_type=FileType.RETIRED, cleanup_at=now,
                            expected_type=FileType.REGULAR)
    except FileTypeMismatch as exc:
        if exc.actual != FileType.RETIRED.name:  # RETIRED: a retry of a lost answer
            raise


def entry_problem(node: RetinaNode, e: FileEntry, f: FileRecord | None,
                  paths: dict[int, PathRecord], rgs: dict[int, list[RGEntry]]) -> str:
    """Why a checkpoint FileEntry cannot be kept ("" if it can)."""
    if f is None:
        return "not in catalog"
    if f.type != FileType.REGULAR:
        return f"not REGULAR: catalog says {f.type.name}"
    if (f.min_row_id, f.max_row_id, f.num_row_group) != (e.min_row_id, e.max_row_id,
                                                          e.num_row_group):
        return "hull mismatch: row-id hull or row groups differ from the catalog"
    path = paths.get(f.path_id)
    if path is None or path.table_id != e.table_id:
        return "table mismatch: the file's path belongs to another table"
    try:
        name = file_names.parse(f.name)
    except ValueError:
        return "name unparsable"
    if name.node_id != node.node_id or name.vnode != e.vnode:
        return "vnode mismatch: the file name names another node or vnode"
    if node.index.main.flushed_row_count(e.file_id) != e.record_num:
        return "index mismatch: the MainIndex flush marker disagrees with recordNum"
    entries = sorted(rgs.get(e.file_id, []), key=lambda r: r.rg_id)
    if [r.rg_id for r in entries] != list(range(e.num_row_group)) or \
            sum(r.row_count for r in entries) != e.record_num:
        return "visibility mismatch: row-group entries do not cover the file"
    return _footer_problem(e, path.uri, f.name)


def _footer_problem(e: FileEntry, path_uri: str, name: str) -> str:
    """The footer's commit-ts statistics against the entry. Best effort (section 4): a
    footer that cannot be read only warns, and only the footer is read."""
    try:
        meta = open_parquet(path_uri, name).metadata
        column = meta.schema.to_arrow_schema().get_field_index(COMMIT_TS)
        for i in range(meta.num_row_groups):
            stats = meta.row_group(i).column(column).statistics
            if stats is not None and stats.has_min_max and \
                    not e.min_commit_ts <= stats.min <= stats.max <= e.max_commit_ts:
                return "footer mismatch: commit-ts statistics outside the entry's range"
    except (OSError, ValueError) as exc:
        FOOTERS_UNREADABLE.inc()
        log.warning("cleansing_footer_unreadable", file_id=e.file_id, error=str(exc))
    return ""


def _admit(node: RetinaNode, e: FileEntry, rgs: list[RGEntry], block_count: int) -> None:
    node.registry.register(IngestFileMeta(
        e.file_id, e.table_id, e.vnode, e.first_block_id, e.min_commit_ts, e.max_commit_ts,
        e.record_num, e.min_row_id, e.max_row_id, e.num_row_group, block_count))
    for rg in sorted(rgs, key=lambda r: r.rg_id):
        node.visibility.adopt(e.file_id, rg.rg_id, restore(rg))


# --- the rewind ----------------------------------------------------------------------------
def rewind(node: RetinaNode, starts: ReplayStarts, kept: list[KeptFile]) -> tuple[int, int]:
    """Back to the state as of each scope's replay start; returns (index versions
    removed, rows hidden). Then checks INDEX_POINTS_AT_DURABLE_ROWS."""
    vnode_of = node.topology.vnode_of_key
    survivors: list[tuple[int, bytes, int, int]] = []
    removed = node.index.primary.truncate_versions(
        starts.node_replay_from_ts,
        lambda table_id, key: starts.scope_start(table_id, vnode_of(key)),
        lambda *version: survivors.append(version))
    hidden = sum(_hide_rows_at_or_after(node, k, starts.scope_start(k.entry.table_id,
                                                                     k.entry.vnode))
                 for k in kept)
    log.info("recovery_rewound", node=node.node_id, index_versions_removed=removed,
             rows_hidden=hidden)
    check_index_points_at_durable_rows(node, survivors)
    return removed, hidden


def _hide_rows_at_or_after(node: RetinaNode, kept: KeptFile, start: int) -> int:
    """Hide a kept file's rows committed at or after ``start``: replay re-inserts them."""
    if kept.entry.max_commit_ts < start:
        return 0  # the whole file predates the replay start
    try:
        return _hide_in_file(node, kept, start)
    except (OSError, ValueError) as exc:
        # Unlike the footer audit, this needs the data: without it the node cannot be
        # put at its replay start, and queries could not read the file either.
        raise RewindFailed(f"kept file {kept.entry.file_id} ({kept.name}) cannot be read "
                           f"for the rewind: {exc}") from exc


def _hide_in_file(node: RetinaNode, kept: KeptFile, start: int) -> int:
    parquet = open_parquet(kept.path_uri, kept.name)
    column = parquet.metadata.schema.to_arrow_schema().get_field_index(COMMIT_TS)
    hidden = 0
    for rg in range(parquet.metadata.num_row_groups):
        stats = parquet.metadata.row_group(rg).column(column).statistics
        if stats is not None and stats.has_min_max and stats.max < start:
            continue  # this row group predates the start: its column is never read
        stamps = parquet.read_row_group(rg, columns=[COMMIT_TS]).column(0)
        rows = [i for i, ts in enumerate(stamps.to_pylist()) if ts >= start]
        if rows:
            vis = node.visibility.get(kept.entry.file_id, rg)
            hidden += vis.delete(rows, vis.base_timestamp)
    return hidden


def check_index_points_at_durable_rows(
        node: RetinaNode, versions: list[tuple[int, bytes, int, int]]) -> None:
    """INDEX_POINTS_AT_DURABLE_ROWS over ``versions`` (table, key, ts, rowId): the versions
    the rewind kept at or above the node's replay start, the lowest timestamp any
    replay of this node can write at. Only each key's latest kept version is checked:
    every kept version lies below its scope's start, every replayed write at or above
    it, so a replay resolves a key to its latest version and never to an older one
    (which may rightly point at a row Storage GC dropped as deleted)."""
    latest: dict[tuple[int, bytes], tuple[int, int]] = {}
    for table_id, key, ts, row_id in versions:
        seen = latest.get((table_id, key))
        if seen is None or ts > seen[0]:
            latest[(table_id, key)] = (ts, row_id)
    bad: list[str] = []
    for (table_id, key), (ts, row_id) in latest.items():
        if row_id == TOMBSTONE:
            continue
        location = node.index.main.location_of(row_id)
        if location is None or location.file_id not in node.registry:
            where = "no durable location" if location is None else \
                f"file {location.file_id} not kept"
            bad.append(f"table {table_id} key {key.hex()[:16]}@{ts} -> row {row_id} ({where})")
            if len(bad) >= 5:
                break
    if bad:
        raise RewindInvariantBroken(
            "INDEX_POINTS_AT_DURABLE_ROWS: primary-index versions point at rows that are not "
            "durable after the rewind: " + "; ".join(bad))

