"""The change feed in the campaign (issue 28): a follower per cluster that reads every
table's feed after every episode, applies it strictly to a replica of its own, and checks
the replica against the snapshot the feed ends at.

The follower starts with a snapshot (every table read whole at S0, the replica) and then
follows from S0, as a consumer that starts with a snapshot does. Its history is held by a
registered consumer (``chaos-feed``, trans_gate/consumers.py) whose cursor is committed
after each read to the start of the range just read (which the next episode reads
again), so Storage GC, folds and the 20 s history retention never pass it, across
TransServer kills (the consumer failpoints are in the rotation).

Once healed, per episode (every node READY, the connector caught up):

1. a read transaction T at S; every table's commits in ``(cursor, S]``;
2. each commit applied strictly, change by change: an ``insert`` or ``update_after`` of a
   key the replica holds is a **duplicated** change, a ``delete`` or ``update_before`` whose
   image is not the replica's row (or whose key it lacks) a **duplicated or lost** one
   (``wrong_before``); a commit at or below the previous one is **out of order**; ordinals
   must be 0..n-1 and an update's images adjacent;
3. the replica compared with every table read whole in T: a key whose row differs is a
   **lost** change (in either direction: a change the feed never gave, or one it gave that
   the snapshot does not have);
4. the previous episode's range, and the range read just before this episode's fault, read
   again: the same commits, change for change (a feed is history: a range read after a
   fault must give what it gave before; ``reread_differs``).

Counts go to the report's ``feed`` counter: ``reads``, ``commits``, ``changes``,
``changes_<type>``, ``duplicated``, ``wrong_before``, ``out_of_order``, ``lost``,
``rereads``, ``reread_differs``, ``expired``, ``refused_<CODE>``, ``tables_checked``,
``restarted_rebuilt`` (the cursor's range reached into history a node's recovery rebuilt
and refuses, HISTORY_REBUILT_IS_REFUSED: the follower starts again with a snapshot, as a
consumer does; not an anomaly), ``before_fault_reads``, ``before_fault_refused``.
Any of duplicated, wrong_before, out_of_order, lost, reread_differs and expired is an
anomaly (``feed_<what>``).
"""

from __future__ import annotations

import contextlib
import time
from collections import Counter
from collections.abc import Callable, Mapping
from typing import Any

import grpc
import pyarrow as pa

from retina_common.change_reader import ChangeFeedReader, ChangesExpired, Commit
from retina_common.consumer_client import ConsumerClient
from retina_common.pb import trans_pb2_grpc
from retina_common.reader import SnapshotReader

from .snapshots import row_digest
from .workload import SCHEMA, Key, TableSpec

CONSUMER = "chaos-feed"
# In a changes_expired refusal of history a node's recovery rebuilt (read_history.py).
REBUILT = "HISTORY_REBUILT_IS_REFUSED"
READ_ATTEMPTS = 5

# anomaly(kind, detail)
Anomaly = Callable[[str, str], None]


