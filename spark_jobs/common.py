"""What both Spark drivers share: exit codes, the Spark session, configuration
loading, a listed file as tasks get it (:class:`FileRef`), gRPC retries inside
tasks, and telling a failed Spark job's cause.

Exit codes (every driver): 0 done; 1 the job failed otherwise (a corrupt
changelog, a bug: the message says what); 2 bad arguments or configuration;
3 refused (FAILED_PRECONDITION, a FAILED node, a stale recovery attempt);
4 unavailable (a node not READY, the query gate closed, a dependency down).

A task runs in a Spark Python worker, possibly on another machine, so
whatever it raises reaches the driver only as text inside a Spark exception.
Tasks therefore raise :class:`TaskError` whose message starts with a marker
(``[retina:UNAVAILABLE]``, ``[retina:REFUSED]``) that :func:`exit_code_of`
finds again in that text.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import threading
import time
from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

import grpc

from retina_common import exit_codes, tls
from retina_common.config import Config, ConfigError
from retina_common.retry import RETRYABLE_CODES, rpc_with_retry
from retina_common.topology import Topology, load_config_and_topology

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession

DEFAULT_MASTER = "local[2]"
JVM_START_ATTEMPTS = 3
UNAVAILABLE_MARK = "[retina:UNAVAILABLE]"
REFUSED_MARK = "[retina:REFUSED]"
# Quiet, reproducible defaults; --conf overrides any of them.
BASE_CONF = {
    "spark.ui.showConsoleProgress": "false",
    "spark.sql.session.timeZone": "UTC",
    "spark.sql.parquet.outputTimestampType": "TIMESTAMP_MICROS",
}

T = TypeVar("T")
_EXCEPTION_LINE = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Changelog): ")


@dataclass(frozen=True)
class FileRef:
    """A listed file as both jobs hand it to their tasks: the fields of a QueryFile a task
    needs (snapshot_query's task rebuilds the message from them)."""

    file_id: int
    name: str
    path_uri: str


class TaskError(Exception):
    """A task gave up; the message starts with a marker the driver maps to an exit code."""

    @classmethod
    def of(cls, exc: grpc.RpcError, what: str) -> TaskError:
        mark = UNAVAILABLE_MARK if exc.code() in RETRYABLE_CODES else REFUSED_MARK
        return cls(f"{mark} {what}: {exc.code().name}: {exc.details()}")


def exit_code_of(exc: BaseException) -> int:
    """The exit code for a failure, including one that reached us through Spark."""
    if isinstance(exc, grpc.RpcError):
        return exit_codes.UNAVAILABLE if exc.code() in RETRYABLE_CODES else exit_codes.REFUSED
    text = str(exc)
    if REFUSED_MARK in text:
        return exit_codes.REFUSED
    if UNAVAILABLE_MARK in text:
        return exit_codes.UNAVAILABLE
    return exit_codes.FAILED


def short_reason(exc: BaseException, limit: int = 600) -> str:
    """The line of a (possibly Spark-wrapped) failure worth printing."""
    text = str(exc)
    for mark in (REFUSED_MARK, UNAVAILABLE_MARK):
        at = text.find(mark)
        if at >= 0:
            return text[at:].splitlines()[0][:limit]
    if isinstance(exc, grpc.RpcError):
        return f"{exc.code().name}: {exc.details()}"
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    # Inside Spark's text, the task's own exception ends its Python traceback.
    in_traceback = False
    for line in lines:
        if line.startswith("Traceback (most recent call last)"):
            in_traceback = True
        elif in_traceback and _EXCEPTION_LINE.match(line):
            return line[:limit]
    return (lines[-1] if lines else type(exc).__name__)[:limit]


def call_with_retry(call: Callable[[], T], what: str, attempts: int = 6) -> T:
    """``call()``, sent again with backoff on a retryable code (RETRYABLE_CODES);
    raises TaskError when it is refused or keeps failing."""
    try:
        return rpc_with_retry(call, attempts=attempts)
    except grpc.RpcError as exc:
        raise TaskError.of(exc, what) from None


def load(config_path: str | None) -> tuple[Config, Topology]:
    """The config (``--config`` or ``$RETINA_CONFIG``) and its topology; ConfigError if bad."""
    config, topology = load_config_and_topology(config_path)
    # Channels of the driver, and (through spark_session) of its tasks, use it.
    tls.configure(config.tls)
    return config, topology


def add_spark_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--master", default=None,
                        help=f"Spark master (default {DEFAULT_MASTER} when run with python; "
                             "under spark-submit its own --master applies)")
    parser.add_argument("--conf", action="append", default=[], metavar="KEY=VALUE",
                        help="a Spark setting, as for spark-submit (repeatable)")
    parser.add_argument("--no-progress", action="store_true",
                        help="no progress bar on stderr (none is drawn unless stderr is a "
                             "terminal; stdout and the exit code are the same either way)")


