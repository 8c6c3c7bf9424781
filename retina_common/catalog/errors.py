"""Typed catalog errors. Every failure raises; nothing is reported as a bare False."""

from __future__ import annotations

from enum import StrEnum


class CatalogError(Exception):
    """Base class of every catalog failure."""


class CatalogUnavailable(CatalogError):
    """PostgreSQL could not be reached or the statement failed before commit; nothing changed."""


class CatalogOutcomeUnknown(CatalogError):
    """The connection broke during COMMIT: the change may or may not be durable.

    Re-read the catalog before deciding, and never delete a file that the
    possibly-committed change may reference (docs/architecture.md, "Durability conventions").
    """


class CatalogVersionError(CatalogError):
    """The database holds a catalog schema this code does not know."""


class NotFound(CatalogError):
    """A schema, table, path or file does not exist."""


class AlreadyExists(CatalogError):
    """The object exists already (unique name)."""


class InvalidCatalogArgument(CatalogError, ValueError):
    """Malformed input rejected before any SQL runs."""


class CleanupAtViolation(InvalidCatalogArgument):
    """cleanupAt set on a non-RETIRED file, or missing on a RETIRED one."""


class ConstraintViolation(CatalogError):
    """PostgreSQL refused the change with a constraint (the last line of defence)."""


class FileTypeMismatch(CatalogError):
    """A guarded update found the file in another type than expected; nothing changed."""

    def __init__(self, file_id: int, expected: object, actual: object) -> None:
        super().__init__(f"file {file_id} is {actual}, expected {expected}")
        self.file_id = file_id
        self.expected = expected
        self.actual = actual


class SwapPrecondition(StrEnum):
    NO_OLD_FILES = "NO_OLD_FILES"
    DUPLICATE_OLD_FILES = "DUPLICATE_OLD_FILES"
    NEW_FILE_AMONG_OLD = "NEW_FILE_AMONG_OLD"
    NEW_FILE_MISSING = "NEW_FILE_MISSING"
    NEW_FILE_NOT_TEMPORARY_GC = "NEW_FILE_NOT_TEMPORARY_GC"
    OLD_FILE_MISSING = "OLD_FILE_MISSING"
    OLD_FILE_NOT_REGULAR = "OLD_FILE_NOT_REGULAR"
    PATH_MISMATCH = "PATH_MISMATCH"


class SwapPreconditionFailed(CatalogError):
    """atomicSwapFiles refused: the named precondition failed and nothing changed."""

    def __init__(self, precondition: SwapPrecondition, file_id: int | None, detail: str) -> None:
        super().__init__(f"atomicSwapFiles: {precondition.value}: {detail}")
        self.precondition = precondition
        self.file_id = file_id
