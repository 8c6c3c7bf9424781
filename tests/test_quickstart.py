"""The user manual's quickstart ("Writing to Retina", docs/operations.md), run as
written: the command block is read from the page, so the page and this test cannot
drift apart. Real processes: the local cluster, retina-write, retina-query, a SIGKILL
of a node, retina-admin recover."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from .support import ROOT

pytestmark = pytest.mark.integration

PAGE = ROOT / "docs" / "operations.md"
HEADING = "### Quickstart: from `make setup` to a crash and back"


def quickstart_commands() -> list[str]:
    """The indented command block under the quickstart heading, one command a line
    (continuations joined, comments dropped), without the set-up line."""
    text = PAGE.read_text()
    block = text[text.index(HEADING):].split("\n\n", 3)[2]
    lines = [line[4:] for line in block.splitlines()]
    joined = re.sub(r"\\\n\s*", "", "\n".join(lines))
    commands = [line.split("  #")[0].strip() for line in joined.splitlines()]
    return [c for c in commands if c and not c.startswith("make setup")]


def rows_printed(done: subprocess.CompletedProcess[str]) -> list[str]:
    """The table's rows (stdout: a header, a rule, the rows); the footer on stderr says
    how many there are."""
    match = re.search(r"-- (\d+) rows at snapshot", done.stderr)
    assert match, done.stderr
    rows = sorted(line.rstrip() for line in done.stdout.splitlines()[2:] if line.strip())
    assert len(rows) == int(match.group(1)), done.stdout + done.stderr
    return rows


def test_the_quickstart_runs_as_written_and_keeps_every_row_across_a_crash(
        base_dir: Path) -> None:
    # Under the session's directory: PostgreSQL runs as the postgres user, who cannot
    # enter pytest's private tmp_path (nor run with it as its working directory).
    workdir = base_dir / "quickstart"
    workdir.mkdir()
    state = workdir / "cluster"
    bin_dir = Path(sys.executable).parent
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"}
    commands = quickstart_commands()
    assert commands[0].startswith("retina-cluster start")
    node = None
    outputs: list[tuple[str, subprocess.CompletedProcess[str]]] = []
    try:
        for command in commands:
            if command.startswith("export "):
                name, _, value = command[len("export "):].partition("=")
                env[name] = value.replace(".retina-cluster", str(state))
                continue
            argv = shlex.split(command)
            if argv[0] == "retina-cluster":
                argv += ["--state-dir", str(state)]
            if node is not None:
                argv = [node if a == "127.0.0.1:NNNNN" else a for a in argv]
            done = subprocess.run(argv, env=env, cwd=workdir, capture_output=True,
                                  text=True, timeout=180)
            outputs.append((command, done))
            expect_refusal = command.startswith("retina-query") and any(
                c.startswith("retina-cluster kill-node") for c, _ in outputs) and not any(
                c.startswith("retina-cluster start-node") for c, _ in outputs)
            assert done.returncode == (1 if expect_refusal else 0), \
                f"{command}: exit {done.returncode}\n{done.stdout}\n{done.stderr}"
            if argv[:2] == ["retina-cluster", "start"]:
                node = json.loads((state / "cluster.json").read_text())["nodes"][0]
        queries = [d for c, d in outputs if c.startswith("retina-query") and d.returncode == 0]
        before, after = (rows_printed(q) for q in queries)
        assert len(before) == 3 and after == before
        recovered = [d for c, d in outputs if c.startswith("retina-admin recover")][-1]
        assert f"{node}: READY" in recovered.stdout
    finally:
        subprocess.run(["retina-cluster", "stop", "--state-dir", str(state)], env=env,
                       capture_output=True, timeout=120)
