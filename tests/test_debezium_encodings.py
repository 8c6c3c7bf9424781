"""Debezium's own value encodings: decoded by the event's ``schema`` block, stored in
the Retina column type, and a value that does not decode or fit stops the connector
(exit 3, the event named, nothing of its transaction applied).

The fixtures are change events in the exact JSON shape Debezium 2.x (PostgreSQL
connector, JSON converter with schemas, default ``decimal.handling.mode=precise``,
``time.precision.mode=adaptive``, ``binary.handling.mode=bytes``,
``provide.transaction.metadata=true``) writes for a table with numeric,
timestamptz, timestamp, date, time, bytea, jsonb and uuid columns.
"""

from __future__ import annotations

import base64
import json
import math
from collections.abc import Callable, Iterator
from datetime import UTC, date, datetime, time, timedelta, timezone
from decimal import Decimal, localcontext
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from cdc_client.source import RowChange, SourceError, SourceTransaction
from cdc_client.sources.debezium import DebeziumFileSource
from cdc_client.sources.debezium_values import (
    DEFAULT_PLACEHOLDER,
    ValueDecodeError,
    field_decoder,
    parse_zoned_timestamp,
)
from cdc_client.translate import MalformedChange, TableMap, translate
from retina_common.catalog import Catalog, ColumnSpec
from retina_common.catalog.model import ColumnRecord, TableRecord
from retina_common.client import TableWriter
from retina_common.codec import EncodingError, decode_column, encode_value
from retina_common.etcd import EtcdStore
from retina_common.topology import Topology

from .cdc import CdcPlane
from .dataplane import SCHEMA, DataPlane
from .support import eventually

# --- a Debezium 2.x event generator ----------------------------------------------------
SERVER = "pg1"
VERSION = "2.5.4.Final"
EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


def unscaled_base64(value: Decimal, scale: int) -> str:
    """Kafka Connect's Decimal: the unscaled value's minimal big-endian two's complement
    (Java's BigInteger.toByteArray), base64 in the JSON converter."""
    with localcontext() as exact:
        exact.prec = 100  # the default 28 digits would round a numeric(38,s)
        unscaled = int(value.scaleb(scale))
        assert Decimal(unscaled).scaleb(-scale) == value, "the generator's value must be exact"
    length = (unscaled + (unscaled < 0)).bit_length() // 8 + 1
    return base64.b64encode(unscaled.to_bytes(length, "big", signed=True)).decode()


def zoned(value: datetime) -> str:
    """io.debezium.time.ZonedTimestamp: ISO_OFFSET_DATE_TIME, fraction trimmed; in the
    value's own offset (``Z`` for UTC), as a connector with another zone writes it."""
    text = value.strftime("%Y-%m-%dT%H:%M:%S")
    if value.microsecond:
        text += f".{value.microsecond:06d}".rstrip("0")
    offset = value.utcoffset()
    if not offset:
        return text + "Z"
    minutes = offset // timedelta(minutes=1)
    sign = "-" if minutes < 0 else "+"
    return text + f"{sign}{abs(minutes) // 60:02d}:{abs(minutes) % 60:02d}"


def micros(value: datetime) -> int:
    return (value - EPOCH) // timedelta(microseconds=1)


# One PostgreSQL column: (Debezium field schema without "field", wire form of a value).
Column = tuple[dict[str, Any], Callable[[Any], Any]]


def numeric(precision: int, scale: int) -> Column:
    return ({"type": "bytes", "optional": True, "name": "org.apache.kafka.connect.data.Decimal",
             "version": 1, "parameters": {"scale": str(scale),
                                          "connect.decimal.precision": str(precision)}},
            lambda v: unscaled_base64(v, scale))


def _variable_scale(value: Decimal) -> dict[str, Any]:
    scale = max(0, -value.as_tuple().exponent)  # type: ignore[operator]
    return {"scale": scale, "value": unscaled_base64(value, scale)}


NUMERIC_UNCONSTRAINED: Column = (
    {"type": "struct", "fields": [{"type": "int32", "optional": False, "field": "scale"},
                                  {"type": "bytes", "optional": False, "field": "value"}],
     "optional": True, "name": "io.debezium.data.VariableScaleDecimal", "version": 1,
     "doc": "Variable scaled decimal"}, _variable_scale)


def logical(kind: str, name: str, wire: Callable[[Any], Any]) -> Column:
    return {"type": kind, "optional": True, "name": name, "version": 1}, wire


PG_COLUMNS: dict[str, Column] = {
    "int8": ({"type": "int64", "optional": False}, lambda v: v),
    "timestamptz": logical("string", "io.debezium.time.ZonedTimestamp", zoned),
    "timestamp": logical("int64", "io.debezium.time.MicroTimestamp", micros),
    "date": logical("int32", "io.debezium.time.Date", lambda v: (v - date(1970, 1, 1)).days),
    "time": logical("int64", "io.debezium.time.MicroTime",
                    lambda v: ((v.hour * 60 + v.minute) * 60 + v.second) * 10**6
                    + v.microsecond),
    "bytea": ({"type": "bytes", "optional": True}, lambda v: base64.b64encode(v).decode()),
    "jsonb": logical("string", "io.debezium.data.Json", lambda v: v),
    "uuid": logical("string", "io.debezium.data.Uuid", lambda v: v),
}


