"""The time map: wall-clock time -> timestamp, for ``BeginTrans.as_of_time_ms``.

The TransServer samples ``(wall ms, HWM)`` every ``trans.time_map_sample_ms`` while the
HWM moves. A time T resolves to the HWM of the latest sample at or before T: a commit
made at or before T (the newest one, to within one sample interval). Samples are kept
in *chunks* of at most ``CHUNK_SAMPLES``, delta- and varint-encoded (about three bytes
a sample), one etcd key each (``/pixels/trans/history/timemap/<first wall ms>``); the
open chunk is written every ``trans.time_map_flush_ms``, and chunks whose every sample
is at or below the GC horizon are pruned (what they resolve to is no longer readable).

Each TransServer incarnation is a *segment*: its chunks carry its start and their
sequence number in it, and say how far they *cover* (the last time the sampler ran
before the flush). Between two chunks that do not follow each other (another segment,
or a missing sequence number) lies a *gap*:

* after a clean stop (the last chunk is *closed*) nothing committed until the next
  start, so a time in the gap resolves to the last HWM before it;
* after a crash, commits between the last flush and the crash were not recorded:
  a time between the last covered time and the restart is ambiguous, and refused
  (:class:`TimeUnmapped`) rather than guessed (TIME_MAP_NEVER_GUESSES).

Invariant TIME_RESOLVES_AT_OR_BEFORE: ``resolve(T)`` is the HWM at some moment at or
before T, so every row it reads was committed at or before T.
"""

from __future__ import annotations

import threading
from bisect import bisect_right
from collections.abc import Callable
from dataclasses import dataclass, field

from retina_common import varint
from retina_common.etcd import EtcdError, EtcdStore
from retina_common.failpoints import TRANS_TIME_MAP_FLUSH_AFTER, TRANS_TIME_MAP_FLUSH_BEFORE
from retina_common.keys import TIME_MAP_PREFIX, time_map_chunk_key
from retina_common.log import get_logger

log = get_logger(component="time_map")

FORMAT_VERSION = 1
CHUNK_SAMPLES = 64  # a flush rewrites at most this many samples (~200 bytes)


class TimeMapError(Exception):
    """A time the map cannot resolve (the subclasses say why)."""


class TimeInFuture(TimeMapError):
    pass


class TimeBeforeMap(TimeMapError):
    """Before the oldest sample kept: older than anything still readable."""


class TimeUnmapped(TimeMapError):
    """Inside a gap a crash left: ``gap`` is its (from_ms, to_ms)."""

    def __init__(self, message: str, gap: tuple[int, int]) -> None:
        super().__init__(message)
        self.gap = gap


@dataclass(eq=False)  # chunks are compared by identity
class Chunk:
    segment_ms: int  # when its TransServer incarnation began sampling
    seq: int  # its place in the segment: a missing number is a gap
    walls: list[int] = field(default_factory=list)
    hwms: list[int] = field(default_factory=list)
    covered_to_ms: int = 0  # the map is complete up to here
    closed: bool = False  # the segment ended with a clean stop

    @property
    def key(self) -> str:
        return time_map_chunk_key(self.walls[0])

    def follows(self, other: Chunk) -> bool:
        return self.segment_ms == other.segment_ms and self.seq == other.seq + 1


def encode_chunk(chunk: Chunk) -> bytes:
    """version u8 | flags u8 (1: closed) | varints: segment_ms, seq, n,
    covered_to - last wall, wall0, hwm0, then n-1 (wall delta, hwm delta)."""
    walls, hwms = chunk.walls, chunk.hwms
    head = [chunk.segment_ms, chunk.seq, len(walls), chunk.covered_to_ms - walls[-1],
            walls[0], hwms[0]]
    deltas = [v for i in range(1, len(walls))
              for v in (walls[i] - walls[i - 1], hwms[i] - hwms[i - 1])]
    return bytes([FORMAT_VERSION, 1 if chunk.closed else 0]) + varint.encode(head + deltas)


