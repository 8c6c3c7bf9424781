"""A gated snapshot read of one table into a Spark DataFrame.

The steps and their order are those of :mod:`retina_common.reader`, with the
file reads spread over Spark tasks:

1. begin a read-only transaction at the TransServer: the query gate grants
   it only while every Retina node is READY. A refusal (UNAVAILABLE) ends
   the job with exit code 4; nothing is ever read around the gate;
2. on the driver, GetWriteBuffer from every node (rows of unpublished files
   visible at the snapshot, with their file id), *then* ListQueryFiles (the
   REGULAR files). A file leaves a write buffer only after it became
   REGULAR, so a row is found in one of the two (or both; step 4 keeps one);
3. one Spark task per REGULAR file reads it at the snapshot timestamp with
   its owner's QueryVisibility (``SnapshotReader._read_file``);
4. the write-buffer rows whose file is not in the REGULAR list are added.

The DataFrame is materialised (``localCheckpoint(eager=True)``) while the
read transaction is still live: a lazy plan evaluated after it ended could
read files or visibility that Storage GC has since folded or removed. Lost
checkpointed blocks fail the job rather than being re-read outside the
snapshot.

A past snapshot (docs/history.md): ``--as-of TS|TIME`` (a timestamp, or an ISO 8601
time: the newest commit at or before it) or ``--pin NAME`` (a named pin: what a long
job should read, since the pin, not the transaction's lease, keeps it readable). A point
older than the history kept is refused (exit 3, snapshot_expired, naming the earliest
readable point) before Spark starts.

    python -m spark_jobs.snapshot_query --config retina.toml --table shop.orders --show 20
    python -m spark_jobs.snapshot_query --config retina.toml --table shop.orders --pin eod
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Iterable, Iterator
from contextlib import ExitStack
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Any

import grpc
import pyarrow as pa
import pyarrow.compute as pc

from retina_common import exit_codes
from retina_common import tls as tls_mod
from retina_common.as_of_point import NEWEST, AsOf, BadPoint, format_ms, parse_as_of
from retina_common.client import CHANNEL_OPTIONS
from retina_common.config import Config, ConfigError, TlsConfig
from retina_common.pb import retina_pb2 as rpb
from retina_common.pb import retina_pb2_grpc, trans_pb2_grpc
from retina_common.pb import trans_pb2 as tpb
from retina_common.reader import FILE_ID, HIDDEN, SnapshotReader
from retina_common.refusal import (
    Unreachable,
    earliest_readable,
    reaching_node,
    reaching_trans_server,
)
from retina_common.schema_evolution import conform
from retina_common.topology import Topology, load_config_and_topology, load_topology
from spark_jobs.common import (
    FileRef,
    add_frame_arguments,
    add_spark_arguments,
    call_with_retry,
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

PROG = "snapshot_query"
RPC_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class SparkSnapshot:
    frame: DataFrame  # materialised; the table's columns only
    timestamp: int
    files: int  # REGULAR files read, one Spark task each
    buffer_rows: int  # write-buffer rows added from the driver


@dataclass(frozen=True)
class FileReadSpec:
    """Everything a file-reading task needs: plain, picklable data."""

    trans_address: str
    nodes: tuple[str, ...]
    virtual_nodes: int
    timestamp: int
    trans_id: int  # the live read transaction the owners check
    schema: pa.Schema  # the table's columns, no hidden ones
    tls: TlsConfig = field(default_factory=TlsConfig)  # the driver's: tasks run elsewhere


def rows_of(table: pa.Table, schema: pa.Schema) -> Iterator[tuple[Any, ...]]:
    """``table``'s rows as tuples in ``schema``'s column order and types (a file written
    before a column was added reads it as NULL)."""
    table = conform(table, schema)
    yield from zip(*(column.to_pylist() for column in table.columns), strict=True)


def read_files(spec: FileReadSpec, refs: Iterable[FileRef]) -> Iterator[tuple[Any, ...]]:
    """The visible rows of ``refs`` at the snapshot; runs inside a Spark task."""
    reader = SnapshotReader(spec.trans_address, Topology(spec.nodes, spec.virtual_nodes),
                            timeout_s=RPC_TIMEOUT_S, tls=spec.tls)
    trans = tpb.BeginTransResponse(trans_id=spec.trans_id, timestamp=spec.timestamp)
    try:
        for ref in refs:
            message = tpb.QueryFile(file_id=ref.file_id, name=ref.name, path_uri=ref.path_uri)
            # The reader's own per-file step: rows committed at or before the
            # snapshot, minus what the owner's visibility says is deleted.
            part = call_with_retry(partial(reader.read_file, message, trans),
                                   f"reading file {ref.name}")
            yield from rows_of(part, spec.schema)
    finally:
        reader.close()


def _write_buffers(nodes: Iterable[str], trans: tpb.BeginTransResponse, schema: str,
                   table: str, tls: TlsConfig) -> list[pa.Table]:
    out = []
    for node in nodes:
        with tls_mod.open_channel(node, tls, CHANNEL_OPTIONS) as channel, reaching_node(node):
            reply = retina_pb2_grpc.RetinaWorkerServiceStub(channel).GetWriteBuffer(
                rpb.GetWriteBufferRequest(schema_name=schema, table_name=table,
                                          timestamp=trans.timestamp, trans_id=trans.trans_id),
                timeout=RPC_TIMEOUT_S)
        out.append(pa.ipc.open_stream(reply.arrow_ipc_stream).read_all())
    return out


def _list_files(trans_address: str, trans: tpb.BeginTransResponse, schema: str,
                table: str, tls: TlsConfig) -> list[tpb.QueryFile]:
    with tls_mod.open_channel(trans_address, tls, CHANNEL_OPTIONS) as channel, \
            reaching_trans_server(trans_address):
        listing = trans_pb2_grpc.TransServiceStub(channel).ListQueryFiles(
            tpb.ListQueryFilesRequest(trans_id=trans.trans_id, schema_name=schema,
                                      table_name=table), timeout=RPC_TIMEOUT_S)
    return list(listing.files)


@dataclass(frozen=True)
class SnapshotPlan:
    """The driver's part of a snapshot read, everything but Spark: the file-reading
    tasks to run (``read_files(spec, ...)``, one per file) and the write-buffer rows to
    add to their rows."""

    spec: FileReadSpec
    refs: tuple[FileRef, ...]
    buffer_rows: list[tuple[Any, ...]]  # in ``spec.schema``'s column order


def plan_snapshot(trans: tpb.BeginTransResponse, trans_address: str, topology: Topology,
                  schema: str, table: str, tls: TlsConfig) -> SnapshotPlan:
    """Step 2 and the driver's share of step 4: GetWriteBuffer from every node, *then*
    ListQueryFiles, under ``trans`` (a live, gated read-only transaction); the buffered
    rows whose file is not listed. Spark-free: the fault campaign runs it, and the
    tasks' ``read_files``, in its own process (chaos/snapshots.py)."""
    buffers = _write_buffers(topology.nodes, trans, schema, table, tls)  # before the file list
    files = _list_files(trans_address, trans, schema, table, tls)
    # The widest: a node that has not seen a row since a column was added still answers
    # with the older columns (schema evolution only appends).
    widest = max((b.schema for b in buffers), key=len)
    columns = pa.schema([f for f in widest if f.name not in HIDDEN])
    regular = pa.array(sorted({f.file_id for f in files}), pa.int64())
    buffered = [b.filter(pc.invert(pc.is_in(b.column(FILE_ID), regular))) for b in buffers]
    buffer_rows = [row for b in buffered for row in rows_of(b, columns)]
    spec = FileReadSpec(trans_address, topology.nodes, topology.virtual_nodes,
                        trans.timestamp, trans.trans_id, columns, tls)
    refs = tuple(FileRef(f.file_id, f.name, f.path_uri) for f in files)
    return SnapshotPlan(spec, refs, buffer_rows)


