"""``retina-admin writers ...`` and ``retina-admin recover``: the replay sources
(``retina_common/replay_sources.py``) and a recovery driver that needs no connector.

    retina-admin writers list                    every registered writer and its changelog
    retina-admin writers gone WRITER --reason R  its changelog is lost: stop waiting for it
    retina-admin recover [--node N] [--mode vnode|node] [--wait S]

``recover`` drives every RECOVERING node (or the ``--node`` ones) to READY the way the
connector does: GetRecoveryReplayTs, the changelog of every ACTIVE replay source merged
in timestamp order from the node's starts, MarkReady naming them all. A cluster whose
writers are applications only (no ``retina-cdc``) is brought back with it.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

import grpc

from retina_common import exit_codes, replay_sources
from retina_common.admin_cluster import Cluster
from retina_common.changelog import ChangelogGap, CorruptChangelog
from retina_common.changelog_replay import (
    ReplayLog,
    changelog_rows,
    check_retained,
    merged_replay_requests,
    node_starts,
    registered_logs,
)
from retina_common.columnar import min_columnar_rows
from retina_common.pb import retina_pb2 as pb
from retina_common.recovery_driver import (
    GATE_WAIT_S,
    RecoveryFailed,
    await_gate_ready,
    drive_recovery,
)
from retina_common.replay_sources import ReplaySourceError

MODES = {"vnode": pb.VNODE, "node": pb.NODE}
# A recovery's requests: the connector's default (cdc.request_max_rows).
REQUEST_MAX_ROWS = 10_000


def add_parsers(sub: Any, common: argparse.ArgumentParser) -> None:
    writers = sub.add_parser("writers", help="registered replay sources (durable writers)"
                             ).add_subparsers(dest="writers_command", required=True)
    writers.add_parser("list", parents=[common], help="every writer, its state and changelog")
    s = writers.add_parser("gone", parents=[common],
                           help="declare a writer's changelog lost (nodes stop waiting for "
                                "its replay; its unreplayed rows are lost on a crash)")
    s.add_argument("writer", metavar="WRITER")
    s.add_argument("--reason", required=True, help="why: kept with the record")
    s = sub.add_parser("recover", parents=[common],
                       help="replay every registered writer into RECOVERING nodes, MarkReady")
    s.add_argument("--mode", choices=sorted(MODES), default="vnode")
    s.add_argument("--wait", type=float, default=60.0,
                   help="seconds to wait for a node's replay starts (default 60)")


def cmd_writers_list(cluster: Cluster, args: argparse.Namespace) -> int:
    sources = replay_sources.load(cluster.etcd())
    rows: list[dict[str, Any]] = [{"writer_id": s.writer_id, "kind": s.kind, "state": s.state.value,
             "schema": s.schema, "changelog_root": s.changelog_root,
             "registered_at_ms": s.registered_at_ms, "gone_at_ms": s.gone_at_ms,
             "gone_reason": s.gone_reason} for s in sorted(sources.values(),
                                                            key=lambda s: s.writer_id)]
    if args.json:
        print(json.dumps({"writers": rows}, indent=2))
        return exit_codes.OK
    if not rows:
        print("no registered writers (nothing but anonymous writes, if the nodes allow them)")
        return exit_codes.OK
    width = max(len(r["writer_id"]) for r in rows)
    for r in rows:
        extra = f"  gone: {r['gone_reason']}" if r["state"] == "GONE" else ""
        print(f"{r['writer_id']:<{width}}  {r['kind']:<5}  {r['state']:<6}  "
              f"{r['schema'] or '-':<10}  {r['changelog_root']}{extra}")
    return exit_codes.OK


def cmd_writers_gone(cluster: Cluster, args: argparse.Namespace) -> int:
    try:
        source = replay_sources.declare_gone(cluster.etcd(), args.writer, args.reason)
    except ReplaySourceError as exc:
        print(f"retina-admin: {exc}", flush=True)
        return exit_codes.FAILED
    if args.json:
        print(json.dumps({"writer_id": source.writer_id, "state": source.state.value,
                          "gone_reason": source.gone_reason}, indent=2))
    else:
        print(f"{source.writer_id}: GONE ({source.gone_reason}). Recovering nodes no longer "
              "wait for its replay; its rows not in a checkpoint are lost on a crash.")
    return exit_codes.OK


def cmd_recover(cluster: Cluster, args: argparse.Namespace) -> int:
    # The registry and the catalog once for every node: the same writers for all.
    sources = replay_sources.load(cluster.etcd())
    catalog = cluster.catalog()
    try:
        logs = registered_logs(sources.values(), catalog)
        results = {node: _recover(cluster, node, logs, args) for node in cluster.nodes}
    finally:
        catalog.close()
    # A query run right after `recover` is admitted: the gate has seen the nodes READY.
    unseen = await_gate_ready(cluster.trans, [n for n, r in results.items()
                                              if r["outcome"] == "READY"],
                              rpc_timeout_s=cluster.timeout_s)
    for node, state in unseen.items():
        results[node]["detail"] = (f"READY, but the query gate still sees it {state} after "
                                   f"{GATE_WAIT_S:.0f}s")
    if args.json:
        print(json.dumps({"nodes": results}, indent=2))
    else:
        for node, r in results.items():
            print(f"{node}: {r['outcome']}" + (f" ({r['detail']})" if r.get("detail") else ""))
    return exit_codes.OK if all(r["outcome"] in ("READY", "READY already") for r in results.values()
                          ) else exit_codes.FAILED


def _recover(cluster: Cluster, node: str, logs: list[ReplayLog],
             args: argparse.Namespace) -> dict[str, Any]:
    stub = cluster.node(node)
    try:
        status = stub.GetRetinaStatus(pb.GetRetinaStatusRequest(), timeout=cluster.timeout_s)
    except grpc.RpcError as exc:
        return {"outcome": "unreachable", "detail": f"{exc.code().name}: {exc.details()}"}
    if status.state == pb.READY:
        return {"outcome": "READY already"}
    counted = {"rows": 0, "requests": 0}
    mode = MODES[args.mode]

    def replay(starts: pb.GetRecoveryReplayTsResponse,
               context: pb.RecoveryReplayContext) -> Any:
        vnode_starts = node_starts(node, cluster.topology, starts, mode)
        check_retained(logs, vnode_starts)  # before the first request: nothing half-sent
        for request in merged_replay_requests(
                logs, vnode_starts, context, REQUEST_MAX_ROWS,
                min_columnar_rows=min_columnar_rows(status.accepts_columnar),
                accepts_partial=status.accepts_partial):
            counted["rows"] += changelog_rows(request)
            counted["requests"] += 1
            yield request
        check_retained(logs, vnode_starts)  # retention ran meanwhile: never MarkReady

    started = time.monotonic()
    try:
        drive_recovery(stub, replay=replay, mode=mode, timeout_s=args.wait,
                       replayed_writers=[log.writer_id for log in logs])
    except (ChangelogGap, CorruptChangelog) as exc:
        return {"outcome": "not recovered", "detail": f"{exc}; nothing was marked READY (see "
                "docs/operations.md, 'A writer's changelog is lost')"}
    except (RecoveryFailed, TimeoutError) as exc:
        return {"outcome": "not recovered", "detail": str(exc)}
    except grpc.RpcError as exc:
        return {"outcome": "not recovered", "detail": f"{exc.code().name}: {exc.details()}"}
    return {"outcome": "READY", "writers": [log.writer_id for log in logs],
            "rows": counted["rows"], "requests": counted["requests"],
            "seconds": round(time.monotonic() - started, 3)}