class FeedFollower:
    def __init__(self, reader: SnapshotReader, trans: trans_pb2_grpc.TransServiceStub,
                 tables: Mapping[str, TableSpec], counts: Counter[str],
                 anomaly: Anomaly) -> None:
        self._reader = reader
        self._feed: ChangeFeedReader = reader.change_feed()
        self._trans = trans
        self._tables = dict(tables)
        self.counts = counts
        self._anomaly = anomaly
        self._replica: dict[str, dict[Key, bytes]] = {}
        self._last_ts: dict[str, int] = {}
        self.cursor = 0
        self._consumers = ConsumerClient(trans)
        # Ranges read before, to read again once healed: (start, end, commits by table).
        self._ranges: list[tuple[int, int, dict[str, list[tuple[int, list[Any]]]]]] = []

    # --- start: a snapshot, then follow ---------------------------------------------------------
    def start(self) -> None:
        with self._reader.transaction() as trans:
            for name, spec in self._tables.items():
                rows = self._reader.read_in(trans, SCHEMA, name).table.to_pylist()
                self._replica[name] = {_key(r, spec): row_digest(_row(r)) for r in rows}
                self._last_ts[name] = trans.timestamp
            self._hold(trans.timestamp)
            self.cursor = trans.timestamp

    def _restart(self) -> None:
        """Start again with a snapshot (the cursor's history is refused)."""
        self._ranges = []
        try:
            self.start()
        except grpc.RpcError:
            self._replica.clear()  # not restarted: the next episode tries again
            self.counts["restart_refused"] += 1

    def close(self) -> None:
        with contextlib.suppress(grpc.RpcError):
            self._consumers.drop(CONSUMER)

    def _hold(self, cursor: int) -> None:
        """Hold history above ``cursor`` as a registered consumer does: registered there
        (the first time), else its cursor committed forward to it."""
        state = self._consumers.register(CONSUMER, cursor)
        if state.cursor_ts < cursor:
            self._consumers.commit(CONSUMER, cursor)

    # --- before the fault -----------------------------------------------------------------------
    def before_fault(self) -> None:
        """Read every table's changes since the cursor now, to read the same range again once
        healed: a fault in between (a node killed and recovered from the changelogs, a
        Storage GC pass, a sweep) must not change what the range holds."""
        if not self._replica:
            return
        try:
            with self._reader.transaction() as trans:
                end = trans.timestamp
            got = {name: [(c.ts, _changes(c.changes)) for c in
                          self._feed.read(SCHEMA, name, self.cursor, to_ts=end)]
                   for name in self._tables}
        except (grpc.RpcError, ChangesExpired):
            self.counts["before_fault_refused"] += 1  # read again only what was read
            return
        self.counts["before_fault_reads"] += 1
        self._ranges.append((self.cursor, end, got))

    # --- once healed ---------------------------------------------------------------------------
    def after_healing(self) -> None:
        """Steps 1-4 of the module docstring (every node READY)."""
        if not self._replica:
            if not self.counts["expired"]:
                self._restart()  # a restart that was refused before
            return
        for attempt in range(READ_ATTEMPTS):
            try:
                self._follow_once()
                return
            except ChangesExpired as exc:
                if REBUILT in str(exc):
                    # Refused, never answered differently: history a recovery rebuilt and
                    # cannot vouch for (read_history.py). A consumer starts again with a
                    # snapshot; so does the follower.
                    self.counts["restarted_rebuilt"] += 1
                    self._restart()
                    return
                self.counts["expired"] += 1
                self._anomaly("feed_expired", f"cursor {self.cursor}: {exc}")
                self._replica.clear()  # the follower cannot go on exactly: stop following
                return
            except grpc.RpcError as exc:
                self.counts[f"refused_{exc.code().name}"] += 1
                if attempt == READ_ATTEMPTS - 1:
                    return  # the next episode reads the same range again
                time.sleep(0.5)

    def _follow_once(self) -> None:
        with self._reader.transaction() as trans:
            end = trans.timestamp
            got: dict[str, list[Commit]] = {}
            for name in self._tables:
                got[name] = list(self._feed.read(SCHEMA, name, self.cursor, to_ts=end))
            images = {name: self._reader.read_in(trans, SCHEMA, name).table.to_pylist()
                      for name in self._tables}
        self.counts["reads"] += 1
        self._reread_previous()
        for name, commits in got.items():
            for commit in commits:
                self._apply(name, commit)
            self._compare(name, images[name], end)
        try:
            self._hold(self.cursor)
        except grpc.RpcError as exc:  # the next episode commits again (forward only)
            self.counts[f"hold_refused_{exc.code().name}"] += 1
        self._ranges = [(self.cursor, end, {n: [(c.ts, _changes(c.changes)) for c in cs]
                                            for n, cs in got.items()})]
        # The pin stays at this range's start: the next episode reads the range again.
        self.cursor = end

    def _apply(self, name: str, commit: Commit) -> None:
        spec, replica = self._tables[name], self._replica[name]
        if commit.ts <= self._last_ts[name]:
            self.counts["out_of_order"] += 1
            self._anomaly("feed_out_of_order", f"{name}: commit {commit.ts} after "
                          f"{self._last_ts[name]}")
        self._last_ts[name] = max(self._last_ts[name], commit.ts)
        rows = commit.changes.to_pylist()
        self.counts["commits"] += 1
        if [r["_ordinal"] for r in rows] != list(range(len(rows))):
            self.counts["out_of_order"] += 1
            self._anomaly("feed_out_of_order", f"{name}: commit {commit.ts} ordinals "
                          f"{[r['_ordinal'] for r in rows][:10]}")
        for row in rows:
            kind = row["_change_type"]
            self.counts["changes"] += 1
            self.counts[f"changes_{kind}"] += 1
            key, digest = _key(row, spec), row_digest(_row(row))
            if kind in ("insert", "update_after"):
                if key in replica:
                    self.counts["duplicated"] += 1
                    self._anomaly("feed_duplicated", f"{name}: {kind} of {key} at "
                                  f"{commit.ts}, which the replica holds")
                replica[key] = digest
            elif replica.pop(key, None) != digest:
                self.counts["wrong_before"] += 1
                self._anomaly("feed_wrong_before", f"{name}: {kind} of {key} at "
                              f"{commit.ts} does not match the replica's row")

    def _compare(self, name: str, rows: list[dict[str, Any]], end: int) -> None:
        spec, replica = self._tables[name], self._replica[name]
        image = {_key(r, spec): row_digest(_row(r)) for r in rows}
        self.counts["tables_checked"] += 1
        differ = [k for k in image.keys() | replica.keys() if image.get(k) != replica.get(k)]
        if differ:
            self.counts["lost"] += len(differ)
            only_feed = sorted((k for k in differ if k not in image), key=repr)
            only_snapshot = sorted((k for k in differ if k not in replica), key=repr)
            changed = sorted((k for k in differ if k in image and k in replica), key=repr)
            self._anomaly("feed_lost", f"{name}: the feed up to {end} leaves {len(differ)} "
                          f"keys unlike the snapshot: {len(only_feed)} the snapshot lacks "
                          f"{only_feed[:3]}, {len(only_snapshot)} the replica lacks "
                          f"{only_snapshot[:3]}, {len(changed)} with other values "
                          f"{changed[:3]}")
            self._replica[name] = image  # go on from the snapshot

    def _reread_previous(self) -> None:
        """Step 4: the ranges read before (the previous episode's, and this one's before its
        fault) read again: the same commits, change for change."""
        for start, end, before in self._ranges:
            for name, commits in before.items():
                again = [(c.ts, _changes(c.changes)) for c in
                         self._feed.read(SCHEMA, name, start, to_ts=end)]
                self.counts["rereads"] += 1
                if again != commits:
                    self.counts["reread_differs"] += 1
                    self._anomaly("feed_reread_differs",
                                  f"{name}: ({start}, {end}] read again differs: "
                                  f"{_first_difference(commits, again)}")