class DebeziumTable:
    """Debezium 2.x change events (envelope with schema) of one PostgreSQL table."""

    def __init__(self, table: str, columns: dict[str, Column], *, db: str = "shop") -> None:
        self.table = table
        self.columns = columns
        self.db = db
        self.lsn = 24_023_128
        self.txid = 570

    def _row_schema(self, key: str) -> dict[str, Any]:
        return {"type": "struct",
                "fields": [{**schema, "field": name} for name, (schema, _) in self.columns.items()],
                "optional": True, "name": f"{SERVER}.public.{self.table}.Value", "field": key}

    def envelope_schema(self) -> dict[str, Any]:
        source_fields = [
            {"type": "string", "optional": False, "field": "version"},
            {"type": "string", "optional": False, "field": "connector"},
            {"type": "string", "optional": False, "field": "name"},
            {"type": "int64", "optional": False, "field": "ts_ms"},
            {"type": "string", "optional": True, "name": "io.debezium.data.Enum", "version": 1,
             "parameters": {"allowed": "true,last,false,incremental"}, "default": "false",
             "field": "snapshot"},
            {"type": "string", "optional": False, "field": "db"},
            {"type": "string", "optional": True, "field": "sequence"},
            {"type": "string", "optional": False, "field": "schema"},
            {"type": "string", "optional": False, "field": "table"},
            {"type": "int64", "optional": True, "field": "txId"},
            {"type": "int64", "optional": True, "field": "lsn"},
            {"type": "int64", "optional": True, "field": "xmin"}]
        return {"type": "struct", "fields": [
            self._row_schema("before"), self._row_schema("after"),
            {"type": "struct", "fields": source_fields, "optional": False,
             "name": "io.debezium.connector.postgresql.Source", "field": "source"},
            {"type": "string", "optional": False, "field": "op"},
            {"type": "int64", "optional": True, "field": "ts_ms"},
            {"type": "struct", "fields": [
                {"type": "string", "optional": False, "field": "id"},
                {"type": "int64", "optional": False, "field": "total_order"},
                {"type": "int64", "optional": False, "field": "data_collection_order"}],
             "optional": True, "name": "event.block", "version": 1, "field": "transaction"}],
            "optional": False, "name": f"{SERVER}.public.{self.table}.Envelope", "version": 1}

    def wire_row(self, row: dict[str, Any] | None) -> dict[str, Any] | None:
        if row is None:
            return None
        return {name: None if row[name] is None else wire(row[name])
                for name, (_, wire) in self.columns.items()}

    def transaction(self, changes: list[tuple[str, dict | None, dict | None]],
                    *, snapshot: bool = False, raw_after: dict[int, dict] | None = None,
                    ) -> list[dict[str, Any]]:
        """BEGIN, the change events, END (transaction metadata topic messages)."""
        self.txid += 1
        txid = f"{self.txid}:{self.lsn}"
        ts_ms = 1_709_287_000_000 + self.txid
        events = []
        for order, (op, before, after) in enumerate(changes, start=1):
            self.lsn += 56
            after_wire = self.wire_row(after)
            if raw_after and order - 1 in raw_after:
                after_wire = {**(after_wire or {}), **raw_after[order - 1]}
            source = {"version": VERSION, "connector": "postgresql", "name": SERVER,
                      "ts_ms": ts_ms, "snapshot": "true" if snapshot else "false",
                      "db": self.db, "sequence": json.dumps([str(self.lsn - 56), str(self.lsn)]),
                      "schema": "public", "table": self.table, "txId": self.txid,
                      "lsn": self.lsn, "xmin": None}
            events.append({"schema": self.envelope_schema(), "payload": {
                "before": self.wire_row(before), "after": after_wire, "source": source,
                "op": op, "ts_ms": ts_ms + 7,
                "transaction": {"id": txid, "total_order": order,
                                "data_collection_order": order}}})
        return [self._metadata("BEGIN", txid, ts_ms, None), *events,
                self._metadata("END", txid, ts_ms, len(events))]

    def _metadata(self, status: str, txid: str, ts_ms: int, count: int | None) -> dict:
        collections = None if count is None else [
            {"data_collection": f"public.{self.table}", "event_count": count}]
        schema = {"type": "struct", "fields": [
            {"type": "string", "optional": False, "field": "status"},
            {"type": "string", "optional": False, "field": "id"},
            {"type": "int64", "optional": True, "field": "event_count"},
            {"type": "array", "items": {"type": "struct", "fields": [
                {"type": "string", "optional": False, "field": "data_collection"},
                {"type": "int64", "optional": False, "field": "event_count"}],
                "optional": False}, "optional": True, "field": "data_collections"},
            {"type": "int64", "optional": False, "field": "ts_ms"}],
            "optional": False, "name": "io.debezium.connector.common.TransactionMetadataValue",
            "version": 1}
        return {"schema": schema, "payload": {"status": status, "id": txid,
                                              "event_count": count,
                                              "data_collections": collections, "ts_ms": ts_ms}}


# The test table: PostgreSQL
#   CREATE TABLE readings (id int8 PRIMARY KEY, amount numeric(12,2), ratio numeric,
#     at timestamptz, local_at timestamp, day date, tod time, payload bytea, doc jsonb,
#     ref uuid);
READINGS_PG: dict[str, Column] = {
    "id": PG_COLUMNS["int8"], "amount": numeric(12, 2), "ratio": NUMERIC_UNCONSTRAINED,
    "at": PG_COLUMNS["timestamptz"], "local_at": PG_COLUMNS["timestamp"],
    "day": PG_COLUMNS["date"], "tod": PG_COLUMNS["time"], "payload": PG_COLUMNS["bytea"],
    "doc": PG_COLUMNS["jsonb"], "ref": PG_COLUMNS["uuid"],
}
# ... and the Retina table it is stored in.
READINGS_RETINA = [
    ColumnSpec("id", "int64"), ColumnSpec("amount", "decimal(12,2)"),
    ColumnSpec("ratio", "decimal(20,6)"), ColumnSpec("at", "timestamp_us"),
    ColumnSpec("local_at", "timestamp_us"), ColumnSpec("day", "date32"),
    ColumnSpec("tod", "int64"), ColumnSpec("payload", "binary"), ColumnSpec("doc", "string"),
    ColumnSpec("ref", "string"),
]


def reading(id_: int, **over: Any) -> dict[str, Any]:
    row = {"id": id_, "amount": Decimal("1234.50"), "ratio": Decimal("0.125"),
           "at": datetime(2024, 3, 1, 10, 15, 30, 123456, tzinfo=UTC),
           "local_at": datetime(2024, 3, 1, 10, 15, 30, 5, tzinfo=UTC),
           "day": date(2024, 3, 1), "tod": time(23, 59, 59, 999999),
           "payload": b"\x00\xffbin", "doc": '{"k": [1, 2.5, "x"], "n": null}',
           "ref": "a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11"}
    return {**row, **over}


