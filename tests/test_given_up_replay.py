"""A transaction given up before it reached a node is not replayed into it: the history a
recovered node answers is the one its readers saw (issue 28; APPLIED_OR_LIVE,
retina_server/applied_writes.py and recovery/replay_admission.py).

Real processes: etcd, PostgreSQL, a TransServer, two Retina nodes that refuse anonymous
writes, an application writer (DurableWriter) that sends node by node. Its transaction T
is logged and applied by the first node; the second node's apply fails (a failpoint), so
the writer gives T up (rolled back, in doubt) and resends it at T1 with its next commit
T2. Readers saw T's part on the first node only. The second node is SIGKILLed and
recovered by ``retina-admin recover`` twice in a row (the first READY checkpoint fails):
its replay presents T, which it never applied and whose transaction ended, and skips it.
Every AS OF point and the change feed over all of it equal what readers saw before.

And the other side of the rule: a transaction in flight when the node dies (the writer
retries, its transaction live) is replayed into the node, and the writer's retry then
applies it again: not lost, not doubled, at its own timestamp.
"""

from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest

from retina_common import failpoints, storage
from retina_common.catalog import Catalog
from retina_common.changelog import Changelog
from retina_common.etcd import EtcdStore
from retina_common.writer import DurableWriter, TableChanges, WriteRefused, WriterSettings

from . import gc
from .dataplane import DataPlane
from .test_as_of_reads import published
from .test_durable_writers import STRICT, event, keyed, read
from .test_refused_replay import (
    Rows,
    as_of,
    feed_served,
    log_has,
    logged_ts,
    recovered_with_writer,
    restart,
    rows_on,
    tick,
    written_below_the_replay,
)

pytestmark = pytest.mark.integration


