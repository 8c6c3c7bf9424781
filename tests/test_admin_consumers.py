"""``retina-admin consumer ...`` as an operator runs it, against a real TransServer (etcd and
PostgreSQL real, the query gate off): the console script, its text and JSON output and its
exit codes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from typing import Any

import pytest

from retina_common.pb import trans_pb2 as tpb
from retina_common.refusal import earliest_cursor

from .support import ROOT, TransServerProcess, begin_write
from .test_trans_server import trans_factory  # noqa: F401  (the fixture)

pytestmark = pytest.mark.integration


def admin(server: TransServerProcess, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "retina_common.admin_cli", "consumer", args[0],
                           "--config", str(server.config_path), *args[1:]], cwd=ROOT,
                          capture_output=True, text=True, timeout=60, env=dict(os.environ))


def admin_json(server: TransServerProcess, *args: str) -> Any:
    done = admin(server, *args, "--json")
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def commit(stub) -> int:
    w = begin_write(stub)
    stub.CommitTrans(tpb.CommitTransRequest(trans_id=w.trans_id), timeout=10)
    return w.timestamp


def test_a_consumer_from_the_command_line(
        trans_factory: Callable[..., TransServerProcess]) -> None:  # noqa: F811
    server = trans_factory(gate={"retina_enabled": False},
                           trans={"history_retention_ms": 0}).start()
    stub = server.stub()
    stamps = [commit(stub) for _ in range(4)]
    newest = admin_json(server, "register", "index", "--table", "shop.orders")
    assert (newest["cursor_ts"], newest["table"], newest["lag_commits"]) == \
        (stamps[-1], "shop.orders", 0)  # no --cursor: the high watermark
    early = admin(server, "register", "audit", "--cursor", str(stamps[0]))
    assert early.returncode == 0, early.stderr
    assert early.stdout.startswith(f"consumer audit at cursor {stamps[0]}, ")
    assert "3 commit(s) behind" in early.stdout
    listed = admin_json(server, "list")
    assert [c["name"] for c in listed["consumers"]] == ["audit", "index"]
    assert listed["max_consumer_lag_ms"] == 3_600_000
    shown = admin(server, "list")
    assert shown.returncode == 0 and "cursor" in shown.stdout and "shop.orders" in shown.stdout
    assert stub.GetSafeGcTimestamp(tpb.GetSafeGcTimestampRequest(),
                                   timeout=10).safe_gc_ts == stamps[0]

    moved = admin_json(server, "commit", "audit", str(stamps[2]))
    assert moved["cursor_ts"] == stamps[2] and moved["lag_commits"] == 1
    back = admin(server, "commit", "audit", str(stamps[1]))
    assert back.returncode == 1 and "INVALID_ARGUMENT" in back.stderr
    assert stub.GetSafeGcTimestamp(tpb.GetSafeGcTimestampRequest(),
                                   timeout=10).safe_gc_ts == stamps[2]  # the horizon now
    late = admin(server, "register", "late", "--cursor", str(stamps[0]))
    assert late.returncode == 1 and "FAILED_PRECONDITION: changes_expired" in late.stderr
    assert earliest_cursor(late.stderr.split(": ", 3)[3].strip()) == stamps[2]
    bad = admin(server, "register", "no/slash")
    assert bad.returncode == 1 and "INVALID_ARGUMENT" in bad.stderr

    assert admin_json(server, "drop", "audit") == {"name": "audit", "dropped": True}
    again = admin(server, "drop", "audit")
    assert again.returncode == 1 and "no consumer named audit" in again.stderr
    gone = admin(server, "commit", "audit", str(stamps[3]))
    assert gone.returncode == 1 and "NOT_FOUND" in gone.stderr
    usage = subprocess.run([sys.executable, "-m", "retina_common.admin_cli", "consumer",
                            "commit", "index"], cwd=ROOT, capture_output=True, text=True,
                           timeout=60)
    assert usage.returncode == 2
