"""The primary index of one node, on LMDB (durable on every write transaction).

Multi-version: ``(tableId, primary-key bytes, ts) -> rowId`` or a tombstone.
resolvePrimary at T reads the latest version at or before T. Versions are what
makes recovery exact: cleansing drops every version written at or after its
scope's replay start (``truncate_versions``), so the index is back at the
state the replay starts from, however far ahead of the checkpoint it was when
the process died.

This module answers in row ids only; where a row id lives is the MainIndex's
(main_index.py), and the two meet in the facade (index.py). The node's source
positions (source_positions.py) are a named database of the same environment
(``open_store``), written in the same request transaction and pruned with it.
"""

from __future__ import annotations

import bisect
import itertools
import struct
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import lmdb
import numpy as np

from retina_common import failpoints as fp
from retina_common.log import get_logger
from retina_server.index_errors import IndexBackendError

log = get_logger(component="index")

# LMDB's map is address space, not disk: the file grows with what is written. 1 TiB, so a
# node's index is bounded by its disk, not by the map. (It was 8 GiB, which a table of
# about 50 million keys fills at ~165 bytes of versions and by-timestamp entries per key:
# every write then failed with MapFullError.)
MAP_SIZE = 1 << 40
_TABLE = struct.Struct(">q")
_LEN = struct.Struct(">I")
_TS = struct.Struct(">Q")  # big-endian, so versions of a key sort by timestamp
_ROW = struct.Struct(">q")  # rowId, or TOMBSTONE
TOMBSTONE = -1
# LMDB's largest key is 511 bytes; a version key adds the table id, the key's length
# and the timestamp (20 bytes) to the primary-key bytes. UpdateRecord refuses a longer
# key (INVALID_ARGUMENT) instead of failing in the index (a retryable UNAVAILABLE that
# would be retried forever).
MAX_KEY_BYTES = 511 - 20
_MAX_PREFIX = 511 - 8  # the longest tableId|len|key a version key can have
_PRUNED_BELOW = b"pruned_below"
# KEYS_STORED_REVERSED: the key bytes in a version key are stored back to front. The codec
# lays an integer key out little-endian, so consecutive ids (an auto-increment column, a
# load of ids 1..N) would land all over the B-tree: every chunk of a load, every batch of
# inserts, touched almost every page. Reversed, they are big-endian: neighbours in the
# tree, so a load's key check and its puts stay near a few pages however large the table
# (20M keys: 0.14 s and 0.40 s per million, against 0.38 s and 1.40 s, and a file 2.4
# times smaller). An index created before this layout keeps its own (LAYOUT_LEGACY).
_KEY_LAYOUT = b"key_layout"
LAYOUT_REVERSED = b"reversed"
LAYOUT_LEGACY = b"legacy"
# A store of this environment dropping its entries below a new prune horizon, in the
# transaction that records the horizon (``prune_versions``).
BelowHorizon = Callable[["lmdb.Transaction[bytes]", int], object]


def drop_keys_below(txn: lmdb.Transaction[bytes], db: lmdb._Database, end: bytes) -> int:
    """Delete every entry of ``db`` whose key sorts below ``end`` (a store keyed by a
    big-endian timestamp first: what it holds below a prune horizon); returns how many."""
    cursor = txn.cursor(db=db)
    dropped = 0
    cursor.first()
    # delete() moves to the next entry; past the last one the key reads b"".
    while (key := cursor.key()) and key < end:
        cursor.delete()
        dropped += 1
    return dropped


def _version_prefix(table_id: int, key: bytes) -> bytes:
    """tableId | len(key) | key: unambiguous, so no key's versions mix with another's."""
    return _TABLE.pack(table_id) + _LEN.pack(len(key)) + key


def _version_prefixes(table_id: int, keys: Iterable[bytes]) -> list[bytes]:
    """``_version_prefix`` of many keys of one table (the head packed once per length:
    the keys of a table of fixed-width key columns all have one)."""
    table, pack_len = _TABLE.pack(table_id), _LEN.pack
    heads: dict[int, bytes] = {}
    out = []
    for key in keys:
        head = heads.get(len(key))
        if head is None:
            head = heads[len(key)] = table + pack_len(len(key))
        out.append(head + key)
    return out


