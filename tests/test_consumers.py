"""Registered change-feed consumers at a real TransServer process (etcd and PostgreSQL real,
the query gate off): register, commit, drop and list; the hold on safeGcTs across SIGKILL
restarts; the lag drop; SIGKILL at every durable step (docs/write-paths/history.md, H4)."""

from __future__ import annotations

import json
import random
from collections.abc import Callable

import grpc
import pytest
import requests
from prometheus_client.parser import text_string_to_metric_families

from retina_common.etcd import EtcdStore
from retina_common.keys import CONSUMER_PREFIX, consumer_key
from retina_common.pb import trans_pb2 as tpb
from retina_common.refusal import CHANGES_EXPIRED, earliest_cursor

from .support import TransServerProcess, begin_write, eventually, rpc_error
from .test_trans_server import trans_factory  # noqa: F401  (the fixture)

pytestmark = pytest.mark.integration

TransFactory = Callable[..., TransServerProcess]


def server_of(trans_factory: TransFactory, **trans: object) -> TransServerProcess:  # noqa: F811
    # No retention: only reads, pins and consumers hold safeGcTs, so it is exact here.
    return trans_factory(gate={"retina_enabled": False},
                         trans={"history_retention_ms": 0, "time_map_sample_ms": 50,
                                "time_map_flush_ms": 200, "lease_sweep_interval_ms": 100,
                                **trans})


def commit(stub) -> int:
    w = begin_write(stub)
    stub.CommitTrans(tpb.CommitTransRequest(trans_id=w.trans_id), timeout=10)
    return w.timestamp


def hwm(stub) -> int:
    return stub.GetHighWatermark(tpb.GetHighWatermarkRequest(), timeout=10).high_watermark


def safe_gc(stub) -> int:
    return stub.GetSafeGcTimestamp(tpb.GetSafeGcTimestampRequest(), timeout=10).safe_gc_ts


def register(stub, name: str, cursor: int, table: str = "") -> tpb.Consumer:
    return stub.RegisterConsumer(tpb.RegisterConsumerRequest(
        name=name, cursor_ts=cursor, table=table), timeout=10).consumer


def advance(stub, name: str, cursor: int) -> tpb.Consumer:
    return stub.CommitConsumer(tpb.CommitConsumerRequest(name=name, cursor_ts=cursor),
                               timeout=10).consumer


def listed(stub) -> dict[str, tpb.Consumer]:
    return {c.name: c for c in stub.ListConsumers(tpb.ListConsumersRequest(),
                                                  timeout=10).consumers}


def stored(etcd: EtcdStore) -> dict[str, int]:
    """name -> cursor as etcd holds them."""
    kvs, _ = etcd.get_prefix(CONSUMER_PREFIX)
    records = [json.loads(kv.value) for kv in kvs]
    assert [kv.key for kv in kvs] == [consumer_key(r["name"]) for r in records]
    return {r["name"]: r["cursor_ts"] for r in records}


def expired(call: Callable[[], object]) -> int:
    err = rpc_error(call)
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION, err.details()
    assert err.details().startswith(CHANGES_EXPIRED), err.details()
    found = earliest_cursor(err.details())
    assert found is not None, err.details()
    return found


def metric(server: TransServerProcess, name: str, **labels: str) -> float | None:
    text = requests.get(f"http://{server.metrics}/metrics", timeout=5).text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and sample.labels == labels:
                return sample.value
    return None


def test_register_commit_drop_and_list(trans_factory: TransFactory,  # noqa: F811
                                       etcd: EtcdStore) -> None:
    server = server_of(trans_factory).start()
    stub = server.stub()
    stamps = [commit(stub) for _ in range(5)]
    first = register(stub, "search-index", stamps[1], "shop.orders")
    assert (first.name, first.cursor_ts, first.table) == ("search-index", stamps[1],
                                                         "shop.orders")
    assert first.created_ms == first.renewed_ms > 0
    assert first.lag_commits == 3  # stamps[2..4] are above its cursor
    again = register(stub, "search-index", stamps[3], "other.table")
    assert again.cursor_ts == stamps[1] and again.table == "shop.orders"  # unchanged
    assert stored(etcd) == {"search-index": stamps[1]}
    assert safe_gc(stub) == stamps[1]  # the changes above the cursor stay readable

    for cursor in (stamps[0], hwm(stub) + 1):  # backwards; above the HWM
        err = rpc_error(lambda c=cursor: advance(stub, "search-index", c))
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, err.details()
    moved = advance(stub, "search-index", stamps[3])
    assert moved.cursor_ts == stamps[3] and moved.renewed_ms >= first.renewed_ms
    assert moved.lag_commits == 1
    assert advance(stub, "search-index", stamps[3]).cursor_ts == stamps[3]  # a renewal
    assert stored(etcd) == {"search-index": stamps[3]}
    assert safe_gc(stub) == stamps[3]
    register(stub, "cache", stamps[3])
    assert sorted(listed(stub)) == ["cache", "search-index"]
    reply = stub.ListConsumers(tpb.ListConsumersRequest(), timeout=10)
    assert reply.max_consumer_lag_ms == 3_600_000

    assert stub.DropConsumer(tpb.DropConsumerRequest(name="search-index"), timeout=10).dropped
    assert not stub.DropConsumer(tpb.DropConsumerRequest(name="search-index"),
                                 timeout=10).dropped
    err = rpc_error(lambda: advance(stub, "search-index", stamps[4]))
    assert err.code() == grpc.StatusCode.NOT_FOUND and "not registered" in err.details()
    assert advance(stub, "cache", stamps[4]).cursor_ts == stamps[4]
    assert safe_gc(stub) == stamps[4] - 1  # a cursor at the HWM holds nothing more
    assert stored(etcd) == {"cache": stamps[4]}


