"""Partial updates: a row given only its target columns, merged with the key's row.

A partial update (``TableUpdateData.partial_data`` / ``partial_rows_arrow``, validated
by update_record.prepare) names its target columns, the key columns among them. Inside
the apply, under the request's stream locks and admitted by the write fence, before
anything of the request is applied, :func:`fold` turns every partial update into a
replace: a DELETE of the key and an INSERT of the merged row, which the apply then
writes like any other replace (DELETE_TARGETS, REPLACE_WRITES_ONE_VERSION, the same
compensation). The merged row is the key's *base* row with the target columns set to
the values given (NULL is a value); a key with no base gets NULL outside the targets.
The stored result is always a whole row, so every reader (snapshots, AS OF, lookups,
the change feed) sees whole rows.

The base is the key's row just before the update's timestamp T, in timestamp order:
the row the request's own earlier parts left (an insert, a replace, a merged partial
update; none after a delete or a TRUNCATE of its virtual node), otherwise the row of
the key's latest version below T in the index (``RowLookup.rows_before``). A version
at exactly T is not a base: only this same update writes at T (one timestamp is one
source transaction, and a key has one net change in it), so it is a copy a retry or a
replay left, and the DELETE at T removes it.

Invariants:

* PARTIAL_BASE_IS_BEFORE_T: the base is what the key held just before T, so applying
  the same update again (a retry, a recovery replay after the index was rewound to
  below T) merges the same row: exactly once through crashes.
* PARTIAL_UPDATES_IN_TIMESTAMP_ORDER: a partial update of a key that has a version
  after T and none at T (a later write applied first) is refused FAILED_PRECONDITION with
  nothing applied: merged now, it would not reach the later row, and that row would miss
  its columns. Every writer sends a key's changes in timestamp order (the connector
  commits one micro-batch before the next; replay goes in timestamp order), so this
  refuses only a writer that does not. A version at T is this same update applied
  before (one timestamp is one transaction, one change per key in it): the later
  versions were written after it, over the row it merged, so the retry (a request
  whose answer was lost, sent again after the micro-batch's later requests) merges
  the same row again, and its new copy ends at the next version
  (SUPERSEDED_COPIES_END_AT_THE_NEXT_VERSION, update_record.py). A recovery replay is
  not checked: every write then comes from a changelog in timestamp order, and a version
  after T is a copy of a write the replay made before (a replay task retried).
* NOT_NULL_HOLDS: a key with no base gets NULL outside its targets; if such a column
  is NOT NULL, the request is refused INVALID_ARGUMENT naming the column and the key,
  with nothing of it applied (checked here, before the apply's first effect).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Protocol

import grpc
import numpy as np
import pyarrow as pa
from prometheus_client import Counter

from retina_common.catalog import TableRecord
from retina_common.codec import arrow_type
from retina_common.refusal import Refusal
from retina_server.node import RetinaNode, Stream
from retina_server.prepared_update import PartialRows, PreparedUpdate
from retina_server.primary_index import TOMBSTONE
from retina_server.row_lookup import LookupAnswer

PARTIAL_ROWS = Counter("retina_partial_update_rows_total",
                       "Partial updates merged, by where their base row came from",
                       ["base"])

# A base row of the request itself: the columns of an earlier part's inserts and the row.
_Source = tuple[list[pa.Array], int]


class BaseRows(Protocol):
    def rows_before(self, table: TableRecord, keys: list[bytes], ts: int) -> LookupAnswer:
        ...


@dataclasses.dataclass
class _RequestState:
    """What the request's parts folded so far did, per (table, virtual node)."""

    rows: dict[tuple[int, int], dict[bytes, _Source | None]] = \
        dataclasses.field(default_factory=dict)
    cleared: set[tuple[int, int]] = dataclasses.field(default_factory=set)
    written_at: dict[tuple[int, bytes], int] = dataclasses.field(default_factory=dict)
    truncated_at: dict[tuple[int, int], int] = dataclasses.field(default_factory=dict)

    def record(self, u: PreparedUpdate) -> None:
        tid, stream = u.table.table_id, (u.table.table_id, u.vnode)
        rows = self.rows.setdefault(stream, {})
        if u.truncate:
            rows.clear()
            self.cleared.add(stream)
            self.truncated_at[stream] = max(self.truncated_at.get(stream, 0), u.ts)
        for key in u.delete_keys:
            rows[key] = None
        for i, key in enumerate(u.insert_keys):
            rows[key] = (u.insert_columns, i)
        for key in (*u.delete_keys, *u.insert_keys):
            self.written_at[(tid, key)] = max(self.written_at.get((tid, key), 0), u.ts)


