"""The GC journal's writes follow its transition table (pure logic, a real directory)."""

from __future__ import annotations

from pathlib import Path

import pytest

from retina_common import failpoints as fp
from retina_server.gc.gc_journal import (
    GcJournal,
    JournalConflict,
    JournalEntry,
    JournalState,
    OldFile,
)


def entry() -> JournalEntry:
    return JournalEntry(
        rewrite_id="r1", state=JournalState.INDEX_SWITCHING, node_id="127.0.0.1:1",
        schema_name="shop", table_name="orders", table_id=1, vnode=0, path_id=1,
        path_uri="file:///tmp/x", new_file_id=9, new_file_name="n.pxl", new_row_id_start=0,
        new_rg_row_counts=(3,), old_files=(OldFile(7, "o.pxl", (4,), 0, 1),), cutoff_ts=10,
        cleanup_at_ms=0, created_at_ms=1, updated_at_ms=1)


def write(journal: GcJournal, e: JournalEntry) -> JournalEntry:
    return journal.write(e, fp.GC_JOURNAL_CHECKPOINTED_BEFORE, fp.GC_JOURNAL_CHECKPOINTED_AFTER)


def test_a_stale_promotion_cannot_overwrite_a_revert(tmp_path: Path) -> None:
    """JOURNAL_WRITES_FOLLOW_TRANSITIONS: a checkpoint's promotion and an operator's
    revert both read SWAPPED_NOT_CHECKPOINTED; the revert writes first, so the
    promotion's CHECKPOINTED is refused and REVERTING stays durable."""
    journal = GcJournal(tmp_path)
    swapped = write(journal, entry().moved(JournalState.SWAPPED_NOT_CHECKPOINTED, 2))
    reverting = write(journal, swapped.moved(JournalState.REVERTING, 3))
    with pytest.raises(JournalConflict):
        write(journal, swapped.moved(JournalState.CHECKPOINTED, 4))
    assert journal.get("r1") == reverting
    assert [e.state for e in GcJournal(tmp_path).load()] == [JournalState.REVERTING]
    # After REVERTED no stale writer can bring the rewrite back either.
    write(journal, reverting.moved(JournalState.REVERTED, 5))
    with pytest.raises(JournalConflict):
        write(journal, swapped.moved(JournalState.CHECKPOINTED, 6))
    assert [e.state for e in GcJournal(tmp_path).load()] == [JournalState.REVERTED]


def test_a_revert_after_a_promotion_and_a_repeated_write_are_allowed(tmp_path: Path) -> None:
    journal = GcJournal(tmp_path)
    swapped = write(journal, entry().moved(JournalState.SWAPPED_NOT_CHECKPOINTED, 2))
    write(journal, swapped.moved(JournalState.CHECKPOINTED, 3))
    write(journal, swapped.moved(JournalState.CHECKPOINTED, 3))  # the same state again
    write(journal, swapped.moved(JournalState.REVERTING, 4))  # CHECKPOINTED -> REVERTING
    assert [e.state for e in GcJournal(tmp_path).load()] == [JournalState.REVERTING]
