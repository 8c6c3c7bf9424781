"""The change feed (docs/change-feed.md) against the model's history, change by change, with
real TransServer, Retina nodes, etcd and PostgreSQL: inserts, updates (and updates that
changed nothing), deletes, whole commits across pages, stable ordinals, refusals."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import grpc
import pytest

from retina_common.catalog import Catalog
from retina_common.change_reader import (
    ChangeFeedReader,
    ChangesExpired,
    Commit,
    decode_cursor,
)
from retina_common.pb import retina_pb2 as rpb
from retina_common.pb import trans_pb2 as tpb
from retina_common.reader import main as query_main
from retina_common.refusal import CHANGES_EXPIRED

from .dataplane import SCHEMA, DataPlane
from .feed_model import apply_changes, expected_changes, feed_changes
from .support import eventually, rpc_error
from .test_as_of_reads import (
    hand_out_safe_gc_ts,
    maintenance,
    published,
    rewrite_every_stream,
    step,
    sweep_replaced,
)
from .test_lineage import revert
from .test_recovery_protocol import order

ORDER_COLUMNS = ("id", "customer", "amount", "note")


def history(plane: DataPlane, table: str) -> list[tuple[int, dict[bytes, dict[str, Any]]]]:
    return [(ts, snap[table]) for ts, snap in plane.model.history]


def read_feed(plane: DataPlane, table: str, from_ts: int, **options: Any) -> list[Commit]:
    assert plane.reader is not None
    return list(plane.reader.change_feed().read(SCHEMA, table, from_ts, **options))


def check_feed(plane: DataPlane, table: str, from_ts: int, columns: tuple[str, ...],
               **options: Any) -> list[Commit]:
    """The feed above ``from_ts`` equals the model's history commit by commit, and turns
    the model's table at ``from_ts`` into its newest table."""
    commits = read_feed(plane, table, from_ts, **options)
    writer = plane.writers[table]
    got = feed_changes([(c.ts, c.changes) for c in commits], writer.key, columns)
    last = commits[-1].ts if commits else from_ts
    want = expected_changes(history(plane, table), from_ts, last, columns)
    assert got == want, f"the feed of {table} above {from_ts} differs from the model"
    start: dict[bytes, dict[str, Any]] = {}
    for ts, rows in history(plane, table):
        if ts > from_ts:
            break
        start = rows
    final = apply_changes(start, got, columns)
    assert final == {k: tuple((c, r.get(c)) for c in columns)
                     for k, r in plane.model.rows[table].items()}
    return commits


@pytest.mark.integration
def test_the_feed_equals_the_models_history_change_by_change(
        make_plane: Callable[..., DataPlane], catalog: Catalog) -> None:
    plane = make_plane(nodes=2)
    points = [step(plane, catalog, n) for n in range(4)]
    # An update that changed nothing (the same row again) and one that did, in one commit.
    same = plane.model.rows["orders"][plane.writers["orders"].key({"id": 13})]
    plane.commit({"orders": {"replaces": [dict(same), order(14, note="changed")]}})
    points.append(step(plane, catalog, 4))

    start = points[0] - 1
    commits = check_feed(plane, "orders", start, ORDER_COLUMNS)
    assert {c.ts for c in commits} <= set(points) | {plane.model.history[4][0]}
    kinds = {r["_change_type"] for c in commits for r in c.changes.to_pylist()}
    assert kinds == {"insert", "update_before", "update_after", "delete"}
    check_feed(plane, "events", start, ("tenant", "seq", "payload", "ok"))
    # From any cursor on, and read again: the same commits, the same ordinals.
    for cursor in points[:3]:
        check_feed(plane, "orders", cursor, ORDER_COLUMNS)
    again = read_feed(plane, "orders", start)
    assert [(c.ts, c.changes.to_pylist()) for c in again] == \
        [(c.ts, c.changes.to_pylist()) for c in commits]
    # Pages of one change still deliver whole commits.
    paged = read_feed(plane, "orders", start, page_changes=1)
    assert [(c.ts, c.changes.to_pylist()) for c in paged] == \
        [(c.ts, c.changes.to_pylist()) for c in commits]

    # The update that changed nothing, kept on request.
    unchanged_ts = plane.model.history[4][0]
    kept = read_feed(plane, "orders", unchanged_ts - 1, to_ts=unchanged_ts,
                     keep_unchanged=True)
    rows = kept[0].changes.to_pylist()
    ids = sorted((r["_change_type"], r["id"]) for r in rows)
    assert ids == [("update_after", 13), ("update_after", 14),
                   ("update_before", 13), ("update_before", 14)]
    dropped = read_feed(plane, "orders", unchanged_ts - 1, to_ts=unchanged_ts)
    assert sorted((r["_change_type"], r["id"]) for r in dropped[0].changes.to_pylist()) == \
        [("update_after", 14), ("update_before", 14)]
    # Columns: the key always, then the ones asked for.
    narrow = read_feed(plane, "orders", start, columns=["note"])
    assert narrow[0].changes.column_names == ["_change_type", "_commit_ts", "_ordinal",
                                              "_source_position", "id", "note"]
    # A cursor names its table; it resumes where it says.
    assert decode_cursor(commits[1].cursor, SCHEMA, "orders") == commits[1].ts
    check_feed(plane, "orders", decode_cursor(commits[1].cursor), ORDER_COLUMNS)


