"""Source positions: where each commit came from in its source, by commit timestamp.

A writer with a durable changelog (the CDC connector, a DurableWriter) sends, with every
TableUpdateData of a transaction, the position its changelog records for that
transaction (``TableUpdateData.source_position``: opaque, e.g. a PostgreSQL LSN; empty:
none), and a recovery replay sends the same position from the same changelog record.
One timestamp is one transaction of one writer (one TransServer issues them), so the
node keeps ``ts -> (writer_id, position)``; the change feed (ReadChanges) gives the
position back with every change of the commit (``positions``).

Invariants:

* POSITION_DURABLE_WITH_APPLY: a request's positions are put in the request's
  primary-index write transaction (``PrimaryIndex.write_batch``; this store is a
  named database of the same LMDB environment). They are durable exactly when the
  request's index versions are, with one fsync for both; a request refused or failed
  before its commit stores none.
* ONE_POSITION_PER_TS: every TableUpdateData of one timestamp in a request carries
  the same position, of at most ``MAX_POSITION_BYTES`` (checked by UpdateRecord's
  validation, INVALID_ARGUMENT, nothing stored). A replay rewrites the value its
  changelog record holds: the same one (idempotent).
* POSITIONS_BOUNDED: positions below the primary index's prune horizon are dropped in
  the transaction that records the horizon (``PrimaryIndex.prune_versions``, called
  by the GC scheduler). The horizon is at most the fold timestamp (at most safeGcTs:
  the feed never reads at or below it) and at most the replay floor, so no replay
  writes a position below it again: the store holds the positions of the
  timestamps above the horizon only.

Cleansing leaves positions alone, also at or after a replay start, where it drops
index versions: a position is a fact about its timestamp's source transaction, not
state derived from the apply, and replay rewrites the same value. Dropping them
would be wrong, not only useless: the replay starts are per scope (table, virtual
node) and a position is per timestamp, so a timestamp at or above the smallest start
whose scopes all start above it keeps its changes but would not get its position
back. A position whose changes the rewind removed and no replay redoes (an
unlogged development write) names a timestamp the feed has no change at: it is
never read, and goes with the next prune.
"""

from __future__ import annotations

import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import lmdb
from prometheus_client import Counter

from retina_server.index_errors import IndexBackendError
from retina_server.primary_index import PrimaryIndex

PRUNED = Counter("retina_source_positions_pruned_total",
                 "Source positions dropped below the primary index's prune horizon")
MAX_POSITION_BYTES = 4096
_TS = struct.Struct(">Q")  # big-endian: the store iterates in timestamp order
_LEN = struct.Struct(">H")  # the writer id's length (a registered writer id is short)


@dataclass(frozen=True)
class SourcePosition:
    writer_id: str  # the registered replay source whose changelog holds the commit
    position: str


def _encode(writer_id: str, position: str) -> bytes:
    writer = writer_id.encode()
    return _LEN.pack(len(writer)) + writer + position.encode()


def _decode(value: bytes) -> SourcePosition:
    (n,) = _LEN.unpack(value[:2])
    return SourcePosition(value[2:2 + n].decode(), value[2 + n:].decode())


class SourcePositions:
    """``ts -> (writer_id, position)`` in the node's primary-index LMDB environment."""

    def __init__(self, index: PrimaryIndex) -> None:
        self._index = index
        self._db = index.open_store(b"source_positions")

    def put(self, writer_id: str, positions: Mapping[int, str]) -> None:
        """Store each ``ts -> position`` of one request. Inside the request's
        ``write_batch`` (POSITION_DURABLE_WITH_APPLY), else in a transaction of its own.
        Idempotent: a replay puts the value back."""
        if not positions:
            return
        items = sorted((_TS.pack(ts), _encode(writer_id, p)) for ts, p in positions.items())
        try:
            with self._index.transaction() as txn:
                txn.cursor(db=self._db).putmulti(items)
        except lmdb.Error as exc:
            raise IndexBackendError(f"source positions write failed: {exc}") from exc

    def sources(self, ts_list: Sequence[int]) -> dict[int, SourcePosition]:
        """The stored (writer, position) of each timestamp that has one; one read
        transaction, safe from any thread."""
        out: dict[int, SourcePosition] = {}
        try:
            with self._index.transaction(write=False) as txn:
                get = txn.get
                for ts in dict.fromkeys(ts_list):
                    value = get(_TS.pack(ts), db=self._db)
                    if value is not None:
                        out[ts] = _decode(value)
        except lmdb.Error as exc:
            raise IndexBackendError(f"source positions read failed: {exc}") from exc
        return out

    def positions(self, ts_list: Sequence[int]) -> dict[int, str]:
        """The position of each timestamp of ``ts_list`` that has one (a timestamp
        without one, e.g. an application write, is left out)."""
        return {ts: s.position for ts, s in self.sources(ts_list).items()}

    def drop_below(self, txn: lmdb.Transaction[bytes], horizon: int) -> int:
        """POSITIONS_BOUNDED: delete every position at a timestamp below ``horizon`` in
        ``txn`` (the prune's horizon transaction); returns how many."""
        cursor = txn.cursor(db=self._db)
        end = _TS.pack(horizon)
        dropped = 0
        cursor.first()
        # delete() moves to the next entry; past the last one the key reads b"".
        while (key := cursor.key()) and key < end:
            cursor.delete()
            dropped += 1
        PRUNED.inc(dropped)
        return dropped

    def count(self) -> int:
        """Positions stored (LMDB's entry count)."""
        with self._index.transaction(write=False) as txn:
            return int(txn.stat(self._db)["entries"])
