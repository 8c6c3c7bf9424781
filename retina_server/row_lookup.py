"""LookupRows on one node: the rows of given primary keys at a gated snapshot S.

A key's answer is read point-wise, in this order, each step from one structure:

1. the primary index: the key's latest version at or before S
   (``PrimaryIndex.latest``); none, or a tombstone, and the key has no row at S;
2. the MainIndex: where that row id lives (file, row group, offset); nowhere, and
   the version is an orphan (its row is outside the node's files): no row, as
   resolvePrimary answers;
3. the file: a write-buffer file (its rows in memory), a registered file, or one a
   Storage GC swap replaced or staged (``VisibilityIndex.readable``; read from
   storage through the :class:`RowGroupCache`); none of them, and the version is
   an orphan;
4. the row group's visibility at S: a row deleted at S is no row; and the row's
   ``_commit_ts`` is at or before S.

LOOKUP_EQUALS_SNAPSHOT: a key's answer at S is the row the gated snapshot read at S
holds for that key, or none when it holds none. Why it holds:

* The service answers only a live read transaction whose snapshot is S or later,
  below no read floor, and raises the write fence to S first (as GetWriteBuffer
  does): every write at or below S has finished and none can come, so the
  versions at or below S, the rows they name and their deletes at or below S are
  final, and a write above S only adds versions and deletes above S, which no step
  reads.
* The index answers S exactly: every INSERT writes a version, every DELETE (and
  TRUNCATE) a tombstone, and a replace's INSERT supersedes its DELETE, so a key's
  latest version at or before S names the row it has at S. Version pruning keeps
  every answer at or above its horizon (PRUNE_KEEPS_ANSWERS_ABOVE_HORIZON): S
  below the horizon is refused, FAILED_PRECONDITION ``snapshot_expired``.
* Steps 2 to 4 check what the snapshot read checks: the row's file is one the
  node serves, the row is not deleted at S, it was committed at or before S. A
  row group whose visibility was folded above S cannot say what S saw: refused,
  ``snapshot_expired``.
* Rows that move while a lookup reads (a Storage GC commit or rollback, a revert,
  a sweep) could pair a version of one moment with a location or visibility of
  another; RowMoves tells, and the lookup reads again (ROW_READS_SEE_NO_MOVE).
* The service refuses while the node is not READY, and refuses an answer when the
  node stopped being READY while it was read (it failed closed).

Costs: one LMDB read transaction per request and three cursor steps per key (in key
order); one vectorised MainIndex lookup; one visibility check per row group touched;
one commit-timestamp check and one numpy gather per column per decode unit touched (a
published file's span of row groups, SPAN_ROWS, or a write-buffer block). A span is
decoded once into the cache and read from memory after that.
"""

from __future__ import annotations

import functools
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import grpc
import numpy as np
import pyarrow as pa
from prometheus_client import Counter, Histogram

from retina_common.catalog import Catalog, TableRecord
from retina_common.codec import EncodingError, encode_primary_keys, primary_key_problem
from retina_common.columnar import ColumnarError, decode_key_columns, row_count
from retina_common.log import get_logger
from retina_common.pb import retina_pb2 as pb
from retina_common.refusal import Refusal, snapshot_expired
from retina_common.schema_evolution import table_schema
from retina_common.storage import open_parquet
from retina_server.node import RetinaNode
from retina_server.row_gather import RowGroupRows, assemble, assemble_few
from retina_server.row_group_cache import RowGroupCache
from retina_server.row_moves import MovesInProgress
from retina_server.visibility import RGVisibility
from retina_server.write_buffer import Block, FileState, IngestFile

log = get_logger(component="row_lookup")
# Answers of up to this many rows are built from Arrow slices, larger ones with numpy
# gathers (row_gather.py): each way is the cheaper one on its side.
FEW_ROWS = 8

