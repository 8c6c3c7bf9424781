"""Column value encoding of ``InsertData.col_values`` (one ``bytes`` per column).

Documented in ``docs/encoding.md``. Empty bytes is NULL for every type. A
non-NULL value is:

| type | bytes |
|---|---|
| boolean | 1 byte, 0 or 1 |
| int32, date32 (days since epoch) | 4 bytes little-endian two's complement |
| int64, timestamp_us (µs since epoch, UTC) | 8 bytes little-endian two's complement |
| float32 / float64 | 4 / 8 bytes IEEE-754 little-endian |
| decimal(p,s) | 16 bytes little-endian two's complement of the unscaled value |
| string | 0x01 then UTF-8 (so "" is ``b"\\x01"``) |
| binary | 0x01 then the bytes |

Fixed-width columns without NULLs decode without a per-row Python loop.
``encode_primary_keys`` is the batch form of ``encode_primary_key`` over decoded
columns; Retina uses it to check that an INSERT's key bytes match its row.
"""

from __future__ import annotations

import re
import struct
from collections.abc import Sequence
from datetime import date, datetime
from decimal import Decimal
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

# The hidden column of every data file: each row's commit timestamp (one home for the
# name: the write path, cleansing, Storage GC, the reader and the Spark jobs use it).
COMMIT_TS = "_commit_ts"
# The codec of every data file (ingest publish and Storage GC rewrites write the same).
PARQUET_COMPRESSION = "zstd"

_DECIMAL = re.compile(r"^decimal\((\d+),(\d+)\)$")
_FIXED = {"boolean": 1, "int32": 4, "date32": 4, "int64": 8, "timestamp_us": 8,
          "float32": 4, "float64": 8}
_STRUCT = {"int32": struct.Struct("<i"), "date32": struct.Struct("<i"),
           "int64": struct.Struct("<q"), "timestamp_us": struct.Struct("<q"),
           "float32": struct.Struct("<f"), "float64": struct.Struct("<d")}


_MARKER = pa.scalar(b"\x01", pa.binary())  # leads every non-NULL string or binary value


class EncodingError(ValueError):
    """A value's bytes do not match its column type."""


def arrow_type(type_name: str) -> pa.DataType:
    match = _DECIMAL.match(type_name)
    if match:
        return pa.decimal128(int(match.group(1)), int(match.group(2)))
    return {
        "boolean": pa.bool_(), "int32": pa.int32(), "int64": pa.int64(),
        "float32": pa.float32(), "float64": pa.float64(), "string": pa.string(),
        "binary": pa.binary(), "date32": pa.date32(), "timestamp_us": pa.timestamp("us", "UTC"),
    }[type_name]


def _width(type_name: str) -> int | None:
    if _DECIMAL.match(type_name):
        return 16
    return _FIXED.get(type_name)


def decode_column(type_name: str, values: Sequence[bytes]) -> pa.Array:
    """Decode one column of a batch; raises EncodingError on a malformed value."""
    width = _width(type_name)
    arrow = arrow_type(type_name)
    if width is not None:
        if all(len(v) == width for v in values):  # fast path: no NULLs
            data = b"".join(values)
            if type_name == "boolean":
                if data.strip(b"\x00\x01"):
                    raise EncodingError("boolean values must be 0 or 1")
                return pa.array(bytearray(data), pa.uint8()).cast(pa.bool_())
            return pa.Array.from_buffers(arrow, len(values), [None, pa.py_buffer(data)])
        bad = [v for v in values if len(v) not in (0, width)]
        if bad:
            raise EncodingError(f"{type_name} value of {len(bad[0])} bytes, expected {width}")
        valid = [len(v) == width for v in values]
        filler = b"\x00" * width
        data = b"".join(v if ok else filler for v, ok in zip(values, valid, strict=True))
        if type_name == "boolean":
            return pa.array([bool(v[0]) if ok else None for v, ok in zip(values, valid,
                                                                          strict=True)], arrow)
        mask = pa.array(valid, pa.bool_())
        dense = pa.Array.from_buffers(arrow, len(values), [None, pa.py_buffer(data)])
        return pc.if_else(mask, dense, pa.nulls(len(values), arrow))
    out: list[Any] = []
    for v in values:
        if not v:
            out.append(None)
        elif v[0] != 1:
            raise EncodingError(f"{type_name} value must start with 0x01")
        else:
            out.append(v[1:])
    if type_name == "string":
        try:
            return pa.array([None if v is None else v.decode() for v in out], pa.string())
        except UnicodeDecodeError as exc:
            raise EncodingError(f"string value is not UTF-8: {exc}") from None
    return pa.array(out, pa.binary())


