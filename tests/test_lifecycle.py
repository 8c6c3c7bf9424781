"""Lifecycle phases, the transition table, and the leased lifecycle key against real etcd."""

from __future__ import annotations

import grpc
import pytest

from retina_common.etcd import EtcdStore
from retina_common.keys import lifecycle_key
from retina_common.lifecycle_record import LifecycleRecord, LifecycleState
from retina_common.refusal import Refusal
from retina_server.lifecycle import (
    TRANSITIONS,
    IllegalTransition,
    LifecycleAnnouncer,
    LifecycleStateMachine,
    Phase,
    Request,
)

from .support import eventually

HAPPY_PATH = [Phase.LOADING_CHECKPOINT, Phase.CLEANSING, Phase.AWAITING_REPLAY, Phase.BARRIER,
              Phase.READY]


def admitted(sm: LifecycleStateMachine) -> dict[Request, str]:
    """What each kind of request gets in the current phase: "ok" or the status name."""
    out = {}
    for request in Request:
        try:
            sm.admit(request)
            out[request] = "ok"
        except Refusal as exc:
            out[request] = exc.code.name
    return out


def test_the_happy_path_and_what_each_phase_admits() -> None:
    seen = []
    sm = LifecycleStateMachine(on_change=lambda old, new, _why: seen.append((old, new)))
    table = {}
    for phase in HAPPY_PATH:
        table[sm.phase] = (sm.state, admitted(sm))
        sm.transition(phase)
    table[sm.phase] = (sm.state, admitted(sm))
    u, f = "UNAVAILABLE", "FAILED_PRECONDITION"
    early = {Request.WRITE: u, Request.REPLAY_WRITE: f, Request.READ: u, Request.CHECKPOINT: u,
             Request.REPLAY_TS: u, Request.MARK_READY: u, Request.GC: u}
    assert table[Phase.STARTING] == (LifecycleState.RECOVERING, early)
    assert table[Phase.CLEANSING] == (LifecycleState.RECOVERING, early)
    assert table[Phase.AWAITING_REPLAY] == (LifecycleState.RECOVERING, {
        Request.WRITE: u, Request.REPLAY_WRITE: "ok", Request.READ: u, Request.CHECKPOINT: u,
        Request.REPLAY_TS: "ok", Request.MARK_READY: "ok", Request.GC: u})
    assert table[Phase.BARRIER] == (LifecycleState.RECOVERING, {
        Request.WRITE: u, Request.REPLAY_WRITE: f, Request.READ: u, Request.CHECKPOINT: u,
        Request.REPLAY_TS: "ok", Request.MARK_READY: "ok", Request.GC: u})
    assert table[Phase.READY] == (LifecycleState.READY, {
        Request.WRITE: "ok", Request.REPLAY_WRITE: f, Request.READ: "ok",
        Request.CHECKPOINT: "ok", Request.REPLAY_TS: f, Request.MARK_READY: "ok",
        Request.GC: "ok"})
    assert [new for _old, new in seen] == HAPPY_PATH


def test_ready_is_reachable_only_through_the_barrier() -> None:
    assert [p for p, targets in TRANSITIONS.items() if Phase.READY in targets] == [Phase.BARRIER]
    sm = LifecycleStateMachine()
    with pytest.raises(IllegalTransition):
        sm.transition(Phase.READY)  # no shortcut, not even for a fresh start
    sm.transition(Phase.LOADING_CHECKPOINT)
    with pytest.raises(IllegalTransition):
        sm.transition(Phase.AWAITING_REPLAY)  # cleansing cannot be skipped
    assert sm.phase == Phase.LOADING_CHECKPOINT


def test_failed_is_final_and_reachable_from_every_phase() -> None:
    for stop_at in range(len(HAPPY_PATH) + 1):
        sm = LifecycleStateMachine()
        for phase in HAPPY_PATH[:stop_at]:
            sm.transition(phase)
        sm.fail("boom")
        sm.fail("again")  # idempotent
        assert sm.state == LifecycleState.FAILED and sm.reason == "boom"
        assert set(admitted(sm).values()) == {"FAILED_PRECONDITION"}
        with pytest.raises(Refusal, match="FAILED: boom") as refused:
            sm.admit(Request.READ)
        assert refused.value.code == grpc.StatusCode.FAILED_PRECONDITION
        with pytest.raises(IllegalTransition):
            sm.transition(Phase.STARTING)


@pytest.mark.integration
def test_announcer_writes_a_leased_fresh_value_and_never_the_token(etcd: EtcdStore) -> None:
    node = "127.0.0.1:40123"
    clock = [1_000]
    announcer = LifecycleAnnouncer(etcd, node, ttl_s=1, clock_ms=lambda: clock[0])
    announcer.announce(LifecycleState.RECOVERING, checkpoint_id=3, recovery_epoch=2,
                      token_hash="abcdef12")
    record = LifecycleRecord.parse(node, etcd.get(lifecycle_key(node)).value)
    assert (record.state, record.checkpoint_id, record.token_hash) == (
        LifecycleState.RECOVERING, 3, "abcdef12")
    assert etcd.get(lifecycle_key(node)).lease != 0
    announcer.start()
    clock[0] = 5_000
    eventually(lambda: LifecycleRecord.parse(node, etcd.get(lifecycle_key(node)).value)
               .updated_at_ms == 5_000, 5, "the heartbeat to refresh updatedAtMs")
    announcer.stop()  # revokes the lease: the key goes at once
    assert etcd.get(lifecycle_key(node)) is None


@pytest.mark.integration
def test_failed_is_never_replaced_by_a_late_ready(etcd: EtcdStore) -> None:
    node = "127.0.0.1:40124"
    announcer = LifecycleAnnouncer(etcd, node, ttl_s=5)
    announcer.announce(LifecycleState.FAILED, checkpoint_id=1, recovery_epoch=1, token_hash="")
    announcer.announce(LifecycleState.READY, checkpoint_id=1, recovery_epoch=1, token_hash="")
    kv = etcd.get(lifecycle_key(node))
    assert kv is not None and LifecycleRecord.parse(node, kv.value).state == \
        LifecycleState.FAILED
    announcer.stop()