KEYS = Counter("retina_lookup_keys_total", "Keys answered by LookupRows", ["outcome"])
FOUND, NOT_FOUND = KEYS.labels(outcome="found"), KEYS.labels(outcome="not_found")
REREADS = Counter("retina_lookup_rereads_total",
                  "LookupRows reads repeated because rows moved meanwhile (RowMoves)")
SECONDS = Histogram("retina_lookup_seconds", "LookupRows latency on the node",
                    buckets=(0.0002, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.1, 1))


class LookupInconsistent(Exception):
    """The node's structures disagree about a row (a bug): refused, never answered."""

    grpc_status = grpc.StatusCode.INTERNAL


def _invalid(message: str) -> Refusal:
    return Refusal(grpc.StatusCode.INVALID_ARGUMENT, message)


@dataclass(frozen=True)
class LookupRequest:
    """A validated LookupRows request."""

    table: TableRecord
    keys: list[bytes]
    columns: list[str]  # in the order asked
    ts: int


@dataclass(frozen=True)
class LookupAnswer:
    found: np.ndarray  # bool per key, in request order
    commit_ts: np.ndarray  # int64 per key: its row's commit timestamp (0: not found)
    rows: pa.Table  # the found keys' rows, in request order: the asked columns


# --- validation ------------------------------------------------------------------------------
def prepare(node: RetinaNode, request: pb.LookupRowsRequest, max_keys: int) -> LookupRequest:
    """Validate the whole request; raises Refusal (or NotFound), changes nothing."""
    if not request.schema_name or not request.table_name:
        raise _invalid("schema_name and table_name are required")
    if request.timestamp <= 0:
        raise _invalid("timestamp must be the positive snapshot of the read transaction")
    table = node.table(request.schema_name, request.table_name)  # NOT_FOUND if unknown
    table, columns = asked_columns(node, table, list(request.columns))
    if request.keys and request.key_columns_arrow:
        raise _invalid("give the keys either as keys or as key_columns_arrow, not both")
    try:  # counted before anything is decoded
        count = len(request.keys) + row_count(request.key_columns_arrow, "key_columns_arrow")
    except ColumnarError as exc:
        raise _invalid(f"{table.name}: {exc}") from None
    if count > max_keys:
        raise _invalid(f"the request carries {count} keys; the limit is {max_keys}")
    keys = _keys(table, request)
    _check_owned(node, keys)
    return LookupRequest(table, keys, columns, request.timestamp)


def asked_columns(node: RetinaNode, table: TableRecord,
                  wanted: list[str]) -> tuple[TableRecord, list[str]]:
    """The asked columns (empty: every column), each a column of the table; a name the
    cached table lacks re-reads it once (a column may have been added)."""
    names = [c.name for c in table.columns]
    if not wanted:
        return table, names
    if len(set(wanted)) != len(wanted):
        raise _invalid(f"a column is asked for twice: {wanted}")
    if not set(wanted) <= set(names):
        table = node.refresh_table(table.schema_name, table.name)
        names = [c.name for c in table.columns]
    unknown = [c for c in wanted if c not in names]
    if unknown:
        raise _invalid(f"{table.name} has no column(s) {', '.join(unknown)} "
                       f"(columns: {', '.join(names)})")
    return table, wanted


def _keys(table: TableRecord, request: pb.LookupRowsRequest) -> list[bytes]:
    by_name = {c.name: c.type for c in table.columns}
    types = [by_name[c] for c in table.primary_key]
    if request.key_columns_arrow:
        try:
            columns = decode_key_columns(request.key_columns_arrow, table)
            return encode_primary_keys(types, columns).to_pylist()
        except (ColumnarError, EncodingError) as exc:
            raise _invalid(f"{table.name}: {exc}") from None
    keys = list(request.keys)
    problem = primary_key_problem(types, keys)
    if problem is not None:
        i, what = problem
        shape = ", ".join(f"{c} {t}" for c, t in zip(table.primary_key, types, strict=True))
        raise _invalid(f"{table.name}: key {i} is not a primary key ({shape}): {what}")
    return keys


