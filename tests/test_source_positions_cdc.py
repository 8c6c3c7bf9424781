"""Source positions end to end (issue 28): a real source PostgreSQL, a real ``retina-cdc``,
a TransServer and two Retina nodes. The oracle is the connector's durable changelog: every
timestamp a node holds a change at must have exactly the position the changelog records
for it, whether the change arrived live or through a replay after a SIGKILL, and a fold
round drops the positions below its prune horizon. Each node's store is read from its
LMDB environment (LMDB takes readers from other processes), as the change feed reads it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import grpc
import pytest

from retina_common.change_reader import ChangesExpired
from retina_common.changelog import Changelog, transaction_positions
from retina_common.client import requests_by_node
from retina_common.pb import retina_pb2 as rpb
from retina_common.pb import trans_pb2 as tpb
from retina_server.primary_index import PrimaryIndex
from retina_server.source_positions import SourcePosition, SourcePositions

from .cdc import CdcPlane
from .dataplane import SCHEMA, DataPlane
from .support import begin_write, eventually, rpc_error
from .test_cdc_connector import make_cdc  # noqa: F401  (a fixture)
from .test_recovery_protocol import order

pytestmark = pytest.mark.integration

QUIET = {"checkpoint_interval_ms": 3_600_000, "gc_interval_ms": 3_600_000}


@contextmanager
def node_store(plane: DataPlane, node: str) -> Iterator[tuple[PrimaryIndex, SourcePositions]]:
    """The node's primary index and source positions, opened beside the node's process."""
    host, port = node.rsplit(":", 1)
    index = PrimaryIndex(plane.workdir / "state" / f"{host}-{port}" / "index" / "primary.lmdb")
    try:
        yield index, SourcePositions(index)
    finally:
        index.close()


def changelog_positions(cdc: CdcPlane) -> dict[str, dict[int, SourcePosition]]:
    """Per node: ts -> (the connector, the position its changelog records) of every
    transaction with a row in one of the node's virtual nodes."""
    plane = cdc.plane
    log = Changelog(cdc.cdc.settings["changelog_root"])
    records = log.records()
    positions = transaction_positions(records)
    writer = cdc.cdc.settings["name"]
    out: dict[str, dict[int, SourcePosition]] = {n: {} for n in plane.nodes}
    every_vnode = dict.fromkeys(range(plane.topology.virtual_nodes), 0)
    for row in log.read(every_vnode, records=records):
        out[plane.topology.node_of_vnode(row.vnode)][row.ts] = SourcePosition(
            writer, positions[row.ts])
    return out


def assert_positions_match_the_changelog(cdc: CdcPlane, above: int = 0) -> dict[str, int]:
    """Every timestamp at or above ``above`` that a node holds an index version at has
    its changelog position; nothing else is stored but changelog positions of the node's
    transactions at or above ``above``. Returns each node's count of positions."""
    expected = changelog_positions(cdc)
    counts = {}
    for node in cdc.plane.nodes:
        with node_store(cdc.plane, node) as (index, positions):
            applied = {ts for _t, _k, ts, _r in index.versions() if ts >= above}
            stored = positions.sources(sorted(set(expected[node]) | applied))
            counts[node] = positions.count()
        # Above a prune horizon a node may hold nothing: the later commits' rows can all
        # live on the other node.
        assert applied or above, f"{node} holds no change"
        assert applied <= set(stored), f"{node}: changes without a position at " \
                                       f"{sorted(applied - set(stored))[:5]}"
        assert stored == {ts: expected[node][ts] for ts in stored}, f"{node}: wrong positions"
        assert counts[node] == len(stored), f"{node} holds positions the changelog lacks"
        assert all(ts >= above for ts in stored)
    return counts


def assert_the_feed_gives_the_changelog_positions(cdc: CdcPlane) -> int:
    """ReadChanges gives every change the position its commit's changelog record holds,
    from the earliest cursor the feed serves (a restarted node refuses the history its
    replay rebuilt). Returns the commits read."""
    assert cdc.plane.reader is not None
    feed = cdc.plane.reader.change_feed()
    log = Changelog(cdc.cdc.settings["changelog_root"])
    positions = transaction_positions(log.records())
    read = 0
    for table in cdc.plane.tables:
        try:
            commits = list(feed.read(SCHEMA, table, 0))
        except ChangesExpired as expired:
            commits = list(feed.read(SCHEMA, table, expired.earliest))
        for commit in commits:
            got = set(commit.changes.column("_source_position").to_pylist())
            assert got == {positions[commit.ts]}, (table, commit.ts, got)
        read += len(commits)
    return read


def kill_while_the_connector_sends(cdc: CdcPlane, victim: str) -> None:
    """SIGKILL ``victim``; commit in the source until the connector has a batch for it
    that it cannot send (logged: its part reaches the node only through the replay);
    restart it for the connector to replay."""
    proc = cdc.plane.retinas[victim]
    assert cdc.source is not None
    proc.kill9()
    before = len(cdc.cdc.logged("cdc_node_unavailable"))

    def stuck() -> bool:
        cdc.source.run(3)
        return len([e for e in cdc.cdc.logged("cdc_node_unavailable")[before:]
                    if e.get("node") == victim]) > 0
    eventually(stuck, 60, f"the connector to wait for {victim}", 0.5)
    proc.start()


