"""The failpoint catalogue and its environment switch."""

from __future__ import annotations

import subprocess
import sys

import pytest

from retina_common import failpoints
from retina_common.failpoints import FailpointError, FailpointTriggered

from .support import ROOT


def test_every_durable_step_of_this_layer_is_catalogued() -> None:
    names = set(failpoints.catalogue())
    for step in ("trans.ts_block", "trans.txid_block"):
        assert {f"{step}.before_persist", f"{step}.after_persist"} <= names
    for step in ("bootstrap", "add_file", "update_file", "delete_files", "swap"):
        assert {f"catalog.{step}.before_commit", f"catalog.{step}.after_commit"} <= names


@pytest.mark.parametrize("spec, message", [
    ("catalog.swap.before_comit=exit(1)", "unknown failpoint"),
    ("catalog.swap.before_commit", "not name=action"),
    ("catalog.swap.before_commit=explode", "bad action"),
    ("catalog.swap.before_commit=exit(x)", "integer code"),
    ("catalog.swap.before_commit=sleep(soon)", "needs seconds"),
    ("catalog.swap.before_commit=exit(1)@0", "K >= 1"),
])
def test_malformed_switch_is_refused(spec: str, message: str) -> None:
    with pytest.raises(FailpointError, match=message):
        failpoints.parse_spec(spec)


def test_raise_acts_from_the_kth_hit(active_failpoints) -> None:
    active_failpoints("catalog.swap.before_commit=raise(boom)@3")
    failpoints.CATALOG_SWAP_BEFORE_COMMIT.hit()
    failpoints.CATALOG_SWAP_BEFORE_COMMIT.hit()
    with pytest.raises(FailpointTriggered, match="boom"):
        failpoints.CATALOG_SWAP_BEFORE_COMMIT.hit()
    failpoints.CATALOG_SWAP_AFTER_COMMIT.hit()  # not configured: inert


def test_times_limits_how_many_hits_act(active_failpoints) -> None:
    active_failpoints("catalog.swap.before_commit=raise@2*2")
    point = failpoints.CATALOG_SWAP_BEFORE_COMMIT
    point.hit()
    for _ in range(2):
        with pytest.raises(FailpointTriggered):
            point.hit()
    point.hit()  # the third acting hit would be the fourth: inert again


def test_exit_kills_the_process_without_cleanup() -> None:
    code = ("import atexit, sys\n"
            "atexit.register(lambda: print('cleanup ran'))\n"
            "from retina_common import failpoints\n"
            "failpoints.CATALOG_SWAP_AFTER_COMMIT.hit()\n"
            "print('survived')\n")
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60,
        env={"RETINA_FAILPOINTS": "catalog.swap.after_commit=exit(137)", "PATH": "/usr/bin"})
    assert result.returncode == 137
    assert "survived" not in result.stdout and "cleanup ran" not in result.stdout


def test_processes_refuse_to_start_with_a_bad_switch() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "trans_gate"], cwd=ROOT, capture_output=True, text=True,
        timeout=60, env={"RETINA_FAILPOINTS": "no.such.point=exit(1)", "PATH": "/usr/bin"})
    assert result.returncode == 2
    assert "unknown failpoint 'no.such.point'" in result.stderr
