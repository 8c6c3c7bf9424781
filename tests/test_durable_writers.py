"""Every acknowledged write survives a crash, whoever wrote it (issue 26).

Real processes throughout: etcd, PostgreSQL (catalog and CDC source), a TransServer,
two Retina nodes that refuse anonymous writes, ``retina-cdc``, and application
writers (``retina_common.writer.DurableWriter`` in the test, ``retina-write`` as a
process of its own where it must die at a failpoint). A model of every table is kept
beside the system and whole snapshots are compared after every crash.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import grpc
import pytest

from retina_common import replay_sources
from retina_common.catalog import Catalog
from retina_common.etcd import EtcdStore
from retina_common.pb import retina_pb2 as rpb
from retina_common.refusal import SOURCES_NOT_REPLAYED
from retina_common.writer import WriteInDoubt, WriterSettings
from retina_server.recovery.registered_writers import REFRESH_S

from .cdc import CdcPlane, normalise
from .dataplane import SCHEMA, DataPlane
from .support import ROOT, eventually
from .test_cdc_connector import make_cdc  # noqa: F401  (a fixture)

pytestmark = pytest.mark.integration

STRICT = {"anonymous_writes": False, "checkpoint_interval_ms": 3_600_000}


def event(tenant: int, seq: int, payload: bytes = b"p", ok: bool = True) -> dict[str, Any]:
    return {"tenant": tenant, "seq": seq, "payload": payload, "ok": ok}


def keyed(plane: DataPlane, table: str, rows: Mapping[Any, Mapping[str, Any]] | list
          ) -> dict[bytes, dict[str, Any]]:
    items = rows.values() if isinstance(rows, Mapping) else rows
    return {plane.writers[table].key(r): normalise(table, dict(r)) for r in items}


def read(plane: DataPlane, table: str) -> dict[bytes, dict[str, Any]]:
    """One gated snapshot of ``table``. After a restart, a snapshot below the node's read
    floor is refused ABORTED until the HWM passes it: a writer killed with its transaction
    open holds the HWM for that transaction's lease (5 s: run_write). Begin again until
    admitted."""
    def attempt() -> dict[bytes, dict[str, Any]] | None:
        try:
            return plane.read(table)
        except grpc.RpcError as exc:
            if exc.code() != grpc.StatusCode.ABORTED:
                raise
            return None
    return eventually(attempt, 40, f"a read of {table} above the read floor", 0.2)


def fullest_node(plane: DataPlane, table: str, rows: list[dict[str, Any]]) -> str:
    """The node that owns most of ``rows``."""
    owners = [plane.topology.node_of_vnode(plane.topology.vnode_of_key(
        plane.writers[table].key(r))) for r in rows]
    return max(plane.nodes, key=owners.count)


def crash_and_restart(plane: DataPlane, node: str) -> None:
    proc = plane.retinas[node]
    proc.kill9()
    proc.start()


def test_application_rows_survive_a_node_crash_with_the_connector_and_two_writers(
        make_cdc: Callable[..., CdcPlane],  # noqa: F811  (the fixture imported above)
        tmp_path: Path) -> None:
    """The issue's scenario: the connector owns shop.orders; two programs write
    shop.events through the client library (committed, acknowledged); SIGKILL of the
    node holding most of them; the connector drives its recovery. Before issue 26 the
    node's replay covered the connector's changelog only and 4 of 5 rows vanished."""
    cdc = make_cdc(retina=STRICT, source_tables="public.orders")
    assert cdc.source is not None
    cdc.cdc.start()
    eventually(cdc.all_ready, 60, "the connector to drive both nodes to READY")
    cdc.source.run(20)
    first = cdc.plane.durable_writer("orders-app", tmp_path / "writers")
    second = cdc.plane.durable_writer("audit-app", tmp_path / "writers")
    model: dict[tuple[int, int], dict[str, Any]] = {}
    batch = [event(1, s, bytes([s])) for s in range(5)]
    first.write("events", upserts=batch)
    model.update({(r["tenant"], r["seq"]): r for r in batch})
    more = [event(2, s, ok=False) for s in range(4)]
    second.write("events", upserts=more)
    model.update({(r["tenant"], r["seq"]): r for r in more})
    first.write("events", deletes=[event(1, 0)])  # a delete must stay deleted, too
    del model[(1, 0)]
    expected = {"orders": keyed(cdc.plane, "orders", cdc.source.rows("orders")),
                "events": keyed(cdc.plane, "events", model)}
    cdc.converged(expected)

    victim = fullest_node(cdc.plane, "events", list(model.values()))
    crash_and_restart(cdc.plane, victim)
    eventually(cdc.all_ready, 90, f"the connector to replay {victim} to READY")
    cdc.converged(expected)
    done = cdc.cdc.logged("cdc_replay_start")
    assert {"orders-app", "audit-app", cdc.cdc.settings["name"]} <= set(done[-1]["writers"])

    # A second crash in a row, with more writes in between, replays again exactly.
    cdc.source.run(10)
    first.write("events", upserts=[event(3, 1)])
    model[(3, 1)] = event(3, 1)
    crash_and_restart(cdc.plane, victim)
    eventually(cdc.all_ready, 90, f"the connector to replay {victim} again")
    cdc.converged({"orders": keyed(cdc.plane, "orders", cdc.source.rows("orders")),
                   "events": keyed(cdc.plane, "events", model)})


def strict_plane(tmp_path: Path, etcd: EtcdStore, catalog: Catalog, catalog_dsn: str
                 ) -> DataPlane:
    plane = DataPlane(tmp_path / "plane", etcd, catalog, catalog_dsn, nodes=2, retina=STRICT)
    plane.start(recover=False)
    return plane


def admin(plane: DataPlane, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "retina_common.admin_cli", "--config",
                           str(plane.config_path), *args], capture_output=True, text=True,
                          timeout=120, cwd=ROOT)


def test_writes_without_a_registered_writer_are_refused_and_change_nothing(
        tmp_path: Path, etcd: EtcdStore, catalog: Catalog, catalog_dsn: str) -> None:
    plane = strict_plane(tmp_path, etcd, catalog, catalog_dsn)
    try:
        assert admin(plane, "recover").returncode == 0  # fresh nodes, nothing to replay
        w = plane.durable_writer("app", tmp_path / "writers")
        w.write("events", upserts=[event(1, 1)])
        # The documented low-level path, with no writer id: refused before anything.
        with pytest.raises(grpc.RpcError) as refused:
            plane.commit({"events": {"inserts": [event(1, 2)]}})
        assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "writer_id" in (refused.value.details() or "")
        # A writer id nobody registered: refused at once (an unknown id is looked up).
        applied: list[dict[str, Any]] = []
        refused = _attempt(plane, "nobody", applied)
        assert refused is not None and not applied
        assert refused.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "nobody" in (refused.details() or "")
        # One declared GONE: refused by every node at most REFRESH_S after the declaration
        # (a write in between is still applied: it stays in the model).
        replay_sources.declare_gone(etcd, "app", "test: changelog deleted")
        refused = eventually(lambda: _attempt(plane, "app", applied), REFRESH_S + 10,
                             "writes of a GONE writer to be refused")
        assert refused.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "declared GONE" in (refused.details() or "")
        assert read(plane, "events") == keyed(plane, "events", [event(1, 1), *applied[:1]])
    finally:
        plane.stop()


def _attempt(plane: DataPlane, writer_id: str,
             applied: list[dict[str, Any]]) -> grpc.RpcError | None:
    """A one-row upsert as ``writer_id`` (the same row every time): its refusal, or None
    if it was applied (then the row is added to ``applied``)."""
    row = event(1, 3)
    try:
        plane.commit({"events": {"replaces": [row]}}, writer_id=writer_id)
    except grpc.RpcError as exc:
        return exc
    applied.append(row)
    return None


def test_a_node_waits_for_every_writer_then_for_an_operator_who_declares_one_gone(
        tmp_path: Path, etcd: EtcdStore, catalog: Catalog, catalog_dsn: str) -> None:
    plane = strict_plane(tmp_path, etcd, catalog, catalog_dsn)
    try:
        assert admin(plane, "recover").returncode == 0
        kept = plane.durable_writer("kept", tmp_path / "writers")
        lost = plane.durable_writer("lost", tmp_path / "writers")
        kept_rows = [event(1, s) for s in range(6)]
        lost_rows = [event(2, s) for s in range(6)]
        kept.write("events", upserts=kept_rows)
        lost.write("events", upserts=lost_rows)
        victim = fullest_node(plane, "events", kept_rows + lost_rows)
        crash_and_restart(plane, victim)
        stub = plane.retinas[victim].stub
        status = plane.wait_replay_ready(victim)
        # A driver that replays one writer only is refused, and the node waits.
        with pytest.raises(grpc.RpcError) as refused:
            stub.MarkReady(rpb.MarkReadyRequest(
                recovery_attempt_token=status.recovery_attempt_token,
                checkpoint_id=status.checkpoint_id, replayed_writers=["kept"]), timeout=30)
        assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert SOURCES_NOT_REPLAYED in (refused.value.details() or "")
        assert "lost" in (refused.value.details() or "")
        assert plane.status(victim).phase == "AWAITING_REPLAY"
        # The operator deletes a changelog and says so; then recover replays the rest.
        listing = json.loads(admin(plane, "writers", "list", "--json").stdout)
        lost_root = next(x["changelog_root"] for x in listing["writers"]
                         if x["writer_id"] == "lost")
        assert lost_root.endswith("/lost")
        gone = admin(plane, "writers", "gone", "lost", "--reason", "disk of the app lost")
        assert gone.returncode == 0, gone.stderr
        done = admin(plane, "recover", "--node", victim)
        assert done.returncode == 0, done.stdout + done.stderr
        survivors = kept_rows + [r for r in lost_rows if plane.topology.node_of_vnode(
            plane.topology.vnode_of_key(plane.writers["events"].key(r))) != victim]
        assert read(plane, "events") == keyed(plane, "events", survivors)
    finally:
        plane.stop()


def crash_recover_and_read(plane: DataPlane, victim: str) -> dict[bytes, dict[str, Any]]:
    """SIGKILL and restart ``victim``, ``retina-admin recover`` (it must succeed), then
    the events table."""
    crash_and_restart(plane, victim)
    recovered = admin(plane, "recover")
    assert recovered.returncode == 0, recovered.stdout + recovered.stderr
    return read(plane, "events")


def run_write(plane: DataPlane, writer_id: str, rows: list[dict[str, Any]],
              failpoint: str = "", *args: str) -> subprocess.CompletedProcess[str]:
    """``retina-write`` in a process of its own (JSON rows: payload as text). Its lease is
    short: a killed writer's transaction holds the HWM (and every read) back for it."""
    text = json.dumps([{**r, "payload": r["payload"].decode()} if "payload" in r else r
                       for r in rows])
    return subprocess.run(
        [sys.executable, "-m", "retina_common.write_cli", "--config", str(plane.config_path),
         "--writer", writer_id, f"{SCHEMA}.events", "--rows", text, "--lease-ms", "5000",
         *args],
        capture_output=True, text=True, timeout=120, cwd=ROOT,
        env={**os.environ, "RETINA_FAILPOINTS": failpoint})


