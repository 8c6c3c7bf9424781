"""``retina-admin``: inspect and operate a Retina cluster (like ``etcdctl`` for etcd).

    retina-admin status                         every node, the TransServer, the query gate
    retina-admin replay-ts [--mode vnode|node] [--scopes]
    retina-admin mark-ready NODE --token TOKEN [--checkpoint-id N]
    retina-admin checkpoint [--node NODE]
    retina-admin files SCHEMA.TABLE [--type REGULAR ...]
    retina-admin gc status
    retina-admin gc run [--sweep [--dry-run]]
    retina-admin lineage
    retina-admin writers list | writers gone WRITER --reason R
    retina-admin recover [--mode vnode|node] [--wait S]
    retina-admin pin create NAME [--at TS | --at-time ISO8601|MS]; pin list; pin drop NAME
    retina-admin consumer register NAME [--cursor TS] [--table S.T]; consumer commit NAME TS;
        consumer list; consumer drop NAME

Every command takes ``--json`` (one JSON document on stdout instead of tables),
``--node host:port`` (repeatable: only these nodes) and ``--no-progress``.
Configuration: ``--config FILE`` or ``$RETINA_CONFIG``, as for every Retina process.

``mark-ready`` is the manual end of a recovery: it refuses unless the node is
AWAITING_REPLAY and TOKEN names its current recovery attempt (the full token, or
the 8-hex-digit tokenHash that ``status`` shows and the node publishes on its
lifecycle key). The node checks the token again.

Exit codes: 0 done, 1 an operation failed or was refused (or a component did not
answer; the message on stderr says which), 2 usage or configuration error.
"""

from __future__ import annotations

import argparse
import hmac
import json
import sys
import time
from collections.abc import Callable
from typing import Any

import grpc

from retina_common import (
    admin_consumers,
    admin_pins,
    admin_writers,
    exit_codes,
    file_names,
    progress,
)
from retina_common.admin_cluster import Cluster
from retina_common.as_of_point import format_ms
from retina_common.catalog import CatalogError, FileType
from retina_common.catalog.cli import parse_file_type
from retina_common.checkpoint_store import CorruptCheckpoint, Pointer
from retina_common.cli_json import message_dict
from retina_common.config import ConfigError
from retina_common.etcd import EtcdError
from retina_common.gc_cli import (
    SHOWN_ID_DIGITS,
    print_table,
    show_lineage,
    show_sweep,
    sweep_view,
    when,
)
from retina_common.keys import LIFECYCLE_PREFIX, checkpoint_slot_key, node_of_lifecycle_key
from retina_common.lifecycle_record import LifecycleRecord, MalformedLifecycleValue
from retina_common.log import token_hash
from retina_common.pb import retina_pb2 as pb
from retina_common.pb import trans_pb2
from retina_common.replay_ts import PLUS_INF
from retina_common.topology import load_config_and_topology

PROG = "retina-admin"
MODES = {"vnode": pb.VNODE, "node": pb.NODE}


class UsageError(Exception):
    """Bad arguments or configuration: exit 2."""


# --- output helpers ---------------------------------------------------------------------
def _age(ms: int, now_ms: int) -> str:
    if not ms:
        return "-"
    seconds = max(0, now_ms - ms) // 1000
    if seconds < 120:
        return f"{seconds}s"
    if seconds < 7200:
        return f"{seconds // 60}m"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


def _ts(value: int) -> str:
    return "+INF" if value == PLUS_INF else ("-" if value < 0 else str(value))


def _err(message: str) -> None:
    print(f"{PROG}: {message}", file=sys.stderr)


def _rpc_error(exc: grpc.RpcError) -> dict[str, str]:
    return {"error": exc.code().name, "detail": exc.details() or ""}


# --- the cluster the config names --------------------------------------------------------
def open_cluster(args: argparse.Namespace) -> Cluster:
    try:
        config, topology = load_config_and_topology(args.config)
    except ConfigError as exc:
        raise UsageError(str(exc)) from None
    nodes = list(args.node) or list(topology.nodes)
    unknown = [n for n in nodes if n not in topology.nodes]
    if unknown:
        raise UsageError(f"{', '.join(unknown)} not in the topology {list(topology.nodes)}")
    return Cluster(config, topology, nodes, args.timeout, args.no_progress)


