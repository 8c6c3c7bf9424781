"""Recovery replay timestamps, derived on every start and never stored (specification 3).

    RecoveryScope      = (retinaNodeId, tableId, virtualNodeId)
    scopeReplayFromTs  = min(checkpointAppliedTs, earliestUnsafeInsertTs)
    vnodeReplayFromTs  = min(scopeReplayFromTs over the node's tables, per vnode)
    nodeReplayFromTs   = min(vnodeReplayFromTs)

``earliestUnsafeInsertTs`` of a scope comes from its ingest segment chain
(the checkpoint's REGULAR-admitted, pending and open segments in
firstBlockId order): the smallest ``minCommitTs`` of the non-empty pending or
open segments after the last admitted one; ``+INF`` when there is none (an
all-DELETE scope replays from checkpointAppliedTs, never from 0). The
specification names the first such segment's ``minCommitTs``; the minimum
over all of them is never later, and it stays right when concurrent
transactions append out of timestamp order. A chain that cannot be trusted
(admitted after unsafe, overlapping blocks, two open segments, inverted
commit-ts ranges) degrades the scope to ``MIN_REPLAY_TS = 0``: recovery only
ever replays more, never less. Both replay modes are inclusive.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from enum import IntEnum
from functools import cached_property

MIN_REPLAY_TS = 0
PLUS_INF = (1 << 63) - 1  # +INF on the wire (int64 max)


class SegmentKind(IntEnum):
    ADMITTED = 0  # a REGULAR file the checkpoint captured
    PENDING = 1  # sealed / closing / publishing, not admitted
    OPEN = 2  # the stream's open file


@dataclass(frozen=True)
class IngestSegment:
    table_id: int
    vnode: int
    kind: SegmentKind
    file_id: int
    first_block_id: int
    block_count: int
    row_count: int
    min_commit_ts: int  # meaningful only when row_count > 0
    max_commit_ts: int


@dataclass(frozen=True)
class ScopeStart:
    table_id: int
    vnode: int
    scope_replay_from_ts: int
    earliest_unsafe_insert_ts: int  # PLUS_INF for no unsafe insert
    trustworthy: bool


@dataclass(frozen=True)
class ReplayStarts:
    checkpoint_applied_ts: int
    scopes: tuple[ScopeStart, ...]
    vnode_replay_from_ts: dict[int, int]
    node_replay_from_ts: int

    def scope_start(self, table_id: int, vnode: int) -> int:
        """The scope's own start: the rewind drops what lies at or above it, and replay
        applies only what lies at or above it (REWIND_MATCHES_REPLAY, docs/recovery.md).
        A scope without an entry (a table created after the checkpoint) starts at
        checkpointAppliedTs, as it has nothing older."""
        return self._by_scope.get((table_id, vnode), self.checkpoint_applied_ts)

    def mode_start(self, mode: str, vnode: int) -> int:
        """What the client replays from (the admission floor): the vnode's start in
        VNODE mode, the node's start in NODE mode."""
        if mode == "NODE":
            return self.node_replay_from_ts
        return self.vnode_replay_from_ts.get(vnode, self.node_replay_from_ts)

    @cached_property
    def _by_scope(self) -> dict[tuple[int, int], int]:
        return {(s.table_id, s.vnode): s.scope_replay_from_ts for s in self.scopes}


def chain_problem(chain: list[IngestSegment]) -> str:
    """Why a scope's segment chain cannot be trusted ("" if it can)."""
    seen_unsafe = False
    opens = 0
    end_of_previous = None
    for seg in chain:
        if end_of_previous is not None and seg.first_block_id < end_of_previous:
            return f"file {seg.file_id} overlaps the blocks of the previous segment"
        end_of_previous = seg.first_block_id + seg.block_count
        if seg.kind == SegmentKind.ADMITTED and seen_unsafe:
            return f"admitted file {seg.file_id} follows an unpublished one"
        if seg.kind != SegmentKind.ADMITTED:
            seen_unsafe = True
        opens += seg.kind == SegmentKind.OPEN
        if seg.row_count < 0 or (seg.row_count and seg.min_commit_ts > seg.max_commit_ts):
            return f"file {seg.file_id} has an inverted commit-ts range"
    if opens > 1:
        return "more than one open segment"
    if chain and opens and chain[-1].kind != SegmentKind.OPEN:
        return "the open segment is not the last one"
    return ""


def earliest_unsafe_insert_ts(chain: list[IngestSegment]) -> tuple[int, bool]:
    """(earliestUnsafeInsertTs, trustworthy) of one scope's chain."""
    chain = sorted(chain, key=lambda s: s.first_block_id)
    if chain_problem(chain):
        return MIN_REPLAY_TS, False
    unsafe = [s for s in chain if s.kind != SegmentKind.ADMITTED and s.row_count > 0]
    return (min(s.min_commit_ts for s in unsafe) if unsafe else PLUS_INF), True


def derive(checkpoint_applied_ts: int, segments: Iterable[IngestSegment],
           owned_vnodes: Iterable[int], table_ids: Iterable[int]) -> ReplayStarts:
    """Replay starts of every scope of this node, every owned vnode, and the node."""
    chains: dict[tuple[int, int], list[IngestSegment]] = defaultdict(list)
    for seg in segments:
        chains[(seg.table_id, seg.vnode)].append(seg)
    vnodes = sorted(set(owned_vnodes))
    keys = {(t, v) for t in table_ids for v in vnodes} | set(chains)
    scopes = []
    per_vnode: dict[int, int] = dict.fromkeys(vnodes, checkpoint_applied_ts)
    for table_id, vnode in sorted(keys):
        unsafe_ts, trusted = earliest_unsafe_insert_ts(chains.get((table_id, vnode), []))
        start = MIN_REPLAY_TS if not trusted else min(checkpoint_applied_ts, unsafe_ts)
        scopes.append(ScopeStart(table_id, vnode, start, unsafe_ts, trusted))
        per_vnode[vnode] = min(per_vnode.get(vnode, checkpoint_applied_ts), start)
    node = min(per_vnode.values(), default=checkpoint_applied_ts)
    return ReplayStarts(checkpoint_applied_ts, tuple(scopes), per_vnode, node)
