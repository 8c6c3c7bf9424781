"""``retina-admin pin ...``: named pins, snapshots kept readable until dropped (docs/history.md).

    retina-admin pin create NAME [--at TS | --at-time ISO8601|MS]   (neither: the newest)
    retina-admin pin list
    retina-admin pin drop NAME

A pin is created at the TransServer (CreatePin), atomically with the GC horizon: a point
at or below it is refused snapshot_expired, naming the earliest readable point. Read at
a pin with ``retina-query --pin NAME`` or ``spark_jobs/snapshot_query.py --pin NAME``.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

import grpc

from retina_common.admin_cluster import Cluster, report_dropped, rpc_failed
from retina_common.as_of_point import BadPoint, format_ms, parse_time_ms
from retina_common.pb import trans_pb2 as tpb

EXIT_OK, EXIT_USAGE = 0, 2


def add_parsers(sub: Any, common: argparse.ArgumentParser) -> None:
    pins = sub.add_parser("pin", help="named pins: snapshots kept readable until dropped"
                          ).add_subparsers(dest="pin_command", required=True)
    s = pins.add_parser("create", parents=[common], help="pin a snapshot under a name")
    s.add_argument("name", metavar="NAME")
    at = s.add_mutually_exclusive_group()
    at.add_argument("--at", type=int, metavar="TS",
                    help="a timestamp (neither --at nor --at-time: the newest snapshot)")
    at.add_argument("--at-time", metavar="ISO8601|MS",
                    help="a wall-clock time: the newest commit at or before it")
    pins.add_parser("list", parents=[common], help="every pin")
    s = pins.add_parser("drop", parents=[common], help="release a pin")
    s.add_argument("name", metavar="NAME")


def pin_dict(pin: tpb.Pin) -> dict[str, Any]:
    return {"name": pin.name, "ts": pin.ts, "created_ms": pin.created_ms,
            "at_time_ms": pin.at_time_ms}


def cmd_pin_create(cluster: Cluster, args: argparse.Namespace) -> int:
    try:
        at_time = parse_time_ms(args.at_time) if args.at_time else 0
    except BadPoint as exc:
        print(f"retina-admin: {exc}", file=sys.stderr)
        return EXIT_USAGE
    try:
        ts = args.at or 0
        if not ts and not at_time:  # the newest snapshot: always above the horizon
            ts = cluster.trans.GetHighWatermark(tpb.GetHighWatermarkRequest(),
                                                timeout=cluster.timeout_s).high_watermark
        pin = cluster.trans.CreatePin(tpb.CreatePinRequest(
            name=args.name, ts=ts, at_time_ms=at_time), timeout=cluster.timeout_s).pin
    except grpc.RpcError as exc:
        return rpc_failed(exc, f"pin {args.name}")
    if args.json:
        print(json.dumps(pin_dict(pin), indent=2))
    else:
        asked = f" (the newest commit at or before {format_ms(pin.at_time_ms)})" \
            if pin.at_time_ms else ""
        print(f"pin {pin.name} holds timestamp {pin.ts}{asked}")
    return EXIT_OK


def cmd_pin_list(cluster: Cluster, args: argparse.Namespace) -> int:
    try:
        pins = cluster.trans.ListPins(tpb.ListPinsRequest(), timeout=cluster.timeout_s).pins
    except grpc.RpcError as exc:
        return rpc_failed(exc, "pins")
    rows = [pin_dict(p) for p in pins]
    if args.json:
        print(json.dumps({"pins": rows}, indent=2))
    elif not rows:
        print("no pins")
    else:
        width = max(len(r["name"]) for r in rows)
        for r in rows:
            print(f"{r['name']:<{width}}  ts {r['ts']}  created {format_ms(r['created_ms'])}"
                  + (f"  at time {format_ms(r['at_time_ms'])}" if r["at_time_ms"] else ""))
    return EXIT_OK


def cmd_pin_drop(cluster: Cluster, args: argparse.Namespace) -> int:
    try:
        dropped = cluster.trans.DropPin(tpb.DropPinRequest(name=args.name),
                                        timeout=cluster.timeout_s).dropped
    except grpc.RpcError as exc:
        return rpc_failed(exc, f"pin {args.name}")
    return report_dropped("pin", args.name, dropped, args.json)
