"""Debezium change events from JSON-lines files in a directory.

Each line of each ``*.json`` / ``*.jsonl`` file (read in file-name order)
is one Debezium message, bare or wrapped in a ``{"schema", "payload"}``
envelope: either transaction metadata (``status`` BEGIN / END) or a change
event (``op`` c, r, u, d). The events between a BEGIN and its END form one
transaction; an event without transaction data is a transaction of its own.

Column values are decoded by the event's own ``schema`` block when it has one
(``debezium_values.py``: base64 decimals, epoch-day dates, ISO-8601 zoned
timestamps, ...); a value that does not decode is a malformed event. JSON
numbers are parsed as ``Decimal``, so no digit of a decimal is lost.

Debezium's unavailable-value placeholder (an unchanged TOASTed value under
REPLICA IDENTITY DEFAULT) is never stored: an UPDATE takes the value from its
own ``before`` image (REPLICA IDENTITY FULL) or from the row as an earlier
change of the same transaction wrote it; else an UPDATE that keeps its key
leaves the field out, a partial update that keeps the row's current value.
An event whose ``after`` lacks fields is a partial update of the fields it has
(translate). A placeholder that cannot be kept (an insert, a key change) stops
the source (SourceError, exit 3), naming the event and the fields (docs/cdc.md).

A transaction's position is ``file:line`` of the line that completed it, so
positions order by (file name, line number). The files are the durable
record, which is why :meth:`DebeziumFileSource.ack` has nothing to do.

Only complete lines (ending in ``\\n``) are read: a writer may be in the
middle of appending the last one. Once a later file exists, an earlier file
is finished, and an unterminated last line in it is taken as complete.
"""

from __future__ import annotations

import bisect
import json
import os
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from decimal import Decimal
from pathlib import Path
from typing import Any, cast

from cdc_client.cdc_metrics import UNCHANGED_KEPT as _KEPT
from cdc_client.source import Op, RowChange, SourceError, SourceTransaction
from cdc_client.sources.debezium_values import (
    DEFAULT_PLACEHOLDER,
    UNAVAILABLE,
    ValueDecodeError,
    decode_row,
    row_decoder,
)

UNCHANGED_KEPT = _KEPT.labels(source="debezium-file")
SUFFIXES = (".json", ".jsonl")
CHUNK_BYTES = 1 << 20
POLL_STEP_S = 0.05

OPS: dict[str, Op] = {"c": "insert", "r": "insert", "u": "update", "d": "delete"}
# Source table (schema.table) -> its primary-key columns, None when unknown.
PrimaryKey = Callable[[str], tuple[str, ...] | None]


@dataclass(frozen=True)
class _Line:
    file: str
    number: int  # 1-based
    text: bytes

    @property
    def where(self) -> str:
        return f"{self.file}:{self.number}"


class _LineFeed:
    """The complete lines of the directory's files, in order, following growth."""

    def __init__(self, directory: Path, start_file: str | None) -> None:
        self._dir = directory
        self._files: list[str] = []
        self._index = 0  # the file being read
        self._offset = 0  # bytes of it consumed
        self._line_no = 0  # lines of it consumed
        self._pending: deque[_Line] = deque()
        self._scan()
        if start_file is not None:
            # Earlier files hold only positions at or before the resume point.
            self._index = bisect.bisect_left(self._files, start_file)

    def next_line(self) -> _Line | None:
        if not self._pending and not self._fill():
            return None
        return self._pending.popleft()

    def _fill(self) -> bool:
        self._scan()
        while self._index < len(self._files):
            sealed = self._index < len(self._files) - 1
            lines = self._read(self._files[self._index], sealed=sealed)
            if lines:
                self._pending.extend(lines)
                return True
            if not sealed:
                return False
            self._index += 1
            self._offset = 0
            self._line_no = 0
        return False

    def _scan(self) -> None:
        try:
            names = [p.name for p in self._dir.iterdir()
                     if p.suffix in SUFFIXES and p.is_file()]
        except OSError as exc:
            raise SourceError(f"cannot list {self._dir}: {exc}") from exc
        known = set(self._files)
        for name in sorted(names):
            if name in known:
                continue
            at = bisect.bisect_left(self._files, name)
            if self._files and at <= self._index:
                # Its lines would belong before ones already handed out.
                raise SourceError(f"{name} appeared in {self._dir} after reading had moved "
                                  f"past its place (now reading {self._files[self._index]})")
            self._files.insert(at, name)

    def _read(self, name: str, *, sealed: bool) -> list[_Line]:
        try:
            with (self._dir / name).open("rb") as f:
                if os.fstat(f.fileno()).st_size < self._offset:
                    raise SourceError(f"{name} shrank below the {self._offset} bytes already read")
                f.seek(self._offset)
                data = f.read(CHUNK_BYTES)
                end = data.rfind(b"\n")
                while end < 0:  # a line longer than a chunk: read on to its end
                    more = f.read(CHUNK_BYTES)
                    if not more:
                        break
                    newline = more.rfind(b"\n")
                    end = len(data) + newline if newline >= 0 else -1
                    data += more
        except OSError as exc:
            raise SourceError(f"cannot read {self._dir / name}: {exc}") from exc
        if end >= 0:
            texts, consumed = data[:end].split(b"\n"), end + 1
        elif sealed and data:
            texts, consumed = [data], len(data)
        else:
            return []
        self._offset += consumed
        lines = [_Line(name, self._line_no + i, text) for i, text in enumerate(texts, start=1)]
        self._line_no += len(texts)
        return lines


