"""Time a bulk append of one Arrow dataset into a new table of one lakehouse format.

Runs in the peers' virtual environment (`make bench-peers` makes it), never in
Retina's: pypaimon pins pyarrow below Retina's. Standard library, pyarrow and the
peer's package only.

    bulk_driver.py --system delta|paimon-append|paimon-pk --data ROWS.parquet \\
        --dir DIR --out RESULT.json [--batch-rows N]

ROWS.parquet holds the rows: ``id`` (int64, unique, the key) and the value columns
``c1`` (int64), ``c2`` (float64), ``c3`` (string), ``c4`` (int64), ``c5`` (string).
The whole file is read into one Arrow table and the new, empty table is created
under DIR before the clock starts. The time is that of writing every row through
the system's own batch write API, one commit for the whole table, or one commit per
slice of N rows with ``--batch-rows N``:

* delta: ``write_deltalake(mode="append")`` into a table created with the schema;
* paimon-append: a pypaimon append-only table (no primary key);
* paimon-pk: a pypaimon primary-key table keyed by ``id`` (one bucket, as in
  peer_driver.py).

A new reader then reads the table back (untimed): its row count, number of distinct
ids and sum of ids must equal the input's, or the driver exits with status 1.
RESULT.json holds ``system``, ``rows``, ``seconds``, ``rows_per_s``,
``bytes_on_disk`` (every file under the table's directory, metadata included),
``files`` (data files only) and ``verified``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

VALUE_COLUMNS = ["c1", "c2", "c3", "c4", "c5"]


def _schema(data: pa.Schema) -> pa.Schema:
    return pa.schema([data.field("id").with_nullable(False)] +
                     [data.field(c) for c in VALUE_COLUMNS])


class Delta:
    """deltalake (delta-rs): one ``write_deltalake(mode="append")`` per commit."""

    def __init__(self, root: Path, schema: pa.Schema) -> None:
        from deltalake import write_deltalake

        self.root = root / "delta"
        write_deltalake(str(self.root), schema.empty_table(), mode="overwrite")

    def write(self, data: pa.Table) -> None:
        from deltalake import write_deltalake

        write_deltalake(str(self.root), data, mode="append")

    def read_ids(self) -> pa.ChunkedArray:
        from deltalake import DeltaTable

        return DeltaTable(str(self.root)).to_pyarrow_table(columns=["id"]).column("id")

    def is_data_file(self, relative: Path) -> bool:
        return relative.parts[0] != "_delta_log" and relative.suffix == ".parquet"


class Paimon:
    """pypaimon table, append-only or with primary key ``id`` (deduplicate merge
    engine, one bucket): one batch write (write_arrow, prepare_commit, commit) per
    commit."""

    def __init__(self, root: Path, schema: pa.Schema, primary_key: bool) -> None:
        from pypaimon import CatalogFactory, Schema

        self.catalog = CatalogFactory.create({"warehouse": str(root / "warehouse")})
        self.catalog.create_database("bench", False)
        self.schema = schema
        if primary_key:
            paimon_schema = Schema.from_pyarrow_schema(schema, primary_keys=["id"],
                                                       options={"bucket": "1"})
        else:
            paimon_schema = Schema.from_pyarrow_schema(schema)
        self.catalog.create_table("bench.t", paimon_schema, False)
        self.table = self.catalog.get_table("bench.t")
        self.root = root / "warehouse" / "bench.db" / "t"

    def write(self, data: pa.Table) -> None:
        builder = self.table.new_batch_write_builder()
        write, commit = builder.new_write(), builder.new_commit()
        try:
            write.write_arrow(data)
            commit.commit(write.prepare_commit())
        finally:
            write.close()
            commit.close()

    def read_ids(self) -> pa.ChunkedArray:
        builder = self.catalog.get_table("bench.t").new_read_builder().with_projection(["id"])
        return builder.new_read().to_arrow(builder.new_scan().plan().splits()).column("id")

    def is_data_file(self, relative: Path) -> bool:
        return relative.parts[0].startswith("bucket-")


SYSTEMS: dict[str, Callable[[Path, pa.Schema], Delta | Paimon]] = {
    "delta": Delta,
    "paimon-append": lambda root, schema: Paimon(root, schema, primary_key=False),
    "paimon-pk": lambda root, schema: Paimon(root, schema, primary_key=True)}


def disk_usage(system: Delta | Paimon) -> tuple[int, int]:
    """(data files, bytes of every file) under the table's directory."""
    files = [Path(d) / f for d, _, names in os.walk(system.root) for f in names]
    data_files = sum(system.is_data_file(f.relative_to(system.root)) for f in files)
    return data_files, sum(f.stat().st_size for f in files)


def id_summary(ids: pa.Array | pa.ChunkedArray) -> tuple[int, int, int]:
    """(count, distinct count, sum) of the ids: equal for equal sets of unique ids."""
    total = pc.sum(ids).as_py()
    return len(ids), pc.count_distinct(ids).as_py(), 0 if total is None else total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--system", choices=sorted(SYSTEMS), required=True)
    parser.add_argument("--data", type=Path, required=True)
    parser.add_argument("--dir", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--batch-rows", type=int, default=None,
                        help="write in slices of N rows, one commit per slice")
    args = parser.parse_args()
    if args.batch_rows is not None and args.batch_rows <= 0:
        parser.error("--batch-rows must be positive")
    raw = pq.read_table(args.data)
    schema = _schema(raw.schema)
    data = raw.select(schema.names).cast(schema).combine_chunks()
    step = args.batch_rows or max(data.num_rows, 1)
    slices = [data.slice(lo, step) for lo in range(0, data.num_rows, step)]
    args.dir.mkdir(parents=True, exist_ok=True)
    system = SYSTEMS[args.system](args.dir, schema)
    started = time.perf_counter()
    for piece in slices:
        system.write(piece)
    elapsed = time.perf_counter() - started
    files, size = disk_usage(system)
    expected, found = id_summary(data.column("id")), id_summary(system.read_ids())
    if found != expected:
        sys.exit(f"bulk_driver: VERIFICATION FAILED for {args.system} under {args.dir}: "
                 f"read back (rows, distinct ids, sum of ids) = {found}, "
                 f"wrote {expected}")
    args.out.write_text(json.dumps({
        "system": args.system, "rows": data.num_rows, "seconds": elapsed,
        "rows_per_s": data.num_rows / elapsed if elapsed > 0 else None,
        "bytes_on_disk": size, "files": files, "verified": True}))


if __name__ == "__main__":
    main()
