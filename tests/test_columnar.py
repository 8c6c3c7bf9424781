"""The columnar form of UpdateRecord (Arrow IPC): decoding is exact and fails closed,
and the row and columnar forms write the same data, through a crash and a replay."""

from __future__ import annotations

import datetime
import random
import re
import struct
from dataclasses import replace
from decimal import Decimal

import pyarrow as pa
import pytest

from retina_common.catalog.model import ColumnRecord, TableRecord
from retina_common.changelog import DELETE, REPLACE, ChangeRow
from retina_common.changelog_replay import changelog_rows, requests
from retina_common.client import TableWriter
from retina_common.codec import (
    decode_column,
    encode_primary_key,
    encode_primary_keys,
    encode_value,
)
from retina_common.columnar import (
    COLUMNAR_MIN_ROWS,
    ColumnarError,
    decode_delete_keys,
    decode_insert_rows,
    encode_delete_keys,
    encode_insert_values,
    min_columnar_rows,
    row_count,
    stream_width,
    table_schema,
)
from retina_common.topology import Topology

from .dataplane import DataPlane

TYPES = ["int64", "int32", "string", "binary", "boolean", "float64", "float32", "date32",
         "timestamp_us", "decimal(12,2)"]
TABLE = TableRecord(1, 1, "s", "every_type", 1, tuple(
    ColumnRecord(i + 1, f"c{i}", t, i, 0 if i == 0 else None) for i, t in enumerate(TYPES)))
# The same table after one ADD COLUMN.
EVOLVED = TableRecord(1, 1, "s", "every_type", 1, (
    *TABLE.columns, ColumnRecord(len(TYPES) + 1, "added", "string", len(TYPES), None, 2)), 2)


def sample_rows(n: int) -> list[list[bytes]]:
    values = []
    for i in range(n):
        python = [i, -i, f"s{i}é", bytes([i % 256]) * (i % 3), i % 2 == 0, i / 3, 1.5,
                  datetime.date(2024, 1, 1) + datetime.timedelta(days=i),
                  datetime.datetime(2024, 1, 1, tzinfo=datetime.UTC)
                  + datetime.timedelta(microseconds=i), Decimal(i) / 100]
        if i % 4 == 3:  # NULLs in every column but the key
            python[1:] = [None] * (len(python) - 1)
        values.append([b"" if v is None else encode_value(t, v)
                       for t, v in zip(TYPES, python, strict=True)])
    return values


def test_insert_rows_round_trip_every_type_exactly() -> None:
    rows = sample_rows(50)
    decoded = decode_insert_rows(encode_insert_values(TABLE, rows), TABLE)
    assert decoded.schema == table_schema(TABLE)
    for i, column in enumerate(TABLE.columns):
        assert decoded.column(i).combine_chunks().equals(
            decode_column(column.type, [r[i] for r in rows]))
    assert row_count(encode_insert_values(TABLE, rows)) == 50


def test_rows_of_an_older_schema_version_pad_with_null_and_decode_for_both() -> None:
    old, new = sample_rows(3), [[*r, encode_value("string", "x")] for r in sample_rows(2)]
    decoded = decode_insert_rows(encode_insert_values(EVOLVED, old + new), EVOLVED)
    assert decoded.column("added").to_pylist() == [None, None, None, "x", "x"]
    # Old rows alone make a stream as wide as their version: the node pads it.
    narrow = decode_insert_rows(encode_insert_values(EVOLVED, old), EVOLVED)
    assert narrow.num_columns == len(TYPES)
    with pytest.raises(ColumnarError, match="has 11 columns; the table has 10"):
        decode_insert_rows(encode_insert_values(EVOLVED, new), TABLE)
    with pytest.raises(ColumnarError, match="11 values"):
        encode_insert_values(TABLE, new)


@pytest.mark.parametrize("column, arrow", [
    ("c8", pa.timestamp("us", "+00:00")), ("c8", pa.timestamp("us")),
    ("c9", pa.decimal128(13, 2)), ("c0", pa.uint64()), ("c2", pa.large_string())])
