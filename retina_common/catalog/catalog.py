"""The catalog on PostgreSQL: schemas, tables, columns, paths and FILES.

Rules enforced here (specification sections 2, C00.1, C00.5, C01):

* every write reports success by returning its result and raises on any
  failure; a publish barrier can rely on "returned" meaning "committed";
* ``cleanupAt`` is set iff the type is RETIRED (checked here before SQL, and
  by a CHECK constraint for anything that bypasses this layer);
* :meth:`Catalog.get_files_by_type` is the single SQL enumeration entry
  point; every other listing is built on it;
* :meth:`Catalog.atomic_swap_files` is one database transaction with row
  locks taken in file-id order, so two concurrent swaps over the same files
  have exactly one winner.

A broken connection during COMMIT raises :class:`CatalogOutcomeUnknown`;
anything that fails before COMMIT raises an error meaning "nothing changed".
"""

from __future__ import annotations

import select
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, TypeVar

import psycopg2
import psycopg2.errors
import psycopg2.extensions
import psycopg2.pool

from retina_common import file_names
from retina_common.catalog import schema as catalog_schema
from retina_common.catalog.errors import (
    AlreadyExists,
    CatalogError,
    CatalogOutcomeUnknown,
    CatalogUnavailable,
    ConstraintViolation,
    FileTypeMismatch,
    InvalidCatalogArgument,
    NotFound,
    SwapPrecondition,
    SwapPreconditionFailed,
)
from retina_common.catalog.model import (
    ColumnRecord,
    ColumnSpec,
    FileRecord,
    FileType,
    PathRecord,
    SchemaRecord,
    SwapResult,
    TableRecord,
    check_cleanup_at,
    check_column_type,
    check_name,
)
from retina_common.failpoints import (
    CATALOG_ADD_COLUMN_COMMIT_AFTER,
    CATALOG_ADD_COLUMN_COMMIT_BEFORE,
    CATALOG_ADD_FILE_COMMIT_AFTER,
    CATALOG_ADD_FILE_COMMIT_BEFORE,
    CATALOG_DELETE_FILES_COMMIT_AFTER,
    CATALOG_DELETE_FILES_COMMIT_BEFORE,
    CATALOG_REVERT_SWAP_COMMIT_AFTER,
    CATALOG_REVERT_SWAP_COMMIT_BEFORE,
    CATALOG_SWAP_COMMIT_AFTER,
    CATALOG_SWAP_COMMIT_BEFORE,
    CATALOG_UPDATE_FILE_COMMIT_AFTER,
    CATALOG_UPDATE_FILE_COMMIT_BEFORE,
    Failpoint,
    FailpointTriggered,
)
from retina_common.log import get_logger

log = get_logger(component="catalog")
T = TypeVar("T")

_FILE_COLUMNS = "file_id, name, type, num_row_group, path_id, min_row_id, max_row_id, cleanup_at"
_UNSET: Any = object()


def _file(row: Sequence[Any]) -> FileRecord:
    return FileRecord(file_id=row[0], name=row[1], type=FileType(row[2]), num_row_group=row[3],
                      path_id=row[4], min_row_id=row[5], max_row_id=row[6], cleanup_at=row[7])


def _table_in(cur: Any, schema_name: str, name: str, *, lock: bool = False) -> TableRecord:
    """One table with its columns, read with ``cur``; ``lock`` holds its row until commit
    (concurrent schema changes of one table serialise)."""
    cur.execute("SELECT t.table_id, t.schema_id, t.primary_index_id, t.schema_version "
                "FROM tables t JOIN schemas s ON s.schema_id = t.schema_id "
                "WHERE s.name = %s AND t.name = %s" + (" FOR UPDATE OF t" if lock else ""),
                (schema_name, name))
    row = cur.fetchone()
    if row is None:
        raise NotFound(f"table {schema_name}.{name} does not exist")
    cur.execute("SELECT column_id, name, type, ordinal, pk_position, since_version, nullable "
                "FROM columns WHERE table_id = %s ORDER BY ordinal", (row[0],))
    columns = tuple(ColumnRecord(*c) for c in cur.fetchall())
    return TableRecord(table_id=row[0], schema_id=row[1], schema_name=schema_name, name=name,
                       primary_index_id=row[2], columns=columns, schema_version=row[3])


