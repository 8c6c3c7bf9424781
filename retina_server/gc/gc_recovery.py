"""Recovery's decision per Storage GC journal entry (specification C07.6), made at start-up
right after the checkpoint is loaded and before cleansing reads the catalog.

| journal state | loaded checkpoint holds the new file | decision |
|---|---|---|
| INDEX_SWITCHING | no | roll back |
| INDEX_SWITCHING | yes | FAILED (impossible by construction: the journal disagrees) |
| SWAPPED_NOT_CHECKPOINTED | yes | keep the new file (promoted once both slots hold it) |
| SWAPPED_NOT_CHECKPOINTED | no | roll back to the old-file baseline |
| CHECKPOINTED, ABORTED | — | nothing (final) |
| REVERTING, REVERTED | — | lineage.recover_reverts (finish, rebuild the baseline) |

A rollback first checks its anchors (the old files' catalog rows, MainIndex
ranges and objects, and the row counts the journal recorded); if one is gone
the node fails closed rather than guess (runbook: "GC journal mismatch").
Rollback steps are idempotent (storage_gc.roll_back), so a crash inside one
is finished by the next start.

Unjournaled GC files: a TEMPORARY_GC file of this node that no entry names
but that has MainIndex ranges means a rewrite whose journal is gone; if any
primary-index version points into those ranges the node fails closed
(GC_ROWS_HAVE_A_JOURNAL), otherwise the ranges are dropped.

Lost records of swapped rewrites (REWRITE_OUTPUTS_HAVE_A_JOURNAL): once the
decisions and the reverts are done, a REGULAR file of this node that the loaded
checkpoint (as the reverts rebased it) does not hold and that no journal record
names, old or new, must be an ingest file published after the checkpoint. If its
footer says it is a Storage GC output (``retina.gc_rewrite_id``), only a swapped
rewrite whose record is gone explains it: cleansing would retire it and discard
the RETIRED old files' checkpoint entries, and replay would have to start from
the oldest of them. The node fails closed instead. The healthy cases never
match: a kept rewrite's output is in the checkpoint; a promoted one
(CHECKPOINTED) is in both slots, so also after a fallback to ``previous``, and
in every later checkpoint, also once its record is swept; a rolled-back or
reverted output is no longer REGULAR (and named by its record until swept); a
revert's rebased baseline holds the old files again. A footer that cannot be
read fails the node only with a second sign in the same stream: a checkpointed
file that is RETIRED in the catalog and that no record names. A swap leaves
that sign; its only other source is cleansing, which retires a checkpoint
entry it discarded at an earlier start, so a healthy node never meets it
together with an unreadable object; with both, a lost rewrite cannot be ruled
out and the node fails closed. Otherwise an unreadable footer only warns.

A journal record that does not check (CRC32C, length) fails the node closed:
it is never read as "no entry".
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

from prometheus_client import Counter

from retina_common import file_names
from retina_common.catalog import (
    Catalog,
    CatalogOutcomeUnknown,
    CatalogUnavailable,
    FileRecord,
    FileType,
    PathRecord,
)
from retina_common.checkpoint_store import CheckpointBody
from retina_common.codec import GC_REWRITE_ID_KEY
from retina_common.log import get_logger
from retina_common.storage import open_parquet
from retina_server.gc.gc_journal import GcJournal, JournalEntry, JournalState
from retina_server.gc.rewrites import Survivors, entry_survivors, roll_back
from retina_server.node import RetinaNode

log = get_logger(component="gc_recovery")
DECISIONS = Counter("retina_gc_recovery_decisions_total",
                    "Recovery decisions on GC journal entries", ["decision"])


class GcJournalMismatch(Exception):
    """The journal, the checkpoint and the catalog disagree, or a rollback anchor is gone:
    the node fails closed."""


@dataclass(frozen=True)
class Decision:
    rewrite_id: str
    state_before: str
    decision: str  # "keep" | "roll_back"


def decide(node: RetinaNode, catalog: Catalog, journal: GcJournal,
           checkpointed: set[int], files: list[FileRecord]) -> list[Decision]:
    """Decide every open entry. ``checkpointed``: file ids of the loaded checkpoint;
    ``files``: the catalog's files (re-read by the caller afterwards)."""
    decisions = []
    by_id = {f.file_id: f for f in files}
    for entry in journal.open_entries():
        if entry.state == JournalState.REVERTING:
            continue  # an operator's revert: lineage.recover_reverts finishes it
        holds_new = entry.new_file_id in checkpointed
        if entry.state == JournalState.SWAPPED_NOT_CHECKPOINTED and holds_new:
            # Keep the new file. Promotion waits until both slots hold it (the READY
            # checkpoint makes that so): a later fallback to ``previous`` must find it.
            decisions.append(Decision(entry.rewrite_id, entry.state.value, "keep"))
            DECISIONS.labels(decision="keep").inc()
            log.info("gc_recovery_kept", node=node.node_id, rewrite_id=entry.rewrite_id,
                     new_file_id=entry.new_file_id)
            continue
        if holds_new:
            raise GcJournalMismatch(
                f"rewrite {entry.rewrite_id} is {entry.state.value}, but the checkpoint holds "
                f"its new file {entry.new_file_id}")
        plan = _anchors(node, catalog, entry, by_id)
        roll_back(node, catalog, journal, entry, plan,
                  f"recovery: {entry.state.value} and the loaded checkpoint does not hold the "
                  "new file")
        decisions.append(Decision(entry.rewrite_id, entry.state.value, "roll_back"))
        DECISIONS.labels(decision="roll_back").inc()
    return decisions


