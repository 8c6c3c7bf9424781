"""TransServer benchmark: gated read-only BeginTrans latency and write throughput.

Starts a private cluster (etcd, PostgreSQL, TransServer; durable settings),
marks every expected Retina node READY through the lifecycle keys, then
measures over loopback gRPC:

* gated read-only BeginTrans latency, p50/p99/max (sequential client);
* the gate decision alone (``trans_gate_decision_seconds`` from /metrics);
* write BeginTrans + CommitTrans pairs per second, 1 and N client threads;
* BeginTransBatch + CommitTransBatch of 100 transactions;
* the stack's floor: the same client against a TransService whose BeginTrans
  returns a constant (a grpcio Python server in a process of its own), measured
  the same way right after, so the gated figure can be read against what
  loopback gRPC in Python costs on this machine at this moment.

Prints figures and the machine they ran on; asserts nothing.

    make bench            # or: .venv/bin/python bench/bench_trans.py --reads 5000
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import platform
import shutil
import statistics
import tempfile
import threading
import time
from pathlib import Path

import grpc
import requests

from devtools.cluster import free_port, start_cluster, stop_cluster, wait_for
from retina_common.etcd import EtcdStore
from retina_common.keys import lifecycle_key
from retina_common.lifecycle_record import LifecycleRecord, LifecycleState
from retina_common.log import configure_logging
from retina_common.pb import trans_pb2 as tpb
from retina_common.pb import trans_pb2_grpc


def percentile(samples: list[float], pct: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, round(pct / 100 * (len(ordered) - 1)))]


def gate_decision_quantiles(metrics_url: str) -> str:
    text = requests.get(metrics_url, timeout=5).text
    buckets = []
    total = 0.0
    for line in text.splitlines():
        if line.startswith("trans_gate_decision_seconds_bucket"):
            le = line.split('le="')[1].split('"')[0]
            buckets.append((float("inf") if le == "+Inf" else float(le), float(line.split()[-1])))
        elif line.startswith("trans_gate_decision_seconds_count"):
            total = float(line.split()[-1])
    if not total:
        return "n/a"
    def bound(q: float) -> str:
        for le, count in buckets:
            if count >= q * total:
                return f"<= {le * 1e6:.0f} us" if le != float("inf") else "> 10 ms"
        return "n/a"
    return f"p50 {bound(0.5)}, p99 {bound(0.99)} (histogram buckets, server side)"


def sequential_begins(stub: trans_pb2_grpc.TransServiceStub,
                      calls: int) -> tuple[list[float], list[int]]:
    """Latencies (ms) and transaction ids of ``calls`` read-only BeginTrans, one after
    another (after 200 of warm-up, whose ids are among those returned)."""
    ids = [stub.BeginTrans(tpb.BeginTransRequest(read_only=True)).trans_id
           for _ in range(200)]
    latencies = []
    for _ in range(calls):
        t0 = time.perf_counter()
        r = stub.BeginTrans(tpb.BeginTransRequest(read_only=True))
        latencies.append((time.perf_counter() - t0) * 1000)
        ids.append(r.trans_id)
    return latencies, ids


class _ConstantBegin(trans_pb2_grpc.TransServiceServicer):
    def BeginTrans(self, request: tpb.BeginTransRequest,
                   context: grpc.ServicerContext) -> tpb.BeginTransResponse:
        return tpb.BeginTransResponse(trans_id=1, timestamp=1, lease_expires_at_ms=1)


def _serve_constant(address: str) -> None:
    from concurrent import futures
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=16))
    trans_pb2_grpc.add_TransServiceServicer_to_server(_ConstantBegin(), server)
    server.add_insecure_port(address)
    server.start()
    server.wait_for_termination()


def stack_floor(calls: int) -> str:
    """The same measurement against a server that does nothing."""
    address = f"127.0.0.1:{free_port()}"
    process = multiprocessing.get_context("spawn").Process(target=_serve_constant,
                                                           args=(address,), daemon=True)
    process.start()
    try:
        channel = grpc.insecure_channel(address)
        grpc.channel_ready_future(channel).result(timeout=30)
        latencies, _ = sequential_begins(trans_pb2_grpc.TransServiceStub(channel), calls)
        channel.close()
    finally:
        process.kill()
        process.join()
    return (f"p50 {statistics.median(latencies):.3f} ms, p99 {percentile(latencies, 99):.3f} ms,"
            f" max {max(latencies):.3f} ms")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reads", type=int, default=5000)
    parser.add_argument("--writes", type=int, default=5000)
    parser.add_argument("--threads", type=int, default=4)
    args = parser.parse_args()
    configure_logging("bench", "warning")
    state_dir = Path(tempfile.mkdtemp(prefix="retina-bench-"))
    print(f"setup: {platform.platform()}, {os.cpu_count()} cores, Python "
          f"{platform.python_version()}, grpcio {grpc.__version__}, loopback gRPC, "
          "one TransServer process, etcd and PostgreSQL on the same machine")
    state = start_cluster(state_dir, log=lambda _m: None)
    try:
        etcd = EtcdStore([state.etcd.endpoint])
        for node in state.nodes:
            record = LifecycleRecord(LifecycleState.READY, node, None, 1, "",
                                     int(time.time() * 1000) + 3_600_000)
            etcd.put(lifecycle_key(node), record.to_json())
        channel = grpc.insecure_channel(state.trans_listen)
        stub = trans_pb2_grpc.TransServiceStub(channel)

        def admitted() -> bool:
            stub.BeginTrans(tpb.BeginTransRequest(read_only=True), timeout=5)
            return True

        wait_for(admitted, 10, "the gate to admit")
        latencies, ids = sequential_begins(stub, args.reads)
        for chunk in range(0, len(ids), 1000):
            stub.CommitTransBatch(tpb.CommitTransBatchRequest(trans_ids=ids[chunk:chunk + 1000]))
        print(f"gated read-only BeginTrans ({args.reads} calls, sequential): "
              f"p50 {statistics.median(latencies):.3f} ms, p99 {percentile(latencies, 99):.3f} ms,"
              f" max {max(latencies):.3f} ms")
        print(f"gate decision alone: {gate_decision_quantiles(f'http://{state.trans_metrics}/metrics')}")
        print(f"stack floor, a BeginTrans that returns a constant: {stack_floor(args.reads)}")

        def write_pairs(n: int) -> None:
            own = trans_pb2_grpc.TransServiceStub(grpc.insecure_channel(state.trans_listen))
            for _ in range(n):
                w = own.BeginTrans(tpb.BeginTransRequest())
                own.CommitTrans(tpb.CommitTransRequest(trans_id=w.trans_id))

        for threads in (1, args.threads):
            per_thread = args.writes // threads
            workers = [threading.Thread(target=write_pairs, args=(per_thread,))
                       for _ in range(threads)]
            t0 = time.perf_counter()
            for w in workers:
                w.start()
            for w in workers:
                w.join()
            elapsed = time.perf_counter() - t0
            print(f"write BeginTrans+CommitTrans, {threads} client thread(s): "
                  f"{per_thread * threads / elapsed:,.0f} transactions/s")

        batches = max(1, args.writes // 100)
        t0 = time.perf_counter()
        for _ in range(batches):
            batch = stub.BeginTransBatch(tpb.BeginTransBatchRequest(count=100))
            stub.CommitTransBatch(tpb.CommitTransBatchRequest(
                trans_ids=[t.trans_id for t in batch.transactions]))
        elapsed = time.perf_counter() - t0
        print(f"write BeginTransBatch(100)+CommitTransBatch: {batches * 100 / elapsed:,.0f} "
              "transactions/s")
        channel.close()
    finally:
        stop_cluster(state, log=lambda _m: None)
        shutil.rmtree(state_dir, ignore_errors=True)


if __name__ == "__main__":
    main()
