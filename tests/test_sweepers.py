"""Sweepers and the retention guard (issue 11): retired files leave storage, the catalog,
the MainIndex and memory once nothing can need them, and not a moment earlier; a kill at
every sweeper step is finished by the next round; temporary files, checkpoint bodies and
orphans are swept on their own rules; every outcome is checked against the model."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import sqlite3
import subprocess
import sys
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime, timedelta
from pathlib import Path

import grpc
import pytest

from devtools.cluster import free_port
from retina_common import failpoints, file_names
from retina_common.catalog import Catalog, FileRecord, FileType
from retina_common.pb import retina_pb2 as rpb
from retina_common.pb import trans_pb2 as tpb
from retina_common.reader import HIDDEN
from retina_common.recovery_driver import RecoveryFailed
from retina_common.storage import write_durably
from retina_server.gc.retention_guard import HoldReason, Holds, hold_reason

from . import gc
from .dataplane import SCHEMA, DataPlane
from .support import eventually, rpc_error
from .test_deploy_monitoring import scrape, value
from .test_recovery_protocol import order
from .test_recovery_sequences import restart_and_recover
from .test_storage_gc import all_streams_rewritten, load

NOW = 1_000_000
ORPHAN_REMOVED = "no catalog row, journal entry or rewrite names it"


# --- the retention guard: one test per reason ------------------------------------------------
def _retired(cleanup_at: int = NOW - 1, file_id: int = 7) -> FileRecord:
    return FileRecord(file_id, "f.parquet", FileType.RETIRED, 1, 1, 0, 9, cleanup_at)


def _holds(**kw: object) -> Holds:
    base: dict[str, object] = {"now_ms": NOW, "reader_files": frozenset(),
                               "listings_in_flight": 0, "checkpoint_files": frozenset(),
                               "journal_anchors": frozenset()}
    return Holds(**{**base, **kw})  # type: ignore[arg-type]


def test_guard_lets_a_due_unheld_retired_file_go() -> None:
    assert hold_reason(_retired(), _holds()) is None


def test_guard_holds_a_retired_file_before_its_cleanup_at() -> None:
    assert hold_reason(_retired(cleanup_at=NOW + 1), _holds()) == \
        HoldReason.CLEANUP_AT_NOT_PASSED


def test_guard_holds_a_temporary_file_before_its_ttl() -> None:
    temp = FileRecord(7, "f.parquet", FileType.TEMPORARY_INGEST, 0, 1, None, None, None)
    assert hold_reason(temp, _holds(), due_at_ms=NOW + 1) == HoldReason.TTL_NOT_PASSED
    assert hold_reason(temp, _holds(), due_at_ms=NOW) is None


def test_guard_holds_everything_while_reader_holds_are_unknown() -> None:
    assert hold_reason(_retired(), _holds(reader_files=None)) == HoldReason.READ_HOLDS_UNKNOWN


def test_guard_holds_everything_while_a_listing_is_in_flight() -> None:
    assert hold_reason(_retired(), _holds(listings_in_flight=1)) == \
        HoldReason.LISTING_IN_FLIGHT


def test_guard_holds_a_file_a_live_reader_listed() -> None:
    assert hold_reason(_retired(), _holds(reader_files=frozenset({7}))) == \
        HoldReason.LIVE_READER
    assert hold_reason(_retired(), _holds(reader_files=frozenset({8}))) is None


def test_guard_holds_a_file_a_checkpoint_slot_names_or_when_slots_are_unreadable() -> None:
    assert hold_reason(_retired(), _holds(checkpoint_files=frozenset({7}))) == \
        HoldReason.CHECKPOINT_SLOT
    assert hold_reason(_retired(), _holds(checkpoint_files=None)) == HoldReason.CHECKPOINT_SLOT


def test_guard_holds_a_rollback_anchor_of_an_open_journal_entry() -> None:
    assert hold_reason(_retired(), _holds(journal_anchors=frozenset({7}))) == \
        HoldReason.JOURNAL_ANCHOR


def test_guard_holds_an_orphan_candidate_by_its_grace_and_by_the_holds_on_every_file() -> None:
    """``file=None``: an object no catalog row names. It has no id for a reader, slot or
    journal entry to name, but its grace and every hold that covers all files apply."""
    assert hold_reason(None, _holds(), due_at_ms=NOW + 1) == HoldReason.GRACE_NOT_PASSED
    assert hold_reason(None, _holds(), due_at_ms=None) == HoldReason.GRACE_NOT_PASSED
    assert hold_reason(None, _holds(), due_at_ms=NOW) is None
    assert hold_reason(None, _holds(reader_files=None), due_at_ms=NOW) == \
        HoldReason.READ_HOLDS_UNKNOWN
    assert hold_reason(None, _holds(listings_in_flight=2), due_at_ms=NOW) == \
        HoldReason.LISTING_IN_FLIGHT
    assert hold_reason(None, _holds(checkpoint_files=None), due_at_ms=NOW) == \
        HoldReason.CHECKPOINT_SLOT
    everything = _holds(reader_files=frozenset({7}), checkpoint_files=frozenset({7}),
                        journal_anchors=frozenset({7}))
    assert hold_reason(None, everything, due_at_ms=NOW) is None


# --- helpers ----------------------------------------------------------------------------------
def sweep(plane: DataPlane, node: str, *passes: str, dry_run: bool = False,
          grace_ms: int = 0) -> rpb.RunSweeperResponse:
    return plane.retinas[node].stub.RunSweeper(rpb.RunSweeperRequest(
        passes=list(passes), dry_run=dry_run, orphan_grace_ms=grace_ms), timeout=60)


def retired_rows(catalog: Catalog, plane: DataPlane) -> list[FileRecord]:
    path = catalog.get_paths(plane.tables["orders"].table_id)[0]
    return catalog.get_files_by_type(path.path_id, [FileType.RETIRED])


def ranged_files(plane: DataPlane, node: str) -> set[int]:
    """File ids with MainIndex ranges in the node's durable index (read-only)."""
    db = plane.workdir / "state" / node.replace(":", "-") / "index" / "main_index.sqlite"
    conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    try:
        return {int(f) for (f,) in conn.execute("SELECT DISTINCT file_id FROM row_id_ranges")}
    finally:
        conn.close()


