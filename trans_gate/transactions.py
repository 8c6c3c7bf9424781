"""Write and read-only transactions, their leases, the HWM and the safe GC timestamp.

Invariants (named as in docs/trans-server.md):

* HWM_PREFIX: every write transaction with a timestamp at or below the HWM
  has ended. The HWM is ``min(live write timestamps) - 1``, or the last
  issued write timestamp when none is live; it never decreases, and it
  never passes a live write transaction, however the others end.
* SNAPSHOT_AT_HWM: a read-only transaction's snapshot is the HWM at begin, or
  the past point it asked for (AS OF), admitted only if ``horizon < S <= HWM``
  (the gate decides whether it may begin at all; see :mod:`trans_gate.gate`).
* SAFE_GC_BELOW_READERS: ``safeGcTs = max(horizon, min(HWM, live non-offloaded
  read snapshots, pins, consumer cursors + 1, the retained snapshot) - 1)``:
  strictly below every snapshot a live query, a pin or the history retention
  holds, at or below every registered consumer's cursor (the changes above it
  stay readable: consumers.py), and never below a value handed out before (the
  GC horizon, history.py), so folding never removes a version anyone can still
  see or still be admitted to read.
* HORIZON_BELOW_READABLE: an AS OF read or a pin at S is admitted, under the
  same lock that raises the horizon, only if ``horizon < S`` (history.py); a
  consumer's cursor C only if ``horizon <= C`` (CONSUMER_AT_OR_ABOVE_HORIZON).
* LISTED_FILES_HELD: a file ListQueryFiles gave a live read transaction
  (offloaded or not) is reported by :meth:`TransactionTable.read_holds` until
  the transaction ends; while a listing is between its catalog read and its
  record, every file counts as held (``listings_in_flight``).
* ENDED_IS_FINAL: a transaction ends once (commit, rollback or lease
  expiry); ending it again is refused and changes nothing.

After a restart every transaction of the previous incarnation is ended (its
id is below the id counter's session start) and the HWM starts at the first
timestamp of the new session minus one.
"""

from __future__ import annotations

import heapq
import threading
from array import array
from bisect import bisect_right, insort
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from enum import StrEnum

import grpc

from retina_common.refusal import changes_expired, snapshot_expired
from trans_gate.history import GcHorizon
from trans_gate.timestamps import DurableCounter


class TransKind(StrEnum):
    WRITE = "write"
    READ = "read"


class EndReason(StrEnum):
    COMMITTED = "committed"
    ROLLED_BACK = "rolled back"
    LEASE_EXPIRED = "rolled back: lease expired"
    SERVER_RESTARTED = "ended by a TransServer restart"
    UNKNOWN = "ended"


class TransError(Exception):
    """A refused transaction call; ``grpc_status`` is its gRPC status
    (retina_common/refusal.py maps it)."""

    grpc_status = grpc.StatusCode.INTERNAL


class UnknownTransaction(TransError):
    grpc_status = grpc.StatusCode.NOT_FOUND


class TransactionEnded(TransError):
    grpc_status = grpc.StatusCode.FAILED_PRECONDITION


class WrongTransactionKind(TransError):
    grpc_status = grpc.StatusCode.FAILED_PRECONDITION


class BadTransArgument(TransError):
    grpc_status = grpc.StatusCode.INVALID_ARGUMENT


class SnapshotAhead(TransError):
    """An AS OF point above the HWM: not every write at or below it has ended (yet)."""

    grpc_status = grpc.StatusCode.OUT_OF_RANGE


class TransactionOffloaded(TransError):
    """An offloaded read no longer holds back safeGcTs, so a rewrite may since have
    dropped rows its snapshot reads: it must list its files before it offloads."""

    grpc_status = grpc.StatusCode.FAILED_PRECONDITION


@dataclass
class Transaction:
    trans_id: int
    kind: TransKind
    timestamp: int
    lease_expires_at_ms: int
    offloaded: bool = False
    as_of: bool = False  # a read at a past point (BeginTrans.as_of_*)
    # Files ListQueryFiles gave this (read-only) transaction: the sweepers keep them.
    listed: set[int] = field(default_factory=set)


@dataclass(frozen=True)
class ReadHolds:
    """What live read transactions can still read (the sweepers' retention guard)."""

    file_ids: frozenset[int]
    listings_in_flight: int
    live_reads: int
    oldest_snapshot_ts: int | None


