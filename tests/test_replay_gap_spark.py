"""``spark_jobs.cdc_replay`` and the changelog's retention low-watermark: a start
below it stops the job with exit 5 before Spark starts, nothing is sent, and a
recovering node is not marked READY. Real TransServer and Retina processes; the
job runs as an operator runs it, in a subprocess."""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path

import pytest

from retina_common.catalog import Catalog
from retina_common.etcd import EtcdStore
from retina_common.pb import retina_pb2 as rpb
from spark_jobs.cdc_replay import EXIT_REPLAY_GAP

from .dataplane import DataPlane
from .test_spark_jobs import LoggedPlane, run_job, workload


@pytest.fixture
def logged_plane(tmp_path: Path, etcd: EtcdStore, catalog: Catalog,
                 catalog_dsn: str) -> Iterator[LoggedPlane]:
    plane = DataPlane(tmp_path / "plane", etcd, catalog, catalog_dsn, nodes=2,
                      retina={"block_rows": 4, "blocks_per_file": 2, "flush_interval_ms": 600_000})
    try:
        plane.start()
        yield LoggedPlane(plane, tmp_path / "changelog")
    finally:
        plane.stop()


def test_cdc_replay_exits_5_on_a_replay_gap_and_sends_nothing(
        logged_plane: LoggedPlane) -> None:
    logged, plane = logged_plane, logged_plane.plane
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
    assert backfill.returncode == EXIT_REPLAY_GAP == 5, backfill.stdout + backfill.stderr
    assert "replay gap" in backfill.stderr and f"ts >= {retained} only" in backfill.stderr
    assert {t: plane.read(t) for t in rows} == rows  # nothing was written

    plane.retinas[victim].kill9()
    plane.retinas[victim].start()
    recover = run_job("spark_jobs.cdc_replay", "--config", logged.config, "--recover", victim)
    assert recover.returncode == EXIT_REPLAY_GAP, recover.stdout + recover.stderr
    assert f"{victim} stays RECOVERING" in recover.stderr and "replay gap" in recover.stderr
    assert "is READY" not in recover.stdout
    status = plane.status(victim)
    assert status.state == rpb.RECOVERING and status.replay_ts_ready