def stored(path_uri: str, name: str) -> bool:
    return (Path(path_uri.removeprefix("file://")) / name).exists()


def rewritten(plane: DataPlane, catalog: Catalog) -> tuple[str, list[FileRecord]]:
    """Load orders, rewrite every stream, and checkpoint twice (neither slot holds the
    old files any more). Returns the node and the files the rewrites retired."""
    load(plane, catalog)
    node = plane.nodes[0]
    all_streams_rewritten(plane)
    retired = retired_rows(catalog, plane)
    assert retired
    plane.checkpoint(node)
    plane.checkpoint(node)
    return node, retired


def assert_swept(plane: DataPlane, catalog: Catalog, node: str, files: list[FileRecord]) -> None:
    path = catalog.get_paths(plane.tables["orders"].table_id)[0]
    ids = {f.file_id for f in files}
    assert not ids & {f.file_id for f in catalog.get_files_by_type(None, list(FileType))}
    assert not any(stored(path.uri, f.name) for f in files)
    assert not ids & ranged_files(plane, node)


# --- the retired-file sweeper --------------------------------------------------------------------
@pytest.mark.integration
def test_retired_files_go_once_no_slot_holds_them_and_reads_stay_exact(
        make_plane: Callable[..., DataPlane], catalog: Catalog) -> None:
    plane = make_plane(gc_retired_retention_ms=0, sweeper_interval_ms=0)
    load(plane, catalog)
    node = plane.nodes[0]
    all_streams_rewritten(plane)
    retired = retired_rows(catalog, plane)
    ids = {f.file_id for f in retired}
    # The current slot still holds the old files, then the previous one does.
    for _ in range(2):
        reply = sweep(plane, node, "retired")
        assert reply.removed == 0
        assert {o.file_id: o.reason for o in reply.objects if o.action == "held"} == \
            dict.fromkeys(ids, "checkpoint_slot")
        plane.checkpoint(node)
    dry = sweep(plane, node, "retired", dry_run=True)
    assert {o.file_id for o in dry.objects if o.action == "would_remove"} == ids
    assert {f.file_id for f in retired_rows(catalog, plane)} == ids  # a dry run removes nothing
    reply = sweep(plane, node, "retired")
    assert reply.removed == len(ids) and reply.bytes_removed > 0
    assert_swept(plane, catalog, node, retired)
    assert plane.read("orders") == plane.model.rows["orders"]
    # The moved rows are still found; two restarts in a row converge.
    plane.commit({"orders": {"deletes": [{"id": i} for i in range(1, 120, 4)],
                             "replaces": [order(i, note="s") for i in range(2, 120, 4)]}})
    for _ in range(2):
        restart_and_recover(plane, node)
        assert plane.read("orders") == plane.model.rows["orders"]
    # A restart's cleansing retires the files published after the last checkpoint
    # (their rows are rewound and replayed): whether there are any depends on when
    # the publisher ran (load's last write to events, say). Those may go at once;
    # the rewritten files never come back.
    leftovers = {f.file_id for t in plane.tables.values()
                 for p in catalog.get_paths(t.table_id)
                 for f in catalog.get_files_by_type(p.path_id, [FileType.RETIRED])}
    assert not leftovers & ids
    sweep(plane, node, "retired")
    assert sweep(plane, node, "retired").removed == 0  # nothing left to do
    for table in ("orders", "events"):  # none of them was needed
        assert plane.read(table) == plane.model.rows[table]


