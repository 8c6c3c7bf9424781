"""Storage GC inside the campaign: an in-process, Spark-free GC pass against one node.

A pass does what ``spark_jobs/storage_gc.py`` does for one node, with the job's own pure
per-group functions (``rewrite_group``: QueryVisibility at the cutoff, the surviving rows,
``encode_parquet``, ``register_temporary_gc``, ``write_durably``), so the campaign drives
the real protocol without starting Spark:

1. a gated read-only transaction (the gate refuses while a node is not READY: the pass
   ends, a note), GetSafeGcTimestamp inside it, ListQueryFiles per campaign table;
2. the node's REGULAR files per stream (owner node and vnode from the file name), a few
   streams at random, each in the node's order (firstBlockId, from QueryVisibility at
   safeGcTs, as the job's planner orders them; a stream with a file that has no place is
   left alone, as the job does), cut into random CONSECUTIVE runs (a single file, a few,
   or the whole stream);
3. per group: PrepareGcRewrite on the owning node, the rewrite, CommitGcRewrite, with
   source changes of rows of the group's files racing it (between prepare and rewrite or
   between rewrite and commit, so deletes of rows being rewritten arrive while the node
   pins the cutoff or while it commits);
4. every COMMITTED answer is checked against the node's journal (GetGcStatus) and the
   catalog (new file REGULAR, old files RETIRED).

What the node may refuse (ABORTED: a file in another open rewrite, a cutoff below a fold
or a base; FAILED_PRECONDITION: not consecutive in the node's order, not its files;
UNAVAILABLE: not READY or going away) is counted and noted. INTERNAL, an unexpected code,
a rewrite that disagrees with the node's expected rows, or a commit answer that disagrees
with the journal or the catalog is an anomaly.
"""

from __future__ import annotations

import contextlib
import random
import time
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import grpc
import psycopg2
import pyarrow as pa

from retina_common import file_names
from retina_common.catalog import Catalog, CatalogError, FileType
from retina_common.client import channel
from retina_common.pb import retina_pb2 as rpb
from retina_common.pb import retina_pb2_grpc, trans_pb2_grpc
from retina_common.pb import trans_pb2 as tpb
from retina_common.retry import RETRYABLE_CODES, Backoff
from retina_common.storage import open_parquet
from spark_jobs.common import UNAVAILABLE_MARK, FileRef
from spark_jobs.storage_gc_task import (
    RewriteResult,
    RewriteTask,
    TaskSpec,
    rewrite_group,
)

from . import spark_task
from .workload import BY_NAME, SCHEMA, TABLES, Key, change_key

RPC_TIMEOUT_S = 30.0
# Rows per row group of the new files, one drawn per pass. 8 gives a new file more row
# groups than its old files had blocks (a block holds up to block_rows = 32 rows); 40 and
# 65,536 never do (the job's default is 65,536).
ROW_GROUP_ROWS = (8, 40, 65_536)
# The read transaction outlives the pass by a margin: a killed campaign must not pin
# safeGcTs for long.
LEASE_MS = 60_000
# A commit answered a retryable code (UNAVAILABLE: "is committing") is asked again
# (a repeated commit answers the same) until this deadline.
COMMIT_RETRY_S = 30.0
OPEN_STATES = ("INDEX_SWITCHING", "SWAPPED_NOT_CHECKPOINTED")
COMMITTED_STATES = ("SWAPPED_NOT_CHECKPOINTED", "CHECKPOINTED")
# Codes a node answers for a reason of its own (counted, noted); any other is an anomaly.
REFUSALS = (grpc.StatusCode.ABORTED, grpc.StatusCode.FAILED_PRECONDITION,
            grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED,
            grpc.StatusCode.CANCELLED)


@dataclass(frozen=True)
class ListedFile:
    file_id: int
    name: str
    path_uri: str
    vnode: int
    position: int = -1  # the node's firstBlockId (QueryVisibility); -1 until asked


