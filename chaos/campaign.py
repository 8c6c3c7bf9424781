"""``retina-chaos``: a seeded, reproducible fault campaign against a real local cluster.

Each episode: a few random source transactions (and transactions of the application
writer, chaos/app_workload.py), one fault, recovery of every process, convergence, and a
comparison of every table's gated snapshot with the source (the application writer's
table with its model). Episode
``k`` of seed ``S`` draws from ``random.Random(S * 100003 + k)``, so ``--seed S --episode
k`` replays it alone on a fresh cluster (same workload statements and fault; the history
of earlier episodes, e.g. what the cold tables hold, is not replayed).
"""

from __future__ import annotations

import argparse
import contextlib
import random
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psycopg2

from devtools.cluster import ClusterError, pid_alive
from retina_common import exit_codes
from retina_common.catalog import Catalog, TableRecord
from retina_common.etcd import EtcdStore
from retina_common.pb import retina_pb2 as rpb
from retina_common.topology import Topology, load_topology

from . import wide, workload
from .app_workload import APP_STREAM, AppWriter
from .as_of_reads import AsOfReader
from .bulk_loads import LOAD_STREAM, BulkLoads
from .campaign_cluster import CDC, CDC_NAME, TRANS, WRITER, ChaosCluster
from .compare import (
    Comparison,
    FastSnapshotReader,
    ModelTable,
    committed_lsn,
    converge,
    expected_images,
)
from .faults import (
    FAULTS,
    UNREACHABLE,
    FaultContext,
    FaultResult,
    choose_fault,
    inject,
    relevant_points,
)
from .feed_follower import FeedFollower
from .gc_driver import ROW_GROUP_ROWS, journal_states
from .key_lookups import KeyLookups, lookup_over
from .pinned_snapshots import PinBook
from .prober import Prober, ReadinessTracker
from .repeatable_reads import SnapshotBook
from .report import Anomaly, Report
from .snapshots import SPECS, SnapshotReaders
from .sweep import StorageAudit
from .wide import WIDE_STREAM, WideModel, WideWorkload

# 6: the workload changes the source schema only by nullable ADD COLUMNs, which the
# connector must follow; a stop on a schema change is a finding.
CDC_STOP_CODES = {
    exit_codes.REFUSED: "stopped by a malformed source event or a refusal",
    exit_codes.SCHEMA_CHANGE: "stopped by a source schema change it could not follow"}
READY_TIMEOUT_S = 60.0
# Exit codes that are not findings by themselves: a signal, "restart me" (1), the
# failpoint's 137, and 4 (a dependency, e.g. PostgreSQL, unreachable at start).
EXPECTED_EXITS = {exit_codes.OK, exit_codes.FAILED, exit_codes.UNAVAILABLE,
                  exit_codes.KILLED_AT_FAILPOINT, -signal.SIGKILL, -signal.SIGTERM}


# The stream of the fault kinds that joined late (faults.LATE_FAULTS), apart from the
# fault's own stream so that the other kinds' draws stay as they were.
LATE_FAULT_STREAM = 0x5BA4C
# The first episode's ADD COLUMN (run_episode), apart from the workload's own draws.
SCHEMA_STREAM = 0x5C4E3A


def episode_seed(seed: int, episode: int) -> int:
    return seed * 100003 + episode


