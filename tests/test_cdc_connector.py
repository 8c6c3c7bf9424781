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

from cdc_client.changelog import Changelog
from cdc_client.retention import horizon, run_retention
from retina_common.catalog import Catalog
from retina_common.cluster import PostgresInstance
from retina_common.etcd import EtcdStore
from retina_common.pb import retina_pb2 as rpb
from retina_common.pb import trans_pb2 as tpb

from .cdc import CdcPlane, SourceDb
from .dataplane import DataPlane
from .support import eventually


@pytest.fixture
def make_cdc(tmp_path: Path, etcd: EtcdStore, catalog: Catalog, catalog_dsn: str,
             pg_server: PostgresInstance) -> Iterator[Callable[..., CdcPlane]]:
    made: list[CdcPlane] = []
    planes: list[DataPlane] = []
    sources: list[SourceDb] = []

    def make(**settings: object) -> CdcPlane:
        plane = DataPlane(tmp_path / "plane", etcd, catalog, catalog_dsn, nodes=2,
                          retina={"block_rows": 16, "blocks_per_file": 2,
                                  "flush_interval_ms": 200})
        planes.append(plane)
        plane.start(recover=False)  # the connector drives both nodes to READY
        sources.append(SourceDb(pg_server))
        made.append(CdcPlane(plane, sources[-1], tmp_path, **settings))
        return made[-1]

    yield make
    for cdc in made:
        cdc.cdc.terminate()
    for plane in planes:
        plane.stop()
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
    "cdc.batch.after_begin", "cdc.changelog.after_segments", "cdc.changelog.after_record",
    "cdc.send.between_nodes", "cdc.send.after_all", "cdc.commit.after",
    "cdc.position.after_store",
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


def test_retina_crash_during_replay(make_cdc: Callable[..., CdcPlane]) -> None:
    """The node dies again while the connector replays into it; the connector
    starts the replay over against the new attempt."""
    cdc = make_cdc(request_max_rows=10)
    cdc.cdc.start("cdc.replay.after_request=sleep(0.3)")
    eventually(cdc.all_ready, 60, "both nodes READY")
    victim = cdc.plane.nodes[1]
    cdc.source.run(80)
    cdc.converged()
    cdc.plane.retinas[victim].kill9()
    cdc.plane.retinas[victim].start()
    eventually(lambda: any(e["node"] == victim for e in cdc.cdc.logged("cdc_replay_start")),
               60, "the replay to start")
    cdc.plane.retinas[victim].kill9()
    cdc.plane.retinas[victim].start()
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


def test_retention_keeps_what_a_checkpoint_can_ask_for(make_cdc: Callable[..., CdcPlane],
                                                       etcd: EtcdStore) -> None:
    """Retention drops only batches below every node's current and previous
    checkpoint replay start; a crash after retention still recovers exactly."""
    cdc = make_cdc(batch_max_transactions=5)
    cdc.cdc.start()
    eventually(cdc.all_ready, 60, "both nodes READY")
    cdc.source.run(40)
    cdc.converged()
    for node in cdc.plane.nodes:
        cdc.plane.checkpoint(node)
    cdc.source.run(20)
    cdc.converged()
    for node in cdc.plane.nodes:
        cdc.plane.checkpoint(node)
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
    """A source column the Retina table does not have: exit 3 with the table
    and column named; the transactions before it are applied, it is not."""
    cdc = make_cdc()
    cdc.cdc.start()
    eventually(cdc.all_ready, 60, "both nodes READY")
    cdc.source.run(10)
    cdc.converged()
    before = cdc.expected()
    with cdc.source.connect() as conn, conn, conn.cursor() as cur:
        cur.execute("ALTER TABLE orders ADD COLUMN colour text")
        cur.execute("INSERT INTO events VALUES (99, 1, NULL, true)")
        cur.execute("INSERT INTO orders VALUES (424242, 'x', 1, NULL, 'red')")
    assert cdc.cdc.wait_exit(60) == 3, cdc.cdc.log_tail()
    error = cdc.cdc.logged("cdc_stopped_malformed")[-1]["error"]
    assert "schema mismatch" in error and "colour" in error
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
