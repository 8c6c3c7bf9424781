"""Fakes for the fault campaign's pure-logic tests (tests/test_chaos_snapshots.py,
tests/test_chaos_history.py): the readers and the TransServer's pin calls, over dicts."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import grpc

from chaos.snapshots import ReadRefused, TableImage
from retina_common.pb import trans_pb2 as tpb

PK = ("id",)


def image(*rows: dict[str, object]) -> TableImage:
    return TableImage.of(rows, PK)


class FakeReaders:
    """SnapshotReaders' interface over dicts: S -> the rows a read at S returns (or a
    status code, a refusal), the transactions begun and ended, and AS OF begins: a time
    or a pin resolves through ``times`` / ``pins``; ``refuse_begin`` (S -> refusal)
    refuses a BeginTrans AS OF S."""

    def __init__(self) -> None:
        self.answers: dict[int, dict[str, TableImage] | str] = {}
        self.hwm = 10
        self.live: set[int] = set()
        self.next_id = 100
        self.times: dict[int, int] = {}
        self.pins: dict[str, int] = {}
        self.refuse_begin: dict[int, ReadRefused] = {}

    def begin(self, lease_ms: int = 0, *, as_of_ts: int = 0, as_of_time_ms: int = 0,
              as_of_pin: str = "") -> tpb.BeginTransResponse:
        if as_of_pin and as_of_pin not in self.pins:
            raise ReadRefused("NOT_FOUND", f"no pin named {as_of_pin!r}")
        ts = as_of_ts or (as_of_time_ms and self.times.get(as_of_time_ms, self.hwm)) \
            or (as_of_pin and self.pins[as_of_pin]) or self.hwm
        if ts in self.refuse_begin:
            raise self.refuse_begin[ts]
        self.next_id += 1
        self.live.add(self.next_id)
        return tpb.BeginTransResponse(trans_id=self.next_id, timestamp=ts)

    def end(self, trans_id: int) -> bool:
        if trans_id not in self.live:
            return False
        self.live.remove(trans_id)
        return True

    def extend(self, trans_id: int, lease_ms: int = 0) -> None:
        pass

    def high_watermark(self) -> int | None:
        return self.hwm

    @contextlib.contextmanager
    def transaction(self) -> Iterator[tpb.BeginTransResponse]:
        trans = self.begin()
        try:
            yield trans
        finally:
            self.end(trans.trans_id)

    def read(self, via: str, trans: tpb.BeginTransResponse,
             tables: Sequence[str]) -> dict[str, TableImage]:
        answer = self.answers.get(trans.timestamp, {t: image({"id": 1, "v": "a"})
                                                    for t in tables})
        if isinstance(answer, str):
            raise ReadRefused(answer, "refused")
        return answer


class Status(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode, details: str = "why") -> None:
        self._code = code
        self._details = details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


class FakePinStub:
    """The TransServer's pin RPCs over a dict (name -> ts); ``fail`` (RPC name -> a
    status code) fails the next call of that RPC once, before (``lost=False``) or after
    it changed anything (``lost=True``: the answer lost)."""

    def __init__(self, readers: FakeReaders) -> None:
        self.readers = readers  # its pins dict is the store, so AS OF pin reads see it
        self.fail: dict[str, tuple[grpc.StatusCode, bool]] = {}

    def _maybe_fail(self, rpc: str, change: bool) -> None:
        if rpc in self.fail and self.fail[rpc][1] == change:
            code, _ = self.fail.pop(rpc)
            raise Status(code)

    def CreatePin(self, request: tpb.CreatePinRequest, timeout: float = 0
                  ) -> tpb.CreatePinResponse:
        self._maybe_fail("CreatePin", False)
        self.readers.pins[request.name] = request.ts
        self._maybe_fail("CreatePin", True)
        return tpb.CreatePinResponse(pin=tpb.Pin(name=request.name, ts=request.ts))

    def DropPin(self, request: tpb.DropPinRequest, timeout: float = 0,
                wait_for_ready: bool = False) -> tpb.DropPinResponse:
        self._maybe_fail("DropPin", False)
        dropped = self.readers.pins.pop(request.name, None) is not None
        self._maybe_fail("DropPin", True)
        return tpb.DropPinResponse(dropped=dropped)

    def ListPins(self, request: tpb.ListPinsRequest, timeout: float = 0,
                 wait_for_ready: bool = False) -> tpb.ListPinsResponse:
        return tpb.ListPinsResponse(pins=[tpb.Pin(name=n, ts=t)
                                          for n, t in sorted(self.readers.pins.items())])