# --- status -----------------------------------------------------------------------------
def _etcd_view(cluster: Cluster) -> dict[str, Any]:
    """Lifecycle records and current checkpoint pointers, as etcd has them."""
    store = cluster.etcd()
    kvs, revision = store.get_prefix(LIFECYCLE_PREFIX)
    lifecycle: dict[str, Any] = {}
    for kv in kvs:
        node = node_of_lifecycle_key(kv.key)
        try:
            r = LifecycleRecord.parse(node, kv.value)
            lifecycle[node] = {"state": r.state.value, "checkpoint_id": r.checkpoint_id,
                               "recovery_epoch": r.recovery_epoch, "token_hash": r.token_hash,
                               "updated_at_ms": r.updated_at_ms}
        except MalformedLifecycleValue as exc:
            lifecycle[node] = {"malformed": str(exc)}
    pointers: dict[str, Any] = {}
    for node in cluster.nodes:
        slot = store.get(checkpoint_slot_key(node, "current"))
        if slot is None:
            continue
        try:
            p = Pointer.parse(slot.value)
            pointers[node] = {"checkpoint_id": p.checkpoint_id,
                              "checkpoint_applied_ts": p.checkpoint_applied_ts,
                              "bytes": p.length}
        except CorruptCheckpoint as exc:
            pointers[node] = {"malformed": str(exc)}
    return {"revision": revision, "lifecycle": lifecycle, "checkpoints": pointers}


def _trans_view(cluster: Cluster) -> dict[str, Any]:
    stub, t = cluster.trans, cluster.timeout_s
    out: dict[str, Any] = {"address": cluster.config.trans.listen}
    try:
        out["high_watermark"] = stub.GetHighWatermark(
            trans_pb2.GetHighWatermarkRequest(), timeout=t).high_watermark
        # GetHistoryStatus, not GetSafeGcTimestamp: asking that one would hand safeGcTs
        # out, raising the GC horizon (history it makes unreadable for good).
        history = stub.GetHistoryStatus(trans_pb2.GetHistoryStatusRequest(), timeout=t)
        gate = stub.GetQueryGateStatus(trans_pb2.GetQueryGateStatusRequest(), timeout=t)
    except grpc.RpcError as exc:
        out.update(_rpc_error(exc))
        return out
    out["safe_gc_ts"] = history.next_safe_gc_ts
    out["history"] = message_dict(history)
    out["gate"] = {"admitted": gate.admitted, "message": gate.message,
                   "nodes": dict(gate.nodes), "watch_healthy": gate.watch_healthy,
                   "revision": gate.revision}
    return out


def _node_view(cluster: Cluster, node: str) -> dict[str, Any]:
    try:
        s = cluster.node(node).GetRetinaStatus(pb.GetRetinaStatusRequest(),
                                               timeout=cluster.timeout_s)
    except grpc.RpcError as exc:
        return _rpc_error(exc)
    view = message_dict(s)
    # The token itself stays on the node; operators name the attempt by its hash.
    token = view.pop("recovery_attempt_token", "")
    view["token_hash"] = token_hash(token) if token else ""
    return view


def collect_status(cluster: Cluster) -> tuple[dict[str, Any], list[str]]:
    """Everything ``status`` shows, and what did not answer."""
    problems: list[str] = []
    try:
        etcd = _etcd_view(cluster)
    except EtcdError as exc:
        etcd = {"error": str(exc), "lifecycle": {}, "checkpoints": {}}
        problems.append(f"etcd: {exc}")
    nodes = {}
    for node in progress.track(cluster.nodes, desc="status", unit="node",
                               disabled=cluster.no_progress):
        nodes[node] = _node_view(cluster, node)
        if "error" in nodes[node]:
            problems.append(f"{node}: {nodes[node]['error']}: {nodes[node]['detail']}")
    trans = _trans_view(cluster)
    if "error" in trans:
        problems.append(f"TransServer {trans['address']}: {trans['error']}: {trans['detail']}")
    return {"now_ms": int(time.time() * 1000), "nodes": nodes, "etcd": etcd,
            "trans": trans}, problems


