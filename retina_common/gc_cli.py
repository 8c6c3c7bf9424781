"""``retina-gc``: sweepers, orphans, the rewrite lineage and its revert, on every node.

    retina-gc --config retina.toml sweep [--pass retired ...] [--dry-run] [--json]
    retina-gc --config retina.toml orphans [--dry-run] [--grace-ms N] [--json]
    retina-gc --config retina.toml lineage [--json]
    retina-gc --config retina.toml revert REWRITE_ID [--json]

Nodes come from the topology of the config (``--node host:port`` narrows it).
REWRITE_ID is the full id or any prefix of at least 8 hex digits that names one
rewrite (``lineage`` shows the first 12). ``--json`` prints one document: per node
the reply's every field (numbers as numbers, defaults included), as ``retina-admin``
does; a sweep adds ``dry_run``, ``would_remove`` and ``bytes_would_remove``.
Exit codes: 0 done, 1 a node refused or was unreachable (its status is
printed) or no node knows the rewrite, 2 bad usage or configuration (including
a rewrite id prefix that is too short or matches several rewrites).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterable, Mapping, Sequence
from datetime import UTC, datetime
from typing import Any

import grpc

from retina_common import exit_codes
from retina_common.cli_json import message_dict
from retina_common.client import channel
from retina_common.config import ConfigError
from retina_common.pb import retina_pb2 as pb
from retina_common.pb import retina_pb2_grpc
from retina_common.topology import load_config_and_topology

PROG = "retina-gc"
# `lineage` shows this many digits of a rewrite id (a 32-digit id would make the table
# twice as wide); `revert` takes any prefix of at least MIN_ID_PREFIX digits that names
# one rewrite. Two ids sharing 8 digits are rare among the rewrites a lineage keeps, and
# then the prefix is refused with both candidates rather than guessed.
SHOWN_ID_DIGITS = 12
MIN_ID_PREFIX = 8
_HEX_DIGITS = frozenset("0123456789abcdef")


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
    revert.add_argument("rewrite_id", metavar="REWRITE_ID",
                        help="the id, or a prefix of at least 8 hex digits naming one "
                             "rewrite (as `lineage` shows it)")
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


def sweep_view(reply: pb.RunSweeperResponse, dry_run: bool) -> dict[str, Any]:
    """A sweeper round as both CLIs print it, in tables and in JSON: the reply's fields,
    and what a dry run would remove (the reply counts only what was removed)."""
    view = message_dict(reply)
    would = [o for o in reply.objects if o.action == "would_remove"]
    view.update(dry_run=dry_run, would_remove=len(would),
                bytes_would_remove=sum(o.bytes for o in would))
    return view


def show_sweep(node: str, view: dict[str, Any]) -> None:
    if view["dry_run"]:
        print(f"{node}: dry run, would remove {view['would_remove']} "
              f"({view['bytes_would_remove']} bytes), held {view['held']}")
    else:
        print(f"{node}: removed {view['removed']} ({view['bytes_removed']} bytes), "
              f"held {view['held']}")
    if view["objects"]:
        print_table([[o["pass_name"], o["file_id"], o["name"], o["action"], o["reason"],
                      o["bytes"]] for o in view["objects"]],
                    ["pass", "file", "name", "action", "reason", "bytes"])


def show_lineage(node: str, records: list[dict[str, Any]]) -> None:
    """Lineage records (``message_dict`` of GcLineageRecord) as a table. The rewrite
    column is the id's first 12 digits: every command taking a rewrite id takes them."""
    print(f"{node}: {len(records)} rewrites")
    if records:
        print_table([[r["rewrite_id"][:SHOWN_ID_DIGITS], r["status"], r["journal_state"],
                      f"{r['schema_name']}.{r['table_name']}/{r['virtual_node_id']}",
                      r["new_file_id"], ",".join(map(str, r["old_file_ids"])),
                      when(r["created_at_ms"]), when(r["completed_at_ms"]),
                      when(r["reverted_at_ms"]),
                      "yes" if r["revertible"] else f"no: {r['not_revertible_reason']}"]
                     for r in records],
                    ["rewrite", "status", "journal", "table/vnode", "new", "old", "created",
                     "completed", "reverted", "revertible"])


# --- rewrite ids: a unique prefix names a rewrite ------------------------------------------
class RewriteIdError(Exception):
    """A rewrite id argument that names no single rewrite; ``exit_code`` says whose
    mistake it is (2: the argument, 1: no node knows it)."""

    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code