def _now_ms() -> int:
    return int(time.time() * 1000)


# Idle connections a Catalog keeps for reuse. psycopg2's pools keep at most ``minconn``
# idle (closing every other one they are given back): with 0, every catalog call paid a
# new PostgreSQL connection and backend, ~2.5 ms against ~0.1 ms for the call itself.
KEEP_IDLE = 2
# A connection idle longer than this is also asked SELECT 1 before it is handed out (its
# socket is looked at every time): one that went stale is replaced, not failed on first use.
REVALIDATE_AFTER_S = 1.0


# TCP keepalives: a pooled connection to a host that vanished (a partition, a frozen
# server) fails within about a minute instead of hanging its next call.
_KEEPALIVES = {"keepalives": 1, "keepalives_idle": 30, "keepalives_interval": 10,
               "keepalives_count": 3}


class _Connection(psycopg2.extensions.connection):
    """A pooled connection that remembers since when it has been idle (opened, or last
    given back)."""

    def __init__(self, dsn: str, *args: Any, **kwargs: Any) -> None:
        super().__init__(dsn, *args, **kwargs)
        self.idle_since = time.monotonic()


def _usable(conn: _Connection) -> bool:
    """Whether a pooled connection can be handed out. An idle connection has nothing to
    read: a readable socket means the server closed it or sent an error (a restart, an
    idle timeout), checked at no cost on every checkout; one idle for a while is also
    asked SELECT 1."""
    try:
        closed_by_server = bool(select.select([conn.fileno()], [], [], 0)[0])
    except (OSError, ValueError, psycopg2.Error):
        return False
    if not closed_by_server and time.monotonic() - conn.idle_since <= REVALIDATE_AFTER_S:
        return True
    return _alive(conn)


def _alive(conn: _Connection) -> bool:
    try:
        with conn.cursor() as cur:
            cur.execute("SELECT 1")
        conn.rollback()
        return True
    except psycopg2.Error:
        return False


