"""Which past snapshot an AS OF request names: a timestamp, a wall-clock time or a pin.

``BeginTrans`` (``as_of_ts`` | ``as_of_time_ms`` | ``as_of_pin``) and ``CreatePin``
(``ts`` | ``at_time_ms``) name a point in one of these ways; :class:`AsOfPoints` turns
it into a timestamp or refuses, changing nothing. Whether that timestamp is still
readable (``horizon < ts <= HWM``) is decided afterwards, under the transaction table's
lock (transactions.py, HORIZON_BELOW_READABLE).

| request | refusal |
|---|---|
| an AS OF field on a write transaction, two of them, a negative value | INVALID_ARGUMENT |
| a time in the future | OUT_OF_RANGE |
| a time before the oldest sample kept | FAILED_PRECONDITION snapshot_expired |
| a time in a gap a crash left (time_map.py) | FAILED_PRECONDITION as_of_time_unmapped |
| an unknown pin | NOT_FOUND |
"""

from __future__ import annotations

from collections.abc import Callable

import grpc

from retina_common.refusal import AS_OF_TIME_UNMAPPED, Refusal, snapshot_expired
from trans_gate.pins import Pins
from trans_gate.time_map import TimeBeforeMap, TimeInFuture, TimeMap, TimeUnmapped


class AsOfPoints:
    def __init__(self, time_map: TimeMap, pins: Pins, horizon: Callable[[], int]) -> None:
        self._time_map = time_map
        self._pins = pins
        self._horizon = horizon

    def of_begin(self, read_only: bool, ts: int, time_ms: int, pin: str) -> int | None:
        """The snapshot a BeginTrans asks for; None: the newest (no AS OF field)."""
        given = [n for n, v in (("as_of_ts", ts), ("as_of_time_ms", time_ms),
                                ("as_of_pin", pin)) if v]
        if not given:
            return None
        if not read_only:
            raise Refusal(grpc.StatusCode.INVALID_ARGUMENT,
                          f"{given[0]} is for read-only transactions only")
        if len(given) > 1:
            raise Refusal(grpc.StatusCode.INVALID_ARGUMENT,
                          f"give one of as_of_ts, as_of_time_ms, as_of_pin, not {given}")
        if pin:
            found = self._pins.get(pin)
            if found is None:
                raise Refusal(grpc.StatusCode.NOT_FOUND, f"no pin named {pin!r}")
            return found.ts
        return self.of_point(ts, time_ms, "as_of_ts", "as_of_time_ms")

    def of_point(self, ts: int, time_ms: int, ts_name: str = "ts",
                 time_name: str = "at_time_ms") -> int:
        """Exactly one of a timestamp and a time (CreatePin; BeginTrans via of_begin)."""
        if (ts != 0) == (time_ms != 0):
            raise Refusal(grpc.StatusCode.INVALID_ARGUMENT,
                          f"give exactly one of {ts_name} and {time_name}")
        if ts < 0 or time_ms < 0:
            raise Refusal(grpc.StatusCode.INVALID_ARGUMENT,
                          f"{ts_name if ts < 0 else time_name} must not be negative")
        return ts if ts else self.of_time(time_ms)

    def of_time(self, time_ms: int) -> int:
        """The newest commit at or before ``time_ms`` (time_map.py), or the refusal."""
        try:
            return self._time_map.resolve(time_ms)
        except TimeInFuture as exc:
            raise Refusal(grpc.StatusCode.OUT_OF_RANGE, f"as_of_time_ms {exc}") from None
        except TimeBeforeMap as exc:
            earliest = self._horizon() + 1
            raise snapshot_expired(
                str(exc), earliest, self._time_map.earliest_time_at_or_above(earliest)) from None
        except TimeUnmapped as exc:
            raise Refusal(grpc.StatusCode.FAILED_PRECONDITION,
                          f"{AS_OF_TIME_UNMAPPED}: {exc}; pass a timestamp (as_of_ts) or a "
                          "time outside the gap") from None