class Campaign:
    def __init__(self, args: argparse.Namespace, log: Callable[[str], None] = print) -> None:
        self.args = args
        self.log = log
        self.report = Report(args.seed, len(self.episode_numbers()))
        from retina_common import failpoints

        self.report.catalogue = list(failpoints.catalogue())
        self.report.unreachable = dict(UNREACHABLE)
        self.tracker = ReadinessTracker()
        self.state_dir = Path(args.state_dir or tempfile.mkdtemp(prefix="retina-chaos-"))
        self.state_dir.mkdir(parents=True, exist_ok=True)
        # PostgreSQL runs as its own user when we are root: let it reach its data dir.
        self.state_dir.chmod(0o755)
        self.cluster: ChaosCluster = None  # type: ignore[assignment]  # set per generation
        self.conn: Any = None
        self.reader: FastSnapshotReader | None = None
        self.prober: Prober | None = None
        self.book: SnapshotBook | None = None  # SNAPSHOT_IS_IMMUTABLE's snapshots, per cluster
        self.etcd: EtcdStore | None = None
        self.unconverged = 0  # episodes in a row that did not converge
        self.broken = ""  # set when the cluster cannot go on: stop the campaign
        self.cdc_stopped = False
        self._exits_seen: dict[tuple[int, str, int | None], int] = {}
        # GC journal entries by rewrite id (unique across clusters): the state last seen,
        # and how many checks in a row found one swapped but not yet promoted.
        self._gc_seen: dict[str, str] = {}
        self._gc_unpromoted: dict[str, int] = {}
        self.audit: StorageAudit | None = None  # per cluster
        self.app: AppWriter | None = None  # the application writer, per cluster
        self.loads: BulkLoads | None = None  # the bulk loader and its model, per cluster
        self.follower: FeedFollower | None = None  # the change feed's, per cluster
        # The wide table's sources and model (chaos/wide.py), per cluster; its sources are
        # written once the connector has committed (_wide_ready).
        self.wide: WideWorkload | None = None
        self._wide_started = False
        self._episode = -1

    def episode_numbers(self) -> list[int]:
        if self.args.episode is not None:
            return [self.args.episode]
        return list(range(self.args.episodes))

    def gc_row_group_rows(self) -> tuple[int, ...]:
        return tuple(int(n) for n in self.args.gc_row_group_rows.split(","))

    def failpoint_prefixes(self) -> tuple[str, ...]:
        return tuple(filter(None, self.args.failpoints.split(",")))

    def replay_command(self, episode: int) -> str:
        extra = f" --nodes {self.args.nodes}" if self.args.nodes != 2 else ""
        if self.args.failpoints:  # the rotation depends on the selection
            extra += f" --failpoints {self.args.failpoints}"
        if self.args.faults:
            extra += f" --faults {self.args.faults}"
        if self.gc_row_group_rows() != ROW_GROUP_ROWS:
            extra += f" --gc-row-group-rows {self.args.gc_row_group_rows}"
        return f"retina-chaos --seed {self.args.seed} --episode {episode}{extra}"

    # --- the campaign -----------------------------------------------------------------------
    def run(self) -> Report:
        started = time.monotonic()
        try:
            for index, episode in enumerate(self.episode_numbers()):
                if self._over_budget(started):
                    self.report.stopped_early = "time budget reached"
                    break
                if index % self.args.cluster_episodes == 0:
                    # A fresh cluster every so many episodes: only the GC faults compact
                    # the tiny ingest files, now and then and one node's few streams at a
                    # time, and every comparison reads all of them.
                    self._close_cluster()
                    self._open_cluster(index // self.args.cluster_episodes)
                before = len(self.report.anomalies)
                try:
                    self.run_episode(episode)
                except ClusterError as exc:  # a process could not be brought back
                    self._anomaly(episode, "cluster_error", str(exc), CDC)
                    self.broken = f"the cluster broke in episode {episode}"
                if self.broken:
                    self.report.stopped_early = self.broken
                    break
                if self.args.stop_on_failure and len(self.report.anomalies) > before:
                    self.report.stopped_early = f"anomaly in episode {episode}"
                    break
        finally:
            self.report.duration_s = time.monotonic() - started
            self._close_cluster()
            if not self.args.keep and not self.args.state_dir:
                shutil.rmtree(self.state_dir, ignore_errors=True)
            elif self.args.keep:
                self.log(f"chaos: state and logs kept in {self.state_dir}")
        return self.report

    def _over_budget(self, started: float) -> bool:
        budget = self.args.time_budget
        return bool(budget) and time.monotonic() - started >= budget

    def _open_cluster(self, generation: int) -> None:
        t0 = time.monotonic()
        self.cluster = ChaosCluster(self.state_dir / f"cluster-{generation:03d}",
                                    nodes=self.args.nodes, log=self.log)
        self.tracker = ReadinessTracker()
        self.cluster.observer = self.tracker.observed
        self.cluster.on_node_start = self.tracker.started
        self.cluster.boot()
        assert self.cluster.state is not None
        topology = load_topology(self.cluster.state.topology_path)
        self.conn = self.cluster.source_connect()
        # etcd restarts on the same ports, so one client serves the cluster's lifetime.
        self.etcd = EtcdStore([self.cluster.state.etcd.endpoint], 5)
        self.reader = FastSnapshotReader(self.cluster.state.trans_listen, topology, 10)
        self.prober = Prober(self.cluster.state.trans_listen, topology, self.args.seed)
        self.prober.start()
        self.audit = StorageAudit(self.cluster.state.postgres.dsn())
        self.app = AppWriter(self.cluster, topology, self.etcd)
        self.app.start()
        self.loads = BulkLoads(self._table_records()[workload.LOADED_TABLE.name], topology,
                               self.cluster.state.trans_listen, list(topology.nodes))
        # Nothing has written the routed sources but their preload (inserts): the wide
        # table starts as the two joined.
        model = WideModel(lambda xid: wide.txid_status(self._source(), xid), self.report.wide)
        model.start(wide.joined_rows(self._source()))
        self.wide = WideWorkload(model, self.report.wide)
        self._wide_started = False
        self.book = self._snapshot_book(topology)
        self.follower = FeedFollower(
            self.reader, self.book.readers.trans, SPECS, self.report.feed,
            lambda kind, detail: self._anomaly(self._episode, kind, detail, CDC))
        self.follower.start()
        self.log(f"chaos: cluster {generation} READY in {time.monotonic() - t0:.1f}s "
                 f"({self.cluster.state_dir}); seed {self.args.seed}")

    def _snapshot_book(self, topology: Topology) -> SnapshotBook:
        """SNAPSHOT_IS_IMMUTABLE's snapshots, their AS OF re-reads and pins (one cluster)."""
        assert self.cluster.state is not None and self.app is not None
        cluster, app, loads = self.cluster, self.app, self.loads
        assert loads is not None and self.wide is not None
        models: list[ModelTable] = [app, loads, self.wide.model]
        readers = SnapshotReaders(self.reader, cluster.state.trans_listen, topology)
        def all_ready() -> bool:
            return cluster.alive(TRANS) and cluster.all_ready()

        as_of = AsOfReader(readers, self.report.history, [],
                           trans_started_at=lambda: cluster.procs[TRANS].started_at,
                           all_ready=all_ready)
        pins = PinBook(readers.channel, as_of, self.report.history, [])
        lookups = KeyLookups(lookup_over(readers.reader, self._table_records()),
                             self.report.lookups, [], all_ready=all_ready)
        return SnapshotBook(readers, self.report.snapshots, as_of, pins,
                            expected=lambda: expected_images(self._source, models),
                            lookups=lookups)

    def _table_records(self) -> dict[str, TableRecord]:
        """The catalog's records of the tables the campaign reads (their key columns)."""
        assert self.cluster.state is not None
        catalog = Catalog(self.cluster.state.postgres.dsn(), pool_max=1)
        try:
            return {name: catalog.get_table(workload.SCHEMA, name) for name in SPECS}
        finally:
            catalog.close()

    def _close_cluster(self) -> None:
        if self.follower is not None:
            self.follower.close()
            self.follower = None
        if self.app is not None:
            with contextlib.suppress(Exception):
                self.app.close()
            self.report.app.update(self.app.counts)
            self.app = None
        if self.wide is not None:
            self.report.wide["unresolved_at_close"] += self.wide.model.unresolved
            self.wide = None
        if self.loads is not None:
            self.loads.close()
            self.report.workload.update({f"loads_{k}": v for k, v in self.loads.counts.items()})
            self.loads = None
        if self.prober is not None:
            self.prober.stop()
            self.report.reads_served += self.prober.served
            self.report.reads_refused += self.prober.refused
            self.report.reads_failed += self.prober.failed
            self.prober = None
        if self.book is not None:
            self.book.close()
            self.book.readers.close()
            self.report.snapshots.update(self.book.readers.read_ms)
            self.book = None
        if self.reader is not None:
            self.reader.close()
            self.reader = None
        if self.conn is not None:
            with contextlib.suppress(Exception):
                self.conn.close()
            self.conn = None
        if self.audit is not None:
            self.report.sweep.update(self.audit.counts)
            self.audit = None
        if self.cluster is not None:
            with contextlib.suppress(Exception):
                self.cluster.stop()
            if not self.args.keep:
                self.cluster.remove()
            self.cluster = None

    # --- one episode -----------------------------------------------------------------------
    def run_episode(self, episode: int) -> None:
        t0 = time.monotonic()
        self._episode = episode
        derived = episode_seed(self.args.seed, episode)
        fault_rng = random.Random(derived)
        # The workload draws from its own stream, so how many steps a failpoint wait
        # needed does not shift the fault choices.
        work_rng = random.Random(derived ^ 0x5DEECE66D)
        # The application writer's transactions: a stream of their own again.
        app_rng = random.Random(derived ^ APP_STREAM)
        # The bulk loads too (chaos/bulk_loads.py).
        load_rng = random.Random(derived ^ LOAD_STREAM)
        # And the wide table's sources (chaos/wide.py).
        wide_rng = random.Random(derived ^ WIDE_STREAM)
        # The snapshots too (chaos/repeatable_reads.py): adding them moved no other draw.
        assert self.book is not None
        book = self.book
        book.begin_episode(episode, random.Random(derived ^ 0x5A4E5A))
        ctx = FaultContext(self.cluster, self.tracker, fault_rng,
                           lambda: self._write(work_rng, app_rng, load_rng, wide_rng, episode),
                           self._source,
                           gc_row_group_rows=self.gc_row_group_rows(),
                           evolve=lambda: self._add_column(work_rng, episode),
                           snapshots=book, app=self.app,
                           load=lambda: self._load(load_rng),
                           source_burst=lambda going: self._wide_burst(wide_rng, going))
        for _ in range(fault_rng.randint(1, 2)):
            ctx.write()
        if episode == self.episode_numbers()[0]:
            # Every campaign changes the source schema at least once: the workload's own
            # ADD COLUMNs are rare draws, and how many draws an episode makes depends on
            # its timing (a fixed seed once drew none in CI). From a stream of its own, so
            # no other draw moves; before the fault, which the connector follows it through.
            self._add_column(random.Random(derived ^ SCHEMA_STREAM), episode)
        book.before_fault()
        if self.follower is not None:
            self.follower.before_fault()
        kind = self._fault_kind(fault_rng, random.Random(derived ^ LATE_FAULT_STREAM), episode)
        try:
            result = inject(ctx, kind, self.args.seed, episode, self.failpoint_prefixes())
        except (ClusterError, OSError, psycopg2.Error) as exc:
            result = FaultResult(kind, notes=[f"fault injection failed: {exc}"])
        book.after_fault(f"{result.kind} {result.detail}".strip())
        self._record_fault(episode, result)
        t_fault = time.monotonic()
        self._heal(episode)
        t_heal = time.monotonic()
        if self.broken:
            self.report.episodes += 1
            return
        assert self.reader is not None and self.etcd is not None and self.app is not None
        etcd = self.etcd
        self._settle_app(episode)
        mark_lsn = self._mark(episode)
        converge_s = 0.0
        for _attempt in range(3):  # the connector may die while catching up: heal, go on
            comparison, took, caught_up = converge(
                self.reader, self._source, self.args.converge_timeout, etcd, CDC_NAME,
                mark_lsn, lambda: self.cluster.alive(CDC), models=self._models())
            converge_s += took
            if self.cluster.alive(CDC) or self.broken:
                break
            self._heal(episode)
        self._check_progress(episode, caught_up, comparison.clean)
        self._record_comparison(episode, comparison)
        self.app.release()  # a writer left down by its failpoint starts at the next step
        self._record_app(episode)
        self._check_gc_journals(episode)
        self._check_storage(episode)
        self._record_breaches(episode)
        book.after_healing(comparison.clean)
        if self.follower is not None and comparison.clean:
            self.follower.after_healing()
        self._record_snapshots(episode)
        self.report.episodes += 1
        self.report.episode_seconds.append(time.monotonic() - t0)
        self.report.converge_seconds.append(converge_s)
        status = "ok" if comparison.clean else "DIFF"
        self.log(f"episode {episode:4d} {result.kind:18s} {result.detail[:58]:58s} {status:4s} "
                 f"{time.monotonic() - t0:5.1f}s (fault {t_fault - t0:.1f} heal "
                 f"{t_heal - t_fault:.1f} converge {converge_s:.1f})")

    def _check_progress(self, episode: int, caught_up: bool, clean: bool) -> None:
        """A connector alive but not catching up is a finding; restart it so the campaign
        can go on, and stop after three episodes in a row that do not converge. Rows
        that differ although the connector caught up are their own anomaly (lost,
        phantom...), not this one: the connector is then left alone."""
        converged = caught_up and clean
        self.unconverged = 0 if converged else self.unconverged + 1
        if converged:
            return
        if not caught_up and self.cluster.alive(CDC):
            self._anomaly(episode, "cdc_not_caught_up", "the connector is alive but its "
                          "committed position did not pass the source's last commit; "
                          f"{self._replication_state()}", CDC)
            self.cluster.kill(CDC)
            self.cluster.start_cdc()
        if self.unconverged >= 3:
            self.broken = f"no convergence in three episodes in a row (last {episode})"

    def _fault_kind(self, rng: random.Random, late_rng: random.Random, episode: int) -> str:
        # Every other episode (and every one with --failpoints-only) arms the next
        # failpoint of the rotation; the rest draw a fault kind by weight.
        if self.args.failpoints_only or episode % 2 == 1:
            return "failpoint"
        only = self.args.faults.split(",") if self.args.faults else None
        return choose_fault(rng, late_rng, only)

    def _source(self) -> Any:
        if self.conn is not None and self.conn.closed:
            self.conn = None
        if self.conn is None:
            self.conn = self.cluster.source_connect()
        return self.conn

    def _mark(self, episode: int) -> int:
        for _attempt in range(3):  # the source may just be back from an outage
            try:
                return workload.mark(self._source(), episode)
            except psycopg2.Error:
                with contextlib.suppress(Exception):
                    self.conn.close()
                self.conn = None
                time.sleep(0.5)  # back-off before reconnecting
        return 0

    def _load(self, rng: random.Random) -> None:
        """One bulk load (the load.* failpoints' driver)."""
        if self.loads is not None:
            self.loads.load(rng)

    def _models(self) -> list[ModelTable]:
        """The tables compared with a model the campaign keeps instead of the source."""
        return [m for m in (self.app, self.loads, self.wide.model if self.wide else None)
                if m is not None]

    def _wide_ready(self) -> bool:
        """The wide table's sources are written once the connector has committed a
        position (its initial snapshot's consistent point is then fixed; chaos/wide.py)."""
        if not self._wide_started and self.etcd is not None:
            self._wide_started = committed_lsn(self.etcd, CDC_NAME) > 0
        return self._wide_started

    def _write(self, rng: random.Random, app_rng: random.Random, load_rng: random.Random,
               wide_rng: random.Random, episode: int) -> None:
        """The application writer's transactions, then one workload step and the wide
        table's sources' transactions; a source outage (the PostgreSQL fault) skips the
        source's part. The writer goes first: its wait for answers would otherwise shift
        what every fault does right after a step (a kill lands while the step's rows are
        on their way, a snapshot fetches them from the write buffers...)."""
        if self.app is not None:
            self.app.step(app_rng)
        if self.loads is not None:
            self.loads.maybe_load(load_rng, self.cluster.all_ready)
        try:
            self.report.transactions += workload.step(self._source(), rng, episode,
                                                      self.report.workload)
            if self.wide is not None:
                self.report.transactions += self.wide.step(self._source, wide_rng,
                                                           self._wide_ready)
        except psycopg2.Error:
            with contextlib.suppress(Exception):
                self.conn.close()
            self.conn = None
        if self.book is not None:
            self.book.during_fault_write()

    def _wide_burst(self, rng: random.Random, going: Callable[[], bool]) -> None:
        """The wide table's sources written while PostgreSQL is being stopped (the
        postgres_restart fault) until the stop cuts them off."""
        if self.wide is None:
            return
        before = self.report.wide["transactions"]
        try:
            self.wide.burst(self._source, rng, self._wide_ready, going)
        except psycopg2.Error:  # what the burst waits for: the source going away
            with contextlib.suppress(Exception):
                self.conn.close()
            self.conn = None
        finally:
            self.report.transactions += self.report.wide["transactions"] - before

    def _add_column(self, rng: random.Random, episode: int) -> str:
        """An ADD COLUMN and a write of it (the schema failpoints' driver); "" if none."""
        try:
            return workload.add_column(self._source(), rng, episode,
                                       counts=self.report.workload)
        except psycopg2.Error:
            with contextlib.suppress(Exception):
                self.conn.close()
            self.conn = None
            return ""

    # --- recovery and convergence -----------------------------------------------------------
    def _heal(self, episode: int) -> None:
        """Restart whatever is down, then wait for every node READY and the connector up."""
        assert self.cluster.state is not None
        if not pid_alive(self.cluster.state.etcd.pid):
            self.cluster.restart_etcd(0)
        if not self.cluster.postgres_up():
            self.report.notes.append(f"episode {episode}: PostgreSQL was down: started")
            self.cluster.start_postgres()
        deadline = time.monotonic() + READY_TIMEOUT_S
        failed_restarted: set[str] = set()
        self.cdc_stopped = False
        while True:
            self._restart_dead(episode)
            states = self.cluster.node_states()
            failed = [n for n, s in states.items() if s == rpb.FAILED]
            for node in failed:
                if node not in failed_restarted:
                    self._anomaly(episode, "node_failed", f"{node} is FAILED", node)
                    failed_restarted.add(node)
                    self.cluster.kill(node)
                    self.tracker.down(node)
                    self.cluster.start_node(node)
            if all(s == rpb.READY for s in states.values()) and self.cluster.alive(CDC):
                return
            if self.cdc_stopped and not self.cluster.alive(CDC):
                self.broken = f"the connector stopped twice in episode {episode}"
                return
            if time.monotonic() >= deadline:
                names = {n: rpb.LifecycleState.Name(s) if s else "down"
                         for n, s in states.items()}
                self._anomaly(episode, "not_ready", f"not READY after {READY_TIMEOUT_S:.0f}s: "
                              f"{names}", CDC)
                # Later episodes would only repeat this one's failure.
                self.broken = f"the cluster did not recover in episode {episode}"
                return
            time.sleep(0.1)  # polling interval, bounded by the deadline

    def _restart_dead(self, episode: int) -> None:
        for name in [TRANS, *self.cluster.nodes, CDC]:
            if self.cluster.alive(name):
                continue
            code = self.cluster.exit_code(name)
            first = self._exits_seen.get((episode, name, code), 0) == 0
            self._exits_seen[(episode, name, code)] = self._exits_seen.get(
                (episode, name, code), 0) + 1
            if first:  # one report per process and code per episode, however many restarts
                self.report.unexpected_exits.append(f"episode {episode}: {name} exited {code}")
            if name == CDC and code in CDC_STOP_CODES:
                if first:
                    self._anomaly(episode, "cdc_stopped",
                                  f"connector exit {code}: {CDC_STOP_CODES[code]}", CDC)
                if self.cdc_stopped:
                    continue  # stopped again after one restart: the campaign cannot go on
                self.cdc_stopped = True  # recorded; one restart to see if it resumes
            elif code not in EXPECTED_EXITS and first:
                self._anomaly(episode, "unexpected_exit", f"{name} exited {code}", name)
            if name in self.cluster.nodes:
                self.tracker.down(name)
            self.cluster.start(name)
            if name == TRANS:
                self.cluster.wait_trans()

    def _record_fault(self, episode: int, result: FaultResult) -> None:
        self.report.faults[result.kind] += 1
        if result.failpoint:
            self.report.failpoint_attempts[result.failpoint] += 1
            if result.failpoint_hit:
                self.report.failpoint_hits[result.failpoint] += 1
            else:
                self.report.failpoint_not_reached[result.failpoint] += 1
        self.report.gc.update(result.gc)
        self.report.sweep.update(result.sweep)
        self.report.replay.update(result.replay)
        self.report.snapshots.update(result.reads)
        self.report.transactions += result.gc["racing_transactions"]
        for note in result.notes:
            self.report.notes.append(f"episode {episode}: {note}")
        for text in result.anomalies:
            kind, _, detail = text.partition(": ")
            self._anomaly(episode, kind, detail, "")

    def _check_gc_journals(self, episode: int) -> None:
        """Every READY node's GC journal once the cluster is healed (and has converged, so
        the READY checkpoints are written): no entry may be INDEX_SWITCHING (no commit runs
        now: the campaign's passes are over, and recovery decides every open entry before
        READY). Counts what recovery and promotion did since the last look."""
        for node, state in self.cluster.node_states().items():
            if state != rpb.READY:
                continue
            entries = journal_states(node)
            if entries is None:
                self.report.notes.append(f"episode {episode}: GetGcStatus of {node} "
                                         "unanswered")
                continue
            for rid, entry in entries.items():
                before = self._gc_seen.get(rid)
                if entry.state == "INDEX_SWITCHING" and before != entry.state:  # once each
                    self._anomaly(episode, "gc_journal_stuck",
                                  f"{node}: rewrite {rid} (new file {entry.new_file_id}, old "
                                  f"{list(entry.old_file_ids)}) is INDEX_SWITCHING on a READY "
                                  "node after healing", node)
                if entry.state == before:
                    if entry.state == "SWAPPED_NOT_CHECKPOINTED":
                        self._gc_unpromoted[rid] = self._gc_unpromoted.get(rid, 0) + 1
                        if self._gc_unpromoted[rid] == 3:
                            self.report.notes.append(
                                f"episode {episode}: {node}: rewrite {rid} still "
                                "SWAPPED_NOT_CHECKPOINTED after three episodes READY")
                    continue
                self._gc_seen[rid] = entry.state
                if entry.state == "ABORTED":
                    how = "recovery" if entry.reason.startswith("recovery:") else "in_place"
                    self.report.gc[f"rolled_back_{how}"] += 1
                elif entry.state == "CHECKPOINTED":
                    self.report.gc["promoted"] += 1

    def _record_snapshots(self, episode: int) -> None:
        """SNAPSHOT_IS_IMMUTABLE's findings of the episode (snapshot_changed, ...)."""
        assert self.book is not None
        for text in self.book.drain():
            kind, _, detail = text.partition(": ")
            self._anomaly(episode, kind, detail, "")

    def _check_storage(self, episode: int) -> None:
        """Once healed and converged: no REGULAR file without its object, and no RETIRED
        file left long after its cleanupAt (the sweepers run every 2 s while READY)."""
        assert self.audit is not None
        ready = {n for n, s in self.cluster.node_states().items() if s == rpb.READY}
        anomalies, notes = self.audit.check(ready)
        for text in notes:
            self.report.notes.append(f"episode {episode}: {text}")
        for text in anomalies:
            kind = text.split(":", 1)[0]
            self._anomaly(episode, kind, text, CDC if kind != "retired_not_swept" else
                          next(iter(sorted(ready)), ""))

    def _settle_app(self, episode: int) -> None:
        """The application writer open and idle before the comparison (its open applies
        what an earlier process left in doubt), unless its failpoint left it down."""
        assert self.app is not None
        problem = self.app.settle()
        if problem:
            self._anomaly(episode, "app_writer_stuck", problem, WRITER)

    def _record_app(self, episode: int) -> None:
        """The application writer's anomalies (an unexpected exit) and notes."""
        assert self.app is not None
        findings, notes = self.app.drain()
        self.report.notes.extend(f"episode {episode}: {n}" for n in notes)
        for kind, detail in findings:
            self._anomaly(episode, kind, detail, WRITER)

    def _record_comparison(self, episode: int, comparison: Comparison) -> None:
        self.report.rows_compared += comparison.total("rows")
        app_table = comparison.tables.get(workload.APP_TABLE.name)
        if app_table is not None:
            self.report.app["rows_compared"] += app_table.rows
            self.report.app["undecided_keys"] += app_table.undecided
            self.report.app["undecided_applied"] += app_table.undecided_applied
        wide_table = comparison.tables.get(workload.WIDE_TABLE.name)
        if wide_table is not None:
            self.report.wide["rows_compared"] += wide_table.rows
            self.report.wide["undecided_keys"] += wide_table.undecided
        for attr in ("lost", "duplicated", "phantom", "mismatched"):
            count = comparison.total(attr)
            setattr(self.report, attr, getattr(self.report, attr) + count)
            if count:
                examples = [e for d in comparison.tables.values() for e in d.examples][:5]
                per_table = {t: getattr(d, attr) for t, d in comparison.tables.items()
                             if getattr(d, attr)}
                self._anomaly(episode, f"{attr}_rows", f"{per_table} e.g. {examples}", CDC)
        if comparison.error:
            self._anomaly(episode, "snapshot_unreadable", comparison.error, CDC)

    def _record_breaches(self, episode: int) -> None:
        assert self.prober is not None
        breaches = self.tracker.breaches(self.prober.take_served())
        if breaches:
            self.report.reads_outside_ready += len(breaches)
            node, start, end = breaches[0]
            self._anomaly(episode, "read_outside_ready",
                          f"{len(breaches)} reads served while {node} was not READY "
                          f"(first took {end - start:.2f}s)", node)

    def _replication_state(self) -> str:
        """The source's replication slot and walsender as PostgreSQL sees them now (what a
        connector that receives nothing is waiting for)."""
        try:
            conn = self.cluster.source_connect()
            try:
                with conn.cursor() as cur:
                    cur.execute("SELECT slot_name, active, confirmed_flush_lsn, restart_lsn, "
                                "pg_current_wal_lsn() FROM pg_replication_slots")
                    slots = cur.fetchall()
                    cur.execute("SELECT pid, backend_type, state, wait_event_type, wait_event, "
                                "left(query, 80) FROM pg_stat_activity WHERE backend_type = "
                                "'walsender' OR wait_event_type = 'Lock'")
                    activity = cur.fetchall()
            finally:
                conn.close()
        except Exception as exc:  # diagnostics only: never fail the campaign on them
            return f"replication state unavailable: {exc}"
        return f"slots {slots}; walsenders and lock waits {activity}"

    def _anomaly(self, episode: int, kind: str, detail: str, log_of: str) -> None:
        tail = self.cluster.log_tail(log_of) if log_of else ""
        self.report.anomalies.append(Anomaly(episode, kind, detail,
                                             self.replay_command(episode), tail))
        self.log(f"episode {episode}: ANOMALY {kind}: {detail}\n"
                 f"  replay: {self.replay_command(episode)}")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="retina-chaos", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--episodes", type=int, default=20)
    parser.add_argument("--episode", type=int, default=None,
                        help="replay this one episode alone on a fresh cluster")
    parser.add_argument("--nodes", type=int, default=2, help="Retina nodes (at least 2)")
    parser.add_argument("--state-dir", help="default: a fresh temporary directory")
    parser.add_argument("--keep", action="store_true", help="keep the state dir and logs")
    parser.add_argument("--json", type=Path, help="write the report as JSON here")
    parser.add_argument("--stop-on-failure", action="store_true")
    parser.add_argument("--time-budget", type=float, default=0,
                        help="start no new episode after this many seconds")
    parser.add_argument("--converge-timeout", type=float, default=60)
    parser.add_argument("--cluster-episodes", type=int, default=50,
                        help="episodes per cluster before a fresh one (only the GC faults "
                             "compact files, and every comparison reads them all)")
    parser.add_argument("--failpoints-only", action="store_true",
                        help="every episode arms the next failpoint of the rotation")
    parser.add_argument("--gc-row-group-rows", default=",".join(map(str, ROW_GROUP_ROWS)),
                        help="rows per row group of the GC passes' new files, one drawn "
                             "per pass (default %(default)s; 8 gives a new file more row "
                             "groups than its old files had blocks)")
    parser.add_argument("--failpoints", default="",
                        help="comma-separated name prefixes: failpoint episodes rotate "
                             "through these points only (e.g. gc.,catalog.swap.)")
    parser.add_argument("--faults", default="",
                        help=f"comma-separated fault kinds to draw from: {', '.join(FAULTS)}")
    args = parser.parse_args(argv)
    if args.nodes < 2:
        parser.error("--nodes: at least 2")
    unknown = set(filter(None, args.faults.split(","))) - set(FAULTS)
    if unknown:
        parser.error(f"--faults: unknown kinds {sorted(unknown)}")
    try:
        if not all(int(n) > 0 for n in args.gc_row_group_rows.split(",")):
            raise ValueError
    except ValueError:
        parser.error("--gc-row-group-rows: comma-separated positive numbers")
    if args.failpoints and not relevant_points(tuple(filter(None, args.failpoints.split(",")))):
        parser.error(f"--failpoints: no failpoint starts with {args.failpoints}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # SIGTERM must run the clean-up (the cluster's processes live in their own sessions).
    signal.signal(signal.SIGTERM, lambda _s, _f: sys.exit(exit_codes.TERMINATED))
    campaign = Campaign(args, log=lambda m: print(m, flush=True))
    try:
        report = campaign.run()
    except ClusterError as exc:
        print(f"retina-chaos: the cluster did not start: {exc}", file=sys.stderr)
        return exit_codes.USAGE
    except SystemExit:  # SIGTERM: the cluster is already down; report what ran
        campaign.report.stopped_early = "terminated by a signal"
        print(campaign.report.text(), flush=True)
        if args.json:
            campaign.report.write_json(args.json)
        raise
    print(report.text(), flush=True)
    if args.json:
        report.write_json(args.json)
    return exit_codes.FAILED if report.anomalies else exit_codes.OK


if __name__ == "__main__":
    sys.exit(main())
