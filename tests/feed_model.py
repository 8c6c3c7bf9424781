"""The change feed's oracle: the changes a model's history says each commit made.

A commit's expected changes are the difference between the model's table before it and
after it (FEED_IS_HISTORY): a key that went is a ``delete`` of its old row, a key that
came an ``insert``, a key whose row changed an ``update_before`` and ``update_after``; a
key rewritten with the same row changed nothing (dropped, as the feed drops it by
default). Used by the tests and by the fault campaign's follower.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import pyarrow as pa

Row = dict[str, Any]
Change = tuple[str, bytes, tuple[tuple[str, Any], ...]]  # (type, key, row items)


def _items(row: Row, columns: Sequence[str]) -> tuple[tuple[str, Any], ...]:
    return tuple((c, row.get(c)) for c in columns)


def expected_changes(history: Iterable[tuple[int, dict[bytes, Row]]], from_ts: int,
                     to_ts: int, columns: Sequence[str]) -> dict[int, list[Change]]:
    """Per commit timestamp in ``(from_ts, to_ts]`` that changed the table, its changes
    (sorted: the feed's order within a commit is the stream's, compared apart)."""
    before: dict[bytes, Row] = {}
    out: dict[int, list[Change]] = {}
    for ts, rows in history:
        if ts > to_ts:
            break
        if ts > from_ts:
            changes = diff(before, rows, columns)
            if changes:
                out[ts] = sorted(changes)
        before = rows
    return out


def diff(before: dict[bytes, Row], after: dict[bytes, Row],
         columns: Sequence[str]) -> list[Change]:
    changes: list[Change] = []
    for key, row in before.items():
        now = after.get(key)
        if now is None:
            changes.append(("delete", key, _items(row, columns)))
        elif _items(now, columns) != _items(row, columns):
            changes.append(("update_before", key, _items(row, columns)))
            changes.append(("update_after", key, _items(now, columns)))
    for key, row in after.items():
        if key not in before:
            changes.append(("insert", key, _items(row, columns)))
    return changes


def feed_changes(commits: Iterable[tuple[int, pa.Table]], key_of: Callable[[Row], bytes],
                 columns: Sequence[str]) -> dict[int, list[Change]]:
    """The feed's commits in the oracle's form; checks what holds within a commit: one
    commit per timestamp, ascending, ordinals 0..n-1, an update's images adjacent."""
    out: dict[int, list[Change]] = {}
    last = -1
    for ts, changes in commits:
        assert ts > last, f"commit {ts} after {last}: out of order or given twice"
        last = ts
        rows = changes.to_pylist()
        assert [r["_ordinal"] for r in rows] == list(range(len(rows))), ts
        assert all(r["_commit_ts"] == ts for r in rows), ts
        for i, r in enumerate(rows):
            if r["_change_type"] == "update_before":
                after = rows[i + 1]
                assert after["_change_type"] == "update_after", (ts, r, after)
                assert key_of(after) == key_of(r), (ts, r, after)
        out[ts] = sorted((r["_change_type"], key_of(r), _items(r, columns)) for r in rows)
    return out


def apply_changes(state: dict[bytes, Row], changes: dict[int, list[Change]],
                  columns: Sequence[str]) -> dict[bytes, tuple[tuple[str, Any], ...]]:
    """The table the changes make of ``state``, strictly: an insert of a key present, a
    delete or before image that is not the current row, is a duplicated or lost change."""
    table = {k: _items(r, columns) for k, r in state.items()}
    for ts in sorted(changes):
        for kind, key, items in sorted(changes[ts], key=lambda c: c[0] != "delete"
                                       and c[0] != "update_before"):
            if kind in ("delete", "update_before"):
                assert table.get(key) == items, (ts, kind, key, items, table.get(key))
                del table[key]
            else:
                assert key not in table, (ts, kind, key, "inserted twice")
                table[key] = items
    return table
