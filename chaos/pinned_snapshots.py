"""Named pins in the campaign (docs/history.md): a snapshot pinned, kept for a few
episodes across the faults (node kills, TransServer restarts, GC passes, sweeps,
reverts), read through the pin, then dropped; and the TransServer's pin failpoints.

- **PinBook**: the episode's image (chaos/repeatable_reads.py, taken once healed) is
  pinned (``CreatePin`` at its S while its transaction is still open, so S is readable)
  now and then, at most ``PIN_MAX`` at once, for ``PIN_EPISODES`` episodes (never past
  ``PIN_MAX_S``: a pin holds safeGcTs, so retired files stay unswept, and the storage
  audit reports a retired file 90 s past its cleanupAt). Each episode one held pin is
  read AS OF it (it must answer exactly: a pinned S is never expired), each due pin is
  read once more if it never was, then dropped (``DropPin`` must answer dropped), and
  ``ListPins`` must list exactly the held pins. A pin whose create or drop answer was
  lost (UNAVAILABLE: the TransServer or etcd away) is *in doubt* until a later call
  settles it; it is never an anomaly to find it either way.
- **PinFailpoint**: the ``trans.pin.*`` points are reached only by CreatePin and
  DropPin, so a failpoint episode on them creates and drops pins while it waits; once
  the TransServer died at the point and restarted, the pin in flight must be there
  exactly when the point lies after its etcd write (``create.after``, ``drop.before``).
"""

from __future__ import annotations

import contextlib
import random
import time
from collections import Counter
from dataclasses import dataclass, field

import grpc

from retina_common.client import channel
from retina_common.pb import trans_pb2 as tpb
from retina_common.pb import trans_pb2_grpc

from .as_of_reads import AWAY, AsOfPoint, AsOfReader, Circumstances, judge_refusal
from .snapshots import ReadRefused, Taken, refusal_of

PIN_P = 0.35
PIN_MAX = 2
PIN_EPISODES = (2, 4)
PIN_MAX_S = 45.0
# The campaign's pin names: the book's (BOOK_PREFIX + the snapshot's number) and the
# failpoint episodes' (FAILPOINT_PREFIX + a count).
BOOK_PREFIX = "chaos-s"
FAILPOINT_PREFIX = "chaos-fp-"
TIMEOUT_S = 10.0
# Where a TransServer killed at a pin point leaves the pin in flight: True if present.
PRESENT_AFTER_CRASH = {"trans.pin.create.before": False, "trans.pin.create.after": True,
                       "trans.pin.drop.before": True, "trans.pin.drop.after": False}


@dataclass
class HeldPin:
    name: str
    taken: Taken
    until_episode: int
    created_at: float = field(default_factory=time.monotonic)
    reads: int = 0


def due(pin: HeldPin, episode: int, now: float) -> bool:
    return pin.until_episode <= episode or now - pin.created_at > PIN_MAX_S


def listing_problems(listed: dict[str, int], held: dict[str, int], dropped: set[str],
                     in_doubt: set[str]) -> list[str]:
    """What ListPins' campaign pins (name -> ts) get wrong against what the campaign
    holds (name -> ts), dropped (confirmed) and left in doubt."""
    problems = [f"{name} (ts {ts}) missing" for name, ts in held.items()
                if name not in in_doubt and name not in listed]
    problems += [f"{name} listed at ts {listed[name]}, created at {ts}"
                 for name, ts in held.items() if name in listed and listed[name] != ts]
    problems += [f"{name} listed after it was dropped" for name in listed
                 if name in dropped and name not in in_doubt]
    return problems


