"""Replay a range of the durable CDC changelog into Retina with Spark: one task
per virtual node, rows in (ts, seq) order inside it.

Two modes:

``--recover NODE``
    Drive one RECOVERING node to READY, exactly as the connector's recovery
    driver does (specification section 6), but with the replay spread over
    Spark tasks: GetRetinaStatus until replayTsReady → GetRecoveryReplayTs →
    one task per virtual node the node owns, replaying that virtual node's
    changelog rows from its start (inclusive) as DELETE + INSERT with the
    RecoveryReplayContext → MarkReady once every task succeeded. Virtual
    nodes are independent streams on the Retina side, so they may be replayed
    concurrently; only the order inside one stream matters.

``--backfill --from-ts N [--to-ts M]``
    Every virtual node of every node, ordinary UpdateRecord (no context), for
    rows with N <= ts <= M. The rows keep their original timestamps, so the
    caller must hold the write transaction(s) covering those timestamps open
    at the TransServer until the job has finished (the HWM must not pass a
    timestamp whose rows are still being written), and every node must be READY.

A task needs only plain, picklable data (the changelog root, the schema,
table records, a virtual node, its range, the context fields) and opens its
own gRPC channel. UNAVAILABLE is retried with backoff inside the task, then
the task fails and Spark may run it again: replaying a row twice is harmless,
it is a DELETE + INSERT of one key at one timestamp (a partial update merges the
same row again; a copy left under a later version ends at it). In backfill mode
(no recovery context) a partial update whose key another writer wrote later is
refused FAILED_PRECONDITION (PARTIAL_UPDATES_IN_TIMESTAMP_ORDER) and the task fails:
a backfill of partial updates must not overlap later writes of their keys.

Both modes first compare every virtual node's start with the changelog's
retention low-watermark (``Changelog.retained_from``): a start below it needs
batches retention has dropped, so the job sends nothing, never calls
MarkReady, and exits ``exit_codes.REPLAY_GAP`` (5, the connector's code for the
same stop). The low-watermark is read again after the tasks, before
MarkReady, in case retention ran meanwhile.

Progress: one line per finished virtual node, from a Spark accumulator, and a
summary (also as JSON with ``--json``). Exit codes: see spark_jobs.common,
plus 5, a replay gap.

    python -m spark_jobs.cdc_replay --config retina.toml --recover 127.0.0.1:18890
    spark-submit spark_jobs/cdc_replay.py --config retina.toml --backfill --from-ts 100
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any

import grpc

from retina_common import exit_codes, progress, replay_sources
from retina_common.catalog import Catalog, CatalogError, TableRecord
from retina_common.changelog import Changelog, ChangelogGap, CorruptChangelog, changelog_root
from retina_common.changelog_replay import (
    ReplayLog,
    changelog_rows,
    merged_replay_requests,
    node_starts,
    replay_requests,
)
from retina_common.client import channel
from retina_common.columnar import min_columnar_rows
from retina_common.config import Config, ConfigError
from retina_common.etcd import EtcdError, EtcdStore
from retina_common.failpoints import CDC_REPLAY_REQUEST_AFTER
from retina_common.log import token_hash
from retina_common.pb import retina_pb2 as pb
from retina_common.pb import retina_pb2_grpc, trans_pb2_grpc
from retina_common.recovery_driver import GATE_WAIT_S, await_gate_ready, wait_replay_ready
from retina_common.replay_sources import ReplaySourceError
from retina_common.topology import Topology
from spark_jobs.common import (
    REFUSED_MARK,
    TaskError,
    add_spark_arguments,
    call_with_retry,
    exit_code_of,
    fail,
    load,
    parse_conf,
    run_reported,
    short_reason,
    spark_session,
)

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

PROG = "cdc_replay"
MODES = {"vnode": pb.VNODE, "node": pb.NODE}
RPC_TIMEOUT_S = 60.0
# The next code after spark_jobs.common's, the same as retina-cdc's replay-gap stop.
REPLAY_GAP_MARK = "[retina:REPLAY_GAP]"


# --- what a task receives: plain data ---------------------------------------------------------
@dataclass(frozen=True)
class ReplayContext:
    """The fields of RecoveryReplayContext (a protobuf message is rebuilt in the task)."""

    token: str
    checkpoint_id: int
    mode: pb.ReplayMode

    def message(self) -> pb.RecoveryReplayContext:
        return pb.RecoveryReplayContext(recovery_attempt_token=self.token,
                                        checkpoint_id=self.checkpoint_id, replay_mode=self.mode)


@dataclass(frozen=True)
class OtherSource:
    """Another registered replay source (an application writer, retina_common/writer.py):
    a recovery replays its changelog too, merged in timestamp order with the connector's."""

    writer_id: str
    changelog_root: str
    schema: str
    tables: Mapping[str, TableRecord]


