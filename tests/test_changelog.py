"""The durable changelog: ordering, per-vnode starts, corruption, retention."""

from __future__ import annotations

from pathlib import Path

import crc32c
import pytest

from retina_common.changelog import (
    DELETE,
    PARTIAL,
    REPLACE,
    WATERMARK_NAME,
    BatchRecord,
    Changelog,
    ChangelogGap,
    ChangeRow,
    CorruptChangelog,
    LoggedTransaction,
    SegmentRef,
    encode_segment,
)
from retina_common.failpoints import FailpointTriggered


def txn(ts: int, rows: list[tuple[int, bytes, int]]) -> LoggedTransaction:
    return LoggedTransaction(ts, f"pos{ts}", f"x{ts}", 0, [
        ChangeRow(ts, seq, vnode, "t", op, key, None if op == DELETE else (b"\x01" + key,))
        for seq, (vnode, key, op) in enumerate(rows)])


def test_read_from_per_vnode_starts_in_ts_order(tmp_path: Path) -> None:
    log = Changelog(str(tmp_path))
    log.append([txn(10, [(0, b"a", REPLACE), (1, b"b", REPLACE)]), txn(11, [(0, b"a", DELETE)])])
    log.append([txn(20, [(1, b"c", REPLACE), (0, b"d", REPLACE)])])
    rows = list(log.read({0: 11, 1: 0}))
    assert [(r.ts, r.vnode, r.key, r.op) for r in rows] == [
        (10, 1, b"b", REPLACE), (11, 0, b"a", DELETE), (20, 0, b"d", REPLACE),
        (20, 1, b"c", REPLACE)]
    assert rows[-1].values == (b"\x01c",)
    assert list(log.read({0: 10}, upto_ts=10)) == [
        ChangeRow(10, 0, 0, "t", REPLACE, b"a", (b"\x01a",))]
    assert log.records()[-1].last_position == "pos20"


def test_batches_need_ascending_distinct_timestamps(tmp_path: Path) -> None:
    log = Changelog(str(tmp_path))
    with pytest.raises(ValueError):
        log.append([txn(5, []), txn(5, [])])
    assert log.records() == []


def test_corrupt_record_and_segment_are_errors_not_absence(tmp_path: Path) -> None:
    log = Changelog(str(tmp_path))
    record = log.append([txn(1, [(0, b"a", REPLACE)])])
    path = tmp_path / "batches" / record.name
    path.write_bytes(path.read_bytes()[:-1] + b" ")
    with pytest.raises(CorruptChangelog):
        log.records()
    log2 = Changelog(str(tmp_path / "two"))
    log2.append([txn(1, [(3, b"a", REPLACE)])])
    segment = next((tmp_path / "two" / "segments").rglob("*.parquet"))
    segment.write_bytes(segment.read_bytes() + b"\0")
    with pytest.raises(CorruptChangelog):
        list(log2.read({3: 0}))


def test_drop_before_keeps_the_horizon_and_removes_orphans(tmp_path: Path) -> None:
    log = Changelog(str(tmp_path))
    log.append([txn(1, [(0, b"a", REPLACE)])])
    log.append([txn(5, [(0, b"b", REPLACE)])])
    log.append([txn(9, [(0, b"c", REPLACE)])])
    # Segments no record names (a crash between the two writes), in both layouts; the
    # newest may still be mid-write, so only one below the horizon goes.
    orphans = [tmp_path / "segments" / d / f"{ts:020d}-{ts:020d}.parquet"
               for d, ts in (("vnode=0000", 2), ("batch", 3), ("batch", 10))]
    for orphan in orphans:
        orphan.parent.mkdir(parents=True, exist_ok=True)
        orphan.write_bytes(b"never named by a record")
    assert log.drop_before(5) == 1
    assert [r.first_ts for r in log.records()] == [5, 9]
    assert [o.exists() for o in orphans] == [False, False, True]
    # The batch ending at 1 is gone: the changelog holds everything from 2 on.
    assert [r.key for r in log.read({0: 2})] == [b"b", b"c"]


def three_batches(root: Path) -> Changelog:
    log = Changelog(str(root))
    log.append([txn(1, [(0, b"a", REPLACE)]), txn(2, [(1, b"x", REPLACE)])])
    log.append([txn(5, [(0, b"b", REPLACE)])])
    log.append([txn(9, [(0, b"c", REPLACE)])])
    return log