@dataclass(frozen=True)
class GcGroup:
    table: str
    vnode: int
    files: tuple[ListedFile, ...]

    @property
    def file_ids(self) -> list[int]:
        return [f.file_id for f in self.files]


def node_streams(files: Sequence[tpb.QueryFile], node: str) -> dict[int, list[ListedFile]]:
    """The listed files ``node`` created (owner node and vnode from the file name), per
    vnode, in listing order: their order in the stream comes from the node."""
    out: dict[int, list[ListedFile]] = {}
    for f in files:
        try:
            parsed = file_names.parse(f.name)
        except ValueError:
            continue
        if parsed.node_id == node:
            out.setdefault(parsed.vnode, []).append(
                ListedFile(f.file_id, f.name, f.path_uri, parsed.vnode))
    return out


def in_stream_order(files: Sequence[ListedFile], positions: dict[int, int],
                    ) -> list[ListedFile] | None:
    """A stream's files in the node's order (firstBlockId, as the job orders them: a GC
    output takes the place of the files it replaced, which its name's sequence number
    does not show), or None if one has no place (refused, or replaced since the listing:
    like the job, the pass then leaves the stream alone, since no run around it is sure
    to be consecutive)."""
    placed = []
    for f in files:
        position = positions.get(f.file_id, -1)
        if position < 0:
            return None
        placed.append(ListedFile(f.file_id, f.name, f.path_uri, f.vnode, position))
    return sorted(placed, key=lambda f: f.position)


def cut_runs(files: Sequence[ListedFile], rng: random.Random) -> list[tuple[ListedFile, ...]]:
    """A stream's files (in stream order) cut into consecutive runs: sometimes the whole
    stream (a full compaction), else runs of one to four files."""
    if not files:
        return []
    if rng.random() < 0.3:
        return [tuple(files)]
    runs, i = [], 0
    while i < len(files):
        n = rng.randint(1, 4)
        runs.append(tuple(files[i:i + n]))
        i += n
    return runs


def focused(runs: list[tuple[ListedFile, ...]], focus: frozenset[int],
            ) -> list[tuple[ListedFile, ...]]:
    """The runs holding a ``focus`` file (all runs if none does, or without a focus)."""
    return [r for r in runs if focus & {f.file_id for f in r}] or runs


def pick_streams(listings: dict[str, Sequence[tpb.QueryFile]], node: str,
                 rng: random.Random, max_groups: int, focus: frozenset[int] = frozenset(),
                 ) -> list[tuple[str, int, list[ListedFile]]]:
    """Up to ``max_groups`` of ``node``'s streams, at random: one group each, so no two
    groups of a pass share a file. With ``focus``, only streams holding one of those
    files."""
    streams = [(table, vnode, files) for table in sorted(listings)
               for vnode, files in sorted(node_streams(listings[table], node).items())
               if not focus or focus & {f.file_id for f in files}]
    rng.shuffle(streams)
    return streams[:max_groups]


@dataclass
class PassResult:
    node: str
    counts: Counter[str] = field(default_factory=Counter)
    notes: list[str] = field(default_factory=list)
    anomalies: list[str] = field(default_factory=list)
    stopped: str = ""  # why the pass ended early: gate closed, node gone, ...
    first_refusal: dict[str, str] = field(default_factory=dict)  # code -> first reason
    task_exits: list[int] = field(default_factory=list)  # child rewrite tasks, if any

    def refused(self, what: str, exc: grpc.RpcError) -> None:
        code = exc.code().name
        self.counts[f"refused_{code}"] += 1
        self.first_refusal.setdefault(code, f"{what}: {(exc.details() or '')[:160]}")

    def summary(self) -> str:
        c = self.counts
        refused = ", ".join(f"{k[len('refused_'):]} x{v}" for k, v in sorted(c.items())
                            if k.startswith("refused_"))
        text = (f"gc pass on {self.node}: {c['groups']} group(s), {c['committed']} committed"
                f"{', refused ' + refused if refused else ''}")
        if self.first_refusal:
            text += " (" + "; ".join(f"{k}: {v}" for k, v in self.first_refusal.items()) + ")"
        if self.stopped:
            text += f"; stopped: {self.stopped}"
        return text