def _status_row(node: str, status: dict[str, Any], now_ms: int) -> list[Any]:
    view = status["nodes"][node]
    record = status["etcd"]["lifecycle"].get(node, {})
    pointer = status["etcd"]["checkpoints"].get(node, {})
    gate = status["trans"].get("gate", {}).get("nodes", {}).get(node, "-")
    lifecycle = record.get("state", "?" if "error" in status["etcd"] else "missing")
    if "error" in view:
        return [node, lifecycle, f"unreachable ({view['error']})",
                pointer.get("checkpoint_id", "-"), "-", "-", record.get("token_hash") or "-",
                gate]
    checkpoint_id = pointer.get("checkpoint_id", view["last_checkpoint_id"] or "-")
    age = _age(int(view["last_checkpoint_write_time_ms"]), now_ms) \
        if checkpoint_id == int(view["last_checkpoint_id"]) else "-"
    phase = view["phase"] + (f" ({view['failure_reason']})" if view["failure_reason"] else "")
    return [node, lifecycle, phase, checkpoint_id, age,
            _ts(int(view["node_replay_from_ts"])), view["token_hash"] or "-", gate]


def print_status(status: dict[str, Any]) -> None:
    now = status["now_ms"]
    print_table([_status_row(n, status, now) for n in status["nodes"]],
                ["node", "lifecycle", "phase", "checkpoint", "age", "replay_from",
                 "token_hash", "gate"])
    trans = status["trans"]
    print()
    if "error" in trans:
        print(f"transserver {trans['address']}: unreachable ({trans['error']})")
        return
    gate = trans["gate"]
    print(f"transserver {trans['address']}  HWM {trans['high_watermark']}  "
          f"safeGcTs {trans['safe_gc_ts']}")
    history = trans["history"]
    retention = int(history["history_retention_ms"])
    print(f"history     earliest readable: timestamp {history['earliest_readable_ts']} (time "
          f"{format_ms(int(history['earliest_readable_time_ms']))}); GC horizon "
          f"{history['horizon_ts']}; retention {retention // 1000} s; "
          f"{history['pins']} pin(s)")
    for gap in history["time_gaps"]:
        print(f"            times not mapped (a TransServer crash): "
              f"{format_ms(int(gap['from_ms']))} .. {format_ms(int(gap['to_ms']))}")
    for node, view in status["nodes"].items():
        for gap in view.get("rebuilt_history", []):
            print(f"            {node} refuses AS OF timestamps [{gap['from_ts']}, "
                  f"{gap['to_ts']}): history its recovery rebuilt")
    message = gate["message"].removeprefix("query gate closed: ")
    print(f"query gate  {'OPEN' if gate['admitted'] else 'CLOSED'}: {message}")


def cmd_status(cluster: Cluster, args: argparse.Namespace) -> int:
    status, problems = collect_status(cluster)
    if args.json:
        status["problems"] = problems
        print(json.dumps(status, indent=2, sort_keys=True))
    else:
        print_status(status)
    for problem in problems:
        _err(problem)
    return exit_codes.FAILED if problems else exit_codes.OK


# --- replay-ts --------------------------------------------------------------------------
def _replay_starts(cluster: Cluster, node: str, mode: pb.ReplayMode) -> dict[str, Any]:
    stub = cluster.node(node)
    s = stub.GetRetinaStatus(pb.GetRetinaStatusRequest(), timeout=cluster.timeout_s)
    out: dict[str, Any] = {"state": pb.LifecycleState.Name(s.state), "phase": s.phase,
                           "checkpoint_id": s.checkpoint_id,
                           "node_replay_from_ts": s.node_replay_from_ts}
    if not s.recovery_attempt_token or not s.replay_ts_ready:
        # READY: the starts of the recovery it finished; per-vnode starts are served only
        # while the attempt is open (GetRecoveryReplayTs needs its token).
        out["note"] = "per-vnode starts are served only while AWAITING_REPLAY"
        return out
    r = stub.GetRecoveryReplayTs(pb.GetRecoveryReplayTsRequest(
        recovery_attempt_token=s.recovery_attempt_token, checkpoint_id=s.checkpoint_id,
        replay_mode=mode), timeout=cluster.timeout_s)
    out.update(checkpoint_applied_ts=r.checkpoint_applied_ts,
               node_replay_from_ts=r.node_replay_from_ts,
               vnode_replay_from_ts=dict(sorted(r.vnode_replay_from_ts.items())),
               scopes=[{"table_id": c.table_id, "vnode": c.virtual_node_id,
                        "scope_replay_from_ts": c.scope_replay_from_ts,
                        "earliest_unsafe_insert_ts": c.earliest_unsafe_insert_ts}
                       for c in r.scopes])
    return out


