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

import functools
import math
import numbers
import re
import struct
from collections.abc import Callable, Sequence
from datetime import UTC, date, datetime, time, timedelta
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
# The footer key under which a Storage GC output names its rewrite (the job writes
# "gc_rewrite_id" under its "retina." prefix, spark_jobs/storage_gc.py). Ingest files
# never carry it: recovery tells a rewrite's output from an ingest file by it.
GC_REWRITE_ID_KEY = b"retina.gc_rewrite_id"
# The Parquet footer key a bulk load's files carry: the load's id (retina_server/bulk_load.py).
LOAD_ID_KEY = b"retina.load_id"

_DECIMAL = re.compile(r"^decimal\((\d+),(\d+)\)$")
_FIXED = {"boolean": 1, "int32": 4, "date32": 4, "int64": 8, "timestamp_us": 8,
          "float32": 4, "float64": 8}
_STRUCT = {"int32": struct.Struct("<i"), "date32": struct.Struct("<i"),
           "int64": struct.Struct("<q"), "timestamp_us": struct.Struct("<q"),
           "float32": struct.Struct("<f"), "float64": struct.Struct("<d")}


_MARKER = pa.scalar(b"\x01", pa.binary())  # leads every non-NULL string or binary value
_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_EPOCH_DATE = date(1970, 1, 1)


class EncodingError(ValueError):
    """A value's bytes do not match its column type."""


@functools.lru_cache(maxsize=256)  # called per column per TableUpdateData
def arrow_type(type_name: str) -> pa.DataType:
    match = _DECIMAL.match(type_name)
    if match:
        return pa.decimal128(int(match.group(1)), int(match.group(2)))
    return {
        "boolean": pa.bool_(), "int32": pa.int32(), "int64": pa.int64(),
        "float32": pa.float32(), "float64": pa.float64(), "string": pa.string(),
        "binary": pa.binary(), "date32": pa.date32(), "timestamp_us": pa.timestamp("us", "UTC"),
    }[type_name]


@functools.lru_cache(maxsize=256)
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
            return _checked(pa.Array.from_buffers(arrow, len(values),
                                                  [None, pa.py_buffer(data)]))
        bad = [v for v in values if len(v) not in (0, width)]
        if bad:
            raise EncodingError(f"{type_name} value of {len(bad[0])} bytes, expected {width}")
        valid = [len(v) == width for v in values]
        filler = b"\x00" * width
        data = b"".join(v if ok else filler for v, ok in zip(values, valid, strict=True))
        if type_name == "boolean":
            if any(ok and v[0] > 1 for v, ok in zip(values, valid, strict=True)):
                raise EncodingError("boolean values must be 0 or 1")
            return pa.array([bool(v[0]) if ok else None for v, ok in zip(values, valid,
                                                                          strict=True)], arrow)
        mask = pa.array(valid, pa.bool_())
        dense = _checked(pa.Array.from_buffers(arrow, len(values), [None, pa.py_buffer(data)]))
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


def _checked(array: pa.Array) -> pa.Array:
    """A decimal column's unscaled values fit its precision (the 16 bytes hold more);
    other fixed-width types have no invalid bit patterns."""
    if pa.types.is_decimal(array.type):
        try:
            array.validate(full=True)
        except pa.ArrowInvalid as exc:
            raise EncodingError(str(exc)) from None
    return array


def encode_value(type_name: str, value: Any) -> bytes:
    """The client side of the encoding (used by drivers, tools, tests and the CDC connector).

    Raises :class:`EncodingError`, and nothing else, for a value the column type
    cannot hold exactly: a Python type that contradicts the column type (a
    string for a timestamp, a date for an int64, ...), an integer outside the
    type's range, a decimal with more fractional digits than the scale or more
    digits than the precision. Accepted besides the natural type: an int for
    float and decimal columns, a str for decimal ones (parsed exactly), a
    ``datetime`` for timestamp_us (naive is taken as UTC), a ``date`` for date32
    and a ``time`` of day for int64 (µs since midnight: Retina has no time type).
    """
    if value is None:
        return b""
    return value_encoder(type_name)(value)


