"""The durable changelog: ordering, per-vnode starts, corruption, retention."""

from __future__ import annotations

from pathlib import Path

import pytest

from cdc_client.changelog import (
    DELETE,
    REPLACE,
    Changelog,
    ChangeRow,
    CorruptChangelog,
    LoggedTransaction,
)


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
    orphan = tmp_path / "segments" / "vnode=0000" / f"{2:020d}-{2:020d}.parquet"
    orphan.write_bytes(b"never named by a record")
    assert log.drop_before(5) == 1
    assert [r.first_ts for r in log.records()] == [5, 9]
    assert not orphan.exists()
    assert [r.key for r in log.read({0: 0})] == [b"b", b"c"]
