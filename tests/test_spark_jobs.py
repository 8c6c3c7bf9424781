"""The Spark drivers end to end: real TransServer and Retina processes, a real durable
changelog, and the jobs run as an operator runs them (``python -m spark_jobs...``, Spark in
local mode) in a subprocess.

Spark start-up dominates, so only three tests start Spark; the refusals are decided before
Spark starts and are checked in the same subprocess style.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping
from decimal import Decimal
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest

from retina_common import exit_codes, failpoints, replay_sources
from retina_common.catalog import Catalog, FileType
from retina_common.changelog import DELETE, REPLACE, Changelog, ChangeRow, LoggedTransaction
from retina_common.changelog_replay import node_starts
from retina_common.codec import encode_value
from retina_common.config import CdcConfig
from retina_common.etcd import EtcdStore
from retina_common.pb import retina_pb2 as rpb
from retina_common.pb import trans_pb2 as tpb
from spark_jobs import cdc_replay

from .dataplane import SCHEMA, DataPlane
from .support import ROOT, begin_write, eventually

pytestmark = pytest.mark.integration

SPARK_ARGS = ("--conf", "spark.ui.enabled=false", "--conf", "spark.sql.shuffle.partitions=2",
              "--conf", "spark.driver.memory=1g")
Changes = Mapping[str, Mapping[str, list[dict[str, Any]]]]


class LoggedPlane:
    """A DataPlane whose every committed transaction is also in a durable Changelog,
    encoded exactly as the CDC connector logs it."""

    def __init__(self, plane: DataPlane, root: Path) -> None:
        self.plane = plane
        self.changelog = Changelog(str(root))
        self.config = plane.workdir / "spark-job.toml"
        # The file every process reads, plus the [cdc] section the jobs need.
        self.config.write_text(plane.config_path.read_text() +
                               f'\n[cdc]\nschema = "{SCHEMA}"\nchangelog_root = "{root}"\n')

    def entry(self, ts: int, changes: Changes) -> LoggedTransaction:
        rows, seq = [], 0
        for table, ops in changes.items():
            writer, record = self.plane.writers[table], self.plane.tables[table]
            for row in ops.get("deletes", ()):
                key = writer.key(row)
                rows.append(ChangeRow(ts, seq, self.plane.topology.vnode_of_key(key), table,
                                      DELETE, key, None))
                seq += 1
            for row in [*ops.get("inserts", ()), *ops.get("replaces", ())]:
                key = writer.key(row)
                values = tuple(encode_value(c.type, row.get(c.name)) for c in record.columns)
                rows.append(ChangeRow(ts, seq, self.plane.topology.vnode_of_key(key), table,
                                      REPLACE, key, values))
                seq += 1
        return LoggedTransaction(ts, f"pos-{ts}", str(ts), int(time.time() * 1000), rows)

    def commit(self, changes: Changes) -> int:
        ts, _ = self.plane.commit(changes)
        self.changelog.append([self.entry(ts, changes)])
        return ts


def order(i: int, note: str = "") -> dict[str, Any]:
    return {"id": i, "customer": f"c{i % 5}", "amount": Decimal(i) / 4, "note": note or None}


def event(i: int) -> dict[str, Any]:
    return {"tenant": i % 3, "seq": i, "payload": bytes([i % 256]) * 3, "ok": i % 2 == 0}


def workload(logged: LoggedPlane, rng: random.Random, steps: int, next_id: int) -> int:
    """Inserts, deletes and replaces over both tables; returns the next free id."""
    for step in range(steps):
        live = sorted(logged.plane.model.rows["orders"].values(), key=lambda r: r["id"])
        picked = rng.sample(live, min(len(live), rng.randint(0, 6)))
        inserts = [order(next_id + i) for i in range(rng.randint(1, 12))]
        changes: dict[str, dict[str, list[dict[str, Any]]]] = {"orders": {
            "inserts": inserts,
            "deletes": [{"id": r["id"]} for r in picked[: len(picked) // 2]],
            "replaces": [order(r["id"], f"s{step}") for r in picked[len(picked) // 2:]],
        }}
        next_id += len(inserts)
        if rng.random() < 0.5:
            changes["events"] = {"replaces": [event(next_id + j) for j in range(3)]}
            next_id += 3
        logged.commit(changes)
    return next_id


def apply_changes(plane: DataPlane, rows: dict[str, dict[bytes, dict]], changes: Changes) -> None:
    for table, ops in changes.items():
        writer = plane.writers[table]
        for row in ops.get("deletes", ()):
            rows[table].pop(writer.key(row), None)
        for row in [*ops.get("inserts", ()), *ops.get("replaces", ())]:
            rows[table][writer.key(row)] = dict(row)


def run_job(module: str, *args: str | Path, master: str = "local[2]",
            env: Mapping[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", module, *map(str, args), "--master", master,
                           *SPARK_ARGS],
                          cwd=ROOT, capture_output=True, text=True, timeout=240,
                          env={**os.environ, "PYSPARK_PYTHON": sys.executable, **(env or {})})


def last_json(stdout: str) -> dict[str, Any]:
    return json.loads([line for line in stdout.splitlines() if line.startswith("{")][-1])


def regular_files(catalog: Catalog) -> int:
    return len(catalog.get_files_by_type(None, [FileType.REGULAR]))


@pytest.fixture
def logged(tmp_path: Path, etcd: EtcdStore, catalog: Catalog,
           catalog_dsn: str) -> Iterator[LoggedPlane]:
    # Small files publish as soon as they fill; the long flush interval keeps the
    # remainder of every stream in its write buffer.
    plane = DataPlane(tmp_path / "plane", etcd, catalog, catalog_dsn, nodes=2,
                      retina={"block_rows": 4, "blocks_per_file": 2, "flush_interval_ms": 600_000})
    try:
        plane.start()
        yield LoggedPlane(plane, tmp_path / "changelog")
    finally:
        plane.stop()


# --- cdc_replay --recover ---------------------------------------------------------------------
def test_recover_replays_a_killed_node_from_the_changelog(logged: LoggedPlane,
                                                          catalog: Catalog,
                                                          tmp_path: Path) -> None:
    """Also the changelog of an application writer (a registered replay source of its
    own, retina_common/writer.py), merged with the connector's: EVERY_SOURCE_REPLAYED."""
    plane = logged.plane
    rng = random.Random(7)
    next_id = workload(logged, rng, 20, 0)
    eventually(lambda: regular_files(catalog) >= 2, 20, "files published before the checkpoint")
    victim = plane.nodes[0]
    plane.checkpoint(victim)
    before = regular_files(catalog)
    next_id = workload(logged, rng, 20, next_id)
    eventually(lambda: regular_files(catalog) > before, 20, "files published after it")
    workload(logged, rng, 4, next_id)  # and rows still in write buffers
    app_rows = [event(i) for i in range(10_000, 10_016)]
    plane.durable_writer("side-app", tmp_path / "writers").write("events", upserts=app_rows)
    for row in app_rows:
        plane.model.rows["events"][plane.writers["events"].key(row)] = row
    app_vnodes = [plane.topology.vnode_of_key(plane.writers["events"].key(r))
                  for r in app_rows]
    plane.retinas[victim].kill9()
    plane.retinas[victim].start()
    assert plane.status(victim).state == rpb.RECOVERING

    result = run_job("spark_jobs.cdc_replay", "--config", logged.config, "--recover", victim,
                     "--json")
    assert result.returncode == 0, result.stdout + result.stderr
    summary = last_json(result.stdout)
    owned = plane.topology.vnodes_of(victim)
    assert sorted(int(v) for v in summary["per_vnode"]) == sorted(owned)
    for vnode in owned:  # exactly the changelog rows from each vnode's start, one line each
        start = summary["starts"][str(vnode)]
        expected = sum(1 for _ in logged.changelog.read({vnode: start})) + \
            app_vnodes.count(vnode)  # written after the checkpoint: above every start
        assert summary["per_vnode"][str(vnode)]["rows"] == expected
        assert f"vnode {vnode}: {expected:,} rows," in result.stdout
    assert summary["rows"] > 0 and f"{victim} is READY" in result.stdout
    assert "also replaying the changelogs of side-app" in result.stdout
    assert plane.status(victim).state == rpb.READY
    assert plane.gate_open()  # the job waited for the gate: a query right after is admitted
    for table in ("orders", "events"):
        assert plane.read(table) == plane.model.rows[table]  # read() also rejects duplicates


