"""The fault kinds, and how each is injected into the running cluster."""

from __future__ import annotations

import contextlib
import json
import random
import signal
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import grpc

from devtools.cluster import node_state
from retina_common import exit_codes, failpoints
from retina_common.catalog import Catalog, FileType
from retina_common.codec import encode_primary_key, encode_value
from retina_common.etcd import EtcdStore
from retina_common.keys import checkpoint_slot_key
from retina_common.pb import retina_pb2 as rpb
from retina_common.pb import retina_pb2_grpc, trans_pb2_grpc
from retina_common.pb import trans_pb2 as tpb
from retina_common.tls import open_channel
from retina_common.topology import load_topology

from . import spark_replay, split_reads, stalls
from .app_workload import AppWriter
from .campaign_cluster import CDC, TRANS, ChaosCluster
from .gc_driver import ROW_GROUP_ROWS, GcDriver, PassResult, maintenance
from .pinned_snapshots import PinFailpoint
from .prober import ReadinessTracker
from .repeatable_reads import SnapshotBook
from .sweep import (
    ORPHAN_GRACE_MS,
    Planted,
    code_of,
    lineage,
    local_dir,
    plant_orphans,
    plant_temporary,
    revert,
    run_orphan_pass,
    run_sweeper,
)
from .workload import PROBE_TABLE, SCHEMA

# Which process reaches which failpoints (by name prefix).
# etcd.txn.*: every compare-and-swap; Retina's checkpoint pointer swap does one constantly.
# update_record.*: the write fence's points (issue 25), reached by every UpdateRecord.
# refused_writes.*: the record of a write the fence refused (issue 28), reached only by a
# fenced write (a writer stalled past its lease: the stalled_write fault makes them), and
# its pruning by a GC round once such a record is below the replay floor; armed while
# neither happens, the point is noted not reached and the node restarted clean.
RETINA_PREFIXES = ("ingest.", "index.", "checkpoint.", "recovery.", "catalog.", "etcd.", "gc.",
                   "sweeper.", "update_record.", "refused_writes.", "load.")
# Bulk load points (retina_server/bulk_load.py): reached only by a load, so the wait loads a
# chunk at every turn (chaos/bulk_loads.py); promotion follows two checkpoints after one.
# The re-apply points are reached at start-up when a load no checkpoint holds is journaled:
# the campaign loads a chunk right before it kills the node, and arms the point for the start.
LOAD_POINTS = ("load.",)
LOAD_START_POINTS = ("load.reapply.",)
# Points of the Spark job's rewrite task (spark_jobs/storage_gc_task.py, rewrite_group).
REWRITER_PREFIXES = ("gc.rewrite.",)
# Schema evolution: only the connector's Catalog.add_column reaches them, when it reads the
# first change carrying a column a source ALTER TABLE ADD COLUMN added. The connector is
# restarted with the point armed and the workload adds a column and writes it at once
# (workload.add_column; it also does so by itself, rarely); crash at the first hit. The
# restarted connector must add the column or find it there (the comparison checks the
# rows; tests/test_schema_evolution.py checks the catalog too).
SCHEMA_POINTS = ("catalog.add_column.",)
# The application writer's points (retina_common/writer.py): armed in the campaign's own
# writer process (chaos/app_writer.py), which writes between workload steps; it dies with
# its transaction in doubt (logged, not acknowledged) and is started again.
WRITER_PREFIXES = ("writer.",)
# Points no process of this topology reaches, with the reason (reported, never hidden).
# Empty since the campaign runs Storage GC (chaos/gc_driver.py): atomicSwapFiles, the only
# caller of catalog.swap.commit.*, is reached by every GC commit; and since the workload
# adds columns, which reaches catalog.add_column.commit.*.
UNREACHABLE: dict[str, str] = {
    # The bulk loader's own points (retina_common/bulk_loader.py): the campaign's loader
    # runs inside the campaign process, which a kill there would end.
    point: "the loader's own point: the campaign's loader runs in the campaign process; "
           "tests/test_spark_bulk_load.py kills a Spark task there and Spark runs it again"
    for point in ("loader.commit_trans.before", "loader.commit_trans.after")}
# Storage GC points, by what reaches them (chaos/gc_driver.py runs the passes):
# - the commit: reached only while a GC commit runs, so the campaign runs GC passes on the
#   armed node while it waits (catalog.update_file.commit.* is also reached by every
#   ingest publish: the wait writes and runs GC passes, whichever comes first);
GC_COMMIT_POINTS = ("gc.journal.switching.", "gc.visibility.", "gc.main_index.",
                    "gc.primary_switch.", "gc.swap.", "gc.journal.swapped.", "gc.registry.",
                    "catalog.swap.commit.", "catalog.update_file.commit.")
# - promotion: after a GC commit, once both checkpoint slots hold the new file (two
#   checkpoints: a few seconds with the campaign's checkpoint interval);
GC_PROMOTE_POINTS = ("gc.journal.checkpointed.",)
# - the rollback: only when a rewrite is left open by a crash. The node is first crashed
#   inside a GC commit (GC_ROLLBACK_PREPARE), where no checkpoint can hold the new file yet
#   (the switch runs under the stream locks a checkpoint takes), so the next start must
#   roll it back; the point is armed for that start and hit during start-up.
GC_ROLLBACK_POINTS = ("gc.rollback.", "gc.journal.aborted.", "catalog.revert_swap.commit.")
# - the revert (retina_server/gc/lineage.py): reached only by RevertGcRewrite of a COMPLETED
#   rewrite whose old files are still RETIRED: the wait runs a GC pass when the node lists
#   no revertible rewrite (ListGcLineage), else reverts a random revertible one.
GC_REVERT_POINTS = ("gc.revert.",)
# Sweeper points (retina_server/gc/sweeper.py, orphans.py, CheckpointStore.cleanup), by the
# pass that reaches them once something is due. The node's own round runs every 2 s while READY
# (cluster.RETINA_SETTINGS); the wait also forces rounds with RunSweeper and makes files
# due: GC passes (retired files, then settled final journal records), planted temporary
# leftovers (a TEMPORARY_GC / TEMPORARY_INGEST row named two hours ago) and planted orphan
# objects (chaos/sweep.py). checkpoint.body_delete.* is also reached by every checkpoint.
# The TransServer's pin points (trans_gate/pins.py): reached only by CreatePin and
# DropPin, so the wait creates and drops pins (chaos/pinned_snapshots.py, PinFailpoint);
# once restarted, the pin in flight must be there exactly when the point lies after its
# etcd write. The time map's points are reached by its flush (every second).
PIN_POINTS = ("trans.pin.",)
# The GC horizon's points (trans_gate/history.py): reached when a safeGcTs above the
# durable horizon is handed out. The nodes' GC rounds ask every 5 s, and only a few of
# those raise it (the retained snapshot moves with the time map), so the wait asks too,
# as a GC job's driver does.
HORIZON_POINTS = ("trans.horizon.",)
SWEEP_PASSES = {"sweeper.retired.": "retired", "sweeper.temporary.": "temporary",
                "sweeper.orphan.": "orphans", "sweeper.journal.": "journal",
                "checkpoint.body_delete.": "checkpoints"}
