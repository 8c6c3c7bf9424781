"""The CDC connector loop: source → timestamps → changelog → Retina → commit → ack.

One batch of source transactions at a time (specification section 6):

1. take committed source transactions from the intake thread, which polls
   the source and translates and validates every change ahead of time
   (``intake.py``); close the batch at a size or a delay; skip any at or
   before the committed position (a source re-delivers after a crash);
2. a malformed transaction stops the connector once the batch before it is
   committed: nothing is allocated or sent for it;
3. ``BeginTransBatch``: one write transaction, one timestamp, per source
   transaction;
4. append the batch to the durable changelog;
5. send each Retina node its rows (one ``UpdateRecord`` per node), retrying
   UNAVAILABLE with backoff; a node found RECOVERING is driven through
   recovery from the changelog, which already holds this batch;
6. ``CommitTransBatch`` only after every node acknowledged;
7. store the committed position (etcd, CAS-fenced), then acknowledge the
   source.

A refusal other than UNAVAILABLE rolls the batch back and stops the
connector with the status in the error. A recovering node that needs
changelog retention already dropped stops the connector before anything is
replayed (:class:`ReplayGap`): the node stays RECOVERING rather than become
READY with rows missing. A crash anywhere is recovered by
starting again: uncommitted transactions are rolled back by their lease,
the source re-delivers everything after the committed position, and the
CDC replace encoding makes re-applying them converge. Retina stays READY.
Crash windows: ``docs/write-paths/cdc-changelog.md``.
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass
from typing import TypeVar

import grpc
import structlog

from cdc_client import cdc_metrics as m
from cdc_client.intake import Intake, Item
from cdc_client.positions import CommittedPosition, PositionStore
from cdc_client.snapshot_load import SnapshotLoader, loadable
from cdc_client.source import Source, SourceTransaction
from cdc_client.translate import TableMap
from retina_common.catalog import TableRecord
from retina_common.changelog import (
    PARTIAL,
    Changelog,
    ChangelogGap,
    ChangeRow,
    LoggedTransaction,
    transaction_positions,
)
from retina_common.changelog_replay import (
    PartialUpdatesRefused,
    ReplayLog,
    by_node,
    changelog_rows,
    check_retained,
    merged_replay_requests,
    node_starts,
    requests,
)
from retina_common.columnar import ROW_FORM_ONLY, min_columnar_rows
from retina_common.etcd import EtcdError, EtcdUnavailable
from retina_common.failpoints import (
    CDC_BATCH_BEGIN_AFTER,
    CDC_COMMIT_AFTER,
    CDC_POSITION_STORE_AFTER,
    CDC_REPLAY_MARK_READY_BEFORE,
    CDC_REPLAY_REQUEST_AFTER,
    CDC_SEND_ALL_ACKS_AFTER,
    CDC_SEND_NODE_ACK_AFTER,
)
from retina_common.pb import retina_pb2 as pb
from retina_common.pb import retina_pb2_grpc, trans_pb2_grpc
from retina_common.pb import trans_pb2 as tpb
from retina_common.recovery_driver import RecoveryFailed, drive_recovery
from retina_common.refusal import SOURCES_NOT_REPLAYED
from retina_common.retry import RETRYABLE_CODES, Backoff
from retina_common.topology import Topology

log = structlog.get_logger("cdc")
T = TypeVar("T")
# The first pause between two attempts (doubled up to Settings.backoff_max_s).
FIRST_PAUSE_S = 0.05


class ConnectorStopped(Exception):
    """A refusal the connector must not retry blindly; the message says why."""


class ReplayGap(ConnectorStopped):
    """A recovering node needs changelog batches retention has dropped. Nothing
    was replayed and MarkReady was not sent; an operator must rebuild the node
    (docs/operations.md, "connector stopped with a replay gap")."""

    def __init__(self, node: str, gap: ChangelogGap) -> None:
        super().__init__(f"{node}: {gap}")
        self.node = node
        self.gap = gap


class BatchExpired(Exception):
    """The batch's transactions ended at the TransServer (lease) while waiting, or a
    Retina node's write fence refused its timestamps (ABORTED: a read or the HWM passed
    them, so they had ended): the batch is done again at new timestamps."""


class SendAbandoned(ConnectorStopped):
    """A send given up because another node's send of the batch failed first."""


