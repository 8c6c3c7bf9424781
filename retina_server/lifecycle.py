"""The Retina lifecycle: external states, internal phases, and the leased lifecycle key.

External states (specification section 2) are what etcd, the query gate and
GetRetinaStatus see: RECOVERING, READY, FAILED. RECOVERING is split into
explicit internal phases, and every move between phases goes through one
transition table; anything else raises :class:`IllegalTransition`.

    STARTING ─▶ LOADING_CHECKPOINT ─▶ CLEANSING ─▶ AWAITING_REPLAY ─▶ BARRIER ─▶ READY
        └──────────────┴──────────────────┴──────────────┴──────────────┴──────────┴─▶ FAILED

What each phase admits is the table :data:`ADMISSION`, and it is the only
admission gate: the gRPC services and the recovery coordinator call
:meth:`LifecycleStateMachine.admit` instead of comparing phases themselves.

(U = UNAVAILABLE: retry later; F = FAILED_PRECONDITION: a protocol refusal; ok = admitted)

| phase | WRITE | REPLAY_WRITE | READ | CHECKPOINT | REPLAY_TS | MARK_READY | GC |
|---|---|---|---|---|---|---|---|
| STARTING, LOADING_CHECKPOINT, CLEANSING | U | F | U | U | U | U | U |
| AWAITING_REPLAY | U | ok | U | U | ok | ok | U |
| BARRIER | U | F (entry closed) | U | U | ok | ok (resumes an interrupted barrier) | U |
| READY | ok | F (no attempt) | ok | ok | F | ok (same token) | ok |
| FAILED | F | F | F | F | F | F | F |

Invariant READY_ONLY_THROUGH_BARRIER: READY is reachable only from BARRIER,
that is only through MarkReady; a fresh start takes the same path.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from enum import StrEnum

import grpc
from prometheus_client import Gauge

from retina_common.etcd import EtcdError, EtcdStore
from retina_common.keys import lifecycle_key
from retina_common.lifecycle_record import LifecycleRecord, LifecycleState
from retina_common.log import get_logger
from retina_common.refusal import Refusal

log = get_logger(component="lifecycle")
STATE = Gauge("retina_lifecycle_state", "1 for the node's current lifecycle phase", ["phase"])


class Phase(StrEnum):
    STARTING = "STARTING"
    LOADING_CHECKPOINT = "LOADING_CHECKPOINT"
    CLEANSING = "CLEANSING"
    AWAITING_REPLAY = "AWAITING_REPLAY"
    BARRIER = "BARRIER"
    READY = "READY"
    FAILED = "FAILED"


class Request(StrEnum):
    """What a caller asks the node to do; admitted or refused by :data:`ADMISSION`."""

    WRITE = "ordinary write"
    REPLAY_WRITE = "recovery replay write"
    READ = "read"
    CHECKPOINT = "checkpoint"
    REPLAY_TS = "replay starts"
    MARK_READY = "MarkReady"
    GC = "Storage GC"


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

_UNAVAILABLE = grpc.StatusCode.UNAVAILABLE
_REFUSED = grpc.StatusCode.FAILED_PRECONDITION
_RECOVERING_EARLY: dict[Request, grpc.StatusCode | None] = {
    Request.WRITE: _UNAVAILABLE, Request.REPLAY_WRITE: _REFUSED, Request.READ: _UNAVAILABLE,
    Request.CHECKPOINT: _UNAVAILABLE, Request.REPLAY_TS: _UNAVAILABLE,
    Request.MARK_READY: _UNAVAILABLE, Request.GC: _UNAVAILABLE,
}
# None: admitted. A status: refused with it (see the module docstring's table).
ADMISSION: dict[Phase, dict[Request, grpc.StatusCode | None]] = {
    Phase.STARTING: _RECOVERING_EARLY,
    Phase.LOADING_CHECKPOINT: _RECOVERING_EARLY,
    Phase.CLEANSING: _RECOVERING_EARLY,
    Phase.AWAITING_REPLAY: {
        Request.WRITE: _UNAVAILABLE, Request.REPLAY_WRITE: None, Request.READ: _UNAVAILABLE,
        Request.CHECKPOINT: _UNAVAILABLE, Request.REPLAY_TS: None, Request.MARK_READY: None,
        Request.GC: _UNAVAILABLE},
    Phase.BARRIER: {
        Request.WRITE: _UNAVAILABLE, Request.REPLAY_WRITE: _REFUSED, Request.READ: _UNAVAILABLE,
        Request.CHECKPOINT: _UNAVAILABLE, Request.REPLAY_TS: None,
        Request.MARK_READY: None, Request.GC: _UNAVAILABLE},
    Phase.READY: {
        Request.WRITE: None, Request.REPLAY_WRITE: _REFUSED, Request.READ: None,
        Request.CHECKPOINT: None, Request.REPLAY_TS: _REFUSED, Request.MARK_READY: None,
        Request.GC: None},
    Phase.FAILED: dict.fromkeys(Request, _REFUSED),
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
        self._changed(old, to, reason)

    def fail(self, reason: str) -> bool:
        """Move to FAILED from anywhere; False if it was FAILED already (the check and
        the move are one step, so two concurrent failures never collide)."""
        with self._lock:
            old = self._phase
            if old == Phase.FAILED:
                return False
            self._phase, self._reason = Phase.FAILED, reason
        self._changed(old, Phase.FAILED, reason)
        return True

    def _changed(self, old: Phase, new: Phase, reason: str) -> None:
        for p in Phase:
            STATE.labels(phase=p.value).set(1 if p == new else 0)
        log.info("lifecycle_transition", old=old.value, new=new.value,
                 state=EXTERNAL[new].value, reason=reason)
        self._on_change(old, new, reason)

    def admit(self, request: Request) -> Phase:
        """The phase the request is admitted in; raises :class:`Refusal` otherwise."""
        phase = self._phase
        code = ADMISSION[phase][request]
        if code is None:
            return phase
        if phase == Phase.FAILED:
            raise Refusal(code, f"{request.value} refused: the node is FAILED: {self._reason}")
        if phase == Phase.READY:
            raise Refusal(code, f"{request.value} refused: no recovery attempt is in "
                                "progress on this node (it is READY)")
        if phase == Phase.BARRIER and request == Request.REPLAY_WRITE:
            raise Refusal(code, "replay write refused: MarkReady closed the replay entry")
        hint = "; retry later" if code == _UNAVAILABLE else ""
        raise Refusal(code, f"{request.value} refused: the node is RECOVERING "
                            f"({phase.value}){hint}")


class LifecycleAnnouncer:
    """Keeps ``/pixels/retina/lifecycle/<node>`` current on a lease of its own.

    The value is re-written (new ``updatedAtMs``) every ``ttl_s / 3`` seconds,
    as the freshness contract of the query gate requires; when the process
    dies the lease expires and the key disappears. A lost lease is replaced
    by a new one. Only the token's hash prefix is ever written.
    """

    def __init__(self, store: EtcdStore, node_id: str, ttl_s: int,
                 clock_ms: Callable[[], int] = lambda: int(time.time() * 1000),
                 on_put: Callable[[LifecycleState], None] = lambda _state: None) -> None:
        self._store = store
        self._node = node_id
        self._ttl = ttl_s
        self._clock_ms = clock_ms
        # Told after every successful put: health follows what etcd says, including
        # a READY that only the heartbeat managed to announce (mark_ready.py).
        self._on_put = on_put
        self._lease = 0
        self._record: LifecycleRecord | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="lifecycle-heartbeat", daemon=True)

    def announce(self, state: LifecycleState, *, checkpoint_id: int | None, recovery_epoch: int,
                 token_hash: str) -> None:
        with self._lock:
            if self._record is not None and self._record.state == LifecycleState.FAILED:
                return  # FAILED is final: a late READY announcement must never replace it
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
        self._on_put(record.state)

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
