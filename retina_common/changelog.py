"""The durable changelog: every source transaction, with its Retina timestamp
and source position, stored before anything is sent (specification section 6).

Layout under the changelog root (a local directory or any pyarrow.fs URI)::

    segments/batch/<firstTs>-<lastTs>.parquet        one per batch, every virtual node
    batches/<firstTs>-<lastTs>.rec                   the batch record (the commit point)
    retained_from.rcw                                the retention low-watermark

A batch's segment holds the rows of all its virtual nodes (a ``vnode`` column,
sorted by it), so a batch costs two durable writes whatever the number of
virtual nodes. Changelogs written before that hold one segment per batch and
virtual node, ``segments/vnode=0003/<firstTs>-<lastTs>.parquet``; their records
name them so (no ``dir``), and they are read and dropped as before.

A batch (one or more source transactions, timestamps ascending) is durable
once its batch record is: segments are written and fsynced first, then the
record naming them with their length and CRC32C. A segment no record names
(a crash between the two) is never read and is removed by retention. Rows
carry the encoded primary key and column values exactly as UpdateRecord
sends them, so replay never re-encodes and never consults the source.

A segment row is one net effect of one transaction on one key: ``op`` 0 is a
DELETE, 1 a CDC replace (DELETE + INSERT of the same key); or ``op`` 2, a
TRUNCATE of the table in the segment's virtual node (empty key, applied
before the other rows of its timestamp); or ``op`` 3, a partial update
(docs/encoding.md, "Partial updates"): ``values`` are its target columns'
values, in the order of the row's ``targets`` (a ``targets`` column the segment
has only when it holds a partial update). Replay reads a
virtual node from a timestamp, inclusive, in (ts, seq) order.

The record format: ``RCLB2 <length> <crc32c>\\n`` then a JSON body of that
length (``RCLB1`` for a record of the older layout, or of a batch without rows;
``RCLB3`` for a batch holding a partial update, so that a reader from before
partial updates stops at it, CorruptChangelog, instead of replaying one as a DELETE).
A corrupt record or segment raises :class:`CorruptChangelog`; it is
never read as absent.

The retention low-watermark (``RCLW1 <length> <crc32c>\\n`` + JSON
``{"retainedFromTs": N}``) is the lowest timestamp from which the changelog
still holds every batch. Retention writes it, durably, before it deletes
anything, so a crash in between leaves a low-watermark above data that is
still there (harmless), never below data that is gone. No file: nothing was
ever dropped, the changelog holds everything from 0. :meth:`Changelog.read`
refuses (:class:`ChangelogGap`) a start below it rather than replay less.
"""

from __future__ import annotations

import io
import json
import re
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import crc32c
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from retina_common import storage
from retina_common.failpoints import (
    CDC_CHANGELOG_RECORD_AFTER,
    CDC_CHANGELOG_SEGMENTS_AFTER,
    CDC_RETENTION_WATERMARK_AFTER,
    CDC_RETENTION_WATERMARK_BEFORE,
)

if TYPE_CHECKING:
    from retina_common.config import Config

# TRUNCATE: every row of the table in the row's virtual node (key b"", no values).
DELETE, REPLACE, TRUNCATE, PARTIAL = 0, 1, 2, 3
# RCLB2: a record naming a batch's shared segment (``dir``). A connector or replay job
# from before that layout reads it as not a record (CorruptChangelog, a clear stop)
# instead of looking for per-virtual-node files that are not there. RCLB1 records
# (one segment per virtual node) are still read.
_MAGIC = "RCLB2"
_MAGIC_V1 = "RCLB1"
_MAGIC_PARTIAL = "RCLB3"  # a batch with a partial update (op 3): see the module doc
_WATERMARK_MAGIC = "RCLW1"
WATERMARK_NAME = "retained_from.rcw"
_RECORD = re.compile(r"^(\d{20})-(\d{20})\.rec$")
SEGMENT_SCHEMA = pa.schema([
    ("ts", pa.int64()), ("seq", pa.int32()), ("table", pa.string()), ("op", pa.int8()),
    ("key", pa.binary()), ("values", pa.list_(pa.binary())),
])
SHARED_SEGMENT_SCHEMA = SEGMENT_SCHEMA.append(pa.field("vnode", pa.int32()))
TARGETS_FIELD = pa.field("targets", pa.list_(pa.string()))  # partial updates only


