"""AS OF transactions, pins, the GC horizon and the time map at a real TransServer process
(etcd and PostgreSQL real, the query gate off: no Retina node is involved here), with
SIGKILL at every durable step of the history (docs/write-paths/history.md)."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest

from retina_common import failpoints
from retina_common.etcd import EtcdStore
from retina_common.keys import GC_HORIZON_KEY, TIME_MAP_PREFIX, pin_key
from retina_common.pb import trans_pb2 as tpb
from retina_common.refusal import AS_OF_TIME_UNMAPPED, SNAPSHOT_EXPIRED, earliest_readable

from .support import TransServerProcess, begin_write, eventually, rpc_error
from .test_trans_server import trans_factory  # noqa: F401  (the fixture)

TransFactory = Callable[..., TransServerProcess]


def server_of(trans_factory: TransFactory, **trans: object) -> TransServerProcess:  # noqa: F811
    return trans_factory(gate={"retina_enabled": False},
                         trans={"time_map_sample_ms": 50, "time_map_flush_ms": 200, **trans})


def commit(stub) -> int:
    w = begin_write(stub)
    stub.CommitTrans(tpb.CommitTransRequest(trans_id=w.trans_id), timeout=10)
    return w.timestamp


def as_of(stub, **point: object) -> tpb.BeginTransResponse:
    """An AS OF read transaction, ended at once (it would hold safeGcTs otherwise)."""
    r = stub.BeginTrans(tpb.BeginTransRequest(read_only=True, **point), timeout=10)
    stub.CommitTrans(tpb.CommitTransRequest(trans_id=r.trans_id), timeout=10)
    return r


def safe_gc(stub) -> int:
    return stub.GetSafeGcTimestamp(tpb.GetSafeGcTimestampRequest(), timeout=10).safe_gc_ts


def history(stub) -> tpb.GetHistoryStatusResponse:
    return stub.GetHistoryStatus(tpb.GetHistoryStatusRequest(), timeout=10)


def expired(call: Callable[[], object]) -> tuple[int, int]:
    err = rpc_error(call)
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION, err.details()
    assert err.details().startswith(SNAPSHOT_EXPIRED), err.details()
    found = earliest_readable(err.details())
    assert found is not None, err.details()
    return found


def wait_flushed(stub) -> None:
    """The time map's sampler and flush have run since now (sample 50 ms, flush 200 ms)."""
    time.sleep(0.5)


@pytest.mark.parametrize("request_fields, code", [
    ({"read_only": False, "as_of_ts": 1}, grpc.StatusCode.INVALID_ARGUMENT),
    ({"read_only": True, "as_of_ts": 1, "as_of_time_ms": 1}, grpc.StatusCode.INVALID_ARGUMENT),
    ({"read_only": True, "as_of_ts": 1, "as_of_pin": "p"}, grpc.StatusCode.INVALID_ARGUMENT),
    ({"read_only": True, "as_of_ts": -3}, grpc.StatusCode.INVALID_ARGUMENT),
    ({"read_only": True, "as_of_ts": 10**12}, grpc.StatusCode.OUT_OF_RANGE),
    ({"read_only": True, "as_of_time_ms": int(time.time() * 1000) + 3_600_000},
     grpc.StatusCode.OUT_OF_RANGE),
    ({"read_only": True, "as_of_pin": "nobody"}, grpc.StatusCode.NOT_FOUND),
])
@pytest.mark.integration
def test_malformed_or_impossible_as_of_requests_are_refused_and_begin_nothing(
        trans_factory: TransFactory, request_fields: dict, code: grpc.StatusCode) -> None:  # noqa: F811
    server = server_of(trans_factory).start()
    stub = server.stub()
    commit(stub)
    before = history(stub)
    err = rpc_error(lambda: stub.BeginTrans(tpb.BeginTransRequest(**request_fields),
                                            timeout=10))
    assert err.code() == code, err.details()
    holds = stub.GetReadHolds(tpb.GetReadHoldsRequest(), timeout=10)
    assert holds.live_read_transactions == 0
    assert history(stub).horizon_ts == before.horizon_ts