@dataclass(frozen=True)
class JobSpec:
    changelog_root: str
    schema: str
    tables: Mapping[str, TableRecord]
    max_rows: int
    context: ReplayContext | None  # None: ordinary writes (backfill)
    rpc_timeout_s: float = RPC_TIMEOUT_S
    # The connector's replay-source id (cdc.name): backfill writes name it, since the rows
    # are in its changelog (WRITES_HAVE_A_REPLAY_SOURCE).
    writer_id: str = ""
    others: tuple[OtherSource, ...] = ()


@dataclass(frozen=True)
class VnodeTask:
    vnode: int
    node: str
    from_ts: int  # inclusive
    to_ts: int | None  # inclusive; None: to the end of the changelog
    accepts_columnar: bool = False  # the node's GetRetinaStatus.accepts_columnar
    accepts_partial: bool = False  # the node's GetRetinaStatus.accepts_partial


@dataclass(frozen=True)
class VnodeResult:
    vnode: int
    rows: int
    requests: int


class _Tables(dict):
    """Table records by name; a name the catalog does not have refuses the task."""

    def __init__(self, schema: str, tables: Mapping[str, TableRecord]) -> None:
        super().__init__(tables)
        self._schema = schema

    def __missing__(self, name: str) -> TableRecord:
        raise TaskError(f"{REFUSED_MARK} the changelog names table {self._schema}.{name}, "
                        "which the catalog does not have")


# --- the task ---------------------------------------------------------------------------------
def task_requests(spec: JobSpec, task: VnodeTask) -> Iterator[pb.UpdateRecordRequest]:
    """One task's requests, in the order it sends them: its virtual node's changelog rows
    from its start as it reads them now (the changelog only grows at its end)."""
    changelog = Changelog(spec.changelog_root)
    # Batch records are small JSON; of each batch's segment only this vnode's rows are kept.
    records = [r for r in changelog.records(task.from_ts)
               if task.to_ts is None or r.first_ts <= task.to_ts]
    context = spec.context.message() if spec.context else None
    columnar = min_columnar_rows(task.accepts_columnar)
    if context is not None and spec.others:
        # Every replay source's rows of this virtual node, in timestamp order.
        logs = [ReplayLog(spec.writer_id, spec.schema, changelog,
                          _Tables(spec.schema, spec.tables)),
                *(ReplayLog(o.writer_id, o.schema, Changelog(o.changelog_root),
                            _Tables(o.schema, o.tables)) for o in spec.others)]
        return merged_replay_requests(logs, {task.vnode: task.from_ts}, context,
                                      spec.max_rows, min_columnar_rows=columnar,
                                      accepts_partial=task.accepts_partial)
    return replay_requests(changelog, spec.schema, _Tables(spec.schema, spec.tables),
                           {task.vnode: task.from_ts}, context, spec.max_rows, task.to_ts,
                           records, min_columnar_rows=columnar, writer_id=spec.writer_id,
                           accepts_partial=task.accepts_partial)


def replay_vnode(spec: JobSpec, task: VnodeTask) -> VnodeResult:
    """Send one virtual node's changelog range to its node; runs inside a Spark task."""
    sent_rows = sent = 0
    with channel(task.node) as ch:
        stub = retina_pb2_grpc.RetinaWorkerServiceStub(ch)
        try:
            for request in task_requests(spec, task):
                call_with_retry(partial(stub.UpdateRecord, request, timeout=spec.rpc_timeout_s),
                                f"UpdateRecord of vnode {task.vnode} to {task.node}")
                sent_rows += changelog_rows(request)
                sent += 1
                if spec.context is not None:
                    # The connector's point after each acknowledged replay request: a
                    # task dying here has sent part of its range, and Spark runs it
                    # again from its start (docs/spark.md, "A retried task").
                    CDC_REPLAY_REQUEST_AFTER.hit()
        except ChangelogGap as exc:  # retention ran under the task: the driver must know
            raise TaskError(f"{REPLAY_GAP_MARK} {exc}") from None
    return VnodeResult(task.vnode, sent_rows, sent)


