"""The Storage GC journal: a write-ahead rollback record per rewrite (specification C07, 5).

One entry per rewrite, in its own file ``<rewrite_id>.gcj`` under the node's
state directory; every state change replaces the whole file durably (write a
temporary file, fsync, rename, fsync the directory), so a record is never
torn: a file that is there is complete, and one whose length or CRC32C does
not check is corruption (:class:`CorruptJournal`), never "no entry".

Record (integers big-endian)::

    MAGIC "RTNAGCJ1" | version u16 | header length u32 | header JSON
    | bitmap count u32 | (fileId i64, rgId u32, length u32, roaring bytes) * n
    | record length u64 | CRC32C u32 (of every byte before it)

The bitmaps are the rollback anchor that cannot be re-derived after a crash:
per old row group, the rows deleted at the cutoff (dropped by the rewrite).
With them and the old files' MainIndex ranges, new row ``newRowIdStart + i``
maps back to exactly one old row id.

States (the transition table is :data:`TRANSITIONS`)::

    INDEX_SWITCHING ─▶ SWAPPED_NOT_CHECKPOINTED ─▶ CHECKPOINTED
          │                      │        │              │
          └──────────────────────┴─▶ ABORTED             │
                                          └──▶ REVERTING ◀┘ ─▶ REVERTED

INDEX_SWITCHING is written before anything of the rewrite touches the index,
the visibility or the catalog; SWAPPED_NOT_CHECKPOINTED once atomicSwapFiles
committed; CHECKPOINTED once a durable checkpoint holds the new file (from
then on recovery keeps it without looking further); ABORTED after a
rollback. REVERTING is written before an operator's revert of a completed
rewrite touches anything (lineage.py), REVERTED once the catalog swapped
back; recovery finishes a REVERTING entry and rebuilds the old files'
baseline when the loaded checkpoint still holds the new file.
"""

from __future__ import annotations

import contextlib
import json
import os
import struct
import threading
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field, replace
from enum import StrEnum
from pathlib import Path

import crc32c
from pyroaring import BitMap

from retina_common.failpoints import Failpoint
from retina_common.storage import fsync_dir, local_records

MAGIC = b"RTNAGCJ1"
VERSION = 1
SUFFIX = ".gcj"
_BITMAP = struct.Struct(">qII")
_TRAILER = struct.Struct(">QI")


class CorruptJournal(Exception):
    """A journal record does not check: the node cannot know what the rewrite did."""


class IllegalJournalTransition(Exception):
    """A state change the transition table does not allow (a bug)."""


class JournalConflict(Exception):
    """The entry moved since the writer read it (JOURNAL_WRITES_FOLLOW_TRANSITIONS):
    e.g. a checkpoint's promotion that read SWAPPED_NOT_CHECKPOINTED while an
    operator's revert wrote REVERTING. Nothing was written."""


class JournalState(StrEnum):
    INDEX_SWITCHING = "INDEX_SWITCHING"
    SWAPPED_NOT_CHECKPOINTED = "SWAPPED_NOT_CHECKPOINTED"
    CHECKPOINTED = "CHECKPOINTED"
    ABORTED = "ABORTED"
    REVERTING = "REVERTING"
    REVERTED = "REVERTED"


TRANSITIONS: dict[JournalState, frozenset[JournalState]] = {
    JournalState.INDEX_SWITCHING: frozenset({JournalState.SWAPPED_NOT_CHECKPOINTED,
                                             JournalState.ABORTED}),
    JournalState.SWAPPED_NOT_CHECKPOINTED: frozenset({JournalState.CHECKPOINTED,
                                                      JournalState.ABORTED,
                                                      JournalState.REVERTING}),
    JournalState.CHECKPOINTED: frozenset({JournalState.REVERTING}),
    JournalState.ABORTED: frozenset(),
    JournalState.REVERTING: frozenset({JournalState.REVERTED}),
    JournalState.REVERTED: frozenset(),
}
# What a crash can leave half done: recovery decides these (gc_recovery.py, lineage.py).
OPEN_STATES = frozenset({JournalState.INDEX_SWITCHING, JournalState.SWAPPED_NOT_CHECKPOINTED,
                         JournalState.REVERTING})
# Nothing will change these any more (the sweeper removes them after the lineage retention).
FINAL_STATES = frozenset({JournalState.ABORTED, JournalState.REVERTED})


