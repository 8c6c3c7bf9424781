"""Recovery checkpoints: the body format and the two-slot store (specification C04.1/C04.2/C04.4).

This is the format only: it lives in retina_common because the CDC connector
reads checkpoints too (its changelog retention, cdc_client/changelog_pruning.py).
Generation from a running node (``build_body``) stays with the server
(retina_server/recovery/checkpoint.py).

Body (all integers big-endian)::

    MAGIC "RTNACKP1" | schema version u16 | header length u32 | header JSON
    | file count u32 | FileEntry * n
    | segment count u32 | IngestSegmentEntry * n
    | rg count u32 | (RGEntry fixed part, roaring bitmap bytes, chain) * n
    | body length u64 | CRC32C u32 (of every byte before it)

    chain = item count u32 | byte length u32 | varints: (ts delta, zigzag row delta) * n

The header holds retinaNodeId, checkpointId, writerEpoch, writeTime,
checkpointAppliedTs, topologyHash and historyGaps. Replay starts are *not* stored:
they are derived from the segments on every start (replay_ts.py). Each RGEntry is the
row group's visibility as the node holds it: its base timestamp and bitmap (rows
deleted at or before the base: about one bit per row at worst, far less when deletes
are sparse) and its deletion chain up to checkpointAppliedTs, items in (ts, row) order,
each timestamp a delta from the one before (the first from the base), each row a
zigzag delta from the one before (docs/history.md gives the measured bits per row).
So a restarted node answers AS OF reads above the bases exactly. ``historyGaps``
lists the [from, to) timestamp ranges whose history a recovery rebuilt from the
changelogs and which the node therefore refuses for AS OF reads (node.py,
HISTORY_REBUILT_IS_REFUSED). Schema version 1 bodies (no chain, no gaps; the base at
checkpointAppliedTs) are still read.

Install (not "publish": that word is the ingest file publish): write the
immutable body (fsync, rename) → one etcd transaction that moves ``current``
to ``previous`` and sets the new ``current``, guarded by the revision of
``current`` read before → delete bodies that neither slot references. Load:
``current``, else ``previous``. A corrupt body is never taken as "absent": if
both slots are unusable, loading fails.
"""

from __future__ import annotations

import json
import re
import struct
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field, fields
from operator import attrgetter

import crc32c
import numpy as np
from pyroaring import BitMap

from retina_common import failpoints as fp
from retina_common import varint
from retina_common.etcd import EtcdError, EtcdOutcomeUnknown, EtcdStore
from retina_common.keys import checkpoint_slot_key
from retina_common.log import get_logger
from retina_common.replay_ts import IngestSegment, SegmentKind
from retina_common.storage import (
    delete_object,
    file_uri,
    list_objects,
    read_bytes,
    split_file_uri,
    write_durably,
)

log = get_logger(component="checkpoint")

MAGIC = b"RTNACKP1"
SCHEMA_VERSION = 2
READABLE_VERSIONS = (1, 2)
_FILE = struct.Struct(">qqiqqqqqqi")
_SEGMENT = struct.Struct(">qiBqqiqqq")
_RG = struct.Struct(">qiqqI")
_CHAIN = struct.Struct(">II")
_TRAILER = struct.Struct(">QI")
class CheckpointError(Exception):
    """Base class of checkpoint failures."""


class CorruptCheckpoint(CheckpointError):
    """The body is truncated, bit-flipped, of an unknown version, or malformed."""


class ForeignCheckpoint(CheckpointError):
    """A valid body of another node or another topology: never used."""


class CheckpointConflict(CheckpointError):
    """``current`` moved under us: another writer installed one. Nothing was changed."""


class CheckpointUnusable(CheckpointError):
    """Pointers exist but neither slot leads to a usable body."""


class CheckpointIncomplete(CheckpointError):
    """CHECKPOINT_COVERS_REGISTRY does not hold: the body would lose a file."""


@dataclass(frozen=True)
class CheckpointHeader:
    retina_node_id: str
    checkpoint_id: int
    writer_epoch: int
    write_time_ms: int
    checkpoint_applied_ts: int
    topology_hash: str
    # [from, to) timestamp ranges a recovery rebuilt (refused for AS OF reads)
    history_gaps: tuple[tuple[int, int], ...] = ()


