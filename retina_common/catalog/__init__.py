"""The PostgreSQL catalog (schemas, tables, columns, paths, FILES)."""

from retina_common.catalog.catalog import Catalog
from retina_common.catalog.errors import (
    AlreadyExistsError,
    CatalogError,
    CatalogOutcomeUnknown,
    CatalogUnavailable,
    CatalogVersionError,
    CleanupAtViolation,
    ConstraintViolation,
    FileTypeMismatch,
    InvalidCatalogArgument,
    NotFoundError,
    SwapPrecondition,
    SwapPreconditionError,
)
from retina_common.catalog.model import (
    ColumnSpec,
    FileRecord,
    FileType,
    PathRecord,
    SchemaRecord,
    SwapResult,
    TableRecord,
)

__all__ = [
    "AlreadyExistsError", "Catalog", "CatalogError", "CatalogOutcomeUnknown",
    "CatalogUnavailable", "CatalogVersionError", "CleanupAtViolation", "ColumnSpec",
    "ConstraintViolation", "FileRecord", "FileType", "FileTypeMismatch",
    "InvalidCatalogArgument", "NotFoundError", "PathRecord", "SchemaRecord", "SwapPrecondition",
    "SwapPreconditionError", "SwapResult", "TableRecord",
]