def _check_owned(node: RetinaNode, keys: Sequence[bytes]) -> None:
    """Every key routes to a virtual node of this node: another node holds the rows of
    any other key, and answering "not found" for it would be wrong."""
    route, owned = node.topology.vnode_of_key, node.owned_vnodes
    if len(owned) == node.topology.virtual_nodes:
        return  # a node that owns every virtual node holds every key
    for i, key in enumerate(keys):
        vnode = route(key)
        if vnode not in owned:
            raise Refusal(grpc.StatusCode.FAILED_PRECONDITION,
                          f"key {i} routes to virtual node {vnode}, which belongs to "
                          f"{node.topology.node_of_vnode(vnode)}, not {node.node_id}; send "
                          "each key to its owner (retina_common.lookup routes them)")


# --- reading ---------------------------------------------------------------------------------
# A published file is decoded in spans of consecutive row groups of up to this many rows
# (an ingest file's four blocks are one span): a batch of keys costs one gather per span
# it touches, and one span is as much as a single lookup decodes.
SPAN_ROWS = 16_384


@dataclass(frozen=True)
class PublishedFile:
    """Where a published file's object is, and its decode spans."""

    uri: str
    name: str
    spans: tuple[dict[int, int], ...]  # per span: rg id -> rows, in file order
    span_of: tuple[int, ...]  # per rg id: its span


def spans_of(counts: list[int], span_rows: int = SPAN_ROWS) -> tuple[dict[int, int], ...]:
    """Consecutive row groups, each span at most ``span_rows`` rows (or one row group)."""
    spans: list[dict[int, int]] = []
    rows = span_rows
    for rg, count in enumerate(counts):
        if rows + count > span_rows:
            spans.append({})
            rows = 0
        spans[-1][rg] = count
        rows += count
    return tuple(spans)


class FileLocations:
    """Published files by id, from the catalog and their footer once per file (a file id
    never names another object)."""

    def __init__(self, catalog: Catalog) -> None:
        self._catalog = catalog
        self._files: dict[int, PublishedFile] = {}
        self._paths: dict[int, str] = {}  # path id -> uri

    def of(self, table_id: int, file_id: int) -> PublishedFile:
        known = self._files.get(file_id)
        if known is not None:
            return known
        record = self._catalog.get_file(file_id)
        if record is None:
            raise LookupInconsistent(f"file {file_id} is served but not in the catalog")
        uri = self._paths.get(record.path_id)
        if uri is None:
            self._paths.update({p.path_id: p.uri for p in self._catalog.get_paths(table_id)})
            uri = self._paths[record.path_id]
        meta = open_parquet(uri, record.name).metadata
        spans = spans_of([meta.row_group(i).num_rows for i in range(meta.num_row_groups)])
        span_of = tuple(n for n, span in enumerate(spans) for _rg in span)
        self._files[file_id] = PublishedFile(uri, record.name, spans, span_of)
        return self._files[file_id]

    def forget(self, file_ids: list[int]) -> None:
        for file_id in file_ids:
            self._files.pop(file_id, None)