@pytest.mark.integration
def test_as_of_reads_stay_admitted_above_the_horizon_and_are_refused_at_or_below_it(
        trans_factory: TransFactory) -> None:  # noqa: F811
    server = server_of(trans_factory).start()
    stub = server.stub()
    stamps = [commit(stub) for _ in range(5)]
    live = stub.BeginTrans(tpb.BeginTransRequest(read_only=True, as_of_ts=stamps[1]),
                           timeout=10)
    assert live.timestamp == stamps[1]
    status = stub.GetTransStatus(tpb.GetTransStatusRequest(trans_id=live.trans_id), timeout=10)
    assert status.live and status.read_only and status.as_of
    assert safe_gc(stub) == stamps[1] - 1  # the live AS OF read holds it, like any read
    stub.CommitTrans(tpb.CommitTransRequest(trans_id=live.trans_id), timeout=10)
    assert as_of(stub, as_of_ts=stamps[1]).timestamp == stamps[1]  # nothing handed out since
    hwm = stamps[-1]
    assert safe_gc(stub) == hwm - 1
    wait_flushed(stub)
    ts, time_ms = expired(lambda: as_of(stub, as_of_ts=stamps[1]))
    status = history(stub)
    assert ts == status.earliest_readable_ts == hwm == status.horizon_ts + 1
    assert time_ms == status.earliest_readable_time_ms > 0
    assert as_of(stub, as_of_ts=hwm).timestamp == hwm
    # The earliest readable time resolves to the earliest readable timestamp.
    assert as_of(stub, as_of_time_ms=time_ms).timestamp == hwm
    expired(lambda: as_of(stub, as_of_time_ms=time_ms - 1))


@pytest.mark.integration
def test_a_wall_clock_time_resolves_to_the_newest_commit_at_or_before_it(
        trans_factory: TransFactory) -> None:  # noqa: F811
    server = server_of(trans_factory).start()
    stub = server.stub()
    points = []
    for _ in range(4):
        ts = commit(stub)
        wait_flushed(stub)  # sampled
        points.append((int(time.time() * 1000), ts))
        time.sleep(0.2)
    for time_ms, ts in points:
        assert as_of(stub, as_of_time_ms=time_ms).timestamp == ts


@pytest.mark.integration
def test_pins_and_the_horizon_survive_kill9_and_a_dropped_pin_releases_history(
        trans_factory: TransFactory, etcd: EtcdStore) -> None:  # noqa: F811
    server = server_of(trans_factory).start()
    stub = server.stub()
    stamps = [commit(stub) for _ in range(6)]
    wait_flushed(stub)
    at_time = int(time.time() * 1000)
    pin = stub.CreatePin(tpb.CreatePinRequest(name="before-batch", ts=stamps[2]),
                         timeout=10).pin
    timed = stub.CreatePin(tpb.CreatePinRequest(name="by-time", at_time_ms=at_time),
                           timeout=10).pin
    assert (pin.ts, timed.ts, timed.at_time_ms) == (stamps[2], stamps[-1], at_time)
    again = stub.CreatePin(tpb.CreatePinRequest(name="before-batch", ts=stamps[2]), timeout=10)
    assert again.pin == pin  # a retried create: the same pin
    err = rpc_error(lambda: stub.CreatePin(tpb.CreatePinRequest(name="before-batch",
                                                                ts=stamps[3]), timeout=10))
    assert err.code() == grpc.StatusCode.ALREADY_EXISTS
    for bad in (tpb.CreatePinRequest(name="x/y", ts=1), tpb.CreatePinRequest(name="x"),
                tpb.CreatePinRequest(name="x", ts=1, at_time_ms=1)):
        assert rpc_error(lambda b=bad: stub.CreatePin(b, timeout=10)).code() == \
            grpc.StatusCode.INVALID_ARGUMENT
    commit(stub)
    assert safe_gc(stub) == stamps[2] - 1
    expired(lambda: stub.CreatePin(tpb.CreatePinRequest(name="late", ts=stamps[1]),
                                   timeout=10))
    assert etcd.get(pin_key("late")) is None

    server.kill9()
    server.start()
    stub = server.reconnect()
    assert [p.name for p in stub.ListPins(tpb.ListPinsRequest(), timeout=10).pins] == \
        ["before-batch", "by-time"]
    assert history(stub).horizon_ts == stamps[2] - 1
    assert as_of(stub, as_of_pin="before-batch").timestamp == stamps[2]
    expired(lambda: as_of(stub, as_of_ts=stamps[1]))
    assert safe_gc(stub) == stamps[2] - 1  # the restarted server still holds the pin

    assert stub.DropPin(tpb.DropPinRequest(name="before-batch"), timeout=10).dropped
    assert not stub.DropPin(tpb.DropPinRequest(name="before-batch"), timeout=10).dropped
    assert safe_gc(stub) == timed.ts - 1
    expired(lambda: as_of(stub, as_of_ts=stamps[2]))
    assert rpc_error(lambda: as_of(stub, as_of_pin="before-batch")).code() == \
        grpc.StatusCode.NOT_FOUND


