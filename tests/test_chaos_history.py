"""AS OF reads and pins in the fault campaign (chaos/as_of_reads.py, pinned_snapshots.py,
repeatable_reads.py): what a refusal is, when an earlier image must be read exactly, and
how pins are kept, read, dropped and listed. Pure logic over fakes; the campaign itself
runs in tests/test_chaos.py's sample."""

from __future__ import annotations

import random
from collections import Counter

import grpc
import pytest

from chaos.as_of_reads import AsOfPoint, AsOfReader, Circumstances, judge_refusal
from chaos.pinned_snapshots import PinBook, PinFailpoint, listing_problems
from chaos.repeatable_reads import EpisodePlan, SnapshotBook
from chaos.snapshots import Expected, ReadRefused, tables_imaged
from retina_common.refusal import snapshot_expired

from .chaos_fakes import FakePinStub, FakeReaders, image

ROW = {"id": 1, "v": "a"}  # what FakeReaders answers by default, for every table


def expired(earliest: int) -> ReadRefused:
    refusal = snapshot_expired("snapshot below the GC horizon", earliest, 1_700_000_000_000)
    return ReadRefused("FAILED_PRECONDITION", str(refusal))


def when(at_begin: bool = True, pinned: bool = False, trans_restarted: bool = False,
         all_ready: bool = True) -> Circumstances:
    return Circumstances(at_begin, pinned, trans_restarted, all_ready)


BY_TS = AsOfPoint("ts", ts=50)
BY_TIME = AsOfPoint("time", time_ms=1_700_000_000_000)


# --- what a refusal is -------------------------------------------------------------------------
def test_expired_is_benign_only_below_the_earliest_readable_point_it_names() -> None:
    assert judge_refusal(50, BY_TS, expired(51), when()) == "expired"
    assert judge_refusal(50, BY_TS, expired(50), when()).startswith(
        "as_of_refused_wrongly: AS OF ts 50 of S=50 refused FAILED_PRECONDITION")
    assert "at or above the earliest readable 50" in judge_refusal(50, BY_TS, expired(50),
                                                                   when())
    # A pinned S is never expired by the horizon or a fold, whatever the refusal names...
    assert "(S is pinned)" in judge_refusal(50, BY_TS, expired(90), when(pinned=True))
    assert "(S is pinned)" in judge_refusal(50, BY_TS, expired(90),
                                            when(pinned=True, at_begin=False))
    # ... only refused, by a node, in history its recovery rebuilt (HISTORY_REBUILT_IS_
    # REFUSED, docs/history.md), which is counted apart.
    rebuilt = ReadRefused("FAILED_PRECONDITION", str(snapshot_expired(
        "snapshot 50 is in [48, 60), history rebuilt (HISTORY_REBUILT_IS_REFUSED)", 60)))
    assert judge_refusal(50, BY_TS, rebuilt, when(pinned=True, at_begin=False)) == "rebuilt"
    assert judge_refusal(50, BY_TS, rebuilt, when(at_begin=False)) == "expired"
    assert "(S is pinned)" in judge_refusal(50, BY_TS, rebuilt, when(pinned=True))
    # The refusal must name the point.
    bare = ReadRefused("FAILED_PRECONDITION", "snapshot_expired: gone")
    assert "no earliest readable point" in judge_refusal(50, BY_TS, bare, when())


def test_an_unmapped_time_is_benign_only_by_time_after_a_transserver_restart() -> None:
    unmapped = ReadRefused("FAILED_PRECONDITION", "as_of_time_unmapped: in a crash gap")
    assert judge_refusal(50, BY_TIME, unmapped, when(trans_restarted=True)) == "unmapped"
    assert judge_refusal(50, BY_TIME, unmapped, when()).startswith("as_of_refused_wrongly")
    assert judge_refusal(50, BY_TS, unmapped, when(trans_restarted=True)).startswith(
        "as_of_refused_wrongly")


def test_away_codes_are_benign_at_the_gate_or_while_something_is_down() -> None:
    away = ReadRefused("UNAVAILABLE", "a node is not READY")
    assert judge_refusal(50, BY_TS, away, when(at_begin=True)) == "away"
    assert judge_refusal(50, BY_TS, away, when(at_begin=False, all_ready=False)) == "away"
    assert judge_refusal(50, BY_TS, away, when(at_begin=False)).startswith(
        "as_of_refused_wrongly")
    forgotten = ReadRefused("NOT_FOUND", "transaction 9 does not exist")
    assert judge_refusal(50, BY_TS, forgotten, when(trans_restarted=True)) == "away"
    assert judge_refusal(50, BY_TS, forgotten, when()).startswith("as_of_refused_wrongly")


