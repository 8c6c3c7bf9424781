"""Point gathers from decoded row groups with numpy (LookupRows' rows).

A batch of keys touches up to one row group per key, and an Arrow ``take`` costs a fixed
10-20 µs per column and call whatever it takes (pyarrow's compute dispatch): 200 row
groups of five columns would cost 10 ms before a byte moved. So a decoded row group is
kept as numpy views of its Arrow buffers (:class:`RowGroupRows`: no copy of a
fixed-width column, the offsets and bytes of a string one), a gather is numpy indexing
per column and row group (about a microsecond), and the rows of the whole batch become
Arrow arrays once per column (:func:`assemble`).

Every column type of the codec (retina_common/codec.py) is gathered: fixed-width values
(integers, floats, dates, timestamps, decimals: their bytes), booleans (bit-packed in
Arrow), and strings and binaries (offsets and bytes), each with its NULLs. A column a
row group lacks (written before the column was added) gathers as NULL.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from retina_common.codec import COMMIT_TS


def _validity(array: pa.Array) -> np.ndarray | None:
    """True where a value is present; None when none is NULL."""
    if array.null_count == 0:
        return None
    return np.asarray(array.is_valid().to_numpy(zero_copy_only=False), bool)


@dataclass(frozen=True)
class _Piece:
    """Gathered values of one column from one row group."""

    values: np.ndarray  # fixed: the values; var: the bytes; bool: the flags
    lengths: np.ndarray | None  # var only: the byte length of each value
    valid: np.ndarray | None  # None: no NULL among them
    count: int


class _Column:
    """One column of a decoded row group, as numpy views."""

    def __init__(self, array: pa.Array) -> None:
        self.valid = _validity(array)
        kind = array.type
        n, first = len(array), array.offset
        self.var = pa.types.is_string(kind) or pa.types.is_binary(kind)
        self.lengths: np.ndarray | None = None
        if self.var:
            offsets = np.frombuffer(array.buffers()[1], np.int32)[first:first + n + 1]
            self.starts = offsets[:-1]
            self.lengths = np.diff(offsets)
            data = array.buffers()[2]
            self.values = np.frombuffer(data, np.uint8) if data is not None \
                else np.empty(0, np.uint8)
        elif pa.types.is_boolean(kind):
            self.values = np.asarray(array.fill_null(False).to_numpy(zero_copy_only=False),
                                     bool)
        else:
            width = kind.bit_width // 8
            dtype = np.dtype(f"V{width}")
            self.values = np.frombuffer(array.buffers()[1], dtype)[first:first + n]

    def take(self, rows: np.ndarray) -> _Piece:
        valid = None if self.valid is None else self.valid[rows]
        if not self.var:
            return _Piece(self.values[rows], None, valid, len(rows))
        assert self.lengths is not None
        lengths = self.lengths[rows]
        total = int(lengths.sum())
        if not total:
            return _Piece(np.empty(0, np.uint8), lengths, valid, len(rows))
        # The bytes of each value, one after the other: per byte, its value's start plus
        # its place within the value (no Python loop over the values).
        ends = np.cumsum(lengths)
        index = np.repeat(self.starts[rows] - (ends - lengths), lengths) + np.arange(total)
        return _Piece(self.values[index], lengths, valid, len(rows))


class RowGroupRows:
    """Decoded rows ready for point gathers (one chunk per column): one row group, or
    consecutive row groups of one file (``counts``: rg id -> its rows, in file order),
    whose rows are then numbered from the first one's on (:meth:`start`)."""

    def __init__(self, rows: pa.Table, counts: dict[int, int] | None = None) -> None:
        rows = rows.combine_chunks()
        self.table = rows  # for a few rows, Arrow slices cost less (assemble_few)
        self.num_rows = rows.num_rows
        self._starts: dict[int, tuple[int, int]] = {}  # rg id -> (first row, rows)
        at = 0
        for rg, count in (counts or {0: rows.num_rows}).items():
            self._starts[rg] = (at, count)
            at += count
        self.nbytes = rows.nbytes
        self._columns = {name: _Column(column.chunk(0) if column.num_chunks else
                                       pa.array([], column.type))
                         for name, column in zip(rows.column_names, rows.columns,
                                                 strict=True)}
        self.commit_ts = np.frombuffer(self._columns[COMMIT_TS].values, np.int64) \
            if COMMIT_TS in self._columns else np.zeros(self.num_rows, np.int64)

    def start(self, rg_id: int) -> tuple[int, int]:
        """(the number of row group ``rg_id``'s first row here, its rows)."""
        return self._starts[rg_id]

    def take(self, name: str, rows: np.ndarray) -> _Piece | None:
        """Column ``name`` at ``rows``; None when this row group lacks the column."""
        column = self._columns.get(name)
        return None if column is None else column.take(rows)


