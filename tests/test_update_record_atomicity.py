"""A request answered with an error leaves nothing behind: no pending append, no index
entry, no visible row; and so a transient catalog outage never fails the node closed."""

from __future__ import annotations

import subprocess
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from decimal import Decimal
from pathlib import Path

import grpc
import pytest

from devtools.cluster import (
    PostgresInstance,
    _as_postgres,
    _pg_bin,
    start_postgres,
    stop_postgres,
)
from retina_common.catalog import Catalog, FileType
from retina_common.etcd import EtcdStore
from retina_common.pb import retina_pb2 as rpb
from retina_common.pb import trans_pb2 as tpb

from .dataplane import SCHEMA, DataPlane
from .support import eventually, rpc_error

pytestmark = pytest.mark.integration

BLOCK_ROWS = 16
VNODE = 3
# Long enough that the timer never seals the half-full file while the test
# stops PostgreSQL; the end of the test waits past it.
FLUSH_INTERVAL_MS = 5000


@dataclass
class PrivatePostgres:
    """A catalog server of this test alone: stopping it disturbs no other test."""

    instance: PostgresInstance
    log_path: Path

    def stop(self) -> None:
        stop_postgres(self.instance.data_dir)

    def start(self) -> None:
        # start_postgres would pick a new port, but the running processes' DSN
        # names this one; ``pg_ctl restart`` reuses the last start's options.
        if self.up():
            return
        subprocess.run(_as_postgres([_pg_bin("pg_ctl"), "-D", self.instance.data_dir,
                                     "-l", str(self.log_path), "-w", "restart"]),
                       capture_output=True, check=True)
        eventually(self.up, 60, "the catalog PostgreSQL to accept connections")

    def up(self) -> bool:
        try:
            return self.instance.accepting()
        except Exception:
            return False


@pytest.fixture
def private_pg(base_dir: Path) -> Iterator[PrivatePostgres]:
    name = f"pg-outage-{uuid.uuid4().hex[:8]}"
    pg = PrivatePostgres(start_postgres(base_dir / name, base_dir / f"{name}.log",
                                        durable=False), base_dir / f"{name}.log")
    yield pg
    stop_postgres(pg.instance.data_dir)


@pytest.fixture
def plane(tmp_path: Path, etcd: EtcdStore, private_pg: PrivatePostgres) -> Iterator[DataPlane]:
    private_pg.instance.create_database("retina")
    dsn = private_pg.instance.dsn("retina")
    catalog = Catalog(dsn, connect_timeout_s=2)
    catalog.bootstrap()
    dp = DataPlane(tmp_path, etcd, catalog, dsn, nodes=1,
                   retina={"block_rows": BLOCK_ROWS, "blocks_per_file": 2,
                           "flush_interval_ms": FLUSH_INTERVAL_MS})
    try:
        yield dp.start()
    finally:
        private_pg.start()  # the shutdown flush publishes through the catalog
        dp.stop()
        catalog.close()


def order(i: int) -> dict:
    return {"id": i, "customer": f"c{i}", "amount": Decimal(i) / 4, "note": None}


def ids_in_vnode(plane: DataPlane, vnode: int, count: int) -> list[int]:
    key = plane.writers["orders"].key
    return [i for i in range(count * 64)
            if plane.topology.vnode_of_key(key({"id": i})) == vnode][:count]


def insert_request(plane: DataPlane, ts: int, rows: list[dict]) -> rpb.UpdateRecordRequest:
    (datas,) = plane.writers["orders"].updates(ts, inserts=rows).values()
    request = rpb.UpdateRecordRequest(schema_name=SCHEMA)
    request.table_update_data.extend(datas)
    return request


def applied(plane: DataPlane, request: rpb.UpdateRecordRequest) -> rpb.UpdateRecordResponse | None:
    """The reply, or None while the node answers UNAVAILABLE (the caller retries)."""
    try:
        return plane.retinas[plane.nodes[0]].stub.UpdateRecord(request, timeout=10)
    except grpc.RpcError as exc:
        if exc.code() == grpc.StatusCode.UNAVAILABLE:
            return None
        raise


def test_catalog_outage_while_a_batch_spans_into_a_new_file(
        plane: DataPlane, private_pg: PrivatePostgres) -> None:
    node = plane.nodes[0]
    ids = ids_in_vnode(plane, VNODE, 2 * BLOCK_ROWS + 8)
    # The file's first block full, its last block a quarter full.
    plane.commit({"orders": {"inserts": [order(i) for i in ids[:BLOCK_ROWS + 4]]}})
    stub = plane.trans.stub()
    trans = stub.BeginTrans(tpb.BeginTransRequest(), timeout=10)
    rows = [order(i) for i in ids[BLOCK_ROWS + 4:]]  # fills the last block, then a new file
    request = insert_request(plane, trans.timestamp, rows)

    private_pg.stop()
    err = rpc_error(lambda: plane.retinas[node].stub.UpdateRecord(request, timeout=10))
    assert err.code() == grpc.StatusCode.UNAVAILABLE, err.details()

    private_pg.start()
    reply = eventually(lambda: applied(plane, request), 30, "the retried request to apply")
    assert reply.inserted_rows == len(rows)
    stub.CommitTrans(tpb.CommitTransRequest(trans_id=trans.trans_id), timeout=10)
    key = plane.writers["orders"].key
    plane.model.rows["orders"].update({key(r): r for r in rows})
    plane.changelog.append((trans.timestamp, {"orders": {"inserts": rows}}))

    def all_published() -> bool:
        status = plane.status(node)
        if status.state != rpb.READY:  # shown by eventually as the last outcome
            raise AssertionError(f"node is {rpb.LifecycleState.Name(status.state)}: "
                                 f"{status.failure_reason}")
        found = plane.catalog.get_files_by_type(None, list(FileType))
        return len(found) >= 2 and all(f.type == FileType.REGULAR for f in found)

    eventually(all_published, 4 * FLUSH_INTERVAL_MS / 1000, "both files published REGULAR")
    assert plane.status(node).state == rpb.READY
    assert plane.read("orders") == plane.model.rows["orders"]
    # And the node still takes writes.
    plane.commit({"orders": {"inserts": [order(10**6)]}})
    assert plane.read("orders") == plane.model.rows["orders"]
    # The file holding the compensated rows is whole (its MainIndex covers
    # them too): a checkpoint keeps it, so after a crash its vnode replays
    # nothing from before the checkpoint, and the table is the same.
    plane.checkpoint(node)
    plane.retinas[node].kill9()
    plane.retinas[node].start()
    starts = plane.recover(node)
    assert starts is not None
    assert starts.vnode_replay_from_ts[VNODE] == starts.checkpoint_applied_ts
    assert plane.status(node).state == rpb.READY
    assert plane.read("orders") == plane.model.rows["orders"]