@dataclass(frozen=True)
class FileEntry:
    file_id: int
    table_id: int
    vnode: int
    first_block_id: int
    min_commit_ts: int
    max_commit_ts: int
    record_num: int
    min_row_id: int
    max_row_id: int
    num_row_group: int


# A FileEntry's fields in declaration order, as _FILE packs them (asdict would deep-copy
# every entry: 80 ms of a 10,000-file checkpoint).
_FILE_FIELDS = attrgetter(*(f.name for f in fields(FileEntry)))


@dataclass(frozen=True)
class RGEntry:
    file_id: int
    rg_id: int
    row_count: int
    base_timestamp: int
    deleted: BitMap = field(compare=False)
    # Deletes after the base: (ts, row), ts ascending (rows ascending within a ts).
    chain: list[tuple[int, int]] = field(default_factory=list, compare=False)

    def same(self, other: RGEntry) -> bool:
        return (self.file_id, self.rg_id, self.row_count, self.base_timestamp) == \
            (other.file_id, other.rg_id, other.row_count, other.base_timestamp) and \
            self.deleted == other.deleted and sorted(self.chain) == sorted(other.chain)


def encode_chain(base_ts: int, chain: list[tuple[int, int]]) -> bytes:
    """Item count, byte length, then per item (ts - previous ts, zigzag(row - previous row))."""
    if not chain:
        return _CHAIN.pack(0, 0)
    items = np.array(chain, dtype=np.int64)
    items = items[np.lexsort((items[:, 1], items[:, 0]))]
    deltas = np.empty(2 * len(items), dtype=np.uint64)
    deltas[0::2] = np.diff(items[:, 0], prepend=base_ts).astype(np.uint64)
    deltas[1::2] = varint.zigzag(np.diff(items[:, 1], prepend=0))
    data = varint.encode(deltas)
    return _CHAIN.pack(len(items), len(data)) + data


def decode_chain(base_ts: int, row_count: int, data: bytes) -> list[tuple[int, int]]:
    """The chain :func:`encode_chain` wrote; ValueError on anything else."""
    count, _length = _CHAIN.unpack_from(data)
    if not count:
        return []
    values, end = varint.decode(data, 2 * count, _CHAIN.size)
    if end != len(data):
        raise ValueError("trailing bytes after the chain")
    ts = base_ts + np.cumsum(values[0::2].astype(np.int64))
    rows = np.cumsum(varint.unzigzag(values[1::2]))
    if int(ts[0]) <= base_ts or int(rows.min()) < 0 or int(rows.max()) >= row_count:
        raise ValueError("a chain item at or below the base, or outside the row group")
    return list(zip(ts.tolist(), rows.tolist(), strict=True))


@dataclass
class CheckpointBody:
    header: CheckpointHeader
    files: list[FileEntry]
    segments: list[IngestSegment]
    row_groups: list[RGEntry]


def encode(body: CheckpointBody) -> bytes:
    h = body.header
    header = json.dumps({"retinaNodeId": h.retina_node_id, "checkpointId": h.checkpoint_id,
                         "writerEpoch": h.writer_epoch, "writeTime": h.write_time_ms,
                         "checkpointAppliedTs": h.checkpoint_applied_ts,
                         "topologyHash": h.topology_hash,
                         "historyGaps": [list(g) for g in h.history_gaps]},
                        separators=(",", ":")).encode()
    parts = [MAGIC, struct.pack(">HI", SCHEMA_VERSION, len(header)), header,
             struct.pack(">I", len(body.files))]
    parts += [_FILE.pack(*_FILE_FIELDS(f)) for f in body.files]
    parts.append(struct.pack(">I", len(body.segments)))
    parts += [_SEGMENT.pack(s.table_id, s.vnode, int(s.kind), s.file_id, s.first_block_id,
                            s.block_count, s.row_count, s.min_commit_ts, s.max_commit_ts)
              for s in body.segments]
    parts.append(struct.pack(">I", len(body.row_groups)))
    for rg in body.row_groups:
        bits = rg.deleted.serialize()
        parts += [_RG.pack(rg.file_id, rg.rg_id, rg.row_count, rg.base_timestamp, len(bits)),
                  bits, encode_chain(rg.base_timestamp, rg.chain)]
    data = b"".join(parts)
    length = len(data) + _TRAILER.size
    head = data + struct.pack(">Q", length)
    return head + struct.pack(">I", crc32c.crc32c(head))


