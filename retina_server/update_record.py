"""UpdateRecord: validate a request completely, then apply it in the protocol's order.

Validation (no side effect) refuses, with the status of docs/architecture.md ("Error
conventions") and nothing applied: a key timestamp that differs from its TableUpdateData's
(single-source commit timestamp, C03.6), an unknown table, a wrong primary
index id, a wrong key count, a value that does not decode, duplicate keys in
one insert batch, an INSERT whose key bytes are not the encoding of its own
key columns, or whose key column is NULL (INSERT_KEY_IS_ROW_KEY), a key that does not route to the
named virtual node, a virtual node this node does not own, an oversized
request, a source position over MAX_POSITION_BYTES or two different positions at one
timestamp (ONE_POSITION_PER_TS), and a standalone INSERT of a key that is live
(ALREADY_EXISTS: a CDC insert is always sent as DELETE + INSERT, so a retried one
converges instead).
A TableUpdateData in the columnar form (``retina_common.columnar``: Arrow IPC
key and row streams) is decoded and validated in full first; its keys are
computed from the rows' key columns, and every rule above applies to it too.
NULL in a NOT NULL column is refused (NOT_NULL_HOLDS). Partial updates (either
form) are checked here too: their target columns (PARTIAL_TARGETS_NAME_THE_KEY), values,
key bytes and routes; the apply merges them (partial_update.py).

An ordinary request (no RecoveryReplayContext) is then admitted by the node's write
fence under its stream locks (write_fence.py, LATE_WRITES_FENCED): if any of its
timestamps is at or below the write floor (a read at or above it was answered, or the
HWM passed it), it is refused ABORTED with nothing applied, and the writer redoes the
batch at a new timestamp. Before that answer the refusal is recorded durably, so that a
recovery replay skips those timestamps (refused_writes.py).

Apply, per TableUpdateData in request order (section 5, "Unified write order"):

* TRUNCATE (``truncate`` set; a source TRUNCATE, sent to every virtual
  node): a DELETE, as below, of every key of the table in the virtual node
  whose latest primary-index version at or before T is a row, before the
  TableUpdateData's own DELETEs and INSERTs. The table's versions are
  scanned once per request, not once per virtual node, and a re-applied
  TRUNCATE (a retry, a replay) skips the keys it tombstoned: a scan, no
  writes.
* DELETE: resolvePrimary → visibility delete at T → tombstonePrimaryResolved.
  A key that is missing, tombstoned or an orphan changes nothing; a row is
  counted once however often the request deletes it.
* INSERT: append pending → putMainIndexEntries → putPrimaryEntriesOnly →
  publishPendingAppend(visible). If a step fails, the rows are compensated
  (visibility delete at T, primary entries rolled back, settled hidden); if
  the compensation fails too, the node fails closed. An append that fails
  part-way (the next ingest file cannot be registered: catalog down) still
  reports the handles it created, so those rows are compensated too: a
  request answered with an error leaves no pending handle, no primary entry
  and no visible row behind, and the sealed file can close.

Every primary-index write of a request is one durable LMDB transaction (one
fsync per request; the request's source positions are put in it too:
POSITION_DURABLE_WITH_APPLY, source_positions.py; and the (table, virtual node,
timestamp) of every TableUpdateData it applied: APPLIED_RECORDED_WITH_APPLY,
applied_writes.py, which recovery replay reads). The inserts' rows become
visible only after it committed, so "putPrimaryEntriesOnly before
publishPendingAppend(visible)" holds for the durable state too. If the commit
fails, every staged insert of the request is compensated; DELETE effects
already applied to visibility stay, and a
retry converges over them (re-deleting changes nothing).

A CDC replace is a DELETE and an INSERT of the same key in one
TableUpdateData, so the DELETE goes first. The request is acknowledged
all-or-nothing; a failure after a prefix was applied leaves effects that a
retry of the same request converges over (re-deleting is idempotent, and
the re-insert of a replace supersedes the first).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import grpc
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from prometheus_client import Counter

from retina_common import failpoints as fp
from retina_common.catalog import NotFound, TableRecord
from retina_common.codec import (
    EncodingError,
    arrow_type,
    decode_column,
    encode_primary_keys,
    encode_values,
)
from retina_common.columnar import (
    ColumnarError,
    decode_delete_keys,
    decode_insert_rows,
    decode_partial_rows,
    partial_targets,
    row_count,
    stream_width,
)
from retina_common.pb import retina_pb2 as pb
from retina_common.refusal import Refusal
from retina_common.schema_evolution import pad_values
from retina_server import partial_update
from retina_server.index import Resolution
from retina_server.index_errors import IndexBackendError
from retina_server.main_index import RowIdRange
from retina_server.node import NodeFailedClosed, RetinaNode, Stream
from retina_server.prepared_update import PartialRows, PreparedUpdate
from retina_server.primary_index import MAX_KEY_BYTES
from retina_server.source_positions import MAX_POSITION_BYTES
from retina_server.write_buffer import AppendHandle, SettleMode
from retina_server.write_fence import Fenced

SUPERSEDED = Counter("retina_update_record_superseded_rows_total",
                     "Rows written at a timestamp below their key's next version, deleted at "
                     "it (SUPERSEDED_COPIES_END_AT_THE_NEXT_VERSION)")
PARTS = Counter("retina_update_record_parts_total",
                "TableUpdateData that passed validation, by wire form (docs/encoding.md)",
                ["form"])


def _invalid(message: str) -> Refusal:
    return Refusal(grpc.StatusCode.INVALID_ARGUMENT, message)


def prepare(node: RetinaNode, request: pb.UpdateRecordRequest,
            max_rows: int) -> list[PreparedUpdate]:
    """Validate and decode the whole request; raises Refusal, changes nothing."""
    if not request.schema_name:
        raise _invalid("schema_name is required")
    if not request.table_update_data:
        raise _invalid("the request has no table_update_data")
    rows = sum(_rows(t) for t in request.table_update_data)
    if rows > max_rows:
        raise _invalid(f"request carries {rows} rows; the limit is {max_rows}")
    _check_source_positions(request)
    pending: list[_RowInserts] = []
    prepared = [_prepare_one(node, request.schema_name, tud, pending)
                for tud in request.table_update_data]
    _decode_row_inserts(pending)
    columnar = sum(1 for t in request.table_update_data
                   if t.delete_keys_arrow or t.insert_rows_arrow or t.partial_rows_arrow)
    PARTS.labels(form="columnar").inc(columnar)
    PARTS.labels(form="row").inc(len(prepared) - columnar)
    return prepared


def _check_source_positions(request: pb.UpdateRecordRequest) -> None:
    """ONE_POSITION_PER_TS: every TableUpdateData of one timestamp carries the same
    source position (one timestamp is one source transaction), of at most
    MAX_POSITION_BYTES."""
    seen: dict[int, str] = {}
    for tud in request.table_update_data:
        position = tud.source_position
        if len(position.encode()) > MAX_POSITION_BYTES:
            raise _invalid(f"{tud.table_name}: source_position of {len(position.encode())} "
                           f"bytes; the limit is {MAX_POSITION_BYTES}")
        first = seen.setdefault(tud.timestamp, position)
        if first != position:
            raise _invalid(f"{tud.table_name}: source_position {position!r} at timestamp "
                           f"{tud.timestamp} differs from {first!r} of the same timestamp "
                           "in this request (one timestamp is one source transaction)")


def _rows(tud: pb.TableUpdateData) -> int:
    """The delete and insert items of ``tud`` in either form (a columnar payload's
    batch headers are read, not its values)."""
    rows = len(tud.delete_data) + len(tud.insert_data) + len(tud.partial_data)
    try:
        return (rows + row_count(tud.delete_keys_arrow, "delete_keys_arrow")
                + row_count(tud.insert_rows_arrow, "insert_rows_arrow")
                + row_count(tud.partial_rows_arrow, "partial_rows_arrow"))
    except ColumnarError as exc:
        raise _invalid(f"{tud.table_name}: {exc}") from None


def _keys(table: TableRecord, tud: pb.TableUpdateData, items: list, what: str,
          node: RetinaNode, routes: dict[bytes, int]) -> list[bytes]:
    """The primary-key bytes of ``items``; every rule is checked batch-wise and the
    first offending row is named."""
    if not items:
        return []
    name = tud.table_name
    counts = [len(item.index_keys) for item in items]
    if any(c != 1 for c in counts):
        i = next(i for i, c in enumerate(counts) if c != 1)
        raise _invalid(f"{name}: {what} {i} has {counts[i]} index keys; exactly one (the "
                       "primary key) is expected")
    index_keys = [item.index_keys[0] for item in items]
    ts = tud.timestamp
    stamps = [k.timestamp for k in index_keys]
    if stamps.count(ts) != len(stamps):
        i = next(i for i, s in enumerate(stamps) if s != ts)
        raise _invalid(f"{name}: {what} {i} key timestamp {stamps[i]} differs from the update "
                       f"timestamp {ts}")
    ids = [(k.table_id, k.index_id) for k in index_keys]
    expected = (table.table_id, table.primary_index_id)
    if ids.count(expected) != len(ids):
        i = next(i for i, x in enumerate(ids) if x != expected)
        raise _invalid(f"{name}: {what} {i} names table {ids[i][0]} index {ids[i][1]}, not "
                       f"{expected[0]}/{expected[1]}")
    keys = [k.key for k in index_keys]
    _check_routes(node, tud, keys, what, routes)
    return keys


def _check_routes(node: RetinaNode, tud: pb.TableUpdateData, keys: list[bytes], what: str,
                  routes: dict[bytes, int]) -> None:
    """Every key is non-empty, fits the primary index, and routes to the update's
    virtual node."""
    if not all(keys):
        raise _invalid(f"{tud.table_name}: {what} {keys.index(b'')} has an empty key")
    if max(map(len, keys), default=0) > MAX_KEY_BYTES:
        i = next(i for i, k in enumerate(keys) if len(k) > MAX_KEY_BYTES)
        raise _invalid(f"{tud.table_name}: {what} {i} has a primary key of {len(keys[i])} "
                       f"bytes; the limit is {MAX_KEY_BYTES}")
    # ``routes`` is shared by the update's deletes and inserts: a replace's key is
    # hashed once.
    route = node.topology.vnode_of_key
    vnode = tud.virtual_node_id
    got = [routes[k] if k in routes else route(k) for k in keys]
    routes.update(zip(keys, got, strict=True))
    if got.count(vnode) != len(got):
        i = next(i for i, v in enumerate(got) if v != vnode)
        raise _invalid(f"{tud.table_name}: {what} {i} key routes to virtual node {got[i]}, "
                       f"not {vnode}")


@dataclass
class _RowInserts:
    """A row-form update's insert rows, decoded together with the other row-form inserts
    of the request for the same table record (:func:`_decode_row_inserts`)."""

    update: PreparedUpdate
    name: str
    rows: list[Any]


def _prepare_one(node: RetinaNode, schema_name: str, tud: pb.TableUpdateData,
                 pending: list[_RowInserts]) -> PreparedUpdate:
    """Validate one TableUpdateData; its row-form inserts are left in ``pending`` to be
    decoded (their ``insert_columns`` are set by :func:`_decode_row_inserts`)."""
    try:
        table = node.table(schema_name, tud.table_name)
    except NotFound:
        raise _invalid(f"unknown table {schema_name}.{tud.table_name}") from None
    if tud.primary_index_id != table.primary_index_id:
        raise _invalid(f"{tud.table_name}: primary index {tud.primary_index_id} is not the "
                       f"table's ({table.primary_index_id})")
    if tud.timestamp <= 0:
        raise _invalid(f"{tud.table_name}: timestamp must be positive")
    vnode = tud.virtual_node_id
    if not 0 <= vnode < node.topology.virtual_nodes:
        raise _invalid(f"{tud.table_name}: virtual node {vnode} does not exist")
    if vnode not in node.owned_vnodes:
        owner = node.topology.node_of_vnode(vnode)
        raise Refusal(grpc.StatusCode.FAILED_PRECONDITION,
                      f"virtual node {vnode} belongs to {owner}, not {node.node_id}")
    routes: dict[bytes, int] = {}
    if tud.delete_keys_arrow or tud.insert_rows_arrow or tud.partial_rows_arrow:
        if tud.delete_data or tud.insert_data or tud.partial_data:
            raise _invalid(f"{tud.table_name}: a TableUpdateData carries its rows either as "
                           "delete_data/insert_data/partial_data or as delete_keys_arrow/"
                           "insert_rows_arrow/partial_rows_arrow, not both")
        delete_keys = _columnar_deletes(node, tud, routes)
        table, insert_keys, columns = _columnar_inserts(node, schema_name, table, tud, routes)
        table, partials = _columnar_partials(node, schema_name, table, tud, routes)
    else:
        delete_keys = _keys(table, tud, list(tud.delete_data), "delete", node, routes)
        insert_keys = _keys(table, tud, list(tud.insert_data), "insert", node, routes)
        columns = []
        table, partials = _row_partials(node, schema_name, table, tud, routes)
    if len(set(insert_keys)) != len(insert_keys):
        raise _invalid(f"{tud.table_name}: duplicate keys in one insert batch")
    _check_keys_once(tud.table_name, delete_keys, insert_keys, partials)
    rows: list[Any] = []
    if insert_keys and not columns:
        table, widths = _table_for_widths(node, schema_name, table, tud)
        width = len(table.columns)
        if widths == {width}:
            rows = [row.col_values for row in tud.insert_data]
        else:  # a row encoded for an older schema version: NULL for the columns added since
            rows = [pad_values(row.col_values, width) for row in tud.insert_data]
    update = PreparedUpdate(table, vnode, tud.timestamp, delete_keys, insert_keys, columns,
                            tud.truncate, tud.source_position, partials)
    if rows:
        pending.append(_RowInserts(update, tud.table_name, rows))
    return update


def _decode_row_inserts(pending: list[_RowInserts]) -> None:
    """Decode the row-form inserts of a request, one column at a time for every update of
    the same table record at once: a CDC micro-batch is hundreds of TableUpdateData of a
    row or two (one per source transaction and virtual node), and decoding each by
    itself cost a fixed ~40 µs in Arrow calls. Then each update's key bytes are checked
    against its rows (INSERT_KEY_IS_ROW_KEY)."""
    groups: dict[int, list[_RowInserts]] = {}
    for p in pending:
        groups.setdefault(id(p.update.table), []).append(p)
    for group in groups.values():
        table = group[0].update.table
        rows = [row for p in group for row in p.rows]
        columns: list[pa.Array] = []
        # One transposition of the rows into columns (zip, in C).
        for column, values in zip(table.columns, zip(*rows, strict=True), strict=True):
            try:
                columns.append(decode_column(column.type, values))
            except EncodingError as exc:
                raise _invalid(f"{group[0].name}.{column.name}: {exc}") from None
        start = 0
        pk = _key_positions(table)
        for p in group:
            n = len(p.rows)
            # A copy of its own: a slice would keep the whole request's columns alive for
            # as long as the write buffer or a row-group cache holds one of its rows.
            own = columns if n == len(rows) else \
                [pa.concat_arrays([c.slice(start, n)]) for c in columns]
            start += n
            if not _keys_are_row_bytes(pk, p.update.insert_keys, p.rows):
                _check_keys_match_rows(table, p.name, p.update.insert_keys, own)
            check_not_null(table, p.name, own, "insert")
            p.update.insert_columns = own


def _columnar_deletes(node: RetinaNode, tud: pb.TableUpdateData,
                      routes: dict[bytes, int]) -> list[bytes]:
    if not tud.delete_keys_arrow:
        return []
    try:
        keys = decode_delete_keys(tud.delete_keys_arrow)
    except ColumnarError as exc:
        raise _invalid(f"{tud.table_name}: {exc}") from None
    _check_routes(node, tud, keys, "delete", routes)
    return keys


def _columnar_inserts(node: RetinaNode, schema_name: str, table: TableRecord,
                      tud: pb.TableUpdateData, routes: dict[bytes, int]
                      ) -> tuple[TableRecord, list[bytes], list[pa.Array]]:
    """The rows of ``insert_rows_arrow`` as the table's columns (those added after the
    rows were encoded are NULL), and each row's key bytes computed from its key
    columns."""
    if not tud.insert_rows_arrow:
        return table, [], []
    try:
        if stream_width(tud.insert_rows_arrow) > len(table.columns):  # a column was added
            table = node.refresh_table(schema_name, tud.table_name)
        rows = decode_insert_rows(tud.insert_rows_arrow, table)
        columns = [c.combine_chunks() for c in rows.columns]
    except ColumnarError as exc:
        raise _invalid(f"{tud.table_name}: {exc}") from None
    except pa.ArrowException as exc:  # e.g. a column beyond Arrow's 2 GiB offsets
        raise _invalid(f"{tud.table_name}: insert_rows_arrow: {exc}") from None
    n = rows.num_rows
    if not n:
        return table, [], []
    columns += [pa.nulls(n, arrow_type(c.type)) for c in table.columns[len(columns):]]
    pk = _key_positions(table)
    _check_key_columns_present(table, tud.table_name, columns, pk)
    check_not_null(table, tud.table_name, columns, "insert")
    keys = encode_primary_keys([table.columns[p].type for p in pk],
                               [columns[p] for p in pk]).to_pylist()
    _check_routes(node, tud, keys, "insert", routes)
    return table, keys, columns


def _row_partials(node: RetinaNode, schema_name: str, table: TableRecord,
                  tud: pb.TableUpdateData, routes: dict[bytes, int]
                  ) -> tuple[TableRecord, list[PartialRows]]:
    """``partial_data``, grouped by target columns, each target's values decoded as one
    column. The table record is read again once if a target names a column it lacks
    (one added since it was cached)."""
    items = list(tud.partial_data)
    if not items:
        return table, []
    name = tud.table_name
    keys = _keys(table, tud, items, "partial", node, routes)
    table = _table_naming(node, schema_name, table,
                          {n for item in items for n in item.target_columns})
    groups: dict[tuple[str, ...], list[int]] = {}
    for i, item in enumerate(items):
        groups.setdefault(tuple(item.target_columns), []).append(i)
    out = []
    for names, positions in groups.items():
        targets = _targets(table, name, names, f"partial {positions[0]}")
        short = [i for i in positions if len(items[i].col_values) != len(names)]
        if short:
            i = short[0]
            raise _invalid(f"{name}: partial {i} has {len(items[i].col_values)} values for "
                           f"{len(names)} target columns")
        columns = []
        per_target = zip(*(items[i].col_values for i in positions), strict=True)
        for t, values in zip(targets, per_target, strict=True):
            try:
                columns.append(decode_column(table.columns[t].type, values))
            except EncodingError as exc:
                raise _invalid(f"{name}.{table.columns[t].name}: {exc}") from None
        group_keys = [keys[i] for i in positions]
        aligned = _aligned(table, targets, columns)
        _check_keys_match_rows(table, name, group_keys, aligned, "partial", positions)
        check_not_null(table, name, aligned, "partial", positions)
        out.append(PartialRows(targets, group_keys, columns))
    return table, out


def _columnar_partials(node: RetinaNode, schema_name: str, table: TableRecord,
                       tud: pb.TableUpdateData, routes: dict[bytes, int]
                       ) -> tuple[TableRecord, list[PartialRows]]:
    """``partial_rows_arrow``: one group, its targets the stream's columns; each row's
    key bytes computed from its key columns."""
    if not tud.partial_rows_arrow:
        return table, []
    name = tud.table_name
    try:
        names = partial_targets(tud.partial_rows_arrow)
        table = _table_naming(node, schema_name, table, set(names))
        rows = decode_partial_rows(tud.partial_rows_arrow, table)
        columns = [c.combine_chunks() for c in rows.columns]
    except ColumnarError as exc:
        raise _invalid(f"{name}: {exc}") from None
    except pa.ArrowException as exc:
        raise _invalid(f"{name}: partial_rows_arrow: {exc}") from None
    if not rows.num_rows:
        return table, []
    targets = _targets(table, name, tuple(names), "partial_rows_arrow")
    aligned = _aligned(table, targets, columns)
    pk = _key_positions(table)
    _check_key_columns_present(table, name, aligned, pk, "partial")
    key_columns = [c for c in (aligned[p] for p in pk) if c is not None]
    keys = encode_primary_keys([table.columns[p].type for p in pk], key_columns).to_pylist()
    _check_routes(node, tud, keys, "partial", routes)
    check_not_null(table, name, aligned, "partial")
    return table, [PartialRows(targets, keys, columns)]


def _table_naming(node: RetinaNode, schema_name: str, table: TableRecord,
                  names: set[str]) -> TableRecord:
    """``table``, or its record read again if it lacks one of ``names``."""
    if names <= {c.name for c in table.columns}:
        return table
    return node.refresh_table(schema_name, table.name)


def _targets(table: TableRecord, name: str, names: tuple[str, ...],
             what: str) -> tuple[int, ...]:
    """PARTIAL_TARGETS_NAME_THE_KEY: the ordinals of target columns ``names``: known,
    none twice, every primary-key column among them (INVALID_ARGUMENT otherwise)."""
    ordinal = {c.name: i for i, c in enumerate(table.columns)}
    unknown = [n for n in names if n not in ordinal]
    if unknown:
        raise _invalid(f"{name}: {what} names target column {unknown[0]!r}, which the "
                       "table does not have")
    if len(set(names)) != len(names):
        raise _invalid(f"{name}: {what} names a target column twice: {list(names)}")
    missing = [k for k in table.primary_key if k not in names]
    if missing:
        raise _invalid(f"{name}: {what} lacks primary-key column {missing[0]} among its "
                       "target columns (every key column is a target)")
    return tuple(ordinal[n] for n in names)


def _aligned(table: TableRecord, targets: tuple[int, ...],
             columns: list[pa.Array]) -> list[pa.Array | None]:
    """``columns`` at their targets' places among the table's columns (None elsewhere)."""
    aligned: list[pa.Array | None] = [None] * len(table.columns)
    for t, column in zip(targets, columns, strict=True):
        aligned[t] = column
    return aligned


def _check_keys_once(name: str, delete_keys: list[bytes], insert_keys: list[bytes],
                     partials: list[PartialRows]) -> None:
    """A key of a partial update is nowhere else in its TableUpdateData."""
    keys = [k for p in partials for k in p.keys]
    if not keys:
        return
    if len(set(keys)) != len(keys):
        raise _invalid(f"{name}: a key has two partial updates in one TableUpdateData")
    if not set(keys).isdisjoint(delete_keys) or not set(keys).isdisjoint(insert_keys):
        raise _invalid(f"{name}: a key of a partial update is also deleted or inserted in "
                       "the same TableUpdateData")


def _key_positions(table: TableRecord) -> list[int]:
    position = {c.name: i for i, c in enumerate(table.columns)}
    return [position[c] for c in table.primary_key]


def _check_key_columns_present(table: TableRecord, name: str,
                               columns: Sequence[pa.Array | None], pk: list[int],
                               what: str = "insert", rows: Sequence[int] | None = None) -> None:
    for p in pk:
        column = columns[p]
        assert column is not None  # every key column is a target
        if column.null_count:
            i = pc.index(column.is_null(), True).as_py()
            i = i if rows is None else rows[i]
            raise _invalid(f"{name}: {what} {i} has a NULL in key column "
                           f"{table.columns[p].name}")


def check_not_null(table: TableRecord, name: str, columns: Sequence[pa.Array | None],
                   what: str, rows: Sequence[int] | None = None) -> None:
    """NOT_NULL_HOLDS: no NULL in a NOT NULL column (INVALID_ARGUMENT naming the column and
    the first offending row: its place in its TableUpdateData, ``rows[i]`` if given).
    ``columns`` line up with the table's; None: not given."""
    for column, values in zip(table.columns, columns, strict=False):
        if values is not None and values.null_count and not column.accepts_null \
                and column.pk_position is None:  # a NULL key is refused as such
            i = pc.index(values.is_null(), True).as_py()
            row = i if rows is None else rows[i]
            raise _invalid(f"{name}: {what} {row} has NULL in NOT NULL column {column.name}")


