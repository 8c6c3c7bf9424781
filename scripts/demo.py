"""``make demo``: start a private local cluster and run the product end to end.

1. etcd, PostgreSQL (catalog bootstrapped) and the TransServer come up on free ports.
2. Catalog: a table, an ingest file published TEMPORARY_INGEST → REGULAR, a GC
   rewrite swapped in with atomicSwapFiles, and a second swap refused.
3. Query gate: refused while the Retina nodes are missing, admitted once every
   node is READY, refused again when one node goes RECOVERING. ListQueryFiles
   returns REGULAR files only. (The lifecycle keys of this part are written by
   a stand-in heartbeat, clearly named as such: no Retina runs yet.)
4. HWM under out-of-order commits and rollbacks.
5. kill -9 of the TransServer: every timestamp after the restart is greater.
6. The main act (``demo_cdc.py``): a source PostgreSQL database with three
   tables, ``retina-cdc`` reading it by logical replication, two Retina nodes;
   a change workload, SIGKILL of one node in the middle of the stream, its
   restart, replay and MarkReady driven by the connector; then a gated
   snapshot of every table compared with the source, and a report.
7. Storage GC (``demo_gc.py``): the Spark job reclaims deleted and replaced rows and
   merges small files while the stream goes on; a SIGKILL of a Retina node in the
   middle of a commit, its recovery and the GC journal's decision; the snapshot
   compared with the source after each step.

Exits non-zero on any mismatch; ``--keep`` leaves the cluster running.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import sys
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import grpc
from demo_cdc import SCHEMA as CDC_SCHEMA  # scripts/ is on sys.path
from demo_cdc import TABLES as CDC_TABLES
from demo_cdc import cdc_pipeline
from demo_gc import KILL_POINT, gc_act

from devtools.cluster import (
    ClusterState,
    start_cluster,
    start_trans_server,
    stop_cluster,
    wait_for,
)
from devtools.standin import StandInLifecycle
from retina_common import file_names
from retina_common.catalog import Catalog, ColumnSpec, FileType, SwapPreconditionFailed
from retina_common.etcd import EtcdStore
from retina_common.lifecycle_record import LifecycleState
from retina_common.log import configure_logging
from retina_common.pb import trans_pb2 as tpb
from retina_common.pb import trans_pb2_grpc
from retina_common.tls import open_channel


class DemoFailure(Exception):
    pass


def check(condition: bool, what: str) -> None:
    if not condition:
        raise DemoFailure(what)
    print(f"  ok  {what}")


def step(title: str) -> None:
    print(f"\n== {title}")


def refused(call: Any) -> grpc.RpcError | None:
    try:
        call()
    except grpc.RpcError as exc:
        return exc
    return None


def run(state: ClusterState) -> dict[str, Any]:
    report: dict[str, Any] = {}
    catalog = Catalog(state.postgres.dsn())
    etcd = EtcdStore([state.etcd.endpoint])
    channel = open_channel(state.trans_listen)
    stub = trans_pb2_grpc.TransServiceStub(channel)

    step("catalog: publish an ingest file, swap in a GC rewrite")
    catalog.create_schema("shop")
    table = catalog.create_table("shop", "orders", [
        ColumnSpec("id", "int64"), ColumnSpec("customer", "string"),
        ColumnSpec("amount", "decimal(12,2)")], ["id"])
    path = catalog.add_path(table.table_id, f"file://{state.state_dir}/storage/shop/orders")
    node = "127.0.0.1:1"  # catalog rows only, no objects: named after no real node
    now = datetime.now(UTC)
    ingest = catalog.add_file(file_names.make(node, now, 1, 0), FileType.TEMPORARY_INGEST, 0,
                              path.path_id)
    published = catalog.update_file(ingest.file_id, file_type=FileType.REGULAR, num_row_group=1,
                                    min_row_id=0, max_row_id=999,
                                    expected_type=FileType.TEMPORARY_INGEST)
    check(published.type == FileType.REGULAR, f"file {ingest.file_id} published REGULAR")
    second = catalog.add_file(file_names.make(node, now, 2, 0), FileType.REGULAR, 1,
                              path.path_id, 1000, 1999)
    rewrite = catalog.add_file(file_names.make(node, now, 3, 0), FileType.TEMPORARY_GC, 1,
                               path.path_id, 2000, 2999)
    swapped = catalog.atomic_swap_files(rewrite.file_id, [ingest.file_id],
                                        cleanup_at=int(time.time() * 1000) + 60_000)
    check(swapped.new_file.type == FileType.REGULAR and
          swapped.retired_files[0].type == FileType.RETIRED,
          f"atomicSwapFiles: {rewrite.file_id} REGULAR, {ingest.file_id} RETIRED")
    late = catalog.add_file(file_names.make(node, now, 4, 0), FileType.TEMPORARY_GC, 1,
                            path.path_id, 3000, 3999)
    try:
        catalog.atomic_swap_files(late.file_id, [ingest.file_id], cleanup_at=1)
        raise DemoFailure("a swap over a RETIRED file was accepted")
    except SwapPreconditionFailed as exc:
        check(exc.precondition.value == "OLD_FILE_NOT_REGULAR",
              f"second swap refused: {exc.precondition.value}")
    regular_ids = sorted(f.file_id for f in catalog.get_regular_files(path.path_id))
    check(regular_ids == sorted([second.file_id, rewrite.file_id]),
          f"REGULAR files now {regular_ids}")

    step("query gate")
    err = refused(lambda: stub.BeginTrans(tpb.BeginTransRequest(read_only=True), timeout=5))
    check(err is not None and err.code() == grpc.StatusCode.UNAVAILABLE,
          f"read-only refused while no Retina node is READY: {err.details() if err else ''}")
    w = stub.BeginTrans(tpb.BeginTransRequest(read_only=False), timeout=5)
    stub.CommitTrans(tpb.CommitTransRequest(trans_id=w.trans_id), timeout=5)
    check(w.timestamp > 0, f"write transactions are not gated (ts {w.timestamp})")
    lifecycle = StandInLifecycle(etcd, state.nodes, refresh_s=2).start()
    print(f"  ..  stand-in lifecycle heartbeat: {', '.join(state.nodes)} READY")

    def admitted() -> bool:
        try:
            probe = stub.BeginTrans(tpb.BeginTransRequest(read_only=True), timeout=5)
        except grpc.RpcError:
            return False
        # Ended at once: a live read pins the safe GC timestamp (the GC act needs it free).
        stub.CommitTrans(tpb.CommitTransRequest(trans_id=probe.trans_id), timeout=5)
        return True

    wait_for(admitted, 10, "the gate to admit")
    reader = stub.BeginTrans(tpb.BeginTransRequest(read_only=True), timeout=5)
    files = stub.ListQueryFiles(tpb.ListQueryFilesRequest(
        trans_id=reader.trans_id, schema_name="shop", table_name="orders"), timeout=5)
    listed = sorted(f.file_id for f in files.files)
    check(listed == regular_ids, f"ListQueryFiles at snapshot {files.snapshot_ts}: {listed} "
                                 "(TEMPORARY_GC and RETIRED files hidden)")
    lifecycle.set(state.nodes[1], LifecycleState.RECOVERING)
    wait_for(lambda: not admitted(), 10, "the gate to close")
    err = refused(lambda: stub.BeginTrans(tpb.BeginTransRequest(read_only=True), timeout=5))
    check(err is not None and "RECOVERING" in err.details(), f"refused: {err.details()}")
    err = refused(lambda: stub.ListQueryFiles(tpb.ListQueryFilesRequest(
        trans_id=reader.trans_id, schema_name="shop", table_name="orders"), timeout=5))
    check(err is not None and err.code() == grpc.StatusCode.UNAVAILABLE,
          "planning under an earlier read is refused too")
    lifecycle.set(state.nodes[1], LifecycleState.READY)
    wait_for(admitted, 10, "the gate to reopen")
    check(True, "admitted again once every node is READY")
    stub.CommitTrans(tpb.CommitTransRequest(trans_id=reader.trans_id), timeout=5)

    step("high watermark under out-of-order commits")
    t1, t2, t3 = (stub.BeginTrans(tpb.BeginTransRequest(), timeout=5) for _ in range(3))
    h = stub.CommitTrans(tpb.CommitTransRequest(trans_id=t3.trans_id)).high_watermark
    check(h == t1.timestamp - 1, f"commit ts {t3.timestamp}: HWM stays {h}")
    h = stub.RollbackTrans(tpb.RollbackTransRequest(trans_id=t1.trans_id)).high_watermark
    check(h == t2.timestamp - 1, f"rollback ts {t1.timestamp}: HWM {h}")
    h = stub.CommitTrans(tpb.CommitTransRequest(trans_id=t2.trans_id)).high_watermark
    check(h == t3.timestamp, f"commit ts {t2.timestamp}: HWM {h}")

    step("kill -9 the TransServer and restart it")
    before = t3.timestamp
    os.kill(state.trans_pid, signal.SIGKILL)
    started = time.monotonic()
    start_trans_server(state)
    restart_s = time.monotonic() - started
    channel.close()
    channel = open_channel(state.trans_listen)
    stub = trans_pb2_grpc.TransServiceStub(channel)
    probe = stub.BeginTrans(tpb.BeginTransRequest(), timeout=5)
    stub.CommitTrans(tpb.CommitTransRequest(trans_id=probe.trans_id), timeout=5)
    after = probe.timestamp
    check(after > before, f"first timestamp after restart {after} > last before {before}")
    wait_for(admitted, 10, "the gate to admit after the restart")
    check(True, "the restarted gate admits from its fresh lifecycle watch")
    lifecycle.stop()
    channel.close()
    catalog.close()
    report.update(restart_s=restart_s, timestamps=(before, after))
    return report


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--state-dir", default=".retina-demo")
    parser.add_argument("--keep", action="store_true", help="leave the cluster running")
    args = parser.parse_args()
    configure_logging("demo", "warning")
    state_dir = Path(args.state_dir)
    old = ClusterState.load(state_dir)
    if old is not None:
        stop_cluster(old, log=lambda _msg: None)
    shutil.rmtree(state_dir, ignore_errors=True)
    print("== starting a private local cluster")
    t0 = time.monotonic()
    state = start_cluster(state_dir, virtual_nodes=8, log=lambda msg: print(f"  {msg}"))
    startup_s = time.monotonic() - t0
    code = 0
    try:
        report = run(state)
        step("CDC: source PostgreSQL -> retina-cdc -> two Retina nodes; SIGKILL one mid-stream")
        cdc = cdc_pipeline(state, check)
        step(f"Storage GC: Spark rewrites, then a SIGKILL at {KILL_POINT} mid-commit")
        gc = gc_act(state, check, CDC_SCHEMA, list(CDC_TABLES), cdc["more_writes"],
                    cdc["converged"])
        replay, start = cdc["replay"], cdc["replay_start"]
        rows = ", ".join(f"{n} {r}" for n, r in cdc["rows"].items())
        print(f"\n== report\n  cluster start {startup_s:.1f}s, TransServer restart "
              f"{report['restart_s']:.2f}s, timestamps {report['timestamps'][0]} -> "
              f"{report['timestamps'][1]}\n"
              f"  CDC: {cdc['transactions']} source transactions in {cdc['workload_s']:.1f}s; "
              f"rows now: {rows}\n"
              f"  crashed node: READY {cdc['ready_s']:.2f}s after its restart; replay "
              f"{replay['rows']} rows in {replay['requests']} requests, {replay['seconds']}s, "
              f"{start['mode']} mode, checkpoint {start['checkpoint_id']}, node start ts "
              f"{start['node_replay_from_ts']}, vnode starts {start['vnode_starts']}\n"
              f"  snapshot equal to the source {cdc['caught_up_s']:.2f}s after the last "
              f"source commit\n"
              f"  Storage GC: stored rows {gc['before']['rows']} -> {gc['after']['rows']}, "
              f"files {gc['before']['files']} -> {gc['after']['files']}, bytes "
              f"{gc['before']['bytes']:,} -> {gc['after']['bytes']:,} in {gc['seconds']:.1f}s; "
              f"after the crash and a second pass: {gc['final']['rows']} rows in "
              f"{gc['final']['files']} files; recovery decided: {gc['decision']}\n"
              f"  demo passed")
    except DemoFailure as exc:
        print(f"\nDEMO FAILED: {exc}", file=sys.stderr)
        code = 1
    finally:
        if args.keep and code == 0:
            print(f"\ncluster left running: export RETINA_CONFIG={state.config_path}\n"
                  f"stop it with: retina-cluster stop --state-dir {state_dir}")
        else:
            stop_cluster(state, log=lambda _msg: None)
    return code


if __name__ == "__main__":
    sys.exit(main())
