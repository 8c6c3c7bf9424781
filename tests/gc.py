"""A Storage GC rewriter for node-side tests: the Spark job's protocol (prepare → read
visibility at the cutoff → write and register the new file, with the job's footer
keys → commit) without Spark, so that a test can stop between any two of its steps."""

from __future__ import annotations

import io
from collections import defaultdict
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from retina_common import file_names
from retina_common.catalog import FileRecord, FileType
from retina_common.log import logged_events
from retina_common.pb import retina_pb2 as rpb
from retina_common.pb import trans_pb2 as tpb
from retina_common.storage import open_parquet, write_durably
from spark_jobs.storage_gc_arrow import new_file_schema

from .dataplane import SCHEMA, DataPlane
from .support import eventually


@dataclass
class Prepared:
    node: str
    table: str
    vnode: int
    old: list[FileRecord]
    reply: rpb.PrepareGcRewriteResponse
    trans_id: int


def streams(dp: DataPlane, table: str) -> dict[tuple[str, int], list[FileRecord]]:
    """REGULAR files of a table per (node, vnode), in each stream's order (the node's
    firstBlockId, from QueryVisibility: a GC output takes its old files' place)."""
    path = dp.catalog.get_paths(dp.tables[table].table_id)[0]
    out: dict[tuple[str, int], list[tuple[int, FileRecord]]] = defaultdict(list)
    trans_id = begin_read(dp)
    ts = dp.trans.stub().GetHighWatermark(tpb.GetHighWatermarkRequest(),
                                          timeout=10).high_watermark
    try:
        for f in dp.catalog.get_regular_files(path.path_id):
            name = file_names.parse(f.name)
            position = dp.retinas[name.node_id].stub.QueryVisibility(
                rpb.QueryVisibilityRequest(file_id=f.file_id,
                                           rg_ids=[0] if f.num_row_group else [],
                                           timestamp=ts, trans_id=trans_id),
                timeout=10).first_block_id
            out[(name.node_id, name.vnode)].append((position, f))
    finally:
        end(dp, trans_id)
    return {k: [f for _p, f in sorted(v, key=lambda pf: pf[0])] for k, v in out.items()}


def regular_ids(dp: DataPlane, table: str) -> set[int]:
    """Ids of the table's REGULAR files (the catalog alone: no order needed)."""
    path = dp.catalog.get_paths(dp.tables[table].table_id)[0]
    return {f.file_id for f in dp.catalog.get_regular_files(path.path_id)}


def begin_read(dp: DataPlane) -> int:
    # MarkReady returns before the gate's watch sees READY: wait for the gate first.
    eventually(dp.gate_open, 15, "the query gate to admit")
    return dp.trans.stub().BeginTrans(tpb.BeginTransRequest(read_only=True),
                                      timeout=10).trans_id


def end(dp: DataPlane, trans_id: int) -> None:
    dp.trans.stub().CommitTrans(tpb.CommitTransRequest(trans_id=trans_id), timeout=10)


def replay_floor(dp: DataPlane, node: str) -> int:
    """The node's replay floor after its last checkpoint, from the ``replay_floor_observed``
    lines its current process logged (0: none yet)."""
    log = dp.retinas[node].log_path
    started = [e["timestamp"] for e in logged_events(log, "retina_server_started")]
    events = [e for e in logged_events(log, "replay_floor_observed")
              if not started or e["timestamp"] >= started[-1]]
    return int(events[-1]["replay_floor_ts"]) if events else 0


def raise_replay_floor(dp: DataPlane, nodes: list[str] | None = None,
                       above: int | None = None, timeout_s: float = 60) -> None:
    """GC_CUTOFF_BELOW_REPLAY_FLOOR: a rewrite drops the rows deleted at or below ``above``
    only once its node's replay floor is above it. ``above`` defaults to the safeGcTs the
    plane's last source transaction allowed (its timestamp - 1: what the rewrites of a
    test drop). A checkpoint starts at most at HWM - 1, so the HWM is first moved two past
    ``above`` if it is not (a write transaction that writes nothing, rolled back); then
    each node whose floor is not above ``above`` yet checkpoints (CreateCheckpoint) until
    it is: both slots start above it once every row written at or below it is
    published."""
    stub = dp.trans.stub()
    if above is None:
        above = max(dp.changelog[-1][0] - 1 if dp.changelog else 0, 1)
    hwm = stub.GetHighWatermark(tpb.GetHighWatermarkRequest(), timeout=10).high_watermark
    for _ in range(above + 2 - hwm):
        empty = stub.BeginTrans(tpb.BeginTransRequest(), timeout=10)
        stub.RollbackTrans(tpb.RollbackTransRequest(trans_id=empty.trans_id), timeout=10)
    for node in nodes or dp.nodes:
        def passed(node: str = node) -> bool:
            if replay_floor(dp, node) > above:
                return True
            dp.checkpoint(node)
            return replay_floor(dp, node) > above
        eventually(passed, timeout_s, lambda node=node: f"the replay floor of {node} "
                   f"({replay_floor(dp, node)}) to pass {above}", interval_s=0.1)