def _print_replay(node: str, view: dict[str, Any], scopes: bool) -> None:
    print(f"{node}: {view['state']}/{view['phase']}  recovers from checkpoint "
          f"{view['checkpoint_id']}  nodeReplayFromTs {_ts(view['node_replay_from_ts'])}")
    if "note" in view:
        print(f"  ({view['note']})")
        return
    print(f"  checkpointAppliedTs {view['checkpoint_applied_ts']}")
    print_table([[v, _ts(ts)] for v, ts in view["vnode_replay_from_ts"].items()],
                ["vnode", "replay_from_ts"])
    if scopes:
        print_table([[c["table_id"], c["vnode"], _ts(c["scope_replay_from_ts"]),
                      _ts(c["earliest_unsafe_insert_ts"])] for c in view["scopes"]],
                    ["table", "vnode", "scope_replay_from_ts", "earliest_unsafe_insert_ts"])


def cmd_replay_ts(cluster: Cluster, args: argparse.Namespace) -> int:
    return _per_node(cluster, args, lambda n: _replay_starts(cluster, n, MODES[args.mode]),
                     lambda n, v: _print_replay(n, v, args.scopes))


# --- mark-ready -------------------------------------------------------------------------
def _token_matches(given: str, token: str) -> bool:
    given_b = given.strip().encode()
    return bool(token) and (hmac.compare_digest(given_b, token.encode()) or
                            hmac.compare_digest(given_b, token_hash(token).encode()))


def cmd_mark_ready(cluster: Cluster, args: argparse.Namespace) -> int:
    node = args.target
    if node not in cluster.topology.nodes:
        raise UsageError(f"{node} is not in the topology {list(cluster.topology.nodes)}")
    stub = cluster.node(node)
    try:
        s = stub.GetRetinaStatus(pb.GetRetinaStatusRequest(), timeout=cluster.timeout_s)
    except grpc.RpcError as exc:
        return _refused(args, node, f"status unavailable: {exc.code().name}: {exc.details()}")
    state = pb.LifecycleState.Name(s.state)
    # BARRIER: a MarkReady that was interrupted; the node accepts it again to finish it.
    if s.phase not in ("AWAITING_REPLAY", "BARRIER"):
        return _refused(args, node, f"refused: the node is {state} (phase {s.phase}), not "
                        "AWAITING_REPLAY; nothing changed")
    if not _token_matches(args.token, s.recovery_attempt_token):
        return _refused(args, node, "refused: the token does not name the node's current "
                        "recovery attempt (see the token_hash column of `retina-admin "
                        "status`); nothing changed")
    if args.checkpoint_id is not None and args.checkpoint_id != s.checkpoint_id:
        return _refused(args, node, f"refused: the attempt recovers from checkpoint "
                        f"{s.checkpoint_id}, not {args.checkpoint_id}; nothing changed")
    try:
        reply = stub.MarkReady(pb.MarkReadyRequest(
            recovery_attempt_token=s.recovery_attempt_token, checkpoint_id=s.checkpoint_id,
            replayed_writers=args.replayed_writer),
            timeout=cluster.timeout_s)
    except grpc.RpcError as exc:
        return _refused(args, node, f"MarkReady failed: {exc.code().name}: {exc.details()}")
    state = pb.LifecycleState.Name(reply.state)
    if args.json:
        print(json.dumps({"node": node, "state": state, "checkpoint_id": s.checkpoint_id,
                          "token_hash": token_hash(s.recovery_attempt_token)}, indent=2))
    else:
        print(f"{node}: {state} (recovered from checkpoint {s.checkpoint_id})")
    return exit_codes.OK