def _table_for_widths(node: RetinaNode, schema_name: str, table: TableRecord,
                      tud: pb.TableUpdateData) -> tuple[TableRecord, set[int]]:
    """The table record every insert row's width fits, and the rows' distinct widths: a
    row wider than the cached record was encoded after a column was added (schema
    evolution), so the record is re-read from the catalog once. Any width that is no
    schema version's is refused, naming the first row that has it."""
    widths = [len(row.col_values) for row in tud.insert_data]
    distinct = set(widths)
    if max(distinct) > len(table.columns):
        table = node.refresh_table(schema_name, tud.table_name)
    bad = {n for n in distinct if not table.accepts_width(n)}
    if bad:
        i = next(i for i, n in enumerate(widths) if n in bad)
        expected = (f"{len(table.columns)}" if table.original_width == len(table.columns)
                    else f"{table.original_width} to {len(table.columns)}")
        raise _invalid(f"{tud.table_name}: insert {i} has {widths[i]} values for {expected} "
                       "columns")
    return table, distinct


# Below this many rows, comparing each key with its row's bytes in Python costs less than
# the batch check's fixed cost of Arrow and numpy calls (a CDC source transaction of a few
# rows is one TableUpdateData per virtual node: most carry one or two rows).
_SMALL_INSERT = 32
_LENGTHS = [n.to_bytes(4, "big") for n in range(256)]


