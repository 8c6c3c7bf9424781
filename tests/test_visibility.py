"""RGVisibility: snapshots, the DELETE fork by baseTimestamp, folding (pure logic)."""

from __future__ import annotations

import random

import numpy as np
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



@pytest.mark.parametrize("seed", range(6))
def test_deletes_between_are_the_chain_items_of_the_range(seed: int) -> None:
    """The change feed's deletes of (low, high]: exactly the rows whose earliest delete
    lies there, whatever order deletes arrived in (a replay's earlier delete of a row,
    one at or below the base), across folds and a checkpoint's restore; None below the
    base."""
    from retina_server.visibility import checkpoint_entry, restore

    rng = random.Random(seed)
    rg = RGVisibility(row_count=200)
    earliest: dict[int, int] = {}  # the model: row -> the earliest ts it was deleted at
    base = 0
    for step in range(400):
        ts = max(1, step + rng.randint(-30, 3))  # mostly rising, sometimes well behind
        rows = rng.sample(range(200), rng.randint(1, 4))
        rg.delete(rows, ts)
        for r in rows:
            earliest[r] = min(earliest.get(r, ts), ts)
        if rng.random() < 0.02:
            base = max(base, step - rng.randint(10, 60))
            rg.fold(base)
        if rng.random() < 0.02:
            rg = restore(checkpoint_entry(1, 0, rg, applied_ts=10**9))
        low = rng.randint(0, step + 5)
        high = low + rng.randint(0, 40)
        got = rg.deletes_between(low, high)
        if low < base:
            assert got is None
            continue
        expected = {(r, t) for r, t in earliest.items() if low < t <= high and t > base}
        assert got is not None and sorted(got) == sorted(expected)
        assert len(got) == len(expected)  # each row once
    assert sorted(rg.snapshot()[2]) == sorted((t, r) for r, t in earliest.items() if t > base)
    assert [t for t, _r in rg.snapshot()[2]] == sorted(t for t, _r in rg.snapshot()[2])


def test_a_read_below_the_base_is_refused_snapshot_expired() -> None:
    """NO_READ_BELOW_FOLD: the base no longer tells which of its rows were deleted after a
    timestamp below it, so no answer is given there."""
    import grpc

    from retina_common.refusal import SNAPSHOT_EXPIRED, Refusal, earliest_readable

    rg = RGVisibility(row_count=10)
    rg.delete([1], ts=5)
    rg.delete([2], ts=9)
    rg.fold(7)
    assert rg.deleted_at(7) == BitMap([1]) and rg.deleted_at(9) == BitMap([1, 2])
    with pytest.raises(Refusal) as refused:
        rg.deleted_at(6)
    assert refused.value.code == grpc.StatusCode.FAILED_PRECONDITION
    assert str(refused.value).startswith(SNAPSHOT_EXPIRED)
    assert earliest_readable(str(refused.value)) == (7, 0)


def test_a_checkpoint_entry_restores_every_snapshot_at_or_above_the_base() -> None:
    from retina_server.visibility import checkpoint_entry, restore

    rng = random.Random(3)
    rg = RGVisibility(row_count=300)
    for ts in range(1, 120):
        rg.delete(rng.sample(range(300), 2), ts)
    rg.fold(40)
    entry = checkpoint_entry(7, 0, rg, applied_ts=100)
    assert entry.base_timestamp == 40 and all(ts <= 100 for ts, _row in entry.chain)
    back = restore(entry)
    # At or above the base and up to the checkpoint: the same; later deletes are replayed.
    assert all(back.deleted_at(ts) == rg.deleted_at(ts) for ts in range(40, 101))
    assert back.deleted_at(119) == rg.deleted_at(100)


def test_point_checks_agree_with_the_bitmap_and_refuse_below_the_base() -> None:
    """deleted_among (LookupRows' visibility check) equals deleted_at, row by row, at every
    snapshot at or above the base; below it there is no answer."""
    rng = random.Random(3)
    rg = RGVisibility(row_count=200)
    for ts in range(1, 60):
        rg.delete(rng.sample(range(200), 5), ts)
        if ts % 20 == 0:
            rg.fold(ts - 7)
    rows = np.array(rng.sample(range(200), 80), np.int64)
    for ts in range(rg.base_timestamp, 62):
        deleted = rg.deleted_at(ts)
        assert rg.deleted_among(rows, ts).tolist() == [int(r) in deleted for r in rows]
    assert rg.deleted_among(rows, rg.base_timestamp - 1) is None


def test_readable_row_groups_are_the_retired_or_staged_ones_first() -> None:
    index = VisibilityIndex()
    index.add_file(1, [10, 10])
    live = index.readable(1, 1)
    assert live is index.get(1, 1) and index.readable(1, 2) is None
    index.retire_file(1)  # replaced: its frozen row groups still answer
    assert index.readable(1, 1) is live
    staged = [RGVisibility(5, 9)]
    index.stage_file(2, staged)
    assert index.readable(2, 0) is staged[0] and index.readable(2, 1) is None
    index.forget_retired(1)
    index.unstage_file(2)
    assert index.readable(1, 0) is None and index.readable(2, 0) is None


def test_a_files_row_groups_follow_adds_adoptions_removals_and_retirements() -> None:
    """VisibilityIndex.row_groups and files (kept per file, not found by a scan) against a
    model, through every operation that adds or drops a row group."""
    rng = random.Random(11)
    index = VisibilityIndex()
    model: dict[int, set[int]] = {}
    for file_id in range(1, 200):
        choice = rng.random()
        if choice < 0.5:
            groups = rng.randint(1, 4)
            index.add_file(file_id, [10] * groups)
            model[file_id] = set(range(groups))
        else:  # a write-buffer file's blocks adopted one by one as it publishes
            blocks = rng.randint(1, 3)
            for rg_id in range(blocks):
                index.adopt(file_id, rg_id, RGVisibility(5))
            model[file_id] = set(range(blocks))
        if model and rng.random() < 0.3:
            gone = rng.choice(sorted(model))
            if rng.random() < 0.5:
                index.remove_file(gone)
            else:
                retired = index.row_groups(gone)
                index.retire_file(gone)
                assert len(index.retired(gone) or []) == len(retired)
            del model[gone]
        assert index.files() == set(model)
        assert all(index.row_groups(f) == sorted(rgs) for f, rgs in model.items())
    assert index.row_groups(10_000) == []
