"""The change feed of one table over a timestamp range into a Spark DataFrame, one Spark
task per virtual node (docs/spark.md, "Reading the change feed").

The driver, before any task runs:

1. fixes the range's end: ``to_ts`` if given, at most the newest snapshot (the newest
   snapshot when none is given), so every task reads the same ``(from_ts, to_ts]``
   whenever it runs (SAME_RANGE_EVERY_TASK: a task's own read would end at its own
   newest snapshot otherwise);
2. holds the range's history with an AS OF read transaction at ``from_ts + 1``
   (``ChangeFeedReader.hold``) until the DataFrame is materialised: a cursor older than
   the history kept is refused ``changes_expired`` here, before Spark starts, and no
   task meets a horizon that moved past ``from_ts`` meanwhile;
3. asks a node for the changes' schema (``ChangeFeedReader.raw_schema``).

Each task reads its virtual node's part of every commit (``ChangeFeedReader.read(...,
vnodes=[v], raw=True)``), with ``_vnode`` and ``_seq``. The order within a commit is
(virtual node, seq) (retina_server/change_feed.py), so the global ``_ordinal`` is the
rank of (``_vnode``, ``_seq``) within the commit: the one the client merge gives
(SAME_ORDINAL_AS_THE_MERGE). The DataFrame has the client merge's columns:
``_change_type``, ``_commit_ts``, ``_ordinal``, ``_source_position``, the key, the columns
asked for.

    python -m spark_jobs.changes_query --config retina.toml --table shop.orders \\
        --from 81233 --output /data/orders-changes
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterable, Iterator, Sequence
from contextlib import ExitStack, contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import grpc
import pyarrow as pa

from retina_common import exit_codes
from retina_common import tls as tls_mod
from retina_common.change_reader import (
    CHANGE_TYPE,
    COMMIT_TS,
    ORDINAL,
    SOURCE_POSITION,
    BadCursor,
    ChangesExpired,
    decode_cursor,
    encode_cursor,
)
from retina_common.config import ConfigError, TlsConfig
from retina_common.reader import SnapshotReader
from retina_common.refusal import Unreachable
from retina_common.topology import Topology
from spark_jobs.common import (
    REFUSED_MARK,
    TaskError,
    add_frame_arguments,
    add_spark_arguments,
    exit_code_of,
    fail,
    frame_arguments_error,
    load,
    parse_conf,
    report_frame,
    short_reason,
    spark_session,
)

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession

PROG = "changes_query"
RPC_TIMEOUT_S = 60.0
VNODE, SEQ = "_vnode", "_seq"  # ReadChanges' order within a commit (raw reads)
CHANGE_COLUMNS = (CHANGE_TYPE, COMMIT_TS, VNODE, SEQ, SOURCE_POSITION)  # before the row's


@dataclass(frozen=True)
class SparkChanges:
    frame: DataFrame  # materialised, ordered by (_commit_ts, _ordinal)
    from_ts: int
    to_ts: int  # the range's end: resume from it (``cursor``)
    tasks: int  # one per virtual node
    schema: str
    table: str

    @property
    def cursor(self) -> str:
        """Resume after this range."""
        return encode_cursor(self.schema, self.table, self.to_ts)


@dataclass(frozen=True)
class RangeSpec:
    """What a task needs to read its virtual node's part: plain, picklable data."""

    trans_address: str
    nodes: tuple[str, ...]
    virtual_nodes: int
    schema: str
    table: str
    from_ts: int
    to_ts: int
    columns: tuple[str, ...]  # the key's and the others', as the driver's schema names them
    keep_unchanged: bool
    tls: TlsConfig = field(default_factory=TlsConfig)  # the driver's: tasks run elsewhere


