"""The consumer rules of the transaction table and trans_gate/consumers.py against a real
etcd, without gRPC, on a clock the test moves: the hold at the cursor, the lag in time and
commits, the lag drop, and writes that fail."""

from __future__ import annotations

import grpc
import pytest

from retina_common import failpoints
from retina_common.etcd import EtcdStore
from retina_common.keys import consumer_key
from retina_common.refusal import (
    CHANGES_EXPIRED,
    Refusal,
    changes_expired,
    earliest_cursor,
    snapshot_expired,
)
from trans_gate.consumers import Consumers, ConsumerStore
from trans_gate.transactions import TransactionTable, TransKind

from .test_history_rules import commits, table

pytestmark = pytest.mark.integration


def consumers_of(etcd: EtcdStore, t: TransactionTable, clock: list[int],
                 times: dict[int, int], max_lag_ms: int = 10_000) -> Consumers:
    """``times``: ts -> the wall ms it became visible (the time map's part)."""
    def time_of(ts: int) -> int:
        return min((ms for at, ms in times.items() if at >= ts), default=0)
    c = Consumers(ConsumerStore(etcd), t, time_of, max_lag_ms, lambda: clock[0])
    c.load()
    return c


def refused(call, code: grpc.StatusCode) -> str:
    with pytest.raises(Refusal) as caught:
        call()
    assert caught.value.code == code, caught.value
    return str(caught.value)


def test_changes_expired_names_the_earliest_cursor_and_nothing_else_parses() -> None:
    refusal = changes_expired("gone", 41)
    assert refusal.code == grpc.StatusCode.FAILED_PRECONDITION
    assert str(refusal).startswith(CHANGES_EXPIRED) and earliest_cursor(str(refusal)) == 41
    assert earliest_cursor(str(snapshot_expired("x", 41))) is None
    assert earliest_cursor("changes_expired: no number") is None


def test_lag_counts_time_and_committed_writes_above_the_cursor(etcd: EtcdStore) -> None:
    clock = [10_000]
    t = table(etcd, clock)
    hwm = commits(t, 4)
    times = {hwm - 3: 1_000, hwm - 2: 2_000, hwm: 4_000}
    c = consumers_of(etcd, t, clock, times)
    first = c.register("a", hwm - 3, "s.t")
    rolled = t.begin(TransKind.WRITE)[0]
    t.rollback(rolled.trans_id)  # ended, never committed: not a change
    t.commit([t.begin(TransKind.READ)[0].trans_id])  # a read: not a change either
    assert c.lag(first).ms == 10_000 - 2_000 and c.lag(first).commits == 3
    at_hwm = c.register("b", t.high_watermark())
    assert c.lag(at_hwm).ms == 0 and c.lag(at_hwm).commits == 0
    assert t.safe_gc_ts() == hwm - 3  # "a" holds it at its cursor
    # The horizon rose to a's cursor: what is at or below it is no longer counted.
    assert t.committed_writes_above(0) == 3


def test_a_cursor_moves_forward_only_and_holds_until_the_lag_drop(etcd: EtcdStore) -> None:
    clock = [0]
    t = table(etcd, clock)
    hwm = commits(t, 6)
    times = {ts: 100 * ts for ts in range(1, hwm + 1)}
    c = consumers_of(etcd, t, clock, times, max_lag_ms=5_000)
    c.register("slow", hwm - 5)
    c.register("quick", hwm - 5)
    refused(lambda: c.commit("quick", hwm - 6), grpc.StatusCode.INVALID_ARGUMENT)
    refused(lambda: c.commit("quick", hwm + 1), grpc.StatusCode.INVALID_ARGUMENT)
    assert c.commit("quick", hwm).cursor_ts == hwm
    assert t.safe_gc_ts() == hwm - 5
    clock[0] = 100 * (hwm - 4) + 5_000  # slow's oldest change is exactly at the limit
    assert c.drop_lagging() == []
    clock[0] += 1
    (gone,) = c.drop_lagging()
    assert gone.consumer.name == "slow" and gone.lag.ms == 5_001
    assert etcd.get(consumer_key("slow")) is None
    assert t.safe_gc_ts() == hwm - 1  # released: only "quick", at the HWM, is left
    message = refused(lambda: c.commit("slow", hwm), grpc.StatusCode.NOT_FOUND)
    assert "dropped for lag" in message and "5001 ms" in message
    # Registered again it is a new consumer; another TransServer knows nothing of the drop.
    expired = refused(lambda: c.register("slow", hwm - 5),
                      grpc.StatusCode.FAILED_PRECONDITION)
    assert earliest_cursor(expired) == hwm - 1
    assert c.register("slow", hwm).cursor_ts == hwm
    assert c.commit("slow", hwm).cursor_ts == hwm
    reloaded = consumers_of(etcd, table(etcd, clock), clock, times)
    assert [x.name for x, _lag in reloaded.all()] == ["quick", "slow"]
    assert "not registered" in refused(lambda: reloaded.commit("other", 1),
                                       grpc.StatusCode.NOT_FOUND)


def test_failed_writes_change_nothing(etcd: EtcdStore, active_failpoints) -> None:
    clock = [0]
    t = table(etcd, clock)
    hwm = commits(t, 5)
    c = consumers_of(etcd, t, clock, {})
    active_failpoints("trans.consumer.register.before=raise")
    with pytest.raises(failpoints.FailpointTriggered):
        c.register("a", hwm - 3)
    assert c.all() == [] and etcd.get(consumer_key("a")) is None
    assert t.safe_gc_ts() == hwm - 1  # nothing held
    active_failpoints("")
    c.register("b", hwm)
    commits(t, 2)
    active_failpoints("trans.consumer.commit.before=raise")
    with pytest.raises(failpoints.FailpointTriggered):
        c.commit("b", hwm + 2)
    active_failpoints("")
    assert [x.cursor_ts for x, _lag in c.all()] == [hwm]
    assert t.safe_gc_ts() == hwm  # still held at the old cursor
    active_failpoints("trans.consumer.drop.before=raise")
    with pytest.raises(failpoints.FailpointTriggered):
        c.drop("b")
    active_failpoints("")
    assert etcd.get(consumer_key("b")) is not None and t.safe_gc_ts() == hwm