def test_recover_converges_when_spark_retries_a_task_that_died_after_half_its_requests(
        logged: LoggedPlane, catalog: Catalog, failpoint_dir: Path) -> None:
    """A Spark task of the replay dies (its Python worker exits) after it sent half its
    requests; ``local[2,2]`` lets Spark run it again in a new worker, from its start. The
    retry sends its whole range again, every other task and MarkReady follow, and the
    node's snapshot is the model's, whole."""
    plane = logged.plane
    rng = random.Random(17)
    next_id = workload(logged, rng, 10, 0)
    victim = plane.nodes[0]
    plane.checkpoint(victim)
    workload(logged, rng, 30, next_id)  # what the victim must replay
    plane.retinas[victim].kill9()
    plane.retinas[victim].start()
    status = plane.wait_replay_ready(victim)
    # What each task will send, one replace (two items) per request: the kill lands after
    # half the requests of the smallest task, so whichever task gets there first dies
    # with at least as many still to send.
    starts = plane.retinas[victim].stub.GetRecoveryReplayTs(rpb.GetRecoveryReplayTsRequest(
        recovery_attempt_token=status.recovery_attempt_token,
        checkpoint_id=status.checkpoint_id, replay_mode=rpb.VNODE), timeout=10)
    spec = cdc_replay.JobSpec(str(logged.changelog.root), SCHEMA, plane.tables, 2,
                              cdc_replay.ReplayContext(status.recovery_attempt_token,
                                                       status.checkpoint_id, rpb.VNODE))
    requests = {v: sum(1 for _ in cdc_replay.task_requests(spec, cdc_replay.VnodeTask(
        v, victim, start, None, status.accepts_columnar)))
        for v, start in node_starts(victim, plane.topology, starts, rpb.VNODE).items()}
    kill_at = min(requests.values()) // 2
    assert kill_at >= 5, requests
    point = failpoints.CDC_REPLAY_REQUEST_AFTER.name

    # A new Python worker per task attempt: the point's hit counter is per process, and a
    # reused worker would carry one task's hits into the next.
    result = run_job("spark_jobs.cdc_replay", "--config", logged.config, "--recover", victim,
                     "--max-rows", "2", "--json", "--conf", "spark.python.worker.reuse=false",
                     master="local[2,2]",
                     env={failpoints.ENV_VAR: f"{point}=exit(137)@{kill_at}+once",
                          failpoints.DIR_VAR: str(failpoint_dir)})
    assert result.returncode == 0, result.stdout + result.stderr[-4000:]
    died = failpoints.acted_once(failpoint_dir, point)
    assert died is not None and died[1] == kill_at  # a task died after kill_at requests
    assert "Python worker exited unexpectedly" in result.stderr  # Spark saw it die
    summary = last_json(result.stdout)
    for vnode, count in requests.items():  # every task, the retried one too, sent it all
        start = summary["starts"][str(vnode)]
        rows = sum(1 for _ in logged.changelog.read({vnode: start}))
        assert summary["per_vnode"][str(vnode)] == {"rows": rows, "requests": count}
    assert plane.status(victim).state == rpb.READY
    assert plane.gate_open()  # the job waited for the gate: a query right after is admitted
    for table in ("orders", "events"):
        assert plane.read(table) == plane.model.rows[table]  # read() also rejects duplicates


