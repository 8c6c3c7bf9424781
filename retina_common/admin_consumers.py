"""``retina-admin consumer ...``: registered change-feed consumers (docs/change-feed.md).

    retina-admin consumer register NAME [--cursor TS] [--table SCHEMA.TABLE]  (no --cursor: the HWM)
    retina-admin consumer commit NAME TS
    retina-admin consumer list
    retina-admin consumer drop NAME

A registered consumer keeps the changes above its cursor readable (it holds safeGcTs)
until it lags more than ``trans.max_consumer_lag_ms``; a cursor below the GC horizon is
refused ``changes_expired``, naming the earliest cursor accepted.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from typing import Any

import grpc

from retina_common.admin_cluster import Cluster, report_dropped, rpc_failed
from retina_common.as_of_point import format_ms
from retina_common.consumer_client import ConsumerClient, ConsumerState

EXIT_OK = 0


def add_parsers(sub: Any, common: argparse.ArgumentParser) -> None:
    consumers = sub.add_parser(
        "consumer", help="registered change-feed consumers: cursors that hold history"
    ).add_subparsers(dest="consumer_command", required=True)
    s = consumers.add_parser("register", parents=[common], help="register a consumer")
    s.add_argument("name", metavar="NAME")
    s.add_argument("--cursor", type=int, metavar="TS",
                   help="every change at or below TS was delivered (default: the newest, "
                        "the high watermark)")
    s.add_argument("--table", default="", metavar="SCHEMA.TABLE",
                   help="what it follows (informative)")
    s = consumers.add_parser("commit", parents=[common], help="move a consumer's cursor forward")
    s.add_argument("name", metavar="NAME")
    s.add_argument("cursor", type=int, metavar="TS")
    consumers.add_parser("list", parents=[common], help="every consumer with its lag")
    s = consumers.add_parser("drop", parents=[common], help="unregister a consumer")
    s.add_argument("name", metavar="NAME")


def _client(cluster: Cluster) -> ConsumerClient:
    return ConsumerClient(cluster.trans, cluster.timeout_s)


def _answer(args: argparse.Namespace, call: Callable[[], ConsumerState]) -> int:
    """Run a register or commit; print the consumer it answers."""
    try:
        c = call()
    except grpc.RpcError as exc:
        return rpc_failed(exc, f"consumer {args.name}")
    if args.json:
        print(json.dumps(c.to_dict(), indent=2))
    else:
        print(f"consumer {c.name} at cursor {c.cursor_ts}"
              + (f" ({c.table})" if c.table else "")
              + f", {c.lag_ms} ms / {c.lag_commits} commit(s) behind")
    return EXIT_OK


def cmd_consumer_register(cluster: Cluster, args: argparse.Namespace) -> int:
    client = _client(cluster)

    def register() -> ConsumerState:
        cursor = client.high_watermark() if args.cursor is None else args.cursor
        return client.register(args.name, cursor, args.table)
    return _answer(args, register)


def cmd_consumer_commit(cluster: Cluster, args: argparse.Namespace) -> int:
    return _answer(args, lambda: _client(cluster).commit(args.name, args.cursor))


def cmd_consumer_list(cluster: Cluster, args: argparse.Namespace) -> int:
    try:
        listed = _client(cluster).list()
    except grpc.RpcError as exc:
        return rpc_failed(exc, "consumers")
    if args.json:
        print(json.dumps({"consumers": [c.to_dict() for c in listed.consumers],
                          "max_consumer_lag_ms": listed.max_consumer_lag_ms}, indent=2))
    elif not listed.consumers:
        print("no consumers")
    else:
        width = max(len(c.name) for c in listed.consumers)
        for c in listed.consumers:
            print(f"{c.name:<{width}}  cursor {c.cursor_ts}  lag {c.lag_ms} ms "
                  f"({c.lag_commits} commits)  renewed {format_ms(c.renewed_ms)}"
                  + (f"  {c.table}" if c.table else ""))
        print(f"dropped past {listed.max_consumer_lag_ms} ms of lag "
              "(trans.max_consumer_lag_ms)")
    return EXIT_OK


def cmd_consumer_drop(cluster: Cluster, args: argparse.Namespace) -> int:
    try:
        dropped = _client(cluster).drop(args.name)
    except grpc.RpcError as exc:
        return rpc_failed(exc, f"consumer {args.name}")
    return report_dropped("consumer", args.name, dropped, args.json)
