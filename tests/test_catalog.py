"""The PostgreSQL catalog: schema bootstrap, FILES invariants, enumeration, atomicSwapFiles."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path

import psycopg2
import pytest

from retina_common import failpoints, file_names
from retina_common.catalog import (
    AlreadyExists,
    Catalog,
    CatalogVersionError,
    CleanupAtViolation,
    ColumnSpec,
    FileRecord,
    FileType,
    FileTypeMismatch,
    InvalidCatalogArgument,
    NotFound,
    SwapPrecondition,
    SwapPreconditionFailed,
)
from retina_common.catalog.schema import CURRENT_VERSION

from .support import ROOT, eventually

NODE = "127.0.0.1:18890"


def name(age: timedelta = timedelta(0), seq: int = 0, vnode: int = 0) -> str:
    return file_names.make(NODE, datetime.now(UTC) - age, seq, vnode)


@pytest.fixture
def path_id(catalog: Catalog) -> int:
    catalog.create_schema("shop")
    table = catalog.create_table("shop", "orders",
                                 [ColumnSpec("id", "int64"), ColumnSpec("note", "string")], ["id"])
    return catalog.add_path(table.table_id, "file:///data/shop/orders/p0").path_id


def all_files(catalog: Catalog) -> list[FileRecord]:
    return catalog.get_files_by_type(None, list(FileType))


def regular(catalog: Catalog, path_id: int, seq: int, lo: int = 0) -> FileRecord:
    return catalog.add_file(name(seq=seq), FileType.REGULAR, 1, path_id, lo, lo + 9)


def gc_file(catalog: Catalog, path_id: int, seq: int) -> FileRecord:
    return catalog.add_file(name(seq=seq), FileType.TEMPORARY_GC, 1, path_id, 1000 + seq,
                            1100 + seq)


# --- bootstrap ---
@pytest.mark.integration
def test_bootstrap_is_idempotent_and_versioned(catalog_dsn: str) -> None:
    cat = Catalog(catalog_dsn)
    assert cat.bootstrap() == 0
    assert cat.bootstrap() == CURRENT_VERSION
    cat.close()


@pytest.mark.integration
def test_bootstrap_refuses_a_newer_catalog(catalog: Catalog, catalog_dsn: str) -> None:
    with psycopg2.connect(catalog_dsn) as conn, conn.cursor() as cur:
        cur.execute("UPDATE catalog_version SET version = %s", (CURRENT_VERSION + 1,))
    with pytest.raises(CatalogVersionError, match="newer"):
        catalog.bootstrap()


@pytest.mark.integration
def test_bootstrap_refuses_an_unversioned_catalog(catalog_dsn: str) -> None:
    with psycopg2.connect(catalog_dsn) as conn, conn.cursor() as cur:
        cur.execute("CREATE TABLE files (id int)")
    with pytest.raises(CatalogVersionError, match="no catalog_version"):
        Catalog(catalog_dsn).bootstrap()


@pytest.mark.integration
@pytest.mark.parametrize("point, committed", [("commit.before", False), ("commit.after", True)])
def test_kill_during_bootstrap(catalog_dsn: str, tmp_path: Path, point: str,
                               committed: bool) -> None:
    config = tmp_path / "retina.toml"
    config.write_text(f"[catalog]\ndsn = {json.dumps(catalog_dsn)}\n")
    result = _cli(config, f"catalog.bootstrap.{point}=exit(137)", "bootstrap")
    assert result.returncode == 137
    with psycopg2.connect(catalog_dsn) as conn, conn.cursor() as cur:
        cur.execute("SELECT to_regclass('files') IS NOT NULL, "
                    "to_regclass('catalog_version') IS NOT NULL")
        assert cur.fetchone() == (committed, committed)
    again = _cli(config, "", "bootstrap")
    assert again.returncode == 0
    assert json.loads(again.stdout)["previous_version"] == (CURRENT_VERSION if committed else 0)


@pytest.mark.integration
def test_concurrent_bootstraps_serialise(catalog_dsn: str) -> None:
    results: list[int] = []
    errors: list[Exception] = []

    def run() -> None:
        cat = Catalog(catalog_dsn)
        try:
            results.append(cat.bootstrap())
        except Exception as exc:
            errors.append(exc)
        finally:
            cat.close()

    threads = [threading.Thread(target=run) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert sorted(results) == [0, CURRENT_VERSION, CURRENT_VERSION, CURRENT_VERSION]


# --- schemas and tables ---
@pytest.mark.integration
def test_tables_columns_primary_key_and_index_ids(catalog: Catalog) -> None:
    catalog.create_schema("s")
    t1 = catalog.create_table("s", "t1", [ColumnSpec("b", "string"), ColumnSpec("a", "int64"),
                                          ColumnSpec("amount", "decimal(12,2)")], ["a", "b"])
    t2 = catalog.create_table("s", "t2", [ColumnSpec("id", "int64")], ["id"])
    assert [c.name for c in t1.columns] == ["b", "a", "amount"]
    assert t1.primary_key == ("a", "b")
    assert t1.primary_index_id != t2.primary_index_id
    assert catalog.list_tables("s") == ["t1", "t2"]
    assert catalog.get_table("s", "t1") == t1
    with pytest.raises(AlreadyExists):
        catalog.create_table("s", "t1", [ColumnSpec("id", "int64")], ["id"])
    with pytest.raises(NotFound):
        catalog.get_table("s", "nope")
    with pytest.raises(NotFound):
        catalog.create_table("nope", "t", [ColumnSpec("id", "int64")], ["id"])


@pytest.mark.parametrize("columns, key", [
    ([], ["id"]),
    ([ColumnSpec("id", "int64")], []),
    ([ColumnSpec("id", "int64")], ["other"]),
    ([ColumnSpec("id", "int64"), ColumnSpec("id", "string")], ["id"]),
    ([ColumnSpec("id", "varchar")], ["id"]),
    ([ColumnSpec("bad name", "int64")], ["bad name"]),
])
@pytest.mark.integration
def test_malformed_tables_are_refused_and_nothing_is_created(
        catalog: Catalog, columns: list[ColumnSpec], key: list[str]) -> None:
    catalog.create_schema("s")
    with pytest.raises(InvalidCatalogArgument):
        catalog.create_table("s", "t", columns, key)
    assert catalog.list_tables("s") == []


# --- FILES writes and the cleanupAt rule ---
@pytest.mark.integration
def test_add_update_delete_report_success_explicitly(catalog: Catalog, path_id: int) -> None:
    added = catalog.add_file(name(seq=1), FileType.TEMPORARY_INGEST, 0, path_id)
    assert added.type == FileType.TEMPORARY_INGEST and added.file_id > 0
    published = catalog.update_file(added.file_id, file_type=FileType.REGULAR, num_row_group=2,
                                    min_row_id=0, max_row_id=99,
                                    expected_type=FileType.TEMPORARY_INGEST)
    assert (published.type, published.min_row_id, published.max_row_id) == (FileType.REGULAR, 0, 99)
    assert catalog.get_file(added.file_id) == published
    assert catalog.delete_files([added.file_id]) == 1
    assert catalog.get_file(added.file_id) is None


@pytest.mark.integration
def test_write_failures_raise_and_change_nothing(catalog: Catalog, path_id: int) -> None:
    f = regular(catalog, path_id, 1)
    before = all_files(catalog)
    with pytest.raises(NotFound):
        catalog.update_file(999_999, file_type=FileType.REGULAR)
    with pytest.raises(FileTypeMismatch):  # e.g. a concurrent retire won
        catalog.update_file(f.file_id, file_type=FileType.REGULAR,
                            expected_type=FileType.TEMPORARY_INGEST)
    with pytest.raises(NotFound, match="nothing deleted"):
        catalog.delete_files([f.file_id, 999_999])
    with pytest.raises(NotFound):
        catalog.add_file(name(seq=2), FileType.TEMPORARY_INGEST, 0, 424242)
    with pytest.raises(AlreadyExists):
        catalog.add_file(f.name, FileType.TEMPORARY_INGEST, 0, path_id)
    with pytest.raises(InvalidCatalogArgument, match="row-id hull"):
        catalog.add_file(name(seq=3), FileType.REGULAR, 1, path_id)
    with pytest.raises(InvalidCatalogArgument):
        catalog.add_file(name(seq=4), FileType.TEMPORARY_GC, 1, path_id, 10, 5)
    assert all_files(catalog) == before


@pytest.mark.parametrize("file_type, cleanup_at", [
    (FileType.REGULAR, 123), (FileType.TEMPORARY_INGEST, 123), (FileType.TEMPORARY_GC, 123),
    (FileType.RETIRED, None),
])
@pytest.mark.integration
def test_dao_refuses_cleanup_at_violations_before_sql(
        catalog: Catalog, path_id: int, file_type: FileType, cleanup_at: int | None) -> None:
    with pytest.raises(CleanupAtViolation):
        catalog.add_file(name(seq=1), file_type, 1, path_id, 0, 9, cleanup_at)
    assert all_files(catalog) == []


@pytest.mark.integration
def test_dao_refuses_cleanup_at_violations_on_update(catalog: Catalog, path_id: int) -> None:
    f = regular(catalog, path_id, 1)
    with pytest.raises(CleanupAtViolation):
        catalog.update_file(f.file_id, file_type=FileType.RETIRED)
    with pytest.raises(CleanupAtViolation):
        catalog.update_file(f.file_id, cleanup_at=5)
    retired = catalog.update_file(f.file_id, file_type=FileType.RETIRED, cleanup_at=5)
    with pytest.raises(CleanupAtViolation):
        catalog.update_file(f.file_id, cleanup_at=None)
    assert catalog.get_file(f.file_id) == retired


@pytest.mark.parametrize("sql", [
    "INSERT INTO files (name, type, num_row_group, path_id, min_row_id, max_row_id, cleanup_at) "
    "VALUES ('raw1', 1, 1, {path}, 0, 9, 1234)",  # REGULAR with cleanupAt
    "INSERT INTO files (name, type, num_row_group, path_id) VALUES ('raw2', 3, 1, {path})",
    "UPDATE files SET cleanup_at = 77 WHERE file_id = {file}",
    "UPDATE files SET type = 3 WHERE file_id = {file}",  # RETIRED without cleanupAt
    "INSERT INTO files (name, type, num_row_group, path_id) VALUES ('raw3', 4, 1, {path})",
    "INSERT INTO files (name, type, num_row_group, path_id) VALUES ('raw4', 1, 1, {path})",
    "INSERT INTO files (name, type, num_row_group, path_id, min_row_id, max_row_id) "
    "VALUES ('raw5', 0, 1, {path}, 9, 3)",
])
@pytest.mark.integration
def test_check_constraints_refuse_raw_sql(catalog: Catalog, catalog_dsn: str, path_id: int,
                                          sql: str) -> None:
    f = regular(catalog, path_id, 1)
    before = all_files(catalog)
    with psycopg2.connect(catalog_dsn) as conn, conn.cursor() as cur, \
            pytest.raises(psycopg2.errors.CheckViolation):
        cur.execute(sql.format(path=path_id, file=f.file_id))
    assert all_files(catalog) == before


@pytest.mark.integration
def test_constraint_names_document_the_rules(catalog: Catalog, catalog_dsn: str) -> None:
    with psycopg2.connect(catalog_dsn) as conn, conn.cursor() as cur:
        cur.execute("SELECT conname FROM pg_constraint WHERE conrelid = 'files'::regclass "
                    "AND contype = 'c'")
        names = {r[0] for r in cur.fetchall()}
        cur.execute("SELECT column_name FROM information_schema.columns "
                    "WHERE table_name = 'files' ORDER BY ordinal_position")
        columns = [r[0] for r in cur.fetchall()]
    assert {"files_cleanup_at_iff_retired", "files_type_known"} <= names
    assert columns == ["file_id", "name", "type", "num_row_group", "path_id", "min_row_id",
                       "max_row_id", "cleanup_at"]


# --- enumeration ---
@pytest.mark.integration
def test_enumeration_by_type_and_regular_only(catalog: Catalog, path_id: int) -> None:
    other_path = catalog.add_path(catalog.get_table("shop", "orders").table_id,
                                  "file:///data/shop/orders/p1").path_id
    reg = regular(catalog, path_id, 1)
    reg_other = regular(catalog, other_path, 2)
    ingest = catalog.add_file(name(seq=3), FileType.TEMPORARY_INGEST, 0, path_id)
    gc = gc_file(catalog, path_id, 4)
    retired = catalog.add_file(name(seq=5), FileType.RETIRED, 1, path_id, 0, 9, cleanup_at=1)
    assert catalog.get_regular_files(path_id) == [reg]
    assert catalog.get_regular_files(other_path) == [reg_other]
    assert catalog.get_files_by_type(path_id, [FileType.TEMPORARY_INGEST, FileType.TEMPORARY_GC]) \
        == [ingest, gc]
    assert catalog.get_files_by_type(None, [FileType.REGULAR]) == [reg, reg_other]
    assert catalog.get_files_by_type(None, [FileType.RETIRED]) == [retired]
    with pytest.raises(InvalidCatalogArgument):
        catalog.get_files_by_type(path_id, [])


@pytest.mark.integration
def test_temporary_files_due_by_name_age(catalog: Catalog, path_id: int,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    old_ingest = catalog.add_file(name(timedelta(hours=2), seq=1), FileType.TEMPORARY_INGEST, 0,
                                  path_id)
    old_gc = catalog.add_file(name(timedelta(hours=3), seq=2), FileType.TEMPORARY_GC, 1, path_id,
                              0, 5)
    catalog.add_file(name(timedelta(minutes=1), seq=3), FileType.TEMPORARY_INGEST, 0, path_id)
    catalog.add_file(name(timedelta(hours=5), seq=4), FileType.REGULAR, 1, path_id, 10, 20)
    catalog.add_file("legacy-name-without-time.parquet", FileType.TEMPORARY_INGEST, 0, path_id)
    due = catalog.list_temporary_files_due(ttl_ms=3_600_000)
    assert due == [old_ingest, old_gc]
    assert "catalog_temporary_file_name_unparsable" in capsys.readouterr().out


@pytest.mark.integration
def test_retired_files_due_by_cleanup_at(catalog: Catalog, path_id: int) -> None:
    now = int(time.time() * 1000)
    due = catalog.add_file(name(seq=1), FileType.RETIRED, 1, path_id, 0, 9, cleanup_at=now - 1)
    catalog.add_file(name(seq=2), FileType.RETIRED, 1, path_id, 10, 19, cleanup_at=now + 60_000)
    regular(catalog, path_id, 3, lo=20)
    assert catalog.list_retired_files_due(now_ms=now) == [due]


# --- atomicSwapFiles ---
@pytest.mark.integration
def test_swap_promotes_new_and_retires_old_together(catalog: Catalog, path_id: int) -> None:
    a, b, keep = (regular(catalog, path_id, i, lo=10 * i) for i in (1, 2, 3))
    new = gc_file(catalog, path_id, 4)
    result = catalog.atomic_swap_files(new.file_id, [b.file_id, a.file_id], cleanup_at=555)
    assert result.new_file.type == FileType.REGULAR
    assert [(f.file_id, f.type, f.cleanup_at) for f in result.retired_files] == [
        (a.file_id, FileType.RETIRED, 555), (b.file_id, FileType.RETIRED, 555)]
    assert {f.file_id for f in catalog.get_regular_files(path_id)} == {keep.file_id, new.file_id}


def _swap_case(catalog: Catalog, path_id: int, case: str) -> tuple[int, list[int]]:
    a = regular(catalog, path_id, 1)
    new = gc_file(catalog, path_id, 2)
    if case == "new missing":
        return 987_654, [a.file_id]
    if case == "new not TEMPORARY_GC":
        return regular(catalog, path_id, 3, lo=50).file_id, [a.file_id]
    if case == "old missing":
        return new.file_id, [a.file_id, 987_654]
    if case == "old not REGULAR":
        ingest = catalog.add_file(name(seq=4), FileType.TEMPORARY_INGEST, 0, path_id)
        return new.file_id, [a.file_id, ingest.file_id]
    if case == "old RETIRED":
        gone = catalog.add_file(name(seq=5), FileType.RETIRED, 1, path_id, 0, 1, cleanup_at=1)
        return new.file_id, [gone.file_id]
    if case == "other path":
        table = catalog.get_table("shop", "orders")
        other = catalog.add_path(table.table_id, "file:///elsewhere").path_id
        return new.file_id, [regular(catalog, other, 6, lo=70).file_id]
    if case == "no old":
        return new.file_id, []
    if case == "duplicate old":
        return new.file_id, [a.file_id, a.file_id]
    assert case == "new among old"
    return new.file_id, [a.file_id, new.file_id]


@pytest.mark.parametrize("case, precondition", [
    ("new missing", SwapPrecondition.NEW_FILE_MISSING),
    ("new not TEMPORARY_GC", SwapPrecondition.NEW_FILE_NOT_TEMPORARY_GC),
    ("old missing", SwapPrecondition.OLD_FILE_MISSING),
    ("old not REGULAR", SwapPrecondition.OLD_FILE_NOT_REGULAR),
    ("old RETIRED", SwapPrecondition.OLD_FILE_NOT_REGULAR),
    ("other path", SwapPrecondition.PATH_MISMATCH),
    ("no old", SwapPrecondition.NO_OLD_FILES),
    ("duplicate old", SwapPrecondition.DUPLICATE_OLD_FILES),
    ("new among old", SwapPrecondition.NEW_FILE_AMONG_OLD),
])
@pytest.mark.integration
def test_swap_preconditions_change_nothing(catalog: Catalog, path_id: int, case: str,
                                           precondition: SwapPrecondition) -> None:
    new_id, old_ids = _swap_case(catalog, path_id, case)
    before = all_files(catalog)
    with pytest.raises(SwapPreconditionFailed) as err:
        catalog.atomic_swap_files(new_id, old_ids, cleanup_at=1)
    assert err.value.precondition == precondition
    assert all_files(catalog) == before


def _race(catalog_dsn: str, swaps: list[tuple[int, list[int]]]) -> list[object]:
    """Run the swaps at the same moment, each on its own connection."""
    barrier = threading.Barrier(len(swaps))
    outcomes: list[object] = [None] * len(swaps)

    def run(i: int) -> None:
        cat = Catalog(catalog_dsn)
        try:
            barrier.wait()
            outcomes[i] = cat.atomic_swap_files(swaps[i][0], swaps[i][1], cleanup_at=9)
        except Exception as exc:
            outcomes[i] = exc
        finally:
            cat.close()

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(swaps))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    return outcomes


def _lock_waiters(catalog_dsn: str) -> int:
    with psycopg2.connect(catalog_dsn) as conn, conn.cursor() as cur:
        cur.execute("SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
                    "AND wait_event_type = 'Lock'")
        return int(cur.fetchone()[0])


def _overlapping(catalog_dsn: str, swaps: list[tuple[int, list[int]]],
                 enable: Callable[[str], None], failpoint_dir: Path) -> list[object]:
    """The first swap holds its row locks at ``catalog.swap.commit.before`` until the
    second is seen waiting on a lock: the two really overlap, every time."""
    point = "catalog.swap.commit.before"
    for leftover in failpoint_dir.glob(f"{point}.*"):
        leftover.unlink()
    enable(f"{point}=block*1")
    outcomes: list[object] = [None, None]

    def run(i: int) -> None:
        cat = Catalog(catalog_dsn)
        try:
            outcomes[i] = cat.atomic_swap_files(swaps[i][0], swaps[i][1], cleanup_at=9)
        except Exception as exc:
            outcomes[i] = exc
        finally:
            cat.close()

    first = threading.Thread(target=run, args=(0,))
    first.start()
    failpoints.wait_hit(failpoint_dir, point)
    second = threading.Thread(target=run, args=(1,))
    second.start()
    eventually(lambda: _lock_waiters(catalog_dsn) >= 1, 20, "the second swap to wait on a lock")
    failpoints.release(failpoint_dir, point)
    for t in (first, second):
        t.join(timeout=60)
    return outcomes


@pytest.mark.integration
def test_two_concurrent_swaps_over_a_common_file_have_one_winner(
        catalog: Catalog, catalog_dsn: str, path_id: int, active_failpoints: Callable,
        failpoint_dir: Path) -> None:
    for round_ in range(5):
        a, b, c = (regular(catalog, path_id, 10 * round_ + i, lo=100 * round_ + 10 * i)
                   for i in range(3))
        g1, g2 = gc_file(catalog, path_id, 10 * round_ + 7), gc_file(catalog, path_id,
                                                                    10 * round_ + 8)
        outcomes = _overlapping(catalog_dsn, [(g1.file_id, [a.file_id, b.file_id]),
                                              (g2.file_id, [b.file_id, c.file_id])],
                                active_failpoints, failpoint_dir)
        winners = [o for o in outcomes if not isinstance(o, Exception)]
        losers = [o for o in outcomes if isinstance(o, Exception)]
        assert len(winners) == 1 and len(losers) == 1, outcomes
        assert isinstance(losers[0], SwapPreconditionFailed)
        assert losers[0].precondition == SwapPrecondition.OLD_FILE_NOT_REGULAR
        won = winners[0]
        lost_new = g2 if won.new_file.file_id == g1.file_id else g1
        assert catalog.get_file(lost_new.file_id).type == FileType.TEMPORARY_GC
        retired = {f.file_id for f in catalog.get_files_by_type(path_id, [FileType.RETIRED])}
        assert {f.file_id for f in won.retired_files} <= retired
        assert b.file_id in retired


@pytest.mark.integration
def test_two_swaps_of_the_same_new_file_have_one_winner(
        catalog: Catalog, catalog_dsn: str, path_id: int) -> None:
    a, b = regular(catalog, path_id, 1), regular(catalog, path_id, 2, lo=20)
    new = gc_file(catalog, path_id, 3)
    outcomes = _race(catalog_dsn, [(new.file_id, [a.file_id]), (new.file_id, [b.file_id])])
    errors = [o for o in outcomes if isinstance(o, Exception)]
    assert len(errors) == 1
    assert errors[0].precondition in (SwapPrecondition.NEW_FILE_NOT_TEMPORARY_GC,)
    assert len(catalog.get_files_by_type(path_id, [FileType.RETIRED])) == 1


# --- a real process killed at each commit failpoint ---
def _cli(config: Path, failpoint: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "RETINA_FAILPOINTS": failpoint}
    return subprocess.run([sys.executable, "-m", "retina_common.catalog.cli",
                           "--config", str(config), *args],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)


@pytest.fixture
def cli_config(tmp_path: Path, catalog_dsn: str) -> Path:
    path = tmp_path / "retina.toml"
    path.write_text(f"[catalog]\ndsn = {json.dumps(catalog_dsn)}\n")
    return path


@pytest.mark.integration
@pytest.mark.parametrize("point, committed", [("commit.before", False), ("commit.after", True)])
def test_kill_during_swap(catalog: Catalog, path_id: int, cli_config: Path, point: str,
                          committed: bool) -> None:
    a, b = regular(catalog, path_id, 1), regular(catalog, path_id, 2, lo=20)
    new = gc_file(catalog, path_id, 3)
    result = _cli(cli_config, f"catalog.swap.{point}=exit(137)",
                  "swap", str(new.file_id), str(a.file_id), str(b.file_id), "--cleanup-at", "7")
    assert result.returncode == 137, result.stderr
    types = {f.file_id: f.type for f in all_files(catalog)}
    if committed:
        assert types == {a.file_id: FileType.RETIRED, b.file_id: FileType.RETIRED,
                         new.file_id: FileType.REGULAR}
    else:
        assert types == {a.file_id: FileType.REGULAR, b.file_id: FileType.REGULAR,
                         new.file_id: FileType.TEMPORARY_GC}
    # Either way the catalog is consistent and a retry converges.
    retry = _cli(cli_config, "", "swap", str(new.file_id), str(a.file_id), str(b.file_id))
    assert (retry.returncode == 0) != committed
    assert {f.file_id for f in catalog.get_regular_files(path_id)} == {new.file_id}


@pytest.mark.integration
@pytest.mark.parametrize("point, committed", [("commit.before", False), ("commit.after", True)])
def test_kill_during_update_file(catalog: Catalog, path_id: int, cli_config: Path, point: str,
                                 committed: bool) -> None:
    f = catalog.add_file(name(seq=1), FileType.TEMPORARY_INGEST, 0, path_id)
    result = _cli(cli_config, f"catalog.update_file.{point}=exit(137)", "update-file",
                  str(f.file_id), "--type", "REGULAR", "--rows", "0", "99",
                  "--expect", "TEMPORARY_INGEST")
    assert result.returncode == 137
    after = catalog.get_file(f.file_id)
    assert after.type == (FileType.REGULAR if committed else FileType.TEMPORARY_INGEST)
    assert catalog.get_regular_files(path_id) == ([after] if committed else [])


@pytest.mark.parametrize("step, args_of", [
    ("add_file", lambda p, f: ["add-file", str(p), name(seq=9), "TEMPORARY_INGEST"]),
    ("delete_files", lambda p, f: ["delete-files", str(f)]),
])
@pytest.mark.integration
@pytest.mark.parametrize("point", ["commit.before", "commit.after"])
def test_kill_during_add_and_delete(catalog: Catalog, path_id: int, cli_config: Path, step: str,
                                    args_of: Callable, point: str) -> None:
    f = regular(catalog, path_id, 1)
    before = {x.file_id for x in all_files(catalog)}
    result = _cli(cli_config, f"catalog.{step}.{point}=exit(137)", *args_of(path_id, f.file_id))
    assert result.returncode == 137
    after = {x.file_id for x in all_files(catalog)}
    if point == "commit.before":
        assert after == before
    elif step == "add_file":
        assert len(after - before) == 1 and before <= after
    else:
        assert after == before - {f.file_id}


@pytest.mark.integration
def test_cli_creates_not_null_columns_and_refuses_another_flag(catalog: Catalog,
                                                               cli_config: Path) -> None:
    catalog.create_schema("flags")
    bad = _cli(cli_config, "", "create-table", "flags", "t", "--column", "id:int64",
               "--column", "v:string:nonnull", "--primary-key", "id")
    assert bad.returncode == 1 and "'nonnull' is not 'notnull'" in bad.stderr
    assert catalog.list_tables("flags") == []
    good = _cli(cli_config, "", "create-table", "flags", "t", "--column", "id:int64",
                "--column", "v:string:notnull", "--column", "w:decimal(12,2)",
                "--primary-key", "id")
    assert good.returncode == 0, good.stderr
    assert [(c.name, c.type, c.nullable) for c in catalog.get_table("flags", "t").columns] == \
        [("id", "int64", False), ("v", "string", False), ("w", "decimal(12,2)", True)]


@pytest.mark.integration
def test_cli_refusals_use_exit_code_1(catalog: Catalog, path_id: int, cli_config: Path) -> None:
    f = regular(catalog, path_id, 1)
    result = _cli(cli_config, "", "update-file", str(f.file_id), "--cleanup-at", "5")
    assert result.returncode == 1 and "CleanupAtViolation" in result.stderr
    assert catalog.get_file(f.file_id) == f


@pytest.mark.integration
@pytest.mark.parametrize("column", ["id:int46", "id"])
def test_cli_a_bad_column_lists_the_valid_types(catalog: Catalog, cli_config: Path,
                                                column: str) -> None:
    catalog.create_schema("typos")
    result = _cli(cli_config, "", "create-table", "typos", "t", "--column", column,
                  "--primary-key", "id")
    assert result.returncode == 1, result.stderr
    assert ("unknown column type 'int46'; valid types: " if ":" in column
            else "--column 'id' is not name:type[:notnull] (types: ") in result.stderr
    assert ("boolean, int32, int64, float32, float64, string, binary, date32, timestamp_us, "
            "decimal(P,S) with 1 <= P <= 38 and S <= P") in result.stderr
    assert catalog.list_tables("typos") == []


def test_unreachable_catalog_is_reported_as_unavailable() -> None:
    from devtools.cluster import free_port
    from retina_common.catalog import CatalogUnavailable

    cat = Catalog(f"host=127.0.0.1 port={free_port()} dbname=x user=x", connect_timeout_s=2)
    with pytest.raises(CatalogUnavailable):
        cat.get_file(1)



def _backends(dsn: str) -> set[int]:
    """Backend pids connected to the catalog's database, other than this probe's own."""
    conn = psycopg2.connect(dsn)
    try:
        with conn.cursor() as cur:
            cur.execute("SELECT pid FROM pg_stat_activity WHERE datname = current_database() "
                        "AND pid <> pg_backend_pid()")
            return {row[0] for row in cur.fetchall()}
    finally:
        conn.close()


@pytest.mark.integration
@pytest.mark.parametrize("revalidate_after_s", [1e9, 0.0])
def test_idle_connections_are_reused_and_a_dead_one_is_replaced(
        catalog: Catalog, catalog_dsn: str, monkeypatch: pytest.MonkeyPatch,
        revalidate_after_s: float) -> None:
    """Catalog calls reuse pooled PostgreSQL connections (a new one per call cost ~2.5 ms);
    one whose backend died while idle (a PostgreSQL restart, an idle timeout) is replaced
    when it is next handed out, so the call succeeds: seen at once by its readable socket,
    or (idle long enough) by a SELECT 1."""
    from retina_common.catalog import catalog as catalog_module

    catalog.create_schema("pool")
    before = _backends(catalog_dsn)
    assert 1 <= len(before) <= catalog_module.KEEP_IDLE
    for i in range(20):
        catalog.create_table("pool", f"t{i}", [ColumnSpec("id", "int64")], ["id"])
    assert _backends(catalog_dsn) == before  # the same backends served all twenty

    killer = psycopg2.connect(catalog_dsn)
    killer.autocommit = True
    with killer.cursor() as cur:
        cur.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = "
                    "current_database() AND pid <> pg_backend_pid()")
    killer.close()
    eventually(lambda: not _backends(catalog_dsn), 30, "the pooled backends to exit")
    monkeypatch.setattr(catalog_module, "REVALIDATE_AFTER_S", revalidate_after_s)
    assert len(catalog.list_tables("pool")) == 20
    catalog.create_table("pool", "after", [ColumnSpec("id", "int64")], ["id"])
    assert len(catalog.list_tables("pool")) == 21


@pytest.mark.integration
def test_not_null_columns_are_stored_and_a_catalog_of_version_2_keeps_its_columns_nullable(
        catalog_dsn: str) -> None:
    """Catalog version 3: a column created NOT NULL reads back so, a key column is never
    nullable, an added column always is; a catalog bootstrapped at version 2 (every
    column nullable then) is migrated with its columns as they were."""
    from retina_common.catalog.schema import MIGRATIONS

    with psycopg2.connect(catalog_dsn) as conn, conn.cursor() as cur:
        cur.execute("CREATE TABLE catalog_version (id SMALLINT PRIMARY KEY CHECK (id = 1), "
                    "version INT NOT NULL, updated_at TIMESTAMPTZ NOT NULL DEFAULT now())")
        cur.execute(MIGRATIONS[1])
        cur.execute(MIGRATIONS[2])
        cur.execute("INSERT INTO catalog_version (id, version) VALUES (1, 2)")
        cur.execute("INSERT INTO schemas (name) VALUES ('s') RETURNING schema_id")
        schema_id = cur.fetchone()[0]
        cur.execute("INSERT INTO tables (schema_id, name) VALUES (%s, 'old') "
                    "RETURNING table_id", (schema_id,))
        table_id = cur.fetchone()[0]
        cur.execute("INSERT INTO columns (table_id, name, type, ordinal, pk_position) VALUES "
                    "(%s, 'id', 'int64', 0, 0), (%s, 'v', 'string', 1, NULL)",
                    (table_id, table_id))
    cat = Catalog(catalog_dsn)
    try:
        assert cat.bootstrap() == 2
        old = cat.get_table("s", "old")
        assert [(c.name, c.nullable, c.accepts_null) for c in old.columns] == \
            [("id", True, False), ("v", True, True)]
        new = cat.create_table("s", "new", [ColumnSpec("id", "int64"),
                                            ColumnSpec("a", "string", nullable=False),
                                            ColumnSpec("b", "int64")], ["id"])
        assert [(c.name, c.nullable, c.accepts_null) for c in new.columns] == \
            [("id", False, False), ("a", False, False), ("b", True, True)]
        with pytest.raises(InvalidCatalogArgument, match="only a nullable column"):
            cat.add_column("s", "new", "c", "int64", nullable=False)
        added = cat.add_column("s", "new", "c", "int64")
        assert added.columns[-1].nullable and added.columns[-1].accepts_null
        assert cat.get_table("s", "new") == added
    finally:
        cat.close()
