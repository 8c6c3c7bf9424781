"""What history costs (docs/history.md), in one process: checkpoint bytes, node memory, the
time map.

A retained delete is one deletion-chain item (row, ts) until a fold passes it: in the
node's memory (``RGVisibility``'s chain) and in every checkpoint (the chain up to
checkpointAppliedTs, varint-encoded: retina_common/checkpoint_store.py). This prints,
for a row group of ``--rows`` rows and several deleted fractions:

* the checkpoint's bits per row with the deletes folded into the base (no history
  kept), and with all of them as chain items (history kept), and per chain item;
* encode and decode time per million chain items;
* the node's memory per chain item (tracemalloc);
* the time map's bytes per sample (trans_gate/time_map.py).

Deletes arrive ``--per-ts`` rows to a transaction at consecutive timestamps, rows
anywhere in the row group (CDC updates). Prints figures; asserts nothing.

    .venv/bin/python bench/bench_history.py --rows 1000000
"""

from __future__ import annotations

import argparse
import platform
import random
import time
import tracemalloc

from pyroaring import BitMap

from retina_common.checkpoint_store import decode_chain, encode_chain
from retina_server.visibility import RGVisibility
from trans_gate.time_map import Chunk, encode_chunk


def deletes(rows: int, fraction: float, per_ts: int, seed: int = 1) -> list[tuple[int, int]]:
    """(ts, row) items: ``fraction`` of the rows deleted, ``per_ts`` a transaction."""
    doomed = random.Random(seed).sample(range(rows), int(rows * fraction))
    return [(1000 + i // per_ts, row) for i, row in enumerate(doomed)]


def checkpoint_bits(rows: int, chain: list[tuple[int, int]]) -> tuple[float, float, float]:
    """(bits per row folded, bits per row with the chain, bytes per chain item)."""
    folded = len(BitMap(r for _t, r in chain).serialize()) + 8  # + the empty chain's header
    kept = len(BitMap().serialize()) + len(encode_chain(999, chain))
    return folded * 8 / rows, kept * 8 / rows, kept / max(len(chain), 1)


def codec_seconds_per_million(chain: list[tuple[int, int]], rows: int) -> tuple[float, float]:
    decode_chain(999, rows, encode_chain(999, chain[:100]))  # numpy's first-call costs
    started = time.perf_counter()
    data = encode_chain(999, chain)
    encoded = time.perf_counter()
    decode_chain(999, rows, data)
    done = time.perf_counter()
    scale = 1_000_000 / max(len(chain), 1)
    return (encoded - started) * scale, (done - encoded) * scale


def memory_per_item(rows: int, chain: list[tuple[int, int]]) -> float:
    by_ts: dict[int, list[int]] = {}
    for ts, row in chain:
        by_ts.setdefault(ts, []).append(row)
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    rg = RGVisibility(row_count=rows)
    for ts, batch in by_ts.items():
        rg.delete(batch, ts)
    after = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    return (after - before) / max(len(chain), 1)


def time_map_bytes_per_sample(samples: int, commits_per_s: int) -> float:
    walls = [1_800_000_000_000 + 100 * i for i in range(samples)]
    hwms = [10**9 + i * commits_per_s // 10 for i in range(samples)]
    return len(encode_chunk(Chunk(walls[0], 0, walls, hwms, walls[-1]))) / samples


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1_000_000, help="rows of the row group")
    parser.add_argument("--per-ts", type=int, default=10, help="deletes per transaction")
    args = parser.parse_args()
    print(f"bench_history: {platform.python_implementation()} {platform.python_version()}, "
          f"{args.rows:,} rows, {args.per_ts} deletes a transaction")
    print(f"{'deleted':>8} {'items':>10} {'folded b/row':>13} {'history b/row':>14} "
          f"{'B/item':>7} {'encode s/M':>11} {'decode s/M':>11}")
    for fraction in (0.001, 0.01, 0.1, 0.5):
        chain = deletes(args.rows, fraction, args.per_ts)
        folded, kept, per_item = checkpoint_bits(args.rows, chain)
        enc, dec = codec_seconds_per_million(chain, args.rows)
        print(f"{fraction:>8.1%} {len(chain):>10,} {folded:>13.3f} {kept:>14.3f} "
              f"{per_item:>7.2f} {enc:>11.2f} {dec:>11.2f}")
    sample = deletes(args.rows, 0.01, args.per_ts)
    print(f"node memory per chain item: {memory_per_item(args.rows, sample):.0f} bytes "
          f"({len(sample):,} items)")
    for rate in (10, 1000, 100_000):
        print(f"time map at {rate:,} commits/s, a sample every 100 ms: "
              f"{time_map_bytes_per_sample(64, rate):.2f} bytes a sample")


if __name__ == "__main__":
    main()
