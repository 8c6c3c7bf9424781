"""The Storage GC driver (spark_jobs/storage_gc.py, steps 1-5 on the driver): the job's
gated read transaction and its lease, the stats and the plan, each group's prepare,
commit or abort at its owning node, and the report (printed, logged, --json).
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Any, TypeVar

import grpc

from retina_common import exit_codes, file_names, progress
from retina_common.catalog import Catalog, CatalogError
from retina_common.client import channel
from retina_common.config import Config
from retina_common.pb import retina_pb2 as rpb
from retina_common.pb import retina_pb2_grpc, trans_pb2_grpc
from retina_common.pb import trans_pb2 as tpb
from retina_common.refusal import (
    AWAITING_CHECKPOINT,
    HELD_BY_BUFFER_READ,
    ROLLED_BACK_FOR_BUFFER_READ,
)
from retina_common.retry import RETRYABLE_CODES, Backoff, rpc_with_retry
from retina_common.storage import object_size
from retina_common.topology import Topology
from spark_jobs.common import (
    REFUSED_MARK,
    UNAVAILABLE_MARK,
    FileRef,
    fail,
    parse_conf,
    short_reason,
    spark_session,
)
from spark_jobs.storage_gc_arrow import deleted_count
from spark_jobs.storage_gc_plan import FileStats, Group, MiB, Skipped, Thresholds, plan_table
from spark_jobs.storage_gc_task import (
    RPC_TIMEOUT_S,
    RewriteResult,
    RewriteTask,
    TaskSpec,
    run_rewrites,
)

PROG = "storage_gc"
STATS_THREADS = 8

# Outcomes of a group, as printed and in --json.
PLANNED, COMMITTED, REFUSED, FAILED = "PLANNED", "COMMITTED", "REFUSED", "FAILED"
# The node said "not now" (ABORTED: a file is in another rewrite, or an output that no
# checkpoint pair holds yet, or the cutoff is below a fold under way, or a read holds an old file
# through its write-buffer fetch): left for the next run.
BUSY = "BUSY"
# How long commits held for write-buffer readers are asked again before their groups are
# BUSY: one window per run, opened by the first held commit (readers are short; a run with
# many groups of held files waits this once, not once per group).
HELD_RETRY_S = 10.0
# Codes after which a node has said no for a reason of its own: reported, not fatal.
_NOT_OURS = (grpc.StatusCode.UNIMPLEMENTED, grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN)

T = TypeVar("T")


@dataclass
class GroupReport:
    table: str
    vnode: int
    node: str
    kind: str
    old_files: list[dict[str, Any]]
    rows_before: int
    deleted_at_safe_gc_ts: int
    bytes_before: int
    outcome: str = PLANNED
    status: str = ""  # the gRPC status of a refusal or failure
    reason: str = ""
    rewrite_id: str = ""
    cutoff_ts: int = 0
    new_file: dict[str, Any] | None = None
    rows_kept: int = 0
    rows_dropped: int = 0
    bytes_after: int = 0
    task_seconds: float = 0.0
    prepare_seconds: float = 0.0  # the node's PrepareGcRewrite, as the driver saw it
    commit_seconds: float = 0.0  # the node's CommitGcRewrite, as the driver saw it
    chain_items: int = 0
    journal_state: str = ""
    exit_code: int = exit_codes.OK  # what this group alone would make the job exit with


def _report_of(group: Group) -> GroupReport:
    return GroupReport(
        table=f"{group.schema}.{group.table}", vnode=group.vnode, node=group.node,
        kind=group.kind,
        old_files=[{"file_id": f.ref.file_id, "name": f.ref.name, "rows": f.rows,
                    "deleted": f.deleted, "bytes": f.size_bytes} for f in group.files],
        rows_before=group.rows, deleted_at_safe_gc_ts=group.deleted,
        bytes_before=group.bytes_before)


def code_exit(code: grpc.StatusCode) -> int:
    if code in RETRYABLE_CODES:
        return exit_codes.UNAVAILABLE
    if code in _NOT_OURS:
        return exit_codes.FAILED
    return exit_codes.REFUSED


def _held_by_reader(exc: grpc.RpcError) -> bool:
    """The commit waits for a reader; the rewrite stays prepared (ask again)."""
    return exc.code() == grpc.StatusCode.ABORTED and HELD_BY_BUFFER_READ in (exc.details() or "")


def _rolled_back_for_reader(exc: grpc.RpcError) -> bool:
    """The commit met a reader too late and rolled back: the group is for the next run."""
    return (exc.code() == grpc.StatusCode.ABORTED
            and ROLLED_BACK_FOR_BUFFER_READ in (exc.details() or ""))


class LeaseKeeper:
    """Extends the job's read transaction while the job runs: a long job must not lose
    it, and a killed job's transaction must not pin safeGcTs for long (a short lease,
    renewed every third of it)."""

    def __init__(self, trans: trans_pb2_grpc.TransServiceStub, trans_id: int,
                 lease_ms: int) -> None:
        self._trans = trans
        self._trans_id = trans_id
        self._lease_ms = lease_ms
        self._stop = threading.Event()
        self.lost = ""  # why the transaction is gone, if it is
        self._thread = threading.Thread(target=self._run, name="gc-lease", daemon=True)

    def start(self) -> LeaseKeeper:
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self._lease_ms / 3000):
            try:
                rpc_with_retry(lambda: self._trans.ExtendTransLease(tpb.ExtendTransLeaseRequest(
                    trans_id=self._trans_id, lease_ms=self._lease_ms), timeout=10), attempts=3)
            except grpc.RpcError as exc:
                if exc.code() not in RETRYABLE_CODES:
                    self.lost = f"{exc.code().name}: {exc.details()}"
                    return

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=15)


@dataclass
class JobState:
    """Everything the driver learns on its way; becomes the report."""

    safe_gc_ts: int = 0
    snapshot_ts: int = 0
    tables: list[str] = field(default_factory=list)
    files_listed: int = 0
    skipped: list[Skipped] = field(default_factory=list)
    # Files their node would not let go now (QueryVisibility's gc_hold): in no group.
    held: list[dict[str, Any]] = field(default_factory=list)
    groups: list[GroupReport] = field(default_factory=list)
    spark_start_s: float = 0.0
    task_seconds: float = 0.0
    stopped: str = ""  # why the job stopped early, if it did

    def exit_code(self) -> int:
        codes = {g.exit_code for g in self.groups}
        if self.stopped and not codes - {exit_codes.OK}:
            codes.add(exit_codes.UNAVAILABLE)
        for code in (exit_codes.FAILED, exit_codes.UNAVAILABLE, exit_codes.REFUSED):
            if code in codes:
                return code
        return exit_codes.OK


class UnknownSchema(Exception):
    """--schema names no schema of the catalog: a usage error (exit 2)."""

    def __init__(self, schema: str, known: Sequence[str]) -> None:
        super().__init__(f"schema {schema!r} is not in the catalog (its schemas: "
                         f"{', '.join(known) or 'none'}); nothing done")


class StorageGcJob:
    def __init__(self, args: argparse.Namespace, config: Config, topology: Topology,
                 log: Any) -> None:
        self.args = args
        self.config = config
        self.topology = topology
        self.log = log
        self.thresholds = Thresholds(args.deleted_threshold, args.small_file_bytes,
                                     args.target_file_bytes, args.size_ratio,
                                     args.min_tier_bytes)
        self.state = JobState()
        self._held_lock = threading.Lock()
        self._held_until: float | None = None  # the run's held-commit window (HELD_RETRY_S)
        # The driver's bar over the groups while rewrites run (stderr, terminals only).
        self._bar: Any = None
        self._trans_channel = channel(config.trans.listen)
        self.trans = trans_pb2_grpc.TransServiceStub(self._trans_channel)
        self._node_channels = {n: channel(n) for n in topology.nodes}
        self.nodes = {n: retina_pb2_grpc.RetinaWorkerServiceStub(c)
                      for n, c in self._node_channels.items()}

    def close(self) -> None:
        self._trans_channel.close()
        for ch in self._node_channels.values():
            ch.close()

    # --- step 2: stats and the plan ---
    def file_stats(self, trans: tpb.BeginTransResponse, table: str, f: tpb.QueryFile
                   ) -> FileStats | Skipped:
        ref = FileRef(f.file_id, f.name, f.path_uri)
        try:
            parsed = file_names.parse(f.name)
        except ValueError as exc:
            return Skipped(table, f.file_id, f.name, f"unparsable name: {exc}")
        stub = self.nodes.get(parsed.node_id)
        if stub is None:
            return Skipped(table, f.file_id, f.name,
                           f"its node {parsed.node_id} is not in the topology")
        try:
            visibility = rpc_with_retry(lambda: stub.QueryVisibility(rpb.QueryVisibilityRequest(
                file_id=f.file_id, timestamp=self.state.safe_gc_ts, trans_id=trans.trans_id,
                want_gc_hold=True),
                timeout=RPC_TIMEOUT_S))
        except grpc.RpcError as exc:
            if exc.code() in RETRYABLE_CODES:
                raise  # the node is away: the whole run is unavailable
            # snapshot_expired: its visibility base is above safeGcTs (a base a version-1
            # checkpoint restored at its checkpointAppliedTs); try again in a later run.
            return Skipped(table, f.file_id, f.name,
                           f"QueryVisibility at {self.state.safe_gc_ts}: "
                           f"{exc.code().name}: {exc.details()}")
        if visibility.first_block_id < 0:  # replaced by another rewrite since the listing
            return Skipped(table, f.file_id, f.name, "no longer a published file of "
                           f"{parsed.node_id} (replaced since it was listed)")
        rows, deleted = deleted_count(visibility)
        try:
            size = object_size(f.path_uri, f.name)
        except OSError as exc:
            return Skipped(table, f.file_id, f.name, f"size from storage: {exc}")
        return FileStats(ref, parsed.node_id, parsed.vnode, visibility.first_block_id, size,
                         rows, deleted, visibility.gc_hold)

    def plan(self, trans: tpb.BeginTransResponse, schema: str, table: str) -> list[Group]:
        listing = rpc_with_retry(lambda: self.trans.ListQueryFiles(tpb.ListQueryFilesRequest(
            trans_id=trans.trans_id, schema_name=schema, table_name=table),
            timeout=RPC_TIMEOUT_S))
        name = f"{schema}.{table}"
        files = [f for f in listing.files if self._ours(f.name)]
        self.state.files_listed += len(files)
        with ThreadPoolExecutor(STATS_THREADS) as pool:
            stats = list(pool.map(lambda f: self.file_stats(trans, name, f), files))
        usable = [s for s in stats if isinstance(s, FileStats)]
        self.state.held.extend({"table": name, "file_id": u.ref.file_id, "name": u.ref.name,
                                "reason": u.hold} for u in usable if u.hold)
        for s in stats:
            if isinstance(s, Skipped):
                self.state.skipped.append(s)
                self.log.warning("gc_file_skipped", table=name, file_id=s.file_id,
                                 file=s.name, reason=s.reason)
        listed = [FileRef(f.file_id, f.name, f.path_uri) for f in files]
        return plan_table(schema, table, usable, listed, self.thresholds)

    def _ours(self, name: str) -> bool:
        """--node: only the files that node created (streams never span nodes)."""
        if not self.args.node:
            return True
        try:
            return file_names.parse(name).node_id == self.args.node
        except ValueError:
            return False  # reported by a run without --node

    # --- steps 3-5 ---
    def prepare(self, trans: tpb.BeginTransResponse, index: int, group: Group,
                report: GroupReport) -> RewriteTask | None:
        request = rpb.PrepareGcRewriteRequest(
            schema_name=group.schema, table_name=group.table, virtual_node_id=group.vnode,
            old_file_ids=[f.ref.file_id for f in group.files],
            safe_gc_ts=self.state.safe_gc_ts, trans_id=trans.trans_id)
        started = time.monotonic()
        try:
            # Only UNAVAILABLE is sent again: a lost answer (deadline) may have prepared
            # a rewrite that pins these files until it expires, and a second one would
            # be refused for them.
            prepared = rpc_with_retry(lambda: self.nodes[group.node].PrepareGcRewrite(
                request, timeout=RPC_TIMEOUT_S), retry_on=(grpc.StatusCode.UNAVAILABLE,))
        except grpc.RpcError as exc:
            if exc.code() == grpc.StatusCode.ABORTED:
                self._settle(report, BUSY, exc.code(), f"PrepareGcRewrite: {exc.details()}",
                             exit_code=exit_codes.OK)
                return None
            self._settle(report, REFUSED if code_exit(exc.code()) == exit_codes.REFUSED else FAILED,
                         exc.code(), f"PrepareGcRewrite: {exc.details()}")
            return None
        report.rewrite_id, report.cutoff_ts = prepared.rewrite_id, prepared.cutoff_ts
        report.prepare_seconds = round(time.monotonic() - started, 3)
        report.new_file = {"file_id": 0, "name": prepared.file_name}
        return RewriteTask(index, prepared.rewrite_id, group.node, report.table, group.vnode,
                           tuple(f.ref for f in group.files), group.bytes_before,
                           prepared.file_name, prepared.path_id, prepared.path_uri,
                           prepared.cutoff_ts, prepared.expected_rows,
                           prepared.schema_version)

    def _settle(self, report: GroupReport, outcome: str, code: grpc.StatusCode | None,
                reason: str, exit_code: int | None = None) -> None:
        report.outcome, report.reason = outcome, reason
        report.status = code.name if code is not None else ""
        if exit_code is not None:
            report.exit_code = exit_code
        elif code is not None:
            report.exit_code = code_exit(code)
        else:
            report.exit_code = exit_codes.FAILED if outcome == FAILED else exit_codes.OK
        self.log.info("gc_group_done", table=report.table, vnode=report.vnode,
                      node=report.node, outcome=outcome, status=report.status, reason=reason,
                      old_files=[f["file_id"] for f in report.old_files],
                      new_file=report.new_file, rows_kept=report.rows_kept,
                      rows_dropped=report.rows_dropped, bytes_before=report.bytes_before,
                      bytes_after=report.bytes_after)
        with progress.printing():
            print_group(report)
        if self._bar is not None:
            self._bar.update(1)

    def abort(self, task: RewriteTask) -> None:
        """Best effort: a rewrite the node is not told about expires there anyway."""
        try:
            rpc_with_retry(lambda: self.nodes[task.node].AbortGcRewrite(
                rpb.AbortGcRewriteRequest(rewrite_id=task.rewrite_id), timeout=RPC_TIMEOUT_S),
                attempts=3)
        except grpc.RpcError as exc:
            self.log.warning("gc_abort_failed", rewrite_id=task.rewrite_id, node=task.node,
                             status=exc.code().name, reason=exc.details())

    def finish(self, task: RewriteTask, result: RewriteResult, report: GroupReport,
               keeper: LeaseKeeper) -> None:
        """The driver's side of one finished task: commit it, or abort it."""
        report.rows_kept, report.rows_dropped = result.rows_kept, result.rows_dropped
        report.bytes_after, report.task_seconds = result.bytes_after, round(result.seconds, 3)
        if result.error:
            self.abort(task)
            code = (exit_codes.UNAVAILABLE if UNAVAILABLE_MARK in result.error else
                    exit_codes.REFUSED if REFUSED_MARK in result.error else exit_codes.FAILED)
            self._settle(report, FAILED, None, f"rewrite task: {result.error}", code)
            return
        report.new_file = {"file_id": result.new_file_id, "name": task.file_name}
        if keeper.lost:
            # The node checks the rewrite itself; the job just does not start a commit
            # on behalf of a transaction that is gone.
            self.abort(task)
            self._settle(report, FAILED, None, f"the job's read transaction ended: "
                         f"{keeper.lost}", exit_codes.UNAVAILABLE)
            return
        started = time.monotonic()
        try:
            reply = self._commit(task, result)
        except grpc.RpcError as exc:
            report.commit_seconds = round(time.monotonic() - started, 3)
            if _held_by_reader(exc) or _rolled_back_for_reader(exc):
                # Nothing changed; the next run rewrites them.
                self.abort(task)
                self._settle(report, BUSY, exc.code(), f"CommitGcRewrite: {exc.details()}",
                             exit_code=exit_codes.OK)
                return
            if exc.code() in RETRYABLE_CODES:
                # Outcome unknown: the rewrite may have committed. No abort; the node
                # decides (journal) and the next run plans from what is REGULAR.
                self._settle(report, FAILED, exc.code(),
                             f"CommitGcRewrite, outcome unknown: {exc.details()}")
                return
            self.abort(task)
            self._settle(report, REFUSED if code_exit(exc.code()) == exit_codes.REFUSED else FAILED,
                         exc.code(), f"CommitGcRewrite: {exc.details()}")
            return
        report.commit_seconds = round(time.monotonic() - started, 3)
        report.chain_items, report.journal_state = reply.chain_items, reply.journal_state
        self._settle(report, COMMITTED, None, reply.outcome)

    def _commit(self, task: RewriteTask,
                result: RewriteResult) -> rpb.CommitGcRewriteResponse:
        """CommitGcRewrite. A repeated commit of a committed rewrite answers the same, so a
        lost answer (deadline) is simply asked again; a commit held for a reader that got
        rows of an old file from a write buffer (BUFFER_FETCH_HOLDS_FILE: reads are short)
        is asked again within the run's held window (HELD_RETRY_S) before the group is
        left for the next run."""
        request = rpb.CommitGcRewriteRequest(rewrite_id=task.rewrite_id,
                                             new_file_id=result.new_file_id)
        backoff = Backoff(0.2, 2.0)
        while True:
            try:
                return rpc_with_retry(lambda: self.nodes[task.node].CommitGcRewrite(
                    request, timeout=RPC_TIMEOUT_S))
            except grpc.RpcError as exc:
                if not _held_by_reader(exc) or time.monotonic() + backoff.next_s > \
                        self._held_window():
                    raise
            backoff.pause()

    def _held_window(self) -> float:
        """The end of the run's held-commit window, opened now if it is not yet."""
        with self._held_lock:
            if self._held_until is None:
                self._held_until = time.monotonic() + HELD_RETRY_S
            return self._held_until

    def run(self) -> int:
        args = self.args
        try:
            # Through the gate first, exactly like snapshot_query: a refusal must not
            # even start Spark.
            trans = self.trans.BeginTrans(tpb.BeginTransRequest(
                read_only=True, lease_ms=args.lease_ms), timeout=RPC_TIMEOUT_S)
        except grpc.RpcError as exc:
            if exc.code() == grpc.StatusCode.UNAVAILABLE:
                return fail(PROG, "the query gate refused the job's read transaction (a "
                                  "Retina node is not READY, or the TransServer is down): "
                                  f"{exc.details()}", exit_codes.UNAVAILABLE)
            return fail(PROG, f"BeginTrans: {short_reason(exc)}", code_exit(exc.code()))
        keeper = LeaseKeeper(self.trans, trans.trans_id, args.lease_ms).start()
        try:
            return self._run_in(trans, keeper)
        finally:
            keeper.stop()
            try:
                self.trans.CommitTrans(tpb.CommitTransRequest(trans_id=trans.trans_id),
                                       timeout=RPC_TIMEOUT_S)
            except grpc.RpcError as exc:  # an expired lease ended it already
                self.log.warning("gc_trans_end_failed", trans_id=trans.trans_id,
                                 status=exc.code().name, reason=exc.details())

    def _tables(self) -> list[str]:
        """--all-tables: the schema's tables. A schema the catalog does not know is an
        error (UnknownSchema), not an empty run: a typo must not look like 'nothing to
        do' (an existing schema without tables is one)."""
        if not self.args.all_tables:
            return [self.args.table]
        catalog = Catalog(self.config.catalog.dsn, pool_max=1,
                          connect_timeout_s=self.config.catalog.connect_timeout_s)
        try:
            tables = catalog.list_tables(self.args.schema)
            if not tables:
                schemas = catalog.list_schemas()
                if self.args.schema not in schemas:
                    raise UnknownSchema(self.args.schema, schemas)
            return tables
        finally:
            catalog.close()

    def _run_in(self, trans: tpb.BeginTransResponse, keeper: LeaseKeeper) -> int:
        args, state = self.args, self.state
        started = time.monotonic()
        state.snapshot_ts = trans.timestamp
        try:
            state.safe_gc_ts = rpc_with_retry(lambda: self.trans.GetSafeGcTimestamp(
                tpb.GetSafeGcTimestampRequest(), timeout=RPC_TIMEOUT_S)).safe_gc_ts
            state.tables = [f"{args.schema}.{t}" for t in self._tables()]
            self.log.info("gc_job_started", trans_id=trans.trans_id,
                          snapshot_ts=trans.timestamp, safe_gc_ts=state.safe_gc_ts,
                          tables=state.tables, dry_run=args.dry_run)
            groups: list[Group] = []
            for name in progress.track(state.tables, desc="plan", unit="table",
                                       disabled=args.no_progress):
                groups.extend(self.plan(trans, args.schema, name.split(".", 1)[1]))
        except grpc.RpcError as exc:
            if exc.code() == grpc.StatusCode.NOT_FOUND:  # a table that does not exist
                return fail(PROG, f"{exc.details()}; nothing done (check --schema and "
                                  "--table)", exit_codes.USAGE)
            return fail(PROG, f"planning: {short_reason(exc)}", code_exit(exc.code()))
        except UnknownSchema as exc:
            return fail(PROG, str(exc), exit_codes.USAGE)
        except CatalogError as exc:
            return fail(PROG, f"catalog: {exc}", exit_codes.UNAVAILABLE)
        if args.max_groups:
            groups = groups[:args.max_groups]
        reports = [_report_of(g) for g in groups]
        state.groups = reports
        print(f"{PROG}: safeGcTs {state.safe_gc_ts}, snapshot {trans.timestamp}: "
              f"{state.files_listed} files listed in {len(state.tables)} table(s), "
              f"{len(state.skipped)} skipped, {len(state.held)} held by their node, "
              f"{len(groups)} group(s) planned", flush=True)
        for s in state.skipped:
            print(f"  skipped {s.table} file {s.file_id} ({s.name}): {s.reason}", flush=True)
        for h in state.held:
            print(f"  held {h['table']} file {h['file_id']} ({h['name']}): {h['reason']}",
                  flush=True)
        if args.dry_run or not groups:
            for report in reports:
                print_group(report)
            return self.done(started)
        spark_started = time.monotonic()
        spark = spark_session(f"retina-storage-gc-{args.schema}", args.master,
                              parse_conf(args.conf))
        state.spark_start_s = time.monotonic() - spark_started
        self._bar = progress.bar(len(groups), desc="rewrite", unit="group",
                                 disabled=args.no_progress)
        try:
            spec = TaskSpec(self.config.catalog.dsn, self.config.catalog.connect_timeout_s,
                            trans.trans_id, args.row_group_rows)
            # Waves: a prepared rewrite expires at its node, so prepare only what Spark
            # gets to soon.
            for first in range(0, len(groups), args.groups_per_wave):
                if keeper.lost:
                    state.stopped = f"the job's read transaction ended: {keeper.lost}"
                    break
                wave = range(first, min(first + args.groups_per_wave, len(groups)))
                tasks = [t for t in (self.prepare(trans, i, groups[i], reports[i])
                                     for i in wave) if t is not None]
                if not tasks:
                    continue
                task_started = time.monotonic()
                run_rewrites(spark, spec, tasks, lambda task, result: self.finish(
                    task, result, reports[task.index], keeper))
                state.task_seconds += time.monotonic() - task_started
        finally:
            spark.stop()
            self._bar.close()
            self._bar = None
        for report in reports:  # groups the job never got to
            if report.outcome == PLANNED:
                self._settle(report, FAILED, None, f"not attempted: {state.stopped}",
                             exit_codes.UNAVAILABLE)
        return self.done(started)

    def done(self, started: float) -> int:
        state, args = self.state, self.args
        totals = totals_of(state)
        totals["seconds"] = round(time.monotonic() - started, 3)
        totals["spark_start_s"] = round(state.spark_start_s, 3)
        totals["task_seconds"] = round(state.task_seconds, 3)
        code = state.exit_code()
        print(summary_line(totals, args.dry_run), flush=True)
        if state.stopped:
            print(f"{PROG}: stopped early: {state.stopped}", file=sys.stderr, flush=True)
        self.log.info("gc_job_done", exit_code=code, dry_run=args.dry_run,
                      safe_gc_ts=state.safe_gc_ts, **totals)
        if args.json:
            print(json.dumps({"safe_gc_ts": state.safe_gc_ts, "snapshot_ts": state.snapshot_ts,
                              "dry_run": args.dry_run, "tables": state.tables,
                              "files_listed": state.files_listed, "exit_code": code,
                              "totals": totals,
                              "skipped": [asdict(s) for s in state.skipped],
                              "held": state.held,
                              "groups": [asdict(g) for g in state.groups]}), flush=True)
        return code


