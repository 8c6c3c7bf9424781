"""LocalIndexService: staged primary-index primitives, MainIndex flush, row ids.

Real LMDB and SQLite files in a temporary directory."""

from __future__ import annotations

from pathlib import Path

from retina_server.index import LocalIndexService, Resolution, RowIdRange, RowLocation


def everything(_file_id: int) -> bool:
    return True


def test_resolve_put_tombstone_and_orphans(tmp_path: Path) -> None:
    index = LocalIndexService(tmp_path)
    first = index.allocate_row_ids(2)
    index.put_main_index_entries([RowIdRange(first, 2, file_id=5, rg_id=0, rg_row_offset=10)])
    index.put_primary_entries_only(1, [b"a", b"b"], [first, first + 1], ts=3)
    found = index.resolve_primary(1, [b"a", b"b", b"zz"], everything)
    assert [r.status for r in found] == [Resolution.FOUND, Resolution.FOUND,
                                         Resolution.NOT_FOUND_OR_ORPHAN]
    assert found[1].location == RowLocation(5, 0, 11)
    # Same key bytes in another table are another key.
    assert index.resolve_primary(2, [b"a"], everything)[0].status == \
        Resolution.NOT_FOUND_OR_ORPHAN
    # A row in a file outside the baseline is an orphan, not a match.
    assert index.resolve_primary(1, [b"a"], lambda f: f != 5)[0].status == \
        Resolution.NOT_FOUND_OR_ORPHAN
    index.tombstone_primary_resolved(1, [b"a"], ts=4)
    assert index.resolve_primary(1, [b"a"], everything)[0].status == \
        Resolution.NOT_FOUND_OR_ORPHAN


def test_restore_undoes_a_put(tmp_path: Path) -> None:
    index = LocalIndexService(tmp_path)
    r = index.allocate_row_ids(2)
    index.put_main_index_entries([RowIdRange(r, 2, 1, 0, 0)])
    index.put_primary_entries_only(1, [b"k"], [r], ts=1)
    previous = index.put_primary_entries_only(1, [b"k", b"new"], [r + 1, r + 1], ts=2)
    index.restore_primary_entries(1, previous)
    got = index.resolve_primary(1, [b"k", b"new"], everything)
    assert got[0].row_id == r and got[1].status == Resolution.NOT_FOUND_OR_ORPHAN


def test_main_index_flush_is_durable_and_buffers_are_not(tmp_path: Path) -> None:
    index = LocalIndexService(tmp_path)
    a = index.allocate_row_ids(3)
    b = index.allocate_row_ids(3)
    index.put_main_index_entries([RowIdRange(a, 3, 10, 0, 0), RowIdRange(b, 3, 11, 0, 0)])
    index.put_primary_entries_only(1, [b"x", b"y"], [a, b], ts=1)
    assert index.flush_file(10) == 3
    assert index.flush_file(10) == 3  # a retry: the buffer is gone, the marker answers
    assert index.flushed_row_count(10) == 3
    index.close()
    reopened = LocalIndexService(tmp_path)
    assert reopened.location_of(a + 2) == RowLocation(10, 0, 2)
    assert reopened.location_of(b) is None  # file 11 was never flushed: dropped with memory
    resolved = reopened.resolve_primary(1, [b"x", b"y"], everything)
    assert [r.status for r in resolved] == [Resolution.FOUND, Resolution.NOT_FOUND_OR_ORPHAN]
    assert reopened.allocate_row_ids(1) > b + 2  # never reused after a restart
    reopened.delete_main_index_range(10)
    assert reopened.location_of(a) is None and reopened.flushed_row_count(10) is None