@functools.lru_cache(maxsize=256)
def value_encoder(type_name: str) -> Callable[[Any], bytes]:
    """:func:`encode_value` for one column type, resolved once (a writer encodes many
    values of each column): the returned function takes a non-NULL value. For a type
    the codec does not know it raises EncodingError when called, as encode_value does,
    never here: callers resolve every column's encoder up front, before they know which
    values are NULL."""
    match = _DECIMAL.match(type_name)
    if match:
        return functools.partial(_encode_decimal, int(match.group(1)), int(match.group(2)))
    encode = _ENCODERS.get(type_name)
    if encode is None:
        return functools.partial(_unknown_type, type_name)
    general = functools.partial(encode, type_name)
    natural = _NATURAL.get(type_name)
    if natural is None:
        return general
    return _fast_path(natural, _STRUCT[type_name].pack if natural is not str else None,
                      general)


@functools.lru_cache(maxsize=256)
def column_encoder(type_name: str) -> Callable[[Sequence[Any]], list[bytes]]:
    """``encode_value`` over a whole column (a transaction's values of one column), NULL
    (None) as ``b""``: exactly the bytes of encoding each value, and the EncodingError
    of the first value that does not fit. A column of an int64 or float64 column's
    natural Python type is packed by numpy at once; a string column without the
    per-value call; anything else (another type among the values, a value out of
    range) value by value, as ``value_encoder`` does."""
    encode = value_encoder(type_name)
    fixed = {"int64": (int, np.int64, "<i8"), "float64": (float, np.float64, "<f8")}.get(type_name)

    def by_value(values: Sequence[Any]) -> list[bytes]:
        return [b"" if v is None else encode(v) for v in values]

    if type_name == "string":
        def strings(values: Sequence[Any]) -> list[bytes]:
            try:
                return [b"" if v is None else b"\x01" + v.encode() if type(v) is str
                        else encode(v) for v in values]
            except UnicodeEncodeError:  # a lone surrogate: encode says so, value by value
                return by_value(values)
        return strings
    if fixed is None:
        return by_value
    natural, dtype, layout = fixed
    width = np.dtype(layout).itemsize

    def packed(values: Sequence[Any]) -> list[bytes]:
        present = [v for v in values if v is not None]
        if not all(type(v) is natural for v in present):
            return by_value(values)
        try:
            raw = np.fromiter(present, dtype, len(present)).astype(layout, copy=False).tobytes()
        except OverflowError:  # an int out of the int64 range: encode's own error
            return by_value(values)
        out = [raw[i:i + width] for i in range(0, len(raw), width)]
        if len(present) == len(values):
            return out
        it = iter(out)
        return [b"" if v is None else next(it) for v in values]
    return packed


def _fast_path(natural: type, pack: Callable[[Any], bytes] | None,
               general: Callable[[Any], bytes]) -> Callable[[Any], bytes]:
    """``general`` behind a shortcut for the type's natural Python type (an int for
    int64, a float for float64, a str for string), which is what most values are.
    Whatever the shortcut cannot take (out of range, a lone surrogate, another
    type) goes to ``general``, which accepts it or raises the EncodingError."""
    if pack is None:
        def encode_str(value: Any) -> bytes:
            if type(value) is str:
                try:
                    return b"\x01" + value.encode()
                except UnicodeEncodeError:
                    pass
            return general(value)
        return encode_str

    def encode(value: Any) -> bytes:
        if type(value) is natural:
            try:
                return pack(value)
            except (struct.error, OverflowError):
                pass
        return general(value)
    return encode


def _unknown_type(type_name: str, _value: Any) -> bytes:
    raise EncodingError(f"unknown column type {type_name}")


def _refuse(type_name: str, value: Any) -> EncodingError:
    return EncodingError(f"a {type(value).__name__} is not a {type_name} value")


