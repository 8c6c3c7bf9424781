"""Registered change-feed consumers: a named cursor that holds history until it lags too far.

A consumer ``(name, cursor C)`` says "every change committed at or below C was delivered".
Reading the changes above C needs every deletion-chain item above C, so a registered
consumer holds safeGcTs at or below C (transactions.py, SAFE_GC_BELOW_READERS; folding
happens at safeGcTs, NO_READ_BELOW_FOLD). It is the mechanism of the pins (pins.py) with a
cursor that moves forward. Consumers live in etcd under
``/pixels/trans/history/consumers/<name>`` (:class:`ConsumerStore`); :class:`Consumers`
orders memory and etcd so that every crash is safe (docs/write-paths/history.md, H4):

* register: admit and hold in memory first, under the transaction table's lock, where
  ``horizon <= C <= HWM`` is checked (CONSUMER_AT_OR_ABOVE_HORIZON: below the horizon the
  changes above C may be folded, refused ``changes_expired`` naming the horizon); then
  write etcd (create-only); a failed write releases the hold. A crash after the write
  keeps the consumer (the restarted TransServer loads and holds it before it hands out
  any safeGcTs; the durable horizon is at or below C, because it was only ever raised
  with C held);
* commit (advance): write the new cursor to etcd first, then move the hold forward in
  memory. Until the memory moves, the old, lower cursor holds more than needed, never
  less; a crash in between restarts with the new cursor, which the consumer asked for.
  A commit answered UNAVAILABLE may have landed: the consumer retries it (the same
  cursor is accepted again);
* drop, and the lag drop: delete from etcd first, then release the hold. A crash in
  between leaves nothing durable: the restarted TransServer no longer holds it.

The lease: a consumer is held while its lag (the wall-clock age of the oldest change
above its cursor, from the time map) is at most ``trans.max_consumer_lag_ms``;
:meth:`Consumers.drop_lagging`, run by the TransServer's housekeeping loop, drops the
others (log line ``consumer_dropped``, ``retina_consumers_dropped_total``), so one dead
consumer cannot stop all cleanup. Its next CommitConsumer is NOT_FOUND, saying why.
"""

from __future__ import annotations

import json
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Protocol

import grpc
from prometheus_client import Counter

from retina_common.etcd import EtcdError, EtcdStore
from retina_common.failpoints import (
    TRANS_CONSUMER_COMMIT_AFTER,
    TRANS_CONSUMER_COMMIT_BEFORE,
    TRANS_CONSUMER_DROP_AFTER,
    TRANS_CONSUMER_DROP_BEFORE,
    TRANS_CONSUMER_LAG_DROP_AFTER,
    TRANS_CONSUMER_LAG_DROP_BEFORE,
    TRANS_CONSUMER_REGISTER_AFTER,
    TRANS_CONSUMER_REGISTER_BEFORE,
    Failpoint,
)
from retina_common.keys import CONSUMER_PREFIX, consumer_key
from retina_common.log import get_logger
from retina_common.refusal import Refusal
from trans_gate import named_records
from trans_gate.named_records import JsonRecord, NamedRecords

log = get_logger(component="consumers")

TABLE_NAME = re.compile(r"^[^.\s]{1,127}\.[^.\s]{1,127}$")
DROPPED_REMEMBERED = 1000  # names whose lag drop CommitConsumer can still explain

DROPPED_TOTAL = Counter("retina_consumers_dropped", "Change-feed consumers dropped for lag")


class ConsumerCorrupt(Exception):
    """A stored consumer does not parse: the TransServer does not start (it could otherwise
    let GC fold changes a consumer has not read)."""


@dataclass(frozen=True)
class Consumer(JsonRecord):
    name: str
    cursor_ts: int
    table: str
    created_ms: int
    renewed_ms: int

    @classmethod
    def parse(cls, key: str, raw: bytes) -> Consumer:
        try:
            d = json.loads(raw)
            consumer = cls(str(d["name"]), int(d["cursor_ts"]), str(d["table"]),
                           int(d["created_ms"]), int(d["renewed_ms"]))
        except (ValueError, KeyError, TypeError) as exc:
            raise ConsumerCorrupt(f"{key}: {exc}") from None
        if consumer_key(consumer.name) != key or consumer.cursor_ts < 0:
            raise ConsumerCorrupt(f"{key} holds {raw!r}")
        return consumer


