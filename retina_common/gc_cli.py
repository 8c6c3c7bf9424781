"""``retina-gc``: sweepers, orphans, the rewrite lineage and its revert, on every node.

    retina-gc --config retina.toml sweep [--pass retired ...] [--dry-run] [--json]
    retina-gc --config retina.toml orphans [--dry-run] [--grace-ms N] [--json]
    retina-gc --config retina.toml lineage [--json]
    retina-gc --config retina.toml revert REWRITE_ID

Nodes come from the topology of the config (``--node host:port`` narrows it).
Exit codes: 0 done, 1 a node refused or was unreachable (its status is
printed), 2 bad usage or configuration.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

import grpc
from google.protobuf.json_format import MessageToDict

from retina_common.client import channel
from retina_common.config import ConfigError, load_config
from retina_common.pb import retina_pb2 as pb
from retina_common.pb import retina_pb2_grpc
from retina_common.topology import load_topology


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="retina-gc", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", help="TOML config file (default: $RETINA_CONFIG)")
    parser.add_argument("--node", action="append", default=[],
                        help="only this node (host:port); repeatable")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per call")
    sub = parser.add_subparsers(dest="command", required=True)
    sweep = sub.add_parser("sweep", help="one sweeper round now")
    sweep.add_argument("--pass", dest="passes", action="append", default=[],
                       choices=["temporary", "retired", "checkpoints", "journal", "orphans"])
    sweep.add_argument("--dry-run", action="store_true", help="report, remove nothing")
    sweep.add_argument("--json", action="store_true")
    orphans = sub.add_parser("orphans", help="objects nothing knows (after the grace period)")
    orphans.add_argument("--dry-run", action="store_true", help="report, remove nothing")
    orphans.add_argument("--grace-ms", type=int, default=0,
                         help="keep objects younger than this (default: the node's setting; "
                              "at least 3600000, one hour)")
    orphans.add_argument("--json", action="store_true")
    lineage = sub.add_parser("lineage", help="every Storage GC rewrite and its status")
    lineage.add_argument("--json", action="store_true")
    revert = sub.add_parser("revert", help="revert a COMPLETED rewrite (one swap back)")
    revert.add_argument("rewrite_id")
    revert.add_argument("--json", action="store_true")
    return parser


def when(ms: int) -> str:
    """A wall-clock time in ms as UTC text for the operator tables ('-' when unset)."""
    return datetime.fromtimestamp(ms / 1000, UTC).strftime("%Y-%m-%d %H:%M:%S") if ms else "-"


def print_table(rows: list[list[Any]], header: list[str]) -> None:
    """Aligned columns on stdout (retina-gc and retina-admin)."""
    cells = [[str(c) for c in row] for row in [header, *rows]]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    for row in cells:
        print("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip())


def _sweep(stub: retina_pb2_grpc.RetinaWorkerServiceStub, args: argparse.Namespace,
           passes: list[str]) -> pb.RunSweeperResponse:
    return stub.RunSweeper(pb.RunSweeperRequest(
        passes=passes, dry_run=args.dry_run,
        orphan_grace_ms=getattr(args, "grace_ms", 0)), timeout=args.timeout)


def show_sweep(node: str, reply: pb.RunSweeperResponse) -> None:
    print(f"{node}: removed {reply.removed} ({reply.bytes_removed} bytes), held {reply.held}")
    if reply.objects:
        print_table([[o.pass_name, str(o.file_id), o.name, o.action, o.reason, str(o.bytes)]
                      for o in reply.objects],
                     ["pass", "file", "name", "action", "reason", "bytes"])


def show_lineage(node: str, records: list[pb.GcLineageRecord]) -> None:
    print(f"{node}: {len(records)} rewrites")
    if records:
        print_table([[r.rewrite_id[:12], r.status, r.journal_state,
                       f"{r.schema_name}.{r.table_name}/{r.virtual_node_id}",
                       str(r.new_file_id), ",".join(map(str, r.old_file_ids)),
                       when(r.created_at_ms), when(r.completed_at_ms),
                       when(r.reverted_at_ms),
                       "yes" if r.revertible else f"no: {r.not_revertible_reason}"]
                      for r in records],
                     ["rewrite", "status", "journal", "table/vnode", "new", "old", "created",
                      "completed", "reverted", "revertible"])


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        config = load_config(args.config)
        topology = load_topology(config.topology_file)
    except ConfigError as exc:
        print(f"retina-gc: {exc}", file=sys.stderr)
        return 2
    nodes = args.node or list(topology.nodes)
    unknown = [n for n in nodes if n not in topology.nodes]
    if unknown:
        print(f"retina-gc: {unknown} not in the topology {list(topology.nodes)}", file=sys.stderr)
        return 2
    stubs = {n: retina_pb2_grpc.RetinaWorkerServiceStub(channel(n, config.tls)) for n in nodes}
    if args.command == "revert":
        return _revert(stubs, args)
    calls: dict[str, Callable[[retina_pb2_grpc.RetinaWorkerServiceStub], Any]] = {
        "sweep": lambda s: _sweep(s, args, args.passes),
        "orphans": lambda s: _sweep(s, args, ["orphans"]),
        "lineage": lambda s: s.ListGcLineage(pb.ListGcLineageRequest(), timeout=args.timeout),
    }
    failed = False
    out: dict[str, Any] = {}
    for node, stub in stubs.items():
        try:
            reply = calls[args.command](stub)
        except grpc.RpcError as exc:
            failed = True
            out[node] = {"error": exc.code().name, "detail": exc.details()}
            if not args.json:
                print(f"{node}: {exc.code().name}: {exc.details()}", file=sys.stderr)
            continue
        out[node] = MessageToDict(reply, preserving_proto_field_name=True)
        if args.json:
            continue
        if args.command == "lineage":
            show_lineage(node, list(reply.records))
        else:
            show_sweep(node, reply)
    if args.json:
        print(json.dumps(out, indent=2, sort_keys=True))
    return 1 if failed else 0


def _revert(stubs: dict[str, retina_pb2_grpc.RetinaWorkerServiceStub],
            args: argparse.Namespace) -> int:
    """The revert goes to the node whose journal holds the rewrite (ids are unique)."""
    for node, stub in stubs.items():
        try:
            records = stub.ListGcLineage(pb.ListGcLineageRequest(), timeout=args.timeout).records
        except grpc.RpcError as exc:
            print(f"{node}: {exc.code().name}: {exc.details()}", file=sys.stderr)
            continue
        if not any(r.rewrite_id == args.rewrite_id for r in records):
            continue
        try:
            reply = stub.RevertGcRewrite(pb.RevertGcRewriteRequest(rewrite_id=args.rewrite_id),
                                         timeout=args.timeout)
        except grpc.RpcError as exc:
            print(f"{node}: revert refused: {exc.code().name}: {exc.details()}",
                  file=sys.stderr)
            return 1
        if args.json:
            print(json.dumps(MessageToDict(reply.record, preserving_proto_field_name=True),
                             indent=2, sort_keys=True))
        else:
            show_lineage(node, [reply.record])
        return 0
    print(f"retina-gc: no node knows rewrite {args.rewrite_id}", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
