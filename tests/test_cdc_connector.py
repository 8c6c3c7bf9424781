"""The CDC connector end to end: a real source PostgreSQL (pgoutput logical
replication), a real ``retina-cdc`` process, a TransServer and two Retina
nodes. After every crash (connector, Retina, both, Retina during replay) the
gated snapshot must equal the source tables: nothing lost, nothing duplicated.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import requests
from prometheus_client.parser import text_string_to_metric_families

from cdc_client.changelog_pruning import run_retention
from devtools.cluster import PostgresInstance, free_port
from retina_common import exit_codes, failpoints
from retina_common.catalog import Catalog, FileType
from retina_common.changelog import Changelog
from retina_common.changelog_retention import horizon
from retina_common.checkpoint_store import CheckpointStore
from retina_common.etcd import EtcdStore
from retina_common.pb import retina_pb2 as rpb
from retina_common.pb import trans_pb2 as tpb

from .cdc import CdcPlane, SourceDb
from .dataplane import DataPlane
from .support import eventually, now_ms
from .test_snapshot_immutable import parked

pytestmark = pytest.mark.integration


@pytest.fixture
def make_cdc(tmp_path: Path, etcd: EtcdStore, catalog: Catalog, catalog_dsn: str,
             pg_server: PostgresInstance) -> Iterator[Callable[..., CdcPlane]]:
    made: list[CdcPlane] = []
    planes: list[DataPlane] = []
    sources: list[SourceDb] = []

    def make(*, node_metrics: bool = False, retina: dict[str, object] | None = None,
             **settings: object) -> CdcPlane:
        plane = DataPlane(tmp_path / "plane", etcd, catalog, catalog_dsn, nodes=2,
                          retina={"block_rows": 16, "blocks_per_file": 2,
                                  "flush_interval_ms": 200, **(retina or {})})
        if node_metrics:
            for proc in plane.retinas.values():
                proc.metrics_listen = f"127.0.0.1:{free_port()}"
        planes.append(plane)
        plane.start(recover=False)  # the connector drives both nodes to READY
        sources.append(SourceDb(pg_server))
        made.append(CdcPlane(plane, sources[-1], tmp_path, **settings))
        return made[-1]

    yield make
    for cdc in made:
        cdc.cdc.kill9()
    for plane in planes:
        plane.stop(kill=True)
    for source in sources:
        source.drop()


def test_source_changes_reach_retina(make_cdc: Callable[..., CdcPlane]) -> None:
    cdc = make_cdc()
    cdc.cdc.start()
    eventually(cdc.all_ready, 60, "the connector to drive both nodes to READY")
    cdc.source.run(60)
    cdc.converged()
    committed = cdc.cdc.logged("cdc_batch_committed")
    assert committed and committed[-1]["last_ts"] >= committed[0]["first_ts"]
    metrics = requests.get(f"http://{cdc.cdc.settings['metrics_listen']}/metrics",
                           timeout=5).text
    sample = {line.split(" ")[0]: float(line.split(" ")[1]) for line in metrics.splitlines()
              if line.startswith("cdc_")}
    assert sample["cdc_transactions_total"] == sum(c["transactions"] for c in committed)
    assert sample["cdc_committed_ts"] == committed[-1]["last_ts"]


CRASH_POINTS = [
    "cdc.batch.begin.after", "cdc.changelog.segments.after", "cdc.changelog.record.after",
    "cdc.send.node_ack.after", "cdc.send.all_acks.after", "cdc.commit.after",
    "cdc.position.store.after",
]


@pytest.mark.parametrize("point", CRASH_POINTS)
def test_connector_crash_resumes_under_ready(make_cdc: Callable[..., CdcPlane],
                                             point: str) -> None:
    """A connector-only crash at each durable step: Retina never leaves READY,
    the restarted connector resumes from its committed position."""
    cdc = make_cdc(batch_max_transactions=4)
    cdc.cdc.start(f"{point}=exit(137)@3")
    eventually(cdc.all_ready, 60, "both nodes READY")
    epochs = {n: cdc.plane.status(n).recovery_epoch for n in cdc.plane.nodes}
    cdc.source.run(30)
    assert cdc.cdc.wait_exit(60) == 137, cdc.cdc.log_tail()
    cdc.cdc.start()
    cdc.converged()
    assert cdc.all_ready()
    assert {n: cdc.plane.status(n).recovery_epoch for n in cdc.plane.nodes} == epochs


def parts(cdc: CdcPlane, node: str, form: str) -> float:
    """TableUpdateData the node validated in ``form`` (its metrics)."""
    page = requests.get(f"http://{cdc.plane.retinas[node].metrics_listen}/metrics",
                        timeout=5).text
    return sum(s.value for f in text_string_to_metric_families(page) for s in f.samples
               if s.name == "retina_update_record_parts_total" and s.labels["form"] == form)


def large_transaction(cdc: CdcPlane, rows: int) -> None:
    """One source transaction of ``rows`` inserts, an update of a seventh of the orders
    and a delete of a thirteenth: tens of rows per virtual node, the columnar form."""
    source = cdc.source
    assert source is not None
    first, source.next_id = source.next_id, source.next_id + rows
    k = source.committed
    with source.connect() as conn, conn, conn.cursor() as cur:
        cur.execute("INSERT INTO orders SELECT g, 'c' || (g %% 50), g / 100.0, NULL "
                    "FROM generate_series(%s, %s) AS g", (first, first + rows - 1))
        cur.execute("UPDATE orders SET amount = amount + 1, note = %s WHERE id %% 7 = %s",
                    (f"big{k}", k % 7))
        cur.execute("DELETE FROM orders WHERE id %% 13 = %s", (k % 13,))
    source.committed += 1


def test_large_transactions_go_columnar_through_a_crash_and_replay(
        make_cdc: Callable[..., CdcPlane]) -> None:
    """Source transactions of hundreds of rows reach Retina in the columnar form (the
    nodes say they accept it), and a node killed between them is replayed from the
    changelog in the columnar form too; the snapshot equals the source after each step,
    and small transactions in between keep the row form."""
    # No checkpoint while the test runs: the victim's replay starts at the beginning.
    cdc = make_cdc(node_metrics=True, retina={"checkpoint_interval_ms": 3_600_000})
    cdc.cdc.start()
    eventually(cdc.all_ready, 60, "the connector to drive both nodes to READY")
    victim = cdc.plane.nodes[1]
    for _ in range(3):
        large_transaction(cdc, 600)
    cdc.converged()
    assert all(parts(cdc, n, "columnar") > 0 for n in cdc.plane.nodes)
    rows_before = sum(parts(cdc, n, "row") for n in cdc.plane.nodes)
    cdc.source.run(10)  # 1-6 statements each: a few rows per virtual node
    cdc.converged()
    assert sum(parts(cdc, n, "row") for n in cdc.plane.nodes) > rows_before
    cdc.plane.retinas[victim].kill9()
    cdc.plane.retinas[victim].start()
    eventually(cdc.all_ready, 60, "the connector to replay the victim")
    cdc.converged()
    # The new process counted only the replay: the changelog's large transactions.
    assert parts(cdc, victim, "columnar") > 0
    large_transaction(cdc, 400)
    cdc.source.run(10)
    cdc.converged()


def test_retina_crash_mid_stream_is_replayed(make_cdc: Callable[..., CdcPlane]) -> None:
    cdc = make_cdc()
    cdc.cdc.start()
    eventually(cdc.all_ready, 60, "both nodes READY")
    victim = cdc.plane.nodes[1]
    with cdc.source.background(150):
        eventually(lambda: cdc.source.committed >= 40, 60, "the workload to get going")
        cdc.plane.retinas[victim].kill9()
        eventually(lambda: cdc.source.committed >= 80, 60, "more source commits")
        cdc.plane.retinas[victim].start()
    cdc.converged(timeout_s=90)
    done = cdc.cdc.logged("cdc_replay_done")
    assert any(d["node"] == victim for d in done), cdc.cdc.log_tail()


def test_connector_and_retina_crash_together(make_cdc: Callable[..., CdcPlane]) -> None:
    cdc = make_cdc()
    cdc.cdc.start()
    eventually(cdc.all_ready, 60, "both nodes READY")
    victim = cdc.plane.nodes[0]
    with cdc.source.background(120):
        eventually(lambda: cdc.source.committed >= 40, 60, "the workload to get going")
        cdc.cdc.kill9()
        cdc.plane.retinas[victim].kill9()
    cdc.plane.retinas[victim].start()
    cdc.cdc.start()
    cdc.converged(timeout_s=90)
    assert cdc.all_ready()


def test_retina_crash_during_replay(make_cdc: Callable[..., CdcPlane], failpoint_dir: Path,
                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """The node dies again while the connector replays into it; the connector
    starts the replay over against the new attempt."""
    monkeypatch.setenv(failpoints.DIR_VAR, str(failpoint_dir))
    point = "cdc.replay.request.after"
    cdc = make_cdc(request_max_rows=10)
    cdc.cdc.start(f"{point}=block")  # the connector waits after its first replay request
    eventually(cdc.all_ready, 60, "both nodes READY")
    victim = cdc.plane.nodes[1]
    cdc.source.run(80)
    cdc.converged()
    cdc.plane.retinas[victim].kill9()
    cdc.plane.retinas[victim].start()
    failpoints.wait_hit(failpoint_dir, point)  # mid-replay into the victim ...
    cdc.plane.retinas[victim].kill9()  # ... which dies again
    cdc.plane.retinas[victim].start()
    failpoints.release(failpoint_dir, point)
    cdc.source.run(20)
    cdc.converged(timeout_s=120)
    assert cdc.plane.status(victim).state == rpb.READY
    assert len([e for e in cdc.cdc.logged("cdc_replay_start") if e["node"] == victim]) >= 2


def test_node_mode_replay(make_cdc: Callable[..., CdcPlane]) -> None:
    cdc = make_cdc(replay_mode="node")
    cdc.cdc.start()
    eventually(cdc.all_ready, 60, "both nodes READY")
    cdc.source.run(40)
    victim = cdc.plane.nodes[0]
    cdc.plane.retinas[victim].kill9()
    cdc.plane.retinas[victim].start()
    cdc.source.run(20)
    cdc.converged(timeout_s=90)
    assert [e["mode"] for e in cdc.cdc.logged("cdc_replay_start")][-1] == "NODE"


def two_checkpoints_apart(make_cdc: Callable[..., CdcPlane]) -> CdcPlane:
    """A running connector and two checkpoints per node with a workload between them,
    so that retention has batches it may drop and batches it must keep."""
    cdc = make_cdc(batch_max_transactions=5)
    cdc.cdc.start()
    eventually(cdc.all_ready, 60, "both nodes READY")
    for rows in (40, 20):
        cdc.source.run(rows)
        cdc.converged()
        for node in cdc.plane.nodes:
            cdc.plane.checkpoint(node)
    return cdc


def test_retention_keeps_what_a_checkpoint_can_ask_for(make_cdc: Callable[..., CdcPlane],
                                                       etcd: EtcdStore) -> None:
    """Retention drops only batches below every node's current and previous
    checkpoint replay start; a crash after retention still recovers exactly."""
    cdc = two_checkpoints_apart(make_cdc)
    changelog = Changelog(cdc.cdc.settings["changelog_root"])
    before = changelog.records()
    low = horizon(etcd, cdc.plane.topology)
    assert 0 < low <= before[-1].last_ts
    removed = run_retention(changelog, etcd, cdc.plane.topology)
    after = changelog.records()
    assert removed == sum(1 for r in before if r.last_ts < low) > 0
    assert [r.name for r in after] == [r.name for r in before if r.last_ts >= low]
    victim = cdc.plane.nodes[0]
    cdc.plane.retinas[victim].kill9()
    cdc.plane.retinas[victim].start()
    cdc.source.run(10)
    cdc.converged(timeout_s=90)


def test_schema_drift_in_the_source_stops_the_connector(
        make_cdc: Callable[..., CdcPlane]) -> None:
    """A source column whose type the Retina table cannot hold (a nullable ADD COLUMN
    evolves the table instead: tests/test_schema_evolution.py): exit 6 with the table and
    column named; the transactions before it are applied, it is not."""
    cdc = make_cdc()
    cdc.cdc.start()
    eventually(cdc.all_ready, 60, "both nodes READY")
    cdc.source.run(10)
    cdc.converged()
    before = cdc.expected()
    with cdc.source.connect() as conn, conn, conn.cursor() as cur:
        cur.execute("ALTER TABLE orders ALTER COLUMN customer TYPE int8 USING length(customer)")
        cur.execute("INSERT INTO events VALUES (99, 1, NULL, true)")
        cur.execute("INSERT INTO orders VALUES (424242, 7, 1, NULL)")
    assert cdc.cdc.wait_exit(60) == 6, cdc.cdc.log_tail()
    error = cdc.cdc.logged("cdc_stopped_schema_change")[-1]["error"]
    assert "orders" in error and "customer" in error, error
    assert cdc.all_ready()
    cdc.converged(before)


def test_a_node_refusal_rolls_the_batch_back_and_stops(make_cdc: Callable[..., CdcPlane]) -> None:
    """A refusal other than UNAVAILABLE (here an injected INTERNAL error on one
    node) rolls the batch back and stops the connector with the status; the
    source keeps the transaction, so a restart applies it."""
    cdc = make_cdc()
    cdc.cdc.start()
    eventually(cdc.all_ready, 60, "both nodes READY")
    cdc.source.run(5)
    cdc.converged()
    # Two empty write transactions move the HWM past the last batch, so the
    # checkpoint of the clean stop below leaves nothing to replay: the
    # injected fault hits an ordinary send, not the replay.
    trans = cdc.plane.trans.stub()
    for _ in range(2):
        empty = trans.BeginTrans(tpb.BeginTransRequest(), timeout=10)
        trans.CommitTrans(tpb.CommitTransRequest(trans_id=empty.trans_id), timeout=10)
    victim = cdc.plane.nodes[1]
    cdc.plane.retinas[victim].stop()
    cdc.plane.retinas[victim].start("index.primary_commit.before=raise*1")
    eventually(cdc.all_ready, 60, "the restarted node READY again")
    cdc.source.run(30)
    assert cdc.cdc.wait_exit(60) == 3, cdc.cdc.log_tail()
    error = cdc.cdc.logged("cdc_stopped_refused")[-1]["error"]
    assert victim in error and "INTERNAL" in error
    committed = [b["last_ts"] for b in cdc.cdc.logged("cdc_batch_committed")]
    cdc.cdc.start()
    cdc.converged()
    assert cdc.cdc.logged("cdc_batch_committed")[-1]["last_ts"] > max(committed)


def checkpoint_twice_and_drop(cdc: CdcPlane, etcd: EtcdStore) -> Changelog:
    """A workload, two checkpoints of every node, then retention: the oldest
    batches are gone and the changelog's low-watermark is above them."""
    cdc.source.run(40)
    cdc.converged()
    for node in cdc.plane.nodes:
        cdc.plane.checkpoint(node)
    cdc.source.run(20)
    cdc.converged()
    for node in cdc.plane.nodes:
        cdc.plane.checkpoint(node)
    changelog = Changelog(cdc.cdc.settings["changelog_root"])
    assert run_retention(changelog, etcd, cdc.plane.topology) > 0
    assert changelog.retained_from() > 0
    return changelog