def run_tasks(spark: SparkSession, spec: JobSpec, tasks: Sequence[VnodeTask],
              on_done: Callable[[VnodeResult], None]) -> list[VnodeResult]:
    """Run one Spark task per virtual node; ``on_done`` is called on the driver as
    each one finishes. Raises whatever the Spark job raised."""
    seen: dict[int, VnodeResult] = {}

    def done(vnode: Any, counts: Any) -> None:
        seen[vnode] = VnodeResult(vnode, *counts)
        on_done(seen[vnode])

    def work(task: VnodeTask) -> tuple[int, tuple[int, int]]:
        result = replay_vnode(spec, task)
        return result.vnode, (result.rows, result.requests)

    failure = run_reported(spark, tasks, work, done, "spark-replay-job")
    if failure is not None:
        raise failure
    return [seen[t.vnode] for t in tasks]


# --- the driver -------------------------------------------------------------------------------
def replay_gap(changelog: Changelog, starts: Mapping[int, int], what: str) -> int | None:
    """exit_codes.REPLAY_GAP (with the message) if a start lies below the changelog's
    low-watermark: replaying what is left would silently lose rows."""
    try:
        changelog.check_retained(starts)
    except CorruptChangelog as exc:
        return fail(PROG, f"{what}: {exc}", exit_codes.FAILED)
    except ChangelogGap as gap:
        return fail(PROG, f"{what}: {gap}. Nothing was sent. Rebuild from the source or "
                          "restore the changelog (docs/operations.md, \"connector stopped "
                          "with a replay gap\")", exit_codes.REPLAY_GAP)
    return None


def table_records(config: Config) -> dict[str, TableRecord]:
    return schema_tables(config, config.cdc.schema)


def schema_tables(config: Config, schema: str) -> dict[str, TableRecord]:
    catalog = Catalog(config.catalog.dsn, pool_max=1,
                      connect_timeout_s=config.catalog.connect_timeout_s)
    try:
        return {name: catalog.get_table(schema, name) for name in catalog.list_tables(schema)}
    finally:
        catalog.close()


def request_rows(config: Config, override: int | None) -> int:
    """Items per request (``requests`` counts a replace as two, as Retina does),
    the connector's default: never above the server's limit."""
    return override or min(config.cdc.request_max_rows, config.retina.max_rows_per_request)


def print_progress(result: VnodeResult) -> None:
    print(f"vnode {result.vnode}: {result.rows:,} rows, {result.requests:,} requests",
          flush=True)


@dataclass
class Plan:
    """What the driver decided before Spark starts."""

    mode: str
    tasks: list[VnodeTask]
    context: ReplayContext | None
    summary: dict[str, Any]
    stub: retina_pb2_grpc.RetinaWorkerServiceStub | None = None


def plan_recovery(node: str, mode_name: str, wait_s: float, topology: Topology,
                  changelog: Changelog) -> Plan | int:
    """Wait for the node's replay starts and open its attempt; an int is an exit code."""
    if node not in topology.nodes:
        return fail(PROG, f"{node} is not in the topology ({', '.join(topology.nodes)})",
                    exit_codes.USAGE)
    stub = retina_pb2_grpc.RetinaWorkerServiceStub(channel(node))
    try:
        status = wait_replay_ready(stub, wait_s)
    except grpc.RpcError as exc:
        return fail(PROG, f"{node}: GetRetinaStatus: {short_reason(exc)}", exit_code_of(exc))
    except TimeoutError as exc:
        return fail(PROG, str(exc), exit_codes.UNAVAILABLE)
    if status.state == pb.READY:
        print(f"{node} is READY already; nothing to replay")
        return exit_codes.OK
    if status.state == pb.FAILED:
        return fail(PROG, f"{node} is FAILED: {status.failure_reason}", exit_codes.REFUSED)
    mode = MODES[mode_name]
    context = ReplayContext(status.recovery_attempt_token, status.checkpoint_id, mode)
    try:
        starts = stub.GetRecoveryReplayTs(pb.GetRecoveryReplayTsRequest(
            recovery_attempt_token=context.token, checkpoint_id=context.checkpoint_id,
            replay_mode=mode), timeout=30)
    except grpc.RpcError as exc:
        return fail(PROG, f"{node}: GetRecoveryReplayTs: {short_reason(exc)}",
                    exit_code_of(exc))
    vnode_starts = node_starts(node, topology, starts, mode)
    gap = replay_gap(changelog, vnode_starts, f"{node} stays RECOVERING")
    if gap is not None:
        return gap
    tasks = [VnodeTask(v, node, s, None, status.accepts_columnar, status.accepts_partial)
             for v, s in sorted(vnode_starts.items())]
    print(f"{node}: recovery attempt {token_hash(context.token)}, checkpoint "
          f"{context.checkpoint_id}, {mode_name} mode: replaying {len(tasks)} virtual nodes "
          f"from ts {min(vnode_starts.values(), default=0)}", flush=True)
    summary = {"node": node, "checkpoint_id": context.checkpoint_id, "replay_mode": mode_name,
               "starts": {str(v): s for v, s in sorted(vnode_starts.items())}}
    return Plan("recover", tasks, context, summary, stub)