class _Reader:
    def __init__(self, data: bytes, end: int) -> None:
        self._data, self._pos, self._end = data, 0, end

    def take(self, size: int) -> bytes:
        if self._pos + size > self._end:
            raise CorruptCheckpoint("body ends inside a section")
        chunk = self._data[self._pos:self._pos + size]
        self._pos += size
        return chunk

    def unpack(self, fmt: struct.Struct) -> tuple:
        return fmt.unpack(self.take(fmt.size))

    def unpack_many(self, fmt: struct.Struct, count: int) -> Iterator[tuple]:
        """``count`` records of a fixed size, laid end to end."""
        return fmt.iter_unpack(self.take(fmt.size * count))

    @property
    def done(self) -> bool:
        return self._pos == self._end


def decode(data: bytes, *, expect_node: str, expect_topology_hash: str) -> CheckpointBody:
    """Parse and validate a body; raises CorruptCheckpoint or ForeignCheckpoint."""
    if len(data) < len(MAGIC) + 6 + _TRAILER.size:
        raise CorruptCheckpoint(f"body of {len(data)} bytes is too short")
    if not data.startswith(MAGIC):
        raise CorruptCheckpoint("bad magic")
    length, crc = _TRAILER.unpack(data[-_TRAILER.size:])
    if length != len(data):
        raise CorruptCheckpoint(f"length field says {length} bytes, the body has {len(data)}")
    if crc32c.crc32c(data[:-4]) != crc:
        raise CorruptCheckpoint("CRC32C mismatch")
    reader = _Reader(data, len(data) - _TRAILER.size)
    reader.take(len(MAGIC))
    version, header_len = reader.unpack(struct.Struct(">HI"))
    if version not in READABLE_VERSIONS:
        raise CorruptCheckpoint(f"schema version {version}; this code reads "
                                f"{', '.join(map(str, READABLE_VERSIONS))}")
    try:
        raw = json.loads(reader.take(header_len))
        gaps = tuple((int(a), int(b)) for a, b in raw.get("historyGaps", ()))
        header = CheckpointHeader(raw["retinaNodeId"], raw["checkpointId"], raw["writerEpoch"],
                                  raw["writeTime"], raw["checkpointAppliedTs"],
                                  raw["topologyHash"], gaps)
    except (ValueError, KeyError, TypeError) as exc:
        raise CorruptCheckpoint(f"bad header: {exc}") from None
    if header.retina_node_id != expect_node:
        raise ForeignCheckpoint(f"body of node {header.retina_node_id}, not {expect_node}")
    if header.topology_hash != expect_topology_hash:
        raise ForeignCheckpoint("body written under another topology (topologyHash differs)")
    if header.checkpoint_applied_ts < 0 or header.checkpoint_id < 0:
        raise CorruptCheckpoint("negative checkpointAppliedTs or checkpointId")
    (n,) = reader.unpack(struct.Struct(">I"))
    files = [FileEntry(*fields) for fields in reader.unpack_many(_FILE, n)]
    (n,) = reader.unpack(struct.Struct(">I"))
    segments = []
    for t, v, kind, f, first, blocks, rows, lo, hi in reader.unpack_many(_SEGMENT, n):
        try:
            segments.append(IngestSegment(t, v, SegmentKind(kind), f, first, blocks, rows, lo, hi))
        except ValueError:
            raise CorruptCheckpoint(f"unknown segment kind {kind}") from None
    (n,) = reader.unpack(struct.Struct(">I"))
    rgs = []
    for _ in range(n):
        f, rg, rows, base_ts, size = reader.unpack(_RG)
        try:
            bits = BitMap.deserialize(reader.take(size))
        except (ValueError, OSError) as exc:
            raise CorruptCheckpoint(f"bad bitmap of file {f} rg {rg}: {exc}") from None
        chain: list[tuple[int, int]] = []
        if version >= 2:
            count, length = reader.unpack(_CHAIN)
            data = _CHAIN.pack(count, length) + reader.take(length)
            try:
                chain = decode_chain(base_ts, rows, data)
            except ValueError as exc:
                raise CorruptCheckpoint(f"bad chain of file {f} rg {rg}: {exc}") from None
        rgs.append(RGEntry(f, rg, rows, base_ts, bits, chain))
    if not reader.done:
        raise CorruptCheckpoint("trailing bytes after the last section")
    return CheckpointBody(header, files, segments, rgs)