def _load_items(table_id: int, keys: Sequence[bytes], row_ids: np.ndarray,
                ts: int, reverse: bool) -> tuple[list[bytes], list[bytes], list[bytes]]:
    """A bulk load's version keys ``prefix|ts``, their values (row ids) and by-timestamp keys
    ``ts|prefix``, sorted by version key. Keys of one width (a table of fixed-width key
    columns) are laid out and sorted with numpy, not one by one."""
    stamp = _TS.pack(ts)
    ids = np.asarray(row_ids, dtype=">i8")
    width = len(keys[0])
    if any(len(k) != width for k in keys):
        prefixes = _version_prefixes(table_id, [k[::-1] for k in keys] if reverse else keys)
        by_key = sorted(range(len(prefixes)), key=prefixes.__getitem__)
        return ([prefixes[i] + stamp for i in by_key], ids[by_key].view("V8").tolist(),
                [stamp + prefixes[i] for i in by_key])
    n = len(keys)
    head = np.frombuffer(_TABLE.pack(table_id) + _LEN.pack(width), np.uint8)
    tail = np.frombuffer(stamp, np.uint8)
    size = len(head) + width + len(tail)
    versions = np.empty((n, size), np.uint8)
    versions[:, :len(head)] = head
    body = np.frombuffer(b"".join(keys), np.uint8).reshape(n, width)
    versions[:, len(head):len(head) + width] = body[:, ::-1] if reverse else body
    versions[:, len(head) + width:] = tail
    order = np.argsort(versions.view(f"S{size}").ravel(), kind="stable")
    versions = versions[order]
    stamped = np.empty((n, size), np.uint8)
    stamped[:, :len(tail)] = tail
    stamped[:, len(tail):] = versions[:, :len(head) + width]
    return (versions.view(f"V{size}").ravel().tolist(), ids[order].view("V8").tolist(),
            stamped.view(f"V{size}").ravel().tolist())


def _split_prefix(prefix: bytes) -> tuple[int, bytes]:
    (table_id,) = _TABLE.unpack(prefix[:8])
    (length,) = _LEN.unpack(prefix[8:12])
    return table_id, prefix[12:12 + length]


def _versioned(cursor: lmdb.Cursor[bytes], prefixes: list[bytes]) -> list[int]:
    """The positions of ``prefixes`` (version prefixes) that have at least one version.

    Sorted prefixes are walked against the index: the first entry at or after
    ``prefixes[i]`` has prefix ``found``, and every prefix from ``i`` up to ``found``
    has no version (its versions would sort between ``prefixes[i]`` and that entry:
    prefixes of one table and key length are of one length, so a smaller one is smaller
    at a byte, whatever follows it). So a load of keys the index holds nothing between
    (a new table, a new range of ids) costs one descent, not one per key; keys that
    interleave with the index's cost a descent each, as a lookup per key would.
    Unsorted prefixes are looked up one by one."""
    set_range, key_at = cursor.set_range, cursor.key
    if any(a >= b for a, b in itertools.pairwise(prefixes)):
        return [i for i, p in enumerate(prefixes) if set_range(p) and key_at().startswith(p)]
    versioned: list[int] = []
    i, n = 0, len(prefixes)
    while i < n:
        if not set_range(prefixes[i]):
            break  # nothing at or after it: no later prefix has a version either
        found = key_at()[:-8]
        if found < prefixes[i]:  # no version entry is shaped so: the walk would not move
            raise IndexBackendError(f"primary index entry {key_at().hex()} is not a version")
        i = bisect.bisect_left(prefixes, found, i)
        if i < n and prefixes[i] == found:
            versioned.append(i)
            i += 1
    return versioned


