"""SNAPSHOT_IS_IMMUTABLE in the fault campaign (chaos/snapshots.py, repeatable_reads.py,
stalls.py, split_reads.py): the rules that decide what a re-read that differs is, and how the new
faults are put together. The campaign itself runs in tests/test_chaos.py's sample."""

from __future__ import annotations

import random
from collections import Counter

import grpc
import pyarrow as pa

from chaos import faults, gc_driver, split_reads, stalls
from chaos.repeatable_reads import EpisodePlan, SnapshotBook
from chaos.snapshots import (
    REFUSALS,
    ReadRefused,
    Taken,
    compare_taken,
    diff_images,
    duplicates_in,
    is_refusal,
    refusal_of,
    row_digest,
)
from retina_common import failpoints
from retina_common.pb import trans_pb2 as tpb
from retina_common.reader import FILE_ID
from spark_jobs.common import TaskError

from .chaos_fakes import FakeReaders as _Readers
from .chaos_fakes import Status, image


def test_a_column_added_after_s_reads_null_and_changes_no_digest() -> None:
    assert row_digest({"id": 1, "v": "a"}) == row_digest({"id": 1, "v": "a", "x1": None})
    assert row_digest({"id": 1, "v": "a"}) != row_digest({"id": 1, "v": "a", "x1": 0})
    assert row_digest({"id": 1, "v": None}) != row_digest({"id": 1, "v": ""})


def test_a_second_read_is_judged_row_by_row_and_column_by_column() -> None:
    first = image({"id": 1, "v": "a"}, {"id": 2, "v": "b"}, {"id": 3, "v": "c"})
    assert diff_images(first, image({"id": 3, "v": "c"}, {"id": 2, "v": "b"},
                                    {"id": 1, "v": "a"})).same  # order does not matter
    again = image({"id": 1, "v": "a"}, {"id": 1, "v": "a"}, {"id": 2, "v": "B"},
                  {"id": 4, "v": "d"})
    diff = diff_images(first, again)
    assert (diff.lost, diff.extra, diff.changed, diff.duplicated) == ([(3,)], [(4,)],
                                                                     [(2,)], [(1,)])
    assert "1 lost" in diff.describe() and "1 duplicated" in diff.describe()


def test_a_split_read_that_only_repeats_rows_is_snapshot_duplicates() -> None:
    ref = image({"id": 1, "v": "a"}, {"id": 2, "v": "b"})
    first = Taken(7, "split", 40, 3, "at the start of a split read", {"t": ref})
    assert compare_taken(first, {"t": ref}, "again", "") == ""
    twice = image({"id": 1, "v": "a"}, {"id": 1, "v": "a"}, {"id": 2, "v": "b"})
    text = compare_taken(first, {"t": twice}, "in the split read", "a GC pass")
    assert text.startswith("snapshot_duplicates: SNAPSHOT_IS_IMMUTABLE broken: S=40")
    assert "between: a GC pass" in text
    lost = image({"id": 1, "v": "a"})
    assert compare_taken(first, {"t": lost}, "again", "").startswith("snapshot_changed:")
    assert duplicates_in({"t": twice}, "S=40").startswith("snapshot_duplicates: S=40")
    assert duplicates_in({"t": ref}, "S=40") == ""


def test_refusals_are_counted_by_their_code_whichever_reader_got_them() -> None:
    assert refusal_of(Status(grpc.StatusCode.ABORTED)).code == "ABORTED"
    wrapped = TaskError.of(Status(grpc.StatusCode.FAILED_PRECONDITION), "reading file f")
    assert refusal_of(wrapped).code == "FAILED_PRECONDITION"
    assert refusal_of(OSError("gone")).code == "ERROR"
    assert refusal_of(ReadRefused("NOT_FOUND", "x")).code == "NOT_FOUND"
    assert {"ABORTED", "UNAVAILABLE", "FAILED_PRECONDITION"} <= REFUSALS
    assert "INTERNAL" not in REFUSALS and "INVALID_ARGUMENT" not in REFUSALS


def test_a_not_found_refuses_only_for_a_forgotten_transaction() -> None:
    """A TransServer restart forgets transactions (NOT_FOUND): a refusal. A node's NOT_FOUND
    for a file or its visibility under a live reader is a file removed under a snapshot."""
    assert is_refusal(ReadRefused("NOT_FOUND", "transaction 41 does not exist"))
    assert not is_refusal(ReadRefused("NOT_FOUND", "file 12 is not served by node-0"))
    assert not is_refusal(ReadRefused("NOT_FOUND", "no visibility for file 12 row group 0"))
    assert is_refusal(ReadRefused("ABORTED", "snapshot 5 is below node-0's read floor 9"))
    assert not is_refusal(ReadRefused("INTERNAL", "boom"))


def test_an_episodes_snapshots_are_drawn_up_front_from_their_own_stream() -> None:
    plans = [EpisodePlan.draw(random.Random(s)) for s in range(200)]
    assert plans[:5] == [EpisodePlan.draw(random.Random(s)) for s in range(5)]
    assert {p.before for p in plans} == {"gated", "spark"}
    assert any(p.hold for p in plans) and not all(p.hold for p in plans)
    assert any(p.during_at for p in plans) and {p.after for p in plans} == {"gated", "spark"}
    # The episode's image: every episode, some AS OF a wall-clock time, some pinned.
    assert any(p.by_time for p in plans) and not all(p.by_time for p in plans)
    assert any(p.pin for p in plans) and not all(p.pin for p in plans)


