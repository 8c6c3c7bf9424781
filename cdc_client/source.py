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
from dataclasses import dataclass
from typing import Any, Literal, Protocol

Op = Literal["insert", "update", "delete"]


class SourceError(Exception):
    """The source stream is malformed or out of protocol; the connector stops."""


@dataclass(frozen=True)
class RowChange:
    """One row effect of a source transaction.

    ``table`` is the source table as ``schema.table``. ``before`` is the old
    row (at least its primary-key columns) for delete, and for update when the
    source sends it (without it, the key did not change), else None;
    ``after`` is the full new row for insert and update, else None. Values are
    Python values :func:`retina_common.codec.encode_value` accepts (int,
    float, Decimal, bool, str, bytes, date, datetime) or None.
    """

    table: str
    op: Op
    before: Mapping[str, Any] | None
    after: Mapping[str, Any] | None


@dataclass(frozen=True)
class SourceTransaction:
    position: str          # where the source resumes after this transaction
    source_txid: str       # the source's own transaction id, for logs
    commit_time_ms: int    # source commit time, ms since the epoch (freshness)
    changes: tuple[RowChange, ...]


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