@pytest.mark.parametrize("fields", [
    {"name": "", "cursor_ts": 1}, {"name": "a/b", "cursor_ts": 1}, {"name": "x" * 129},
    {"name": "ok", "cursor_ts": -1}, {"name": "ok", "table": "no_dot"},
    {"name": "ok", "table": "a.b.c"},
])
def test_malformed_registrations_are_refused_and_store_nothing(
        trans_factory: TransFactory, etcd: EtcdStore, fields: dict) -> None:  # noqa: F811
    server = server_of(trans_factory).start()
    stub = server.stub()
    commit(stub)
    err = rpc_error(lambda: stub.RegisterConsumer(tpb.RegisterConsumerRequest(**fields),
                                                  timeout=10))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, err.details()
    assert listed(stub) == {} and stored(etcd) == {}
    assert safe_gc(stub) == hwm(stub) - 1
    for bad in (tpb.CommitConsumerRequest(name="a/b", cursor_ts=1),
                tpb.CommitConsumerRequest(name="ok", cursor_ts=-1)):
        assert rpc_error(lambda b=bad: stub.CommitConsumer(b, timeout=10)).code() == \
            grpc.StatusCode.INVALID_ARGUMENT


def test_a_cursor_below_the_gc_horizon_is_refused_naming_the_earliest_cursor(
        trans_factory: TransFactory, etcd: EtcdStore) -> None:  # noqa: F811
    server = server_of(trans_factory).start()
    stub = server.stub()
    stamps = [commit(stub) for _ in range(4)]
    horizon = safe_gc(stub)
    assert horizon == stamps[-1] - 1
    earliest = expired(lambda: register(stub, "late", stamps[0]))
    assert earliest == horizon
    assert stored(etcd) == {} and listed(stub) == {}
    assert register(stub, "late", earliest).cursor_ts == horizon  # at the horizon: admitted
    err = rpc_error(lambda: register(stub, "ahead", hwm(stub) + 1))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, err.details()


def test_safe_gc_never_passes_a_cursor_across_two_kill9_restarts_in_a_row(
        trans_factory: TransFactory, etcd: EtcdStore) -> None:  # noqa: F811
    """A model (name -> cursor) beside the server: after every step the stored and listed
    consumers equal it and safeGcTs is at or below every cursor (exactly the lowest
    one while something committed above it)."""
    rng = random.Random(28)
    server = server_of(trans_factory).start()
    stub = server.stub()
    model: dict[str, int] = {}
    stamps = [commit(stub) for _ in range(3)]
    for name in ("a", "b", "c"):
        model[name] = register(stub, name, stamps[0]).cursor_ts

    def check() -> None:
        assert {n: c.cursor_ts for n, c in listed(stub).items()} == model == stored(etcd)
        given = safe_gc(stub)
        assert given <= min(model.values())
        if hwm(stub) > min(model.values()):
            assert given == min(model.values())

    for restart in range(3):
        for _ in range(6):
            stamps.append(commit(stub))
            name = rng.choice(sorted(model))
            model[name] = advance(stub, name, rng.randint(model[name], hwm(stub))).cursor_ts
            check()
        if restart == 1:
            assert stub.DropConsumer(tpb.DropConsumerRequest(name="c"), timeout=10).dropped
            del model["c"]
            check()
        if restart < 2:
            server.kill9()
            server.start()
            stub = server.reconnect()
            check()