def _refused(args: argparse.Namespace, node: str, message: str) -> int:
    if args.json:
        print(json.dumps({"node": node, "refused": message}, indent=2))
    _err(f"{node}: {message}")
    return exit_codes.FAILED


# --- checkpoint -------------------------------------------------------------------------
def cmd_checkpoint(cluster: Cluster, args: argparse.Namespace) -> int:
    def run(node: str) -> dict[str, Any]:
        r = cluster.node(node).CreateCheckpoint(pb.CreateCheckpointRequest(),
                                                timeout=cluster.timeout_s)
        return message_dict(r)

    rows: list[list[Any]] = []
    code = _per_node(cluster, args, run, lambda n, v: rows.append(
        [n, v["checkpoint_id"], v["checkpoint_applied_ts"], v["body_length"]]))
    if rows:
        print_table(rows, ["node", "checkpoint", "applied_ts", "bytes"])
    return code


# --- files ------------------------------------------------------------------------------
def _file_row(f: Any, uri: str) -> dict[str, Any]:
    try:
        parsed = file_names.parse(f.name)
        node, vnode = parsed.node_id, parsed.vnode
    except ValueError:
        node, vnode = "", None
    return {"file_id": f.file_id, "type": f.type.name, "name": f.name, "node": node,
            "vnode": vnode, "row_groups": f.num_row_group, "min_row_id": f.min_row_id,
            "max_row_id": f.max_row_id, "cleanup_at": f.cleanup_at, "path_id": f.path_id,
            "path": uri}


def cmd_files(cluster: Cluster, args: argparse.Namespace) -> int:
    schema, dot, name = args.table.partition(".")
    if not dot or not schema or not name:
        raise UsageError(f"{args.table!r} is not SCHEMA.TABLE")
    types = args.type or list(FileType)
    try:
        catalog = cluster.catalog()
    except CatalogError as exc:
        _err(f"catalog: {type(exc).__name__}: {exc}")
        return exit_codes.FAILED
    try:
        record = catalog.get_table(schema, name)
        rows = [_file_row(f, p.uri) for p in catalog.get_paths(record.table_id)
                for f in catalog.get_files_by_type(p.path_id, types)]
    except CatalogError as exc:
        _err(f"catalog: {type(exc).__name__}: {exc}")
        return exit_codes.FAILED
    finally:
        catalog.close()
    if args.node:
        rows = [r for r in rows if r["node"] in args.node]
    rows.sort(key=lambda r: r["file_id"])
    if args.json:
        print(json.dumps({"table": args.table, "types": [t.name for t in types],
                          "files": rows}, indent=2))
        return exit_codes.OK
    print_table([[r["file_id"], r["type"], r["node"] or "-",
                  "-" if r["vnode"] is None else r["vnode"], r["row_groups"],
                  _span(r["min_row_id"], r["max_row_id"]), when(r["cleanup_at"] or 0),
                  r["name"]] for r in rows],
                ["file", "type", "node", "vnode", "rgs", "row_ids", "cleanup_at", "name"])
    print(f"{len(rows)} files")
    return exit_codes.OK


def _span(lo: int | None, hi: int | None) -> str:
    return "-" if lo is None or hi is None else f"{lo}..{hi}"


# --- gc ---------------------------------------------------------------------------------
def _print_gc_status(node: str, v: dict[str, Any]) -> None:
    floor = int(v["fold_floor_ts"])
    print(f"{node}: pending rewrites {v['pending_rewrites']}  fold floor "
          f"{'-' if floor < 0 else floor}  last fold {v['last_fold_ts']}  "
          f"last prune horizon {v['last_prune_horizon_ts']}")
    if v["entries"]:
        print_table([[e["rewrite_id"][:SHOWN_ID_DIGITS], e["state"],
                      f"{e['table_id']}/{e['virtual_node_id']}", e["new_file_id"],
                      ",".join(map(str, e["old_file_ids"])), e["cutoff_ts"], e["rows_kept"],
                      when(int(e["updated_at_ms"])), e["reason"]] for e in v["entries"]],
                    ["rewrite", "state", "table/vnode", "new", "old", "cutoff", "rows_kept",
                     "updated", "reason"])


