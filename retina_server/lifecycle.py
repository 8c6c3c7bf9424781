"""The Retina lifecycle: external states, internal phases, and the leased lifecycle key.

External states (specification section 2) are what etcd, the query gate and
GetRetinaStatus see: RECOVERING, READY, FAILED. RECOVERING is split into
explicit internal phases, and every move between phases goes through one
transition table; anything else raises :class:`IllegalTransition`.

    STARTING ─▶ LOADING_CHECKPOINT ─▶ CLEANSING ─▶ AWAITING_REPLAY ─▶ BARRIER ─▶ READY
        └──────────────┴──────────────────┴──────────────┴──────────────┴──────────┴─▶ FAILED

What each phase admits (C05.4, C06.3):

| phase | CDC writes | replay writes | reads (QueryVisibility, GetWriteBuffer, ...) |
|---|---|---|---|
| STARTING, LOADING_CHECKPOINT, CLEANSING | refused | refused | refused |
| AWAITING_REPLAY | refused | accepted (matching context) | refused |
| BARRIER | refused | refused (entry closed) | refused |
| READY | accepted | refused (no attempt) | accepted |
| FAILED | refused | refused | refused |

Invariant READY_ONLY_THROUGH_BARRIER: READY is reachable only from BARRIER,
that is only through MarkReady; a fresh start takes the same path.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from enum import StrEnum

from retina_common.etcd import EtcdError, EtcdStore
from retina_common.keys import lifecycle_key
from retina_common.lifecycle_record import LifecycleRecord, LifecycleState
from retina_common.log import get_logger

log = get_logger(component="lifecycle")


class Phase(StrEnum):
    STARTING = "STARTING"
    LOADING_CHECKPOINT = "LOADING_CHECKPOINT"
    CLEANSING = "CLEANSING"
    AWAITING_REPLAY = "AWAITING_REPLAY"
    BARRIER = "BARRIER"
    READY = "READY"
    FAILED = "FAILED"


class WritePolicy(StrEnum):
    NONE = "none"
    REPLAY_ONLY = "replay only"
    ALL = "all"


EXTERNAL: dict[Phase, LifecycleState] = {
    Phase.STARTING: LifecycleState.RECOVERING,
    Phase.LOADING_CHECKPOINT: LifecycleState.RECOVERING,
    Phase.CLEANSING: LifecycleState.RECOVERING,
    Phase.AWAITING_REPLAY: LifecycleState.RECOVERING,
    Phase.BARRIER: LifecycleState.RECOVERING,
    Phase.READY: LifecycleState.READY,
    Phase.FAILED: LifecycleState.FAILED,
}

TRANSITIONS: dict[Phase, frozenset[Phase]] = {
    Phase.STARTING: frozenset({Phase.LOADING_CHECKPOINT, Phase.FAILED}),
    Phase.LOADING_CHECKPOINT: frozenset({Phase.CLEANSING, Phase.FAILED}),
    Phase.CLEANSING: frozenset({Phase.AWAITING_REPLAY, Phase.FAILED}),
    Phase.AWAITING_REPLAY: frozenset({Phase.BARRIER, Phase.FAILED}),
    Phase.BARRIER: frozenset({Phase.READY, Phase.FAILED}),
    Phase.READY: frozenset({Phase.FAILED}),
    Phase.FAILED: frozenset(),
}

WRITES: dict[Phase, WritePolicy] = {
    Phase.AWAITING_REPLAY: WritePolicy.REPLAY_ONLY,
    Phase.READY: WritePolicy.ALL,
}


class IllegalTransition(Exception):
    """A phase change that the transition table does not allow."""


class LifecycleStateMachine:
    """The current phase, changed only through :data:`TRANSITIONS`."""

    def __init__(self, on_change: Callable[[Phase, Phase, str], None] | None = None) -> None:
        self._phase = Phase.STARTING
        self._reason = ""
        self._lock = threading.Lock()
        self._on_change = on_change or (lambda _old, _new, _why: None)

    @property
    def phase(self) -> Phase:
        return self._phase

    @property
    def state(self) -> LifecycleState:
        return EXTERNAL[self._phase]

    @property
    def reason(self) -> str:
        return self._reason

    def transition(self, to: Phase, reason: str = "") -> None:
        with self._lock:
            old = self._phase
            if to not in TRANSITIONS[old]:
                raise IllegalTransition(f"{old} -> {to} is not a lifecycle transition")
            self._phase, self._reason = to, reason
        log.info("lifecycle_transition", old=old.value, new=to.value,
                 state=EXTERNAL[to].value, reason=reason)
        self._on_change(old, to, reason)

    def fail(self, reason: str) -> None:
        """Move to FAILED from anywhere (idempotent once FAILED)."""
        with self._lock:
            if self._phase == Phase.FAILED:
                return
        self.transition(Phase.FAILED, reason)

    def write_policy(self) -> WritePolicy:
        return WRITES.get(self._phase, WritePolicy.NONE)

    def reads_allowed(self) -> bool:
        return self._phase == Phase.READY


class LifecyclePublisher:
    """Keeps ``/pixels/retina/lifecycle/<node>`` current on a lease of its own.

    The value is re-written (new ``updatedAtMs``) every ``ttl_s / 3`` seconds,
    as the freshness contract of the query gate requires; when the process
    dies the lease expires and the key disappears. A lost lease is replaced
    by a new one. Only the token's hash prefix is ever written.
    """

    def __init__(self, store: EtcdStore, node_id: str, ttl_s: int,
                 clock_ms: Callable[[], int] = lambda: int(time.time() * 1000)) -> None:
        self._store = store
        self._node = node_id
        self._ttl = ttl_s
        self._clock_ms = clock_ms
        self._lease = 0
        self._record: LifecycleRecord | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="lifecycle-heartbeat", daemon=True)

    def publish(self, state: LifecycleState, *, checkpoint_id: int | None, recovery_epoch: int,
                token_hash: str) -> None:
        with self._lock:
            self._record = LifecycleRecord(state, self._node, checkpoint_id, recovery_epoch,
                                           token_hash, self._clock_ms())
            self._put_locked()

    def _put_locked(self) -> None:
        if self._record is None:
            return
        if not self._lease:
            self._lease = self._store.grant_lease(self._ttl)
        record = LifecycleRecord(self._record.state, self._node, self._record.checkpoint_id,
                                 self._record.recovery_epoch, self._record.token_hash,
                                 self._clock_ms())
        self._store.put(lifecycle_key(self._node), record.to_json(), lease_id=self._lease)

    def _run(self) -> None:
        while not self._stop.wait(max(self._ttl / 3, 0.2)):
            with self._lock:
                try:
                    if self._lease and self._store.keepalive(self._lease) <= 0:
                        log.warning("lifecycle_lease_lost", node=self._node)
                        self._lease = 0
                    self._put_locked()
                except EtcdError as exc:
                    # The key will expire and the gate will refuse: fail closed by itself.
                    log.warning("lifecycle_heartbeat_failed", node=self._node, error=str(exc))

    def start(self) -> None:
        self._thread.start()

    def stop(self, revoke: bool = True) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)
        if revoke and self._lease:
            try:
                self._store.revoke_lease(self._lease)
            except EtcdError as exc:
                log.warning("lifecycle_revoke_failed", node=self._node, error=str(exc))
