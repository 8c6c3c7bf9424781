"""The initial snapshot of a PostgreSQL source (``cdc.snapshot_mode = "initial"``).

The slot is created with ``CREATE_REPLICATION_SLOT .. LOGICAL pgoutput
EXPORT_SNAPSHOT`` on a replication connection. A second connection imports
that snapshot (``SET TRANSACTION SNAPSHOT`` in a REPEATABLE READ READ ONLY
transaction) before the replication connection is closed, and reads every
published table in primary-key order, ``chunk_rows`` rows at a time. Each
chunk is one :class:`SourceTransaction` of inserts; the first one starts
with a TRUNCATE of every table (:meth:`SnapshotReader.next_chunk`). The snapshot shows
exactly the transactions that committed before the slot's consistent point,
and the slot streams exactly those that commit after it: nothing is lost or
doubled at the seam.

A chunk's position (``snapshot:<consistent point>:<seq>:<json>``) names the
table and the primary key of its last row. It sorts before every streamed
position (see :func:`position_key`), so the connector's committed position
is durable snapshot progress. A connector restarted mid-snapshot cannot
import the exported snapshot again (it died with its session): it reads the
rest, from the key after the committed one, in a fresh REPEATABLE READ
snapshot. That snapshot is newer than the consistent point, so a row may be
read in a state a change streamed later re-applies; every streamed change
carries the full row (or deletes it) and lands later in Retina, so each row
ends at its last streamed state, and one never touched since the consistent
point reads the same in both snapshots. Rows already loaded before the crash
are brought up to date the same way.

Each chunk carries its table's columns as this snapshot read them (a
:class:`SourceSchema`, like a streamed Relation), so the Retina table follows
a column added since the consistent point (which a resumed snapshot reads)
before the chunk's rows are translated. A table or column dropped after its
columns were read stops the source (``UnsupportedSchemaChange``, exit 6).

Values are read as text (each type's output function) in the replication
session's output settings and parsed by the same code as the streamed pgoutput values, so a
snapshot row and a streamed row of the same content are identical.
"""

from __future__ import annotations

import dataclasses
import json
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import psycopg2
import psycopg2.extensions
import psycopg2.extras
import structlog
from psycopg2 import sql

from cdc_client import cdc_metrics as m
from cdc_client.schema_change import SourceSchema, pg_source_schema
from cdc_client.source import RowChange, SourceError, SourceTransaction
from cdc_client.sources.pgoutput import (
    VANISHED,
    Column,
    Relation,
    decode_row,
    format_lsn,
    parse_lsn,
    replication_dsn,
    vanished,
)

log = structlog.get_logger("cdc")
PREFIX = "snapshot:"
SNAPSHOT_MODES = ("initial", "never")
_SLOT_NAME = re.compile(r"^[a-z0-9_]{1,63}$")  # PostgreSQL's rule for slot names


@dataclass(frozen=True)
class SnapshotPosition:
    """How far the snapshot got: the last row of chunk ``seq`` is ``table``'s
    row with primary-key text ``after`` (``()``: nothing of ``table`` yet)."""

    consistent_point: int
    seq: int
    table: str
    after: tuple[str, ...]

    def encode(self) -> str:
        body = json.dumps({"table": self.table, "after": list(self.after)},
                          separators=(",", ":"), ensure_ascii=False)
        return f"{PREFIX}{format_lsn(self.consistent_point)}:{self.seq}:{body}"

    @classmethod
    def parse(cls, text: str) -> SnapshotPosition:
        try:
            _, lsn, seq, body = text.split(":", 3)
            d = json.loads(body)
            return cls(parse_lsn(lsn), int(seq), str(d["table"]),
                       tuple(str(v) for v in d["after"]))
        except (ValueError, KeyError, TypeError) as exc:
            raise SourceError(f"not a snapshot position: {text!r}") from exc


def is_snapshot_position(text: str) -> bool:
    return text.startswith(PREFIX)


