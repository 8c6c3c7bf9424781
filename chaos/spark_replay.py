"""The Spark replay job's recovery inside the campaign, with one task retried half-way.

``spark_jobs/cdc_replay.py --recover NODE`` run as Spark would run it, without a JVM: the
job's own driver steps in the campaign's process (``plan_recovery``: GetRetinaStatus
until replayTsReady, GetRecoveryReplayTs, the replay-gap check; ``complete``: the gap
check again, MarkReady), and each task (``replay_vnode``, one per virtual node the node
owns) in a process of its own (chaos/spark_task.py), as a Spark executor's Python worker
runs it. One task, the victim, is killed after it sent about half its requests (the
job's ``cdc.replay.request.after`` point, after each acknowledged request, armed
``exit(137)@K+once`` in that task's processes only), and run again from its start in a
new process with the same input and environment: Spark's task retry (``+once`` lets the
retry through, as the Spark test's retried worker). The tasks before the victim, the
victim twice, the tasks after it, then MarkReady.

The tasks replay every registered replay source, not the connector's changelog alone:
``job_spec`` lists the other ACTIVE writers (the campaign's application writer,
chaos/app_workload.py), each task merges their changelogs with the connector's in
timestamp order, and ``complete`` names them all at MarkReady (EVERY_SOURCE_REPLAYED);
``other_writers`` counts them.

What counts: the retry must exit 0 having sent at least every request the changelog held
for its virtual node when it started (acknowledged in full: ``replay_vnode`` raises on
any request it could not get acknowledged); every other task must exit 0 and MarkReady
must answer READY. Anything else is an anomaly. The comparison of every table with the
source after the episode is the real check: a row the retry or the rest lost, or one
they applied twice, shows there.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import random
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from devtools.cluster import node_state
from retina_common import exit_codes, failpoints
from retina_common.changelog import Changelog, changelog_root
from retina_common.changelog_replay import changelog_rows
from spark_jobs.cdc_replay import (
    JobSpec,
    Plan,
    VnodeResult,
    VnodeTask,
    complete,
    job_spec,
    plan_recovery,
    replay_vnode,
    task_requests,
)
from spark_jobs.common import load

from . import spark_task

POINT = failpoints.CDC_REPLAY_REQUEST_AFTER.name
# How long the driver waits for the restarted node to answer and derive its starts.
WAIT_S = 30.0
# Items per request (a replace counts two), one drawn per recovery; None: the job's
# default. Small requests give a task many of them, so "half" is a real midpoint: a
# victim with fewer than FEW_REQUESTS under the drawn size gets the smallest (2: one
# replace per request).
MAX_ROWS = (2, 8, None)
FEW_REQUESTS = 4


@dataclass
class ReplayOutcome:
    counts: Counter[str] = field(default_factory=Counter)
    notes: list[str] = field(default_factory=list)
    anomalies: list[str] = field(default_factory=list)
    detail: str = ""


@dataclass(frozen=True)
class Victim:
    task: VnodeTask
    requests: int  # what it would send, counted before its first run
    kill_at: int  # acknowledged requests before it dies (the K of exit(137)@K)


def _quietly(call: Callable[[], object]) -> tuple[object, str]:
    """The job's driver steps print for an operator; the campaign keeps their text for
    its notes instead."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        value = call()
    return value, out.getvalue().strip()


def planned(spec: JobSpec, task: VnodeTask) -> tuple[int, int]:
    """(requests, changelog rows) the task would send if it started now."""
    requests = rows = 0
    for request in task_requests(spec, task):
        requests += 1
        rows += changelog_rows(request)
    return requests, rows


