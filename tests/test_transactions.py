"""TransactionTable and DurableCounter against a real etcd (no gRPC)."""

from __future__ import annotations

import pytest

from retina_common import failpoints
from retina_common.etcd import EtcdStore
from retina_common.keys import GC_HORIZON_KEY, TRANS_ID_KEY, TRANS_TIMESTAMP_KEY
from trans_gate.history import GcHorizon
from trans_gate.timestamps import CounterCorrupt, CounterFenced, DurableCounter
from trans_gate.transactions import (
    BadTransArgument,
    TransactionEnded,
    TransactionOffloaded,
    TransactionTable,
    TransKind,
    UnknownTransaction,
    WrongTransactionKind,
)

pytestmark = pytest.mark.integration


def counter(etcd: EtcdStore, key: str = TRANS_TIMESTAMP_KEY, block: int = 3) -> DurableCounter:
    c = DurableCounter(etcd, key, block, failpoints.TRANS_TS_BLOCK_PERSIST_BEFORE,
                       failpoints.TRANS_TS_BLOCK_PERSIST_AFTER)
    c.open()
    return c


def table(etcd: EtcdStore, clock: list[int], block: int = 3) -> TransactionTable:
    return TransactionTable(counter(etcd, TRANS_TIMESTAMP_KEY, block),
                            counter(etcd, TRANS_ID_KEY, block), lambda: clock[0],
                            write_lease_ms=100, read_lease_ms=1000, max_lease_ms=5000,
                            horizon=horizon(etcd), ended_cache_size=4)


def horizon(etcd: EtcdStore) -> GcHorizon:
    h = GcHorizon(etcd, GC_HORIZON_KEY, failpoints.TRANS_HORIZON_PERSIST_BEFORE,
                  failpoints.TRANS_HORIZON_PERSIST_AFTER)
    h.load()
    return h


def test_counter_never_reuses_a_value_across_reopen(etcd: EtcdStore) -> None:
    first = counter(etcd)
    issued = [first.take() for _ in range(7)]  # crosses two block boundaries
    second = counter(etcd)  # a restart: whatever the first one had reserved is skipped
    later = [second.take() for _ in range(5)]
    assert issued == sorted(set(issued))
    assert min(later) > max(issued)
    assert second.take(10) + 9 < second.take()


def test_a_second_writer_fences_the_first(etcd: EtcdStore) -> None:
    old = counter(etcd, block=2)
    old.take(2)
    new = counter(etcd, block=2)
    with pytest.raises(CounterFenced):
        old.take(5)  # needs a block; the bound moved under it
    assert new.take() >= 3
    with pytest.raises(CounterFenced):
        old.take()


def test_corrupt_bound_is_refused(etcd: EtcdStore) -> None:
    etcd.put(TRANS_TIMESTAMP_KEY, "twelve")
    with pytest.raises(CounterCorrupt):
        counter(etcd)


def test_hwm_advances_only_over_a_contiguous_prefix(etcd: EtcdStore) -> None:
    t = table(etcd, [0])
    start = t.high_watermark()
    w1, w2, w3 = t.begin(TransKind.WRITE, 3)
    assert t.high_watermark() == w1.timestamp - 1 == start
    t.commit([w3.trans_id])
    assert t.high_watermark() == w1.timestamp - 1
    t.rollback(w1.trans_id)
    assert t.high_watermark() == w2.timestamp - 1
    t.commit([w2.trans_id])
    assert t.high_watermark() == w3.timestamp


def test_read_snapshots_and_safe_gc_ts(etcd: EtcdStore) -> None:
    t = table(etcd, [0])
    (w,) = t.begin(TransKind.WRITE)
    t.commit([w.trans_id])
    (r1,) = t.begin(TransKind.READ)
    assert r1.timestamp == w.timestamp == t.high_watermark()
    (w2,) = t.begin(TransKind.WRITE)
    t.commit([w2.trans_id])
    (r2,) = t.begin(TransKind.READ)
    assert r2.timestamp == w2.timestamp
    assert t.safe_gc_ts() == r1.timestamp - 1
    t.mark_offloaded(r1.trans_id)
    assert t.safe_gc_ts() == r2.timestamp - 1
    t.commit([r2.trans_id])
    assert t.safe_gc_ts() == t.high_watermark() - 1
    (w3,) = t.begin(TransKind.WRITE)
    with pytest.raises(WrongTransactionKind):
        t.live_read(w3.trans_id)
    with pytest.raises(WrongTransactionKind):
        t.mark_offloaded(w3.trans_id)


