"""The compose connector's wrapper (deploy/images/cdc-entrypoint.sh, installed in the image
as retina-cdc-container): an exit that needs an operator (3, 5, 6) leaves the container up
and idle instead of a restart loop; any other exit is passed on; SIGTERM reaches the
connector, so a `docker stop` is still a clean stop.

The real script under /bin/sh with a stand-in ``retina-cdc`` on PATH: the wrapper's
contract is about exit codes and signals, whatever the connector does inside.
"""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

import pytest

from .support import ROOT, eventually

pytestmark = pytest.mark.integration

WRAPPER = ROOT / "deploy" / "images" / "cdc-entrypoint.sh"
# Exits with $FAKE_EXIT, or on SIGTERM writes a marker and exits 0 (a clean stop).
FAKE_CDC = """#!/bin/sh
trap 'echo stopped-cleanly > "$MARKER"; exit 0' TERM
if [ -n "${FAKE_EXIT:-}" ]; then
    echo "retina-cdc: stopped (exit $FAKE_EXIT)" >&2
    exit "$FAKE_EXIT"
fi
echo running > "$MARKER"
while :; do sleep 1 & wait $!; done
"""


def start(tmp_path: Path, fake_exit: str | None) -> tuple[subprocess.Popen[str], Path]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "retina-cdc"
    fake.write_text(FAKE_CDC)
    fake.chmod(0o755)
    marker = tmp_path / "marker"
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "MARKER": str(marker)}
    if fake_exit is not None:
        env["FAKE_EXIT"] = fake_exit
    proc = subprocess.Popen(["/bin/sh", str(WRAPPER)], env=env, stderr=subprocess.PIPE,
                            text=True)
    return proc, marker


@pytest.mark.parametrize("code", ["3", "5", "6"])
def test_an_exit_that_needs_an_operator_keeps_the_container_idle(tmp_path: Path,
                                                                 code: str) -> None:
    proc, _ = start(tmp_path, code)
    try:
        with pytest.raises(subprocess.TimeoutExpired):
            proc.wait(timeout=2)  # still up: no exit for the restart policy to act on
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=10) == 0
        stderr = proc.stderr.read() if proc.stderr else ""
        assert f"retina-cdc exited {code} and needs an operator" in stderr
        assert "docker-compose restart cdc" in stderr
    finally:
        proc.kill()


@pytest.mark.parametrize("code", ["0", "1", "2", "4", "137"])
def test_other_exits_are_passed_on(tmp_path: Path, code: str) -> None:
    proc, _ = start(tmp_path, code)
    assert proc.wait(timeout=10) == int(code)
    assert "needs an operator" not in (proc.stderr.read() if proc.stderr else "")


def test_sigterm_reaches_the_connector(tmp_path: Path) -> None:
    proc, marker = start(tmp_path, None)
    try:
        eventually(lambda: marker.exists() and marker.read_text().strip() == "running", 10,
                   "the stand-in connector to start")
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=10) == 0
        assert marker.read_text().strip() == "stopped-cleanly"
    finally:
        proc.kill()
