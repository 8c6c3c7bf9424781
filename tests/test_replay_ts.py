"""Replay timestamp derivation (pure logic, specification section 3)."""

from __future__ import annotations

from retina_common.replay_ts import (
    MIN_REPLAY_TS,
    PLUS_INF,
    IngestSegment,
    SegmentKind,
    derive,
    earliest_unsafe_insert_ts,
)

A, P, OPEN = SegmentKind.ADMITTED, SegmentKind.PENDING, SegmentKind.OPEN


def seg(kind: SegmentKind, first: int, rows: int = 10, lo: int = 0, hi: int = 0,
        table: int = 1, vnode: int = 0, blocks: int = 1) -> IngestSegment:
    return IngestSegment(table, vnode, kind, 100 + first, first, blocks, rows, lo, hi)


def test_unsafe_insert_is_the_earliest_unpublished_commit() -> None:
    chain = [seg(A, 0, lo=1, hi=5), seg(A, 1, lo=6, hi=9), seg(P, 2, lo=12, hi=20),
             seg(OPEN, 3, lo=10, hi=30)]  # interleaved commits: the open file holds ts 10
    assert earliest_unsafe_insert_ts(chain) == (10, True)


def test_empty_and_all_admitted_chains_are_plus_inf() -> None:
    assert earliest_unsafe_insert_ts([]) == (PLUS_INF, True)
    assert earliest_unsafe_insert_ts([seg(A, 0, lo=1, hi=2), seg(OPEN, 1, rows=0)]) == \
        (PLUS_INF, True)


def test_untrustworthy_chains_degrade_to_min_replay_ts() -> None:
    assert earliest_unsafe_insert_ts([seg(P, 0, lo=3, hi=4), seg(A, 1, lo=5, hi=6)]) == \
        (MIN_REPLAY_TS, False)  # admitted after unpublished: publish order was broken
    assert earliest_unsafe_insert_ts([seg(A, 0, blocks=4), seg(A, 2)])[1] is False
    two_open = [seg(OPEN, 0, lo=1, hi=1), seg(OPEN, 1, lo=2, hi=2)]
    assert earliest_unsafe_insert_ts(two_open)[1] is False
    assert earliest_unsafe_insert_ts([seg(P, 0, lo=9, hi=3)])[1] is False


def test_scope_vnode_and_node_starts() -> None:
    segments = [
        seg(A, 0, lo=1, hi=50, table=1, vnode=0), seg(OPEN, 1, lo=70, hi=90, table=1, vnode=0),
        seg(A, 0, lo=1, hi=40, table=2, vnode=0), seg(P, 1, lo=45, hi=60, table=2, vnode=0),
        seg(A, 0, lo=1, hi=80, table=1, vnode=2),  # only admitted files: +INF
        seg(P, 0, lo=5, hi=4, table=2, vnode=4),  # untrustworthy
    ]
    starts = derive(100, segments, owned_vnodes=[0, 2, 4, 6], table_ids=[1, 2])
    by_scope = {(s.table_id, s.vnode): s for s in starts.scopes}
    assert by_scope[(1, 0)].scope_replay_from_ts == 70
    assert by_scope[(2, 0)].scope_replay_from_ts == 45
    assert by_scope[(1, 2)].earliest_unsafe_insert_ts == PLUS_INF
    assert by_scope[(1, 2)].scope_replay_from_ts == 100  # all-DELETE-like: never 0
    assert by_scope[(2, 4)].scope_replay_from_ts == MIN_REPLAY_TS
    assert by_scope[(1, 6)].scope_replay_from_ts == 100  # no segments at all
    assert starts.vnode_replay_from_ts == {0: 45, 2: 100, 4: 0, 6: 100}
    assert starts.node_replay_from_ts == 0


def test_checkpoint_applied_ts_caps_every_start() -> None:
    starts = derive(10, [seg(OPEN, 0, lo=50, hi=60)], owned_vnodes=[0], table_ids=[1])
    assert starts.vnode_replay_from_ts == {0: 10} and starts.node_replay_from_ts == 10