def _keys_are_row_bytes(pk: list[int], keys: list[bytes], rows: list[Any]) -> bool:
    """Whether each insert's key bytes are its row's values of the key columns at ``pk``,
    byte for byte (a small batch only; False otherwise: the caller then checks
    batch-wise).

    Exact: a primary key is, per key column, the 4-byte big-endian length of the
    column's value encoding and that encoding (codec.py), which is what the row sends;
    the row's values decoded without error re-encode to the same bytes. An empty value
    (NULL) is never a match, so the batch check names it."""
    if len(keys) > _SMALL_INSERT:
        return False
    lengths = _LENGTHS
    for key, row in zip(keys, rows, strict=True):
        values = [row[p] for p in pk]
        if not all(values) or max(map(len, values)) > 255:
            return False
        if key != b"".join(lengths[len(v)] + v for v in values):
            return False
    return True


def _check_keys_match_rows(table: TableRecord, name: str, keys: list[bytes],
                           columns: Sequence[pa.Array | None], what: str = "insert",
                           rows: Sequence[int] | None = None) -> None:
    """Every insert's key columns are non-NULL and encode to exactly its key bytes.

    The index would otherwise file the row under a key its columns do not
    carry. One batch compare; only an offending row is looked at by itself."""
    pk = _key_positions(table)
    _check_key_columns_present(table, name, columns, pk, what, rows)
    types = [table.columns[p].type for p in pk]
    key_columns = [c for c in (columns[p] for p in pk) if c is not None]
    expected = encode_primary_keys(types, key_columns)
    same = pc.equal(expected, pa.array(keys, pa.binary()))
    if pc.all(same).as_py():
        return
    i = pc.index(same, False).as_py()
    values = [encode_values(t, c.slice(i, 1))[0].as_py()
              for t, c in zip(types, key_columns, strict=True)]
    column = _first_disagreeing_column(keys[i], values)
    i = i if rows is None else rows[i]
    raise _invalid(f"{name}: {what} {i} key column {table.columns[pk[column]].name} does not "
                   "match the row's value (the key bytes disagree with the row)")


