"""The GC scheduler: primary-index version pruning, visibility folding, the replay floor.

Pruning runs against a real LMDB/SQLite LocalIndexService in a temporary
directory and is checked against whole answer sets (every key at every
timestamp at or above the horizon). Folding runs on a RetinaNode: published
row groups without a catalog, write-buffer blocks with the private PostgreSQL
catalog of tests/conftest.py.
"""

from __future__ import annotations

import random
import threading
from collections.abc import Callable
from pathlib import Path

import pyarrow as pa
import pytest

from retina_common.catalog import Catalog, ColumnSpec
from retina_common.topology import Topology
from retina_server.gc.gc_scheduler import GcScheduler, MaintenanceResult, ReplayFloor
from retina_server.index import LocalIndexService, Resolved
from retina_server.main_index import RowIdRange
from retina_server.node import BufferSettings, RetinaNode, table_schema
from retina_server.primary_index import TOMBSTONE
from retina_server.write_buffer import SettleMode

from .support import eventually

NODE = "127.0.0.1:1"
LIVE_FILE, GONE_FILE = 1, 2  # rows of GONE_FILE are orphans (outside the baseline)
TABLES = (1, 2)


def baseline(file_id: int) -> bool:
    return file_id == LIVE_FILE


# --- primary-index histories -------------------------------------------------------

def write_history(index: LocalIndexService, seed: int, keys: int = 120,
                  max_ts: int = 90) -> list[tuple[int, bytes]]:
    """Random multi-version histories: inserts, replaces and tombstones, some keys in
    both tables, some versions at the same timestamp for many keys."""
    rng = random.Random(seed)
    rows = 8 * keys * len(TABLES)
    first = index.sequences.allocate_row_ids(rows)
    half = rows // 2
    index.main.put_main_index_entries([RowIdRange(first, half, LIVE_FILE, 0, 0),
                                  RowIdRange(first + half, rows - half, GONE_FILE, 0, 0)])
    free = iter(range(first, first + rows))
    names = [(t, f"k{i:04d}".encode()) for t in TABLES for i in range(keys)]
    for table_id, key in names:
        stamps = sorted(rng.sample(range(1, max_ts), rng.randint(0, 7)))
        for ts in stamps:
            if rng.random() < 0.3:
                index.primary.tombstone_primary_resolved(table_id, [key], ts)
            else:
                index.primary.put_primary_entries_only(table_id, [key], [next(free)], ts)
    return names


Answers = dict[tuple[int, int], tuple[list[Resolved], list[list[Resolved]] | None]]


def answers(index: LocalIndexService, names: list[tuple[int, bytes]], lo: int,
            hi: int) -> Answers:
    """resolvePrimary and resolve_for_delete of every key at every T in [lo, hi]."""
    out: Answers = {}
    for table_id in TABLES:
        keys = [k for t, k in names if t == table_id]
        for ts in range(lo, hi + 1):
            out[table_id, ts] = (index.resolve_primary(table_id, keys, baseline, ts),
                                 index.resolve_for_delete(table_id, keys, baseline, ts))
    return out


def by_key(index: LocalIndexService) -> dict[tuple[int, bytes], list[tuple[int, int]]]:
    out: dict[tuple[int, bytes], list[tuple[int, int]]] = {}
    for table_id, key, ts, row in index.primary.versions():
        out.setdefault((table_id, key), []).append((ts, row))
    return out


@pytest.mark.parametrize("seed", [1, 2, 3])
@pytest.mark.parametrize("horizon", [1, 37, 60, 95])
def test_prune_keeps_every_answer_at_and_above_the_horizon(tmp_path: Path, seed: int,
                                                           horizon: int) -> None:
    index = LocalIndexService(tmp_path)
    names = write_history(index, seed)
    before = by_key(index)
    expected = answers(index, names, horizon, 100)
    total = index.primary.primary_version_count()

    removed = index.primary.prune_versions(horizon, 0, keys_per_txn=17, entries_per_txn=40)

    assert answers(index, names, horizon, 100) == expected
    after = by_key(index)
    assert removed == total - index.primary.primary_version_count() == \
        sum(map(len, before.values())) - sum(map(len, after.values()))
    for name, versions in before.items():
        below = [v for v in versions if v[0] < horizon]
        above = [v for v in versions if v[0] >= horizon]
        kept = [] if not below or below[-1][1] == TOMBSTONE else [below[-1]]
        assert after.get(name, []) == kept + above, name
    assert index.primary.version_index_mismatches() == []
    assert index.primary.prune_versions(horizon, 0) == 0  # nothing left to prune at that horizon