def test_ending_twice_unknown_ids_and_batches(etcd: EtcdStore) -> None:
    t = table(etcd, [0])
    a, b = t.begin(TransKind.WRITE, 2)
    t.commit([a.trans_id])
    with pytest.raises(TransactionEnded, match="committed"):
        t.commit([a.trans_id])
    with pytest.raises(TransactionEnded, match="committed"):
        t.rollback(a.trans_id)
    with pytest.raises(UnknownTransaction):
        t.commit([b.trans_id + 100_000])
    with pytest.raises(UnknownTransaction):
        t.rollback(0)
    with pytest.raises(TransactionEnded):  # all-or-nothing: b stays live
        t.commit([b.trans_id, a.trans_id])
    with pytest.raises(BadTransArgument):
        t.commit([b.trans_id, b.trans_id])
    assert t.commit([b.trans_id]) == b.timestamp


def test_lease_expiry_rolls_back(etcd: EtcdStore) -> None:
    clock = [1_000]
    t = table(etcd, clock)
    (w,) = t.begin(TransKind.WRITE)
    (r,) = t.begin(TransKind.READ)
    clock[0] += 150  # past the write lease, within the read lease
    assert [x.trans_id for x in t.expire_leases()] == [w.trans_id]
    with pytest.raises(TransactionEnded, match="lease expired"):
        t.commit([w.trans_id])
    assert t.high_watermark() == w.timestamp
    assert t.live_read(r.trans_id).timestamp == r.timestamp
    assert t.extend_lease(r.trans_id, 50_000) == clock[0] + 5000  # capped at max_lease_ms


def test_transactions_of_a_previous_incarnation_are_ended(etcd: EtcdStore) -> None:
    before = table(etcd, [0])
    (old,) = before.begin(TransKind.WRITE)
    after = table(etcd, [0])
    with pytest.raises(TransactionEnded, match="restart"):
        after.commit([old.trans_id])
    assert after.high_watermark() >= old.timestamp


def test_listed_files_are_held_until_their_transaction_ends(etcd: EtcdStore) -> None:
    """LISTED_FILES_HELD: the sweepers' retention guard reads these holds."""
    clock = [1_000]
    t = table(etcd, clock)
    (w,) = t.begin(TransKind.WRITE)
    (r1, r2) = t.begin(TransKind.READ, count=2)
    assert t.read_holds().file_ids == frozenset() and t.read_holds().live_reads == 2
    with pytest.raises(WrongTransactionKind):
        t.listing_started(w.trans_id)
    t.listing_started(r1.trans_id)
    assert t.read_holds().listings_in_flight == 1  # between the catalog read and the record
    t.listing_done(r1.trans_id, [10, 11])
    t.listing_started(r2.trans_id)
    t.listing_done(r2.trans_id, [11, 12])
    holds = t.read_holds()
    assert (holds.file_ids, holds.listings_in_flight) == (frozenset({10, 11, 12}), 0)
    assert holds.oldest_snapshot_ts == r1.timestamp
    t.mark_offloaded(r1.trans_id)  # offloaded readers still hold their files
    assert t.read_holds().file_ids == frozenset({10, 11, 12})
    # ... but list nothing more: GC no longer waits for their snapshot, so a file
    # listed now could lack rows it still reads.
    with pytest.raises(TransactionOffloaded):
        t.listing_started(r1.trans_id)
    assert t.read_holds().listings_in_flight == 0
    t.commit([r2.trans_id])
    assert t.read_holds().file_ids == frozenset({10, 11})
    clock[0] += 2_000  # r1's lease runs out
    t.expire_leases()
    assert t.read_holds().file_ids == frozenset() and t.read_holds().live_reads == 0
    with pytest.raises(TransactionEnded):
        t.listing_started(r1.trans_id)
    assert t.read_holds().listings_in_flight == 0  # a refused listing never counts
