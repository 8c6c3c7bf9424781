"""Changelog rows as UpdateRecord requests, for live sends and recovery replay.

Rows become one ``TableUpdateData`` per (timestamp, table, virtual node): a
DELETE as a deleted key; a replace as a deleted key plus an inserted row of
the same key (Retina applies the DELETE first); a TRUNCATE as ``truncate =
true`` (applied before both); a partial update as itself (``partial_data``, or
``partial_rows_arrow`` when the update's partial updates share their targets).
Requests are cut at ``max_rows`` items, so none exceeds the server's
``max_rows_per_request`` (the connector uses the smaller of ``cdc.request_max_rows``
and ``retina.max_rows_per_request``), and at about ``REQUEST_MAX_BYTES`` of values.

An update of ``min_columnar_rows`` items or more goes in the columnar form
(``retina_common.columnar``, Arrow IPC: ``delete_keys_arrow`` and
``insert_rows_arrow``), a smaller one in the row form (``delete_data`` and
``insert_data``). Callers take the threshold from the node's
``GetRetinaStatus.accepts_columnar`` (``columnar.min_columnar_rows``): a node
built before the columnar form would ignore its fields. An update whose rows
are wider than the connector's table record (a column added since it was
read) or whose values do not decode goes in the row form too: the node
re-reads its catalog, or refuses the row with the same message as ever.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field

from retina_common.catalog import Catalog, TableRecord
from retina_common.changelog import (
    PARTIAL,
    REPLACE,
    TRUNCATE,
    BatchRecord,
    Changelog,
    ChangelogGap,
    ChangeRow,
    transaction_positions,
)
from retina_common.client import fill_update
from retina_common.columnar import COLUMNAR_MIN_ROWS, row_count
from retina_common.pb import retina_pb2 as pb
from retina_common.replay_sources import ReplaySource
from retina_common.topology import Topology


@dataclass
class _Update:
    """The rows of one (ts, table, virtual node) of a request, in arrival order."""

    table: TableRecord
    ts: int
    vnode: int
    min_columnar_rows: int
    source_position: str = ""
    truncate: bool = False
    rows: list[ChangeRow] = field(default_factory=list)

    def message(self) -> pb.TableUpdateData:
        tud = pb.TableUpdateData(table_name=self.table.name,
                                 primary_index_id=self.table.primary_index_id,
                                 timestamp=self.ts, virtual_node_id=self.vnode,
                                 truncate=self.truncate, source_position=self.source_position)
        replaces = [r for r in self.rows if r.op == REPLACE]
        partials = [(r.key, r.targets or (), list(r.values or ())) for r in self.rows
                    if r.op == PARTIAL]
        fill_update(tud, self.table, [r.key for r in self.rows if r.op != PARTIAL],
                    [r.key for r in replaces], [r.values or () for r in replaces],
                    self.min_columnar_rows, partials)
        return tud


class PartialUpdatesRefused(ValueError):
    """A partial update for a node that does not say ``accepts_partial``: a node built
    before partial updates would drop them and acknowledge the request."""


# A request is cut here too, whatever its row count: a Retina node takes messages of up
# to 64 MiB (retina_common.grpc_server), and wide rows reach that before max_rows.
REQUEST_MAX_BYTES = 16 * 1024 * 1024


def requests(schema: str, tables: Mapping[str, TableRecord], rows: Iterable[ChangeRow],
             max_rows: int = 5000, min_columnar_rows: int = COLUMNAR_MIN_ROWS, *,
             writer_id: str = "", positions: Mapping[int, str] | None = None,
             accepts_partial: bool = False) -> Iterator[pb.UpdateRecordRequest]:
    """Rows (already in (ts, seq) order, all for one node) as requests of at
    most ``max_rows`` delete/insert items each, as Retina counts them (a
    replace is two), and about ``REQUEST_MAX_BYTES`` of values; an update of
    ``min_columnar_rows`` items or more in the columnar form. ``writer_id``: the
    registered replay source whose changelog holds the rows. ``positions``: ts -> the
    source position the changelog records for that transaction, set on every
    TableUpdateData of the ts (``transaction_positions``; none: empty).
    ``accepts_partial``: the node's ``GetRetinaStatus.accepts_partial``; a partial update
    for a node that does not say so raises PartialUpdatesRefused, nothing of its request
    sent."""
    positions = positions or {}
    current: dict[tuple[int, str, int], _Update] = {}
    count = size = 0
    for row in rows:
        if row.op == PARTIAL and not accepts_partial:
            raise PartialUpdatesRefused(
                f"a partial update of {row.table} at ts {row.ts} for a node that does not "
                "say accepts_partial (built before partial updates, it would drop it): "
                "upgrade the Retina nodes first")
        weight = 2 if row.op == REPLACE else 1
        # Values' bytes, a key twice (the delete and the insert) and a per-row margin.
        row_bytes = 2 * len(row.key) + 16 + (sum(map(len, row.values)) if row.values else 0)
        if count and (count + weight > max_rows or size + row_bytes > REQUEST_MAX_BYTES):
            yield _request(schema, current, writer_id)
            current, count, size = {}, 0, 0
        slot = (row.ts, row.table, row.vnode)
        update = current.get(slot)
        if update is None:
            update = current[slot] = _Update(tables[row.table], row.ts, row.vnode,
                                             min_columnar_rows, positions.get(row.ts, ""))
        if row.op == TRUNCATE:  # the first row of its (ts, table, vnode): applied first
            update.truncate = True
        else:
            update.rows.append(row)
        count += weight
        size += row_bytes
    if count:
        yield _request(schema, current, writer_id)


def _request(schema: str, updates: Mapping[tuple[int, str, int], _Update],
             writer_id: str) -> pb.UpdateRecordRequest:
    return pb.UpdateRecordRequest(schema_name=schema, writer_id=writer_id,
                                  table_update_data=[u.message() for u in updates.values()])


def replay_requests(changelog: Changelog, schema: str, tables: Mapping[str, TableRecord],
                    starts: Mapping[int, int], context: pb.RecoveryReplayContext | None,
                    max_rows: int, upto_ts: int | None = None,
                    records: Sequence[BatchRecord] | None = None, *,
                    min_columnar_rows: int = COLUMNAR_MIN_ROWS, writer_id: str = "",
                    accepts_partial: bool = False) -> Iterator[pb.UpdateRecordRequest]:
    """The changelog of the virtual nodes in ``starts`` (vnode → first ts,
    inclusive), as requests carrying ``context`` (recovery replay) or none
    (backfill), each transaction with the source position its record holds."""
    if records is None:
        records = changelog.records(min(starts.values())) if starts else []
    rows = changelog.read(starts, upto_ts, records)
    for request in requests(schema, tables, rows, max_rows, min_columnar_rows,
                            writer_id=writer_id, positions=transaction_positions(records),
                            accepts_partial=accepts_partial):
        if context is not None:
            request.recovery_replay_context.CopyFrom(context)
        yield request


def changelog_rows(request: pb.UpdateRecordRequest) -> int:
    """Changelog rows in a request: each is exactly one deleted key (a
    ``delete_data`` entry or a row of ``delete_keys_arrow``), a ``truncate``
    flag, or a partial update."""
    return sum(len(t.delete_data) + row_count(t.delete_keys_arrow) + int(t.truncate)
               + len(t.partial_data) + row_count(t.partial_rows_arrow)
               for t in request.table_update_data)


def by_node(rows: Iterable[ChangeRow], topology: Topology) -> dict[str, list[ChangeRow]]:
    out: dict[str, list[ChangeRow]] = {}
    for row in rows:
        out.setdefault(topology.node_of_vnode(row.vnode), []).append(row)
    return out


def node_starts(node: str, topology: Topology, starts: pb.GetRecoveryReplayTsResponse,
                mode: int) -> dict[int, int]:
    """vnode → inclusive replay start for every virtual node ``node`` owns."""
    if mode == pb.NODE:
        return dict.fromkeys(topology.vnodes_of(node), starts.node_replay_from_ts)
    # A virtual node the answer leaves out replays from the node's start:
    # replaying more is safe, replaying less is not.
    return {v: starts.vnode_replay_from_ts.get(v, starts.node_replay_from_ts)
            for v in topology.vnodes_of(node)}


# --- every replay source at once (EVERY_SOURCE_REPLAYED) -----------------------------------
@dataclass(frozen=True)
class ReplayLog:
    """One registered replay source's changelog, as a recovery driver reads it."""

    writer_id: str
    schema: str
    changelog: Changelog
    tables: Mapping[str, TableRecord]