@dataclass(frozen=True)
class OldFile:
    """One replaced file, as it was when the rewrite committed."""

    file_id: int
    name: str
    rg_row_counts: tuple[int, ...]
    first_block_id: int
    block_count: int


@dataclass(frozen=True)
class JournalEntry:
    rewrite_id: str
    state: JournalState
    node_id: str
    schema_name: str
    table_name: str
    table_id: int
    vnode: int
    path_id: int
    path_uri: str
    new_file_id: int
    new_file_name: str
    new_row_id_start: int
    new_rg_row_counts: tuple[int, ...]
    old_files: tuple[OldFile, ...]
    cutoff_ts: int
    cleanup_at_ms: int
    created_at_ms: int
    updated_at_ms: int
    reason: str = ""
    # Lineage times: when the swap committed, when a revert swapped back (0: not yet).
    completed_at_ms: int = 0
    reverted_at_ms: int = 0
    # (old fileId, rgId) -> rows deleted at the cutoff (not in the new file).
    dropped: dict[tuple[int, int], BitMap] = field(default_factory=dict, compare=False,
                                                     repr=False)

    @property
    def rows_kept(self) -> int:
        return sum(self.new_rg_row_counts)

    @property
    def old_file_ids(self) -> list[int]:
        return [f.file_id for f in self.old_files]

    def moved(self, state: JournalState, now_ms: int, reason: str = "") -> JournalEntry:
        if state not in TRANSITIONS[self.state]:
            raise IllegalJournalTransition(f"rewrite {self.rewrite_id}: {self.state} -> {state}")
        completed = now_ms if state == JournalState.SWAPPED_NOT_CHECKPOINTED \
            else self.completed_at_ms
        reverted = now_ms if state == JournalState.REVERTED else self.reverted_at_ms
        return replace(self, state=state, updated_at_ms=now_ms, reason=reason or self.reason,
                       completed_at_ms=completed, reverted_at_ms=reverted)


def encode(entry: JournalEntry) -> bytes:
    header = asdict(entry)
    header.pop("dropped")
    header["state"] = entry.state.value
    raw = json.dumps(header, separators=(",", ":"), sort_keys=True).encode()
    parts = [MAGIC, struct.pack(">HI", VERSION, len(raw)), raw,
             struct.pack(">I", len(entry.dropped))]
    for (file_id, rg_id), bits in sorted(entry.dropped.items()):
        data = bits.serialize()
        parts += [_BITMAP.pack(file_id, rg_id, len(data)), data]
    body = b"".join(parts)
    head = body + struct.pack(">Q", len(body) + _TRAILER.size)
    return head + struct.pack(">I", crc32c.crc32c(head))


def decode(data: bytes, source: str = "record") -> JournalEntry:
    if len(data) < len(MAGIC) + 6 + _TRAILER.size or not data.startswith(MAGIC):
        raise CorruptJournal(f"{source}: not a GC journal record (bad magic or too short)")
    length, crc = _TRAILER.unpack(data[-_TRAILER.size:])
    if length != len(data):
        raise CorruptJournal(f"{source}: length field says {length}, the record has {len(data)}")
    if crc32c.crc32c(data[:-4]) != crc:
        raise CorruptJournal(f"{source}: CRC32C mismatch")
    pos = len(MAGIC)
    version, header_len = struct.unpack_from(">HI", data, pos)
    if version != VERSION:
        raise CorruptJournal(f"{source}: version {version}; this code reads {VERSION}")
    pos += 6
    try:
        raw = json.loads(data[pos:pos + header_len])
        raw["state"] = JournalState(raw["state"])
        raw["old_files"] = tuple(OldFile(**{**f, "rg_row_counts": tuple(f["rg_row_counts"])})
                                 for f in raw["old_files"])
        raw["new_rg_row_counts"] = tuple(raw["new_rg_row_counts"])
        entry = JournalEntry(**raw)
    except (ValueError, KeyError, TypeError) as exc:
        raise CorruptJournal(f"{source}: bad header: {exc}") from None
    pos += header_len
    (count,) = struct.unpack_from(">I", data, pos)
    pos += 4
    end = len(data) - _TRAILER.size
    dropped: dict[tuple[int, int], BitMap] = {}
    for _ in range(count):
        if pos + _BITMAP.size > end:
            raise CorruptJournal(f"{source}: ends inside the bitmaps")
        file_id, rg_id, size = _BITMAP.unpack_from(data, pos)
        pos += _BITMAP.size
        if pos + size > end:
            raise CorruptJournal(f"{source}: ends inside a bitmap")
        try:
            dropped[(file_id, rg_id)] = BitMap.deserialize(data[pos:pos + size])
        except (ValueError, OSError) as exc:
            raise CorruptJournal(f"{source}: bad bitmap: {exc}") from None
        pos += size
    if pos != end:
        raise CorruptJournal(f"{source}: trailing bytes")
    return replace(entry, dropped=dropped)