@pytest.mark.integration
def test_a_reader_that_listed_a_retired_file_keeps_it_until_it_ends(
        make_plane: Callable[..., DataPlane], catalog: Catalog) -> None:
    plane = make_plane(gc_retired_retention_ms=0, sweeper_interval_ms=0)
    load(plane, catalog)
    node = plane.nodes[0]
    assert plane.reader is not None
    expected = plane.model.snapshot()["orders"]
    writer = plane.writers["orders"]
    with plane.reader.transaction() as old:
        listing = plane.trans.stub().ListQueryFiles(tpb.ListQueryFilesRequest(
            trans_id=old.trans_id, schema_name=SCHEMA, table_name="orders"), timeout=10)
        listed = {f.file_id for f in listing.files}
        # The reader is offloaded: it no longer holds safeGcTs, but still its files.
        plane.trans.stub().MarkTransOffloaded(tpb.MarkTransOffloadedRequest(
            trans_id=old.trans_id), timeout=10)
        # It lists nothing more: GC no longer waits for its snapshot.
        with pytest.raises(grpc.RpcError) as refused:
            plane.trans.stub().ListQueryFiles(tpb.ListQueryFilesRequest(
                trans_id=old.trans_id, schema_name=SCHEMA, table_name="orders"), timeout=10)
        assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        all_streams_rewritten(plane)
        plane.checkpoint(node)
        plane.checkpoint(node)
        reply = sweep(plane, node, "retired")
        held = {o.file_id: o.reason for o in reply.objects if o.action == "held"}
        assert held and set(held.values()) == {"live_reader"} and set(held) <= listed
        assert reply.removed == 0
        rows = [{k: v for k, v in r.items() if k not in HIDDEN}
                for f in listing.files for r in plane.reader.read_file(f, old).to_pylist()]
        assert {writer.key(r): r for r in rows} == expected
    reply = sweep(plane, node, "retired")
    assert reply.removed == len(held)
    assert plane.read("orders") == plane.model.rows["orders"]


SWEEP_POINTS = ["sweeper.retired.visibility.before", "sweeper.retired.visibility.after",
                "sweeper.retired.main_index.before", "sweeper.retired.main_index.after",
                "sweeper.retired.object.before", "sweeper.retired.object.after",
                "sweeper.retired.catalog.before", "sweeper.retired.catalog.after"]


@pytest.mark.integration
@pytest.mark.parametrize("point", SWEEP_POINTS)
def test_a_kill_at_every_sweeper_step_is_finished_by_the_next_round(
        point: str, make_plane: Callable[..., DataPlane], catalog: Catalog) -> None:
    plane = make_plane(gc_retired_retention_ms=0, sweeper_interval_ms=0)
    node, retired = rewritten(plane, catalog)
    retina = plane.retinas[node]
    retina.stop()
    retina.start(f"{point}=exit(137)")
    plane.recover(node)
    err = rpc_error(lambda: sweep(plane, node, "retired"))
    assert err.code() == grpc.StatusCode.UNAVAILABLE
    assert retina.wait_exit() == 137
    retina.start()
    plane.recover(node)
    assert plane.read("orders") == plane.model.rows["orders"]
    sweep(plane, node, "retired")
    assert_swept(plane, catalog, node, retired)
    assert plane.read("orders") == plane.model.rows["orders"]
    plane.commit({"orders": {"deletes": [{"id": i} for i in range(1, 120, 5)]}})
    restart_and_recover(plane, node)
    assert plane.read("orders") == plane.model.rows["orders"]


