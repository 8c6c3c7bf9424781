"""The Arrow part of a Storage GC rewrite (spark_jobs/storage_gc.py, step 4): a file's
rows minus those its owner's visibility reports deleted, and the new file's schema
and bytes. Pure: no catalog, no RPC, no storage.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from retina_common.codec import COMMIT_TS, PARQUET_COMPRESSION
from retina_common.pb import retina_pb2 as rpb

META_PREFIX = "retina."  # the publisher's prefix for our own footer keys


def deleted_mask(bitmap: bytes, rows: int) -> np.ndarray:
    """RowGroupVisibility.deleted_bitmap (bit i, little-endian in each byte, set = row i
    deleted) as a boolean array of ``rows`` entries; missing trailing bytes are zeros."""
    bits = np.unpackbits(np.frombuffer(bitmap, dtype=np.uint8), bitorder="little")
    if bits.size < rows:
        bits = np.concatenate([bits, np.zeros(rows - bits.size, dtype=np.uint8)])
    return bits[:rows].astype(bool)


def deleted_count(visibility: rpb.QueryVisibilityResponse) -> tuple[int, int]:
    """(rows, deleted rows) of a file from its QueryVisibility answer."""
    rows = deleted = 0
    for g in visibility.row_groups:
        rows += g.row_count
        deleted += int(deleted_mask(g.deleted_bitmap, g.row_count).sum())
    return rows, deleted


class RewriteError(Exception):
    """A file does not match what its owner's visibility describes: the group fails."""


def surviving_rows(parquet: pq.ParquetFile, visibility: rpb.QueryVisibilityResponse,
                   what: str) -> tuple[pa.Table, int]:
    """The rows of one file its visibility does not report deleted, in file order
    (row group by row group, row by row), and how many were dropped."""
    by_rg = {g.rg_id: g for g in visibility.row_groups}
    count = parquet.metadata.num_row_groups
    if sorted(by_rg) != list(range(count)):
        raise RewriteError(f"{what}: {count} row groups, visibility for {sorted(by_rg)}")
    schema = parquet.schema_arrow
    parts, dropped = [], 0
    for rg in range(count):
        rows = parquet.read_row_group(rg)
        vis = by_rg[rg]
        if vis.row_count != rows.num_rows:
            raise RewriteError(f"{what}: row group {rg} has {rows.num_rows} rows, its "
                               f"visibility {vis.row_count}")
        deleted = deleted_mask(vis.deleted_bitmap, rows.num_rows)
        dropped += int(deleted.sum())
        parts.append(rows.filter(pa.array(~deleted)))
    table = pa.concat_tables(parts) if parts else schema.empty_table()
    return table, dropped


def new_file_schema(schema: pa.Schema, metadata: dict[str, str]) -> pa.Schema:
    """The old files' columns, ``_commit_ts`` included, with this rewrite's own footer keys
    (an old file's keys, such as its first block id, would be wrong for the new one)."""
    if COMMIT_TS not in schema.names:
        raise RewriteError(f"the files have no {COMMIT_TS} column")
    return schema.remove_metadata().with_metadata(
        {f"{META_PREFIX}{k}": v for k, v in metadata.items()})


def encode_parquet(rows: pa.Table, schema: pa.Schema, row_group_rows: int) -> bytes:
    """One Parquet file of ``rows``. No rows at all (every row deleted) make a file with
    no row group: the node refuses an empty row group."""
    sink = pa.BufferOutputStream()
    # The ingest publisher's codec: a rewrite never stores the same rows in more bytes.
    with pq.ParquetWriter(sink, schema, compression=PARQUET_COMPRESSION) as writer:
        if rows.num_rows:
            writer.write_table(rows.cast(schema), row_group_size=row_group_rows)
    return sink.getvalue().to_pybytes()


