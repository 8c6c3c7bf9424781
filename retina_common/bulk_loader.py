"""The loader's side of a bulk load: Arrow batches in, Parquet files out, published at one
commit timestamp per chunk (docs/write-paths/bulk-load.md; the node's side is
retina_server/bulk_load.py).

Per chunk of ``chunk_rows`` rows, one write transaction T:

1. BeginTrans (write): T is every row's hidden ``_commit_ts``;
2. the rows' keys, encoded and routed: one file per virtual node;
3. PrepareBulkLoad on each node that serves a virtual node of the chunk: the node
   names the files and registers them TEMPORARY_INGEST;
4. each file written durably by this process (Arrow -> Parquet, the load id in its
   footer): no Python row object anywhere on the way;
5. CommitBulkLoad on each node (checked, journaled, indexed, published there);
6. CommitTrans: the chunk is visible at T.

A commit whose answer was lost (UNAVAILABLE, DEADLINE_EXCEEDED) is asked again until
``timeout_s``: the node answers a committed load from its journal, and one it never
journaled NOT_FOUND. A node's answer is *definite* when it says the chunk was not
committed there (INVALID_ARGUMENT, ALREADY_EXISTS: a live key, ABORTED: fenced,
NOT_FOUND); anything else (no answer by the deadline, a node that failed closed) leaves
its part *in doubt*: it may have been journaled, and then it appears at T.

- every node committed: CommitTrans, done;
- every node refused definitely: AbortBulkLoad, RollbackTrans, ``LoadRefused``: nothing
  of the chunk is there;
- none committed, some in doubt: ``LoadInDoubt``: each row of the chunk is there at T or
  absent, never twice (a load's rows are only ever published whole, per node);
- some committed: their rows are durable, so T is committed, and ``PartialLoad`` names
  the files refused or in doubt.

``load`` raises the first such outcome after the chunks in flight have finished (their
outcomes are in the exception's ``report``); the chunk written but not yet sent is
aborted and rolled back.

Chunks are pipelined: chunk N+1 is encoded and written while chunk N commits.
"""

from __future__ import annotations

import contextlib
import time
from collections import deque
from collections.abc import Iterable, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial

import grpc
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from retina_common import failpoints as fp
from retina_common.catalog import TableRecord
from retina_common.codec import COMMIT_TS, LOAD_ID_KEY, PARQUET_COMPRESSION, encode_primary_keys
from retina_common.log import get_logger
from retina_common.pb import retina_pb2 as rpb
from retina_common.pb import retina_pb2_grpc as rpb_grpc
from retina_common.pb import trans_pb2 as tpb
from retina_common.pb import trans_pb2_grpc as tpb_grpc
from retina_common.retry import until_deadline
from retina_common.schema_evolution import table_schema
from retina_common.storage import write_durably
from retina_common.topology import Topology

log = get_logger(component="bulk_loader")

DEFAULT_CHUNK_ROWS = 1_000_000
DEFAULT_ROW_GROUP_ROWS = 131_072
COMMITS_IN_FLIGHT = 2


# A node's answers that say its part of the chunk was not committed (see the docstring).
DEFINITE = frozenset({grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.ALREADY_EXISTS,
                      grpc.StatusCode.ABORTED, grpc.StatusCode.NOT_FOUND})
TRANSIENT = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED})


class LoadFailed(Exception):
    """A chunk did not load whole. ``ts``: its timestamp; ``report``: what ``load`` had
    committed when it stopped (the chunks before, and those in flight that finished)."""

    def __init__(self, message: str, ts: int) -> None:
        super().__init__(message)
        self.ts = ts
        self.report: LoadReport | None = None


class LoadRefused(LoadFailed):
    """Every node refused the chunk definitely: nothing of it is there."""


class LoadInDoubt(LoadFailed):
    """No node is known to have committed the chunk, some may have: each of its rows is
    there at ``ts`` or absent, never twice."""


class PartialLoad(LoadFailed):
    """Some nodes committed the chunk (visible at ``ts``); ``refused`` names the files
    of the others (refused, or in doubt)."""

    def __init__(self, message: str, ts: int, refused: list[str]) -> None:
        super().__init__(message, ts)
        self.refused = refused


@dataclass
class LoadReport:
    rows: int = 0
    chunks: int = 0
    files: int = 0
    timestamps: list[int] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def rows_per_s(self) -> float:
        return self.rows / self.seconds if self.seconds else 0.0


@dataclass
class _Chunk:
    ts: int
    trans_id: int
    rows: int
    loads: dict[str, rpb.PrepareBulkLoadResponse]  # node -> its prepared load
    # Nodes whose part an earlier attempt of this loader committed (its load id).
    done_before: frozenset[str] = frozenset()


