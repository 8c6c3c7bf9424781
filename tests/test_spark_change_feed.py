"""The Spark batch reader of the change feed (spark_jobs/changes_query.py) against the client
merge and the model, with real TransServer, Retina nodes, etcd, PostgreSQL and Spark local
mode: one task per virtual node, the same rows and ordinals as the merge, the model's
changes; an expired cursor refused before Spark; the command's Parquet."""

from __future__ import annotations

from collections.abc import Callable
from decimal import Decimal
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from retina_common import exit_codes
from retina_common.catalog import Catalog
from retina_common.change_reader import ChangesExpired, decode_cursor
from spark_jobs.changes_query import SparkChanges, read_changes

from .dataplane import SCHEMA, DataPlane
from .feed_model import expected_changes, feed_changes
from .test_as_of_reads import hand_out_safe_gc_ts, maintenance, step
from .test_change_feed import ORDER_COLUMNS, history, read_feed
from .test_recovery_protocol import order
from .test_spark_jobs import last_json, run_job

pytestmark = pytest.mark.integration

EVENT_COLUMNS = ("tenant", "seq", "payload", "ok")


def plain(row: dict[str, Any]) -> dict[str, Any]:
    """Spark gives binary as bytearray, the merge bytes."""
    return {k: bytes(v) if isinstance(v, bytearray) else v for k, v in row.items()}


def merged_rows(plane: DataPlane, table: str, from_ts: int, to_ts: int,
                **options: Any) -> list[dict[str, Any]]:
    return [r for c in read_feed(plane, table, from_ts, to_ts=to_ts, **options)
            for r in c.changes.to_pylist()]


def spark_rows(changes: SparkChanges) -> list[dict[str, Any]]:
    return [plain(r.asDict()) for r in changes.frame.collect()]


def by_commit(rows: list[dict[str, Any]]) -> list[tuple[int, pa.Table]]:
    commits: dict[int, list[dict[str, Any]]] = {}
    for r in rows:
        commits.setdefault(r["_commit_ts"], []).append(r)
    return [(ts, pa.Table.from_pylist(part)) for ts, part in sorted(commits.items())]


def check_against_merge_and_model(plane: DataPlane, spark: Any, table: str, from_ts: int,
                                  to_ts: int | None, model_columns: tuple[str, ...],
                                  **options: Any) -> SparkChanges:
    assert plane.reader is not None
    changes = read_changes(spark, plane.trans.address, plane.topology, SCHEMA, table,
                           from_ts, to_ts, **options)
    got = spark_rows(changes)
    # Row for row, ordinals included, in (commit ts, ordinal) order.
    assert got == merged_rows(plane, table, from_ts, changes.to_ts, **options)
    if not options.get("keep_unchanged"):  # the model drops updates that changed nothing
        want = expected_changes(history(plane, table), from_ts, changes.to_ts, model_columns)
        assert feed_changes(by_commit(got), plane.writers[table].key, model_columns) == want
    return changes


