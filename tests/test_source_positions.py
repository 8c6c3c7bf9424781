"""Source positions (issue 28): the store, UpdateRecord's rules for them, the requests the
writers build from a changelog, and their pruning. Pure logic on a real LMDB and a real
changelog directory; the end-to-end tests are in test_source_positions_cdc.py."""

from __future__ import annotations

import threading
from pathlib import Path

import grpc
import pytest

from retina_common.catalog.model import ColumnRecord, TableRecord
from retina_common.changelog import (
    DELETE,
    REPLACE,
    Changelog,
    ChangeRow,
    LoggedTransaction,
    transaction_positions,
)
from retina_common.changelog_replay import (
    ReplayLog,
    merged_replay_requests,
    replay_requests,
    requests,
)
from retina_common.client import TableWriter
from retina_common.pb import retina_pb2 as pb
from retina_common.refusal import Refusal
from retina_common.topology import Topology
from retina_server.primary_index import PrimaryIndex
from retina_server.source_positions import (
    MAX_POSITION_BYTES,
    SourcePosition,
    SourcePositions,
)
from retina_server.update_record import prepare

from .test_gc_scheduler import bare_node, scheduler


def store(path: Path) -> tuple[PrimaryIndex, SourcePositions]:
    index = PrimaryIndex(path)
    return index, SourcePositions(index)


# --- the store -----------------------------------------------------------------------------
def test_positions_are_stored_read_back_and_survive_a_reopen(tmp_path: Path) -> None:
    index, positions = store(tmp_path / "p.lmdb")
    positions.put("cdc-a", {10: "0/16B3748", 12: "0/16B37F0"})
    positions.put("app", {11: "app:7"})
    positions.put("app", {})  # nothing to store
    assert positions.positions([12, 10, 11, 13, 10]) == {10: "0/16B3748", 11: "app:7",
                                                         12: "0/16B37F0"}
    assert positions.sources([11]) == {11: SourcePosition("app", "app:7")}
    positions.put("cdc-a", {10: "0/16B3748"})  # a replay puts the same value back
    assert positions.count() == 3
    index.close()
    index, positions = store(tmp_path / "p.lmdb")
    assert positions.sources([10, 11, 12]) == {10: SourcePosition("cdc-a", "0/16B3748"),
                                               11: SourcePosition("app", "app:7"),
                                               12: SourcePosition("cdc-a", "0/16B37F0")}
    assert positions.positions([]) == {}


def test_a_position_commits_with_the_batch_or_not_at_all(tmp_path: Path) -> None:
    index, positions = store(tmp_path / "p.lmdb")
    seen_outside: list[dict[int, str]] = []
    with index.write_batch():
        positions.put("w", {5: "lsn-5"})
        index.put_primary_entries_only(1, [b"k"], [0], 5, keep_previous=False)
        assert positions.positions([5]) == {5: "lsn-5"}  # the batch sees its own writes
        reader = threading.Thread(target=lambda: seen_outside.append(positions.positions([5])))
        reader.start()
        reader.join()
    assert seen_outside == [{}]  # another thread: not before the commit
    assert positions.positions([5]) == {5: "lsn-5"}
    with pytest.raises(RuntimeError), index.write_batch():
        positions.put("w", {6: "lsn-6"})
        index.put_primary_entries_only(1, [b"k"], [1], 6, keep_previous=False)
        raise RuntimeError("the request failed before its commit")
    assert positions.positions([5, 6]) == {5: "lsn-5"}
    assert [v[2] for v in index.versions()] == [5]  # the version went with it too


def test_readers_on_many_threads_see_whole_requests(tmp_path: Path) -> None:
    index, positions = store(tmp_path / "p.lmdb")
    stop = threading.Event()
    torn: list[dict[int, str]] = []

    def read() -> None:
        while not stop.is_set():
            got = positions.positions(list(range(1, 201)))
            # A request puts two timestamps at once: a reader sees both or neither.
            if any(ts + 1 not in got for ts in got if ts % 2):
                torn.append(got)

    readers = [threading.Thread(target=read) for _ in range(3)]
    for t in readers:
        t.start()
    for ts in range(1, 200, 2):
        with index.write_batch():
            positions.put("w", {ts: f"p{ts}", ts + 1: f"p{ts + 1}"})
    stop.set()
    for t in readers:
        t.join()
    assert torn == []
    assert positions.positions(list(range(1, 201))) == {ts: f"p{ts}" for ts in range(1, 201)}