def by_file(reply: rpb.RunSweeperResponse) -> dict[int, tuple[str, str]]:
    return {o.file_id: (o.action, o.reason) for o in reply.objects}


@pytest.mark.integration
def test_a_removal_that_fails_is_skipped_and_retried_after_its_backoff_while_the_rest_go(
        make_plane: Callable[..., DataPlane], catalog: Catalog) -> None:
    """ONE_FAILURE_NEVER_STALLS_A_SWEEP: a RETIRED file and a TEMPORARY_INGEST leftover
    whose objects the store refuses to delete (a directory stands in their place), each
    the first of its pass, are skipped with a metric; every other file goes in the same
    round; the next round leaves them alone (backoff); once the store lets them go, the
    round after removes them, and reads equal the model throughout."""
    plane = make_plane(gc_retired_retention_ms=0, sweeper_interval_ms=0,
                       gc_prepare_ttl_ms=1_000, temporary_file_ttl_ms=60_000)
    node = plane.nodes[0]
    retina = plane.retinas[node]
    retina.stop()
    retina.metrics_listen = f"127.0.0.1:{free_port()}"
    retina.start()
    plane.recover(node)
    node, retired = rewritten(plane, catalog)
    path = catalog.get_paths(plane.tables["orders"].table_id)[0]
    directory = Path(path.uri.removeprefix("file://"))
    two_hours_ago = datetime.now(UTC) - timedelta(hours=2)
    leftovers = {}
    for seq in (9_200_001, 9_200_002, 9_200_003):
        name = file_names.make(node, two_hours_ago, seq, 0)
        leftovers[catalog.add_file(name, FileType.TEMPORARY_INGEST, 0, path.path_id).file_id] = name
        write_durably(path.uri, name, b"left by a crash")
    stuck = {min(leftovers): leftovers[min(leftovers)],
             min(f.file_id for f in retired): min(retired, key=lambda f: f.file_id).name}
    for name in stuck.values():  # the store refuses: an OSError on every delete
        (directory / name).unlink()
        (directory / name).mkdir()
        (directory / name / "x").write_bytes(b"x")
    everything = set(leftovers) | {f.file_id for f in retired}

    reply = by_file(sweep(plane, node, "temporary", "retired"))
    assert {f: reply[f] for f in stuck} == dict.fromkeys(stuck, ("held", "removal_failed"))
    assert {reply[f][0] for f in everything - set(stuck)} == {"removed"}
    assert_swept(plane, catalog, node, [f for f in retired if f.file_id not in stuck])
    left = {f.file_id for f in catalog.get_files_by_type(None, list(FileType))}
    assert left & everything == set(stuck)
    page = scrape(retina.metrics_listen)
    for pass_name in ("temporary", "retired"):
        assert value(page, "retina_sweeper_removal_failures_total", **{"pass": pass_name}) == 1
        assert value(page, "retina_sweeper_files_in_backoff", **{"pass": pass_name}) == 1
    assert plane.read("orders") == plane.model.rows["orders"]

    reply = by_file(sweep(plane, node, "temporary", "retired"))  # backing off
    assert reply == dict.fromkeys(stuck, ("held", "removal_backoff"))
    for name in stuck.values():  # the store lets go
        shutil.rmtree(directory / name)
    reply = by_file(sweep(plane, node, "temporary", "retired"))
    assert {reply[f][0] for f in stuck} == {"removed"}
    assert not {f.file_id for f in catalog.get_files_by_type(None, list(FileType))} & everything
    assert_swept(plane, catalog, node, retired)
    page = scrape(retina.metrics_listen)
    for pass_name in ("temporary", "retired"):
        assert value(page, "retina_sweeper_files_in_backoff", **{"pass": pass_name}) == 0
    assert plane.read("orders") == plane.model.rows["orders"]
    restart_and_recover(plane, node)
    assert plane.read("orders") == plane.model.rows["orders"]


