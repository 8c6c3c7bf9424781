"""The Retina data plane end to end: real TransServer, Retina nodes, etcd, PostgreSQL, storage."""

from __future__ import annotations

from collections.abc import Iterator
from decimal import Decimal
from pathlib import Path

import pytest

from retina_common.catalog import Catalog
from retina_common.etcd import EtcdStore

from .dataplane import DataPlane

pytestmark = pytest.mark.integration


@pytest.fixture
def plane(tmp_path: Path, etcd: EtcdStore, catalog: Catalog, catalog_dsn: str
          ) -> Iterator[DataPlane]:
    dp = DataPlane(tmp_path, etcd, catalog, catalog_dsn).start()
    yield dp
    dp.stop()


def order(i: int, note: str = "") -> dict:
    return {"id": i, "customer": f"c{i % 7}", "amount": Decimal(i) / 4, "note": note or None}


def test_insert_delete_replace_read_back(plane: DataPlane) -> None:
    plane.commit({"orders": {"inserts": [order(i) for i in range(10)]}})
    plane.commit({"orders": {"deletes": [{"id": 3}], "replaces": [order(4, "changed")]}})
    got = plane.read("orders")
    assert got == plane.model.rows["orders"]
    assert len(got) == 9


def event(tenant: int, seq: int, rng) -> dict:
    return {"tenant": tenant, "seq": seq, "payload": rng.randbytes(rng.randint(0, 12)),
            "ok": rng.random() < 0.5}


def write_buffer_rows(plane: DataPlane, table: str) -> int:
    from retina_common.pb import retina_pb2 as rpb

    assert plane.reader is not None
    with plane.reader.transaction() as trans:
        return sum(p.stub.GetWriteBuffer(rpb.GetWriteBufferRequest(
            schema_name="shop", table_name=table, timestamp=trans.timestamp,
            trans_id=trans.trans_id),
            timeout=10).row_count for p in plane.retinas.values())


def test_randomized_workload_matches_the_model(plane: DataPlane, catalog: Catalog) -> None:
    import os
    import random

    seed = int(os.environ.get("RETINA_TEST_SEED", random.randrange(1 << 30)))
    rng = random.Random(seed)
    next_order, next_event = 0, 0
    checked_history = 0
    deleted_ids: list[int] = []
    for step in range(150):
        changes: dict = {}
        if rng.random() < 0.8:
            live = list(plane.model.rows["orders"].values())
            ops: dict = {"inserts": [], "deletes": [], "replaces": []}
            for _ in range(rng.randint(1, 25)):
                ops["inserts"].append(order(next_order))
                next_order += 1
            if deleted_ids and rng.random() < 0.4:  # a plain INSERT of a deleted key is legal
                ops["inserts"].append(order(deleted_ids.pop(rng.randrange(len(deleted_ids)))))
            picked = rng.sample(live, min(len(live), rng.randint(0, 8)))
            for row in picked[: len(picked) // 2]:
                ops["deletes"].append({"id": row["id"]})
                deleted_ids.append(row["id"])
            for row in picked[len(picked) // 2:]:
                ops["replaces"].append(order(row["id"], f"v{step}"))
            if rng.random() < 0.3:  # a key that never existed: a no-op delete
                ops["deletes"].append({"id": 10**9 + step})
            changes["orders"] = ops
        if rng.random() < 0.6:
            live = list(plane.model.rows["events"].values())
            ops = {"inserts": [], "deletes": [], "replaces": []}
            for _ in range(rng.randint(1, 10)):
                ops["inserts"].append(event(next_event % 5, next_event, rng))
                next_event += 1
            for row in rng.sample(live, min(len(live), rng.randint(0, 4))):
                if rng.random() < 0.5:
                    ops["deletes"].append({"tenant": row["tenant"], "seq": row["seq"]})
                else:
                    ops["replaces"].append(event(row["tenant"], row["seq"], rng))
            changes["events"] = ops
        if not changes:
            continue
        expected_deleted = sum(
            len({plane.writers[t].key(r) for r in [*ops["deletes"], *ops["replaces"]]}
                & plane.model.rows[t].keys()) for t, ops in changes.items())
        expected_inserted = sum(len(ops["inserts"]) + len(ops["replaces"])
                                for ops in changes.values())
        _ts, responses = plane.commit(changes)
        assert sum(r.deleted_rows for r in responses.values()) == expected_deleted, seed
        assert sum(r.inserted_rows for r in responses.values()) == expected_inserted, seed
        if step % 25 == 24:
            for table in ("orders", "events"):
                assert plane.read(table) == plane.model.rows[table], f"seed {seed} step {step}"
            # An older snapshot still reads exactly what was committed then.
            ts, then = plane.model.history[rng.randrange(checked_history, len(
                plane.model.history))]
            checked_history = len(plane.model.history) - 1
            for table in ("orders", "events"):
                assert plane.read_at(table, ts) == then[table], f"seed {seed} at ts {ts}"
    # Let every buffered row be published, then read only from files.
    from .support import eventually

    eventually(lambda: write_buffer_rows(plane, "orders") == 0 and
               write_buffer_rows(plane, "events") == 0, 30, "every file to be published")
    assert len(catalog.get_files_by_type(None, [1])) >= 4
    for table in ("orders", "events"):
        assert plane.read(table) == plane.model.rows[table], f"seed {seed} after publish"
    ts, then = plane.model.history[len(plane.model.history) // 2]
    assert plane.read_at("orders", ts) == then["orders"], f"seed {seed} history after publish"