# Retired files are due 8 s after their swap (and two checkpoints), final journal records
# 10 s after their last change once their files are gone.
SWEEP_DEADLINE_S = 40.0
# Swapped (revert_swap reverts the catalog) twice as often as not swapped (revert_swap
# answers not_swapped and the new file is deleted): both cases of every rollback step.
GC_ROLLBACK_PREPARE = {"gc.journal.swapped.after": 2, "gc.primary_switch.after": 1}
# Points reached while a process starts (bootstrap, cleansing, MarkReady, recovery's GC
# rollback) or during the one replay the fault provokes: crash at the first hit.
# Everything else lets a few hits pass first (K drawn from the seed).
START_POINTS = ("catalog.bootstrap.", "recovery.", "catalog.delete_files.", "cdc.replay.",
                *GC_ROLLBACK_POINTS, *LOAD_START_POINTS)
FAILPOINT_DEADLINE_S = 10.0
# A GC-driven wait needs the node READY again after its restart (the pass's read
# transaction goes through the gate) and up to three commits.
GC_FAILPOINT_DEADLINE_S = 25.0
# Points reached only when an earlier crash left something behind: first crash the node at
# the preparing point, then arm the point itself on the next start. Cleansing deletes the
# TEMPORARY_INGEST files of a crashed node, and a crash right after ingest.alloc leaves one.
PREPARE = {"catalog.delete_files.commit.before": "ingest.alloc.catalog.after",
           "catalog.delete_files.commit.after": "ingest.alloc.catalog.after"}


def process_of(point: str) -> str:
    """``retina``, ``cdc``, ``trans``, ``rewriter`` (a GC rewrite task, which the
    campaign runs as a child process when one of its points is armed) or ``writer`` (the
    application writer, chaos/app_writer.py): the process a failpoint is armed in."""
    if point.startswith(REWRITER_PREFIXES):
        return "rewriter"
    if point.startswith(WRITER_PREFIXES):
        return "writer"
    if point.startswith(("cdc.", *SCHEMA_POINTS)):
        return "cdc"
    if point.startswith("trans."):
        return "trans"
    # Retina's prefixes, and the default for a point added later under a new prefix
    # (tests/test_chaos.py then asks for a deliberate choice).
    return "retina"


def gc_driving(point: str) -> str:
    """How a GC point is driven: ``pass`` (GC passes while waiting), ``rollback`` (a crash
    inside a GC commit first, then the point armed for the next start), ``revert``
    (reverts of completed rewrites while waiting) or ``""``."""
    if point.startswith(GC_REVERT_POINTS):
        return "revert"
    if point.startswith(GC_ROLLBACK_POINTS):
        return "rollback"
    if point.startswith(GC_COMMIT_POINTS + GC_PROMOTE_POINTS):
        return "pass"
    return ""


def sweep_driving(point: str) -> str:
    """The sweeper pass that reaches ``point`` (``retired``, ``temporary``, ``orphans``,
    ``journal``, ``checkpoints``), or ``""`` for a point no sweeper pass reaches."""
    return next((p for prefix, p in SWEEP_PASSES.items() if point.startswith(prefix)), "")


def relevant_points(prefixes: tuple[str, ...] = ()) -> list[str]:
    """The catalogue minus UNREACHABLE; with ``prefixes``, only the points they start."""
    return [p for p in failpoints.catalogue() if p not in UNREACHABLE
            and (not prefixes or p.startswith(prefixes))]