# --- temporary files, checkpoint bodies, orphans -----------------------------------------------
@pytest.mark.integration
def test_temporary_files_past_their_ttl_go_unless_something_names_them(
        make_plane: Callable[..., DataPlane], catalog: Catalog) -> None:
    plane = make_plane(sweeper_interval_ms=0, gc_prepare_ttl_ms=1_000,
                       temporary_file_ttl_ms=60_000)
    node = plane.nodes[0]
    plane.commit({"orders": {"replaces": [order(i) for i in range(40)]}})
    path = catalog.get_paths(plane.tables["orders"].table_id)[0]
    old = datetime.now(UTC) - timedelta(hours=2)
    planted = {}
    for seq, kind in ((9_000_001, FileType.TEMPORARY_INGEST), (9_000_002, FileType.TEMPORARY_GC)):
        name = file_names.make(node, old, seq, 0)
        planted[catalog.add_file(name, kind, 0, path.path_id).file_id] = name
        write_durably(path.uri, name, b"leftover of a crash")
    young = file_names.make(node, datetime.now(UTC), 9_000_003, 0)
    young_id = catalog.add_file(young, FileType.TEMPORARY_GC, 0, path.path_id).file_id
    odd = catalog.add_file("not-a-retina-name.parquet", FileType.TEMPORARY_INGEST, 0,
                           path.path_id).file_id
    reply = sweep(plane, node, "temporary")
    assert {o.file_id for o in reply.objects if o.action == "removed"} == set(planted)
    left = {f.file_id for f in catalog.get_files_by_type(None, list(FileType))}
    assert not left & set(planted) and {young_id, odd} <= left  # young, or not parseable
    assert not any(stored(path.uri, n) for n in planted.values())
    assert plane.read("orders") == plane.model.rows["orders"]  # live ingest files untouched


@pytest.mark.integration
def test_an_ingest_leftover_past_its_ttl_goes_with_its_main_index_ranges(
        make_plane: Callable[..., DataPlane], catalog: Catalog) -> None:
    """LEFTOVER_RANGES_GO_WITH_THE_FILE in the temporary sweeper: a TEMPORARY_INGEST row,
    its object and its durable MainIndex ranges, in no write buffer (what a kill between
    ``ingest.index_flush.after`` and the REGULAR step leaves; cleansing normally takes it
    at the restart, so the state is put in place on the running node) are removed
    together, the ranges before the row."""
    plane = make_plane(sweeper_interval_ms=0, gc_prepare_ttl_ms=1_000,
                       temporary_file_ttl_ms=60_000)
    node = plane.nodes[0]
    plane.commit({"orders": {"replaces": [order(i) for i in range(40)]}})
    path = catalog.get_paths(plane.tables["orders"].table_id)[0]
    name = file_names.make(node, datetime.now(UTC) - timedelta(hours=2), 9_300_001, 0)
    leftover = catalog.add_file(name, FileType.TEMPORARY_INGEST, 0, path.path_id).file_id
    write_durably(path.uri, name, b"left by a crash after its index flush")
    db = plane.workdir / "state" / node.replace(":", "-") / "index" / "main_index.sqlite"
    with contextlib.closing(sqlite3.connect(db, timeout=30, isolation_level=None)) as conn:
        conn.execute("BEGIN IMMEDIATE")
        conn.executemany("INSERT INTO row_id_ranges VALUES (?, ?, ?, ?, ?)",
                         [(10**15 + 16 * rg, 16, leftover, rg, 0) for rg in range(2)])
        conn.execute("INSERT INTO row_id_range_flush_markers VALUES (?, ?)", (leftover, 32))
        conn.execute("COMMIT")
    assert leftover in ranged_files(plane, node)
    reply = sweep(plane, node, "temporary")
    assert by_file(reply)[leftover] == ("removed", "TEMPORARY_INGEST past its TTL")
    assert leftover not in ranged_files(plane, node)
    with contextlib.closing(sqlite3.connect(f"file:{db}?mode=ro", uri=True)) as conn:
        assert conn.execute("SELECT COUNT(*) FROM row_id_range_flush_markers "
                            "WHERE file_id = ?", (leftover,)).fetchone() == (0,)
    assert catalog.get_file(leftover) is None and not stored(path.uri, name)
    assert plane.read("orders") == plane.model.rows["orders"]
    restart_and_recover(plane, node)
    assert plane.read("orders") == plane.model.rows["orders"]