def test_the_new_fault_kinds_are_on_the_menu_and_their_points_in_the_catalogue() -> None:
    for kind in ("stalled_write", "split_read"):
        assert kind in faults.FAULTS
    assert "index.primary_commit.before" in stalls.stall_points()
    assert set(stalls.stall_points()) <= set(failpoints.catalogue())
    # The write fence's points, once the catalogue has them, are armed in a Retina node.
    assert faults.process_of("update_record.fence.before") == "retina"
    assert "update_record.fence.before".startswith(faults.RETINA_PREFIXES)
    assert min(stalls.STALL_S) > 2.0  # above the connector's write lease in the campaign


def test_a_split_read_aims_at_the_node_and_files_holding_the_fetched_rows() -> None:
    def rows(*file_ids: int) -> pa.Table:
        return pa.table({"id": list(range(len(file_ids))),
                         FILE_ID: pa.array(file_ids, pa.int64())})

    buffers = {"a": {"n1": rows(5, 5), "n2": rows(9)}, "b": {"n1": rows(), "n2": rows(8, 9)}}
    assert split_reads.buffered_by_node(buffers).most_common(1) == [("n2", 3)]
    assert split_reads.buffered_files(buffers, "n2") == {8, 9}


def _listed(node: str, vnode: int, seq: int, file_id: int) -> tpb.QueryFile:
    host, port = node.split(":")
    return tpb.QueryFile(file_id=file_id, name=f"{host}-{port}_20260101000000_{seq}_{vnode}"
                                              ".parquet", path_uri="file:///x")


def test_a_focused_gc_pass_rewrites_only_streams_and_runs_holding_the_focus() -> None:
    node = "127.0.0.1:1000"
    listing = {"t": [_listed(node, v, s, 10 * v + s) for v in (0, 1, 2) for s in (1, 2, 3)]}
    rng = random.Random(3)
    picked = gc_driver.pick_streams(listing, node, rng, 3, frozenset({12}))
    assert [(t, v) for t, v, _ in picked] == [("t", 1)]
    files = picked[0][2]
    runs = [tuple(files[:1]), tuple(files[1:])]
    assert gc_driver.focused(runs, frozenset({12})) == [tuple(files[1:])]
    assert gc_driver.focused(runs, frozenset()) == runs
    # Without a focus the draws are those of the pass before focus existed.
    a, b = random.Random(9), random.Random(9)
    assert gc_driver.pick_streams(listing, node, a, 2) == \
        gc_driver.pick_streams(listing, node, b, 2, frozenset())


def _book(readers: _Readers) -> SnapshotBook:
    book = SnapshotBook(readers, Counter())  # type: ignore[arg-type]
    book.begin_episode(4, random.Random(1))
    return book


def test_an_open_snapshot_read_differently_once_healed_is_snapshot_changed() -> None:
    readers = _Readers()
    book = _book(readers)
    first = book.take("gated", "before the fault")
    assert first is not None and first.trans is not None and readers.live
    book.after_fault("stalled_write cdc cdc.batch.begin.after=block@2*1")
    readers.answers[10] = {t: image({"id": 1, "v": "a"}, {"id": 2, "v": "late"})
                           for t in first.images}
    book.reread("after healing")
    (text,) = book.drain()
    assert text.startswith("snapshot_changed: SNAPSHOT_IS_IMMUTABLE broken: S=10")
    assert "1 extra" in text and "between: episode 4: stalled_write cdc" in text
    assert book.counts["reread_changed"] == 1 and not book.open and not readers.live


def test_a_refused_re_read_is_counted_by_code_and_ends_the_pin() -> None:
    readers = _Readers()
    book = _book(readers)
    book.take("spark", "before the fault", hold_episodes=3)
    readers.answers[10] = "ABORTED"  # a node restarted since: its floor is above S
    book.reread("after healing")
    assert book.drain() == []
    assert book.counts["reread_refused_ABORTED"] == 1 and book.counts["held_ended"] == 1
    assert not book.open and not readers.live
    del readers.answers[10]
    book.take("gated", "before the fault")
    readers.answers[10] = "INTERNAL"
    book.reread("after healing")
    assert book.drain()[0].startswith("snapshot_read_error: a re-read answered INTERNAL")


def test_a_held_snapshot_stays_open_until_due_and_close_ends_every_one() -> None:
    readers = _Readers()
    book = _book(readers)
    held = book.take("gated", "before the fault", hold_episodes=2)
    book.take("gated", "during the fault")
    book.reread("after healing")
    assert book.open == [held] and len(readers.live) == 1
    book.begin_episode(6, random.Random(2))
    book.reread("after healing")
    assert not book.open and book.counts["reread_identical"] == 3
    book.take("gated", "before the fault", hold_episodes=2)
    book.take("spark", "before the fault")
    book.close()
    assert not book.open and not readers.live