class GrowingBlocks:
    """The rows of write-buffer blocks still growing, each kept as one table that grows
    with its block: a reader polling a stream (a change-feed follower, several times a
    second) decodes only the batches appended since it last looked, not again a block's
    hundreds of one-row batches (a CDC transaction's part of a virtual node). A block's
    batches are only ever appended to, so the first ``n`` of them never change. The
    ``limit`` newest blocks are kept: a block that stopped growing is read from the
    row-group cache instead, and its entry ages out."""

    def __init__(self, limit: int = 256) -> None:
        self._limit = limit
        self._lock = threading.Lock()
        self._tables: OrderedDict[tuple[int, int], tuple[int, pa.Table]] = OrderedDict()

    def rows(self, file_id: int, block: Block) -> pa.Table:
        """Every row appended to ``block`` so far (visible or not: the caller slices)."""
        key = (file_id, block.rg_id)
        with self._lock:
            count, table = self._tables.get(key, (0, None))
        if table is not None and count == len(block.batches):
            return table  # nothing appended since: no copy of the batch list
        batches = block.batches[:]  # a copy of the list: appends go on meanwhile
        if table is None or count > len(batches):
            table = pa.Table.from_batches(batches) if batches else _no_rows(block)
        else:
            table = pa.concat_tables([table, pa.Table.from_batches(batches[count:])])
        table = table.combine_chunks()
        with self._lock:
            self._tables[key] = (len(batches), table)
            self._tables.move_to_end(key)
            while len(self._tables) > self._limit:
                self._tables.popitem(last=False)
        return table


def _no_rows(block: Block) -> pa.Table:
    raise LookupInconsistent(f"write-buffer block {block.block_id} has no batch")


