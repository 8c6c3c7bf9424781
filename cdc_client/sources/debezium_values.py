"""Column values of a Debezium change event, decoded by the event's own ``schema`` block.

Debezium's JSON converter writes a value in the shape its Kafka Connect
schema gives it, not in the column's natural form: a ``numeric(p,s)`` is the
base64 of its unscaled big-endian two's-complement integer, a ``timestamptz``
an ISO-8601 string, a ``timestamp`` microseconds since the epoch, a ``date``
days since the epoch, a ``bytea`` base64. :func:`row_decoder` reads the
``before``/``after`` struct of an envelope schema and gives, per column, the
decoder from that wire form to the Python value
:func:`retina_common.codec.encode_value` stores in the Retina column type:

| Debezium schema (``name``, else ``type``) | Python value | Retina column |
|---|---|---|
| Connect ``Decimal`` (bytes, ``scale``) | ``Decimal`` | ``decimal(p,s)`` |
| ``VariableScaleDecimal`` (struct scale, value) | ``Decimal`` | ``decimal(p,s)`` |
| ``time.Date``, Connect ``Date`` | ``date`` | ``date32`` |
| ``time.Timestamp``/``MicroTimestamp``/``NanoTimestamp``, Connect ``Timestamp`` | UTC
``datetime`` | ``timestamp_us`` |
| ``time.ZonedTimestamp`` (ISO-8601, offset) | UTC ``datetime`` | ``timestamp_us`` |
| ``time.Time``/``MicroTime``/``NanoTime``, Connect ``Time`` | ``time`` | ``int64``
(µs since midnight) |
| ``bytes`` (any other name) | ``bytes`` | ``binary`` |
| ``data.Json``/``Uuid``/``Xml``/``Enum``, ``string`` | ``str`` | ``string`` |
| ``int8`` … ``int64``, ``boolean`` | the JSON value | the same |
| ``float``/``double`` (FLOAT32/64; ``decimal.handling.mode=double``) | ``float`` |
``float*``, ``decimal(p,s)`` |

JSON numbers with a fraction or exponent are parsed as ``Decimal`` (never
``float``): a Connect ``Decimal`` the JSON converter writes as a number
(``decimal.format=NUMERIC``) keeps every digit, and the float decoder
converts to ``float`` itself.

Debezium writes its ``unavailable.value.placeholder`` for an unchanged
TOASTed value it did not receive: the text, or (``bytes`` columns) the base64
of its UTF-8 bytes. :func:`decode_row` gives :data:`UNAVAILABLE` for it, never
the placeholder as data; the source resolves it or stops.

A value that does not decode (bad base64, a timestamp that does not parse,
one finer than a microsecond, a value of another JSON type than its schema
says) raises :class:`ValueDecodeError`; the source reports it as a malformed
event naming the line and the field. Whether a decoded value fits the Retina
column (precision, scale, type) is the codec's check, in ``translate``.
A schema-less event (no ``fields``) keeps its JSON values as they are.
"""

from __future__ import annotations

import base64
import binascii
import re
from collections.abc import Callable, Mapping
from datetime import UTC, date, datetime, time, timedelta
from decimal import Decimal
from typing import Any, NamedTuple

Decoder = Callable[[Any], Any]
DEFAULT_PLACEHOLDER = "__debezium_unavailable_value"  # Debezium's own default

EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
EPOCH_DATE = date(1970, 1, 1)
_ZONED = re.compile(r"(\d{4})-(\d\d)-(\d\d)T(\d\d):(\d\d)(?::(\d\d)(?:\.(\d{1,9}))?)?"
                    r"(Z|[+-]\d\d:\d\d(?::\d\d)?)")


class ValueDecodeError(ValueError):
    """A value that its own Debezium schema cannot decode."""


class _Unavailable:
    """A value Debezium did not have: its unavailable-value placeholder."""

    def __repr__(self) -> str:
        return "UNAVAILABLE"


UNAVAILABLE: Any = _Unavailable()


class Field(NamedTuple):
    label: str  # the schema's name, else its type, for errors
    decode: Decoder
    binary: bool  # a ``bytes`` schema: the placeholder comes base64-encoded