def replays_of(cdc: CdcPlane, node: str, event: str) -> int:
    return sum(1 for e in cdc.cdc.logged(event) if e["node"] == node)


def test_a_replay_gap_stops_the_connector_and_the_node_stays_recovering(
        make_cdc: Callable[..., CdcPlane], etcd: EtcdStore, catalog: Catalog) -> None:
    """Regression: cleansing discards an admitted file whose rows only dropped
    batches held, so the node's replay start falls below the changelog's
    low-watermark. Replaying what is left and calling MarkReady would lose
    those rows silently; the connector stops with exit 5 and names the gap,
    sends nothing, and the node stays RECOVERING (also after a restart)."""
    cdc = make_cdc(batch_max_transactions=5)
    cdc.cdc.start()
    eventually(cdc.all_ready, 60, "both nodes READY")
    changelog = checkpoint_twice_and_drop(cdc, etcd)
    retained = changelog.retained_from()
    victim = cdc.plane.nodes[0]
    found = CheckpointStore(etcd, victim, "", cdc.plane.topology.topology_hash).read_slot(
        "current")
    assert found is not None
    oldest = min(found[1].files, key=lambda entry: entry.min_commit_ts)
    assert oldest.min_commit_ts < retained, "the file's rows must lie in dropped batches"
    starts, dones = (replays_of(cdc, victim, e) for e in ("cdc_replay_start", "cdc_replay_done"))

    cdc.plane.retinas[victim].kill9()
    # What an operator's `retina-catalog update-file --type RETIRED` does: the
    # file is no longer REGULAR, so cleansing discards its checkpoint entry.
    catalog.update_file(oldest.file_id, file_type=FileType.RETIRED, cleanup_at=now_ms(),
                        expected_type=FileType.REGULAR)
    cdc.plane.retinas[victim].start()

    assert cdc.cdc.wait_exit(90) == exit_codes.REPLAY_GAP == 5, cdc.cdc.log_tail()
    gap = cdc.cdc.logged("cdc_replay_gap")[-1]
    assert gap["node"] == victim and gap["retained_from_ts"] == retained
    assert gap["needed_ts"] <= oldest.min_commit_ts < retained
    assert gap["vnode"] in cdc.plane.topology.vnodes_of(victim)
    assert cdc.cdc.logged("cdc_stopped_replay_gap")[-1]["node"] == victim
    status = cdc.plane.status(victim)
    assert status.state == rpb.RECOVERING and status.replay_ts_ready, status
    # Nothing was replayed into it, and MarkReady was never sent.
    assert replays_of(cdc, victim, "cdc_replay_start") == starts
    assert replays_of(cdc, victim, "cdc_replay_done") == dones
    # A restart finds the same gap: it is not a transient failure.
    cdc.cdc.start()
    assert cdc.cdc.wait_exit(90) == exit_codes.REPLAY_GAP, cdc.cdc.log_tail()
    assert cdc.plane.status(victim).state == rpb.RECOVERING
    assert replays_of(cdc, victim, "cdc_replay_done") == dones