class RowLookup:
    def __init__(self, node: RetinaNode, cache: RowGroupCache, files: FileLocations, *,
                 settle_timeout_s: float = 5.0, attempts: int = 20) -> None:
        self._node = node
        self._cache = cache
        self._growing = GrowingBlocks()
        self._files = files
        self._settle_timeout_s = settle_timeout_s
        self._attempts = attempts

    def lookup(self, request: LookupRequest) -> LookupAnswer:
        """The rows of ``request.keys`` at ``request.ts`` (the caller admitted the read:
        READY, a live read transaction, the write fence raised to ``ts``)."""
        with SECONDS.time():
            answer = self._node.row_moves.read_unmoved(
                lambda: self._read(request), REREADS.inc,
                settle_timeout_s=self._settle_timeout_s, attempts=self._attempts)
            found = int(answer.found.sum())
            FOUND.inc(found)
            NOT_FOUND.inc(len(answer.found) - found)
            return answer

    def rows_before(self, table: TableRecord, keys: list[bytes], ts: int) -> LookupAnswer:
        """Every column of the rows ``keys`` had just before ``ts`` (each key's latest
        version below it): a partial update's base (partial_update.py). Read inside the
        write's apply, under the stream locks of the keys' virtual nodes, so no row of
        theirs moves meanwhile (no reread), before the apply's first effect (what its
        own earlier parts write, partial_update takes from them). The row a version
        names is the base, as it is the row a DELETE at ``ts`` removes (DELETE_TARGETS):
        the visibility is not asked, so a row group folded above ``ts`` (a replay's
        first timestamps) answers too; and the versions below ``ts`` are exact from the
        pruning horizon on (a replay may start right at it). Moves outside the stream
        locks (a GC rollback, a sweep) are watched as a lookup watches them
        (ROW_READS_SEE_NO_MOVE), without waiting for one (the caller holds stream locks a
        move may need): read again, a few times, then MovesInProgress (UNAVAILABLE: the
        writer sends it again)."""
        moves = self._node.row_moves
        request = LookupRequest(table, keys, [c.name for c in table.columns], ts - 1)
        for _attempt in range(3):
            sequence, running = moves.now()
            try:
                answer = self._read(request, deletes=False, horizon_ts=ts)
            except Exception:
                if running or not moves.unchanged_since(sequence):
                    continue  # what failed may be what moved
                raise
            if not running and moves.unchanged_since(sequence):
                break
        else:
            raise MovesInProgress("rows kept moving while a partial update read its base rows")
        return answer

    def _read(self, request: LookupRequest, deletes: bool = True,
              horizon_ts: int | None = None) -> LookupAnswer:
        table, ts = request.table, request.ts
        index = self._node.index
        row_ids = index.primary.latest(table.table_id, request.keys, ts)
        horizon = index.primary.pruned_below  # read after the versions: see PrimaryIndex
        if (ts if horizon_ts is None else horizon_ts) < horizon:
            raise snapshot_expired(f"snapshot {ts} is below the primary index's pruning "
                                   f"horizon {horizon} (versions below it are gone)", horizon)
        positions = np.flatnonzero(row_ids >= 0)
        located, files, rgs, offsets = index.main.locate(row_ids[positions])
        order = np.lexsort((offsets[located], rgs[located], files[located]))
        positions, files, rgs, offsets = (a[located][order]
                                          for a in (positions, files, rgs, offsets))
        change = np.empty(len(files), bool)
        change[:1] = True
        np.not_equal(files[1:], files[:-1], out=change[1:])
        change[1:] |= rgs[1:] != rgs[:-1]
        starts = np.flatnonzero(change)
        ends = np.append(starts[1:], len(files))[:len(starts)]  # none when nothing located
        # Per row group touched: its visibility check and the decoded unit that holds it
        # (a Python step each); per unit: one commit-timestamp check and one gather.
        lengths = ends - starts
        first = np.zeros(len(starts), np.int64)  # per group: its first row in its unit
        served = np.ones(len(starts), bool)
        deleted = np.zeros(len(files), bool)  # per key
        units: list[RowGroupRows] = []
        unit_of = np.zeros(len(starts), np.int64)
        batch = ReadMemo()
        for g, (start, end, file_id, rg_id) in enumerate(zip(
                starts.tolist(), ends.tolist(), files[starts].tolist(), rgs[starts].tolist(),
                strict=True)):
            found = self.row_group(table.table_id, file_id, rg_id, batch)
            if found is None:
                served[g] = False  # an orphan: its row is in no file this node serves
                unit_of[g] = max(len(units) - 1, 0)  # keeps key_unit sorted (masked out)
                continue
            visibility, rows = found
            rows_at = offsets[start:end]
            dead = visibility.deleted_among(rows_at, ts) if deletes else \
                np.zeros(len(rows_at), bool)
            if dead is None:
                base = visibility.base_timestamp
                raise snapshot_expired(f"snapshot {ts} is below the visibility base {base} of "
                                       f"file {file_id} row group {rg_id} (deletes up to it "
                                       "are folded together)", base)
            deleted[start:end] = dead
            first[g], count = rows.start(rg_id)
            if int(rows_at[-1]) >= count:
                raise LookupInconsistent(f"row {int(rows_at[-1])} of file {file_id} row group "
                                         f"{rg_id} is beyond its {count} rows")
            if not units or units[-1] is not rows:
                units.append(rows)
            unit_of[g] = len(units) - 1
        at = offsets + np.repeat(first, lengths)
        live = np.repeat(served, lengths) & ~deleted
        key_unit = np.repeat(unit_of, lengths)
        # Groups of one unit are consecutive (sorted by file, then row group): so are
        # its keys.
        bounds = np.searchsorted(key_unit, np.arange(len(units) + 1))
        gathered = []
        for u, rows in enumerate(units):
            lo, hi = int(bounds[u]), int(bounds[u + 1])
            unit_at = at[lo:hi]
            keep = live[lo:hi] & (rows.commit_ts[unit_at] <= ts)
            if keep.any():
                gathered.append((rows, unit_at[keep], positions[lo:hi][keep]))
        return _answer(len(request.keys), gathered,
                       _output_schema(table, tuple(request.columns)))

    def row_group(self, table_id: int, file_id: int, rg_id: int,
                  batch: ReadMemo) -> tuple[RGVisibility, RowGroupRows] | None:
        """Row group ``rg_id`` of a file this node serves (its visibility, and decoded rows
        that hold it), else None (an orphan). ``batch``: what this read found already."""
        if file_id != batch.file_id:
            batch.file_id, batch.buffered = file_id, self._node.buffer_file(file_id)
        buffered = batch.buffered
        if buffered is not None:  # still in the write buffer: its rows are in memory
            if rg_id >= len(buffered.blocks):
                raise LookupInconsistent(f"write-buffer file {file_id} has no block {rg_id}")
            block = buffered.blocks[rg_id]
            final = buffered.state != FileState.OPEN
            return block.visibility, self._block_rows(file_id, block, final)
        visibility = self._node.visibility.readable(file_id, rg_id)
        if visibility is None:
            return None
        published = self._files.of(table_id, file_id)
        counts = published.spans[published.span_of[rg_id]]
        if batch.span is counts and batch.rows is not None:  # a span's row groups come
            return visibility, batch.rows  # one after the other

        def load() -> RowGroupRows:
            parquet = open_parquet(published.uri, published.name)
            return RowGroupRows(parquet.read_row_groups(list(counts)), counts)

        rows = self._cache.get((file_id, next(iter(counts))), load)
        batch.span, batch.rows = counts, rows
        return visibility, rows

    def _block_rows(self, file_id: int, block: Block, sealed: bool) -> RowGroupRows:
        """A write-buffer block's visible rows (VISIBLE_PREFIX; the size is read before the
        batches, which only ever grow). A block that can take no more rows (full, or its
        file sealed) holds its final rows and is cached; a block still growing is decoded
        for this read only."""
        visible = block.visible_size

        def load() -> RowGroupRows:
            batches = list(block.batches)
            return RowGroupRows(pa.Table.from_batches(batches).slice(0, visible),
                                {block.rg_id: visible})

        if (sealed or visible == block.capacity) and not block.pending:
            return self._cache.get((file_id, block.rg_id, BUFFERED), load)
        return RowGroupRows(self._growing.rows(file_id, block).slice(0, visible),
                            {block.rg_id: visible})