def stored(row: dict[str, Any]) -> dict[str, Any]:
    """A reading as a gated snapshot returns it (time of day: µs since midnight)."""
    tod = row["tod"]
    return {**row, "tod": None if tod is None else
            ((tod.hour * 60 + tod.minute) * 60 + tod.second) * 10**6 + tod.microsecond}


def write(path: Path, messages: list[dict]) -> None:
    with open(path, "a") as out:
        for message in messages:
            out.write(json.dumps(message) + "\n")


# --- unit: each Debezium type ------------------------------------------------------------
def decode(column: Column, value: Any) -> Any:
    return field_decoder(column[0])(column[1](value))


@pytest.mark.parametrize("value", [Decimal("1234.50"), Decimal("-1234.50"), Decimal("0.00"),
                                   Decimal("-0.01"), Decimal("-128.00"), Decimal("127.99"),
                                   Decimal("9999999999.99"), Decimal("-9999999999.99")])
def test_decimal_round_trips_through_its_base64_form(value: Decimal) -> None:
    got = decode(numeric(12, 2), value)
    assert got == value and got.as_tuple().exponent == -2
    assert decode_column("decimal(12,2)", [encode_value("decimal(12,2)", got)]).to_pylist() \
        == [value]


def test_negative_decimal_is_twos_complement() -> None:
    schema = numeric(5, 2)[0]
    assert field_decoder(schema)(base64.b64encode(b"\xff").decode()) == Decimal("-0.01")
    assert field_decoder(schema)(base64.b64encode(b"\xff\x7f").decode()) == Decimal("-1.29")
    assert field_decoder(schema)(base64.b64encode(b"\x00\x80").decode()) == Decimal("1.28")


def test_decimal_is_rescaled_exactly_to_the_column_scale_or_refused() -> None:
    # numeric(12,2) into decimal(20,6): more scale is exact.
    value = decode(numeric(12, 2), Decimal("-12.34"))
    assert decode_column("decimal(20,6)", [encode_value("decimal(20,6)", value)]).to_pylist() \
        == [Decimal("-12.340000")]
    # numeric(12,4) into decimal(12,2): exact when the dropped digits are zeros ...
    assert decode_column("decimal(12,2)", [encode_value(
        "decimal(12,2)", decode(numeric(12, 4), Decimal("5.1200")))]).to_pylist() \
        == [Decimal("5.12")]
    # ... and refused (never rounded) when they are not, or when precision is short.
    with pytest.raises(EncodingError, match="more than 2 fractional digits"):
        encode_value("decimal(12,2)", decode(numeric(12, 4), Decimal("5.1234")))
    with pytest.raises(EncodingError, match="more than 4 digits"):
        encode_value("decimal(4,2)", decode(numeric(12, 2), Decimal("123.45")))


@pytest.mark.parametrize(("value", "column", "expected"), [
    (Decimal("0.125"), "decimal(20,6)", Decimal("0.125000")),
    (Decimal("-98765.4321"), "decimal(20,6)", Decimal("-98765.432100")),
    (Decimal("42"), "decimal(20,6)", Decimal("42.000000")),
    (Decimal("12345678901234567890.123456789012345678"), "decimal(38,18)",
     Decimal("12345678901234567890.123456789012345678")),
])
def test_variable_scale_decimal(value: Decimal, column: str, expected: Decimal) -> None:
    got = decode(NUMERIC_UNCONSTRAINED, value)
    assert got == value  # exact, also past Decimal's 28-digit default context
    assert decode_column(column, [encode_value(column, got)]).to_pylist() == [expected]


def test_variable_scale_decimal_that_does_not_fit_is_refused() -> None:
    with pytest.raises(EncodingError, match="fractional digits"):
        encode_value("decimal(20,6)", decode(NUMERIC_UNCONSTRAINED, Decimal("1.0000001")))
    decoder = field_decoder(NUMERIC_UNCONSTRAINED[0])
    with pytest.raises(ValueDecodeError, match="'scale' and 'value'"):
        decoder({"value": "AQ=="})


@pytest.mark.parametrize(("text", "expected"), [
    ("2024-03-01T10:15:30.123456Z", datetime(2024, 3, 1, 10, 15, 30, 123456, tzinfo=UTC)),
    ("2024-03-01T10:15:30Z", datetime(2024, 3, 1, 10, 15, 30, tzinfo=UTC)),
    ("2024-03-01T10:15:30.5Z", datetime(2024, 3, 1, 10, 15, 30, 500000, tzinfo=UTC)),
    ("2024-03-01T10:15:30.123456000Z", datetime(2024, 3, 1, 10, 15, 30, 123456, tzinfo=UTC)),
    ("2024-03-01T10:15:30.25+05:30", datetime(2024, 3, 1, 4, 45, 30, 250000, tzinfo=UTC)),
    ("2024-03-01T01:00:00-08:00", datetime(2024, 3, 1, 9, 0, tzinfo=UTC)),
    ("2024-01-01T00:30:00+01:00", datetime(2023, 12, 31, 23, 30, tzinfo=UTC)),
    ("1969-12-31T23:59:59.999999Z", datetime(1969, 12, 31, 23, 59, 59, 999999, tzinfo=UTC)),
    ("0001-01-01T00:00:00Z", datetime(1, 1, 1, tzinfo=UTC)),
])
def test_zoned_timestamp_parses_offsets_and_fractions(text: str, expected: datetime) -> None:
    assert parse_zoned_timestamp(text) == expected
    got = field_decoder(PG_COLUMNS["timestamptz"][0])(text)
    assert decode_column("timestamp_us", [encode_value("timestamp_us", got)]).to_pylist() \
        == [expected]