@dataclass(frozen=True)
class Lag:
    ms: int  # how long ago the HWM passed the cursor (0: it has not)
    commits: int  # write transactions committed above the cursor (this incarnation's)


def check_name(name: str) -> None:
    named_records.check_name("consumer", name)


def check_cursor(name: str, cursor: int) -> None:
    if cursor < 0:
        raise Refusal(grpc.StatusCode.INVALID_ARGUMENT,
                      f"consumer {name}: cursor_ts {cursor} must not be negative")


def check_table(table: str) -> None:
    if table and not TABLE_NAME.match(table):
        raise Refusal(grpc.StatusCode.INVALID_ARGUMENT,
                      f"table {table!r}: empty or schema.table")


class ConsumerStore(NamedRecords[Consumer]):
    """The consumers in etcd."""

    def __init__(self, store: EtcdStore) -> None:
        super().__init__(store, CONSUMER_PREFIX, consumer_key, Consumer.parse, "consumer")


class CursorHolder(Protocol):
    """The transaction table: its lock makes a hold atomic with the GC horizon."""

    def hold_cursor(self, name: str, cursor: int, *, check: bool = True) -> None: ...

    def move_cursor(self, name: str, cursor: int) -> None: ...

    def release_cursor(self, name: str) -> None: ...

    def committed_writes_above(self, ts: int) -> int: ...

    def high_watermark(self) -> int: ...


@dataclass(frozen=True)
class Dropped:
    consumer: Consumer
    lag: Lag