class BulkLoader:
    """Loads Arrow data into one table, chunk by chunk (see the module docstring)."""

    def __init__(self, schema_name: str, table: TableRecord, topology: Topology,
                 trans: tpb_grpc.TransServiceStub,
                 nodes: Mapping[str, rpb_grpc.RetinaWorkerServiceStub], *,
                 chunk_rows: int = DEFAULT_CHUNK_ROWS,
                 row_group_rows: int = DEFAULT_ROW_GROUP_ROWS, timeout_s: float = 300,
                 lease_ms: int = 0, id_prefix: str = "") -> None:
        if chunk_rows <= 0 or row_group_rows <= 0:
            raise ValueError("chunk_rows and row_group_rows must be positive")
        self._schema_name = schema_name
        self._table = table
        self._topology = topology
        self._trans = trans
        self._nodes = dict(nodes)
        self._chunk_rows = chunk_rows
        self._row_group_rows = row_group_rows
        self._timeout_s = timeout_s
        self._lease_ms = lease_ms  # each chunk's write transaction (0: the server's default)
        # Load ids of our own, "<id_prefix>.<chunk>.<node>" (LOADER_IDS_ARE_IDEMPOTENT):
        # run again over the same data (a Spark task retried), the loader learns which
        # parts an earlier run committed and loads only the rest. Empty: node-chosen ids.
        self._id_prefix = id_prefix
        self._chunk_seq = 0
        self._file_schema = table_schema(table)
        by_name = {c.name: c for c in table.columns}
        self._key_names = list(table.primary_key)
        self._key_types = [by_name[n].type for n in self._key_names]

    def load(self, data: pa.Table | Iterable[pa.RecordBatch | pa.Table]) -> LoadReport:
        """Load every row of ``data`` (a table, or batches/tables of the table's columns).
        Raises LoadFailed (see the module docstring) or ValueError (rows that do not fit
        the table), with what was committed before in ``report`` of a LoadFailed."""
        report = LoadReport()
        started = time.perf_counter()
        # COMMITS_IN_FLIGHT commits at once: the node checks the next chunk's files while
        # the last one's index transaction syncs; their streams' locks keep their order.
        with ThreadPoolExecutor(max_workers=COMMITS_IN_FLIGHT,
                                thread_name_prefix="bulk-commit") as pool:
            inflight: deque[Future[_Chunk]] = deque()
            failure: BaseException | None = None
            unsent: _Chunk | None = None  # written, its commits not yet asked for
            try:
                for chunk in self._chunks(data):
                    unsent = self._write_chunk(chunk)
                    while len(inflight) >= COMMITS_IN_FLIGHT:
                        self._count(report, inflight.popleft().result())
                    inflight.append(pool.submit(self._commit_chunk, unsent))
                    unsent = None
            except BaseException as exc:
                failure = exc
                if unsent is not None:  # nothing of it can be committed: let it go
                    self._abort(unsent.loads)
                    self._roll_back(unsent.ts, unsent.trans_id)
            # The chunks in flight finish either way; their outcomes are counted.
            while inflight:
                try:
                    self._count(report, inflight.popleft().result())
                except BaseException as exc:
                    failure = failure or exc
        report.seconds = time.perf_counter() - started
        if failure is not None:
            if isinstance(failure, LoadFailed):
                failure.report = report
            raise failure
        log.debug("bulk_load_done", table=self._table.name, rows=report.rows,
                  chunks=report.chunks, files=report.files, seconds=round(report.seconds, 3))
        return report

    @staticmethod
    def _count(report: LoadReport, chunk: _Chunk) -> None:
        report.rows += chunk.rows
        report.chunks += 1
        report.files += sum(len(p.files) for p in chunk.loads.values())
        report.timestamps.append(chunk.ts)

    def _chunks(self, data: pa.Table | Iterable[pa.RecordBatch | pa.Table]) -> Iterator[pa.Table]:
        parts: Iterable[pa.RecordBatch | pa.Table] = \
            data.to_batches(self._chunk_rows) if isinstance(data, pa.Table) else data
        pending: list[pa.Table] = []
        size = 0
        for part in parts:
            table = self._columns(part if isinstance(part, pa.Table)
                                  else pa.Table.from_batches([part]))
            while table.num_rows:
                take = min(table.num_rows, self._chunk_rows - size)
                pending.append(table.slice(0, take))
                table = table.slice(take)
                size += take
                if size == self._chunk_rows:
                    yield pa.concat_tables(pending)
                    pending, size = [], 0
        if size:
            yield pa.concat_tables(pending)

    def _columns(self, rows: pa.Table) -> pa.Table:
        """The table's columns, by name, in its order and types (an extra column or a
        missing one: ValueError)."""
        names = [f.name for f in self._file_schema if f.name != COMMIT_TS]
        extra = sorted(set(rows.column_names) - set(names))
        missing = [n for n in names if n not in rows.column_names]
        if extra or missing:
            raise ValueError(f"{self._schema_name}.{self._table.name} has columns {names}: "
                             f"the rows lack {missing}, and have {extra} besides")
        schema = pa.schema([self._file_schema.field(n) for n in names])
        return rows.select(names).cast(schema)

    def _conform(self, rows: pa.Table, ts: int) -> pa.Table:
        """The file's rows: ``rows`` (the table's columns, ``_columns``) and ``_commit_ts`` = T."""
        stamps = pa.array(np.full(rows.num_rows, ts, np.int64))
        return pa.Table.from_arrays([*rows.columns, stamps], schema=self._file_schema)

    def _vnodes(self, rows: pa.Table) -> np.ndarray:
        keys = encode_primary_keys(self._key_types, [rows.column(n).combine_chunks()
                                                     for n in self._key_names])
        return self._topology.vnodes_of_keys(keys.to_pylist())

    def _write_chunk(self, chunk: pa.Table) -> _Chunk:
        begun = self._trans.BeginTrans(tpb.BeginTransRequest(lease_ms=self._lease_ms),
                                       timeout=30)
        seq, self._chunk_seq = self._chunk_seq, self._chunk_seq + 1
        try:
            rows = self._conform(chunk, begun.timestamp)
            loads, before = self._prepare_and_write(begun.timestamp, self._by_vnode(rows), seq)
        except BaseException:
            self._roll_back(begun.timestamp, begun.trans_id)
            raise
        return _Chunk(begun.timestamp, begun.trans_id, rows.num_rows, loads, before)

    def _by_vnode(self, rows: pa.Table) -> dict[int, pa.Table]:
        vnodes = self._vnodes(rows)
        order = np.argsort(vnodes, kind="stable")
        present, starts = np.unique(vnodes[order], return_index=True)
        bounds = [*starts.tolist(), len(order)]
        return {int(v): rows.take(order[bounds[i]:bounds[i + 1]])
                for i, v in enumerate(present)}

    def _prepare_and_write(self, ts: int, by_vnode: Mapping[int, pa.Table], seq: int = 0
                           ) -> tuple[dict[str, rpb.PrepareBulkLoadResponse], frozenset[str]]:
        """PrepareBulkLoad on every node of ``by_vnode``'s virtual nodes, then each file
        written; on a failure the loads prepared so far are aborted and it is raised.
        Returns the prepared loads, and the nodes whose part an earlier run of this
        loader committed under the same load id (nothing prepared there)."""
        loads: dict[str, rpb.PrepareBulkLoadResponse] = {}
        before: set[str] = set()
        try:
            nodes = sorted({self._topology.node_of_vnode(v) for v in by_vnode})
            for node in nodes:
                mine = sorted(v for v in by_vnode if self._topology.node_of_vnode(v) == node)
                load_id = f"{self._id_prefix}.{seq}.{self._topology.nodes.index(node)}" \
                    if self._id_prefix else ""
                request = rpb.PrepareBulkLoadRequest(
                    schema_name=self._schema_name, table_name=self._table.name, timestamp=ts,
                    virtual_node_ids=mine, load_id=load_id)
                answer = until_deadline(
                    partial(self._nodes[node].PrepareBulkLoad, request, timeout=self._timeout_s),
                    transient=(grpc.RpcError,), deadline_s=self._timeout_s,
                    on_retry=_only_transient)
                if answer.committed_ts:
                    before.add(node)
                else:
                    loads[node] = answer
            for prepared in loads.values():
                for f in prepared.files:
                    self._write_file(prepared, f, by_vnode[f.virtual_node_id])
        except BaseException:
            self._abort(loads)
            raise
        return loads, frozenset(before)

    def _write_file(self, prepared: rpb.PrepareBulkLoadResponse, f: rpb.BulkLoadFile,
                    rows: pa.Table) -> None:
        rows = rows.replace_schema_metadata({LOAD_ID_KEY: prepared.load_id.encode()})
        sink = pa.BufferOutputStream()
        pq.write_table(rows, sink, row_group_size=self._row_group_rows,
                       compression=PARQUET_COMPRESSION)
        write_durably(prepared.path_uri, f.file_name, sink.getvalue().to_pybytes())

    def _commit_at_nodes(self, ts: int, loads: Mapping[str, rpb.PrepareBulkLoadResponse],
                         done_before: frozenset[str] = frozenset()) -> None:
        """CommitBulkLoad on every node (a lost answer asked again until ``timeout_s``).
        Raises LoadRefused, LoadInDoubt or PartialLoad (the module docstring)."""
        committed: list[str] = []
        refused: list[tuple[str, grpc.RpcError]] = []
        for node, prepared in loads.items():
            request = rpb.CommitBulkLoadRequest(load_id=prepared.load_id, timestamp=ts)
            try:
                until_deadline(partial(self._nodes[node].CommitBulkLoad, request,
                                       timeout=self._timeout_s),
                               transient=(grpc.RpcError,), deadline_s=self._timeout_s,
                               on_retry=_only_transient)
                committed.append(node)
            except grpc.RpcError as exc:
                refused.append((node, exc))
        if not refused:
            return
        first, error = refused[0]
        what = f"{first} answered {error.code().name} for the chunk at {ts}: {error.details()}"
        if not committed and not done_before:
            self._abort(loads)
            if all(e.code() in DEFINITE for _n, e in refused):
                raise LoadRefused(f"refused: {what}", ts) from error
            raise LoadInDoubt(f"in doubt: {what}; each row of the chunk is there at {ts} "
                              "or absent", ts) from error
        names = [f.file_name for n, _e in refused for f in loads[n].files]
        raise PartialLoad(f"partial: {what}; the parts of {committed} are loaded", ts,
                          names) from error

    def load_at(self, ts: int, rows: pa.Table) -> int:
        """Load ``rows`` (the table's columns) at ``ts``, a write transaction the caller
        holds and commits itself (the CDC connector's initial snapshot): prepare, write,
        commit on the nodes, nothing at the TransServer. Raises as :meth:`load` does,
        LoadRefused with every prepared load aborted; returns the files written."""
        loads, _before = self._prepare_and_write(
            ts, self._by_vnode(self._conform(self._columns(rows), ts)))
        self._commit_at_nodes(ts, loads)
        return sum(len(p.files) for p in loads.values())

    def _commit_chunk(self, chunk: _Chunk) -> _Chunk:
        if not chunk.loads:  # an earlier run committed every part: T is not needed
            self._roll_back(chunk.ts, chunk.trans_id)
            return chunk
        try:
            self._commit_at_nodes(chunk.ts, chunk.loads, chunk.done_before)
        except (LoadRefused, LoadInDoubt):
            self._roll_back(chunk.ts, chunk.trans_id)
            raise
        except PartialLoad:
            # The committed parts are durable on their nodes and become visible at T
            # anyway (when its lease ends): committed now, so the loaded part is exact.
            with contextlib.suppress(grpc.RpcError):  # its lease ends on its own
                self._trans.CommitTrans(tpb.CommitTransRequest(trans_id=chunk.trans_id),
                                        timeout=30)
            raise
        fp.LOADER_COMMIT_TRANS_BEFORE.hit()
        self._trans.CommitTrans(tpb.CommitTransRequest(trans_id=chunk.trans_id), timeout=30)
        fp.LOADER_COMMIT_TRANS_AFTER.hit()
        return chunk

    def _abort(self, loads: Mapping[str, rpb.PrepareBulkLoadResponse]) -> None:
        for node, prepared in loads.items():
            try:
                self._nodes[node].AbortBulkLoad(
                    rpb.AbortBulkLoadRequest(load_id=prepared.load_id), timeout=10)
            except grpc.RpcError as exc:  # it lapses on its own (the prepare TTL)
                log.warning("bulk_load_abort_failed", node=node, error=exc.details())

    def _roll_back(self, ts: int, trans_id: int) -> None:
        try:
            self._trans.RollbackTrans(tpb.RollbackTransRequest(trans_id=trans_id), timeout=10)
        except grpc.RpcError as exc:  # its lease ends on its own
            log.warning("bulk_load_rollback_failed", ts=ts, error=exc.details())


def parquet_batches(paths: Iterable[str], batch_rows: int = 65_536) -> Iterator[pa.RecordBatch]:
    """The rows of Parquet files, as Arrow batches (``retina-load``, the Spark job)."""
    for path in paths:
        yield from pq.ParquetFile(path).iter_batches(batch_size=batch_rows)


def _only_transient(exc: BaseException) -> None:
    """Retry a commit whose answer was lost; anything else is the node's answer."""
    if not isinstance(exc, grpc.RpcError) or exc.code() not in TRANSIENT:
        raise exc