@pytest.mark.parametrize("point", ["cdc.replay.request.after", "cdc.replay.mark_ready.before"])
def test_connector_crash_while_driving_recovery_converges(make_cdc: Callable[..., CdcPlane],
                                                          point: str) -> None:
    """The connector dies while it replays into a recovering node, or after the
    replay but before MarkReady: the node stays RECOVERING at its attempt, and
    the restarted connector replays it again and marks it READY. The replayed range
    ends with a TRUNCATE: the second replay puts the rows written before it back
    under its tombstones (no rewind in between), and it must delete them again."""
    cdc = make_cdc(request_max_rows=10)
    cdc.cdc.start()
    eventually(cdc.all_ready, 60, "both nodes READY")
    cdc.source.run(40)
    with cdc.source.connect() as conn, conn, conn.cursor() as cur:
        cur.execute("TRUNCATE events")
    cdc.converged()
    cdc.cdc.terminate()
    victim = cdc.plane.nodes[1]
    cdc.plane.retinas[victim].kill9()
    cdc.plane.retinas[victim].start()
    dones = replays_of(cdc, victim, "cdc_replay_done")
    cdc.cdc.start(f"{point}=exit(137)")
    assert cdc.cdc.wait_exit(60) == 137, cdc.cdc.log_tail()
    assert f"failpoint {point}" in cdc.cdc.log_tail()
    assert cdc.plane.status(victim).state == rpb.RECOVERING
    cdc.cdc.start()
    cdc.source.run(10)
    cdc.converged(timeout_s=90)
    assert cdc.all_ready()
    assert replays_of(cdc, victim, "cdc_replay_done") == dones + 1