def add_frame_arguments(parser: argparse.ArgumentParser, what: str) -> None:
    """``--table`` and what the jobs that read one into a DataFrame do with it:
    ``--output`` (Parquet), ``--overwrite``, ``--show``, ``--json``."""
    parser.add_argument("--table", required=True, help="schema.table")
    parser.add_argument("--output", metavar="DIR",
                        help=f"write the {what} as Parquet: a Spark output directory of "
                             "part-*.parquet files (read it back with spark.read.parquet or "
                             "pyarrow.parquet)")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing --output")
    parser.add_argument("--show", type=int, metavar="N", default=0,
                        help="print the first N rows")
    parser.add_argument("--json", action="store_true", help="also print the result as JSON")


def frame_arguments_error(args: argparse.Namespace) -> str | None:
    """What is wrong with add_frame_arguments' arguments, if anything."""
    schema, dot, table = args.table.partition(".")
    if not dot or not schema or not table:
        return "give the table as schema.table"
    if args.output and not args.overwrite and os.path.exists(args.output):
        return f"{args.output} exists; pass --overwrite to replace it"
    return None


def report_frame(args: argparse.Namespace, frame: DataFrame, line: Callable[[int], str],
                 summary: dict[str, Any]) -> None:
    """Print ``line(row count)``, then do add_frame_arguments' ``--show``, ``--output`` and
    ``--json`` (the table, ``summary``, the count and the output)."""
    count = frame.count()
    print(line(count), flush=True)
    if args.show:
        frame.show(args.show, truncate=False)
    if args.output:
        frame.write.mode("overwrite" if args.overwrite else "errorifexists").parquet(args.output)
        print(f"wrote {args.output}", flush=True)
    if args.json:
        print(json.dumps({"table": args.table, **summary, "count": count,
                          "output": args.output}), flush=True)


def parse_conf(pairs: Sequence[str]) -> dict[str, str]:
    out = {}
    for pair in pairs:
        key, eq, value = pair.partition("=")
        if not eq or not key.strip():
            raise ConfigError(f"--conf expects KEY=VALUE, got {pair!r}")
        out[key.strip()] = value.strip()
    return out


def _under_spark_submit() -> bool:
    # spark-submit starts the Python driver with a gateway to its own JVM.
    return "PYSPARK_GATEWAY_PORT" in os.environ


def spark_session(app_name: str, master: str | None, conf: dict[str, str]) -> SparkSession:
    from pyspark.sql import SparkSession

    builder = SparkSession.builder.appName(app_name)
    if master is None and not _under_spark_submit():
        master = DEFAULT_MASTER
    if master is not None:
        builder = builder.master(master)
        if master.startswith("local"):
            # Local workers must run this interpreter (the venv with our packages),
            # not whatever "python3" is on PATH.
            os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    for key, value in {**BASE_CONF, **tls.spark_executor_env(), **conf}.items():
        builder = builder.config(key, value)
    for attempt in range(1, JVM_START_ATTEMPTS + 1):
        try:
            spark = builder.getOrCreate()
            break
        except Exception as exc:
            # A JVM that dies before it reports its port (memory or CPU pressure on a busy
            # machine) is a failed start, not a failed job: start it again, twice at most.
            if "JAVA_GATEWAY_EXITED" not in str(exc) or attempt == JVM_START_ATTEMPTS:
                raise
            print(f"spark: the JVM exited while starting ({attempt}/{JVM_START_ATTEMPTS}); "
                  "starting it again", file=sys.stderr)
            time.sleep(attempt)  # backoff between start attempts, not synchronisation
    spark.sparkContext.setLogLevel("ERROR")
    return spark


def run_reported(spark: SparkSession, items: Sequence[Any],
                 work: Callable[[Any], tuple[Hashable, Any]],
                 on_result: Callable[[Hashable, Any], None], name: str) -> BaseException | None:
    """One Spark task per item; each task's ``(key, value)`` reaches the driver through an
    accumulator, and ``on_result`` runs on the driver as each one arrives (a GC commit
    goes out while the other tasks still run). Returns what the Spark job raised (None:
    every task ran); Ctrl-C cancels the job."""
    from spark_jobs.accumulators import KeyedResults  # needs pyspark: the driver only

    sc = spark.sparkContext
    progress = sc.accumulator({}, KeyedResults())

    def run_partition(part: Iterable[Any]) -> None:
        for item in part:
            key, value = work(item)
            progress.add({key: value})

    rdd = sc.parallelize(list(items), max(1, len(items)))
    failure: list[BaseException] = []

    def job() -> None:
        try:
            rdd.foreachPartition(run_partition)
        except BaseException as exc:
            failure.append(exc)

    runner = threading.Thread(target=job, name=name, daemon=True)
    runner.start()
    seen: set[Hashable] = set()
    try:
        while True:
            finished = not runner.is_alive()  # read before the value: nothing is missed
            for key, value in dict(progress.value).items():
                if key not in seen:
                    seen.add(key)
                    on_result(key, value)
            if finished:
                break
            runner.join(0.2)
    except KeyboardInterrupt:
        sc.cancelAllJobs()
        raise
    return failure[0] if failure else None


def fail(prog: str, message: str, code: int) -> int:
    print(f"{prog}: {message}", file=sys.stderr)
    return code