class PinBook:
    def __init__(self, trans_channel: grpc.Channel, as_of: AsOfReader, counts: Counter[str],
                 anomalies: list[str]) -> None:
        self.trans = trans_pb2_grpc.TransServiceStub(trans_channel)
        self.as_of = as_of
        self.counts = counts
        self.anomalies = anomalies
        self.held: dict[str, HeldPin] = {}
        self.dropped: set[str] = set()
        self.in_doubt: set[str] = set()  # a create or drop whose answer was lost

    def create(self, taken: Taken, episode: int, rng: random.Random) -> None:
        """Pin ``taken``'s S (its transaction still open: S is readable)."""
        name = f"{BOOK_PREFIX}{taken.sid}"
        try:
            pin = self.trans.CreatePin(tpb.CreatePinRequest(name=name, ts=taken.ts),
                                       timeout=TIMEOUT_S).pin
        except grpc.RpcError as exc:
            self._create_refused(taken, name, refusal_of(exc))
            return
        self.counts["pins_created"] += 1
        if pin.ts != taken.ts or pin.name != name:
            self.anomalies.append(f"pin_wrong: CreatePin({name}, ts={taken.ts}) answered "
                                  f"{pin.name} at ts {pin.ts}")
        taken.pin = name
        self.held[name] = HeldPin(name, taken, episode + rng.randint(*PIN_EPISODES))

    def _create_refused(self, taken: Taken, name: str, exc: ReadRefused) -> None:
        self.counts[f"pin_create_refused_{exc.code}"] += 1
        if exc.code in AWAY:  # the answer lost: created or not
            self.in_doubt.add(name)  # dropped once healed if it was created after all
            return
        verdict = judge_refusal(taken.ts, AsOfPoint("ts", ts=taken.ts), exc,
                                Circumstances(True, False, False, True))
        if verdict != "expired":
            self.anomalies.append(f"pin_{verdict}; CreatePin of {taken.label()} "
                                  "whose transaction is still open")

    # --- each episode once healed -----------------------------------------------------
    def episode(self, episode: int, rng: random.Random, history: str,
                release: bool = False) -> None:
        """Read one held pin, drop the due ones (all with ``release``), check ListPins."""
        readable = sorted((p for p in self.held.values() if p.name not in self.in_doubt),
                          key=lambda p: p.name)
        if readable and not release:
            self._read(rng.choice(readable), rng, history)
        now = time.monotonic()
        for pin in sorted(self.held.values(), key=lambda p: p.name):
            # A pin read wrongly once is dropped: later reads would only repeat it.
            if release or due(pin, episode, now) or pin.taken.reported:
                if not (pin.reads or release or pin.taken.reported or
                        pin.name in self.in_doubt):
                    self._read(pin, rng, history)
                self._drop(pin.name)
        self._settle_in_doubt()
        self._check_listed()

    def _read(self, pin: HeldPin, rng: random.Random, history: str) -> None:
        pin.reads += 1
        self.counts["pins_read"] += 1
        self.as_of.read(pin.taken, AsOfPoint("pin", pin=pin.name), rng,
                        f"through its pin (created {time.monotonic() - pin.created_at:.0f}s "
                        "ago)", history, pinned=True)

    def _drop(self, name: str) -> None:
        """DropPin: dropped, or found gone after an answer was lost, or in doubt again."""
        try:
            dropped = self.trans.DropPin(tpb.DropPinRequest(name=name),
                                         timeout=TIMEOUT_S).dropped
        except grpc.RpcError as exc:
            code = refusal_of(exc).code
            self.counts[f"pin_drop_refused_{code}"] += 1
            if name in self.held:  # S is no longer sure to be pinned
                self.held[name].taken.pin = ""
            if code in AWAY:
                self.in_doubt.add(name)  # dropped or not: asked again next episode
            else:  # reported once, forgotten
                self.anomalies.append(f"pin_drop_refused: DropPin({name}) answered {code}")
                self.held.pop(name, None)
                self.in_doubt.discard(name)
            return
        pin = self.held.pop(name, None)
        if pin is not None:
            pin.taken.pin = ""
        self.dropped.add(name)
        if dropped:
            self.counts["pins_dropped"] += 1
        elif name not in self.in_doubt:
            self.anomalies.append(f"pin_lost: DropPin({name}) found no such pin; it was "
                                  f"created at S={pin.taken.ts if pin else '?'} and never "
                                  "dropped")
        self.in_doubt.discard(name)

    def _settle_in_doubt(self) -> None:
        """Pins whose answer was lost and that are no longer held: dropped again (a
        create that landed after all, a drop that did not)."""
        for name in sorted(self.in_doubt - self.held.keys()):
            self._drop(name)

    def _check_listed(self) -> None:
        try:
            pins = self.trans.ListPins(tpb.ListPinsRequest(), timeout=TIMEOUT_S).pins
        except grpc.RpcError as exc:
            self.counts[f"pin_list_refused_{refusal_of(exc).code}"] += 1
            return
        listed = {p.name: p.ts for p in pins if p.name.startswith(BOOK_PREFIX)}
        held = {name: pin.taken.ts for name, pin in self.held.items()}
        problems = listing_problems(listed, held, self.dropped, self.in_doubt)
        if problems:
            self.anomalies.append(f"pin_list_disagrees: ListPins: {'; '.join(problems)}")

    def close(self) -> None:
        """Drop every pin (the end of a cluster: nothing is checked any more)."""
        for name in sorted(self.held.keys() | self.in_doubt):
            with contextlib.suppress(grpc.RpcError):  # the cluster goes away with its pins
                self.trans.DropPin(tpb.DropPinRequest(name=name), timeout=TIMEOUT_S)
        self.held.clear()
        self.in_doubt.clear()


