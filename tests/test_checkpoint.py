"""Checkpoint bodies and the two-slot store, against real etcd and storage."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from pyroaring import BitMap

from retina_common import failpoints
from retina_common.checkpoint_store import (
    CheckpointBody,
    CheckpointConflict,
    CheckpointHeader,
    CheckpointStore,
    CheckpointUnusable,
    CorruptCheckpoint,
    FileEntry,
    ForeignCheckpoint,
    RGEntry,
    decode,
    encode,
)
from retina_common.etcd import EtcdStore
from retina_common.failpoints import FailpointTriggered
from retina_common.keys import checkpoint_slot_key
from retina_common.replay_ts import IngestSegment, SegmentKind

NODE, TOPO = "127.0.0.1:18890", "ab" * 32


def body(checkpoint_id: int, applied_ts: int = 100, node: str = NODE) -> CheckpointBody:
    return CheckpointBody(
        CheckpointHeader(node, checkpoint_id, 7, 1_700_000_000_000, applied_ts, TOPO),
        files=[FileEntry(11, 1, 0, 0, 5, 90, 8192, 0, 8191, 2)],
        segments=[IngestSegment(1, 0, SegmentKind.ADMITTED, 11, 0, 2, 8192, 5, 90),
                  IngestSegment(1, 0, SegmentKind.OPEN, 12, 2, 1, 10, 95, 99)],
        row_groups=[RGEntry(11, 0, 4096, applied_ts, BitMap([1, 7, 4000])),
                    RGEntry(11, 1, 4096, applied_ts, BitMap())])


def decode_ok(data: bytes) -> CheckpointBody:
    return decode(data, expect_node=NODE, expect_topology_hash=TOPO)


def test_round_trip() -> None:
    original = body(3)
    back = decode_ok(encode(original))
    assert back.header == original.header and back.files == original.files
    assert back.segments == original.segments
    assert all(a.same(b) for a, b in zip(back.row_groups, original.row_groups, strict=True))


@pytest.mark.parametrize("damage", [
    lambda d: d[:-1],  # truncated
    lambda d: d[: len(d) // 2],
    lambda d: d[:40] + bytes([d[40] ^ 0x01]) + d[41:],  # one bit flipped in the header
    lambda d: d[:-20] + bytes([d[-20] ^ 0x80]) + d[-19:],  # one bit flipped in a bitmap
    lambda d: b"XXXXXXXX" + d[8:],
    lambda d: d + b"\0",
])
def test_damage_is_detected_never_read_as_absent(damage: Callable[[bytes], bytes]) -> None:
    with pytest.raises(CorruptCheckpoint):
        decode_ok(damage(encode(body(3))))


def test_foreign_bodies_are_refused() -> None:
    with pytest.raises(ForeignCheckpoint):
        decode_ok(encode(body(3, node="127.0.0.1:1")))
    with pytest.raises(ForeignCheckpoint):
        decode(encode(body(3)), expect_node=NODE, expect_topology_hash="cd" * 32)


def test_body_size_is_about_a_bit_per_row_at_worst() -> None:
    rows = 10 * 65536
    dense = BitMap(range(0, rows, 2))
    big = CheckpointBody(body(1).header, [], [],
                         [RGEntry(1, i, 65536, 5, BitMap(x - i * 65536 for x in dense
                                                         if i * 65536 <= x < (i + 1) * 65536))
                          for i in range(10)])
    assert len(encode(big)) <= rows / 8 * 1.05 + 10 * 64


@pytest.fixture
def store(tmp_path: Path, etcd: EtcdStore) -> CheckpointStore:
    return CheckpointStore(etcd, NODE, "file://" + str(tmp_path / "storage"), TOPO)


def bodies_on_disk(tmp_path: Path) -> list[str]:
    directory = tmp_path / "storage" / "_checkpoints" / NODE.replace(":", "-")
    return sorted(p.name for p in directory.iterdir()) if directory.exists() else []


@pytest.mark.integration
def test_install_swaps_current_and_previous(store: CheckpointStore, tmp_path: Path) -> None:
    assert store.load() is None  # no pointer at all: a fresh node
    store.install(body(1))
    store.install(body(2))
    loaded = store.load()
    assert loaded is not None and loaded.slot == "current"
    assert loaded.body.header.checkpoint_id == 2
    store.install(body(3))
    # Body 1 is referenced by no slot any more: cleaned up. 2 and 3 stay.
    assert bodies_on_disk(tmp_path) == [f"ckpt-{i:020d}.bin" for i in (2, 3)]


@pytest.mark.integration
def test_a_damaged_current_falls_back_to_previous(store: CheckpointStore, tmp_path: Path) -> None:
    store.install(body(1))
    store.install(body(2))
    newest = tmp_path / "storage" / "_checkpoints" / NODE.replace(":", "-") / \
        f"ckpt-{2:020d}.bin"
    data = bytearray(newest.read_bytes())
    data[100] ^= 0x04
    newest.write_bytes(bytes(data))
    loaded = store.load()
    assert loaded is not None and loaded.slot == "previous"
    assert loaded.body.header.checkpoint_id == 1 and "current" in loaded.rejected[0]
    (newest.parent / f"ckpt-{1:020d}.bin").write_bytes(b"truncated")
    with pytest.raises(CheckpointUnusable):
        store.load()  # both bad: FAILED territory, never "no checkpoint"


@pytest.mark.integration
def test_a_malformed_pointer_is_unusable_not_absent(store: CheckpointStore,
                                                    etcd: EtcdStore) -> None:
    etcd.put(checkpoint_slot_key(NODE, "current"), b"{not json")
    with pytest.raises(CheckpointUnusable):
        store.load()


@pytest.mark.parametrize("point, survivor", [
    ("checkpoint.body_write.before", 1), ("checkpoint.body_write.after", 1),
    ("checkpoint.pointer_swap.before", 1), ("checkpoint.pointer_swap.after", 2),
    ("checkpoint.cleanup.before", 2),
])
@pytest.mark.integration
def test_a_crash_at_each_step_leaves_a_usable_checkpoint(
        store: CheckpointStore, tmp_path: Path, active_failpoints, point: str,
        survivor: int) -> None:
    store.install(body(1))
    active_failpoints(f"{point}=raise")
    with pytest.raises(FailpointTriggered):
        store.install(body(2))
    active_failpoints("")
    loaded = store.load()
    assert loaded is not None and loaded.body.header.checkpoint_id == survivor
    store.install(body(3))  # whatever the crash left unreferenced is cleaned up now
    assert bodies_on_disk(tmp_path) == [f"ckpt-{i:020d}.bin" for i in (survivor, 3)]


@pytest.mark.integration
def test_a_concurrent_writer_is_refused(store: CheckpointStore, tmp_path: Path,
                                        etcd: EtcdStore, active_failpoints,
                                        failpoint_dir: Path) -> None:
    import threading

    store.install(body(1))
    other = CheckpointStore(etcd, NODE, "file://" + str(tmp_path / "storage"), TOPO)
    # A reads `current`, writes its body, then waits before its swap (the first hit only).
    active_failpoints("checkpoint.pointer_swap.before=block*1")
    outcome: list[BaseException | None] = []

    def install_a() -> None:
        try:
            store.install(body(2))
            outcome.append(None)
        except BaseException as exc:
            outcome.append(exc)

    a = threading.Thread(target=install_a)
    a.start()
    failpoints.wait_hit(failpoint_dir, "checkpoint.pointer_swap.before")
    assert f"ckpt-{2:020d}.bin" in bodies_on_disk(tmp_path)  # A's body is written
    other.install(body(3))  # B swaps first
    failpoints.release(failpoint_dir, "checkpoint.pointer_swap.before")
    a.join(timeout=30)
    assert len(outcome) == 1 and isinstance(outcome[0], CheckpointConflict)
    loaded = store.load()
    assert loaded is not None and loaded.body.header.checkpoint_id == 3
    assert etcd.get(checkpoint_slot_key(NODE, "previous")) is not None


def test_deletion_chains_and_history_gaps_round_trip_compactly() -> None:
    import random

    rng = random.Random(5)
    chain = sorted({(rng.randrange(101, 10_000), rng.randrange(4096)) for _ in range(3000)})
    original = body(4)
    original.header = CheckpointHeader(NODE, 4, 7, 1_700_000_000_000, 10_000, TOPO,
                                       ((50, 80), (90, 95)))
    original.row_groups[0] = RGEntry(11, 0, 4096, 100, BitMap([1, 7]), chain)
    data = encode(original)
    back = decode_ok(data)
    assert back.header.history_gaps == ((50, 80), (90, 95))
    assert back.row_groups[0].chain == chain
    assert all(a.same(b) for a, b in zip(back.row_groups, original.row_groups, strict=True))
    without = encode(body(4))
    # Timestamps close together, rows anywhere in the row group: about 3 bytes an item.
    assert (len(data) - len(without)) / len(chain) < 3.5


def test_a_version_1_body_is_still_read() -> None:
    """Schema version 1 (before the chains): no chain, no gaps, the base as written."""
    import json
    import struct

    import crc32c

    original = body(3)
    h = original.header
    header = json.dumps({"retinaNodeId": h.retina_node_id, "checkpointId": h.checkpoint_id,
                         "writerEpoch": h.writer_epoch, "writeTime": h.write_time_ms,
                         "checkpointAppliedTs": h.checkpoint_applied_ts,
                         "topologyHash": h.topology_hash}).encode()
    parts = [b"RTNACKP1", struct.pack(">HI", 1, len(header)), header, struct.pack(">I", 1),
             struct.pack(">qqiqqqqqqi", 11, 1, 0, 0, 5, 90, 8192, 0, 8191, 2),
             struct.pack(">I", 0), struct.pack(">I", 1)]
    bits = BitMap([1, 7]).serialize()
    parts += [struct.pack(">qiqqI", 11, 0, 4096, 100, len(bits)), bits]
    data = b"".join(parts)
    data += struct.pack(">Q", len(data) + 12)
    data += struct.pack(">I", crc32c.crc32c(data))
    back = decode_ok(data)
    assert back.header.history_gaps == () and back.header.checkpoint_applied_ts == 100
    assert back.row_groups[0].chain == [] and back.row_groups[0].deleted == BitMap([1, 7])


def test_a_chain_item_at_or_below_its_base_is_corrupt() -> None:
    original = body(3)
    original.row_groups[0] = RGEntry(11, 0, 4096, 100, BitMap(), [(150, 3)])
    data = bytearray(encode(original))
    good = decode_ok(bytes(data))
    assert good.row_groups[0].chain == [(150, 3)]
    bad = body(3)
    bad.row_groups[0] = RGEntry(11, 0, 4096, 100, BitMap(), [(100, 3)])
    with pytest.raises(CorruptCheckpoint):
        decode_ok(encode(bad))
    outside = body(3)
    outside.row_groups[0] = RGEntry(11, 0, 4096, 100, BitMap(), [(150, 4096)])
    with pytest.raises(CorruptCheckpoint):
        decode_ok(encode(outside))