def changelog_root(config: Config) -> str:
    """Where the changelog lives: ``cdc.changelog_root``, else ``_changelog`` under storage.

    Here, not in the connector's process module, because the Spark replay job needs it too."""
    return config.cdc.changelog_root or storage.file_uri(storage.root_uri(config.storage.root),
                                                         "_changelog")


class CorruptChangelog(Exception):
    """A batch record, segment or the low-watermark fails its length or CRC32C check."""


class ChangelogGap(Exception):
    """A replay needs timestamps retention has already dropped: replaying what
    is left would silently lose data. ``short`` maps each virtual node that
    needs more to its needed start (inclusive)."""

    def __init__(self, short: Mapping[int, int], retained_from_ts: int) -> None:
        self.short = dict(sorted(short.items()))
        self.retained_from_ts = retained_from_ts
        # The virtual node that needs the oldest timestamp, and that timestamp.
        self.vnode, self.needed_ts = min(self.short.items(),
                                         key=lambda item: (item[1], item[0]))
        super().__init__(f"replay gap: vnode {self.vnode} needs the changelog from ts "
                         f"{self.needed_ts}, it holds ts >= {retained_from_ts} only "
                         f"({len(self.short)} virtual node(s) short)")


# Not frozen: a frozen dataclass is built through object.__setattr__, five times slower
# (0.6 against 0.12 µs), and the connector builds two rows per change (translated, then
# stamped with its timestamp). Nothing mutates a row once built.
@dataclass(slots=True)
class ChangeRow:
    ts: int
    seq: int
    vnode: int
    table: str
    op: int
    key: bytes
    values: tuple[bytes, ...] | None  # encoded column values; None for DELETE
    # A partial update's target columns (``values`` holds theirs, in this order).
    targets: tuple[str, ...] | None = None


@dataclass
class LoggedTransaction:
    ts: int
    position: str
    source_txid: str
    commit_time_ms: int
    rows: list[ChangeRow] = field(default_factory=list)


@dataclass(frozen=True)
class SegmentRef:
    """The rows of one virtual node in a batch: ``rows`` of them in the file ``dir/name``,
    whose ``length`` and CRC32C are checked on every read. ``dir`` is ``segments/batch``
    for a segment shared by every virtual node of its batch (the refs of one batch then
    name the same file), or empty for the older one-file-per-virtual-node layout."""

    vnode: int
    name: str
    rows: int
    length: int
    crc32c: int
    dir: str = ""

    @property
    def path(self) -> tuple[str, str]:
        return (self.dir or _segment_dir(self.vnode), self.name)


@dataclass(frozen=True)
class BatchRecord:
    first_ts: int
    last_ts: int
    transactions: tuple[dict, ...]  # {"ts", "position", "sourceTxid", "commitTimeMs", "rows"}
    segments: tuple[SegmentRef, ...]
    partial: bool = False  # it holds a partial update (RCLB3)

    @property
    def name(self) -> str:
        return f"{self.first_ts:020d}-{self.last_ts:020d}.rec"

    @property
    def last_position(self) -> str:
        return self.transactions[-1]["position"]

    def to_bytes(self) -> bytes:
        body = json.dumps({
            "firstTs": self.first_ts, "lastTs": self.last_ts,
            "transactions": list(self.transactions),
            "segments": [{"vnode": s.vnode, "name": s.name, "rows": s.rows,
                          "length": s.length, "crc32c": s.crc32c,
                          **({"dir": s.dir} if s.dir else {})} for s in self.segments],
        }, separators=(",", ":")).encode()
        magic = _MAGIC_PARTIAL if self.partial else \
            _MAGIC if any(s.dir for s in self.segments) else _MAGIC_V1
        return f"{magic} {len(body)} {crc32c.crc32c(body)}\n".encode() + body

    @classmethod
    def parse(cls, data: bytes, where: str) -> BatchRecord:
        head, _, body = data.partition(b"\n")
        parts = head.decode(errors="replace").split(" ")
        if len(parts) != 3 or parts[0] not in (_MAGIC, _MAGIC_V1, _MAGIC_PARTIAL) or \
                not all(p.isdigit() for p in parts[1:]):
            raise CorruptChangelog(f"{where}: not a changelog batch record")
        if len(body) != int(parts[1]) or crc32c.crc32c(body) != int(parts[2]):
            raise CorruptChangelog(f"{where}: length or CRC32C mismatch")
        d = json.loads(body)
        return cls(int(d["firstTs"]), int(d["lastTs"]), tuple(d["transactions"]),
                   tuple(SegmentRef(int(s["vnode"]), s["name"], int(s["rows"]),
                                    int(s["length"]), int(s["crc32c"]), s.get("dir", ""))
                         for s in d["segments"]), parts[0] == _MAGIC_PARTIAL)


