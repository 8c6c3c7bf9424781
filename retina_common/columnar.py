"""The columnar form of a ``TableUpdateData``: Arrow IPC streams instead of rows.

Documented in ``docs/encoding.md`` ("Columnar form"). ``delete_keys_arrow``
holds one binary column ``key`` (the primary-key bytes of each row to
delete); ``insert_rows_arrow`` holds the rows to insert, one column per table
column, by name and in column order, with the column's Arrow type
(``codec.arrow_type``); a prefix of the columns is a row encoded before a
column was added. Retina computes an inserted row's key bytes from its key
columns (``codec.encode_primary_keys``), so a key cannot disagree with its row.

The row form (``delete_data`` / ``insert_data``, one protobuf message and one
``bytes`` per value) stays for compatibility; this form is what the client
library, the connector and the Spark replay send for parts of
``COLUMNAR_MIN_ROWS`` items or more, to nodes that accept it, because it is
decoded and checked a column at a time instead of a value at a time.

Decoding is the trust boundary: a stream that does not parse, is compressed,
holds a dictionary batch or pre-V5 metadata, holds a type or name other than
the table's, or fails Arrow's full validation (offsets, UTF-8, decimal
precision) raises ``ColumnarError`` with a message naming what is wrong; the
server turns it into INVALID_ARGUMENT.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence

import pyarrow as pa

from retina_common.catalog import TableRecord
from retina_common.codec import arrow_type, decode_column

DELETE_KEY = "key"
_DELETE_SCHEMA = pa.schema([pa.field(DELETE_KEY, pa.binary(), nullable=False)])
_U16, _U32, _I32, _I64 = (struct.Struct(f) for f in ("<H", "<I", "<i", "<q"))

# Below this many items (deletes plus inserts) in a TableUpdateData the row form is
# cheaper end to end: an Arrow IPC stream costs a fixed ~50 µs to write and ~15 µs to
# read, an item ~7 µs in the row form (measured on the 2-core bench machine, 6 columns;
# crossover ~16 items).
COLUMNAR_MIN_ROWS = 32
# A node that does not say GetRetinaStatus.accepts_columnar gets the row form only.
ROW_FORM_ONLY = 2**62


def min_columnar_rows(accepts_columnar: bool) -> int:
    """The columnar threshold for a node, from its GetRetinaStatus.accepts_columnar: a
    node built before the columnar form would ignore its fields, losing the rows."""
    return COLUMNAR_MIN_ROWS if accepts_columnar else ROW_FORM_ONLY


class ColumnarError(ValueError):
    """A columnar payload is malformed or does not fit the table."""


def table_schema(table: TableRecord, width: int | None = None) -> pa.Schema:
    """The Arrow schema of ``insert_rows_arrow`` for the first ``width`` columns."""
    columns = table.columns if width is None else table.columns[:width]
    return pa.schema([pa.field(c.name, arrow_type(c.type)) for c in columns])


def _ipc(batch: pa.RecordBatch) -> bytes:
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, batch.schema) as writer:
        writer.write_batch(batch)
    return sink.getvalue().to_pybytes()


def encode_delete_keys(keys: Sequence[bytes]) -> bytes:
    """``delete_keys_arrow`` for primary-key bytes ``keys``."""
    return _ipc(pa.record_batch([pa.array(keys, pa.binary())], schema=_DELETE_SCHEMA))


def encode_insert_rows(table: TableRecord, columns: Sequence[pa.Array]) -> bytes:
    """``insert_rows_arrow`` for the table's first ``len(columns)`` columns."""
    return _ipc(pa.record_batch(list(columns), schema=table_schema(table, len(columns))))


def encode_insert_values(table: TableRecord, rows: Sequence[Sequence[bytes]]) -> bytes:
    """``insert_rows_arrow`` for rows whose values are in the row form's encoding
    (``codec``), as the connector's changelog keeps them; rows of different schema
    versions are padded with NULL to the widest. Raises ``codec.EncodingError`` on a
    value that does not decode and ``ColumnarError`` on a row wider than ``table``."""
    if not rows:
        raise ValueError("no rows to encode")
    width = max(len(r) for r in rows)
    if width > len(table.columns):
        raise ColumnarError(f"a row has {width} values; {table.name} has "
                            f"{len(table.columns)} columns")
    if any(len(r) != width for r in rows):
        rows = [(*r, *([b""] * (width - len(r)))) for r in rows]
    columns = [decode_column(c.type, values)
               for c, values in zip(table.columns, zip(*rows, strict=True), strict=False)]
    return encode_insert_rows(table, columns)


