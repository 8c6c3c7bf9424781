"""PostgreSQL logical replication source: the built-in ``pgoutput`` plugin, protocol 1.

The walsender streams pgoutput messages (PostgreSQL documentation, "Logical
Replication Message Formats"); this module decodes them itself and groups
Begin .. Commit into :class:`SourceTransaction` values. A transaction's
position is the end LSN of its commit record: acknowledging it as the
slot's flush LSN makes the server skip the transaction on the next start,
and every later transaction has a greater end LSN.

Values arrive in text form. The replication session pins the output
settings (UTF8, ISO dates, UTC, hex bytea) so the text parses the same way
whatever the server's defaults are.
"""

from __future__ import annotations

import select
import time
from collections.abc import Mapping, Sequence
from contextlib import closing, suppress
from dataclasses import dataclass, field
from typing import Any

import psycopg2
import psycopg2.errors
import psycopg2.extensions
import psycopg2.extras
import structlog
from psycopg2 import sql

from cdc_client.cdc_metrics import UNCHANGED_KEPT as _KEPT
from cdc_client.schema_change import (
    SourceSchema,
    pg_source_schema,
)
from cdc_client.source import RowChange, SourceError, SourceTransaction
from cdc_client.sources import pg_snapshot
from cdc_client.sources.pg_stream import Keepalive, ReplicationStream, XLogData
from cdc_client.sources.pgoutput import (
    FEEDBACK_INTERVAL_S,
    PG_EPOCH_MS,
    UNCHANGED,
    VANISHED,
    VISIBILITY_WARN_S,
    Begin,
    Commit,
    Delete,
    Insert,
    Message,
    Origin,
    Relation,
    Truncate,
    TypeInfo,
    Update,
    decode_message,
    decode_row,
    format_lsn,
    parse_lsn,
    replication_dsn,
    vanished,
)
from retina_common.config import UNCHANGED_TOAST_MODES
from retina_common.retry import Backoff

log = structlog.get_logger("cdc")
UNCHANGED_KEPT = _KEPT.labels(source="postgres")

def _without_nulls(row: Mapping[str, Any]) -> dict[str, Any]:
    # A 'K' tuple carries the key columns and nulls in place of the rest.
    return {name: value for name, value in row.items()
            if value is not None and value is not UNCHANGED}


def _unchanged(row: Mapping[str, Any]) -> list[str]:
    return [name for name, value in row.items() if value is UNCHANGED]


def _key_of(relation: Relation, row: Mapping[str, Any]) -> tuple[Any, ...]:
    return tuple(row.get(c.name) for c in relation.columns if c.is_key)


# --- setup and teardown ---
def _table_identifier(name: str) -> sql.Identifier:
    schema, sep, table = name.partition(".")
    return sql.Identifier(schema, table) if sep else sql.Identifier(name)


def ensure_publication(dsn: str, publication: str, tables: Sequence[str] | None) -> None:
    """Create ``publication`` unless it exists (an existing one is left as it is)."""
    if tables is not None and not tables:
        raise ValueError("a publication needs at least one table (or None for all tables)")
    if tables is None:
        target = sql.SQL("FOR ALL TABLES")
    else:
        target = sql.SQL("FOR TABLE {}").format(
            sql.SQL(", ").join(_table_identifier(t) for t in tables))
    with closing(psycopg2.connect(dsn, connect_timeout=10)) as conn:
        conn.autocommit = True
        with conn.cursor() as cur:
            cur.execute("SELECT 1 FROM pg_publication WHERE pubname = %s", (publication,))
            if cur.fetchone() is not None:
                return
            # Created concurrently by someone else is just as good.
            with suppress(psycopg2.errors.DuplicateObject):
                cur.execute(sql.SQL("CREATE PUBLICATION {} {}").format(
                    sql.Identifier(publication), target))


