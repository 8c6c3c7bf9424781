"""Routes: several source tables (or column subsets of them) onto one target table.

A ``[[cdc.routes]]`` entry (retina_common.config.CdcRoute) sends the changes of one
source table to a Retina table of another name, each mapped column renamed and every
other source column left out. Several routes may share a target: the wide-table
pattern, where orders, payments and shipments keyed alike by order id each fill
their own columns of one row per order. A source table may have several routes (to
several targets); a source table with none goes to the table of its own name.

A routed change is rewritten before translate sees it, as a change of the target
with the target's column names:

* an INSERT or UPDATE becomes an upsert of the mapped columns it carries. Naming
  only some of the target's columns, it is a partial update (translate: a row whose
  ``after`` lacks columns), so each source keeps the other sources' columns;
* a DELETE deletes the target row, whatever columns the source owns: a delete from
  any source removes the whole row (no silent no-op, docs/encoding.md);
* a TRUNCATE truncates the target, every row of it, for the same reason;
* an UPDATE that changes the key deletes the old key's row and upserts the new key.

Invariant ROUTES_NAME_THE_TARGET_KEY: every route maps a source column onto each of
its target's primary-key columns, so every routed change names its target row
(checked against the catalog when the connector starts). The old row of a routed
DELETE or key-changing UPDATE must hold those source columns too: the source table is
keyed by them, or has REPLICA IDENTITY FULL (else the change is refused,
MalformedChange). A routed source table's own schema changes are not followed: its
route names the columns it takes, and a new source column is simply not among them;
a mapped column the source drops or renames stops the connector
(UnsupportedSchemaChange, exit 6), where a silently frozen target column would be.
A routed change is a partial update of the columns it carries (``RowChange.partial``);
one that carries every column of its target is a whole row.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

from cdc_client.schema_change import UnsupportedSchemaChange
from cdc_client.source import MalformedChange, RowChange, SourceTransaction
from retina_common.catalog import TableRecord
from retina_common.config import CdcRoute


class RouteError(Exception):
    """A route that cannot work against the catalog (a configuration error)."""


class Routes:
    """The configured routes by source table, and the rewrite of a transaction."""

    def __init__(self, schema: str, routes: Iterable[CdcRoute]) -> None:
        self.schema = schema
        self._by_source: dict[str, list[CdcRoute]] = {}
        for route in routes:
            self._by_source.setdefault(route.source, []).append(route)

    def __bool__(self) -> bool:
        return bool(self._by_source)

    def routed(self, source_table: str) -> bool:
        return source_table in self._by_source

    def targets(self) -> list[CdcRoute]:
        return [r for routes in self._by_source.values() for r in routes]

    def check(self, lookup: Callable[[str, str], TableRecord | None]) -> None:
        """ROUTES_NAME_THE_TARGET_KEY and every mapped column, against the catalog;
        raises RouteError naming the route."""
        for route in self.targets():
            problem = route_problem(route, lookup(self.schema, route.target), self.schema)
            if problem:
                raise RouteError(problem)

    def source_key(self, source_table: str,
                   lookup: Callable[[str, str], TableRecord | None]) -> tuple[str, ...] | None:
        """The source columns that map onto the key of the first route's target (the
        Debezium source finds a transaction's earlier write of a row by them)."""
        routes = self._by_source.get(source_table)
        if not routes:
            return None
        record = lookup(self.schema, routes[0].target)
        if record is None:
            return None
        back = {t: s for s, t in routes[0].columns}
        if not all(k in back for k in record.primary_key):
            return None
        return tuple(back[k] for k in record.primary_key)

    def rewrite(self, trans: SourceTransaction,
                lookup: Callable[[str, str], TableRecord | None]) -> SourceTransaction:
        """``trans`` with every routed change replaced by its routes' changes of their
        targets, in order; the routed tables' schemas checked against their routes
        (UnsupportedSchemaChange for a mapped column the source no longer has) and
        dropped (not followed)."""
        self._check_schemas(trans)
        if not any(c.table in self._by_source for c in trans.changes):
            return trans
        changes: list[RowChange] = []
        for change in trans.changes:
            routes = self._by_source.get(change.table)
            if routes is None:
                changes.append(change)
                continue
            changes += [self._routed(change, route, lookup) for route in routes]
        schemas = tuple(s for s in trans.schemas if s.table not in self._by_source)
        return SourceTransaction(trans.position, trans.source_txid, trans.commit_time_ms,
                                 tuple(changes), schemas, trans.bulk)

    def _check_schemas(self, trans: SourceTransaction) -> None:
        for schema in trans.schemas:
            names = {c.name for c in schema.columns}
            for route in self._by_source.get(schema.table, ()):
                gone = [s for s, _t in route.columns if s not in names]
                if gone:
                    raise UnsupportedSchemaChange(
                        f"source transaction {trans.source_txid} at {trans.position}: "
                        f"{schema.table} has no column(s) {gone} any more, which its route to "
                        f"{self.schema}.{route.target} maps (dropped or renamed at the "
                        "source): change the route, then restart")

    def _routed(self, change: RowChange, route: CdcRoute,
                lookup: Callable[[str, str], TableRecord | None]) -> RowChange:
        before = _renamed(change.before, route)
        if before is not None:
            record = lookup(self.schema, route.target)
            missing = [k for k in (record.primary_key if record else ()) if k not in before]
            if missing:
                sources = [s for s, t in route.columns if t in missing]
                raise MalformedChange(
                    f"{change.origin or change.table}: the old row of a {change.op} of "
                    f"{change.table} lacks column(s) {sources}, which its route maps onto the "
                    f"key of {self.schema}.{route.target}: key the source table by them, or "
                    f"set REPLICA IDENTITY FULL on it (docs/cdc.md, routes)")
        return RowChange(f"{self.schema}.{route.target}", change.op, before,
                         _renamed(change.after, route), origin=change.origin,
                         partial=change.op != "delete")


def route_problem(route: CdcRoute, record: TableRecord | None, schema: str) -> str:
    """Why ``route`` cannot write into ``record`` ("" when it can)."""
    where = f"cdc.routes: {route.source} -> {schema}.{route.target}"
    if record is None:
        return f"{where}: no table {schema}.{route.target} in the Retina catalog"
    names = {c.name for c in record.columns}
    unknown = [t for _s, t in route.columns if t not in names]
    if unknown:
        return f"{where}: the target has no column(s) {unknown}"
    mapped = {t for _s, t in route.columns}
    unkeyed = [k for k in record.primary_key if k not in mapped]
    if unkeyed:
        return (f"{where}: no source column maps onto primary-key column(s) {unkeyed} "
                "(ROUTES_NAME_THE_TARGET_KEY: a routed change must name its target row)")
    return ""


def _renamed(row: Mapping[str, Any] | None, route: CdcRoute) -> dict[str, Any] | None:
    """The row's mapped columns under their target names; a column the source left
    out (an unchanged TOAST value, a minimal row image) stays out."""
    if row is None:
        return None
    return {target: row[source] for source, target in route.columns if source in row}


