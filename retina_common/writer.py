"""The durable write path for applications: ``DurableWriter``.

A Retina node keeps what it applied since its last checkpoint in memory; after a
crash, recovery gets those rows back only from a writer's durable changelog. So
an application writes the way the CDC connector does (one transaction at a time):

1. BeginTrans at the TransServer: the transaction's timestamp T;
2. **log**: the transaction's net effect per key, encoded exactly as UpdateRecord
   sends it, is appended to the writer's own changelog (the connector's format,
   ``retina_common/changelog.py``: segment, then batch record, each durable). From
   here the transaction is durable: every recovery driver replays it;
3. **send** UpdateRecord to every node that owns one of its keys, naming the writer
   (``writer_id``: WRITES_HAVE_A_REPLAY_SOURCE);
4. CommitTrans; then the *acknowledged* mark (``acked.json`` in the changelog root)
   moves to T, and :meth:`DurableWriter.commit` returns T.

The writer registers itself as a replay source (``retina_common/replay_sources.py``)
before its first write, with its changelog under ``<storage.root>/_writers/<id>``,
so a node that crashes is brought back with these rows by whoever drives its
recovery (the connector, ``retina-admin recover``), whether this process still
runs or not.

Crash windows (``docs/write-paths/application-writes.md``): a transaction whose
commit did not return is *in doubt*. If it reached the log (step 2) it is applied
when the writer is opened again with the same id (:meth:`open` sends again, at new
timestamps and in order, every logged transaction after the acknowledged mark); a
node's recovery replay may apply it earlier. If it did not reach the log, nothing
of it was sent, and nothing of it ever appears.

Rows are upserts: an insert of a key that exists replaces the row (it is sent as
DELETE + INSERT, the CDC form). A *partial* row (``partials``: the key columns and
the columns to set) is a partial update: the row's other columns keep their values
(docs/encoding.md, "Partial updates"). It is logged with its target columns, so a
resend or a replay merges the same row. What the node would refuse whatever its state
(a column the table does not have, a target list without the key, a key written twice
in one transaction) raises ValueError before anything is logged; partial updates go
only to nodes that say ``accepts_partial`` (PartialUpdatesRefused, nothing logged).
One process per writer id at a time; a key should
be written by one writer (two writers that resend in-doubt transactions over each
other's keys could put an older value back).
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc

from retina_common import replay_sources, storage
from retina_common.catalog import Catalog, TableRecord
from retina_common.changelog import (
    DELETE,
    PARTIAL,
    REPLACE,
    Changelog,
    ChangeRow,
    LoggedTransaction,
)
from retina_common.changelog_replay import PartialUpdatesRefused, by_node, requests
from retina_common.changelog_retention import horizon
from retina_common.client import Row, TableWriter, channel
from retina_common.codec import EncodingError
from retina_common.config import Config
from retina_common.etcd import EtcdError, EtcdStore
from retina_common.failpoints import (
    WRITER_ACKNOWLEDGE_BEFORE,
    WRITER_APPEND_AFTER,
    WRITER_COMMIT_BEFORE,
)
from retina_common.log import get_logger
from retina_common.pb import retina_pb2 as rpb
from retina_common.pb import retina_pb2_grpc, trans_pb2_grpc
from retina_common.pb import trans_pb2 as tpb
from retina_common.retry import RETRYABLE_CODES, Backoff
from retina_common.topology import Topology, load_topology

log = get_logger(component="writer")

ACKED_NAME = "acked.json"
RETENTION_EVERY = 200  # commits between two retention passes over the writer's changelog


class WriteRefused(Exception):
    """A node or the TransServer refused the transaction for good (a malformed row, an
    unknown table): it was logged, so it stays in doubt until the cause is fixed."""


class WriteInDoubt(Exception):
    """The transaction is in the writer's changelog but could not be sent and committed
    within the deadline (a node down for longer): it will be applied by the next
    :meth:`DurableWriter.open` with the same id, or by a node's recovery replay."""


class _Expired(Exception):
    """The timestamp ended (lease, or a node's write fence): log again at a new one."""


