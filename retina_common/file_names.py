"""Data file names: ``<host>-<port>_<yyyyMMddHHmmss>_<seq>_<vnode>.parquet``.

The name embeds the creating node, its UTC creation time (the TTL sweeper
reads it: :func:`created_at_ms`), a per-node sequence number and the virtual
node id (cleansing cross-checks it against the checkpoint). Parsing splits
from the right, so a host name may contain ``_`` and ``-``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import UTC, datetime

from retina_common.config import split_host_port

SUFFIX = ".parquet"
_TIME_FORMAT = "%Y%m%d%H%M%S"
_TIME = re.compile(r"[0-9]{14}")  # ASCII digits only; fullmatch: no trailing newline


@dataclass(frozen=True)
class FileName:
    node_id: str
    created_at: datetime
    seq: int
    vnode: int

    def __str__(self) -> str:
        host, port = split_host_port(self.node_id)
        stamp = self.created_at.astimezone(UTC).strftime(_TIME_FORMAT)
        return f"{host}-{port}_{stamp}_{self.seq}_{self.vnode}{SUFFIX}"


def make(node_id: str, created_at: datetime, seq: int, vnode: int) -> str:
    if seq < 0 or vnode < 0:
        raise ValueError("seq and vnode must not be negative")
    if created_at.tzinfo is None:
        raise ValueError("created_at must be timezone-aware")
    return str(FileName(node_id, created_at, seq, vnode))


def parse(name: str) -> FileName:
    """Parse a data file name; raises ValueError on anything else."""
    if not name.endswith(SUFFIX):
        raise ValueError(f"{name!r}: not a {SUFFIX} data file")
    parts = name[: -len(SUFFIX)].rsplit("_", 3)
    if len(parts) != 4:
        raise ValueError(f"{name!r}: expected node_time_seq_vnode")
    node, stamp, seq, vnode = parts
    host, dash, port = node.rpartition("-")
    if not dash or not host or not port.isdigit():
        raise ValueError(f"{name!r}: node part {node!r} is not host-port")
    if not _TIME.fullmatch(stamp):
        raise ValueError(f"{name!r}: creation time {stamp!r} is not yyyyMMddHHmmss")
    if not seq.isdigit() or not vnode.isdigit():
        raise ValueError(f"{name!r}: sequence and vnode must be numbers")
    try:  # by hand: strptime costs 20 us a name, and cleansing parses every file's
        created = datetime(int(stamp[0:4]), int(stamp[4:6]), int(stamp[6:8]),
                           int(stamp[8:10]), int(stamp[10:12]), int(stamp[12:14]), tzinfo=UTC)
    except ValueError as exc:
        raise ValueError(f"{name!r}: bad creation time: {exc}") from None
    return FileName(f"{host}:{port}", created, int(seq), int(vnode))


def created_at_ms(name: str) -> int:
    return int(parse(name).created_at.timestamp() * 1000)