def test_cdc_positions_survive_kills_through_the_replay_and_go_with_the_fold(
        make_cdc: Callable[..., CdcPlane]) -> None:  # noqa: F811  (the fixture imported above)
    cdc = make_cdc(retina=QUIET)
    assert cdc.source is not None
    cdc.cdc.start()
    eventually(cdc.all_ready, 60, "the connector to drive both nodes to READY")
    cdc.source.run(20)
    cdc.converged()
    assert_positions_match_the_changelog(cdc)
    assert assert_the_feed_gives_the_changelog_positions(cdc) >= 20

    # Two SIGKILLs in a row, each with commits the victim gets only from the replay.
    victim = cdc.plane.nodes[1]
    for n in (1, 2):
        kill_while_the_connector_sends(cdc, victim)
        cdc.converged(timeout_s=90)
        eventually(cdc.all_ready, 60, "both nodes READY")
        replays = [e for e in cdc.cdc.logged("cdc_replay_done")
                   if e["node"] == victim and e["rows"] > 0]
        assert len(replays) >= n, cdc.cdc.log_tail()
        before = assert_positions_match_the_changelog(cdc)

    cdc.source.run(5)  # live commits after the restarts, for the feed to serve
    cdc.converged()
    assert assert_the_feed_gives_the_changelog_positions(cdc) >= 5

    # A fold round prunes below its horizon: the positions there go with the versions.
    highest = max(ts for p in changelog_positions(cdc).values() for ts in p)
    horizons: dict[str, int] = {}

    def pruned() -> bool:
        cdc.source.run(1)  # safeGcTs passes the earlier commits once a later one commits
        cdc.converged()
        for node in cdc.plane.nodes:
            for _ in range(2):  # the replay floor moves with the two newest checkpoints
                cdc.plane.checkpoint(node)
            done = cdc.plane.retinas[node].stub.RunGcMaintenance(
                rpb.RunGcMaintenanceRequest(), timeout=60)
            horizons[node] = done.prune_horizon_ts
        return min(horizons.values()) > highest
    eventually(pruned, 90, "a prune horizon above the positions written so far", 1)
    after = assert_positions_match_the_changelog(cdc, above=min(horizons.values()))
    assert all(after[n] < before[n] for n in cdc.plane.nodes), (before, after)
    for node in cdc.plane.nodes:
        with node_store(cdc.plane, node) as (_index, positions):
            assert positions.positions(range(1, horizons[node])) == {}


def test_malformed_positions_are_refused_and_store_nothing(
        make_plane: Callable[..., DataPlane]) -> None:
    plane = make_plane(nodes=1, **QUIET)
    node = plane.nodes[0]
    stub = plane.retinas[node].stub
    trans_stub = plane.trans.stub()
    trans = begin_write(trans_stub)
    ts = trans.timestamp

    def request(*positions: str) -> rpb.UpdateRecordRequest:
        """Orders and events at ``ts``: one TableUpdateData per virtual node and table,
        the i-th of them with positions[i % len(positions)]."""
        parts = [plane.writers["orders"].updates(ts, replaces=[order(i) for i in range(6)]),
                 plane.writers["events"].updates(ts, replaces=[
                     {"tenant": 1, "seq": i, "payload": b"p", "ok": True} for i in range(6)])]
        built = requests_by_node(SCHEMA, parts)[node]
        for i, tud in enumerate(built.table_update_data):
            tud.source_position = positions[i % len(positions)]
        return built

    for bad in (request("x" * 4097), request("0/A", "0/B"), request("0/A", "")):
        assert len(bad.table_update_data) > 1
        err = rpc_error(lambda bad=bad: stub.UpdateRecord(bad, timeout=30))
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, err.details()
    with node_store(plane, node) as (index, positions):
        assert positions.count() == 0
        assert index.versions() == []
    good = request("0/16B3748")
    done = stub.UpdateRecord(good, timeout=30)
    assert done.inserted_rows == 12
    trans_stub.CommitTrans(tpb.CommitTransRequest(trans_id=trans.trans_id), timeout=10)
    assert sorted(plane.read("orders")) == sorted(
        plane.writers["orders"].key(order(i)) for i in range(6))
    with node_store(plane, node) as (_index, positions):
        assert positions.sources([ts]) == {ts: SourcePosition("", "0/16B3748")}
        assert positions.count() == 1
    # A refused request leaves a stored position as it was.
    again = begin_write(trans_stub)
    bad = request("y" * 5000)
    for tud in bad.table_update_data:
        tud.timestamp = again.timestamp
    assert rpc_error(lambda: stub.UpdateRecord(bad, timeout=30)).code() == \
        grpc.StatusCode.INVALID_ARGUMENT
    trans_stub.RollbackTrans(tpb.RollbackTransRequest(trans_id=again.trans_id), timeout=10)
    with node_store(plane, node) as (_index, positions):
        assert positions.sources([ts, again.timestamp]) == {
            ts: SourcePosition("", "0/16B3748")}