def test_a_column_of_another_arrow_type_is_refused(column: str, arrow: pa.DataType) -> None:
    """Types are compared exactly: another time zone (or none), another precision,
    signedness or offset width is another type, not something cast."""
    rows = decode_insert_rows(encode_insert_values(TABLE, sample_rows(4)), TABLE)
    i = rows.schema.get_field_index(column)
    bad = rows.set_column(i, pa.field(column, arrow), rows.column(i).cast(arrow))
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, bad.schema) as writer:
        writer.write_table(bad)
    with pytest.raises(ColumnarError, match=re.escape(f"{column}: {arrow}")):
        decode_insert_rows(sink.getvalue().to_pybytes(), TABLE)


def test_delete_keys_round_trip() -> None:
    keys = [b"\x00\x00\x00\x08" + bytes(8), b"k" * 300, b"\x01"]
    assert decode_delete_keys(encode_delete_keys(keys)) == keys
    assert row_count(encode_delete_keys(keys)) == 3
    assert row_count(b"") == 0


@pytest.mark.parametrize("seed", range(4))
def test_damaged_streams_fail_closed(seed: int) -> None:
    """Flipped, dropped and inserted bytes anywhere in a stream: the decoder either
    refuses with ColumnarError or returns rows of exactly the table's schema that pass
    Arrow's full validation; it never raises anything else (or crashes the process)."""
    rng = random.Random(seed)
    good = encode_insert_values(TABLE, sample_rows(20))
    keys = encode_delete_keys([b"a" * 12, b"b" * 12])
    outcomes = {"refused": 0, "accepted": 0}
    for _ in range(300):
        data = bytearray(rng.choice((good, keys)))
        for _ in range(rng.randint(1, 4)):
            at = rng.randrange(len(data))
            action = rng.random()
            if action < 0.6:
                data[at] = rng.randrange(256)
            elif action < 0.8:
                del data[at:at + rng.randint(1, 16)]
            else:
                data[at:at] = bytes(rng.randrange(256) for _ in range(rng.randint(1, 8)))
        try:
            # What the node runs first: the row count (metadata only) and the width.
            assert row_count(bytes(data)) >= 0
            assert stream_width(bytes(data)) >= 0
            if rng.random() < 0.5:
                rows = decode_insert_rows(bytes(data), TABLE)
                assert rows.schema.types == table_schema(TABLE).types
                rows.validate(full=True)
            else:
                assert all(isinstance(k, bytes) for k in decode_delete_keys(bytes(data)))
            outcomes["accepted"] += 1
        except ColumnarError:
            outcomes["refused"] += 1
    assert outcomes["refused"] > 0


def test_compressed_and_dictionary_streams_are_refused_before_decoding() -> None:
    """A compressed body could expand a small request into gigabytes, so it is refused
    from its metadata alone; a dictionary batch has no column type to belong to."""
    rows = pa.table({"key": pa.array([b"k" * 1000] * 5000)})
    for codec in ("zstd", "lz4"):
        sink = pa.BufferOutputStream()
        with pa.ipc.new_stream(sink, rows.schema,
                               options=pa.ipc.IpcWriteOptions(compression=codec)) as writer:
            writer.write_table(rows)
        data = sink.getvalue().to_pybytes()
        assert len(data) < 100_000  # 5 MB of keys in a few KB
        for decode in (row_count, decode_delete_keys):
            with pytest.raises(ColumnarError, match="compressed"):
                decode(data)
    table = pa.table({"key": pa.array(["a", "b", "a"]).dictionary_encode()})
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    with pytest.raises(ColumnarError, match="dictionary"):
        row_count(sink.getvalue().to_pybytes())