def cmd_gc_status(cluster: Cluster, args: argparse.Namespace) -> int:
    return _per_node(cluster, args, lambda n: message_dict(cluster.node(n).GetGcStatus(
        pb.GetGcStatusRequest(), timeout=cluster.timeout_s)), _print_gc_status)


def _gc_round(cluster: Cluster, args: argparse.Namespace, node: str) -> dict[str, Any]:
    stub = cluster.node(node)
    out: dict[str, Any] = {}
    if not args.dry_run:  # a fold/prune round has no dry run: it is left out of one
        out["maintenance"] = message_dict(stub.RunGcMaintenance(
            pb.RunGcMaintenanceRequest(), timeout=cluster.timeout_s))
    if args.sweep:
        out["sweep"] = sweep_view(stub.RunSweeper(pb.RunSweeperRequest(dry_run=args.dry_run),
                                                  timeout=cluster.timeout_s), args.dry_run)
    return out


def _print_gc_round(node: str, v: dict[str, Any]) -> None:
    if "maintenance" in v:
        m = v["maintenance"]
        print(f"{node}: folded {m['folded_items']} items at {m['fold_ts']}, pruned "
              f"{m['pruned_versions']} versions below {m['prune_horizon_ts']}")
    if "sweep" in v:
        show_sweep(node, v["sweep"])


def cmd_gc_run(cluster: Cluster, args: argparse.Namespace) -> int:
    if args.dry_run and not args.sweep:
        raise UsageError("--dry-run applies to the sweep (--sweep); a fold/prune round "
                         "has no dry run")
    return _per_node(cluster, args, lambda n: _gc_round(cluster, args, n), _print_gc_round)


def cmd_lineage(cluster: Cluster, args: argparse.Namespace) -> int:
    return _per_node(cluster, args, lambda n: message_dict(cluster.node(n).ListGcLineage(
        pb.ListGcLineageRequest(), timeout=cluster.timeout_s)),
        lambda n, v: show_lineage(n, v["records"]))


# --- shared per-node loop ---------------------------------------------------------------
def _per_node(cluster: Cluster, args: argparse.Namespace, call: Callable[[str], dict[str, Any]],
              show: Callable[[str, dict[str, Any]], None]) -> int:
    """``call`` on every selected node (a bar over them); tables as each answers, or one
    JSON document at the end. A node that fails is reported on stderr: exit 1."""
    out: dict[str, Any] = {}
    failed = False
    for node in progress.track(cluster.nodes, desc=args.command, unit="node",
                               disabled=cluster.no_progress):
        try:
            view = call(node)
        except grpc.RpcError as exc:
            failed = True
            out[node] = _rpc_error(exc)
            _err(f"{node}: {exc.code().name}: {exc.details()}")
            continue
        out[node] = view  # the table shows the same view: one shape for both
        if not args.json:
            show(node, view)
    if args.json:
        print(json.dumps(out, indent=2, sort_keys=True))
    return exit_codes.FAILED if failed else exit_codes.OK


# --- arguments --------------------------------------------------------------------------
COMMON_DEFAULTS: dict[str, Any] = {"config": None, "node": (), "timeout": 60.0, "json": False,
                                   "no_progress": False}


def _common() -> argparse.ArgumentParser:
    """Options taken before or after the command (``retina-admin --json status`` and
    ``retina-admin status --json``). SUPPRESS: a subcommand's default must not overwrite
    what was given before it; :func:`main` fills in what was given nowhere."""
    common = argparse.ArgumentParser(add_help=False, argument_default=argparse.SUPPRESS)
    common.add_argument("--config", help="TOML config file (default: $RETINA_CONFIG)")
    common.add_argument("--node", action="append", help="only this node (host:port); repeatable")
    common.add_argument("--timeout", type=float, help="seconds per call (default 60)")
    common.add_argument("--json", action="store_true", help="one JSON document on stdout")
    common.add_argument("--no-progress", action="store_true",
                        help="no progress bar (none is drawn unless stderr is a terminal)")
    return common


