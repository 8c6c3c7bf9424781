"""Where the CDC connector's own time goes, per micro-batch, in one process (no cluster).

The connector's durable path (``cdc_client/connector.py``) does, per micro-batch: build
the source's change objects (here: what a source decoder hands over), ``translate``
(validation, net effect per key, the row form's encoding, routing), the changelog
append (Parquet encode, then the segment and the batch record written durably: four
fsyncs), and the UpdateRecord requests (``changelog_replay.requests``: the columnar
form, decoded back from the row form) and their protobuf serialisation. The node's
side is ``bench_apply_stages.py``; the RPCs between them and the commit are in
``bench_peers.py``'s per-batch latency (``BENCH_LOG_LEVEL=info`` prints the stages).

The workload is ``bench_peers.py``'s (seed 15: 70 % inserts, 20 % updates, 10 %
deletes of a 6-column table keyed by an int64, each micro-batch collapsed to its net
effect per key), one source transaction per micro-batch, 8 virtual nodes on one node
(the requests stage splits the rows by node as the connector does). Prints the
median of each stage per micro-batch, its microseconds per change and its share of
the connector's total; asserts nothing.

    .venv/bin/python bench/bench_connector_stages.py                  # B=100 and B=5000
    .venv/bin/python bench/bench_connector_stages.py --batch 5000 --rows 200000
"""

from __future__ import annotations

import argparse
import platform
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pyarrow as pa
from bench_peers import COLUMNS, SCHEMA, generate, micro_batches

from cdc_client.connector import stamped
from cdc_client.source import RowChange, SourceTransaction
from cdc_client.translate import TableMap, translate
from retina_common.catalog.model import ColumnRecord, TableRecord
from retina_common.changelog import (
    Changelog,
    ChangeRow,
    LoggedTransaction,
    encode_segment,
    transaction_positions,
)
from retina_common.changelog_replay import by_node, requests
from retina_common.columnar import COLUMNAR_MIN_ROWS
from retina_common.topology import Topology

STAGES = ("source objects", "translate", "stamp", "changelog encode", "changelog append",
          "requests", "serialise")
TABLE = "t"


def table_record() -> TableRecord:
    columns = tuple(ColumnRecord(i, c.name, c.type, i, 0 if c.name == "id" else None)
                    for i, c in enumerate(COLUMNS))
    return TableRecord(1, 1, SCHEMA, TABLE, 1, columns)


def timed(out: dict[str, list[float]], stage: str, call: Callable[[], Any]) -> Any:
    t0 = time.perf_counter()
    result = call()
    out[stage].append((time.perf_counter() - t0) * 1000)
    return result


def measure(rows: int, batch: int, root: Path) -> tuple[dict[str, list[float]], int]:
    """Every stage's time per micro-batch (ms), and the changes measured."""
    table = table_record()
    tables = TableMap(SCHEMA, lambda _schema, _name: table)
    topology = Topology(("127.0.0.1:1",), 8)
    changelog = Changelog("file://" + str(root / f"changelog-{batch}"))
    times: dict[str, list[float]] = {s: [] for s in STAGES}
    changes = 0
    for i, b in enumerate(micro_batches(generate(rows, 15), batch), start=1):
        def source_objects(b: Any = b, i: int = i) -> SourceTransaction:
            made = [RowChange(f"public.{TABLE}", "delete", {"id": k}, None) for k in b.deletes]
            made += [RowChange(f"public.{TABLE}", "update", None, r) for r in b.upserts]
            return SourceTransaction(str(i), str(i), 0, tuple(made))
        trans = timed(times, "source objects", source_objects)
        translated: list[ChangeRow] = timed(times, "translate",
                                            lambda t=trans: translate(t, tables, topology))
        rows = timed(times, "stamp", lambda r=translated, ts=i: stamped(r, ts))
        timed(times, "changelog encode", lambda r=rows: encode_segment(r))
        logged = LoggedTransaction(i, str(i), str(i), 0, rows)
        record = timed(times, "changelog append", lambda t=logged: changelog.append([t]))

        def node_requests(r: list[ChangeRow] = rows, rec: Any = record) -> list[Any]:
            positions = transaction_positions([rec])
            return [q for node_rows in by_node(r, topology).values()
                    for q in requests(SCHEMA, {TABLE: table}, node_rows, 10_000,
                                      COLUMNAR_MIN_ROWS, positions=positions)]
        made = timed(times, "requests", node_requests)
        timed(times, "serialise", lambda m=made: [q.SerializeToString() for q in m])
        changes += b.changes
    return times, changes


def report(batch: int, times: dict[str, list[float]], changes: int) -> None:
    per_batch = changes / len(times["translate"])
    # The append encodes too: its own encode is part of it, not added again.
    total = sum(statistics.median(times[s]) for s in STAGES if s != "changelog encode")
    print(f"\nB={batch}: {len(times['translate'])} micro-batches, {per_batch:,.0f} changes "
          f"each on average")
    print(f"{'stage':<18}{'median ms':>10}{'us/change':>11}{'share':>8}")
    for stage in STAGES:
        median = statistics.median(times[stage])
        share = "" if stage == "changelog encode" else f"{median / total:>7.0%}"
        print(f"{stage:<18}{median:>10.2f}{median * 1000 / per_batch:>11.2f}{share:>8}")
    print(f"{'connector total':<18}{total:>10.2f}{total * 1000 / per_batch:>11.2f}"
          f"   (= {per_batch / total * 1000:,.0f} changes/s on one core, before any RPC)")


def filesystem(path: Path) -> str:
    """The type of the file system ``path`` is on (Linux: the longest mount point)."""
    try:
        mounts = [line.split() for line in Path("/proc/mounts").read_text().splitlines()]
    except OSError:
        return "unknown"
    resolved = str(path.resolve())
    best = max((m for m in mounts if len(m) > 2 and (resolved + "/").startswith(
        m[1].rstrip("/") + "/")), key=lambda m: len(m[1]), default=None)
    return best[2] if best else "unknown"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=100_000, help="changes per batch size")
    parser.add_argument("--batch", type=int, action="append",
                        help="changes per micro-batch (repeatable; default 100 and 5000)")
    parser.add_argument("--dir", type=Path, default=None,
                        help="where the changelog goes (default: the system's temporary "
                             "directory; on a tmpfs its fsyncs cost nothing)")
    args = parser.parse_args()
    sizes = args.batch or [100, 5000]
    print(f"setup: {platform.platform()}, Python {platform.python_version()}, pyarrow "
          f"{pa.__version__}; {args.rows} changes per batch size (bench_peers' workload, "
          f"seed 15); one source transaction per micro-batch; 8 virtual nodes; in one "
          f"process, no cluster")
    with tempfile.TemporaryDirectory(prefix="retina-connector-stages-", dir=args.dir) as tmp:
        print(f"the changelog (fsynced) under {tmp}, on a {filesystem(Path(tmp))} file system")
        for size in sizes:
            times, changes = measure(args.rows, size, Path(tmp))
            report(size, times, changes)


if __name__ == "__main__":
    main()