def test_cdc_replay_decides_without_spark_when_there_is_nothing_to_run(
        logged: LoggedPlane) -> None:
    plane = logged.plane
    ready = run_job("spark_jobs.cdc_replay", "--config", logged.config, "--recover",
                    plane.nodes[0])
    assert ready.returncode == 0 and "READY already" in ready.stdout, ready.stderr
    unknown = run_job("spark_jobs.cdc_replay", "--config", logged.config, "--recover",
                      "127.0.0.1:1")
    assert unknown.returncode == 2 and "not in the topology" in unknown.stderr
    plane.retinas[plane.nodes[1]].kill9()
    plane.retinas[plane.nodes[1]].start()
    refused = run_job("spark_jobs.cdc_replay", "--config", logged.config, "--backfill",
                      "--from-ts", "1")
    assert refused.returncode == 4 and "is not READY" in refused.stderr, refused.stderr


# --- cdc_replay --backfill --------------------------------------------------------------------
def test_backfill_sends_a_logged_range_under_open_write_transactions(
        logged: LoggedPlane, etcd: EtcdStore) -> None:
    plane = logged.plane
    workload(logged, random.Random(3), 8, 0)  # committed, sent and logged as usual
    stub = plane.trans.stub()
    first, second, outside = (begin_write(stub, lease_ms=300_000) for _ in range(3))
    live = sorted(plane.model.rows["orders"])
    old = [r for k, r in plane.model.rows["orders"].items() if k in live[:4]]
    batch: list[tuple[int, Changes]] = [
        (first.timestamp, {"orders": {"inserts": [order(i) for i in range(500, 540)],
                                      "deletes": [{"id": r["id"]} for r in old[:2]],
                                      "replaces": [order(r["id"], "bf") for r in old[2:]]},
                           "events": {"replaces": [event(i) for i in range(500, 520)]}}),
        (second.timestamp, {"orders": {"replaces": [order(i, "again") for i in range(500, 510)],
                                       "deletes": [{"id": 539}]}}),
        (outside.timestamp, {"orders": {"inserts": [order(i) for i in range(900, 910)]}}),
    ]
    # Logged (the connector logs before it sends) but never sent to Retina.
    logged.changelog.append([logged.entry(ts, changes) for ts, changes in batch])
    expected = plane.model.snapshot()
    for _ts, changes in batch[:2]:
        apply_changes(plane, expected, changes)

    result = run_job("spark_jobs.cdc_replay", "--config", logged.config, "--backfill",
                     "--from-ts", first.timestamp, "--to-ts", second.timestamp, "--json")
    assert result.returncode == 0, result.stdout + result.stderr
    summary = last_json(result.stdout)
    assert summary["vnodes"] == plane.topology.virtual_nodes
    assert summary["rows"] == sum(len(logged.entry(ts, c).rows) for ts, c in batch[:2])
    # The covering transactions end only now; the one outside the range never happened.
    for trans in (first, second):
        stub.CommitTrans(tpb.CommitTransRequest(trans_id=trans.trans_id), timeout=10)
    stub.RollbackTrans(tpb.RollbackTransRequest(trans_id=outside.trans_id), timeout=10)
    eventually(plane.gate_open, 15, "the gate to admit")
    for table in ("orders", "events"):
        assert plane.read(table) == expected[table]
    # Its writes named the connector's replay source, whose changelog holds the rows; the
    # job registered it, since no connector ran here (WRITES_HAVE_A_REPLAY_SOURCE).
    source = replay_sources.get(etcd, CdcConfig().name)
    assert source is not None and source.active and source.kind == "cdc"
    assert source.changelog_root == logged.changelog.root