@pytest.mark.parametrize("text", [
    "2024-03-01T10:15:30.123456789Z",  # nanoseconds: a Retina timestamp holds µs
    "2024-03-01T10:15:30",             # no offset
    "2024-03-01 10:15:30Z",
    "2024-02-30T10:15:30Z",
    "infinity",
    "",
])
def test_zoned_timestamp_that_cannot_be_held_is_refused(text: str) -> None:
    with pytest.raises(ValueDecodeError):
        field_decoder(PG_COLUMNS["timestamptz"][0])(text)


@pytest.mark.parametrize(("name", "ticks", "expected"), [
    ("io.debezium.time.MicroTimestamp", 1_709_288_130_123_456,
     datetime(2024, 3, 1, 10, 15, 30, 123456, tzinfo=UTC)),
    ("io.debezium.time.MicroTimestamp", -1, datetime(1969, 12, 31, 23, 59, 59, 999999,
                                                     tzinfo=UTC)),
    ("io.debezium.time.Timestamp", -86_400_001, datetime(1969, 12, 30, 23, 59, 59, 999000,
                                                         tzinfo=UTC)),
    ("io.debezium.time.NanoTimestamp", 1_709_288_130_123_456_000,
     datetime(2024, 3, 1, 10, 15, 30, 123456, tzinfo=UTC)),
    ("io.debezium.time.NanoTimestamp", -1_000, datetime(1969, 12, 31, 23, 59, 59, 999999,
                                                        tzinfo=UTC)),
])
def test_epoch_timestamps(name: str, ticks: int, expected: datetime) -> None:
    got = field_decoder({"type": "int64", "name": name})(ticks)
    assert got == expected
    encoded = encode_value("timestamp_us", got)
    assert decode_column("timestamp_us", [encoded]).to_pylist() == [expected]


def test_nano_timestamp_finer_than_a_microsecond_is_refused() -> None:
    with pytest.raises(ValueDecodeError, match="finer than a microsecond"):
        field_decoder({"type": "int64", "name": "io.debezium.time.NanoTimestamp"})(1_001)
    with pytest.raises(ValueDecodeError, match="out of the datetime range"):
        field_decoder({"type": "int64", "name": "io.debezium.time.MicroTimestamp"})(2**63 - 1)


@pytest.mark.parametrize(("days", "expected"), [
    (19_783, date(2024, 3, 1)), (0, date(1970, 1, 1)), (-1, date(1969, 12, 31)),
    (-719_162, date(1, 1, 1)), (2_932_896, date(9999, 12, 31)),
])
def test_dates_including_before_1970(days: int, expected: date) -> None:
    got = field_decoder(PG_COLUMNS["date"][0])(days)
    assert got == expected
    assert decode_column("date32", [encode_value("date32", got)]).to_pylist() == [expected]
    with pytest.raises(ValueDecodeError):
        field_decoder(PG_COLUMNS["date"][0])(days + 10**9)


def test_times_of_day_are_microseconds_since_midnight() -> None:
    for name, ticks in [("io.debezium.time.MicroTime", 45_296_789_012),
                        ("io.debezium.time.Time", 45_296_789),
                        ("io.debezium.time.NanoTime", 45_296_789_012_000)]:
        got = field_decoder({"type": "int64", "name": name})(ticks)
        assert got == time(12, 34, 56, 789012 if name != "io.debezium.time.Time" else 789000)
        assert decode_column("int64", [encode_value("int64", got)]).to_pylist() \
            == [(12 * 3600 + 34 * 60 + 56) * 10**6 + got.microsecond]
    with pytest.raises(ValueDecodeError, match="not a time of day"):
        field_decoder(PG_COLUMNS["time"][0])(86_400_000_000)  # PostgreSQL's 24:00:00


def test_bytes_json_and_uuid() -> None:
    assert decode(PG_COLUMNS["bytea"], b"\x00\x01\xfe\xff") == b"\x00\x01\xfe\xff"
    assert decode(PG_COLUMNS["bytea"], b"") == b""
    for bad in ["not base64!", "AAE", 17]:
        with pytest.raises(ValueDecodeError):
            field_decoder(PG_COLUMNS["bytea"][0])(bad)
    doc = '{"a": {"b": [1, 2]}}'
    assert decode(PG_COLUMNS["jsonb"], doc) == doc
    assert decode(PG_COLUMNS["uuid"], "a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11") \
        == "a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11"
    with pytest.raises(ValueDecodeError, match="expected a JSON string"):
        field_decoder(PG_COLUMNS["jsonb"][0])({"a": 1})


@pytest.mark.parametrize(("column_type", "value"), [
    ("string", datetime(2024, 3, 1, tzinfo=UTC)),  # a timestamptz into a string column
    ("timestamp_us", "2024-03-01T10:15:30Z"),      # a string into a timestamp column
    ("int64", date(2024, 3, 1)),                   # a date into an int64 column
    ("date32", datetime(2024, 3, 1, tzinfo=UTC)),  # a timestamp into a date column
    ("binary", "AAE="),                            # base64 not decoded: a string
    ("string", b"bytes"),
    ("decimal(12,2)", date(2024, 3, 1)),
    ("timestamp_us", time(1, 2)),
    ("boolean", "false"),
])
def test_a_value_that_contradicts_the_column_type_is_an_encoding_error(
        column_type: str, value: Any) -> None:
    with pytest.raises(EncodingError):
        encode_value(column_type, value)


ODD_VALUES = ["x", "", b"\x00", 1.5, float("inf"), float("nan"), 2**70, -2**70, 2**31,
              Decimal("NaN"), Decimal("1E+400"), Decimal("0.001"), True, date(2024, 1, 1),
              datetime(9999, 12, 31, tzinfo=UTC), time(1, 2, 3), [1], {"a": 1}, object(),
              "2024-03-01T10:15:30Z", "\ud800"]
ALL_TYPES = ["boolean", "int32", "int64", "float32", "float64", "date32", "timestamp_us",
             "decimal(12,2)", "decimal(38,0)", "string", "binary"]