@pytest.mark.integration
def test_checkpoint_bodies_no_slot_references_are_removed_newer_ones_stay(
        make_plane: Callable[..., DataPlane], catalog: Catalog) -> None:
    plane = make_plane(sweeper_interval_ms=0)
    node = plane.nodes[0]
    plane.commit({"orders": {"replaces": [order(i) for i in range(20)]}})
    for _ in range(3):
        current = plane.checkpoint(node).checkpoint_id
    directory = plane.workdir / "storage" / "_checkpoints" / node.replace(":", "-")
    stale = f"ckpt-{1:020d}.bin"
    ahead = f"ckpt-{current + 1000:020d}.bin"  # an install under way
    for name in (stale, ahead):
        (directory / name).write_bytes(b"x")
    reply = sweep(plane, node, "checkpoints")
    assert [o.name for o in reply.objects if o.action == "removed"] == [stale]
    bodies = sorted(p.name for p in directory.iterdir())
    assert ahead in bodies and len(bodies) == 3  # current, previous and the one ahead
    restart_and_recover(plane, node)
    assert plane.read("orders") == plane.model.rows["orders"]


@pytest.mark.integration
def test_orphans_are_reported_by_a_dry_run_and_removed_after_their_grace(
        make_plane: Callable[..., DataPlane], catalog: Catalog) -> None:
    plane = make_plane(sweeper_interval_ms=0)
    node = plane.nodes[0]
    plane.commit({"orders": {"replaces": [order(i) for i in range(30)]}})
    path = catalog.get_paths(plane.tables["orders"].table_id)[0]
    directory = Path(path.uri.removeprefix("file://"))
    directory.mkdir(parents=True, exist_ok=True)
    orphan = file_names.make(node, datetime.now(UTC) - timedelta(days=2), 8_000_001, 1)
    tmp_orphan = "." + file_names.make(node, datetime.now(UTC) - timedelta(days=2),
                                       8_000_002, 1) + ".tmp"
    fresh = file_names.make(node, datetime.now(UTC), 8_000_003, 1)
    two_days_ago = (datetime.now(UTC) - timedelta(days=2)).timestamp()
    for name in (orphan, tmp_orphan, fresh, "README.txt"):
        (directory / name).write_bytes(b"nobody knows me")
        if name != fresh:  # written long ago (the grace counts from the later time)
            os.utime(directory / name, (two_days_ago, two_days_ago))
    before = {f.file_id for f in catalog.get_files_by_type(None, list(FileType))}
    cli = subprocess.run(
        [sys.executable, "-m", "retina_common.gc_cli", "--config", str(plane.config_path),
         "--node", node, "orphans", "--dry-run", "--grace-ms", "3600000", "--json"],
        capture_output=True, text=True, timeout=60, check=False)
    assert cli.returncode == 0, cli.stderr
    report = json.loads(cli.stdout)[node]
    actions = {o["name"]: (o["action"], o["reason"]) for o in report["objects"]}
    assert actions[orphan][0] == actions[tmp_orphan][0] == "would_remove"
    assert actions[fresh] == ("held", "grace_not_passed")
    assert actions["README.txt"] == ("held", "foreign_name")
    assert all((directory / n).exists() for n in (orphan, tmp_orphan, fresh))
    reply = sweep(plane, node, "orphans", grace_ms=3_600_000)
    assert {o.name for o in reply.objects if o.action == "removed"} == {orphan, tmp_orphan}
    assert not (directory / orphan).exists() and (directory / fresh).exists()
    assert {f.file_id for f in catalog.get_files_by_type(None, list(FileType))} == before
    assert plane.read("orders") == plane.model.rows["orders"]


def _plant_orphan(plane: DataPlane, catalog: Catalog, node: str, seq: int) -> tuple[Path, str]:
    """An object of this node's name format, named and written two days ago, that nothing
    names: what a crash between an object's write and its catalog row leaves."""
    path = catalog.get_paths(plane.tables["orders"].table_id)[0]
    directory = Path(path.uri.removeprefix("file://"))
    directory.mkdir(parents=True, exist_ok=True)
    two_days_ago = datetime.now(UTC) - timedelta(days=2)
    name = file_names.make(node, two_days_ago, seq, 1)
    (directory / name).write_bytes(b"nobody knows me")
    os.utime(directory / name, (two_days_ago.timestamp(), two_days_ago.timestamp()))
    return directory, name


def outcome(reply: rpb.RunSweeperResponse, name: str) -> tuple[str, str] | None:
    """(action, reason) of one object in a sweep's answer (None: not reported). An
    ingest file's ``.tmp`` being written may be reported too (held by its grace)."""
    found = [(o.action, o.reason) for o in reply.objects if o.name == name]
    assert len(found) <= 1, found
    return found[0] if found else None


