"""A TRUNCATE applied by Retina nodes (TableUpdateData.truncate, one per virtual node):
every row of the table before its timestamp goes, and applying it again (a retry, a
replay) deletes nothing written after it, however much, and everything a replay put
back before it."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterator
from decimal import Decimal

import grpc
import pytest

from retina_common.client import requests_by_node
from retina_common.pb import retina_pb2 as rpb
from retina_common.pb import trans_pb2 as tpb

from .dataplane import SCHEMA, DataPlane, module_plane
from .support import rpc_error

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def plane(tmp_path_factory: pytest.TempPathFactory, etcd_server, pg_server) -> Iterator[DataPlane]:
    with module_plane(tmp_path_factory.mktemp("truncate"), etcd_server.endpoint, pg_server,
                      {"orders": {"inserts": [order(i) for i in range(40)]}}) as dp:
        yield dp


def order(i: int) -> dict:
    return {"id": i, "customer": f"c{i}", "amount": Decimal("2.50"), "note": None}


def truncate(plane: DataPlane, ts: int, inserts: tuple[dict, ...] = ()
             ) -> dict[str, rpb.UpdateRecordRequest]:
    """A source TRUNCATE of orders at ``ts``, then ``inserts`` in the same transaction:
    the flag on one TableUpdateData per virtual node, as the connector sends it."""
    table = plane.tables["orders"]
    rows = plane.writers["orders"].updates(ts, inserts=list(inserts))
    by_vnode = {d.virtual_node_id: d for datas in rows.values() for d in datas}
    per_node: dict[str, list[rpb.TableUpdateData]] = defaultdict(list)
    for vnode in range(plane.topology.virtual_nodes):
        data = by_vnode.get(vnode) or rpb.TableUpdateData(
            table_name=table.name, primary_index_id=table.primary_index_id, timestamp=ts,
            virtual_node_id=vnode)
        data.truncate = True
        per_node[plane.topology.node_of_vnode(vnode)].append(data)
    return requests_by_node(SCHEMA, [dict(per_node)])


def send(plane: DataPlane, requests: dict[str, rpb.UpdateRecordRequest]) -> int:
    """Apply the requests; returns the rows they deleted."""
    return sum(plane.retinas[node].stub.UpdateRecord(request, timeout=30).deleted_rows
               for node, request in requests.items())


def ids(plane: DataPlane) -> list[int]:
    return sorted(r["id"] for r in plane.read("orders").values())


def test_truncate_applied_again_keeps_everything_written_after_it(plane: DataPlane) -> None:
    """Applied again while its transaction is open (a retry whose answer was lost, after
    later transactions wrote: the same index sequence as a replay over them), a TRUNCATE
    deletes nothing written after it. Once a read has passed its timestamp, applying it
    again is refused (the write fence) and changes nothing."""
    stub = plane.trans.stub()
    t1 = stub.BeginTrans(tpb.BeginTransRequest(), timeout=10)
    requests = truncate(plane, t1.timestamp)
    assert send(plane, requests) == 40
    assert send(plane, requests) == 0  # a retry of the same request
    # Later transactions write keys the TRUNCATE deleted, and new ones.
    plane.commit({"orders": {"inserts": [order(5), order(100)]}})
    plane.commit({"orders": {"replaces": [order(5)], "inserts": [order(101)]}})
    # The TRUNCATE at t1 applied once more, over them.
    assert send(plane, requests) == 0
    stub.CommitTrans(tpb.CommitTransRequest(trans_id=t1.trans_id), timeout=10)
    assert ids(plane) == [5, 100, 101]
    late = rpc_error(lambda: send(plane, requests))
    assert late.code() == grpc.StatusCode.ABORTED and "write fence" in late.details()
    assert ids(plane) == [5, 100, 101]


def test_truncate_then_inserts_applied_twice_leave_one_copy(plane: DataPlane) -> None:
    before = ids(plane)
    stub = plane.trans.stub()
    t = stub.BeginTrans(tpb.BeginTransRequest(), timeout=10)
    requests = truncate(plane, t.timestamp, (order(7), order(8)))
    assert send(plane, requests) == len(before)
    # Again: the copies of 7 and 8 at its own timestamp are replaced, nothing else.
    assert send(plane, requests) == 2
    stub.CommitTrans(tpb.CommitTransRequest(trans_id=t.trans_id), timeout=10)
    assert ids(plane) == [7, 8]


def test_insert_then_truncate_replayed_without_a_rewind_leave_nothing(plane: DataPlane) -> None:
    """A replay of a range already replayed into the same recovery attempt (the
    connector killed before MarkReady replays again; no rewind in between) applies an
    INSERT at t1, then the TRUNCATE at t2 > t1, a second time. The INSERT puts a row
    under the TRUNCATE's own tombstone; the TRUNCATE must delete it again (the fault
    campaign's phantom row: seed 1132, episode 49). Since
    SUPERSEDED_COPIES_END_AT_THE_NEXT_VERSION the replayed INSERT's row already ends at
    the TRUNCATE's tombstone, so the replayed TRUNCATE finds nothing left to delete."""
    stub = plane.trans.stub()
    t1 = stub.BeginTrans(tpb.BeginTransRequest(), timeout=10)
    inserted = requests_by_node(SCHEMA, [plane.writers["orders"].updates(
        t1.timestamp, replaces=[order(161)])])
    send(plane, inserted)
    t2 = stub.BeginTrans(tpb.BeginTransRequest(), timeout=10)
    truncated = truncate(plane, t2.timestamp)
    assert send(plane, truncated) >= 1
    # Both again, in order, at their own timestamps (the transactions still open: no read
    # has passed them, as none does during a replay).
    send(plane, inserted)
    assert send(plane, truncated) == 0  # the replayed copy of 161 ended at t2 already
    send(plane, truncated)  # and once more: nothing new to delete
    stub.CommitTransBatch(tpb.CommitTransBatchRequest(trans_ids=[t1.trans_id, t2.trans_id]),
                          timeout=10)
    assert ids(plane) == []