def _is_int(value: Any) -> bool:
    if type(value) is int:  # the common case, without the ABC check below
        return True
    return isinstance(value, numbers.Integral) and not isinstance(value, bool | np.bool_)


def _pack_int(type_name: str, number: int) -> bytes:
    bits = _FIXED[type_name] * 8
    if not -(1 << (bits - 1)) <= number < 1 << (bits - 1):
        raise EncodingError(f"{number} is out of the {type_name} range")
    return _STRUCT[type_name].pack(number)


def _encode_int(type_name: str, value: Any) -> bytes:
    if type_name == "int64" and isinstance(value, time):
        value = _micros_of_day(value)
    elif not _is_int(value):
        raise _refuse(type_name, value)
    return _pack_int(type_name, int(value))


def _micros_of_day(value: time) -> int:
    if value.tzinfo is not None:
        raise EncodingError("a time of day with a time zone is not an int64 value")
    return ((value.hour * 60 + value.minute) * 60 + value.second) * 1_000_000 + value.microsecond


def _encode_date(type_name: str, value: Any) -> bytes:
    if isinstance(value, date) and not isinstance(value, datetime):
        value = (value - _EPOCH_DATE).days
    elif not _is_int(value):
        raise _refuse(type_name, value)
    return _pack_int(type_name, int(value))


def _encode_timestamp(type_name: str, value: Any) -> bytes:
    if isinstance(value, datetime):
        # Exact integer arithmetic: a float of seconds loses microseconds far from 1970.
        aware = value if value.tzinfo is not None else value.replace(tzinfo=UTC)
        value = (aware - _EPOCH) // timedelta(microseconds=1)
    elif not _is_int(value):
        raise _refuse(type_name, value)
    return _pack_int(type_name, int(value))


def _encode_float(type_name: str, value: Any) -> bytes:
    # type(value) is float: the common case, without the ABC checks.
    if type(value) is not float and (isinstance(value, bool | np.bool_)
                                     or not isinstance(value, numbers.Real | Decimal)):
        raise _refuse(type_name, value)
    try:
        number = float(value)
        if math.isinf(number) and isinstance(value, Decimal) and value.is_finite():
            raise OverflowError("beyond the float range")  # float() made it infinite
        return _STRUCT[type_name].pack(number)
    except (OverflowError, struct.error, ValueError) as exc:  # ValueError: a signalling NaN
        raise EncodingError(f"{value} does not fit a {type_name}: {exc}") from None


def _encode_boolean(type_name: str, value: Any) -> bytes:
    if isinstance(value, bool | np.bool_) or (_is_int(value) and value in (0, 1)):
        return b"\x01" if value else b"\x00"
    raise _refuse(type_name, value)


def _encode_string(type_name: str, value: Any) -> bytes:
    if not isinstance(value, str):
        raise _refuse(type_name, value)
    try:
        return b"\x01" + value.encode()
    except UnicodeEncodeError as exc:  # a lone surrogate
        raise EncodingError(f"not encodable as UTF-8: {exc}") from None


def _encode_binary(type_name: str, value: Any) -> bytes:
    if not isinstance(value, bytes | bytearray | memoryview):
        raise _refuse(type_name, value)
    return b"\x01" + bytes(value)


def _encode_decimal(precision: int, scale: int, value: Any) -> bytes:
    type_name = f"decimal({precision},{scale})"
    if isinstance(value, float):
        value = repr(value)  # the float's shortest decimal form, not its binary expansion
    if isinstance(value, str):
        try:
            value = Decimal(value.strip())
        except ArithmeticError:
            raise EncodingError(f"{value!r} is not a decimal number") from None
    elif _is_int(value):
        value = Decimal(int(value))
    elif not isinstance(value, Decimal):
        raise _refuse(type_name, value)
    if not value.is_finite():
        raise EncodingError(f"{value} is not a finite decimal")
    unscaled = _unscaled(value, precision, scale)
    if abs(unscaled) >= 10 ** precision:
        raise EncodingError(f"{value} has more than {precision} digits")
    try:
        return unscaled.to_bytes(16, "little", signed=True)
    except OverflowError:
        raise EncodingError(f"{value} does not fit 16 bytes") from None


