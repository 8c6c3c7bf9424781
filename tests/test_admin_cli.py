"""``retina-admin`` as an operator runs it, against one real cluster shared by the module:
etcd, PostgreSQL, a TransServer and two Retina nodes (tests/dataplane.py)."""

from __future__ import annotations

import fcntl
import json
import os
import pty
import struct
import subprocess
import sys
import termios
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from devtools.cluster import EtcdInstance, PostgresInstance
from retina_common.catalog import FileType
from retina_common.keys import lifecycle_key
from retina_common.lifecycle_record import LifecycleRecord
from retina_common.pb import retina_pb2 as rpb
from retina_common.pb import trans_pb2 as tpb

from .dataplane import DataPlane, module_plane
from .support import ROOT, eventually

pytestmark = pytest.mark.integration

ORDERS = [{"id": i, "customer": f"c{i % 7}", "amount": "1.50", "note": "n"}
          for i in range(1, 401)]


@pytest.fixture(scope="module")
def plane(base_dir: Path, etcd_server: EtcdInstance,
          pg_server: PostgresInstance) -> Iterator[DataPlane]:
    workdir = base_dir / "admin-cli"
    workdir.mkdir()
    with module_plane(workdir, etcd_server.endpoint, pg_server,
                      {"orders": {"inserts": ORDERS}}) as dp:
        # More rows, so that every stream also has REGULAR files, not only open ones.
        for start in range(401, 2001, 400):
            dp.commit({"orders": {"inserts": [dict(r, id=r["id"] + start - 1)
                                              for r in ORDERS]}})
        yield dp


def admin(plane: DataPlane, *args: str, env: dict[str, str] | None = None
          ) -> subprocess.CompletedProcess[str]:
    """The real console script; --config unless the environment names the config."""
    config = [] if env else ["--config", str(plane.config_path)]
    command, *rest = args
    sub = [command, rest.pop(0)] if command in ("gc", "pin") else [command]
    return subprocess.run([sys.executable, "-m", "retina_common.admin_cli", *sub, *config,
                           *rest], cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env={**os.environ, **(env or {})})


def admin_json(plane: DataPlane, *args: str) -> Any:
    done = admin(plane, *args, "--json")
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_status_shows_every_node_ready_with_its_checkpoint(plane: DataPlane) -> None:
    status = admin_json(plane, "status")
    assert status["problems"] == []
    for node in plane.nodes:
        view = status["nodes"][node]
        assert (view["state"], view["phase"]) == ("READY", "READY")
        # The READY hooks took a checkpoint; etcd's current slot names the same one.
        assert view["last_checkpoint_id"] > 0
        assert status["etcd"]["checkpoints"][node]["checkpoint_id"] == \
            view["last_checkpoint_id"]
        assert view["last_checkpoint_write_time_ms"] > 0
        assert status["etcd"]["lifecycle"][node]["state"] == "READY"
        assert status["trans"]["gate"]["nodes"][node] == "READY"
    assert status["trans"]["gate"]["admitted"] is True
    assert status["trans"]["high_watermark"] >= plane.changelog[-1][0]
    assert 0 <= status["trans"]["safe_gc_ts"] <= status["trans"]["high_watermark"]

    human = admin(plane, "status")
    assert human.returncode == 0, human.stderr
    lines = human.stdout.splitlines()
    assert lines[0].split()[:4] == ["node", "lifecycle", "phase", "checkpoint"]
    for node in plane.nodes:
        row = next(line.split() for line in lines if line.startswith(node))
        assert row[1:4] == ["READY", "READY", str(status["nodes"][node]["last_checkpoint_id"])]
    assert any(line.startswith("query gate  OPEN") for line in lines)


def test_checkpoint_advances_the_checkpoint_id(plane: DataPlane) -> None:
    node = plane.nodes[0]
    before = admin_json(plane, "status")["nodes"][node]["last_checkpoint_id"]
    taken = admin_json(plane, "checkpoint", "--node", node)
    assert list(taken) == [node] and taken[node]["checkpoint_id"] > before
    after = admin_json(plane, "status")
    assert after["nodes"][node]["last_checkpoint_id"] == taken[node]["checkpoint_id"]
    assert after["etcd"]["checkpoints"][node]["checkpoint_id"] == taken[node]["checkpoint_id"]