@pytest.mark.parametrize("point", ["cdc.retention.watermark.before",
                                   "cdc.retention.watermark.after"])
def test_connector_crash_in_retention_never_hides_a_gap(make_cdc: Callable[..., CdcPlane],
                                                        etcd: EtcdStore, point: str) -> None:
    """A kill around the low-watermark write: before it nothing changed; after
    it the mark is durable and every batch is still there. The restarted
    connector finishes retention, and a node crash afterwards recovers exactly."""
    cdc = two_checkpoints_apart(make_cdc)
    changelog = Changelog(cdc.cdc.settings["changelog_root"])
    names = [r.name for r in changelog.records()]
    cdc.cdc.terminate()
    cdc.cdc.start(f"{point}=exit(137)", retention_interval_s=1)
    assert cdc.cdc.wait_exit(60) == 137, cdc.cdc.log_tail()
    assert [r.name for r in changelog.records()] == names  # nothing deleted yet
    retained = changelog.retained_from()
    if point.endswith(".before"):
        assert retained == 0
    else:
        assert 0 < retained <= horizon(etcd, cdc.plane.topology)
        assert any(r.last_ts < retained for r in changelog.records())
    cdc.cdc.start(retention_interval_s=1)

    def finished() -> bool:
        low = changelog.retained_from()
        return low > 0 and all(r.last_ts >= low for r in changelog.records())

    eventually(finished, 30, "the restarted connector to finish retention")
    assert len(changelog.records()) < len(names)
    victim = cdc.plane.nodes[0]
    cdc.plane.retinas[victim].kill9()
    cdc.plane.retinas[victim].start()
    cdc.source.run(10)
    cdc.converged(timeout_s=90)
    assert cdc.all_ready()