def encode_partial_rows(table: TableRecord, targets: Sequence[str],
                        columns: Sequence[pa.Array]) -> bytes:
    """``partial_rows_arrow``: partial updates of the ``targets`` columns (the key columns
    among them), one array per target in that order."""
    by_name = {c.name: c for c in table.columns}
    unknown = [t for t in targets if t not in by_name]
    if unknown:
        raise ColumnarError(f"{table.name} has no column {unknown[0]}")
    schema = pa.schema([pa.field(t, arrow_type(by_name[t].type)) for t in targets])
    return _ipc(pa.record_batch(list(columns), schema=schema))


def _plain_rows(data: bytes, what: str) -> int:
    """The rows of a stream, read from its messages' metadata without decoding them,
    after checking every message is the schema or an uncompressed record batch.

    A compressed body could expand a request of a few KB into gigabytes before any
    row is counted; a dictionary batch has no column type to belong to. Both are
    refused before anything is decoded, as is metadata older than V5 (which could
    flag compression another way), so a decoded stream is never larger than the
    request that carried it."""
    try:
        reader = pa.ipc.MessageReader.open_stream(pa.py_buffer(data))
        rows = 0
        for i, message in enumerate(reader):
            kind = message.type
            if message.metadata_version != pa.ipc.MetadataVersion.V5:
                # Before V5 a batch could say it is compressed in its message's custom
                # metadata (ARROW:experimental_compression), which Arrow still honours.
                raise ColumnarError(f"{what} uses an Arrow IPC metadata version before "
                                    "V5; only V5 is taken")
            if i == 0 and kind == "schema":
                continue
            if kind != "record batch" or i == 0:
                raise ColumnarError(f"{what} holds a {kind} message; only a schema and "
                                    "record batches are taken")
            length, compressed = _record_batch_header(message.metadata.to_pybytes())
            if compressed:
                raise ColumnarError(f"{what} is compressed; send it uncompressed")
            rows += length
    except (pa.ArrowException, OSError, ValueError, IndexError, struct.error) as exc:
        if isinstance(exc, ColumnarError):
            raise
        raise ColumnarError(f"{what} is not a valid Arrow IPC stream: {exc}") from None
    return rows


def _record_batch_header(meta: bytes) -> tuple[int, bool]:
    """(row count, compressed?) of a record batch message's flatbuffer metadata: the
    Message table's ``header`` (field 2) is a RecordBatch table whose ``length`` is
    field 0 and ``compression`` field 3 (Arrow's Message.fbs)."""
    message = _table(meta, _U32.unpack_from(meta, 0)[0])
    header = _field(meta, message, 2)
    if header is None:
        raise ColumnarError("a record batch message without its header")
    batch = _table(meta, header + _U32.unpack_from(meta, header)[0])
    length_at = _field(meta, batch, 0)
    length = 0 if length_at is None else _I64.unpack_from(meta, length_at)[0]
    if length < 0:
        raise ColumnarError("a record batch of negative length")
    return length, _field(meta, batch, 3) is not None


def _table(meta: bytes, at: int) -> tuple[int, int]:
    """(table position, vtable position) of the flatbuffer table at ``at``."""
    vtable = at - _I32.unpack_from(meta, at)[0]
    if not 0 <= vtable < len(meta) or not 0 <= at < len(meta):
        raise ColumnarError("flatbuffer offsets outside the metadata")
    return at, vtable


def _field(meta: bytes, table: tuple[int, int], index: int) -> int | None:
    """Where field ``index`` of ``table`` is stored, or None if it is absent."""
    at, vtable = table
    size = _U16.unpack_from(meta, vtable)[0]
    slot = 4 + 2 * index
    if slot + 2 > size:
        return None
    offset = _U16.unpack_from(meta, vtable + slot)[0]
    return at + offset if offset else None


def _read(data: bytes, what: str) -> pa.Table:
    _plain_rows(data, what)
    try:
        table = pa.ipc.open_stream(pa.py_buffer(data)).read_all()
    except (pa.ArrowException, OSError, ValueError) as exc:
        raise ColumnarError(f"{what} is not a valid Arrow IPC stream: {exc}") from None
    try:
        table.validate(full=True)
    except (pa.ArrowException, ValueError) as exc:
        raise ColumnarError(f"{what} holds invalid data: {exc}") from None
    return table


def decode_delete_keys(data: bytes) -> list[bytes]:
    """The primary-key bytes of ``delete_keys_arrow``."""
    table = _read(data, "delete_keys_arrow")
    if table.schema.names != [DELETE_KEY] or table.schema.types[0] != pa.binary():
        raise ColumnarError(f"delete_keys_arrow must hold one binary column {DELETE_KEY!r}, "
                            f"not {_describe(table.schema)}")
    column = table.column(0).combine_chunks()
    if column.null_count:
        raise ColumnarError("delete_keys_arrow holds a NULL key")
    return column.to_pylist()