@dataclass(frozen=True)
class Settings:
    schema: str
    batch_max_transactions: int = 500
    batch_max_rows: int = 5000
    batch_max_delay_ms: int = 50
    batch_idle_gap_ms: int = 0
    write_lease_ms: int = 15_000
    replay_mode: pb.ReplayMode = pb.VNODE
    drive_recovery: bool = True
    request_max_rows: int = 10_000
    backoff_max_s: float = 2.0
    node_check_interval_s: float = 1.0
    # The replay source this connector registered (cdc.name): every UpdateRecord names
    # it (WRITES_HAVE_A_REPLAY_SOURCE). Empty only against nodes that allow anonymous
    # writes (tests of the connector alone).
    writer_id: str = ""
    rpc_timeout_s: float = 30.0
    # Initial-snapshot chunks through the bulk load path (cdc_client/snapshot_load.py).
    snapshot_bulk_load: bool = True


@dataclass
class Batch:
    transactions: list[SourceTransaction]
    rows: list[list[ChangeRow]]  # per transaction, ts 0 until stamped
    collect_ms: float = 0.0

    @functools.cached_property
    def partial_vnodes(self) -> list[int]:
        """The virtual node of each partial update in the batch (one pass, kept: a batch
        done again at new timestamps has the same rows)."""
        return [r.vnode for rows in self.rows for r in rows if r.op == PARTIAL]


