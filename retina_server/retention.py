"""The retention guard: the one rule every sweeper asks before it removes a file.

A file is physically removed only when all of these hold (seed 002, HUDI-7779:
a cleaner must never remove what a reader can still need):

* CLEANUP_AT_PASSED: a RETIRED file's cleanupAt has passed (a temporary file's
  TTL, counted from the UTC time in its name, has);
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
    READ_HOLDS_UNKNOWN = "read_holds_unknown"
    LISTING_IN_FLIGHT = "listing_in_flight"
    LIVE_READER = "live_reader"
    CHECKPOINT_SLOT = "checkpoint_slot"
    JOURNAL_ANCHOR = "journal_anchor"


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


def hold_reason(file: FileRecord, holds: Holds, *, due_at_ms: int | None = None
                ) -> HoldReason | None:
    """Why ``file`` must stay, or None if it may be removed now. ``due_at_ms``: when a
    non-RETIRED file becomes due (a temporary file's name time + TTL); a RETIRED
    file is due at its cleanupAt."""
    if file.type == FileType.RETIRED:
        if file.cleanup_at is None or file.cleanup_at > holds.now_ms:
            return HoldReason.CLEANUP_AT_NOT_PASSED
    elif due_at_ms is None or due_at_ms > holds.now_ms:
        return HoldReason.TTL_NOT_PASSED
    if holds.reader_files is None:
        return HoldReason.READ_HOLDS_UNKNOWN
    if holds.listings_in_flight:
        return HoldReason.LISTING_IN_FLIGHT
    if file.file_id in holds.reader_files:
        return HoldReason.LIVE_READER
    if holds.checkpoint_files is None or file.file_id in holds.checkpoint_files:
        return HoldReason.CHECKPOINT_SLOT
    if file.file_id in holds.journal_anchors:
        return HoldReason.JOURNAL_ANCHOR
    return None