def fold(node: RetinaNode, updates: list[PreparedUpdate],
         streams: Mapping[tuple[int, int], Stream], base_rows: BaseRows | None, *,
         replay: bool = False) -> list[PreparedUpdate]:
    """The request's updates with every partial update folded into a replace of its
    merged row, in request order; raises Refusal (nothing applied yet) as the module
    says. ``replay``: a recovery replay's request (no order check)."""
    if not any(u.partials for u in updates):
        return updates
    if base_rows is None:
        raise RuntimeError("partial updates need the node's row reader")
    state = _RequestState()
    folded = []
    for u in updates:
        if u.partials:
            u = _fold_one(node, streams[(u.table.table_id, u.vnode)], u, base_rows, state,
                          check_order=not replay)
        state.record(u)
        folded.append(u)
    return folded


def _fold_one(node: RetinaNode, stream: Stream, u: PreparedUpdate, base_rows: BaseRows,
              state: _RequestState, check_order: bool) -> PreparedUpdate:
    table = stream.table  # the stream's schema version is u.table's or newer
    keys = [k for p in u.partials for k in p.keys]
    later: dict[int, int] = {}  # position -> the key's first version after T
    versions = node.index.primary.candidates(table.table_id, keys, u.ts, later)
    if versions is None:
        raise Refusal(grpc.StatusCode.UNAVAILABLE, "primary index backend error")
    applied = {k for k, (at, _before) in zip(keys, versions, strict=True)
               if at is not None and at != TOMBSTONE}
    # A tombstone at T: its transaction's TRUNCATE, applied by another request.
    truncated = {k for k, (at, _before) in zip(keys, versions, strict=True) if at == TOMBSTONE}
    if check_order:
        _check_order(u, [keys[i] for i in later], keys, state, applied)
    before = {k: b for k, (_at, b) in zip(keys, versions, strict=True)}
    bases, combined = _bases(table, u, keys, base_rows, state, truncated, before)
    merged: list[list[pa.Array]] = []  # per group, per column
    start = 0
    for p in u.partials:
        group_bases = bases[start:start + len(p.keys)]
        merged.append(_merge_group(table, u, p, group_bases, combined))
        start += len(p.keys)
    found = sum(b is not None for b in bases)
    PARTIAL_ROWS.labels(base="row").inc(found)
    PARTIAL_ROWS.labels(base="none").inc(len(keys) - found)
    columns = [pa.concat_arrays([g[c] for g in merged]) for c in range(len(table.columns))]
    if u.insert_keys:
        n = len(u.insert_keys)
        whole = list(u.insert_columns) + [pa.nulls(n, arrow_type(c.type))
                                          for c in table.columns[len(u.insert_columns):]]
        columns = [pa.concat_arrays([a, b]) for a, b in zip(whole, columns, strict=True)]
    return dataclasses.replace(u, table=table, delete_keys=[*u.delete_keys, *keys],
                               insert_keys=[*u.insert_keys, *keys], insert_columns=columns,
                               partials=[])


def _check_order(u: PreparedUpdate, after: list[bytes], keys: list[bytes],
                 state: _RequestState, applied: set[bytes]) -> None:
    """PARTIAL_UPDATES_IN_TIMESTAMP_ORDER, against the index (``after``: keys with a
    version after T; ``applied``: keys with a row at T) and the request's earlier parts
    (none after T)."""
    tid = u.table.table_id
    later = [k for k in after if k not in applied]
    later += [k for k in keys if state.written_at.get((tid, k), 0) > u.ts]
    if state.truncated_at.get((tid, u.vnode), 0) > u.ts:
        later += keys[:1]
    if later:
        raise Refusal(grpc.StatusCode.FAILED_PRECONDITION,
                      f"{u.table.name}: a partial update at timestamp {u.ts} of key "
                      f"{later[0].hex()}, which has a write after it already "
                      f"(PARTIAL_UPDATES_IN_TIMESTAMP_ORDER): send a key's changes in "
                      "timestamp order; nothing was applied")