@pytest.mark.integration
def test_the_orphan_pass_refuses_a_grace_below_an_hour_and_asks_the_retention_guard(
        make_plane: Callable[..., DataPlane], catalog: Catalog) -> None:
    """ORPHAN_GRACE_ABOVE_ANY_COMMIT and the guard: a grace below the minimum is refused
    (nothing removed), and while the TransServer cannot say which files readers hold,
    an orphan candidate is held like every other file."""
    plane = make_plane(sweeper_interval_ms=0)
    node = plane.nodes[0]
    plane.commit({"orders": {"replaces": [order(i) for i in range(30)]}})
    directory, orphan = _plant_orphan(plane, catalog, node, 8_100_001)
    for grace_ms in (1, 3_599_999):
        for dry_run in (True, False):
            err = rpc_error(lambda g=grace_ms, d=dry_run: sweep(plane, node, "orphans",
                                                                 dry_run=d, grace_ms=g))
            assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, err
            assert "below the minimum orphan grace 3600000" in err.details()
    assert (directory / orphan).exists()
    plane.trans.stop()
    reply = sweep(plane, node, "orphans", grace_ms=3_600_000)
    assert outcome(reply, orphan) == ("held", "read_holds_unknown")
    assert (directory / orphan).exists()
    plane.trans.start()

    def removed() -> bool:  # held until the node's channel to the TransServer is back
        action = outcome(sweep(plane, node, "orphans", grace_ms=3_600_000), orphan)
        assert action is not None and action[0] in ("held", "removed"), action
        assert action[1] in ("read_holds_unknown", ORPHAN_REMOVED), action
        return action[0] == "removed"
    eventually(removed, 30, "the orphan to be removed once read holds are known")
    assert not (directory / orphan).exists()
    assert plane.read("orders") == plane.model.rows["orders"]