# --- snapshot_query ---------------------------------------------------------------------------
def test_snapshot_query_exports_exactly_the_gated_snapshot(logged: LoggedPlane,
                                                           catalog: Catalog,
                                                           tmp_path: Path) -> None:
    plane = logged.plane
    next_id = workload(logged, random.Random(11), 25, 0)
    eventually(lambda: regular_files(catalog) >= 3, 20, "published files")
    workload(logged, random.Random(12), 3, next_id)  # rows still in write buffers
    out = tmp_path / "orders-snapshot"
    result = run_job("spark_jobs.snapshot_query", "--config", logged.config,
                     "--table", f"{SCHEMA}.orders", "--output", out, "--json")
    assert result.returncode == 0, result.stdout + result.stderr
    info = last_json(result.stdout)
    assert plane.reader is not None
    # Nothing was written since, so any later snapshot has the same rows.
    assert info["count"] == plane.reader.read(SCHEMA, "orders").table.num_rows
    assert info["count"] == len(plane.model.rows["orders"])
    assert info["files"] >= 3 and info["buffer_rows"] > 0  # both sources were read
    assert f"at timestamp {info['timestamp']}: {info['count']:,} rows" in result.stdout
    exported = pq.read_table(out)
    writer = plane.writers["orders"]
    rows = {writer.key(r): r for r in exported.to_pylist()}
    assert len(rows) == exported.num_rows  # no duplicated row
    assert rows == plane.model.rows["orders"]