@pytest.mark.parametrize("code,detail", [
    ("ABORTED", "snapshot 50 is below node-0's read floor 60"),
    ("OUT_OF_RANGE", "snapshot 50 is above the high watermark 40"),
    ("NOT_FOUND", "file 12 is not served by node-0"),
    ("NOT_FOUND", "no pin named 'chaos-s3'"),
    ("INTERNAL", "boom"),
])
def test_any_other_refusal_of_a_readable_point_is_an_anomaly(code: str, detail: str) -> None:
    verdict = judge_refusal(50, BY_TS, ReadRefused(code, detail), when())
    assert verdict.startswith(f"as_of_refused_wrongly: AS OF ts 50 of S=50 refused {code}")


# --- the book's AS OF re-reads ----------------------------------------------------------------
def _book(readers: FakeReaders, expected: Expected | None = None,
          trans_started_at: float = 0.0) -> SnapshotBook:
    as_of = AsOfReader(readers, Counter(), [],  # type: ignore[arg-type]
                       trans_started_at=lambda: trans_started_at)
    book = SnapshotBook(readers, Counter(), as_of,  # type: ignore[arg-type]
                        expected=None if expected is None else lambda: expected)
    _episode(book, 4)
    return book


def _episode(book: SnapshotBook, episode: int, by_time: bool = False,
             pin: bool = False) -> None:
    book.begin_episode(episode, random.Random(episode))
    book.plan = EpisodePlan("gated", 0, "gated", False, 2, "gated", by_time, pin)


def test_an_earlier_image_is_read_again_as_of_its_point_and_must_be_identical() -> None:
    readers = FakeReaders()
    book = _book(readers)
    book.after_healing()  # the episode's image, at S=10
    (first,) = book.remembered
    assert set(first.images) == set(tables_imaged()) and not readers.live
    readers.hwm = 20
    _episode(book, 5)
    book.after_healing()  # read again AS OF 10: identical
    assert book.as_of.counts["as_of_identical"] == 1 and book.drain() == []
    readers.answers[10] = {t: image(ROW, {"id": 2, "v": "late"}) for t in tables_imaged()}
    readers.hwm = 30
    _episode(book, 6)
    book.after_healing()
    changed = [t for t in book.drain() if t.startswith("snapshot_changed")]
    assert len(changed) == 1 and "AS OF ts 10" in changed[0] and first.reported
    assert book.as_of.counts["as_of_changed"] == 1
    # Found once: never read again.
    _episode(book, 7)
    book.after_healing()
    assert first not in book.remembered and book.as_of.counts["as_of_changed"] == 1


def test_expired_below_the_earliest_point_is_counted_and_a_wrong_refusal_reported_once() -> None:
    readers = FakeReaders()
    book = _book(readers)
    book.after_healing()
    readers.refuse_begin[10] = expired(11)
    readers.hwm = 20
    _episode(book, 5)
    book.after_healing()
    assert book.drain() == [] and book.as_of.counts["as_of_refused_expired"] >= 1
    # S=20 refused although the TransServer names 15 as the earliest readable point.
    readers.refuse_begin = {20: expired(15)}
    readers.hwm = 30
    _episode(book, 6)
    book.after_healing()
    wrong = [t for t in book.drain() if t.startswith("as_of_refused_wrongly")]
    assert len(wrong) == 1 and "S=20" in wrong[0]
    readers.hwm = 40
    _episode(book, 7)
    book.after_healing()
    assert not [t for t in book.drain() if "S=20" in t]


def test_an_open_snapshot_read_as_of_its_point_must_be_answered() -> None:
    readers = FakeReaders()
    book = _book(readers)
    book.rng = random.Random(0)  # 0.84: read AS OF S under a new transaction
    first = book.take("gated", "before the fault")
    assert first is not None
    readers.answers[10] = "ABORTED"  # below a node's read floor: not allowed AS OF
    book.reread("after healing")
    (text,) = book.drain()
    assert text.startswith("as_of_refused_wrongly: AS OF ts 10 of S=10 refused ABORTED")
    assert not book.open and not readers.live and first not in book.remembered


def test_an_image_taken_as_of_a_time_is_read_again_by_that_time() -> None:
    readers = FakeReaders()
    book = _book(readers, trans_started_at=1e12)  # restarted "after" every snapshot
    _episode(book, 4, by_time=True)
    readers.times = {}  # the fake resolves any unknown time to the HWM
    book.after_healing()
    (first,) = book.remembered
    assert first.time_ms and first.ts == 10
    readers.times[first.time_ms] = 10
    readers.hwm = 20
    for episode in range(5, 10):  # by time now and then (BY_TIME_PICK_P, _REREAD_P)
        _episode(book, episode)
        book.after_healing()
    assert book.as_of.counts["as_of_by_time"] >= 1 and book.drain() == []
    # The time now resolves elsewhere: the point moved.
    readers.times[first.time_ms] = 9
    outcome = book.as_of.read(first, AsOfPoint("time", time_ms=first.time_ms),
                              random.Random(1), "again", "")
    (moved,) = book.drain()
    assert outcome == "moved" and moved.startswith("as_of_point_moved: AS OF time")
    assert "began at S=9, but it named S=10" in moved and first.reported


