"""What the write fence costs (retina_server/write_fence.py), in one process.

Every ordinary UpdateRecord passes ``WriteFence.admit`` under its stream locks, and every
read RPC, GC prepare, fold and checkpoint calls ``raise_to``. This times both, alone and
with writer threads admitting concurrently (the node's gRPC pool runs requests on up to 16
threads), so the figures can be set against an UpdateRecord's own time
(bench/bench_dataplane.py, bench/bench_apply_stages.py). A refused write is recorded
durably before it is answered (retina_server/refused_writes.py): that record (one LMDB
write transaction, fsynced) and the replay's lookup of it are timed too, on a primary
index in a temporary directory. Prints figures; asserts nothing.

    .venv/bin/python bench/bench_write_fence.py --ops 200000 --threads 4
"""

from __future__ import annotations

import argparse
import contextlib
import os
import platform
import tempfile
import threading
import time
from pathlib import Path

from retina_common.log import configure_logging
from retina_common.refusal import Refusal
from retina_server.primary_index import PrimaryIndex
from retina_server.refused_writes import RefusedWrites
from retina_server.write_fence import WriteFence


def per_op_ns(fn: object, ops: int) -> float:
    started = time.perf_counter_ns()
    for i in range(ops):
        fn(i)  # type: ignore[operator]
    return (time.perf_counter_ns() - started) / ops


def admit_once(fence: WriteFence, ts: int) -> None:
    with fence.admit(ts):
        pass


def contended(fence: WriteFence, threads: int, ops: int) -> float:
    """ns per admit while ``threads`` threads admit at once (wall time / all admits)."""
    start = threading.Barrier(threads + 1)

    def writer(base: int) -> None:
        start.wait()
        for i in range(ops):
            admit_once(fence, base + i)

    workers = [threading.Thread(target=writer, args=(10**9 * (n + 1),)) for n in range(threads)]
    for w in workers:
        w.start()
    started = time.perf_counter_ns()
    start.wait()
    for w in workers:
        w.join()
    return (time.perf_counter_ns() - started) / (threads * ops)


def refusal_records(ops: int) -> tuple[float, float]:
    """ns per durable refusal record, and per replay lookup of one."""
    with tempfile.TemporaryDirectory() as work:
        index = PrimaryIndex(Path(work) / "primary.lmdb", map_size=1 << 28)
        try:
            refused = RefusedWrites(index)
            record = per_op_ns(lambda i: refused.record("bench", [i + 1]), ops)
            lookup = per_op_ns(lambda i: refused.skips(i % ops + 1), ops * 100)
        finally:
            index.close()
    return record, lookup


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ops", type=int, default=200_000)
    parser.add_argument("--threads", type=int, default=4)
    args = parser.parse_args()
    configure_logging("bench", "error")  # the refused admits would log a WARN each
    print(f"setup: {platform.python_implementation()} {platform.python_version()}, "
          f"{os.cpu_count()} cores, {platform.system()} {platform.release()}; "
          f"{args.ops} ops per figure")
    fence = WriteFence("bench")
    admit = per_op_ns(lambda i: admit_once(fence, 10**12 + i), args.ops)
    fence_raise = per_op_ns(lambda i: fence.raise_to(i, "bench"), args.ops)
    refused = WriteFence("bench")
    refused.raise_to(10**12, "bench")

    def refuse(i: int) -> None:
        with contextlib.suppress(Refusal):  # the refusal is what is timed
            admit_once(refused, i)

    refusal = per_op_ns(refuse, args.ops // 10)
    busy = contended(WriteFence("bench"), args.threads, args.ops // args.threads)
    record, lookup = refusal_records(max(args.ops // 200, 10))
    print(f"admit (a write passes the fence)       {admit:8.0f} ns")
    print(f"raise_to, nothing admitted (a read)     {fence_raise:8.0f} ns")
    print(f"admit refused (a late write, logged)   {refusal:8.0f} ns")
    print(f"admit, {args.threads} threads at once (per admit)  {busy:8.0f} ns")
    print(f"refusal recorded (LMDB put, fsync)     {record:8.0f} ns")
    print(f"replay lookup of a refusal             {lookup:8.0f} ns")


if __name__ == "__main__":
    main()