@pytest.mark.parametrize("point", ["writer.append.after", "writer.commit.before",
                                   "writer.acknowledge.before"])
def test_a_writer_killed_after_its_log_append_loses_nothing_acknowledged_and_finishes_on_reopen(
        tmp_path: Path, etcd: EtcdStore, catalog: Catalog, catalog_dsn: str,
        point: str) -> None:
    """The writer dies with its transaction logged (not sent, or sent and not committed):
    it is in doubt, never acknowledged. A node crash then loses nothing acknowledged, and
    each in-doubt row is either absent or exactly as logged (the node that replayed has
    it, the other may not yet); the writer's next run applies it everywhere at a new
    timestamp; a crash after that replays every copy and still converges."""
    plane = strict_plane(tmp_path, etcd, catalog, catalog_dsn)
    try:
        assert admin(plane, "recover").returncode == 0
        done = run_write(plane, "batch-job", [event(1, 1)])
        assert done.returncode == 0, done.stderr
        acknowledged = keyed(plane, "events", [event(1, 1)])
        in_doubt = keyed(plane, "events", [event(1, s, b"doubt") for s in range(2, 8)])
        died = run_write(plane, "batch-job", list(in_doubt.values()), f"{point}=exit(137)")
        assert died.returncode == 137, died.stdout + died.stderr
        victim = fullest_node(plane, "events", list(in_doubt.values()))
        crash_and_restart(plane, victim)
        recovered = admin(plane, "recover")
        assert recovered.returncode == 0, recovered.stdout + recovered.stderr
        got = read(plane, "events")
        assert {k: v for k, v in got.items() if k in acknowledged} == acknowledged
        assert all(k in in_doubt and v == in_doubt[k] for k, v in got.items()
                   if k not in acknowledged), got
        # The writer's next run finishes what it logged, then writes its new row.
        again = run_write(plane, "batch-job", [event(1, 9)])
        assert again.returncode == 0, again.stderr
        model = {**acknowledged, **in_doubt, **keyed(plane, "events", [event(1, 9)])}
        assert read(plane, "events") == model
        # And once more across a crash: the log holds every copy, replay converges.
        assert crash_recover_and_read(plane, victim) == model
    finally:
        plane.stop()


