"""Change-feed consumers at the TransServer: what they cost (docs/change-feed.md#consumers).

In one process against a private etcd (no gRPC), prints:

* write commits/s of the transaction table (begin + commit, one at a time), with an
  empty record of committed writes and with 1,000,000 already recorded (the counting
  behind ``lag_commits`` is an insort into an array of 8-byte timestamps);
* one housekeeping round over N consumers (``drop_lagging`` then ``all``: the lag of
  each in time and commits), for N = 10, 100, 1,000;
* what recording one commit costs alone, and the record's memory per commit.

Prints figures; asserts nothing.

    .venv/bin/python bench/bench_consumers.py [--commits 20000]
"""

from __future__ import annotations

import argparse
import platform
import tempfile
import time
from pathlib import Path

from devtools.cluster import start_etcd, terminate
from retina_common import failpoints
from retina_common.etcd import EtcdStore
from retina_common.keys import GC_HORIZON_KEY, TRANS_ID_KEY, TRANS_TIMESTAMP_KEY
from trans_gate.consumers import Consumers, ConsumerStore
from trans_gate.history import GcHorizon
from trans_gate.timestamps import DurableCounter
from trans_gate.transactions import TransactionTable, TransKind


def table_on(etcd: EtcdStore) -> TransactionTable:
    def counter(key: str) -> DurableCounter:
        c = DurableCounter(etcd, key, 100_000, failpoints.TRANS_TS_BLOCK_PERSIST_BEFORE,
                           failpoints.TRANS_TS_BLOCK_PERSIST_AFTER)
        c.open()
        return c
    horizon = GcHorizon(etcd, GC_HORIZON_KEY, failpoints.TRANS_HORIZON_PERSIST_BEFORE,
                        failpoints.TRANS_HORIZON_PERSIST_AFTER)
    horizon.load()
    return TransactionTable(counter(TRANS_TIMESTAMP_KEY), counter(TRANS_ID_KEY),
                            lambda: int(time.time() * 1000), write_lease_ms=60_000,
                            read_lease_ms=60_000, max_lease_ms=60_000, horizon=horizon)


def commits_per_s(t: TransactionTable, n: int) -> float:
    started = time.perf_counter()
    for _ in range(n):
        (w,) = t.begin(TransKind.WRITE)
        t.commit([w.trans_id])
    return n / (time.perf_counter() - started)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--commits", type=int, default=20_000)
    args = parser.parse_args()
    print(f"machine: {platform.processor() or platform.machine()}, "
          f"python {platform.python_version()}")
    with tempfile.TemporaryDirectory() as tmp:
        etcd_proc = start_etcd(Path(tmp) / "etcd", Path(tmp) / "etcd.log")
        try:
            etcd = EtcdStore([etcd_proc.endpoint])
            t = table_on(etcd)
            print(f"commits/s, record empty:       {commits_per_s(t, args.commits):,.0f}")
            recorded = t._committed_writes  # filled directly: a bench
            base = t.high_watermark()
            recorded.extend(range(base - 1_000_000, base))
            print(f"commits/s, 1,000,000 recorded: {commits_per_s(t, args.commits):,.0f}")
            n, nxt = 200_000, t.high_watermark() + 1
            started = time.perf_counter()
            for ts in range(nxt, nxt + n):
                t._record_committed(ts)  # the step a write commit adds, alone
            print(f"recording one commit: {(time.perf_counter() - started) / n * 1e9:.0f} ns")
            print(f"record: {recorded.itemsize} bytes a commit "
                  f"({len(recorded) * recorded.itemsize / 2**20:.1f} MiB now)")
            hwm = t.high_watermark()
            consumers = Consumers(ConsumerStore(etcd), t, lambda ts: int(time.time() * 1000)
                                  - 1000, 3_600_000)
            made = 0
            for n in (10, 100, 1000):
                for i in range(made, n):
                    consumers.register(f"c{i}", hwm - i)
                made = n
                rounds = 20
                started = time.perf_counter()
                for _ in range(rounds):
                    consumers.drop_lagging()
                    consumers.all()
                ms = (time.perf_counter() - started) / rounds * 1000
                print(f"housekeeping round, {n:>5} consumers: {ms:.2f} ms")
        finally:
            terminate(etcd_proc.pid)


if __name__ == "__main__":
    main()