class CatalogTables(dict):
    """Table records of one schema by name, read from the catalog on first use."""

    def __init__(self, catalog: Catalog, schema: str) -> None:
        super().__init__()
        self._catalog = catalog
        self._schema = schema

    def __missing__(self, name: str) -> TableRecord:
        record = self._catalog.get_table(self._schema, name)
        self[name] = record
        return record


def registered_logs(sources: Iterable[ReplaySource], catalog: Catalog) -> list[ReplayLog]:
    """The changelog of every ACTIVE source, in writer-id order."""
    return [ReplayLog(s.writer_id, s.schema, Changelog(s.changelog_root),
                      CatalogTables(catalog, s.schema))
            for s in sorted(sources, key=lambda s: s.writer_id) if s.active]


def check_retained(logs: Sequence[ReplayLog], starts: Mapping[int, int]) -> int:
    """The lowest low-watermark of ``logs``; raises :class:`SourceGap` for the first
    log that no longer holds a start."""
    low = 0
    for log in logs:
        try:
            retained = log.changelog.check_retained(starts)
        except ChangelogGap as gap:
            raise SourceGap(log.writer_id, gap) from None
        low = retained if not low else min(low, retained)
    return low


class SourceGap(ChangelogGap):
    """A :class:`ChangelogGap` in a named writer's changelog."""

    def __init__(self, writer_id: str, gap: ChangelogGap) -> None:
        super().__init__(gap.short, gap.retained_from_ts)
        self.writer_id = writer_id
        self.args = (f"writer {writer_id}: {gap}",)