def parser() -> argparse.ArgumentParser:
    common = _common()
    p = argparse.ArgumentParser(prog=PROG, description=__doc__, parents=[common],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    sub.add_parser("status", parents=[common], help="every node, the TransServer, the gate")
    s = sub.add_parser("replay-ts", parents=[common], help="replay starts of recovering nodes")
    s.add_argument("--mode", choices=sorted(MODES), default="vnode")
    s.add_argument("--scopes", action="store_true", help="also every (table, vnode) scope")
    s = sub.add_parser("mark-ready", parents=[common],
                       help="end a recovery by hand (guarded: AWAITING_REPLAY and the token)")
    s.add_argument("target", metavar="NODE", help="host:port of the node")
    s.add_argument("--token", required=True,
                   help="the recovery attempt token, or its 8-hex-digit tokenHash")
    s.add_argument("--checkpoint-id", type=int, help="also require this checkpoint id")
    s.add_argument("--replayed-writer", action="append", default=[], metavar="WRITER",
                   help="a registered writer whose changelog you replayed; the node refuses "
                        "unless every ACTIVE writer is named (repeatable)")
    sub.add_parser("checkpoint", parents=[common], help="take a checkpoint now (READY nodes)")
    s = sub.add_parser("files", parents=[common], help="a table's catalog files by type")
    s.add_argument("table", metavar="SCHEMA.TABLE")
    s.add_argument("--type", type=parse_file_type, action="append",
                   help=f"only this type ({', '.join(t.name for t in FileType)}); repeatable")
    gc = sub.add_parser("gc", help="GC state and rounds").add_subparsers(dest="gc_command",
                                                                       required=True)
    gc.add_parser("status", parents=[common], help="journal, pending rewrites, fold floor")
    s = gc.add_parser("run", parents=[common], help="one fold/prune round now (and a sweep)")
    s.add_argument("--sweep", action="store_true", help="also one sweeper round")
    s.add_argument("--dry-run", action="store_true",
                   help="with --sweep: only the sweep, removing nothing (no fold/prune round)")
    sub.add_parser("lineage", parents=[common], help="every Storage GC rewrite")
    admin_writers.add_parsers(sub, common)
    admin_pins.add_parsers(sub, common)
    admin_consumers.add_parsers(sub, common)
    return p


COMMANDS: dict[str, Callable[[Cluster, argparse.Namespace], int]] = {
    "status": cmd_status, "replay-ts": cmd_replay_ts, "mark-ready": cmd_mark_ready,
    "checkpoint": cmd_checkpoint, "files": cmd_files, "gc status": cmd_gc_status,
    "gc run": cmd_gc_run, "lineage": cmd_lineage,
    "writers list": admin_writers.cmd_writers_list,
    "writers gone": admin_writers.cmd_writers_gone, "recover": admin_writers.cmd_recover,
    "pin create": admin_pins.cmd_pin_create, "pin list": admin_pins.cmd_pin_list,
    "pin drop": admin_pins.cmd_pin_drop,
    "consumer register": admin_consumers.cmd_consumer_register,
    "consumer commit": admin_consumers.cmd_consumer_commit,
    "consumer list": admin_consumers.cmd_consumer_list,
    "consumer drop": admin_consumers.cmd_consumer_drop,
}


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)  # exits 2 on bad usage
    for name, default in COMMON_DEFAULTS.items():
        if not hasattr(args, name):
            setattr(args, name, default)
    if args.command == "gc":
        args.command = f"gc {args.gc_command}"
    if args.command == "writers":
        args.command = f"writers {args.writers_command}"
    if args.command == "pin":
        args.command = f"pin {args.pin_command}"
    if args.command == "consumer":
        args.command = f"consumer {args.consumer_command}"
    try:
        cluster = open_cluster(args)
        try:
            return COMMANDS[args.command](cluster, args)
        finally:
            cluster.close()
    except UsageError as exc:
        _err(str(exc))
        return exit_codes.USAGE
    except EtcdError as exc:
        _err(f"etcd: {exc}")
        return exit_codes.FAILED


if __name__ == "__main__":
    sys.exit(main())