def test_snapshot_query_exits_4_while_a_node_is_recovering(logged: LoggedPlane,
                                                           tmp_path: Path) -> None:
    plane = logged.plane
    workload(logged, random.Random(5), 3, 0)
    victim = plane.nodes[1]
    plane.retinas[victim].kill9()
    plane.retinas[victim].start()
    eventually(lambda: not plane.gate_open(), 15, "the gate to refuse")
    out = tmp_path / "never"
    result = run_job("spark_jobs.snapshot_query", "--config", logged.config,
                     "--table", f"{SCHEMA}.orders", "--output", out)
    assert result.returncode == 4, result.stdout + result.stderr
    assert "query gate refused" in result.stderr and not out.exists()
    assert plane.status(victim).state == rpb.RECOVERING


def test_snapshot_query_reads_at_a_pin_and_refuses_an_expired_point_before_spark(
        logged: LoggedPlane, catalog: Catalog, tmp_path: Path) -> None:
    """A long job reads at a named pin (docs/history.md): the table as it was when pinned,
    after later writes; a point the GC horizon has passed exits 3 before Spark starts."""
    plane = logged.plane
    stub = plane.trans.stub()
    next_id = workload(logged, random.Random(21), 12, 0)
    pinned = dict(plane.model.rows["orders"])
    hwm = stub.GetHighWatermark(tpb.GetHighWatermarkRequest(), timeout=10).high_watermark
    stub.CreatePin(tpb.CreatePinRequest(name="eod", ts=hwm), timeout=10)
    workload(logged, random.Random(22), 6, next_id)  # deletes and replaces after the pin
    assert plane.model.rows["orders"] != pinned
    out = tmp_path / "eod"
    result = run_job("spark_jobs.snapshot_query", "--config", logged.config,
                     "--table", f"{SCHEMA}.orders", "--pin", "eod", "--output", out, "--json")
    assert result.returncode == 0, result.stdout + result.stderr
    assert last_json(result.stdout)["timestamp"] == hwm
    writer = plane.writers["orders"]
    assert {writer.key(r): r for r in pq.read_table(out).to_pylist()} == pinned
    stub.DropPin(tpb.DropPinRequest(name="eod"), timeout=10)
    stub.GetSafeGcTimestamp(tpb.GetSafeGcTimestampRequest(), timeout=10)  # passes hwm
    never = tmp_path / "never"
    result = run_job("spark_jobs.snapshot_query", "--config", logged.config,
                     "--table", f"{SCHEMA}.orders", "--as-of", str(hwm), "--output", never)
    assert result.returncode == 3, result.stdout + result.stderr
    assert "snapshot_expired" in result.stderr and "earliest readable point" in result.stderr
    assert not never.exists()


# --- the retention low-watermark ----------------------------------------------------------
def test_cdc_replay_exits_5_on_a_replay_gap_and_sends_nothing(logged: LoggedPlane) -> None:
    """A start below the changelog's retention low-watermark stops the job with exit 5
    before Spark starts: nothing is sent, a recovering node is not marked READY."""
    plane = logged.plane
    rng = random.Random(5)
    next_id = workload(logged, rng, 10, 0)
    victim = plane.nodes[0]
    plane.checkpoint(victim)
    workload(logged, rng, 5, next_id)
    records = logged.changelog.records()
    # Retention of everything but the newest batch: far above the victim's checkpoint.
    assert logged.changelog.drop_before(records[-1].first_ts) == len(records) - 1
    retained = logged.changelog.retained_from()
    assert retained == records[-2].last_ts + 1
    rows = {t: plane.read(t) for t in ("orders", "events")}

    backfill = run_job("spark_jobs.cdc_replay", "--config", logged.config, "--backfill",
                       "--from-ts", "1")
    assert backfill.returncode == exit_codes.REPLAY_GAP == 5, backfill.stdout + backfill.stderr
    assert "replay gap" in backfill.stderr and f"ts >= {retained} only" in backfill.stderr
    assert {t: plane.read(t) for t in rows} == rows  # nothing was written

    plane.retinas[victim].kill9()
    plane.retinas[victim].start()
    recover = run_job("spark_jobs.cdc_replay", "--config", logged.config, "--recover", victim)
    assert recover.returncode == exit_codes.REPLAY_GAP, recover.stdout + recover.stderr
    assert f"{victim} stays RECOVERING" in recover.stderr and "replay gap" in recover.stderr
    assert "is READY" not in recover.stdout
    status = plane.status(victim)
    assert status.state == rpb.RECOVERING and status.replay_ts_ready
