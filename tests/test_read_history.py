"""Which past snapshots a restarted node answers (retina_server/read_history.py), as pure
logic: SNAPSHOTS_END_AT_RESTART and HISTORY_REBUILT_IS_REFUSED."""

from __future__ import annotations

import grpc
import pytest

from retina_common.refusal import SNAPSHOT_EXPIRED, Refusal, earliest_readable
from retina_server.read_history import ReadHistory


def refusal(history: ReadHistory, *args: object) -> Refusal:
    with pytest.raises(Refusal) as refused:
        history.check(*args)  # type: ignore[arg-type]
    return refused.value


def restarted(gaps: tuple[tuple[int, int], ...] = (), rebuilt_from: int = 100,
              floor: int = 200, fence_trans_id: int = 50) -> ReadHistory:
    h = ReadHistory("n1")
    h.restored(gaps, rebuilt_from, applied_ts=rebuilt_from)
    h.fence(floor, fence_trans_id)
    return h


def test_as_of_reads_begun_after_the_fence_are_answered_outside_the_rebuilt_range() -> None:
    h = restarted()
    assert h.gaps() == ((100, 200),)
    h.check(99, None, 51, True)  # below the replay start: the checkpoint's history
    h.check(200, 200, 51, True)  # at the floor: this process's own
    for low in (100, 150, 199):
        refused = refusal(h, low, None, 51, True)
        assert refused.code == grpc.StatusCode.FAILED_PRECONDITION
        assert str(refused).startswith(SNAPSHOT_EXPIRED)
        assert earliest_readable(str(refused)) == (200, 0)


def test_reads_begun_before_the_fence_and_ordinary_reads_below_the_floor_are_aborted() -> None:
    h = restarted()
    assert refusal(h, 99, None, 50, True).code == grpc.StatusCode.ABORTED  # before the fence
    assert refusal(h, 99, None, 51, False).code == grpc.StatusCode.ABORTED  # not AS OF
    # GetWriteBuffer's timestamp counts: a snapshot read below the floor.
    assert refusal(h, 250, 150, 51, False).code == grpc.StatusCode.ABORTED
    h.check(250, None, 10, False)  # at or above the floor: anyone


def test_the_ranges_of_earlier_restarts_stay_refused_until_a_fold_passes_them() -> None:
    h = restarted(gaps=((20, 40),), rebuilt_from=300, floor=400)
    assert h.gaps() == ((20, 40), (300, 400))
    refusal(h, 30, None, 51, True)
    h.check(19, None, 51, True)
    h.check(40, None, 51, True)
    h.forget_below(40)
    assert h.gaps() == ((300, 400),)
    h.check(30, None, 51, True)  # (a fold at 40 refuses it there: NO_READ_BELOW_FOLD)


def test_overlapping_ranges_merge() -> None:
    h = restarted(gaps=((150, 250),), rebuilt_from=100, floor=200)
    assert h.gaps() == ((100, 250),)


def test_a_complete_replay_is_inexact_only_from_the_first_timestamp_it_applied() -> None:
    """REPLAY_IS_COMPLETE: below the lowest timestamp R the replay applied, the rebuilt
    history is the checkpoint's plus nothing the node had applied: read there."""
    h = ReadHistory("n1")
    h.restored((), 100, applied_ts=100)
    for ts in (150, 130, 170):  # replay requests, in any order
        h.replayed(ts)
    h.fence(200, 50, replay_complete=True)
    assert h.inexact_ranges() == h.gaps() == ((130, 200),)
    h.check(129, None, 51, True)
    assert refusal(h, 130, None, 51, True).code == grpc.StatusCode.FAILED_PRECONDITION
    # A second recovery that applied nothing (every replayed write a refused one) adds
    # nothing; the first range stays.
    h.restored(h.gaps(), 220, applied_ts=220)
    h.fence(300, 60, replay_complete=True)
    assert h.inexact_ranges() == ((130, 200),)
    h.check(250, None, 61, True)


def test_an_incomplete_replay_is_inexact_from_its_start() -> None:
    """Anonymous writes or a GONE writer: the replay may lack what the node had applied."""
    h = ReadHistory("n1")
    h.restored((), 100, applied_ts=100)
    h.replayed(150)
    h.fence(200, 50, replay_complete=False)
    assert h.inexact_ranges() == ((100, 200),)
    h = ReadHistory("n1")
    h.restored((), 100, applied_ts=100)
    h.fence(200, 50)
    assert h.inexact_ranges() == ((100, 200),)