def test_files_lists_the_tables_files_by_type(plane: DataPlane) -> None:
    table = plane.tables["orders"]
    paths = plane.catalog.get_paths(table.table_id)
    expected = {f.file_id: f.type.name for p in paths
                for f in plane.catalog.get_files_by_type(p.path_id, list(FileType))}
    assert FileType.REGULAR.name in expected.values()
    listed = admin_json(plane, "files", "shop.orders")
    assert {f["file_id"]: f["type"] for f in listed["files"]} == expected
    assert {f["node"] for f in listed["files"]} <= set(plane.nodes)

    regular = admin_json(plane, "files", "shop.orders", "--type", "regular")
    assert {f["file_id"] for f in regular["files"]} == \
        {i for i, t in expected.items() if t == "REGULAR"}
    human = admin(plane, "files", "shop.orders", "--type", "REGULAR")
    assert human.returncode == 0, human.stderr
    assert human.stdout.splitlines()[-1] == f"{len(regular['files'])} files"

    missing = admin(plane, "files", "shop.nope")
    assert missing.returncode == 1 and "NotFound" in missing.stderr
    assert admin(plane, "files", "shop.orders", "--type", "TEMPORARY").returncode == 2


def test_gc_status_run_and_lineage(plane: DataPlane) -> None:
    status = admin_json(plane, "gc", "status")
    assert set(status) == set(plane.nodes)
    assert all(s["pending_rewrites"] == 0 for s in status.values())
    ran = admin_json(plane, "gc", "run")
    for node in plane.nodes:
        assert {"folded_items", "pruned_versions", "fold_ts"} <= set(ran[node]["maintenance"])
        assert "sweep" not in ran[node]
    dry = admin_json(plane, "gc", "run", "--sweep", "--dry-run")
    for node in plane.nodes:
        assert "maintenance" not in dry[node]  # a dry run changes nothing: no fold/prune
        assert dry[node]["sweep"]["removed"] == 0
    alone = admin(plane, "gc", "run", "--dry-run")
    assert alone.returncode == 2 and "--dry-run applies to the sweep" in alone.stderr
    lineage = admin_json(plane, "lineage")
    assert all(v["records"] == [] for v in lineage.values())  # no rewrite has run
    for args in (("gc", "status"), ("lineage",)):
        human = admin(plane, *args)
        assert human.returncode == 0, human.stderr
        assert all(node in human.stdout for node in plane.nodes)