def failpoint_for(seed: int, episode: int, prefixes: tuple[str, ...] = ()) -> str:
    """The failpoint of a failpoint episode: a seeded rotation through the catalogue (or
    the part ``prefixes`` selects), so each point is tried once per len(points) failpoint
    episodes, and one episode is replayable alone (the choice depends on seed, episode
    and the selection only)."""
    points = relevant_points(prefixes)
    if not points:
        raise ValueError(f"no failpoint starts with {prefixes}")
    random.Random(seed).shuffle(points)
    return points[(episode // 2) % len(points)]


@dataclass
class FaultResult:
    kind: str
    detail: str = ""
    failpoint: str = ""
    failpoint_hit: bool | None = None
    anomalies: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    gc: Counter[str] = field(default_factory=Counter)  # GC pass outcomes (chaos/gc_driver.py)
    sweep: Counter[str] = field(default_factory=Counter)  # sweepers, reverts, orphans
    replay: Counter[str] = field(default_factory=Counter)  # chaos/spark_replay.py
    reads: Counter[str] = field(default_factory=Counter)  # stalled writes, split reads


@dataclass
class FaultContext:
    cluster: ChaosCluster
    tracker: ReadinessTracker
    rng: random.Random
    write: Callable[[], None]  # one small workload step on the source
    source: Callable[[], Any] | None = None  # the source connection (GC's racing changes)
    # An ADD COLUMN at the source and a write of the new column (workload.add_column, with
    # the workload's stream); returns "table.column type", or "" if none was added.
    evolve: Callable[[], str] | None = None
    gc_row_group_rows: tuple[int, ...] = ROW_GROUP_ROWS  # the GC passes' new-file row groups
    # The episode's snapshots (chaos/repeatable_reads.py): the stall and split-read faults
    # take and compare their own; GC-driven failpoints end the open ones first.
    snapshots: SnapshotBook | None = None
    # The application writer (chaos/app_workload.py): ``write`` also hands it a
    # transaction; its failpoints are armed in it; node kills are counted against it.
    app: AppWriter | None = None
    # One bulk load (chaos/bulk_loads.py): the load.* points' driver.
    load: Callable[[], None] | None = None
    # Source transactions one after another while the argument says PostgreSQL is being
    # stopped (the wide table's, chaos/wide.py): a COMMIT whose answer the stop cuts off
    # is one of unknown outcome, which the wide table's model must resolve.
    source_burst: Callable[[Callable[[], bool]], None] | None = None

    def gc_pass(self, node: str, result: FaultResult, max_groups: int = 3,
                race: float = 0.5, task_failpoints: str = "", failpoint_dir: str = "",
                dead_task_retry: float = 0.5, focus: frozenset[int] = frozenset()
                ) -> PassResult:
        """One GC pass on ``node``; its counts, notes and anomalies go into ``result``.
        ``focus``: rewrite streams and runs holding these files (GcDriver)."""
        assert self.cluster.state is not None
        state = self.cluster.state
        driver = GcDriver(state.trans_listen, state.postgres.dsn(), self.rng, self.source,
                          task_failpoints, self.gc_row_group_rows, failpoint_dir,
                          dead_task_retry, focus)
        done = driver.run_pass(node, lambda: self.cluster.alive(node), max_groups, race)
        done.task_exits = driver.task_exits
        result.gc.update(done.counts)
        result.anomalies.extend(done.anomalies)
        result.notes.extend(done.notes)
        if done.stopped.startswith("BeginTrans"):
            result.gc["gate_closed"] += 1  # routine while the node restarts: counted only
        elif done.first_refusal or (done.stopped and "exited" not in done.stopped):
            # A node exiting mid-pass is what a failpoint wait is for (counted as
            # commit_unknown); refusals and other stops are worth a line.
            result.notes.append(done.summary())
        return done

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        self.cluster.kill(name, sig)
        if name in self.cluster.nodes:
            self.tracker.down(name)
            if self.app is not None:
                self.app.node_killed(name)

    def node(self) -> str:
        return self.rng.choice(self.cluster.nodes)

    def failpoint_dir(self) -> str:
        """A fresh RETINA_FAILPOINT_DIR for this fault's task processes (+once markers)."""
        assert self.cluster.state is not None
        parent = self.cluster.state_dir / "failpoints"
        parent.mkdir(exist_ok=True)
        return tempfile.mkdtemp(dir=parent)


# --- process kills ------------------------------------------------------------------------
def kill_node(ctx: FaultContext, sig: int) -> FaultResult:
    node = ctx.node()
    ctx.write()
    ctx.kill(node, sig)
    if ctx.rng.random() < 0.5:
        ctx.write()  # the stream goes on while the node is down
    ctx.cluster.start_node(node)
    return FaultResult(f"retina_{signal.Signals(sig).name.lower()}", node)


def kill_cdc(ctx: FaultContext, sig: int) -> FaultResult:
    ctx.write()
    ctx.kill(CDC, sig)
    ctx.write()  # the source moves on while the connector is down
    ctx.cluster.start_cdc()
    return FaultResult(f"cdc_{signal.Signals(sig).name.lower()}")


def kill_both(ctx: FaultContext, sig: int) -> FaultResult:
    node = ctx.node()
    ctx.write()
    ctx.kill(CDC, sig)
    ctx.kill(node, sig)
    ctx.write()
    order = [node, CDC] if ctx.rng.random() < 0.5 else [CDC, node]
    for name in order:
        ctx.cluster.start(name)
    return FaultResult(f"both_{signal.Signals(sig).name.lower()}", f"{node} first={order[0]}")


def kill_trans(ctx: FaultContext) -> FaultResult:
    ctx.write()
    ctx.kill(TRANS, signal.SIGKILL)
    ctx.cluster.start_trans()
    ctx.cluster.wait_trans()
    return FaultResult("trans_sigkill")


def restart_burst(ctx: FaultContext) -> FaultResult:
    """Two or three restarts of one node in a row, no writes between them."""
    node = ctx.node()
    ctx.write()
    times = ctx.rng.randint(2, 3)
    for _ in range(times):
        ctx.kill(node, signal.SIGKILL)
        ctx.cluster.start_node(node)
        # Let the node get a random distance into its start-up before the next kill.
        _wait_quietly(lambda: ctx.cluster.node_states()[node] is not None,
                      ctx.rng.uniform(0.2, 3.0))
    return FaultResult("restart_burst", f"{node} x{times}")


def _wait_quietly(condition: Callable[[], bool], timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if condition():
                return True
        except Exception:  # the process is still coming up
            pass
        time.sleep(0.05)
    return False


# --- infrastructure outages ----------------------------------------------------------------
def restart_etcd(ctx: FaultContext) -> FaultResult:
    ctx.write()
    ctx.cluster.restart_etcd(ctx.rng.uniform(0.2, 2.0))
    ctx.write()
    return FaultResult("etcd_restart")


def restart_postgres(ctx: FaultContext) -> FaultResult:
    """A catalog + source outage, started right after a burst of writes so that a batch
    (and, with tiny ingest files, a file boundary) is usually in flight."""
    ctx.write()
    mode = ctx.rng.choice(["immediate", "fast"])
    down_s = ctx.rng.uniform(0.2, 2.0)
    if ctx.source_burst is None or mode != "immediate":
        # A fast shutdown waits for the walsenders' WAL to be confirmed, which a burst's
        # last commits would hold up until it escalates (the catalog is on this server).
        note = ctx.cluster.restart_postgres(down_s, mode)
    else:  # the stop in a thread, source transactions committing until it cuts them off
        done: list[str] = []
        failed: list[BaseException] = []

        def restart() -> None:
            try:
                done.append(ctx.cluster.restart_postgres(down_s, mode))
            except BaseException as exc:  # ClusterError: raised again below
                failed.append(exc)

        stopper = threading.Thread(target=restart, name="chaos-pg-restart")
        stopper.start()
        try:
            ctx.source_burst(stopper.is_alive)
        finally:
            stopper.join()
        if failed:
            raise failed[0]
        note = done[0]
    ctx.write()
    return FaultResult("postgres_restart", mode, notes=[note] if note else [])


# --- corrupt checkpoint body ----------------------------------------------------------------
def corrupt_checkpoint(ctx: FaultContext) -> FaultResult:
    """Damage the ``current`` body of a killed node; it must fall back to ``previous``.

    Only while ``previous`` names another body: with one usable checkpoint a corrupt
    ``current`` must fail closed (FAILED), by design, so that case is not a fault to
    survive but an operator's repair."""
    node = ctx.node()
    ctx.write()
    ctx.kill(node, signal.SIGKILL)
    assert ctx.cluster.state is not None
    etcd = EtcdStore([ctx.cluster.state.etcd.endpoint], 5)
    current = etcd.get(checkpoint_slot_key(node, "current"))
    previous = etcd.get(checkpoint_slot_key(node, "previous"))
    result = FaultResult("corrupt_checkpoint", node)
    paths = [json.loads(kv.value)["path"] if kv else None for kv in (current, previous)]
    if paths[0] is None or paths[1] is None or paths[0] == paths[1]:
        result.notes.append(f"{node}: no distinct previous checkpoint: nothing damaged")
    else:
        path = _local_path(paths[0])
        how = ctx.rng.choice(["truncate", "bitflip"])
        _damage(path, how, ctx.rng)
        result.detail = f"{node} {how} {path.name}"
    ctx.cluster.start_node(node)
    return result


def _local_path(uri: str) -> Path:
    return Path(urlparse(uri).path) if uri.startswith("file:") else Path(uri)


def _damage(path: Path, how: str, rng: random.Random) -> None:
    data = bytearray(path.read_bytes())
    if how == "truncate":
        data = data[: rng.randrange(0, max(1, len(data)))]
    elif data:
        i = rng.randrange(len(data))
        data[i] ^= 1 << rng.randrange(8)
    path.write_bytes(bytes(data))


# --- failpoints ---------------------------------------------------------------------------------
def arm_failpoint(ctx: FaultContext, point: str, hit_k: int) -> FaultResult:
    """Restart the right process with ``point=exit(137)@K`` and drive it to the point.

    Waits for exit 137 (hit) or the deadline (not reached: restarted clean)."""
    role = process_of(point)
    if role == "rewriter":
        return arm_rewriter_failpoint(ctx, point, hit_k)
    if role == "writer":
        return arm_writer_failpoint(ctx, point, hit_k)
    driving = gc_driving(point)
    sweep_pass = sweep_driving(point)
    spec = f"{point}=exit({exit_codes.KILLED_AT_FAILPOINT})@{hit_k}"
    result = FaultResult("failpoint", f"{spec}", failpoint=point)
    if (driving or sweep_pass in ("retired", "journal")) and ctx.snapshots is not None:
        # GC passes after a restart: a held read below the node's new floor would stop them.
        ctx.snapshots.release(f"before {point}")
    ctx.write()  # leave work in flight, so start-up paths (cleansing) have something to do
    name = TRANS if role == "trans" else CDC if role == "cdc" else ctx.node()
    if sweep_pass in ("retired", "journal") and node_state(name) == rpb.READY:
        # Rewrites now, so that retired files (then final journal records) fall due
        # while the armed node runs.
        ctx.gc_pass(name, result, max_groups=3, race=0.3)
    if point.startswith(LOAD_START_POINTS) and ctx.load is not None and \
            node_state(name) == rpb.READY:
        ctx.load()  # journaled, no checkpoint holds it yet: the next start re-applies it
    elif point.startswith(START_POINTS):
        # A random moment after the write: the rows are often on their way into a
        # (TEMPORARY_INGEST) file when the kill lands, so cleansing has work at start.
        time.sleep(ctx.rng.uniform(0.0, 0.4))
    ctx.kill(name, signal.SIGKILL)
    if point in PREPARE:
        ctx.cluster.start(name, f"{PREPARE[point]}=exit({exit_codes.KILLED_AT_FAILPOINT})@1")
        prepared = _drive_until_exit(ctx, name, FAILPOINT_DEADLINE_S)
        result.detail += f" (after {PREPARE[point]}: {prepared})"
        ctx.kill(name, signal.SIGKILL)
    elif driving == "rollback":
        # Leave an open rewrite that no checkpoint holds: a crash inside a GC commit.
        prep = ctx.rng.choices(list(GC_ROLLBACK_PREPARE),
                               weights=list(GC_ROLLBACK_PREPARE.values()))[0]
        ctx.cluster.start(name, f"{prep}=exit({exit_codes.KILLED_AT_FAILPOINT})@1")
        prepared = _drive_until_exit(ctx, name, GC_FAILPOINT_DEADLINE_S,
                                     _gc_action(ctx, name, result))
        result.detail += f" (after {prep}: {prepared})"
        if prepared != exit_codes.KILLED_AT_FAILPOINT:
            result.notes.append(f"{point}: no GC commit crashed at {prep}: nothing to roll "
                                "back")
        ctx.kill(name, signal.SIGKILL)
    ctx.cluster.start(name, spec)
    if point.startswith(SCHEMA_POINTS):
        added = ctx.evolve() if ctx.evolve is not None else ""
        result.detail += f" (adding {added})" if added else " (no column left to add)"
    if role == "cdc" and ".replay." in point:
        # Replay points are only reached while a node recovers: give the connector one.
        node = ctx.node()
        ctx.kill(node, signal.SIGKILL)
        ctx.cluster.start_node(node)
        result.detail += f" (replaying {node})"
    action: Callable[[], None] | None = None
    deadline_s = FAILPOINT_DEADLINE_S
    pins = PinFailpoint(ctx.cluster.state.trans_listen, point) \
        if point.startswith(PIN_POINTS) and ctx.cluster.state is not None else None
    if pins is not None:
        action = pins.act
    elif point.startswith(HORIZON_POINTS) and ctx.cluster.state is not None:
        action = _safe_gc_action(ctx.cluster.state.trans_listen)
    elif driving == "pass":
        action, deadline_s = _gc_action(ctx, name, result), GC_FAILPOINT_DEADLINE_S
    elif driving == "revert":
        action, deadline_s = _revert_action(ctx, name, result), GC_FAILPOINT_DEADLINE_S
    elif sweep_pass:
        action, deadline_s = _sweep_action(ctx, name, sweep_pass, hit_k, result), \
            SWEEP_DEADLINE_S
    elif point.startswith(LOAD_POINTS) and not point.startswith(LOAD_START_POINTS):
        action, deadline_s = ctx.load, GC_FAILPOINT_DEADLINE_S
    code = _drive_until_exit(ctx, name, deadline_s, action)
    result.failpoint_hit = code == exit_codes.KILLED_AT_FAILPOINT
    if name in ctx.cluster.nodes and code is not None:
        ctx.tracker.down(name)
    if code is None:
        result.notes.append(f"{point} not reached within {deadline_s:.0f}s")
        ctx.kill(name, signal.SIGKILL)
    elif code != exit_codes.KILLED_AT_FAILPOINT:
        result.notes.append(f"{name} exited {code} instead of at {point}")
    ctx.cluster.start(name)
    if name == TRANS:
        ctx.cluster.wait_trans()
    if pins is not None:
        result.anomalies.extend(pins.check(bool(result.failpoint_hit)))
        pins.close()
    return result


def arm_rewriter_failpoint(ctx: FaultContext, point: str, hit_k: int,
                           dead_task_retry: float = 0.5) -> FaultResult:
    """A point of the GC rewrite task: GC passes on a random node whose rewrite tasks run
    as child processes with ``point=exit(137)@1+once``, until a task dies there (a dead
    Spark task: its TEMPORARY_GC file is left registered, written or not). The dead task is
    then run again (Spark's retry, ``dead_task_retry`` of the time: the same prepared
    group, a new process; its commit must go through or be refused with a documented
    code) or its group is aborted or forgotten (never committed); then one ordinary pass,
    which must be able to rewrite the same files."""
    # Each task process rewrites one group and reaches the point once: crash at the
    # first hit (hit_k is the rotation's draw, unused here), in one task of the fault
    # only (+once: the retry and the other groups' tasks go through, as in a Spark job
    # that lost one task).
    del hit_k
    if ctx.snapshots is not None:
        # A held read that fetched the write buffers holds the files published since
        # (BUFFER_FETCH_HOLDS_FILE: their commit waits for it); the retried task's group
        # must be able to commit.
        ctx.snapshots.release(f"before {point}")
    spec = f"{point}=exit({exit_codes.KILLED_AT_FAILPOINT})@1+once"
    directory = ctx.failpoint_dir()
    node = ctx.node()
    result = FaultResult("failpoint", f"{spec} (tasks for {node})", failpoint=point)
    deadline = time.monotonic() + GC_FAILPOINT_DEADLINE_S
    result.failpoint_hit = False
    while time.monotonic() < deadline and not result.failpoint_hit:
        ctx.write()
        if node_state(node) != rpb.READY:
            continue  # the gate would refuse the pass's read transaction
        done = ctx.gc_pass(node, result, max_groups=3, race=0.3, task_failpoints=spec,
                           failpoint_dir=directory, dead_task_retry=dead_task_retry)
        result.failpoint_hit = exit_codes.KILLED_AT_FAILPOINT in done.task_exits
        other = sorted({c for c in done.task_exits if c not in (0, exit_codes.KILLED_AT_FAILPOINT)})
        if other:
            result.notes.append(f"rewrite task exited {other} instead of at {point}")
    if not result.failpoint_hit:
        result.notes.append(f"{point} not reached within {GC_FAILPOINT_DEADLINE_S:.0f}s")
        return result
    retried = "retried" if result.gc["task_retried"] else "not retried"
    rerun = ctx.gc_pass(node, result, max_groups=3, race=0.3)
    result.detail += f", {retried}, then a clean pass: {rerun.counts['committed']} committed"
    return result


def arm_writer_failpoint(ctx: FaultContext, point: str, hit_k: int) -> FaultResult:
    """The application writer restarted with ``point=exit(137)@K`` and written through
    until it dies there, its transaction in doubt (``writer.append.after``: logged,
    nothing sent; ``writer.commit.before``: every node applied it, not committed). Then,
    drawn 1 : 1, it is started again at once (its open applies the transaction), or left
    down through the episode's comparison with a node killed and recovered meanwhile
    (the recovery replays the in-doubt transaction on that node only: each of its rows
    present or absent, never another value), and started again in the next episode."""
    spec = f"{point}=exit({exit_codes.KILLED_AT_FAILPOINT})@{hit_k}"
    result = FaultResult("failpoint", spec, failpoint=point, failpoint_hit=False)
    app = ctx.app
    if app is None:
        result.notes.append(f"{point}: no application writer in this campaign")
        return result
    ctx.write()
    app.hold()  # the armed process only: none started again behind the wait's back
    app.restart(spec)
    app.wait_opened()
    deadline = time.monotonic() + FAILPOINT_DEADLINE_S
    while app.running() and time.monotonic() < deadline:
        ctx.write()
    code = None if app.running() else app.exit_code
    result.failpoint_hit = code == exit_codes.KILLED_AT_FAILPOINT
    if code is None:
        result.notes.append(f"{point} not reached within {FAILPOINT_DEADLINE_S:.0f}s")
        app.stop()
    elif code != exit_codes.KILLED_AT_FAILPOINT:
        result.notes.append(f"the application writer exited {code} instead of at {point}")
    if result.failpoint_hit and ctx.rng.random() < 0.5:
        node = ctx.node()
        ctx.kill(node, signal.SIGKILL)
        ctx.cluster.start_node(node)
        result.detail += f" (writer left down; {node} killed)"
        return result  # released after the comparison (Campaign.run_episode)
    app.release()
    app.start()
    return result


def _drive_until_exit(ctx: FaultContext, name: str, timeout_s: float,
                      action: Callable[[], None] | None = None) -> int | None:
    """Keep the workload going (small steps) until ``name`` exits or the deadline passes;
    with ``action``, also run it while the node is READY: GC passes (points only a GC
    commit, its promotion or a crash inside it reaches), reverts, sweeper rounds."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        code = ctx.cluster.wait_exit(name, 0.3)
        if code is not None:
            return code
        ctx.write()
        # Only once the restarted node is READY: before, the gate refuses the pass (or a
        # stale READY key admits it to a node that is not listening yet). The
        # TransServer's actions (pins) need it up only.
        if action is not None and ctx.cluster.alive(name) and \
                (name == TRANS or node_state(name) == rpb.READY):
            action()
    return ctx.cluster.exit_code(name)


def _safe_gc_action(trans_address: str) -> Callable[[], None]:
    """GetSafeGcTimestamp, as a GC job's driver asks it (the horizon's points)."""
    def act() -> None:
        # An error: the TransServer died at the point.
        with open_channel(trans_address) as chan, contextlib.suppress(grpc.RpcError):
            trans_pb2_grpc.TransServiceStub(chan).GetSafeGcTimestamp(
                tpb.GetSafeGcTimestampRequest(), timeout=5)
    return act


def _gc_action(ctx: FaultContext, node: str, result: FaultResult) -> Callable[[], None]:
    def act() -> None:
        ctx.gc_pass(node, result, max_groups=3, race=0.3)
    return act


def _revert_action(ctx: FaultContext, node: str, result: FaultResult) -> Callable[[], None]:
    """A revert of a random revertible rewrite of ``node``; a GC pass when there is none."""

    def act() -> None:
        try:
            records = [r for r in lineage(node) if r.revertible]
        except grpc.RpcError:
            return  # the node is going away
        if not records:
            ctx.gc_pass(node, result, max_groups=2, race=0.3)
            return
        record = ctx.rng.choice(records)
        result.sweep["reverts"] += 1
        try:
            revert(node, record.rewrite_id)
            result.sweep["reverted"] += 1
        except grpc.RpcError as exc:  # UNAVAILABLE: the node died at the point
            result.sweep[f"revert_refused_{code_of(exc)}"] += 1
    return act


def _sweep_action(ctx: FaultContext, node: str, pass_name: str, hit_k: int,
                  result: FaultResult) -> Callable[[], None]:
    """A forced sweeper round of ``pass_name`` on ``node`` after making something due:
    planted leftovers (temporary, orphans: ``hit_k`` of them, once), GC passes now and
    then (retired files, final journal records)."""
    assert ctx.cluster.state is not None
    dsn = ctx.cluster.state.postgres.dsn()
    rounds = [0]

    def act() -> None:
        rounds[0] += 1
        if pass_name in ("temporary", "orphans") and rounds[0] == 1:
            catalog = Catalog(dsn, pool_max=1)
            try:
                if pass_name == "temporary":
                    result.sweep["temporary_planted"] += len(
                        plant_temporary(catalog, node, ctx.rng, count=max(2, hit_k)))
                else:
                    planted = plant_orphans(catalog, node, ctx.rng, count=max(2, hit_k),
                                            with_held=False)
                    result.sweep["orphans_planted"] += len(planted.orphans)
            finally:
                catalog.close()
        if pass_name in ("retired", "journal") and rounds[0] % 4 == 1:
            ctx.gc_pass(node, result, max_groups=2, race=0.3)
        result.sweep["rounds_forced"] += 1
        try:
            reply = run_sweeper(node, [pass_name],
                                grace_ms=ORPHAN_GRACE_MS if pass_name == "orphans" else 0)
        except grpc.RpcError:
            return  # UNAVAILABLE: the node died at the point (or was not READY yet)
        result.sweep[f"{pass_name}_removed"] += reply.removed
    return act


def mark_ready_crash(ctx: FaultContext) -> FaultResult:
    """A crash between the end of replay and MarkReady, with rows buffered at the
    checkpoint: on the Retina side (recovery.mark_ready.barrier.after) or, when the catalogue
    has it, on the connector side (cdc.replay.mark_ready.before)."""
    cdc_point = "cdc.replay.mark_ready.before"
    if cdc_point in failpoints.catalogue() and ctx.rng.random() < 0.5:
        point = cdc_point
    else:
        point = "recovery.mark_ready.barrier.after"
    result = arm_failpoint(ctx, point, 1)
    result.kind = "mark_ready_crash"
    return result


# --- Storage GC ---------------------------------------------------------------------------------
def gc_rewrite(ctx: FaultContext) -> FaultResult:
    """A GC pass on a random node, source changes racing it, then sometimes at once a
    SIGKILL (a crash right after a commit, before any checkpoint holds the new file:
    recovery rolls it back), or RunGcMaintenance (fold + prune), sometimes then a kill."""
    node = ctx.node()
    ctx.write()
    result = FaultResult("gc_rewrite", node)
    done = ctx.gc_pass(node, result, max_groups=ctx.rng.randint(1, 4), race=0.6)
    after = ctx.rng.choices(["none", "kill", "maintenance", "maintenance+kill"],
                            weights=[3, 3, 1, 2])[0]
    result.detail = f"{node} committed {done.counts['committed']}/{done.counts['groups']}"
    if after.startswith("maintenance"):
        result.detail += f", {maintenance(node)}"
    if after.endswith("kill"):
        ctx.kill(node, signal.SIGKILL)
        if ctx.rng.random() < 0.5:
            ctx.write()  # the stream goes on while the node is down
        ctx.cluster.start_node(node)
    result.detail += f", then {after}"
    return result


# --- Spark task retries (issue 25) -------------------------------------------------------------
def spark_replay_retry(ctx: FaultContext) -> FaultResult:
    """A node killed and recovered by the Spark replay job's code instead of the connector,
    one of its tasks killed after about half its requests and retried (chaos/spark_replay.py).

    The connector must not drive the same node: it is restarted with drive_recovery off
    first (the operator's procedure of docs/spark.md: it keeps streaming, and only waits
    for a RECOVERING node to be READY, its sends to it backing off), and restarted with it
    on once the job's MarkReady is answered. If the job fails, that restart lets the
    connector recover the node itself, so the episode heals either way."""
    node = ctx.node()
    result = FaultResult("spark_replay_retry", node)
    assert ctx.cluster.state is not None
    config = ctx.cluster.state.config_path
    ctx.write()
    ctx.kill(CDC, signal.SIGTERM)
    ctx.cluster.start_cdc(drive_recovery=False)
    # Rows the node holds when it dies, the replay's range: the kill waits (a few
    # seconds at most) until the restarted connector logged this step.
    logged = spark_replay.logged_through(config)
    ctx.write()
    if not spark_replay.wait_logged_past(config, logged, 5.0):
        result.notes.append("spark replay: the connector logged nothing new within 5s")
    ctx.kill(node, signal.SIGKILL)
    if ctx.rng.random() < 0.5:
        ctx.write()  # the source moves on while the node is down
    ctx.cluster.start_node(node)
    try:
        outcome = spark_replay.recover(config, node, ctx.rng, ctx.failpoint_dir(), ctx.write)
    finally:
        if ctx.cluster.alive(CDC):  # one that exited by itself is the heal's to report
            ctx.kill(CDC, signal.SIGTERM)
            ctx.cluster.start_cdc()
    result.replay.update(outcome.counts)
    result.notes.extend(outcome.notes)
    result.anomalies.extend(outcome.anomalies)
    result.detail = outcome.detail or f"{node}: not recovered by the job"
    return result


def spark_gc_retry(ctx: FaultContext) -> FaultResult:
    """A GC rewrite task killed at a random ``gc.rewrite.write.*`` point (its new file
    registered, its bytes written or not) and always retried: the same prepared group's
    task again in a new process, then CommitGcRewrite of that group, which must go through
    or be refused with a documented code; the comparison checks the table."""
    points = [p for p in relevant_points() if process_of(p) == "rewriter"]
    result = arm_rewriter_failpoint(ctx, ctx.rng.choice(points), 1, dead_task_retry=1.0)
    result.kind = "spark_gc_retry"
    return result


# --- sweepers, revert, orphans (issue 11) -------------------------------------------------------
def sweeper_kill(ctx: FaultContext) -> FaultResult:
    """A node killed at a random sweeper point during a sweeper round: something is made
    due (GC passes, planted leftovers), the node restarted with the point armed, rounds
    forced with RunSweeper until it dies there; restarted clean, the next round must finish
    what the dead one left (the comparison and the storage audit check it)."""
    points = [p for p in relevant_points() if sweep_driving(p)]
    point = ctx.rng.choice(points)
    result = arm_failpoint(ctx, point, ctx.rng.randint(1, 3))
    result.kind = "sweeper_kill"
    return result


def gc_revert(ctx: FaultContext) -> FaultResult:
    """A revert of a random revertible rewrite (ListGcLineage; a GC pass first when there is
    none), source changes racing it; one time in three killed at a random gc.revert.* point
    instead (recovery finishes a revert whose REVERTING is durable). A clean revert's answer
    must agree with the lineage and the catalog (old files REGULAR, new file RETIRED); then,
    drawn 2 : 1, nothing or a SIGKILL at once (REVERTED before any checkpoint: recovery maps
    the loaded baseline back to the old files)."""
    if ctx.rng.random() < 1 / 3:
        points = [p for p in relevant_points() if gc_driving(p) == "revert"]
        result = arm_failpoint(ctx, ctx.rng.choice(points), 1)
        result.kind = "gc_revert"
        return result
    node = ctx.node()
    ctx.write()
    result = FaultResult("gc_revert", node)
    try:
        records = [r for r in lineage(node) if r.revertible]
        if not records:
            ctx.gc_pass(node, result, max_groups=ctx.rng.randint(1, 3), race=0.3)
            records = [r for r in lineage(node) if r.revertible]
    except grpc.RpcError as exc:
        result.notes.append(f"ListGcLineage of {node}: {code_of(exc)}")
        return result
    if not records:
        result.detail += ": nothing revertible"
        result.sweep["revert_nothing"] += 1
        return result
    record = ctx.rng.choice(records)
    if ctx.rng.random() < 0.5:
        ctx.write()  # changes that may land on the new file's rows, right before
    result.sweep["reverts"] += 1
    try:
        reply = revert(node, record.rewrite_id)
    except grpc.RpcError as exc:
        code = code_of(exc)
        result.sweep[f"revert_refused_{code}"] += 1
        text = f"revert {record.rewrite_id} on {node}: {code} {(exc.details() or '')[:160]}"
        if code in ("FAILED_PRECONDITION", "ABORTED", "UNAVAILABLE", "DEADLINE_EXCEEDED"):
            result.notes.append(text)  # e.g. the old files swept since the listing
        else:
            result.anomalies.append(f"gc_revert_unexpected_answer: {text}")
        return result
    result.sweep["reverted"] += 1
    result.detail = f"{node} {record.rewrite_id[:12]} ({len(record.old_file_ids)} old files)"
    problem = _revert_disagrees(ctx, node, record, reply.record)
    if problem:
        result.anomalies.append(f"gc_revert_disagrees: {node} rewrite {record.rewrite_id}: "
                                f"{problem}")
    if ctx.rng.random() < 1 / 3:
        ctx.kill(node, signal.SIGKILL)
        ctx.write()
        ctx.cluster.start_node(node)
        result.detail += ", then SIGKILL"
    return result


def _revert_disagrees(ctx: FaultContext, node: str, asked: rpb.GcLineageRecord,
                      answered: rpb.GcLineageRecord) -> str:
    if (answered.status, answered.journal_state) != ("REVERTED", "REVERTED"):
        return f"answered {answered.status}/{answered.journal_state}"
    assert ctx.cluster.state is not None
    catalog = Catalog(ctx.cluster.state.postgres.dsn(), pool_max=1)
    try:
        types = {i: catalog.get_file(i) for i in (asked.new_file_id, *asked.old_file_ids)}
    finally:
        catalog.close()
    named = {i: f.type.name if f is not None else "missing" for i, f in types.items()}
    want = {i: "REGULAR" for i in asked.old_file_ids} | {asked.new_file_id: "RETIRED"}
    if named != want:
        return f"catalog {named}, expected {want}"
    try:
        now = {r.rewrite_id: r for r in lineage(node)}
    except grpc.RpcError:
        return ""
    if asked.rewrite_id in now and now[asked.rewrite_id].status != "REVERTED":
        return f"lineage says {now[asked.rewrite_id].status} after REVERTED"
    return ""


def orphan_sweep(ctx: FaultContext) -> FaultResult:
    """Orphan objects planted under table paths (this node's name format, two days old),
    with a fresh orphan and a foreign name that must be held; an orphan pass as a dry run
    (reports, removes nothing), writes, then for real: every planted orphan removed, the
    held ones kept, and nothing the catalog knows reported or removed."""
    node = ctx.node()
    ctx.write()
    assert ctx.cluster.state is not None
    dsn = ctx.cluster.state.postgres.dsn()
    catalog = Catalog(dsn, pool_max=1)
    result = FaultResult("orphan_sweep", node)
    try:
        planted = plant_orphans(catalog, node, ctx.rng)
        result.sweep["orphans_planted"] += len(planted.orphans)
        try:
            names = {name for _uri, name in planted.orphans}
            dry = run_orphan_pass(node, names, dry_run=True)
            ctx.write()
            real = run_orphan_pass(node, names)
        except grpc.RpcError as exc:
            result.notes.append(f"orphan pass on {node}: {code_of(exc)}")
            planted.remove_held()
            return result
        uris = {p.path_id: p.uri for p in catalog.list_paths()}
        known = {(uris.get(f.path_id, ""), f.name)
                 for f in catalog.get_files_by_type(None, list(FileType))}
        problems = _orphan_problems(planted, dry, real, known)
        result.sweep["orphan_passes"] += 2
        result.sweep["orphans_removed"] += real.removed
        result.detail = (f"{node} planted {len(planted.orphans)}, dry run "
                         f"{sum(o.action == 'would_remove' for o in dry.objects)}, removed "
                         f"{real.removed}")
        result.anomalies.extend(f"orphan_sweep_wrong: {node}: {p}" for p in problems)
        planted.remove_held()
    finally:
        catalog.close()
    return result


def _orphan_problems(planted: Planted, dry: rpb.RunSweeperResponse, real: rpb.RunSweeperResponse,
                     known: set[tuple[str, str]]) -> list[str]:
    problems = []
    would = {(o.path_uri, o.name) for o in dry.objects if o.action == "would_remove"}
    removed = {(o.path_uri, o.name) for o in real.objects if o.action == "removed"}
    held = {(o.path_uri, o.name): o.reason for o in real.objects if o.action == "held"}
    for uri, name in planted.orphans:
        if (uri, name) not in would:
            problems.append(f"dry run does not report planted orphan {name}")
        if (uri, name) not in removed or (local_dir(uri) / name).exists():
            problems.append(f"planted orphan {name} not removed")
    for uri, name, why in planted.held:
        if (uri, name) in would or (uri, name) in removed:
            problems.append(f"{name} ({why}) reported or removed")
        elif held.get((uri, name)) != why:
            problems.append(f"{name} held for {held.get((uri, name))!r}, expected {why}")
        if not (local_dir(uri) / name).exists():
            problems.append(f"{name} ({why}) is gone")
    for uri, name in (would | removed) & known:
        problems.append(f"{name} under {uri} is known to the catalog but was "
                        f"{'removed' if (uri, name) in removed else 'reported'} as an orphan")
    return problems


# --- malformed keys ---------------------------------------------------------------------------
def malformed_key(ctx: FaultContext) -> FaultResult:
    """UpdateRecord straight to a READY node with key bytes that disagree with the row's key
    column, or a NULL key column. Expected: INVALID_ARGUMENT."""
    assert ctx.cluster.state is not None
    state = ctx.cluster.state
    topology = load_topology(state.topology_path)
    catalog = Catalog(state.postgres.dsn(), pool_max=1)
    try:
        probe = catalog.get_table(SCHEMA, PROBE_TABLE)
    finally:
        catalog.close()
    variant = ctx.rng.choice(["key_disagrees", "null_key"])
    row_id = ctx.rng.randint(1, 10**9)
    key_id = row_id + 1 if variant == "key_disagrees" else row_id
    key = encode_primary_key(["int64"], [key_id])
    col_id = encode_value("int64", row_id) if variant == "key_disagrees" else b""
    vnode = topology.vnode_of_key(key)
    target = topology.node_of_vnode(vnode)
    # The key decides the node (every node is READY after the previous episode's heal).
    result = FaultResult("malformed_key", f"{variant} -> {target}")
    trans_channel = open_channel(state.trans_listen)
    trans = trans_pb2_grpc.TransServiceStub(trans_channel)
    try:
        begun = trans.BeginTrans(tpb.BeginTransRequest(read_only=False), timeout=5)
        data = rpb.TableUpdateData(table_name=PROBE_TABLE,
                                   primary_index_id=probe.primary_index_id,
                                   timestamp=begun.timestamp, virtual_node_id=vnode)
        item = data.insert_data.add()
        item.index_keys.append(rpb.IndexKey(table_id=probe.table_id,
                                            index_id=probe.primary_index_id, key=key,
                                            timestamp=begun.timestamp))
        item.col_values.extend([col_id, encode_value("string", "malformed")])
        code = _send(target, rpb.UpdateRecordRequest(schema_name=SCHEMA,
                                                     table_update_data=[data]))
        trans.RollbackTrans(tpb.RollbackTransRequest(trans_id=begun.trans_id), timeout=5)
    except grpc.RpcError as exc:
        result.notes.append(f"could not run the probe: {exc.code().name}")
        return result
    finally:
        trans_channel.close()
    if code == "OK":
        result.anomalies.append(f"malformed_accepted: {variant} accepted by {target}")
    elif code != "INVALID_ARGUMENT":
        result.notes.append(f"malformed {variant} refused with {code}, not INVALID_ARGUMENT")
    result.detail += f" -> {code}"
    return result


def _send(node: str, request: rpb.UpdateRecordRequest) -> str:
    with open_channel(node) as chan:
        try:
            retina_pb2_grpc.RetinaWorkerServiceStub(chan).UpdateRecord(request, timeout=5)
        except grpc.RpcError as exc:
            return str(exc.code().name)
    return "OK"


# --- SNAPSHOT_IS_IMMUTABLE: stalled writes, split reads (issue 25) ----------------------------
def stalled_write(ctx: FaultContext) -> FaultResult:
    """An UpdateRecord parked past its lease (chaos/stalls.py)."""
    result = FaultResult("stalled_write")
    stalls.stall(ctx, result)
    return result


def split_read(ctx: FaultContext) -> FaultResult:
    """A read split across a GC commit or a restart (chaos/split_reads.py)."""
    result = FaultResult("split_read")
    split_reads.split_read(ctx, result)
    return result


# --- the fault menu -----------------------------------------------------------------------------
FAULTS: dict[str, tuple[float, Callable[[FaultContext], FaultResult]]] = {
    "retina_sigkill": (4, lambda c: kill_node(c, signal.SIGKILL)),
    "retina_sigterm": (2, lambda c: kill_node(c, signal.SIGTERM)),
    "cdc_sigkill": (3, lambda c: kill_cdc(c, signal.SIGKILL)),
    "cdc_sigterm": (1, lambda c: kill_cdc(c, signal.SIGTERM)),
    "both_sigkill": (3, lambda c: kill_both(c, signal.SIGKILL)),
    "both_sigterm": (1, lambda c: kill_both(c, signal.SIGTERM)),
    "trans_sigkill": (2, kill_trans),
    "etcd_restart": (1, restart_etcd),
    "postgres_restart": (1, restart_postgres),
    "corrupt_checkpoint": (2, corrupt_checkpoint),
    "restart_burst": (2, restart_burst),
    "mark_ready_crash": (2, mark_ready_crash),
    "malformed_key": (1, malformed_key),
    "gc_rewrite": (4, gc_rewrite),
    "sweeper_kill": (3, sweeper_kill),
    "gc_revert": (3, gc_revert),
    "orphan_sweep": (2, orphan_sweep),
    "spark_replay_retry": (3, spark_replay_retry),
    "spark_gc_retry": (2, spark_gc_retry),
    "stalled_write": (3, stalled_write),
    "split_read": (3, split_read),
}
# Kinds that joined the menu after the campaigns of docs/chaos.md: drawn from a stream of
# their own (``late_rng``), so that every episode they do not take draws exactly the fault
# it drew before they joined (a new weight in one draw would move them all).
LATE_FAULTS = ("spark_replay_retry", "spark_gc_retry")


def _weighted(rng: random.Random, names: list[str]) -> str:
    return rng.choices(names, weights=[FAULTS[n][0] for n in names])[0]


def choose_fault(rng: random.Random, late_rng: random.Random,
                 only: list[str] | None = None) -> str:
    """A fault kind by weight (among ``only``, if given). The earlier kinds are drawn from
    ``rng`` as ever; then a late kind takes the episode with its share of the weights."""
    names = [n for n in FAULTS if not only or n in only]
    early = [n for n in names if n not in LATE_FAULTS]
    late = [n for n in names if n in LATE_FAULTS]
    if not early:
        return _weighted(rng, late)
    pick = _weighted(rng, early)
    share = sum(FAULTS[n][0] for n in late) / sum(FAULTS[n][0] for n in names)
    if late and late_rng.random() < share:
        return _weighted(late_rng, late)
    return pick


def inject(ctx: FaultContext, kind: str, seed: int, episode: int,
           prefixes: tuple[str, ...] = ()) -> FaultResult:
    if kind == "failpoint":
        point = failpoint_for(seed, episode, prefixes)
        k = 1 if point.startswith(START_POINTS + GC_REVERT_POINTS + SCHEMA_POINTS) \
            else ctx.rng.randint(1, 3)
        return arm_failpoint(ctx, point, k)
    return FAULTS[kind][1](ctx)