def _bases(table: TableRecord, u: PreparedUpdate, keys: list[bytes], base_rows: BaseRows,
           state: _RequestState, truncated: set[bytes], before: dict[bytes, int | None]
           ) -> tuple[list[int | None], list[pa.Array]]:
    """Per key, its base row's place in ``combined`` (None: no base); ``combined`` holds,
    per column some group does not target, the base rows read from the index and files,
    then those of the request's earlier parts. ``truncated``: keys with a tombstone at T,
    the TRUNCATE of the update's own transaction sent in another request: no base
    either. ``before``: each key's latest version below T; one that names a row the read
    did not find (an orphan: its file is gone) is refused FAILED_PRECONDITION rather than
    merged as no row, which would put NULL where the row had values."""
    stream = (table.table_id, u.vnode)
    needed = [any(c not in p.targets for p in u.partials) for c in range(len(table.columns))]
    if u.truncate:  # the update's own TRUNCATE applies first: no key has a row
        return [None] * len(keys), [pa.nulls(0, arrow_type(c.type)) for c in table.columns]
    earlier = state.rows.get(stream, {})
    cleared = stream in state.cleared
    stored = [k for k in keys if k not in earlier and k not in truncated] if not cleared \
        else []
    answer = base_rows.rows_before(table, stored, u.ts) if stored else None
    rank: dict[bytes, int] = {}
    if answer is not None:
        ranks = np.cumsum(answer.found) - 1
        rank = {k: int(r) for k, f, r in zip(stored, answer.found.tolist(), ranks.tolist(),
                                             strict=True) if f}
    lost = [k for k in stored if k not in rank and before[k] not in (None, TOMBSTONE)]
    if lost:
        raise Refusal(grpc.StatusCode.FAILED_PRECONDITION,
                      f"{table.name}: key {lost[0].hex()} has a version below {u.ts} whose "
                      f"row this node cannot read (row id {before[lost[0]]}: an orphan); a "
                      "partial update is not merged without its row; nothing was applied")
    n_stored = 0 if answer is None else answer.rows.num_rows
    extra: list[_Source] = []
    bases: list[int | None] = []
    for key in keys:
        if key in earlier:
            source = earlier[key]
            if source is None:
                bases.append(None)
            else:
                bases.append(n_stored + len(extra))
                extra.append(source)
        else:
            bases.append(rank.get(key))
    combined: list[pa.Array] = []
    for c, column in enumerate(table.columns):
        kind = arrow_type(column.type)
        if not needed[c]:  # every group sets it: no base value is read
            combined.append(pa.nulls(0, kind))
            continue
        parts: list[pa.Array] = []
        if answer is not None:
            parts.append(answer.rows.column(c).combine_chunks())
        parts += [cols[c].slice(i, 1) if c < len(cols) else pa.nulls(1, kind)
                  for cols, i in extra]
        combined.append(pa.concat_arrays(parts) if parts else pa.nulls(0, kind))
    return bases, combined


def _merge_group(table: TableRecord, u: PreparedUpdate, p: PartialRows,
                 bases: list[int | None], combined: list[pa.Array]) -> list[pa.Array]:
    """The merged rows of one group, a whole row each (NOT_NULL_HOLDS checked)."""
    missing = [i for i, b in enumerate(bases) if b is None]
    take = pa.array(bases, pa.int64())
    out = []
    for c, column in enumerate(table.columns):
        if c in p.targets:
            out.append(p.columns[p.targets.index(c)])
            continue
        if missing and not column.accepts_null:
            raise Refusal(grpc.StatusCode.INVALID_ARGUMENT,
                          f"{u.table.name}: a partial update inserts key "
                          f"{p.keys[missing[0]].hex()} (it has no row) without NOT NULL "
                          f"column {column.name} among its targets; nothing was applied")
        out.append(combined[c].take(take))
    return out
