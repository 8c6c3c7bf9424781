"""Named pins: a snapshot kept readable until the pin is dropped (like Paimon's tags).

A pin ``(name, ts)`` holds safeGcTs below ``ts`` (transactions.py, the SAFE_GC rule),
so AS OF reads at ``ts`` (``BeginTrans.as_of_pin`` or ``as_of_ts``) answer exactly
across Storage GC, sweeps and restarts. Pins live in etcd under
``/pixels/trans/history/pins/<name>`` (:class:`PinStore`); :class:`Pins` keeps
memory and etcd in the order that makes every crash safe
(docs/write-paths/history.md):

* create: admit and hold in memory first, under the transaction table's lock, where
  ``horizon < ts <= HWM`` is checked (PIN_ABOVE_HORIZON: a pin at or below the horizon
  is refused snapshot_expired, since what it names may already be folded); then write
  etcd (create-only); a failed write releases the hold. A crash after the write keeps
  the pin (the restarted TransServer loads it; the durable horizon is below ``ts``,
  because it was only ever raised with the pin held);
* drop: delete from etcd first, then release the hold. A crash in between leaves
  nothing durable: the restarted TransServer no longer holds it.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import grpc

from retina_common.etcd import EtcdStore
from retina_common.failpoints import (
    TRANS_PIN_CREATE_AFTER,
    TRANS_PIN_CREATE_BEFORE,
    TRANS_PIN_DROP_AFTER,
    TRANS_PIN_DROP_BEFORE,
)
from retina_common.keys import PIN_PREFIX, pin_key
from retina_common.log import get_logger
from retina_common.refusal import Refusal
from trans_gate import named_records
from trans_gate.named_records import JsonRecord, NamedRecords

log = get_logger(component="pins")

class PinCorrupt(Exception):
    """A stored pin does not parse: the TransServer does not start (it could otherwise
    let GC pass a snapshot someone pinned)."""


@dataclass(frozen=True)
class Pin(JsonRecord):
    name: str
    ts: int
    created_ms: int
    at_time_ms: int = 0  # the wall-clock time it was asked at (0: by timestamp)

    @classmethod
    def parse(cls, key: str, raw: bytes) -> Pin:
        try:
            d = json.loads(raw)
            pin = cls(str(d["name"]), int(d["ts"]), int(d["created_ms"]),
                      int(d.get("at_time_ms", 0)))
        except (ValueError, KeyError, TypeError) as exc:
            raise PinCorrupt(f"{key}: {exc}") from None
        if pin_key(pin.name) != key or pin.ts < 1:
            raise PinCorrupt(f"{key} holds {raw!r}")
        return pin


def check_name(name: str) -> None:
    named_records.check_name("pin", name)


class PinStore(NamedRecords[Pin]):
    """The pins in etcd."""

    def __init__(self, store: EtcdStore) -> None:
        super().__init__(store, PIN_PREFIX, pin_key, Pin.parse, "pin")


class PinHolder(Protocol):
    """The transaction table: its lock makes a hold atomic with the GC horizon."""

    def hold_pin(self, name: str, ts: int, *, check: bool = True) -> None: ...

    def release_pin(self, name: str) -> None: ...


class Pins:
    """Create, drop and list pins: memory (the table's holds) and etcd in a safe order."""

    def __init__(self, store: PinStore, holder: PinHolder,
                 clock_ms: Callable[[], int] = lambda: int(time.time() * 1000)) -> None:
        self._store = store
        self._holder = holder
        self._clock_ms = clock_ms
        self._lock = threading.Lock()  # one create or drop at a time
        self._pins: dict[str, Pin] = {}

    def load(self) -> list[Pin]:
        """At start: every stored pin is held again (before any safeGcTs is handed out)."""
        loaded = self._store.load()
        with self._lock:
            for pin in loaded.values():
                self._holder.hold_pin(pin.name, pin.ts, check=False)
            self._pins = dict(loaded)
        return sorted(loaded.values(), key=lambda p: p.name)

    def create(self, name: str, ts: int, at_time_ms: int = 0) -> Pin:
        check_name(name)
        with self._lock:
            known = self._pins.get(name)
            if known is not None:
                return self._same(known, ts)
            self._holder.hold_pin(name, ts)  # PIN_ABOVE_HORIZON is checked here
            pin = Pin(name, ts, self._clock_ms(), at_time_ms)
            try:
                TRANS_PIN_CREATE_BEFORE.hit()
                stored = self._store.create(pin)
            except BaseException:
                self._holder.release_pin(name)
                raise
            if stored.ts != ts:  # created meanwhile by another TransServer
                self._holder.release_pin(name)
                return self._same(stored, ts)
            TRANS_PIN_CREATE_AFTER.hit()
            self._pins[name] = stored
            log.info("pin_created", name=name, ts=ts, at_time_ms=at_time_ms)
            return stored

    @staticmethod
    def _same(known: Pin, ts: int) -> Pin:
        if known.ts != ts:
            raise Refusal(grpc.StatusCode.ALREADY_EXISTS,
                          f"pin {known.name} exists at timestamp {known.ts}, not {ts}; "
                          "drop it first or choose another name")
        return known

    def drop(self, name: str) -> bool:
        check_name(name)
        with self._lock:
            if name not in self._pins:
                return False
            TRANS_PIN_DROP_BEFORE.hit()
            self._store.delete(name)
            TRANS_PIN_DROP_AFTER.hit()
            del self._pins[name]
            self._holder.release_pin(name)
            log.info("pin_dropped", name=name)
            return True

    def get(self, name: str) -> Pin | None:
        with self._lock:
            return self._pins.get(name)

    def all(self) -> list[Pin]:
        with self._lock:
            return sorted(self._pins.values(), key=lambda p: p.name)