def _anchors(node: RetinaNode, catalog: Catalog, entry: JournalEntry,
             by_id: dict[int, FileRecord]) -> Survivors:
    """What a rollback needs: the old files (catalog rows, objects, MainIndex ranges)
    and the survivors' keys and old row ids. Raises GcJournalMismatch if one is gone."""
    for old in entry.old_files:
        record = by_id.get(old.file_id)
        if record is None or record.type not in (FileType.REGULAR, FileType.RETIRED):
            raise GcJournalMismatch(
                f"rewrite {entry.rewrite_id}: rollback anchor gone: old file {old.file_id} is "
                f"{'missing' if record is None else record.type.name} in the catalog")
    try:
        return entry_survivors(node, entry)
    except (CatalogUnavailable, CatalogOutcomeUnknown):
        raise  # the catalog is briefly away: start-up retries
    except Exception as exc:  # an anchor is unreadable: never guess
        raise GcJournalMismatch(f"rewrite {entry.rewrite_id}: rollback anchor gone: "
                                f"{exc}") from exc


def check_unjournaled(node: RetinaNode, catalog: Catalog, journal: GcJournal,
                      files: list[FileRecord]) -> int:
    """GC_ROWS_HAVE_A_JOURNAL (see the module docstring); returns ranges dropped."""
    named = {f for e in journal.entries() for f in (e.new_file_id, *e.old_file_ids)}
    with_ranges = node.index.main.files_with_ranges()
    suspects = []
    for f in files:
        if f.type != FileType.TEMPORARY_GC or f.file_id in named or \
                f.file_id not in with_ranges:
            continue
        with contextlib.suppress(ValueError):
            if file_names.parse(f.name).node_id == node.node_id:
                suspects.append(f)
    if not suspects:
        return 0
    spans = [(r.row_id_start, r.row_id_end) for f in suspects
             for r in node.index.main.ranges_of_file(f.file_id)]
    bad = node.index.primary.versions_pointing_into(spans)
    if bad:
        raise GcJournalMismatch(
            "GC_ROWS_HAVE_A_JOURNAL: primary-index versions point at rows of GC files "
            f"{[f.file_id for f in suspects][:5]} that no journal entry names: "
            + "; ".join(f"table {t} key {k.hex()[:16]}@{ts} -> row {r}" for t, k, ts, r in bad))
    for f in suspects:
        node.index.main.delete_main_index_range(f.file_id)
        log.warning("gc_unjournaled_ranges_dropped", file_id=f.file_id, name=f.name)
    return len(suspects)


def check_rewrite_outputs(node: RetinaNode, journal: GcJournal, body: CheckpointBody,
                          files: list[FileRecord], paths: list[PathRecord]) -> None:
    """REWRITE_OUTPUTS_HAVE_A_JOURNAL (see the module docstring); ``body``: the loaded
    baseline after the reverts rebased it; ``files``: the catalog after the decisions."""
    named = {f for e in journal.entries() for f in (e.new_file_id, *e.old_file_ids)}
    held = {e.file_id for e in body.files}
    by_path = {p.path_id: p for p in paths}
    lost: list[str] = []
    for f in files:
        stream = _own_stream(node, f, by_path)
        if f.type != FileType.REGULAR or f.file_id in held or f.file_id in named or \
                stream is None:
            continue
        rewrite_id, unreadable = _footer_rewrite_id(by_path[f.path_id].uri, f.name)
        if rewrite_id:
            lost.append(f"file {f.file_id} ({f.name}) is the output of rewrite {rewrite_id}")
        elif unreadable and stream in _retired_unnamed_streams(body, files, named):
            lost.append(f"file {f.file_id} ({f.name}): footer unreadable ({unreadable}) "
                        "beside checkpointed files RETIRED with no record")
    if lost:
        raise GcJournalMismatch(
            "REWRITE_OUTPUTS_HAVE_A_JOURNAL: REGULAR files that only a swapped Storage GC "
            "rewrite explains are in no journal record and not in the loaded checkpoint "
            "(the record is lost; restore it): " + "; ".join(lost[:5]))


def _own_stream(node: RetinaNode, f: FileRecord, paths: dict[int, PathRecord]
                ) -> tuple[int, int] | None:
    """(table, vnode) of one of this node's files, None for another node's."""
    try:
        name = file_names.parse(f.name)
    except ValueError:
        return None
    path = paths.get(f.path_id)
    if name.node_id != node.node_id or path is None:
        return None
    return path.table_id, name.vnode


def _footer_rewrite_id(path_uri: str, name: str) -> tuple[str, str]:
    """(the rewrite id in a file's footer or "", why the footer cannot be read or "")."""
    try:
        meta = open_parquet(path_uri, name).metadata.metadata or {}
    except (OSError, ValueError) as exc:
        log.warning("gc_recovery_footer_unreadable", name=name, error=str(exc))
        return "", str(exc) or type(exc).__name__
    return meta.get(GC_REWRITE_ID_KEY, b"").decode(), ""


def _retired_unnamed_streams(body: CheckpointBody, files: list[FileRecord],
                             named: set[int]) -> set[tuple[int, int]]:
    """Streams of checkpointed files the catalog says are RETIRED and no record names."""
    retired = {f.file_id for f in files if f.type == FileType.RETIRED}
    return {(e.table_id, e.vnode) for e in body.files
            if e.file_id in retired and e.file_id not in named}