def test_the_episodes_image_is_compared_with_the_source_when_it_is_recent_enough() -> None:
    readers = FakeReaders()
    want: Expected = {t: (image(ROW), frozenset()) for t in tables_imaged()}
    want["accounts"] = (image(ROW, {"id": 3, "v": "c"}), frozenset())
    # The application writer's model leaves key 5 undecided: not compared.
    want["app_items"] = (image(ROW, {"id": 5, "v": "x"}), frozenset({(5,)}))
    book = _book(readers, want)
    book.after_healing()
    (text,) = book.drain()
    assert text.startswith("image_differs_from_source: S=10")
    assert "accounts: 1 lost (e.g. [(3,)])" in text and "app_items" not in text
    # AS OF a time before the comparison's reads: the source moved since, not compared.
    _episode(book, 5, by_time=True)
    readers.times = {}
    readers.hwm = 20
    book.readers.high_watermark = lambda: 25  # type: ignore[method-assign]
    book.after_healing()
    assert book.counts["images_below_comparison"] == 1


# --- pins ------------------------------------------------------------------------------------
def _pinned_book(readers: FakeReaders) -> tuple[SnapshotBook, FakePinStub]:
    as_of = AsOfReader(readers, Counter(), [])  # type: ignore[arg-type]
    pins = PinBook(grpc.insecure_channel("127.0.0.1:9"), as_of, as_of.counts, [])
    stub = FakePinStub(readers)
    pins.trans = stub  # type: ignore[assignment]
    book = SnapshotBook(readers, Counter(), as_of, pins)  # type: ignore[arg-type]
    _episode(book, 4, pin=True)
    return book, stub


def test_a_pin_is_kept_read_through_and_dropped_when_due() -> None:
    readers = FakeReaders()
    book, _stub = _pinned_book(readers)
    assert book.pins is not None
    book.after_healing()
    (held,) = book.pins.held.values()
    assert readers.pins == {held.name: 10} and held.taken.pin == held.name
    counts = book.as_of.counts
    episode = 5
    while book.pins.held:
        readers.hwm += 10
        _episode(book, episode)
        book.after_healing()
        episode += 1
    assert counts["pins_created"] == 1 and counts["pins_dropped"] == 1
    assert counts["pins_read"] >= 1 and counts["as_of_by_pin"] == counts["pins_read"]
    assert readers.pins == {} and book.drain() == []


def test_a_pin_that_vanished_is_reported_and_a_lost_answer_is_settled_quietly() -> None:
    readers = FakeReaders()
    book, stub = _pinned_book(readers)
    assert book.pins is not None
    book.after_healing()
    (name,) = book.pins.held
    readers.pins.clear()  # gone behind the campaign's back
    _episode(book, 5)
    book.after_healing()
    found = book.drain()
    assert any(t.startswith("as_of_refused_wrongly: AS OF pin") for t in found)
    assert any(t.startswith(f"pin_lost: DropPin({name})") for t in found)
    # A drop whose answer was lost: in doubt, asked again, never an anomaly.
    _episode(book, 6, pin=True)
    book.after_healing()
    stub.fail["DropPin"] = (grpc.StatusCode.UNAVAILABLE, True)
    book.pins.episode(20, random.Random(1), "", release=True)
    assert book.pins.in_doubt and not readers.pins
    _episode(book, 21)
    book.after_healing()
    assert book.drain() == [] and not book.pins.in_doubt


def test_listpins_must_list_exactly_the_held_pins() -> None:
    assert listing_problems({"a": 1}, {"a": 1}, set(), set()) == []
    assert listing_problems({}, {"a": 1}, set(), set()) == ["a (ts 1) missing"]
    assert listing_problems({}, {"a": 1}, set(), {"a"}) == []
    assert listing_problems({"a": 2}, {"a": 1}, set(), set()) == [
        "a listed at ts 2, created at 1"]
    assert listing_problems({"b": 3}, {}, {"b"}, set()) == ["b listed after it was dropped"]
    assert listing_problems({"b": 3}, {}, {"b"}, {"b"}) == []


@pytest.mark.parametrize("point,present", [
    ("trans.pin.create.before", False), ("trans.pin.create.after", True),
    ("trans.pin.drop.before", True), ("trans.pin.drop.after", False)])
def test_a_pin_in_flight_at_a_crash_is_there_exactly_after_its_etcd_write(
        point: str, present: bool) -> None:
    readers = FakeReaders()
    stub = FakePinStub(readers)
    driver = PinFailpoint("127.0.0.1:9", point)
    driver.trans = stub  # type: ignore[assignment]
    driver.in_flight = "chaos-fp-1"
    readers.pins = {"chaos-fp-1": 5} if present else {}
    assert driver.check(hit=True) == [] and readers.pins == {}
    readers.pins = {} if present else {"chaos-fp-1": 5}
    (text,) = driver.check(hit=True)
    assert text.startswith(f"pin_not_durable: the TransServer killed at {point}")
    driver.close()