def totals_of(state: JobState) -> dict[str, Any]:
    committed = [g for g in state.groups if g.outcome == COMMITTED]
    return {
        "groups": len(state.groups),
        "committed": len(committed),
        "refused": sum(g.outcome == REFUSED for g in state.groups),
        "busy": sum(g.outcome == BUSY for g in state.groups),
        # BUSY because a file is an earlier output both checkpoint slots do not hold yet:
        # what back-to-back runs closer than two checkpoint intervals meet.
        "busy_awaiting_checkpoint": sum(g.outcome == BUSY and AWAITING_CHECKPOINT in g.reason
                                        for g in state.groups),
        "failed": sum(g.outcome == FAILED for g in state.groups),
        "skipped_files": len(state.skipped),
        "held_files": len(state.held),
        "held_awaiting_checkpoint": sum(AWAITING_CHECKPOINT in h["reason"]
                                        for h in state.held),
        "files_before": sum(len(g.old_files) for g in committed),
        "files_after": len(committed),
        "rows_kept": sum(g.rows_kept for g in committed),
        "rows_dropped": sum(g.rows_dropped for g in committed),
        "bytes_before": sum(g.bytes_before for g in committed),
        "bytes_after": sum(g.bytes_after for g in committed),
        # Summed over tasks (they overlap): rows per task-second is the per-core rate.
        "task_busy_seconds": round(sum(g.task_seconds for g in state.groups), 3),
        "prepare_seconds": round(sum(g.prepare_seconds for g in state.groups), 3),
        "commit_seconds": round(sum(g.commit_seconds for g in state.groups), 3),
    }


