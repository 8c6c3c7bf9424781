"""ReadChanges on one node: every change of a table committed in ``(from_ts, to_ts]``.

The feed is derived from what the node already stores, with no change log of its own
(docs/change-feed.md, "Why derived"):

* an INSERT is a row whose ``_commit_ts`` is in the range: every row carries it, in a
  write-buffer block, an ingest file and a Storage GC output alike; a row in its row
  group's base bitmap although committed after the base (hidden by a recovery's rewind:
  cleansing.py) was in no snapshot and is none;
* a DELETE is a deletion-chain item ``(row, ts)`` in the range (visibility.py keeps every
  delete above a row group's base, in memory and in checkpoints); its before image is the
  deleted row itself, still in its file;
* an UPDATE is a DELETE and an INSERT of the same key at the same timestamp in the same
  virtual node (a replace: update_record.py applies the DELETE first): ``update_before``
  is the deleted row, ``update_after`` the inserted one. Equal images mean the update
  changed nothing: it is dropped unless the reader keeps such updates.

Invariants (docs/change-feed.md):

* FEED_IS_HISTORY: the changes of ``(a, b]`` are exactly the difference between the node's
  snapshot at ``a`` and its snapshot at ``b``, commit by commit: applying the changes of
  each commit ``t`` to the snapshot before it gives the snapshot at ``t``. A row inserted
  and deleted at one timestamp was in no snapshot and is no change. Storage GC, sweeps,
  reverts and recovery move rows or rebuild state without changing any snapshot, so they
  emit nothing, and a replayed commit is where the snapshot has it: once, at its own
  timestamp.
* FEED_READS_ABOVE_BASE: the range is read only when its start is at or above every row
  group's base (NO_READ_BELOW_FOLD), else refused ``changes_expired`` naming the earliest
  cursor this node answers. The caller holds the range with a read transaction whose
  snapshot is at or below ``a`` (``hold_trans_id``), so no fold or rewrite passes ``a``
  while it reads; a file Storage GC dropped whole held only rows deleted at or below its
  cutoff, which the hold keeps below ``a``.
* COMMITS_WHOLE: the changes of one commit timestamp go out in one message, whatever the
  page size.
* FEED_SEES_NO_MOVE: a read that a move ran through (a Storage GC commit, a rollback, a
  revert, a sweep: RowMoves) is read again, as point lookups are.
* EVERY_VNODE_IS_READ: every virtual node asked is read from its registered files, and
  from its write buffer when it has one. A Stream (and so its buffer) is created by the
  stream's first write: after a restart, a virtual node no write reached yet has none,
  while its published files hold its history. (Iterating the node's Streams instead left
  such a virtual node's commits out until its next write, and a range read again then
  gave more.) A stream created while the feed reads holds writes above ``to_ts`` only:
  the write fence was raised to ``to_ts`` first.

The order within a commit on one virtual node is the stream's: the deletes that pair with
no insert in the stream order of their rows, then the inserts in the order they were
appended, an update's before image right before its after image. ``_seq`` numbers them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import grpc
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from prometheus_client import Counter as MetricCounter
from prometheus_client import Histogram

from retina_common.catalog import TableRecord
from retina_common.codec import COMMIT_TS, encode_primary_keys
from retina_common.pb import retina_pb2 as pb
from retina_common.refusal import Refusal, changes_expired
from retina_common.schema_evolution import table_schema
from retina_server.node import RetinaNode, Stream
from retina_server.row_gather import RowGroupRows, assemble
from retina_server.row_lookup import LookupInconsistent, ReadMemo, RowLookup, asked_columns

CHANGE_TYPE, CHANGE_TS, VNODE, SEQ, SOURCE_POSITION = (
    "_change_type", "_commit_ts", "_vnode", "_seq", "_source_position")
INSERT, UPDATE_BEFORE, UPDATE_AFTER, DELETE = (
    "insert", "update_before", "update_after", "delete")
DEFAULT_PAGE_CHANGES = 10_000
MAX_PAGE_CHANGES = 1_000_000

SERVED = MetricCounter("retina_changes_served_total", "Changes sent by ReadChanges",
                       ["change_type"])
UNCHANGED = MetricCounter("retina_changes_unchanged_updates_total",
                          "Updates ReadChanges left out because they changed no column")
SECONDS = Histogram("retina_changes_read_seconds", "ReadChanges: time to derive a range",
                    buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1, 5))
REREADS = MetricCounter("retina_changes_rereads_total",
                        "ReadChanges reads repeated because rows moved meanwhile (RowMoves)")

# A source position: ts -> the position of the commit at ts (source_positions.py).
Positions = Callable[[Sequence[int]], dict[int, str]]


def no_positions(_ts: Sequence[int]) -> dict[int, str]:
    return {}


def _invalid(message: str) -> Refusal:
    return Refusal(grpc.StatusCode.INVALID_ARGUMENT, message)


@dataclass(frozen=True)
class ChangesRequest:
    """A validated ReadChanges request."""

    table: TableRecord
    columns: list[str]  # the output's row columns: the key, then the others asked for
    from_ts: int
    to_ts: int
    keep_unchanged: bool
    page_changes: int
    vnodes: frozenset[int]  # the virtual nodes read (every one of this node's)


def prepare(node: RetinaNode, request: pb.ReadChangesRequest) -> ChangesRequest:
    """Validate the whole request (the transactions are the service's to check); raises
    Refusal (or NotFound), changes nothing."""
    if not request.schema_name or not request.table_name:
        raise _invalid("schema_name and table_name are required")
    if request.from_ts < 0 or request.to_ts < request.from_ts:
        raise _invalid(f"the range ({request.from_ts}, {request.to_ts}] is not a range: "
                       "0 <= from_ts <= to_ts")
    if not 0 <= request.page_changes <= MAX_PAGE_CHANGES:
        raise _invalid(f"page_changes must be 0 (the default) to {MAX_PAGE_CHANGES}")
    table = node.table(request.schema_name, request.table_name)  # NOT_FOUND if unknown
    table, asked = asked_columns(node, table, list(request.columns))
    columns = [*table.primary_key, *(c for c in asked if c not in table.primary_key)]
    vnodes = frozenset(request.virtual_nodes) or node.owned_vnodes
    foreign = sorted(vnodes - node.owned_vnodes)
    if foreign:
        raise Refusal(grpc.StatusCode.FAILED_PRECONDITION,
                      f"virtual node(s) {foreign} are not {node.node_id}'s (it has "
                      f"{sorted(node.owned_vnodes)}): ask their owners")
    return ChangesRequest(table, columns, request.from_ts, request.to_ts,
                          request.keep_unchanged_updates,
                          request.page_changes or DEFAULT_PAGE_CHANGES, vnodes)


@dataclass
class _Side:
    """The rows of one kind (deleted or inserted) a stream's range touched: per decoded
    unit, the row offsets; per row, its change timestamp and stream position."""

    units: list[tuple[RowGroupRows, np.ndarray]] = field(default_factory=list)
    ts: list[np.ndarray] = field(default_factory=list)
    vnode: list[np.ndarray] = field(default_factory=list)
    block: list[np.ndarray] = field(default_factory=list)  # the file's first block id
    rg: list[np.ndarray] = field(default_factory=list)
    row: list[np.ndarray] = field(default_factory=list)

    def add(self, rows: RowGroupRows, at: np.ndarray, ts: np.ndarray, vnode: int,
            first_block: int, rg_id: int, offsets: np.ndarray) -> None:
        self.units.append((rows, at))
        self.ts.append(ts)
        self.vnode.append(np.full(len(at), vnode, np.int64))
        self.block.append(np.full(len(at), first_block, np.int64))
        self.rg.append(np.full(len(at), rg_id, np.int64))
        self.row.append(offsets)

    def arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """(ts, virtual node, first block id, rg id, row offset) per row."""
        def joined(parts: list[np.ndarray]) -> np.ndarray:
            return np.concatenate(parts).astype(np.int64) if parts else np.empty(0, np.int64)
        return (joined(self.ts), joined(self.vnode), joined(self.block), joined(self.rg),
                joined(self.row))


class ChangeFeed:
    def __init__(self, node: RetinaNode, rows: RowLookup, positions: Positions = no_positions,
                 *, settle_timeout_s: float = 5.0, attempts: int = 20) -> None:
        self._node = node
        self._rows = rows  # the point reader's files and decoded-row cache, shared
        self._positions = positions
        self._settle_timeout_s = settle_timeout_s
        self._attempts = attempts

    def read(self, request: ChangesRequest) -> pa.Table:
        """Every change of ``request``'s range on this node, in (commit ts, virtual node,
        seq) order (the caller admitted the read: READY, live transactions, the write
        fence raised to ``to_ts``, the range held)."""
        with SECONDS.time():
            # FEED_SEES_NO_MOVE
            return self._node.row_moves.read_unmoved(
                lambda: self._read(request), REREADS.inc,
                settle_timeout_s=self._settle_timeout_s, attempts=self._attempts)

    def _read(self, request: ChangesRequest) -> pa.Table:
        # EVERY_VNODE_IS_READ: not only the virtual nodes that have a Stream in this process.
        streams = {s.vnode: s for s in self._node.streams_of_table(request.table.table_id)}
        deleted, inserted = _Side(), _Side()
        for vnode in sorted(request.vnodes):
            self._stream_rows(request, vnode, streams.get(vnode), deleted, inserted)
        # One derivation for every virtual node: a poll's fixed cost once, not per stream.
        table = _changes(request, deleted, inserted)
        return self._with_positions(table) if table.num_rows else table

    def _with_positions(self, table: pa.Table) -> pa.Table:
        stamps = table.column(CHANGE_TS).to_numpy()
        known = self._positions(np.unique(stamps).tolist())
        if not known:
            return table
        values = pa.array([known.get(t) for t in stamps.tolist()], pa.string())
        return table.set_column(table.schema.get_field_index(SOURCE_POSITION),
                                SOURCE_POSITION, values)

    # --- one stream ---------------------------------------------------------------------------
    def _stream_rows(self, request: ChangesRequest, vnode: int, stream: Stream | None,
                     deleted: _Side, inserted: _Side) -> None:
        """Add the rows the range deleted and inserted in the stream (table, ``vnode``) to
        ``deleted`` and ``inserted``; ``stream``: its write buffer, None when it has none
        in this process (no write reached it since the start)."""
        low, high = request.from_ts, request.to_ts
        memo = ReadMemo()
        table_id = request.table.table_id
        for file_id, first_block, lo_ts, hi_ts, rg_ids in self._files(table_id, vnode, stream):
            may_insert = lo_ts is not None and hi_ts is not None and hi_ts > low \
                and lo_ts <= high
            for rg_id in rg_ids:
                visibility = self._node.rg_visibility(file_id, rg_id)
                dels = visibility.deletes_between(low, high)
                if dels is None:  # FEED_READS_ABOVE_BASE
                    base = visibility.base_timestamp
                    raise changes_expired(
                        f"changes above {low} of {request.table.name}: file {file_id} row "
                        f"group {rg_id} on {self._node.node_id} folded its deletes up to "
                        f"{base} together", base)
                if not dels and not may_insert:
                    continue
                found = self._rows.row_group(table_id, file_id, rg_id, memo)
                if found is None:
                    raise LookupInconsistent(f"file {file_id} row group {rg_id} is served "
                                             "but has no rows to read")
                rows = found[1]
                first, count = rows.start(rg_id)
                if dels:
                    offsets = np.fromiter((r for r, _t in dels), np.int64, len(dels))
                    if int(offsets.max()) >= count:
                        raise LookupInconsistent(f"a delete names row {int(offsets.max())} "
                                                 f"of file {file_id} row group {rg_id}, "
                                                 f"which has {count} rows")
                    stamps = np.fromiter((t for _r, t in dels), np.int64, len(dels))
                    deleted.add(rows, first + offsets, stamps, vnode, first_block, rg_id,
                                offsets)
                if may_insert:
                    committed = rows.commit_ts[first:first + count]
                    offsets = np.flatnonzero((committed > low) & (committed <= high))
                    # Rows the rewind hid (in the base, committed after it) were in no
                    # snapshot: their replayed copies are the inserts.
                    offsets = offsets[~visibility.in_base(offsets)]
                    if len(offsets):
                        inserted.add(rows, first + offsets, committed[offsets], vnode,
                                     first_block, rg_id, offsets.astype(np.int64))

    def _files(self, table_id: int, vnode: int, stream: Stream | None
               ) -> list[tuple[int, int, int | None, int | None, list[int]]]:
        """(file id, first block id, min and max commit ts, row group ids) of every file
        of the stream (table_id, vnode): its write-buffer files first, if it has a buffer
        (read before the registry: a file is registered before it leaves the buffer, so
        none is missed), then its published ones."""
        files: list[tuple[int, int, int | None, int | None, list[int]]] = []
        if stream is not None:
            buffer = stream.buffer
            with buffer.lock:
                files = [(f.file_id, f.first_block_id, f.min_commit_ts, f.max_commit_ts,
                          list(range(len(f.blocks)))) for f in buffer.files]
        seen = {f[0] for f in files}
        for meta in self._node.registry.stream_files(table_id, vnode):
            if meta.file_id not in seen:
                files.append((meta.file_id, meta.first_block_id, meta.file_min_commit_ts,
                              meta.file_max_commit_ts,
                              self._node.visibility.row_groups(meta.file_id)))
        return files



def _changes(request: ChangesRequest, deleted: _Side, inserted: _Side) -> pa.Table:
    """The changes of the streams read, numbered (FEED_IS_HISTORY, the module docstring's
    order), in (commit ts, virtual node, seq) order. Vectorised: a range of 100,000
    changes costs no Python step per change, and the virtual nodes are derived together
    (a row's place is (virtual node, first block id, rg id, row): block ids are per
    stream)."""
    schema = output_schema(request.table, tuple(request.columns))
    d_ts, d_vn, d_block, d_rg, d_row = deleted.arrays()
    i_ts, i_vn, i_block, i_rg, i_row = inserted.arrays()
    if not len(d_ts) and not len(i_ts):
        return schema.empty_table()
    full = _full_schema(request.table)
    images = pa.concat_tables([assemble(full, deleted.units), assemble(full, inserted.units)])
    nd = len(d_ts)
    codes = _key_codes(request.table, images)
    d_code, i_code = codes[:nd], codes[nd:]
    # A row inserted and deleted at one timestamp was in no snapshot: no change (a row is
    # at most once on each side: one chain item, one insert).
    still_d, still_i = _matches((d_vn, d_block, d_rg, d_row, d_ts),
                                (i_vn, i_block, i_rg, i_row, i_ts))
    d_live = np.ones(nd, bool)
    d_live[still_d] = False
    i_live = np.ones(len(i_ts), bool)
    i_live[still_i] = False
    d_idx, i_idx = np.flatnonzero(d_live), np.flatnonzero(i_live)
    # An update: a delete and an insert of one key at one timestamp (once each, the
    # stillborn rows left out).
    pd, pi = _matches((d_ts[d_idx], d_vn[d_idx], d_code[d_idx]),
                      (i_ts[i_idx], i_vn[i_idx], i_code[i_idx]))
    pair_d, pair_i = d_idx[pd], i_idx[pi]
    if len(pair_d) and not request.keep_unchanged:
        same = _unchanged(images, pair_d, nd + pair_i)
        UNCHANGED.inc(int(same.sum()))
    else:
        same = np.zeros(len(pair_d), bool)
    paired_d = np.zeros(nd, bool)
    paired_d[pair_d] = True
    paired_i = np.zeros(len(i_ts), bool)
    paired_i[pair_i] = True
    lone_d = np.flatnonzero(d_live & ~paired_d)
    lone_i = np.flatnonzero(i_live & ~paired_i)
    up_d, up_i = pair_d[~same], pair_i[~same]
    # Entries: (ts, vnode, phase, block, rg, row, sub) order; phase 0: a delete that pairs
    # with no insert; 1: an insert, or an update at its insert's place (before, then after).
    parts = [
        (d_ts[lone_d], d_vn[lone_d], 0, d_block[lone_d], d_rg[lone_d], d_row[lone_d], 0,
         DELETE, lone_d),
        (i_ts[lone_i], i_vn[lone_i], 1, i_block[lone_i], i_rg[lone_i], i_row[lone_i], 0,
         INSERT, nd + lone_i),
        (i_ts[up_i], i_vn[up_i], 1, i_block[up_i], i_rg[up_i], i_row[up_i], 0,
         UPDATE_BEFORE, up_d),
        (i_ts[up_i], i_vn[up_i], 1, i_block[up_i], i_rg[up_i], i_row[up_i], 1,
         UPDATE_AFTER, nd + up_i),
    ]
    n = sum(len(p[0]) for p in parts)
    if not n:
        return schema.empty_table()
    ts, vn, phase, block, rg, row, sub, image = (np.concatenate(
        [np.broadcast_to(np.asarray(p[k], np.int64), len(p[0])) for p in parts])
        for k in (0, 1, 2, 3, 4, 5, 6, 8))
    kind = np.concatenate([np.full(len(p[0]), j, np.int8) for j, p in enumerate(parts)])
    order = np.lexsort((sub, row, rg, block, phase, vn, ts))
    counts = np.bincount(kind, minlength=len(parts))
    for j, p in enumerate(parts):
        if counts[j]:
            SERVED.labels(change_type=p[7]).inc(int(counts[j]))
    names = pa.array([p[7] for p in parts], pa.string())
    return _numbered(schema, images, ts[order], vn[order], image[order],
                     pa.DictionaryArray.from_arrays(pa.array(kind[order]), names))


def _matches(left: tuple[np.ndarray, ...], right: tuple[np.ndarray, ...]
             ) -> tuple[np.ndarray, np.ndarray]:
    """(indices into ``left``, indices into ``right``) of the tuples (one array per field)
    found on both sides; each tuple is at most once on each side."""
    if not len(left[0]) or not len(right[0]):
        return np.empty(0, np.int64), np.empty(0, np.int64)
    fields = [np.concatenate([a, b]) for a, b in zip(left, right, strict=True)]
    side = np.concatenate([np.zeros(len(left[0]), np.int8), np.ones(len(right[0]), np.int8)])
    index = np.concatenate([np.arange(len(left[0])), np.arange(len(right[0]))])
    order = np.lexsort((side, *reversed(fields)))
    same = np.ones(len(order) - 1, bool)
    for f in fields:
        same &= f[order[1:]] == f[order[:-1]]
    # Side 0 sorts first among equal tuples: a match is a left one followed by a right one.
    same &= (side[order[:-1]] == 0) & (side[order[1:]] == 1)
    first = np.flatnonzero(same)
    return index[order[first]], index[order[first + 1]]


def _numbered(schema: pa.Schema, images: pa.Table, stamps: np.ndarray, vnodes: np.ndarray,
              image: np.ndarray, kinds: pa.DictionaryArray) -> pa.Table:
    """The changes as the output table; ``_seq`` numbers each commit's changes on each
    virtual node from 0."""
    n = len(stamps)
    new_part = np.empty(n, bool)
    new_part[:1] = True
    np.not_equal(stamps[1:], stamps[:-1], out=new_part[1:])
    new_part[1:] |= vnodes[1:] != vnodes[:-1]
    starts = np.maximum.accumulate(np.where(new_part, np.arange(n), 0))
    seq = np.arange(n) - starts
    rows = images.take(pa.array(image, pa.int64()))
    head = [kinds.cast(pa.string()), pa.array(stamps), pa.array(vnodes.astype(np.int32)),
            pa.array(seq.astype(np.int64)), pa.nulls(n, pa.string())]
    names = schema.names[len(head):]
    return pa.Table.from_arrays([*head, *(rows.column(c) for c in names)], schema=schema)


def _key_codes(table: TableRecord, images: pa.Table) -> np.ndarray:
    """A number per image: equal exactly when the primary-key bytes are equal."""
    by_name = {c.name: c.type for c in table.columns}
    key_columns = [images.column(k).combine_chunks() for k in table.primary_key]
    keys = encode_primary_keys([by_name[k] for k in table.primary_key], key_columns)
    encoded = pc.dictionary_encode(keys)
    return np.asarray(encoded.indices.to_numpy(zero_copy_only=False), np.int64)


def _unchanged(images: pa.Table, before: np.ndarray, after: np.ndarray) -> np.ndarray:
    """Per pair of images, whether they are equal in every column (NULL equals NULL)."""
    x_rows = images.take(pa.array(before, pa.int64()))
    y_rows = images.take(pa.array(after, pa.int64()))
    same = np.ones(len(before), bool)
    for name in images.column_names:
        x, y = x_rows.column(name), y_rows.column(name)
        equal = pc.fill_null(pc.equal(x, y), False)
        both_null = pc.and_(pc.is_null(x), pc.is_null(y))
        same &= np.asarray(pc.or_(equal, both_null).to_numpy(zero_copy_only=False), bool)
    return same


def _full_schema(table: TableRecord) -> pa.Schema:
    full = table_schema(table)
    return full.remove(full.get_field_index(COMMIT_TS))


def output_schema(table: TableRecord, columns: tuple[str, ...]) -> pa.Schema:
    """The changes' schema: the change columns, then the row columns asked for."""
    full = table_schema(table)
    return pa.schema([pa.field(CHANGE_TYPE, pa.string(), nullable=False),
                      pa.field(CHANGE_TS, pa.int64(), nullable=False),
                      pa.field(VNODE, pa.int32(), nullable=False),
                      pa.field(SEQ, pa.int64(), nullable=False),
                      pa.field(SOURCE_POSITION, pa.string()),
                      *(full.field(c) for c in columns)])


def pages(changes: pa.Table, page_changes: int, to_ts: int) -> Iterator[tuple[pa.Table, int]]:
    """(page, through_ts): whole commits of up to ``page_changes`` changes each (one commit
    larger than that alone; COMMITS_WHOLE), the last page through ``to_ts`` (empty if no
    change is left)."""
    stamps = changes.column(CHANGE_TS).to_numpy() if changes.num_rows else np.empty(0, np.int64)
    start, n = 0, len(stamps)
    while start < n:
        end = min(start + page_changes, n)
        if end < n and stamps[end] == stamps[end - 1]:
            commit_end = int(np.searchsorted(stamps, stamps[end - 1], side="right"))
            commit_start = int(np.searchsorted(stamps, stamps[end - 1], side="left"))
            end = commit_start if commit_start > start else commit_end
        if end >= n:
            break
        yield changes.slice(start, end - start), int(stamps[end - 1])
        start = end
    yield changes.slice(start, n - start), to_ts