def _first_difference(first: list[tuple[int, list[Any]]],
                      again: list[tuple[int, list[Any]]]) -> str:
    was, now = dict(first), dict(again)
    gone = sorted(was.keys() - now.keys())
    new = sorted(now.keys() - was.keys())
    changed = sorted(t for t in was.keys() & now.keys() if was[t] != now[t])
    parts = [f"{len(first)} commits then, {len(again)} now"]
    if gone:
        parts.append(f"commits gone {gone[:5]} (first: {[c[0] for c in was[gone[0]]][:6]})")
    if new:
        parts.append(f"commits new {new[:5]} (first: {[c[0] for c in now[new[0]]][:6]})")
    if changed:
        t = changed[0]
        parts.append(f"commits changed {changed[:5]} (first {t}: then "
                     f"{[c[0] for c in was[t]][:6]}, now {[c[0] for c in now[t]][:6]})")
    return "; ".join(parts)


def _key(row: Mapping[str, Any], spec: TableSpec) -> Key:
    return tuple(row[c] for c in spec.pk)


def _row(row: Mapping[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in row.items() if not k.startswith("_")}  # the change columns


def _changes(table: pa.Table) -> list[Any]:
    return [(r["_change_type"], r["_ordinal"], row_digest(_row(r))) for r in table.to_pylist()]