def test_a_prune_drops_the_positions_below_its_horizon_with_it(tmp_path: Path) -> None:
    index, positions = store(tmp_path / "p.lmdb")
    for ts in range(1, 11):
        with index.write_batch():
            index.put_primary_entries_only(1, [b"a"], [ts], ts, keep_previous=False)
            positions.put("w", {ts: f"p{ts}"})
    index.prune_versions(4, 0, below_horizon=positions.drop_below)
    assert sorted(positions.positions(range(1, 11))) == list(range(4, 11))
    # The horizon does not move: nothing is recorded, nothing dropped.
    index.prune_versions(4, 0, below_horizon=positions.drop_below)
    assert positions.count() == 7
    index.prune_versions(8, 4, below_horizon=positions.drop_below)
    assert positions.positions(range(1, 11)) == {ts: f"p{ts}" for ts in (8, 9, 10)}
    index.prune_versions(100, 8, below_horizon=positions.drop_below)
    assert positions.count() == 0
    index.close()
    index, positions = store(tmp_path / "p.lmdb")
    assert positions.count() == 0 and index.pruned_below == 100


def test_a_prune_whose_horizon_transaction_fails_records_and_drops_nothing(
        tmp_path: Path) -> None:
    index, positions = store(tmp_path / "p.lmdb")
    positions.put("w", {ts: f"p{ts}" for ts in range(1, 6)})

    def failing(txn: object, horizon: int) -> None:
        positions.drop_below(txn, horizon)  # type: ignore[arg-type]
        raise OSError("the disk went away mid-transaction")

    with pytest.raises(OSError):
        index.prune_versions(4, 0, below_horizon=failing)
    assert positions.count() == 5 and index.pruned_below == 0  # one transaction: neither
    index.prune_versions(4, 0, below_horizon=positions.drop_below)
    assert sorted(positions.positions(range(1, 6))) == [4, 5] and index.pruned_below == 4


def test_a_gc_round_prunes_the_node_s_positions_below_its_horizon(tmp_path: Path) -> None:
    node = bare_node(tmp_path)
    for ts in range(1, 11):
        with node.index.primary.write_batch():
            node.index.primary.put_primary_entries_only(1, [b"a"], [ts], ts)
            node.source_positions.put("w", {ts: f"p{ts}"})
    result = scheduler(node, lambda: 9, replay=6).run_once()
    assert result.prune_horizon_ts == 6
    assert sorted(node.source_positions.positions(range(1, 11))) == [6, 7, 8, 9, 10]


# --- UpdateRecord's rules (validation: nothing is read or written) ---------------------------
def update(ts: int, position: str, table: str = "orders", vnode: int = 0) -> pb.TableUpdateData:
    return pb.TableUpdateData(table_name=table, primary_index_id=1, timestamp=ts,
                              virtual_node_id=vnode, source_position=position)


@pytest.mark.parametrize(("parts", "message"), [
    ([update(5, "x" * (MAX_POSITION_BYTES + 1))], "limit is 4096"),
    ([update(5, "é" * 2049)], "source_position of 4098 bytes"),  # bytes, not characters
    ([update(5, "a"), update(5, "b", vnode=1)], "differs from 'a'"),
    ([update(5, "a"), update(6, "b"), update(5, "", table="events")], "differs from 'a'"),
])
def test_a_bad_position_is_refused_before_anything_is_read(
        tmp_path: Path, parts: list[pb.TableUpdateData], message: str) -> None:
    node = bare_node(tmp_path)  # no catalog: a refusal here happens before any lookup
    request = pb.UpdateRecordRequest(schema_name="shop", table_update_data=parts)
    with pytest.raises(Refusal) as refused:
        prepare(node, request, 1000)
    assert refused.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert message in str(refused.value)
    assert node.source_positions.count() == 0


