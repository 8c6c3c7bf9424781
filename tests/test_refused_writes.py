"""The write fence's refusal records and the replay that skips them (refused_writes.py,
recovery/replay_admission.py), as logic over a real LMDB environment: durable across a
reopen and a rewind, partial when a part of the transaction was applied, pruned below the
replay floor, and skipped (only when whole) by the replay admission."""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import pytest

from retina_common.failpoints import FailpointTriggered
from retina_common.replay_ts import ReplayStarts
from retina_server.gc.gc_scheduler import GcScheduler, ReplayFloor
from retina_server.index import LocalIndexService
from retina_server.recovery.replay_admission import REFUSED_SKIPPED, to_apply
from retina_server.refused_writes import RefusedWrites
from retina_server.update_record import PreparedUpdate, _record_refusal
from retina_server.write_fence import Fenced

from .test_gc_scheduler import bare_node

TABLE = SimpleNamespace(table_id=7, name="orders")


def update(ts: int, vnode: int = 0) -> PreparedUpdate:
    return PreparedUpdate(TABLE, vnode, ts, [b"k%d" % ts], [], [])  # type: ignore[arg-type]


def starts(node_start: int) -> ReplayStarts:
    return ReplayStarts(node_start, (), {}, node_start)


def test_records_are_durable_and_survive_a_rewind_and_a_reopen(tmp_path: Path) -> None:
    index = LocalIndexService(tmp_path / "index")
    refused = RefusedWrites(index.primary)
    refused.record("app", [30, 31])
    assert refused.skips(30) == "app" and refused.skips(31) == "app"
    assert refused.skips(29) is None
    # Cleansing's rewind drops versions, never the records: they say what happened.
    index.primary.truncate_versions(0, lambda _t, _k: 0)
    index.close()
    index = LocalIndexService(tmp_path / "index")
    assert RefusedWrites(index.primary).records() == {30: (False, "app"), 31: (False, "app")}
    index.close()


def test_a_refusal_after_a_part_of_the_transaction_was_applied_is_partial_and_replayed(
        tmp_path: Path) -> None:
    index = LocalIndexService(tmp_path / "index")
    index.primary.tombstone_primary_resolved(7, [b"a"], 40)  # an earlier request of ts 40
    refused = RefusedWrites(index.primary)
    refused.record("app", [40, 41])
    assert refused.records() == {40: (True, "app"), 41: (False, "app")}
    assert refused.skips(40) is None  # SKIP_ONLY_WHAT_CHANGED_NOTHING
    assert refused.skips(41) == "app"
    index.close()


def test_the_replay_skips_whole_refusals_only_and_counts_them(tmp_path: Path) -> None:
    index = LocalIndexService(tmp_path / "index")
    index.primary.tombstone_primary_resolved(7, [b"a"], 52)
    refused = RefusedWrites(index.primary)
    refused.record("app", [51])
    refused.record("app", [52])  # partial
    before = REFUSED_SKIPPED._value.get()
    applied = to_apply([update(50), update(51), update(52), update(53)], starts(50), "NODE",
                       refused)
    assert [u.ts for u in applied] == [50, 52, 53]
    assert REFUSED_SKIPPED._value.get() == before + 1
    index.close()


def test_records_below_the_replay_floor_are_pruned(tmp_path: Path) -> None:
    index = LocalIndexService(tmp_path / "index")
    refused = RefusedWrites(index.primary)
    refused.record("a", [10, 20])
    refused.record("b", [30])
    assert refused.prune_below(5) == 0
    assert refused.prune_below(21) == 2
    assert refused.records() == {30: (False, "b")}
    index.close()
    index = LocalIndexService(tmp_path / "index")
    assert RefusedWrites(index.primary).records() == {30: (False, "b")}
    index.close()


@pytest.mark.parametrize("point, recorded", [("refused_writes.record.before", {}),
                                             ("refused_writes.record.after",
                                              {60: (False, "app")})])
def test_a_failure_around_the_record_leaves_all_of_it_or_nothing(
        tmp_path: Path, active_failpoints: Callable[[str], None], point: str,
        recorded: dict[int, tuple[bool, str]]) -> None:
    index = LocalIndexService(tmp_path / "index")
    refused = RefusedWrites(index.primary)
    active_failpoints(f"{point}=raise")
    with pytest.raises(FailpointTriggered):
        refused.record("app", [60])
    index.close()
    index = LocalIndexService(tmp_path / "index")
    assert RefusedWrites(index.primary).records() == recorded
    index.close()


def test_a_gc_round_prunes_the_records_below_the_replay_floor_only(tmp_path: Path) -> None:
    """The replay floor, not safeGcTs or a pinned cutoff: a record is needed exactly as long
    as a replay may start at or below it."""
    node = bare_node(tmp_path)
    node.refused.record("app", [3, 6, 9])
    floor = ReplayFloor()
    sched = GcScheduler(node, lambda: 2, lambda: 1, floor.floor, 3600, threading.Event())
    floor.observe(1, 7)
    sched.run_once()  # one checkpoint observed: the floor is 0
    assert sorted(node.refused.records()) == [3, 6, 9]
    floor.observe(2, 8)
    sched.run_once()
    assert sorted(node.refused.records()) == [9]


def test_a_refused_request_records_only_its_timestamps_at_or_below_the_floor(
        tmp_path: Path) -> None:
    """A CDC request spans several transactions: the fence refuses it whole when its lowest
    timestamp is at or below the floor, but one above the floor may still be admitted
    later, so only the ones at or below it are recorded (then never applied here)."""
    node = bare_node(tmp_path)
    node.fence.raise_to(10, "a read at 10")
    with pytest.raises(Fenced) as refused, node.fence.admit(5):
        pass
    assert refused.value.floor == 10
    _record_refusal(node, [update(5), update(10), update(12)], "cdc", refused.value.floor)
    assert node.refused.records() == {5: (False, "cdc"), 10: (False, "cdc")}