@dataclass
class TableChanges:
    """One table's part of a transaction: rows to upsert, keys to delete, and partial
    rows (the key and the columns to set). A key is in one of them at most."""

    upserts: list[Row] = field(default_factory=list)
    deletes: list[Row] = field(default_factory=list)
    partials: list[Row] = field(default_factory=list)


@dataclass(frozen=True)
class WriterSettings:
    lease_ms: int = 15_000
    rpc_timeout_s: float = 30.0
    # How long one transaction may wait for an unreachable node before WriteInDoubt.
    send_deadline_s: float = 120.0
    backoff_max_s: float = 1.0
    min_columnar_rows: int = 1 << 30  # the row form: every node takes it


class DurableWriter:
    def __init__(self, writer_id: str, schema: str, *, etcd: EtcdStore, catalog: Catalog,
                 topology: Topology, trans: trans_pb2_grpc.TransServiceStub,
                 nodes: Mapping[str, retina_pb2_grpc.RetinaWorkerServiceStub],
                 changelog_root: str, settings: WriterSettings | None = None,
                 kind: str = "app") -> None:
        self.writer_id = replay_sources.check_writer_id(writer_id)
        self.schema = schema
        self._etcd = etcd
        self._catalog = catalog
        self._topology = topology
        self._trans = trans
        self._nodes = dict(nodes)
        self._root = storage.root_uri(changelog_root)
        self.changelog = Changelog(self._root)
        self.settings = settings or WriterSettings()
        self._kind = kind
        self._tables: dict[str, TableWriter] = {}
        self._accepts_partial: set[str] = set()  # nodes whose GetRetinaStatus said so
        self._commits = 0
        self._opened = False
        # A transaction of this process was logged and then not acknowledged (its
        # commit() raised): it is finished before the next one, or the acknowledged mark
        # would pass over it and no open() would ever send it again.
        self._in_doubt = False
        self._lock = threading.Lock()  # one transaction at a time: the log is in ts order
        self._closers: list[Callable[[], None]] = []

    @classmethod
    def connect(cls, config: Config, writer_id: str, schema: str,
                settings: WriterSettings | None = None,
                topology: Topology | None = None) -> DurableWriter:
        """A writer with its own connections to the cluster ``config`` describes (its
        topology read from ``config`` unless given), its changelog under
        ``<storage.root>/_writers/<writer_id>``. Call :meth:`open`."""
        topology = topology or load_topology(config.topology_file)
        etcd = EtcdStore.from_config(config.etcd)
        catalog = Catalog(config.catalog.dsn, pool_max=1,
                          connect_timeout_s=config.catalog.connect_timeout_s)
        channels = {n: channel(n, config.tls) for n in topology.nodes}
        trans_channel = channel(config.trans.listen, config.tls)
        writer = cls(writer_id, schema, etcd=etcd, catalog=catalog, topology=topology,
                     trans=trans_pb2_grpc.TransServiceStub(trans_channel),
                     nodes={n: retina_pb2_grpc.RetinaWorkerServiceStub(c)
                            for n, c in channels.items()},
                     changelog_root=replay_sources.default_root(config.storage.root,
                                                                writer_id),
                     settings=settings)
        writer._closers = [catalog.close, trans_channel.close,
                           *(c.close for c in channels.values())]
        return writer

    def close(self) -> None:
        for close in self._closers:
            close()
        self._closers = []

    # --- life ---------------------------------------------------------------------------
    def open(self) -> DurableWriter:
        """Register the writer, then apply every transaction left in doubt by an earlier
        process of this writer id (in order, at new timestamps). Returns self."""
        replay_sources.register(self._etcd, self.writer_id, kind=self._kind,
                                changelog_root=self._root, schema=self.schema)
        self._opened = True
        with self._lock:
            finished = self._finish_in_doubt()
        self._retention()
        log.info("writer_opened", writer_id=self.writer_id, changelog=self._root,
                 in_doubt_applied=finished)
        return self

    def __enter__(self) -> DurableWriter:
        return self if self._opened else self.open()

    def __exit__(self, *_exc: object) -> None:
        self.close()

    # --- writing ------------------------------------------------------------------------
    def write(self, table: str, *, upserts: Iterable[Row] = (),
              deletes: Iterable[Row] = (), partials: Iterable[Row] = ()) -> int:
        """One transaction on one table; returns its commit timestamp."""
        return self.commit({table: TableChanges(list(upserts), list(deletes),
                                                list(partials))})

    def commit(self, changes: Mapping[str, TableChanges]) -> int:
        """One transaction over several tables of the writer's schema. Returns the
        commit timestamp once every node applied it and the TransServer committed it."""
        if not self._opened:
            raise RuntimeError("DurableWriter.open() first: it registers the writer")
        with self._lock:
            rows = self._encode(changes)
            if not rows:
                raise ValueError("a transaction with no rows")
            if self._in_doubt:
                self._finish_in_doubt()
            return self._apply(rows)

    def _encode(self, changes: Mapping[str, TableChanges]) -> list[ChangeRow]:
        """The net effect per key (the last of its deletes and upserts wins), timestamp
        0. Raises ValueError (nothing logged) for a partial row the node would refuse
        whatever its state, or whose key has another change in the transaction (which
        would come first is not for the writer to guess)."""
        rows: dict[tuple[str, bytes], ChangeRow] = {}

        def add(table: str, key: bytes, op: int, values: tuple[bytes, ...] | None,
                targets: tuple[str, ...] | None = None) -> None:
            prior = rows.get((table, key))
            if prior is not None and PARTIAL in (op, prior.op):
                raise ValueError(f"{table}: key {key.hex()} has a partial row and another "
                                 "change in one transaction; give it one change (nothing "
                                 "was logged)")
            rows[(table, key)] = ChangeRow(0, 0, self._topology.vnode_of_key(key), table, op,
                                           key, values, targets)

        for table, part in changes.items():
            writer = self._table(table)
            for row in part.deletes:
                add(table, writer.key(row), DELETE, None)
            for row in part.upserts:
                add(table, writer.key(row), REPLACE, writer.values(row))
            for row in part.partials:
                add(table, *self._partial(writer, row))
        return list(rows.values())

    @staticmethod
    def _partial(writer: TableWriter, row: Row
                 ) -> tuple[bytes, int, tuple[bytes, ...], tuple[str, ...]]:
        missing = [c for c in writer.table.primary_key if c not in row]
        if missing:  # PARTIAL_TARGETS_NAME_THE_KEY
            raise ValueError(f"{writer.table.name}: a partial row without its key column(s) "
                             f"{missing} (nothing was logged)")
        try:
            targets, values = writer.partial_values(row)
        except EncodingError as exc:
            raise ValueError(f"{writer.table.name}: {exc} (nothing was logged)") from None
        return writer.key(row), PARTIAL, tuple(values), targets

    def _table(self, name: str) -> TableWriter:
        writer = self._tables.get(name)
        if writer is None:
            writer = self._tables[name] = TableWriter(self._catalog.get_table(self.schema, name),
                                                      self._topology)
        return writer

    def table_record(self, name: str) -> TableRecord:
        """The catalog's record of a table of the writer's schema (NotFound)."""
        return self._table(name).table

    def _records(self) -> dict[str, TableRecord]:
        return {name: w.table for name, w in self._tables.items()}

    def _apply(self, rows: Sequence[ChangeRow], resend: bool = False) -> int:
        """Log, send and commit ``rows`` as one transaction; again at a new timestamp
        when the first one ended under it. ``resend``: an in-doubt transaction."""
        self._check_partial_accepted(rows, resend)
        logged = False
        while True:
            try:
                begun = self._trans.BeginTrans(tpb.BeginTransRequest(
                    read_only=False, lease_ms=self.settings.lease_ms),
                    timeout=self.settings.rpc_timeout_s)
            except grpc.RpcError as exc:
                if not logged:
                    raise  # nothing of this transaction exists anywhere
                raise WriteInDoubt(f"BeginTrans for a redo: {exc.code().name}: "
                                   f"{exc.details()}; an earlier attempt is logged and will "
                                   "be applied") from None
            stamped = [ChangeRow(begun.timestamp, seq, r.vnode, r.table, r.op, r.key, r.values,
                                 r.targets) for seq, r in enumerate(rows)]
            self._in_doubt = True  # until acknowledged: see __init__
            try:
                record = self.changelog.append([LoggedTransaction(
                    begun.timestamp, f"{self.writer_id}:{begun.trans_id}",
                    str(begun.trans_id), int(time.time() * 1000), stamped)])
                logged = True
                WRITER_APPEND_AFTER.hit()
                # The position the changelog holds: a replay sends the same one.
                self._send(stamped, begun.trans_id, record.last_position)
                WRITER_COMMIT_BEFORE.hit()
                self._commit(begun.trans_id)
                WRITER_ACKNOWLEDGE_BEFORE.hit()
            except _Expired as exc:
                log.warning("writer_transaction_expired", writer_id=self.writer_id,
                            ts=begun.timestamp, reason=str(exc))
                self._rollback(begun.trans_id)
                continue
            except BaseException:
                # Whatever it was (a refusal, a node away past the deadline, the log's
                # storage failing), the open transaction would hold the HWM, and so every
                # snapshot, for its whole lease. What was logged stays in doubt.
                self._rollback(begun.trans_id)
                raise
            self._acknowledge(begun.timestamp)
            self._in_doubt = False
            return int(begun.timestamp)

    def _check_partial_accepted(self, rows: Sequence[ChangeRow], resend: bool) -> None:
        """Before a transaction with partial updates is logged (or sent again): every
        node it goes to says ``accepts_partial`` (a node built before them would drop
        them), or PartialUpdatesRefused. A node that cannot be asked is asked again
        until the send deadline, then WriteRefused (WriteInDoubt for a resend: it is
        logged). ``resend``: an in-doubt transaction, already in the log."""
        partial = [r for r in rows if r.op == PARTIAL]
        kept = "it stays in doubt" if resend else "nothing was logged"
        for node in sorted(by_node(partial, self._topology)):
            deadline = time.monotonic() + self.settings.send_deadline_s
            backoff = Backoff(0.05, self.settings.backoff_max_s)
            while node not in self._accepts_partial:
                try:
                    status = self._nodes[node].GetRetinaStatus(
                        rpb.GetRetinaStatusRequest(), timeout=self.settings.rpc_timeout_s)
                except grpc.RpcError as exc:
                    if exc.code() in RETRYABLE_CODES and time.monotonic() < deadline:
                        backoff.pause()
                        continue
                    error = WriteInDoubt if resend else WriteRefused
                    raise error(f"{node} cannot say whether it accepts partial updates "
                                f"({exc.code().name}: {exc.details()}); {kept}") from None
                if not status.accepts_partial:
                    raise PartialUpdatesRefused(
                        f"{node} does not say accepts_partial (built before partial updates, "
                        f"it would drop them): upgrade the Retina nodes first; {kept}")
                self._accepts_partial.add(node)

    def _send(self, rows: Sequence[ChangeRow], trans_id: int, position: str) -> None:
        tables = self._records()
        positions = {rows[0].ts: position} if rows else {}
        for node, node_rows in sorted(by_node(rows, self._topology).items()):
            for request in requests(self.schema, tables, node_rows,
                                    min_columnar_rows=self.settings.min_columnar_rows,
                                    writer_id=self.writer_id, positions=positions,
                                    accepts_partial=node in self._accepts_partial):
                self._send_one(node, request, trans_id)

    def _send_one(self, node: str, request: Any, trans_id: int) -> None:
        deadline = time.monotonic() + self.settings.send_deadline_s
        backoff = Backoff(0.05, self.settings.backoff_max_s)
        while True:
            try:
                self._nodes[node].UpdateRecord(request, timeout=self.settings.rpc_timeout_s)
                return
            except grpc.RpcError as exc:
                if exc.code() == grpc.StatusCode.ABORTED:  # the node's write fence
                    raise _Expired(f"UpdateRecord to {node}: {exc.details()}") from None
                if exc.code() not in RETRYABLE_CODES:
                    raise WriteRefused(f"UpdateRecord to {node} refused: {exc.code().name}: "
                                       f"{exc.details()} (the transaction is logged and "
                                       "stays in doubt)") from None
                if time.monotonic() > deadline:
                    raise WriteInDoubt(f"{node} unreachable for {self.settings.send_deadline_s}"
                                       f" s ({exc.details()}); the transaction is logged and "
                                       "will be applied") from None
                log.warning("writer_node_unavailable", node=node, error=exc.details())
            self._extend(trans_id)
            backoff.pause()

    def _extend(self, trans_id: int) -> None:
        try:
            self._trans.ExtendTransLease(tpb.ExtendTransLeaseRequest(
                trans_id=trans_id, lease_ms=self.settings.lease_ms),
                timeout=self.settings.rpc_timeout_s)
        except grpc.RpcError as exc:
            if exc.code() not in RETRYABLE_CODES:
                raise _Expired(f"ExtendTransLease: {exc.code().name}") from None

    def _commit(self, trans_id: int) -> None:
        try:
            self._trans.CommitTrans(tpb.CommitTransRequest(trans_id=trans_id),
                                    timeout=self.settings.rpc_timeout_s)
        except grpc.RpcError as exc:
            if exc.code() in RETRYABLE_CODES:
                raise WriteInDoubt(f"CommitTrans: {exc.code().name}: {exc.details()}; the "
                                   "transaction is logged and will be applied") from None
            # NOT_FOUND / FAILED_PRECONDITION: the lease ran out; do it again.
            raise _Expired(f"CommitTrans: {exc.code().name}: {exc.details()}") from None

    def _rollback(self, trans_id: int) -> None:
        try:
            self._trans.RollbackTrans(tpb.RollbackTransRequest(trans_id=trans_id),
                                      timeout=self.settings.rpc_timeout_s)
        except grpc.RpcError as exc:  # its lease will end it
            log.warning("writer_rollback_failed", trans_id=trans_id, error=exc.details())

    # --- the acknowledged mark, in-doubt transactions, retention --------------------------
    def acknowledged_ts(self) -> int:
        """The last timestamp whose commit returned (0: none yet)."""
        try:
            return int(json.loads(storage.read_bytes(self._root, ACKED_NAME))["ackedTs"])
        except FileNotFoundError:
            return 0

    def _acknowledge(self, ts: int) -> None:
        storage.write_durably(self._root, ACKED_NAME,
                              json.dumps({"ackedTs": ts}).encode())
        self._commits += 1
        if self._commits % RETENTION_EVERY == 0:
            self._retention()

    def _finish_in_doubt(self) -> int:
        """Send again, in order and each at a new timestamp, every logged transaction
        after the acknowledged mark. Applying a suffix of a writer's transactions again
        in order leaves every key as the last of them put it."""
        acked = self.acknowledged_ts()
        # Only this writer's own retention drops its batches, and it runs after this.
        low = max(acked + 1, self.changelog.retained_from())
        vnodes = dict.fromkeys(range(self._topology.virtual_nodes), low)
        done = 0
        for record in self.changelog.records(acked + 1):
            if record.first_ts <= acked:
                continue
            by_ts: dict[int, list[ChangeRow]] = {}
            for row in self.changelog.read(vnodes, records=[record]):
                by_ts.setdefault(row.ts, []).append(row)
            for ts, rows in sorted(by_ts.items()):
                for row in rows:
                    self._table(row.table)
                log.warning("writer_in_doubt_resent", writer_id=self.writer_id, logged_ts=ts,
                            rows=len(rows))
                self._apply(rows, resend=True)
                done += 1
        return done

    def _retention(self) -> None:
        """Drop batches no checkpoint can replay from any more (as the connector does)."""
        try:
            low = horizon(self._etcd, self._topology)
            if low > 0:
                self.changelog.drop_before(low)
        except (EtcdError, OSError) as exc:
            log.warning("writer_retention_failed", writer_id=self.writer_id, error=str(exc))
