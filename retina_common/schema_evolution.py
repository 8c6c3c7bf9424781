"""Reading data across schema versions of a table (docs/catalog.md, "Schema evolution").

A table only ever gains nullable columns, appended at the end
(:meth:`retina_common.catalog.Catalog.add_column`). Files, write-buffer rows
and UpdateRecord rows written before a column was added simply lack it; every
reader conforms them to the table's current columns, where the missing
column is NULL. A Storage GC rewrite writes the current columns.
"""

from __future__ import annotations

from collections.abc import Sequence

import pyarrow as pa

from retina_common.catalog import TableRecord
from retina_common.codec import COMMIT_TS, arrow_type


def table_schema(table: TableRecord, version: int = 0) -> pa.Schema:
    """The Arrow schema of a table's data files at its current schema version (or at
    ``version``: the columns it had then): its columns in catalog order, then the
    hidden commit-timestamp column."""
    fields = [pa.field(c.name, arrow_type(c.type)) for c in table.columns
              if not version or c.since_version <= version]
    return pa.schema([*fields, pa.field(COMMIT_TS, pa.int64(), nullable=False)])


def conform(rows: pa.Table, schema: pa.Schema) -> pa.Table:
    """``rows`` with exactly ``schema``'s columns, in its order and types: a column the
    rows lack (added after they were written) is all NULL; other columns are dropped."""
    if rows.schema.remove_metadata().equals(schema.remove_metadata()):
        return rows
    arrays = []
    for field in schema:
        if field.name in rows.column_names:
            column = rows.column(field.name)
            arrays.append(column if column.type == field.type else column.cast(field.type))
        else:
            arrays.append(pa.nulls(rows.num_rows, field.type))
    return pa.Table.from_arrays(arrays, schema=schema)


def pad_values(values: Sequence[bytes], width: int) -> list[bytes]:
    """One UpdateRecord row's column values for a table of ``width`` columns: a row
    encoded for an older schema version gets NULL (empty bytes) for the columns added
    since."""
    return [*values, *([b""] * (width - len(values)))]
