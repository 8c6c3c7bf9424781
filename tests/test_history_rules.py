"""The history rules of the transaction table (trans_gate/transactions.py, history.py,
pins.py) against a real etcd, without gRPC: the GC horizon, AS OF admission, pins and
the retention."""

from __future__ import annotations

import threading

import grpc
import pytest

from retina_common import failpoints
from retina_common.etcd import EtcdStore
from retina_common.keys import GC_HORIZON_KEY, pin_key
from retina_common.refusal import SNAPSHOT_EXPIRED, Refusal, earliest_readable
from trans_gate.history import GcHorizon, HorizonFenced, retained_snapshot
from trans_gate.pins import Pins, PinStore
from trans_gate.transactions import SnapshotAhead, TransactionTable, TransKind

from .test_transactions import counter, horizon


def table(etcd: EtcdStore, clock: list[int], **kw: object) -> TransactionTable:
    from retina_common.keys import TRANS_ID_KEY, TRANS_TIMESTAMP_KEY
    return TransactionTable(counter(etcd, TRANS_TIMESTAMP_KEY, 100),
                            counter(etcd, TRANS_ID_KEY, 100), lambda: clock[0],
                            write_lease_ms=1000, read_lease_ms=1000, max_lease_ms=5000,
                            horizon=horizon(etcd), **kw)  # type: ignore[arg-type]


def commits(t: TransactionTable, n: int) -> int:
    for w in t.begin(TransKind.WRITE, n):
        t.commit([w.trans_id])
    return t.high_watermark()


def expired(call) -> tuple[int, int]:
    with pytest.raises(Refusal) as refused:
        call()
    assert refused.value.code == grpc.StatusCode.FAILED_PRECONDITION
    assert str(refused.value).startswith(SNAPSHOT_EXPIRED)
    found = earliest_readable(str(refused.value))
    assert found is not None
    return found


@pytest.mark.integration
def test_the_horizon_is_durable_monotonic_and_bounds_as_of_reads(etcd: EtcdStore) -> None:
    clock = [0]
    t = table(etcd, clock)
    hwm = commits(t, 10)
    old = t.begin_as_of(hwm - 5)  # a live AS OF read holds safeGcTs below it
    assert old.as_of and old.timestamp == hwm - 5
    assert t.safe_gc_ts() == hwm - 6
    assert int(etcd.get(GC_HORIZON_KEY).value) == hwm - 6
    t.commit([old.trans_id])
    assert t.safe_gc_ts() == hwm - 1  # nothing holds it now
    # At or below the horizon: refused, naming the earliest readable point.
    assert expired(lambda: t.begin_as_of(hwm - 1)) == (hwm, 0)
    with pytest.raises(SnapshotAhead):
        t.begin_as_of(hwm + 1)
    assert t.begin_as_of(hwm).timestamp == hwm
    # A restarted table starts from the stored horizon: never lower.
    again = table(etcd, clock)
    assert again.horizon() == hwm - 1
    assert again.safe_gc_ts() >= hwm - 1
    expired(lambda: again.begin_as_of(hwm - 1))


@pytest.mark.integration
def test_safe_gc_ts_is_durable_before_it_is_answered(etcd: EtcdStore, active_failpoints) -> None:
    clock = [0]
    t = table(etcd, clock)
    hwm = commits(t, 5)
    active_failpoints("trans.horizon.persist.before=raise")
    with pytest.raises(failpoints.FailpointTriggered):
        t.safe_gc_ts()
    # Nobody got hwm - 1, but it is raised in memory: no read at or below it is admitted.
    assert etcd.get(GC_HORIZON_KEY) is None
    expired(lambda: t.begin_as_of(hwm - 1))
    active_failpoints("")
    assert t.safe_gc_ts() == hwm - 1
    assert int(etcd.get(GC_HORIZON_KEY).value) == hwm - 1


