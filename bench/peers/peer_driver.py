"""Apply a bench_peers workload to one lakehouse table format, through its own API.

Runs in the peers' virtual environment (`make bench-peers` makes it), never in
Retina's: pypaimon pins pyarrow below Retina's. Standard library, pyarrow and the
peer's package only.

    peer_driver.py --system delta|iceberg|paimon --workload W.parquet --batch 5000 \\
        --rows 200000 --budget-s 120 --dir DIR --out RESULT.json

The workload file holds the micro-batches already collapsed to their net effect
per key (bench_peers.py writes it): columns ``batch`` (int64), ``deleted`` (bool),
``id`` and the value columns. Each micro-batch is one commit through the system's
idiomatic upsert/delete API; its latency is from the start of the apply to the
return of the commit, after which a new reader sees it. The driver stops at the
budget (at a batch boundary) and writes the table's content as read by a new
reader to ``DIR/final.parquet``, for bench_peers.py to compare with its model.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import time
from collections.abc import Callable
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

VALUE_COLUMNS = ["c1", "c2", "c3", "c4", "c5"]


def _schema(workload: pa.Schema) -> pa.Schema:
    return pa.schema([workload.field("id").with_nullable(False)] +
                     [workload.field(c) for c in VALUE_COLUMNS])


class Delta:
    """deltalake (delta-rs): one MERGE per micro-batch (delete, update, insert)."""

    def __init__(self, root: Path, schema: pa.Schema) -> None:
        from deltalake import DeltaTable, write_deltalake

        self.path = str(root / "delta")
        write_deltalake(self.path, schema.empty_table(), mode="overwrite")
        self.table = DeltaTable(self.path)

    def apply(self, batch: pa.Table) -> None:
        values = {c: f"s.{c}" for c in ["id", *VALUE_COLUMNS]}
        (self.table.merge(source=batch, predicate="t.id = s.id", source_alias="s",
                          target_alias="t")
         .when_matched_delete(predicate="s.deleted")
         .when_matched_update(updates=values, predicate="NOT s.deleted")
         .when_not_matched_insert(updates=values, predicate="NOT s.deleted")
         .execute())

    def read(self) -> pa.Table:
        from deltalake import DeltaTable

        return DeltaTable(self.path).to_pyarrow_table()


class Iceberg:
    """pyiceberg with a SQL (SQLite) catalog: upsert, then delete, per micro-batch."""

    def __init__(self, root: Path, schema: pa.Schema) -> None:
        from pyiceberg.catalog.sql import SqlCatalog
        from pyiceberg.schema import Schema
        from pyiceberg.types import DoubleType, LongType, NestedField, StringType

        self.catalog = SqlCatalog("bench", uri=f"sqlite:///{root}/catalog.db",
                                  warehouse=f"file://{root}/warehouse")
        self.catalog.create_namespace("bench")
        kinds = {pa.int64(): LongType(), pa.float64(): DoubleType(), pa.string(): StringType()}
        fields = [NestedField(1, "id", LongType(), required=True)]
        fields += [NestedField(i + 2, c, kinds[schema.field(c).type], required=False)
                   for i, c in enumerate(VALUE_COLUMNS)]
        self.table = self.catalog.create_table(
            "bench.t", schema=Schema(*fields, identifier_field_ids=[1]))
        self.schema = schema

    def apply(self, batch: pa.Table) -> None:
        from pyiceberg.expressions import In

        deleted = batch.filter(batch.column("deleted"))
        upserts = batch.filter(pc.invert(batch.column("deleted"))).select(self.schema.names)
        if upserts.num_rows:
            self.table.upsert(upserts.cast(self.schema))
        if deleted.num_rows:
            self.table.delete(delete_filter=In("id", deleted.column("id").to_pylist()))

    def read(self) -> pa.Table:
        return self.catalog.load_table("bench.t").scan().to_arrow()


class Paimon:
    """pypaimon primary-key table (deduplicate merge engine): one commit per micro-batch,
    deletes as rows of kind -D (the table's rowkind.field)."""

    def __init__(self, root: Path, schema: pa.Schema) -> None:
        from pypaimon import CatalogFactory, Schema

        self.catalog = CatalogFactory.create({"warehouse": str(root / "warehouse")})
        self.catalog.create_database("bench", False)
        self.schema = schema.append(pa.field("kind", pa.string()))
        self.catalog.create_table("bench.t", Schema.from_pyarrow_schema(
            self.schema, primary_keys=["id"],
            options={"bucket": "1", "rowkind.field": "kind"}), False)
        self.table = self.catalog.get_table("bench.t")

    def apply(self, batch: pa.Table) -> None:
        kinds = pc.if_else(batch.column("deleted"), "-D", "+I")
        data = batch.select(self.schema.names[:-1]).append_column("kind", kinds)
        builder = self.table.new_batch_write_builder()
        write, commit = builder.new_write(), builder.new_commit()
        try:
            write.write_arrow(data.cast(self.schema))
            commit.commit(write.prepare_commit())
        finally:
            write.close()
            commit.close()

    def read(self) -> pa.Table:
        builder = self.catalog.get_table("bench.t").new_read_builder()
        return builder.new_read().to_arrow(builder.new_scan().plan().splits()).drop_columns(
            ["kind"])


SYSTEMS: dict[str, Callable[[Path, pa.Schema], Delta | Iceberg | Paimon]] = {
    "delta": Delta, "iceberg": Iceberg, "paimon": Paimon}


def disk_usage(root: Path) -> tuple[int, int]:
    files = [Path(d) / f for d, _, names in os.walk(root) for f in names]
    return len(files), sum(f.stat().st_size for f in files)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--system", choices=sorted(SYSTEMS), required=True)
    parser.add_argument("--workload", type=Path, required=True)
    parser.add_argument("--budget-s", type=float, default=120.0)
    parser.add_argument("--dir", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    workload = pq.read_table(args.workload)
    batches = workload.column("batch").to_numpy()
    bounds = [0, *(i for i in range(1, len(batches)) if batches[i] != batches[i - 1]),
              len(batches)]
    args.dir.mkdir(parents=True, exist_ok=True)
    system = SYSTEMS[args.system](args.dir, _schema(workload.schema))
    latencies: list[float] = []
    started = time.perf_counter()
    for lo, hi in itertools.pairwise(bounds):
        t0 = time.perf_counter()
        system.apply(workload.slice(lo, hi - lo))
        latencies.append(time.perf_counter() - t0)
        if time.perf_counter() - started > args.budget_s:
            break
    elapsed = time.perf_counter() - started
    files, size = disk_usage(args.dir)  # before the final read adds nothing, after all writes
    pq.write_table(system.read().select(["id", *VALUE_COLUMNS]), args.dir / "final.parquet")
    args.out.write_text(json.dumps({
        "batches_applied": len(latencies), "seconds": elapsed, "latencies_s": latencies,
        "files": files, "bytes": size, "final": str(args.dir / "final.parquet")}))


if __name__ == "__main__":
    main()
