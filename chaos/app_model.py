"""The oracle of the application writer's table (``workload.APP_TABLE``).

The CDC tables are compared with the source database; the application writer's table
has no source, so the campaign keeps its expected rows beside the writer, from what
each transaction's caller was told (``chaos/app_writer.py`` answers every one):

* **acknowledged** (``write()`` returned its commit timestamp): the transaction's rows
  are expected, exactly, through every crash that follows;
* **in doubt** (the writer died inside the call after the transaction reached its
  changelog: killed at ``writer.append.after`` or ``writer.commit.before``, or an error
  after the log append): until the writer's next successful open, each key it wrote
  holds either its value before the transaction or exactly the value the transaction
  logged (absent for a delete), never another; a node's recovery replay may apply it
  before that. The next successful open applies it: from then on it is expected;
* **never sent** (an error before the log append, e.g. BeginTrans refused): nothing of
  it may ever appear;
* **unknown** (the process died in the call some other way, so whether the log append
  returned is not known): its keys may hold either value for good, until a later
  acknowledged transaction writes them again. The campaign only kills the writer at its
  failpoints, so this is the defect path of the writer program, reported apart.

A transaction still unanswered is in doubt as well while it runs. Rows are tuples over
the table's columns; a transaction's net effect per key is its deletes, then its
upserts (the last write of a key wins), as ``DurableWriter`` encodes it.
"""

from __future__ import annotations

from dataclasses import dataclass

from .workload import Key, Row

Expected = tuple[dict[Key, Row], dict[Key, frozenset[Row | None]]]


@dataclass(frozen=True)
class Txn:
    """One transaction sent to the writer: rows to upsert, keys to delete."""

    seq: int
    upserts: tuple[Row, ...]
    deletes: tuple[Key, ...]

    def effects(self, width: int) -> dict[Key, Row | None]:
        """The value each key holds once the transaction is applied (None: deleted)."""
        net: dict[Key, Row | None] = dict.fromkeys(self.deletes)
        net.update((row[:width], row) for row in self.upserts)
        return net


class AppModel:
    """Expected rows of the application writer's table (module docstring's rules)."""

    def __init__(self, width: int) -> None:
        self.width = width
        self.rows: dict[Key, Row] = {}  # every acknowledged (or applied in-doubt) effect
        self.last_ts: dict[Key, int] = {}  # the commit ts of each key's last acknowledged write
        self.pending: Txn | None = None  # sent, not answered yet
        self.in_doubt: list[Txn] = []  # logged, not acknowledged: applied by the next open
        self.unknown: list[Txn] = []  # whether logged is not known: either value, for good
        self.either: dict[Key, frozenset[Row | None]] = {}  # the unknowns' keys after an open

    # --- what happened to a transaction ------------------------------------------------
    def sent(self, txn: Txn) -> None:
        if self.pending is not None:
            raise ValueError(f"transaction {self.pending.seq} is still unanswered")
        self.pending = txn

    def acknowledged(self, seq: int, ts: int) -> Txn:
        txn = self._answered(seq)
        self._apply(txn, ts)
        return txn

    def not_sent(self, seq: int) -> Txn:
        return self._answered(seq)

    def logged_not_acknowledged(self, seq: int) -> Txn:
        txn = self._answered(seq)
        self.in_doubt.append(txn)
        return txn

    def died(self, at_failpoint: bool) -> Txn | None:
        """The writer process is gone; the transaction it was running, if any, is in
        doubt (killed at a ``writer.*`` point: after its log append) or unknown."""
        txn, self.pending = self.pending, None
        if txn is not None:
            (self.in_doubt if at_failpoint else self.unknown).append(txn)
        return txn

    def opened(self) -> int:
        """A writer process opened: every in-doubt transaction is applied now (its open
        sent them again, in order); the unknown ones may or may not have been. Returns
        how many in-doubt transactions that resolved."""
        resolved = len(self.in_doubt)
        for txn in self.in_doubt:
            self._apply(txn, 0)
        for txn in self.unknown:
            for key, row in txn.effects(self.width).items():
                self.either[key] = self.either.get(key, frozenset({self.rows.get(key)})) | {row}
        self.in_doubt, self.unknown = [], []
        return resolved

    def _answered(self, seq: int) -> Txn:
        if self.pending is None or self.pending.seq != seq:
            raise ValueError(f"an answer for transaction {seq}, which is not the one running")
        txn, self.pending = self.pending, None
        return txn

    def _apply(self, txn: Txn, ts: int) -> None:
        for key, row in txn.effects(self.width).items():
            if row is None:
                self.rows.pop(key, None)
            else:
                self.rows[key] = row
            self.either.pop(key, None)
            if ts:
                self.last_ts[key] = ts

    # --- what the table may hold -------------------------------------------------------
    def expected(self) -> Expected:
        """The rows expected exactly, and the keys that may hold any one of several
        values (None: absent), which override them."""
        either = dict(self.either)
        undecided = [*self.in_doubt, *self.unknown, *([self.pending] if self.pending else [])]
        for txn in undecided:
            for key, row in txn.effects(self.width).items():
                either[key] = either.get(key, frozenset({self.rows.get(key)})) | {row}
        return dict(self.rows), either

    def acknowledged_after(self, ts: int) -> list[Key]:
        """Keys whose last acknowledged write committed after ``ts``."""
        return sorted(k for k, t in self.last_ts.items() if t > ts)

    @property
    def undecided(self) -> int:
        """Transactions whose effect is not decided yet (running, in doubt, unknown)."""
        return len(self.in_doubt) + len(self.unknown) + (self.pending is not None)