def plan_backfill(args: argparse.Namespace, topology: Topology,
                  changelog: Changelog) -> Plan | int:
    """Every virtual node of every node; every node must be READY."""
    if args.from_ts is None or args.from_ts < 1:
        return fail(PROG, "--backfill needs --from-ts N (N >= 1)", exit_codes.USAGE)
    if args.to_ts is not None and args.to_ts < args.from_ts:
        return fail(PROG, "--to-ts must not be below --from-ts", exit_codes.USAGE)
    gap = replay_gap(changelog, dict.fromkeys(range(topology.virtual_nodes), args.from_ts),
                     "backfill")
    if gap is not None:
        return gap
    accepts_columnar: dict[str, bool] = {}
    accepts_partial: dict[str, bool] = {}
    for node in topology.nodes:
        with channel(node) as ch:
            try:
                status = retina_pb2_grpc.RetinaWorkerServiceStub(ch).GetRetinaStatus(
                    pb.GetRetinaStatusRequest(), timeout=10)
            except grpc.RpcError as exc:
                return fail(PROG, f"{node}: GetRetinaStatus: {short_reason(exc)}",
                            exit_code_of(exc))
        if status.state == pb.FAILED:
            return fail(PROG, f"{node} is FAILED: {status.failure_reason}", exit_codes.REFUSED)
        if status.state != pb.READY:
            return fail(PROG, f"{node} is not READY ({pb.LifecycleState.Name(status.state)}); "
                              "recover it first, backfill writes only to READY nodes",
                        exit_codes.UNAVAILABLE)
        accepts_columnar[node] = status.accepts_columnar
        accepts_partial[node] = status.accepts_partial
    tasks = [VnodeTask(v, topology.node_of_vnode(v), args.from_ts, args.to_ts,
                       accepts_columnar[topology.node_of_vnode(v)],
                       accepts_partial[topology.node_of_vnode(v)])
             for v in range(topology.virtual_nodes)]
    print(f"backfill of ts {args.from_ts}..{'end' if args.to_ts is None else args.to_ts} "
          f"into {len(topology.nodes)} nodes, {len(tasks)} virtual nodes", flush=True)
    return Plan("backfill", tasks, None,
                {"from_ts": args.from_ts, "to_ts": args.to_ts, "nodes": list(topology.nodes)})


def job_spec(config: Config, plan: Plan, max_rows: int | None) -> JobSpec | int:
    """What every task of the plan gets; an int is an exit code (the catalog away)."""
    try:
        tables = table_records(config)
    except CatalogError as exc:
        return fail(PROG, f"catalog: {exc}", exit_codes.UNAVAILABLE)
    others = replay_source_plan(config, plan)
    if isinstance(others, int):
        return others
    return JobSpec(changelog_root(config), config.cdc.schema, tables,
                   request_rows(config, max_rows), plan.context, writer_id=config.cdc.name,
                   others=others)


