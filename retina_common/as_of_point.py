"""A past point as the command lines take it: a timestamp, a wall-clock time or a pin.

``retina-query --as-of``, ``retina-admin pin create --at/--at-time`` and the Spark
snapshot query share these rules (docs/history.md):

* a plain integer is a timestamp (``--as-of 81234``);
* an ISO 8601 time is a wall-clock time (``--as-of 2026-11-27T09:00:00Z``; without a
  zone it is the local time), resolved by the TransServer to the newest commit at or
  before it;
* ``--at-time`` also takes milliseconds since the epoch.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime

from retina_common.pb import trans_pb2 as tpb


class BadPoint(ValueError):
    """Neither a timestamp nor a time."""


@dataclass(frozen=True)
class AsOf:
    """One of the three, or none (the newest snapshot)."""

    ts: int = 0
    time_ms: int = 0
    pin: str = ""

    def begin_request(self, lease_ms: int = 0) -> tpb.BeginTransRequest:
        return tpb.BeginTransRequest(read_only=True, lease_ms=lease_ms, as_of_ts=self.ts,
                                     as_of_time_ms=self.time_ms, as_of_pin=self.pin)

    def describe(self) -> str:
        if self.pin:
            return f"pin {self.pin}"
        if self.time_ms:
            return f"time {format_ms(self.time_ms)}"
        return f"timestamp {self.ts}" if self.ts else "the newest snapshot"


NEWEST = AsOf()


def parse_time_ms(text: str) -> int:
    """Milliseconds since the epoch, or an ISO 8601 time."""
    text = text.strip()
    if text.isdigit():
        return int(text)
    try:
        moment = datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        raise BadPoint(f"{text!r} is neither milliseconds since the epoch nor an ISO 8601 "
                       "time (2026-11-27T09:00:00Z)") from None
    return int(moment.timestamp() * 1000)


def parse_as_of(text: str) -> AsOf:
    """``--as-of``: an integer is a timestamp, anything else an ISO 8601 time."""
    text = text.strip()
    if text.isdigit():
        if int(text) == 0:
            raise BadPoint("timestamp 0 names no snapshot")
        return AsOf(ts=int(text))
    if text[:1] == "-":
        raise BadPoint(f"{text!r}: a timestamp is positive")
    return AsOf(time_ms=parse_time_ms(text))


def format_ms(ms: int) -> str:
    """A wall-clock time for people (UTC, milliseconds)."""
    if not ms:
        return "-"
    return datetime.fromtimestamp(ms / 1000, tz=UTC).isoformat(timespec="milliseconds")
