"""The bulk-load journal of one node: what makes a committed load survive a crash.

A bulk load (bulk_load.py) writes no changelog: its rows live in the Parquet files
the loader wrote. A checkpoint admits those files like any ingest file, but until
*both* checkpoint slots hold them, and hold them below their stream's replay start,
a restart could hide or retire them (the rewind hides every row at or above a
scope's start; cleansing retires a REGULAR file no checkpoint holds). The journal
record, written as the commit's last durable step, is then the load's changelog:
recovery re-applies the rows of its files at the load's timestamp
(LOADS_REAPPLIED_FROM_THEIR_FILES) and the sweepers keep those files
(LOAD_FILES_OUTLIVE_THEIR_ENTRY).

One file per committed load, ``<load_id>.ldj``, written once (temporary file,
fsync, rename, directory fsync: never torn; a leftover ``.tmp`` is a write that
never reached its rename, and is removed unread)::

    MAGIC "RTNALDJ1" | header length u32 | header JSON | CRC32C u32 (of every byte before)

States (``TRANSITIONS``; any other move raises ``IllegalLoadTransition``)::

    (none) -> COMMITTED -> PROMOTED

PROMOTED is the record's removal: both checkpoint slots start their replay above
the load's timestamp in every stream it wrote, so no restart can need it again.
A record that does not check raises ``CorruptLoadJournal``, and the node fails
closed: a damaged record is never read as "no load".
"""

from __future__ import annotations

import contextlib
import json
import os
import struct
import threading
from dataclasses import asdict, dataclass
from enum import StrEnum
from pathlib import Path

import crc32c

from retina_common.failpoints import Failpoint
from retina_common.storage import fsync_dir, local_records

MAGIC = b"RTNALDJ1"
SUFFIX = ".ldj"
_LEN = struct.Struct(">I")


class CorruptLoadJournal(Exception):
    """A load journal record does not check (fail closed)."""


class IllegalLoadTransition(Exception):
    """A journal write that the state machine does not allow."""


class LoadState(StrEnum):
    COMMITTED = "COMMITTED"  # durable, re-applied by recovery while a slot may need it
    PROMOTED = "PROMOTED"  # both checkpoint slots hold it below their start: removed


TRANSITIONS: dict[LoadState | None, frozenset[LoadState]] = {
    None: frozenset({LoadState.COMMITTED}),
    LoadState.COMMITTED: frozenset({LoadState.PROMOTED}),
    LoadState.PROMOTED: frozenset(),
}


def check_transition(old: LoadState | None, new: LoadState, load_id: str) -> None:
    if new not in TRANSITIONS[old]:
        raise IllegalLoadTransition(f"load {load_id}: {old} -> {new}")


@dataclass(frozen=True)
class LoadedFile:
    vnode: int
    file_id: int
    name: str
    path_id: int
    path_uri: str
    row_count: int
    row_id_start: int
    first_block_id: int
    rg_row_counts: tuple[int, ...]


@dataclass(frozen=True)
class LoadEntry:
    load_id: str
    node_id: str
    schema_name: str
    table_name: str
    table_id: int
    ts: int
    created_at_ms: int
    files: tuple[LoadedFile, ...]

    @property
    def file_ids(self) -> tuple[int, ...]:
        return tuple(f.file_id for f in self.files)

    @property
    def row_count(self) -> int:
        return sum(f.row_count for f in self.files)


def encode(entry: LoadEntry) -> bytes:
    raw = json.dumps(asdict(entry), separators=(",", ":"), sort_keys=True).encode()
    body = MAGIC + _LEN.pack(len(raw)) + raw
    return body + _LEN.pack(crc32c.crc32c(body))


def decode(data: bytes, source: str = "record") -> LoadEntry:
    if len(data) < len(MAGIC) + 8 or not data.startswith(MAGIC):
        raise CorruptLoadJournal(f"{source}: not a load journal record (bad magic or too short)")
    (crc,) = _LEN.unpack(data[-4:])
    if crc32c.crc32c(data[:-4]) != crc:
        raise CorruptLoadJournal(f"{source}: CRC32C mismatch")
    (length,) = _LEN.unpack_from(data, len(MAGIC))
    start = len(MAGIC) + 4
    if start + length + 4 != len(data):
        raise CorruptLoadJournal(f"{source}: header length {length} does not fit the record")
    try:
        raw = json.loads(data[start:start + length])
        raw["files"] = tuple(LoadedFile(**{**f, "rg_row_counts": tuple(f["rg_row_counts"])})
                             for f in raw["files"])
        return LoadEntry(**raw)
    except (ValueError, KeyError, TypeError) as exc:
        raise CorruptLoadJournal(f"{source}: bad header: {exc}") from None


class LoadJournal:
    """The COMMITTED loads of one node, durable in ``directory``; thread-safe."""

    def __init__(self, directory: Path) -> None:
        self._dir = directory
        self._dir.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._entries: dict[str, LoadEntry] = {}

    def load(self) -> list[LoadEntry]:
        """Read every record (start-up); raises CorruptLoadJournal on one that does not
        check, or whose name is not its load id."""
        entries: dict[str, LoadEntry] = {}
        for name, data in local_records(self._dir, SUFFIX):
            entry = decode(data, name)
            if f"{entry.load_id}{SUFFIX}" != name:
                raise CorruptLoadJournal(f"{name}: holds load {entry.load_id}")
            entries[entry.load_id] = entry
        with self._lock:
            self._entries = entries
        return self.entries()

    def entries(self) -> list[LoadEntry]:
        """In timestamp order: the order recovery re-applies them in."""
        with self._lock:
            return sorted(self._entries.values(), key=lambda e: (e.ts, e.load_id))

    def get(self, load_id: str) -> LoadEntry | None:
        with self._lock:
            return self._entries.get(load_id)

    def write(self, entry: LoadEntry, before: Failpoint, after: Failpoint) -> None:
        """COMMITTED, durably, between two failpoints (written once per load)."""
        check_transition(LoadState.COMMITTED if self.get(entry.load_id) else None,
                         LoadState.COMMITTED, entry.load_id)
        name = f"{entry.load_id}{SUFFIX}"
        tmp = self._dir / f"{name}.tmp"
        before.hit()
        with open(tmp, "wb") as out:
            out.write(encode(entry))
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, self._dir / name)
        with self._lock:  # in place: committed for all a reader knows, synced or not
            self._entries[entry.load_id] = entry
        fsync_dir(self._dir)
        after.hit()

    def promote(self, load_id: str, before: Failpoint, after: Failpoint) -> None:
        """PROMOTED: the record goes (a crash in between leaves it COMMITTED, and the
        next promotion removes it)."""
        check_transition(LoadState.COMMITTED if self.get(load_id) else None,
                         LoadState.PROMOTED, load_id)
        before.hit()
        with contextlib.suppress(FileNotFoundError):
            (self._dir / f"{load_id}{SUFFIX}").unlink()
        fsync_dir(self._dir)
        with self._lock:
            self._entries.pop(load_id, None)
        after.hit()

    def protected_files(self) -> set[int]:
        """LOAD_FILES_OUTLIVE_THEIR_ENTRY: the files a COMMITTED load may be re-applied
        from; no sweeper removes them and cleansing does not delete them."""
        return {f for e in self.entries() for f in e.file_ids}
