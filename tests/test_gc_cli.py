"""``retina-gc`` as an operator runs it (issue 26): ``revert`` takes the id prefix that
``lineage`` shows, and every JSON answer has one shape per record, the same as
``retina-admin``'s (every field, numbers as numbers), a dry-run sweep included."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from typing import Any

import pytest

from retina_common import exit_codes
from retina_common.catalog import Catalog
from retina_common.gc_cli import RewriteIdError, resolve_rewrite_id
from retina_common.pb import retina_pb2 as rpb

from . import gc
from .dataplane import DataPlane
from .support import ROOT
from .test_storage_gc import load

KEEP = 3_600_000  # the rewrite stays revertible for the whole test
A = "2e645a264ad1" + "0" * 20
B = "2e645a264ad1" + "f" * 20
C = "9a0b" + "1" * 28


def run(plane: DataPlane, module: str, *args: str) -> subprocess.CompletedProcess[str]:
    """A console command (retina-gc, retina-admin) against ``plane``."""
    return subprocess.run([sys.executable, "-m", module, "--config", str(plane.config_path),
                           *args], cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "RETINA_NO_PROGRESS": "1"})


def gc_json(plane: DataPlane, *args: str) -> Any:
    done = run(plane, "retina_common.gc_cli", *args, "--json")
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


# --- a rewrite id prefix names one rewrite, or the message says why not ---------------------
def test_a_unique_prefix_resolves_to_the_full_id_and_its_node() -> None:
    known = {"n1:1": [A, C], "n2:2": []}
    assert resolve_rewrite_id(C[:8], known) == ("n1:1", C)
    assert resolve_rewrite_id(C.upper(), known) == ("n1:1", C)  # the whole id, any case


def test_an_ambiguous_prefix_is_refused_listing_every_candidate() -> None:
    with pytest.raises(RewriteIdError) as refused:
        resolve_rewrite_id(A[:12], {"n1:1": [A], "n2:2": [B, C]})
    assert refused.value.exit_code == exit_codes.USAGE
    assert str(refused.value) == (
        f"rewrite id prefix {A[:12]} is ambiguous, it matches 2 rewrites: {A} on n1:1, "
        f"{B} on n2:2; give more digits")


@pytest.mark.parametrize("given, message, code", [
    ("2e645a", "rewrite id prefix 2e645a is too short: give at least 8 hex digits",
     exit_codes.USAGE),
    ("2e645a26-4ad1", "'2e645a26-4ad1' is not a rewrite id: hex digits", exit_codes.USAGE),
    ("0123abcd", "no node knows a rewrite whose id starts with 0123abcd (`retina-gc lineage` "
                 "lists them); n3:3 did not answer and may know it", exit_codes.FAILED),
])
def test_a_prefix_naming_no_rewrite_says_why(given: str, message: str, code: int) -> None:
    with pytest.raises(RewriteIdError) as refused:
        resolve_rewrite_id(given, {"n1:1": [A], "n2:2": [C]}, ["n3:3"])
    assert refused.value.exit_code == code
    assert str(refused.value).startswith(message)


# --- against a real cluster -------------------------------------------------------------------
@pytest.mark.integration
def test_lineage_json_has_every_field_and_revert_takes_the_prefix_lineage_shows(
        make_plane: Callable[..., DataPlane], catalog: Catalog) -> None:
    plane = make_plane(nodes=2, gc_retired_retention_ms=KEEP, sweeper_interval_ms=0)
    load(plane, catalog)
    # Virtual node 0's stream: the field at its default value, which must still be there.
    (node, _vnode), files = next((k, v) for k, v in gc.streams(plane, "orders").items()
                                 if k[1] == 0)
    rewrite = gc.rewrite(plane, node, "orders", 0, files)
    assert rewrite.outcome == "COMMITTED"
    other = next(n for n in plane.nodes if n != node)

    lineage = gc_json(plane, "lineage")
    assert lineage[other] == {"records": []}  # not {}: the field is there, empty
    [record] = lineage[node]["records"]
    assert set(record) == set(rpb.GcLineageRecord.DESCRIPTOR.fields_by_name)
    assert (record["rewrite_id"], record["virtual_node_id"], record["new_file_id"],
            record["old_file_ids"], record["status"]) == \
        (rewrite.rewrite_id, 0, rewrite.new_file_id, [f.file_id for f in files], "COMPLETED")
    assert isinstance(record["created_at_ms"], int) and record["reverted_at_ms"] == 0
    admin = run(plane, "retina_common.admin_cli", "lineage", "--json")
    assert admin.returncode == 0, admin.stderr
    assert json.loads(admin.stdout) == lineage  # one shape in both CLIs

    table = run(plane, "retina_common.gc_cli", "lineage")
    shown = rewrite.rewrite_id[:12]
    assert shown in table.stdout and rewrite.rewrite_id not in table.stdout
    too_short = run(plane, "retina_common.gc_cli", "revert", shown[:7])
    assert too_short.returncode == 2 and "too short" in too_short.stderr
    absent = "0" * 8 if not rewrite.rewrite_id.startswith("0" * 8) else "f" * 8
    unknown = run(plane, "retina_common.gc_cli", "revert", absent)
    assert unknown.returncode == 1
    assert f"no node knows a rewrite whose id starts with {absent}" in unknown.stderr

    reverted = run(plane, "retina_common.gc_cli", "revert", shown, "--json")
    assert reverted.returncode == 0, reverted.stderr
    done = json.loads(reverted.stdout)
    assert (done["rewrite_id"], done["status"], done["virtual_node_id"]) == \
        (rewrite.rewrite_id, "REVERTED", 0)
    assert plane.read("orders") == plane.model.rows["orders"]


@pytest.mark.integration
def test_a_dry_run_sweep_prints_what_it_would_remove_in_json_and_in_the_table(
        make_plane: Callable[..., DataPlane]) -> None:
    plane = make_plane(sweeper_interval_ms=0)
    node = plane.nodes[0]
    plane.checkpoint(node)
    # A checkpoint body no slot names: the checkpoints pass would remove it.
    directory = plane.workdir / "storage" / "_checkpoints" / node.replace(":", "-")
    stale = directory / f"ckpt-{0:020d}.bin"
    stale.write_bytes(b"stale")

    view = gc_json(plane, "sweep", "--pass", "checkpoints", "--dry-run")[node]
    assert set(view) == {"objects", "removed", "bytes_removed", "held", "dry_run",
                         "would_remove", "bytes_would_remove"}
    would = [o for o in view["objects"] if o["action"] == "would_remove"]
    assert stale.name in {o["name"] for o in would}
    assert (view["dry_run"], view["removed"], view["bytes_removed"]) == (True, 0, 0)
    assert view["would_remove"] == len(would) >= 1
    assert view["bytes_would_remove"] == sum(o["bytes"] for o in would)
    table = run(plane, "retina_common.gc_cli", "sweep", "--pass", "checkpoints", "--dry-run")
    assert table.returncode == 0, table.stderr
    assert (f"{node}: dry run, would remove {view['would_remove']} "
            f"({view['bytes_would_remove']} bytes)") in table.stdout
    assert stale.name in table.stdout and stale.exists()  # nothing removed
    admin = run(plane, "retina_common.admin_cli", "gc", "run", "--sweep", "--dry-run",
                "--json")
    assert admin.returncode == 0, admin.stderr
    assert set(json.loads(admin.stdout)[node]["sweep"]) == set(view)