def query(plane: DataPlane, *args: str) -> subprocess.CompletedProcess[str]:
    """``retina-query shop.orders ...`` as an operator runs it."""
    return subprocess.run([sys.executable, "-m", "retina_common.reader", "shop.orders",
                           "--config", str(plane.config_path), *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)


def test_a_pin_from_the_command_line_is_read_as_of_and_released_by_dropping_it(
        plane: DataPlane) -> None:
    stub = plane.trans.stub()
    hwm = stub.GetHighWatermark(tpb.GetHighWatermarkRequest(), timeout=10).high_watermark
    pinned = len(plane.model.rows["orders"])
    created = admin_json(plane, "pin", "create", "cli-pin", "--at", str(hwm))
    assert created["name"] == "cli-pin" and created["ts"] == hwm
    assert "cli-pin" in [p["name"] for p in admin_json(plane, "pin", "list")["pins"]]
    history = admin_json(plane, "status")["trans"]["history"]
    assert history["pins"] == 1 and history["earliest_readable_ts"] <= hwm
    shown = admin(plane, "status")
    assert "earliest readable: timestamp" in shown.stdout and "1 pin(s)" in shown.stdout
    plane.commit({"orders": {"deletes": [{"id": i} for i in range(1, 41)]}})
    for point in (["--as-of", str(hwm)], ["--pin", "cli-pin"]):
        done = query(plane, *point, "--format", "count")
        assert done.returncode == 0, done.stderr
        assert int(done.stdout) == pinned and f"at snapshot {hwm} (as of" in done.stderr
    assert int(query(plane, "--format", "count").stdout) == len(plane.model.rows["orders"])
    bad = admin(plane, "pin", "create", "other", "--at-time", "yesterday")
    assert bad.returncode == 2 and "ISO 8601" in bad.stderr
    assert admin(plane, "pin", "drop", "cli-pin").returncode == 0
    again = admin(plane, "pin", "drop", "cli-pin")
    assert again.returncode == 1 and "no pin named cli-pin" in again.stderr
    stub.GetSafeGcTimestamp(tpb.GetSafeGcTimestampRequest(), timeout=10)  # passes it now
    gone = query(plane, "--as-of", str(hwm))
    assert gone.returncode == 1
    assert "FAILED_PRECONDITION: snapshot_expired" in gone.stderr
    assert "the earliest readable point is timestamp" in gone.stderr


def test_usage_and_configuration_errors_exit_2(plane: DataPlane, tmp_path: Path) -> None:
    unknown = admin(plane, "status", "--node", "127.0.0.1:1")
    assert unknown.returncode == 2 and "not in the topology" in unknown.stderr
    missing = admin(plane, "status", env={"RETINA_CONFIG": str(tmp_path / "none.toml")})
    assert missing.returncode == 2 and missing.stderr.startswith("retina-admin:")
    assert admin(plane, "mark-ready", plane.nodes[0]).returncode == 2  # --token is required
    # The config from the environment, and the common options before the command.
    from_env = subprocess.run([sys.executable, "-m", "retina_common.admin_cli", "--json",
                               "status"], cwd=ROOT, capture_output=True, text=True, timeout=120,
                              env={**os.environ, "RETINA_CONFIG": str(plane.config_path)})
    assert from_env.returncode == 0 and json.loads(from_env.stdout)["problems"] == []


def test_mark_ready_refuses_a_ready_node(plane: DataPlane) -> None:
    node = plane.nodes[0]
    record = plane.etcd.get(lifecycle_key(node))
    assert record is not None
    refused = admin(plane, "mark-ready", node, "--token", "0123abcd")
    assert refused.returncode == 1
    assert "not AWAITING_REPLAY" in refused.stderr and "nothing changed" in refused.stderr
    status = plane.status(node)
    assert (status.state, status.phase) == (rpb.READY, "READY")


def test_mark_ready_is_guarded_by_the_phase_and_the_token(plane: DataPlane) -> None:
    """A node restarted (gracefully: nothing to replay) waits in AWAITING_REPLAY; the
    operator ends its recovery with the token hash `status` shows."""
    node = plane.nodes[1]
    plane.retinas[node].stop()
    down = admin(plane, "status")
    assert down.returncode == 1 and node in down.stderr  # what did not answer, on stderr
    row = next(line for line in down.stdout.splitlines() if line.startswith(node))
    assert "unreachable" in row
    plane.retinas[node].start()
    plane.wait_replay_ready(node)
    status = admin(plane, "status", "--json")
    assert status.returncode == 0, status.stderr
    view = json.loads(status.stdout)["nodes"][node]
    assert (view["state"], view["phase"]) == ("RECOVERING", "AWAITING_REPLAY")
    assert "recovery_attempt_token" not in view  # the token itself is never printed
    published = LifecycleRecord.parse(node, plane.etcd.get(lifecycle_key(node)).value)
    assert view["token_hash"] == published.token_hash and len(published.token_hash) == 8

    starts = admin_json(plane, "replay-ts", "--node", node)[node]
    assert starts["checkpoint_id"] == view["checkpoint_id"]
    assert set(starts["vnode_replay_from_ts"]) == {
        str(v) for v in range(plane.topology.virtual_nodes)
        if plane.topology.node_of_vnode(v) == node}

    wrong = admin(plane, "mark-ready", node, "--token", "ffffffff")
    assert wrong.returncode == 1 and "does not name" in wrong.stderr
    stale_ckpt = admin(plane, "mark-ready", node, "--token", view["token_hash"],
                       "--checkpoint-id", str(view["checkpoint_id"] + 1))
    assert stale_ckpt.returncode == 1 and "nothing changed" in stale_ckpt.stderr
    assert plane.status(node).phase == "AWAITING_REPLAY"

    done = admin(plane, "mark-ready", node, "--token", view["token_hash"], "--json")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["state"] == "READY"
    assert (plane.status(node).state, plane.status(node).phase) == (rpb.READY, "READY")
    eventually(plane.gate_open, 15, "the query gate to admit after mark-ready")
    again = admin(plane, "mark-ready", node, "--token", view["token_hash"])
    assert again.returncode == 1 and "not AWAITING_REPLAY" in again.stderr


def _run_with_tty_stderr(script: str, env: dict[str, str]) -> tuple[str, str]:
    """stdout (a pipe) and what reached stderr (a pseudo-terminal) of ``python -c``."""
    leader, follower = pty.openpty()
    # A terminal of 100 columns (a fresh pseudo-terminal has none, and tqdm draws nothing).
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))
    try:
        done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, stdout=subprocess.PIPE,
                              stderr=follower, text=True, timeout=60, env={**os.environ, **env})
    finally:
        os.close(follower)
    seen = b""
    try:
        while chunk := os.read(leader, 4096):
            seen += chunk
    except OSError:  # EIO: the terminal has no writer left and everything was read
        pass
    finally:
        os.close(leader)
    assert done.returncode == 0
    return done.stdout, seen.decode(errors="replace")


def test_a_progress_bar_is_drawn_only_on_a_terminal_and_never_on_stdout() -> None:
    script = ("from retina_common import progress\n"
              "for i in progress.track(range(3), desc='sweeping', unit='node'):\n"
              "    with progress.printing():\n"
              "        print(i)\n")
    stdout, terminal = _run_with_tty_stderr(script, {"RETINA_NO_PROGRESS": ""})
    assert stdout == "0\n1\n2\n" and "sweeping" in terminal
    stdout, terminal = _run_with_tty_stderr(script, {"RETINA_NO_PROGRESS": "1"})
    assert stdout == "0\n1\n2\n" and terminal == ""
    piped = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True,
                           text=True, timeout=60)
    assert piped.stdout == "0\n1\n2\n" and piped.stderr == ""