def position_key(text: str) -> tuple[Any, ...]:
    """Snapshot chunks sort by their sequence number, all before the streamed
    transactions (``(lsn, 1)``), whose commits all end after the consistent point."""
    if is_snapshot_position(text):
        position = SnapshotPosition.parse(text)
        return (position.consistent_point, 0, position.seq)
    return (parse_lsn(text), 1)


@dataclass(frozen=True)
class SnapshotTable:
    relation: Relation  # columns in table order; is_key marks the primary key
    key: tuple[str, ...]  # primary-key columns in index order


def _qualified(relation: Relation) -> sql.Composable:
    return sql.Identifier(relation.namespace, relation.name)


def published_tables(cur: Any, publication: str) -> list[SnapshotTable]:
    """Every table of ``publication``, by name, with its columns and primary key."""
    cur.execute("SELECT c.oid, n.nspname, c.relname FROM pg_publication_tables p "
                "JOIN pg_namespace n ON n.nspname = p.schemaname "
                "JOIN pg_class c ON c.relnamespace = n.oid AND c.relname = p.tablename "
                "WHERE p.pubname = %s ORDER BY n.nspname, c.relname", (publication,))
    tables = []
    for oid, namespace, name in cur.fetchall():
        # The columns pgoutput sends: generated columns are left out. The type modifier
        # (a numeric's precision and scale) is what a Relation message carries too.
        cur.execute("SELECT attname, atttypid, atttypmod FROM pg_attribute "
                    "WHERE attrelid = %s AND attnum > 0 AND NOT attisdropped "
                    "AND attgenerated = '' ORDER BY attnum", (oid,))
        columns = cur.fetchall()
        cur.execute("SELECT a.attname FROM pg_index i, unnest(i.indkey::int2[]) "
                    "WITH ORDINALITY AS k(attnum, ord), pg_attribute a "
                    "WHERE i.indrelid = %s AND i.indisprimary AND a.attrelid = i.indrelid "
                    "AND a.attnum = k.attnum ORDER BY k.ord", (oid,))
        key = tuple(r[0] for r in cur.fetchall())
        if not key:
            raise SourceError(f"{namespace}.{name}: no primary key; the initial snapshot "
                              "reads a table in primary-key order (and Retina needs one)")
        relation = Relation(oid, namespace, name, "d", tuple(
            Column(col, int(type_oid), col in key, int(typmod))
            for col, type_oid, typmod in columns))
        tables.append(SnapshotTable(relation, key))
    # A resumed snapshot finds its place by comparing these names in Python: the order
    # must be that comparison's, not the database collation's (which can put 'B' after
    # 'a', and would then skip a table when the one to resume in is gone).
    tables.sort(key=lambda t: t.relation.table)
    return tables


def read_as_text(conn: psycopg2.extensions.connection, type_oids: Sequence[int]) -> None:
    """Values of these types come back as the server's text, unparsed: the
    type's output function, exactly what pgoutput sends (a ``::text`` cast is
    not: ``true::text`` is 'true', pgoutput sends 't')."""
    caster = psycopg2.extensions.new_type(tuple(sorted(set(type_oids))), "RETINA_TEXT",
                                          lambda value, _cur: value)
    psycopg2.extensions.register_type(caster, conn)


def _tuple(values: Sequence[str | None]) -> tuple[tuple[str, bytes | None], ...]:
    return tuple(("n", None) if v is None else ("t", v.encode("utf-8")) for v in values)