class PrimaryIndex:
    def __init__(self, path: Path, *, map_size: int = MAP_SIZE) -> None:
        self._env = lmdb.open(str(path), map_size=map_size, sync=True, metasync=True,
                              max_dbs=8)  # refused_writes.py, source_positions.py, ...
        # Versions: tableId|len|key|ts -> rowId or TOMBSTONE; and ts|tableId|len|key -> ''
        # so that recovery can drop everything written after a replay start.
        self._primary = self._env.open_db(b"primary_versions")
        self._by_ts = self._env.open_db(b"primary_by_ts")
        self._meta = self._env.open_db(b"primary_meta")
        self._batch = threading.local()  # the request's open LMDB write transaction
        # The highest horizon any prune of this index started at (durable: a restarted
        # process knows it too). A read at a timestamp below it may have lost versions.
        with self._env.begin(db=self._meta) as txn:
            stored = txn.get(_PRUNED_BELOW, db=self._meta)
        self.pruned_below = 0 if stored is None else _TS.unpack(stored)[0]
        self._reverse = self._key_layout() == LAYOUT_REVERSED

    def _key_layout(self) -> bytes:
        """KEYS_STORED_REVERSED for a new index; an index that has versions and no layout
        record was written before the layout existed, and keeps its keys as they are."""
        with self._env.begin(write=True, db=self._meta) as txn:
            layout = txn.get(_KEY_LAYOUT, db=self._meta)
            if layout is None:
                empty = txn.stat(self._primary)["entries"] == 0
                layout = LAYOUT_REVERSED if empty else LAYOUT_LEGACY
                txn.put(_KEY_LAYOUT, layout, db=self._meta)
        return bytes(layout)

    def _prefix(self, table_id: int, key: bytes) -> bytes:
        return _version_prefix(table_id, key[::-1] if self._reverse else key)

    def _prefixes(self, table_id: int, keys: Iterable[bytes]) -> list[bytes]:
        return _version_prefixes(table_id, (k[::-1] for k in keys) if self._reverse
                                 else keys)

    def _split(self, prefix: bytes) -> tuple[int, bytes]:
        table_id, key = _split_prefix(prefix)
        return table_id, key[::-1] if self._reverse else key

    def index_order(self, keys: Sequence[bytes]) -> np.ndarray:
        """The positions of ``keys`` in the order their versions lie in the index (one
        sort; numpy for keys of one width): a bulk load checks and writes them so."""
        if not keys:
            return np.zeros(0, np.int64)
        width = len(keys[0])
        if all(len(k) == width for k in keys):
            body = np.frombuffer(b"".join(keys), np.uint8).reshape(len(keys), width)
            if self._reverse:
                body = np.ascontiguousarray(body[:, ::-1])
            return np.argsort(body.view(f"S{width}").ravel(), kind="stable")
        prefixes = self._prefixes(0, keys)
        return np.array(sorted(range(len(keys)), key=prefixes.__getitem__), np.int64)

    def close(self) -> None:
        self._env.close()

    @property
    def env(self) -> lmdb.Environment:
        """The LMDB environment: refused_writes.py keeps its records in a named database
        of it (durable per write transaction, like the versions)."""
        return self._env

    def has_versions_at(self, ts: int) -> bool:
        """Whether any key has a version (a row or a tombstone) written at exactly ``ts``:
        whether a write at ``ts`` changed anything in this index."""
        start = _TS.pack(ts)
        try:
            with self._env.begin(db=self._by_ts) as txn:
                cursor = txn.cursor(db=self._by_ts)
                return bool(cursor.set_range(start)) and cursor.key()[:8] == start
        except lmdb.Error as exc:
            raise IndexBackendError(f"primary index read failed: {exc}") from exc

    def open_store(self, name: bytes) -> lmdb._Database:
        """A named database of this LMDB environment, for a store kept durable with the
        request's index versions (source_positions.py): its writes in a ``write_batch``
        commit with the batch, one fsync for both."""
        return self._env.open_db(name)

    def switch_primary(self, table_id: int, keys: Sequence[bytes], from_rows: Sequence[int],
                       to_rows: Sequence[int]) -> int:
        """Storage GC's primary switch (updatePrimaryResolved over every version): each
        version of ``keys[i]`` that points at ``from_rows[i]`` is pointed at
        ``to_rows[i]``, at its own timestamp; a version that points elsewhere (the key
        was replaced or deleted since) is left alone. One durable LMDB transaction;
        idempotent, and the reverse call undoes it. Returns versions switched."""
        switched = 0
        if not len(keys) == len(from_rows) == len(to_rows):
            raise ValueError("switch_primary: keys and rows differ in length")
        # In the index's order: each descent starts where the last ended (the switch holds
        # the node's one LMDB write transaction, which every writer waits for).
        order = self.index_order(keys).tolist()
        try:
            with self._env.begin(write=True, db=self._primary) as txn:
                cursor = txn.cursor(db=self._primary)
                for i in order:
                    key, old, new = keys[i], from_rows[i], to_rows[i]
                    prefix = self._prefix(table_id, key)
                    want = _ROW.pack(old)
                    if not cursor.set_range(prefix):
                        continue
                    hits = []
                    for version, value in cursor:
                        if not version.startswith(prefix) or len(version) != len(prefix) + 8:
                            break
                        if value == want:
                            hits.append(version)
                    for version in hits:
                        txn.put(version, _ROW.pack(new), db=self._primary)
                    switched += len(hits)
        except lmdb.Error as exc:
            raise IndexBackendError(f"primary switch failed: {exc}") from exc
        return switched

    # --- bulk load (retina_server/bulk_load.py) ---
    def load_conflicts(self, table_id: int, keys: Sequence[bytes], ts: int) -> list[int]:
        """LOAD_KEYS_HAVE_NO_LIVE_VERSION: the positions of ``keys`` a bulk load at ``ts``
        may not insert: a key whose latest version at or before ``ts`` is a row (live, or
        an orphan only a resolution could sort out), or that has any version after ``ts``
        (a later write the load would slip under). A key with no version, or whose
        versions up to ``ts`` end in a tombstone, is free. Keys with versions are found by
        ``_versioned`` (one descent per run of keys the index holds nothing between), and
        only their versions are walked."""
        prefixes = self._prefixes(table_id, keys)
        tombstone = _ROW.pack(TOMBSTONE)
        clash = []
        try:
            with self.transaction(write=False) as txn:
                cursor = txn.cursor(db=self._primary)
                for i in _versioned(cursor, prefixes):
                    prefix = prefixes[i]
                    cursor.set_range(prefix)
                    latest = None
                    for version, value in cursor:
                        if not version.startswith(prefix) or len(version) != len(prefix) + 8:
                            break
                        if _TS.unpack(version[-8:])[0] > ts:
                            latest = b"later"
                            break
                        latest = value
                    if latest is not None and latest != tombstone:
                        clash.append(i)
        except lmdb.Error as exc:
            raise IndexBackendError(f"primary index read failed: {exc}") from exc
        return clash

    def put_load_versions(self, table_id: int, keys: Sequence[bytes], row_ids: np.ndarray,
                          ts: int) -> None:
        """A bulk load's versions ``keys[i]@ts -> row_ids[i]`` (no key twice; any order:
        sorted here), with putmulti into both databases in one durable LMDB transaction:
        one fsync for the whole load. A database whose last entry sorts before the load's
        first is appended to (LMDB's append mode: no descent)."""
        if not len(keys):
            return
        versions, values, stamped = _load_items(table_id, keys, row_ids, ts, self._reverse)
        try:
            with self._env.begin(write=True, db=self._primary) as txn:
                for db, items in ((self._primary, zip(versions, values, strict=True)),
                                  (self._by_ts, ((k, b"") for k in stamped))):
                    cursor = txn.cursor(db=db)
                    first = versions[0] if db is self._primary else stamped[0]
                    append = not cursor.last() or cursor.key() < first
                    cursor.putmulti(items, append=append)
        except lmdb.Error as exc:
            raise IndexBackendError(f"bulk load index write failed: {exc}") from exc

    def versions_pointing_into(self, ranges: Sequence[tuple[int, int]],
                               limit: int = 5) -> list[tuple[int, bytes, int, int]]:
        """Versions (table, key, ts, rowId) whose rowId lies in one of the half-open
        ``ranges``; a full scan, used only when recovery finds row ids no journal
        explains."""
        found: list[tuple[int, bytes, int, int]] = []
        spans = sorted(ranges)
        starts = [a for a, _ in spans]
        with self._env.begin(db=self._primary) as txn:
            for version, value in txn.cursor(db=self._primary):
                (row_id,) = _ROW.unpack(value)
                i = bisect.bisect_right(starts, row_id) - 1
                if i >= 0 and row_id < spans[i][1]:
                    table_id, key = self._split(version[:-8])
                    found.append((table_id, key, _TS.unpack(version[-8:])[0], row_id))
                    if len(found) >= limit:
                        break
        return found

    @contextmanager
    def write_batch(self) -> Iterator[None]:
        """Every primary-index write inside the block is one durable LMDB transaction.

        One fsync per request instead of one per step. Reads inside the block
        see the block's own writes. If the commit fails nothing of the block
        is durable and IndexBackendError is raised.
        """
        if getattr(self._batch, "txn", None) is not None:
            yield  # already inside a batch
            return
        txn = self._env.begin(write=True, db=self._primary)
        self._batch.txn = txn
        try:
            yield
        except BaseException:
            txn.abort()
            raise
        else:
            try:
                fp.INDEX_PRIMARY_COMMIT_BEFORE.hit()
            except BaseException:
                txn.abort()
                raise
            try:
                txn.commit()
            except lmdb.Error as exc:
                raise IndexBackendError(f"primary index commit failed: {exc}") from exc
            fp.INDEX_PRIMARY_COMMIT_AFTER.hit()
        finally:
            self._batch.txn = None

    def candidates(self, table_id: int, keys: Sequence[bytes], ts: int,
                   later: dict[int, int] | None = None
                   ) -> list[tuple[int | None, int | None]] | None:
        """Per key: (the version at exactly ts, the latest version before ts); each a
        rowId, TOMBSTONE or None. None on a backend error. ``later``, if given, gets the
        timestamp of each key's first version after ``ts``, by position (no extra
        descent: the scan lands there first)."""
        try:
            batch = getattr(self._batch, "txn", None)
            if batch is not None:
                return self._scan(batch, table_id, keys, ts, later)
            with self._env.begin(db=self._primary) as txn:
                return self._scan(txn, table_id, keys, ts, later)
        except lmdb.Error as exc:
            log.error("primary_index_read_failed", table=table_id, error=str(exc))
            return None

    def _scan(self, txn: lmdb.Transaction[bytes], table_id: int, keys: Sequence[bytes],
              ts: int, later: dict[int, int] | None = None
              ) -> list[tuple[int | None, int | None]]:
        cursor = txn.cursor(db=self._primary)
        bound, own = _TS.pack(ts + 1), _TS.pack(ts)
        unpack = _ROW.unpack
        set_range, prev, last = cursor.set_range, cursor.prev, cursor.last
        key_at, value_at = cursor.key, cursor.value
        out: list[tuple[int | None, int | None]] = []
        for i, prefix in enumerate(self._prefixes(table_id, keys)):
            at: int | None = None
            before: int | None = None
            after = set_range(prefix + bound)
            if after and later is not None and (next_version := key_at()).startswith(prefix) \
                    and len(next_version) == len(prefix) + 8:
                later[i] = _TS.unpack(next_version[-8:])[0]
            moved = prev() if after else last()
            if moved and (found := key_at()).startswith(prefix):
                if found == prefix + own:
                    at = unpack(value_at())[0]
                    moved = prev() and key_at().startswith(prefix)
                if moved:
                    before = unpack(value_at())[0]
            out.append((at, before))
        return out

    def latest(self, table_id: int, keys: Sequence[bytes], ts: int) -> np.ndarray:
        """Per key, its latest version at or before ``ts``: the row id, or TOMBSTONE (-1)
        when that version is a tombstone or the key has none: the key's row at snapshot
        ``ts`` (LookupRows). One read transaction (the open batch's, its own writes
        included, inside one). Exact at every ``ts`` at or above ``pruned_below``
        (PRUNE_KEEPS_ANSWERS_ABOVE_HORIZON); the caller reads ``pruned_below`` after
        this and refuses a ``ts`` below it."""
        bound = _TS.pack(ts + 1)
        unpack = _ROW.unpack
        prefixes = self._prefixes(table_id, keys)
        # In key order: each descent starts where the last one ended in the B-tree's pages.
        order = sorted(range(len(prefixes)), key=prefixes.__getitem__)
        out = np.full(len(prefixes), TOMBSTONE, np.int64)
        try:
            with self.transaction(write=False) as txn:
                cursor = txn.cursor(db=self._primary)
                set_range, prev, last = cursor.set_range, cursor.prev, cursor.last
                key_at, value_at = cursor.key, cursor.value
                found = []
                for i in order:
                    prefix = prefixes[i]
                    if len(prefix) > _MAX_PREFIX:
                        continue  # longer than any key written (MAX_KEY_BYTES): no version
                    moved = prev() if set_range(prefix + bound) else last()
                    if moved and key_at().startswith(prefix):
                        found.append((i, unpack(value_at())[0]))
        except lmdb.Error as exc:
            raise IndexBackendError(f"primary index read failed: {exc}") from exc
        if found:
            at, rows = zip(*found, strict=True)
            out[list(at)] = rows
        return out

    def _write(self, table_id: int, items: Iterable[tuple[bytes, int, int]],
               what: str, keep_previous: bool = True) -> list[tuple[bytes, int, bytes | None]]:
        """Write versions (key, rowId, ts) in the open batch (or a transaction of their
        own); returns what each (key, ts) held before, for restorePrimaryEntries
        (skipped with ``keep_previous=False``: inside a batch, the abort is the undo)."""
        previous = []
        pack_ts, pack_row = _TS.pack, _ROW.pack
        items = list(items)
        prefixes = self._prefixes(table_id, (key for key, _, _ in items))
        stamps = [pack_ts(ts) for _, _, ts in items]
        versions = [p + t for p, t in zip(prefixes, stamps, strict=True)]
        try:
            with self.transaction() as txn:
                if keep_previous:
                    get = txn.get
                    previous = [(key, ts, get(v, db=self._primary))
                                for (key, _, ts), v in zip(items, versions, strict=True)]
                # putmulti: the puts of a request in one call (LMDB's loop, not ours)
                txn.cursor(db=self._primary).putmulti(
                    [(v, pack_row(row_id)) for v, (_, row_id, _) in
                     zip(versions, items, strict=True)])
                txn.cursor(db=self._by_ts).putmulti(
                    [(t + p, b"") for p, t in zip(prefixes, stamps, strict=True)])
        except lmdb.Error as exc:
            raise IndexBackendError(f"{what} failed: {exc}") from exc
        return previous

    @contextmanager
    def transaction(self, write: bool = True) -> Iterator[lmdb.Transaction[bytes]]:
        """The open batch (its own writes included) if there is one, else a transaction
        of its own (read-only unless ``write``). Also for a store of this environment
        (``open_store``): inside a batch its writes commit with the batch."""
        batch = getattr(self._batch, "txn", None)
        if batch is not None:
            yield batch
            return
        with self._env.begin(write=write, db=self._primary) as txn:
            yield txn

    def put_primary_entries_only(self, table_id: int, keys: Sequence[bytes],
                                 row_ids: Sequence[int], ts: int, *, keep_previous: bool = True
                                 ) -> list[tuple[bytes, int, bytes | None]]:
        """putPrimaryEntriesOnly: a version key@ts -> new rowId; returns what was there
        (for restorePrimaryEntries)."""
        return self._write(table_id, ((k, r, ts) for k, r in zip(keys, row_ids, strict=True)),
                           "putPrimaryEntriesOnly", keep_previous)

    def truncate_targets(self, table_id: int, ts: int,
                         vnode_of: Callable[[bytes], int]) -> dict[int, list[bytes]]:
        """The keys of ``table_id`` a TRUNCATE at ``ts`` has to delete, by virtual node,
        in the index's order: those whose latest version at or before ``ts`` is a row id (live,
        or an orphan that resolution sorts out). A key whose latest version before
        ``ts`` is a tombstone is dead already, and a key first written after ``ts``
        cannot be touched by it.

        A tombstone at exactly ``ts`` is this TRUNCATE (or a DELETE of the same
        update) applied before: a retry, or a replay over it. It does not make the
        key dead, so the version before ``ts`` decides, as for a DELETE
        (``delete_targets``): a replay that re-inserted the key at an earlier
        timestamp put a live row under that tombstone, and the TRUNCATE applied
        again must delete it (invariant REAPPLY_CONVERGES; the fault campaign found
        a phantom row here, seed 1132 episode 49). Re-applied over nothing new, it
        rewrites its own tombstones and deletes nothing.

        One sequential scan of the table's versions (inside the open batch, its own
        writes included) serves every virtual node of a request."""
        table = _TABLE.pack(table_id)
        bound = _TS.pack(ts)
        tombstone = _ROW.pack(TOMBSTONE)
        targets: dict[int, list[bytes]] = {}

        def settle(prefix: bytes | None, before: bytes | None, at: bytes | None) -> None:
            deciding = at if at is not None and at != tombstone else before
            if prefix is not None and deciding is not None and deciding != tombstone:
                key = self._split(prefix)[1]
                targets.setdefault(vnode_of(key), []).append(key)

        try:
            with self.transaction(write=False) as txn:
                cursor = txn.cursor(db=self._primary)
                prefix: bytes | None = None
                before: bytes | None = None  # the latest version before ts
                at: bytes | None = None  # the version at exactly ts
                if cursor.set_range(table):
                    for version, value in cursor:
                        if not version.startswith(table):
                            break
                        if version[:-8] != prefix:
                            settle(prefix, before, at)
                            prefix, before, at = version[:-8], None, None
                        stamp = version[-8:]  # big-endian: byte order is ts order
                        if stamp < bound:
                            before = value
                        elif stamp == bound:
                            at = value
                settle(prefix, before, at)
        except lmdb.Error as exc:
            raise IndexBackendError(f"primary index scan failed: {exc}") from exc
        return targets

    def tombstone_primary_resolved(self, table_id: int, keys: Sequence[bytes], ts: int) -> None:
        """tombstonePrimaryResolved: the keys' rows were deleted at ``ts``."""
        self._write(table_id, ((k, TOMBSTONE, ts) for k in keys), "tombstonePrimaryResolved",
                    keep_previous=False)

    def restore_primary_entries(self, table_id: int,
                                previous: Sequence[tuple[bytes, int, bytes | None]]) -> None:
        """restorePrimaryEntries: undo a putPrimaryEntriesOnly (compensation)."""
        try:
            with self.transaction() as txn:
                for key, ts, value in previous:
                    prefix = self._prefix(table_id, key)
                    version = prefix + _TS.pack(ts)
                    if value is None:
                        txn.delete(version, db=self._primary)
                        txn.delete(_TS.pack(ts) + prefix, db=self._by_ts)
                    else:
                        txn.put(version, value, db=self._primary)
        except lmdb.Error as exc:
            raise IndexBackendError(f"restorePrimaryEntries failed: {exc}") from exc

    def truncate_versions(self, min_ts: int, start_of: Callable[[int, bytes], int],
                          kept: Callable[[int, bytes, int, int], None] | None = None) -> int:
        """Remove every version written at or after its scope's replay start.

        ``start_of(table_id, key)`` gives the scope's start; only versions at or
        after ``min_ts`` (the smallest start) are looked at, through the
        by-timestamp index. Recovery calls this during cleansing so that the
        index holds exactly the state as of each replay start; replay redoes
        the rest. ``kept(table_id, key, ts, row_id)`` is told every version of
        that range that stays (in the same scan: the rewind checks them).
        Returns the number of versions removed.
        """
        removed = 0
        try:
            with self._env.begin(write=True) as txn:
                cursor = txn.cursor(db=self._by_ts)
                if not cursor.set_range(_TS.pack(min_ts)):
                    return 0
                doomed = []
                for entry in cursor.iternext(keys=True, values=False):
                    ts = _TS.unpack(entry[:8])[0]
                    table_id, key = self._split(entry[8:])
                    if ts >= start_of(table_id, key):
                        doomed.append((entry, entry[8:] + entry[:8]))
                    elif kept is not None:
                        value = txn.get(entry[8:] + entry[:8], db=self._primary)
                        if value is not None:
                            kept(table_id, key, ts, _ROW.unpack(value)[0])
                for by_ts, version in doomed:
                    txn.delete(by_ts, db=self._by_ts)
                    txn.delete(version, db=self._primary)
                    removed += 1
        except lmdb.Error as exc:
            raise IndexBackendError(f"primary index truncation failed: {exc}") from exc
        return removed

    # --- version pruning (the GC scheduler: retina_server/gc/gc_scheduler.py) ---
    def prune_versions(self, horizon: int, since: int = 0, *, keys_per_txn: int = 5_000,
                       entries_per_txn: int = 50_000,
                       below_horizon: BelowHorizon | None = None) -> int:
        """Remove the primary-index versions no resolution at or above ``horizon`` reads.

        Rule, per key: of its versions with ``ts < horizon`` only the latest one
        (call it L) stays, and L goes too when it is a TOMBSTONE. Versions at or
        above ``horizon`` are never touched; ``horizon <= 0`` removes nothing.

        Invariant PRUNE_KEEPS_ANSWERS_ABOVE_HORIZON: resolvePrimary and
        resolve_for_delete answer exactly as before at every ``T >= horizon``.
        Proof: per key both read only (a) the version at exactly ``T`` and (b) the
        latest version with ``ts < T``, and both give "no version" and a TOMBSTONE
        the same answer (nothing found). (a) has ``ts = T >= horizon``: untouched.
        (b): if the key has a version in ``[horizon, T)``, the latest of them is (b)
        before and after, untouched. Otherwise (b) was L: it is still there when it
        is a row id; when it was a TOMBSTONE, no version below ``horizon`` is left,
        so (b) is "no version", the same answer as the tombstone gave. QED.

        It holds through a rewind too: ``truncate_versions`` from a start
        ``s >= horizon`` keeps exactly the versions below ``s``, whose part below
        ``horizon`` is the same with or without the truncation, so pruning and
        truncation commute and the replay's resolutions (at ``T >= s``) are exact.
        That is why the scheduler's horizon is at most the replay floor (the lowest
        replay start any restart can use). Precondition: nothing writes a version
        below ``horizon`` afterwards (the scheduler's horizon is at most safeGcTs,
        below the HWM, so every write transaction below it has ended; a replay
        writes at or above its start).

        Incremental: after a prune at ``h1`` every key has at most one version below
        ``h1``, a row id, so at ``h2 > h1`` only keys with a version in ``[h1, h2)``
        can have anything to remove. They are found by scanning ``primary_by_ts``
        from ``since`` (the previous horizon; 0 for every key) up to ``horizon``.
        Bounded work: keys are pruned in LMDB write transactions of at most
        ``keys_per_txn`` keys (found within ``entries_per_txn`` by-timestamp
        entries), so a concurrent UpdateRecord waits for one short transaction at
        most. A key's versions and their ``primary_by_ts`` entries go in the same
        transaction: a crash leaves both dbs consistent and some keys not yet
        pruned (the next process prunes from ``since = 0`` and finds them).

        ``below_horizon(txn, horizon)``: what a store sharing this environment drops
        below the new horizon (source_positions.py), in the transaction that records
        it: no durable step of its own, and never without the horizon.

        Never call it inside a ``write_batch`` (one LMDB writer per thread:
        RuntimeError). Returns the number of versions removed; IndexBackendError on
        a storage failure (the transactions committed before it stay).
        """
        if getattr(self._batch, "txn", None) is not None:
            raise RuntimeError("prune_versions inside a write_batch would deadlock LMDB")
        if horizon <= 0 or since >= horizon:
            return 0
        self._raise_pruned_below(horizon, below_horizon)
        end = _TS.pack(horizon)
        position: bytes | None = _TS.pack(max(since, 0))
        removed = 0
        try:
            while position is not None:
                prefixes, position = self._keys_written(position, end, keys_per_txn,
                                                        entries_per_txn)
                if prefixes:
                    removed += self._prune_keys(sorted(prefixes), end)
        except lmdb.Error as exc:
            raise IndexBackendError(f"primary index pruning failed: {exc}") from exc
        return removed

    def _raise_pruned_below(self, horizon: int, below_horizon: BelowHorizon | None) -> None:
        """Record ``horizon`` (durably, then in memory) before any version below it goes:
        a reader that saw a pruned version reads ``pruned_below`` after it, and so sees
        at least this horizon (``latest``)."""
        if horizon <= self.pruned_below:
            return
        fp.INDEX_PRUNE_HORIZON_BEFORE.hit()
        try:
            with self._env.begin(write=True, db=self._meta) as txn:
                txn.put(_PRUNED_BELOW, _TS.pack(horizon), db=self._meta)
                if below_horizon is not None:
                    below_horizon(txn, horizon)
        except lmdb.Error as exc:
            raise IndexBackendError(f"primary index pruning horizon: {exc}") from exc
        self.pruned_below = horizon
        fp.INDEX_PRUNE_HORIZON_AFTER.hit()

    def _keys_written(self, start: bytes, end: bytes, max_keys: int,
                      max_entries: int) -> tuple[set[bytes], bytes | None]:
        """Distinct key prefixes of the ``primary_by_ts`` entries in ``[start, end)``,
        from ``start`` on, and the entry the next chunk starts at (None: done)."""
        found: set[bytes] = set()
        with self._env.begin(db=self._by_ts) as txn:
            cursor = txn.cursor(db=self._by_ts)
            if not cursor.set_range(start):
                return found, None
            for scanned, entry in enumerate(cursor.iternext(keys=True, values=False)):
                if entry[:8] >= end:
                    return found, None
                if len(found) >= max_keys or scanned >= max_entries:
                    return found, entry  # not consumed: the next chunk starts here
                found.add(entry[8:])
        return found, None

    def _prune_keys(self, prefixes: Sequence[bytes], end: bytes) -> int:
        """Apply the pruning rule to each key (``tableId|len|key``) in one write txn."""
        doomed: list[bytes] = []
        with self._env.begin(write=True, db=self._primary) as txn:
            cursor = txn.cursor(db=self._primary)
            for prefix in prefixes:
                width = len(prefix) + 8
                below: list[bytes] = []
                last = b""
                moved = cursor.set_range(prefix)
                while moved:
                    version = cursor.key()
                    if (len(version) != width or not version.startswith(prefix)
                            or version[-8:] >= end):
                        break
                    below.append(version)
                    last = cursor.value()
                    moved = cursor.next()
                if not below:
                    continue
                doomed.extend(below[:-1])
                if _ROW.unpack(last)[0] == TOMBSTONE:
                    doomed.append(below[-1])
            for version in doomed:
                txn.delete(version, db=self._primary)
                txn.delete(version[-8:] + version[:-8], db=self._by_ts)
        return len(doomed)

    def primary_version_count(self) -> int:
        """Versions in the primary index (LMDB's entry count: O(1))."""
        try:
            with self._env.begin() as txn:
                return int(txn.stat(self._primary)["entries"])
        except lmdb.Error as exc:
            raise IndexBackendError(f"primary index stat failed: {exc}") from exc

    def versions(self) -> list[tuple[int, bytes, int, int]]:
        """Every version as (tableId, key, ts, rowId or TOMBSTONE), in key then ts
        order. A full scan: for tests and diagnostics only."""
        with self._env.begin(db=self._primary) as txn:
            return [(*self._split(version[:-8]), _TS.unpack(version[-8:])[0],
                     _ROW.unpack(value)[0])
                    for version, value in txn.cursor(db=self._primary)]

    def version_index_mismatches(self, limit: int = 10) -> list[str]:
        """Diagnostics (a full scan of both dbs): versions without their
        ``primary_by_ts`` entry and entries without their version; [] when they agree."""
        problems: list[str] = []
        with self._env.begin(db=self._primary) as txn:
            for version in txn.cursor(db=self._primary).iternext(values=False):
                if txn.get(version[-8:] + version[:-8], db=self._by_ts) is None:
                    problems.append(f"version {version.hex()} has no by-ts entry")
                    if len(problems) >= limit:
                        return problems
            for entry in txn.cursor(db=self._by_ts).iternext(values=False):
                if txn.get(entry[8:] + entry[:8], db=self._primary) is None:
                    problems.append(f"by-ts entry {entry.hex()} has no version")
                    if len(problems) >= limit:
                        return problems
        return problems