def test_a_consumer_lagging_past_the_limit_is_dropped_and_its_hold_released(
        trans_factory: TransFactory, etcd: EtcdStore) -> None:  # noqa: F811
    server = server_of(trans_factory, max_consumer_lag_ms=1500).start()
    stub = server.stub()
    stamps = [commit(stub) for _ in range(2)]
    register(stub, "dead", stamps[0])
    register(stub, "live", stamps[0])
    assert metric(server, "retina_consumer_max_lag_ms") == 1500
    assert metric(server, "retina_consumers_dropped_total") == 0
    # "live" keeps up; "dead" never commits again: its oldest unread change ages.
    commit(stub)
    advance(stub, "live", hwm(stub))
    eventually(lambda: 0 < (metric(server, "retina_consumer_lag_ms", consumer="dead") or 0)
               <= 1500, 5, "dead's lag exported")
    assert metric(server, "retina_consumer_lag_commits", consumer="dead") == 2
    assert metric(server, "retina_consumer_lag_ms", consumer="live") == 0

    def keep_live_up() -> bool:
        commit(stub)
        advance(stub, "live", hwm(stub))
        return "dead" not in listed(stub)
    eventually(keep_live_up, 20, "the lagging consumer dropped", interval_s=0.2)
    assert "live" in listed(stub) and stored(etcd) == {"live": hwm(stub)}
    assert metric(server, "retina_consumers_dropped_total") == 1
    assert metric(server, "retina_consumer_lag_ms", consumer="dead") is None  # labels gone
    assert metric(server, "retina_consumers") == 1
    assert "consumer_dropped" in server.log_tail(20_000)
    assert safe_gc(stub) == hwm(stub) - 1  # only "live", at the HWM, holds it now
    err = rpc_error(lambda: advance(stub, "dead", stamps[1]))
    assert err.code() == grpc.StatusCode.NOT_FOUND, err.details()
    assert "dropped for lag" in err.details()
    # Re-registered at or above the horizon it is a new consumer.
    assert register(stub, "dead", hwm(stub)).cursor_ts == hwm(stub)
    server.kill9()
    server.start()
    stub = server.reconnect()
    assert sorted(listed(stub)) == ["dead", "live"]


# --- crash windows (docs/write-paths/history.md, H4) -------------------------------------
@pytest.mark.parametrize("point", [
    "trans.consumer.register.before", "trans.consumer.register.after",
    "trans.consumer.commit.before", "trans.consumer.commit.after",
    "trans.consumer.drop.before", "trans.consumer.drop.after",
    "trans.consumer.lag_drop.before", "trans.consumer.lag_drop.after"])
def test_kill_at_each_durable_step_of_a_consumer(trans_factory: TransFactory,  # noqa: F811
                                                 etcd: EtcdStore, point: str) -> None:
    """Whatever step the TransServer dies at, the restarted one holds exactly what etcd
    holds, etcd holds the old or the new state (never a cursor below the horizon), and
    the retried call converges."""
    step = point.split(".")[2]
    lag_drop = step == "lag_drop"
    server = server_of(trans_factory, max_consumer_lag_ms=800 if lag_drop else 3_600_000)
    server.start(failpoints=f"{point}=exit(137)" if step == "register" else "")
    stub = server.stub()
    stamps = [commit(stub) for _ in range(4)]
    if step != "register":
        register(stub, "c", stamps[0])
        commit(stub)
        server.kill9()
        server.start(failpoints=f"{point}=exit(137)")
        stub = server.reconnect()
    calls = {
        "register": lambda: register(stub, "c", stamps[0]),
        "commit": lambda: advance(stub, "c", stamps[2]),
        "drop": lambda: stub.DropConsumer(tpb.DropConsumerRequest(name="c"), timeout=10),
    }
    if not lag_drop:  # else "c" lags from the restart on: the housekeeping loop dies dropping it
        rpc_error(calls[step])
    assert server.wait_exit() == 137
    expected = {
        "trans.consumer.register.before": None, "trans.consumer.register.after": stamps[0],
        "trans.consumer.commit.before": stamps[0], "trans.consumer.commit.after": stamps[2],
        "trans.consumer.drop.before": stamps[0], "trans.consumer.drop.after": None,
        "trans.consumer.lag_drop.before": stamps[0], "trans.consumer.lag_drop.after": None,
    }[point]
    assert stored(etcd) == ({} if expected is None else {"c": expected})
    # Restarted (twice, with a lag limit that drops nothing) it holds what etcd holds.
    for _ in range(2):
        restarted = server_of(trans_factory).start()
        stub = restarted.stub()
        assert {n: c.cursor_ts for n, c in listed(stub).items()} == \
            ({} if expected is None else {"c": expected})
        commit(stub)
        assert safe_gc(stub) == (hwm(stub) - 1 if expected is None else expected)
        restarted.kill9()
    restarted = server_of(trans_factory).start()
    stub = restarted.stub()
    # The retried call converges.
    if step == "register" and expected is None:
        expired(calls["register"])  # safeGcTs was handed out above it meanwhile
    elif step in ("register", "commit"):
        assert calls[step]().cursor_ts == (stamps[2] if step == "commit" else stamps[0])
    elif step == "drop":
        assert calls["drop"]().dropped == (expected is not None)