def encode_value(type_name: str, value: Any) -> bytes:
    """The client side of the encoding (used by drivers, tools and tests)."""
    if value is None:
        return b""
    match = _DECIMAL.match(type_name)
    if match:
        scale = int(match.group(2))
        unscaled = int((Decimal(value) * (10 ** scale)).to_integral_value())
        return unscaled.to_bytes(16, "little", signed=True)
    if type_name == "boolean":
        return b"\x01" if value else b"\x00"
    if type_name == "date32" and isinstance(value, date):
        value = (value - date(1970, 1, 1)).days
    if type_name == "timestamp_us" and isinstance(value, datetime):
        value = int(value.timestamp() * 1_000_000)
    if type_name in _STRUCT:
        return _STRUCT[type_name].pack(value)
    if type_name == "string":
        return b"\x01" + str(value).encode()
    if type_name == "binary":
        return b"\x01" + bytes(value)
    raise EncodingError(f"unknown column type {type_name}")


def encode_primary_key(types: Sequence[str], values: Sequence[Any]) -> bytes:
    """Primary-key bytes: for each key column in key order, a 4-byte big-endian
    length and the column's value encoding. Deterministic, so the same row
    always routes to the same virtual node."""
    if len(types) != len(values):
        raise EncodingError("primary key arity mismatch")
    out = bytearray()
    for type_name, value in zip(types, values, strict=True):
        if value is None:
            raise EncodingError("a primary-key column cannot be NULL")
        encoded = encode_value(type_name, value)
        out += len(encoded).to_bytes(4, "big") + encoded
    return bytes(out)


def encode_primary_keys(types: Sequence[str], columns: Sequence[pa.Array]) -> pa.Array:
    """``encode_primary_key`` of every row at once, from decoded key columns (no NULLs).

    A binary array; row ``i`` equals ``encode_primary_key(types, [c[i] for c in
    columns])``. No per-row Python work: the fixed-width encodings are the
    columns' own little-endian data buffers, laid side by side with numpy."""
    if len(types) != len(columns):
        raise EncodingError("primary key arity mismatch")
    if any(column.null_count for column in columns):
        raise EncodingError("a primary-key column cannot be NULL")
    widths = [_width(t) for t in types]
    if all(w is not None for w in widths):
        return _fixed_width_keys(types, columns)
    parts: list[pa.Array | pa.Scalar] = []
    for type_name, column, width in zip(types, columns, widths, strict=True):
        if width is None:  # length, the 0x01 marker, the bytes: one join for the whole key
            raw = column.cast(pa.binary())
            parts += [_big_endian_lengths(raw, 1), _MARKER, raw]
        else:
            parts += [pa.scalar(width.to_bytes(4, "big"), pa.binary()),
                      encode_values(type_name, column)]
    return pc.binary_join_element_wise(*parts, b"")


def _fixed_width_keys(types: Sequence[str], columns: Sequence[pa.Array]) -> pa.Array:
    # Every key has the same length: one (rows x key bytes) matrix, filled
    # column-wise, is much cheaper than Arrow's element-wise binary join.
    rows = len(columns[0]) if columns else 0
    widths = [_width(t) or 0 for t in types]
    out = np.empty((rows, sum(4 + w for w in widths)), dtype=np.uint8)
    at = 0
    for type_name, column, width in zip(types, columns, widths, strict=True):
        out[:, at:at + 4] = np.frombuffer(width.to_bytes(4, "big"), dtype=np.uint8)
        out[:, at + 4:at + 4 + width] = _value_bytes(type_name, column, width)
        at += 4 + width
    return pa.Array.from_buffers(pa.binary(out.shape[1]), rows,
                                 [None, pa.py_buffer(out)]).cast(pa.binary())


def _value_bytes(type_name: str, column: pa.Array, width: int) -> np.ndarray:
    """A fixed-width column's encodings as a (rows x width) byte matrix."""
    if type_name == "boolean":  # a bitmap in Arrow; one byte on the wire
        column = column.cast(pa.uint8())
    data = np.frombuffer(column.buffers()[1], dtype=np.uint8)
    start = column.offset * width
    return data[start:start + len(column) * width].reshape(len(column), width)


def encode_values(type_name: str, column: pa.Array) -> pa.Array:
    """The value encoding of a decoded column without NULLs, as a binary array."""
    width = _width(type_name)
    if width is None:  # string, binary: the 0x01 marker, then the bytes
        return pc.binary_join_element_wise(_MARKER, column.cast(pa.binary()), b"")
    matrix = _value_bytes(type_name, column, width)
    return pa.Array.from_buffers(pa.binary(width), len(column),
                                 [None, pa.py_buffer(matrix.tobytes())]).cast(pa.binary())


def _big_endian_lengths(values: pa.Array, extra: int) -> pa.Array:
    """4-byte big-endian ``len(value) + extra`` of every value."""
    lengths = (pc.binary_length(values).to_numpy(zero_copy_only=False) + extra).astype(">u4")
    return pa.Array.from_buffers(pa.binary(4), len(values),
                                 [None, pa.py_buffer(lengths.tobytes())]).cast(pa.binary())
