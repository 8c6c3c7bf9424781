"""The campaign's application writer: one ``DurableWriter`` in a process of its own.

    python -m chaos.app_writer --config F --writer ID --table SCHEMA.TABLE

Started by the campaign (``chaos/app_workload.py``) with its standard input and output
as pipes; ``RETINA_FAILPOINTS`` is loaded as in every Retina process (the ``writer.*``
points kill it inside a transaction). It opens the writer (registers it as a replay
source, then finishes the transactions an earlier process of the same id left in
doubt), then runs one transaction per line of its standard input and answers each on
its standard output, one JSON object a line::

    in:  {"seq": 7, "upserts": [{column: value, ...}], "deletes": [{key column: value}]}
    out: {"opened": true}                                   once open() returned
         {"open_failed": "..."}                             then exit 1
         {"seq": 7, "ts": 123}                              committed and acknowledged
         {"seq": 7, "error": "...", "logged": true|false}   not acknowledged

A transaction that failed after it reached the writer's changelog (``logged``) is in
doubt: the process answers, then exits 1, as ``retina-write`` does, and the campaign
starts another one, whose open applies it. One that failed before its log append (the
TransServer unreachable at BeginTrans) was never sent: the process answers and goes on.
End of input: exit 0. Anything else that goes wrong is a defect of this program: exit 3.
Everything the process logs goes to its standard error (the campaign's log file), so
that its standard output carries answers only.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import traceback
from collections.abc import Callable
from typing import Any, TextIO

import grpc

from retina_common import exit_codes, failpoints
from retina_common.catalog import CatalogError
from retina_common.changelog import BatchRecord, LoggedTransaction
from retina_common.config import load_config
from retina_common.etcd import EtcdError
from retina_common.log import configure_logging
from retina_common.replay_sources import ReplaySourceError
from retina_common.writer import DurableWriter, WriteInDoubt, WriteRefused, WriterSettings

# A defect of the writer itself (an exception it does not expect): the campaign's anomaly.
# In doubt after a logged failure it exits exit_codes.FAILED, as retina-write does.
EXIT_DEFECT = 3
# Like the connector's in the campaign (cluster.CDC_SETTINGS): a writer killed with its
# transaction open holds the TransServer's high-water mark for this long.
LEASE_MS = 2000
# A node down for longer than this leaves the transaction in doubt (the heal gives a
# node 60 s to be READY again).
SEND_DEADLINE_S = 60.0
# What a transaction may fail with, the campaign's faults being what they are.
EXPECTED_ERRORS = (WriteRefused, WriteInDoubt, grpc.RpcError, EtcdError, CatalogError,
                   ReplaySourceError, OSError)


class AppendWatch:
    """Whether the writer's changelog took an append since :meth:`reset`: its ``append``
    wrapped, the flag set once it returned (the transaction durable in the log)."""

    def __init__(self, writer: DurableWriter) -> None:
        self.logged = False
        original: Callable[[list[LoggedTransaction]], BatchRecord] = writer.changelog.append

        def append(transactions: list[LoggedTransaction]) -> BatchRecord:
            record = original(transactions)
            self.logged = True
            return record

        writer.changelog.append = append  # type: ignore[method-assign]

    def reset(self) -> None:
        self.logged = False


def answers_channel() -> TextIO:
    """The process's standard output for answers only: a copy of its descriptor, and
    descriptor 1 pointed at standard error, where every log line then goes."""
    answers = os.fdopen(os.dup(sys.stdout.fileno()), "w", buffering=1)
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    return answers


def answer(out: TextIO, message: dict[str, Any]) -> None:
    out.write(json.dumps(message, separators=(",", ":")) + "\n")
    out.flush()


def describe(exc: BaseException) -> str:
    if isinstance(exc, grpc.RpcError):
        return f"{type(exc).__name__}: {exc.code().name}: {exc.details()}"
    return f"{type(exc).__name__}: {exc}"


def serve(writer: DurableWriter, table: str, commands: TextIO, out: TextIO) -> int:
    """Open the writer, then one transaction per command line; the exit code."""
    watch = AppendWatch(writer)
    try:
        writer.open()
    except EXPECTED_ERRORS as exc:
        answer(out, {"open_failed": describe(exc)})
        return exit_codes.FAILED
    answer(out, {"opened": True})
    for line in commands:
        command = json.loads(line)
        watch.reset()
        try:
            ts = writer.write(table, upserts=command["upserts"], deletes=command["deletes"])
        except EXPECTED_ERRORS as exc:
            answer(out, {"seq": command["seq"], "error": describe(exc),
                         "logged": watch.logged})
            if watch.logged:
                return exit_codes.FAILED  # the next process's open applies it
            continue
        answer(out, {"seq": command["seq"], "ts": ts})
    return exit_codes.OK


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="chaos.app_writer", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True)
    parser.add_argument("--writer", required=True, help="the writer id")
    parser.add_argument("--table", required=True, help="SCHEMA.TABLE")
    args = parser.parse_args(argv)
    out = answers_channel()
    configure_logging("app-writer", writer_id=args.writer)
    try:
        failpoints.load_from_env()
        schema, _, table = args.table.partition(".")
        writer = DurableWriter.connect(load_config(args.config), args.writer, schema,
                                       WriterSettings(lease_ms=LEASE_MS,
                                                      send_deadline_s=SEND_DEADLINE_S))
        try:
            return serve(writer, table, sys.stdin, out)
        finally:
            writer.close()
    except Exception:
        traceback.print_exc()
        return EXIT_DEFECT


if __name__ == "__main__":
    sys.exit(main())
