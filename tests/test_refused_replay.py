"""A write the write fence refused is not replayed: the history a recovered node answers is
the history its readers saw (issue 28; retina_server/refused_writes.py, read_history.py).

Real processes: etcd, PostgreSQL, a TransServer, two Retina nodes that refuse anonymous
writes, an application writer (DurableWriter) whose batch reaches one node after its
lease ran out and a read passed it (parked before the fence). The node refuses it and
records the refusal; the writer redoes it at T'. Its changelog holds the batch at T and
at T'. The node is SIGKILLed (also at each side of the record) and recovered with
``retina-admin recover``, twice in a row; every AS OF point around T and T' and the change
feed over them equal the model of what readers saw before the crash (APPLIED_OR_LIVE:
retina_server/applied_writes.py; no point is refused any more).
"""

from __future__ import annotations

from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import pytest

from retina_common import failpoints, storage
from retina_common.catalog import Catalog
from retina_common.change_reader import ChangesExpired
from retina_common.changelog import Changelog
from retina_common.etcd import EtcdStore
from retina_common.pb import trans_pb2 as tpb
from retina_common.refusal import SNAPSHOT_EXPIRED
from retina_common.writer import DurableWriter, WriterSettings

from .dataplane import SCHEMA, DataPlane
from .feed_model import expected_changes, feed_changes
from .support import begin_read, begin_write, eventually
from .test_as_of_reads import published
from .test_change_feed import read_feed
from .test_durable_writers import STRICT, admin, event, keyed, read
from .test_snapshot_immutable import parked

pytestmark = pytest.mark.integration

Rows = dict[bytes, dict[str, Any]]
FENCE = "update_record.fence.before"
EVENT_COLUMNS = ("tenant", "seq", "payload", "ok")


def rows_on(plane: DataPlane, node: str, n: int) -> list[tuple[int, int]]:
    """``n`` (tenant, seq) keys of the events table that ``node`` owns."""
    out = []
    seq = 0
    while len(out) < n:
        seq += 1
        key = plane.writers["events"].key({"tenant": 5, "seq": seq})
        if plane.topology.node_of_vnode(plane.topology.vnode_of_key(key)) == node:
            out.append((5, seq))
    return out


def tick(plane: DataPlane) -> None:
    """An empty write transaction: the HWM moves, nothing is written."""
    stub = plane.trans.stub()
    stub.CommitTrans(tpb.CommitTransRequest(trans_id=begin_write(stub).trans_id), timeout=10)


def as_of(plane: DataPlane, ts: int) -> Rows | None:
    """The events table AS OF ``ts``; None if a node refused it snapshot_expired."""
    assert plane.reader is not None
    try:
        snap = plane.reader.read(SCHEMA, "events", as_of_ts=ts)
    except grpc.RpcError as exc:
        assert exc.code() == grpc.StatusCode.FAILED_PRECONDITION, (ts, exc.details())
        assert (exc.details() or "").startswith(SNAPSHOT_EXPIRED), (ts, exc.details())
        return None
    assert snap.timestamp == ts
    writer = plane.writers["events"]
    return {writer.key(r): r for r in snap.table.to_pylist()}


def check(plane: DataPlane, model: list[tuple[int, Rows]], points: Iterable[int]
          ) -> set[int]:
    """Every point exact (the model after its last commit at or before it) or refused
    snapshot_expired; returns the points refused."""
    eventually(lambda: read(plane, "events"), 30, "a read to be answered")
    refused = set()
    for ts in points:
        want = next(rows for committed, rows in reversed(model) if committed <= ts)
        got = as_of(plane, ts)
        if got is None:
            refused.add(ts)
        else:
            assert got == want, f"AS OF {ts} differs from what readers saw"
    return refused


def feed_served(plane: DataPlane, model: list[tuple[int, Rows]], from_ts: int,
                to_ts: int) -> bool:
    """The change feed over ``(from_ts, to_ts]`` equals the model commit by commit (True),
    or is refused changes_expired (False): never a different change."""
    try:
        commits = read_feed(plane, "events", from_ts, to_ts=to_ts)
    except ChangesExpired:
        return False
    got = feed_changes([(c.ts, c.changes) for c in commits], plane.writers["events"].key,
                       EVENT_COLUMNS)
    assert got == expected_changes(model, from_ts, to_ts, EVENT_COLUMNS), (from_ts, to_ts)
    return True


def recovered_with_writer(plane: DataPlane, root: Path,
                          settings: WriterSettings) -> DurableWriter:
    """The started plane recovered, every point from now on kept readable (a pin:
    history_retention_ms is 0 here), and the application writer ``app`` under ``root``."""
    assert admin(plane, "recover").returncode == 0
    stub = plane.trans.stub()
    stub.CreatePin(tpb.CreatePinRequest(name="history", ts=begin_read(stub).timestamp),
                   timeout=10)
    return plane.durable_writer("app", root, settings)