def resolve_rewrite_id(given: str, known: Mapping[str, Iterable[str]],
                       unanswered: Sequence[str] = ()) -> tuple[str, str]:
    """(node, full id) of the one rewrite whose id starts with ``given``; ``known``: the
    rewrite ids of every node that answered, ``unanswered``: the nodes that did not."""
    prefix = given.strip().lower()
    if not prefix or not set(prefix) <= _HEX_DIGITS:
        raise RewriteIdError(f"{given!r} is not a rewrite id: hex digits, as `retina-gc "
                             "lineage` prints them", exit_codes.USAGE)
    if len(prefix) < MIN_ID_PREFIX:
        raise RewriteIdError(f"rewrite id prefix {prefix} is too short: give at least "
                             f"{MIN_ID_PREFIX} hex digits", exit_codes.USAGE)
    matches = sorted((rid, node) for node, ids in known.items() for rid in ids
                     if rid.startswith(prefix))
    if len(matches) > 1:
        listed = ", ".join(f"{rid} on {node}" for rid, node in matches)
        raise RewriteIdError(f"rewrite id prefix {prefix} is ambiguous, it matches "
                             f"{len(matches)} rewrites: {listed}; give more digits",
                             exit_codes.USAGE)
    if not matches:
        # A node that did not answer may hold it: say so rather than "unknown" alone.
        maybe = (f"; {', '.join(unanswered)} did not answer and may know it"
                 if unanswered else "")
        raise RewriteIdError(f"no node knows a rewrite whose id starts with {prefix} "
                             f"(`retina-gc lineage` lists them){maybe}", exit_codes.FAILED)
    rid, node = matches[0]
    return node, rid


def _known_rewrites(stubs: dict[str, retina_pb2_grpc.RetinaWorkerServiceStub],
                    timeout: float) -> tuple[dict[str, list[str]], list[str]]:
    """Every node's rewrite ids (its lineage), and the nodes that did not answer."""
    known: dict[str, list[str]] = {}
    unanswered: list[str] = []
    for node, stub in stubs.items():
        try:
            records = stub.ListGcLineage(pb.ListGcLineageRequest(), timeout=timeout).records
        except grpc.RpcError as exc:
            print(f"{node}: {exc.code().name}: {exc.details()}", file=sys.stderr)
            unanswered.append(node)
            continue
        known[node] = [r.rewrite_id for r in records]
    return known, unanswered


# --- the command ----------------------------------------------------------------------------
def _view(command: str, stub: retina_pb2_grpc.RetinaWorkerServiceStub,
          args: argparse.Namespace) -> dict[str, Any]:
    """One node's answer to ``command`` as the view both outputs print."""
    if command == "lineage":
        return message_dict(stub.ListGcLineage(pb.ListGcLineageRequest(),
                                               timeout=args.timeout))
    passes = ["orphans"] if command == "orphans" else args.passes
    return sweep_view(_sweep(stub, args, passes), args.dry_run)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        config, topology = load_config_and_topology(args.config)
    except ConfigError as exc:
        print(f"{PROG}: {exc}", file=sys.stderr)
        return exit_codes.USAGE
    nodes = args.node or list(topology.nodes)
    unknown = [n for n in nodes if n not in topology.nodes]
    if unknown:
        print(f"{PROG}: {unknown} not in the topology {list(topology.nodes)}", file=sys.stderr)
        return exit_codes.USAGE
    stubs = {n: retina_pb2_grpc.RetinaWorkerServiceStub(channel(n, config.tls)) for n in nodes}
    if args.command == "revert":
        return _revert(stubs, args)
    failed = False
    out: dict[str, Any] = {}
    for node, stub in stubs.items():
        try:
            view = _view(args.command, stub, args)
        except grpc.RpcError as exc:
            failed = True
            out[node] = {"error": exc.code().name, "detail": exc.details()}
            if not args.json:
                print(f"{node}: {exc.code().name}: {exc.details()}", file=sys.stderr)
            continue
        out[node] = view
        if args.json:
            continue
        if args.command == "lineage":
            show_lineage(node, view["records"])
        else:
            show_sweep(node, view)
    if args.json:
        print(json.dumps(out, indent=2, sort_keys=True))
    return exit_codes.FAILED if failed else exit_codes.OK


def _revert(stubs: dict[str, retina_pb2_grpc.RetinaWorkerServiceStub],
            args: argparse.Namespace) -> int:
    """The revert goes to the node whose lineage holds the rewrite the id (or a unique
    prefix of it) names."""
    try:
        node, rewrite_id = resolve_rewrite_id(args.rewrite_id,
                                              *_known_rewrites(stubs, args.timeout))
    except RewriteIdError as exc:
        print(f"{PROG}: {exc}", file=sys.stderr)
        return exc.exit_code
    try:
        reply = stubs[node].RevertGcRewrite(pb.RevertGcRewriteRequest(rewrite_id=rewrite_id),
                                            timeout=args.timeout)
    except grpc.RpcError as exc:
        print(f"{node}: revert of {rewrite_id} refused: {exc.code().name}: {exc.details()}",
              file=sys.stderr)
        return exit_codes.FAILED
    record = message_dict(reply.record)
    if args.json:
        print(json.dumps(record, indent=2, sort_keys=True))
    else:
        show_lineage(node, [record])
    return exit_codes.OK


if __name__ == "__main__":
    sys.exit(main())
