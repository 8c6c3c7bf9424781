"""Durable, strictly increasing counters (timestamps and transaction ids).

Invariant NEVER_REUSED: a value is handed out only below the upper bound
persisted in etcd, and a (re)started counter begins at the persisted bound.
So every value issued after a restart, even after ``kill -9``, is greater
than every value issued before it. Bounds are reserved in blocks to keep etcd
off the hot path; a crash wastes at most the unused rest of a block.

The bound is advanced with compare-and-swap on its mod revision. If the
compare fails, another TransServer has taken over the key: this instance is
fenced and must stop issuing values (:class:`CounterFenced`).
"""

from __future__ import annotations

import threading

from retina_common.etcd import EtcdOutcomeUnknown, EtcdStore
from retina_common.failpoints import Failpoint
from retina_common.log import get_logger

log = get_logger(component="timestamps")


class CounterCorrupt(Exception):
    """The persisted bound is not a positive integer: refuse to guess."""


class CounterFenced(Exception):
    """Another writer advanced the bound: this instance must stop issuing values."""


class DurableCounter:
    def __init__(self, store: EtcdStore, key: str, block_size: int,
                 before_persist: Failpoint, after_persist: Failpoint) -> None:
        if block_size < 1:
            raise ValueError("block size must be at least 1")
        self._store = store
        self._key = key
        self._block = block_size
        self._before = before_persist
        self._after = after_persist
        self._lock = threading.Lock()
        self._next = 0
        self._limit = 0
        self._revision = 0
        self._session_start = 0
        self._fenced = False

    def open(self) -> None:
        """Read the persisted bound and reserve the first block."""
        kv = self._store.get(self._key)
        if kv is None:
            start, revision = 1, 0
        else:
            try:
                start = int(kv.value.decode())
            except (UnicodeDecodeError, ValueError):
                raise CounterCorrupt(f"{self._key} holds {kv.value!r}, not an integer") from None
            if start < 1:
                raise CounterCorrupt(f"{self._key} holds {start}, not a positive bound")
            revision = kv.mod_revision
        with self._lock:
            self._next = self._limit = self._session_start = start
            self._revision = revision
            self._reserve(1)
        log.info("counter_opened", key=self._key, first=start, reserved_to=self._limit)

    @property
    def session_start(self) -> int:
        """First value this process may issue; everything below predates it."""
        return self._session_start

    @property
    def issued_upper(self) -> int:
        """Exclusive bound of the values issued so far."""
        with self._lock:
            return self._next

    def take(self, count: int = 1) -> int:
        """Issue ``count`` consecutive values; returns the first."""
        if count < 1:
            raise ValueError("count must be at least 1")
        with self._lock:
            if self._fenced:
                raise CounterFenced(f"{self._key}: this instance was fenced")
            if self._next + count > self._limit:
                self._reserve(count)
            first = self._next
            self._next += count
            return first

    def _reserve(self, at_least: int) -> None:
        new_limit = self._next + max(self._block, at_least)
        self._before.hit()
        try:
            revision = self._store.compare_and_put(self._key, str(new_limit), self._revision)
        except EtcdOutcomeUnknown:
            revision = self._reread_after_unknown(new_limit)
        if revision is None:
            self._fenced = True
            log.critical("counter_fenced", key=self._key)
            raise CounterFenced(f"{self._key} was advanced by another writer")
        self._after.hit()
        self._revision = revision
        self._limit = new_limit

    def _reread_after_unknown(self, new_limit: int) -> int | None:
        kv = self._store.get(self._key)
        if kv is not None and kv.value.decode() == str(new_limit):
            return kv.mod_revision
        current = 0 if kv is None else kv.mod_revision
        if current == self._revision:  # not applied: try once more
            return self._store.compare_and_put(self._key, str(new_limit), self._revision)
        return None