def test_a_transaction_given_up_before_it_reached_a_node_is_not_replayed_into_it(
        tmp_path: Path, etcd: EtcdStore, catalog: Catalog, catalog_dsn: str,
        failpoint_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(failpoints.DIR_VAR, str(failpoint_dir))
    plane = DataPlane(tmp_path / "plane", etcd, catalog, catalog_dsn, nodes=2, retina=STRICT)
    first, victim = sorted(plane.nodes)  # the writer sends in this order
    # The victim's second ordinary write fails before anything is applied (INTERNAL: the
    # writer gives the transaction up, it does not retry).
    plane.start({victim: "update_record.fence.before=raise@2*1"}, recover=False)
    try:
        root = tmp_path / "writers"
        w = recovered_with_writer(plane, root, WriterSettings(lease_ms=3000))
        on_first, on_victim = rows_on(plane, first, 3), rows_on(plane, victim, 3)
        before = [event(t, s, b"v0") for t, s in on_first + on_victim]
        t0 = written_below_the_replay(plane, catalog, w, before, victim)

        given_up = [event(t, s, b"v1") for t, s in on_first[:2] + on_victim[:2]]
        with pytest.raises(WriteRefused):
            w.write("events", upserts=given_up)
        t2 = w.write("events", upserts=[event(*on_victim[2], b"v2")])  # resends T at T1 first
        tick(plane)
        logged = [r.last_ts for r in Changelog(storage.root_uri(str(root / "app")))
                  .records(t0 + 1)]
        assert len(logged) == 3 and logged[-1] == t2, logged
        t, t1 = logged[0], logged[1]

        # What readers saw before the crash: T's part on the first node only.
        points = range(t0 - 1, t2 + 2)
        seen: dict[int, Rows | None] = {p: as_of(plane, p) for p in points}
        assert None not in seen.values()
        base = keyed(plane, "events", before)
        assert seen[t] == {**base, **keyed(plane, "events", given_up[:2])}
        assert seen[t1] == {**base, **keyed(plane, "events", given_up)}
        model: list[tuple[int, Rows]] = [(0, {})] + [(ts, seen[ts])  # type: ignore[misc]
                                                    for ts in (t0, t, t1, t2)]
        assert feed_served(plane, model, t0 - 1, t2)

        # Two restarts in a row; the first one's READY checkpoint fails, so the second
        # replays from the same checkpoint again.
        for failpoint in ("checkpoint.body_write.before=raise*1", ""):
            restart(plane, victim, failpoint)
            assert read(plane, "events") == seen[t2 + 1]
            assert {p: as_of(plane, p) for p in points} == seen
            assert feed_served(plane, model, t0 - 1, t2)
        assert log_has(plane, victim, "replay_unapplied_write_skipped")
    finally:
        plane.stop()


def test_a_transaction_in_flight_when_a_node_dies_is_replayed_into_it_while_live(
        tmp_path: Path, etcd: EtcdStore, catalog: Catalog, catalog_dsn: str,
        failpoint_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(failpoints.DIR_VAR, str(failpoint_dir))
    plane = DataPlane(tmp_path / "plane", etcd, catalog, catalog_dsn, nodes=2, retina=STRICT)
    first, victim = sorted(plane.nodes)
    # The victim dies in its second ordinary write, admitted, before anything is applied.
    plane.start({victim: "update_record.fence.after=exit(137)@2"}, recover=False)
    try:
        root = tmp_path / "writers"
        w = recovered_with_writer(plane, root, WriterSettings(lease_ms=3000,
                                                              send_deadline_s=120))
        on_first, on_victim = rows_on(plane, first, 2), rows_on(plane, victim, 2)
        before = [event(t, s, b"v0") for t, s in on_first + on_victim]
        t0 = written_below_the_replay(plane, catalog, w, before, victim)
        changed = [event(t, s, b"v1") for t, s in on_first + on_victim]
        with ThreadPoolExecutor(1) as pool:
            sent = pool.submit(w.write, "events", upserts=changed)
            t = logged_ts(root / "app", t0)
            assert plane.retinas[victim].wait_exit(60) == 137
            # Recovered while the writer retries: T is live, so the replay applies it.
            restart(plane, victim)
            assert sent.result(timeout=180) == t  # not redone: committed at T itself
        tick(plane)
        model: list[tuple[int, Rows]] = [
            (0, {}), (t0, keyed(plane, "events", before)), (t, keyed(plane, "events", changed))]
        points = range(t0 - 1, t + 2)
        want = {p: next(rows for ts, rows in reversed(model) if ts <= p) for p in points}

        def exact() -> None:
            assert read(plane, "events") == model[-1][1]
            assert {p: as_of(plane, p) for p in points} == want
            assert feed_served(plane, model, t0 - 1, t)

        exact()
        # Two more restarts in a row (the first one's READY checkpoint fails): T is no
        # longer live, and is replayed because the node recorded it.
        for failpoint in ("checkpoint.body_write.before=raise*1", ""):
            restart(plane, victim, failpoint)
            exact()
        assert not log_has(plane, victim, "replay_unapplied_write_skipped")
    finally:
        plane.stop()


class Workload:
    """Random upserts and deletes of the events table by one durable writer, and the
    model of every commit (what readers see)."""

    def __init__(self, plane: DataPlane, w: DurableWriter) -> None:
        self._w, self._key = w, plane.writers["events"].key
        self._rng = random.Random(5)
        self.rows: Rows = {}
        self.model: list[tuple[int, Rows]] = [(0, {})]

    def commit(self, n: int) -> None:
        rng, key = self._rng, self._key
        ups = {key(r): r for r in (event(1, rng.randrange(60), b"v%d" % n)
                                   for _ in range(rng.randrange(1, 8)))}
        dels = [r for k, r in self.rows.items() if k not in ups and rng.random() < 0.05]
        ts = self._w.commit({"events": TableChanges(list(ups.values()), dels)})
        for row in dels:
            del self.rows[key(row)]
        self.rows.update(ups)
        self.model.append((ts, dict(self.rows)))


def rewrite_streams(plane: DataPlane) -> int:
    """A Storage GC rewrite of every events stream with two files or more; a stream whose
    files are still in an earlier rewrite (not promoted yet) is left for the next round."""
    committed = 0
    for (node, vnode), files in gc.streams(plane, "events").items():
        if len(files) > 1:
            try:
                reply = gc.rewrite(plane, node, "events", vnode, files)
            except grpc.RpcError as exc:
                assert exc.code() == grpc.StatusCode.ABORTED, exc.details()
                continue
            committed += reply.outcome == "COMMITTED"
    return committed


def test_the_feed_stays_exact_across_restarts_rewrites_and_files_above_the_replay_start(
        tmp_path: Path, etcd: EtcdStore, catalog: Catalog, catalog_dsn: str) -> None:
    """Rows below the replay start in files, rows above it published (cleansing retires
    those files, the replay puts the rows back) and rows in write buffers; then three
    SIGKILLs in a row, each followed by more commits and Storage GC rewrites: every AS OF
    point and the change feed equal the model each time (APPLIED_OR_LIVE: nothing of
    the rebuilt history refused)."""
    plane = DataPlane(tmp_path / "plane", etcd, catalog, catalog_dsn, nodes=2, retina=STRICT)
    plane.start(recover=False)
    try:
        work = Workload(plane, recovered_with_writer(plane, tmp_path / "writers",
                                                     WriterSettings(lease_ms=3000)))
        for n in range(10):
            work.commit(n)
        published(plane, catalog)
        tick(plane)
        tick(plane)
        victim = plane.nodes[0]
        plane.checkpoint(victim)
        for n in range(10, 20):
            work.commit(n)
        published(plane, catalog)  # above the replay start
        for n in range(20, 25):
            work.commit(n)  # in write buffers
        tick(plane)
        first, last = work.model[1][0], work.model[-1][0]
        assert feed_served(plane, work.model, first - 1, last)
        seen = {p: as_of(plane, p) for p in range(first, last + 1)}
        rewrites = 0
        for kill in range(3):
            restart(plane, victim)
            assert read(plane, "events") == work.rows
            assert {p: as_of(plane, p) for p in seen} == seen
            assert feed_served(plane, work.model, first, last)
            for n in range(5):
                work.commit(100 * (kill + 1) + n)
            published(plane, catalog)
            tick(plane)
            rewrites += rewrite_streams(plane)
            last = work.model[-1][0]
            assert feed_served(plane, work.model, first, last)
            seen = {p: as_of(plane, p) for p in range(first, last + 1)}
        assert rewrites > 0
    finally:
        plane.stop()
