"""``retina-catalog``: administer the catalog from a shell (prints JSON).

    retina-catalog bootstrap
    retina-catalog create-schema NAME
    retina-catalog create-table SCHEMA TABLE --column id:int64 --column v:string --primary-key id
                   (--column name:type:notnull: a NOT NULL column)
    retina-catalog show-table SCHEMA TABLE
    retina-catalog add-column SCHEMA TABLE NAME TYPE   (nullable; idempotent)
    retina-catalog add-path SCHEMA TABLE URI
    retina-catalog add-file PATH_ID NAME TYPE [--row-groups N] [--rows MIN MAX] [--cleanup-at MS]
    retina-catalog update-file FILE_ID [--type T] [--rows MIN MAX] [--cleanup-at MS|none]
                               [--expect T]
    retina-catalog delete-files FILE_ID...
    retina-catalog list-files [--path-id ID] [--type T ...]
    retina-catalog swap NEW_FILE_ID OLD_FILE_ID... [--cleanup-at MS]
    retina-catalog temporary-due --ttl-ms MS
    retina-catalog retired-due

Exit codes: 0 done, 1 refused by a catalog rule (nothing changed),
2 usage or configuration error, 3 outcome unknown (re-read before retrying).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from typing import Any

from retina_common import exit_codes, failpoints
from retina_common.catalog import (
    Catalog,
    CatalogError,
    CatalogOutcomeUnknown,
    ColumnSpec,
    FileType,
)
from retina_common.catalog.model import VALID_COLUMN_TYPES
from retina_common.config import ConfigError, load_config


def _json(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {k: _json(v) for k, v in dataclasses.asdict(value).items()}
    if isinstance(value, list | tuple):
        return [_json(v) for v in value]
    if isinstance(value, FileType):
        return value.name
    return value


def parse_file_type(text: str) -> FileType:
    """argparse type of a file-type argument (any case); shared with retina-admin."""
    try:
        return FileType[text.upper()]
    except KeyError:
        raise argparse.ArgumentTypeError(
            f"unknown file type {text!r}; one of {[t.name for t in FileType]}") from None


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="retina-catalog", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", help="TOML config file (default: $RETINA_CONFIG)")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("bootstrap")
    p = sub.add_parser("create-schema")
    p.add_argument("name")
    p = sub.add_parser("create-table")
    p.add_argument("schema")
    p.add_argument("table")
    p.add_argument("--column", action="append", required=True,
                   help="name:type, or name:type:notnull for a NOT NULL column")
    p.add_argument("--primary-key", required=True, help="comma-separated column names")
    p = sub.add_parser("show-table")
    p.add_argument("schema")
    p.add_argument("table")
    p = sub.add_parser("add-column", help="append a nullable column (schema evolution)")
    p.add_argument("schema")
    p.add_argument("table")
    p.add_argument("name")
    p.add_argument("type", help="a column type, e.g. int64, string, decimal(12,2)")
    p = sub.add_parser("add-path")
    p.add_argument("schema")
    p.add_argument("table")
    p.add_argument("uri")
    p = sub.add_parser("add-file")
    p.add_argument("path_id", type=int)
    p.add_argument("name")
    p.add_argument("type", type=parse_file_type)
    p.add_argument("--row-groups", type=int, default=1)
    p.add_argument("--rows", type=int, nargs=2, metavar=("MIN", "MAX"))
    p.add_argument("--cleanup-at", type=int)
    p = sub.add_parser("update-file")
    p.add_argument("file_id", type=int)
    p.add_argument("--type", type=parse_file_type)
    p.add_argument("--rows", type=int, nargs=2, metavar=("MIN", "MAX"))
    p.add_argument("--cleanup-at", help="ms since epoch, or 'none'")
    p.add_argument("--expect", type=parse_file_type, help="refuse unless the file has this type")
    p = sub.add_parser("delete-files")
    p.add_argument("file_ids", type=int, nargs="+")
    p = sub.add_parser("list-files")
    p.add_argument("--path-id", type=int)
    p.add_argument("--type", type=parse_file_type, action="append")
    p = sub.add_parser("swap")
    p.add_argument("new_file_id", type=int)
    p.add_argument("old_file_ids", type=int, nargs="+")
    p.add_argument("--cleanup-at", type=int, help="default: now")
    p = sub.add_parser("temporary-due")
    p.add_argument("--ttl-ms", type=int, required=True)
    sub.add_parser("retired-due")
    return parser


def _run(catalog: Catalog, args: argparse.Namespace) -> Any:
    cmd = args.command
    if cmd == "bootstrap":
        return {"previous_version": catalog.bootstrap()}
    if cmd == "create-schema":
        return catalog.create_schema(args.name)
    if cmd == "create-table":
        columns = []
        for spec in args.column:
            name, sep, type_name = spec.partition(":")
            if not sep:
                raise argparse.ArgumentTypeError(f"--column {spec!r} is not name:type[:notnull] "
                                                 f"(types: {VALID_COLUMN_TYPES})")
            type_name, _, flag = type_name.partition(":")
            if flag not in ("", "notnull"):
                raise argparse.ArgumentTypeError(f"--column {spec!r}: {flag!r} is not 'notnull'")
            columns.append(ColumnSpec(name, type_name, nullable=flag != "notnull"))
        return catalog.create_table(args.schema, args.table, columns, args.primary_key.split(","))
    if cmd == "show-table":
        return catalog.get_table(args.schema, args.table)
    if cmd == "add-column":
        return catalog.add_column(args.schema, args.table, args.name, args.type)
    if cmd == "add-path":
        table = catalog.get_table(args.schema, args.table)
        return catalog.add_path(table.table_id, args.uri)
    if cmd == "add-file":
        lo, hi = args.rows or (None, None)
        return catalog.add_file(args.name, args.type, args.row_groups, args.path_id, lo, hi,
                                args.cleanup_at)
    if cmd == "update-file":
        changes: dict[str, Any] = {}
        if args.type is not None:
            changes["file_type"] = args.type
        if args.rows:
            changes["min_row_id"], changes["max_row_id"] = args.rows
        if args.cleanup_at is not None:
            changes["cleanup_at"] = None if args.cleanup_at == "none" else int(args.cleanup_at)
        return catalog.update_file(args.file_id, expected_type=args.expect, **changes)
    if cmd == "delete-files":
        return {"deleted": catalog.delete_files(args.file_ids)}
    if cmd == "list-files":
        types = args.type or list(FileType)
        return catalog.get_files_by_type(args.path_id, types)
    if cmd == "swap":
        cleanup_at = args.cleanup_at if args.cleanup_at is not None else int(time.time() * 1000)
        return catalog.atomic_swap_files(args.new_file_id, args.old_file_ids, cleanup_at)
    if cmd == "temporary-due":
        return catalog.list_temporary_files_due(args.ttl_ms)
    return catalog.list_retired_files_due()


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        config = load_config(args.config)
        failpoints.load_from_env()
    except (ConfigError, failpoints.FailpointError) as exc:
        print(f"retina-catalog: {exc}", file=sys.stderr)
        return exit_codes.USAGE
    catalog = Catalog(config.catalog.dsn, connect_timeout_s=config.catalog.connect_timeout_s)
    try:
        print(json.dumps(_json(_run(catalog, args)), indent=2))
        return exit_codes.OK
    except CatalogOutcomeUnknown as exc:
        print(f"retina-catalog: outcome unknown: {exc}", file=sys.stderr)
        return exit_codes.OUTCOME_UNKNOWN
    except (CatalogError, argparse.ArgumentTypeError) as exc:
        print(f"retina-catalog: {type(exc).__name__}: {exc}", file=sys.stderr)
        return exit_codes.FAILED
    finally:
        catalog.close()


if __name__ == "__main__":
    sys.exit(main())
