"""The failpoint catalogue and its environment switch."""

from __future__ import annotations

import re
import subprocess
import sys

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


def test_processes_refuse_to_start_with_a_bad_switch() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "trans_gate"], cwd=ROOT, capture_output=True, text=True,
        timeout=60, env={"RETINA_FAILPOINTS": "no.such.point=exit(1)", "PATH": "/usr/bin"})
    assert result.returncode == 2
    assert "unknown failpoint 'no.such.point'" in result.stderr