def test_prune_rule_on_one_key(tmp_path: Path) -> None:
    index = LocalIndexService(tmp_path)
    r = index.sequences.allocate_row_ids(3)
    index.main.put_main_index_entries([RowIdRange(r, 3, LIVE_FILE, 0, 0)])
    index.primary.put_primary_entries_only(1, [b"k"], [r], ts=10)
    index.primary.tombstone_primary_resolved(1, [b"k"], ts=20)
    index.primary.put_primary_entries_only(1, [b"k"], [r + 1], ts=30)
    index.primary.put_primary_entries_only(1, [b"k"], [r + 2], ts=40)

    assert index.primary.prune_versions(0, 0) == 0  # horizon 0: nothing
    assert index.primary.prune_versions(20, 0) == 0  # the latest below 20 is a row: it stays
    # A DELETE at 20 still looks past its own tombstone to the row at 10.
    assert index.resolve_primary(1, [b"k"], baseline, 20)[0].row_id == r
    assert index.primary.prune_versions(21, 0) == 2  # the tombstone at 20 and the row under it
    assert [v[2:] for v in index.primary.versions()] == [(30, r + 1), (40, r + 2)]
    assert index.primary.prune_versions(41, 21) == 1  # the row at 30; the latest, at 40, stays
    assert [v[2:] for v in index.primary.versions()] == [(40, r + 2)]
    assert index.primary.prune_versions(10**6, 41) == 0
    assert index.primary.version_index_mismatches() == []


@pytest.mark.parametrize("seed", [4, 5])
def test_incremental_prunes_equal_one_big_prune(tmp_path: Path, seed: int) -> None:
    steps = LocalIndexService(tmp_path / "steps")
    chunks = LocalIndexService(tmp_path / "chunks")
    once = LocalIndexService(tmp_path / "once")
    for index in (steps, chunks, once):
        write_history(index, seed)
    stepped = sum(steps.primary.prune_versions(h, since)
                  for since, h in [(0, 20), (20, 45), (45, 45), (45, 70)])
    chunked = chunks.primary.prune_versions(70, 0, keys_per_txn=3, entries_per_txn=5)
    whole = once.primary.prune_versions(70, 0)
    assert stepped == chunked == whole > 0
    assert steps.primary.versions() == chunks.primary.versions() == once.primary.versions()
    assert steps.primary.prune_versions(70, 70) == once.primary.prune_versions(70, 0) == 0


def test_prune_inside_a_write_batch_is_refused(tmp_path: Path) -> None:
    index = LocalIndexService(tmp_path)
    index.primary.put_primary_entries_only(1, [b"k"], [0], ts=1)
    with index.primary.write_batch(), pytest.raises(RuntimeError):
        index.primary.prune_versions(10, 0)
    assert index.primary.prune_versions(10, 0) == 0


def test_writes_above_the_horizon_during_a_prune_are_kept(tmp_path: Path) -> None:
    """UpdateRecord-like batches at timestamps above the horizon run between the
    prune's bounded transactions; none of their versions is touched."""
    index = LocalIndexService(tmp_path)
    keys = [f"w{i:05d}".encode() for i in range(3000)]
    for ts in (1, 2, 3):
        index.primary.put_primary_entries_only(1, keys, list(range(len(keys))), ts)
    done = threading.Event()
    written: list[int] = []

    def writer() -> None:
        ts = 100
        while not done.is_set() and ts < 400:
            with index.primary.write_batch():
                index.primary.put_primary_entries_only(1, keys[ts % 50::50], [ts] * 60, ts,
                                               keep_previous=False)
            written.append(ts)
            ts += 1

    thread = threading.Thread(target=writer)
    thread.start()
    try:
        removed = index.primary.prune_versions(50, 0, keys_per_txn=100)
    finally:
        done.set()
        thread.join()
    assert removed == 2 * len(keys)
    stored = by_key(index)
    for i, key in enumerate(keys):
        tail = [(ts, ts) for ts in written if ts % 50 == i % 50]
        assert stored[1, key] == [(3, i), *tail]
    assert index.primary.version_index_mismatches() == []