def read_vnodes(spec: RangeSpec, vnodes: Iterable[int]) -> Iterator[tuple[Any, ...]]:
    """The raw changes of each virtual node in ``vnodes`` over ``spec``'s range, as rows;
    runs inside a Spark task."""
    reader = SnapshotReader(spec.trans_address, Topology(spec.nodes, spec.virtual_nodes),
                            timeout_s=RPC_TIMEOUT_S, tls=spec.tls)
    feed = reader.change_feed()
    try:
        for vnode in vnodes:
            try:
                for commit in feed.read(spec.schema, spec.table, spec.from_ts,
                                        to_ts=spec.to_ts, columns=spec.columns,
                                        keep_unchanged=spec.keep_unchanged,
                                        vnodes=[vnode], raw=True):
                    yield from zip(*(c.to_pylist() for c in commit.changes.columns),
                                   strict=True)
            except ChangesExpired as exc:
                raise TaskError(f"{REFUSED_MARK} virtual node {vnode}: {exc}") from None
            except grpc.RpcError as exc:
                raise TaskError.of(exc, f"reading the changes of virtual node {vnode}") \
                    from None
    finally:
        reader.close()


@dataclass(frozen=True)
class HeldRange:
    """The driver's part, done: the range fixed, its history held, the schema known."""

    spec: RangeSpec
    raw: pa.Schema  # the tasks' output: the changes with _vnode and _seq


@contextmanager
def held_range(trans_address: str, topology: Topology, schema: str, table: str,
               from_ts: int, to_ts: int | None = None, columns: Sequence[str] = (), *,
               keep_unchanged: bool = False, tls: TlsConfig | None = None
               ) -> Iterator[HeldRange]:
    """Steps 1 to 3 of the module docstring; the hold lasts while the context does. Raises
    ChangesExpired when the history above ``from_ts`` is no longer kept."""
    tls = tls_mod.current() if tls is None else tls
    reader = SnapshotReader(trans_address, topology, timeout_s=RPC_TIMEOUT_S, tls=tls)
    feed = reader.change_feed()
    try:
        with reader.transaction() as newest:  # SAME_RANGE_EVERY_TASK
            end = newest.timestamp if to_ts is None else min(to_ts, newest.timestamp)
        end = max(end, from_ts)  # an empty range, not a backwards one
        # Nothing above the newest snapshot to hold (as the merge: it reads nothing then).
        with feed.hold(from_ts) if end > from_ts else nullcontext():
            raw = feed.raw_schema(schema, table, columns)
            # The columns named: a column added while the tasks run is not in their rows.
            named = tuple(c for c in raw.names if c not in CHANGE_COLUMNS)
            yield HeldRange(RangeSpec(trans_address, topology.nodes, topology.virtual_nodes,
                                      schema, table, from_ts, end, named, keep_unchanged,
                                      tls), raw)
    finally:
        reader.close()


def read_changes(spark: SparkSession, trans_address: str, topology: Topology, schema: str,
                 table: str, from_ts: int, to_ts: int | None = None,
                 columns: Sequence[str] = (), *, keep_unchanged: bool = False,
                 tls: TlsConfig | None = None) -> SparkChanges:
    """The changes of ``schema.table`` committed in ``(from_ts, to_ts]`` (``to_ts`` None:
    up to the newest snapshot) as a materialised DataFrame, row for row what
    ``ChangeFeedReader.read`` gives. Raises ChangesExpired (naming the earliest cursor)
    when the history above ``from_ts`` is no longer kept; grpc.RpcError when the gate
    refuses or a node does not answer."""
    with held_range(trans_address, topology, schema, table, from_ts, to_ts, columns,
                    keep_unchanged=keep_unchanged, tls=tls) as held:
        return changes_in(spark, held)


def changes_in(spark: SparkSession, held: HeldRange) -> SparkChanges:
    """Read a held range with Spark, materialised while it is held."""
    spec = held.spec
    frame = _frame(spark, spec, held.raw).localCheckpoint(eager=True)
    return SparkChanges(frame, spec.from_ts, spec.to_ts, spec.virtual_nodes, spec.schema,
                        spec.table)