def choose_victim(spec: JobSpec, tasks: list[VnodeTask], rng: random.Random) -> Victim:
    """A task with at least two requests when there is one (it dies after half of them,
    with more to send), else one with one (it dies after its only request), else any."""
    counts = {t.vnode: planned(spec, t)[0] for t in tasks}
    for least in (2, 1, 0):
        pool = [t for t in tasks if counts[t.vnode] >= least]
        if pool:
            task = rng.choice(pool)
            return Victim(task, counts[task.vnode], max(1, counts[task.vnode] // 2))
    raise ValueError("a recovery plan without tasks")


class ReplayRecovery:
    """One recovery of ``node`` by the replay job's code, its victim task retried."""

    def __init__(self, config_path: str, node: str, rng: random.Random, failpoint_dir: str,
                 between: Callable[[], None]) -> None:
        self.config, self.topology = load(config_path)
        self.node = node
        self.rng = rng
        self.failpoint_dir = failpoint_dir
        self.between = between  # a workload step between the death and the retry
        self.out = ReplayOutcome()

    def run(self) -> ReplayOutcome:
        self.out.counts["recoveries"] += 1
        changelog = Changelog(changelog_root(self.config))
        plan = self._plan(changelog)
        if plan is None:
            return self.out
        spec, text = _quietly(lambda: job_spec(self.config, plan,
                                               self.rng.choice(MAX_ROWS)))
        if not isinstance(spec, JobSpec):
            self._failed(f"job spec: exit {spec}: {text}")
            return self.out
        # The other registered replay sources (the application writer): their changelogs
        # are replayed by the same tasks, merged in timestamp order, and named at MarkReady.
        self.out.counts["other_writers"] += len(spec.others)
        victim = choose_victim(spec, plan.tasks, self.rng)
        if victim.requests < FEW_REQUESTS and spec.max_rows > 2:
            spec = dataclasses.replace(spec, max_rows=2)
            victim = choose_victim(spec, plan.tasks, self.rng)
        others = [t for t in plan.tasks if t is not victim.task]
        at = self.rng.randint(0, len(others))  # Spark runs tasks in any order
        if not (self._run_all(spec, others[:at]) and self._victim(spec, victim)
                and self._run_all(spec, others[at:])):
            return self.out  # no MarkReady: the node stays RECOVERING for the connector
        code, text = _quietly(lambda: complete(plan, spec, WAIT_S))
        if code != exit_codes.OK:
            self._failed(f"after the tasks: exit {code}: {text}")
            return self.out
        self.out.counts["marked_ready"] += 1
        others = "".join(f" + {o.writer_id}" for o in spec.others)
        self.out.detail = (f"{self.node}: {len(plan.tasks)} tasks (cdc{others}), vnode "
                           f"{victim.task.vnode} killed after {victim.kill_at}/"
                           f"{victim.requests} requests, retried, READY")
        return self.out

    def _plan(self, changelog: Changelog) -> Plan | None:
        """The job's first steps; a node that does not answer yet is asked again (the job
        exits 4 then and an operator runs it again), for up to WAIT_S."""
        deadline = time.monotonic() + WAIT_S
        while True:
            if node_state(self.node) is not None:
                plan, text = _quietly(lambda: plan_recovery(
                    self.node, self.config.cdc.replay_mode, WAIT_S, self.topology, changelog))
                if isinstance(plan, Plan):
                    return plan
                if plan != exit_codes.UNAVAILABLE or time.monotonic() >= deadline:
                    # READY already (exit 0) cannot be: nothing else drives this node.
                    self._failed(f"plan: exit {plan}: {text}")
                    return None
            elif time.monotonic() >= deadline:
                self.out.notes.append(f"spark replay: {self.node} did not answer within "
                                      f"{WAIT_S:.0f}s of its restart")
                return None
            time.sleep(0.1)  # polling interval, bounded by the deadline

    def _run(self, spec: JobSpec, task: VnodeTask, failpoints_spec: str = ""
             ) -> spark_task.TaskRun:
        self.out.counts["task_attempts"] += 1
        attempt = spark_task.run(replay_vnode, spec, task, failpoints=failpoints_spec,
                                 failpoint_dir=self.failpoint_dir)
        if attempt.exit_code == 0:
            result: VnodeResult = attempt.result
            self.out.counts["requests"] += result.requests
            self.out.counts["rows"] += result.rows
        return attempt

    def _run_all(self, spec: JobSpec, tasks: list[VnodeTask]) -> bool:
        for task in tasks:
            attempt = self._run(spec, task)
            if attempt.exit_code != 0:
                self._failed(f"task of vnode {task.vnode} exited {attempt.exit_code}: "
                             f"{attempt.stderr[-600:]}")
                return False
        return True

    def _victim(self, spec: JobSpec, victim: Victim) -> bool:
        """The victim dies after ``kill_at`` acknowledged requests, then runs again in a
        new process with the same input and failpoints, and must send everything."""
        armed = f"{POINT}=exit({exit_codes.KILLED_AT_FAILPOINT})@{victim.kill_at}+once"
        first = self._run(spec, victim.task, armed)
        if first.exit_code == 0:  # fewer requests than counted: only with none at all
            self.out.counts["victim_not_killed"] += 1
            self.out.notes.append(f"spark replay: vnode {victim.task.vnode} had no request "
                                  f"to die after ({victim.requests} counted)")
            return True
        if first.exit_code != exit_codes.KILLED_AT_FAILPOINT:
            self._failed(f"victim vnode {victim.task.vnode} exited {first.exit_code}: "
                         f"{first.stderr[-600:]}")
            return False
        self.out.counts["tasks_killed"] += 1
        self.out.counts["requests_before_kill"] += victim.kill_at
        if self.rng.random() < 0.5:
            self.between()  # the source and the connector move on before the retry
        want_requests, want_rows = planned(spec, victim.task)
        retry = self._run(spec, victim.task, armed)
        self.out.counts["tasks_retried"] += 1
        if retry.exit_code != 0:
            self._failed(f"retry of vnode {victim.task.vnode} exited {retry.exit_code}: "
                         f"{retry.stderr[-600:]}")
            return False
        got: VnodeResult = retry.result
        if got.requests < want_requests or got.rows < want_rows:
            self.out.anomalies.append(
                f"spark_replay_retry_incomplete: {self.node} vnode {victim.task.vnode}: the "
                f"retry sent {got.requests} requests / {got.rows} rows, the changelog held "
                f"{want_requests} / {want_rows} when it started")
        else:
            self.out.counts["retries_acknowledged"] += 1
        return True

    def _failed(self, text: str) -> None:
        self.out.anomalies.append(f"spark_replay_failed: {self.node}: {text[:900]}")


def logged_through(config_path: str) -> int:
    """The last timestamp of the changelog's newest batch (0: none yet)."""
    records = Changelog(changelog_root(load(config_path)[0])).records()
    return max((r.last_ts for r in records), default=0)


def wait_logged_past(config_path: str, ts: int, timeout_s: float) -> bool:
    """Whether the connector logged a batch past ``ts`` within ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while logged_through(config_path) <= ts:
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.1)  # polling interval, bounded by the deadline
    return True


def recover(config_path: str, node: str, rng: random.Random, failpoint_dir: str,
            between: Callable[[], None]) -> ReplayOutcome:
    return ReplayRecovery(config_path, node, rng, failpoint_dir, between).run()


__all__ = ["ReplayOutcome", "choose_victim", "logged_through", "planned", "recover",
           "wait_logged_past"]