@pytest.mark.integration
def test_a_cursor_older_than_the_history_kept_is_refused_naming_the_earliest(
        make_plane: Callable[..., DataPlane], catalog: Catalog) -> None:
    plane = make_plane(nodes=2)
    points = [step(plane, catalog, n) for n in range(3)]
    horizon = hand_out_safe_gc_ts(plane)  # the horizon moves to the HWM - 1
    maintenance(plane)
    assert horizon >= points[-1] - 1
    with pytest.raises(ChangesExpired) as refused:
        read_feed(plane, "orders", points[0])
    assert CHANGES_EXPIRED in str(refused.value)
    assert refused.value.earliest == horizon
    # From the earliest cursor named: answered, exactly.
    later = [step(plane, catalog, n) for n in range(3, 5)]
    commits = check_feed(plane, "orders", refused.value.earliest, ORDER_COLUMNS)
    assert [c.ts for c in commits][-2:] == later


@pytest.mark.integration
def test_malformed_or_unheld_reads_are_refused_and_change_nothing(
        make_plane: Callable[..., DataPlane], catalog: Catalog) -> None:
    plane = make_plane(nodes=1)
    first = step(plane, catalog, 0)
    stub = plane.retinas[plane.nodes[0]].stub
    trans = plane.trans.stub()
    current = trans.BeginTrans(tpb.BeginTransRequest(read_only=True), timeout=10)
    hold = trans.BeginTrans(tpb.BeginTransRequest(read_only=True, as_of_ts=first),
                            timeout=10)

    def ask(**fields: Any) -> grpc.RpcError:
        request = rpb.ReadChangesRequest(**{
            "schema_name": SCHEMA, "table_name": "orders", "from_ts": first - 1,
            "to_ts": current.timestamp, "trans_id": current.trans_id,
            "timestamp": current.timestamp, "hold_trans_id": hold.trans_id, **fields})
        return rpc_error(lambda: list(stub.ReadChanges(request, timeout=10)))

    invalid = grpc.StatusCode.INVALID_ARGUMENT
    assert ask(hold_trans_id=0).code() == invalid
    assert ask(from_ts=first - 2).code() == invalid  # the hold does not hold it
    assert ask(to_ts=first - 2).code() == invalid  # not a range
    assert ask(to_ts=current.timestamp + 1).code() == invalid  # after the snapshot
    assert ask(page_changes=-1).code() == invalid
    assert ask(columns=["nope"]).code() == invalid
    assert ask(table_name="nope").code() == grpc.StatusCode.NOT_FOUND
    assert ask(trans_id=0).code() == invalid
    # A good request after them: every change of the commit, nothing else changed.
    replies = list(stub.ReadChanges(rpb.ReadChangesRequest(
        schema_name=SCHEMA, table_name="orders", from_ts=first - 1, to_ts=current.timestamp,
        trans_id=current.trans_id, timestamp=current.timestamp,
        hold_trans_id=hold.trans_id), timeout=10))
    assert sum(r.change_count for r in replies) == len(plane.model.rows["orders"])
    assert replies[-1].through_ts == current.timestamp
    check_feed(plane, "orders", first - 1, ORDER_COLUMNS)