@pytest.mark.integration
def test_concurrent_hand_outs_store_the_largest(etcd: EtcdStore) -> None:
    clock = [0]
    t = table(etcd, clock)
    given: list[int] = []

    def hand_out() -> None:
        for _ in range(20):
            commits(t, 1)
            given.append(t.safe_gc_ts())

    threads = [threading.Thread(target=hand_out) for _ in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert int(etcd.get(GC_HORIZON_KEY).value) == max(given) == t.horizon()


@pytest.mark.integration
def test_another_writer_moving_the_horizon_fences(etcd: EtcdStore) -> None:
    clock = [0]
    t = table(etcd, clock)
    commits(t, 3)
    t.safe_gc_ts()
    etcd.put(GC_HORIZON_KEY, "1")  # another TransServer
    commits(t, 3)
    with pytest.raises(HorizonFenced):
        t.safe_gc_ts()


@pytest.mark.integration
def test_a_corrupt_horizon_is_refused(etcd: EtcdStore) -> None:
    from trans_gate.history import HorizonCorrupt
    etcd.put(GC_HORIZON_KEY, "soon")
    with pytest.raises(HorizonCorrupt):
        GcHorizon(etcd, GC_HORIZON_KEY, failpoints.TRANS_HORIZON_PERSIST_BEFORE,
                  failpoints.TRANS_HORIZON_PERSIST_AFTER).load()


@pytest.mark.integration
def test_a_pin_holds_its_snapshot_until_dropped(etcd: EtcdStore) -> None:
    clock = [1000]
    t = table(etcd, clock)
    pins = Pins(PinStore(etcd), t, clock_ms=lambda: clock[0])
    pins.load()
    hwm = commits(t, 10)
    pin = pins.create("before-batch", hwm - 4)
    assert pins.create("before-batch", hwm - 4) == pin  # again: the same pin
    with pytest.raises(Refusal) as taken:
        pins.create("before-batch", hwm - 3)
    assert taken.value.code == grpc.StatusCode.ALREADY_EXISTS
    commits(t, 10)
    assert t.safe_gc_ts() == hwm - 5
    assert t.begin_as_of(hwm - 4).timestamp == hwm - 4
    # Reloaded (a restarted TransServer): the pin holds again.
    t2 = table(etcd, clock)
    pins2 = Pins(PinStore(etcd), t2)
    assert [p.name for p in pins2.load()] == ["before-batch"]
    assert t2.safe_gc_ts() == hwm - 5
    assert pins2.drop("before-batch") and etcd.get(pin_key("before-batch")) is None
    assert not pins2.drop("before-batch")
    assert t2.safe_gc_ts() == t2.high_watermark() - 1
    # Below the horizon now: a pin there is refused like a read there.
    assert expired(lambda: pins2.create("late", hwm - 4))[0] == t2.high_watermark()
    assert etcd.get(pin_key("late")) is None


@pytest.mark.integration
def test_a_pin_whose_write_fails_holds_nothing(etcd: EtcdStore, active_failpoints) -> None:
    clock = [0]
    t = table(etcd, clock)
    pins = Pins(PinStore(etcd), t)
    hwm = commits(t, 5)
    active_failpoints("trans.pin.create.before=raise")
    with pytest.raises(failpoints.FailpointTriggered):
        pins.create("p", hwm - 2)
    active_failpoints("")
    assert pins.all() == [] and t.safe_gc_ts() == hwm - 1


@pytest.mark.integration
@pytest.mark.parametrize("name", ["", "a/b", "x" * 129, "sp ace"])
def test_bad_pin_names_are_refused(etcd: EtcdStore, name: str) -> None:
    t = table(etcd, [0])
    with pytest.raises(Refusal) as bad:
        Pins(PinStore(etcd), t).create(name, 1)
    assert bad.value.code == grpc.StatusCode.INVALID_ARGUMENT


@pytest.mark.integration
def test_retention_keeps_the_snapshot_of_that_long_ago(etcd: EtcdStore) -> None:
    clock = [10_000]
    samples: list[tuple[int, int]] = []  # (wall, hwm): a stand-in time map

    def hwm_at_or_before(ms: int) -> int | None:
        found = [h for w, h in samples if w <= ms]
        return found[-1] if found else None

    t = table(etcd, clock, retained=retained_snapshot(5_000, hwm_at_or_before,
                                                      lambda: clock[0]))
    for _ in range(10):  # a commit and a sample every second
        samples.append((clock[0], commits(t, 1)))
        clock[0] += 1000
    # Now 20 s: the snapshot of 15 s ago (the sample at 15 s) stays readable.
    assert samples[5][0] == clock[0] - 5_000
    assert t.safe_gc_ts() == samples[5][1] - 1
    clock[0] += 100_000
    assert t.safe_gc_ts() == t.high_watermark() - 1
    fresh = table(etcd, [0], retained=retained_snapshot(5_000, lambda _ms: None, lambda: 0))
    commits(fresh, 3)
    assert fresh.safe_gc_ts() == fresh.horizon()  # the map does not reach back: hold all