def _v4_compressed(stream: bytes) -> bytes:
    """``stream`` (a schema and one zstd-compressed record batch) rewritten the way Arrow
    before V5 flagged compression: the batch's message says metadata V4 and carries
    ARROW:experimental_compression in its custom metadata, with no compression field."""
    u32 = struct.Struct("<I")
    schema, batch = list(pa.ipc.MessageReader.open_stream(pa.py_buffer(stream)))
    meta, body = bytearray(batch.metadata.to_pybytes()), batch.body.to_pybytes()

    def field(table: int, vtable: int, index: int) -> int | None:
        size = struct.unpack_from("<H", meta, vtable)[0]
        if 4 + 2 * index + 2 > size:
            return None
        offset = struct.unpack_from("<H", meta, vtable + 4 + 2 * index)[0]
        return table + offset if offset else None

    message = u32.unpack_from(meta, 0)[0]
    message_vt = message - struct.unpack_from("<i", meta, message)[0]
    header = field(message, message_vt, 2)
    assert header is not None
    record = header + u32.unpack_from(meta, header)[0]
    record_vt = record - struct.unpack_from("<i", meta, record)[0]
    body_length_at = field(message, message_vt, 3)
    assert body_length_at is not None
    body_length = struct.unpack_from("<q", meta, body_length_at)[0]
    struct.pack_into("<H", meta, record_vt + 4 + 2 * 3, 0)  # no RecordBatch.compression
    while len(meta) % 8:
        meta.append(0)
    # A new Message table (V4, custom_metadata) in front; the old one's RecordBatch is
    # reached through the new header offset. A 128-byte shift keeps its alignment.
    size = 128
    out = bytearray(size)
    u32.pack_into(out, 0, 24)
    struct.pack_into("<7H", out, 4, 14, 24, 20, 22, 4, 8, 16)
    struct.pack_into("<iIqIhB", out, 24, 20, size + record - 28, body_length, 48 - 40, 3, 3)
    struct.pack_into("<II", out, 48, 1, 64 - 52)
    struct.pack_into("<4H", out, 56, 8, 12, 4, 8)
    struct.pack_into("<iII", out, 64, 8, 76 - 68, 112 - 72)
    key = b"ARROW:experimental_compression"
    u32.pack_into(out, 76, len(key))
    out[80:80 + len(key)] = key
    u32.pack_into(out, 112, 4)
    out[116:120] = b"zstd"
    new_meta = bytes(out) + bytes(meta)
    continuation = 0xFFFFFFFF
    return (schema.serialize().to_pybytes() + struct.pack("<Ii", continuation, len(new_meta))
            + new_meta + body + struct.pack("<Ii", continuation, 0))


def test_compression_flagged_by_pre_v5_metadata_is_refused() -> None:
    """Arrow still decompresses a V4 batch whose message's custom metadata names a
    codec; the node takes V5 metadata only."""
    keys = [b"k%05d" % i + b"x" * 200 for i in range(1000)]
    sink = pa.BufferOutputStream()
    batch = pa.record_batch([pa.array(keys, pa.binary())], names=["key"])
    with pa.ipc.new_stream(sink, batch.schema,
                           options=pa.ipc.IpcWriteOptions(compression="zstd")) as writer:
        writer.write_batch(batch)
    crafted = _v4_compressed(sink.getvalue().to_pybytes())
    # Arrow itself decodes the crafted stream into the original keys...
    assert pa.ipc.open_stream(crafted).read_all().column(0).to_pylist() == keys
    # ...and the node refuses it before decoding anything.
    for decode in (row_count, decode_delete_keys):
        with pytest.raises(ColumnarError, match="only V5"):
            decode(crafted)


def test_row_count_reads_every_batch_header() -> None:
    batch = pa.record_batch([pa.array([b"k"] * 7)], names=["key"])
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, batch.schema) as writer:
        for n in (7, 0, 3):
            writer.write_batch(batch.slice(0, n))
    assert row_count(sink.getvalue().to_pybytes()) == 10
    assert decode_delete_keys(sink.getvalue().to_pybytes()) == [b"k"] * 10


