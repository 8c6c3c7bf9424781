"""The fault campaign (chaos/): its bookkeeping rules, and a fixed-seed sample run.

The sample is a real test of the system: it starts a real cluster, injects the faults
of seed 7's first episodes, and fails on any lost, duplicated or phantom row, or on any
read served while a node was not READY.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from chaos import faults
from chaos.compare import diff_table, lsn
from chaos.main import episode_seed, parse_args
from chaos.prober import ReadinessTracker
from chaos.workload import BY_NAME
from retina_common import failpoints
from retina_common.pb import retina_pb2 as rpb

SAMPLE = ["--seed", "7", "--episodes", "12", "--time-budget", "120", "--converge-timeout", "45"]


# --- bookkeeping ------------------------------------------------------------------------------
def test_every_catalogue_point_is_armed_or_left_out_with_a_reason() -> None:
    for point in failpoints.catalogue():
        if point in faults.UNREACHABLE:
            assert faults.UNREACHABLE[point]
            continue
        role = faults.process_of(point)
        assert role in ("retina", "cdc", "trans")
        if role == "retina":
            assert point.startswith(faults.RETINA_PREFIXES), point


def test_failpoint_rotation_is_seeded_and_covers_the_catalogue() -> None:
    points = faults.relevant_points()
    # failpoint episodes are the odd ones: one full cycle takes 2 * len(points) episodes
    cycle = {faults.failpoint_for(3, e) for e in range(1, 2 * len(points), 2)}
    assert cycle == set(points)
    assert [faults.failpoint_for(3, e) for e in range(40)] == \
        [faults.failpoint_for(3, e) for e in range(40)]
    assert episode_seed(3, 5) == 3 * 100003 + 5


def test_a_read_inside_a_proven_not_ready_window_is_a_breach() -> None:
    tracker = ReadinessTracker()
    tracker.down("n1")
    t_down = time.monotonic()
    tracker.started("n1", pid=100)
    read = (time.monotonic(), time.monotonic())
    tracker.observed("n1", time.monotonic(), rpb.RECOVERING, pid=100)
    assert tracker.breaches([read]) == [("n1", *read)]
    # a read that began before the process was confirmed gone proves nothing
    assert tracker.breaches([(t_down - 10, read[1])]) == []


def test_no_answer_or_a_second_process_proves_nothing() -> None:
    tracker = ReadinessTracker()
    tracker.down("n1")
    tracker.started("n1", pid=100)
    read = (time.monotonic(), time.monotonic())
    tracker.observed("n1", time.monotonic(), None, pid=100)  # no answer: maybe just slow
    assert tracker.breaches([read]) == []
    # the first process may have been READY, unobserved, before this second death
    tracker.down("n1")
    tracker.started("n1", pid=101)
    tracker.observed("n1", time.monotonic(), rpb.RECOVERING, pid=101)
    assert tracker.breaches([read]) == []
    tracker.observed("n1", time.monotonic(), rpb.READY, pid=101)
    assert tracker.breaches([(time.monotonic(), time.monotonic())]) == []


def test_diff_counts_lost_duplicated_phantom_and_mismatched_rows() -> None:
    table = BY_NAME["lines"]
    want = {(1, 1): (1, 1, "a", 1), (1, 2): (1, 2, "b", 2), (2, 1): (2, 1, "c", 3)}
    got = [(1, 1, "a", 1), (1, 1, "a", 1), (1, 2, "B", 2), (9, 9, "z", 0)]
    diff = diff_table(table, want, got)
    assert (diff.rows, diff.lost, diff.duplicated, diff.phantom, diff.mismatched) == \
        (3, 1, 1, 1, 1)
    assert not diff.clean


def test_lsn_and_arguments() -> None:
    assert lsn("0/10") == 16 and lsn("1/0") == 1 << 32
    args = parse_args(["--seed", "4", "--episode", "9"])
    assert (args.seed, args.episode) == (4, 9)
    with pytest.raises(SystemExit):
        parse_args(["--faults", "no_such_fault"])


# --- the fixed-seed sample --------------------------------------------------------------------
@pytest.mark.integration
@pytest.mark.timeout(330)
def test_fixed_seed_sample_loses_nothing_and_never_serves_outside_ready(tmp_path: Path) -> None:
    report_path = tmp_path / "chaos.json"
    started = time.monotonic()
    result = subprocess.run([sys.executable, "-m", "chaos", *SAMPLE, "--json", str(report_path)],
                            capture_output=True, text=True, timeout=320, check=False)
    took = time.monotonic() - started
    output = result.stdout[-6000:] + result.stderr[-3000:]
    assert report_path.exists(), output
    report = json.loads(report_path.read_text())
    assert report["episodes"] >= 3, output
    assert report["rows_compared"] > 0, output
    assert report["lost"] == 0, output
    assert report["duplicated"] == 0, output
    assert report["phantom"] == 0, output
    assert report["mismatched"] == 0, output
    assert report["reads_outside_ready"] == 0, output
    assert report["reads_served"] > 0, output
    assert not report["stopped_early"] or "time budget" in report["stopped_early"], output
    assert result.returncode == 0, f"anomalies ({took:.0f}s):\n{output}"