def test_the_spark_read_equals_the_merge_and_the_model(
        make_plane: Callable[..., DataPlane], catalog: Catalog, spark: Any) -> None:
    plane = make_plane(nodes=2)
    points = [step(plane, catalog, n) for n in range(4)]
    # An update that changed nothing and one that did, in one commit.
    same = plane.model.rows["orders"][plane.writers["orders"].key({"id": 13})]
    plane.commit({"orders": {"replaces": [dict(same), order(14, note="changed")]}})
    start = points[0] - 1

    whole = check_against_merge_and_model(plane, spark, "orders", start, None, ORDER_COLUMNS)
    assert whole.tasks == plane.topology.virtual_nodes
    assert whole.to_ts >= plane.model.history[-1][0]
    rows = spark_rows(whole)
    assert {r["_change_type"] for r in rows} == {"insert", "update_before", "update_after",
                                                  "delete"}
    # Commits spread over several virtual nodes: the ordinal numbers the whole commit.
    first = [r for r in rows if r["_commit_ts"] == points[1]]
    assert [r["_ordinal"] for r in first] == list(range(len(first))) and len(first) > 8
    assert whole.frame.columns == ["_change_type", "_commit_ts", "_ordinal",
                                   "_source_position", *ORDER_COLUMNS]
    check_against_merge_and_model(plane, spark, "events", start, None, EVENT_COLUMNS)
    # A part of the range, from a cursor, and one resumed from where it ended: together
    # the whole, nothing twice.
    part = check_against_merge_and_model(plane, spark, "orders", start, points[2],
                                         ORDER_COLUMNS)
    rest = check_against_merge_and_model(plane, spark, "orders",
                                         decode_cursor(part.cursor), whole.to_ts, ORDER_COLUMNS)
    assert spark_rows(part) + spark_rows(rest) == rows
    # Options as the merge takes them: the unchanged update kept, fewer columns.
    check_against_merge_and_model(plane, spark, "orders", points[-1], None, ORDER_COLUMNS,
                                  keep_unchanged=True)
    narrow = check_against_merge_and_model(plane, spark, "orders", start, None, ("id", "note"),
                                           columns=["note"])
    assert narrow.frame.columns == ["_change_type", "_commit_ts", "_ordinal",
                                    "_source_position", "id", "note"]
    # An end past the newest snapshot is the newest snapshot, for every task alike; an
    # empty range is an empty frame with the same columns.
    late = read_changes(spark, plane.trans.address, plane.topology, SCHEMA, "orders",
                        start, whole.to_ts + 10**9)
    assert late.to_ts < whole.to_ts + 10**9 and spark_rows(late) == rows
    empty = read_changes(spark, plane.trans.address, plane.topology, SCHEMA, "orders",
                         late.to_ts, None)
    assert empty.frame.count() == 0 and empty.frame.columns == whole.frame.columns


def test_an_expired_cursor_is_refused_naming_the_earliest(
        make_plane: Callable[..., DataPlane], catalog: Catalog, spark: Any) -> None:
    plane = make_plane(nodes=2)
    points = [step(plane, catalog, n) for n in range(3)]
    horizon = hand_out_safe_gc_ts(plane)
    maintenance(plane)
    with pytest.raises(ChangesExpired) as refused:
        read_changes(spark, plane.trans.address, plane.topology, SCHEMA, "orders", points[0])
    assert refused.value.earliest == horizon
    later = [step(plane, catalog, n) for n in range(3, 5)]
    resumed = check_against_merge_and_model(plane, spark, "orders", refused.value.earliest,
                                            None, ORDER_COLUMNS)
    assert sorted({r["_commit_ts"] for r in spark_rows(resumed)})[-2:] == later
    # The command: refused (exit 3) with the earliest cursor, before Spark starts.
    result = run_job("spark_jobs.changes_query", "--config", plane.config_path, "--table",
                     f"{SCHEMA}.orders", "--from", str(points[0]))
    assert result.returncode == exit_codes.REFUSED, result.stderr
    assert f"the earliest cursor is timestamp {horizon}" in result.stderr


def test_the_command_writes_the_changes_as_parquet(
        make_plane: Callable[..., DataPlane], catalog: Catalog, tmp_path: Any) -> None:
    plane = make_plane(nodes=2)
    points = [step(plane, catalog, n) for n in range(3)]
    out = tmp_path / "changes"
    result = run_job("spark_jobs.changes_query", "--config", plane.config_path, "--table",
                     f"{SCHEMA}.orders", "--from", str(points[0] - 1), "--to-ts",
                     str(points[-1]), "--output", out, "--json")
    assert result.returncode == exit_codes.OK, result.stderr
    summary = last_json(result.stdout)
    assert summary["to_ts"] == points[-1]
    assert decode_cursor(summary["cursor"], SCHEMA, "orders") == points[-1]
    written = pq.read_table(out).to_pylist()
    want = merged_rows(plane, "orders", points[0] - 1, points[-1])
    assert summary["count"] == len(want)
    assert sorted(written, key=lambda r: (r["_commit_ts"], r["_ordinal"])) == want
    assert all(isinstance(r["amount"], Decimal) for r in written)
    # Resumed from its cursor: the changes after it, none again.
    step(plane, catalog, 3)
    again = run_job("spark_jobs.changes_query", "--config", plane.config_path, "--table",
                    f"{SCHEMA}.orders", "--from", summary["cursor"], "--json")
    assert again.returncode == exit_codes.OK, again.stderr
    assert last_json(again.stdout)["count"] == len(
        merged_rows(plane, "orders", points[-1], last_json(again.stdout)["to_ts"]))
