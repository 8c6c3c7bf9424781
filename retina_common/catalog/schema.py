"""Versioned, idempotent catalog schema bootstrap.

``catalog_version`` holds one row with the schema version. Bootstrap runs in
one transaction under an advisory lock (concurrent starts serialise): it
creates the schema on an empty database, upgrades an older version step by
step, does nothing on the current one, and refuses a newer, unknown version
or an unversioned database that already has catalog tables.
"""

from __future__ import annotations

from typing import Any

from retina_common.catalog.errors import CatalogVersionError
from retina_common.failpoints import (
    CATALOG_BOOTSTRAP_COMMIT_AFTER,
    CATALOG_BOOTSTRAP_COMMIT_BEFORE,
)

CURRENT_VERSION = 3
_ADVISORY_LOCK = 0x5245_5449_4E41  # "RETINA"

_V1 = """
CREATE TABLE schemas (
    schema_id   BIGSERIAL PRIMARY KEY,
    name        TEXT NOT NULL UNIQUE
);

CREATE SEQUENCE primary_index_id_seq;

CREATE TABLE tables (
    table_id          BIGSERIAL PRIMARY KEY,
    schema_id         BIGINT NOT NULL REFERENCES schemas (schema_id) ON DELETE RESTRICT,
    name              TEXT NOT NULL,
    primary_index_id  BIGINT NOT NULL UNIQUE DEFAULT nextval('primary_index_id_seq'),
    UNIQUE (schema_id, name)
);

CREATE TABLE columns (
    column_id    BIGSERIAL PRIMARY KEY,
    table_id     BIGINT NOT NULL REFERENCES tables (table_id) ON DELETE CASCADE,
    name         TEXT NOT NULL,
    type         TEXT NOT NULL,
    ordinal      INT NOT NULL CHECK (ordinal >= 0),
    pk_position  INT CHECK (pk_position >= 0),
    UNIQUE (table_id, name),
    UNIQUE (table_id, ordinal),
    UNIQUE (table_id, pk_position)
);

-- Storage locations of a table's data files (Pixels' layout level is folded in).
CREATE TABLE paths (
    path_id   BIGSERIAL PRIMARY KEY,
    table_id  BIGINT NOT NULL REFERENCES tables (table_id) ON DELETE RESTRICT,
    uri       TEXT NOT NULL UNIQUE
);

-- Exactly the specification's columns. Ingest-path fields (tableId,
-- virtualNodeId, firstBlockId, commit-ts range) are deliberately absent: they
-- live in the IngestFileMetadataRegistry and the checkpoint body (001, C01.1).
CREATE TABLE files (
    file_id        BIGSERIAL PRIMARY KEY,
    name           TEXT NOT NULL,
    type           SMALLINT NOT NULL,
    num_row_group  INT NOT NULL,
    path_id        BIGINT NOT NULL REFERENCES paths (path_id) ON DELETE RESTRICT,
    min_row_id     BIGINT,
    max_row_id     BIGINT,
    cleanup_at     BIGINT,
    -- TEMPORARY_INGEST=0, REGULAR=1, TEMPORARY_GC=2, RETIRED=3; no legacy TEMPORARY.
    CONSTRAINT files_type_known CHECK (type IN (0, 1, 2, 3)),
    CONSTRAINT files_cleanup_at_iff_retired CHECK ((type = 3) = (cleanup_at IS NOT NULL)),
    CONSTRAINT files_row_id_hull CHECK (
        (min_row_id IS NULL) = (max_row_id IS NULL)
        AND (min_row_id IS NULL OR (min_row_id >= 0 AND min_row_id <= max_row_id))),
    CONSTRAINT files_regular_has_hull CHECK (type <> 1 OR min_row_id IS NOT NULL),
    CONSTRAINT files_num_row_group CHECK (num_row_group >= 0),
    UNIQUE (path_id, name)
);
CREATE INDEX files_by_path_type ON files (path_id, type);
CREATE INDEX files_by_type ON files (type);
"""

# Schema evolution (docs/catalog.md, "Schema evolution"): a table's schema version, bumped
# by every added column, and the version each column arrived in. Rows encoded for an older
# version (fewer columns) stay valid: the columns added since read as NULL.
_V2 = """
ALTER TABLE tables ADD COLUMN schema_version INT NOT NULL DEFAULT 1
    CONSTRAINT tables_schema_version CHECK (schema_version >= 1);
ALTER TABLE columns ADD COLUMN since_version INT NOT NULL DEFAULT 1
    CONSTRAINT columns_since_version CHECK (since_version >= 1);
-- An added column is never part of the primary key.
ALTER TABLE columns ADD CONSTRAINT columns_added_not_key
    CHECK (since_version = 1 OR pk_position IS NULL);
"""

# NOT NULL columns (docs/catalog.md, "NOT NULL columns"): a column created NOT NULL refuses
# NULL in every row written to it (INVALID_ARGUMENT). Columns of an older catalog stay
# nullable; an added column is always nullable (rows written before it hold none).
_V3 = """
ALTER TABLE columns ADD COLUMN nullable BOOLEAN NOT NULL DEFAULT TRUE;
ALTER TABLE columns ADD CONSTRAINT columns_added_nullable
    CHECK (since_version = 1 OR nullable);
"""

MIGRATIONS: dict[int, str] = {1: _V1, 2: _V2, 3: _V3}


def bootstrap(conn: Any) -> int:
    """Bring the catalog schema to CURRENT_VERSION; returns the version found before.

    ``conn`` is a psycopg2 connection outside a transaction. 0 means the
    database was empty.
    """
    with conn.cursor() as cur:
        cur.execute("SELECT pg_advisory_xact_lock(%s)", (_ADVISORY_LOCK,))
        cur.execute("""CREATE TABLE IF NOT EXISTS catalog_version (
                           id SMALLINT PRIMARY KEY CHECK (id = 1),
                           version INT NOT NULL,
                           updated_at TIMESTAMPTZ NOT NULL DEFAULT now())""")
        cur.execute("SELECT version FROM catalog_version WHERE id = 1")
        row = cur.fetchone()
        found = 0 if row is None else int(row[0])
        if row is None:
            cur.execute("SELECT to_regclass('files') IS NOT NULL")
            if cur.fetchone()[0]:
                conn.rollback()
                raise CatalogVersionError(
                    "the database has a 'files' table but no catalog_version: "
                    "not a catalog this code created; refusing to touch it")
        if found > CURRENT_VERSION:
            conn.rollback()
            raise CatalogVersionError(
                f"catalog schema version {found} is newer than this code's {CURRENT_VERSION}; "
                "upgrade the software, do not downgrade the catalog")
        for version in range(found + 1, CURRENT_VERSION + 1):
            cur.execute(MIGRATIONS[version])
        if found == 0:
            cur.execute("INSERT INTO catalog_version (id, version) VALUES (1, %s)",
                        (CURRENT_VERSION,))
        elif found < CURRENT_VERSION:
            cur.execute("UPDATE catalog_version SET version = %s, updated_at = now() WHERE id = 1",
                        (CURRENT_VERSION,))
    CATALOG_BOOTSTRAP_COMMIT_BEFORE.hit()
    conn.commit()
    CATALOG_BOOTSTRAP_COMMIT_AFTER.hit()
    return found
