"""The retention guard: the one rule every sweeper asks before it removes a file.

A file is physically removed only when all of these hold (Apache Hudi's HUDI-7779:
a cleaner must never remove what a reader can still need):

* CLEANUP_AT_PASSED: a RETIRED file's cleanupAt has passed (a temporary file's
  TTL, counted from the UTC time in its name, has; an orphan candidate's grace,
  counted from the later of its name's time and its modification time, has);
* NO_READER_HOLDS: no live read transaction, offloaded ones included, was
  given the file by ListQueryFiles (the TransServer's read holds), no listing
  is between its catalog read and its record, and the TransServer answered
  at all (unknown holds hold everything);
* NO_CHECKPOINT_SLOT_HOLDS: neither checkpoint slot (``current``,
  ``previous``) of this node names the file: a start that falls back to
  ``previous`` must find every file it names;
* NO_JOURNAL_ANCHOR: no open GC journal entry (INDEX_SWITCHING,
  SWAPPED_NOT_CHECKPOINTED, REVERTING) names it: a rollback or a revert
  needs the old files, and a commit under way its new one.

An orphan candidate (orphans.py: an object under a table path that no catalog
row, journal record or prepared rewrite names) is asked with ``file=None``. It
has no file id, so no reader, slot or journal entry can name it by id; what
holds it is its grace and the holds that hold *every* file (read holds unknown,
a listing in flight, a slot that cannot be read). The orphan pass checks the
names itself, once after listing and again just before each delete.

:func:`hold_reason` is that rule; it returns the first reason that holds the
file, or None when the file may go. Every sweeper pass (sweeper.py) and the
orphan reconciliation (orphans.py) call it, never a rule of their own.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from retina_common.catalog import FileRecord, FileType


class HoldReason(StrEnum):
    CLEANUP_AT_NOT_PASSED = "cleanup_at_not_passed"
    TTL_NOT_PASSED = "ttl_not_passed"
    GRACE_NOT_PASSED = "grace_not_passed"
    READ_HOLDS_UNKNOWN = "read_holds_unknown"
    LISTING_IN_FLIGHT = "listing_in_flight"
    LIVE_READER = "live_reader"
    CHECKPOINT_SLOT = "checkpoint_slot"
    JOURNAL_ANCHOR = "journal_anchor"
    LOAD_JOURNAL = "load_journal"  # a prepared or journaled bulk load (bulk_load.py)


@dataclass(frozen=True)
class Holds:
    """Everything that can hold a file, read once per sweep round (in this order:
    catalog candidates first, holds after, so a hold taken after the listing is seen)."""

    now_ms: int
    # None: the TransServer did not answer (every file is held).
    reader_files: frozenset[int] | None
    listings_in_flight: int
    # None: a slot could not be read (every file is held).
    checkpoint_files: frozenset[int] | None
    journal_anchors: frozenset[int]
    # Files of prepared and journaled bulk loads (LOAD_FILES_OUTLIVE_THEIR_ENTRY).
    load_files: frozenset[int] = frozenset()


def hold_reason(file: FileRecord | None, holds: Holds, *, due_at_ms: int | None = None
                ) -> HoldReason | None:
    """Why ``file`` must stay, or None if it may be removed now. ``file=None``: an
    orphan candidate (an object no catalog row names). ``due_at_ms``: when a
    non-RETIRED file becomes due (a temporary file's name time + TTL, an orphan
    candidate's write time + grace); a RETIRED file is due at its cleanupAt."""
    due = _not_due(file, holds.now_ms, due_at_ms)
    if due is not None:
        return due
    if holds.reader_files is None:
        return HoldReason.READ_HOLDS_UNKNOWN
    if holds.listings_in_flight:
        return HoldReason.LISTING_IN_FLIGHT
    if file is None:  # no id: only the holds on every file apply
        return HoldReason.CHECKPOINT_SLOT if holds.checkpoint_files is None else None
    if file.file_id in holds.reader_files:
        return HoldReason.LIVE_READER
    if holds.checkpoint_files is None or file.file_id in holds.checkpoint_files:
        return HoldReason.CHECKPOINT_SLOT
    if file.file_id in holds.journal_anchors:
        return HoldReason.JOURNAL_ANCHOR
    if file.file_id in holds.load_files:
        return HoldReason.LOAD_JOURNAL
    return None


def _not_due(file: FileRecord | None, now_ms: int, due_at_ms: int | None) -> HoldReason | None:
    if file is not None and file.type == FileType.RETIRED:
        if file.cleanup_at is None or file.cleanup_at > now_ms:
            return HoldReason.CLEANUP_AT_NOT_PASSED
        return None
    if due_at_ms is None or due_at_ms > now_ms:
        return HoldReason.GRACE_NOT_PASSED if file is None else HoldReason.TTL_NOT_PASSED
    return None
