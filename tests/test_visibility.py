"""RGVisibility: snapshots, the DELETE fork by baseTimestamp, folding (pure logic)."""

from __future__ import annotations

import random

import pytest
from pyroaring import BitMap

from retina_server.visibility import (
    RGVisibility,
    VisibilityError,
    VisibilityIndex,
    bitmap_to_bytes,
    bytes_to_rows,
)


def test_deletes_are_visible_from_their_timestamp_on() -> None:
    rg = RGVisibility(row_count=10)
    assert rg.delete([1, 2], ts=5) == 2
    assert rg.delete([2, 3], ts=8) == 1  # row 2 already deleted at 5: counted once
    assert rg.deleted_at(4) == BitMap()
    assert rg.deleted_at(5) == BitMap([1, 2])
    assert rg.deleted_at(8) == BitMap([1, 2, 3])


def test_delete_at_or_below_base_folds_copy_on_write() -> None:
    rg = RGVisibility(row_count=10, base_ts=100)
    before = rg.snapshot()[1]
    assert rg.delete([4], ts=100) == 1  # T <= baseTimestamp: into the base
    base_ts, base, chain = rg.snapshot()
    assert base == BitMap([4]) and chain == [] and base_ts == 100
    assert before == BitMap()  # the old base object did not change under its reader
    rg.delete([5], ts=101)  # T > baseTimestamp: a chain item
    assert rg.snapshot()[2] == [(101, 5)]


def test_fold_keeps_every_snapshot_above_safe_ts_unchanged() -> None:
    rng = random.Random(7)
    rg = RGVisibility(row_count=500)
    for ts in range(1, 200):
        rg.delete(rng.sample(range(500), 3), ts)
    expected = {ts: rg.deleted_at(ts) for ts in range(100, 201)}
    assert rg.fold(99) > 0
    assert rg.base_timestamp == 99
    assert all(rg.deleted_at(ts) == bits for ts, bits in expected.items())
    assert rg.fold(50) == 0  # never backwards


def test_rows_outside_the_row_group_are_refused() -> None:
    rg = RGVisibility(row_count=3)
    with pytest.raises(VisibilityError):
        rg.delete([3], ts=1)
    rg.grow(5)
    assert rg.delete([4], ts=1) == 1


def test_index_and_bitset_encoding() -> None:
    index = VisibilityIndex()
    index.add_file(7, [4, 9])
    assert index.row_groups(7) == [0, 1] and 7 in index.files()
    with pytest.raises(VisibilityError):
        index.add_file(7, [1])
    index.get(7, 1).delete([0, 8], 3)
    data = bitmap_to_bytes(index.get(7, 1).deleted_at(3), 9)
    assert data == bytes([0b00000001, 0b00000001])
    assert bytes_to_rows(data, 9) == [0, 8]
    index.remove_file(7)
    assert 7 not in index.files()


def memory_bytes(rg: RGVisibility) -> int:
    """What a row group's visibility holds: its base bitmap, serialized, and 16 bytes per
    chain item (a timestamp and a row)."""
    _base_ts, base, chain = rg.snapshot()
    return len(base.serialize()) + 16 * len(chain)


def test_memory_is_about_a_bit_per_row_or_less() -> None:
    rg = RGVisibility(row_count=1_000_000, base_ts=10)
    rg.delete(range(0, 1_000_000, 2), ts=5)  # the worst case: every other row deleted
    assert memory_bytes(rg) <= 1.1 * 1_000_000 / 8
    sparse = RGVisibility(row_count=1_000_000, base_ts=10)
    sparse.delete(range(0, 1_000_000, 1000), ts=5)
    assert memory_bytes(sparse) <= 1_000_000 / 8 / 10


def test_out_of_order_deletes_keep_the_earliest_timestamp() -> None:
    rg = RGVisibility(row_count=4)
    assert rg.delete([1], ts=10) == 1
    assert rg.delete([1], ts=5) == 1  # a replayed, earlier delete of the same row
    assert rg.deleted_at(5) == BitMap([1]) and rg.deleted_at(4) == BitMap()
    assert rg.delete([1], ts=7) == 0
    assert rg.snapshot()[2] == [(5, 1)]