def _first_disagreeing_column(key: bytes, values: list[bytes]) -> int:
    """Which key column of ``key`` differs from its encoded ``values``."""
    offset = 0
    for n, value in enumerate(values):
        segment = len(value).to_bytes(4, "big") + value
        if key[offset:offset + len(segment)] != segment:
            return n
        offset += len(segment)
    return len(values) - 1  # every column agrees, but the key has trailing bytes


def _check_no_live_inserts(node: RetinaNode, updates: list[PreparedUpdate]) -> None:
    """Refuse a standalone INSERT of a live key (ALREADY_EXISTS), before anything applies."""
    live: dict[tuple[int, bytes], bool] = {}
    for u in updates:
        tid = u.table.table_id
        if u.truncate:
            route = node.topology.vnode_of_key
            live = {k: v and not (k[0] == tid and route(k[1]) == u.vnode)
                    for k, v in live.items()}
        for key in u.delete_keys:
            live[(tid, key)] = False
        deleted = set(u.delete_keys)
        unknown = [] if u.truncate else [k for k in u.insert_keys
                                         if k not in deleted and (tid, k) not in live]
        for k, r in zip(unknown, node.index.resolve_primary(tid, unknown, node.in_baseline,
                                                             u.ts), strict=True):
            if r.status == Resolution.BACKEND_ERROR:
                raise Refusal(grpc.StatusCode.UNAVAILABLE, "primary index backend error")
            live[(tid, k)] = r.status == Resolution.FOUND
        clash = [k for k in u.insert_keys if k not in deleted and live.get((tid, k))]
        if clash:
            raise Refusal(grpc.StatusCode.ALREADY_EXISTS,
                          f"{u.table.name}: INSERT of {len(clash)} live key(s) without a "
                          "DELETE; send a replace (DELETE + INSERT)")
        for key in u.insert_keys:
            live[(tid, key)] = True