class GcJournal:
    """The entries of one node, durable in ``directory``; thread-safe."""

    def __init__(self, directory: Path) -> None:
        self._dir = directory
        self._dir.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        # Held across a write's check and its rename: the compare-and-set of write().
        self._write_lock = threading.Lock()
        self._entries: dict[str, JournalEntry] = {}
        # The open ones among them (few: final entries stay for the lineage retention).
        self._open: dict[str, JournalEntry] = {}

    def load(self) -> list[JournalEntry]:
        """Read every record; raises CorruptJournal on the first that does not check.

        A leftover temporary file is a write that never reached its rename:
        the step after it never started, so it is removed, not read."""
        entries: dict[str, JournalEntry] = {}
        for name, data in local_records(self._dir, SUFFIX):
            entry = decode(data, name)
            if f"{entry.rewrite_id}{SUFFIX}" != name:
                raise CorruptJournal(f"{name}: holds rewrite {entry.rewrite_id}")
            entries[entry.rewrite_id] = entry
        with self._lock:
            self._entries = entries
            self._open = {k: e for k, e in entries.items() if e.state in OPEN_STATES}
        return self.entries()

    def entries(self) -> list[JournalEntry]:
        with self._lock:
            return sorted(self._entries.values(), key=lambda e: (e.created_at_ms, e.rewrite_id))

    def get(self, rewrite_id: str) -> JournalEntry | None:
        with self._lock:
            return self._entries.get(rewrite_id)

    def open_entries(self) -> list[JournalEntry]:
        with self._lock:
            return sorted(self._open.values(), key=lambda e: (e.created_at_ms, e.rewrite_id))

    def write(self, entry: JournalEntry, before: Failpoint, after: Failpoint) -> JournalEntry:
        """Make ``entry`` durable (replacing its previous state), between two failpoints.

        JOURNAL_WRITES_FOLLOW_TRANSITIONS: a compare-and-set on the state. Two threads
        that read the same entry (a checkpoint's promotion, an operator's revert) cannot
        both move it: a write whose state the stored one cannot move to raises
        JournalConflict and changes nothing (rewriting the same state is allowed)."""
        data = encode(entry)
        name = f"{entry.rewrite_id}{SUFFIX}"
        tmp = self._dir / f"{name}.tmp"
        before.hit()
        with self._write_lock:
            stored = self.get(entry.rewrite_id)
            if stored is not None and stored.state != entry.state and \
                    entry.state not in TRANSITIONS[stored.state]:
                raise JournalConflict(f"rewrite {entry.rewrite_id} is {stored.state.value} "
                                      f"now, cannot become {entry.state.value}")
            with open(tmp, "wb") as out:
                out.write(data)
                out.flush()
                os.fsync(out.fileno())
            os.replace(tmp, self._dir / name)
            fsync_dir(self._dir)
            with self._lock:
                self._entries[entry.rewrite_id] = entry
                if entry.state in OPEN_STATES:
                    self._open[entry.rewrite_id] = entry
                else:
                    self._open.pop(entry.rewrite_id, None)
        after.hit()
        return entry

    def protected_files(self) -> set[int]:
        """Files an open entry holds (old and new): cleansing never retires them."""
        return {f for e in self.open_entries() for f in (e.new_file_id, *e.old_file_ids)}

    def names(self, file_ids: Iterable[int]) -> set[int]:
        """Which of ``file_ids`` some entry (any state) names, old or new."""
        known = {f for e in self.entries() for f in (e.new_file_id, *e.old_file_ids)}
        return set(file_ids) & known

    def remove(self, rewrite_id: str) -> None:
        """Forget a terminal entry (sweepers, once nothing can need it)."""
        with self._lock:
            entry = self._entries.get(rewrite_id)
            if entry is None or entry.state in OPEN_STATES:
                return
            del self._entries[rewrite_id]
        with contextlib.suppress(FileNotFoundError):
            (self._dir / f"{rewrite_id}{SUFFIX}").unlink()