@dataclass(frozen=True)
class Pointer:
    """The JSON value of a slot (docs/architecture.md, "etcd keys")."""

    checkpoint_id: int
    path: str
    length: int
    crc32c: int
    checkpoint_applied_ts: int
    writer_epoch: int

    def to_json(self) -> str:
        return json.dumps({"checkpointId": self.checkpoint_id, "path": self.path,
                           "length": self.length, "crc32c": self.crc32c,
                           "checkpointAppliedTs": self.checkpoint_applied_ts,
                           "writerEpoch": self.writer_epoch}, separators=(",", ":"))

    @classmethod
    def parse(cls, raw: bytes) -> Pointer:
        try:
            d = json.loads(raw)
            return cls(int(d["checkpointId"]), str(d["path"]), int(d["length"]),
                       int(d["crc32c"]), int(d["checkpointAppliedTs"]), int(d["writerEpoch"]))
        except (ValueError, KeyError, TypeError) as exc:
            raise CorruptCheckpoint(f"malformed pointer: {exc}") from None


@dataclass(frozen=True)
class LoadedCheckpoint:
    slot: str  # "current" or "previous"
    pointer: Pointer
    body: CheckpointBody
    rejected: tuple[str, ...]  # why a slot before it was not used


_BODY_NAME = re.compile(r"^ckpt-(\d{20})\.bin$")


