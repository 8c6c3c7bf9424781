"""The failpoint catalogue and its environment switch."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from retina_common import failpoints
from retina_common.failpoints import FailpointError, FailpointTriggered

from .support import ROOT


def test_every_durable_step_of_this_layer_is_catalogued() -> None:
    names = set(failpoints.catalogue())
    for step in ("trans.ts_block", "trans.txid_block"):
        assert {f"{step}.persist.before", f"{step}.persist.after"} <= names
    for step in ("bootstrap", "add_file", "update_file", "delete_files", "swap"):
        assert {f"catalog.{step}.commit.before", f"catalog.{step}.commit.after"} <= names


# One naming scheme, <path>.<step>.before|after, so a name says where the window is.
SCHEME = re.compile(r"^[a-z_]+(\.[a-z_]+)+\.(before|after)$")


def test_every_name_follows_the_scheme() -> None:
    off_scheme = [name for name in failpoints.catalogue() if not SCHEME.match(name)]
    assert not off_scheme, off_scheme


def test_every_constant_is_its_name() -> None:
    """``catalog.swap.commit.before`` is CATALOG_SWAP_COMMIT_BEFORE: one name, two spellings.
    Storage GC points (``gc.``) are named by their own change and left out here."""
    points = {attr: value for attr, value in vars(failpoints).items()
              if isinstance(value, failpoints.Failpoint) and not value.name.startswith("gc.")}
    assert points
    wrong = {attr: point.name for attr, point in points.items()
             if attr != point.name.upper().replace(".", "_")}
    assert not wrong, wrong


@pytest.mark.parametrize("spec, message", [
    ("catalog.swap.commit.befor=exit(1)", "unknown failpoint"),
    ("catalog.swap.commit.before", "not name=action"),
    ("catalog.swap.commit.before=explode", "bad action"),
    ("catalog.swap.commit.before=exit(x)", "integer code"),
    ("catalog.swap.commit.before=sleep(soon)", "needs seconds"),
    ("catalog.swap.commit.before=exit(1)@0", "K >= 1"),
    ("catalog.swap.commit.before=exit(1)+twice", "bad action"),
])
def test_malformed_switch_is_refused(spec: str, message: str) -> None:
    with pytest.raises(FailpointError, match=message):
        failpoints.parse_spec(spec)


def test_raise_acts_from_the_kth_hit(active_failpoints) -> None:
    active_failpoints("catalog.swap.commit.before=raise(boom)@3")
    failpoints.CATALOG_SWAP_COMMIT_BEFORE.hit()
    failpoints.CATALOG_SWAP_COMMIT_BEFORE.hit()
    with pytest.raises(FailpointTriggered, match="boom"):
        failpoints.CATALOG_SWAP_COMMIT_BEFORE.hit()
    failpoints.CATALOG_SWAP_COMMIT_AFTER.hit()  # not configured: inert


def test_times_limits_how_many_hits_act(active_failpoints) -> None:
    active_failpoints("catalog.swap.commit.before=raise@2*2")
    point = failpoints.CATALOG_SWAP_COMMIT_BEFORE
    point.hit()
    for _ in range(2):
        with pytest.raises(FailpointTriggered):
            point.hit()
    point.hit()  # the third acting hit would be the fourth: inert again


@pytest.mark.integration
def test_exit_kills_the_process_without_cleanup() -> None:
    code = ("import atexit, sys\n"
            "atexit.register(lambda: print('cleanup ran'))\n"
            "from retina_common import failpoints\n"
            "failpoints.CATALOG_SWAP_COMMIT_AFTER.hit()\n"
            "print('survived')\n")
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60,
        env={"RETINA_FAILPOINTS": "catalog.swap.commit.after=exit(137)", "PATH": "/usr/bin"})
    assert result.returncode == 137
    assert "survived" not in result.stdout and "cleanup ran" not in result.stdout


@pytest.mark.integration
def test_processes_refuse_to_start_with_a_bad_switch() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "trans_gate"], cwd=ROOT, capture_output=True, text=True,
        timeout=60, env={"RETINA_FAILPOINTS": "no.such.point=exit(1)", "PATH": "/usr/bin"})
    assert result.returncode == 2
    assert "unknown failpoint 'no.such.point'" in result.stderr


# Dies at its second hit unless another process already acted there; prints what it did.
ONCE_CHILD = ("from retina_common import failpoints\n"
              "for _ in range(3):\n"
              "    failpoints.CDC_REPLAY_REQUEST_AFTER.hit()\n"
              "print('ran through')\n")


def run_once_child(directory: Path) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", ONCE_CHILD], cwd=ROOT, stdout=subprocess.PIPE, text=True,
        env={"RETINA_FAILPOINTS": "cdc.replay.request.after=exit(137)@2+once",
             "RETINA_FAILPOINT_DIR": str(directory), "PATH": "/usr/bin"})


@pytest.mark.integration
def test_once_acts_in_one_process_only_and_a_retry_runs_through(failpoint_dir: Path) -> None:
    """A retried task starts its hit counter again in a new process: with +once only the
    first process to reach the K-th hit acts, even when several race to it."""
    racing = [run_once_child(failpoint_dir) for _ in range(4)]
    codes = sorted(p.wait(timeout=60) for p in racing)
    assert codes == [0, 0, 0, 137]
    acted = failpoints.acted_once(failpoint_dir, "cdc.replay.request.after")
    assert acted is not None and acted[1] == 2  # pid of the dead one, at its second hit
    assert acted[0] in {p.pid for p in racing if p.returncode == 137}
    retry = run_once_child(failpoint_dir)
    out, _ = retry.communicate(timeout=60)
    assert retry.returncode == 0 and "ran through" in out


def test_once_needs_the_failpoint_directory() -> None:
    with pytest.raises(FailpointError, match="need RETINA_FAILPOINT_DIR"):
        failpoints.load_from_env({failpoints.ENV_VAR: "catalog.swap.commit.before=raise+once"})
    assert failpoints.parse_spec("catalog.swap.commit.before=raise@2*1+once")[
        "catalog.swap.commit.before"] == failpoints.Action("raise", "", 2, 1, True)
    failpoints.load_from_env({})