def apply(node: RetinaNode, updates: list[PreparedUpdate], *, fenced: bool = True,
          writer_id: str = "", check_live: bool = True,
          base_rows: partial_update.BaseRows | None = None) -> pb.UpdateRecordResponse:
    """Apply a validated request. ``fenced``: an ordinary write (of ``writer_id``),
    admitted only above the write floor (LATE_WRITES_FENCED; refused: recorded first,
    refused_writes.py); a recovery replay passes False. ``writer_id``: the request's,
    stored with its source positions (and with a refusal's record). ``check_live``
    False: no ALREADY_EXISTS check of standalone inserts (recovery's re-application of
    a bulk load, bulk_load.py, whose keys were checked at its commit against the whole
    history: after the rewind an older row of a key can look live until the replay of
    its delete, which lands below the load's version). ``base_rows``: the node's row
    reader, which partial updates merge with (partial_update.py)."""
    node.check_writable()
    streams = {(u.table.table_id, u.vnode): node.stream(u.table, u.vnode) for u in updates}
    order = [streams[k] for k in sorted(streams)]
    response = pb.UpdateRecordResponse()
    staged: list[tuple[Stream, PreparedUpdate, list[AppendHandle]]] = []
    if fenced:
        fp.UPDATE_RECORD_FENCE_BEFORE.hit()
    with contextlib.ExitStack() as stack:
        for stream in order:  # a fixed lock order: no deadlock between requests
            stack.enter_context(stream.buffer.lock)
        if fenced and updates:
            # Checked under the stream locks: a write that waited for them behind a GC
            # commit is refused if a read passed its timestamp meanwhile, and one admitted
            # here finishes (settle included) before such a read looks.
            try:
                stack.enter_context(node.fence.admit(min(u.ts for u in updates)))
            except Fenced as fenced_by:
                _record_refusal(node, updates, writer_id, fenced_by.floor)
                raise
            fp.UPDATE_RECORD_FENCE_AFTER.hit()
        try:
            # Before anything applies (a refusal of a merge leaves nothing behind), and
            # before the node's LMDB write transaction opens: reading a base row may go
            # to a file in storage, and every other stream's write waits for that batch.
            updates = partial_update.fold(node, updates, streams, base_rows,
                                          replay=not fenced)
            with node.index.primary.write_batch():
                if check_live:
                    _check_no_live_inserts(node, updates)
                truncates = _TruncateTargets(node)
                for u in updates:
                    stream = streams[(u.table.table_id, u.vnode)]
                    later: dict[bytes, int] = {}  # key -> its first version after u.ts
                    deleted = _apply_truncate(node, u, truncates) + \
                        _apply_deletes(node, u, later)
                    if check_live:  # a bulk load's re-application: no key has a later one
                        _later_of_standalone_inserts(node, u, later)
                    inserted = _stage_inserts(node, stream, u, staged, later)
                    truncates.inserted(u)
                    response.results.add(table_name=u.table.name, virtual_node_id=u.vnode,
                                         deleted_rows=deleted, inserted_rows=inserted)
                    response.deleted_rows += deleted
                    response.inserted_rows += inserted
                # POSITION_DURABLE_WITH_APPLY: in the batch, committed with the versions.
                node.source_positions.put(writer_id, {u.ts: u.source_position
                                                      for u in updates if u.source_position})
                # APPLIED_RECORDED_WITH_APPLY: also a part that changed nothing.
                node.applied.record((u.table.table_id, u.vnode, u.ts) for u in updates)
        except BaseException as exc:
            for stream, u, handles in staged:
                _compensate(node, stream, u, handles)
            if isinstance(exc, IndexBackendError):
                raise Refusal(grpc.StatusCode.UNAVAILABLE,
                              f"request failed and was compensated: {exc}") from exc
            raise
        for stream, _u, handles in staged:
            stream.buffer.settle(handles, SettleMode.VISIBLE)
    for stream in order:
        node.submit_sealed(stream)
    return response


