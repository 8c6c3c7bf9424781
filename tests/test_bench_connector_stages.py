"""bench/bench_connector_stages.py runs on the connector's real code path and reports
every stage (a benchmark that no longer runs is found here, not by the next person
who needs its figures)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from .support import ROOT


@pytest.mark.integration
def test_every_stage_is_reported_for_each_batch_size() -> None:
    done = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "bench_connector_stages.py"), "--rows", "2000",
         "--batch", "100", "--batch", "1000"],
        cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    out = done.stdout
    assert "B=100: 20 micro-batches" in out and "B=1000: 2 micro-batches" in out, out
    for stage in ("source objects", "translate", "stamp", "changelog encode", "changelog append",
                  "requests", "serialise", "connector total"):
        assert out.count(f"\n{stage} ") == 2, (stage, out)