def decode_insert_rows(data: bytes, table: TableRecord) -> pa.Table:
    """The rows of ``insert_rows_arrow``, checked against ``table``'s columns.

    The caller has already refreshed ``table`` if the stream is wider than it.
    Its columns must be a schema version's prefix of the table's, by name and
    Arrow type (field nullability and metadata are not part of the contract)."""
    rows = _read(data, "insert_rows_arrow")
    width = rows.num_columns
    if not table.accepts_width(width):
        raise ColumnarError(f"insert_rows_arrow has {width} columns; the table has "
                            f"{_widths(table)}")
    expected = table_schema(table, width)
    if rows.schema.names != expected.names or rows.schema.types != expected.types:
        raise ColumnarError(f"insert_rows_arrow columns are {_describe(rows.schema)}, not "
                            f"{_describe(expected)}")
    return rows


def partial_targets(data: bytes) -> list[str]:
    """The target column names ``partial_rows_arrow`` declares (schema only)."""
    try:
        return list(pa.ipc.open_stream(pa.py_buffer(data)).schema.names)
    except (pa.ArrowException, OSError, ValueError) as exc:
        raise ColumnarError(f"partial_rows_arrow is not a valid Arrow IPC stream: {exc}"
                            ) from None


def decode_partial_rows(data: bytes, table: TableRecord) -> pa.Table:
    """The rows of ``partial_rows_arrow``: its columns are target columns of ``table``,
    by name and Arrow type, none twice (the caller checks the key columns are among
    them and has refreshed ``table`` if it names a column ``table`` lacks)."""
    rows = _read(data, "partial_rows_arrow")
    names = rows.schema.names
    by_name = {c.name: c for c in table.columns}
    unknown = [n for n in names if n not in by_name]
    if unknown:
        raise ColumnarError(f"partial_rows_arrow names column {unknown[0]!r}, which "
                            f"{table.name} does not have")
    if len(set(names)) != len(names):
        raise ColumnarError(f"partial_rows_arrow names a column twice: {names}")
    wrong = [f"{f.name}: {f.type} (not {arrow_type(by_name[f.name].type)})"
             for f in rows.schema if f.type != arrow_type(by_name[f.name].type)]
    if wrong:
        raise ColumnarError(f"partial_rows_arrow columns of other types: {wrong}")
    return rows


def decode_key_columns(data: bytes, table: TableRecord) -> list[pa.Array]:
    """The key columns of ``key_columns_arrow`` (LookupRows): the table's primary-key
    columns by name, in key order, none NULL. A column of another Arrow type is cast to
    the key column's type when no value changes (an int64 column of an int32 key, say);
    a lossy cast is refused."""
    keys = _read(data, "key_columns_arrow")
    names = list(table.primary_key)
    if keys.schema.names != names:
        raise ColumnarError(f"key_columns_arrow must hold the key columns {names} in key "
                            f"order, not {_describe(keys.schema)}")
    types = {c.name: c.type for c in table.columns}
    out = []
    for name in names:
        column = keys.column(name).combine_chunks()
        if column.null_count:
            raise ColumnarError(f"key_columns_arrow: key column {name} holds a NULL")
        wanted = arrow_type(types[name])
        if column.type != wanted:
            try:
                column = column.cast(wanted, safe=True)
            except (pa.ArrowException, ValueError) as exc:
                raise ColumnarError(f"key_columns_arrow: key column {name} is "
                                    f"{column.type}, not {wanted}: {exc}") from None
        out.append(column)
    return out


def stream_width(data: bytes) -> int:
    """The number of columns ``insert_rows_arrow`` declares (schema only)."""
    try:
        return len(pa.ipc.open_stream(pa.py_buffer(data)).schema)
    except (pa.ArrowException, OSError, ValueError) as exc:
        raise ColumnarError(f"insert_rows_arrow is not a valid Arrow IPC stream: {exc}"
                            ) from None


def row_count(data: bytes, what: str = "columnar payload") -> int:
    """The rows of one columnar payload (``what`` names it in an error), or 0 for an
    empty one."""
    return _plain_rows(data, what) if data else 0


def _widths(table: TableRecord) -> str:
    if table.original_width == len(table.columns):
        return f"{len(table.columns)}"
    return f"{table.original_width} to {len(table.columns)}"


def _describe(schema: pa.Schema) -> str:
    return "(" + ", ".join(f"{f.name}: {f.type}" for f in schema) + ")"
