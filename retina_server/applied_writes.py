"""Applied writes: which (table, virtual node, timestamp) this node applied, durably.

A recovery rebuilds what the node applied since its checkpoint by replaying every
writer's changelog. A changelog also holds transactions the node never applied: a
batch its fence refused (refused_writes.py), and a transaction given up before it
reached this node (the durable writer stops at the first node answering ABORTED, the
connector abandons its other sends when one fails, a node unreachable past the lease,
a writer killed after its log append). Replaying those would put into the node's
history a change no reader of it ever saw (docs/history.md, "Restarts"). So the node
records every stream part it applies, and the replay applies a stream part only if
the node applied it before, or its transaction is still being written.

Invariants:

* APPLIED_RECORDED_WITH_APPLY: every applied UpdateRecord request, ordinary or replay,
  records ``(table_id, vnode, ts)`` of every TableUpdateData it applied (also one that
  changed nothing, e.g. a DELETE of a missing key) in the request's primary-index write
  transaction (``PrimaryIndex.write_batch``; this store is a named database of the same
  LMDB environment): durable exactly when the request's index versions are, with the
  same fsync. Its inserted rows become visible only after that commit (update_record.py).
* APPLIED_OR_LIVE (replay_admission.py): a replayed update of (table, vnode) at ``t`` is
  applied iff (1) this log holds (table, vnode, t), or (2) the write transaction of
  ``t`` is still live at the TransServer when the replay write arrives
  (``TransClient.write_live_at``). Otherwise it is acknowledged without being applied.
  Why it is exact: a snapshot at or above ``t`` is granted only after ``t``'s
  transaction ended (HWM_PREFIX). If it ended and this node had not applied ``t`` for
  the stream, no reader of this node saw that stream at ``t``, and the replay must not
  put it there; if it had, (1) holds. If ``t`` is still live, no reader has seen any
  snapshot at or above it yet, on any node: applying it now is what readers will see.
  A replayed update that is applied is recorded too (a second crash replays it again).

What stays inexact (read_history.py): a stream part of one timestamp split over two
requests (a writer cuts its requests at ``max_rows`` items, ``changelog_replay.requests``,
so one (table, vnode, ts) can straddle the cut) of which only the first was applied
before the transaction was given up: the record says "applied", the replay applies the
whole part. The refusal of the second request is recorded *partial*
(refused_writes.py) and the replay marks its history inexact from there; a writer that
died between the two requests leaves no such trace (docs/history.md, "Restarts").

Records are facts about what happened before a crash: cleansing leaves them. They are
dropped below the primary index's prune horizon in the transaction that records it
(``PrimaryIndex.prune_versions``, like the source positions): the horizon is at most
the replay floor, so no replay asks about a timestamp below it, and at most safeGcTs,
so no write below it is applied any more.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable

import lmdb
from prometheus_client import Counter

from retina_server.index_errors import IndexBackendError
from retina_server.primary_index import PrimaryIndex, drop_keys_below

PRUNED = Counter("retina_applied_writes_pruned_total",
                 "Applied-write records dropped below the primary index's prune horizon")
# ts first (big-endian): the store iterates in timestamp order, so a prune is a prefix.
_KEY = struct.Struct(">QQI")

# (table_id, vnode, ts): one stream part of one timestamp.
StreamPart = tuple[int, int, int]


def _key(part: StreamPart) -> bytes:
    table_id, vnode, ts = part
    return _KEY.pack(ts, table_id, vnode)


class AppliedWrites:
    """The applied-writes log in the node's primary-index LMDB environment."""

    def __init__(self, index: PrimaryIndex) -> None:
        self._index = index
        self._db = index.open_store(b"applied_writes")

    def record(self, parts: Iterable[StreamPart]) -> None:
        """APPLIED_RECORDED_WITH_APPLY: put ``parts`` inside the request's ``write_batch``
        (else in a transaction of their own). Idempotent."""
        items = sorted((_key(p), b"") for p in set(parts))
        if not items:
            return
        try:
            with self._index.transaction() as txn:
                txn.cursor(db=self._db).putmulti(items)
        except lmdb.Error as exc:
            raise IndexBackendError(f"applied writes record failed: {exc}") from exc

    def applied_among(self, parts: Iterable[StreamPart]) -> set[StreamPart]:
        """Those of ``parts`` this node applied (one read transaction)."""
        found: set[StreamPart] = set()
        try:
            with self._index.transaction(write=False) as txn:
                for part in set(parts):
                    if txn.get(_key(part), db=self._db) is not None:
                        found.add(part)
        except lmdb.Error as exc:
            raise IndexBackendError(f"applied writes read failed: {exc}") from exc
        return found

    def drop_below(self, txn: lmdb.Transaction[bytes], horizon: int) -> int:
        """Delete every record at a timestamp below ``horizon`` in ``txn`` (the prune's
        horizon transaction); returns how many."""
        dropped = drop_keys_below(txn, self._db, _KEY.pack(horizon, 0, 0))
        PRUNED.inc(dropped)
        return dropped

    def count(self) -> int:
        """Records kept (LMDB's entry count)."""
        with self._index.transaction(write=False) as txn:
            return int(txn.stat(self._db)["entries"])