def test_a_batch_the_write_fence_refuses_is_redone_at_new_timestamps(
        make_cdc: Callable[..., CdcPlane], failpoint_dir: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A batch whose send to one node stalls past its lease (parked before that node's write
    fence) while a read passes its timestamps is refused ABORTED there. The connector takes
    it for an expired batch: it redoes it at new timestamps and goes on; the tables converge
    and the connector never stops (issue 25)."""
    monkeypatch.setenv(failpoints.DIR_VAR, str(failpoint_dir))
    cdc = make_cdc(write_lease_ms=1000)
    cdc.cdc.start()
    eventually(cdc.all_ready, 60, "the connector to drive both nodes to READY")
    cdc.source.run(10)
    cdc.converged()
    node = cdc.plane.nodes[0]
    cdc.plane.retinas[node].kill9()
    cdc.plane.retinas[node].start("update_record.fence.before=block*1")
    eventually(cdc.all_ready, 60, "the connector to recover the node")
    changelog = Changelog(cdc.cdc.settings["changelog_root"])
    logged = max((r.last_ts for r in changelog.records(0)), default=0)
    with cdc.source.background(20), parked(failpoint_dir, "update_record.fence.before"):
        stalled = eventually(lambda: max(r.last_ts for r in changelog.records(0)) > logged
                             and max(r.last_ts for r in changelog.records(0)), 30,
                             "the stalled batch in the changelog")
        trans = cdc.plane.trans.stub()

        def read_passes_it() -> bool:  # once its lease ran out, a snapshot is above it
            read = trans.BeginTrans(tpb.BeginTransRequest(read_only=True), timeout=10)
            try:
                if read.timestamp < stalled:
                    return False
                cdc.plane.retinas[node].stub.GetWriteBuffer(rpb.GetWriteBufferRequest(
                    schema_name="shop", table_name="orders", timestamp=read.timestamp,
                    trans_id=read.trans_id), timeout=10)
                return True
            finally:
                trans.CommitTrans(tpb.CommitTransRequest(trans_id=read.trans_id), timeout=10)
        eventually(read_passes_it, 30, "a read above the stalled batch")
    cdc.converged()
    expired = cdc.cdc.logged("cdc_batch_expired")
    assert any("write fence" in e["reason"] for e in expired), expired
    assert cdc.cdc.alive()