@pytest.mark.parametrize("column_type", ALL_TYPES)
def test_encode_value_raises_only_encoding_error(column_type: str) -> None:
    """Whatever it is given: bytes that decode back, or EncodingError (never struct.error,
    OverflowError, TypeError: those crashed the connector with exit 1 instead of 3)."""
    refused = 0
    for value in ODD_VALUES:
        try:
            encoded = encode_value(column_type, value)
        except EncodingError:
            refused += 1
            continue
        [decoded] = decode_column(column_type, [encoded]).to_pylist()
        assert _same(decoded, stored_as(column_type, value)), (column_type, value, decoded)
    assert refused >= len(ODD_VALUES) // 2, "most odd values must be refused"


def stored_as(column_type: str, value: Any) -> Any:
    """What a column of the type holds for an accepted value, exactly."""
    if column_type == "float32":
        return float(np.float32(float(value)))
    if column_type == "float64":
        return float(value)
    if column_type.startswith("decimal("):
        scale = int(column_type.rstrip(")").split(",")[1])
        with localcontext() as exact:
            exact.prec = 100
            return Decimal(repr(value) if isinstance(value, float) else value).quantize(
                Decimal(1).scaleb(-scale))
    if column_type == "int64" and isinstance(value, time):  # µs since midnight
        return ((value.hour * 60 + value.minute) * 60 + value.second) * 10**6 \
            + value.microsecond
    if column_type == "timestamp_us" and isinstance(value, int):  # µs since the epoch
        return EPOCH + timedelta(microseconds=value)
    return value


def _same(got: Any, want: Any) -> bool:
    if isinstance(want, float) and math.isnan(want):
        return isinstance(got, float) and math.isnan(got)
    if isinstance(want, Decimal):  # the digits and the scale, not just the number
        return isinstance(got, Decimal) and got.as_tuple() == want.as_tuple()
    return type(got) is type(want) and got == want


# --- the source: events in Debezium 2.x shape ----------------------------------------------
def test_source_decodes_by_the_events_schema(tmp_path: Path) -> None:
    table = DebeziumTable("readings", READINGS_PG)
    first, second = reading(1), reading(2, amount=Decimal("-0.05"), at=None, payload=None)
    changed = {**first, "amount": Decimal("99.99"),
               "at": datetime(1969, 7, 20, 20, 17, 40, tzinfo=UTC)}
    write(tmp_path / "0001.json", table.transaction([("r", None, first)], snapshot=True)
          + table.transaction([("c", None, second), ("u", first, changed),
                               ("d", second, None)]))
    source = DebeziumFileSource(tmp_path)
    snap, tx = source.poll(2), source.poll(2)
    assert isinstance(snap, SourceTransaction) and isinstance(tx, SourceTransaction)
    assert snap.changes == (RowChange("public.readings", "insert", None, first),)
    assert snap.changes[0].origin == "0001.json:2"
    assert tx.source_txid == "572:24023184" and tx.position == "0001.json:8"
    assert tx.changes == (RowChange("public.readings", "insert", None, second),
                          RowChange("public.readings", "update", first, changed),
                          RowChange("public.readings", "delete", second, None))
    assert [c.origin for c in tx.changes] == ["0001.json:5", "0001.json:6", "0001.json:7"]


@pytest.mark.parametrize(("field", "raw", "message"), [
    ("at", "yesterday", "field 'at' (io.debezium.time.ZonedTimestamp): cannot decode"),
    ("amount", "%%%", "field 'amount' (org.apache.kafka.connect.data.Decimal)"),
    ("payload", "AAE", "field 'payload' (bytes)"),
    ("day", "2024-03-01", "field 'day' (io.debezium.time.Date)"),
    ("id", 2**63, "out of the int64 range"),
])
def test_a_value_that_does_not_decode_names_the_event_and_field(
        tmp_path: Path, field: str, raw: Any, message: str) -> None:
    table = DebeziumTable("readings", READINGS_PG)
    write(tmp_path / "0001.json", table.transaction([("c", None, reading(1))])
          + table.transaction([("c", None, reading(2)), ("c", None, reading(3))],
                              raw_after={1: {field: raw}}))
    source = DebeziumFileSource(tmp_path)
    assert source.poll(2) is not None  # the transaction before it is whole
    with pytest.raises(SourceError) as caught:
        source.poll(2)
    text = str(caught.value)
    assert text.startswith("0001.json:6: malformed event (op 'c', table public.readings, "
                           "transaction 572:"), text
    assert message in text


def test_schemaless_events_keep_their_json_values(tmp_path: Path) -> None:
    table = DebeziumTable("readings", READINGS_PG)
    [begin, event, end] = table.transaction([("c", None, reading(1))])
    bare = [begin["payload"], event["payload"], end["payload"]]
    write(tmp_path / "0001.json", bare)
    tx = DebeziumFileSource(tmp_path).poll(2)
    assert tx is not None and tx.changes[0].after == table.wire_row(reading(1))


# --- decimals written as JSON numbers or strings --------------------------------------------
BIG = Decimal("123456789012345678.91")  # 20 digits: more than a binary float holds
DECIMAL_SHAPES = {
    # decimal.handling.mode=precise with the JSON converter's decimal.format=NUMERIC
    "numeric": ({"type": "bytes", "optional": True, "name": "org.apache.kafka.connect.data.Decimal",
                 "version": 1, "parameters": {"scale": "2",
                                              "connect.decimal.precision": "20"}}, str),
    # decimal.handling.mode=string
    "string": ({"type": "string", "optional": True}, str),
    # decimal.handling.mode=double
    "double": ({"type": "double", "optional": True}, str),
}


def _raw_number(table: DebeziumTable, changes: list, field: str, text: str) -> list[str]:
    """The transaction's lines, with ``field`` of the first event written as the JSON
    number ``text`` (json.dumps cannot write a Decimal)."""
    lines = [json.dumps(m) for m in table.transaction(changes, raw_after={0: {field: "@@"}})]
    return [line.replace('"@@"', text) for line in lines]