@pytest.mark.integration
def test_retina_query_changes_prints_commits_and_a_cursor_that_resumes(
        make_plane: Callable[..., DataPlane], capsys: pytest.CaptureFixture[str]) -> None:
    plane = make_plane(nodes=2)
    config = ["--config", str(plane.config_path)]
    first, _ = plane.commit({"orders": {"inserts": [order(i) for i in range(4)]}})
    assert query_main(["changes", f"{SCHEMA}.orders", "--from", "now", "--snapshot-first",
                       *config]) == 0
    out = capsys.readouterr()
    lines = [json.loads(line) for line in out.out.splitlines()]
    assert [(x["change_type"], x["row"]["id"]) for x in lines] == \
        [("snapshot", i) for i in range(4)]
    cursor = out.err.split("-- cursor ")[1].split()[0]
    second, _ = plane.commit({"orders": {"replaces": [order(1, note="x")],
                                         "deletes": [{"id": 2}]}})
    third, _ = plane.commit({"orders": {"inserts": [order(9)]}})
    assert query_main(["changes", f"{SCHEMA}.orders", "--from", cursor, "--columns", "note",
                       "--max-commits", "1", *config]) == 0
    out = capsys.readouterr()
    lines = [json.loads(line) for line in out.out.splitlines()]
    assert sorted((x["change_type"], x["row"]["id"]) for x in lines) == \
        [("delete", 2), ("update_after", 1), ("update_before", 1)]
    assert {x["commit_ts"] for x in lines} == {second}
    assert [x["ordinal"] for x in lines] == [0, 1, 2]
    assert set(lines[0]["row"]) == {"id", "note"}
    cursor = out.err.split("-- cursor ")[1].split()[0]
    assert decode_cursor(cursor, SCHEMA, "orders") == second
    assert query_main(["changes", f"{SCHEMA}.orders", "--from", cursor, *config]) == 0
    out = capsys.readouterr()
    assert [(json.loads(x)["change_type"], json.loads(x)["commit_ts"])
            for x in out.out.splitlines()] == [("insert", third)]
    # A cursor of another table, and one that is not a cursor: usage errors.
    assert query_main(["changes", f"{SCHEMA}.events", "--from", cursor, *config]) == 2
    assert query_main(["changes", f"{SCHEMA}.orders", "--from", "rc1.zzz", *config]) == 2
    # Older than the history kept: refused, naming the earliest cursor.
    hand_out_safe_gc_ts(plane)
    assert query_main(["changes", f"{SCHEMA}.orders", "--from", str(first - 1),
                       *config]) == 1
    assert "changes_expired" in capsys.readouterr().err


@pytest.mark.integration
def test_the_feed_stays_exact_across_gc_folds_a_revert_and_sweeps(
        make_plane: Callable[..., DataPlane], catalog: Catalog) -> None:
    """A consumer-like cursor held by a pin (the registry holds it the same way): the feed
    above it is the model's history, change by change, after every rewrite, fold, revert
    and sweep; Storage GC adds no change."""
    plane = make_plane(nodes=2, gc_retired_retention_ms=0, sweeper_interval_ms=0,
                       gc_interval_ms=1000)
    stub = plane.trans.stub()
    points = [step(plane, catalog, n) for n in range(3)]
    cursor = points[1]
    stub.CreatePin(tpb.CreatePinRequest(name="consumer", ts=cursor + 1), timeout=10)
    points += [step(plane, catalog, n) for n in range(3, 8)]
    assert hand_out_safe_gc_ts(plane) == cursor
    before = check_feed(plane, "orders", cursor, ORDER_COLUMNS)

    def same_commits() -> None:
        now = check_feed(plane, "orders", cursor, ORDER_COLUMNS)
        assert [(c.ts, c.changes.to_pylist()) for c in now[:len(before)]] == \
            [(c.ts, c.changes.to_pylist()) for c in before]
        check_feed(plane, "events", cursor, ("tenant", "seq", "payload", "ok"))

    rewrites = rewrite_every_stream(plane)
    assert rewrites
    assert maintenance(plane) == [cursor] * len(plane.nodes)
    same_commits()
    node, reply = rewrites[0]
    assert revert(plane, node, reply.rewrite_id).record.status == "REVERTED"
    same_commits()
    sweep_replaced(plane, catalog)
    points += [step(plane, catalog, n) for n in range(8, 10)]
    same_commits()
    # A cursor below the pin's hold is refused, naming the earliest.
    with pytest.raises(ChangesExpired) as refused:
        read_feed(plane, "orders", points[0])
    assert refused.value.earliest == cursor



