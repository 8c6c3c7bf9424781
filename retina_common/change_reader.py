"""The change feed from a client: every node's ReadChanges merged into one stream of
whole commits, in commit order (docs/change-feed.md).

    reader = SnapshotReader(trans_address, topology)
    feed = reader.change_feed()
    for commit in feed.read("shop", "orders", from_ts=cursor):   # up to the newest snapshot
        commit.ts, commit.changes, commit.cursor
    for commit in feed.follow("shop", "orders", from_ts=cursor):  # and on, as commits come
        ...

A commit's ``changes`` is one Arrow table: ``_change_type`` (insert, update_before,
update_after, delete; ``snapshot`` for the rows of ``snapshot_first``), ``_commit_ts``,
``_ordinal`` (0, 1, ... within the commit: the same on every read), ``_source_position``
(where the commit came from in its CDC source; NULL for other writers), then the key
columns and the columns asked for. A commit is never split: its changes from every node
arrive together (COMMITS_WHOLE). :meth:`ChangeFeedReader.follow` also yields *heartbeats*:
commits with no change, saying nothing else was committed up to their ``ts``, so a
consumer's cursor moves while its table is quiet.

A cursor is a commit timestamp C, "every change at or below C was delivered", written as
an opaque text (:func:`encode_cursor`) that names its table. Each read holds the history
above its cursor with an AS OF read transaction at C + 1 (the TransServer admits it only
while the GC horizon is at or below C); a cursor older than the history kept is refused
:class:`ChangesExpired` naming the earliest cursor, never answered with a gap.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import json
import time
from collections.abc import Callable, Generator, Iterator, Sequence
from contextlib import AbstractContextManager, ExitStack, contextmanager
from dataclasses import dataclass

import grpc
import numpy as np
import pyarrow as pa

from retina_common.consumer_client import ConsumerClient
from retina_common.pb import retina_pb2 as rpb
from retina_common.pb import retina_pb2_grpc, trans_pb2_grpc
from retina_common.pb import trans_pb2 as tpb
from retina_common.refusal import (
    CHANGES_EXPIRED,
    earliest_cursor,
    earliest_readable,
    reaching_node,
    reaching_trans_server,
)
from retina_common.topology import Topology

CHANGE_TYPE, COMMIT_TS, ORDINAL, SOURCE_POSITION = (
    "_change_type", "_commit_ts", "_ordinal", "_source_position")
_VNODE, _SEQ = "_vnode", "_seq"  # the node's order within a commit (ReadChanges)
SNAPSHOT = "snapshot"
CURSOR_PREFIX = "rc1."


class BadCursor(ValueError):
    """A cursor text that is not one, or names another table."""


class ChangesExpired(Exception):
    """The changes above a cursor are no longer kept (CHANGES_EXPIRED): resume from
    ``earliest`` (losing what lies between) or start again with a snapshot."""

    def __init__(self, message: str, earliest: int) -> None:
        super().__init__(message)
        self.earliest = earliest


def encode_cursor(schema: str, table: str, ts: int) -> str:
    raw = json.dumps({"s": schema, "t": table, "ts": ts}, separators=(",", ":")).encode()
    return CURSOR_PREFIX + base64.urlsafe_b64encode(raw).decode().rstrip("=")


def decode_cursor(text: str, schema: str | None = None, table: str | None = None) -> int:
    """The commit timestamp of a cursor text (a plain timestamp is taken too); refuses one
    that names another table than ``schema.table`` when they are given."""
    text = text.strip()
    if text.isdigit():
        return int(text)
    if not text.startswith(CURSOR_PREFIX):
        raise BadCursor(f"{text!r} is not a change-feed cursor (nor a timestamp)")
    body = text[len(CURSOR_PREFIX):]
    try:
        fields = json.loads(base64.urlsafe_b64decode(body + "=" * (-len(body) % 4)))
        named, ts = (str(fields["s"]), str(fields["t"])), int(fields["ts"])
    except (ValueError, KeyError, TypeError, binascii.Error):
        raise BadCursor(f"{text!r} is not a change-feed cursor") from None
    if schema is not None and named != (schema, table):
        raise BadCursor(f"the cursor is of {named[0]}.{named[1]}, not {schema}.{table}")
    if ts < 0:
        raise BadCursor(f"the cursor's timestamp {ts} is negative")
    return ts


@dataclass(frozen=True)
class Commit:
    """The changes of one commit timestamp, whole; no change: a heartbeat."""

    schema: str
    table: str
    ts: int
    changes: pa.Table

    @property
    def cursor(self) -> str:
        """Resume after this commit."""
        return encode_cursor(self.schema, self.table, self.ts)

    @property
    def heartbeat(self) -> bool:
        return self.changes.num_rows == 0


class ChangeFeedReader:
    """Change-feed reads over the nodes of ``topology``."""

    def __init__(self, topology: Topology, trans_address: str,
                 trans: trans_pb2_grpc.TransServiceStub,
                 node: Callable[[str], retina_pb2_grpc.RetinaWorkerServiceStub], *,
                 timeout_s: float = 60) -> None:
        self._topology = topology
        self._trans_address = trans_address
        self._trans = trans
        self._node = node
        self._timeout_s = timeout_s

    # --- one range ------------------------------------------------------------------------------
    def read(self, schema: str, table: str, from_ts: int, *, to_ts: int = 0,
             columns: Sequence[str] = (), keep_unchanged: bool = False,
             page_changes: int = 0, heartbeat: bool = False,
             vnodes: Sequence[int] = (), raw: bool = False) -> Generator[Commit, None, None]:
        """The commits in ``(from_ts, to_ts]`` (``to_ts`` 0: up to the newest snapshot), in
        commit order; with ``heartbeat``, then a change-less commit at the range's end.
        ``vnodes``: only the changes of these virtual nodes (a commit's part on them).
        ``raw``: each commit's changes keep the nodes' ``_vnode`` and ``_seq`` in place of
        ``_ordinal`` (a commit's part on some virtual nodes cannot number the whole: the
        ordinal is the rank of (``_vnode``, ``_seq``) within the commit)."""
        with ExitStack() as stack:
            current = stack.enter_context(self._transaction(tpb.BeginTransRequest(
                read_only=True)))
            end = current.timestamp if not to_ts else min(to_ts, current.timestamp)
            if end <= from_ts:
                return
            hold = stack.enter_context(self.hold(from_ts))
            yield from self._range(schema, table, from_ts, end, current, hold,
                                   columns=columns, keep_unchanged=keep_unchanged,
                                   page_changes=page_changes, heartbeat=heartbeat,
                                   vnodes=vnodes, raw=raw)

    def _range(self, schema: str, table: str, from_ts: int, end: int,
               current: tpb.BeginTransResponse, hold: tpb.BeginTransResponse, *,
               columns: Sequence[str] = (), keep_unchanged: bool = False,
               page_changes: int = 0, heartbeat: bool = False, vnodes: Sequence[int] = (),
               raw: bool = False) -> Generator[Commit, None, None]:
        """The commits in ``(from_ts, end]``: ``current``'s snapshot is at or above
        ``end``, ``hold``'s at or below ``from_ts + 1``; both stay live meanwhile."""
        streams = {node: self._node(node).ReadChanges(rpb.ReadChangesRequest(
            schema_name=schema, table_name=table, from_ts=from_ts, to_ts=end,
            columns=list(columns), trans_id=current.trans_id,
            timestamp=current.timestamp, keep_unchanged_updates=keep_unchanged,
            page_changes=page_changes, hold_trans_id=hold.trans_id,
            virtual_nodes=owned), timeout=self._timeout_s)
            for node, owned in self._nodes(vnodes).items()}
        last = from_ts
        for ts, changes in _merged(streams, raw):
            last = ts
            yield Commit(schema, table, ts, changes)
        if heartbeat and last < end:
            yield Commit(schema, table, end, _empty_changes())

    def follow(self, schema: str, table: str, from_ts: int = 0, *, poll_s: float = 0.05,
               stop: Callable[[], bool] = lambda: False, columns: Sequence[str] = (),
               keep_unchanged: bool = False, consumer: str = ""
               ) -> Generator[Commit, None, None]:
        """The commits after ``from_ts``, as they come, with a heartbeat after each range
        read, until ``stop()``. ``consumer``: a registered consumer's name (registered at
        ``from_ts``, or at the high watermark when it is 0, unless it is registered
        already: then it resumes from its own cursor); the cursor of every commit the
        caller took is committed, so history is held for the consumer.

        A range is read as soon as the previous one ended if that one had changes, else
        after ``poll_s``. Each range is read with one new transaction: its snapshot is
        the range's end, and it then holds the next range's history (its snapshot is at
        or below the new cursor + 1), so a poll begins and ends one transaction, not
        two (FOLLOW_HOLDS_ITS_CURSOR)."""
        registry = ConsumerClient(self._trans, self._timeout_s) if consumer else None
        cursor = from_ts
        if registry is not None:
            start = from_ts or registry.high_watermark()
            cursor = registry.register(consumer, start, f"{schema}.{table}").cursor_ts
        committed = taken = cursor
        hold: tpb.BeginTransResponse | None = None
        try:
            while not stop():
                changed = False
                current = self._begin(tpb.BeginTransRequest(read_only=True))
                try:
                    for again in (False, True):
                        if current.timestamp <= cursor:
                            break
                        if hold is None:
                            hold = self._begin(_hold_request(cursor), expired_from=cursor)
                        try:
                            for commit in self._range(schema, table, cursor,
                                                      current.timestamp, current, hold,
                                                      columns=columns,
                                                      keep_unchanged=keep_unchanged,
                                                      heartbeat=True):
                                cursor = commit.ts
                                changed |= not commit.heartbeat
                                yield commit
                                taken = commit.ts  # the caller came back: it took it
                            break
                        except grpc.RpcError as exc:
                            # The hold ended under the follower (a TransServer restart
                            # ends every transaction; a lease can run out while the
                            # caller works): hold the cursor anew, once, before the range
                            # gave anything (ChangesExpired if its history is gone).
                            if again or changed or not _ended(exc, hold):
                                raise
                            self._end_quietly(hold)
                            hold = None
                except BaseException:
                    self._end_quietly(current)
                    raise
                # FOLLOW_HOLDS_ITS_CURSOR: the range was read whole (cursor = its end), so
                # this range's transaction holds the next one's history.
                if current.timestamp > cursor + 1:
                    self._end(current)
                    raise RuntimeError(f"FOLLOW_HOLDS_ITS_CURSOR: a range to "
                                       f"{current.timestamp} ended at {cursor}")
                previous, hold = hold, current
                if previous is not None:
                    self._end_quietly(previous)
                if registry is not None and taken > committed:
                    registry.commit(consumer, taken)
                    committed = taken
                if not changed:
                    time.sleep(poll_s)  # nothing new for this table: ask again in a moment
        finally:
            if hold is not None:
                self._end_quietly(hold)
            # Closed (the caller stopped): what it took before the commit it stopped at.
            if registry is not None and taken > committed:
                with contextlib.suppress(grpc.RpcError):  # it is given again next time
                    registry.commit(consumer, taken)

    def raw_schema(self, schema: str, table: str, columns: Sequence[str] = ()) -> pa.Schema:
        """The schema of ``raw`` changes of ``schema.table`` with ``columns``, for a reader
        that must name it before any change arrives (Spark): a node's answer to the empty
        range at the newest snapshot, which that snapshot itself holds."""
        node = self._topology.nodes[0]
        with self._transaction(tpb.BeginTransRequest(read_only=True)) as current:
            request = rpb.ReadChangesRequest(
                schema_name=schema, table_name=table, from_ts=current.timestamp,
                to_ts=current.timestamp, columns=list(columns), trans_id=current.trans_id,
                timestamp=current.timestamp, hold_trans_id=current.trans_id)
            with reaching_node(node):
                replies = list(self._node(node).ReadChanges(request, timeout=self._timeout_s))
        return pa.ipc.open_stream(replies[-1].changes_arrow).schema

    def _nodes(self, vnodes: Sequence[int]) -> dict[str, list[int]]:
        """The nodes to ask and their virtual nodes to read (empty: all of theirs)."""
        if not vnodes:
            return {node: [] for node in self._topology.nodes}
        by_node: dict[str, list[int]] = {}
        for vnode in sorted(set(vnodes)):
            by_node.setdefault(self._topology.node_of_vnode(vnode), []).append(vnode)
        return by_node

    # --- transactions ---------------------------------------------------------------------------
    @contextmanager
    def _transaction(self, request: tpb.BeginTransRequest, *, expired_from: int = -1
                     ) -> Iterator[tpb.BeginTransResponse]:
        """A read transaction for the block. ``expired_from``: a cursor whose begin
        (AS OF above it) is refused snapshot_expired raises ChangesExpired."""
        trans = self._begin(request, expired_from=expired_from)
        try:
            yield trans
        finally:
            self._end(trans)

    def _begin(self, request: tpb.BeginTransRequest, *, expired_from: int = -1
               ) -> tpb.BeginTransResponse:
        with reaching_trans_server(self._trans_address):
            try:
                return self._trans.BeginTrans(request, timeout=self._timeout_s)
            except grpc.RpcError as exc:
                point = earliest_readable(exc.details() or "")
                if expired_from < 0 or exc.code() != grpc.StatusCode.FAILED_PRECONDITION \
                        or point is None:
                    raise
                raise ChangesExpired(
                    f"{CHANGES_EXPIRED}: the changes above {expired_from} are no longer "
                    f"kept ({exc.details()})", point[0] - 1) from None

    def _end(self, trans: tpb.BeginTransResponse) -> None:
        with reaching_trans_server(self._trans_address):
            self._trans.CommitTrans(tpb.CommitTransRequest(trans_id=trans.trans_id),
                                    timeout=self._timeout_s)

    def _end_quietly(self, trans: tpb.BeginTransResponse) -> None:
        """End a read transaction that may have ended already (a TransServer restart, its
        lease): nothing it held is needed any more, and its lease ends it otherwise."""
        with contextlib.suppress(grpc.RpcError):
            self._end(trans)

    def hold(self, from_ts: int) -> AbstractContextManager[tpb.BeginTransResponse]:
        """An AS OF read transaction at ``from_ts + 1``: it holds safeGcTs at or below
        ``from_ts`` while it lives; the TransServer refuses it (ChangesExpired) when the
        history above ``from_ts`` is no longer kept."""
        return self._transaction(_hold_request(from_ts), expired_from=from_ts)


def _ended(exc: grpc.RpcError, trans: tpb.BeginTransResponse) -> bool:
    """Whether a node refused a read because ``trans`` is no longer live (read_guard.py)."""
    return exc.code() == grpc.StatusCode.FAILED_PRECONDITION and \
        f"read transaction {trans.trans_id} is no longer live" in (exc.details() or "")


def _hold_request(from_ts: int) -> tpb.BeginTransRequest:
    return tpb.BeginTransRequest(read_only=True, as_of_ts=from_ts + 1)


def _empty_changes() -> pa.Table:
    return pa.table({CHANGE_TYPE: pa.array([], pa.string()),
                     COMMIT_TS: pa.array([], pa.int64()),
                     ORDINAL: pa.array([], pa.int64()),
                     SOURCE_POSITION: pa.array([], pa.string())})


class _NodeStream:
    """One node's ReadChanges answer, read page by page."""

    def __init__(self, node: str, responses: Iterator[rpb.ReadChangesResponse]) -> None:
        self.node = node
        self._responses = responses
        self.through = -1
        self.done = False
        self.pending: list[pa.Table] = []

    def pull(self) -> None:
        with reaching_node(self.node):
            try:
                reply = next(self._responses)
            except StopIteration:
                self.done = True
                return
            except grpc.RpcError as exc:
                _raise_expired(exc)
                raise
        if reply.change_count:
            self.pending.append(pa.ipc.open_stream(reply.changes_arrow).read_all())
        self.through = reply.through_ts

    def take_through(self, ts: int) -> list[pa.Table]:
        """The pending changes at or below ``ts`` (whole commits: pages end at one)."""
        taken, kept = [], []
        for page in self.pending:
            stamps = page.column(COMMIT_TS).to_numpy()
            cut = int(np.searchsorted(stamps, ts, side="right"))
            if cut:
                taken.append(page.slice(0, cut))
            if cut < page.num_rows:
                kept.append(page.slice(cut))
        self.pending = kept
        return taken


def _raise_expired(exc: grpc.RpcError) -> None:
    earliest = earliest_cursor(exc.details() or "")
    if exc.code() == grpc.StatusCode.FAILED_PRECONDITION and earliest is not None:
        raise ChangesExpired(exc.details() or CHANGES_EXPIRED, earliest) from None


def _merged(streams: dict[str, Iterator[rpb.ReadChangesResponse]], raw: bool = False
            ) -> Iterator[tuple[int, pa.Table]]:
    """(commit ts, its changes) from every node's stream, in commit order: a commit is
    given once every node has sent everything up to it (each page says how far)."""
    nodes = [_NodeStream(node, responses) for node, responses in sorted(streams.items())]
    while True:
        for stream in nodes:
            while not stream.done and stream.through < 0:
                stream.pull()
        open_nodes = [s for s in nodes if not s.done]
        if not open_nodes:
            break
        # Every node has sent every change at or below the smallest "through".
        ready = min(s.through for s in open_nodes)
        parts = [t for s in nodes for t in s.take_through(ready)]
        yield from _commits(parts, raw)
        slowest = min(open_nodes, key=lambda s: s.through)
        slowest.pull()
    yield from _commits([t for s in nodes for t in s.take_through(np.iinfo(np.int64).max)],
                        raw)


def _commits(parts: list[pa.Table], raw: bool = False) -> Iterator[tuple[int, pa.Table]]:
    parts = [p for p in parts if p.num_rows]
    if not parts:
        return
    table = pa.concat_tables(parts, promote_options="default")
    order = np.lexsort((table.column(_SEQ).to_numpy(), table.column(_VNODE).to_numpy(),
                        table.column(COMMIT_TS).to_numpy()))
    table = table.take(pa.array(order))
    stamps = table.column(COMMIT_TS).to_numpy()
    bounds = np.flatnonzero(np.diff(stamps)) + 1
    starts = np.concatenate([[0], bounds])
    ends = np.concatenate([bounds, [len(stamps)]])
    rows = table if raw else table.drop_columns([_VNODE, _SEQ])
    for start, end in zip(starts.tolist(), ends.tolist(), strict=True):
        commit = rows.slice(start, end - start)
        if raw:
            yield int(stamps[start]), commit
            continue
        ordinal = pa.array(np.arange(end - start, dtype=np.int64))
        yield int(stamps[start]), commit.add_column(2, ORDINAL, ordinal)