def transaction_positions(records: Iterable[BatchRecord]) -> dict[int, str]:
    """ts -> source position of every transaction of ``records``: what a request built
    from their rows carries as ``TableUpdateData.source_position``."""
    return {int(t["ts"]): t["position"] for r in records for t in r.transactions}


def encode_watermark(retained_from_ts: int) -> bytes:
    body = json.dumps({"retainedFromTs": retained_from_ts}, separators=(",", ":")).encode()
    return f"{_WATERMARK_MAGIC} {len(body)} {crc32c.crc32c(body)}\n".encode() + body


def parse_watermark(data: bytes) -> int:
    head, _, body = data.partition(b"\n")
    parts = head.decode(errors="replace").split(" ")
    if len(parts) != 3 or parts[0] != _WATERMARK_MAGIC or \
            not all(p.isdigit() for p in parts[1:]):
        raise CorruptChangelog(f"{WATERMARK_NAME}: not a changelog low-watermark")
    if len(body) != int(parts[1]) or crc32c.crc32c(body) != int(parts[2]):
        raise CorruptChangelog(f"{WATERMARK_NAME}: length or CRC32C mismatch")
    return int(json.loads(body)["retainedFromTs"])


SHARED_DIR = "segments/batch"


def _segment_dir(vnode: int) -> str:
    return f"segments/vnode={vnode:04d}"


def encode_segment(rows: list[ChangeRow], *, with_vnode: bool = True) -> bytes:
    columns = {
        "ts": pa.array([r.ts for r in rows], pa.int64()),
        "seq": pa.array([r.seq for r in rows], pa.int32()),
        "table": pa.array([r.table for r in rows], pa.string()),
        "op": pa.array([r.op for r in rows], pa.int8()),
        "key": pa.array([r.key for r in rows], pa.binary()),
        "values": pa.array([None if r.values is None else list(r.values) for r in rows],
                           pa.list_(pa.binary())),
    }
    schema = SEGMENT_SCHEMA
    if with_vnode:
        columns["vnode"] = pa.array([r.vnode for r in rows], pa.int32())
        schema = SHARED_SEGMENT_SCHEMA
    if any(r.op == PARTIAL for r in rows):
        columns["targets"] = pa.array([None if r.targets is None else list(r.targets)
                                       for r in rows], TARGETS_FIELD.type)
        schema = schema.append(TARGETS_FIELD)
    out = io.BytesIO()
    pq.write_table(pa.table(columns, schema=schema), out, compression="zstd")
    return out.getvalue()


def decode_segment(data: bytes, vnodes: set[int], only: int | None = None
                   ) -> dict[int, list[ChangeRow]]:
    """The rows of each of ``vnodes`` in a segment. A one-virtual-node segment (no
    ``vnode`` column) holds ``only``'s rows."""
    table = pq.read_table(io.BytesIO(data))
    names = ("ts", "seq", "table", "op", "key", "values")
    if "vnode" in table.column_names:
        wanted = pc.is_in(table.column("vnode"), pa.array(sorted(vnodes), pa.int32()))
        table = table.filter(wanted)
        vnode_of = table.column("vnode").to_pylist()
    else:
        assert only is not None, "a one-virtual-node segment needs its virtual node"
        vnode_of = [only] * table.num_rows
    cols = [table.column(n).to_pylist() for n in names]
    targets = table.column("targets").to_pylist() if "targets" in table.column_names \
        else [None] * table.num_rows
    out: dict[int, list[ChangeRow]] = {}
    for v, ts, seq, t, op, key, values, names_ in zip(vnode_of, *cols, targets, strict=True):
        out.setdefault(v, []).append(
            ChangeRow(ts, seq, v, t, op, key, None if values is None else tuple(values),
                      None if names_ is None else tuple(names_)))
    return out


