"""LEB128 varints over numpy arrays: compact integer sequences for durable formats.

Used where many small non-negative integers (deltas) are stored: the TransServer's time
map (trans_gate/time_map.py) and the deletion chains of a checkpoint
(retina_common/checkpoint_store.py). Values are unsigned 63-bit; :func:`zigzag` maps
signed deltas onto them. Encoding and decoding are vectorised: a checkpoint of millions
of chain items costs no Python loop per item.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

_MAX_BYTES = 10


def encode(values: Sequence[int] | np.ndarray) -> bytes:
    """Every value as a varint, end to end."""
    v = np.asarray(values, dtype=np.uint64)
    if v.size == 0:
        return b""
    n = np.ones(v.shape, dtype=np.int64)
    for k in range(1, _MAX_BYTES):
        n += v >= (np.uint64(1) << np.uint64(7 * k))
    ends = np.cumsum(n)
    starts = ends - n
    out = np.zeros(int(ends[-1]), dtype=np.uint8)
    for k in range(_MAX_BYTES):
        here = n > k
        if not here.any():
            break
        low = ((v[here] >> np.uint64(7 * k)) & np.uint64(0x7F)).astype(np.uint8)
        more = (n[here] > k + 1).astype(np.uint8) << np.uint8(7)
        out[starts[here] + k] = low | more
    return out.tobytes()


def decode(data: bytes, count: int, offset: int = 0) -> tuple[np.ndarray, int]:
    """``count`` varints from ``data[offset:]``: (values as uint64, offset after them).
    Raises ValueError when the data ends first or a varint is too long."""
    if count == 0:
        return np.zeros(0, dtype=np.uint64), offset
    raw = np.frombuffer(data, dtype=np.uint8, offset=offset)
    ends = np.flatnonzero(raw < 0x80)
    if len(ends) < count:
        raise ValueError(f"{count} varints expected, the data holds {len(ends)}")
    ends = ends[:count]
    starts = np.empty(count, dtype=np.int64)
    starts[0] = 0
    starts[1:] = ends[:-1] + 1
    lengths = ends - starts + 1
    if int(lengths.max()) > _MAX_BYTES:
        raise ValueError("a varint longer than 10 bytes")
    used = raw[: int(ends[-1]) + 1]
    shifts = ((np.arange(len(used)) - np.repeat(starts, lengths)) * 7).astype(np.uint64)
    values = np.add.reduceat((used & 0x7F).astype(np.uint64) << shifts, starts)
    return values.astype(np.uint64), offset + int(ends[-1]) + 1


def zigzag(values: np.ndarray) -> np.ndarray:
    """Signed int64 -> unsigned, small magnitudes small (0, -1, 1, -2 -> 0, 1, 2, 3)."""
    v = np.asarray(values, dtype=np.int64)
    return ((v << 1) ^ (v >> 63)).astype(np.uint64)


def unzigzag(values: np.ndarray) -> np.ndarray:
    v = np.asarray(values, dtype=np.uint64)
    return ((v >> np.uint64(1)).astype(np.int64)) ^ -((v & np.uint64(1)).astype(np.int64))
