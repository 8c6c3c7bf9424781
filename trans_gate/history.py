"""The GC horizon: the largest safeGcTs ever handed out, durable in etcd and monotonic.

Invariant HORIZON_BELOW_READABLE (docs/trans-server.md, "History"): every safeGcTs a
caller was ever given is at or below the horizon stored in etcd *before* the caller got
it, and an AS OF read at S is admitted only if ``horizon < S``. Visibility folding,
primary-index pruning, Storage GC cutoffs and the sweepers all act at or below a
safeGcTs they were given, so nothing a read at ``S > horizon`` needs is gone, across
any number of TransServer restarts.

The protocol (the transaction table's lock makes step 1 atomic with AS OF admission):

1. under the table's lock, compute safeGcTs and raise the in-memory horizon to it
   (:meth:`GcHorizon.raise_to`): from here on no AS OF read at or below it is admitted;
2. outside the lock, :meth:`GcHorizon.persist` it: serialised, only upward,
   compare-and-swap on the key's revision (another writer moving it fences this
   TransServer, as the timestamp counters do);
3. answer the caller only after step 2 succeeded. With etcd away the call answers
   UNAVAILABLE and the caller skips its GC round; the in-memory horizon stays raised,
   which refuses a few reads more than needed, never one too few.

A crash between 1 and 3 loses an in-memory raise nobody acted on.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from retina_common.etcd import EtcdOutcomeUnknown, EtcdStore, EtcdUnavailable
from retina_common.failpoints import Failpoint
from retina_common.log import get_logger
from trans_gate.timestamps import CounterFenced

log = get_logger(component="history")


class HorizonCorrupt(Exception):
    """The stored horizon is not a non-negative integer: refuse to guess."""


class HorizonFenced(CounterFenced):
    """Another writer moved the horizon key: this TransServer must stop."""


def _parse(key: str, raw: bytes) -> int:
    try:
        value = int(raw.decode())
    except (UnicodeDecodeError, ValueError):
        raise HorizonCorrupt(f"{key} holds {raw!r}, not an integer") from None
    if value < 0:
        raise HorizonCorrupt(f"{key} holds {value}, a negative horizon")
    return value


class GcHorizon:
    def __init__(self, store: EtcdStore, key: str, before_persist: Failpoint,
                 after_persist: Failpoint) -> None:
        self._store = store
        self._key = key
        self._before = before_persist
        self._after = after_persist
        self._persist_lock = threading.Lock()
        self._value = 0  # in memory: raised under the table's lock
        self._durable = 0
        self._revision = 0

    def load(self) -> int:
        """Read the stored horizon (0 when there is none yet)."""
        kv = self._store.get(self._key)
        with self._persist_lock:
            if kv is None:
                self._durable, self._revision = 0, 0
            else:
                self._durable, self._revision = _parse(self._key, kv.value), kv.mod_revision
            self._value = self._durable
        log.info("gc_horizon_loaded", horizon=self._durable)
        return self._durable

    @property
    def value(self) -> int:
        """The in-memory horizon: nothing at or below it is admitted."""
        return self._value

    @property
    def durable(self) -> int:
        return self._durable

    def raise_to(self, ts: int) -> None:
        """Step 1 (the caller holds the transaction table's lock)."""
        if ts > self._value:
            self._value = ts

    def persist(self, ts: int) -> None:
        """Step 2: make the horizon at least ``ts`` in etcd. Raises EtcdError (nothing
        durable changed, or an unknown outcome that a later call settles) or
        HorizonFenced."""
        with self._persist_lock:
            if ts <= self._durable:
                return
            self._before.hit()
            try:
                revision = self._store.compare_and_put(self._key, str(ts), self._revision)
            except EtcdOutcomeUnknown:
                revision = self._settle_unknown(ts)
            if revision is None:
                log.critical("gc_horizon_fenced", key=self._key)
                raise HorizonFenced(f"{self._key} was moved by another writer")
            self._after.hit()
            self._durable, self._revision = ts, revision

    def _settle_unknown(self, ts: int) -> int | None:
        """A write whose answer was lost: it landed (our value, a new revision), did not
        land (the revision we know: the caller retries later), or another writer moved
        the key (None: fenced)."""
        kv = self._store.get(self._key)
        if kv is not None and _parse(self._key, kv.value) == ts:
            return kv.mod_revision
        if (0 if kv is None else kv.mod_revision) == self._revision:
            raise EtcdUnavailable(f"{self._key}: the horizon write did not land; retry")
        return None


def retained_snapshot(retention_ms: int, hwm_at_or_before: Callable[[int], int | None],
                      clock_ms: Callable[[], int]) -> Callable[[], int | None]:
    """The snapshot ``trans.history_retention_ms`` keeps readable: the HWM of the time map's
    sample at or before ``now - retention`` (every later time resolves at or above it);
    0 (hold everything) when the map does not reach back that far yet; None when there
    is no retention."""
    def retained() -> int | None:
        if retention_ms <= 0:
            return None
        ts = hwm_at_or_before(clock_ms() - retention_ms)
        return 0 if ts is None else ts
    return retained