class Changelog:
    def __init__(self, root: str) -> None:
        self.root = storage.root_uri(root)

    def _uri(self, sub: str) -> str:
        return storage.file_uri(self.root, sub)

    def append(self, transactions: list[LoggedTransaction]) -> BatchRecord:
        """Make a batch durable; returns its record. Timestamps must ascend."""
        stamps = [t.ts for t in transactions]
        if not stamps or stamps != sorted(stamps) or len(set(stamps)) != len(stamps):
            raise ValueError("a batch needs distinct, ascending timestamps")
        first, last = stamps[0], stamps[-1]
        by_vnode: dict[int, list[ChangeRow]] = {}
        for trans in transactions:
            for row in trans.rows:
                by_vnode.setdefault(row.vnode, []).append(row)
        name = f"{first:020d}-{last:020d}.parquet"
        # One segment for every virtual node of the batch, sorted by virtual node: one
        # durable write (a file and a directory fsync) instead of one per virtual node.
        ordered = sorted(by_vnode.items())
        refs: list[SegmentRef] = []
        if ordered:
            data = encode_segment([row for _vnode, vrows in ordered for row in vrows])
            storage.write_durably(self._uri(SHARED_DIR), name, data)
            length, crc = len(data), crc32c.crc32c(data)
            refs = [SegmentRef(vnode, name, len(vrows), length, crc, SHARED_DIR)
                    for vnode, vrows in ordered]
        CDC_CHANGELOG_SEGMENTS_AFTER.hit()
        record = BatchRecord(first, last, tuple(
            {"ts": t.ts, "position": t.position, "sourceTxid": t.source_txid,
             "commitTimeMs": t.commit_time_ms, "rows": len(t.rows)} for t in transactions),
            tuple(refs), any(r.op == PARTIAL for t in transactions for r in t.rows))
        storage.write_durably(self._uri("batches"), record.name, record.to_bytes())
        CDC_CHANGELOG_RECORD_AFTER.hit()
        return record

    def _list(self, sub: str) -> list[str]:
        fs, base = pafs.FileSystem.from_uri(self._uri(sub))
        try:
            infos = fs.get_file_info(pafs.FileSelector(base, allow_not_found=True))
        except FileNotFoundError:
            return []
        return sorted(i.base_name for i in infos if i.type == pafs.FileType.File)

    def records(self, from_ts: int = 0) -> list[BatchRecord]:
        """Every durable batch whose range reaches ``from_ts`` or later, in ts order."""
        out = []
        for name in self._list("batches"):
            match = _RECORD.match(name)
            if match and int(match.group(2)) >= from_ts:
                out.append(BatchRecord.parse(storage.read_bytes(self._uri("batches"), name),
                                             name))
        return out

    def _read_segments(self, refs: list[SegmentRef]) -> dict[int, list[ChangeRow]]:
        """The rows of each ref's virtual node; a file several refs share is read (and
        checked) once."""
        by_path: dict[tuple[str, str], list[SegmentRef]] = {}
        for ref in refs:
            by_path.setdefault(ref.path, []).append(ref)
        out: dict[int, list[ChangeRow]] = {}
        for (directory, name), same in by_path.items():
            data = storage.read_bytes(self._uri(directory), name)
            first = same[0]
            if len(data) != first.length or crc32c.crc32c(data) != first.crc32c:
                raise CorruptChangelog(f"segment {directory}/{name}: length or CRC32C "
                                       "mismatch")
            rows = decode_segment(data, {r.vnode for r in same},
                                  None if first.dir else first.vnode)
            for ref in same:
                got = rows.get(ref.vnode, [])
                if len(got) != ref.rows:
                    raise CorruptChangelog(f"segment {directory}/{name}: {len(got)} rows of "
                                           f"virtual node {ref.vnode}, the record says "
                                           f"{ref.rows}")
                out[ref.vnode] = got
        return out

    def retained_from(self) -> int:
        """The low-watermark: every batch at or above it is still here (0: all of them)."""
        try:
            data = storage.read_bytes(self.root, WATERMARK_NAME)
        except FileNotFoundError:
            return 0  # retention never dropped anything
        return parse_watermark(data)

    def check_retained(self, starts: Mapping[int, int]) -> int:
        """The low-watermark; raises :class:`ChangelogGap` if a start (vnode →
        first ts, inclusive) lies below it."""
        retained = self.retained_from()
        short = {v: ts for v, ts in starts.items() if ts < retained}
        if short:
            raise ChangelogGap(short, retained)
        return retained

    def read(self, starts: Mapping[int, int], upto_ts: int | None = None,
             records: Iterable[BatchRecord] | None = None) -> Iterator[ChangeRow]:
        """Rows of the virtual nodes in ``starts`` (vnode → first ts, inclusive),
        up to ``upto_ts`` inclusive, in (ts, seq) order. Raises
        :class:`ChangelogGap` rather than silently skip dropped batches."""
        if not starts:
            return
        self.check_retained(starts)
        low = min(starts.values())
        try:
            for record in (self.records(low) if records is None else records):
                read = self._read_segments([r for r in record.segments if r.vnode in starts])
                rows = [row for vnode, vrows in read.items() for row in vrows
                        if row.ts >= starts[vnode] and (upto_ts is None or row.ts <= upto_ts)]
                rows.sort(key=lambda r: (r.ts, r.vnode, r.seq))
                yield from rows
        except FileNotFoundError:
            self.check_retained(starts)  # retention deleted it under us: say so
            raise
        # Retention may have run while we read: the low-watermark goes up before
        # any batch is deleted, so a batch that vanished under us shows here.
        self.check_retained(starts)

    def drop_before(self, horizon_ts: int) -> int:
        """Retention: remove every batch whose last timestamp is below
        ``horizon_ts``, then segments no record names. Returns batches removed.

        The low-watermark is raised first (durably), so no reader ever takes
        the changelog for holding a batch that is gone. Each batch's record
        goes before its segments, so no reader finds a record without them."""
        records = self.records(0)
        doomed = [r for r in records if r.last_ts < horizon_ts]
        if doomed:
            self._raise_watermark(max(r.last_ts for r in doomed) + 1)
        for record in doomed:
            storage.delete_quietly(self._uri("batches"), record.name)
            for directory, name in {ref.path for ref in record.segments}:
                storage.delete_quietly(self._uri(directory), name)
        named = {ref.path for r in records if r.last_ts >= horizon_ts for ref in r.segments}
        self._drop_orphans(named, horizon_ts)
        return len(doomed)

    def _raise_watermark(self, retained_from_ts: int) -> None:
        # Never lowered: a horizon that goes back down (a new node, an unreadable
        # slot) cannot bring dropped batches back. Timestamps between the last
        # dropped batch and the first kept one carry no changelog rows, so the
        # changelog holds everything from just past the last dropped batch.
        current = self.retained_from()
        if retained_from_ts <= current:
            return
        CDC_RETENTION_WATERMARK_BEFORE.hit()
        storage.write_durably(self.root, WATERMARK_NAME, encode_watermark(retained_from_ts))
        CDC_RETENTION_WATERMARK_AFTER.hit()

    def _drop_orphans(self, named: set[tuple[str, str]], horizon_ts: int) -> None:
        # A segment whose record was never written (crash in between) is dead,
        # but only once a later batch exists: the newest one may be mid-write.
        fs, base = pafs.FileSystem.from_uri(self._uri("segments"))
        infos = fs.get_file_info(pafs.FileSelector(base, allow_not_found=True, recursive=True))
        for info in infos:
            if info.type != pafs.FileType.File or not info.base_name.endswith(".parquet"):
                continue
            directory = "segments/" + info.path.rstrip("/").rsplit("/", 2)[-2]
            last = int(info.base_name.split("-")[1].split(".")[0])
            if (directory, info.base_name) not in named and last < horizon_ts:
                storage.delete_quietly(self._uri(directory), info.base_name)