@dataclass
class _OpenTransaction:
    txid: str
    begun_at: str
    events: list[tuple[int | None, RowChange]] = field(default_factory=list)
    # (table, primary-key values) -> the row as this transaction last wrote it, for
    # the unavailable values of a later update of it.
    rows: dict[tuple[str, tuple[Any, ...]], Mapping[str, Any]] = field(default_factory=dict)

    def ordered_changes(self) -> tuple[RowChange, ...]:
        orders = [order for order, _ in self.events]
        if all(isinstance(order, int) for order in orders):
            return tuple(change for _, change in sorted(self.events,
                                                        key=lambda e: cast(int, e[0])))
        return tuple(change for _, change in self.events)  # arrival order is all we have


class DebeziumFileSource:
    """Committed transactions from a directory of Debezium JSON-lines files."""

    name = "debezium-file"

    def __init__(self, directory: Path, *, start_after: str | None = None,
                 unavailable_placeholder: str = DEFAULT_PLACEHOLDER,
                 primary_key: PrimaryKey | None = None) -> None:
        self._start_key = self.position_key(start_after) if start_after else None
        self._lines = _LineFeed(Path(directory), self._start_key[0] if self._start_key else None)
        self._open: _OpenTransaction | None = None
        # Debezium's unavailable.value.placeholder; empty: none is recognised.
        self._placeholder = unavailable_placeholder or None
        self._primary_key = primary_key

    # -- Source protocol --
    def poll(self, timeout_s: float) -> SourceTransaction | None:
        deadline = time.monotonic() + max(timeout_s, 0.0)
        while True:
            tx = self._advance()
            if tx is not None:
                return tx
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return None
            time.sleep(min(POLL_STEP_S, remaining))  # waiting for the writer: no event to wait on

    def ack(self, position: str) -> None:
        """Nothing to release: the files are the record and the connector keeps the position."""

    def position_key(self, position: str) -> tuple[Any, ...]:
        file, sep, line = position.rpartition(":")
        if not sep or not file or not line.isdigit():
            raise SourceError(f"not a Debezium file position (file:line): {position!r}")
        return (file, int(line))

    def close(self) -> None:
        """Files are opened per read; nothing stays open."""

    # -- lines --
    def _advance(self) -> SourceTransaction | None:
        while (line := self._lines.next_line()) is not None:
            if self._start_key is not None and (line.file, line.number) <= self._start_key:
                continue
            tx = self._consume(line)
            if tx is not None:
                return tx
        return None

    def _consume(self, line: _Line) -> SourceTransaction | None:
        if not line.text.strip():
            return None
        message, schema = _parse(line)
        if message is None:
            return None  # a tombstone: only meaningful for Kafka log compaction
        if "status" in message:
            return self._metadata(message, line)
        return self._event(message, schema, line)

    def _metadata(self, message: Mapping[str, Any], line: _Line) -> SourceTransaction | None:
        status, txid = message["status"], str(message.get("id"))
        if status == "BEGIN":
            if self._open is not None:
                raise SourceError(f"{line.where}: BEGIN of transaction {txid} while "
                                  f"{self._open.txid} (begun at {self._open.begun_at}) is open")
            self._open = _OpenTransaction(txid, line.where)
            return None
        if status != "END":
            raise SourceError(f"{line.where}: unknown transaction status {status!r}")
        if self._open is None or self._open.txid != txid:
            raise SourceError(f"{line.where}: END of transaction {txid}, which is not open "
                              f"(open: {self._open.txid if self._open else 'none'})")
        tx, self._open = self._open, None
        count = message.get("event_count")
        if count is not None and count != len(tx.events):
            raise SourceError(f"{line.where}: END of transaction {txid} announces {count} "
                              f"events, {len(tx.events)} arrived since {tx.begun_at}")
        if not tx.events:
            return None  # nothing captured: no transaction for the connector to apply
        return SourceTransaction(position=line.where, source_txid=txid,
                                 commit_time_ms=_ms(message.get("ts_ms")),
                                 changes=tx.ordered_changes())

    def _event(self, message: Mapping[str, Any], schema: Any,
               line: _Line) -> SourceTransaction | None:
        change = self._row_change(message, schema, line)
        info = message.get("transaction")
        if info is None:
            if self._open is not None:
                raise SourceError(f"{line.where}: event without transaction inside open "
                                  f"transaction {self._open.txid} (begun at {self._open.begun_at})")
            source = message["source"]
            return SourceTransaction(
                position=line.where, source_txid=_source_txid(source),
                commit_time_ms=_ms(source.get("ts_ms")) or _ms(message.get("ts_ms")),
                changes=(change,))
        if not isinstance(info, Mapping):
            raise SourceError(f"{line.where}: 'transaction' is not an object")
        txid = str(info.get("id"))
        if self._open is None or self._open.txid != txid:
            raise SourceError(f"{line.where}: event of transaction {txid}, which is not open "
                              f"(open: {self._open.txid if self._open else 'none'})")
        order = info.get("total_order")
        self._open.events.append((order if isinstance(order, int) else None, change))
        self._remember(self._open, change)
        return None

    # -- change events --
    def _row_change(self, message: Mapping[str, Any], schema: Any, line: _Line) -> RowChange:
        if "op" not in message:
            raise SourceError(f"{line.where}: change event without 'op'")
        op = OPS.get(message["op"])
        if op is None:
            raise SourceError(f"{line.where}: unknown op {message['op']!r}")
        # Debezium leaves ``before`` out of an update under PostgreSQL's default
        # replica identity; a key change then arrives as a delete and a create.
        table = _table(message, line)
        before = self._row(message, schema, "before", line, required=op == "delete")
        after = self._row(message, schema, "after", line, required=op in ("insert", "update"))
        if before is not None:
            # Only its key identifies the row; an unavailable value there is no value.
            before = {n: v for n, v in before.items() if v is not UNAVAILABLE}
        kept = False
        if op != "delete" and after is not None and _unavailable(after):
            filled = self._fill_unavailable(message, table, op, before, after, line)
            kept, after = len(filled) < len(after), filled
        return RowChange(table, op, None if op == "insert" else before,
                         None if op == "delete" else after, origin=line.where, partial=kept)

    def _row(self, message: Mapping[str, Any], schema: Any, key: str, line: _Line,
             *, required: bool) -> dict[str, Any] | None:
        row = message.get(key)
        if row is None:
            if required:
                raise SourceError(f"{line.where}: op {message['op']!r} without {key!r}")
            return None
        if not isinstance(row, Mapping):
            raise SourceError(f"{line.where}: {key!r} is not an object")
        # Values come in the wire form of the event's own schema (base64 decimals,
        # epoch-day dates, ...): decoded here, where the schema is known.
        try:
            return decode_row(row, row_decoder(schema, key), self._placeholder)
        except ValueDecodeError as exc:
            raise SourceError(f"{line.where}: malformed event ({_describe(message)}): "
                              f"{key}: {exc}") from None

    def _fill_unavailable(self, message: Mapping[str, Any], table: str, op: Op,
                          before: Mapping[str, Any] | None, after: dict[str, Any],
                          line: _Line) -> dict[str, Any]:
        """An UPDATE that left a TOASTed value alone carries the placeholder for it.
        Taken, exactly, from the event's old row (REPLICA IDENTITY FULL) or from this
        transaction's own earlier write of the row. Else, when the update keeps its
        key, the field is left out: a partial update, and the node keeps the row's
        current value, the value the row had before this update (transactions apply
        in commit order). Otherwise (an insert, a key that changed or cannot be told)
        the source stops: no other record of the value exists for a file source, and
        storing the placeholder would corrupt the row silently."""
        prior: Mapping[str, Any] = {}
        if op == "update" and self._open is not None:
            key = self._row_key(table, before if before else after)
            prior = self._open.rows.get((table, key), {}) if key is not None else {}
        filled = dict(after)
        for name in _unavailable(after):
            for source in ((before or {}) if op == "update" else {}, prior):
                value = source.get(name, UNAVAILABLE)
                if value is not UNAVAILABLE:
                    filled[name] = value
                    break
        missing = _unavailable(filled)
        if missing and op == "update" and self._keeps_key(table, before, filled):
            UNCHANGED_KEPT.inc(len(missing))
            return {n: v for n, v in filled.items() if v is not UNAVAILABLE}
        if missing:
            raise SourceError(
                f"{line.where}: event without the value of field(s) {missing} "
                f"({_describe(message)}): Debezium wrote its unavailable-value placeholder "
                f"{self._placeholder!r} (an unchanged TOASTed value) and neither the event's "
                f"before image nor an earlier change of the row in its transaction has it; "
                f"run ALTER TABLE {table} REPLICA IDENTITY FULL at the source so Debezium "
                f"sends the old value (docs/cdc.md)")
        return filled

    def _keeps_key(self, table: str, before: Mapping[str, Any] | None,
                   after: Mapping[str, Any]) -> bool:
        """Whether an update certainly keeps its row's key: its key is known and whole,
        and its before image (when it has one) names the same key. Without a before
        image the key did not change (Debezium sends a key change as a delete and a
        create)."""
        key = self._row_key(table, after)
        if key is None:
            return False
        return not before or self._row_key(table, before) == key

    def _row_key(self, table: str, row: Mapping[str, Any]) -> tuple[Any, ...] | None:
        columns = self._primary_key(table) if self._primary_key is not None else None
        if not columns or any(row.get(c) in (None, UNAVAILABLE) for c in columns):
            return None
        key = tuple(row[c] for c in columns)
        try:
            hash(key)
        except TypeError:
            # A key value that arrived as a JSON array or object: the codec refuses the
            # row itself (exit 3); it is just not remembered for TOAST filling.
            return None
        return key

    def _remember(self, open_tx: _OpenTransaction, change: RowChange) -> None:
        if self._primary_key is None:
            return
        if change.before is not None:
            old = self._row_key(change.table, change.before)
            if old is not None:  # no key, nothing was remembered
                open_tx.rows.pop((change.table, old), None)
        if change.after is not None:
            new = self._row_key(change.table, change.after)
            if new is not None:
                open_tx.rows[(change.table, new)] = change.after


