"""Checkpoint generation: the body of a running node (specification C04.1).

The format and the two-slot store are in retina_common/checkpoint_store.py.

``build_body`` takes the body from a running node: per stream, one consistent
cut of the registry and the write buffer. Streams that exist only in the
registry (a table not written since this process started: a *cold* stream)
are walked too. Invariant CHECKPOINT_COVERS_REGISTRY, checked on every body:
every file registered when generation began is in the body; a miss is
refused (and the node fails closed), never installed, because the next
start would retire the missing file as a catalog-only REGULAR file.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from retina_common.checkpoint_store import (
    CheckpointBody,
    CheckpointHeader,
    CheckpointIncomplete,
    FileEntry,
    RGEntry,
)
from retina_common.replay_ts import IngestSegment, SegmentKind
from retina_server.visibility import checkpoint_entry
from retina_server.write_buffer import FileState

if TYPE_CHECKING:
    from retina_server.node import RetinaNode
    from retina_server.registry import IngestFileMeta


def build_body(node: RetinaNode, applied_ts: int, checkpoint_id: int,
               writer_epoch: int) -> CheckpointBody:
    """The body of a checkpoint at ``applied_ts`` (see the module docstring)."""
    registered = {meta.file_id for meta in node.registry.all()}
    files: list[FileEntry] = []
    segments: list[IngestSegment] = []
    rgs: list[RGEntry] = []
    streams = node.all_streams()
    for stream in streams:
        # One consistent cut per stream: a file moving from the write buffer to
        # the registry is in exactly one of them.
        with stream.publisher.lock, stream.buffer.lock:
            for meta in node.registry.stream_files(stream.table.table_id, stream.vnode):
                _admitted(node, meta, applied_ts, files, segments, rgs)
            for f in stream.buffer.files:
                if f.file_id in node.registry:
                    continue
                kind = SegmentKind.OPEN if f.state == FileState.OPEN else SegmentKind.PENDING
                segments.append(IngestSegment(
                    f.table_id, f.vnode, kind, f.file_id, f.first_block_id, len(f.blocks),
                    f.row_count, f.min_commit_ts or 0, f.max_commit_ts or 0))
    live = {(s.table.table_id, s.vnode) for s in streams}
    for table_id, vnode in sorted(node.registry.stream_keys() - live):
        # A cold stream: nothing buffered and no publisher, only its files.
        for meta in node.registry.stream_files(table_id, vnode):
            _admitted(node, meta, applied_ts, files, segments, rgs)
    # A file unregistered meanwhile (retired) is rightly absent; only a file that is
    # still registered and missing would be lost.
    still = {meta.file_id for meta in node.registry.all()}
    missing = (registered & still) - {f.file_id for f in files}
    if missing:
        raise CheckpointIncomplete(
            f"CHECKPOINT_COVERS_REGISTRY: registered files {sorted(missing)[:5]} are not in "
            f"checkpoint {checkpoint_id}; it is not installed")
    header = CheckpointHeader(node.node_id, checkpoint_id, writer_epoch,
                              int(time.time() * 1000), applied_ts, node.topology.topology_hash,
                              node.history.gaps())
    return CheckpointBody(header, files, segments, rgs)


def _admitted(node: RetinaNode, meta: IngestFileMeta, applied_ts: int, files: list[FileEntry],
              segments: list[IngestSegment], rgs: list[RGEntry]) -> None:
    files.append(FileEntry(meta.file_id, meta.table_id, meta.virtual_node_id,
                           meta.first_block_id, meta.file_min_commit_ts, meta.file_max_commit_ts,
                           meta.record_num, meta.min_row_id, meta.max_row_id,
                           meta.num_row_group))
    segments.append(IngestSegment(
        meta.table_id, meta.virtual_node_id, SegmentKind.ADMITTED, meta.file_id,
        meta.first_block_id, meta.block_count, meta.record_num, meta.file_min_commit_ts,
        meta.file_max_commit_ts))
    for rg_id in range(meta.num_row_group):
        # Its history too (the chain up to applied_ts): a restart answers AS OF reads.
        rgs.append(checkpoint_entry(meta.file_id, rg_id,
                                    node.visibility.get(meta.file_id, rg_id), applied_ts))