@pytest.mark.integration
def test_safe_gc_ts_is_unavailable_while_etcd_is_away_and_nothing_is_handed_out(
        trans_factory: TransFactory, base_dir: Path) -> None:  # noqa: F811
    from devtools.cluster import free_port, start_etcd, terminate

    own = start_etcd(base_dir / f"etcd-hist-{free_port()}", base_dir / "etcd-hist.log")
    try:
        server = trans_factory(gate={"retina_enabled": False},
                               etcd_endpoint=own.endpoint).start()
        stub = server.stub()
        stamps = [commit(stub) for _ in range(3)]
        terminate(own.pid)
        err = rpc_error(lambda: safe_gc(stub))
        assert err.code() == grpc.StatusCode.UNAVAILABLE, err.details()
        own = start_etcd(Path(own.data_dir), base_dir / "etcd-hist.log",
                         ports=(own.client_port, own.peer_port))
        assert eventually(lambda: safe_gc(stub), 30, "safeGcTs once etcd is back") == \
            stamps[-1] - 1
        assert int(EtcdStore([own.endpoint]).get(GC_HORIZON_KEY).value) == stamps[-1] - 1
    finally:
        terminate(own.pid)


# --- crash windows (docs/write-paths/history.md) ----------------------------------------------
@pytest.mark.integration
def test_a_crash_leaves_unmapped_times_and_a_clean_stop_does_not(
        trans_factory: TransFactory, failpoint_dir: Path,  # noqa: F811
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(failpoints.DIR_VAR, str(failpoint_dir))
    server = server_of(trans_factory)
    # The 4th flush parks the sampler's thread: nothing is written after it (H3).
    server.start(failpoints="trans.time_map.flush.before=block@4")
    stub = server.stub()
    first = commit(stub)
    failpoints.wait_hit(failpoint_dir, "trans.time_map.flush.before", 30)
    time.sleep(0.1)
    second = commit(stub)
    time.sleep(0.3)
    lost = int(time.time() * 1000)  # after `second`, never recorded
    server.kill9()
    time.sleep(0.3)
    server.start()
    stub = server.reconnect()
    err = rpc_error(lambda: as_of(stub, as_of_time_ms=lost))
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION, err.details()
    assert err.details().startswith(AS_OF_TIME_UNMAPPED)
    gaps = history(stub).time_gaps
    assert len(gaps) == 1 and gaps[0].from_ms < lost < gaps[0].to_ms
    assert as_of(stub, as_of_time_ms=gaps[0].from_ms).timestamp == first
    assert as_of(stub, as_of_ts=second).timestamp == second  # a timestamp still reads
    # A clean stop closes the segment: its downtime resolves to its last HWM.
    third = commit(stub)
    wait_flushed(stub)
    server.stop()
    down = int(time.time() * 1000)
    time.sleep(0.3)
    server.start()
    stub = server.reconnect()
    assert as_of(stub, as_of_time_ms=down).timestamp == third
    assert len(history(stub).time_gaps) == 1


@pytest.mark.integration
@pytest.mark.parametrize("point", ["trans.horizon.persist.before",
                                   "trans.horizon.persist.after"])
def test_kill_while_the_horizon_is_persisted(trans_factory: TransFactory,  # noqa: F811
                                             etcd: EtcdStore, point: str) -> None:
    """H1: killed before the write, the horizon stays where it was and no read is refused
    that was admitted before; after it, the horizon is the value nobody received yet.
    Either way no safeGcTs anybody received is above the stored horizon."""
    server = server_of(trans_factory)
    server.start(failpoints=f"{point}=exit(137)@2")
    stub = server.stub()
    stamps = [commit(stub) for _ in range(3)]
    first = safe_gc(stub)  # hit 1: stored
    assert first == stamps[-1] - 1
    more = [commit(stub) for _ in range(3)]
    rpc_error(lambda: safe_gc(stub))  # hit 2: the process dies, no answer
    assert server.wait_exit() == 137
    stored = int(etcd.get(GC_HORIZON_KEY).value)
    assert stored == (first if point.endswith("before") else more[-1] - 1)
    server.start()
    stub = server.reconnect()
    assert history(stub).horizon_ts == stored
    if point.endswith("before"):
        assert as_of(stub, as_of_ts=more[0]).timestamp == more[0]
    else:
        expired(lambda: as_of(stub, as_of_ts=more[0]))
    assert safe_gc(stub) >= stored


@pytest.mark.integration
@pytest.mark.parametrize("point", ["trans.pin.create.before", "trans.pin.create.after",
                                   "trans.pin.drop.before", "trans.pin.drop.after"])
def test_kill_while_a_pin_is_created_or_dropped(trans_factory: TransFactory,  # noqa: F811
                                                etcd: EtcdStore, point: str) -> None:
    """H2: a pin is held in memory before it is written and released after it is deleted,
    so a crash at any step leaves the stored pin set and the horizon consistent: a stored
    pin is always above the stored horizon, and a CreatePin/DropPin retried converges."""
    creating = "create" in point
    server = server_of(trans_factory)
    server.start(failpoints=f"{point}=exit(137)" if creating else "")
    stub = server.stub()
    stamps = [commit(stub) for _ in range(4)]
    if creating:
        def request() -> object:
            return stub.CreatePin(tpb.CreatePinRequest(name="p", ts=stamps[1]), timeout=10)
    else:
        stub.CreatePin(tpb.CreatePinRequest(name="p", ts=stamps[1]), timeout=10)
        server.kill9()
        server.start(failpoints=f"{point}=exit(137)")
        stub = server.reconnect()

        def request() -> object:
            return stub.DropPin(tpb.DropPinRequest(name="p"), timeout=10)
    rpc_error(request)
    assert server.wait_exit() == 137
    stored = etcd.get(pin_key("p")) is not None
    # Written after "create.after" only; gone from "drop.after" on.
    assert stored == (point in ("trans.pin.create.after", "trans.pin.drop.before"))
    server.start()
    stub = server.reconnect()
    names = [p.name for p in stub.ListPins(tpb.ListPinsRequest(), timeout=10).pins]
    assert names == (["p"] if stored else [])
    commit(stub)
    assert safe_gc(stub) == (stamps[1] - 1 if stored else stub.GetHighWatermark(
        tpb.GetHighWatermarkRequest(), timeout=10).high_watermark - 1)
    # The retried call converges.
    if creating and not stored:
        expired(lambda: stub.CreatePin(tpb.CreatePinRequest(name="p", ts=stamps[1]),
                                       timeout=10))
    elif creating:
        assert stub.CreatePin(tpb.CreatePinRequest(name="p", ts=stamps[1]),
                              timeout=10).pin.ts == stamps[1]
    else:
        assert stub.DropPin(tpb.DropPinRequest(name="p"), timeout=10).dropped == stored


@pytest.mark.integration
@pytest.mark.parametrize("point", ["trans.time_map.flush.before",
                                   "trans.time_map.flush.after"])
def test_kill_while_the_time_map_is_flushed(trans_factory: TransFactory,  # noqa: F811
                                            etcd: EtcdStore, point: str) -> None:
    """H3: what was flushed before the kill resolves exactly after the restart; the times
    after it (the lost flush's samples, or only the moment before the kill) fall into the
    gap and are refused, never resolved to an older commit."""
    server = server_of(trans_factory, time_map_flush_ms=300)
    server.start(failpoints=f"{point}=exit(137)@6")
    stub = server.stub()
    points = []
    while server.alive():
        try:
            ts = commit(stub)
        except grpc.RpcError:
            break
        time.sleep(0.12)
        points.append((int(time.time() * 1000), ts))
    assert server.wait_exit() == 137
    kvs, _ = etcd.get_prefix(TIME_MAP_PREFIX)
    assert kvs
    server.start()
    stub = server.reconnect()
    gaps = history(stub).time_gaps
    assert len(gaps) == 1
    resolved = unmapped = 0
    for time_ms, ts in points:
        if time_ms < gaps[0].from_ms:
            assert as_of(stub, as_of_time_ms=time_ms).timestamp == ts
            resolved += 1
        elif time_ms < gaps[0].to_ms:
            err = rpc_error(lambda t=time_ms: as_of(stub, as_of_time_ms=t))
            assert err.details().startswith(AS_OF_TIME_UNMAPPED), err.details()
            unmapped += 1
    assert resolved > 0
    if point.endswith("before"):
        assert unmapped > 0  # 300 ms of samples were never written
