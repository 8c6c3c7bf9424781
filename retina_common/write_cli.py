"""``retina-write``: write rows to a Retina table durably, from the shell.

    retina-write --writer ID SCHEMA.TABLE [--rows JSON] [--delete | --partial]

Rows are JSON objects (``--rows '[{"id": 1, "name": "a"}]'``, or one object per line
on standard input). Each call is one transaction through
``retina_common.writer.DurableWriter``: registered as the replay source ID, logged
durably under ``<storage.root>/_writers/ID``, then sent and committed, so the rows
survive a crash of any node (docs/operations.md, "Writing to Retina"). A row is an
upsert: a row whose key exists replaces it. ``--delete`` deletes the rows' keys (only
the key columns are needed). ``--partial`` sets only the columns each row names (the
key columns among them): the row's other columns keep their values, and a key with no
row gets NULL there (docs/encoding.md, "Partial updates"). A decimal column takes a
number or a string; a binary column takes a string (its UTF-8 bytes).

Prints the transaction's commit timestamp. Exit codes: 0 committed; 1 refused, or in
doubt (logged but not confirmed: it is applied by the next ``retina-write`` with the
same ``--writer``); 2 usage or configuration error.
"""

from __future__ import annotations

import argparse
import json
import sys
from decimal import Decimal, InvalidOperation
from typing import Any

import grpc

from retina_common import exit_codes, failpoints
from retina_common.catalog import CatalogError, NotFound, TableRecord
from retina_common.client import Row
from retina_common.codec import EncodingError
from retina_common.config import ConfigError
from retina_common.etcd import EtcdError
from retina_common.log import configure_logging
from retina_common.replay_sources import ReplaySourceError
from retina_common.topology import load_config_and_topology
from retina_common.writer import (
    DurableWriter,
    TableChanges,
    WriteInDoubt,
    WriteRefused,
    WriterSettings,
)

PROG = "retina-write"


class UsageError(Exception):
    pass


def parse_rows(text: str) -> list[dict[str, Any]]:
    text = text.strip()
    if not text:
        raise UsageError("no rows given (--rows JSON, or JSON objects on standard input)")
    try:
        parsed = json.loads(text) if text.startswith("[") else [
            json.loads(line) for line in text.splitlines() if line.strip()]
    except json.JSONDecodeError as exc:
        raise UsageError(f"rows are not JSON: {exc}") from None
    if not all(isinstance(r, dict) for r in parsed):
        raise UsageError("every row must be a JSON object of column: value")
    return parsed


def typed(table: TableRecord, row: dict[str, Any]) -> dict[str, Any]:
    """JSON values as the codec takes them: decimals as Decimal, binary as bytes."""
    types = {c.name: c.type for c in table.columns}
    unknown = sorted(set(row) - set(types))
    if unknown:
        raise UsageError(f"{table.name} has no column(s) {', '.join(unknown)} "
                         f"(columns: {', '.join(types)})")
    out = dict(row)
    for name, value in row.items():
        if value is None:
            continue
        if types[name].startswith("decimal"):
            try:
                out[name] = Decimal(str(value))
            except InvalidOperation:
                raise UsageError(f"{name}: {value!r} is not a decimal") from None
        elif types[name] == "binary" and isinstance(value, str):
            out[name] = value.encode()
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", help="TOML config file (default: $RETINA_CONFIG)")
    parser.add_argument("--writer", required=True,
                        help="the writer id: one changelog, one process at a time")
    parser.add_argument("table", help="SCHEMA.TABLE")
    parser.add_argument("--rows", help="a JSON array of row objects (default: stdin)")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--delete", action="store_true", help="delete the rows' keys")
    mode.add_argument("--partial", action="store_true",
                      help="set only the columns each row names (the key among them)")
    parser.add_argument("--lease-ms", type=int, default=WriterSettings.lease_ms,
                        help="the write transaction's lease (default %(default)s): if this "
                             "process dies mid-commit, reads wait at most this long for it")
    args = parser.parse_args(argv)
    try:
        if args.lease_ms < 1000:
            raise UsageError(f"--lease-ms {args.lease_ms}: at least 1000")
        failpoints.load_from_env()
        config, topology = load_config_and_topology(args.config)
        schema, _, table = args.table.partition(".")
        if not schema or not table:
            raise UsageError(f"table {args.table!r}: expected SCHEMA.TABLE")
        rows = parse_rows(args.rows if args.rows is not None else sys.stdin.read())
    except (UsageError, ConfigError, failpoints.FailpointError) as exc:
        print(f"{PROG}: {exc}", file=sys.stderr)
        return exit_codes.USAGE
    # The writer's warnings (a node unavailable, an in-doubt transaction sent again) go
    # to stderr, as JSON lines; stdout carries the result alone.
    configure_logging("retina-write", "warning", file=sys.stderr, writer=args.writer)
    try:
        writer = DurableWriter.connect(config, args.writer, schema, topology=topology,
                                       settings=WriterSettings(lease_ms=args.lease_ms))
    except (ReplaySourceError, ConfigError) as exc:
        print(f"{PROG}: {exc}", file=sys.stderr)
        return exit_codes.USAGE
    try:
        return _write(writer, schema, table, rows,
                      "delete" if args.delete else "partial" if args.partial else "upsert")
    finally:
        writer.close()


def _write(writer: DurableWriter, schema: str, table: str, rows: list[dict[str, Any]],
           mode: str) -> int:
    try:
        writer.open()
        record = writer.table_record(table)
        typed_rows: list[Row] = [typed(record, r) for r in rows]
        changes = {"delete": TableChanges(deletes=typed_rows),
                   "partial": TableChanges(partials=typed_rows)}.get(mode,
                                                                     TableChanges(typed_rows))
        ts = writer.commit({table: changes})
    except (NotFound, UsageError, KeyError, ReplaySourceError, EncodingError, ValueError,
            grpc.RpcError, WriteRefused, WriteInDoubt, EtcdError, CatalogError) as exc:
        message, code = _failure(exc, f"{schema}.{table}")
        print(f"{PROG}: {message}", file=sys.stderr)
        return code
    print(f"committed {len(rows)} row(s) to {schema}.{table} at ts {ts} "
          f"(writer {writer.writer_id})")
    return exit_codes.OK


def _failure(exc: Exception, table: str) -> tuple[str, int]:
    """What to say about a write that did not commit, and the exit code."""
    if isinstance(exc, NotFound):
        return f"no table {table} in the catalog", exit_codes.USAGE
    if isinstance(exc, KeyError):
        return f"a row lacks the key column {exc}", exit_codes.USAGE
    if isinstance(exc, (UsageError, ReplaySourceError)):
        return str(exc), exit_codes.USAGE
    if isinstance(exc, EncodingError):
        return f"refused: {exc}", exit_codes.FAILED
    if isinstance(exc, ValueError):  # a partial row refused (the message says what was logged)
        return f"refused: {exc}", exit_codes.USAGE
    if isinstance(exc, grpc.RpcError):
        return (f"the TransServer answered {exc.code().name}: {exc.details()}; nothing of "
                "this transaction was logged or sent", exit_codes.FAILED)
    return str(exc), exit_codes.FAILED  # WriteRefused, WriteInDoubt (they say so), etcd, catalog


if __name__ == "__main__":
    sys.exit(main())