def decode_chunk(data: bytes) -> Chunk:
    """Raises ValueError on anything but a well-formed chunk."""
    if len(data) < 2 or data[0] != FORMAT_VERSION or data[1] not in (0, 1):
        raise ValueError("not a time-map chunk of this version")
    head, offset = varint.decode(data, 6, 2)
    segment_ms, seq, n, covered, wall, hwm = (int(v) for v in head)
    if n < 1:
        raise ValueError("a chunk without samples")
    deltas, end = varint.decode(data, 2 * (n - 1), offset)
    if end != len(data):
        raise ValueError("trailing bytes after the samples")
    walls, hwms = [wall], [hwm]
    for i in range(n - 1):
        walls.append(walls[-1] + int(deltas[2 * i]))
        hwms.append(hwms[-1] + int(deltas[2 * i + 1]))
    return Chunk(segment_ms, seq, walls, hwms, walls[-1] + covered, bool(data[1]))


class TimeMap:
    """Thread-safe. ``load`` then ``start`` once, then ``sample`` / ``flush`` from one
    thread; ``resolve`` and the queries from any."""

    def __init__(self, store: EtcdStore, clock_ms: Callable[[], int],
                 chunk_samples: int = CHUNK_SAMPLES) -> None:
        self._store = store
        self._clock_ms = clock_ms
        self._chunk_samples = chunk_samples
        self._lock = threading.Lock()
        self._chunks: list[Chunk] = []
        self._open: Chunk | None = None
        self._dirty: list[Chunk] = []  # written at the next flush
        self._pruned: list[str] = []  # keys deleted at the next flush

    # --- life cycle ---
    def load(self) -> int:
        """Read the stored chunks; a chunk that does not decode is left out (logged): the
        hole it leaves is a gap, never a guess. Returns how many were loaded."""
        kvs, _revision = self._store.get_prefix(TIME_MAP_PREFIX)
        chunks = []
        for kv in kvs:
            try:
                chunk = decode_chunk(kv.value)
            except ValueError as exc:
                log.error("time_map_chunk_unreadable", key=kv.key, error=str(exc))
                continue
            if chunk.key == kv.key:
                chunks.append(chunk)
        with self._lock:
            self._chunks = sorted(chunks, key=lambda c: c.walls[0])
        return len(chunks)

    def start(self, hwm: int) -> None:
        """Open this incarnation's segment with its first sample."""
        with self._lock:
            now = self._monotonic_now()
            self._open = Chunk(now, 0, [now], [hwm], now)
            self._chunks.append(self._open)
            self._dirty.append(self._open)

    def _monotonic_now(self) -> int:
        """Wall ms, never before a sample already kept (a clock stepped back)."""
        now = self._clock_ms()
        if self._chunks:
            last = self._chunks[-1]
            now = max(now, last.walls[-1], last.covered_to_ms + (last is not self._open))
        return now

    def sample(self, hwm: int) -> None:
        """Record the HWM now (only when it moved); the map covers up to now."""
        with self._lock:
            chunk = self._open
            assert chunk is not None, "TimeMap.start first"
            now = self._monotonic_now()
            if hwm != chunk.hwms[-1]:
                if len(chunk.walls) >= self._chunk_samples:
                    chunk = self._rotate(chunk, now)
                    now = chunk.covered_to_ms
                chunk.walls.append(now)
                chunk.hwms.append(hwm)
            chunk.covered_to_ms = now
            if chunk not in self._dirty:
                self._dirty.append(chunk)

    def _rotate(self, full: Chunk, now: int) -> Chunk:
        """Close a full chunk (written once more at the next flush) and open the next one;
        its first sample is at least a millisecond later (a distinct key)."""
        full.covered_to_ms = now
        if full not in self._dirty:
            self._dirty.append(full)
        now = max(now, full.walls[0] + 1)
        chunk = self._open = Chunk(full.segment_ms, full.seq + 1, [], [], now)
        self._chunks.append(chunk)
        return chunk

    def close(self, hwm: int) -> None:
        """A clean stop: the last sample, marked closed, flushed."""
        self.sample(hwm)
        with self._lock:
            assert self._open is not None
            self._open.closed = True
        self.flush()

    def flush(self) -> bool:
        """Write the chunks changed since the last flush, delete pruned ones. An etcd
        error is logged and retried by the next flush; returns whether all landed."""
        with self._lock:
            writes = [(c.key, encode_chunk(c)) for c in self._dirty]
            deletes = list(self._pruned)
            self._dirty = [c for c in self._dirty if c is self._open]
        try:
            TRANS_TIME_MAP_FLUSH_BEFORE.hit()
            for key, data in writes:
                self._store.put(key, data)
            TRANS_TIME_MAP_FLUSH_AFTER.hit()
            for key in deletes:
                self._store.delete(key)
        except EtcdError as exc:
            log.warning("time_map_flush_failed", error=str(exc))
            with self._lock:  # written again, as they are then, by the next flush
                written = {k for k, _ in writes}
                self._dirty = [c for c in self._chunks if c.key in written or c in self._dirty]
            return False
        with self._lock:
            self._pruned = [k for k in self._pruned if k not in deletes]
        return True

    def prune(self, horizon: int) -> int:
        """Forget the oldest chunks whose every sample is at or below ``horizon`` (a time
        they resolve is no longer readable); the open chunk stays. Returns how many."""
        with self._lock:
            gone = 0
            while len(self._chunks) > 1 and self._chunks[0] is not self._open and \
                    self._chunks[0].hwms[-1] <= horizon:
                chunk = self._chunks.pop(0)
                self._pruned.append(chunk.key)
                if chunk in self._dirty:
                    self._dirty.remove(chunk)
                gone += 1
            return gone

    # --- queries ---
    def resolve(self, time_ms: int) -> int:
        """The HWM of the latest sample at or before ``time_ms``; raises TimeInFuture,
        TimeBeforeMap or TimeUnmapped."""
        with self._lock:
            if time_ms > self._clock_ms():
                raise TimeInFuture(f"{time_ms} ms is in the future")
            i = self._chunk_at(time_ms)
            if i < 0:
                first = self._chunks[0].walls[0] if self._chunks else 0
                raise TimeBeforeMap(f"{time_ms} ms is before the time map's first "
                                    f"sample ({first} ms)")
            chunk = self._chunks[i]
            j = bisect_right(chunk.walls, time_ms) - 1
            if j < len(chunk.walls) - 1 or self._covers(i, time_ms):
                return chunk.hwms[j]
            nxt = self._chunks[i + 1] if i + 1 < len(self._chunks) else None
            gap = (chunk.covered_to_ms, nxt.walls[0] if nxt else self._clock_ms())
            raise TimeUnmapped(f"{time_ms} ms lies in [{gap[0]}, {gap[1]}) ms, after the "
                               "TransServer's last recorded time and before its restart: "
                               "commits made then are not known", gap)

    def _chunk_at(self, time_ms: int) -> int:
        return bisect_right([c.walls[0] for c in self._chunks], time_ms) - 1

    def _covers(self, i: int, time_ms: int) -> bool:
        """Whether a time after chunk i's last sample still resolves to that sample."""
        chunk = self._chunks[i]
        if chunk is self._open or chunk.closed or time_ms <= chunk.covered_to_ms:
            return True
        nxt = self._chunks[i + 1] if i + 1 < len(self._chunks) else None
        return nxt is not None and nxt.follows(chunk)

    def hwm_at_or_before(self, time_ms: int) -> int | None:
        """The HWM of the latest sample at or before ``time_ms``, gaps or not (it is
        never above the HWM of that time); None before the first sample."""
        with self._lock:
            i = self._chunk_at(time_ms)
            if i < 0:
                return None
            chunk = self._chunks[i]
            return chunk.hwms[bisect_right(chunk.walls, time_ms) - 1]

    def earliest_time_at_or_above(self, ts: int) -> int:
        """The first sample's time whose HWM is at least ``ts`` (0: none yet): the
        earliest time that resolves to ``ts`` or later."""
        with self._lock:
            for chunk in self._chunks:
                if chunk.hwms[-1] >= ts:
                    return chunk.walls[bisect_right(chunk.hwms, ts - 1)]
            return 0

    def gaps(self) -> list[tuple[int, int]]:
        """The [from, to) ranges :meth:`resolve` refuses, oldest first."""
        with self._lock:
            return [(c.covered_to_ms, n.walls[0])
                    for c, n in zip(self._chunks, self._chunks[1:], strict=False)
                    if not (c.closed or n.follows(c)) and n.walls[0] > c.covered_to_ms]

    def first_ms(self) -> int:
        with self._lock:
            return self._chunks[0].walls[0] if self._chunks else 0