def _mib(n: int) -> str:
    return f"{n / MiB:,.2f} MiB"


def print_group(g: GroupReport) -> None:
    old = ", ".join(str(f["file_id"]) for f in g.old_files)
    head = f"{g.outcome} {g.table} vnode {g.vnode} ({g.node}, {g.kind}): files [{old}]"
    if g.outcome == PLANNED:
        print(f"{head}: {g.rows_before:,} rows, {g.deleted_at_safe_gc_ts:,} deleted at "
              f"safeGcTs, {_mib(g.bytes_before)}", flush=True)
    elif g.outcome == COMMITTED:
        new = g.new_file or {}
        print(f"{head} -> {new.get('file_id')} ({new.get('name')}): rows kept "
              f"{g.rows_kept:,} dropped {g.rows_dropped:,}, {_mib(g.bytes_before)} -> "
              f"{_mib(g.bytes_after)} (cutoff {g.cutoff_ts}, {g.journal_state})", flush=True)
    else:
        status = f" {g.status}" if g.status else ""
        print(f"{head}:{status} {g.reason}", flush=True)


def _held(t: dict[str, Any]) -> str:
    waiting = t.get("held_awaiting_checkpoint", 0)
    return (f"{t.get('held_files', 0)} held by their node ({waiting} awaiting their second "
            "checkpoint)")


def summary_line(t: dict[str, Any], dry_run: bool) -> str:
    if dry_run:
        return f"dry run: {t['groups']} group(s) planned, {_held(t)}, nothing changed"
    waiting = t.get("busy_awaiting_checkpoint", 0)
    busy = (f"{t['busy']} busy (next run; {waiting} of them hold an earlier rewrite's output "
            "that is awaiting its second checkpoint)" if waiting else
            f"{t['busy']} busy (next run)")
    return (f"done: {t['committed']} of {t['groups']} group(s) committed, {t['refused']} "
            f"refused, {busy}, {t['failed']} failed, "
            f"{t['skipped_files']} file(s) skipped, {_held(t)}; files "
            f"{t['files_before']} -> {t['files_after']}, rows kept {t['rows_kept']:,} dropped "
            f"{t['rows_dropped']:,}, {_mib(t['bytes_before'])} -> {_mib(t['bytes_after'])} "
            f"in {t['seconds']:.2f} s (Spark start-up {t['spark_start_s']:.1f} s, Spark phase "
            f"{t['task_seconds']:.2f} s)")


