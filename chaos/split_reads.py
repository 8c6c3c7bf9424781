"""Readers racing Storage GC and restarts: one read split across a fault (issue 25,
sections 2 and 3).

Inside one gated read-only transaction at S: the reader's first step alone
(``SnapshotReader.fetch_buffers``: GetWriteBuffer on every node; a new transaction after a
workload step until some rows are buffered at S), then a full read of every table (the
reference, remembered like any snapshot); then, drawn:

- **across a GC commit**: the node holding most of the fetched buffered rows; once one of
  their files is published (REGULAR), a GC pass on that node aimed at the streams and runs
  holding those files (``GcDriver``'s focus), so that a file whose rows the reader holds
  from the buffer is rewritten into a new file;
- **across a restart**: that node SIGKILLed and restarted, READY again, and the rows it
  buffered at S published again by the replay;

then the rest of the same read (``list_files``, ``assemble``: ListQueryFiles, the files at
S, the buffered rows whose file is not listed). It must equal the reference or be refused
(counted by code); a key twice is ``snapshot_duplicates``, any other difference
``snapshot_changed`` (SNAPSHOT_IS_IMMUTABLE). The reference is read right after the fetch,
not before it: with the campaign's 400 ms flush interval a row stays buffered for about a
second, and a full read takes about as long.
"""

from __future__ import annotations

import signal
import time
from collections import Counter
from typing import TYPE_CHECKING

import grpc
import pyarrow as pa
import pyarrow.compute as pc

from devtools.cluster import node_state
from retina_common.catalog import Catalog, CatalogError, FileType
from retina_common.codec import COMMIT_TS
from retina_common.pb import retina_pb2 as rpb
from retina_common.pb import trans_pb2 as tpb
from retina_common.reader import FILE_ID

from .repeatable_reads import SnapshotBook
from .snapshots import (
    SPECS,
    ReadRefused,
    SnapshotReaders,
    TableImage,
    compare_taken,
    refusal_of,
    tables_taken,
)
from .stalls import wait_until
from .workload import SCHEMA

if TYPE_CHECKING:  # faults.py registers the fault; this module only fills its result
    from .faults import FaultContext, FaultResult

# The split read's transaction lives across a restart and its recovery.
SPLIT_LEASE_MS = 120_000
# New transactions (a workload step before each) until one sees buffered rows at its S.
BUFFERED_DEADLINE_S = 8.0
PUBLISH_DEADLINE_S = 10.0
READY_DEADLINE_S = 60.0
Buffers = dict[str, dict[str, pa.Table]]  # table -> node -> buffered rows (with _file_id)


def buffered_by_node(buffers: Buffers) -> Counter[str]:
    """Buffered rows fetched, per node (nodes with none left out)."""
    counts: Counter[str] = Counter()
    for by_node in buffers.values():
        counts.update({node: rows.num_rows for node, rows in by_node.items() if rows.num_rows})
    return counts


def buffered_files(buffers: Buffers, node: str) -> frozenset[int]:
    return frozenset(fid for by_node in buffers.values()
                     for fid in by_node[node].column(FILE_ID).to_pylist())


def split_read(ctx: FaultContext, result: FaultResult) -> None:
    """The split-read fault (module docstring); counts in ``result.reads``."""
    assert ctx.snapshots is not None
    book = ctx.snapshots
    how = ctx.rng.choice(["gc", "restart"])
    result.detail = f"across a {'GC commit' if how == 'gc' else 'restart'}"
    result.reads["split_reads"] += 1
    result.reads[f"split_{'gc' if how == 'gc' else 'kill'}"] += 1
    deadline = time.monotonic() + BUFFERED_DEADLINE_S
    while True:
        ctx.write()  # rows to be buffered when the reader fetches the buffers
        try:
            trans = book.readers.begin(SPLIT_LEASE_MS)
        except ReadRefused as exc:
            result.reads[f"split_refused_{exc.code}"] += 1
            return
        try:
            buffers = {t: book.readers.reader.fetch_buffers(trans, SCHEMA, t)
                       for t in tables_taken()}
        except grpc.RpcError as exc:
            result.reads[f"split_refused_{refusal_of(exc).code}"] += 1
            book.readers.end(trans.trans_id)
            return
        if buffered_by_node(buffers) or time.monotonic() >= deadline:
            break
        book.readers.end(trans.trans_id)
    _split_in(ctx, book, trans, buffers, how, result)