@pytest.mark.integration
def test_an_orphan_candidate_named_before_its_delete_is_kept(
        make_plane: Callable[..., DataPlane], catalog: Catalog, failpoint_dir: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """RECHECKED_BEFORE_DELETE: a catalog row committed after the pass read the names (a
    GC task registering its file) keeps the object; the pass asks again by path and
    name just before the delete."""
    monkeypatch.setenv(failpoints.DIR_VAR, str(failpoint_dir))
    plane = make_plane(sweeper_interval_ms=0, failpoints="sweeper.orphan.delete.before=block")
    node = plane.nodes[0]
    plane.commit({"orders": {"replaces": [order(i) for i in range(30)]}})
    directory, name = _plant_orphan(plane, catalog, node, 8_100_002)
    path = catalog.get_paths(plane.tables["orders"].table_id)[0]
    with ThreadPoolExecutor(1) as pool:
        pending = pool.submit(sweep, plane, node, "orphans", grace_ms=3_600_000)
        failpoints.wait_hit(failpoint_dir, "sweeper.orphan.delete.before")
        row = catalog.add_file(name, FileType.TEMPORARY_GC, 0, path.path_id)
        failpoints.release(failpoint_dir, "sweeper.orphan.delete.before")
        reply = pending.result(timeout=60)
    assert outcome(reply, name) == ("held", "named_since_listing")
    assert (directory / name).exists()
    assert catalog.get_file(row.file_id) == row
    reply = sweep(plane, node, "orphans", grace_ms=3_600_000)  # known now: not a candidate
    assert outcome(reply, name) is None and (directory / name).exists()
    assert plane.read("orders") == plane.model.rows["orders"]


@pytest.mark.integration
def test_final_journal_records_go_after_the_lineage_retention_once_settled(
        make_plane: Callable[..., DataPlane], catalog: Catalog) -> None:
    plane = make_plane(gc_retired_retention_ms=0, sweeper_interval_ms=0,
                       gc_lineage_retention_ms=0)
    node, _retired = rewritten(plane, catalog)
    entries = gc.journal(plane, node)
    assert entries and {e.state for e in entries.values()} == {"CHECKPOINTED"}
    reply = sweep(plane, node, "journal")  # the old files are still RETIRED
    assert reply.removed == 0 and {o.reason for o in reply.objects} == {"files_unsettled"}
    sweep(plane, node, "retired")
    reply = sweep(plane, node, "journal")
    assert reply.removed == len(entries) and gc.journal(plane, node) == {}
    restart_and_recover(plane, node)
    assert plane.read("orders") == plane.model.rows["orders"]


@pytest.mark.integration
def test_sweeper_requests_outside_ready_or_malformed_change_nothing(
        make_plane: Callable[..., DataPlane], catalog: Catalog) -> None:
    plane = make_plane(sweeper_interval_ms=0)
    node = plane.nodes[0]
    err = rpc_error(lambda: sweep(plane, node, "everything"))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    err = rpc_error(lambda: plane.retinas[node].stub.RevertGcRewrite(
        rpb.RevertGcRewriteRequest(rewrite_id="nope"), timeout=10))
    assert err.code() == grpc.StatusCode.NOT_FOUND
    retina = plane.retinas[node]
    retina.kill9()
    retina.start()
    plane.wait_replay_ready(node)
    err = rpc_error(lambda: sweep(plane, node, "retired"))
    assert err.code() == grpc.StatusCode.UNAVAILABLE
    plane.recover(node)
    assert catalog.get_files_by_type(None, [FileType.RETIRED]) == []


# --- a kill at every other sweeper delete --------------------------------------------------------
OTHER_POINTS = {
    "sweeper.temporary.object.before": "temporary", "sweeper.temporary.object.after": "temporary",
    "sweeper.temporary.catalog.before": "temporary",
    "sweeper.temporary.catalog.after": "temporary",
    "sweeper.orphan.delete.before": "orphans", "sweeper.orphan.delete.after": "orphans",
    "sweeper.journal.remove.before": "journal", "sweeper.journal.remove.after": "journal",
    "checkpoint.body_delete.before": "checkpoints", "checkpoint.body_delete.after": "checkpoints",
}


@pytest.mark.integration
@pytest.mark.parametrize("point", list(OTHER_POINTS))
def test_a_kill_at_every_other_sweeper_delete_is_finished_by_the_next_round(
        point: str, make_plane: Callable[..., DataPlane], catalog: Catalog) -> None:
    plane = make_plane(gc_retired_retention_ms=0, sweeper_interval_ms=0,
                       gc_lineage_retention_ms=0, gc_prepare_ttl_ms=1_000,
                       temporary_file_ttl_ms=60_000)
    node = plane.nodes[0]
    kind = OTHER_POINTS[point]
    load(plane, catalog)
    path = catalog.get_paths(plane.tables["orders"].table_id)[0]
    directory = Path(path.uri.removeprefix("file://"))
    long_ago = datetime.now(UTC) - timedelta(days=2)
    leftover = file_names.make(node, long_ago, 9_100_001, 0)

    def gone() -> bool:
        if kind == "temporary":
            return not (directory / leftover).exists() and leftover not in \
                {f.name for f in catalog.get_files_by_type(None, list(FileType))}
        if kind == "orphans":
            return not (directory / leftover).exists()
        if kind == "journal":
            return gc.journal(plane, node) == {}
        return not (checkpoints / leftover).exists()

    checkpoints = plane.workdir / "storage" / "_checkpoints" / node.replace(":", "-")

    def plant() -> None:
        if kind == "temporary":
            catalog.add_file(leftover, FileType.TEMPORARY_INGEST, 0, path.path_id)
            write_durably(path.uri, leftover, b"left by a crash")
        elif kind == "orphans":
            (directory / leftover).write_bytes(b"nobody knows me")
            stamp = long_ago.timestamp()
            os.utime(directory / leftover, (stamp, stamp))
        elif kind == "journal":
            all_streams_rewritten(plane)
            plane.checkpoint(node)
            plane.checkpoint(node)
            sweep(plane, node, "retired")
            assert gc.journal(plane, node)
        else:
            (checkpoints / leftover).write_bytes(b"stale")

    if kind == "checkpoints":
        leftover = f"ckpt-{1:020d}.bin"
        plant()  # before: the READY checkpoint of the restart below may be what dies
    retina = plane.retinas[node]
    retina.stop()
    retina.start(f"{point}=exit(137)")
    with contextlib.suppress(grpc.RpcError, RecoveryFailed, AssertionError, TimeoutError):
        plane.recover(node)
        if kind != "checkpoints":
            # After the restart: its cleansing would retire a planted TEMPORARY_INGEST.
            plant()
        sweep(plane, node, kind, grace_ms=3_600_000)
    assert retina.wait_exit() == 137
    retina.start()
    plane.recover(node)
    assert plane.read("orders") == plane.model.rows["orders"]
    sweep(plane, node, kind, grace_ms=3_600_000)
    assert gone()
    plane.commit({"orders": {"deletes": [{"id": i} for i in range(1, 120, 5)]}})
    restart_and_recover(plane, node)
    assert plane.read("orders") == plane.model.rows["orders"]