def assemble(schema: pa.Schema, gathered: Sequence[tuple[RowGroupRows, np.ndarray]]
             ) -> pa.Table:
    """The rows ``gathered`` names (per row group, the row offsets), in that order, as a
    table of ``schema``."""
    columns = [_array(field, [rows.take(field.name, at) for rows, at in gathered],
                      [len(at) for _rows, at in gathered]) for field in schema]
    return pa.Table.from_arrays(columns, schema=schema)


def assemble_few(schema: pa.Schema, rows: Sequence[tuple[RowGroupRows, int]]) -> pa.Table:
    """A few rows (each a row group and an offset), in that order, as a table of ``schema``:
    zero-copy slices of the decoded row groups, for answers where the numpy arrays of
    :func:`assemble` would cost more than they save."""
    parts = []
    for group, offset in rows:
        one = group.table.slice(offset, 1)
        names = one.schema.names
        parts.append(pa.Table.from_arrays(
            [one.column(f.name) if f.name in names else pa.nulls(1, f.type) for f in schema],
            schema=schema))
    return pa.concat_tables(parts) if parts else schema.empty_table()


def _array(field: pa.Field, pieces: list[_Piece | None], counts: list[int]) -> pa.Array:
    n = sum(counts)
    kind = field.type
    valid = _joined_validity(pieces, counts)
    validity = None if valid is None else pa.py_buffer(np.packbits(valid, bitorder="little"))
    present = [p for p in pieces if p is not None]
    if not present:
        return pa.nulls(n, kind)
    if pa.types.is_string(kind) or pa.types.is_binary(kind):
        lengths = np.concatenate([p.lengths if p is not None and p.lengths is not None
                                  else np.zeros(c, np.int32) for p, c in zip(pieces, counts,
                                                                             strict=True)])
        offsets = np.zeros(n + 1, np.int32)
        np.cumsum(lengths, out=offsets[1:])
        data = np.concatenate([p.values for p in present]) if present else np.empty(0)
        return pa.Array.from_buffers(kind, n, [validity, pa.py_buffer(offsets),
                                               pa.py_buffer(data.tobytes())])
    if pa.types.is_boolean(kind):
        flags = np.concatenate([p.values if p is not None else np.zeros(c, bool)
                                for p, c in zip(pieces, counts, strict=True)])
        return pa.Array.from_buffers(kind, n, [validity, pa.py_buffer(
            np.packbits(flags, bitorder="little"))])
    width = kind.bit_width // 8
    blank = np.zeros(1, np.dtype(f"V{width}"))
    values = np.concatenate([p.values if p is not None else np.repeat(blank, c)
                             for p, c in zip(pieces, counts, strict=True)])
    return pa.Array.from_buffers(kind, n, [validity, pa.py_buffer(values.tobytes())])


def _joined_validity(pieces: list[_Piece | None], counts: list[int]) -> np.ndarray | None:
    """Per gathered row, whether its value is present; None when every one is."""
    if all(p is not None and p.valid is None for p in pieces):
        return None
    return np.concatenate([np.zeros(c, bool) if p is None else
                           (np.ones(c, bool) if p.valid is None else p.valid)
                           for p, c in zip(pieces, counts, strict=True)])