def complete(plan: Plan, spec: JobSpec, wait_s: float) -> int:
    """After every task succeeded: the retention low-watermarks again, then (--recover)
    MarkReady, naming every replay source replayed. An exit code."""
    changelog = Changelog(spec.changelog_root)
    # Retention may have dropped a batch after a task listed the records; the
    # low-watermark rises before any delete, so checking it again here sees it.
    gap = replay_gap(changelog, {t.vnode: t.from_ts for t in plan.tasks},
                     f"{plan.mode} incomplete")
    if gap is not None:
        return gap
    for other in spec.others:
        gap = replay_gap(Changelog(other.changelog_root),
                         {t.vnode: t.from_ts for t in plan.tasks},
                         f"{plan.mode} incomplete (writer {other.writer_id})")
        if gap is not None:
            return gap
    if plan.context is not None and plan.stub is not None:
        try:
            plan.stub.MarkReady(pb.MarkReadyRequest(
                recovery_attempt_token=plan.context.token,
                checkpoint_id=plan.context.checkpoint_id,
                replayed_writers=[spec.writer_id, *(o.writer_id for o in spec.others)]),
                timeout=wait_s)
        except grpc.RpcError as exc:
            return fail(PROG, f"MarkReady: {short_reason(exc)}", exit_code_of(exc))
        print(f"{plan.summary['node']} is READY", flush=True)
    return exit_codes.OK


def _await_gate(config: Config, node: str) -> None:
    """The node is READY; wait until the TransServer's query gate sees it so too."""
    with channel(config.trans.listen) as ch:
        unseen = await_gate_ready(trans_pb2_grpc.TransServiceStub(ch), [node])
    for name, state in unseen.items():
        print(f"{PROG}: {name} is READY, but the query gate still sees it {state} after "
              f"{GATE_WAIT_S:.0f}s (retina-admin status)", file=sys.stderr, flush=True)


def execute(args: argparse.Namespace, config: Config, plan: Plan) -> int:
    spec = job_spec(config, plan, args.max_rows)
    if isinstance(spec, int):
        return spec
    started = time.monotonic()
    spark = spark_session(f"retina-cdc-replay-{plan.mode}", args.master, parse_conf(args.conf))
    try:
        job_started = time.monotonic()
        with progress.bar(len(plan.tasks), desc=f"replay {plan.mode}", unit="vnode",
                          disabled=args.no_progress) as bar:
            results = run_tasks(spark, spec, plan.tasks,
                                progress.reporting(bar, print_progress))
        replay_s = time.monotonic() - job_started
    except Exception as exc:  # a task's CorruptChangelog arrives as Spark's exception text
        code = exit_codes.REPLAY_GAP if REPLAY_GAP_MARK in str(exc) else exit_code_of(exc)
        return fail(PROG, f"replay failed: {short_reason(exc)}", code)
    finally:
        spark.stop()
    code = complete(plan, spec, args.wait_s)
    if code != exit_codes.OK:
        return code
    if plan.context is not None:  # --recover: a query run right after the job is admitted
        _await_gate(config, plan.summary["node"])
    rows = sum(r.rows for r in results)
    summary = {
        "mode": plan.mode, **plan.summary, "vnodes": len(results), "rows": rows,
        "requests": sum(r.requests for r in results), "seconds": round(replay_s, 3),
        "rows_per_s": round(rows / replay_s, 1) if replay_s > 0 else 0.0,
        "spark_start_s": round(job_started - started, 3),
        "total_seconds": round(time.monotonic() - started, 3),
        "per_vnode": {str(r.vnode): {"rows": r.rows, "requests": r.requests} for r in results},
    }
    print(f"done: {rows:,} rows in {summary['requests']:,} requests over {len(results)} "
          f"virtual nodes in {replay_s:.2f} s ({summary['rows_per_s']:,.0f} rows/s); "
          f"Spark start-up {summary['spark_start_s']:.1f} s", flush=True)
    if args.json:
        print(json.dumps(summary), flush=True)
    return exit_codes.OK


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=PROG, formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Replay the durable CDC changelog into Retina, one Spark task per "
                    "virtual node.",
        epilog="--backfill sends ordinary writes carrying the rows' original timestamps: the "
               "caller must hold the write transaction(s) covering --from-ts..--to-ts open at "
               "the TransServer until this job has finished.\n"
               "--recover: the CDC connector must not drive the same node at the same time "
               "(set cdc.drive_recovery = false while an operator replays with Spark).\n"
               "Exit codes: 0 done, 1 failed otherwise, 2 bad arguments or configuration, "
               "3 refused (FAILED_PRECONDITION, FAILED node), 4 unavailable, 5 a replay "
               "gap (a start below the changelog's retention low-watermark: nothing sent, "
               "no MarkReady).")
    p.add_argument("--config", help="TOML config file (default: $RETINA_CONFIG)")
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--recover", metavar="NODE",
                      help="host:port of a RECOVERING Retina node to replay and MarkReady")
    what.add_argument("--backfill", action="store_true",
                      help="ordinary UpdateRecord of --from-ts..--to-ts to every READY node")
    p.add_argument("--mode", choices=sorted(MODES), default=None,
                   help="--recover replay mode (default: cdc.replay_mode, normally vnode)")
    p.add_argument("--from-ts", type=int, help="--backfill: first timestamp (inclusive)")
    p.add_argument("--to-ts", type=int,
                   help="--backfill: last timestamp (inclusive; default: the changelog's end)")
    p.add_argument("--wait-s", type=float, default=120.0,
                   help="how long to wait for replayTsReady and for MarkReady (default 120)")
    p.add_argument("--max-rows", type=int, default=None,
                   help="delete/insert items per request, a replace counting two (default: "
                        "min(cdc.request_max_rows, retina.max_rows_per_request))")
    p.add_argument("--json", action="store_true", help="also print the summary as JSON")
    add_spark_arguments(p)
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.recover and (args.from_ts is not None or args.to_ts is not None):
        return fail(PROG, "--from-ts / --to-ts apply to --backfill only", exit_codes.USAGE)
    if args.backfill and args.mode is not None:
        return fail(PROG, "--mode applies to --recover only", exit_codes.USAGE)
    if args.max_rows is not None and args.max_rows < 2:  # a replace is two items
        return fail(PROG, "--max-rows must be at least 2", exit_codes.USAGE)
    try:
        config, topology = load(args.config)
        parse_conf(args.conf)
        if args.recover:
            args.mode = args.mode or config.cdc.replay_mode
            if args.mode not in MODES:
                raise ConfigError(f"cdc.replay_mode: expected vnode or node, got {args.mode!r}")
    except ConfigError as exc:
        return fail(PROG, str(exc), exit_codes.USAGE)
    changelog = Changelog(changelog_root(config))
    plan = (plan_recovery(args.recover, args.mode, args.wait_s, topology, changelog)
            if args.recover else plan_backfill(args, topology, changelog))
    if isinstance(plan, int):
        return plan
    return execute(args, config, plan)


