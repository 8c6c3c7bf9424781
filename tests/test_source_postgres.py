"""PostgresSource against a real PostgreSQL (wal_level=logical) and the pgoutput decoder."""

from __future__ import annotations

import itertools
import struct
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import closing
from dataclasses import dataclass, field
from datetime import UTC, date, datetime
from decimal import Decimal
from typing import Any

import psycopg2
import pytest

from cdc_client.source import SourceError, SourceTransaction
from cdc_client.sources.pgoutput import (
    FEEDBACK_INTERVAL_S,
    decode_message,
    format_lsn,
    parse_lsn,
)
from cdc_client.sources.postgres import PostgresSource, drop_slot, snapshot_sees
from devtools.cluster import PostgresInstance

from .support import eventually

pytestmark = pytest.mark.integration

SCHEMA = """
CREATE TABLE public.accounts (
    id int8 PRIMARY KEY, name text, balance numeric(12,2), active bool, born date,
    updated timestamptz, blob bytea, score float8, seen timestamp, tag varchar(8),
    n int4, small int2, ratio float4, code char(3), ref uuid);
CREATE TABLE public.notes (id int4 PRIMARY KEY, body text, flag int4);
CREATE TABLE public.unpublished (id int4 PRIMARY KEY);
"""
PUBLISHED = ["public.accounts", "public.notes"]


