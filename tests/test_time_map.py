"""The time map (trans_gate/time_map.py): its encoding, resolution, gaps and pruning.

Against a real etcd (the map's only store); the clock is the test's.
"""

from __future__ import annotations

import random

import pytest

from retina_common.etcd import EtcdStore
from retina_common.keys import TIME_MAP_PREFIX
from trans_gate.time_map import (
    Chunk,
    TimeBeforeMap,
    TimeInFuture,
    TimeMap,
    TimeUnmapped,
    decode_chunk,
    encode_chunk,
)


class Clock:
    def __init__(self, now: int = 1_700_000_000_000) -> None:
        self.now = now

    def __call__(self) -> int:
        return self.now


def chunk_of(rng: random.Random, n: int) -> Chunk:
    walls, hwms = [rng.randrange(10**12, 2 * 10**12)], [rng.randrange(0, 10**9)]
    for _ in range(n - 1):
        walls.append(walls[-1] + rng.randrange(0, 5000))
        hwms.append(hwms[-1] + rng.randrange(0, 100_000))
    return Chunk(walls[0] - rng.randrange(0, 10**6), rng.randrange(0, 1000), walls, hwms,
                 walls[-1] + rng.randrange(0, 2000), rng.random() < 0.5)


def test_chunks_round_trip_compactly() -> None:
    rng = random.Random(7)
    for n in (1, 2, 64, 500):
        chunk = chunk_of(rng, n)
        back = decode_chunk(encode_chunk(chunk))
        assert (back.segment_ms, back.seq, back.walls, back.hwms, back.covered_to_ms,
                back.closed) == (chunk.segment_ms, chunk.seq, chunk.walls, chunk.hwms,
                                 chunk.covered_to_ms, chunk.closed)
    # A sample every 100 ms of a cluster committing 100 transactions a second: 2 bytes.
    walls = list(range(0, 6400, 100))
    dense = Chunk(0, 0, [10**12 + w for w in walls], [10**6 + w // 10 for w in walls],
                  10**12 + 6400)
    assert len(encode_chunk(dense)) / len(walls) < 2.5


@pytest.mark.parametrize("damage", [
    lambda b: b[:-1],  # truncated
    lambda b: b + b"\x00",  # trailing bytes
    lambda b: b"\x09" + b[1:],  # another version
    lambda b: b[:1] + b"\x07" + b[2:],  # unknown flags
    lambda b: b"",
])
def test_a_damaged_chunk_is_refused(damage) -> None:
    data = encode_chunk(chunk_of(random.Random(1), 10))
    with pytest.raises(ValueError):
        decode_chunk(damage(data))


@pytest.mark.integration
def test_a_time_resolves_to_the_hwm_of_the_latest_sample_at_or_before_it(
        etcd: EtcdStore) -> None:
    clock = Clock()
    t0 = clock.now
    m = TimeMap(etcd, clock)
    m.load()
    m.start(10)
    for step, hwm in enumerate((10, 12, 12, 15, 20), start=1):
        clock.now = t0 + 100 * step
        m.sample(hwm)
    assert m.resolve(t0) == 10
    assert m.resolve(t0 + 199) == 10
    assert m.resolve(t0 + 200) == 12
    assert m.resolve(t0 + 399) == 12  # 12 twice: one sample
    assert m.resolve(t0 + 400) == 15
    assert m.resolve(t0 + 500) == 20
    clock.now += 10_000  # quiet since: the live map covers up to now
    assert m.resolve(clock.now) == 20
    with pytest.raises(TimeInFuture):
        m.resolve(clock.now + 1)
    with pytest.raises(TimeBeforeMap):
        m.resolve(t0 - 1)
    assert m.earliest_time_at_or_above(13) == t0 + 400
    assert m.earliest_time_at_or_above(21) == 0
    assert m.hwm_at_or_before(t0 - 1) is None
    assert m.hwm_at_or_before(t0 + 250) == 12


def run(etcd: EtcdStore, clock: Clock, hwms: list[int], *, chunk_samples: int = 64,
        flush_every: int = 1) -> TimeMap:
    """A map of one incarnation: a sample every 100 ms, flushed every ``flush_every``."""
    m = TimeMap(etcd, clock, chunk_samples=chunk_samples)
    m.load()
    m.start(hwms[0])
    for i, hwm in enumerate(hwms[1:], start=1):
        clock.now += 100
        m.sample(hwm)
        if i % flush_every == 0:
            assert m.flush()
    return m


@pytest.mark.integration
def test_a_crash_leaves_a_gap_that_is_refused_and_a_clean_stop_does_not(
        etcd: EtcdStore) -> None:
    clock = Clock()
    t0 = clock.now
    first = run(etcd, clock, list(range(100, 110)), flush_every=3)
    last_flush = t0 + 900  # flushes at samples 3, 6, 9
    clock.now += 100
    first.sample(200)  # sampled, never flushed: the crash loses it
    crash = clock.now
    clock.now += 5_000  # down for 5 s
    second = run(etcd, clock, [300, 301])
    restart = crash + 5_000
    assert second.resolve(last_flush) == 109
    with pytest.raises(TimeUnmapped) as gap:
        second.resolve(crash)  # 200 committed before the crash: the map cannot know
    assert gap.value.gap == (last_flush, restart)
    assert second.gaps() == [(last_flush, restart)]
    assert second.resolve(restart) == 300
    # A clean stop closes its segment: the time until the restart resolves to its HWM.
    second.close(305)
    stopped = clock.now
    clock.now += 60_000
    third = run(etcd, clock, [400])
    assert third.resolve(stopped + 30_000) == 305
    assert third.gaps() == [(last_flush, restart)]


@pytest.mark.integration
def test_rotated_chunks_reload_exactly_and_a_lost_chunk_is_a_gap(etcd: EtcdStore) -> None:
    clock = Clock()
    t0 = clock.now
    hwms = list(range(1000, 1050))
    m = run(etcd, clock, hwms, chunk_samples=8)
    kvs, _ = etcd.get_prefix(TIME_MAP_PREFIX)
    assert len(kvs) == 7  # 50 samples, 8 a chunk
    clock.now += 1000  # a clean restart, a second later
    m.close(hwms[-1])
    again = TimeMap(etcd, clock)
    again.load()
    again.start(hwms[-1])
    for i, hwm in enumerate(hwms):
        assert again.resolve(t0 + 100 * i + 50) == m.resolve(t0 + 100 * i + 50) == hwm
    assert again.gaps() == []
    etcd.delete(kvs[2].key)  # the third chunk: samples 16..23
    lossy = TimeMap(etcd, clock)
    lossy.load()
    with pytest.raises(TimeUnmapped):
        lossy.resolve(t0 + 100 * 20)
    assert lossy.resolve(t0 + 100 * 12) == 1012
    assert lossy.resolve(t0 + 100 * 30) == 1030


@pytest.mark.integration
def test_pruning_forgets_chunks_at_or_below_the_horizon(etcd: EtcdStore) -> None:
    clock = Clock()
    t0 = clock.now
    m = run(etcd, clock, list(range(1000, 1050)), chunk_samples=8)
    assert m.prune(1014) == 1  # chunks of 8: the first ends at 1007, the second at 1015
    assert m.prune(1015) == 1
    assert m.prune(1016) == 0
    assert m.flush()
    kvs, _ = etcd.get_prefix(TIME_MAP_PREFIX)
    assert len(kvs) == 5
    with pytest.raises(TimeBeforeMap):
        m.resolve(t0 + 100 * 15)
    assert m.resolve(t0 + 100 * 16) == 1016
    assert m.first_ms() == t0 + 1600
    assert m.prune(10**9) == 4  # never the open chunk
    assert m.resolve(clock.now) == 1049