@pytest.mark.parametrize(("shape", "wire", "column_type", "expected"), [
    ("numeric", "123456789012345678.91", "decimal(20,2)", BIG),
    ("numeric", "-0.10", "decimal(20,2)", Decimal("-0.10")),
    ("numeric", "42", "decimal(20,0)", Decimal("42")),
    ("string", '"123456789012345678.91"', "decimal(20,2)", BIG),
    # double: what the double holds, which is all the source gave
    ("double", "1234.5", "decimal(20,2)", Decimal("1234.50")),
    ("double", "1234.5", "float64", 1234.5),
    ("double", "1.2345678901234568E17", "float64", 1.2345678901234568e17),
    ("double", '"NaN"', "float64", math.nan),
])
def test_decimals_written_as_json_numbers_keep_every_digit(
        tmp_path: Path, shape: str, wire: str, column_type: str, expected: Any) -> None:
    table = DebeziumTable("readings", {"id": PG_COLUMNS["int8"], "amount": DECIMAL_SHAPES[shape]})
    (tmp_path / "0001.json").write_text(
        "\n".join(_raw_number(table, [("c", None, {"id": 1, "amount": None})], "amount",
                               wire)) + "\n")
    tx = DebeziumFileSource(tmp_path).poll(2)
    assert tx is not None
    [encoded] = [encode_value(column_type, tx.changes[0].after["amount"])]
    [stored_value] = decode_column(column_type, [encoded]).to_pylist()
    assert _same(stored_value, expected), (stored_value, expected)


def test_schemaless_json_numbers_are_exact_decimals(tmp_path: Path) -> None:
    (tmp_path / "0001.json").write_text(
        '{"op": "c", "before": null, "after": {"id": 1, "amount": 123456789012345678.91}, '
        '"source": {"schema": "public", "table": "t", "txId": 1, "ts_ms": 5}}\n')
    tx = DebeziumFileSource(tmp_path).poll(2)
    assert tx is not None and tx.changes[0].after == {"id": 1, "amount": BIG}
    assert decode_column("decimal(20,2)", [encode_value("decimal(20,2)", BIG)]).to_pylist() \
        == [BIG]


# --- unchanged TOASTed values: Debezium's unavailable-value placeholder -----------------------
PLACEHOLDER_BYTES = base64.b64encode(DEFAULT_PLACEHOLDER.encode()).decode()


def _placeholders(fields: tuple[str, ...]) -> dict[str, str]:
    """How Debezium 2.x writes the unchanged TOASTed columns of an update: the
    placeholder text, for bytea the base64 of its bytes (binary.handling.mode=bytes)."""
    return {f: PLACEHOLDER_BYTES if f == "payload" else DEFAULT_PLACEHOLDER for f in fields}


def _keys(table: str) -> tuple[str, ...] | None:
    return ("id",) if table == "public.readings" else None


def test_placeholder_bytes_are_the_base64_of_its_text() -> None:
    assert PLACEHOLDER_BYTES == "X19kZWJleml1bV91bmF2YWlsYWJsZV92YWx1ZQ=="


@pytest.mark.parametrize("fields", [("doc",), ("payload",), ("payload", "doc")])
def test_unavailable_value_without_a_record_of_it_is_left_out_as_a_partial_update(
        tmp_path: Path, fields: tuple[str, ...]) -> None:
    """An update that keeps its key: the field is left out of ``after`` (the node keeps
    the row's current value), never stored as the placeholder."""
    table = DebeziumTable("readings", READINGS_PG)
    new = {**reading(1), "amount": Decimal("2.00")}
    # REPLICA IDENTITY DEFAULT: no before image of an update that keeps the key.
    write(tmp_path / "0001.json",
          table.transaction([("u", None, new)], raw_after={0: _placeholders(fields)}))
    tx = DebeziumFileSource(tmp_path, primary_key=_keys).poll(2)
    assert tx is not None
    kept = {n: v for n, v in new.items() if n not in fields}
    assert tx.changes == (RowChange("public.readings", "update", None, kept, partial=True),)


@pytest.mark.parametrize("fields", [("doc",), ("payload", "doc")])
def test_unavailable_value_of_an_update_whose_key_cannot_be_told_stops_the_source(
        tmp_path: Path, fields: tuple[str, ...]) -> None:
    """Without the table's key (no Retina table maps the source table), or with a before
    image naming another key (a key change: the new key's row is not the one that held
    the value), there is no row to keep the value of."""
    table = DebeziumTable("readings", READINGS_PG)
    new = {**reading(1), "amount": Decimal("2.00")}
    write(tmp_path / "0001.json",
          table.transaction([("u", None, new)], raw_after={0: _placeholders(fields)}))
    with pytest.raises(SourceError) as caught:
        DebeziumFileSource(tmp_path).poll(2)
    text = str(caught.value)
    assert text.startswith(f"0001.json:2: event without the value of field(s) {list(fields)} "
                           "(op 'u', table public.readings, transaction 571:"), text
    assert "ALTER TABLE public.readings REPLICA IDENTITY FULL" in text
    assert DEFAULT_PLACEHOLDER in text
    moved = tmp_path / "moved"
    moved.mkdir()
    events = table.transaction([("u", reading(2), new)], raw_after={0: _placeholders(fields)})
    before = events[1]["payload"]["before"]
    before.update(_placeholders(fields))  # the old row's TOASTed values: not sent either
    write(moved / "0001.json", events)
    with pytest.raises(SourceError, match=r"event without the value of field"):
        DebeziumFileSource(moved, primary_key=_keys).poll(2)


def test_unavailable_value_is_taken_from_the_before_image(tmp_path: Path) -> None:
    """REPLICA IDENTITY FULL: the old row carries the value the update left alone."""
    table = DebeziumTable("readings", READINGS_PG)
    old = reading(1, doc='{"big": "' + "x" * 50 + '"}', payload=b"\x01" * 40)
    new = {**old, "amount": Decimal("2.00")}
    write(tmp_path / "0001.json",
          table.transaction([("u", old, new)], raw_after={0: _placeholders(("doc", "payload"))}))
    tx = DebeziumFileSource(tmp_path).poll(2)
    assert tx is not None
    assert tx.changes == (RowChange("public.readings", "update", old, new),)