def ensure_slot(dsn: str, slot: str) -> None:
    """Create the logical slot with pgoutput unless it exists; refuse a foreign one."""
    with closing(psycopg2.connect(dsn, connect_timeout=10)) as conn:
        conn.autocommit = True
        with conn.cursor() as cur:
            if not _slot_exists(cur, slot):
                # Waits for transactions running anywhere in the cluster to end.
                cur.execute("SELECT pg_create_logical_replication_slot(%s, 'pgoutput')", (slot,))


def slot_exists(dsn: str, slot: str) -> bool:
    """Whether ``slot`` exists; a slot that is not ours (plugin, type, database) is refused."""
    with closing(psycopg2.connect(dsn, connect_timeout=10)) as conn, conn.cursor() as cur:
        return _slot_exists(cur, slot)


def _slot_exists(cur: Any, slot: str) -> bool:
    cur.execute("SELECT plugin, slot_type, database = current_database() "
                "FROM pg_replication_slots WHERE slot_name = %s", (slot,))
    row = cur.fetchone()
    if row is not None and tuple(row) != ("pgoutput", "logical", True):
        raise SourceError(f"replication slot {slot!r} exists but is not a pgoutput "
                          f"logical slot of this database: {row!r}")
    return row is not None


def drop_slot(dsn: str, slot: str, timeout_s: float = 10.0) -> None:
    """Drop ``slot`` if it exists.

    A walsender releases its slot only after its connection is gone, a moment
    after the client closes it, so an active slot is retried until the deadline.
    """
    deadline = time.monotonic() + timeout_s
    with closing(psycopg2.connect(dsn, connect_timeout=10)) as conn:
        conn.autocommit = True
        with conn.cursor() as cur:
            while True:
                try:
                    cur.execute("SELECT pg_drop_replication_slot(slot_name) "
                                "FROM pg_replication_slots WHERE slot_name = %s", (slot,))
                    return
                except psycopg2.errors.ObjectInUse:
                    if time.monotonic() >= deadline:
                        raise
                    time.sleep(0.05)


# --- the source ---
@dataclass
class _OpenTransaction:
    xid: int
    changes: list[RowChange] = field(default_factory=list)
    # (table, key) -> the latest full row this transaction wrote: where an
    # unchanged TOAST value of a later update in it comes from.
    rows: dict[tuple[str, tuple[Any, ...]], Mapping[str, Any]] = field(default_factory=dict)
    # Updates whose unchanged TOAST values are read from the source at commit:
    # (index in changes, relation).
    unresolved: list[tuple[int, Relation]] = field(default_factory=list)

    def forget(self, table: str) -> None:
        self.rows = {k: v for k, v in self.rows.items() if k[0] != table}