def written_below_the_replay(plane: DataPlane, catalog: Catalog, w: DurableWriter,
                             rows: list[dict[str, Any]], victim: str) -> int:
    """``rows`` written, published, the HWM past them and ``victim`` checkpointed: its
    replay starts above them. Returns their commit timestamp."""
    t0 = w.write("events", upserts=rows)
    published(plane, catalog)
    tick(plane)
    tick(plane)
    plane.checkpoint(victim)
    return t0


def restart(plane: DataPlane, node: str, failpoint: str = "") -> None:
    """SIGKILL (if it still runs) and a new process, recovered by ``retina-admin recover``."""
    plane.retinas[node].kill9()
    plane.retinas[node].start(failpoint)
    recovered = admin(plane, "recover")
    assert recovered.returncode == 0, recovered.stdout + recovered.stderr


def logged_ts(root: Path, above: int) -> int:
    """The newest transaction the writer logged, once it is above ``above``."""
    def newest() -> int | None:
        records = Changelog(storage.root_uri(str(root))).records(above + 1)
        return records[-1].last_ts if records else None
    return eventually(newest, 30, "the writer to log its transaction")


def log_has(plane: DataPlane, node: str, event_name: str) -> bool:
    return f'"{event_name}"' in plane.retinas[node].log_path.read_text()


@pytest.mark.parametrize("die_at", ["", "refused_writes.record.before",
                                    "refused_writes.record.after"])
def test_a_fenced_write_is_not_replayed_and_the_history_around_it_stays_across_two_restarts(
        tmp_path: Path, etcd: EtcdStore, catalog: Catalog, catalog_dsn: str,
        failpoint_dir: Path, monkeypatch: pytest.MonkeyPatch, die_at: str) -> None:
    monkeypatch.setenv(failpoints.DIR_VAR, str(failpoint_dir))
    plane = DataPlane(tmp_path / "plane", etcd, catalog, catalog_dsn, nodes=2, retina=STRICT)
    victim = plane.nodes[0]
    # The victim's second ordinary write parks before the fence; with ``die_at`` the
    # process dies at that side of the refusal's record.
    plane.start({victim: f"{FENCE}=block@2" + (f";{die_at}=exit(137)" if die_at else "")},
                recover=False)
    try:
        root = tmp_path / "writers"
        w = recovered_with_writer(plane, root, WriterSettings(lease_ms=3000,
                                                              send_deadline_s=120))
        stub = plane.trans.stub()
        keys = rows_on(plane, victim, 7)
        before = [event(t, s, b"v0") for t, s in keys[:6]]
        t0 = written_below_the_replay(plane, catalog, w, before, victim)  # its first write
        model: list[tuple[int, Rows]] = [(0, {}), (t0, keyed(plane, "events", before))]

        upserts = [event(t, s, b"v1") for t, s in keys[:4]] + [event(*keys[6], b"v1")]
        with ThreadPoolExecutor(1) as pool:
            redo = pool.submit(w.write, "events", upserts=upserts, deletes=[before[5]])
            with parked(failpoint_dir, FENCE):
                t = logged_ts(root / "app", t0)
                # The lease runs out; a read at a later snapshot raises the victim's floor.
                eventually(lambda: begin_read(stub).timestamp >= t, 30,
                           "the HWM to pass the stalled transaction")
                assert read(plane, "events") == model[-1][1]
            if die_at:
                assert plane.retinas[victim].wait_exit(60) == 137
                restart(plane, victim)
            t_redo = redo.result(timeout=180)
        assert t_redo > t
        tick(plane)  # the HWM passes t_redo + 1
        after = {**model[-1][1], **keyed(plane, "events", upserts)}
        del after[plane.writers["events"].key(before[5])]
        model.append((t_redo, after))
        assert read(plane, "events") == after
        points = [t0, t - 1, t, t + 1, t_redo - 1, t_redo, t_redo + 1]
        if not die_at:
            assert check(plane, model, points) == set()  # what readers saw before the crash
            assert feed_served(plane, model, t0 - 1, t_redo)
            assert log_has(plane, victim, "refused_write_recorded")

        # Two restarts in a row; the first one's READY checkpoint fails, so the second
        # replays from the same checkpoint again (the record must still be there).
        restart(plane, victim, "checkpoint.body_write.before=raise*1")
        assert check(plane, model, points) == set()
        assert feed_served(plane, model, t0 - 1, t_redo)
        restart(plane, victim)
        assert check(plane, model, points) == set()
        assert feed_served(plane, model, t0 - 1, t_redo)
        assert read(plane, "events") == after
        # Recorded: skipped as a refusal. Not recorded (the process died before): skipped
        # all the same, nothing of T was applied here and its transaction had ended
        # (APPLIED_OR_LIVE). Every point, T' included, reads as before the crash.
        skipped = ("replay_unapplied_write_skipped" if die_at == "refused_writes.record.before"
                   else "replay_refused_write_skipped")
        assert log_has(plane, victim, skipped)
    finally:
        plane.stop()