# --- the requests writers build from a changelog ----------------------------------------------
TABLE = TableRecord(1, 1, "shop", "orders", 1, (
    ColumnRecord(0, "id", "int64", 0, 0), ColumnRecord(1, "note", "string", 1, None)))


WRITER = TableWriter(TABLE, Topology(("127.0.0.1:1",), 2))


def row(ts: int, seq: int, vnode: int, n: int, op: int = REPLACE) -> ChangeRow:
    """A change of key ``n`` (``vnode``: where the changelog files it; requests follow it)."""
    values = {"id": n, "note": f"n{n}"}
    return ChangeRow(ts, seq, vnode, "orders", op, WRITER.key(values),
                     None if op == DELETE else WRITER.values(values))


def positions_of(reqs: list[pb.UpdateRecordRequest]) -> set[tuple[int, int, str, bool]]:
    """(ts, vnode, position, columnar) of every TableUpdateData."""
    return {(t.timestamp, t.virtual_node_id, t.source_position, bool(t.insert_rows_arrow))
            for r in reqs for t in r.table_update_data}


@pytest.mark.parametrize("min_columnar_rows", [1, 10_000])
def test_every_update_of_a_transaction_carries_its_position_in_both_forms(
        min_columnar_rows: int) -> None:
    rows = [row(7, 0, 0, 1), row(7, 1, 1, 2), row(7, 2, 1, 3, DELETE), row(9, 0, 0, 4),
            row(11, 0, 1, 5)]
    reqs = list(requests("shop", {"orders": TABLE}, rows, 3, min_columnar_rows,
                         writer_id="cdc", positions={7: "lsn7", 9: "lsn9"}))
    assert len(reqs) > 1  # cut at 3 items: a transaction's updates span requests
    columnar = min_columnar_rows == 1
    assert positions_of(reqs) == {(7, 0, "lsn7", columnar), (7, 1, "lsn7", columnar),
                                  (9, 0, "lsn9", columnar), (11, 1, "", columnar)}
    assert {r.writer_id for r in reqs} == {"cdc"}


def logged(ts: int, rows: list[ChangeRow]) -> LoggedTransaction:
    return LoggedTransaction(ts, f"0/{ts:X}", f"x{ts}", 0, rows)


def test_a_replay_carries_the_positions_of_the_changelog_records(tmp_path: Path) -> None:
    log = Changelog(str(tmp_path / "cdc"))
    first = log.append([logged(10, [row(10, 0, 0, 1)]), logged(11, [row(11, 0, 1, 2)])])
    log.append([logged(20, [row(20, 0, 0, 3), row(20, 1, 1, 4)])])
    assert transaction_positions([first]) == {10: "0/A", 11: "0/B"}
    context = pb.RecoveryReplayContext(checkpoint_id=1)
    reqs = list(replay_requests(log, "shop", {"orders": TABLE}, {0: 11, 1: 0}, context, 100,
                                writer_id="cdc"))
    assert positions_of(reqs) == {(11, 1, "0/B", False), (20, 0, "0/14", False),
                                  (20, 1, "0/14", False)}
    assert {r.writer_id for r in reqs} == {"cdc"}
    assert all(r.HasField("recovery_replay_context") for r in reqs)


def test_a_merged_replay_gives_each_writer_s_transactions_their_own_positions(
        tmp_path: Path) -> None:
    cdc, app = Changelog(str(tmp_path / "cdc")), Changelog(str(tmp_path / "app"))
    cdc.append([logged(10, [row(10, 0, 0, 1)]), logged(30, [row(30, 0, 0, 2)])])
    app.append([LoggedTransaction(20, "app:4", "4", 0, [row(20, 0, 0, 3)])])
    logs = [ReplayLog("cdc", "shop", cdc, {"orders": TABLE}),
            ReplayLog("app", "shop", app, {"orders": TABLE})]
    reqs = list(merged_replay_requests(logs, {0: 0}, pb.RecoveryReplayContext(), 100))
    assert [(r.writer_id, [(t.timestamp, t.source_position) for t in r.table_update_data])
            for r in reqs] == [("cdc", [(10, "0/A")]), ("app", [(20, "app:4")]),
                               ("cdc", [(30, "0/1E")])]