class Connector:
    def __init__(self, *, source: Source, changelog: Changelog, positions: PositionStore,
                 trans: trans_pb2_grpc.TransServiceStub,
                 nodes: Mapping[str, retina_pb2_grpc.RetinaWorkerServiceStub],
                 tables: TableMap, topology: Topology, settings: Settings,
                 clock_ms: Callable[[], int] = lambda: int(time.time() * 1000),
                 other_logs: Callable[[], list[ReplayLog]] = list) -> None:
        self.source = source
        self.intake = Intake(source, tables, topology)
        self.changelog = changelog
        self.positions = positions
        self.trans = trans
        self.nodes = dict(nodes)
        self.tables = tables
        self.topology = topology
        self.settings = settings
        self._clock_ms = clock_ms
        # The changelogs of the other registered replay sources (application writers,
        # Spark jobs), read afresh for every recovery: a recovering node replays them all.
        self._other_logs = other_logs
        self._stop = threading.Event()
        self._nodes_changed = threading.Event()
        self._committed: CommittedPosition | None = None
        self._pool = ThreadPoolExecutor(max_workers=max(1, len(self.nodes)),
                                        thread_name_prefix="send")
        self._deferred: Exception | None = None  # a malformed transaction after a good batch
        self._open_ids: list[int] = []  # the in-flight batch, kept alive during a replay
        # node -> its columnar threshold, from its last GetRetinaStatus (unknown: the row
        # form, which every node takes).
        self._min_columnar: dict[str, int] = {}
        self._accepts_partial: dict[str, bool] = {}  # GetRetinaStatus.accepts_partial
        self._extended_at = 0.0
        self._held: Item | None = None  # a bulk chunk that closed the batch before it
        self._snapshot = SnapshotLoader(settings.schema, topology, trans, self.nodes,
                                        settings.rpc_timeout_s)

    # --- life -------------------------------------------------------------
    def stop(self) -> None:
        self._stop.set()

    def nodes_changed(self) -> None:
        """Called by the lifecycle watch: look at the nodes before the next batch."""
        self._nodes_changed.set()

    def run(self) -> None:
        self._committed = self.positions.load()
        log.info("cdc_start", source=self.source.name,
                 resume_after=self._committed.position if self._committed else None)
        self.recover_nodes()
        self.intake.start()
        try:
            self._loop()
        finally:
            self.intake.stop()
            self._pool.shutdown(wait=False, cancel_futures=True)
        log.info("cdc_stopped")

    def _loop(self) -> None:
        next_check = time.monotonic() + self.settings.node_check_interval_s
        while not self._stop.is_set():
            if self._nodes_changed.is_set() or time.monotonic() >= next_check:
                self._nodes_changed.clear()
                self.recover_nodes()
                next_check = time.monotonic() + self.settings.node_check_interval_s
            batch = self._collect()
            if batch is not None:
                self._process(batch)

    # --- 1-2: collect and validate ------------------------------------------
    def _already_committed(self, trans: SourceTransaction) -> bool:
        c = self._committed
        return c is not None and (self.source.position_key(trans.position)
                                  <= self.source.position_key(c.position))

    def _collect(self) -> Batch | None:
        if self._deferred is not None:
            raise self._deferred
        s = self.settings
        batch = Batch([], [])
        deadline = None
        rows = 0
        while len(batch.transactions) < s.batch_max_transactions and rows < s.batch_max_rows:
            # A batch closes when nothing more is queued (or the source stays quiet
            # for batch_idle_gap_ms), when it is full, or at its delay cap. Under a
            # backlog, transactions queue while a batch is processed and the next one
            # takes them all (smart batching): batches grow exactly when the fixed cost
            # of a batch (changelog fsyncs, commit) needs amortising, and a lone
            # transaction waits for nothing.
            if deadline is None:
                timeout = 0.2
            else:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                timeout = min(s.batch_idle_gap_ms / 1000, left)  # 0: take what is queued
            if self._stop.is_set():
                break
            item, self._held = (self._held, None) if self._held else \
                (self.intake.get(timeout), None)
            if item is None:
                break
            bulk = item.trans is not None and item.trans.bulk and \
                self.settings.snapshot_bulk_load
            if bulk and batch.transactions:
                self._held = item  # a bulk chunk is a batch of its own
                break
            if item.error is not None:
                if not batch.transactions:
                    raise item.error
                # Commit the valid transactions before it first, then stop.
                self._deferred = item.error
                break
            assert item.trans is not None
            if self._already_committed(item.trans):
                log.info("cdc_skip_committed", position=item.trans.position)
                continue
            batch.transactions.append(item.trans)
            batch.rows.append(item.rows)
            rows += len(item.rows)
            if bulk:
                break
            if deadline is None:
                deadline = time.monotonic() + s.batch_max_delay_ms / 1000
        m.PENDING.set(len(batch.transactions) + self.intake.queued())
        if deadline is not None:
            batch.collect_ms = _ms(time.monotonic() - deadline + s.batch_max_delay_ms / 1000)
        return batch if batch.transactions else None

    # --- 3-7: one batch -------------------------------------------------------
    def _process(self, batch: Batch) -> None:
        started = time.monotonic()
        while True:
            try:
                self._process_once(batch)
                break
            except BatchExpired as exc:
                log.warning("cdc_batch_expired", reason=str(exc))
        rows = sum(len(r) for r in batch.rows)
        m.BATCH_SECONDS.observe(time.monotonic() - started)
        m.TRANSACTIONS.inc(len(batch.transactions))
        m.ROWS.inc(rows)
        m.PARTIAL_ROWS.inc(len(batch.partial_vnodes))
        m.PENDING.set(0)
        last = batch.transactions[-1]
        m.LAG_SECONDS.set(max(0, self._clock_ms() - last.commit_time_ms) / 1000)

    def _retrying(self, call: Callable[[], T], retryable: Callable[[Exception], bool],
                  what: str) -> T:
        """``call()`` until it succeeds or fails with an error ``retryable``
        rejects (raised as is); backs off in between, stops with the connector."""
        backoff = Backoff(FIRST_PAUSE_S, self.settings.backoff_max_s)
        while True:
            try:
                return call()
            except Exception as exc:
                if not retryable(exc):
                    raise
                log.warning("cdc_retry", call=what, error=str(exc))
                self._pause(backoff)

    def _pause(self, backoff: Backoff) -> None:
        if backoff.pause(self._stop):
            raise ConnectorStopped("stopping")

    def _begin(self, count: int) -> list[tpb.BeginTransResponse]:
        request = tpb.BeginTransBatchRequest(read_only=False, count=count,
                                             lease_ms=self.settings.write_lease_ms)
        try:
            answer = self._retrying(lambda: self.trans.BeginTransBatch(
                request, timeout=self.settings.rpc_timeout_s), _unavailable, "BeginTransBatch")
        except grpc.RpcError as exc:
            raise ConnectorStopped(f"BeginTransBatch refused: {exc.code().name}: "
                                   f"{exc.details()}") from None
        return sorted(answer.transactions, key=lambda t: t.timestamp)

    def _bulk(self, batch: Batch) -> bool:
        return (self.settings.snapshot_bulk_load and len(batch.transactions) == 1 and
                batch.transactions[0].bulk and loadable(batch.rows[0]))

    def _process_bulk(self, batch: Batch) -> bool:
        """An initial-snapshot chunk through the bulk load path (snapshot_load.py);
        False: it fell back, and the ordinary path takes it at the same timestamp."""
        t0 = time.monotonic()
        (began,) = self._begin(1)
        CDC_BATCH_BEGIN_AFTER.hit()
        trans = batch.transactions[0]
        try:
            files = self._snapshot.load(began.timestamp, batch.rows[0], self._table_records())
        except Exception as exc:  # any failure: the ordinary path takes it at T
            m.SNAPSHOT_LOADS.labels(outcome="fallback").inc()
            log.info("cdc_snapshot_bulk_fallback", position=trans.position,
                     error=f"{type(exc).__name__}: {exc}")
            self._process_once(batch, [began])
            return False
        except BaseException:
            self._rollback([began.trans_id])  # stopping: T must not hold the HWM
            raise
        t1 = time.monotonic()
        hwm = self._commit([began.trans_id])
        CDC_COMMIT_AFTER.hit()
        committed = CommittedPosition(trans.position, began.timestamp, self.source.name)
        self._store_position(committed)
        self._committed = committed
        CDC_POSITION_STORE_AFTER.hit()
        self.intake.ack(committed.position)
        m.SNAPSHOT_LOADS.labels(outcome="loaded").inc()
        m.COMMITTED_TS.set(committed.ts)
        m.LAST_COMMIT_TIME.set(time.time())
        m.LAG_TIMESTAMPS.set(max(0, committed.ts - hwm))
        log.info("cdc_batch_committed", transactions=1, first_ts=began.timestamp,
                 last_ts=began.timestamp, position=committed.position,
                 rows=len(batch.rows[0]), bulk_files=files,
                 ms={"collect": batch.collect_ms, "load": _ms(t1 - t0),
                     "commit_ack": _ms(time.monotonic() - t1)})
        return True

    def _process_once(self, batch: Batch,
                      began: list[tpb.BeginTransResponse] | None = None) -> None:
        if began is None and self._bulk(batch):
            self._process_bulk(batch)
            return
        t0 = time.monotonic()
        self._check_partial_accepted(batch)
        began = began or self._begin(len(batch.transactions))
        CDC_BATCH_BEGIN_AFTER.hit()
        ids = [t.trans_id for t in began]
        logged = [LoggedTransaction(b.timestamp, t.position, t.source_txid, t.commit_time_ms,
                                    stamped(rows, b.timestamp))
                  for b, t, rows in zip(began, batch.transactions, batch.rows, strict=True)]
        self._open_ids = ids
        t1 = time.monotonic()
        try:
            record = self.changelog.append(logged)
            t2 = time.monotonic()
            self._send([row for t in logged for row in t.rows], ids,
                       transaction_positions([record]))
            t3 = time.monotonic()
        except (ConnectorStopped, BatchExpired):
            self._rollback(ids)  # an expired batch's live timestamps would hold the HWM
            raise
        finally:
            self._open_ids = []
        hwm = self._commit(ids)
        CDC_COMMIT_AFTER.hit()
        committed = CommittedPosition(record.last_position, record.last_ts, self.source.name)
        self._store_position(committed)
        self._committed = committed
        CDC_POSITION_STORE_AFTER.hit()
        self.intake.ack(committed.position)
        m.COMMITTED_TS.set(committed.ts)
        m.LAST_COMMIT_TIME.set(time.time())
        for phase, seconds in (("collect", batch.collect_ms / 1000), ("begin", t1 - t0),
                               ("changelog", t2 - t1), ("send", t3 - t2),
                               ("commit_ack", time.monotonic() - t3)):
            m.BATCH_PHASE_SECONDS.labels(phase=phase).observe(seconds)
        m.LAG_TIMESTAMPS.set(max(0, committed.ts - hwm))
        log.info("cdc_batch_committed", transactions=len(ids), first_ts=record.first_ts,
                 last_ts=record.last_ts, position=committed.position,
                 rows=sum(len(t.rows) for t in logged),
                 ms={"collect": batch.collect_ms, "begin": _ms(t1 - t0),
                     "changelog": _ms(t2 - t1), "send": _ms(t3 - t2),
                     "commit_ack": _ms(time.monotonic() - t3)})

    def _check_partial_accepted(self, batch: Batch) -> None:
        """Before a batch with partial updates is logged: every node they go to says
        ``accepts_partial`` (a node built before them would drop them and acknowledge),
        or ConnectorStopped with nothing logged or sent; logged, the rows would stop
        every later replay into that node too. A node that cannot be asked now is asked
        again with backoff, as for a send."""
        for node in sorted({self.topology.node_of_vnode(v) for v in set(batch.partial_vnodes)}):
            backoff = Backoff(FIRST_PAUSE_S, self.settings.backoff_max_s)
            while not self._accepts_partial.get(node, False):
                if node in self._accepts_partial:
                    raise ConnectorStopped(
                        f"{node} does not say accepts_partial (built before partial updates, "
                        "it would drop them): upgrade the Retina nodes first, or set "
                        "cdc.unchanged_toast = \"read-source\" and route whole rows "
                        "(docs/operations.md, mixed versions); nothing of the batch was "
                        "logged or sent")
                try:
                    status = self.nodes[node].GetRetinaStatus(pb.GetRetinaStatusRequest(),
                                                              timeout=5)
                except grpc.RpcError as exc:
                    if exc.code() not in RETRYABLE_CODES:
                        raise ConnectorStopped(f"GetRetinaStatus of {node} refused: "
                                               f"{exc.code().name}: {exc.details()}") from None
                    log.warning("cdc_node_unavailable", node=node, error=exc.details())
                    self._pause(backoff)
                    continue
                self._accepts_partial[node] = status.accepts_partial

    def _store_position(self, committed: CommittedPosition) -> None:
        # EtcdUnavailable: nothing changed, so the same compare-and-swap again.
        self._retrying(lambda: self.positions.store(committed),
                       lambda exc: isinstance(exc, EtcdUnavailable), "store position")

    def _commit(self, ids: list[int]) -> int:
        """Commit the batch; returns the HWM after it."""
        request = tpb.CommitTransBatchRequest(trans_ids=ids)
        try:
            return self._retrying(lambda: self.trans.CommitTransBatch(
                request, timeout=self.settings.rpc_timeout_s), _unavailable,
                "CommitTransBatch").high_watermark
        except grpc.RpcError as exc:
            # NOT_FOUND / FAILED_PRECONDITION: a lease ran out. Everything was
            # applied, but the timestamps were rolled back: do the batch again.
            raise BatchExpired(f"CommitTransBatch: {exc.code().name}: "
                               f"{exc.details()}") from None

    def _rollback(self, ids: list[int]) -> None:
        for trans_id in ids:
            try:
                self.trans.RollbackTrans(tpb.RollbackTransRequest(trans_id=trans_id),
                                         timeout=self.settings.rpc_timeout_s)
            except grpc.RpcError as exc:  # its lease will end it
                log.warning("cdc_rollback_failed", trans_id=trans_id, error=exc.details())

    def _extend(self, ids: list[int]) -> None:
        self._extended_at = time.monotonic()
        for trans_id in ids:
            try:
                self.trans.ExtendTransLease(tpb.ExtendTransLeaseRequest(
                    trans_id=trans_id, lease_ms=self.settings.write_lease_ms),
                    timeout=self.settings.rpc_timeout_s)
            except grpc.RpcError as exc:
                if exc.code() in RETRYABLE_CODES:
                    return
                raise BatchExpired(f"ExtendTransLease: {exc.code().name}: "
                                   f"{exc.details()}") from None

    # --- 5: send ------------------------------------------------------------
    def _table_records(self) -> dict[str, TableRecord]:
        return _TableRecords(self.tables)

    def _send(self, rows: list[ChangeRow], ids: list[int], positions: dict[int, str]) -> None:
        """Every node its rows, in parallel, each transaction with its changelog
        position (``positions``: ts -> position); returns once all acknowledged.

        On a failure the other sends are told to give up and are waited for,
        so no send of this batch is still running when the batch is rolled
        back or done again at new timestamps."""
        per_node = by_node(rows, self.topology)
        abort = threading.Event()
        futures = {self._pool.submit(self._send_to_node, node, node_rows, ids, positions,
                                     abort): node
                   for node, node_rows in sorted(per_node.items())}
        errors: list[BaseException] = []
        for acknowledged, future in enumerate(as_completed(futures), start=1):
            error = future.exception()
            if error is not None:
                errors.append(error)
                abort.set()
            elif acknowledged < len(futures) and not errors:
                CDC_SEND_NODE_ACK_AFTER.hit()
        if errors:
            # The failure that made the others give up, not their abandonment.
            raise next((e for e in errors if not isinstance(e, SendAbandoned)), errors[0])
        CDC_SEND_ALL_ACKS_AFTER.hit()

    def _send_to_node(self, node: str, rows: list[ChangeRow], ids: list[int],
                      positions: dict[int, str], abort: threading.Event) -> None:
        stub = self.nodes[node]
        backoff = Backoff(FIRST_PAUSE_S, self.settings.backoff_max_s)
        tables = self._table_records()
        while True:
            try:
                for request in requests(self.settings.schema, tables, rows,
                                        self.settings.request_max_rows,
                                        self._min_columnar.get(node, ROW_FORM_ONLY),
                                        writer_id=self.settings.writer_id,
                                        positions=positions,
                                        accepts_partial=self._accepts_partial.get(node, False)):
                    stub.UpdateRecord(request, timeout=self.settings.rpc_timeout_s)
                return
            except PartialUpdatesRefused as exc:
                # _check_partial_accepted asked before the batch was logged; a node that
                # says otherwise now was replaced by an older build meanwhile.
                raise ConnectorStopped(str(exc)) from None
            except grpc.RpcError as exc:
                if exc.code() == grpc.StatusCode.ABORTED:  # the node's write fence
                    raise BatchExpired(f"UpdateRecord to {node}: {exc.details()}") from None
                if exc.code() not in RETRYABLE_CODES:
                    raise ConnectorStopped(f"UpdateRecord to {node} refused: "
                                           f"{exc.code().name}: {exc.details()}") from None
                log.warning("cdc_node_unavailable", node=node, error=exc.details())
            self._extend(ids)
            # A node found RECOVERING is replayed from the changelog, which
            # already holds this batch: its part is then done.
            if self._recover(node):
                return
            if abort.is_set():
                raise SendAbandoned(f"send to {node} abandoned: another node failed")
            self._pause(backoff)

    # --- recovery driver ------------------------------------------------------
    def recover_nodes(self) -> None:
        for node in sorted(self.nodes):
            self._recover(node)

    def _recover(self, node: str) -> bool:
        """Drive ``node`` to READY if it is RECOVERING; True if it was driven."""
        stub = self.nodes[node]
        try:
            status = stub.GetRetinaStatus(pb.GetRetinaStatusRequest(), timeout=5)
        except grpc.RpcError:
            return False
        self._min_columnar[node] = min_columnar_rows(status.accepts_columnar)
        self._accepts_partial[node] = status.accepts_partial
        if status.state == pb.READY:
            return False
        if status.state == pb.FAILED:
            raise ConnectorStopped(f"{node} is FAILED: {status.failure_reason}")
        if not self.settings.drive_recovery:
            return False  # an operator's replay job drives it; keep waiting
        return self._drive(node, stub, status.recovery_epoch)

    def _restarted_since(self, stub: retina_pb2_grpc.RetinaWorkerServiceStub,
                         epoch: int) -> bool:
        """Whether the node is a new process (another recovery epoch) than at ``epoch``."""
        try:
            now = stub.GetRetinaStatus(pb.GetRetinaStatusRequest(), timeout=5)
        except grpc.RpcError:
            return True  # gone again: its next process is another attempt
        return now.recovery_epoch != epoch

    def _drive(self, node: str, stub: retina_pb2_grpc.RetinaWorkerServiceStub,
               epoch: int) -> bool:
        started = time.monotonic()
        counter = {"rows": 0, "requests": 0}
        replayed: list[str] = []

        def replay(starts: pb.GetRecoveryReplayTsResponse,
                   context: pb.RecoveryReplayContext) -> Iterator[pb.UpdateRecordRequest]:
            vnode_starts = node_starts(node, self.topology, starts, self.settings.replay_mode)
            logs = self._replay_logs()
            # Before the first request: a node that needs dropped batches gets
            # nothing, so it stays RECOVERING at its attempt, untouched.
            self._check_retained(node, vnode_starts, logs)
            log.info("cdc_replay_start", node=node, checkpoint_id=context.checkpoint_id,
                     mode=pb.ReplayMode.Name(self.settings.replay_mode),
                     node_replay_from_ts=starts.node_replay_from_ts,
                     vnode_starts={str(v): ts for v, ts in sorted(vnode_starts.items())},
                     writers=[log_.writer_id for log_ in logs])
            try:
                for request in merged_replay_requests(
                        logs, vnode_starts, context, self.settings.request_max_rows,
                        min_columnar_rows=self._min_columnar.get(node, ROW_FORM_ONLY),
                        accepts_partial=self._accepts_partial.get(node, False)):
                    n = changelog_rows(request)
                    yield request
                    counter["rows"] += n
                    counter["requests"] += 1
                    m.REPLAY_ROWS.labels(node=node).inc(n)
                    CDC_REPLAY_REQUEST_AFTER.hit()
                    if self._open_ids and time.monotonic() - self._extended_at > 2:
                        self._extend(self._open_ids)
            except ChangelogGap as gap:  # retention ran while we replayed
                raise self._replay_gap(node, gap) from None
            except PartialUpdatesRefused as exc:  # the node's status was read by _recover
                raise ConnectorStopped(str(exc)) from None
            # Retention may have dropped a batch after it was listed: the
            # low-watermark rises before any delete, so this sees it.
            self._check_retained(node, vnode_starts, logs)
            replayed[:] = [log_.writer_id for log_ in logs if log_.writer_id]
            # drive_recovery sends MarkReady as soon as this generator is done:
            # every request above has been acknowledged by now.
            CDC_REPLAY_MARK_READY_BEFORE.hit()

        m.REPLAY_IN_PROGRESS.labels(node=node).set(1)
        try:
            drive_recovery(stub, replay=replay, mode=self.settings.replay_mode,
                           replayed_writers=lambda: replayed)
        except RecoveryFailed as exc:
            raise ConnectorStopped(str(exc)) from None
        except TimeoutError as exc:
            log.warning("cdc_replay_not_ready", node=node, error=str(exc))
            return False
        except EtcdError as exc:  # the replay-source registry, read for every recovery
            log.warning("cdc_replay_interrupted", node=node, error=str(exc),
                        reason="the replay-source registry is unreadable")
            return False
        except grpc.RpcError as exc:
            if exc.code() in RETRYABLE_CODES:  # the node went away again: start over later
                log.warning("cdc_replay_interrupted", node=node, error=exc.details())
                return False
            if exc.code() == grpc.StatusCode.FAILED_PRECONDITION and \
                    SOURCES_NOT_REPLAYED in (exc.details() or ""):
                # A writer registered while we replayed: replay again with it.
                log.warning("cdc_replay_interrupted", node=node, error=exc.details(),
                            reason="a replay source registered during the replay")
                return False
            if exc.code() == grpc.StatusCode.FAILED_PRECONDITION and \
                    self._restarted_since(stub, epoch):
                # A stale token because the node restarted under the replay: its new
                # attempt has new starts, so start over against it.
                log.warning("cdc_replay_interrupted", node=node, error=exc.details(),
                            reason="the node restarted during the replay")
                return False
            raise ConnectorStopped(f"recovery of {node} refused: {exc.code().name}: "
                                   f"{exc.details()}") from None
        finally:
            m.REPLAY_IN_PROGRESS.labels(node=node).set(0)
        seconds = time.monotonic() - started
        log.info("cdc_replay_done", node=node, rows=counter["rows"],
                 requests=counter["requests"], seconds=round(seconds, 3))
        return True

    def _replay_logs(self) -> list[ReplayLog]:
        """This connector's changelog, then every other ACTIVE replay source's."""
        own = ReplayLog(self.settings.writer_id, self.settings.schema, self.changelog,
                        self._table_records())
        others = [log_ for log_ in self._other_logs()
                  if log_.writer_id != self.settings.writer_id]
        return [own, *others]

    def _check_retained(self, node: str, vnode_starts: Mapping[int, int],
                        logs: list[ReplayLog]) -> None:
        try:
            m.RETAINED_FROM_TS.set(self.changelog.check_retained(vnode_starts))
            check_retained(logs[1:], vnode_starts)
        except ChangelogGap as gap:
            raise self._replay_gap(node, gap) from None

    def _replay_gap(self, node: str, gap: ChangelogGap) -> ReplayGap:
        m.REPLAY_GAP.labels(node=node).set(1)
        m.RETAINED_FROM_TS.set(gap.retained_from_ts)
        log.error("cdc_replay_gap", node=node, vnode=gap.vnode, needed_ts=gap.needed_ts,
                  retained_from_ts=gap.retained_from_ts,
                  mode=pb.ReplayMode.Name(self.settings.replay_mode),
                  short_vnodes={str(v): ts for v, ts in gap.short.items()},
                  action="the node stays RECOVERING; rebuild it from the source or restore "
                         "the changelog (docs/operations.md)")
        return ReplayGap(node, gap)


def _unavailable(exc: Exception) -> bool:
    return isinstance(exc, grpc.RpcError) and exc.code() in RETRYABLE_CODES


def _ms(seconds: float) -> float:
    return round(seconds * 1000, 1)


def stamped(rows: list[ChangeRow], ts: int) -> list[ChangeRow]:
    """The rows with their transaction's timestamp (built directly: dataclasses.replace
    costs several microseconds a row, a measurable share of a 5,000-row batch)."""
    return [ChangeRow(ts, r.seq, r.vnode, r.table, r.op, r.key, r.values, r.targets)
            for r in rows]


class _TableRecords(dict):
    """Table records by name, read from the catalog on first use."""

    def __init__(self, tables: TableMap) -> None:
        super().__init__()
        self._tables = tables

    def __missing__(self, name: str) -> TableRecord:
        record = self._tables.table(name, "changelog")
        self[name] = record
        return record
