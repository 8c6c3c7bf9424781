"""GrowingBlocks: a write-buffer block still growing is read as one table that grows with
it (pure logic): always every batch appended so far, in order, however reads and appends
interleave, and only the newest blocks are kept."""

from __future__ import annotations

import random

import pyarrow as pa

from retina_server.row_lookup import GrowingBlocks
from retina_server.visibility import RGVisibility
from retina_server.write_buffer import Block

SCHEMA = pa.schema([("id", pa.int64()), ("note", pa.string()), ("_commit_ts", pa.int64())])


def batch(first: int, n: int) -> pa.RecordBatch:
    ids = list(range(first, first + n))
    return pa.RecordBatch.from_arrays(
        [pa.array(ids, pa.int64()), pa.array([f"n{i}" for i in ids]),
         pa.array([10 + i for i in ids], pa.int64())], schema=SCHEMA)


def block(rg_id: int) -> Block:
    return Block(block_id=rg_id, rg_id=rg_id, capacity=4096, visibility=RGVisibility(0))


def test_a_growing_block_reads_as_every_batch_appended_so_far() -> None:
    rng = random.Random(5)
    growing = GrowingBlocks(limit=3)
    blocks = {(file_id, rg): block(rg) for file_id in (7, 8) for rg in (0, 1)}
    written = dict.fromkeys(blocks, 0)
    for _ in range(300):
        key = rng.choice(list(blocks))
        for _append in range(rng.randint(0, 3)):  # one-row batches mostly, as CDC writes
            n = rng.choice([1, 1, 1, 2, 5])
            blocks[key].batches.append(batch(written[key], n))
            written[key] += n
        if not blocks[key].batches:
            continue
        table = growing.rows(key[0], blocks[key])
        assert table.num_rows == written[key]
        assert table.equals(pa.Table.from_batches(blocks[key].batches))
        assert all(column.num_chunks == 1 for column in table.columns)
    # Four blocks, three kept: the least recently read was dropped and reads whole again.
    assert len(growing._tables) == 3