def test_a_transaction_left_in_doubt_by_a_down_node_is_finished_before_the_next_one(
        tmp_path: Path, etcd: EtcdStore, catalog: Catalog, catalog_dsn: str) -> None:
    """A node stays down past the writer's send deadline: commit() raises WriteInDoubt
    (logged, applied on the other node only, lease running out). The same process's next
    commit first sends it again, so the acknowledged mark never passes over it; after the
    node's recovery and that commit, every row is there exactly once, across one more
    crash too."""
    plane = strict_plane(tmp_path, etcd, catalog, catalog_dsn)
    try:
        assert admin(plane, "recover").returncode == 0
        w = plane.durable_writer("impatient", tmp_path / "writers",
                                 WriterSettings(send_deadline_s=2, lease_ms=3000))
        first = [event(1, s) for s in range(8)]
        w.write("events", upserts=first)
        victim = fullest_node(plane, "events", first)
        plane.retinas[victim].kill9()
        stalled = [event(2, s) for s in range(8)]
        with pytest.raises(WriteInDoubt):
            w.write("events", upserts=stalled)
        plane.retinas[victim].start()
        assert admin(plane, "recover").returncode == 0
        last = [event(3, 1)]
        w.write("events", upserts=last)
        model = keyed(plane, "events", first + stalled + last)
        assert read(plane, "events") == model
        assert crash_recover_and_read(plane, victim) == model
    finally:
        plane.stop()