class Catalog:
    """Thread-safe catalog client over a small psycopg2 connection pool."""

    def __init__(self, dsn: str, *, pool_max: int = 8, connect_timeout_s: int = 5) -> None:
        self._dsn = dsn
        self._connect_timeout_s = connect_timeout_s
        self._pool_max = pool_max
        self._pool: psycopg2.pool.ThreadedConnectionPool | None = None
        self._pool_lock = threading.Lock()

    # --- connection handling ---------------------------------------------------
    def _get_pool(self) -> psycopg2.pool.ThreadedConnectionPool:
        with self._pool_lock:
            if self._pool is None:
                try:
                    self._pool = psycopg2.pool.ThreadedConnectionPool(
                        min(KEEP_IDLE, self._pool_max), self._pool_max, self._dsn,
                        connect_timeout=self._connect_timeout_s,
                        connection_factory=_Connection, **_KEEPALIVES)
                except psycopg2.Error as exc:
                    raise CatalogUnavailable(f"cannot reach the catalog: {exc}") from exc
            return self._pool

    @contextmanager
    def _connection(self) -> Iterator[Any]:
        pool = self._get_pool()
        conn = self._checkout(pool)
        broken = False
        try:
            yield conn
        except (psycopg2.OperationalError, psycopg2.InterfaceError, CatalogOutcomeUnknown):
            broken = True
            raise
        finally:
            if not broken and conn.closed == 0 and \
                    conn.get_transaction_status() != psycopg2.extensions.TRANSACTION_STATUS_IDLE:
                try:
                    conn.rollback()
                except psycopg2.Error:
                    broken = True  # never back into the pool; the original error stands
            conn.idle_since = time.monotonic()
            pool.putconn(conn, close=broken or conn.closed != 0)

    @staticmethod
    def _checkout(pool: psycopg2.pool.ThreadedConnectionPool) -> _Connection:
        """A connection from the pool, checked first (``_usable``), a dead one dropped.
        After a PostgreSQL restart every idle one is dead: at most KEEP_IDLE are dropped
        before the pool opens a new one."""
        try:
            for _ in range(KEEP_IDLE + 1):
                conn = pool.getconn()
                if _usable(conn):
                    return conn
                pool.putconn(conn, close=True)
            return pool.getconn()
        except psycopg2.pool.PoolError as exc:
            raise CatalogUnavailable(f"catalog connection pool exhausted: {exc}") from exc
        except psycopg2.Error as exc:
            raise CatalogUnavailable(f"cannot reach the catalog: {exc}") from exc

    def _transaction(self, body: Callable[[Any], T], *, before_commit: Failpoint | None = None,
                     after_commit: Failpoint | None = None) -> T:
        """Run ``body(cursor)`` in one transaction and commit.

        Errors before COMMIT roll back (nothing changed); a connection lost
        during COMMIT is an unknown outcome.
        """
        with self._connection() as conn:
            try:
                with conn.cursor() as cur:
                    result = body(cur)
                if before_commit is not None:
                    before_commit.hit()
            except CatalogError:
                conn.rollback()
                raise
            except psycopg2.Error as exc:
                if conn.closed == 0:
                    conn.rollback()
                raise _translate(exc) from exc
            try:
                conn.commit()
            except (psycopg2.OperationalError, psycopg2.InterfaceError) as exc:
                raise CatalogOutcomeUnknown(f"connection lost during COMMIT: {exc}") from exc
            except psycopg2.Error as exc:  # deferred constraint / serialization at commit
                raise _translate(exc) from exc
            if after_commit is not None:
                try:
                    after_commit.hit()
                except FailpointTriggered as exc:  # committed, but the caller hears nothing
                    raise CatalogOutcomeUnknown(f"injected after COMMIT: {exc}") from exc
            return result

    def _read(self, body: Callable[[Any], T]) -> T:
        with self._connection() as conn:
            try:
                with conn.cursor() as cur:
                    return body(cur)
            except psycopg2.Error as exc:
                raise _translate(exc) from exc
            finally:
                if conn.closed == 0:
                    conn.rollback()

    def bootstrap(self) -> int:
        """Create or upgrade the catalog schema; see :mod:`retina_common.catalog.schema`."""
        with self._connection() as conn:
            try:
                return catalog_schema.bootstrap(conn)
            except psycopg2.Error as exc:
                if conn.closed == 0:
                    conn.rollback()
                raise _translate(exc) from exc

    def close(self) -> None:
        with self._pool_lock:
            if self._pool is not None:
                self._pool.closeall()
                self._pool = None

    # --- schemas, tables, columns, paths ------------------------------------------
    def create_schema(self, name: str) -> SchemaRecord:
        check_name("schema", name)

        def body(cur: Any) -> SchemaRecord:
            cur.execute("INSERT INTO schemas (name) VALUES (%s) RETURNING schema_id", (name,))
            return SchemaRecord(cur.fetchone()[0], name)

        return self._transaction(body)

    def create_table(self, schema_name: str, name: str, columns: Sequence[ColumnSpec],
                     primary_key: Sequence[str]) -> TableRecord:
        """Create a table with its columns; a primary index id is allocated for it. A
        column is stored NOT NULL if its spec says so or it is part of the primary key."""
        check_name("table", name)
        if not columns:
            raise InvalidCatalogArgument("a table needs at least one column")
        names = [check_name("column", c.name) for c in columns]
        if len(set(names)) != len(names):
            raise InvalidCatalogArgument("duplicate column name")
        types = [check_column_type(c.type) for c in columns]
        if not primary_key:
            raise InvalidCatalogArgument("a table needs a primary key")
        if len(set(primary_key)) != len(primary_key) or not set(primary_key) <= set(names):
            raise InvalidCatalogArgument(
                f"primary key {list(primary_key)} must name distinct columns")

        def body(cur: Any) -> int:
            cur.execute("SELECT schema_id FROM schemas WHERE name = %s", (schema_name,))
            row = cur.fetchone()
            if row is None:
                raise NotFound(f"schema {schema_name!r} does not exist")
            cur.execute("INSERT INTO tables (schema_id, name) VALUES (%s, %s) RETURNING table_id",
                        (row[0], name))
            table_id = cur.fetchone()[0]
            for ordinal, (spec, col_type) in enumerate(zip(columns, types, strict=True)):
                col = spec.name
                pk_position = primary_key.index(col) if col in primary_key else None
                cur.execute("INSERT INTO columns (table_id, name, type, ordinal, pk_position, "
                            "nullable) VALUES (%s, %s, %s, %s, %s, %s)",
                            (table_id, col, col_type, ordinal, pk_position,
                             spec.nullable and pk_position is None))
            return table_id

        self._transaction(body)
        return self.get_table(schema_name, name)

    def get_table(self, schema_name: str, name: str) -> TableRecord:
        def body(cur: Any) -> TableRecord:
            return _table_in(cur, schema_name, name)

        return self._read(body)

    def add_column(self, schema_name: str, table_name: str, column: str, type_name: str, *,
                   nullable: bool = True) -> TableRecord:
        """Schema evolution: append a nullable column and bump the table's schema version.

        Idempotent: a column of that name and type already there changes nothing (a
        connector retrying after a lost COMMIT, or restarted after the change). Refused
        with nothing changed: a NOT NULL column (rows written before it have no value),
        a bad name or type, and a column of that name with another type. Rows encoded
        for an older schema version stay valid; the added column reads NULL in them.
        """
        check_name("column", column)
        col_type = check_column_type(type_name)
        if not nullable:
            raise InvalidCatalogArgument(
                f"{schema_name}.{table_name}.{column}: only a nullable column can be added "
                "(rows written before it have no value for it)")

        def body(cur: Any) -> TableRecord:
            table = _table_in(cur, schema_name, table_name, lock=True)
            existing = next((c for c in table.columns if c.name == column), None)
            if existing is not None:
                if existing.type != col_type:
                    raise AlreadyExists(
                        f"{schema_name}.{table_name} already has a column {column} of type "
                        f"{existing.type}, not {col_type}")
                return table
            version = table.schema_version + 1
            ordinal = max(c.ordinal for c in table.columns) + 1
            cur.execute("INSERT INTO columns (table_id, name, type, ordinal, pk_position, "
                        "since_version) VALUES (%s, %s, %s, %s, NULL, %s)",
                        (table.table_id, column, col_type, ordinal, version))
            cur.execute("UPDATE tables SET schema_version = %s WHERE table_id = %s",
                        (version, table.table_id))
            return _table_in(cur, schema_name, table_name)

        # No log line here: the CLI prints JSON on stdout; callers log (cdc_schema_column_added).
        return self._transaction(body, before_commit=CATALOG_ADD_COLUMN_COMMIT_BEFORE,
                                 after_commit=CATALOG_ADD_COLUMN_COMMIT_AFTER)

    def list_tables(self, schema_name: str) -> list[str]:
        def body(cur: Any) -> list[str]:
            cur.execute("SELECT t.name FROM tables t JOIN schemas s ON s.schema_id = t.schema_id "
                        "WHERE s.name = %s ORDER BY t.name", (schema_name,))
            return [r[0] for r in cur.fetchall()]

        return self._read(body)

    def list_schemas(self) -> list[str]:
        def body(cur: Any) -> list[str]:
            cur.execute("SELECT name FROM schemas ORDER BY name")
            return [r[0] for r in cur.fetchall()]

        return self._read(body)

    def add_path(self, table_id: int, uri: str) -> PathRecord:
        if not uri:
            raise InvalidCatalogArgument("a path needs a URI")

        def body(cur: Any) -> PathRecord:
            cur.execute("INSERT INTO paths (table_id, uri) VALUES (%s, %s) RETURNING path_id",
                        (table_id, uri))
            return PathRecord(cur.fetchone()[0], table_id, uri)

        return self._transaction(body)

    def get_paths(self, table_id: int) -> list[PathRecord]:
        def body(cur: Any) -> list[PathRecord]:
            cur.execute("SELECT path_id, table_id, uri FROM paths WHERE table_id = %s "
                        "ORDER BY path_id", (table_id,))
            return [PathRecord(*r) for r in cur.fetchall()]

        return self._read(body)


    def list_paths(self) -> list[PathRecord]:
        """Every path of every table (start-up and admin tools)."""

        def body(cur: Any) -> list[PathRecord]:
            cur.execute("SELECT path_id, table_id, uri FROM paths ORDER BY path_id")
            return [PathRecord(*r) for r in cur.fetchall()]

        return self._read(body)

    # --- FILES: writes ------------------------------------------------------------
    def add_file(self, name: str, file_type: FileType, num_row_group: int, path_id: int,
                 min_row_id: int | None = None, max_row_id: int | None = None,
                 cleanup_at: int | None = None) -> FileRecord:
        """Insert one file row; returns it as committed."""
        file_type = FileType(file_type)
        check_cleanup_at(file_type, cleanup_at)
        _check_hull(file_type, min_row_id, max_row_id)
        if not name or "/" in name:
            raise InvalidCatalogArgument(f"bad file name {name!r}")
        if num_row_group < 0:
            raise InvalidCatalogArgument("num_row_group must not be negative")

        def body(cur: Any) -> FileRecord:
            cur.execute(
                f"INSERT INTO files (name, type, num_row_group, path_id, min_row_id, max_row_id, "
                f"cleanup_at) VALUES (%s, %s, %s, %s, %s, %s, %s) RETURNING {_FILE_COLUMNS}",
                (name, int(file_type), num_row_group, path_id, min_row_id, max_row_id, cleanup_at))
            return _file(cur.fetchone())

        return self._transaction(body, before_commit=CATALOG_ADD_FILE_COMMIT_BEFORE,
                                 after_commit=CATALOG_ADD_FILE_COMMIT_AFTER)

    def update_file(self, file_id: int, *, file_type: FileType = _UNSET,
                    num_row_group: int = _UNSET, min_row_id: int | None = _UNSET,
                    max_row_id: int | None = _UNSET, cleanup_at: int | None = _UNSET,
                    expected_type: FileType | None = None) -> FileRecord:
        """Change some fields of one file in one transaction; returns the committed row.

        ``expected_type`` guards the change: if the file is in another type
        (e.g. a concurrent retire), :class:`FileTypeMismatch` is raised and
        nothing changes. The resulting row is checked against the
        cleanupAt and row-id-hull rules before it is written.
        """

        def body(cur: Any) -> FileRecord:
            cur.execute(f"SELECT {_FILE_COLUMNS} FROM files WHERE file_id = %s FOR UPDATE",
                        (file_id,))
            row = cur.fetchone()
            if row is None:
                raise NotFound(f"file {file_id} does not exist")
            current = _file(row)
            if expected_type is not None and current.type != expected_type:
                raise FileTypeMismatch(file_id, FileType(expected_type).name, current.type.name)
            new_type = current.type if file_type is _UNSET else FileType(file_type)
            new = FileRecord(
                file_id=file_id, name=current.name, type=new_type,
                num_row_group=current.num_row_group if num_row_group is _UNSET else num_row_group,
                path_id=current.path_id,
                min_row_id=current.min_row_id if min_row_id is _UNSET else min_row_id,
                max_row_id=current.max_row_id if max_row_id is _UNSET else max_row_id,
                cleanup_at=current.cleanup_at if cleanup_at is _UNSET else cleanup_at)
            check_cleanup_at(new.type, new.cleanup_at)
            _check_hull(new.type, new.min_row_id, new.max_row_id)
            cur.execute(
                f"UPDATE files SET type = %s, num_row_group = %s, min_row_id = %s, "
                f"max_row_id = %s, cleanup_at = %s WHERE file_id = %s RETURNING {_FILE_COLUMNS}",
                (int(new.type), new.num_row_group, new.min_row_id, new.max_row_id,
                 new.cleanup_at, file_id))
            return _file(cur.fetchone())

        return self._transaction(body, before_commit=CATALOG_UPDATE_FILE_COMMIT_BEFORE,
                                 after_commit=CATALOG_UPDATE_FILE_COMMIT_AFTER)

    def delete_files(self, file_ids: Iterable[int]) -> int:
        """Delete every listed file or none: a missing id raises and nothing is deleted."""
        ids = sorted(set(file_ids))
        if not ids:
            raise InvalidCatalogArgument("no file id to delete")

        def body(cur: Any) -> int:
            cur.execute("DELETE FROM files WHERE file_id = ANY(%s) RETURNING file_id", (ids,))
            deleted = {r[0] for r in cur.fetchall()}
            missing = sorted(set(ids) - deleted)
            if missing:
                raise NotFound(f"files {missing} do not exist; nothing deleted")
            return len(deleted)

        return self._transaction(body, before_commit=CATALOG_DELETE_FILES_COMMIT_BEFORE,
                                 after_commit=CATALOG_DELETE_FILES_COMMIT_AFTER)

    def atomic_swap_files(self, new_file_id: int, old_file_ids: Iterable[int],
                          cleanup_at: int) -> SwapResult:
        """atomicSwapFiles (C01.6): TEMPORARY_GC → REGULAR and every old REGULAR →
        RETIRED(cleanupAt), in one transaction, or nothing at all.

        Row locks are taken in ascending file-id order (no deadlock between
        swaps); the preconditions are checked on the locked rows, so of two
        concurrent swaps over a common file exactly one commits and the other
        raises :class:`SwapPreconditionFailed`.
        """
        old_list = list(old_file_ids)
        old = sorted(set(old_list))
        if not old:
            raise SwapPreconditionFailed(SwapPrecondition.NO_OLD_FILES, None, "no old file")
        if len(old) != len(old_list):
            raise SwapPreconditionFailed(SwapPrecondition.DUPLICATE_OLD_FILES, None,
                                         f"old file ids repeat: {old_list}")
        if new_file_id in old:
            raise SwapPreconditionFailed(SwapPrecondition.NEW_FILE_AMONG_OLD, new_file_id,
                                         f"file {new_file_id} is both new and old")
        check_cleanup_at(FileType.RETIRED, cleanup_at)

        def body(cur: Any) -> SwapResult:
            ids = sorted([new_file_id, *old])
            cur.execute(f"SELECT {_FILE_COLUMNS} FROM files WHERE file_id = ANY(%s) "
                        "ORDER BY file_id FOR UPDATE", (ids,))
            rows = {r.file_id: r for r in map(_file, cur.fetchall())}
            new = rows.get(new_file_id)
            if new is None:
                raise SwapPreconditionFailed(SwapPrecondition.NEW_FILE_MISSING, new_file_id,
                                             f"new file {new_file_id} does not exist")
            if new.type != FileType.TEMPORARY_GC:
                raise SwapPreconditionFailed(
                    SwapPrecondition.NEW_FILE_NOT_TEMPORARY_GC, new_file_id,
                    f"new file {new_file_id} is {new.type.name}")
            for file_id in old:
                row = rows.get(file_id)
                if row is None:
                    raise SwapPreconditionFailed(SwapPrecondition.OLD_FILE_MISSING, file_id,
                                                 f"old file {file_id} does not exist")
                if row.type != FileType.REGULAR:
                    raise SwapPreconditionFailed(SwapPrecondition.OLD_FILE_NOT_REGULAR, file_id,
                                                 f"old file {file_id} is {row.type.name}")
                if row.path_id != new.path_id:
                    raise SwapPreconditionFailed(
                        SwapPrecondition.PATH_MISMATCH, file_id,
                        f"old file {file_id} is in path {row.path_id}, new file in {new.path_id}")
            cur.execute(f"UPDATE files SET type = %s WHERE file_id = %s RETURNING {_FILE_COLUMNS}",
                        (int(FileType.REGULAR), new_file_id))
            promoted = _file(cur.fetchone())
            cur.execute(f"UPDATE files SET type = %s, cleanup_at = %s WHERE file_id = ANY(%s) "
                        f"RETURNING {_FILE_COLUMNS}", (int(FileType.RETIRED), cleanup_at, old))
            retired = tuple(sorted(map(_file, cur.fetchall()), key=lambda f: f.file_id))
            return SwapResult(new_file=promoted, retired_files=retired)

        result = self._transaction(body, before_commit=CATALOG_SWAP_COMMIT_BEFORE,
                                   after_commit=CATALOG_SWAP_COMMIT_AFTER)
        log.info("catalog_files_swapped", new_file=new_file_id, retired=old,
                 cleanup_at=cleanup_at)
        return result

    def revert_swap(self, new_file_id: int, old_file_ids: Iterable[int],
                    cleanup_at: int) -> str:
        """Undo an atomicSwapFiles in one transaction: the old files REGULAR again
        (cleanupAt cleared), the new file RETIRED(cleanupAt). Idempotent; returns what
        it found:

        * ``"not_swapped"``: the new file is TEMPORARY_GC (the swap flips it and the
          old ones together, so it never committed), or gone while every old file is
          REGULAR (an earlier attempt already discarded it); nothing changes;
        * ``"already"``: the new file is RETIRED and the old ones REGULAR (a retry of a
          lost answer); nothing changes;
        * ``"reverted"``: the new file was REGULAR and every old one RETIRED.

        Any other combination raises :class:`SwapPreconditionFailed` and changes
        nothing: the catalog disagrees with the GC journal.
        """
        old = sorted(set(old_file_ids))
        check_cleanup_at(FileType.RETIRED, cleanup_at)

        def body(cur: Any) -> str:
            cur.execute(f"SELECT {_FILE_COLUMNS} FROM files WHERE file_id = ANY(%s) "
                        "ORDER BY file_id FOR UPDATE", (sorted([new_file_id, *old]),))
            rows = {r.file_id: r for r in map(_file, cur.fetchall())}
            new = rows.get(new_file_id)
            old_types = {rows[f].type if f in rows else None for f in old}
            if new is not None and new.type == FileType.TEMPORARY_GC:
                return "not_swapped"
            if new is None and old_types == {FileType.REGULAR}:
                return "not_swapped"  # an earlier attempt already discarded the new file
            if new is None:
                raise SwapPreconditionFailed(
                    SwapPrecondition.NEW_FILE_MISSING, new_file_id,
                    f"revert: new file {new_file_id} is gone but the old files are "
                    f"{sorted(t.name if t else 'missing' for t in old_types)}")
            if new.type == FileType.RETIRED and old_types == {FileType.REGULAR}:
                return "already"
            if new.type != FileType.REGULAR or old_types != {FileType.RETIRED}:
                raise SwapPreconditionFailed(
                    SwapPrecondition.OLD_FILE_NOT_REGULAR, new_file_id,
                    f"revert: new file {new_file_id} is {new.type.name}, old files are "
                    f"{sorted(t.name if t else 'missing' for t in old_types)}")
            cur.execute("UPDATE files SET type = %s, cleanup_at = %s WHERE file_id = %s",
                        (int(FileType.RETIRED), cleanup_at, new_file_id))
            cur.execute("UPDATE files SET type = %s, cleanup_at = NULL WHERE file_id = ANY(%s)",
                        (int(FileType.REGULAR), old))
            return "reverted"

        outcome = self._transaction(body, before_commit=CATALOG_REVERT_SWAP_COMMIT_BEFORE,
                                    after_commit=CATALOG_REVERT_SWAP_COMMIT_AFTER)
        log.info("catalog_swap_reverted", new_file=new_file_id, old_files=old, outcome=outcome)
        return outcome

    # --- FILES: enumeration -----------------------------------------------------------
    def get_file(self, file_id: int) -> FileRecord | None:
        def body(cur: Any) -> FileRecord | None:
            cur.execute(f"SELECT {_FILE_COLUMNS} FROM files WHERE file_id = %s", (file_id,))
            row = cur.fetchone()
            return None if row is None else _file(row)

        return self._read(body)

    def get_file_by_name(self, path_id: int, name: str) -> FileRecord | None:
        """The file of any type named ``name`` in a path, if there is one (names are
        unique per path). The orphan pass asks it just before each delete."""
        def body(cur: Any) -> FileRecord | None:
            cur.execute(f"SELECT {_FILE_COLUMNS} FROM files WHERE path_id = %s AND name = %s",
                        (path_id, name))
            row = cur.fetchone()
            return None if row is None else _file(row)

        return self._read(body)

    def get_files_by_type(self, path_id: int | None, types: Iterable[FileType]) -> list[FileRecord]:
        """getFilesByType: THE single SQL enumeration of FILES.

        ``path_id=None`` enumerates across paths (sweepers and admin tools
        only; never a query, planner, cache or GC-candidate path).
        """
        wanted = sorted({int(FileType(t)) for t in types})
        if not wanted:
            raise InvalidCatalogArgument("no file type to enumerate")

        def body(cur: Any) -> list[FileRecord]:
            if path_id is None:
                cur.execute(f"SELECT {_FILE_COLUMNS} FROM files WHERE type = ANY(%s) "
                            "ORDER BY file_id", (wanted,))
            else:
                cur.execute(f"SELECT {_FILE_COLUMNS} FROM files WHERE path_id = %s "
                            "AND type = ANY(%s) ORDER BY file_id", (path_id, wanted))
            return [_file(r) for r in cur.fetchall()]

        return self._read(body)

    def get_regular_files(self, path_id: int) -> list[FileRecord]:
        """The only query-visible enumeration: REGULAR files of one path."""
        return self.get_files_by_type(path_id, [FileType.REGULAR])

    def list_temporary_files_due(self, ttl_ms: int, now_ms: int | None = None) -> list[FileRecord]:
        """TEMPORARY_INGEST / TEMPORARY_GC files created at least ``ttl_ms`` ago.

        The age comes from the UTC ``yyyyMMddHHmmss`` embedded in the file
        name, not from cleanupAt (which is RETIRED-only). A name that does
        not parse is logged and skipped, never deleted by guesswork.
        """
        if ttl_ms < 0:
            raise InvalidCatalogArgument("ttl_ms must not be negative")
        now_ms = _now_ms() if now_ms is None else now_ms
        due = []
        for f in self.get_files_by_type(None, [FileType.TEMPORARY_INGEST, FileType.TEMPORARY_GC]):
            try:
                created_ms = file_names.created_at_ms(f.name)
            except ValueError as exc:
                log.warning("catalog_temporary_file_name_unparsable", file_id=f.file_id,
                            name=f.name, error=str(exc))
                continue
            if created_ms + ttl_ms <= now_ms:
                due.append(f)
        return due

    def list_retired_files_due(self, now_ms: int | None = None) -> list[FileRecord]:
        """RETIRED files whose cleanupAt has passed."""
        now_ms = _now_ms() if now_ms is None else now_ms
        return [f for f in self.get_files_by_type(None, [FileType.RETIRED])
                if f.cleanup_at is not None and f.cleanup_at <= now_ms]