class PinFailpoint:
    """Drives a ``trans.pin.*`` failpoint episode: creates and drops pins until the
    TransServer dies at the point; ``check`` then tells whether the pin in flight
    survived the crash exactly as the point's place says."""

    def __init__(self, trans_address: str, point: str) -> None:
        self._channel = channel(trans_address)
        self.trans = trans_pb2_grpc.TransServiceStub(self._channel)
        self.point = point
        self.count = 0
        self.in_flight = ""  # the pin whose call was under way when the process died

    def act(self) -> None:
        self.count += 1
        name = f"{FAILPOINT_PREFIX}{self.count}"
        try:
            hwm = self.trans.GetHighWatermark(tpb.GetHighWatermarkRequest(),
                                              timeout=TIMEOUT_S).high_watermark
            self.in_flight = name
            self.trans.CreatePin(tpb.CreatePinRequest(name=name, ts=hwm), timeout=TIMEOUT_S)
            self.trans.DropPin(tpb.DropPinRequest(name=name), timeout=TIMEOUT_S)
        except grpc.RpcError:
            return  # the TransServer died at the point (or was not up yet)
        self.in_flight = ""

    def check(self, hit: bool) -> list[str]:
        """Once the TransServer is back: the anomalies (none when the point was not hit),
        then every failpoint pin dropped."""
        try:  # the channel saw the crash: wait for it to connect again
            listed = {p.name for p in self.trans.ListPins(
                tpb.ListPinsRequest(), timeout=TIMEOUT_S, wait_for_ready=True).pins}
        except grpc.RpcError as exc:
            return [f"pin_list_refused: ListPins after {self.point} answered "
                    f"{refusal_of(exc).code}"]
        found: list[str] = []
        if hit and self.in_flight:
            want = PRESENT_AFTER_CRASH[self.point]
            if (self.in_flight in listed) != want:
                found.append(f"pin_not_durable: the TransServer killed at {self.point} "
                             f"while {self.in_flight} was in flight: after its restart the "
                             f"pin is {'missing' if want else 'still there'}")
        for name in sorted(n for n in listed if n.startswith(FAILPOINT_PREFIX)):
            try:
                self.trans.DropPin(tpb.DropPinRequest(name=name), timeout=TIMEOUT_S,
                                   wait_for_ready=True)
            except grpc.RpcError:
                found.append(f"pin_drop_refused: DropPin({name}) after {self.point}")
        return found

    def close(self) -> None:
        self._channel.close()