# --- messages ---
def _parse(line: _Line) -> tuple[Mapping[str, Any] | None, Any]:
    """The message (the envelope's payload) and the envelope's schema, if any."""
    try:
        # Decimal, not float: a decimal written as a JSON number keeps every digit.
        message = json.loads(line.text, parse_float=Decimal)
    except ValueError as exc:  # JSONDecodeError and UnicodeDecodeError
        raise SourceError(f"{line.where}: malformed JSON: {exc}") from exc
    schema = None
    if (isinstance(message, Mapping) and "payload" in message
            and "op" not in message and "status" not in message):
        message, schema = message["payload"], message.get("schema")
    if message is None or isinstance(message, Mapping):
        return message, schema
    raise SourceError(f"{line.where}: expected a JSON object, got {type(message).__name__}")


def _table(message: Mapping[str, Any], line: _Line) -> str:
    source = message.get("source")
    if not isinstance(source, Mapping) or not source.get("table"):
        raise SourceError(f"{line.where}: change event without source.table")
    schema = source.get("schema") or source.get("db")
    if not schema:
        raise SourceError(f"{line.where}: change event without source.schema or source.db")
    return f"{schema}.{source['table']}"


def _describe(message: Mapping[str, Any]) -> str:
    source = message.get("source")
    source = source if isinstance(source, Mapping) else {}
    namespace = source.get("schema") or source.get("db")
    parts = [f"op {message.get('op')!r}", f"table {namespace}.{source.get('table')}"]
    info = message.get("transaction")
    if isinstance(info, Mapping):
        parts.append(f"transaction {info.get('id')}")
    elif source.get("txId") is not None:
        parts.append(f"txId {source['txId']}")
    return ", ".join(parts)


def _source_txid(source: Mapping[str, Any]) -> str:
    # PostgreSQL connectors report txId, MySQL ones a GTID; snapshots neither.
    for key in ("txId", "gtid"):
        if source.get(key) is not None:
            return str(source[key])
    return ""


def _unavailable(row: Mapping[str, Any]) -> list[str]:
    return [name for name, value in row.items() if value is UNAVAILABLE]


def _ms(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int | float | Decimal):
        return 0
    return int(value)