class GcDriver:
    """GC passes against the campaign's cluster (one per fault or failpoint wait)."""

    def __init__(self, trans_listen: str, catalog_dsn: str, rng: random.Random,
                 source: Callable[[], Any] | None = None, task_failpoints: str = "",
                 row_group_rows: Sequence[int] = ROW_GROUP_ROWS, failpoint_dir: str = "",
                 dead_task_retry: float = 0.5, focus: frozenset[int] = frozenset()) -> None:
        self.trans_listen = trans_listen
        self.catalog_dsn = catalog_dsn
        self.rng = rng
        self.source = source  # the source database, for the racing changes
        # Set: every rewrite task runs in a process of its own with these failpoints
        # (chaos/spark_task.py), so a point of the task kills that process, not the
        # campaign; failpoint_dir is their RETINA_FAILPOINT_DIR (+once needs it).
        self.task_failpoints = task_failpoints
        self.failpoint_dir = failpoint_dir
        # The share of dead tasks run again (Spark's retry); the rest are aborted or
        # forgotten, half each.
        self.dead_task_retry = dead_task_retry
        self.task_exits: list[int] = []  # exit codes of the task processes
        self.row_group_rows = tuple(row_group_rows)
        # Files to rewrite if the node lets us (a split read's fetched buffer files): the
        # pass picks only their streams and runs holding them.
        self.focus = focus

    def run_pass(self, node: str, alive: Callable[[], bool], max_groups: int = 3,
                 race: float = 0.5) -> PassResult:
        """One pass on ``node``. ``alive`` says whether its process still runs (a failpoint
        may end it mid-commit: the pass then stops, the outcome left to recovery)."""
        result = PassResult(node)
        result.counts["passes"] += 1
        with channel(self.trans_listen) as trans_ch, channel(node) as node_ch:
            trans = trans_pb2_grpc.TransServiceStub(trans_ch)
            stub = retina_pb2_grpc.RetinaWorkerServiceStub(node_ch)
            try:
                begun = trans.BeginTrans(tpb.BeginTransRequest(read_only=True,
                                                               lease_ms=LEASE_MS),
                                         timeout=RPC_TIMEOUT_S)
            except grpc.RpcError as exc:
                result.stopped = f"BeginTrans: {exc.code().name} (gate closed?)"
                return result
            catalog = Catalog(self.catalog_dsn, pool_max=1)
            try:
                self._pass_in(trans, stub, catalog, begun.trans_id, node, alive, max_groups,
                              race, result)
            except grpc.RpcError as exc:  # listing or safeGcTs: the pass cannot go on
                result.stopped = f"{exc.code().name}: {(exc.details() or '')[:160]}"
            except CatalogError as exc:
                result.stopped = f"catalog: {exc}"
            finally:
                catalog.close()
                with contextlib.suppress(grpc.RpcError):  # an expired lease ended it
                    trans.CommitTrans(tpb.CommitTransRequest(trans_id=begun.trans_id),
                                      timeout=RPC_TIMEOUT_S)
        return result

    def _pass_in(self, trans: trans_pb2_grpc.TransServiceStub,
                 stub: retina_pb2_grpc.RetinaWorkerServiceStub, catalog: Catalog,
                 trans_id: int, node: str, alive: Callable[[], bool], max_groups: int,
                 race: float, result: PassResult) -> None:
        safe = trans.GetSafeGcTimestamp(tpb.GetSafeGcTimestampRequest(),
                                        timeout=RPC_TIMEOUT_S).safe_gc_ts
        if safe <= 0:
            # Nothing is old enough yet (a fresh cluster, an open read at the start):
            # a node refuses a cutoff of 0 (INVALID_ARGUMENT), and the Spark job plans
            # no group then, since nothing is deleted at 0.
            result.counts["passes_before_safe_gc_ts"] += 1
            return
        listings = {t.name: list(trans.ListQueryFiles(tpb.ListQueryFilesRequest(
            trans_id=trans_id, schema_name=SCHEMA, table_name=t.name),
            timeout=RPC_TIMEOUT_S).files) for t in TABLES}
        row_group_rows = self.rng.choice(self.row_group_rows)  # several row groups, or one
        spec = TaskSpec(self.catalog_dsn, 5, trans_id, row_group_rows)
        for table, vnode, files in pick_streams(listings, node, self.rng, max_groups,
                                                self.focus):
            ordered = in_stream_order(files, self._positions(stub, files, safe, trans_id))
            if ordered is None:
                result.counts["streams_skipped"] += 1
                continue
            group = GcGroup(table, vnode, self.rng.choice(focused(cut_runs(ordered, self.rng),
                                                                  self.focus)))
            if not alive():
                result.stopped = f"{node} exited"
                return
            result.counts["groups"] += 1
            if not self._group(stub, catalog, spec, safe, trans_id, node, group, alive,
                               race, result):
                return

    def _positions(self, stub: retina_pb2_grpc.RetinaWorkerServiceStub,
                   files: Sequence[ListedFile], safe: int, trans_id: int) -> dict[int, int]:
        """Each file's place in its stream, from QueryVisibility at safeGcTs (as the job's
        planner asks it); a refused file has none."""
        def ask(f: ListedFile) -> tuple[int, int]:
            try:
                reply = stub.QueryVisibility(rpb.QueryVisibilityRequest(
                    file_id=f.file_id, timestamp=safe, trans_id=trans_id),
                    timeout=RPC_TIMEOUT_S)
            except grpc.RpcError:
                return f.file_id, -1
            return f.file_id, reply.first_block_id

        with ThreadPoolExecutor(8) as pool:  # tiny files: the round trips dominate
            return dict(pool.map(ask, files))

    def _group(self, stub: retina_pb2_grpc.RetinaWorkerServiceStub, catalog: Catalog,
               spec: TaskSpec, safe: int, trans_id: int, node: str, group: GcGroup,
               alive: Callable[[], bool], race: float, result: PassResult) -> bool:
        """Prepare, rewrite and commit one group; False when the pass must stop."""
        what = f"{group.table} vnode {group.vnode} files {group.file_ids}"
        try:
            prepared = stub.PrepareGcRewrite(rpb.PrepareGcRewriteRequest(
                schema_name=SCHEMA, table_name=group.table, virtual_node_id=group.vnode,
                old_file_ids=group.file_ids, safe_gc_ts=safe, trans_id=trans_id),
                timeout=RPC_TIMEOUT_S)
        except grpc.RpcError as exc:
            return self._refusal(f"prepare {what}", exc, node, alive, result)
        race_at = self.rng.choice(["rewrite", "commit"]) if self.rng.random() < race else ""
        if race_at == "rewrite":
            self._race(group, result)
        task = RewriteTask(0, prepared.rewrite_id, node, f"{SCHEMA}.{group.table}",
                           group.vnode, tuple(FileRef(f.file_id, f.name, f.path_uri)
                                              for f in group.files),
                           0, prepared.file_name, prepared.path_id, prepared.path_uri,
                           prepared.cutoff_ts, prepared.expected_rows,
                           prepared.schema_version)
        rewritten = self._rewrite(spec, task)
        retried = rewritten is None
        if rewritten is None:  # the task process died (a gc.rewrite.* failpoint)
            result.counts["task_died"] += 1
            rewritten = self._after_dead_task(stub, catalog, spec, task, result)
            if rewritten is None:
                return True
        if rewritten.error:
            self._abort(stub, prepared.rewrite_id)
            if UNAVAILABLE_MARK in rewritten.error or not alive():
                result.counts["task_unavailable"] += 1
                result.stopped = f"rewrite of {what}: {rewritten.error[:160]}"
                return False
            # The job's functions read exactly the visibility the node pinned: a
            # disagreement (rows, row groups) is a defect on one side or the other.
            result.anomalies.append(f"gc_rewrite_failed: {node} {what} cutoff "
                                    f"{prepared.cutoff_ts}: {rewritten.error[:300]}")
            return True
        if race_at == "commit":
            self._race(group, result)
        reply = self._commit(stub, prepared.rewrite_id, rewritten.new_file_id, alive)
        if isinstance(reply, grpc.RpcError):
            if retried:
                result.counts[f"retry_refused_{reply.code().name}"] += 1
            if reply.code() in (grpc.StatusCode.ABORTED, grpc.StatusCode.FAILED_PRECONDITION):
                self._check_refused(stub, prepared.rewrite_id, what, result)
            return self._refusal(f"commit {what}", reply, node, alive, result)
        if reply is None:
            result.counts["commit_unknown"] += 1
            result.stopped = f"{node} exited during the commit of {what}"
            return False
        result.counts["committed"] += 1
        if retried:
            result.counts["retry_committed"] += 1
        result.counts["files_replaced"] += len(group.files)
        result.counts["rows_kept"] += reply.rows_kept
        result.counts["rows_dropped"] += reply.rows_dropped
        result.counts["chain_items"] += reply.chain_items
        self._check_committed(stub, catalog, group, prepared.rewrite_id,
                              rewritten.new_file_id, reply, alive, result)
        return True

    def _rewrite(self, spec: TaskSpec, task: RewriteTask) -> RewriteResult | None:
        """The job's task for one group, in-process or (with task failpoints) in a child
        process; None if that process died."""
        if not self.task_failpoints:
            return rewrite_group(spec, task)
        attempt = spark_task.run(rewrite_group, spec, task, failpoints=self.task_failpoints,
                                 failpoint_dir=self.failpoint_dir)
        self.task_exits.append(attempt.exit_code)
        return attempt.result if attempt.exit_code == 0 else None

    def _after_dead_task(self, stub: retina_pb2_grpc.RetinaWorkerServiceStub,
                         catalog: Catalog, spec: TaskSpec, task: RewriteTask,
                         result: PassResult) -> RewriteResult | None:
        """What follows a task that died after registering its new file (its bytes written
        or not), drawn once: Spark's retry (the same prepared group's task again, in a new
        process, with the same failpoints: a +once point lets it through), or the driver
        aborts the group (a job without retries, as the job does for a failed task), or
        forgets it (a dead driver: the prepared rewrite lapses with the read transaction).
        The retried task's result, to commit; None when the group ends here."""
        draw = self.rng.random()
        if draw < 1 - self.dead_task_retry:
            if draw < (1 - self.dead_task_retry) / 2:
                self._abort(stub, task.rewrite_id)
            return None
        registered = self._registered(catalog, task)
        result.counts["task_retried"] += 1
        again = self._rewrite(spec, task)
        if again is None:
            result.counts["task_died"] += 1
            result.notes.append(f"gc: the retried rewrite task of {task.rewrite_id} died "
                                f"again (exits {self.task_exits[-2:]})")
            self._abort(stub, task.rewrite_id)
            return None
        if not again.error and registered and again.new_file_id != registered:
            # The retry must reuse the dead attempt's TEMPORARY_GC row, not add another.
            result.anomalies.append(f"gc_retry_disagrees: {task.file_name}: the dead task "
                                    f"registered file {registered}, its retry returned "
                                    f"{again.new_file_id}")
        return again

    def _registered(self, catalog: Catalog, task: RewriteTask) -> int:
        """The file id of the new file's catalog row, 0 if it has none (or unreadable)."""
        try:
            rows = catalog.get_files_by_type(task.path_id, [FileType.TEMPORARY_GC])
        except CatalogError:
            return 0
        return next((f.file_id for f in rows if f.name == task.file_name), 0)

    def _commit(self, stub: retina_pb2_grpc.RetinaWorkerServiceStub, rewrite_id: str,
                new_file_id: int, alive: Callable[[], bool],
                ) -> rpb.CommitGcRewriteResponse | grpc.RpcError | None:
        """The commit's answer, a refusal, or None if the node died (outcome unknown:
        recovery decides from the journal)."""
        deadline = time.monotonic() + COMMIT_RETRY_S
        backoff = Backoff(0.1, 2.0)
        while True:
            try:
                return stub.CommitGcRewrite(rpb.CommitGcRewriteRequest(
                    rewrite_id=rewrite_id, new_file_id=new_file_id), timeout=RPC_TIMEOUT_S)
            except grpc.RpcError as exc:
                retry = exc.code() in RETRYABLE_CODES
                if retry and not alive():
                    return None
                if not retry or time.monotonic() >= deadline:
                    return exc
            backoff.pause()  # bounded by the deadline

    def _refusal(self, what: str, exc: grpc.RpcError, node: str, alive: Callable[[], bool],
                 result: PassResult) -> bool:
        if exc.code() in REFUSALS:
            result.refused(what, exc)
            if exc.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED) and \
                    not alive():
                result.stopped = f"{node} exited"
                return False
            return True
        result.anomalies.append(f"gc_unexpected_answer: {node} {what}: {exc.code().name}: "
                                f"{(exc.details() or '')[:300]}")
        return alive()

    def _abort(self, stub: retina_pb2_grpc.RetinaWorkerServiceStub, rewrite_id: str) -> None:
        with contextlib.suppress(grpc.RpcError):  # best effort: it expires anyway
            stub.AbortGcRewrite(rpb.AbortGcRewriteRequest(rewrite_id=rewrite_id),
                                timeout=RPC_TIMEOUT_S)

    def _journal(self, stub: retina_pb2_grpc.RetinaWorkerServiceStub,
                 ) -> dict[str, rpb.GcJournalEntry] | None:
        try:
            reply = stub.GetGcStatus(rpb.GetGcStatusRequest(), timeout=RPC_TIMEOUT_S)
        except grpc.RpcError:
            return None
        return {e.rewrite_id: e for e in reply.entries}

    def _check_refused(self, stub: retina_pb2_grpc.RetinaWorkerServiceStub, rewrite_id: str,
                       what: str, result: PassResult) -> None:
        """A refused commit changed nothing, or was rolled back in place: its journal entry,
        if it has one, must be ABORTED, never left open on a node that answered."""
        journal = self._journal(stub)
        entry = (journal or {}).get(rewrite_id)
        if entry is not None and entry.state != "ABORTED":
            result.anomalies.append(f"gc_journal_disagrees: commit of {what} was refused but "
                                    f"rewrite {rewrite_id} is {entry.state} in the journal")
        self._abort(stub, rewrite_id)

    def _check_committed(self, stub: retina_pb2_grpc.RetinaWorkerServiceStub,
                         catalog: Catalog, group: GcGroup, rewrite_id: str, new_file_id: int,
                         reply: rpb.CommitGcRewriteResponse, alive: Callable[[], bool],
                         result: PassResult) -> None:
        """COMMITTED must agree with the journal and with the catalog."""
        old = set(group.file_ids)
        problems = []
        if reply.outcome != "COMMITTED" or reply.new_file_id != new_file_id or \
                set(reply.retired_file_ids) != old or \
                reply.journal_state not in COMMITTED_STATES:
            problems.append(f"answer {reply.outcome} new {reply.new_file_id} retired "
                            f"{list(reply.retired_file_ids)} journal {reply.journal_state}")
        journal = self._journal(stub)
        if journal is None:
            # Only a process that died right after answering (a promotion failpoint) may
            # not answer; anything else is the node refusing its own status.
            if alive():
                problems.append("GetGcStatus unanswered by a live node")
        else:
            entry = journal.get(rewrite_id)
            if entry is None:
                problems.append("no journal entry")
            elif entry.state not in COMMITTED_STATES or entry.new_file_id != new_file_id or \
                    set(entry.old_file_ids) != old or entry.rows_kept != reply.rows_kept:
                problems.append(f"journal {entry.state} new {entry.new_file_id} old "
                                f"{list(entry.old_file_ids)} rows {entry.rows_kept}")
        try:
            new = catalog.get_file(new_file_id)
            olds = [catalog.get_file(f) for f in group.file_ids]
        except CatalogError as exc:
            result.notes.append(f"gc: catalog unreadable after a commit: {exc}")
        else:
            if new is None or new.type != FileType.REGULAR or \
                    any(o is None or o.type != FileType.RETIRED for o in olds):
                problems.append(f"catalog new {new.type.name if new else 'missing'} old "
                                f"{[o.type.name if o else 'missing' for o in olds]}")
        if problems:
            result.anomalies.append(f"gc_commit_disagrees: {result.node} {group.table} vnode "
                                    f"{group.vnode} rewrite {rewrite_id} files "
                                    f"{group.file_ids} -> {new_file_id}: "
                                    + "; ".join(problems))

    # --- source changes racing the rewrite ---------------------------------------------------
    def _race(self, group: GcGroup, result: PassResult) -> None:
        """Delete or change, at the source, a few rows of the group's files: the connector
        then sends deletes of rows the node is rewriting (chain items to carry over, or
        deletes landing on the new file once it is swapped in)."""
        if self.source is None:
            return
        keys = self._keys_of(group)
        if not keys:
            return
        table = BY_NAME[group.table]
        chosen = self.rng.sample(keys, k=min(len(keys), self.rng.randint(1, 6)))
        try:
            conn = self.source()
            with conn, conn.cursor() as cur:
                for key in chosen:
                    change_key(cur, table, key, self.rng)
        except psycopg2.Error as exc:
            result.notes.append(f"gc: racing source change failed: {exc}".strip()[:200])
            return
        result.counts["racing_changes"] += len(chosen)
        result.counts["racing_transactions"] += 1

    def _keys_of(self, group: GcGroup) -> list[Key]:
        pk = list(BY_NAME[group.table].pk)
        keys: list[Key] = []
        for f in group.files:
            try:
                rows = open_parquet(f.path_uri, f.name).read(columns=pk)
            except (OSError, pa.ArrowException):
                continue  # the sweepers do not exist yet; a read error only skips a race
            columns = [rows.column(c).to_pylist() for c in pk]
            keys.extend(zip(*columns, strict=True))
        return keys


def maintenance(node: str) -> str:
    """RunGcMaintenance (fold + prune) on ``node``; a short description of what it did."""
    with channel(node) as ch:
        stub = retina_pb2_grpc.RetinaWorkerServiceStub(ch)
        try:
            r = stub.RunGcMaintenance(rpb.RunGcMaintenanceRequest(), timeout=RPC_TIMEOUT_S)
        except grpc.RpcError as exc:
            return f"maintenance {exc.code().name}"
    return f"folded {r.folded_items} pruned {r.pruned_versions}"


def journal_states(node: str) -> dict[str, rpb.GcJournalEntry] | None:
    """Every journal entry of ``node`` (None if it does not answer)."""
    with channel(node) as ch:
        try:
            reply = retina_pb2_grpc.RetinaWorkerServiceStub(ch).GetGcStatus(
                rpb.GetGcStatusRequest(), timeout=10)
        except grpc.RpcError:
            return None
    return {e.rewrite_id: e for e in reply.entries}


__all__ = ["ROW_GROUP_ROWS", "GcDriver", "GcGroup", "PassResult", "cut_runs",
           "in_stream_order", "journal_states", "maintenance", "node_streams", "pick_streams"]
