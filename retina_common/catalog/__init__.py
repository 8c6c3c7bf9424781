"""The PostgreSQL catalog (schemas, tables, columns, paths, FILES)."""

from retina_common.catalog.catalog import Catalog
from retina_common.catalog.errors import (
    AlreadyExists,
    CatalogError,
    CatalogOutcomeUnknown,
    CatalogUnavailable,
    CatalogVersionError,
    CleanupAtViolation,
    ConstraintViolation,
    FileTypeMismatch,
    InvalidCatalogArgument,
    NotFound,
    SwapPrecondition,
    SwapPreconditionFailed,
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
    "AlreadyExists", "Catalog", "CatalogError", "CatalogOutcomeUnknown",
    "CatalogUnavailable", "CatalogVersionError", "CleanupAtViolation", "ColumnSpec",
    "ConstraintViolation", "FileRecord", "FileType", "FileTypeMismatch",
    "InvalidCatalogArgument", "NotFound", "PathRecord", "SchemaRecord", "SwapPrecondition",
    "SwapPreconditionFailed", "SwapResult", "TableRecord",
]
