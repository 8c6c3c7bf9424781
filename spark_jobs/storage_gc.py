"""Storage GC, the heavy part: rewrite files of a table without the rows deleted at or
below ``safeGcTs``, and merge runs of small files, with Spark; the owning Retina node
commits each rewrite (docs/architecture.md, "Storage GC and sweepers: who does what").

The job never makes a file REGULAR and never touches an index or visibility. Per run:

1. begin a read-only transaction at the TransServer: the query gate grants it only while
   every Retina node is READY (refused: exit 4, nothing done). Its lease is kept alive
   while the job runs, and it is ended at the end. Inside its lifetime: GetSafeGcTimestamp,
   then ListQueryFiles(trans_id, schema, table): the only way candidates are enumerated
   (never an admin enumeration of the catalog);
2. plan, on the driver: every listed file belongs to one stream, ``(table, vnode)`` of
   the node that created it (both from its name). QueryVisibility at safeGcTs gives each
   file's row count, deleted rows and place in the stream (the node's firstBlockId: a GC
   output takes the place of the files it replaced, which its name does not show); its
   size comes from storage. A group is a run of files of ONE stream, CONSECUTIVE in that
   order (the node refuses anything else): a file whose deleted fraction is at least
   ``--deleted-threshold`` alone, or at least two small files (``< --small-file-bytes``)
   of comparable size (``--size-ratio``, ``--min-tier-bytes``: size-tiered, see
   storage_gc_plan.py) merged up to ``--target-file-bytes``; a file its node holds
   (QueryVisibility's gc_hold) is in no group. A file whose
   visibility the node cannot answer at safeGcTs (FAILED_PRECONDITION snapshot_expired:
   its visibility base is above it), or that was replaced since the listing, is skipped
   for this run and reported, and its stream is left alone (its place is unknown);
3. per group, the owning node's PrepareGcRewrite names the rewrite, the new file, where it
   goes, the cutoff (the visibility the task reads is at exactly that cutoff) and the rows
   the node expects to survive;
4. one Spark task per prepared group (``storage_gc_task.rewrite_group``): each old file
   in the given order, its QueryVisibility at the cutoff, the Parquet rows minus the
   deleted ones (an Arrow filter on a NumPy mask), concatenated in order and written as
   ONE new Parquet file with the same schema (``_commit_ts`` carried unchanged). The
   catalog row (TEMPORARY_GC) is registered BEFORE the bytes are written, so that bytes
   on storage always have a catalog row the TTL sweeper can find; the bytes go through
   ``write_durably`` (temp + fsync + rename + directory fsync);
5. the driver sends CommitGcRewrite(rewrite_id, new_file_id) to the owning node as each
   task finishes, or AbortGcRewrite (best effort) when the task failed or the node refused.

A killed driver leaves at most prepared rewrites (the node forgets them when they expire)
and TEMPORARY_GC files (the sweeper removes them); a second run plans from what is REGULAR
then. Exit codes (spark_jobs.common): 0 every group committed, or nothing to do; 1 a group
failed otherwise; 2 bad arguments or configuration, a schema or table the catalog does not
know; 3 a group was refused; 4 unavailable (gate closed, a node or the catalog away).
Per-group failures never stop the other groups.

This module is the command; the job's parts are modules of their own:
``storage_gc_plan`` (what the plan is made of, and planning: pure),
``storage_gc_arrow`` (the Arrow part: pure), ``storage_gc_task`` (the task, and running
one per group) and ``storage_gc_driver`` (the driver: steps 1-3 and 5, the report).

    python -m spark_jobs.storage_gc --config retina.toml --schema shop --table orders
    spark-submit spark_jobs/storage_gc.py --config retina.toml --schema shop --all-tables --json
"""


from __future__ import annotations

import argparse
import sys

import grpc

from retina_common import exit_codes
from retina_common.config import Config, ConfigError
from retina_common.log import configure_logging
from spark_jobs.common import add_spark_arguments, fail, load, parse_conf, short_reason
from spark_jobs.storage_gc_driver import PROG, StorageGcJob, code_exit
from spark_jobs.storage_gc_plan import (
    DEFAULT_DELETED_THRESHOLD,
    DEFAULT_MIN_TIER_BYTES,
    DEFAULT_SIZE_RATIO,
    DEFAULT_SMALL_FILE_BYTES,
    DEFAULT_TARGET_FILE_BYTES,
)