def merged_replay_requests(logs: Sequence[ReplayLog], starts: Mapping[int, int],
                           context: pb.RecoveryReplayContext, max_rows: int, *,
                           min_columnar_rows: int = COLUMNAR_MIN_ROWS,
                           accepts_partial: bool = False
                           ) -> Iterator[pb.UpdateRecordRequest]:
    """Every log's rows of the virtual nodes in ``starts`` (inclusive), merged in
    timestamp order (timestamps are unique across writers: one TransServer issues them),
    as replay requests carrying ``context``. A request holds one writer's rows: the
    schema is per writer."""
    positions: list[dict[int, str]] = [{} for _ in logs]  # per log: ts -> source position

    def tagged(index: int, log: ReplayLog) -> Iterator[tuple[int, int, int, int, ChangeRow]]:
        try:
            records = log.changelog.records(min(starts.values())) if starts else []
            positions[index] = transaction_positions(records)
            for row in log.changelog.read(starts, records=records):
                yield row.ts, index, row.vnode, row.seq, row
        except ChangelogGap as gap:
            raise SourceGap(log.writer_id, gap) from None

    merged = heapq.merge(*(tagged(i, log) for i, log in enumerate(logs)))
    for index, run in itertools.groupby(merged, key=lambda item: item[1]):
        log = logs[index]
        for request in requests(log.schema, log.tables, (item[4] for item in run), max_rows,
                                min_columnar_rows, writer_id=log.writer_id,
                                positions=positions[index], accepts_partial=accepts_partial):
            request.recovery_replay_context.CopyFrom(context)
            yield request