def log_rows(replaces: int, deletes: int) -> list[ChangeRow]:
    """Changelog rows of one (ts, table, virtual node): replaces, then deletes."""
    rows = [ChangeRow(7, i, 0, TABLE.name, REPLACE, encode_primary_key(["int64"], [i]),
                      tuple(values)) for i, values in enumerate(sample_rows(replaces))]
    rows += [ChangeRow(7, i, 0, TABLE.name, DELETE, encode_primary_key(["int64"], [i]), None)
             for i in range(replaces, replaces + deletes)]
    return rows


@pytest.mark.parametrize("items", [COLUMNAR_MIN_ROWS - 1, COLUMNAR_MIN_ROWS])
def test_the_columnar_threshold_counts_one_virtual_nodes_items(items: int) -> None:
    """Deletes and inserts of one virtual node count together against the threshold,
    in the client and in the connector (where a replace is two items) alike; a node
    that does not say it accepts the columnar form gets the row form at any size."""
    columnar = items >= COLUMNAR_MIN_ROWS
    topology = Topology(("a:1",), 1)  # every key in virtual node 0
    rows = [{c.name: None for c in TABLE.columns} | {"c0": i} for i in range(items)]
    [tud] = TableWriter(TABLE, topology).updates(
        5, deletes=rows[:items // 2], inserts=rows[items // 2:])["a:1"]
    assert bool(tud.delete_keys_arrow) == columnar and bool(tud.delete_data) != columnar
    log = log_rows(items // 2, items % 2)
    [request] = requests("s", {TABLE.name: TABLE}, log)
    [part] = request.table_update_data
    assert bool(part.delete_keys_arrow) == columnar and bool(part.delete_data) != columnar
    [old_node] = requests("s", {TABLE.name: TABLE}, log,
                          min_columnar_rows=min_columnar_rows(False))
    assert old_node.table_update_data[0].delete_data
    assert min_columnar_rows(True) == COLUMNAR_MIN_ROWS and min_columnar_rows(False) > 10**9


def order(i: int, version: int) -> dict:
    return {"id": i, "customer": f"c{i}-{version}", "amount": Decimal(i % 1000) / 100,
            "note": None if i % 3 else f"n{version}"}


def event(i: int, version: int) -> dict:
    return {"tenant": i % 4, "seq": i, "payload": bytes([version % 256]) * (i % 5),
            "ok": (i + version) % 2 == 0}


@pytest.mark.integration
def test_row_and_columnar_forms_write_the_same_rows_through_a_crash_and_replay(
        make_plane) -> None:
    """Transactions alternate between the two forms on the same tables; after each
    one, after a SIGKILL and replay, and after a second restart in a row, every table
    equals the model."""
    plane: DataPlane = make_plane(nodes=2)
    rows = {"orders": order, "events": event}
    writers = {form: {t: TableWriter(plane.tables[t], plane.topology, columnar=form,
                                     min_columnar_rows=1)
                      for t in rows} for form in (False, True)}
    rng = random.Random(7)
    live: dict[str, set[int]] = {t: set() for t in rows}
    next_id = 0
    for step in range(24):
        plane.writers.update(writers[step % 2 == 0])
        changes: dict[str, dict[str, list[dict]]] = {}
        for table, make in rows.items():
            fresh = list(range(next_id, next_id + rng.randint(5, 40)))
            next_id += len(fresh)
            old = sorted(live[table])
            replaced = rng.sample(old, min(len(old), rng.randint(0, 15)))
            deleted = rng.sample([k for k in old if k not in replaced],
                                 min(len(old) - len(replaced), rng.randint(0, 8)))
            changes[table] = {"inserts": [make(i, step) for i in fresh],
                              "replaces": [make(i, step) for i in replaced],
                              "deletes": [make(i, step) for i in deleted]}
            live[table] = (live[table] | set(fresh)) - set(deleted)
        plane.commit(changes)
        if step in (10, 17):  # one replay sent in each form (the current writers')
            node = plane.nodes[step % 2]
            plane.retinas[node].kill9()
            plane.retinas[node].start()
            plane.recover(node)
        for table in rows:
            assert plane.read(table) == plane.model.rows[table], (step, table)
    for node in plane.nodes:  # two restarts in a row, nothing written in between
        for _ in range(2):
            plane.retinas[node].kill9()
            plane.retinas[node].start()
            plane.recover(node)
    for table in rows:
        assert plane.read(table) == plane.model.rows[table]
        assert {r["id"] if table == "orders" else r["seq"]
                for r in plane.read(table).values()} == live[table]


def test_a_topology_routes_the_same_in_both_forms() -> None:
    topology = Topology(("a:1", "b:1"), 8)
    rows = [{c.name: None for c in TABLE.columns} | {"c0": i} for i in range(64)]
    by_row = TableWriter(TABLE, topology, columnar=False).updates(5, replaces=rows)
    by_col = TableWriter(TABLE, topology, min_columnar_rows=1).updates(5, replaces=rows)
    assert {n: [t.virtual_node_id for t in d] for n, d in by_row.items()} == \
        {n: [t.virtual_node_id for t in d] for n, d in by_col.items()}
    for node, datas in by_col.items():
        for col, row in zip(datas, by_row[node], strict=True):
            assert decode_delete_keys(col.delete_keys_arrow) == \
                [d.index_keys[0].key for d in row.delete_data]
            assert row_count(col.insert_rows_arrow) == len(row.insert_data)
    # The default sends parts below COLUMNAR_MIN_ROWS in the row form.
    small = TableWriter(TABLE, topology).updates(5, replaces=rows[:COLUMNAR_MIN_ROWS // 2 - 1])
    assert all(t.delete_data and not t.delete_keys_arrow for d in small.values() for t in d)


def changes(n: int) -> list[ChangeRow]:
    values = sample_rows(n)
    out = []
    for i, row in enumerate(values):
        key = encode_primary_key(["int64"], [i])
        out.append(ChangeRow(7, i, 0, TABLE.name, DELETE if i % 5 == 4 else REPLACE, key,
                             None if i % 5 == 4 else tuple(row)))
    return out


def test_connector_requests_carry_the_same_rows_in_both_forms() -> None:
    """The changelog's encoded rows, as the connector sends them: columnar from
    COLUMNAR_MIN_ROWS items, the row form below it and for a row the cached table
    record is too narrow for (the node then re-reads its catalog)."""
    rows = changes(60)
    [col] = requests("s", {TABLE.name: TABLE}, rows)
    [row] = requests("s", {TABLE.name: TABLE}, rows, min_columnar_rows=10**6)
    [c], [r] = col.table_update_data, row.table_update_data
    assert not c.delete_data and not r.delete_keys_arrow
    assert decode_delete_keys(c.delete_keys_arrow) == [d.index_keys[0].key for d in r.delete_data]
    decoded = decode_insert_rows(c.insert_rows_arrow, TABLE)
    for i, column in enumerate(TABLE.columns):
        assert decoded.column(i).combine_chunks().equals(
            decode_column(column.type, [item.col_values[i] for item in r.insert_data]))
    # The key the node computes from each row's key column is the changelog row's key.
    computed = encode_primary_keys(["int64"], [decoded.column("c0").combine_chunks()])
    assert computed.to_pylist() == [x.key for x in rows if x.op == REPLACE]
    assert changelog_rows(col) == changelog_rows(row) == 60
    [small] = requests("s", {TABLE.name: TABLE}, rows[:COLUMNAR_MIN_ROWS // 2 - 1])
    assert small.table_update_data[0].delete_data
    wide = [replace(x, values=(*x.values, b"")) if x.values else x for x in rows]
    [fallback] = requests("s", {TABLE.name: TABLE}, wide)
    assert len(fallback.table_update_data[0].insert_data) == 48