def _frame(spark: SparkSession, spec: RangeSpec, raw: pa.Schema) -> DataFrame:
    """One task per virtual node, then the ordinal within each commit."""
    from pyspark.sql import Window
    from pyspark.sql import functions as F
    from pyspark.sql.pandas.types import from_arrow_schema

    vnodes = list(range(spec.virtual_nodes))
    rows = spark.sparkContext.parallelize(vnodes, len(vnodes)).mapPartitions(
        lambda part: read_vnodes(spec, part))
    parts = spark.createDataFrame(rows, from_arrow_schema(raw))
    within = Window.partitionBy(COMMIT_TS).orderBy(VNODE, SEQ)  # SAME_ORDINAL_AS_THE_MERGE
    ordinal = (F.row_number().over(within) - 1).cast("long").alias(ORDINAL)
    return parts.select(CHANGE_TYPE, COMMIT_TS, ordinal, SOURCE_POSITION, *spec.columns) \
        .orderBy(COMMIT_TS, ORDINAL)


# --- the command ------------------------------------------------------------------------------
def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=PROG, formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Read one table's change feed over a timestamp range into Spark: one task "
                    "per virtual node; optionally write it as Parquet.",
        epilog="Exit codes: 0 done, 1 failed otherwise, 2 bad arguments or configuration, "
               "3 refused (changes_expired: the cursor is older than the history kept; the "
               "earliest cursor is printed), 4 unavailable (the query gate refused, or a node "
               "did not answer).")
    p.add_argument("--config", help="TOML config file (default: $RETINA_CONFIG)")
    add_frame_arguments(p, "changes")
    p.add_argument("--from", dest="start", required=True, metavar="CURSOR|TS",
                   help="a cursor (or a commit timestamp): the changes above it")
    p.add_argument("--to-ts", type=int, default=None,
                   help="the range's last commit timestamp (default: the newest snapshot)")
    p.add_argument("--columns", default="",
                   help="comma-separated columns besides the key (default: every one)")
    p.add_argument("--keep-unchanged", action="store_true",
                   help="keep updates that changed no column")
    add_spark_arguments(p)
    return p


def report(args: argparse.Namespace, changes: SparkChanges) -> None:
    report_frame(args, changes.frame, lambda count: (
        f"changes of {args.table} in ({changes.from_ts}, {changes.to_ts}]: {count:,} "
        f"({changes.tasks} tasks, one per virtual node); resume from {changes.cursor}"),
        {"from_ts": changes.from_ts, "to_ts": changes.to_ts, "cursor": changes.cursor,
         "tasks": changes.tasks})


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if (error := frame_arguments_error(args)) is not None:
        return fail(PROG, error, exit_codes.USAGE)
    schema, _dot, table = args.table.partition(".")
    try:
        start = decode_cursor(args.start, schema, table)
        config, topology = load(args.config)
        conf = parse_conf(args.conf)
    except (BadCursor, ConfigError) as exc:
        return fail(PROG, str(exc), exit_codes.USAGE)
    if args.to_ts is not None and args.to_ts < start:
        return fail(PROG, f"--to-ts {args.to_ts} is below the start {start}", exit_codes.USAGE)
    columns = [c.strip() for c in args.columns.split(",") if c.strip()]
    try:
        with ExitStack() as stack:
            # The range held (or refused) first: a refusal must not even start Spark.
            held = stack.enter_context(held_range(
                config.trans.listen, topology, schema, table, start, args.to_ts, columns,
                keep_unchanged=args.keep_unchanged))
            spark = spark_session(f"retina-changes-{args.table}", args.master, conf)
            stack.callback(spark.stop)
            report(args, changes_in(spark, held))
    except ChangesExpired as exc:
        return fail(PROG, f"{exc}; the earliest cursor is timestamp {exc.earliest}",
                    exit_codes.REFUSED)
    except Unreachable as exc:
        return fail(PROG, exc.details(), exit_codes.UNAVAILABLE)
    except Exception as exc:
        return fail(PROG, f"change-feed read failed: {short_reason(exc)}", exit_code_of(exc))
    return exit_codes.OK


if __name__ == "__main__":
    # The package's copy of main: tasks then pickle references to importable code.
    from spark_jobs.changes_query import main as package_main

    sys.exit(package_main())
