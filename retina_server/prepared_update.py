"""A validated UpdateRecord part (update_record.prepare), as the apply takes it."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import pyarrow as pa

from retina_common.catalog import TableRecord


@dataclass(frozen=True)
class PartialRows:
    """Partial updates of one TableUpdateData with the same target columns: ``targets``
    are ordinals of the table's columns (its key columns among them), ``columns`` one
    array per target, in that order, a row per key."""

    targets: tuple[int, ...]
    keys: list[bytes]
    columns: list[pa.Array]


@dataclass
class PreparedUpdate:
    table: TableRecord
    vnode: int
    ts: int
    delete_keys: list[bytes]
    insert_keys: list[bytes]
    insert_columns: list[pa.Array]
    truncate: bool = False  # every live key of (table, vnode) deleted first
    source_position: str = ""  # the commit's source position (source_positions.py)
    # Partial updates (partial_update.py): folded into delete_keys / insert_keys as
    # replaces of merged rows inside the apply, before anything of the request applies.
    partials: list[PartialRows] = dataclasses.field(default_factory=list)