# --- primitive checks -------------------------------------------------------
def _integer(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueDecodeError(f"expected a JSON integer, got {type(value).__name__}")
    return value


def _string(value: Any) -> str:
    if not isinstance(value, str):
        raise ValueDecodeError(f"expected a JSON string, got {type(value).__name__}")
    return value


def _float(value: Any) -> float:
    # A JSON number arrives as int or (parse_float=Decimal) Decimal.
    if isinstance(value, bool) or not isinstance(value, int | float | Decimal):
        # The JSON converter writes NaN and the infinities as strings.
        if value in ("NaN", "Infinity", "-Infinity"):
            return float(value)
        raise ValueDecodeError(f"expected a JSON number, got {type(value).__name__}")
    return float(value)


def _boolean(value: Any) -> bool:
    if not isinstance(value, bool):
        raise ValueDecodeError(f"expected a JSON boolean, got {type(value).__name__}")
    return value


def _bytes(value: Any) -> bytes:
    try:
        return base64.b64decode(_string(value), validate=True)
    except binascii.Error as exc:
        raise ValueDecodeError(f"not base64: {exc}") from None


def _int_range(bits: int) -> Decoder:
    low, high = -(1 << (bits - 1)), (1 << (bits - 1)) - 1

    def decode(value: Any) -> int:
        number = _integer(value)
        if not low <= number <= high:
            raise ValueDecodeError(f"{number} is out of the int{bits} range")
        return number
    return decode


# --- decimals ---------------------------------------------------------------
def _unscaled(value: Any) -> int:
    raw = _bytes(value)
    if not raw:
        raise ValueDecodeError("a decimal of zero bytes")
    return int.from_bytes(raw, "big", signed=True)


def _decimal(parameters: Mapping[str, Any]) -> Decoder:
    try:
        scale = int(parameters["scale"])
    except (KeyError, TypeError, ValueError):
        scale = None

    def decode(value: Any) -> Decimal:
        if scale is None:
            raise ValueDecodeError("Decimal schema without an integer 'scale' parameter")
        if isinstance(value, Decimal):  # the converter's decimal.format=NUMERIC
            return value
        if isinstance(value, int) and not isinstance(value, bool):
            return Decimal(value)  # NUMERIC with no fraction digits (scale 0)
        if isinstance(value, float):  # a parser without parse_float=Decimal: refuse to guess
            raise ValueDecodeError("a decimal parsed as a binary float has lost digits")
        return _scaled(_unscaled(value), scale)
    return decode


def _variable_scale_decimal(value: Any) -> Decimal:
    if not isinstance(value, Mapping) or set(value) != {"scale", "value"}:
        raise ValueDecodeError("expected an object with 'scale' and 'value'")
    return _scaled(_unscaled(value["value"]), _integer(value["scale"]))


def _scaled(unscaled: int, scale: int) -> Decimal:
    # From a string, exactly: Decimal arithmetic (scaleb) would round to 28 digits.
    return Decimal(f"{unscaled}E{-scale}")


# --- dates and times ----------------------------------------------------------
def _date(value: Any) -> date:
    try:
        return EPOCH_DATE + timedelta(days=_integer(value))
    except OverflowError:
        raise ValueDecodeError(f"{value} days from 1970-01-01 is out of range") from None


def _instant(per_second: int) -> Decoder:
    """A count of 1/``per_second`` seconds since the epoch, as an exact UTC datetime."""
    def decode(value: Any) -> datetime:
        ticks = _integer(value)
        micros, rest = divmod(ticks * 1_000_000, per_second)
        if rest:
            raise ValueDecodeError(f"{ticks} is finer than a microsecond, which Retina "
                                   "timestamps cannot hold")
        try:
            return EPOCH + timedelta(microseconds=micros)
        except OverflowError:
            raise ValueDecodeError(f"{ticks} is out of the datetime range") from None
    return decode


def _time_of_day(per_second: int) -> Decoder:
    def decode(value: Any) -> time:
        ticks = _integer(value)
        micros, rest = divmod(ticks * 1_000_000, per_second)
        if rest:
            raise ValueDecodeError(f"{ticks} is finer than a microsecond")
        if not 0 <= micros < 86_400_000_000:
            # PostgreSQL's time allows 24:00:00, which a time of day cannot hold.
            raise ValueDecodeError(f"{ticks} is not a time of day")
        seconds, micro = divmod(micros, 1_000_000)
        return time(seconds // 3600, seconds // 60 % 60, seconds % 60, micro)
    return decode


def parse_zoned_timestamp(text: str) -> datetime:
    """ISO-8601 date-time with an offset (``Z`` or ``±hh:mm``), exactly, as UTC."""
    match = _ZONED.fullmatch(text)
    if match is None:
        raise ValueDecodeError("not an ISO-8601 date-time with an offset")
    year, month, day, hour, minute, second, fraction, offset = match.groups()
    digits = (fraction or "").ljust(9, "0")
    if digits[6:] != "000":
        raise ValueDecodeError("finer than a microsecond, which Retina timestamps cannot hold")
    try:
        local = datetime(int(year), int(month), int(day), int(hour), int(minute),
                         int(second or 0), int(digits[:6]), tzinfo=UTC)
    except ValueError as exc:
        raise ValueDecodeError(str(exc)) from None
    shift = timedelta()
    if offset != "Z":
        sign = -1 if offset[0] == "-" else 1
        parts = [int(p) for p in offset[1:].split(":")]
        shift = sign * timedelta(hours=parts[0], minutes=parts[1],
                                 seconds=parts[2] if len(parts) > 2 else 0)
    try:
        return local - shift
    except OverflowError:
        raise ValueDecodeError("out of the datetime range") from None


def _zoned_timestamp(value: Any) -> datetime:
    return parse_zoned_timestamp(_string(value))


# --- schemas ----------------------------------------------------------------
LOGICAL: dict[str, Decoder] = {
    "io.debezium.data.VariableScaleDecimal": _variable_scale_decimal,
    "io.debezium.time.Date": _date,
    "org.apache.kafka.connect.data.Date": _date,
    "io.debezium.time.Timestamp": _instant(1_000),
    "org.apache.kafka.connect.data.Timestamp": _instant(1_000),
    "io.debezium.time.MicroTimestamp": _instant(1_000_000),
    "io.debezium.time.NanoTimestamp": _instant(1_000_000_000),
    "io.debezium.time.ZonedTimestamp": _zoned_timestamp,
    "io.debezium.time.Time": _time_of_day(1_000),
    "org.apache.kafka.connect.data.Time": _time_of_day(1_000),
    "io.debezium.time.MicroTime": _time_of_day(1_000_000),
    "io.debezium.time.NanoTime": _time_of_day(1_000_000_000),
}
# The JSON converter names FLOAT32/FLOAT64 "float"/"double" in a schema block.
PRIMITIVE: dict[str, Decoder] = {
    "int8": _int_range(8), "int16": _int_range(16), "int32": _int_range(32),
    "int64": _int_range(64), "float": _float, "double": _float,
    "float32": _float, "float64": _float,
    "boolean": _boolean, "string": _string, "bytes": _bytes,
}


def _passthrough(value: Any) -> Any:
    return value


def field_decoder(schema: Mapping[str, Any]) -> Decoder:
    """The decoder of one field schema; arrays, maps and unknown structs pass through
    (a Retina column cannot hold them, which the codec then reports)."""
    name = schema.get("name")
    if name == "org.apache.kafka.connect.data.Decimal":
        parameters = schema.get("parameters")
        return _decimal(parameters if isinstance(parameters, Mapping) else {})
    if isinstance(name, str) and name in LOGICAL:
        return LOGICAL[name]
    kind = schema.get("type")
    # A malformed schema's type can be a list or an object: not a key to look up.
    return PRIMITIVE.get(kind, _passthrough) if isinstance(kind, str) else _passthrough


def row_decoder(envelope: Any, key: str) -> dict[str, Field] | None:
    """Per column of the envelope's ``key`` ("before"/"after") struct: its
    :class:`Field`. None for a schema-less event."""
    if not isinstance(envelope, Mapping) or not isinstance(envelope.get("fields"), list):
        return None
    for field in envelope["fields"]:
        if isinstance(field, Mapping) and field.get("field") == key:
            columns = field.get("fields")
            if not isinstance(columns, list):
                return None
            return {c["field"]: Field(str(c.get("name") or c.get("type")), field_decoder(c),
                                      c.get("type") == "bytes")
                    for c in columns if isinstance(c, Mapping) and "field" in c}
    return None


def is_placeholder(value: Any, placeholder: str | None, *, binary: bool) -> bool:
    """Whether a wire value is Debezium's unavailable-value placeholder: its text, or
    for a ``bytes`` schema the base64 of its UTF-8 bytes."""
    if placeholder is None or not isinstance(value, str):
        return False
    if value == placeholder:
        return True
    if not binary:
        return False
    try:
        return base64.b64decode(value, validate=True) == placeholder.encode()
    except binascii.Error:
        return False


def decode_row(row: Mapping[str, Any], decoders: Mapping[str, Field] | None,
               placeholder: str | None = DEFAULT_PLACEHOLDER) -> dict[str, Any]:
    """The row's values decoded, :data:`UNAVAILABLE` for the placeholder (None: no
    placeholder recognised); raises ValueDecodeError naming the column."""
    out: dict[str, Any] = {}
    for column, value in row.items():
        field = decoders.get(column) if decoders is not None else None
        if is_placeholder(value, placeholder, binary=field is not None and field.binary):
            out[column] = UNAVAILABLE
        elif value is None or field is None:
            # schema-less, or a column the schema omits: translate reports it
            out[column] = value
        else:
            out[column] = _decoded(column, field, value)
    return out


def _decoded(column: str, field: Field, value: Any) -> Any:
    try:
        return field.decode(value)
    except ValueDecodeError as exc:
        shown = repr(value) if len(repr(value)) <= 80 else repr(value)[:77] + "..."
        raise ValueDecodeError(f"field {column!r} ({field.label}): cannot decode {shown}: "
                               f"{exc}") from None