def test_unavailable_value_is_taken_from_the_transactions_earlier_write(tmp_path: Path) -> None:
    table = DebeziumTable("readings", READINGS_PG)
    inserted = reading(7, doc='{"v": 1}', payload=b"toast")
    updated = {**inserted, "amount": Decimal("3.00")}
    again = {**updated, "tod": time(1, 2, 3)}
    write(tmp_path / "0001.json",
          table.transaction([("c", None, inserted), ("u", None, updated), ("u", None, again)],
                            raw_after={1: _placeholders(("doc", "payload")),
                                       2: _placeholders(("doc",))}))
    tx = DebeziumFileSource(tmp_path, primary_key=_keys).poll(2)
    assert tx is not None
    assert [c.after for c in tx.changes] == [inserted, updated, again]
    # Another row's write is not this row's value; neither is one of another transaction:
    # the field is left out (a partial update keeps the row's current value).
    other = {**reading(8), "amount": Decimal("1.00")}
    write(tmp_path / "0001.json",
          table.transaction([("u", None, other)], raw_after={0: _placeholders(("doc",))}))
    source = DebeziumFileSource(tmp_path, primary_key=_keys, start_after=tx.position)
    later = source.poll(2)
    assert later is not None
    assert later.changes[0].after == {n: v for n, v in other.items() if n != "doc"}


def test_unavailable_value_in_an_insert_stops_the_source(tmp_path: Path) -> None:
    table = DebeziumTable("readings", READINGS_PG)
    write(tmp_path / "0001.json",
          table.transaction([("c", None, reading(1))], raw_after={0: _placeholders(("doc",))}))
    with pytest.raises(SourceError, match=r"0001.json:2: event without the value of field"):
        DebeziumFileSource(tmp_path, primary_key=_keys).poll(2)


def test_the_placeholder_is_configurable(tmp_path: Path) -> None:
    table = DebeziumTable("readings", READINGS_PG)
    write(tmp_path / "0001.json",
          table.transaction([("u", None, reading(1))], raw_after={0: {"doc": "<toasted>"}}))
    with pytest.raises(SourceError, match=r"field\(s\) \['doc'\].*'<toasted>'"):
        DebeziumFileSource(tmp_path, unavailable_placeholder="<toasted>").poll(2)
    # With another placeholder configured, that text is ordinary data.
    tx = DebeziumFileSource(tmp_path).poll(2)
    assert tx is not None and tx.changes[0].after["doc"] == "<toasted>"


# --- translate: the decoded value against the Retina column --------------------------------
def _record(columns: list[ColumnSpec]) -> TableRecord:
    return TableRecord(1, 1, SCHEMA, "readings", 1, tuple(
        ColumnRecord(i + 1, c.name, c.type, i, 0 if c.name == "id" else None)
        for i, c in enumerate(columns)))


def test_translate_names_the_event_of_a_value_that_does_not_fit(tmp_path: Path) -> None:
    table = DebeziumTable("readings", {**READINGS_PG, "amount": numeric(14, 4)})
    write(tmp_path / "0001.json",
          table.transaction([("c", None, reading(1, amount=Decimal("1.2500"))),
                             ("c", None, reading(2, amount=Decimal("1.2345")))]))
    tx = DebeziumFileSource(tmp_path).poll(2)
    assert tx is not None
    tables = TableMap(SCHEMA, lambda _s, _n: _record(READINGS_RETINA))
    with pytest.raises(MalformedChange) as caught:
        translate(tx, tables, Topology(("127.0.0.1:1",), 4))
    assert "at 0001.json:4, change 1 (event at 0001.json:3)" in str(caught.value)
    assert "readings.amount (decimal(12,2)): cannot encode Decimal('1.2345')" \
        in str(caught.value)


# --- the real connector ------------------------------------------------------------------
@pytest.fixture
def readings_cdc(tmp_path: Path, etcd: EtcdStore, catalog: Catalog,
                 catalog_dsn: str) -> Iterator[CdcPlane]:
    plane = DataPlane(tmp_path / "plane", etcd, catalog, catalog_dsn, nodes=2)
    record = catalog.create_table(SCHEMA, "readings", READINGS_RETINA, ["id"])
    plane.tables["readings"] = record
    plane.writers["readings"] = TableWriter(record, plane.topology, min_columnar_rows=1)
    plane.start(recover=False)
    (tmp_path / "events").mkdir()
    cdc = CdcPlane(plane, None, tmp_path, source="debezium-file",
                   debezium_dir=str(tmp_path / "events"))
    try:
        yield cdc
    finally:
        cdc.cdc.terminate()
        plane.stop()


def expected_readings(cdc: CdcPlane, rows: list[dict[str, Any]]) -> dict:
    writer = cdc.plane.writers["readings"]
    return {"orders": {}, "events": {},
            "readings": {writer.key(r): stored(r) for r in rows}}