@pytest.mark.integration
def test_a_registered_consumer_resumes_from_its_cursor_and_holds_its_history(
        make_plane: Callable[..., DataPlane], catalog: Catalog,
        capsys: pytest.CaptureFixture[str]) -> None:
    plane = make_plane(nodes=2)
    assert plane.reader is not None
    feed = plane.reader.change_feed()
    first = step(plane, catalog, 0)
    taken: list[Commit] = []
    # A follower registered at the first commit takes two commits, then stops.
    follow = feed.follow(SCHEMA, "orders", first, consumer="search", poll_s=0.05)
    points = [step(plane, catalog, n) for n in range(1, 4)]
    for commit in follow:
        if not commit.heartbeat:
            taken.append(commit)
        if len(taken) == 2:
            break
    follow.close()
    assert [c.ts for c in taken] == points[:2]
    consumers = {c.name: c for c in plane.trans.stub().ListConsumers(
        tpb.ListConsumersRequest(), timeout=10).consumers}
    # Committed after a whole round was taken: at least the first commit, never past what
    # was taken.
    assert first < consumers["search"].cursor_ts <= points[1]
    cursor = consumers["search"].cursor_ts
    # The consumer holds its history: safeGcTs stays at or below its cursor.
    assert hand_out_safe_gc_ts(plane) <= cursor
    maintenance(plane)
    # Resumed by name (from_ts is then its own cursor): the commits after it, once each.
    config = ["--config", str(plane.config_path)]
    assert query_main(["changes", f"{SCHEMA}.orders", "--consumer", "search", *config]) == 0
    out = capsys.readouterr().out
    stamps = sorted({json.loads(line)["commit_ts"] for line in out.splitlines()})
    assert stamps == [p for p in points if p > cursor]
    consumers = {c.name: c for c in plane.trans.stub().ListConsumers(
        tpb.ListConsumersRequest(), timeout=10).consumers}
    assert consumers["search"].cursor_ts >= points[-1]
    check_feed(plane, "orders", cursor, ORDER_COLUMNS)


def follow_into(feed: ChangeFeedReader, first: int, got: list[Commit],
                stop: Callable[[], bool]) -> None:
    """Follow orders from ``first`` until ``stop()``, the commits with changes into ``got``
    (``stop`` runs between two reads: where a test commits, folds or restarts)."""
    for commit in feed.follow(SCHEMA, "orders", first, poll_s=0.01, stop=stop):
        if not commit.heartbeat:
            got.append(commit)


def assert_followed_history(plane: DataPlane, got: list[Commit], first: int,
                            points: list[int]) -> None:
    """The follower got every commit after ``first`` once, in order, each equal to the
    model's history."""
    assert [c.ts for c in got] == points
    changes = feed_changes([(c.ts, c.changes) for c in got], plane.writers["orders"].key,
                           ORDER_COLUMNS)
    assert changes == expected_changes(history(plane, "orders"), first, points[-1],
                                       ORDER_COLUMNS)


@pytest.mark.integration
def test_a_follower_holds_its_history_between_polls_while_fold_rounds_run(
        make_plane: Callable[..., DataPlane], catalog: Catalog) -> None:
    """FOLLOW_HOLDS_ITS_CURSOR: a follower with no registered consumer, on a cluster that
    keeps no history. Between two of its polls (where ``stop`` is asked) two commits come
    and a fold round runs on every node: the transaction of the range just read holds the
    cursor's history, so the next poll is never refused, and the follower gets every
    commit, equal to the model's history."""
    plane = make_plane(nodes=2, gc_interval_ms=1000)
    assert plane.reader is not None
    feed = plane.reader.change_feed()
    first = step(plane, catalog, 0)
    points: list[int] = []
    folds: list[int] = []
    got: list[Commit] = []

    asked: list[bool] = []

    def between_polls() -> bool:
        asked.append(True)  # the first time, before the first poll: nothing holds yet
        if len(asked) > 1 and len(points) < 6:  # two commits: the horizon could pass it
            n = len(points)
            points.extend([step(plane, catalog, n + 1), step(plane, catalog, n + 2)])
            hand_out_safe_gc_ts(plane)
            folds.append(max(maintenance(plane)))
            return False
        return bool(got) and got[-1].ts >= points[-1]

    follow_into(feed, first, got, between_polls)
    assert_followed_history(plane, got, first, points)
    assert max(folds) > first, "the fold rounds moved on behind the follower"


@pytest.mark.integration
def test_a_follower_holds_its_cursor_anew_after_a_transserver_restart(
        make_plane: Callable[..., DataPlane], catalog: Catalog) -> None:
    """The transaction a follower keeps between two reads ends when the TransServer
    restarts; the nodes then refuse it as no longer live. The follower holds its cursor
    anew (an AS OF transaction above it) and goes on: every commit once, in order, equal
    to the model's history, across two restarts."""
    plane = make_plane(nodes=2)
    assert plane.reader is not None
    feed = plane.reader.change_feed()
    first = step(plane, catalog, 0)
    points: list[int] = []
    got: list[Commit] = []
    asked: list[bool] = []

    def between_polls() -> bool:
        asked.append(True)  # the first time, before the first read: nothing is held yet
        if len(asked) > 1 and len(points) < 2:
            plane.trans.kill9()
            plane.trans.start()
            plane.trans.reconnect()
            eventually(lambda: plane.reader is not None and plane.reader.trans.GetHighWatermark(
                tpb.GetHighWatermarkRequest(), timeout=5), 30, "the follower's channel")
            points.append(step(plane, catalog, len(points) + 1))
            return False
        return len(points) == 2 and bool(got) and got[-1].ts >= points[-1]

    follow_into(feed, first, got, between_polls)
    assert_followed_history(plane, got, first, points)