# --- the replay floor ----------------------------------------------------------------

def test_replay_floor_keeps_the_two_newest_checkpoints() -> None:
    floor = ReplayFloor()
    assert floor.floor() == 0  # nothing observed: nothing may be pruned
    floor.observe(7, 500)
    # Only the loaded slot is known; the previous slot (a lower start, maybe) is the
    # fallback until this process publishes a checkpoint.
    assert floor.floor() == 0
    floor.observe(6, 300)  # loaded out of order at start-up: both slots count
    assert floor.floor() == 300
    floor.observe(8, 900)  # 6 leaves the slots
    assert floor.floor() == 500
    floor.observe(9, 950)
    assert floor.floor() == 900
    floor.observe(9, 940)  # the same checkpoint again: the lower start wins
    assert floor.floor() == 900
    floor.observe(3, 10)  # older than both slots: gone at once
    assert floor.floor() == 900
    threads = [threading.Thread(target=lambda i=i: floor.observe(100 + i, 1000 + i))
               for i in range(16)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert floor.floor() == 1014  # the two newest: 114 and 115


# --- folding and the scheduler --------------------------------------------------------

def bare_node(tmp_path: Path, catalog: Catalog | None = None) -> RetinaNode:
    """A RetinaNode without a cluster (the catalog is only needed for write buffers)."""
    return RetinaNode(NODE, Topology((NODE,), 4), catalog,  # type: ignore[arg-type]
                      LocalIndexService(tmp_path / "index"), f"file://{tmp_path}/data",
                      BufferSettings(block_rows=8, blocks_per_file=2), lambda: 0)


def scheduler(node: RetinaNode, safe: Callable[[], int], *, gc_floor: int | None = None,
              replay: int = 0, interval_s: float = 3600, stop: threading.Event | None = None,
              is_ready: Callable[[], bool] = lambda: True) -> GcScheduler:
    return GcScheduler(node, safe, lambda: gc_floor, lambda: replay, interval_s,
                       stop or threading.Event(), is_ready=is_ready)


def published_deletes(node: RetinaNode) -> None:
    """Two files of two row groups; deletes at 5, 10, 15, 20 and 25."""
    node.visibility.add_file(10, [8, 8])
    node.visibility.add_file(11, [8, 8], base_ts=3)
    for n, ts in enumerate((5, 10, 15, 20, 25)):
        node.visibility.get(10, n % 2).delete([n], ts)
        node.visibility.get(11, 1).delete([n, n + 1], ts)


def deleted_sets(node: RetinaNode, lo: int, hi: int) -> dict[tuple[int, int, int], list[int]]:
    out = {}
    for file_id in sorted(node.visibility.files()):
        for rg in node.visibility.row_groups(file_id):
            for ts in range(lo, hi + 1):
                out[file_id, rg, ts] = list(node.visibility.get(file_id, rg).deleted_at(ts))
    return out


def chain_items(node: RetinaNode) -> int:
    return sum(len(node.visibility.get(f, rg).snapshot()[2])
               for f in node.visibility.files() for rg in node.visibility.row_groups(f))


def test_fold_moves_items_at_or_below_fold_ts_into_the_base(tmp_path: Path) -> None:
    node = bare_node(tmp_path)
    published_deletes(node)
    expected = deleted_sets(node, 12, 30)
    result = scheduler(node, lambda: 12).run_once()
    # Folded: file 10's deletes at 5 and 10, file 11's rows deleted at 5 and 10 (3).
    assert (result.folded_items, result.fold_ts, result.chain_items) == (5, 12, 6)
    assert deleted_sets(node, 12, 30) == expected
    assert {node.visibility.get(f, rg).base_timestamp
            for f in (10, 11) for rg in (0, 1)} == {12}
    assert chain_items(node) == 6
    # A lower fold timestamp later changes nothing (never below the base).
    assert scheduler(node, lambda: 8).run_once().folded_items == 0
    assert deleted_sets(node, 12, 30) == expected


def test_a_pinned_gc_floor_limits_the_fold(tmp_path: Path) -> None:
    node = bare_node(tmp_path)
    published_deletes(node)
    expected = deleted_sets(node, 8, 30)
    result = scheduler(node, lambda: 22, gc_floor=8).run_once()
    assert (result.fold_ts, result.folded_items) == (8, 3)  # only the deletes at 5
    assert deleted_sets(node, 8, 30) == expected
    assert node.visibility.get(10, 1).base_timestamp == 8
    # The rewrite went away: the next round folds up to safeGcTs.
    result = scheduler(node, lambda: 22, gc_floor=None).run_once()
    assert (result.fold_ts, result.folded_items) == (22, 6)
    assert deleted_sets(node, 22, 30) == {k: v for k, v in expected.items() if k[2] >= 22}


@pytest.mark.integration
def test_fold_reaches_write_buffer_blocks(tmp_path: Path, catalog: Catalog) -> None:
    catalog.create_schema("shop")
    table = catalog.create_table("shop", "orders", [ColumnSpec("id", "int64")], ["id"])
    node = bare_node(tmp_path, catalog)
    stream = node.stream(table, 0)
    schema = table_schema(table)
    ids = list(range(20))  # 8-row blocks, 2 per file: two files, three blocks
    batch = pa.RecordBatch.from_arrays([pa.array(ids, pa.int64()), pa.array([1] * 20,
                                                                           pa.int64())],
                                       schema=schema)
    with stream.buffer.lock:
        handles = stream.buffer.append_pending(batch, 1, node.index.sequences.allocate_row_ids(20))
        stream.buffer.settle(handles, SettleMode.VISIBLE)
        blocks = [b for f in stream.buffer.files for b in f.blocks]
    assert len(blocks) == 3
    for n, block in enumerate(blocks):
        block.visibility.delete([0], 4 + n)  # 4, 5, 6
        block.visibility.delete([1], 10 + n)  # 10, 11, 12
    # A block adopted by a publish sits in both places: folded once.
    node.visibility.adopt(999, 0, blocks[0].visibility)
    before = [[list(b.visibility.deleted_at(ts)) for ts in range(6, 15)] for b in blocks]

    result = scheduler(node, lambda: 6).run_once()

    assert (result.folded_items, result.chain_items) == (3, 3)
    assert [b.visibility.base_timestamp for b in blocks] == [6, 6, 6]
    assert [[list(b.visibility.deleted_at(ts)) for ts in range(6, 15)] for b in blocks] == \
        before
    assert node.write_buffer_rows(table, 20).column("id").to_pylist() == \
        [i for i in ids if i % 8 > 1]


def test_a_round_prunes_below_the_lowest_of_its_three_bounds(tmp_path: Path) -> None:
    node = bare_node(tmp_path)
    index = node.index
    for ts in range(1, 11):
        index.primary.put_primary_entries_only(1, [b"a", b"b"], [ts, 100 + ts], ts)
    floor = ReplayFloor()
    sched = GcScheduler(node, lambda: 9, lambda: None, floor.floor, 3600, threading.Event())
    # One checkpoint observed: the replay floor is still 0, nothing is pruned.
    floor.observe(1, 4)
    assert sched.run_once().pruned_versions == 0
    floor.observe(0, 5)  # the previous slot, read at start-up
    result = sched.run_once()
    assert (result.prune_horizon_ts, result.pruned_versions) == (4, 4)  # 1 and 2 of each
    floor.observe(2, 7)  # slot 1 (4) is still the previous checkpoint
    assert sched.run_once().pruned_versions == 0
    floor.observe(3, 12)  # now min(7, 12) = 7, and safeGcTs 9
    result = sched.run_once()
    assert (result.prune_horizon_ts, result.pruned_versions) == (7, 6)  # 3..5 of each
    assert [v[2] for v in index.primary.versions() if v[1] == b"a"] == [6, 7, 8, 9, 10]
    # A pinned Storage GC cutoff below the horizon holds it back...
    pinned = GcScheduler(node, lambda: 100, lambda: 5, lambda: 100, 3600, threading.Event())
    assert pinned.run_once().prune_horizon_ts == 5
    # ...and the horizon never moves down within a process.
    assert sched.run_once().prune_horizon_ts == 7
    assert sched.status()["last_prune_horizon_ts"] == 7
    assert index.primary.version_index_mismatches() == []


def test_rounds_are_skipped_when_not_ready_or_safe_gc_ts_fails(tmp_path: Path) -> None:
    node = bare_node(tmp_path)
    published_deletes(node)
    ready = [False]
    sched = scheduler(node, lambda: 30, is_ready=lambda: ready[0])
    assert sched.run_once() == MaintenanceResult(skipped="not_ready")
    ready[0] = True

    def unreachable() -> int:
        raise ConnectionError("TransServer down")

    failing = scheduler(node, unreachable)
    assert failing.run_once() == MaintenanceResult(skipped="safe_gc_ts_unavailable")
    assert chain_items(node) == 11  # nothing folded
    node.fail_closed("test")
    assert sched.run_once().skipped == "not_ready"


def test_the_loop_runs_rounds_skips_failures_and_stops_on_the_event(tmp_path: Path) -> None:
    node = bare_node(tmp_path)
    published_deletes(node)
    calls = [0]

    def flaky() -> int:
        calls[0] += 1
        if calls[0] <= 2:
            raise ConnectionError("TransServer down")
        return 30

    stop = threading.Event()
    sched = scheduler(node, flaky, interval_s=0.01, stop=stop)
    sched.start()
    sched.start()  # idempotent
    eventually(lambda: sched.status()["rounds"] >= 2, 10, "two rounds after the failures")
    status = sched.status()
    assert status["skipped_rounds"] == 2 and status["last_fold_ts"] == 30
    assert chain_items(node) == 0
    stop.set()
    assert sched.join(10)
    assert not sched.status()["running"]


def test_the_fold_fence_is_raised_before_the_pins_are_read(tmp_path: Path) -> None:
    """FOLD_FENCE: a prepare that pins a cutoff after the round read the pins sees a
    fence at least the round's fold timestamp (and refuses a lower cutoff)."""
    node = bare_node(tmp_path)
    published_deletes(node)
    fences: list[tuple[str, int]] = []
    pins: list[int | None] = [None]
    safe = [12]

    def gc_floor() -> int | None:
        fences.append(("pins read", sched.fold_fence()))
        return pins[0]

    def replay_floor() -> int:  # read first: it bounds the announcement
        fences.append(("replay floor read", sched.fold_fence()))
        return 0

    sched = GcScheduler(node, lambda: safe[0], gc_floor, replay_floor, 3600,
                        threading.Event())
    assert sched.fold_fence() == 0
    assert sched.run_once().fold_ts == 12
    assert fences == [("replay floor read", 0), ("pins read", 12)]
    assert sched.fold_fence() == 12
    pins[0] = 14  # a pinned cutoff limits the fold; the fence is what was folded
    safe[0] = 20
    assert sched.run_once().fold_ts == 14 and sched.fold_fence() == 14

    def broken() -> int | None:
        raise RuntimeError("journal unreadable")

    failing = GcScheduler(node, lambda: 40, broken, lambda: 0, 3600, threading.Event())
    assert failing.run_once().skipped == "floor_unavailable"
    assert failing.fold_fence() == 0  # nothing was folded
    assert node.visibility.get(10, 0).base_timestamp == 14