def read_chunk(cur: Any, table: SnapshotTable, after: tuple[str, ...], limit: int
               ) -> tuple[list[dict[str, Any]], tuple[str, ...]]:
    """Up to ``limit`` rows after key ``after`` in key order, and the last one's key text."""
    rel = table.relation
    columns = sql.SQL(", ").join(sql.Identifier(c.name) for c in rel.columns)
    # Qualified: ORDER BY names the table's column, never an output column.
    key = sql.SQL(", ").join(sql.Identifier(rel.namespace, rel.name, k) for k in table.key)
    query = sql.SQL("SELECT {} FROM {}").format(columns, _qualified(rel))
    args: list[Any] = []
    if after:
        # Text literals take the key columns' types; a row compares like ORDER BY.
        query += sql.SQL(" WHERE ({}) > ({})").format(
            key, sql.SQL(", ").join(sql.Placeholder() * len(after)))
        args.extend(after)
    query += sql.SQL(" ORDER BY {} LIMIT %s").format(key)
    cur.execute(query, (*args, limit))
    raw = cur.fetchall()
    if not raw:
        return [], after
    names = [c.name for c in rel.columns]
    last = dict(zip(names, raw[-1], strict=True))
    return ([decode_row(rel, _tuple(r)) for r in raw], tuple(last[k] for k in table.key))


def _reader(dsn: str) -> psycopg2.extensions.connection:
    # The replication session's output settings: values parse the same way.
    conn = psycopg2.connect(replication_dsn(dsn), connect_timeout=10)
    conn.set_session(isolation_level=psycopg2.extensions.ISOLATION_LEVEL_REPEATABLE_READ,
                     readonly=True)
    return conn