def replay_source_plan(config: Config, plan: Plan) -> tuple[OtherSource, ...] | int:
    """Backfill: register the connector's changelog as its replay source (its rows are
    durable there) if the connector never ran. Recover: every other ACTIVE replay source,
    whose changelog the tasks replay too (EVERY_SOURCE_REPLAYED). An int is an exit code."""
    try:
        etcd = EtcdStore.from_config(config.etcd)
        if plan.context is None:
            replay_sources.register(etcd, config.cdc.name, kind="cdc",
                                    changelog_root=changelog_root(config),
                                    schema=config.cdc.schema)
            return ()
        sources = [s for s in replay_sources.load(etcd).values()
                   if s.active and s.writer_id != config.cdc.name]
    except (EtcdError, ReplaySourceError) as exc:
        return fail(PROG, f"replay sources: {exc}", exit_codes.UNAVAILABLE
                    if isinstance(exc, EtcdError) else exit_codes.USAGE)
    try:
        others = tuple(OtherSource(s.writer_id, s.changelog_root, s.schema,
                                   schema_tables(config, s.schema)) for s in sources)
    except CatalogError as exc:
        return fail(PROG, f"catalog: {exc}", exit_codes.UNAVAILABLE)
    starts = {t.vnode: t.from_ts for t in plan.tasks}
    for other in others:
        gap = replay_gap(Changelog(other.changelog_root), starts,
                         f"{plan.summary.get('node')} stays RECOVERING (writer {other.writer_id})")
        if gap is not None:
            return gap
    if others:
        print(f"also replaying the changelogs of {', '.join(o.writer_id for o in others)}",
              flush=True)
    return others


if __name__ == "__main__":
    # Run the package's copy of main, also when spark-submit runs this file as a
    # script: tasks then pickle references to spark_jobs.cdc_replay, which
    # executors import, rather than copies of __main__'s functions.
    from spark_jobs.cdc_replay import main as package_main

    sys.exit(package_main())