@pytest.mark.integration
def test_after_node_kills_the_feed_is_exact_or_refuses_the_rebuilt_range(
        make_plane: Callable[..., DataPlane], catalog: Catalog) -> None:
    """Two node SIGKILLs in a row (the second without a checkpoint since READY): below the
    history a recovery rebuilt, the feed gives exactly what it gave before the kills;
    a range reaching into it is refused changes_expired naming where the feed answers
    again (HISTORY_REBUILT_IS_REFUSED), never answered differently; above it, exact."""
    plane = make_plane(nodes=2)
    node = plane.nodes[0]
    points = [step(plane, catalog, n) for n in range(2)]
    cursor = points[0]
    plane.checkpoint(node)
    points += [step(plane, catalog, n) for n in range(2, 4)]  # replayed after the kill
    before = {c.ts: c.changes.to_pylist() for c in read_feed(plane, "orders", cursor)}
    assert sorted(before) == points[1:]
    for n in (4, 5):
        plane.retinas[node].kill9()  # the second time without a checkpoint since READY
        plane.retinas[node].start()
        plane.recover(node)
        points.append(step(plane, catalog, n))
    rebuilt = _rebuilt(plane, node)
    lowest = min(lo for lo, hi in rebuilt if hi > cursor + 1)
    # Below the rebuilt range: the same commits as before the kills.
    if lowest - 1 > cursor:
        below = read_feed(plane, "orders", cursor, to_ts=lowest - 1)
        assert {c.ts: c.changes.to_pylist() for c in below} == \
            {t: v for t, v in before.items() if t < lowest}
    # Into it: refused, naming the earliest cursor answered again.
    with pytest.raises(ChangesExpired) as refused:
        read_feed(plane, "orders", cursor)
    assert "HISTORY_REBUILT_IS_REFUSED" in str(refused.value)
    earliest = refused.value.earliest
    assert any(hi == earliest for _lo, hi in rebuilt)
    # From there on: exact, the later commits included.
    commits = check_feed(plane, "orders", earliest, ORDER_COLUMNS)
    assert [c.ts for c in commits][-1:] == points[-1:]


def _rebuilt(plane: DataPlane, node: str) -> list[tuple[int, int]]:
    return [(r.from_ts, r.to_ts) for r in plane.status(node).rebuilt_history]


@pytest.mark.integration
def test_after_a_restart_the_feed_reads_the_streams_no_write_reached_yet(
        make_plane: Callable[..., DataPlane], catalog: Catalog) -> None:
    """A stream's write buffer is created by its first write, so after a restart a virtual
    node no write reached yet has none; its published files are its history all the
    same: the feed reads them (EVERY_VNODE_IS_READ), the same commits as before the
    restart, two restarts in a row, and then after new writes too."""
    plane = make_plane(nodes=2)
    node = plane.nodes[0]
    points = [step(plane, catalog, n) for n in range(4)]
    cursor = points[0]
    # Then commits of the other table only: the replay after the kills writes no order.
    for n in range(4, 7):
        _events_only(plane, catalog, n)
    before = {c.ts: c.changes.to_pylist()
              for c in check_feed(plane, "orders", cursor, ORDER_COLUMNS)}
    assert sorted(before) == points[1:]
    plane.checkpoint(node)
    for _restart in range(2):
        plane.retinas[node].kill9()
        plane.retinas[node].start()
        plane.recover(node)
        lowest = min(lo for lo, hi in _rebuilt(plane, node) if hi > cursor + 1)
        assert lowest > points[-1]  # every order commit below the history replayed
        again = read_feed(plane, "orders", cursor, to_ts=lowest - 1)
        assert {c.ts: c.changes.to_pylist() for c in again} == before
    points.append(step(plane, catalog, 7))
    earliest = max(hi for _lo, hi in _rebuilt(plane, node))
    assert [c.ts for c in check_feed(plane, "orders", earliest, ORDER_COLUMNS)] == points[-1:]


def _events_only(plane: DataPlane, catalog: Catalog, n: int) -> int:
    ts, _ = plane.commit({"events": {"replaces": [
        {"tenant": n % 2, "seq": n, "payload": b"e", "ok": True}]}})
    published(plane, catalog)
    return ts