class TransactionTable:
    def __init__(self, timestamps: DurableCounter, trans_ids: DurableCounter,
                 clock_ms: Callable[[], int], *, write_lease_ms: int, read_lease_ms: int,
                 max_lease_ms: int, horizon: GcHorizon, ended_cache_size: int = 100_000,
                 retained: Callable[[], int | None] = lambda: None,
                 time_of: Callable[[int], int] = lambda _ts: 0) -> None:
        """``retained``: the snapshot the history retention keeps readable (None: no
        retention); ``time_of(ts)``: the earliest wall-clock time that resolves to
        ``ts`` or later (0: unknown), for the refusals' details."""
        self._ts = timestamps
        self._ids = trans_ids
        self._clock_ms = clock_ms
        self._write_lease_ms = write_lease_ms
        self._read_lease_ms = read_lease_ms
        self._max_lease_ms = max_lease_ms
        self._ended_cache_size = ended_cache_size
        self._lock = threading.Lock()
        self._live: dict[int, Transaction] = {}
        # Min-heap of live write timestamps; ended ones are dropped lazily.
        self._write_heap: list[tuple[int, int]] = []
        self._ended: OrderedDict[int, EndReason] = OrderedDict()
        # Everything before this session is ended.
        self._last_write_ts = timestamps.session_start - 1
        self._hwm = self._last_write_ts
        self._listings_in_flight = 0
        self._horizon = horizon
        self._retained = retained
        self._time_of = time_of
        self._pins: dict[str, int] = {}  # name -> ts (pins.py keeps them durable)
        self._cursors: dict[str, int] = {}  # consumer -> cursor (consumers.py)
        # This incarnation's committed write timestamps above the horizon, ascending: a
        # consumer's lag in commits (8 bytes a commit; pruned when the horizon rises).
        self._committed_writes = array("q")

    # --- begin ---------------------------------------------------------------
    def _lease(self, kind: TransKind, lease_ms: int) -> int:
        if lease_ms < 0:
            raise BadTransArgument("lease_ms must not be negative")
        if lease_ms == 0:
            lease_ms = self._write_lease_ms if kind == TransKind.WRITE else self._read_lease_ms
        return self._clock_ms() + min(lease_ms, self._max_lease_ms)

    def begin(self, kind: TransKind, count: int = 1, lease_ms: int = 0) -> list[Transaction]:
        if not 1 <= count <= 100_000:
            raise BadTransArgument("count must be between 1 and 100000")
        expires = self._lease(kind, lease_ms)
        with self._lock:
            first_id = self._ids.take(count)
            if kind == TransKind.WRITE:
                first_ts = self._ts.take(count)
                stamps = list(range(first_ts, first_ts + count))
                self._last_write_ts = stamps[-1]
            else:
                stamps = [self._compute_hwm()] * count
            created = []
            for offset, ts in enumerate(stamps):
                trans = Transaction(first_id + offset, kind, ts, expires)
                self._live[trans.trans_id] = trans
                if kind == TransKind.WRITE:
                    heapq.heappush(self._write_heap, (ts, trans.trans_id))
                created.append(trans)
            return created

    def begin_as_of(self, ts: int, lease_ms: int = 0) -> Transaction:
        """A read-only transaction at the past snapshot ``ts`` (HORIZON_BELOW_READABLE)."""
        expires = self._lease(TransKind.READ, lease_ms)
        with self._lock:
            self._check_readable(ts, "snapshot")
            trans = Transaction(self._ids.take(1), TransKind.READ, ts, expires, as_of=True)
            self._live[trans.trans_id] = trans
            return trans

    def _check_readable(self, ts: int, what: str) -> None:
        """``horizon < ts <= HWM`` or the refusal (the caller holds the lock)."""
        hwm = self._compute_hwm()
        if ts > hwm:
            raise SnapshotAhead(f"{what} {ts} is above the high watermark {hwm}: writes at or "
                                "below it have not all ended yet; retry later")
        horizon = self._horizon.value
        if ts <= horizon:
            raise snapshot_expired(
                f"{what} {ts} is at or below the GC horizon {horizon}: history up to it "
                "may be folded or rewritten", horizon + 1, self._time_of(horizon + 1))

    # --- pins (pins.py) --------------------------------------------------------
    def hold_pin(self, name: str, ts: int, *, check: bool = True) -> None:
        """A pin holds safeGcTs below ``ts``; refused like an AS OF read at ``ts`` unless
        ``check`` is off (a stored pin loaded at start)."""
        with self._lock:
            if check:
                self._check_readable(ts, f"pin {name} at")
            self._pins[name] = ts

    def release_pin(self, name: str) -> None:
        with self._lock:
            self._pins.pop(name, None)

    # --- consumers (consumers.py) -----------------------------------------------
    def hold_cursor(self, name: str, cursor: int, *, check: bool = True) -> None:
        """A consumer holds safeGcTs at or below ``cursor``. With ``check`` (register),
        CONSUMER_AT_OR_ABOVE_HORIZON: ``horizon <= cursor <= HWM`` under the lock that
        raises the horizon, or the refusal; a loaded consumer (``check`` off) and an
        advanced cursor (:meth:`move_cursor`) need none."""
        with self._lock:
            if check:
                hwm = self._compute_hwm()
                if cursor > hwm:
                    raise BadTransArgument(f"consumer {name}: cursor {cursor} is above the "
                                           f"high watermark {hwm}")
                horizon = self._horizon.value
                if cursor < horizon:
                    raise changes_expired(
                        f"consumer {name}: changes above cursor {cursor} are no longer all "
                        f"kept (the GC horizon is {horizon}); register at {horizon} or "
                        "later, or start with a snapshot", horizon)
            self._cursors[name] = cursor

    def move_cursor(self, name: str, cursor: int) -> None:
        """Advance a held cursor (only forward: the hold never reaches back)."""
        with self._lock:
            if cursor < self._cursors.get(name, cursor):
                raise AssertionError(f"consumer {name}: cursor moved back to {cursor}")
            self._cursors[name] = cursor

    def release_cursor(self, name: str) -> None:
        with self._lock:
            self._cursors.pop(name, None)

    def _record_committed(self, ts: int) -> None:
        """Keep the record ascending; commits mostly end in timestamp order (an append)."""
        writes = self._committed_writes
        if not writes or ts > writes[-1]:
            writes.append(ts)
        else:
            insort(writes, ts)

    def committed_writes_above(self, ts: int) -> int:
        """Write transactions committed above ``ts`` in this incarnation (those of an
        earlier one are not known: the count starts at this TransServer's start)."""
        with self._lock:
            writes = self._committed_writes
            return len(writes) - bisect_right(writes, ts)

    # --- end -----------------------------------------------------------------
    def _require_live(self, trans_id: int) -> Transaction:
        trans = self._live.get(trans_id)
        if trans is not None:
            return trans
        if trans_id <= 0 or trans_id >= self._ids.issued_upper:
            raise UnknownTransaction(f"transaction {trans_id} does not exist")
        if trans_id < self._ids.session_start:
            reason = EndReason.SERVER_RESTARTED
        else:
            reason = self._ended.get(trans_id, EndReason.UNKNOWN)
        raise TransactionEnded(f"transaction {trans_id} already {reason.value}")

    def _end(self, trans: Transaction, reason: EndReason) -> None:
        del self._live[trans.trans_id]
        self._ended[trans.trans_id] = reason
        while len(self._ended) > self._ended_cache_size:
            self._ended.popitem(last=False)

    def commit(self, trans_ids: Iterable[int]) -> int:
        """Commit all or none; returns the HWM after the commit."""
        ids = list(trans_ids)
        if not ids:
            raise BadTransArgument("no transaction to commit")
        if len(set(ids)) != len(ids):
            raise BadTransArgument("a transaction id repeats in the batch")
        with self._lock:
            live = [self._require_live(i) for i in ids]  # validate everything first
            for trans in live:
                self._end(trans, EndReason.COMMITTED)
                if trans.kind == TransKind.WRITE:
                    self._record_committed(trans.timestamp)
            return self._compute_hwm()

    def rollback(self, trans_id: int) -> int:
        with self._lock:
            self._end(self._require_live(trans_id), EndReason.ROLLED_BACK)
            return self._compute_hwm()

    def extend_lease(self, trans_id: int, lease_ms: int) -> int:
        with self._lock:
            trans = self._require_live(trans_id)
            trans.lease_expires_at_ms = self._lease(trans.kind, lease_ms)
            return trans.lease_expires_at_ms

    def mark_offloaded(self, trans_id: int) -> None:
        with self._lock:
            trans = self._require_live(trans_id)
            if trans.kind != TransKind.READ:
                raise WrongTransactionKind(f"transaction {trans_id} is not read-only")
            trans.offloaded = True

    def expire_leases(self) -> list[Transaction]:
        """Roll back every transaction whose lease has run out; returns them."""
        now = self._clock_ms()
        with self._lock:
            expired = [t for t in self._live.values() if t.lease_expires_at_ms <= now]
            for trans in expired:
                self._end(trans, EndReason.LEASE_EXPIRED)
            return expired

    # --- queries -----------------------------------------------------------------
    def live_read(self, trans_id: int) -> Transaction:
        """The live read-only transaction ``trans_id``; refuses anything else."""
        with self._lock:
            trans = self._require_live(trans_id)
            if trans.kind != TransKind.READ:
                raise WrongTransactionKind(f"transaction {trans_id} is a write transaction")
            return trans

    def listing_started(self, trans_id: int) -> Transaction:
        """A ListQueryFiles call begins (before its catalog read): until
        :meth:`listing_done`, :meth:`read_holds` reports a listing in flight."""
        with self._lock:
            trans = self._require_live(trans_id)
            if trans.kind != TransKind.READ:
                raise WrongTransactionKind(f"transaction {trans_id} is a write transaction")
            if trans.offloaded:
                raise TransactionOffloaded(
                    f"transaction {trans_id} is offloaded: list its files before "
                    "MarkTransOffloaded (its snapshot no longer holds back Storage GC)")
            self._listings_in_flight += 1
            return trans

    def listing_done(self, trans_id: int, file_ids: Iterable[int]) -> None:
        """Record what the listing gave (nothing if it failed), then end it."""
        with self._lock:
            trans = self._live.get(trans_id)
            if trans is not None:
                trans.listed.update(file_ids)
            self._listings_in_flight -= 1

    def read_holds(self) -> ReadHolds:
        with self._lock:
            reads = [t for t in self._live.values() if t.kind == TransKind.READ]
            held = frozenset(f for t in reads for f in t.listed)
            oldest = min((t.timestamp for t in reads), default=None)
            return ReadHolds(held, self._listings_in_flight, len(reads), oldest)

    def status(self, trans_id: int) -> Transaction | None:
        """The live transaction ``trans_id``, or None if it is not live."""
        with self._lock:
            return self._live.get(trans_id)

    def high_watermark(self) -> int:
        with self._lock:
            return self._compute_hwm()

    def safe_gc_ts(self) -> int:
        """Hand out safeGcTs: raised into the horizon under the lock, durable before it
        is returned (history.py; EtcdError: nothing may use it)."""
        with self._lock:
            value = self._safe_gc_locked()
            self._horizon.raise_to(value)
            # No consumer can ask for the commits at or below the horizon any more.
            del self._committed_writes[:bisect_right(self._committed_writes,
                                                     self._horizon.value)]
        self._horizon.persist(value)
        return value

    def peek_safe_gc_ts(self) -> int:
        """What :meth:`safe_gc_ts` would hand out now, for a gauge: raises nothing."""
        with self._lock:
            return self._safe_gc_locked()

    def _safe_gc_locked(self) -> int:
        floor = self._compute_hwm()
        for trans in self._live.values():
            if trans.kind == TransKind.READ and not trans.offloaded:
                floor = min(floor, trans.timestamp)
        floor = min([floor, *self._pins.values(), *(c + 1 for c in self._cursors.values())])
        retained = self._retained()
        if retained is not None:
            floor = min(floor, retained)
        return max(self._horizon.value, floor - 1, 0)

    def horizon(self) -> int:
        """The GC horizon: the earliest readable snapshot is one above it."""
        with self._lock:
            return self._horizon.value

    def live_counts(self) -> dict[TransKind, int]:
        with self._lock:
            counts = dict.fromkeys(TransKind, 0)
            for trans in self._live.values():
                counts[trans.kind] += 1
            return counts

    def _compute_hwm(self) -> int:
        heap = self._write_heap
        while heap and heap[0][1] not in self._live:
            heapq.heappop(heap)
        hwm = heap[0][0] - 1 if heap else self._last_write_ts
        # HWM_PREFIX: monotonic by construction; asserted because a regression
        # here would let a query read a timestamp that is still being written.
        if hwm < self._hwm:
            raise AssertionError(f"HWM went backwards: {hwm} < {self._hwm}")
        self._hwm = hwm
        return hwm