def prepare(dp: DataPlane, node: str, table: str, vnode: int, old: list[FileRecord],
            trans_id: int | None = None, raise_floor: bool = True) -> Prepared:
    """PrepareGcRewrite at safeGcTs. With ``raise_floor``, the node's replay floor is first
    raised above the safeGcTs of the plane's last source transaction (checkpoints only if
    it is not yet), so the cutoff drops every row deleted before that transaction."""
    trans_id = trans_id or begin_read(dp)
    if raise_floor:
        raise_replay_floor(dp, [node])
    safe = dp.trans.stub().GetSafeGcTimestamp(tpb.GetSafeGcTimestampRequest(),
                                              timeout=10).safe_gc_ts
    reply = dp.retinas[node].stub.PrepareGcRewrite(rpb.PrepareGcRewriteRequest(
        schema_name=SCHEMA, table_name=table, virtual_node_id=vnode,
        old_file_ids=[f.file_id for f in old], safe_gc_ts=safe, trans_id=trans_id), timeout=30)
    return Prepared(node, table, vnode, old, reply, trans_id)


def write_new_file(dp: DataPlane, p: Prepared, row_group_rows: int = 50,
                   footer_rewrite_id: str | None = None) -> int:
    """Read the old files, drop rows deleted at the cutoff, write and register the new
    file (TEMPORARY_GC); returns its file id. ``footer_rewrite_id``: the rewrite its footer
    names (default: its own)."""
    stub = dp.retinas[p.node].stub
    parts = []
    for f in p.old:
        vis = stub.QueryVisibility(rpb.QueryVisibilityRequest(
            file_id=f.file_id, timestamp=p.reply.cutoff_ts, trans_id=p.trans_id), timeout=30)
        parquet = open_parquet(p.reply.path_uri, f.name)
        for rg in vis.row_groups:
            rows = parquet.read_row_group(rg.rg_id)
            bits = np.unpackbits(np.frombuffer(rg.deleted_bitmap, dtype=np.uint8),
                                 bitorder="little")[:rg.row_count].astype(bool)
            parts.append(rows.filter(pa.array(~bits)))
    schema = open_parquet(p.reply.path_uri, p.old[0].name).schema_arrow
    table = pa.concat_tables(parts) if parts else schema.empty_table()
    assert table.num_rows == p.reply.expected_rows
    # The job's own footer keys (spark_jobs/storage_gc_task.py _rewrite): recovery reads
    # ``retina.gc_rewrite_id`` to tell a GC output from an ingest file.
    table = table.cast(new_file_schema(schema, {
        "node": p.node, "vnode": str(p.vnode),
        "gc_rewrite_id": p.reply.rewrite_id if footer_rewrite_id is None else footer_rewrite_id,
        "gc_cutoff_ts": str(p.reply.cutoff_ts),
        "gc_old_file_ids": ",".join(str(f.file_id) for f in p.old)}))
    sink = io.BytesIO()
    pq.write_table(table, sink, row_group_size=row_group_rows)
    record = dp.catalog.add_file(p.reply.file_name, FileType.TEMPORARY_GC,
                                 pq.ParquetFile(io.BytesIO(sink.getvalue())).num_row_groups,
                                 p.reply.path_id)
    write_durably(p.reply.path_uri, p.reply.file_name, sink.getvalue())
    return record.file_id


def commit(dp: DataPlane, p: Prepared, new_file_id: int) -> rpb.CommitGcRewriteResponse:
    return dp.retinas[p.node].stub.CommitGcRewrite(rpb.CommitGcRewriteRequest(
        rewrite_id=p.reply.rewrite_id, new_file_id=new_file_id), timeout=60)


def rewrite(dp: DataPlane, node: str, table: str, vnode: int, old: list[FileRecord],
            row_group_rows: int = 50) -> rpb.CommitGcRewriteResponse:
    p = prepare(dp, node, table, vnode, old)
    try:
        return commit(dp, p, write_new_file(dp, p, row_group_rows))
    finally:
        end(dp, p.trans_id)


def journal(dp: DataPlane, node: str) -> dict[str, rpb.GcJournalEntry]:
    reply = dp.retinas[node].stub.GetGcStatus(rpb.GetGcStatusRequest(), timeout=10)
    return {e.rewrite_id: e for e in reply.entries}


def regular_rows(dp: DataPlane, table: str) -> int:
    path = dp.catalog.get_paths(dp.tables[table].table_id)[0]
    return sum(open_parquet(path.uri, f.name).metadata.num_rows
               for f in dp.catalog.get_regular_files(path.path_id))
