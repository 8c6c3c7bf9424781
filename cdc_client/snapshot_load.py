"""The initial snapshot through the bulk load path (docs/cdc.md, "Initial snapshot").

A snapshot chunk after the first (the first starts with the TRUNCATE of every table)
holds only inserts of keys that have no live version: the TRUNCATE tombstoned every
older row, and a resumed snapshot reads on after the last committed chunk. The
connector loads such a chunk with ``retina_common.bulk_loader`` at the timestamp it
began for it: its rows' values decoded into Arrow columns, one Parquet file per virtual
node written by this process, published by each node, journaled there instead of in the
connector's changelog (the node re-applies it after a crash). Then the connector commits
the timestamp and the chunk's position as for any batch.

A chunk the bulk path cannot take whole falls back to the ordinary path at the same
timestamp (changelog, UpdateRecord replaces, commit): a node that refuses it (a key
already live, because a previous connector loaded the chunk and died before committing
its position), a node away past the deadline, a part loaded on some nodes only. A
replace of a key the chunk's load made live deletes that row at the same timestamp and
inserts the same values, so either way the chunk lands exactly once.
"""

from __future__ import annotations

from collections.abc import Mapping

import pyarrow as pa

from retina_common.bulk_loader import BulkLoader
from retina_common.catalog import TableRecord
from retina_common.changelog import REPLACE, ChangeRow
from retina_common.codec import decode_column
from retina_common.columnar import table_schema
from retina_common.pb import retina_pb2_grpc, trans_pb2_grpc
from retina_common.topology import Topology


def loadable(rows: list[ChangeRow]) -> bool:
    """Only replaces (a snapshot chunk's inserts), at least one."""
    return bool(rows) and all(r.op == REPLACE and r.values is not None for r in rows)


def arrow_rows(table: TableRecord, rows: list[ChangeRow]) -> pa.Table:
    """``rows``' encoded values as the table's Arrow columns (one decode per column)."""
    schema = table_schema(table)
    values = [r.values or () for r in rows]
    columns = []
    for i, column in enumerate(table.columns):
        if all(len(v) > i for v in values):
            columns.append(decode_column(column.type, [v[i] for v in values]))
        else:  # a column the table gained after the chunk was translated: NULL
            columns.append(pa.nulls(len(values), schema.field(i).type))
    return pa.Table.from_arrays(columns, schema=schema)


class SnapshotLoader:
    """One ``BulkLoader`` per table, over the connector's channels."""

    def __init__(self, schema: str, topology: Topology, trans: trans_pb2_grpc.TransServiceStub,
                 nodes: Mapping[str, retina_pb2_grpc.RetinaWorkerServiceStub],
                 timeout_s: float) -> None:
        self._schema = schema
        self._topology = topology
        self._trans = trans
        self._nodes = nodes
        self._timeout_s = timeout_s
        self._loaders: dict[tuple[int, int], BulkLoader] = {}

    def load(self, ts: int, rows: list[ChangeRow], tables: Mapping[str, TableRecord]) -> int:
        """Load a chunk's rows at ``ts`` (held by the caller); returns files written.
        Raises LoadRefused, PartialLoad or grpc.RpcError (see the module docstring)."""
        by_table: dict[str, list[ChangeRow]] = {}
        for row in rows:
            by_table.setdefault(row.table, []).append(row)
        files = 0
        for name, part in sorted(by_table.items()):
            table = tables[name]
            files += self._loader(table).load_at(ts, arrow_rows(table, part))
        return files

    def _loader(self, table: TableRecord) -> BulkLoader:
        key = (table.table_id, table.schema_version)
        loader = self._loaders.get(key)
        if loader is None:
            loader = self._loaders[key] = BulkLoader(
                self._schema, table, self._topology, self._trans, self._nodes,
                timeout_s=self._timeout_s)
        return loader