def _record_refusal(node: RetinaNode, updates: list[PreparedUpdate], writer_id: str,
                    floor: int) -> None:
    """REFUSED_IS_RECORDED_BEFORE_ANSWERED (refused_writes.py): every timestamp of the
    refused request at or below the floor that refused it (a later one may still be
    admitted), once the writes admitted at or below them have finished (a part of the
    same transaction still applying must be seen: SKIP_ONLY_WHAT_CHANGED_NOTHING)."""
    stamps = {u.ts for u in updates if u.ts <= floor}
    node.fence.wait_admitted(max(stamps), "recording a refused write")
    node.refused.record(writer_id, stamps)


class _TruncateTargets:
    """The keys each TRUNCATE of one request deletes. A source TRUNCATE arrives as one
    TableUpdateData per virtual node: the table's versions are scanned once per (table,
    timestamp) and grouped by virtual node, not once per virtual node. The scan is taken
    again only for a virtual node that got inserts since (a later TRUNCATE of the same
    table in the request must see them); deletes only ever add tombstones, which leave a
    scanned target a harmless no-op."""

    def __init__(self, node: RetinaNode) -> None:
        self._node = node
        self._scans: dict[int, tuple[int, dict[int, list[bytes]]]] = {}  # table -> (ts, keys)
        self._inserted: set[tuple[int, int]] = set()  # (table, vnode) written since its scan

    def keys(self, u: PreparedUpdate) -> list[bytes]:
        tid = u.table.table_id
        scan = self._scans.get(tid)
        if scan is None or scan[0] != u.ts or (tid, u.vnode) in self._inserted:
            scan = (u.ts, self._node.index.primary.truncate_targets(
                tid, u.ts, self._node.topology.vnode_of_key))
            self._scans[tid] = scan
            self._inserted = {w for w in self._inserted if w[0] != tid}
        return scan[1].get(u.vnode, [])

    def inserted(self, u: PreparedUpdate) -> None:
        if u.insert_keys:
            self._inserted.add((u.table.table_id, u.vnode))


