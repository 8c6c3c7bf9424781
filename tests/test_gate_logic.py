"""QueryAvailabilityGate decisions from its local snapshot (pure logic, controlled clock)."""

from __future__ import annotations

import pytest

from retina_common.etcd import KeyValue, WatchEvent
from retina_common.keys import lifecycle_key
from retina_common.lifecycle_record import LifecycleRecord, LifecycleState
from trans_gate.gate import NodeAvailability, QueryAvailabilityGate

A, B = "127.0.0.1:1001", "127.0.0.1:1002"
NOW = 1_000_000


def kv(node: str, state: str = "READY", updated: int = NOW, raw: bytes | None = None) -> KeyValue:
    value = raw if raw is not None else LifecycleRecord(
        LifecycleState(state), node, 1, 1, "", updated).to_json().encode()
    return KeyValue(lifecycle_key(node), value, 5, 5, 1, 0)


def gate(clock: list[int]) -> QueryAvailabilityGate:
    return QueryAvailabilityGate([A, B], stale_after_ms=1000, clock_ms=lambda: clock[0])


def test_refuses_until_the_watch_is_initialised() -> None:
    g = gate([NOW])
    decision = g.check()
    assert not decision.admitted
    assert "not initialised" in decision.message


def test_admits_only_when_every_expected_node_is_ready_and_fresh() -> None:
    clock = [NOW]
    g = gate(clock)
    g.reset([kv(A), kv(B)], revision=5)
    assert g.check().admitted
    clock[0] = NOW + 1001
    decision = g.check()
    assert not decision.admitted
    assert decision.refusal_reasons == {A: NodeAvailability.STALE, B: NodeAvailability.STALE}


@pytest.mark.parametrize("b_entry, reason", [
    (None, NodeAvailability.MISSING),
    (kv(B, "RECOVERING"), NodeAvailability.RECOVERING),
    (kv(B, "FAILED"), NodeAvailability.FAILED),
    (kv(B, raw=b"{broken"), NodeAvailability.MALFORMED),
    (kv(B, updated=NOW - 5000), NodeAvailability.STALE),
])
def test_each_bad_node_state_closes_the_gate(b_entry: KeyValue | None,
                                             reason: NodeAvailability) -> None:
    g = gate([NOW])
    g.reset([kv(A)] + ([b_entry] if b_entry else []), revision=5)
    decision = g.check()
    assert not decision.admitted
    assert decision.refusal_reasons == {B: reason}
    assert B in decision.message and A not in decision.message


def test_unexpected_nodes_do_not_open_or_close_the_gate() -> None:
    g = gate([NOW])
    g.reset([kv(A), kv(B), kv("127.0.0.1:9999", "FAILED")], revision=5)
    assert g.check().admitted


def test_watch_events_and_a_broken_watch() -> None:
    g = gate([NOW])
    g.reset([kv(A), kv(B)], revision=5)
    g.apply([WatchEvent("DELETE", lifecycle_key(B), b"", 6)])
    assert g.check().refusal_reasons == {B: NodeAvailability.MISSING}
    g.apply([WatchEvent("PUT", lifecycle_key(B), kv(B).value, 7)])
    assert g.check().admitted
    g.mark_watch_broken("connection reset")
    decision = g.check()
    assert not decision.admitted and "watch lost: connection reset" in decision.message
    g.reset([kv(A), kv(B)], revision=8)
    assert g.check().admitted


def test_disabled_gate_admits_and_enabled_gate_needs_nodes() -> None:
    assert QueryAvailabilityGate([], 1000, lambda: NOW, enabled=False).check().admitted
    with pytest.raises(ValueError):
        QueryAvailabilityGate([], 1000, lambda: NOW)