@pytest.mark.integration
def test_connector_stores_debezium_values_in_retina_types(readings_cdc: CdcPlane) -> None:
    cdc = readings_cdc
    table = DebeziumTable("readings", READINGS_PG)
    events = Path(cdc.cdc.settings["debezium_dir"])
    rows = {
        1: reading(1),
        2: reading(2, amount=Decimal("-9999999999.99"), ratio=Decimal("-98765.432101"),
                   # written in the connector's zone, not UTC
                   at=datetime(1965, 5, 4, 8, 32, 1, 900000,
                               tzinfo=timezone(timedelta(hours=5, minutes=30))),
                   local_at=datetime(1901, 1, 1, tzinfo=UTC), day=date(1900, 2, 28),
                   tod=time(0, 0), payload=b"", doc="[]",
                   ref="00000000-0000-0000-0000-000000000000"),
        3: reading(3, **{k: None for k in ("amount", "ratio", "at", "local_at", "day", "tod",
                                            "payload", "doc", "ref")}),
        4: reading(4, at=datetime(2024, 12, 31, 15, 59, 59, 999999,
                                  tzinfo=timezone(timedelta(hours=-8))),
                   ratio=Decimal("7")),
    }
    write(events / "0001.json",
          table.transaction([("r", None, rows[1]), ("r", None, rows[2])], snapshot=True)
          + table.transaction([("c", None, rows[3]), ("c", None, rows[4])]))
    cdc.cdc.start()
    eventually(cdc.all_ready, 60, "both nodes READY")
    cdc.converged(expected_readings(cdc, list(rows.values())))
    # An update (the new image decoded the same way) and a delete by its before image.
    rows[1] = {**rows[1], "amount": Decimal("0.01"), "doc": '{"v": 2}',
               "at": datetime(2024, 3, 2, tzinfo=UTC)}
    write(events / "0002.json", table.transaction([("u", reading(1), rows[1]),
                                                   ("d", rows[3], None)]))
    del rows[3]
    cdc.converged(expected_readings(cdc, list(rows.values())))
    # Updates that left TOASTed values alone (Debezium's placeholder in their place): the
    # value comes from the old row (REPLICA IDENTITY FULL) or from the row as an earlier
    # change of the transaction wrote it; the placeholder is never stored.
    old4, rows[4] = rows[4], {**rows[4], "amount": Decimal("4.00")}
    rows[5] = reading(5, doc='{"toasted": true}', payload=b"\x05" * 9)
    inserted5 = rows[5]
    rows[5] = {**rows[5], "amount": Decimal("5.00")}
    write(events / "0003.json", table.transaction(
        [("u", old4, rows[4]), ("c", None, inserted5), ("u", None, rows[5])],
        raw_after={0: _placeholders(("payload", "doc")), 2: _placeholders(("payload", "doc"))}))
    cdc.converged(expected_readings(cdc, list(rows.values())))
    # No record of the values at all (no before image, no earlier write): a partial update,
    # and the node keeps the row's doc and payload.
    rows[2] = {**rows[2], "amount": Decimal("7.00")}
    write(events / "0004.json", table.transaction(
        [("u", None, rows[2])], raw_after={0: _placeholders(("payload", "doc"))}))
    cdc.converged(expected_readings(cdc, list(rows.values())))


@pytest.mark.parametrize(("case", "override", "named"), [
    # decoded by the source: a timestamptz that does not parse
    ("undecodable", {"at": "2024-13-01T00:00:00Z"},
     "0001.json:7: malformed event (op 'c', table public.readings"),
    # decoded, but more digits than the Retina column's decimal(12,2) holds
    ("does not fit", {"amount": unscaled_base64(Decimal("12345678901.00"), 2)},
     "at 0001.json:8, change 2 (event at 0001.json:7): column readings.amount "
     "(decimal(12,2))"),
    # Debezium's placeholder with no record of the value: never stored
    ("unavailable", {"doc": DEFAULT_PLACEHOLDER},
     "0001.json:7: event without the value of field(s) ['doc'] (op 'c', table "
     "public.readings"),
])
@pytest.mark.integration
def test_malformed_value_stops_the_connector_with_exit_3(
        readings_cdc: CdcPlane, case: str, override: dict, named: str) -> None:
    cdc = readings_cdc
    table = DebeziumTable("readings", READINGS_PG)
    events = Path(cdc.cdc.settings["debezium_dir"])
    good = reading(1)
    write(events / "0001.json",
          table.transaction([("c", None, good)])
          # the offending transaction also carries valid rows: none may be applied
          + table.transaction([("c", None, reading(2)), ("u", good, {**good, "doc": "{}"}),
                               ("c", None, reading(3))], raw_after={2: override}))
    cdc.cdc.start()
    assert cdc.cdc.wait_exit(90) == 3, cdc.cdc.log_tail()
    stopped = cdc.cdc.logged("cdc_stopped_malformed")
    assert stopped and named in stopped[-1]["error"], (case, cdc.cdc.log_tail())
    assert "retina-cdc: stopped (exit 3, needs an operator): " in cdc.cdc.log_tail()
    cdc.converged(expected_readings(cdc, [good]))
    # Deterministic: a restart stops at the same event again, having applied nothing more.
    cdc.cdc.start()
    assert cdc.cdc.wait_exit(90) == 3, cdc.cdc.log_tail()
    assert len(cdc.cdc.logged("cdc_stopped_malformed")) == 2
    assert cdc.cdc.logged("cdc_stopped_malformed")[-1]["error"] == stopped[-1]["error"]
    cdc.converged(expected_readings(cdc, [good]))


def test_malformed_schema_type_and_object_key_are_malformed_events(tmp_path: Path) -> None:
    """A field schema whose type is a list, and a key that arrives as a JSON object, are
    refused as malformed (exit 3) naming the event: never a TypeError (exit 1, a crash
    loop over the same event)."""
    table = DebeziumTable("readings", READINGS_PG)
    [begin, event, end] = table.transaction([("c", None, reading(1))])
    after_schema = event["schema"]["fields"][1]["fields"]
    after_schema[0] = {**after_schema[0], "type": ["int64"]}
    event["payload"]["after"]["id"] = {"high": 0, "low": 1}
    write(tmp_path / "0001.json", [begin, event, end])
    tx = DebeziumFileSource(tmp_path, primary_key=_keys).poll(2)
    assert tx is not None and tx.changes[0].after["id"] == {"high": 0, "low": 1}
    tables = TableMap(SCHEMA, lambda _s, _n: _record(READINGS_RETINA))
    with pytest.raises(MalformedChange) as caught:
        translate(tx, tables, Topology(("127.0.0.1:1",), 4))
    assert "(event at 0001.json:2)" in str(caught.value)
    assert "primary key of readings: a dict is not a int64 value" in str(caught.value)