def _split_in(ctx: FaultContext, book: SnapshotBook, trans: tpb.BeginTransResponse,
              buffers: Buffers, how: str, result: FaultResult) -> None:
    reader = book.readers.reader
    try:
        reference = book.readers.read("gated", trans, tables_taken())
    except ReadRefused as exc:
        result.reads[f"split_refused_{exc.code}"] += 1
        book.readers.end(trans.trans_id)
        return
    # The book owns the transaction from here: the reference is read again once healed.
    first = book.adopt("split", trans, "at the start of a split read", reference)
    rows = buffered_by_node(buffers)
    if not rows:
        result.reads["split_nothing_buffered"] += 1
    node = rows.most_common(1)[0][0] if rows else ctx.node()
    result.detail += f" on {node} ({rows[node]} buffered rows fetched)"
    if how == "gc":
        between = _across_gc(ctx, node, buffered_files(buffers, node), result)
    else:
        between = _across_restart(ctx, node, trans.timestamp, result)
    try:
        split = {t: TableImage.of(reader.assemble(trans, buffers[t].values(),
                                                  reader.list_files(trans, SCHEMA, t))
                                  .table.to_pylist(), SPECS[t].pk) for t in tables_taken()}
    except Exception as exc:  # a status (refused) or a file unreadable
        refused = refusal_of(exc)
        result.reads[f"split_refused_{refused.code}"] += 1
        if refused.code == "ERROR":
            result.anomalies.append(f"snapshot_read_error: a split read: {refused.detail}")
        return
    found = compare_taken(first, split, "read again by the split read in the same "
                          "transaction", f"the buffers fetched, then {between}")
    if found:
        result.anomalies.append(found)
    outcome = found.partition(":")[0].removeprefix("snapshot_") if found else "identical"
    result.reads[f"split_{outcome}"] += 1  # split_identical, _duplicates or _changed


def _across_gc(ctx: FaultContext, node: str, files: frozenset[int],
               result: FaultResult) -> str:
    """A GC pass on ``node`` aimed at the fetched buffer files, once one is published."""
    assert ctx.cluster.state is not None
    catalog = Catalog(ctx.cluster.state.postgres.dsn(), pool_max=1)
    try:
        published = wait_until(lambda: bool(_of_type(catalog, files, FileType.REGULAR)),
                               PUBLISH_DEADLINE_S)
        done = ctx.gc_pass(node, result, max_groups=3, race=0.3, focus=files)
        rewritten = _of_type(catalog, files, FileType.RETIRED)
    finally:
        catalog.close()
    if rewritten:
        result.reads["split_gc_committed"] += 1
    what = (f"a GC pass on {node} ({done.counts['committed']} committed, fetched files "
            f"{sorted(rewritten)} rewritten; published in time: {published})")
    result.detail += f", {what}"
    return what


def _of_type(catalog: Catalog, files: frozenset[int], kind: FileType) -> set[int]:
    try:
        return {f for f in files if (r := catalog.get_file(f)) is not None and r.type == kind}
    except CatalogError:
        return set()


def _across_restart(ctx: FaultContext, node: str, ts: int, result: FaultResult) -> str:
    """SIGKILL ``node``, restart it; wait until READY and its rows at ``ts`` published."""
    ctx.kill(node, signal.SIGKILL)
    ctx.cluster.start_node(node)
    ready = wait_until(lambda: node_state(node) == rpb.READY, READY_DEADLINE_S)
    assert ctx.snapshots is not None
    readers = ctx.snapshots.readers
    published = ready and wait_until(lambda: _buffered_up_to(readers, node, ts) == 0,
                                     PUBLISH_DEADLINE_S)
    what = f"a SIGKILL of {node} and its recovery (READY {ready}, rows republished {published})"
    result.detail += f", {what}"
    return what


def _buffered_up_to(readers: SnapshotReaders, node: str, ts: int) -> int:
    """Rows committed at or before ``ts`` still in ``node``'s write buffer, under a fresh
    transaction (-1 if it cannot tell: the gate, a refusal)."""
    try:
        with readers.transaction() as trans:
            total = 0
            for table in tables_taken():
                rows = readers.reader.fetch_buffers(trans, SCHEMA, table)[node]
                if rows.num_rows:
                    total += pc.sum(pc.less_equal(rows.column(COMMIT_TS), ts)).as_py() or 0
            return total
    except (ReadRefused, grpc.RpcError):
        return -1