def snapshot_in(spark: SparkSession, trans: tpb.BeginTransResponse, trans_address: str,
                topology: Topology, schema: str, table: str,
                tls: TlsConfig | None = None) -> SparkSnapshot:
    """Read ``schema.table`` at ``trans``'s snapshot (a live, gated read-only
    transaction the caller holds until this returns). ``tls``: default the
    process's settings (retina_common.tls)."""
    from pyspark.sql.pandas.types import from_arrow_schema

    tls = tls_mod.current() if tls is None else tls
    plan = plan_snapshot(trans, trans_address, topology, schema, table, tls)
    spec, refs = plan.spec, list(plan.refs)  # the tasks' closure: the spec alone
    sc = spark.sparkContext
    file_rows = sc.parallelize(refs, max(1, len(refs))).mapPartitions(
        lambda part: read_files(spec, part))
    rdd = file_rows.union(sc.parallelize(plan.buffer_rows, 1))
    frame = spark.createDataFrame(rdd, from_arrow_schema(spec.schema)).localCheckpoint(eager=True)
    return SparkSnapshot(frame, trans.timestamp, len(refs), len(plan.buffer_rows))


def snapshot_dataframe(spark: SparkSession, config: Config | str | os.PathLike[str] | None,
                       schema: str, table: str, as_of: AsOf = NEWEST) -> SparkSnapshot:
    """A gated snapshot of ``schema.table`` as a materialised DataFrame, with its
    timestamp: the newest, or ``as_of`` a past timestamp, time or pin. ``config`` is a
    loaded Config or a path to retina.toml. Raises grpc.RpcError: UNAVAILABLE when the
    gate refuses (a node is not READY), FAILED_PRECONDITION snapshot_expired when the
    point is older than the history kept."""
    if isinstance(config, Config):
        topology = load_topology(config.topology_file)
    else:
        config, topology = load_config_and_topology(config)
    reader = SnapshotReader(config.trans.listen, topology, tls=config.tls)
    try:
        with reader.transaction(as_of) as trans:
            return snapshot_in(spark, trans, config.trans.listen, topology, schema, table,
                               config.tls)
    finally:
        reader.close()