DEFAULT_ROW_GROUP_ROWS = 65_536
DEFAULT_LEASE_MS = 60_000
DEFAULT_GROUPS_PER_WAVE = 32


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=PROG, formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Storage GC rewrites with Spark: drop rows deleted at or below safeGcTs "
                    "and merge small files, one task per group; the owning Retina node "
                    "commits each rewrite.",
        epilog="Exit codes: 0 every group committed (or nothing to do), 1 a group failed "
               "otherwise, 2 bad arguments or configuration (also a schema or table the "
               "catalog does not know), 3 a group was refused by its "
               "node, 4 unavailable (the query gate refused, a node or the catalog away).")
    p.add_argument("--config", help="TOML config file (default: $RETINA_CONFIG)")
    p.add_argument("--schema", help="the schema (default: cdc.schema of the config)")
    which = p.add_mutually_exclusive_group(required=True)
    which.add_argument("--table", help="one table (TABLE, or SCHEMA.TABLE)")
    which.add_argument("--all-tables", action="store_true",
                       help="every table of the schema (the catalog's table list)")
    p.add_argument("--deleted-threshold", type=float, default=DEFAULT_DELETED_THRESHOLD,
                   help="rewrite a file whose deleted fraction at safeGcTs is at least this "
                        f"(default {DEFAULT_DELETED_THRESHOLD})")
    p.add_argument("--small-file-bytes", type=int, default=DEFAULT_SMALL_FILE_BYTES,
                   help=f"files below this size are merged (default {DEFAULT_SMALL_FILE_BYTES})")
    p.add_argument("--target-file-bytes", type=int, default=DEFAULT_TARGET_FILE_BYTES,
                   help="a merged file grows up to about this size "
                        f"(default {DEFAULT_TARGET_FILE_BYTES})")
    p.add_argument("--size-ratio", type=float, default=DEFAULT_SIZE_RATIO,
                   help="size-tiered merging: an older small file joins a group only while it "
                        "is at most this times the group's size so far, so a merged file is "
                        "rewritten again only once that share of its size arrived beside it "
                        f"(default {DEFAULT_SIZE_RATIO})")
    p.add_argument("--min-tier-bytes", type=int, default=DEFAULT_MIN_TIER_BYTES,
                   help="in that comparison, files and groups below this count as this size "
                        f"(default {DEFAULT_MIN_TIER_BYTES}: the smallest files are one tier)")
    p.add_argument("--row-group-rows", type=int, default=DEFAULT_ROW_GROUP_ROWS,
                   help=f"rows per row group of a new file (default {DEFAULT_ROW_GROUP_ROWS})")
    p.add_argument("--max-groups", type=int, default=0,
                   help="rewrite at most this many groups, in plan order (default 0: all)")
    p.add_argument("--groups-per-wave", type=int, default=DEFAULT_GROUPS_PER_WAVE,
                   help="groups prepared and handed to Spark at a time "
                        f"(default {DEFAULT_GROUPS_PER_WAVE})")
    p.add_argument("--lease-ms", type=int, default=DEFAULT_LEASE_MS,
                   help="lease of the job's read transaction, renewed every third of it "
                        f"(default {DEFAULT_LEASE_MS})")
    p.add_argument("--node", help="only the streams of this Retina node (host:port); the "
                                  "node's own GC scheduler runs the job this way")
    p.add_argument("--dry-run", action="store_true", help="print the plan only; change nothing")
    p.add_argument("--json", action="store_true", help="also print the report as JSON")
    add_spark_arguments(p)
    return p


def check_args(args: argparse.Namespace, config: Config) -> str | None:
    """Normalises schema/table; returns what is wrong, if anything."""
    if args.table and "." in args.table:
        schema, _dot, table = args.table.partition(".")
        if args.schema and args.schema != schema:
            return f"--table {args.table} disagrees with --schema {args.schema}"
        args.schema, args.table = schema, table
    args.schema = args.schema or config.cdc.schema
    if not args.schema or (args.table is not None and not args.table):
        return "give the table as --table TABLE (with --schema) or SCHEMA.TABLE"
    if not 0.0 <= args.deleted_threshold <= 1.0:
        return "--deleted-threshold must be between 0 and 1"
    if args.small_file_bytes < 0 or args.target_file_bytes < 1:
        return "--small-file-bytes must not be negative, --target-file-bytes must be positive"
    if args.size_ratio <= 0 or args.min_tier_bytes < 0:
        return "--size-ratio must be positive, --min-tier-bytes must not be negative"
    if args.row_group_rows < 1 or args.max_groups < 0 or args.groups_per_wave < 1:
        return "--row-group-rows and --groups-per-wave must be positive, --max-groups >= 0"
    if args.lease_ms < 3000:
        return "--lease-ms must be at least 3000"
    return None


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        config, topology = load(args.config)
        parse_conf(args.conf)
    except ConfigError as exc:
        return fail(PROG, str(exc), exit_codes.USAGE)
    problem = check_args(args, config)
    if args.node and args.node not in topology.nodes:
        problem = f"--node {args.node} is not in the topology {list(topology.nodes)}"
    if problem:
        return fail(PROG, problem, exit_codes.USAGE)
    log = configure_logging(PROG, config.log_level)
    job = StorageGcJob(args, config, topology, log)
    try:
        return job.run()
    except grpc.RpcError as exc:
        return fail(PROG, short_reason(exc), code_exit(exc.code()))
    finally:
        job.close()


if __name__ == "__main__":
    # Run as a script or with -m, this module is __main__; what a Spark task runs lives in
    # spark_jobs.storage_gc_task, so tasks pickle references to it, which executors import.
    sys.exit(main())