class PostgresSource:
    """Committed transactions from a pgoutput logical replication slot, after
    the initial snapshot of the published tables (``snapshot_mode="initial"``,
    :mod:`cdc_client.sources.pg_snapshot`).

    ``start_after`` is the connector's committed position: None for a new
    connector, a snapshot position mid-snapshot, else an LSN. A new connector
    with ``snapshot_mode="initial"`` takes a snapshot: it creates the slot
    itself, to read the tables exactly at the slot's consistent point; a slot
    that already exists then (a first start that died before committing any
    snapshot chunk, or one made by hand) is dropped first. With a committed
    LSN, or ``snapshot_mode="never"``, the existing slot (created if missing)
    resumes streaming.
    """

    name = "postgres"

    def __init__(self, dsn: str, *, slot: str, publication: str,
                 tables: Sequence[str] | None = None, start_after: str | None = None,
                 snapshot_mode: str = "initial", snapshot_chunk_rows: int = 5000,
                 unchanged_toast: str = "keep-current") -> None:
        if snapshot_mode not in pg_snapshot.SNAPSHOT_MODES:
            raise ValueError(f"snapshot_mode: expected one of {pg_snapshot.SNAPSHOT_MODES}, "
                             f"got {snapshot_mode!r}")
        if unchanged_toast not in UNCHANGED_TOAST_MODES:
            raise ValueError(f"unchanged_toast: expected one of {UNCHANGED_TOAST_MODES}, "
                             f"got {unchanged_toast!r}")
        self._keep_current = unchanged_toast == "keep-current"
        self._dsn = dsn
        self._slot = slot
        self._publication = publication
        ensure_publication(dsn, publication, tables)
        self._snapshot = self._open_snapshot(start_after, snapshot_mode, snapshot_chunk_rows)
        if self._snapshot is not None:
            start_after = None  # the stream starts at the slot's consistent point
        self._start_after = start_after
        self._floor = parse_lsn(start_after) if start_after else 0
        self._stream: ReplicationStream | None = None  # the replication connection, once streaming
        self._lookup: Any = None  # a plain connection for unchanged TOAST values
        self._relations: dict[int, Relation] = {}
        self._schemas: list[SourceSchema] = []  # Relations not yet handed out
        self._open: _OpenTransaction | None = None
        self._returned_lsn = self._floor  # end LSN of the last transaction handed out
        self._acked_lsn = self._floor
        self._empty_lsn = 0  # end LSN of a skipped empty transaction not yet confirmed
        self._idle_lsn = 0  # a keepalive's WAL end, safe to confirm (_on_keepalive)
        self._last_feedback = time.monotonic()
        if self._snapshot is None:
            self._start_streaming()

    def _open_snapshot(self, start_after: str | None, mode: str,
                       chunk_rows: int) -> pg_snapshot.SnapshotReader | None:
        dsn, slot = self._dsn, self._slot
        if start_after and pg_snapshot.is_snapshot_position(start_after):
            if not slot_exists(dsn, slot):
                raise SourceError(
                    f"replication slot {slot!r} is gone while the initial snapshot is "
                    "incomplete: changes since its consistent point are lost; reset the "
                    "connector and start over (docs/cdc.md, initial snapshot)")
            return pg_snapshot.SnapshotReader.resume(
                dsn, self._publication, pg_snapshot.SnapshotPosition.parse(start_after),
                chunk_rows)
        if start_after or mode == "never":
            ensure_slot(dsn, slot)
            return None
        if slot_exists(dsn, slot):
            log.warning("cdc_snapshot_slot_recreated", slot=slot,
                        reason="no committed position: the snapshot needs a new slot")
            drop_slot(dsn, slot)
        return pg_snapshot.SnapshotReader.create(dsn, slot, self._publication, chunk_rows)

    def _start_streaming(self) -> None:
        conn = psycopg2.connect(replication_dsn(self._dsn), connect_timeout=10,
                                connection_factory=psycopg2.extras.LogicalReplicationConnection)
        try:
            cur = conn.cursor()
            cur.start_replication(
                slot_name=self._slot, decode=False, start_lsn=self._start_after or 0,
                options={"proto_version": "1",
                         "publication_names": _quote_ident(self._publication)})
        except BaseException:
            conn.close()
            raise
        # 0, which the server ignores, until something is confirmed: the slot may be
        # ahead of the committed position already (a keepalive's WAL end).
        self._stream = ReplicationStream(conn, confirmed=0)
        self._last_feedback = time.monotonic()

    # -- Source protocol --
    def poll(self, timeout_s: float) -> SourceTransaction | None:
        if self._snapshot is not None:
            chunk = self._snapshot.next_chunk()
            if chunk is not None:
                return chunk
            log.info("cdc_snapshot_done", rows=self._snapshot.rows,
                     consistent_point=format_lsn(self._snapshot.consistent_point))
            self._snapshot.close()
            self._snapshot = None
            self._start_streaming()
        stream = self._streaming()
        deadline = time.monotonic() + max(timeout_s, 0.0)
        while True:
            self._keep_alive()
            msg = stream.read()
            if isinstance(msg, XLogData):
                tx = self._handle(decode_message(msg.payload))
                if tx is not None:
                    return tx
            elif msg is not None:
                self._on_keepalive(msg)
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return None  # a half-read transaction stays open for the next poll
            if msg is None:
                select.select([stream], [], [], min(remaining, FEEDBACK_INTERVAL_S))

    def ack(self, position: str) -> None:
        if pg_snapshot.is_snapshot_position(position):
            return  # a snapshot chunk: the slot stays at its consistent point
        lsn = parse_lsn(position)
        self._acked_lsn = max(self._acked_lsn, lsn)
        if self._empty_lsn and lsn >= self._returned_lsn:
            lsn = max(lsn, self._empty_lsn)
            self._empty_lsn = 0
        self._confirm(lsn)

    def position_key(self, position: str) -> tuple[Any, ...]:
        return pg_snapshot.position_key(position)

    def close(self) -> None:
        if self._stream is not None:
            self._stream.close()  # under the stream's lock: never under a read
        if self._lookup is not None:
            self._lookup.close()
        if self._snapshot is not None:
            self._snapshot.close()

    # -- feedback --
    def _streaming(self) -> ReplicationStream:
        if self._stream is None:
            raise SourceError("the replication stream is not open")
        return self._stream

    def _confirm(self, lsn: int) -> None:
        # reply=True: the server answers at once, so its view is current.
        self._streaming().confirm(lsn, reply=True)
        self._last_feedback = time.monotonic()

    def _keep_alive(self) -> None:
        # The stream answers the server's reply requests as they are read, but
        # only while someone reads; this bounds the gap to our own interval.
        if time.monotonic() - self._last_feedback >= FEEDBACK_INTERVAL_S:
            self._streaming().confirm(self._idle_lsn)
            self._last_feedback = time.monotonic()

    def _on_keepalive(self, keepalive: Keepalive) -> None:
        """Take the keepalive's WAL end as safe to confirm when nothing read is
        unacknowledged.

        The server sends every transaction that commits before the WAL end it
        reports ahead of the keepalive, so with no transaction half-read and
        every one handed out acknowledged, everything before that end is
        confirmed or was never ours (other tables' changes, empty transactions).
        Without this, a source busy only with unpublished tables would keep
        its WAL for the slot forever (PostgreSQL 15 sends nothing for them).
        Invariant *confirm-only-committed*: never confirm past a transaction
        read but not acknowledged (module pg_stream says how that lost data)."""
        # Confirmed with the next periodic status update, not at once: the
        # server pings after every WAL flush while we lag its WAL end, and a
        # reply to each would be a message per flush on a busy server. Still
        # safe then: what precedes this end does not change by reading on.
        if self._open is None and self._acked_lsn >= self._returned_lsn:
            self._idle_lsn = max(self._idle_lsn, keepalive.wal_end)

    # -- messages --
    def _handle(self, message: Message) -> SourceTransaction | None:
        match message:
            case Begin():
                if self._open is not None:
                    raise SourceError(f"pgoutput Begin of xid {message.xid} inside open "
                                      f"transaction {self._open.xid}")
                self._open = _OpenTransaction(message.xid)
            case Commit():
                return self._commit(message)
            case Relation():
                self._relations[message.oid] = message
                # Handed out with the next returned transaction (schema_change.py).
                self._schemas.append(pg_source_schema(message, self._dsn))
            case TypeInfo() | Origin():
                pass  # unknown types decode as text; origins do not matter here
            case Truncate():
                # One message for every table of the statement (CASCADE included).
                open_tx = self._transaction()
                for oid in message.relation_oids:
                    table = self._relation(oid).table
                    open_tx.changes.append(RowChange(table, "truncate", None, None))
                    open_tx.forget(table)
            case Insert() | Update() | Delete():
                self._transaction().changes.append(self._row_change(message))
        return None

    def _transaction(self) -> _OpenTransaction:
        if self._open is None:
            raise SourceError("pgoutput change outside Begin .. Commit")
        return self._open

    def _relation(self, oid: int) -> Relation:
        relation = self._relations.get(oid)
        if relation is None:
            raise SourceError(f"pgoutput change for relation OID {oid} before its Relation")
        return relation

    def _row_change(self, message: Insert | Update | Delete) -> RowChange:
        relation = self._relation(message.relation_oid)
        open_tx = self._transaction()
        if isinstance(message, Insert):
            after = decode_row(relation, message.new)
            open_tx.rows[(relation.table, _key_of(relation, after))] = after
            return RowChange(relation.table, "insert", None, after)
        if isinstance(message, Delete):
            before = _without_nulls(decode_row(relation, message.old))
            open_tx.rows.pop((relation.table, _key_of(relation, before)), None)
            return RowChange(relation.table, "delete", before, None)
        after = decode_row(relation, message.new)
        old: dict[str, Any] = {}
        if message.old is None:  # key unchanged: the server sends no old tuple
            before = {c.name: after[c.name] for c in relation.columns if c.is_key}
        else:
            before = decode_row(relation, message.old)
            if message.old_kind == "K":  # key columns only: nulls stand for the rest
                before = _without_nulls(before)
            else:
                old = before
        if _unchanged(after):
            after = self._fill_unchanged(relation, open_tx, before, old, after)
        open_tx.rows.pop((relation.table, _key_of(relation, before)), None)
        open_tx.rows[(relation.table, _key_of(relation, after))] = after
        # Fewer columns than the relation: unchanged values left out, kept by the node.
        return RowChange(relation.table, "update", before, after,
                         partial=len(after) < len(relation.columns))

    def _fill_unchanged(self, relation: Relation, open_tx: _OpenTransaction,
                        before: Mapping[str, Any], old: Mapping[str, Any],
                        after: dict[str, Any]) -> dict[str, Any]:
        """An UPDATE that left a TOASTed value alone does not send it (REPLICA
        IDENTITY DEFAULT). Taken, exactly, from the old row (REPLICA IDENTITY
        FULL) or from this transaction's own earlier write of the row. Else, with
        ``unchanged_toast = "keep-current"`` and the key unchanged, left out: the
        update is a partial update and the node keeps the row's value, which is the
        value the source row had before this update (the connector applies the
        source's transactions in commit order). Otherwise (a key change: the new
        key's row in Retina is not the one that held the value; or "read-source")
        read from the source at commit (:meth:`_read_unchanged`)."""
        prior = open_tx.rows.get((relation.table, _key_of(relation, before)), {})
        filled = dict(after)
        for name in _unchanged(after):
            for source in (old, prior):
                value = source.get(name, UNCHANGED)
                if value is not UNCHANGED:
                    filled[name] = value
                    break
        if not _unchanged(filled):
            return filled
        if any(c.is_key and filled[c.name] is UNCHANGED for c in relation.columns) or \
                not any(c.is_key for c in relation.columns):
            raise SourceError(
                f"{relation.table}: UPDATE without the value of TOASTed column(s) "
                f"{_unchanged(filled)} and no replica identity key to read it by; "
                f"run ALTER TABLE {relation.table} REPLICA IDENTITY FULL")
        if self._keep_current and _key_of(relation, before) == _key_of(relation, filled):
            UNCHANGED_KEPT.inc(len(_unchanged(filled)))
            return {n: v for n, v in filled.items() if v is not UNCHANGED}
        open_tx.unresolved.append((len(open_tx.changes), relation))
        return filled

    def _commit(self, message: Commit) -> SourceTransaction | None:
        open_tx = self._transaction()
        self._open = None
        if message.end_lsn <= self._floor:
            return None  # delivered before the position we resumed after
        if not open_tx.changes:
            self._skip_empty(message.end_lsn)
            return None
        if open_tx.unresolved or self._schemas:
            # Both read the source next (unchanged TOAST values here, a new column's
            # facts in translate): what they read must include this transaction.
            self._wait_visible(open_tx.xid)
        if open_tx.unresolved:
            self._read_unchanged(open_tx)
        self._returned_lsn = message.end_lsn
        self._empty_lsn = 0  # the ack of this transaction covers skipped ones before it
        return SourceTransaction(
            position=format_lsn(message.end_lsn),
            source_txid=str(open_tx.xid),
            commit_time_ms=PG_EPOCH_MS + message.commit_time_us // 1000,
            changes=tuple(open_tx.changes), schemas=self._take_schemas())

    def _take_schemas(self) -> tuple[SourceSchema, ...]:
        schemas, self._schemas = tuple(self._schemas), []
        return schemas

    def _read_unchanged(self, open_tx: _OpenTransaction) -> None:
        """Fill the remaining unchanged TOAST values with the row as the source
        holds it now (the transaction visible: :meth:`_wait_visible`), read by its
        replica identity key.

        Exact for the final state: the value is read after this transaction
        committed. If nothing changed the row since, it is the value the row
        had at this update. If something did, a later transaction carries that
        change and is applied after this one. A row gone from the source was
        deleted by a later transaction (or got another key): this update
        becomes a delete of its keys, which that transaction does anyway."""
        by_table: dict[str, tuple[Relation, list[int]]] = {}
        for index, relation in open_tx.unresolved:
            by_table.setdefault(relation.table, (relation, []))[1].append(index)
        replaced: dict[int, list[RowChange]] = {}
        for relation, indexes in by_table.values():
            current = self._current_rows(relation, [open_tx.changes[i] for i in indexes])
            for i in indexes:
                change = open_tx.changes[i]
                assert change.after is not None and change.before is not None
                row = current.get(_key_of(relation, change.after))
                if row is not None:
                    after = {n: row[n] if v is UNCHANGED else v for n, v in change.after.items()}
                    replaced[i] = [RowChange(change.table, "update", change.before, after)]
                    continue
                log.info("cdc_toast_row_gone", table=relation.table, xid=open_tx.xid)
                keys = {c.name for c in relation.columns if c.is_key}
                new_key = {n: v for n, v in change.after.items() if n in keys}
                replaced[i] = [RowChange(change.table, "delete", new_key, None)]
                if _key_of(relation, change.before) != _key_of(relation, change.after):
                    replaced[i].insert(0, RowChange(change.table, "delete", change.before, None))
        open_tx.changes = [r for i, c in enumerate(open_tx.changes) for r in replaced.get(i, [c])]
        open_tx.unresolved = []

    def _lookup_connection(self) -> Any:
        if self._lookup is None:
            self._lookup = psycopg2.connect(replication_dsn(self._dsn), connect_timeout=10)
            self._lookup.autocommit = True
        return self._lookup

    def _wait_visible(self, xid: int) -> None:
        """Return once transaction ``xid`` is visible to new snapshots.

        PostgreSQL flushes a commit record, and logical decoding sends the
        Commit, before the committing backend leaves the running transactions;
        synchronous replication can hold that window open for as long as a
        standby is missing. A read in it sees the row as it was before the
        transaction, or not at all: a row that is not there wrongly turned an
        update into a delete (the fault campaign lost a key-changed row), and a
        column added in the transaction is not in the catalog yet (the campaign's
        connector stopped, exit 6, on its own ADD COLUMN). Visibility never goes
        back, so once a snapshot sees the transaction, every later statement does."""
        started, backoff, warned = time.monotonic(), Backoff(0.001, 0.1), False
        with self._lookup_connection().cursor() as cur:
            while True:
                # txid_current_snapshot, not pg_current_snapshot: the same text, and
                # servers before 13 have only this one.
                cur.execute("SELECT txid_current_snapshot()::text")
                if snapshot_sees(cur.fetchone()[0], xid):
                    return
                self._keep_alive()  # a long wait must not end the stream (wal_sender_timeout)
                if not warned and time.monotonic() - started >= VISIBILITY_WARN_S:
                    self._refuse_if_synchronous_standby(cur)
                    log.warning("cdc_waiting_for_commit_visibility", xid=xid,
                                reason="committed in WAL, not yet visible (synchronous "
                                       "replication waiting for a standby?)")
                    warned = True
                backoff.pause()  # the commit is durable, it will show

    def _refuse_if_synchronous_standby(self, cur: Any) -> None:
        """A commit that waits for this very connection (its walsender is a synchronous
        standby, e.g. ``synchronous_standby_names = '*'``) never becomes visible before
        we confirm it, and we confirm only after handing it out: stop, and say why."""
        cur.execute("SELECT r.sync_state FROM pg_stat_replication r JOIN "
                    "pg_replication_slots s ON s.active_pid = r.pid WHERE s.slot_name = %s",
                    (self._slot,))
        row = cur.fetchone()
        if row is not None and row[0] in ("sync", "quorum"):
            raise SourceError(
                f"the connector's replication connection (slot {self._slot}) is a "
                f"synchronous standby ({row[0]}): commits wait for it while it waits for "
                "them to become visible; leave it out of synchronous_standby_names "
                "(docs/cdc.md, 'What the slot is confirmed to')")

    def _current_rows(self, relation: Relation, changes: Sequence[RowChange]
                      ) -> dict[tuple[Any, ...], dict[str, Any]]:
        """The source's current rows of ``changes`` (by their new key), key and
        unchanged columns only, parsed like streamed values."""
        lookup = self._lookup_connection()
        key_cols = [c for c in relation.columns if c.is_key]
        wanted = sorted({n for c in changes if c.after for n in _unchanged(c.after)})
        columns = key_cols + [c for c in relation.columns
                              if c.name in wanted and not c.is_key]
        part = Relation(relation.oid, relation.namespace, relation.name,
                        relation.replica_identity, tuple(columns))
        key = sql.SQL(", ").join(sql.Identifier(c.name) for c in key_cols)
        one = sql.SQL("({})").format(sql.SQL(", ").join(sql.Placeholder() * len(key_cols)))
        pg_snapshot.read_as_text(lookup, [c.type_oid for c in columns])
        found: dict[tuple[Any, ...], dict[str, Any]] = {}
        wanted_keys = list(dict.fromkeys(_key_of(relation, c.after or {}) for c in changes))
        with lookup.cursor() as cur:
            for start in range(0, len(wanted_keys), 500):
                chunk = wanted_keys[start:start + 500]
                try:
                    cur.execute(sql.SQL("SELECT {} FROM {} WHERE ({}) IN ({})").format(
                        sql.SQL(", ").join(sql.Identifier(c.name) for c in columns),
                        sql.Identifier(relation.namespace, relation.name), key,
                        sql.SQL(", ").join([one] * len(chunk))),
                        [v for k in chunk for v in k])
                except VANISHED as exc:
                    raise vanished(self._dsn, relation, columns, exc,
                                   "reading unchanged TOAST values") from exc
                for raw in cur.fetchall():
                    row = decode_row(part, tuple(
                        ("n", None) if v is None else ("t", v.encode("utf-8")) for v in raw))
                    found[_key_of(part, row)] = row
        return found

    def _skip_empty(self, end_lsn: int) -> None:
        # Servers before 15 send Begin/Commit for transactions that touch no
        # published table. Nobody acks those, so confirm them ourselves once
        # everything handed out before them is acked, or WAL piles up.
        if self._acked_lsn >= self._returned_lsn:
            self._confirm(end_lsn)
        else:
            self._empty_lsn = end_lsn


def snapshot_sees(snapshot: str, xid: int) -> bool:
    """Whether a committed 32-bit ``xid`` is visible in ``snapshot``, the text of
    ``txid_current_snapshot()`` (``xmin:xmax:xip,...``, 64-bit transaction ids).

    ``xmax`` is one past the latest *completed* transaction: a transaction at or
    above it is still running for this snapshot, and is not in the ``xip`` list.
    The 64-bit id is the one nearest ``xmax`` (an xid is never 2^31 away)."""
    xmin_text, xmax_text, xip_text = snapshot.split(":")
    xmin, xmax = int(xmin_text), int(xmax_text)
    offset = (xid - xmax) % (1 << 32)
    full = xmax + (offset - (1 << 32) if offset >= 1 << 31 else offset)
    if full >= xmax:
        return False
    return full < xmin or str(full) not in xip_text.split(",")


def _quote_ident(name: str) -> str:
    # pgoutput splits publication_names as an identifier list: quote to keep case.
    return '"' + name.replace('"', '""') + '"'


