"""GC_CUTOFF_BELOW_REPLAY_FLOOR (retina_server/gc/rewrites.py): a Storage GC rewrite never
drops a row deleted at or after the lowest replay start a crash-restart could use, so a
replayed partial update finds the row it merges with (docs/write-paths/storage-gc.md,
"The cutoff and the replay floor"). The decision itself, the replay floor it reads, and a
crash after a rewrite whose requested cutoff passed a partial update, on a real node."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import grpc
import pytest

from retina_common.catalog import Catalog, FileType
from retina_common.log import logged_events
from retina_common.refusal import Refusal
from retina_server.gc.gc_scheduler import ReplayFloor, fold_target
from retina_server.gc.rewrites import bounded_cutoff

from . import gc
from .dataplane import DataPlane
from .support import eventually
from .test_gc_scheduler import bare_node, deleted_sets, published_deletes, scheduler
from .test_recovery_protocol import order
from .test_storage_gc import advance

# --- the decision --------------------------------------------------------------------------


def test_the_cutoff_is_the_requested_one_below_the_replay_floor() -> None:
    assert bounded_cutoff(100, 500) == 100  # the floor is above: nothing to lower
    assert bounded_cutoff(100, 101) == 100  # the floor just above the requested cutoff
    assert bounded_cutoff(100, 100) == 99  # a row deleted at the floor stays
    assert bounded_cutoff(100, 40) == 39
    assert bounded_cutoff(100, 40, visibility_base=39) == 39  # at the base: readable


@pytest.mark.parametrize("replay_floor", [0, 1])
def test_no_known_replay_floor_refuses_and_changes_nothing(replay_floor: int) -> None:
    with pytest.raises(Refusal) as info:
        bounded_cutoff(100, replay_floor)
    assert info.value.code == grpc.StatusCode.ABORTED
    assert "GC_CUTOFF_BELOW_REPLAY_FLOOR" in str(info.value)
    assert "nothing changed, take a later run" in str(info.value)
    if replay_floor == 0:
        assert "no replay floor yet" in str(info.value)


def test_a_cutoff_lowered_below_the_visibility_base_is_refused_naming_both() -> None:
    with pytest.raises(Refusal) as info:
        bounded_cutoff(100, 40, visibility_base=60)
    assert info.value.code == grpc.StatusCode.ABORTED
    message = str(info.value)
    assert "cutoff 39 (safeGcTs 100 lowered below the replay floor 40)" in message
    assert "visibility base 60" in message and "take a later run" in message
    with pytest.raises(Refusal) as info:  # not lowered: the base alone
        bounded_cutoff(50, 400, visibility_base=60)
    assert "cutoff 50 is below the visibility base 60" in str(info.value)


# --- the floor, from one slot ----------------------------------------------------------------

def test_a_checkpoint_installed_with_the_other_slot_empty_is_the_floor_alone() -> None:
    floor = ReplayFloor()
    floor.observe(0, 0)  # a first start: no checkpoint loaded, a replay from 0
    assert floor.floor() == 0
    floor.observe(1, 40, only_slot=True)  # the first checkpoint: previous stays empty
    assert floor.floor() == 40
    floor.observe(2, 70)  # the next one moves 1 to previous
    assert floor.floor() == 40
    floor.observe(3, 90)
    assert floor.floor() == 70


def test_without_the_empty_slot_one_checkpoint_leaves_the_floor_unknown() -> None:
    floor = ReplayFloor()
    floor.observe(5, 40)  # loaded: its previous slot may hold a lower start
    assert floor.floor() == 0
    late = ReplayFloor()
    late.observe(1, 40, only_slot=True)
    late.observe(0, 0)  # an older checkpoint seen late counts: lower, never higher
    assert late.floor() == 0


# --- the fold stays where a rewrite can read ------------------------------------------------

def test_the_fold_target_stays_below_a_known_replay_floor() -> None:
    assert fold_target(100, None, 0) == 100  # no floor known: safeGcTs (no rewrite yet)
    assert fold_target(100, None, 500) == 100
    assert fold_target(100, None, 40) == 39  # a rewrite's cutoff can be 39: readable
    assert fold_target(100, 20, 40) == 20  # a pinned cutoff is lower still
    assert fold_target(100, 60, 40) == 39
    assert fold_target(100, None, 1) == 0  # nothing to fold


def test_a_round_folds_below_the_replay_floor_and_prunes_below_it(tmp_path: Path) -> None:
    """Deletes at 5..25, safeGcTs 22, replay floor 16: the fold stops at 15 (a rewrite at
    the cutoff 15 reads every row group at its base), the prune horizon is the floor."""
    node = bare_node(tmp_path)
    published_deletes(node)
    expected = deleted_sets(node, 15, 30)
    sched = scheduler(node, lambda: 22, replay=16)
    result = sched.run_once()
    assert (result.fold_ts, result.folded_items, result.prune_horizon_ts) == (15, 7, 16)
    assert {node.visibility.get(f, rg).base_timestamp
            for f in (10, 11) for rg in (0, 1)} == {15}
    assert sched.fold_fence() == 15  # a prepare at cutoff 15 is not refused for a fold
    assert deleted_sets(node, 15, 30) == expected
    assert bounded_cutoff(22, 16, visibility_base=15) == 15


# --- a crash after a rewrite whose requested cutoff passed a partial update ----------------

@pytest.mark.integration
def test_a_replayed_partial_update_finds_its_base_after_a_rewrite_and_a_kill(
        make_plane: Callable[..., DataPlane], catalog: Catalog) -> None:
    """A partial update at T of a row in a published file F; a rewrite of F asked at
    safeGcTs >= T while the replay floor is below T; a checkpoint that holds the new
    file while the merged row is still in the write buffer (so the restart replays from
    at or below T and keeps the rewrite); SIGKILL, restart, replay. The replayed partial
    update merges with the key's row below T: without the bound, the rewrite dropped it
    (its replace deleted it at T) and the replay was refused (an orphan base)."""
    # Nothing flushed by the timer: a file is published when full (2 blocks of 16 rows),
    # so the merged row stays in the write buffer and the replay starts at or below it.
    plane = make_plane(flush_interval_ms=3_600_000, checkpoint_interval_ms=3_600_000,
                       gc_interval_ms=3_600_000)
    node = plane.nodes[0]
    writer = plane.writers["orders"]
    vnode = plane.topology.vnode_of_key(writer.key({"id": 0}))
    ids = [i for i in range(2000)
           if plane.topology.vnode_of_key(writer.key({"id": i})) == vnode][:32]

    plane.commit({"orders": {"replaces": [order(i, note="first") for i in ids]}})
    path = catalog.get_paths(plane.tables["orders"].table_id)[0]
    published = eventually(lambda: catalog.get_regular_files(path.path_id), 30,
                           "the full orders file to be published")
    assert len(published) == 1 and published[0].num_row_group == 2
    deleted_ts, _ = plane.commit({"orders": {"deletes": [{"id": i} for i in ids[:4]]}})
    advance(plane)
    advance(plane)
    # Checkpoints after the deletes until both slots start above them (the floor).
    gc.raise_replay_floor(plane, above=deleted_ts)
    key = ids[10]
    before = dict(plane.model.rows["orders"][writer.key({"id": key})])
    t, _ = plane.commit({"orders": {"partials": [{"id": key, "note": "merged"}]}})
    advance(plane)  # safeGcTs passes T

    prepared = gc.prepare(plane, node, "orders", vnode, published, raise_floor=False)
    try:
        reply = gc.commit(plane, prepared, gc.write_new_file(plane, prepared))
    finally:
        gc.end(plane, prepared.trans_id)
    assert reply.outcome == "COMMITTED"
    assert plane.read("orders") == plane.model.rows["orders"]
    # The current slot holds the new file: the restart keeps the rewrite. The merged row
    # is still buffered: the replay starts at or below T and replays the partial update.
    plane.checkpoint(node)
    assert [f.file_id for f in catalog.get_regular_files(path.path_id)] == [reply.new_file_id]
    assert catalog.get_files_by_type(path.path_id, [FileType.TEMPORARY_INGEST])

    plane.retinas[node].kill9()
    plane.retinas[node].start()
    # Without GC_CUTOFF_BELOW_REPLAY_FLOOR the replay is refused here, FAILED_PRECONDITION:
    # the key's version below T points at a row the rewrite dropped (an orphan).
    starts = plane.recover(node)
    assert starts is not None and starts.vnode_replay_from_ts[vnode] <= t, (starts, t)
    assert {e.rewrite_id: e.new_file_id for e in gc.journal(plane, node).values()} == \
        {reply.rewrite_id: reply.new_file_id}
    rows = plane.read("orders")
    assert rows == plane.model.rows["orders"]  # no row lost, none twice
    merged = rows[writer.key({"id": key})]
    assert merged == {**before, "note": "merged"}  # the columns outside the targets kept
    assert len(rows) == len(ids) - 4

    # The cutoff the job was given (and read visibility at) was below the replay floor,
    # which was below T, although the job asked for a safeGcTs at or above T.
    events = [e for e in logged_events(plane.retinas[node].log_path, "gc_rewrite_prepared")
              if e["rewrite_id"] == prepared.reply.rewrite_id]
    assert len(events) == 1, events
    assert events[0]["requested_cutoff_ts"] >= t, (events, t)
    replay_floor = events[0]["replay_floor_ts"]
    assert deleted_ts < replay_floor <= t, (deleted_ts, replay_floor, t)
    assert prepared.reply.cutoff_ts == events[0]["cutoff_ts"] == replay_floor - 1
    assert reply.rows_dropped == 4  # the rows deleted below the floor, not the merged key's