def test_a_fresh_changelog_holds_everything_from_zero(tmp_path: Path) -> None:
    log = three_batches(tmp_path)
    assert log.retained_from() == 0
    assert [r.key for r in log.read({0: 0, 1: 0})] == [b"a", b"x", b"b", b"c"]
    assert log.drop_before(1) == 0 and log.retained_from() == 0  # nothing dropped, no mark


def test_retention_raises_the_low_watermark_and_read_refuses_below_it(tmp_path: Path) -> None:
    log = three_batches(tmp_path)
    assert log.drop_before(6) == 2
    # The last dropped batch ended at 5: everything from 6 on is still here.
    assert Changelog(str(tmp_path)).retained_from() == 6
    assert [r.key for r in log.read({0: 6})] == [b"c"]
    with pytest.raises(ChangelogGap) as gap:
        list(log.read({0: 7, 1: 3}))
    assert (gap.value.vnode, gap.value.needed_ts, gap.value.retained_from_ts) == (1, 3, 6)
    assert gap.value.short == {1: 3}
    # A horizon that goes back down (a new node) never lowers it: the data is gone.
    assert log.drop_before(2) == 0
    assert log.retained_from() == 6


def test_the_low_watermark_is_durable_before_any_batch_is_deleted(
        tmp_path: Path, active_failpoints) -> None:
    log = three_batches(tmp_path)
    names = [r.name for r in log.records()]
    active_failpoints("cdc.retention.watermark.before=raise")
    with pytest.raises(FailpointTriggered):
        log.drop_before(6)
    assert log.retained_from() == 0 and [r.name for r in log.records()] == names
    # A crash after the mark, before the deletes: a reader (a new process) sees
    # the mark above batches that are still there: it refuses more, never less.
    active_failpoints("cdc.retention.watermark.after=raise")
    with pytest.raises(FailpointTriggered):
        log.drop_before(6)
    reopened = Changelog(str(tmp_path))
    assert reopened.retained_from() == 6 and [r.name for r in reopened.records()] == names
    with pytest.raises(ChangelogGap):
        list(reopened.read({0: 0}))
    active_failpoints("")
    assert reopened.drop_before(6) == 2  # the next retention run finishes the job
    assert [r.first_ts for r in reopened.records()] == [9]


def test_a_read_that_retention_overtakes_fails_instead_of_ending_short(tmp_path: Path) -> None:
    log = three_batches(tmp_path)
    rows = log.read({0: 0})
    assert next(rows).key == b"a"
    log.drop_before(6)  # the batch of ts 5 goes while the reader is past it
    with pytest.raises(ChangelogGap):
        list(rows)


def test_a_corrupt_low_watermark_is_an_error_not_zero(tmp_path: Path) -> None:
    log = three_batches(tmp_path)
    log.drop_before(6)
    mark = tmp_path / WATERMARK_NAME
    mark.write_bytes(mark.read_bytes().replace(b"6", b"1"))
    with pytest.raises(CorruptChangelog):
        log.retained_from()
    with pytest.raises(CorruptChangelog):
        list(log.read({0: 9}))


def test_a_batch_is_one_segment_file_whatever_its_virtual_nodes(tmp_path: Path) -> None:
    log = Changelog(str(tmp_path))
    record = log.append([txn(7, [(v, bytes([v]), REPLACE) for v in range(8)] +
                              [(3, b"z", DELETE)])])
    # A record of the shared layout says so in its magic: a connector from before it
    # refuses the record (not a record) instead of looking for per-vnode files.
    assert (tmp_path / "batches" / record.name).read_bytes().startswith(b"RCLB2 ")
    files = list((tmp_path / "segments").rglob("*.parquet"))
    assert [f.relative_to(tmp_path).as_posix() for f in files] == [
        f"segments/batch/{7:020d}-{7:020d}.parquet"]
    assert sorted((r.vnode, r.rows) for r in record.segments) == [
        (v, 2 if v == 3 else 1) for v in range(8)]
    rows = list(log.read({3: 0, 5: 0}))
    assert [(r.vnode, r.key, r.op) for r in rows] == [
        (3, b"\x03", REPLACE), (3, b"z", DELETE), (5, b"\x05", REPLACE)]