class Consumers:
    """Register, commit, drop and list consumers: the table's holds and etcd in a safe
    order. ``time_of(ts)``: the earliest wall-clock time that resolves to ``ts`` or later
    (the time map; 0: not known)."""

    def __init__(self, store: ConsumerStore, holder: CursorHolder,
                 time_of: Callable[[int], int], max_lag_ms: int,
                 clock_ms: Callable[[], int] = lambda: int(time.time() * 1000)) -> None:
        self._store = store
        self._holder = holder
        self._time_of = time_of
        self.max_lag_ms = max_lag_ms
        self._clock_ms = clock_ms
        self._lock = threading.Lock()  # one register, commit or drop at a time
        self._consumers: dict[str, Consumer] = {}
        self._dropped: OrderedDict[str, Dropped] = OrderedDict()

    def load(self) -> list[Consumer]:
        """At start: every stored consumer is held again (before any safeGcTs is handed
        out)."""
        loaded = self._store.load()
        with self._lock:
            for consumer in loaded.values():
                self._holder.hold_cursor(consumer.name, consumer.cursor_ts, check=False)
            self._consumers = dict(loaded)
        return sorted(loaded.values(), key=lambda c: c.name)

    def register(self, name: str, cursor: int, table: str = "") -> Consumer:
        check_name(name)
        check_cursor(name, cursor)
        check_table(table)
        with self._lock:
            known = self._consumers.get(name)
            if known is not None:
                return known  # the same name again: its record, unchanged
            # CONSUMER_AT_OR_ABOVE_HORIZON is checked here (changes_expired).
            self._holder.hold_cursor(name, cursor)
            now = self._clock_ms()
            consumer = Consumer(name, cursor, table, now, now)
            try:
                TRANS_CONSUMER_REGISTER_BEFORE.hit()
                stored = self._store.create(consumer)
            except BaseException:
                self._holder.release_cursor(name)
                raise
            if stored != consumer:  # created meanwhile by another TransServer: held there
                self._holder.release_cursor(name)
                self._holder.hold_cursor(name, stored.cursor_ts, check=False)
            TRANS_CONSUMER_REGISTER_AFTER.hit()
            self._consumers[name] = stored
            self._dropped.pop(name, None)
            log.info("consumer_registered", name=name, cursor_ts=stored.cursor_ts,
                     table=stored.table)
            return stored

    def commit(self, name: str, cursor: int) -> Consumer:
        """Move the cursor forward (or to where it is: a renewal)."""
        check_name(name)
        check_cursor(name, cursor)
        with self._lock:
            known = self._require(name)
            if cursor < known.cursor_ts:
                raise Refusal(grpc.StatusCode.INVALID_ARGUMENT,
                              f"consumer {name}: cursor {cursor} is below its cursor "
                              f"{known.cursor_ts}; a cursor only moves forward")
            hwm = self._holder.high_watermark()
            if cursor > hwm:
                raise Refusal(grpc.StatusCode.INVALID_ARGUMENT,
                              f"consumer {name}: cursor {cursor} is above the high "
                              f"watermark {hwm}")
            advanced = replace(known, cursor_ts=cursor, renewed_ms=self._clock_ms())
            TRANS_CONSUMER_COMMIT_BEFORE.hit()
            self._store.put(advanced)  # an unknown outcome: the consumer retries
            TRANS_CONSUMER_COMMIT_AFTER.hit()
            self._holder.move_cursor(name, cursor)
            self._consumers[name] = advanced
            return advanced

    def _require(self, name: str) -> Consumer:
        known = self._consumers.get(name)
        if known is not None:
            return known
        dropped = self._dropped.get(name)
        if dropped is not None:
            raise Refusal(grpc.StatusCode.NOT_FOUND,
                          f"consumer {name} was dropped for lag: its cursor "
                          f"{dropped.consumer.cursor_ts} was {dropped.lag.ms} ms behind "
                          f"(trans.max_consumer_lag_ms = {self.max_lag_ms}); register it "
                          "again at a cursor at or above the GC horizon (retina-admin "
                          "status), or start with a snapshot")
        raise Refusal(grpc.StatusCode.NOT_FOUND,
                      f"consumer {name} is not registered (never registered, dropped, or "
                      "dropped for lag before the TransServer's last restart); register "
                      "it at a cursor at or above the GC horizon, or start with a snapshot")

    def drop(self, name: str) -> bool:
        check_name(name)
        with self._lock:
            if name not in self._consumers:
                return False
            self._delete(name, TRANS_CONSUMER_DROP_BEFORE, TRANS_CONSUMER_DROP_AFTER)
            log.info("consumer_unregistered", name=name)
            return True

    def _delete(self, name: str, before: Failpoint, after: Failpoint) -> Consumer:
        """etcd first, then the hold (the caller holds the lock)."""
        before.hit()
        self._store.delete(name)
        after.hit()
        consumer = self._consumers.pop(name)
        self._holder.release_cursor(name)
        return consumer

    def lag(self, consumer: Consumer) -> Lag:
        cursor = consumer.cursor_ts
        if cursor >= self._holder.high_watermark():
            return Lag(0, 0)
        since = self._time_of(cursor + 1)  # when the HWM passed the cursor
        ms = max(0, self._clock_ms() - since) if since else 0
        return Lag(ms, self._holder.committed_writes_above(cursor))

    def all(self) -> list[tuple[Consumer, Lag]]:
        with self._lock:
            consumers = sorted(self._consumers.values(), key=lambda c: c.name)
        return [(c, self.lag(c)) for c in consumers]

    def drop_lagging(self) -> list[Dropped]:
        """Drop every consumer whose lag exceeds ``max_lag_ms``; an etcd error leaves it
        registered (logged) for the next round."""
        dropped = []
        with self._lock:
            for consumer in list(self._consumers.values()):
                lag = self.lag(consumer)
                if lag.ms <= self.max_lag_ms:
                    continue
                try:
                    self._delete(consumer.name, TRANS_CONSUMER_LAG_DROP_BEFORE,
                                 TRANS_CONSUMER_LAG_DROP_AFTER)
                except EtcdError as exc:
                    log.warning("consumer_drop_failed", name=consumer.name, error=str(exc))
                    continue
                gone = Dropped(consumer, lag)
                self._dropped[consumer.name] = gone
                while len(self._dropped) > DROPPED_REMEMBERED:
                    self._dropped.popitem(last=False)
                DROPPED_TOTAL.inc()
                log.warning("consumer_dropped", name=consumer.name,
                            cursor_ts=consumer.cursor_ts, lag_ms=lag.ms,
                            lag_commits=lag.commits, max_consumer_lag_ms=self.max_lag_ms)
                dropped.append(gone)
        return dropped