def _check_hull(file_type: FileType, min_row_id: int | None, max_row_id: int | None) -> None:
    if (min_row_id is None) != (max_row_id is None):
        raise InvalidCatalogArgument("min_row_id and max_row_id are set together")
    if min_row_id is not None and max_row_id is not None and not 0 <= min_row_id <= max_row_id:
        raise InvalidCatalogArgument(f"bad row-id hull [{min_row_id}, {max_row_id}]")
    if file_type == FileType.REGULAR and min_row_id is None:
        raise InvalidCatalogArgument("a REGULAR file needs its row-id hull")


def _translate(exc: psycopg2.Error) -> CatalogError:
    if isinstance(exc, psycopg2.errors.UniqueViolation):
        return AlreadyExists(str(exc).strip())
    if isinstance(exc, psycopg2.errors.ForeignKeyViolation):
        return NotFound(f"referenced object does not exist: {str(exc).strip()}")
    if isinstance(exc, psycopg2.errors.CheckViolation | psycopg2.errors.NotNullViolation):
        return ConstraintViolation(str(exc).strip())
    if isinstance(exc, psycopg2.OperationalError | psycopg2.InterfaceError):
        return CatalogUnavailable(f"catalog unavailable: {str(exc).strip()}")
    return CatalogError(f"catalog error: {str(exc).strip()}")
