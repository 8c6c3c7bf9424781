"""IngestFileMetadataRegistry: ingest-path metadata of this node's published files.

The catalog does not hold ``tableId, virtualNodeId, firstBlockId,
fileMinCommitTs, fileMaxCommitTs`` (specification C01.1): this registry
is their runtime source of truth, the checkpoint body their cross-process one.

Lifecycle rules:

* ``register`` is called synchronously right after the catalog REGULAR commit
  of the file returns (by the stream publisher);
* ``unregister`` right after RETIRED marking returns;
* REGISTRY_COVERS_VISIBILITY: every file id in the visibility index is
  registered; a miss is a publisher/retire ordering bug and fails closed;
* never exposed over RPC.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass


class RegistryError(Exception):
    """A registry rule was broken (fail closed)."""


@dataclass(frozen=True)
class IngestFileMeta:
    file_id: int
    table_id: int
    virtual_node_id: int
    first_block_id: int
    file_min_commit_ts: int
    file_max_commit_ts: int
    # What cleansing cross-checks against the catalog row.
    record_num: int = 0
    min_row_id: int = 0
    max_row_id: int = 0
    num_row_group: int = 0
    block_count: int = 0


class IngestFileMetadataRegistry:
    def __init__(self) -> None:
        self._by_file: dict[int, IngestFileMeta] = {}
        self._by_stream: dict[tuple[int, int], dict[int, IngestFileMeta]] = {}
        self._lock = threading.Lock()

    def register(self, meta: IngestFileMeta) -> None:
        with self._lock:
            existing = self._by_file.get(meta.file_id)
            if existing is not None:
                if existing != meta:
                    raise RegistryError(f"file {meta.file_id} registered with other metadata")
                return  # a retried publish
            self._by_file[meta.file_id] = meta
            stream = self._by_stream.setdefault((meta.table_id, meta.virtual_node_id), {})
            stream[meta.file_id] = meta

    def unregister(self, file_id: int) -> None:
        with self._lock:
            meta = self._by_file.pop(file_id, None)
            if meta is not None:
                self._by_stream[(meta.table_id, meta.virtual_node_id)].pop(file_id, None)

    def get(self, file_id: int) -> IngestFileMeta:
        meta = self._by_file.get(file_id)
        if meta is None:
            raise RegistryError(f"file {file_id} is not in the ingest registry")
        return meta

    def __contains__(self, file_id: object) -> bool:
        return file_id in self._by_file

    def stream_files(self, table_id: int, vnode: int) -> list[IngestFileMeta]:
        """A stream's published files in firstBlockId order."""
        with self._lock:
            files = list(self._by_stream.get((table_id, vnode), {}).values())
        return sorted(files, key=lambda m: m.first_block_id)

    def stream_keys(self) -> set[tuple[int, int]]:
        """Every stream ``(tableId, virtualNodeId)`` with a registered file."""
        with self._lock:
            return {k for k, files in self._by_stream.items() if files}

    def all(self) -> list[IngestFileMeta]:
        with self._lock:
            return sorted(self._by_file.values(), key=lambda m: m.file_id)
