"""The pgoutput protocol (version 1) as this connector reads it: LSNs, the message
types and their decoding, row values from their text form, the replication session's
settings, and what a vanished column or table means. Below both the streaming source
(``postgres.py``) and the initial snapshot (``pg_snapshot.py``), which decode the same
rows.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, date, datetime
from decimal import Decimal
from typing import Any

import psycopg2
import psycopg2.errors
import psycopg2.extensions
import psycopg2.extras

from cdc_client.schema_change import (
    UnsupportedSchemaChange,
    pg_column_facts,
)
from cdc_client.source import SourceError

# 2000-01-01T00:00:00Z, PostgreSQL's timestamp epoch, in ms since the Unix epoch.
PG_EPOCH_MS = 946_684_800_000

# wal_sender_timeout defaults to 60 s; a status update every couple of seconds
# keeps the walsender alive even with a much shorter timeout.
FEEDBACK_INTERVAL_S = 2.0
VISIBILITY_WARN_S = 5.0  # a committed transaction still invisible this long: say so

# Appended to the replication session's options: the text format of every
# value we parse depends on these settings.
SESSION_OPTIONS = ("-c client_encoding=UTF8 -c DateStyle=ISO -c TimeZone=UTC "
                   "-c bytea_output=hex -c extra_float_digits=3")


# --- LSNs ---
def format_lsn(lsn: int) -> str:
    """``X/Y`` as PostgreSQL prints an LSN (upper and lower 32 bits, hex)."""
    return f"{lsn >> 32:X}/{lsn & 0xFFFFFFFF:X}"


def parse_lsn(text: str) -> int:
    high, sep, low = text.partition("/")
    try:
        if not sep:
            raise ValueError("no '/'")
        return (int(high, 16) << 32) | int(low, 16)
    except ValueError as exc:
        raise SourceError(f"not a PostgreSQL LSN: {text!r}") from exc


# --- pgoutput messages ---
@dataclass(frozen=True)
class Column:
    name: str
    type_oid: int
    is_key: bool
    type_modifier: int = -1  # e.g. a numeric's precision and scale (schema changes)


@dataclass(frozen=True)
class Relation:
    oid: int
    namespace: str
    name: str
    replica_identity: str
    columns: tuple[Column, ...]

    @property
    def table(self) -> str:
        # pgoutput sends an empty namespace for pg_catalog.
        return f"{self.namespace or 'pg_catalog'}.{self.name}"


# One column of a TupleData: kind 'n' (null), 'u' (unchanged TOAST) or 't' (text).
TupleData = tuple[tuple[str, bytes | None], ...]


@dataclass(frozen=True)
class Begin:
    final_lsn: int
    commit_time_us: int
    xid: int


@dataclass(frozen=True)
class Commit:
    commit_lsn: int
    end_lsn: int
    commit_time_us: int


@dataclass(frozen=True)
class Origin:
    origin_lsn: int
    name: str


@dataclass(frozen=True)
class TypeInfo:
    oid: int
    namespace: str
    name: str


@dataclass(frozen=True)
class Insert:
    relation_oid: int
    new: TupleData


@dataclass(frozen=True)
class Update:
    relation_oid: int
    old_kind: str | None  # 'K' (old key), 'O' (old row) or None (key unchanged)
    old: TupleData | None
    new: TupleData


@dataclass(frozen=True)
class Delete:
    relation_oid: int
    old_kind: str
    old: TupleData


@dataclass(frozen=True)
class Truncate:
    relation_oids: tuple[int, ...]


Message = Begin | Commit | Origin | Relation | TypeInfo | Insert | Update | Delete | Truncate


class _Reader:
    """Big-endian cursor over one message; running off the end raises SourceError."""

    def __init__(self, data: bytes) -> None:
        self._data = data
        self._pos = 0

    def _unpack(self, fmt: str) -> int:
        size = struct.calcsize(fmt)
        if self._pos + size > len(self._data):
            raise SourceError(f"pgoutput message truncated at byte {self._pos}")
        (value,) = struct.unpack_from(fmt, self._data, self._pos)
        self._pos += size
        return value

    def int8(self) -> int:
        return self._unpack(">b")

    def int16(self) -> int:
        return self._unpack(">h")

    def int32(self) -> int:
        return self._unpack(">i")

    def uint32(self) -> int:
        return self._unpack(">I")

    def int64(self) -> int:
        return self._unpack(">q")

    def uint64(self) -> int:
        return self._unpack(">Q")

    def char(self) -> str:
        return chr(self._unpack(">B"))

    def peek_char(self) -> str:
        if self._pos >= len(self._data):
            raise SourceError(f"pgoutput message truncated at byte {self._pos}")
        return chr(self._data[self._pos])

    def raw(self, length: int) -> bytes:
        if length < 0 or self._pos + length > len(self._data):
            raise SourceError(f"pgoutput message truncated at byte {self._pos}")
        value = self._data[self._pos:self._pos + length]
        self._pos += length
        return value

    def string(self) -> str:
        end = self._data.find(b"\0", self._pos)
        if end < 0:
            raise SourceError(f"pgoutput string not terminated at byte {self._pos}")
        value = self._data[self._pos:end].decode("utf-8")
        self._pos = end + 1
        return value


def _read_tuple(reader: _Reader) -> TupleData:
    columns: list[tuple[str, bytes | None]] = []
    for _ in range(reader.int16()):
        kind = reader.char()
        if kind in ("n", "u"):
            columns.append((kind, None))
        elif kind == "t":
            columns.append((kind, reader.raw(reader.int32())))
        else:  # 'b' (binary) exists only when the binary option is requested; we never do
            raise SourceError(f"unsupported pgoutput tuple column kind {kind!r}")
    return tuple(columns)


def _read_relation(reader: _Reader) -> Relation:
    oid = reader.uint32()
    namespace = reader.string()
    name = reader.string()
    replica_identity = reader.char()
    columns = []
    for _ in range(reader.int16()):
        flags = reader.int8()
        col_name = reader.string()
        type_oid = reader.uint32()
        # The type modifier: values parse from their text form without it; schema
        # change checks compare it (a numeric's precision and scale).
        columns.append(Column(col_name, type_oid, bool(flags & 1), reader.int32()))
    return Relation(oid, namespace, name, replica_identity, tuple(columns))


def _read_update(reader: _Reader) -> Update:
    oid = reader.uint32()
    old_kind: str | None = None
    old: TupleData | None = None
    if reader.peek_char() in ("K", "O"):
        old_kind = reader.char()
        old = _read_tuple(reader)
    _expect(reader, "N")
    return Update(oid, old_kind, old, _read_tuple(reader))


def _read_delete(reader: _Reader) -> Delete:
    oid = reader.uint32()
    old_kind = reader.char()
    if old_kind not in ("K", "O"):
        raise SourceError(f"pgoutput Delete: expected 'K' or 'O', got {old_kind!r}")
    return Delete(oid, old_kind, _read_tuple(reader))


def _read_insert(reader: _Reader) -> Insert:
    oid = reader.uint32()
    _expect(reader, "N")
    return Insert(oid, _read_tuple(reader))


def _read_truncate(reader: _Reader) -> Truncate:
    count = reader.int32()
    reader.int8()  # options: CASCADE / RESTART IDENTITY
    return Truncate(tuple(reader.uint32() for _ in range(count)))


def _read_commit(reader: _Reader) -> Commit:
    reader.int8()  # flags, unused
    return Commit(reader.uint64(), reader.uint64(), reader.int64())


def _expect(reader: _Reader, tag: str) -> None:
    got = reader.char()
    if got != tag:
        raise SourceError(f"pgoutput: expected {tag!r}, got {got!r}")


_MESSAGE_READERS: dict[str, Callable[[_Reader], Message]] = {
    "B": lambda r: Begin(r.uint64(), r.int64(), r.uint32()),
    "C": _read_commit,
    "O": lambda r: Origin(r.uint64(), r.string()),
    "R": _read_relation,
    "Y": lambda r: TypeInfo(r.uint32(), r.string(), r.string()),
    "I": _read_insert,
    "U": _read_update,
    "D": _read_delete,
    "T": _read_truncate,
}


def decode_message(payload: bytes) -> Message:
    """One pgoutput (protocol 1) message."""
    if not payload:
        raise SourceError("empty pgoutput message")
    reader = _Reader(payload)
    tag = reader.char()
    read = _MESSAGE_READERS.get(tag)
    if read is None:
        raise SourceError(f"unknown pgoutput message type {tag!r}")
    try:
        return read(reader)
    except UnicodeDecodeError as exc:
        raise SourceError(f"pgoutput {tag!r} message: {exc}") from exc


# --- values ---
def _parse_bool(text: str) -> bool:
    if text not in ("t", "f"):
        raise ValueError(f"not a boolean: {text!r}")
    return text == "t"


def _parse_timestamp(text: str) -> datetime:
    # timestamp without time zone: the convention is that it holds UTC.
    return datetime.fromisoformat(text).replace(tzinfo=UTC)


def _parse_timestamptz(text: str) -> datetime:
    value = datetime.fromisoformat(text)
    if value.tzinfo is None:
        raise ValueError(f"timestamptz without offset: {text!r}")
    return value.astimezone(UTC)


def _parse_bytea(text: str) -> bytes:
    if not text.startswith("\\x"):
        raise ValueError("bytea not in hex format")
    return bytes.fromhex(text[2:])


VALUE_PARSERS: dict[int, Callable[[str], Any]] = {
    16: _parse_bool,
    20: int, 21: int, 23: int,
    700: float, 701: float,
    1700: Decimal,
    25: str, 1043: str, 1042: str, 19: str,
    1082: date.fromisoformat,
    1114: _parse_timestamp,
    1184: _parse_timestamptz,
    17: _parse_bytea,
}


def _parse_value(relation: Relation, column: Column, raw: bytes) -> Any:
    parse = VALUE_PARSERS.get(column.type_oid, str)
    try:
        return parse(raw.decode("utf-8"))
    except (ValueError, ArithmeticError) as exc:  # Decimal raises InvalidOperation
        # e.g. 'infinity' or BC dates, which Python's date types cannot hold.
        raise SourceError(f"{relation.table}.{column.name}: cannot convert "
                          f"{raw[:80]!r} (type OID {column.type_oid}): {exc}") from exc


class _Unchanged:
    """An unchanged TOAST value: the server did not send it (kind 'u')."""

    def __repr__(self) -> str:
        return "UNCHANGED"


UNCHANGED: Any = _Unchanged()


def decode_row(relation: Relation, data: TupleData) -> dict[str, Any]:
    """Column name -> value; an unchanged TOAST value is :data:`UNCHANGED`."""
    if len(data) != len(relation.columns):
        raise SourceError(f"{relation.table}: tuple has {len(data)} columns, "
                          f"relation has {len(relation.columns)}")
    row: dict[str, Any] = {}
    for column, (kind, raw) in zip(relation.columns, data, strict=True):
        if kind == "u":
            row[column.name] = UNCHANGED
        else:
            row[column.name] = None if raw is None else _parse_value(relation, column, raw)
    return row


# A read by name of a table or column the source no longer has (dropped or renamed since).
VANISHED = (psycopg2.errors.UndefinedColumn, psycopg2.errors.UndefinedTable)


def vanished(dsn: str, relation: Relation, columns: Sequence[Column], exc: psycopg2.Error,
             reading: str) -> UnsupportedSchemaChange:
    """The stop (exit 6) for a :data:`VANISHED` error of a read of ``columns`` of
    ``relation``, naming the table and the columns it no longer has. Not a crash: a
    restart would read the same names again and fail the same way."""
    message = exc.diag.message_primary or str(exc).strip()
    facts = pg_column_facts(dsn, relation.oid)  # by OID: a renamed table still answers
    if not facts:
        return UnsupportedSchemaChange(
            f"source table {relation.table} was dropped while {reading} ({message})")
    if isinstance(exc, psycopg2.errors.UndefinedTable):
        return UnsupportedSchemaChange(
            f"source table {relation.table} was renamed while {reading} ({message})")
    gone = [c.name for c in columns if c.name not in facts]
    return UnsupportedSchemaChange(
        f"source table {relation.table}: column(s) {gone or '?'} dropped or renamed while "
        f"{reading} ({message})")


def replication_dsn(dsn: str) -> str:
    params = psycopg2.extensions.parse_dsn(dsn)
    # Ours last: a later -c wins, and the parsers rely on these settings.
    params["options"] = f"{params.get('options', '')} {SESSION_OPTIONS}".strip()
    return psycopg2.extensions.make_dsn(**params)