class CheckpointStore:
    def __init__(self, etcd: EtcdStore, node_id: str, storage_root: str,
                 topology_hash: str) -> None:
        self._etcd = etcd
        self._node = node_id
        self._topology_hash = topology_hash
        # file_uri keeps an object store's options (``?endpoint_override=...``) at the end.
        self._dir = file_uri(storage_root, f"_checkpoints/{node_id.replace(':', '-')}")
        self._current = checkpoint_slot_key(node_id, "current")
        self._previous = checkpoint_slot_key(node_id, "previous")
        # install() and cleanup() may run on different threads (checkpoint timer, sweeper).
        self._cleanup_lock = threading.Lock()
        self._slot_files: dict[str, frozenset[int]] = {}

    def install(self, body: CheckpointBody) -> Pointer:
        """Write the body, swap the slots, clean up what no slot references."""
        data = encode(body)
        name = f"ckpt-{body.header.checkpoint_id:020d}.bin"
        pointer = Pointer(body.header.checkpoint_id, file_uri(self._dir, name), len(data),
                          crc32c.crc32c(data), body.header.checkpoint_applied_ts,
                          body.header.writer_epoch)
        fp.CHECKPOINT_BODY_WRITE_BEFORE.hit()
        write_durably(self._dir, name, data)
        fp.CHECKPOINT_BODY_WRITE_AFTER.hit()
        current = self._etcd.get(self._current)
        puts: list[tuple[str, str | bytes, int]] = [(self._current, pointer.to_json(), 0)]
        if current is not None:
            puts.append((self._previous, current.value, 0))
        fp.CHECKPOINT_POINTER_SWAP_BEFORE.hit()
        try:
            swapped = self._etcd.compare_and_swap(
                [(self._current, 0 if current is None else current.mod_revision)], puts)
        except EtcdOutcomeUnknown:
            after = self._etcd.get(self._current)
            swapped = 1 if after is not None and after.value == pointer.to_json().encode() \
                else None
        if swapped is None:
            raise CheckpointConflict(f"checkpoint {pointer.checkpoint_id}: current moved; "
                                     "another writer installed one")
        fp.CHECKPOINT_POINTER_SWAP_AFTER.hit()
        log.info("checkpoint_installed", node=self._node, checkpoint_id=pointer.checkpoint_id,
                 bytes=pointer.length, applied_ts=pointer.checkpoint_applied_ts)
        self.cleanup()
        return pointer

    def previous_empty(self) -> bool:
        """Whether the ``previous`` slot holds nothing (a node's first install moves no
        ``current`` there): a restart can then load ``current`` or nothing. Raises
        EtcdError when etcd cannot say."""
        return self._etcd.get(self._previous) is None

    def _slot_ids(self) -> tuple[int, set[int]] | None:
        """``current``'s checkpoint id and the ids both slots name, from one read of each
        slot; None when ``current`` is empty or a pointer is unreadable (it could name
        any body: remove none). Bodies are matched by the id in their name, not by
        path: a storage root spelled differently since must not make ``previous`` look
        unreferenced."""
        ids: dict[str, int] = {}
        for key in (self._current, self._previous):
            kv = self._etcd.get(key)
            if kv is None:
                continue
            try:
                ids[key] = Pointer.parse(kv.value).checkpoint_id
            except CorruptCheckpoint:
                return None
        if self._current not in ids:
            return None
        return ids[self._current], set(ids.values())

    def cleanup(self, dry_run: bool = False) -> list[str]:
        """Delete the bodies neither slot references and older than ``current`` (replaced
        ones, orphans of a crash). Listed through pyarrow.fs, so a local directory and
        an S3-compatible bucket are swept alike. A body newer than ``current`` may be an
        install under way (written, its pointer not yet swapped): it stays until a later
        checkpoint passes it. Returns the names removed (or that would be)."""
        with self._cleanup_lock:
            slots = self._slot_ids()
            if slots is None:
                return []
            current, named = slots
            fp.CHECKPOINT_CLEANUP_BEFORE.hit()
            removed = []
            for body in list_objects(self._dir):
                found = _BODY_NAME.match(body.name)
                if found is None or int(found.group(1)) in named or \
                        int(found.group(1)) >= current:
                    continue
                if not dry_run:
                    fp.CHECKPOINT_BODY_DELETE_BEFORE.hit()
                    delete_object(self._dir, body.name)
                    fp.CHECKPOINT_BODY_DELETE_AFTER.hit()
                removed.append(body.name)
            if removed and not dry_run:
                log.info("checkpoint_bodies_removed", node=self._node, bodies=removed)
            return removed

    def slot_file_ids(self) -> frozenset[int] | None:
        """Every file id either slot's body names (its files and its segments); None if a
        slot cannot be read (the caller then holds every file). Bodies are immutable:
        one read per body, cached by its path."""
        ids: set[int] = set()
        for key in (self._current, self._previous):
            try:
                kv = self._etcd.get(key)
                if kv is None:
                    continue
                pointer = Pointer.parse(kv.value)
                cached = self._slot_files.get(pointer.path)
                if cached is None:
                    slot = "current" if key == self._current else "previous"
                    found = self.read_slot(slot)
                    if found is None or found[0].path != pointer.path:
                        return None  # moved while read: the next round reads again
                    body = found[1]
                    cached = frozenset({f.file_id for f in body.files} |
                                       {s.file_id for s in body.segments})
                    self._slot_files[pointer.path] = cached
                    while len(self._slot_files) > 4:  # two slots, and the two before them
                        del self._slot_files[next(iter(self._slot_files))]
                ids |= cached
            except (CheckpointError, OSError, EtcdError) as exc:
                log.warning("checkpoint_slot_unreadable_for_sweep", node=self._node,
                            error=str(exc))
                return None
        return frozenset(ids)

    def read_slot(self, slot: str) -> tuple[Pointer, CheckpointBody] | None:
        """The slot's pointer and verified body; None if the slot is empty.
        Raises CheckpointError or OSError if it cannot be used."""
        kv = self._etcd.get(self._current if slot == "current" else self._previous)
        if kv is None:
            return None
        pointer = Pointer.parse(kv.value)
        directory, name = split_file_uri(pointer.path)
        data = read_bytes(directory, name)
        if len(data) != pointer.length or crc32c.crc32c(data) != pointer.crc32c:
            raise CorruptCheckpoint("body differs from its pointer (length or CRC32C)")
        body = decode(data, expect_node=self._node, expect_topology_hash=self._topology_hash)
        if body.header.checkpoint_id != pointer.checkpoint_id:
            raise CorruptCheckpoint("pointer and body name different checkpoints")
        return pointer, body

    def load(self) -> LoadedCheckpoint | None:
        """``current`` if usable, else ``previous``; None only if no slot exists at all."""
        rejected: list[str] = []
        any_pointer = False
        for slot in ("current", "previous"):
            try:
                found = self.read_slot(slot)
            except (CheckpointError, OSError) as exc:
                any_pointer = True
                rejected.append(f"{slot}: {exc}")
                log.warning("checkpoint_slot_rejected", node=self._node, slot=slot,
                            error=str(exc))
                continue
            if found is not None:
                return LoadedCheckpoint(slot, found[0], found[1], tuple(rejected))
        if any_pointer:
            raise CheckpointUnusable("; ".join(rejected))
        return None