class SnapshotReader:
    """The snapshot's chunks, in order; :meth:`next_chunk` returns None once done."""

    def __init__(self, conn: psycopg2.extensions.connection, dsn: str, publication: str,
                 consistent_point: int, chunk_rows: int,
                 resume: SnapshotPosition | None = None) -> None:
        if chunk_rows < 1:
            raise ValueError("snapshot chunk_rows must be at least 1")
        # A new snapshot (not a resumed one) empties the tables first; see next_chunk.
        self._truncate_first = resume is None
        self._conn = conn
        self._cur = conn.cursor()
        self.consistent_point = consistent_point
        self._chunk_rows = chunk_rows
        self._dsn = dsn
        self._tables = published_tables(self._cur, publication)
        # Each chunk carries its table's columns as this snapshot reads them, like a
        # streamed transaction its Relation: the Retina table follows them (a column
        # added since the consistent point, seen by a resumed snapshot) before any row
        # of the chunk is translated.
        self._schemas: dict[str, SourceSchema] = {
            t.relation.table: pg_source_schema(t.relation, dsn) for t in self._tables}
        read_as_text(conn, [c.type_oid for t in self._tables for c in t.relation.columns])
        self._index = 0
        self._after: tuple[str, ...] = ()
        self._seq = 0
        self.rows = 0
        m.SNAPSHOT_IN_PROGRESS.set(1)
        if resume is not None:
            self._seq = resume.seq
            names = [t.relation.table for t in self._tables]
            self._index = next((i for i, n in enumerate(names) if n >= resume.table), len(names))
            if self._index < len(names) and names[self._index] == resume.table:
                self._after = resume.after
        log.info("cdc_snapshot_tables", tables=[t.relation.table for t in self._tables],
                 consistent_point=format_lsn(consistent_point), resumed=resume is not None,
                 resume_table=resume.table if resume else None)

    @classmethod
    def create(cls, dsn: str, slot: str, publication: str, chunk_rows: int) -> SnapshotReader:
        """Create ``slot`` (which must not exist) and import the snapshot it exports."""
        if not _SLOT_NAME.match(slot):
            raise SourceError(f"invalid replication slot name {slot!r}: lower-case letters, "
                              "digits and underscores, at most 63")
        repl = psycopg2.connect(replication_dsn(dsn), connect_timeout=10,
                                connection_factory=psycopg2.extras.LogicalReplicationConnection)
        try:
            with repl.cursor() as cur:
                # Waits for transactions running anywhere in the cluster to end.
                cur.execute(f"CREATE_REPLICATION_SLOT {slot} LOGICAL pgoutput EXPORT_SNAPSHOT")
                _name, lsn, snapshot_name, _plugin = cur.fetchone()
            conn = _reader(dsn)
            try:
                with conn.cursor() as cur:  # must be the transaction's first statement
                    cur.execute("SET TRANSACTION SNAPSHOT %s", (snapshot_name,))
                reader = cls(conn, dsn, publication, parse_lsn(lsn), chunk_rows)
            except BaseException:
                conn.close()
                raise
        finally:
            # The exported snapshot lives until the exporting session's next
            # command; once imported, the importing transaction holds it.
            repl.close()
        log.info("cdc_snapshot_start", slot=slot, consistent_point=lsn, snapshot=snapshot_name)
        return reader

    @classmethod
    def resume(cls, dsn: str, publication: str, position: SnapshotPosition,
               chunk_rows: int) -> SnapshotReader:
        """Carry on after ``position`` in a fresh snapshot (the exported one is gone)."""
        conn = _reader(dsn)
        try:
            reader = cls(conn, dsn, publication, position.consistent_point, chunk_rows,
                         position)
        except BaseException:
            conn.close()
            raise
        log.info("cdc_snapshot_resume", table=position.table, seq=position.seq,
                 consistent_point=format_lsn(position.consistent_point))
        return reader

    def next_chunk(self) -> SourceTransaction | None:
        """The next chunk. The first one of a new snapshot starts with a TRUNCATE
        of every table: a first attempt that died before committing a chunk may
        have left rows in Retina (sent, or in the changelog a recovery replays)
        that this snapshot, from a new slot, no longer has; nothing would ever
        delete them otherwise. With every table empty it is the only change."""
        chunk = self._next_rows()
        if not self._truncate_first or not self._tables:
            # Inserts only: every older row was truncated by the first chunk, and a
            # resumed snapshot reads on after the last committed one.
            return dataclasses.replace(chunk, bulk=True) if chunk is not None else None
        self._truncate_first = False
        truncates = tuple(RowChange(t.relation.table, "truncate", None, None)
                          for t in self._tables)
        if chunk is not None:
            return dataclasses.replace(chunk, changes=truncates + chunk.changes)
        self._seq += 1  # nothing to read: resuming after it reads every table again
        return self._transaction(SnapshotPosition(self.consistent_point, self._seq, "", ()),
                                 truncates)

    def _transaction(self, position: SnapshotPosition, changes: tuple[RowChange, ...],
                     schemas: tuple[SourceSchema, ...] = ()) -> SourceTransaction:
        return SourceTransaction(position=position.encode(), source_txid=f"snapshot-{position.seq}",
                                 commit_time_ms=int(time.time() * 1000), changes=changes,
                                 schemas=schemas)

    def _next_rows(self) -> SourceTransaction | None:
        while self._index < len(self._tables):
            table = self._tables[self._index]
            rows, after = self._read(table)
            if rows:
                self._after = after
                self._seq += 1
                self.rows += len(rows)
                m.SNAPSHOT_ROWS.inc(len(rows))
                name = table.relation.table
                position = SnapshotPosition(self.consistent_point, self._seq, name, after)
                return self._transaction(
                    position, tuple(RowChange(name, "insert", None, r) for r in rows),
                    (self._schemas[name],))
            self._index += 1
            self._after = ()
        return None

    def _read(self, table: SnapshotTable) -> tuple[list[dict[str, Any]], tuple[str, ...]]:
        try:
            return read_chunk(self._cur, table, self._after, self._chunk_rows)
        except VANISHED as exc:
            # Dropped (or renamed) after this snapshot read the table's columns: the
            # exported snapshot's catalog still shows it, the table no longer has it.
            raise vanished(self._dsn, table.relation, table.relation.columns, exc,
                           "the initial snapshot read it") from exc

    def close(self) -> None:
        m.SNAPSHOT_IN_PROGRESS.set(0)
        self._conn.close()