BUFFERED = -1  # the third part of a write-buffer block's cache key


class ReadMemo:
    """What one read found about the file and the span it read last (its row groups come
    in file, then row-group order), so that each is looked up once a read."""

    def __init__(self) -> None:
        self.file_id = -1
        self.buffered: IngestFile | None = None
        self.span: dict[int, int] | None = None
        self.rows: RowGroupRows | None = None


@functools.lru_cache(maxsize=256)
def _output_schema(table: TableRecord, columns: tuple[str, ...]) -> pa.Schema:
    full = table_schema(table)
    return pa.schema([full.field(c) for c in columns])


def _answer(n: int, units: list[tuple[RowGroupRows, np.ndarray, np.ndarray]],
            schema: pa.Schema) -> LookupAnswer:
    """Per key found and commit timestamp, and the found rows in request order."""
    found = np.zeros(n, bool)
    commit_ts = np.zeros(n, np.int64)
    if not units:
        return LookupAnswer(found, commit_ts, schema.empty_table())
    where = np.concatenate([positions for _rows, _at, positions in units])
    found[where] = True
    commit_ts[where] = np.concatenate([rows.commit_ts[at] for rows, at, _p in units])
    gathered = [(rows, at) for rows, at, _p in units]
    if len(where) <= FEW_ROWS:
        picked = [(group, int(o)) for group, at in gathered for o in at.tolist()]
        order = np.argsort(where, kind="stable").tolist()
        return LookupAnswer(found, commit_ts, assemble_few(schema, [picked[i] for i in order]))
    rows = assemble(schema, gathered)
    if (where[1:] < where[:-1]).any():
        # Gathered row group by row group; one take puts them in request order.
        rows = rows.take(pa.array(np.argsort(where, kind="stable")))
    return LookupAnswer(found, commit_ts, rows)


def row_lookup(node: RetinaNode, catalog: Catalog, cache_bytes: int) -> RowLookup:
    """The node's RowLookup; its row-group cache and file locations are told of every file
    that goes."""
    cache = RowGroupCache(cache_bytes)
    files = FileLocations(catalog)

    def gone(file_ids: list[int]) -> None:
        cache.forget_files(file_ids)
        files.forget(file_ids)

    node.row_moves.on_files_gone = gone
    return RowLookup(node, cache, files)
