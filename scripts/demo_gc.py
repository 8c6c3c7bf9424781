"""The demo's Storage GC act, on the cluster the CDC act left running: the Spark job
(``spark_jobs/storage_gc.py``, local mode) reclaims the rows the workload deleted or
replaced and merges small files while the stream goes on; then a Retina node is killed
(SIGKILL at the failpoint ``gc.primary_switch.after``) in the middle of a commit,
restarted, recovered by the connector, and recovery's decision from the GC journal is
shown. The gated snapshot equals the source after each step."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from devtools.cluster import ClusterState, node_state, start_retina_server, wait_for
from retina_common import file_names
from retina_common.catalog import Catalog, FileType
from retina_common.pb import retina_pb2 as rpb
from retina_common.pb import retina_pb2_grpc
from retina_common.storage import object_size, open_parquet
from retina_common.tls import open_channel

KILL_POINT = "gc.primary_switch.after"


def stored(catalog: Catalog, schema: str, tables: list[str]) -> dict[str, int]:
    """REGULAR files, their bytes and the rows they physically hold, over ``tables``."""
    out = {"files": 0, "bytes": 0, "rows": 0}
    for name in tables:
        table = catalog.get_table(schema, name)
        for path in catalog.get_paths(table.table_id):
            for f in catalog.get_regular_files(path.path_id):
                out["files"] += 1
                out["bytes"] += object_size(path.uri, f.name)
                out["rows"] += open_parquet(path.uri, f.name).metadata.num_rows
    return out


def settled(catalog: Catalog) -> bool:
    """Every written row is in a published file (the flush timer ran): what is stored
    can be compared before and after a GC pass."""
    return not catalog.get_files_by_type(None, [FileType.TEMPORARY_INGEST])


def run_job(state: ClusterState, schema: str,
            threshold: float = 0.05) -> tuple[int, dict[str, Any], float]:
    """One run of the Spark job; returns its exit code, its JSON report and seconds."""
    argv = [sys.executable, "-m", "spark_jobs.storage_gc", "--config", state.config_path,
            "--schema", schema, "--all-tables", "--master", "local[2]", "--json",
            "--deleted-threshold", str(threshold)]
    started = time.monotonic()
    done = subprocess.run(argv, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "RETINA_CONFIG": state.config_path})
    seconds = time.monotonic() - started
    report: dict[str, Any] = {}
    for line in reversed(done.stdout.splitlines()):
        if line.startswith("{"):
            report = json.loads(line)
            break
    log = Path(state.state_dir, "logs", "storage-gc.log")
    with open(log, "a") as out:
        out.write(done.stdout + done.stderr)
    return done.returncode, report, seconds


def gc_status(node: str) -> rpb.GetGcStatusResponse:
    with open_channel(node) as channel:
        return retina_pb2_grpc.RetinaWorkerServiceStub(channel).GetGcStatus(
            rpb.GetGcStatusRequest(), timeout=10)


def checkpoint_twice(state: ClusterState) -> None:
    """Two checkpoints on every node: both slots then hold the new files, their journal
    entries are promoted, and a later pass may rewrite those files again."""
    for node in state.nodes:
        with open_channel(node) as channel:
            stub = retina_pb2_grpc.RetinaWorkerServiceStub(channel)
            for _ in range(2):
                stub.CreateCheckpoint(rpb.CreateCheckpointRequest(), timeout=60)


def gc_act(state: ClusterState, check: Callable[[bool, str], None], schema: str,
           tables: list[str], more_writes: Callable[[int], None],
           converged: Callable[[], bool]) -> dict[str, Any]:
    catalog = Catalog(state.postgres.dsn())
    try:
        more_writes(20)  # safeGcTs passes the workload's last deletes
        wait_for(lambda: settled(catalog), 30, "the write buffers to be published")
        # And so does every replay start a restart could use: a rewrite drops only rows
        # deleted below both checkpoint slots' (GC_CUTOFF_BELOW_REPLAY_FLOOR).
        checkpoint_twice(state)
        before = stored(catalog, schema, tables)
        code, report, seconds = run_job(state, schema)
        totals = report.get("totals", {})
        check(code == 0 and totals.get("committed", 0) > 0,
              f"storage_gc (Spark local[2]) committed {totals.get('committed')} rewrite(s) "
              f"in {seconds:.1f}s (exit {code})")
        wait_for(lambda: settled(catalog), 30, "the write buffers to be published")
        after = stored(catalog, schema, tables)
        check(after["rows"] < before["rows"],
              f"rows stored {before['rows']} -> {after['rows']} (reclaimed "
              f"{totals.get('rows_dropped')} deleted or replaced rows), files "
              f"{before['files']} -> {after['files']}, bytes {before['bytes']:,} -> "
              f"{after['bytes']:,}")
        wait_for(converged, 60, "the gated snapshot to equal the source after GC")
        check(True, "gated snapshot = source after the rewrites")

        checkpoint_twice(state)
        victim = state.nodes[0]
        os.kill(state.retina_pids[victim], 9)
        start_retina_server(state, victim, {"RETINA_FAILPOINTS": f"{KILL_POINT}=exit(137)"})
        wait_for(lambda: node_state(victim) == rpb.READY, 120, "the connector to recover it")
        more_writes(40)
        # Threshold 0: every file is a candidate, so the victim surely gets a commit.
        code, report, _s = run_job(state, schema, threshold=0.0)
        wait_for(lambda: node_state(victim) is None, 60, f"{victim} to die at {KILL_POINT}")
        check(code != 0, f"SIGKILL {victim} at {KILL_POINT}, in the middle of a commit "
                         f"(the job reports it and exits {code})")
        started = time.monotonic()
        # Replaced files may go as soon as nothing holds them; rounds only on demand (the
        # sweeper act below).
        start_retina_server(state, victim, {"RETINA__RETINA__GC_RETIRED_RETENTION_MS": "0",
                                            "RETINA__RETINA__SWEEPER_INTERVAL_MS": "0"})
        wait_for(lambda: node_state(victim) == rpb.READY, 120, "the connector to recover it")
        ready_s = time.monotonic() - started
        entries = gc_status(victim).entries
        rolled = [e for e in entries if e.state == "ABORTED" and e.reason.startswith("recovery")]
        check(bool(rolled), f"restarted: READY in {ready_s:.2f}s; recovery's decision: "
                            f"{rolled[-1].reason if rolled else 'none'} (journal ABORTED, "
                            "old files REGULAR again)")
        wait_for(converged, 60, "the gated snapshot to equal the source after the crash")
        check(True, "gated snapshot = source after the crash and the rollback")
        checkpoint_twice(state)
        code, report, _s = run_job(state, schema, threshold=0.0)
        totals = report.get("totals", {})
        check(code == 0, f"GC again: {totals.get('committed')} rewrite(s) committed")
        wait_for(converged, 60, "the gated snapshot to equal the source")
        swept = lineage_and_sweep(state, check, victim, converged)
        final = stored(catalog, schema, tables)
        journal = {e.state for n in state.nodes for e in gc_status(n).entries}
        return {"before": before, "after": after, "final": final, "seconds": seconds,
                "decision": rolled[-1].reason if rolled else "", "journal": sorted(journal),
                "swept": swept,
                "streams": len({file_names.parse(f.name).vnode
                                for f in catalog.get_files_by_type(None, [FileType.REGULAR])})}
    finally:
        catalog.close()


def retina_gc(state: ClusterState, *args: str) -> dict[str, Any]:
    """``retina-gc --json`` as an operator runs it; its JSON answer."""
    done = subprocess.run([sys.executable, "-m", "retina_common.gc_cli", "--config",
                           state.config_path, *args, "--json"],
                          capture_output=True, text=True, timeout=300, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"retina-gc {' '.join(args)} exited {done.returncode}: "
                           f"{done.stderr.strip()[-500:]}")
    return json.loads(done.stdout)


def lineage_and_sweep(state: ClusterState, check: Callable[[bool, str], None], node: str,
                      converged: Callable[[], bool]) -> dict[str, Any]:
    """Revert one completed rewrite of ``node`` (its retention is 0: the sweeper may
    remove what the rewrites replaced once no checkpoint slot holds it), then sweep."""
    records = retina_gc(state, "--node", node, "lineage")[node].get("records", [])
    revertible = [r for r in records if r.get("revertible")]
    check(bool(revertible), f"retina-gc lineage: {len(records)} rewrites on {node}, "
                            f"{len(revertible)} revertible")
    target = revertible[-1]
    reverted = retina_gc(state, "revert", target["rewrite_id"])
    check(reverted.get("status") == "REVERTED",
          f"retina-gc revert {target['rewrite_id'][:12]}: file {target['new_file_id']} -> "
          f"files {target.get('old_file_ids')} again (one catalog swap back)")
    wait_for(converged, 60, "the gated snapshot to equal the source after the revert")
    check(True, "gated snapshot = source after the revert")
    held = retina_gc(state, "--node", node, "sweep", "--pass", "retired", "--dry-run")[node]
    reasons = sorted({o.get("reason", "") for o in held.get("objects", [])
                      if o.get("action") == "held"})
    checkpoint_twice(state)  # neither slot holds the replaced files any more
    swept = retina_gc(state, "--node", node, "sweep")[node]
    removed = [o for o in swept.get("objects", []) if o.get("action") == "removed"
               and o.get("pass_name") == "retired"]
    check(bool(removed), f"retina-gc sweep: held before the checkpoints ({', '.join(reasons)}), "
                         f"then {len(removed)} retired files removed "
                         f"({int(swept.get('bytes_removed', 0)):,} bytes)")
    wait_for(converged, 60, "the gated snapshot to equal the source after the sweep")
    check(True, "gated snapshot = source after the sweep")
    return {"reverted": target["rewrite_id"], "removed": len(removed),
            "bytes_removed": int(swept.get("bytes_removed", 0))}
