"""Catalog records and the four file types of the protocol (specification section 2)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import IntEnum

from retina_common.catalog.errors import CleanupAtViolation, InvalidCatalogArgument


class FileType(IntEnum):
    """Catalog file types; the numbers are the Java reference's.

    There is no legacy ``TEMPORARY`` type: the CHECK constraint refuses any
    other number.
    """

    TEMPORARY_INGEST = 0  # pre-allocated or in-progress ingest file
    REGULAR = 1  # published, query-visible
    TEMPORARY_GC = 2  # Storage GC rewrite, governed by the GC journal
    RETIRED = 3  # retired by a GC swap or by recovery cleansing; cleanupAt drives deletion


def check_cleanup_at(file_type: FileType, cleanup_at: int | None) -> None:
    """Invariant FILE_CLEANUP_AT_IFF_RETIRED: cleanupAt is set iff the type is RETIRED.

    Checked here (fail fast, before SQL) and by the ``files_cleanup_at_iff_retired``
    CHECK constraint (even raw SQL cannot break it).
    """
    if file_type == FileType.RETIRED and cleanup_at is None:
        raise CleanupAtViolation("a RETIRED file needs cleanupAt")
    if file_type != FileType.RETIRED and cleanup_at is not None:
        raise CleanupAtViolation(f"cleanupAt is only for RETIRED files, not {file_type.name}")


# Column types a table may declare, with their Arrow counterparts.
COLUMN_TYPES = {
    "boolean": "bool",
    "int32": "int32",
    "int64": "int64",
    "float32": "float32",
    "float64": "float64",
    "string": "string",
    "binary": "binary",
    "date32": "date32",
    "timestamp_us": "timestamp[us]",
}
_DECIMAL = re.compile(r"^decimal\((\d{1,2}),(\d{1,2})\)$")
# Named in every refusal of a type: "unknown column type" alone leaves the operator guessing.
VALID_COLUMN_TYPES = ", ".join([*COLUMN_TYPES, "decimal(P,S) with 1 <= P <= 38 and S <= P"])
_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,62}$")


def check_name(kind: str, name: str) -> str:
    if not isinstance(name, str) or not _NAME.match(name):
        raise InvalidCatalogArgument(f"bad {kind} name {name!r}: letters, digits, _ (max 63)")
    return name


def check_column_type(type_name: str) -> str:
    normalized = type_name.strip().lower().replace(" ", "")
    if normalized in COLUMN_TYPES:
        return normalized
    match = _DECIMAL.match(normalized)
    if match and 0 < int(match.group(1)) <= 38 and int(match.group(2)) <= int(match.group(1)):
        return normalized
    raise InvalidCatalogArgument(f"unknown column type {type_name!r}; valid types: "
                                 f"{VALID_COLUMN_TYPES}")


@dataclass(frozen=True)
class ColumnSpec:
    name: str
    type: str
    nullable: bool = True  # False: NOT NULL (a primary-key column is NOT NULL whatever it says)


@dataclass(frozen=True)
class SchemaRecord:
    schema_id: int
    name: str


@dataclass(frozen=True)
class ColumnRecord:
    column_id: int
    name: str
    type: str
    ordinal: int
    pk_position: int | None
    since_version: int = 1  # the table schema version that added it (1: created with it)
    nullable: bool = True  # False: NOT NULL; a primary-key column never holds NULL either

    @property
    def accepts_null(self) -> bool:
        """Whether a row may hold NULL here: a nullable column outside the primary key."""
        return self.nullable and self.pk_position is None


@dataclass(frozen=True)
class TableRecord:
    table_id: int
    schema_id: int
    schema_name: str
    name: str
    primary_index_id: int
    columns: tuple[ColumnRecord, ...]
    schema_version: int = 1  # bumped by every added column (Catalog.add_column)

    @property
    def original_width(self) -> int:
        """How many columns the table was created with."""
        return sum(1 for c in self.columns if c.since_version == 1)

    def accepts_width(self, width: int) -> bool:
        """A row encoded for some schema version of the table: columns are only ever
        appended one per version, so every width from the original one up to today's."""
        return self.original_width <= width <= len(self.columns)

    @property
    def primary_key(self) -> tuple[str, ...]:
        keyed = [c for c in self.columns if c.pk_position is not None]
        return tuple(c.name for c in sorted(keyed, key=lambda c: c.pk_position or 0))


@dataclass(frozen=True)
class PathRecord:
    path_id: int
    table_id: int
    uri: str


@dataclass(frozen=True)
class FileRecord:
    """One row of FILES: exactly the specification's columns."""

    file_id: int
    name: str
    type: FileType
    num_row_group: int
    path_id: int
    min_row_id: int | None
    max_row_id: int | None
    cleanup_at: int | None


@dataclass(frozen=True)
class SwapResult:
    new_file: FileRecord
    retired_files: tuple[FileRecord, ...]
