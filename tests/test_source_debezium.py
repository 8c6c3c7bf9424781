"""DebeziumFileSource: grouping, op mapping, resume, following growth, refusals (pure files)."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest

from cdc_client.source import RowChange, SourceError, SourceTransaction
from cdc_client.sources.debezium import CHUNK_BYTES, DebeziumFileSource

SOURCE = {"connector": "postgresql", "db": "shop", "schema": "public", "table": "accounts",
          "ts_ms": 1_700_000_000_123, "txId": 771}


def event(op: str, before: dict | None, after: dict | None, *, txid: str | None = None,
          order: int = 1, table: str = "accounts", ts_ms: int = 1_700_000_000_500,
          source: dict | None = None) -> dict[str, Any]:
    return {"before": before, "after": after, "op": op, "ts_ms": ts_ms,
            "source": {**SOURCE, "table": table} if source is None else source,
            "transaction": None if txid is None else
            {"id": txid, "total_order": order, "data_collection_order": order}}


def begin(txid: str) -> dict[str, Any]:
    return {"status": "BEGIN", "id": txid, "event_count": None, "data_collections": None,
            "ts_ms": 1_700_000_000_000}


def end(txid: str, count: int | None, ts_ms: int = 1_700_000_000_999) -> dict[str, Any]:
    return {"status": "END", "id": txid, "event_count": count,
            "data_collections": [{"data_collection": "public.accounts", "event_count": count}],
            "ts_ms": ts_ms}


def write(path: Path, *messages: Any, mode: str = "a") -> None:
    with path.open(mode) as f:
        for message in messages:
            f.write((message if isinstance(message, str) else json.dumps(message)) + "\n")


def poll_all(source: DebeziumFileSource, count: int,
             timeout_s: float = 5) -> list[SourceTransaction]:
    """Poll until ``count`` transactions arrived (failing at the deadline)."""
    deadline = time.monotonic() + timeout_s
    got: list[SourceTransaction] = []
    while len(got) < count:
        remaining = deadline - time.monotonic()
        assert remaining > 0, f"only {len(got)} of {count} transactions arrived: {got}"
        tx = source.poll(min(remaining, 0.5))
        if tx is not None:
            got.append(tx)
    return got


def test_begin_end_groups_events_in_total_order(tmp_path: Path) -> None:
    write(tmp_path / "0001.jsonl",
          begin("tx1"),
          event("c", None, {"id": 2, "name": "b"}, txid="tx1", order=2),
          event("c", None, {"id": 1, "name": "a"}, txid="tx1", order=1),
          end("tx1", 2))
    source = DebeziumFileSource(tmp_path)
    [tx] = poll_all(source, 1)
    assert tx.position == "0001.jsonl:4"
    assert tx.source_txid == "tx1"
    assert tx.commit_time_ms == 1_700_000_000_999
    assert tx.changes == (
        RowChange("public.accounts", "insert", None, {"id": 1, "name": "a"}),
        RowChange("public.accounts", "insert", None, {"id": 2, "name": "b"}),
    )
    assert source.poll(0.1) is None


def test_events_without_transaction_are_their_own_transactions(tmp_path: Path) -> None:
    no_source_ts = {k: v for k, v in SOURCE.items() if k != "ts_ms"}
    write(tmp_path / "a.json",
          event("r", None, {"id": 1}),
          "",  # blank lines are skipped but still counted
          event("c", None, {"id": 2}, source=no_source_ts, ts_ms=42),
          {**event("c", None, {"id": 3}, source=no_source_ts), "ts_ms": None})
    txs = poll_all(DebeziumFileSource(tmp_path), 3)
    assert [t.position for t in txs] == ["a.json:1", "a.json:3", "a.json:4"]
    assert [t.commit_time_ms for t in txs] == [1_700_000_000_123, 42, 0]
    assert [t.source_txid for t in txs] == ["771", "771", "771"]
    assert [t.changes[0].after for t in txs] == [{"id": 1}, {"id": 2}, {"id": 3}]


def test_envelope_form_uses_the_payload(tmp_path: Path) -> None:
    schema = {"type": "struct", "name": "shop.public.accounts.Envelope"}
    write(tmp_path / "x.jsonl",
          {"schema": schema, "payload": begin("t9")},
          {"schema": schema, "payload": event("c", None, {"id": 1, "ok": True, "x": 1.5},
                                              txid="t9")},
          {"schema": schema, "payload": end("t9", 1)},
          {"schema": None, "payload": None})  # a tombstone: nothing to apply
    source = DebeziumFileSource(tmp_path)
    [tx] = poll_all(source, 1)
    assert tx.changes == (RowChange("public.accounts", "insert", None,
                                    {"id": 1, "ok": True, "x": 1.5}),)
    assert source.poll(0.1) is None


def test_op_mapping_including_key_change(tmp_path: Path) -> None:
    write(tmp_path / "ops.jsonl",
          begin("t1"),
          event("c", None, {"id": 1, "v": "a"}, txid="t1", order=1),
          event("r", None, {"id": 2, "v": "b"}, txid="t1", order=2),
          event("u", {"id": 1, "v": "a"}, {"id": 1, "v": "A"}, txid="t1", order=3),
          event("u", {"id": 2, "v": "b"}, {"id": 20, "v": "b"}, txid="t1", order=4),
          event("d", {"id": 20, "v": "b"}, None, txid="t1", order=5),
          end("t1", 5))
    [tx] = poll_all(DebeziumFileSource(tmp_path), 1)
    assert [(c.op, c.before, c.after) for c in tx.changes] == [
        ("insert", None, {"id": 1, "v": "a"}),
        ("insert", None, {"id": 2, "v": "b"}),
        ("update", {"id": 1, "v": "a"}, {"id": 1, "v": "A"}),
        ("update", {"id": 2, "v": "b"}, {"id": 20, "v": "b"}),
        ("delete", {"id": 20, "v": "b"}, None),
    ]


def test_table_falls_back_to_database_name(tmp_path: Path) -> None:
    mysql_source = {"connector": "mysql", "db": "shop", "table": "orders", "ts_ms": 5}
    write(tmp_path / "m.jsonl", event("c", None, {"id": 1}, source=mysql_source))
    [tx] = poll_all(DebeziumFileSource(tmp_path), 1)
    assert tx.changes[0].table == "shop.orders"
    assert tx.source_txid == ""


def test_start_after_resumes_after_that_position(tmp_path: Path) -> None:
    write(tmp_path / "0001.jsonl",
          begin("t1"), event("c", None, {"id": 1}, txid="t1"), end("t1", 1),
          event("c", None, {"id": 2}))
    write(tmp_path / "0002.jsonl",
          begin("t3"), event("c", None, {"id": 3}, txid="t3"), end("t3", 1))
    first = poll_all(DebeziumFileSource(tmp_path), 3)
    assert [t.position for t in first] == ["0001.jsonl:3", "0001.jsonl:4", "0002.jsonl:3"]

    source = DebeziumFileSource(tmp_path, start_after=first[0].position)
    rest = poll_all(source, 2)
    assert [t.position for t in rest] == [t.position for t in first[1:]]
    assert source.poll(0.1) is None

    later = DebeziumFileSource(tmp_path, start_after="0001.jsonl:4")
    assert [t.changes[0].after for t in poll_all(later, 1)] == [{"id": 3}]
    assert later.poll(0.1) is None


def test_positions_order_by_file_then_line(tmp_path: Path) -> None:
    source = DebeziumFileSource(tmp_path)
    keys = [source.position_key(p) for p in ["0001.jsonl:9", "0001.jsonl:10", "0002.jsonl:1"]]
    assert keys == sorted(keys)
    assert source.position_key("dir:with:colons.jsonl:7") == ("dir:with:colons.jsonl", 7)
    with pytest.raises(SourceError, match="file:line"):
        source.position_key("0001.jsonl")


def test_partial_trailing_line_waits_for_its_newline(tmp_path: Path) -> None:
    path = tmp_path / "0001.jsonl"
    line = json.dumps(event("c", None, {"id": 1}))
    path.write_text(line[:25])
    source = DebeziumFileSource(tmp_path)
    assert source.poll(0.2) is None
    with path.open("a") as f:
        f.write(line[25:])  # complete, but still no newline
    assert source.poll(0.2) is None
    with path.open("a") as f:
        f.write("\n")
    [tx] = poll_all(source, 1)
    assert tx.position == "0001.jsonl:1"

    # Growth of the last file and new files are followed without re-reading.
    write(path, event("c", None, {"id": 2}))
    write(tmp_path / "0002.jsonl", event("c", None, {"id": 3}))
    txs = poll_all(source, 2)
    assert [t.position for t in txs] == ["0001.jsonl:2", "0002.jsonl:1"]
    assert source.poll(0.1) is None


def test_transaction_split_by_a_partial_line_and_across_polls(tmp_path: Path) -> None:
    path = tmp_path / "0001.jsonl"
    write(path, begin("t1"), event("c", None, {"id": 1}, txid="t1", order=1))
    source = DebeziumFileSource(tmp_path)
    assert source.poll(0.1) is None  # the transaction has not ended yet
    write(path, event("c", None, {"id": 2}, txid="t1", order=2), end("t1", 2))
    [tx] = poll_all(source, 1)
    assert [c.after for c in tx.changes] == [{"id": 1}, {"id": 2}]


def test_unterminated_last_line_of_an_earlier_file_counts_once_a_later_file_exists(
        tmp_path: Path) -> None:
    (tmp_path / "0001.jsonl").write_text(json.dumps(event("c", None, {"id": 1})))
    source = DebeziumFileSource(tmp_path)
    assert source.poll(0.1) is None
    write(tmp_path / "0002.jsonl", event("c", None, {"id": 2}))
    txs = poll_all(source, 2)
    assert [t.position for t in txs] == ["0001.jsonl:1", "0002.jsonl:1"]


def test_lines_longer_than_a_read_chunk(tmp_path: Path) -> None:
    big = "x" * (3 * CHUNK_BYTES // 2)
    write(tmp_path / "0001.jsonl", event("c", None, {"id": 1, "big": big}),
          event("c", None, {"id": 2, "big": big}))
    txs = poll_all(DebeziumFileSource(tmp_path), 2)
    assert [t.changes[0].after["id"] for t in txs] == [1, 2]
    assert txs[1].changes[0].after["big"] == big


def test_other_files_are_ignored(tmp_path: Path) -> None:
    write(tmp_path / "notes.txt", "not json")
    write(tmp_path / "0001.jsonl", event("c", None, {"id": 1}))
    assert [t.position for t in poll_all(DebeziumFileSource(tmp_path), 1)] == ["0001.jsonl:1"]


def test_poll_returns_none_at_its_timeout(tmp_path: Path) -> None:
    source = DebeziumFileSource(tmp_path)
    started = time.monotonic()
    assert source.poll(0.3) is None
    assert 0.25 <= time.monotonic() - started < 2


def test_file_appearing_before_the_current_one_is_refused(tmp_path: Path) -> None:
    write(tmp_path / "0002.jsonl", event("c", None, {"id": 2}))
    source = DebeziumFileSource(tmp_path)
    poll_all(source, 1)
    write(tmp_path / "0001.jsonl", event("c", None, {"id": 1}))
    with pytest.raises(SourceError, match=r"0001\.jsonl appeared"):
        source.poll(0.1)


def test_file_shrinking_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "0001.jsonl"
    write(path, event("c", None, {"id": 1}))
    source = DebeziumFileSource(tmp_path)
    poll_all(source, 1)
    path.write_text("")
    with pytest.raises(SourceError, match="shrank"):
        source.poll(0.1)


MALFORMED: list[tuple[str, list[Any], str, str]] = [
    ("bad json", ['{"op": "c", '], r"f\.jsonl:1", "malformed JSON"),
    ("not an object", ["[1, 2]"], r"f\.jsonl:1", "expected a JSON object"),
    ("missing op", [{"before": None, "after": {"id": 1}, "source": SOURCE}],
     r"f\.jsonl:1", "without 'op'"),
    ("unknown op", [event("x", None, {"id": 1})], r"f\.jsonl:1", "unknown op 'x'"),
    ("insert without after", [event("c", None, None)], r"f\.jsonl:1", "'c' without 'after'"),
    ("update without after", [event("u", {"id": 1}, None)], r"f\.jsonl:1", "'u' without 'after'"),
    ("delete without before", [event("d", None, None)], r"f\.jsonl:1", "'d' without 'before'"),
    ("row not an object", [event("c", None, [1])], r"f\.jsonl:1", "'after' is not an object"),
    ("no table", [event("c", None, {"id": 1}, source={"db": "x"})], r"f\.jsonl:1",
     "without source.table"),
    ("event of a transaction not open", [event("c", None, {"id": 1}, txid="t7")],
     r"f\.jsonl:1", "transaction t7, which is not open"),
    ("interleaved transactions",
     [begin("t1"), event("c", None, {"id": 1}, txid="t1"), event("c", None, {"id": 2}, txid="t2")],
     r"f\.jsonl:3", "transaction t2, which is not open \\(open: t1\\)"),
    ("event without transaction inside one",
     [begin("t1"), event("c", None, {"id": 1})], r"f\.jsonl:2", "inside open transaction t1"),
    ("nested begin", [begin("t1"), begin("t2")], r"f\.jsonl:2", "BEGIN of transaction t2 while t1"),
    ("end without begin", [end("t1", 0)], r"f\.jsonl:1",
     "END of transaction t1, which is not open"),
    ("event count mismatch",
     [begin("t1"), event("c", None, {"id": 1}, txid="t1"), end("t1", 2)],
     r"f\.jsonl:3", "announces 2 events, 1 arrived since f\\.jsonl:1"),
    ("unknown status", [{"status": "ROLLBACK", "id": "t1"}], r"f\.jsonl:1", "unknown transaction"),
]


@pytest.mark.parametrize("lines, where, what", [m[1:] for m in MALFORMED],
                         ids=[m[0] for m in MALFORMED])
def test_malformed_streams_raise_source_error(tmp_path: Path, lines: list[Any], where: str,
                                              what: str) -> None:
    write(tmp_path / "f.jsonl", *lines)
    source = DebeziumFileSource(tmp_path)
    with pytest.raises(SourceError, match=f"^{where}: .*{what}"):
        source.poll(1)
