"""LocalIndexService: staged primary-index primitives, MainIndex flush, row ids.

Real LMDB and SQLite files in a temporary directory."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from retina_server.index import LocalIndexService, Resolution
from retina_server.main_index import RowIdRange, RowLocation
from retina_server.primary_index import TOMBSTONE


def everything(_file_id: int) -> bool:
    return True


def test_resolve_put_tombstone_and_orphans(tmp_path: Path) -> None:
    index = LocalIndexService(tmp_path)
    first = index.sequences.allocate_row_ids(2)
    index.main.put_main_index_entries([RowIdRange(first, 2, file_id=5, rg_id=0, rg_row_offset=10)])
    index.primary.put_primary_entries_only(1, [b"a", b"b"], [first, first + 1], ts=3)
    found = index.resolve_primary(1, [b"a", b"b", b"zz"], everything, 10)
    assert [r.status for r in found] == [Resolution.FOUND, Resolution.FOUND,
                                         Resolution.NOT_FOUND_OR_ORPHAN]
    assert found[1].location == RowLocation(5, 0, 11)
    # Same key bytes in another table are another key.
    assert index.resolve_primary(2, [b"a"], everything, 10)[0].status == \
        Resolution.NOT_FOUND_OR_ORPHAN
    # A row in a file outside the baseline is an orphan, not a match.
    assert index.resolve_primary(1, [b"a"], lambda f: f != 5, 10)[0].status == \
        Resolution.NOT_FOUND_OR_ORPHAN
    index.primary.tombstone_primary_resolved(1, [b"a"], ts=4)
    assert index.resolve_primary(1, [b"a"], everything, 10)[0].status == \
        Resolution.NOT_FOUND_OR_ORPHAN


def test_restore_undoes_a_put(tmp_path: Path) -> None:
    index = LocalIndexService(tmp_path)
    r = index.sequences.allocate_row_ids(2)
    index.main.put_main_index_entries([RowIdRange(r, 2, 1, 0, 0)])
    index.primary.put_primary_entries_only(1, [b"k"], [r], ts=1)
    previous = index.primary.put_primary_entries_only(1, [b"k", b"new"], [r + 1, r + 1], ts=2)
    index.primary.restore_primary_entries(1, previous)
    got = index.resolve_primary(1, [b"k", b"new"], everything, 10)
    assert got[0].row_id == r and got[1].status == Resolution.NOT_FOUND_OR_ORPHAN


def test_main_index_flush_is_durable_and_buffers_are_not(tmp_path: Path) -> None:
    index = LocalIndexService(tmp_path)
    a = index.sequences.allocate_row_ids(3)
    b = index.sequences.allocate_row_ids(3)
    index.main.put_main_index_entries([RowIdRange(a, 3, 10, 0, 0), RowIdRange(b, 3, 11, 0, 0)])
    index.primary.put_primary_entries_only(1, [b"x", b"y"], [a, b], ts=1)
    assert index.main.flush_file(10) == 3
    assert index.main.flush_file(10) == 3  # a retry: the buffer is gone, the marker answers
    assert index.main.flushed_row_count(10) == 3
    index.close()
    reopened = LocalIndexService(tmp_path)
    assert reopened.main.location_of(a + 2) == RowLocation(10, 0, 2)
    assert reopened.main.location_of(b) is None  # file 11 was never flushed: dropped with memory
    resolved = reopened.resolve_primary(1, [b"x", b"y"], everything, 10)
    assert [r.status for r in resolved] == [Resolution.FOUND, Resolution.NOT_FOUND_OR_ORPHAN]
    assert reopened.sequences.allocate_row_ids(1) > b + 2  # never reused after a restart
    reopened.main.delete_main_index_range(10)
    assert reopened.main.location_of(a) is None and reopened.main.flushed_row_count(10) is None


def test_versions_resolve_by_timestamp_and_truncate_from_a_start(tmp_path: Path) -> None:
    index = LocalIndexService(tmp_path)
    r = index.sequences.allocate_row_ids(3)
    index.main.put_main_index_entries([RowIdRange(r, 3, 1, 0, 0)])
    index.primary.put_primary_entries_only(1, [b"k"], [r], ts=10)
    index.primary.tombstone_primary_resolved(1, [b"k"], ts=20)
    index.primary.put_primary_entries_only(1, [b"k"], [r + 1], ts=30)
    index.primary.put_primary_entries_only(1, [b"k2"], [r + 2], ts=25)
    at = {ts: index.resolve_primary(1, [b"k"], everything, ts)[0] for ts in (5, 15, 20, 25, 35)}
    assert at[5].status == Resolution.NOT_FOUND_OR_ORPHAN
    assert at[15].row_id == r and at[25].status == Resolution.NOT_FOUND_OR_ORPHAN
    # A DELETE at 20 looks past its own tombstone at 20 (a retry or a replay).
    assert at[20].row_id == r
    assert at[35].row_id == r + 1
    # A key that is a prefix of another never sees the other's versions.
    assert index.resolve_primary(1, [b"k2"], everything, 40)[0].row_id == r + 2
    # Back to the state as of 20 for key k (start 20), 30 for k2 (start 30).
    removed = index.primary.truncate_versions(20, lambda _t, key: 20 if key == b"k" else 30)
    assert removed == 2
    assert index.resolve_primary(1, [b"k"], everything, 99)[0].row_id == r
    assert index.resolve_primary(1, [b"k2"], everything, 99)[0].row_id == r + 2


def test_delete_targets_the_predecessor_and_a_stale_copy_at_its_own_timestamp(
        tmp_path: Path) -> None:
    index = LocalIndexService(tmp_path)
    r = index.sequences.allocate_row_ids(3)
    index.main.put_main_index_entries([RowIdRange(r, 3, 1, 0, 0)])
    index.primary.put_primary_entries_only(1, [b"k"], [r], ts=12)  # a replayed re-insert
    index.primary.put_primary_entries_only(1, [b"k"], [r + 1], ts=16)  # a stale copy of event 16
    targets = index.resolve_for_delete(1, [b"k"], everything, 16)
    assert targets is not None
    assert sorted(t.row_id for t in targets[0]) == [r, r + 1]
    # Normal operation: nothing at the delete's own timestamp, only the predecessor.
    assert [t.row_id for t in index.resolve_for_delete(1, [b"k"], everything, 20)[0]] == [r + 1]
    index.primary.tombstone_primary_resolved(1, [b"k"], ts=20)
    assert [t.row_id for t in index.resolve_for_delete(1, [b"k"], everything, 20)[0]] == [r + 1]
    assert index.resolve_for_delete(1, [b"k"], everything, 25)[0] == []


def test_truncate_targets_skip_dead_keys_and_later_versions(tmp_path: Path) -> None:
    """What a TRUNCATE at 20 deletes: keys whose latest version at or before 20 is a
    row. Keys tombstoned before 20 and keys first written after 20 are left out;
    versions after 20 never matter. Its own tombstones at 20 (a re-application) do
    not hide the row before them."""
    index = LocalIndexService(tmp_path)
    r = index.sequences.allocate_row_ids(8)
    index.main.put_main_index_entries([RowIdRange(r, 8, 1, 0, 0)])
    index.primary.put_primary_entries_only(1, [b"live", b"dead", b"later", b"stale"],
                                   [r, r + 1, r + 2, r + 3], ts=10)
    index.primary.tombstone_primary_resolved(1, [b"dead"], ts=15)
    index.primary.put_primary_entries_only(1, [b"later"], [r + 4], ts=25)
    index.primary.put_primary_entries_only(1, [b"fresh"], [r + 5], ts=30)
    index.primary.put_primary_entries_only(1, [b"stale"], [r + 6], ts=20)  # a copy at 20 itself
    index.primary.put_primary_entries_only(2, [b"other"], [r + 7], ts=10)  # another table

    def vnode(key: bytes) -> int:
        return len(key) % 2

    # In the index's order (keys stored reversed: KEYS_STORED_REVERSED).
    assert index.primary.truncate_targets(1, 20, vnode) == {0: [b"live"], 1: [b"stale", b"later"]}
    assert index.primary.truncate_targets(1, 5, vnode) == {}
    assert index.primary.truncate_targets(3, 20, vnode) == {}
    # The TRUNCATE at 20 applied: its tombstones, then the same key inserted at 25.
    index.primary.tombstone_primary_resolved(1, [b"live", b"later", b"stale"], ts=20)
    # Applied again: the same keys (their rows before 20 are deleted already, so the
    # DELETE writes only the same tombstones); "dead" stays out.
    # In the index's order (keys stored reversed: KEYS_STORED_REVERSED).
    assert index.primary.truncate_targets(1, 20, vnode) == {0: [b"live"], 1: [b"stale", b"later"]}
    assert index.resolve_primary(1, [b"later"], everything, 99)[0].row_id == r + 4
    assert index.primary.truncate_targets(1, 99, vnode) == {1: [b"fresh", b"later"]}


def test_truncate_applied_again_deletes_a_row_replayed_under_its_tombstone(
        tmp_path: Path) -> None:
    """A replay without a rewind in between (a connector killed before MarkReady
    replays the same range again) re-inserts a key at 10 under the tombstone its
    first TRUNCATE at 20 wrote: the TRUNCATE applied again must delete that row."""
    index = LocalIndexService(tmp_path)
    r = index.sequences.allocate_row_ids(2)
    index.main.put_main_index_entries([RowIdRange(r, 2, 1, 0, 0)])
    index.primary.put_primary_entries_only(1, [b"k"], [r], ts=10)
    index.primary.tombstone_primary_resolved(1, [b"k"], ts=20)
    index.primary.put_primary_entries_only(1, [b"k"], [r + 1], ts=10)  # the replay's new copy
    assert index.primary.truncate_targets(1, 20, lambda _k: 0) == {0: [b"k"]}
    targets = index.delete_targets(1, [b"k"], everything, 20)
    assert targets is not None and targets.found_keys == [b"k"]
    assert targets.rows_by_rg == {(1, 0): [1]}  # the replayed copy, row r + 1


def _grouped(keys: list[bytes], resolved: list) -> tuple[list[bytes], dict]:
    """resolve_for_delete's answer in delete_targets' shape."""
    by_rg: dict[tuple[int, int], list[int]] = {}
    found = []
    for key, rows in zip(keys, resolved, strict=True):
        for r in rows:
            by_rg.setdefault((r.location.file_id, r.location.rg_id), []).append(
                r.location.rg_row_offset)
        if rows:
            found.append(key)
    return found, by_rg


@pytest.mark.parametrize("asked_keys", [120, 4], ids=["arrays", "a-few-keys"])
def test_batch_delete_targets_equal_resolve_for_delete_at_every_timestamp(
        tmp_path: Path, asked_keys: int) -> None:
    """delete_targets (array lookups of the MainIndex; point lookups for a few keys, a
    CDC transaction's part) against resolve_for_delete (one object per key), seeded:
    ranges in the buffer and flushed, files outside the baseline, dropped ranges,
    tombstones, stale copies at a delete's own timestamp."""
    import random

    rng = random.Random(15)
    index = LocalIndexService(tmp_path)
    keys = [f"k{i}".encode() for i in range(300)]
    files = list(range(1, 9))
    outside = {2, 5}

    def baseline(file_id: int) -> bool:
        return file_id not in outside

    compared = 0

    def compare(ts: int) -> None:
        nonlocal compared
        asked = [*rng.sample(keys, asked_keys), b"never-written"]
        resolved = index.resolve_for_delete(1, asked, baseline, ts)
        targets = index.delete_targets(1, asked, baseline, ts)
        assert targets is not None and resolved is not None
        assert (targets.found_keys, targets.rows_by_rg) == _grouped(asked, resolved), ts
        compared += len(targets.found_keys)

    # Rows are written at even timestamps and tombstones at odd ones, so a delete at an
    # odd timestamp takes the batch path (nothing but a tombstone at its own timestamp)
    # and one at an even timestamp the stale-copy path. Compared after every step too:
    # the MainIndex's arrays follow each change (ranges added at the end and, when a
    # file is flushed out of row-id order, in the middle; a file's ranges dropped).
    for step in range(1, 60):
        ts = 2 * step
        chosen = rng.sample(keys, 25)
        file_id = rng.choice(files)
        first = index.sequences.allocate_row_ids(len(chosen))
        index.main.put_main_index_entries([RowIdRange(first, len(chosen), file_id, ts % 3,
                                                 rng.randrange(100))])
        index.primary.put_primary_entries_only(1, chosen,
                                               list(range(first, first + len(chosen))), ts)
        index.primary.tombstone_primary_resolved(1, rng.sample(keys, 5), ts + 1)
        if step % 4 == 0:
            index.main.flush_file(rng.choice(files))
        if step == 45:
            index.main.delete_main_index_range(files[-1])  # its rows become orphans
        compare(ts + 1)
        compare(ts)
    for ts in range(0, 124):
        compare(ts)
    assert compared > 50 * asked_keys  # the comparison saw real deletes, not empty answers


def test_latest_is_each_keys_row_at_a_snapshot_and_the_prune_horizon_is_durable(
        tmp_path: Path) -> None:
    """PrimaryIndex.latest (LookupRows' first step) against a model of every key's history,
    at every snapshot; pruning records its horizon before it removes anything, and a
    reopened index still knows it."""
    index = LocalIndexService(tmp_path)
    primary = index.primary
    rng = random.Random(7)
    keys = [f"k{i}".encode() for i in range(30)]
    life: dict[bytes, list[tuple[int, int]]] = {k: [] for k in keys}  # (ts, row or -1)
    row = 0
    for ts in range(1, 80):
        for key in rng.sample(keys, 6):
            if life[key] and life[key][-1][1] >= 0 and rng.random() < 0.4:
                primary.tombstone_primary_resolved(1, [key], ts)
                life[key].append((ts, TOMBSTONE))
            else:
                primary.put_primary_entries_only(1, [key], [row], ts)
                life[key].append((ts, row))
                row += 1

    def expected(ts: int) -> list[int]:
        return [max(((t, r) for t, r in life[k] if t <= ts), default=(0, TOMBSTONE))[1]
                for k in keys]

    assert all(primary.latest(1, keys, ts).tolist() == expected(ts) for ts in range(0, 82))
    assert primary.latest(2, keys, 80).tolist() == [TOMBSTONE] * len(keys)  # another table
    assert primary.latest(1, [], 80).tolist() == []
    assert primary.latest(1, [b"x" * 600, keys[0]], 80).tolist() == [TOMBSTONE, expected(80)[0]]
    assert primary.pruned_below == 0
    assert primary.prune_versions(40, 0) > 0
    assert primary.pruned_below == 40
    assert all(primary.latest(1, keys, ts).tolist() == expected(ts) for ts in range(40, 82))
    primary.prune_versions(30, 0)  # a lower horizon never lowers it
    assert primary.pruned_below == 40
    index.close()
    reopened = LocalIndexService(tmp_path)
    assert reopened.primary.pruned_below == 40
    assert reopened.primary.latest(1, keys, 60).tolist() == expected(60)


def test_keys_are_stored_reversed_and_an_older_index_keeps_its_layout(tmp_path: Path) -> None:
    """KEYS_STORED_REVERSED: consecutive little-endian ids are neighbours in a new index.
    An index written before the layout existed (versions, no layout record) keeps its
    keys as they are, and answers as before."""
    from retina_server.primary_index import LAYOUT_LEGACY, LAYOUT_REVERSED, PrimaryIndex

    keys = [i.to_bytes(8, "little") for i in range(300)]
    new = PrimaryIndex(tmp_path / "new")
    new.put_primary_entries_only(1, keys, range(300), ts=5)
    stored = [key for _t, key, _ts, _row in new.versions()]
    assert sorted(stored) == sorted(keys)  # versions() answers the keys as written
    with new.env.begin() as txn:
        raw = [k for k, _v in txn.cursor(db=new._primary)]
    assert [k[12:20] for k in raw] == [k[::-1] for k in keys]  # in id order
    with new.env.begin(db=new._meta) as txn:
        assert txn.get(b"key_layout", db=new._meta) == LAYOUT_REVERSED
    # An older index: versions written unreversed and no layout record.
    old_dir = tmp_path / "old"
    legacy = PrimaryIndex(old_dir)
    legacy._reverse = False
    legacy.put_primary_entries_only(1, keys[:3], [7, 8, 9], ts=5)
    with legacy.env.begin(write=True, db=legacy._meta) as txn:
        txn.delete(b"key_layout", db=legacy._meta)
    legacy.close()
    reopened = PrimaryIndex(old_dir)
    with reopened.env.begin(db=reopened._meta) as txn:
        assert txn.get(b"key_layout", db=reopened._meta) == LAYOUT_LEGACY
    assert reopened.latest(1, keys[:3], 5).tolist() == [7, 8, 9]
    assert reopened.load_conflicts(1, keys[:4], 6) == [0, 1, 2]


@pytest.mark.parametrize("seed", range(6))
def test_load_conflicts_match_a_model_of_every_key(tmp_path: Path, seed: int) -> None:
    """LOAD_KEYS_HAVE_NO_LIVE_VERSION, against a model: versions of other tables and
    key widths around the load's, runs of keys with no version between keys with one
    (the walk's skips), tombstones, versions after the load's timestamp; the keys in
    the index's order (the walk) and shuffled (one lookup each) give the same answer."""
    from retina_server.primary_index import PrimaryIndex

    rng = random.Random(seed)
    index = PrimaryIndex(tmp_path / "primary")
    table, load_ts = 7, 50
    versions: dict[bytes, list[tuple[int, int]]] = {}  # the load table's, by key
    for other in (6, 8):  # neighbours in the index's order on both sides
        index.put_primary_entries_only(other, [i.to_bytes(8, "little") for i in range(40)],
                                       range(40), ts=3)
    index.put_primary_entries_only(table, [b"ab", b"abc"], [1, 2], ts=4)  # other widths
    universe = [i.to_bytes(8, "little") for i in range(400)]
    for key in rng.sample(universe, 120):
        for ts in sorted(rng.sample(range(1, 80), rng.randint(1, 3))):
            row = TOMBSTONE if rng.random() < 0.4 else rng.randint(0, 10**6)
            if row == TOMBSTONE:
                index.tombstone_primary_resolved(table, [key], ts=ts)
            else:
                index.put_primary_entries_only(table, [key], [row], ts=ts)
            versions.setdefault(key, []).append((ts, row))

    def clashes(key: bytes) -> bool:
        stamps = versions.get(key, [])
        if any(ts > load_ts for ts, _row in stamps):
            return True
        upto = [row for ts, row in stamps if ts <= load_ts]
        return bool(upto) and upto[-1] != TOMBSTONE

    load = rng.sample(universe, 250)
    ordered = [load[i] for i in index.index_order(load)]
    expected = [i for i, key in enumerate(ordered) if clashes(key)]
    assert 0 < len(expected) < len(ordered)
    assert index.load_conflicts(table, ordered, load_ts) == expected
    shuffled = rng.sample(ordered, len(ordered))
    assert sorted(shuffled[i] for i in index.load_conflicts(table, shuffled, load_ts)) == \
        sorted(ordered[i] for i in expected)
    assert index.load_conflicts(table, [k for k in universe if k not in versions], load_ts) == []
