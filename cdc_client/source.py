"""What every CDC source yields: committed source transactions, in commit order.

A source (PostgreSQL logical replication, Debezium files) turns the source's
own stream into :class:`SourceTransaction` values. The connector gives each
one a Retina timestamp, stores it in the durable changelog, sends it, commits
it, and only then calls :meth:`Source.ack` with its position, so the source
may forget it.

Positions are opaque strings to the connector, but every source makes them
totally ordered by :meth:`Source.position_key` (an LSN, a file and line), so
the connector can skip transactions it already committed when a source
re-delivers them after a crash.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Protocol

if TYPE_CHECKING:
    from cdc_client.schema_change import SourceSchema

# "truncate": every row of ``table`` is deleted (before and after are None);
# changes after it in the same transaction still apply.
Op = Literal["insert", "update", "delete", "truncate"]


class SourceError(Exception):
    """The source stream is malformed or out of protocol; the connector stops."""


class MalformedChange(Exception):
    """A source change that does not fit the Retina table; the connector stops."""


@dataclass(frozen=True)
class RowChange:
    """One row effect of a source transaction.

    ``table`` is the source table as ``schema.table``. ``before`` is the old
    row (at least its primary-key columns) for delete, and for update when the
    source sends it (without it, the key did not change), else None;
    ``after`` is the full new row for insert and update, else None. Values are
    Python values :func:`retina_common.codec.encode_value` accepts (int,
    float, Decimal, bool, str, bytes, date, datetime, time) or None.
    ``origin`` names where the change is in the source (a Debezium
    ``file:line``), for errors; it is not part of the change's value.
    ``partial``: ``after`` names only the columns to set, and every column it
    leaves out keeps the row's current value (an unchanged TOAST value the
    source left out, a route's columns: docs/encoding.md, "Partial updates").
    Without it, a row that lacks columns the table was created with is a
    partial update too (a Debezium minimal row image), and a row that lacks
    only columns added later is whole, NULL there (decoded with the source's
    older relation).
    """

    table: str
    op: Op
    before: Mapping[str, Any] | None
    after: Mapping[str, Any] | None
    origin: str = field(default="", compare=False)
    partial: bool = False


@dataclass(frozen=True)
class SourceTransaction:
    position: str          # where the source resumes after this transaction
    source_txid: str       # the source's own transaction id, for logs
    commit_time_ms: int    # source commit time, ms since the epoch (freshness)
    changes: tuple[RowChange, ...]
    # Table schemas the source learnt since the previous transaction it returned (pgoutput
    # Relation messages); compared with the Retina tables before ``changes`` are translated
    # (cdc_client/schema_change.py).
    schemas: tuple[SourceSchema, ...] = ()
    # Inserts of keys with no live version only (an initial snapshot's chunk after the
    # one that truncates): the connector may load it with the bulk load path
    # (cdc_client/snapshot_load.py).
    bulk: bool = False


class Source(Protocol):
    name: str  # "postgres" | "debezium-file"

    def poll(self, timeout_s: float) -> SourceTransaction | None:
        """The next committed transaction, or None if none arrived in time.
        Raises SourceError on a malformed stream."""

    def ack(self, position: str) -> None:
        """Everything up to and including ``position`` is durable downstream."""

    def position_key(self, position: str) -> tuple[Any, ...]:
        """A sort key: a later transaction has a greater key."""

    def close(self) -> None: ...