def _apply_truncate(node: RetinaNode, u: PreparedUpdate, targets: _TruncateTargets) -> int:
    """TRUNCATE of (table, vnode) at ``u.ts``: a DELETE of every key whose latest version
    at or before ``u.ts`` is a row (``PrimaryIndex.truncate_targets``; its own
    tombstones at ``u.ts`` do not count). Re-applied (a retry, a replay) it rewrites
    those tombstones, deletes a stale copy at exactly ``u.ts`` (which the INSERTs of
    the same update put back) and a row a replay put back under a tombstone at an
    earlier timestamp; versions after ``u.ts`` are never touched."""
    if not u.truncate:
        return 0
    keys = targets.keys(u)
    return _apply_deletes(node, dataclasses.replace(u, delete_keys=keys)) if keys else 0


def _apply_deletes(node: RetinaNode, u: PreparedUpdate,
                   later: dict[bytes, int] | None = None) -> int:
    """The update's DELETEs (DELETE_TARGETS); ``later`` gets each deleted key's first
    version after ``u.ts``, if it has one (SUPERSEDED_COPIES_END_AT_THE_NEXT_VERSION)."""
    if not u.delete_keys:
        return 0
    tid = u.table.table_id
    keys = list(dict.fromkeys(u.delete_keys))
    after: dict[int, int] = {}
    targets = node.index.delete_targets(tid, keys, node.in_baseline, u.ts, after)
    if targets is None:
        raise Refusal(grpc.StatusCode.UNAVAILABLE, "primary index backend error")
    if later is not None:
        later.update((keys[i], ts) for i, ts in after.items())
    by_rg, found_keys = targets.rows_by_rg, targets.found_keys
    deleted = sum(node.rg_visibility(f, rg).delete(rows, u.ts) for (f, rg), rows in by_rg.items())
    # REPLACE_WRITES_ONE_VERSION: a key this update re-inserts gets its version at u.ts
    # from the INSERT (putPrimaryEntriesOnly, same batch, same key@ts), which would
    # overwrite the tombstone: writing it first changes nothing durable, so it is not
    # written. If the INSERT fails, the batch aborts and neither is written.
    reinserted = set(u.insert_keys)
    tombstoned = [k for k in found_keys if k not in reinserted] if reinserted else found_keys
    if tombstoned:
        node.index.primary.tombstone_primary_resolved(tid, tombstoned, u.ts)
    return deleted


