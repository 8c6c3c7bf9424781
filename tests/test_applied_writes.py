"""The applied-writes log and the replay rule over it (applied_writes.py,
recovery/replay_admission.py APPLIED_OR_LIVE), as logic over a real LMDB environment:
committed with the request's index transaction or not at all, durable across a reopen
and a rewind, pruned with the index's horizon, and read by the replay admission, which
asks the TransServer only about the timestamps the log does not hold."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from retina_common.replay_ts import ReplayStarts
from retina_server.applied_writes import AppliedWrites
from retina_server.index import LocalIndexService
from retina_server.recovery.replay_admission import UNAPPLIED_SKIPPED, to_apply
from retina_server.refused_writes import RefusedWrites
from retina_server.update_record import PreparedUpdate

from .test_gc_scheduler import bare_node, scheduler

ORDERS = SimpleNamespace(table_id=7, name="orders")
EVENTS = SimpleNamespace(table_id=8, name="events")


def update(ts: int, vnode: int = 0, table: SimpleNamespace = ORDERS) -> PreparedUpdate:
    return PreparedUpdate(table, vnode, ts, [b"k%d" % ts], [], [])  # type: ignore[arg-type]


def test_records_commit_with_the_batch_or_not_at_all_and_survive_reopen_and_rewind(
        tmp_path: Path) -> None:
    index = LocalIndexService(tmp_path / "index")
    applied = AppliedWrites(index.primary)
    with index.primary.write_batch():
        index.primary.tombstone_primary_resolved(7, [b"a"], 10)
        applied.record([(7, 0, 10), (8, 3, 10), (7, 0, 10)])
    with pytest.raises(RuntimeError), index.primary.write_batch():
        applied.record([(7, 0, 11)])
        raise RuntimeError("the request failed before its commit")
    parts = [(7, 0, 10), (8, 3, 10), (7, 0, 11), (7, 1, 10), (8, 0, 10)]
    assert applied.applied_among(parts) == {(7, 0, 10), (8, 3, 10)}
    # Cleansing's rewind drops versions, never the records: they say what happened.
    index.primary.truncate_versions(0, lambda _t, _k: 0)
    index.close()
    index = LocalIndexService(tmp_path / "index")
    assert AppliedWrites(index.primary).applied_among(parts) == {(7, 0, 10), (8, 3, 10)}
    assert AppliedWrites(index.primary).count() == 2
    index.close()


def test_a_gc_round_drops_the_records_below_its_prune_horizon(tmp_path: Path) -> None:
    node = bare_node(tmp_path)
    for ts in range(1, 11):
        with node.index.primary.write_batch():
            node.index.primary.put_primary_entries_only(1, [b"a"], [ts], ts)
            node.applied.record([(1, 0, ts), (1, 2, ts)])
    result = scheduler(node, lambda: 9, replay=6).run_once()
    assert result.prune_horizon_ts == 6
    kept = node.applied.applied_among((1, v, ts) for v in (0, 2) for ts in range(1, 11))
    assert sorted({ts for _t, _v, ts in kept}) == [6, 7, 8, 9, 10]
    assert node.applied.count() == 10


def test_the_replay_applies_what_was_applied_or_is_live_and_skips_the_rest(
        tmp_path: Path) -> None:
    """APPLIED_OR_LIVE: 50 applied here for (orders, 0) only; 51 given up before it came
    here; 52 still being written; 53 applied for events. Per stream part, not per ts."""
    index = LocalIndexService(tmp_path / "index")
    applied = AppliedWrites(index.primary)
    applied.record([(7, 0, 50), (8, 0, 53)])
    asked: list[int] = []

    def live(ts: int) -> bool:
        asked.append(ts)
        return ts == 52

    updates = [update(50), update(50, vnode=1), update(51), update(52), update(52, vnode=1),
               update(53, table=EVENTS), update(53)]
    before = UNAPPLIED_SKIPPED._value.get()
    admitted = to_apply(updates, ReplayStarts(50, (), {}, 50), "NODE",
                        RefusedWrites(index.primary), applied, live)
    assert [(u.table.table_id, u.vnode, u.ts) for u in admitted.apply] == [
        (7, 0, 50), (7, 0, 52), (7, 1, 52), (8, 0, 53)]
    assert admitted.inexact_from is None  # every part applied exactly
    assert UNAPPLIED_SKIPPED._value.get() == before + 3  # (7,1,50), (7,0,51), (7,0,53)
    assert sorted(asked) == [50, 51, 52, 53]  # once per timestamp, only for unlogged parts
    asked.clear()
    to_apply([update(50)], ReplayStarts(50, (), {}, 50), "NODE",
             RefusedWrites(index.primary), applied, live)
    assert asked == []  # a logged part needs no question
    index.close()