def _unscaled(value: Decimal, precision: int, scale: int) -> int:
    """``value * 10**scale`` exactly, in integers (Decimal arithmetic rounds to its
    context's 28 digits); refuses a value with digits below the scale."""
    sign, digits, exponent = value.as_tuple()
    assert isinstance(exponent, int)  # finite
    coefficient = int("".join(map(str, digits)) or "0")
    shift = exponent + scale
    if coefficient == 0:
        return 0
    if shift > precision:  # already more digits than the precision: do not build 10**shift
        raise EncodingError(f"{value} has more than {precision} digits")
    if shift >= 0:
        unscaled = coefficient * 10 ** shift
    elif -shift > len(digits):  # a non-zero coefficient below 10**-shift: not a whole number
        raise EncodingError(f"{value} has more than {scale} fractional digits")
    else:
        unscaled, rest = divmod(coefficient, 10 ** -shift)
        if rest:
            raise EncodingError(f"{value} has more than {scale} fractional digits")
    return -unscaled if sign else unscaled


# The Python type most values of a column type arrive as, taken by a shortcut.
_NATURAL: dict[str, type] = {"int32": int, "int64": int, "float32": float, "float64": float,
                             "string": str}

_ENCODERS = {"int32": _encode_int, "int64": _encode_int, "date32": _encode_date,
             "timestamp_us": _encode_timestamp, "float32": _encode_float,
             "float64": _encode_float, "boolean": _encode_boolean,
             "string": _encode_string, "binary": _encode_binary}


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
        encoded = value_encoder(type_name)(value)
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


def primary_key_problem(types: Sequence[str], keys: Sequence[bytes]) -> tuple[int, str] | None:
    """The first of ``keys`` that is not the primary-key encoding of one value of each
    key column of ``types`` (its position and what is wrong), or None. The shape is
    checked (the arity, each value's length and marker), not the values: a well-formed
    key of no row is simply not found. Keys of fixed-width columns only are checked a
    batch at a time."""
    widths = [_width(t) for t in types]
    if all(w is not None for w in widths) and len(keys) >= 16:  # below: numpy costs more
        size = sum(4 + (w or 0) for w in widths)
        lengths = np.fromiter(map(len, keys), np.int64, len(keys))
        if (lengths == size).all():
            matrix = np.frombuffer(b"".join(keys), np.uint8).reshape(len(keys), size)
            headers = np.concatenate([np.frombuffer((w or 0).to_bytes(4, "big"), np.uint8)
                                      for w in widths])
            starts = np.cumsum([0] + [4 + (w or 0) for w in widths[:-1]])
            at = np.concatenate([np.arange(s, s + 4) for s in starts])
            bad = (matrix[:, at] != headers).any(axis=1)
            if not bad.any():
                return None
            first = int(np.argmax(bad))
            return first, _key_problem(types, keys[first]) or "malformed"
    for i, key in enumerate(keys):
        problem = _key_problem(types, key)
        if problem is not None:
            return i, problem
    return None


def _key_problem(types: Sequence[str], key: bytes) -> str | None:
    at = 0
    for n, type_name in enumerate(types):
        if at + 4 > len(key):
            return f"it ends after {n} of {len(types)} key columns"
        length = int.from_bytes(key[at:at + 4], "big")
        at += 4
        if at + length > len(key):
            return f"key column {n} claims {length} bytes; {len(key) - at} are left"
        width = _width(type_name)
        if width is not None and length != width:
            return f"key column {n} ({type_name}) holds {length} bytes, not {width}"
        if width is None and (length < 1 or key[at] != 1):
            return f"key column {n} ({type_name}) lacks its 0x01 marker"
        at += length
    if at != len(key):
        return f"{len(key) - at} bytes follow its {len(types)} key columns"
    return None


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