@dataclass
class SourceDb:
    """A fresh database, its replication slot, and the sources opened on it."""

    dsn: str
    slot: str
    publication: str = "retina_pub"
    sources: list[PostgresSource] = field(default_factory=list)

    def open(self, start_after: str | None = None, dsn: str | None = None,
             snapshot_mode: str = "never", chunk_rows: int = 5000,
             unchanged_toast: str = "keep-current") -> PostgresSource:
        # Streaming tests: no initial snapshot unless asked (tests/test_pg_snapshot.py).
        source = PostgresSource(dsn or self.dsn, slot=self.slot, publication=self.publication,
                                tables=PUBLISHED, start_after=start_after,
                                snapshot_mode=snapshot_mode, snapshot_chunk_rows=chunk_rows,
                                unchanged_toast=unchanged_toast)
        self.sources.append(source)
        return source

    def execute(self, *statements: str | tuple[str, tuple[Any, ...]]) -> str:
        """Run ``statements`` as one transaction; returns its 32-bit xid."""
        with closing(psycopg2.connect(self.dsn)) as conn, conn, conn.cursor() as cur:
            for statement in statements:
                query, args = statement if isinstance(statement, tuple) else (statement, ())
                cur.execute(query, args)
            cur.execute("SELECT pg_current_xact_id()::text::int8")
            return str(cur.fetchone()[0] % 2**32)

    def execute_autocommit(self, *statements: str) -> None:
        """Statements that cannot run in a transaction block (ALTER SYSTEM)."""
        with closing(psycopg2.connect(self.dsn)) as conn:
            conn.autocommit = True
            with conn.cursor() as cur:
                for statement in statements:
                    cur.execute(statement)

    def query(self, query: str, args: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
        with closing(psycopg2.connect(self.dsn)) as conn, conn, conn.cursor() as cur:
            cur.execute(query, args)
            return cur.fetchall()


@pytest.fixture
def db(pg_server: PostgresInstance) -> Iterator[SourceDb]:
    name = f"cdc_{uuid.uuid4().hex[:12]}"
    pg_server.create_database(name)
    source_db = SourceDb(pg_server.dsn(name), slot=f"slot_{uuid.uuid4().hex[:12]}")
    source_db.execute(SCHEMA)
    yield source_db
    # An active slot keeps the database from being dropped: close, then drop the slot.
    for source in source_db.sources:
        source.close()
    drop_slot(source_db.dsn, source_db.slot)
    pg_server.drop_database(name)


def collect(source: PostgresSource, count: int, timeout_s: float = 15) -> list[SourceTransaction]:
    """Poll until ``count`` transactions arrived; fail the test at the deadline."""
    deadline = time.monotonic() + timeout_s
    got: list[SourceTransaction] = []
    while len(got) < count:
        remaining = deadline - time.monotonic()
        assert remaining > 0, f"only {len(got)} of {count} transactions arrived: {got}"
        tx = source.poll(min(remaining, 1.0))
        if tx is not None:
            got.append(tx)
    return got


def assert_quiet(source: PostgresSource, for_s: float = 1.0) -> None:
    tx = source.poll(for_s)
    assert tx is None, f"unexpected transaction {tx}"


def keys(source: PostgresSource, txs: list[SourceTransaction]) -> list[tuple[Any, ...]]:
    return [source.position_key(t.position) for t in txs]


FULL_ROW = ("INSERT INTO accounts VALUES (1, 'Zoë', 1234.50, true, '1999-12-31', "
            "'2024-02-29 13:14:15.123456+01', '\\x00ff10'::bytea, 2.5, '2024-03-01 04:05:06.5', "
            "'v8', 7, -3, 0.25, 'ab', 'a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11')")


def test_multi_row_transaction_with_typed_values(db: SourceDb) -> None:
    source = db.open()
    before_ms = int(time.time() * 1000)
    xid = db.execute(FULL_ROW, "INSERT INTO accounts (id) VALUES (2)",
                     "INSERT INTO notes VALUES (10, 'hello', NULL)")
    [tx] = collect(source, 1)
    assert tx.source_txid == xid
    assert before_ms - 1000 <= tx.commit_time_ms <= int(time.time() * 1000) + 1000
    assert [(c.table, c.op, c.before) for c in tx.changes] == [
        ("public.accounts", "insert", None), ("public.accounts", "insert", None),
        ("public.notes", "insert", None)]
    full, nulls, note = (c.after for c in tx.changes)
    assert full == {
        "id": 1, "name": "Zoë", "balance": Decimal("1234.50"), "active": True,
        "born": date(1999, 12, 31),
        "updated": datetime(2024, 2, 29, 12, 14, 15, 123456, tzinfo=UTC),
        "blob": b"\x00\xff\x10", "score": 2.5,
        "seen": datetime(2024, 3, 1, 4, 5, 6, 500000, tzinfo=UTC),
        "tag": "v8", "n": 7, "small": -3, "ratio": 0.25, "code": "ab ",
        "ref": "a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11",
    }
    assert all(type(full[k]) is int for k in ("id", "n", "small"))
    assert nulls == {"id": 2, **{k: None for k in full if k != "id"}}
    assert note == {"id": 10, "body": "hello", "flag": None}
    assert_quiet(source, 0.5)


def test_update_key_change_and_delete(db: SourceDb) -> None:
    source = db.open()
    db.execute("INSERT INTO accounts (id, name, balance) VALUES (1, 'a', 1.00)")
    db.execute("UPDATE accounts SET name = 'b', balance = NULL WHERE id = 1")
    db.execute("UPDATE accounts SET id = 2 WHERE id = 1")
    db.execute("DELETE FROM accounts WHERE id = 2")
    insert, update, rekey, delete = collect(source, 4)

    assert keys(source, [insert, update, rekey, delete]) == sorted(
        set(keys(source, [insert, update, rekey, delete])))  # strictly increasing
    [change] = update.changes
    assert change.op == "update"
    assert change.before == {"id": 1}  # key unchanged: the key columns of the new row
    assert change.after["name"] == "b" and change.after["balance"] is None
    [change] = rekey.changes
    assert (change.op, change.before, change.after["id"]) == ("update", {"id": 1}, 2)
    assert change.after["name"] == "b"
    [change] = delete.changes
    assert (change.op, change.before, change.after) == ("delete", {"id": 2}, None)


def test_replica_identity_full_sends_old_rows(db: SourceDb) -> None:
    db.execute("ALTER TABLE notes REPLICA IDENTITY FULL",
               "INSERT INTO notes VALUES (1, 'x', NULL)")
    source = db.open()
    db.execute("UPDATE notes SET body = 'y' WHERE id = 1")
    db.execute("DELETE FROM notes WHERE id = 1")
    update, delete = collect(source, 2)
    assert update.changes[0].before == {"id": 1, "body": "x", "flag": None}
    assert update.changes[0].after == {"id": 1, "body": "y", "flag": None}
    assert delete.changes[0].before == {"id": 1, "body": "y"}  # nulls dropped


def test_unpublished_tables_produce_nothing(db: SourceDb) -> None:
    source = db.open()
    db.execute("INSERT INTO unpublished VALUES (1)")
    db.execute("INSERT INTO notes VALUES (1, 'n', 1)", "INSERT INTO unpublished VALUES (2)")
    [tx] = collect(source, 1)
    assert [c.table for c in tx.changes] == ["public.notes"]
    assert_quiet(source, 0.5)


def test_ack_then_resume_after_the_acked_position(db: SourceDb) -> None:
    source = db.open()
    for i in range(3):
        db.execute(f"INSERT INTO notes VALUES ({i}, 'n{i}', {i})")
    first, second, third = collect(source, 3)
    source.ack(first.position)
    eventually(lambda: confirmed_flush(db) >= parse_lsn(first.position), 10,
               "the slot to confirm the acked position")
    source.close()

    resumed = db.open(start_after=first.position)
    db.execute("INSERT INTO notes VALUES (3, 'n3', 3)")
    again = collect(resumed, 3)
    assert [t.position for t in again[:2]] == [second.position, third.position]
    assert [t.changes[0].after["id"] for t in again] == [1, 2, 3]
    assert keys(resumed, again) == sorted(set(keys(resumed, again)))
    assert_quiet(resumed, 0.5)

    # Acknowledged everything: a fresh start from the slot sends nothing old.
    resumed.ack(again[-1].position)
    eventually(lambda: confirmed_flush(db) >= parse_lsn(again[-1].position), 10,
               "the slot to confirm the last position")
    resumed.close()
    assert_quiet(db.open(), 1.0)


def confirmed_flush(db: SourceDb) -> int:
    [(lsn,)] = db.query("SELECT confirmed_flush_lsn::text FROM pg_replication_slots "
                        "WHERE slot_name = %s", (db.slot,))
    return parse_lsn(lsn)


def current_wal(db: SourceDb) -> int:
    [(lsn,)] = db.query("SELECT pg_current_wal_lsn()::text")
    return parse_lsn(lsn)


def test_read_ahead_is_never_confirmed_by_a_keepalive(db: SourceDb) -> None:
    """T2 begins first and writes a lot, T1 and T3 commit, then T2 commits.
    The connector has read T3 ahead but committed only T1; while T2 streams
    (its change LSNs lie below T1's commit), every acknowledgement of T1 asks
    the server for a keepalive. psycopg2 used to confirm such a keepalive's
    WAL end, past T3: the slot then skipped T3 after a restart (seed 1132)."""
    source = db.open()
    with closing(psycopg2.connect(db.dsn)) as long_conn, long_conn.cursor() as cur:
        cur.execute("INSERT INTO notes SELECT g, repeat('x', 200), g "
                    "FROM generate_series(1000, 40999) g")
        db.execute("INSERT INTO notes VALUES (1, 't1', 1)")
        db.execute("INSERT INTO notes VALUES (3, 't3', 3)")
        long_conn.commit()
    t1, t3 = collect(source, 2)
    deadline = time.monotonic() + 60
    t2 = None
    while t2 is None:  # read T2 a message or so at a time, acknowledging T1 in between
        assert time.monotonic() < deadline, "T2 did not arrive"
        source.ack(t1.position)
        t2 = source.poll(0.0)
    assert len(t2.changes) == 40_000
    source.ack(t1.position)
    assert_quiet(source, FEEDBACK_INTERVAL_S + 0.5)  # a periodic status update went out too
    assert confirmed_flush(db) == parse_lsn(t1.position)
    source.close()

    resumed = db.open(start_after=t1.position)
    again = collect(resumed, 2, 60)
    assert [t.position for t in again] == [t3.position, t2.position]
    assert again[0].changes[0].after == {"id": 3, "body": "t3", "flag": 3}


def test_keepalives_move_the_slot_past_other_tables_only_when_caught_up(db: SourceDb) -> None:
    """A source busy only with unpublished tables sends us nothing: the slot
    follows the keepalives' WAL end, so it does not keep that WAL forever,
    but never past a transaction read and not yet acknowledged."""
    source = db.open()
    db.execute("INSERT INTO notes VALUES (1, 'a', 1)")
    [tx] = collect(source, 1)
    for i in range(3):
        db.execute(f"INSERT INTO unpublished VALUES ({i})")
    assert_quiet(source, 2 * FEEDBACK_INTERVAL_S)  # keepalives come and go, unacked tx
    assert confirmed_flush(db) < parse_lsn(tx.position)

    source.ack(tx.position)
    for i in range(3, 6):
        db.execute(f"INSERT INTO unpublished VALUES ({i})")
    busy_elsewhere = current_wal(db)

    def slot_moved() -> bool:
        assert source.poll(0.2) is None
        return confirmed_flush(db) >= busy_elsewhere
    eventually(slot_moved, 30, "the slot to follow the keepalives past other tables' WAL")
    source.close()
    assert_quiet(db.open(start_after=tx.position), 1.0)


def test_start_after_skips_redelivered_transactions(db: SourceDb) -> None:
    source = db.open()
    db.execute("INSERT INTO notes VALUES (1, 'a', 1)")
    db.execute("INSERT INTO notes VALUES (2, 'b', 2)")
    _first, second = collect(source, 2)
    source.close()  # never acked: the slot would send both again
    resumed = db.open(start_after=second.position)
    db.execute("INSERT INTO notes VALUES (3, 'c', 3)")
    [tx] = collect(resumed, 1)
    assert tx.changes[0].after["id"] == 3
    assert resumed.position_key(tx.position) > resumed.position_key(second.position)


def test_truncate_of_several_tables_then_inserts(db: SourceDb) -> None:
    source = db.open()
    db.execute("INSERT INTO notes VALUES (1, 'a', 1)", "TRUNCATE notes, accounts",
               "INSERT INTO notes VALUES (2, 'b', 2)")
    [tx] = collect(source, 1)
    assert [(c.table, c.op) for c in tx.changes] == [
        ("public.notes", "insert"), ("public.notes", "truncate"),
        ("public.accounts", "truncate"), ("public.notes", "insert")]
    assert tx.changes[-1].after == {"id": 2, "body": "b", "flag": 2}


# Random hex does not compress below the TOAST threshold; EXTERNAL storage keeps
# it out of line uncompressed anyway: an UPDATE that leaves it alone sends 'u'.
BIG = "SELECT string_agg(md5(random()::text), '') FROM generate_series(1, 3200)"  # 100 kB


def big_text(db: SourceDb) -> str:
    db.execute("ALTER TABLE notes ALTER COLUMN body SET STORAGE EXTERNAL")
    [(text,)] = db.query(BIG)
    return text


def test_unchanged_toast_value_is_left_out_when_the_key_stays(db: SourceDb) -> None:
    """keep-current (the default): an update that keeps its key and leaves a TOASTed
    value alone lacks that column (a partial update: the node keeps the row's value),
    and nothing is read from the source. A key change still reads it: the new key's row
    is not the one that held the value."""
    text = big_text(db)
    db.execute(("INSERT INTO notes VALUES (1, %s, 0), (2, %s, 0)", (text, text[::-1])))
    source = db.open()
    db.execute("UPDATE notes SET flag = 1 WHERE id = 1")
    db.execute("UPDATE notes SET flag = 2 WHERE id = 2", "UPDATE notes SET id = 3 WHERE id = 2")
    db.execute("UPDATE notes SET flag = 4 WHERE id = 1", "DELETE FROM notes WHERE id = 1")
    first, second, third = collect(source, 3)
    assert [(c.op, c.before, c.after, c.partial) for c in first.changes] == \
        [("update", {"id": 1}, {"id": 1, "flag": 1}, True)]
    assert [(c.op, c.before) for c in second.changes] == [("update", {"id": 2}),
                                                          ("update", {"id": 2})]
    assert second.changes[0].after == {"id": 2, "flag": 2}
    assert second.changes[1].after == {"id": 3, "body": text[::-1], "flag": 2}
    # A later delete of the row changes nothing: the update is not read, only left out.
    assert [(c.op, c.after) for c in third.changes] == [("update", {"id": 1, "flag": 4}),
                                                        ("delete", None)]


def test_unchanged_toast_value_is_read_from_the_source(db: SourceDb) -> None:
    text = big_text(db)
    db.execute(("INSERT INTO notes VALUES (1, %s, 0), (2, %s, 0)", (text, text[::-1])))
    source = db.open(unchanged_toast="read-source")
    db.execute("UPDATE notes SET flag = 1 WHERE id = 1")
    db.execute("UPDATE notes SET flag = 2 WHERE id = 2", "UPDATE notes SET id = 3 WHERE id = 2")
    first, second = collect(source, 2)
    [change] = first.changes
    assert change.after == {"id": 1, "body": text, "flag": 1}
    # Row 2 is row 3 by the time the source is read: the first update becomes a
    # delete of key 2, which the key change does anyway.
    assert [(c.op, c.before) for c in second.changes] == [("delete", {"id": 2}),
                                                          ("update", {"id": 2})]
    assert second.changes[1].after == {"id": 3, "body": text[::-1], "flag": 2}


def test_unchanged_toast_value_within_its_transaction_and_of_a_deleted_row(db: SourceDb
                                                                         ) -> None:
    text = big_text(db)
    source = db.open(unchanged_toast="read-source")
    # The insert in the same transaction holds the value.
    db.execute(("INSERT INTO notes VALUES (1, %s, 0)", (text,)),
               "UPDATE notes SET flag = 1 WHERE id = 1")
    # Deleted before the source reads it: the update becomes a delete of its key.
    db.execute("UPDATE notes SET flag = 2 WHERE id = 1")
    db.execute("DELETE FROM notes WHERE id = 1")
    inserted, updated, deleted = collect(source, 3)
    assert [c.after for c in inserted.changes] == [{"id": 1, "body": text, "flag": 0},
                                                   {"id": 1, "body": text, "flag": 1}]
    assert [(c.op, c.before) for c in updated.changes] == [("delete", {"id": 1})]
    assert [(c.op, c.before) for c in deleted.changes] == [("delete", {"id": 1})]


def test_a_terminated_walsender_ends_the_stream_with_the_servers_reason(db: SourceDb) -> None:
    """The connector exits 1 on a lost source connection and resumes from its committed
    position; what it logs says why the server ended the stream."""
    source = db.open()
    assert source.poll(0.2) is None  # streaming
    [(pid,)] = db.query("SELECT active_pid FROM pg_replication_slots WHERE slot_name = %s",
                        (db.slot,))
    db.query("SELECT pg_terminate_backend(%s)", (pid,))
    with pytest.raises(psycopg2.OperationalError, match="terminating connection"):
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            source.poll(0.2)


PROBE_IDS = itertools.count(-1, -1)  # keys of the probes' rows, never published


class HeldCommit:
    """One transaction whose commit synchronous replication holds: flushed and decoded,
    not yet visible to other sessions, while the standby named in
    ``synchronous_standby_names`` does not answer (``nosuch``: it does not exist;
    ``*``: any walsender, the connector's own included)."""

    def __init__(self, db: SourceDb, standbys: str, *statements: str) -> None:
        self.db, self.statements = db, statements
        self.pid: list[int] = []
        db.execute_autocommit(f"ALTER SYSTEM SET synchronous_standby_names = '{standbys}'",
                              "SELECT pg_reload_conf()")
        self._wait_until_commits_wait()
        self.thread = threading.Thread(target=self._commit, args=(statements, self.pid))
        self.thread.start()
        self._wait_for_sync_rep(self.pid, 10, "the commit to wait for the standby")

    def _commit(self, statements: tuple[str, ...], pid: list[int]) -> None:
        with closing(psycopg2.connect(self.db.dsn)) as conn, conn.cursor() as cur:
            cur.execute("SELECT pg_backend_pid()")
            pid.append(cur.fetchone()[0])
            cur.execute("SET synchronous_commit = on")  # the test server runs with it off
            for statement in statements:
                cur.execute(statement)
            conn.commit()

    def _wait_for_sync_rep(self, pid: list[int], timeout_s: float, what: str) -> None:
        eventually(lambda: bool(pid) and self.db.query(
            "SELECT wait_event FROM pg_stat_activity WHERE pid = %s", (pid[0],)
        ) == [("SyncRep",)], timeout_s, what)

    def _wait_until_commits_wait(self) -> None:
        """Commits wait once the server has taken the reloaded setting everywhere (a
        shared flag the checkpointer sets): probe with a commit of a write to a table
        the publication leaves out until one waits, then cancel its wait."""
        deadline = time.monotonic() + 20
        while True:
            assert time.monotonic() < deadline, "commits never waited for the standby"
            probe: list[int] = []
            write = f"INSERT INTO unpublished VALUES ({next(PROBE_IDS)})"
            thread = threading.Thread(target=self._commit, args=((write,), probe))
            thread.start()
            try:
                self._wait_for_sync_rep(probe, 1, "a probe commit to wait")
            except AssertionError:
                thread.join(10)
                continue  # committed without waiting: not taken yet
            self.db.execute_autocommit(f"SELECT pg_cancel_backend({probe[0]})")
            thread.join(10)
            return

    def release(self) -> None:
        self.db.execute_autocommit("ALTER SYSTEM RESET synchronous_standby_names",
                                   "SELECT pg_reload_conf()")
        self.thread.join(10)


def collect_held(db: SourceDb, source: PostgresSource, *statements: str
                 ) -> tuple[SourceTransaction, dict[str, Any]]:
    """Run ``statements`` as a :class:`HeldCommit`, released after a second. Returns the
    source's transaction and its schemas' facts as read the moment it was handed out
    (the connector's translate reads them then)."""
    held = HeldCommit(db, "nosuch", *statements)
    release = threading.Timer(1.0, held.release)
    try:
        release.start()
        [tx] = collect(source, 1)  # comes once the commit is visible
        return tx, {schema.table: schema.facts() for schema in tx.schemas}
    finally:
        release.cancel()
        held.release()


def test_unchanged_toast_value_is_read_once_the_commit_is_visible(db: SourceDb) -> None:
    """Logical decoding sends a Commit before the transaction is visible to other
    sessions. A key change keeping its TOASTed value read in that window found no row
    and became two deletes (the fault campaign lost the row this way)."""
    text = big_text(db)
    db.execute(("INSERT INTO notes VALUES (51, %s, 0)", (text,)))
    source = db.open()  # the slot starts after the insert
    tx, _facts = collect_held(db, source, "UPDATE notes SET id = 2324 WHERE id = 51")
    assert [(c.op, c.before) for c in tx.changes] == [("update", {"id": 51})]
    assert tx.changes[0].after == {"id": 2324, "body": text, "flag": 0}


def test_a_column_added_in_the_transaction_is_in_the_source_facts(db: SourceDb) -> None:
    """The new column's facts are read from the source's catalog after the Commit; read
    before the transaction is visible, the column is not there yet (the campaign's
    connector stopped with exit 6 on its own ADD COLUMN)."""
    source = db.open()
    tx, facts = collect_held(db, source, "ALTER TABLE notes ADD COLUMN extra int4",
                             "INSERT INTO notes VALUES (1, 'a', 1, 7)")
    assert tx.changes[0].after == {"id": 1, "body": "a", "flag": 1, "extra": 7}
    assert "extra" in facts["public.notes"]


def test_a_connector_that_is_a_synchronous_standby_stops_with_the_reason(db: SourceDb
                                                                          ) -> None:
    """synchronous_standby_names = '*' makes the connector's own walsender a synchronous
    standby: a commit waits for the connector to confirm it, and the connector waits
    for it to become visible. The source says so and stops, instead of hanging."""
    source = db.open()
    db.execute("INSERT INTO notes VALUES (1, 'a', 1)")
    [first] = collect(source, 1)
    source.ack(first.position)  # a confirmed flush makes the walsender a candidate
    eventually(lambda: db.query("SELECT sync_state FROM pg_stat_replication") == [("async",)],
               10, "the walsender to report its state")
    held = HeldCommit(db, "*", "ALTER TABLE notes ADD COLUMN extra int4",
                      "INSERT INTO notes VALUES (2, 'b', 2, 7)")
    outcome: list[BaseException] = []

    def poll() -> None:  # on a thread: a regression would hang here, not fail
        try:
            collect(source, 1, timeout_s=30)
        except BaseException as exc:  # handed to the test thread
            outcome.append(exc)

    poller = threading.Thread(target=poll, daemon=True)
    try:
        poller.start()
        poller.join(40)
        assert not poller.is_alive(), "the source hung waiting for its own confirmation"
    finally:
        held.release()
    [error] = outcome
    assert isinstance(error, SourceError) and "synchronous standby" in str(error), error


@pytest.mark.parametrize(("snapshot", "xid", "sees"), [
    ("100:105:101,103", 99, True), ("100:105:101,103", 101, False),
    ("100:105:101,103", 102, True), ("100:105:", 104, True),
    # At or above xmax: not completed when the snapshot was taken.
    ("100:105:", 105, False), ("105:105:", 107, False),
    # 64-bit ids: the 32-bit xid belongs to xmax's epoch, or to the one before.
    (f"{2**32 + 5}:{2**32 + 9}:{2**32 + 7}", 7, False),
    (f"{2**32 + 5}:{2**32 + 9}:", 7, True),
    (f"{2**32 - 10}:{2**32 + 9}:{2**32 - 3}", 2**32 - 3, False),
    (f"{2**32 - 10}:{2**32 + 9}:{2**32 - 3}", 2**32 - 4, True),
    (f"{2**32 - 10}:{2**32 - 5}:", 3, False),  # the next epoch: after xmax
])
def test_snapshot_sees(snapshot: str, xid: int, sees: bool) -> None:
    assert snapshot_sees(snapshot, xid) is sees


def test_unchanged_toast_value_with_replica_identity_full(db: SourceDb) -> None:
    text = big_text(db)
    db.execute("ALTER TABLE notes REPLICA IDENTITY FULL",
               ("INSERT INTO notes VALUES (1, %s, 0)", (text,)))
    source = db.open()
    db.execute("UPDATE notes SET flag = 1 WHERE id = 1")
    [tx] = collect(source, 1)
    assert tx.changes[0].after == {"id": 1, "body": text, "flag": 1}


def test_feedback_keeps_a_short_wal_sender_timeout_alive(db: SourceDb) -> None:
    source = db.open(dsn=f"{db.dsn} options='-c wal_sender_timeout=1000'")
    idle_until = time.monotonic() + 3.5  # several timeouts of an idle stream
    while time.monotonic() < idle_until:
        assert source.poll(idle_until - time.monotonic()) is None
    db.execute("INSERT INTO notes VALUES (1, 'still here', 1)")
    [tx] = collect(source, 1)
    assert tx.changes[0].after["body"] == "still here"


# --- pure decoding ---
def test_lsn_format_round_trip() -> None:
    for lsn in (0, 1, 0x16B3748, (0xAB << 32) | 0x1, 2**64 - 1):
        assert parse_lsn(format_lsn(lsn)) == lsn
    assert format_lsn((0x1 << 32) | 0x16B3748) == "1/16B3748"
    with pytest.raises(SourceError):
        parse_lsn("nonsense")


@pytest.mark.parametrize("payload, what", [
    (b"", "empty"),
    (b"Z\x00", "unknown pgoutput message type 'Z'"),
    (b"B\x00\x00", "truncated"),
    (b"R" + struct.pack(">I", 5) + b"public", "not terminated"),
    (b"I" + struct.pack(">I", 5) + b"N" + struct.pack(">h", 1) + b"b", "column kind 'b'"),
])
def test_malformed_messages(payload: bytes, what: str) -> None:
    with pytest.raises(SourceError, match=what):
        decode_message(payload)


def test_decode_insert_and_update_messages() -> None:
    insert = decode_message(b"I" + struct.pack(">I", 5) + b"N" + struct.pack(">h", 2)
                            + b"n" + b"t" + struct.pack(">i", 2) + b"42")
    assert (insert.relation_oid, insert.new) == (5, (("n", None), ("t", b"42")))
    key = b"K" + struct.pack(">h", 1) + b"t" + struct.pack(">i", 1) + b"1"
    new = b"N" + struct.pack(">h", 1) + b"t" + struct.pack(">i", 1) + b"2"
    update = decode_message(b"U" + struct.pack(">I", 5) + key + new)
    assert (update.old_kind, update.old, update.new) == ("K", (("t", b"1"),), (("t", b"2"),))