def _later_of_standalone_inserts(node: RetinaNode, u: PreparedUpdate,
                                 later: dict[bytes, int]) -> None:
    """``later`` for the inserts no DELETE of the update scanned (an INSERT alone; beside
    a TRUNCATE): their keys' first versions after ``u.ts``."""
    deleted = set(u.delete_keys)
    alone = [k for k in u.insert_keys if k not in deleted]
    if not alone:
        return
    after: dict[int, int] = {}
    if node.index.primary.candidates(u.table.table_id, alone, u.ts, after) is None:
        raise Refusal(grpc.StatusCode.UNAVAILABLE, "primary index backend error")
    later.update((alone[i], ts) for i, ts in after.items())


def _stage_inserts(node: RetinaNode, stream: Stream, u: PreparedUpdate,
                   staged: list[tuple[Stream, PreparedUpdate, list[AppendHandle]]],
                   later: dict[bytes, int] | None = None) -> int:
    """Append pending → putMainIndexEntries → putPrimaryEntriesOnly (in the batch).

    The handles are recorded in ``staged`` as soon as they exist, even those
    of an append that fails part-way (a new file cannot be registered), so a
    failure at any later point compensates them.

    SUPERSEDED_COPIES_END_AT_THE_NEXT_VERSION: a key of a replace that already has a
    version after ``u.ts`` (``later``: an earlier attempt of the same write was followed
    by later writes of the key before this retry, or a write of another writer at a
    later timestamp came first) gets its row deleted at that version's timestamp, so the
    row is visible exactly until the key's next version: without it, the row would stay
    visible beside the later one (a key twice in every snapshot after it)."""
    n = len(u.insert_keys)
    if not n:
        return 0
    ts_column = pa.array(np.full(n, u.ts, dtype=np.int64))
    # The stream may have evolved past u.table (a column added while this request was
    # prepared): the columns added since are NULL in its rows.
    added = [pa.nulls(n, f.type) for f in list(stream.schema)[len(u.insert_columns):-1]]
    batch = pa.RecordBatch.from_arrays([*u.insert_columns, *added, ts_column],
                                       schema=stream.schema)
    first_row_id = node.index.sequences.allocate_row_ids(n)
    handles: list[AppendHandle] = []
    staged.append((stream, u, handles))
    stream.buffer.append_pending(batch, u.ts, first_row_id, handles)
    node.index.main.put_main_index_entries(_ranges(handles))
    node.index.primary.put_primary_entries_only(  # the batch's abort is the undo
        u.table.table_id, u.insert_keys, range(first_row_id, first_row_id + n), u.ts,
        keep_previous=False)
    if later:
        _end_superseded(u.insert_keys, handles, later)
    return n


def _end_superseded(keys: list[bytes], handles: list[AppendHandle],
                    later: dict[bytes, int]) -> None:
    """Delete each inserted row whose key has a later version at that version's
    timestamp (``_stage_inserts``); rows are in ``keys`` order across the handles."""
    position = 0
    for h in handles:
        for offset, key in enumerate(keys[position:position + h.count]):
            ends = later.get(key)
            if ends is not None:
                SUPERSEDED.inc()
                h.block.visibility.delete([h.start + offset], ends)
        position += h.count


def _compensate(node: RetinaNode, stream: Stream, u: PreparedUpdate,
                handles: list[AppendHandle]) -> None:
    """Hide rows whose primary entries were rolled back with the batch."""
    try:
        # Hidden rows stay in their file, and recovery checks that a file's
        # MainIndex rows equal its row count: a partial append never put its
        # ranges (re-adding a range is idempotent).
        node.index.main.put_main_index_entries(_ranges(handles))
        for h in handles:
            h.block.visibility.delete(range(h.start, h.start + h.count), u.ts)
        stream.buffer.settle(handles, SettleMode.HIDDEN)
    except Exception as exc:
        node.fail_closed(f"compensation of a failed insert failed: {exc}")
        raise NodeFailedClosed(str(exc)) from exc


def _ranges(handles: list[AppendHandle]) -> list[RowIdRange]:
    return [RowIdRange(h.row_id_start, h.count, h.file.file_id, h.block.rg_id, h.start)
            for h in handles]