# --- the command ------------------------------------------------------------------------------
def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=PROG, formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Read one table at a gated snapshot into Spark: one task per data file "
                    "plus the write-buffer rows.",
        epilog="Exit codes: 0 done, 1 failed otherwise, 2 bad arguments or configuration, "
               "3 refused, 4 unavailable (the query gate refused: a Retina node is not READY).")
    p.add_argument("--config", help="TOML config file (default: $RETINA_CONFIG)")
    add_frame_arguments(p, "snapshot")
    point = p.add_mutually_exclusive_group()
    point.add_argument("--as-of", metavar="TS|TIME",
                       help="a past snapshot: a timestamp, or an ISO 8601 time (the newest "
                            "commit at or before it)")
    point.add_argument("--pin", metavar="NAME",
                       help="the snapshot a named pin holds (retina-admin pin create)")
    add_spark_arguments(p)
    return p


def report(args: argparse.Namespace, snap: SparkSnapshot) -> None:
    report_frame(args, snap.frame, lambda count: (
        f"snapshot of {args.table} at timestamp {snap.timestamp}: {count:,} rows "
        f"({snap.files} files, one task each; {snap.buffer_rows} write-buffer rows)"),
        {"timestamp": snap.timestamp, "files": snap.files, "buffer_rows": snap.buffer_rows})


def _earliest(exc: grpc.RpcError) -> str:
    found = earliest_readable(exc.details() or "")
    return "" if found is None else (f"; the earliest readable point is timestamp {found[0]} "
                                     f"(time {format_ms(found[1])})")


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if (error := frame_arguments_error(args)) is not None:
        return fail(PROG, error, exit_codes.USAGE)
    schema, _dot, table = args.table.partition(".")
    try:
        as_of = parse_as_of(args.as_of) if args.as_of else AsOf(pin=args.pin or "")
    except BadPoint as exc:
        return fail(PROG, str(exc), exit_codes.USAGE)
    try:
        config, topology = load(args.config)
        conf = parse_conf(args.conf)
    except ConfigError as exc:
        return fail(PROG, str(exc), exit_codes.USAGE)
    reader = SnapshotReader(config.trans.listen, topology)
    try:
        with ExitStack() as stack:
            try:
                # Through the gate first: a refusal must not even start Spark.
                trans = stack.enter_context(reader.transaction(as_of))
            except Unreachable as exc:  # not the gate: nothing answered at all
                return fail(PROG, exc.details(), exit_codes.UNAVAILABLE)
            except grpc.RpcError as exc:
                if exc.code() == grpc.StatusCode.UNAVAILABLE:
                    return fail(PROG, "the query gate refused a snapshot (a Retina node is not "
                                      f"READY, or the TransServer is down): {exc.details()}",
                                exit_codes.UNAVAILABLE)
                return fail(PROG, f"BeginTrans ({as_of.describe()}): {short_reason(exc)}"
                            + _earliest(exc), exit_code_of(exc))
            spark = spark_session(f"retina-snapshot-{args.table}", args.master, conf)
            stack.callback(spark.stop)
            report(args, snapshot_in(spark, trans, config.trans.listen, topology,
                                     schema, table))
    except Exception as exc:
        return fail(PROG, f"snapshot read failed: {short_reason(exc)}", exit_code_of(exc))
    finally:
        reader.close()
    return exit_codes.OK


if __name__ == "__main__":
    # The package's copy of main: tasks then pickle references to importable code.
    from spark_jobs.snapshot_query import main as package_main

    sys.exit(package_main())