def write_legacy_batch(root: Path, ts: int, rows: list[tuple[int, bytes, int]]) -> None:
    """A batch as changelogs before the shared segment wrote it: one segment file per
    virtual node, named by refs without ``dir``."""
    trans = txn(ts, rows)
    name = f"{ts:020d}-{ts:020d}.parquet"
    refs = []
    for vnode in sorted({r.vnode for r in trans.rows}):
        data = encode_segment([r for r in trans.rows if r.vnode == vnode], with_vnode=False)
        directory = root / "segments" / f"vnode={vnode:04d}"
        directory.mkdir(parents=True, exist_ok=True)
        (directory / name).write_bytes(data)
        refs.append(SegmentRef(vnode, name, sum(r.vnode == vnode for r in trans.rows),
                               len(data), crc32c.crc32c(data)))
    record = BatchRecord(ts, ts, ({"ts": ts, "position": f"pos{ts}", "sourceTxid": f"x{ts}",
                                   "commitTimeMs": 0, "rows": len(trans.rows)},), tuple(refs))
    (root / "batches").mkdir(parents=True, exist_ok=True)
    (root / "batches" / record.name).write_bytes(record.to_bytes())


def test_a_changelog_of_both_layouts_reads_and_drops_in_order(tmp_path: Path) -> None:
    """A connector upgraded over an existing changelog: its older batches have a segment
    per virtual node; replay reads across both, retention drops both."""
    write_legacy_batch(tmp_path, 3, [(0, b"a", REPLACE), (1, b"b", REPLACE), (0, b"c", DELETE)])
    assert (tmp_path / "batches" / f"{3:020d}-{3:020d}.rec").read_bytes().startswith(b"RCLB1 ")
    log = Changelog(str(tmp_path))
    log.append([txn(8, [(1, b"b", DELETE), (0, b"d", REPLACE)])])
    assert [(r.ts, r.vnode, r.key, r.op) for r in log.read({0: 0, 1: 0})] == [
        (3, 0, b"a", REPLACE), (3, 0, b"c", DELETE), (3, 1, b"b", REPLACE),
        (8, 0, b"d", REPLACE), (8, 1, b"b", DELETE)]
    assert [r.key for r in log.read({1: 4})] == [b"b"]
    assert log.drop_before(5) == 1
    assert not list((tmp_path / "segments").glob("vnode=*/*.parquet"))
    assert [r.ts for r in log.read({0: 4, 1: 4})] == [8, 8]


def test_a_shared_segment_that_lost_rows_of_a_virtual_node_is_corrupt(tmp_path: Path) -> None:
    log = Changelog(str(tmp_path))
    record = log.append([txn(4, [(0, b"a", REPLACE), (2, b"b", REPLACE)])])
    # A record whose row count for a virtual node disagrees with its (intact) segment.
    lying = BatchRecord(record.first_ts, record.last_ts, record.transactions, tuple(
        SegmentRef(r.vnode, r.name, r.rows + (r.vnode == 2), r.length, r.crc32c, r.dir)
        for r in record.segments))
    (tmp_path / "batches" / record.name).write_bytes(lying.to_bytes())
    assert [r.key for r in log.read({0: 0})] == [b"a"]
    with pytest.raises(CorruptChangelog, match="virtual node 2"):
        list(log.read({2: 0}))


def test_partial_updates_keep_their_targets_and_mark_their_batch(tmp_path: Path) -> None:
    """A partial update (op 3) is read back with its target columns; its batch record is
    RCLB3, so a reader from before partial updates stops at it (CorruptChangelog)
    instead of replaying it as a DELETE; a batch without one stays RCLB2, its segment
    without a targets column, and reads as before."""
    log = Changelog(str(tmp_path))
    partial = ChangeRow(10, 1, 1, "t", PARTIAL, b"b", (b"\x01x", b""), ("id", "note"))
    first = log.append([LoggedTransaction(10, "p10", "x10", 0, [
        ChangeRow(10, 0, 0, "t", REPLACE, b"a", (b"\x01a",)), partial])])
    second = log.append([txn(11, [(0, b"c", REPLACE)])])
    assert first.partial and not second.partial
    head = (tmp_path / "batches" / first.name).read_bytes()[:6]
    assert head == b"RCLB3 "
    assert (tmp_path / "batches" / second.name).read_bytes()[:6] == b"RCLB2 "
    rows = list(log.read({0: 0, 1: 0}))
    assert rows[1] == partial and rows[0].targets is None and rows[2].targets is None
    assert [rec.partial for rec in log.records()] == [True, False]