def test_partial_rows_set_some_columns_through_crashes_and_in_doubt(
        tmp_path: Path, etcd: EtcdStore, catalog: Catalog, catalog_dsn: str) -> None:
    """An application sets one column of its rows (``partials``): the others keep their
    values, a key with no row gets NULL there, and the changelog holds the partial rows,
    so a node's crash replays them, and a transaction left in doubt by a down node is
    resent at a new timestamp and merges the same row. What the node would refuse
    whatever its state is refused before anything is logged."""
    plane = strict_plane(tmp_path, etcd, catalog, catalog_dsn)
    try:
        assert admin(plane, "recover").returncode == 0
        w = plane.durable_writer("status-app", tmp_path / "writers",
                                 WriterSettings(send_deadline_s=2, lease_ms=3000))
        rows = {s: event(1, s, bytes([s]) * 3) for s in range(10)}
        w.write("events", upserts=list(rows.values()))
        # Every key of tenant 1: both nodes are asked whether they accept partial updates.
        w.write("events", partials=[{"tenant": 1, "seq": s, "ok": s % 3 == 0}
                                    for s in range(10)]
                + [{"tenant": 7, "seq": 1, "ok": True}])  # no such row: payload NULL
        for s in range(10):
            rows[s] = {**rows[s], "ok": s % 3 == 0}
        rows[-1] = {"tenant": 7, "seq": 1, "payload": None, "ok": True}
        model = keyed(plane, "events", rows)
        assert read(plane, "events") == model
        victim = fullest_node(plane, "events", list(rows.values()))
        assert crash_recover_and_read(plane, victim) == model

        # In doubt: the victim is down past the send deadline.
        plane.retinas[victim].kill9()
        stalled = [{"tenant": 1, "seq": s, "payload": b"set"} for s in range(10)]
        with pytest.raises(WriteInDoubt):
            w.write("events", partials=stalled)
        plane.retinas[victim].start()
        assert admin(plane, "recover").returncode == 0
        w.write("events", partials=[{"tenant": 1, "seq": 0, "ok": False}])
        for s in range(10):
            rows[s] = {**rows[s], "payload": b"set"}
        rows[0] = {**rows[0], "ok": False}
        model = keyed(plane, "events", rows)
        assert read(plane, "events") == model
        assert crash_recover_and_read(plane, victim) == model
        assert crash_recover_and_read(plane, victim) == model  # two restarts in a row

        # Refused before anything is logged: the acknowledged mark and the log stay.
        acked, records = w.acknowledged_ts(), len(list(w.changelog.records(0)))
        for bad, problem in [({"tenant": 1, "ok": True}, r"without its key column\(s\)"),
                             ({"tenant": 1, "seq": 2, "colour": 1}, "no column 'colour'")]:
            with pytest.raises(ValueError, match=problem):
                w.write("events", partials=[bad])
        with pytest.raises(ValueError, match="a partial row and another change"):
            w.write("events", upserts=[event(1, 2)],
                    partials=[{"tenant": 1, "seq": 2, "ok": True}])
        assert (w.acknowledged_ts(), len(list(w.changelog.records(0)))) == (acked, records)
        assert read(plane, "events") == model
        # retina-write --partial: a writer of its own, one column set.
        done = run_write(plane, "status-cli", [{"tenant": 1, "seq": 9, "ok": False}], "",
                         "--partial")
        assert done.returncode == 0, done.stdout + done.stderr
        rows[9] = {**rows[9], "ok": False}
        model = keyed(plane, "events", rows)
        assert crash_recover_and_read(plane, victim) == model
    finally:
        plane.stop()
