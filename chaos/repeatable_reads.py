"""Repeatable reads: every episode's snapshots, held open across its fault and read again
once it is healed (SNAPSHOT_IS_IMMUTABLE, chaos/snapshots.py), and read again later AS OF
their past point (chaos/as_of_reads.py, issue 27).

Per episode, drawn up front from the episode's own random stream (``EpisodePlan``, so
neither the faults' nor the workload's draws moved):

- **before the fault**, after the episode's first writes: a snapshot (gated or the Spark
  path); its read transaction stays open through the fault;
- sometimes a **held** snapshot (``HOLD_P``; at most ``HELD_MAX`` at once): its
  transaction stays open for the next two to four episodes (never past ``HELD_MAX_S``);
- sometimes **during the fault**, after its n-th workload write (the gate refuses it while
  a node is down: counted); the stall and split-read faults take theirs besides;
- **once healed** (every table compared equal to the source): every open snapshot is read
  again at its S, in its own transaction or in a new transaction AS OF S (drawn; the open
  one pins S either way: safeGcTs stays below it, so no fold or rewrite may drop what S
  sees), by a reader drawn anew (so the two readers are checked against each other too);
  the episode's transactions are then ended, the held ones when due;
- then **AS OF re-reads** (``AS_OF_REREADS``) of snapshots whose transactions ended, in
  this episode or in the ``REMEMBER_EPISODES`` before: by timestamp, or by the wall-clock
  time a snapshot was taken AS OF; with ``trans.history_retention_ms`` set (20 s in the
  campaign) the recent ones must answer exactly and the older ones be refused
  ``snapshot_expired`` below the earliest readable point (chaos/as_of_reads.py); the held
  pins are read, the due ones dropped (chaos/pinned_snapshots.py);
- last, **the episode's image**: a snapshot of every table and the application writer's
  table, at the newest snapshot or AS OF a wall-clock time a moment ago
  (``BY_TIME_P``), compared whole with the source (and the writer's model) when its S is
  at or above the HWM read after the comparison (``image_differs_from_source``), pinned
  now and then (``pinned_snapshots.PIN_P``); its transaction ended at once, it is read
  again AS OF its S (or time, or pin) in later episodes. An image AS OF a time that is
  refused (a node's recovery rebuilt that history) is taken at the newest snapshot
  instead (``images_by_time_fell_back``): every episode has one, and its lookups.

An open transaction whose re-read is refused is ended (S is no longer readable in it: a
node restarted since, its floor above S; kept, it would only hold safeGcTs below that
floor, where every GC pass's QueryVisibility is refused). For the same reason every open
one is read again and ended, and every pin dropped, before a fault that restarts a node
and then needs GC passes on it (``release``).
"""

from __future__ import annotations

import random
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

from retina_common.pb import trans_pb2 as tpb
from retina_common.refusal import AS_OF_TIME_UNMAPPED, SNAPSHOT_EXPIRED

from .as_of_reads import AsOfPoint, AsOfReader
from .key_lookups import AS_OF_P, KeyLookups
from .pinned_snapshots import PIN_MAX, PIN_P, PinBook
from .snapshots import (
    VIAS,
    Expected,
    ReadRefused,
    SnapshotReaders,
    TableImage,
    Taken,
    compare_taken,
    differences_from,
    duplicates_in,
    is_refusal,
    tables_imaged,
    tables_taken,
)

HOLD_P = 0.3
HELD_MAX = 2
HELD_EPISODES = (2, 4)
# Held transactions keep their listed files from the sweepers; the storage audit reports
# a RETIRED file still there 90 s past its cleanupAt.
HELD_MAX_S = 60.0
# The fault's workload write a mid-fault snapshot follows (0: none).
DURING_AT = (0, 0, 0, 0, 1, 2)
# Ended snapshots: read again AS OF their point for this many episodes, at most
# REMEMBER_MAX kept, AS_OF_REREADS of them per episode (the newest and one drawn). A full
# read of the tables takes 0.5 to 1 s on the loaded 2-core machine (a refused one much
# less): an episode does about six.
REMEMBER_EPISODES = 5
REMEMBER_MAX = 8
AS_OF_REREADS = 2
# A re-read AS OF a wall-clock time, when the snapshot was taken AS OF one; the drawn
# re-read picks among those this often (the newest snapshot is rarely one of them).
BY_TIME_REREAD_P = 0.6
BY_TIME_PICK_P = 0.5
# The episode's image taken AS OF a wall-clock time this long ago (the TransServer's time
# map samples every 100 ms and is durable every second) rather than at the newest snapshot.
BY_TIME_P = 0.5
BY_TIME_LAG_MS = 1500
HISTORY_MAX = 40


@dataclass(frozen=True)
class EpisodePlan:
    """An episode's snapshots, drawn up front: how many writes a fault needed does not
    shift the later draws."""

    before: str  # the reader of the snapshot taken before the fault
    during_at: int  # taken after the fault's n-th workload write (0: none)
    during: str
    hold: bool  # that snapshot held open for the next episodes too
    hold_episodes: int
    after: str  # the reader of the episode's image, taken once healed
    by_time: bool  # that image taken AS OF a wall-clock time a moment ago
    pin: bool  # that image pinned (if fewer than PIN_MAX are)

    @classmethod
    def draw(cls, rng: random.Random) -> EpisodePlan:
        return cls(rng.choice(VIAS), rng.choice(DURING_AT), rng.choice(VIAS),
                   rng.random() < HOLD_P, rng.randint(*HELD_EPISODES), rng.choice(VIAS),
                   rng.random() < BY_TIME_P, rng.random() < PIN_P)


class SnapshotBook:
    """One cluster's snapshots: open, held, remembered (ended); re-reads, AS OF re-reads
    and pins; counts (the report's ``snapshots`` counter; AS OF reads and pins in
    ``as_of.counts``) and anomaly texts (drained by the campaign)."""

    def __init__(self, readers: SnapshotReaders, counts: Counter[str],
                 as_of: AsOfReader | None = None, pins: PinBook | None = None,
                 expected: Callable[[], Expected] | None = None,
                 lookups: KeyLookups | None = None) -> None:
        """``as_of`` (default: one over ``readers`` counting into a counter of its own),
        ``pins`` and ``lookups`` (default: none) share the book's anomaly list;
        ``expected``: what the episode's image must hold (default: not compared)."""
        self.readers = readers
        self.counts = counts
        self.anomalies: list[str] = []
        self.as_of = as_of or AsOfReader(readers, Counter(), self.anomalies)
        self.as_of.anomalies = self.anomalies
        self.pins = pins
        if pins is not None:
            pins.anomalies = self.anomalies
        self.expected = expected
        self.lookups = lookups
        if lookups is not None:
            lookups.anomalies = self.anomalies
            self.as_of.on_answered = self._lookups_as_of
        self.open: list[Taken] = []  # transactions still open: this episode's and held
        self.remembered: list[Taken] = []  # ended, read again AS OF their point
        self._history: list[tuple[int, str]] = []
        self._next_sid = 1
        self.episode = 0
        self.rng = random.Random(0)
        self.plan = EpisodePlan.draw(self.rng)
        self._fault_writes = -1  # -1: no mid-fault snapshot to come
        self._in_fault = False

    # --- the episode --------------------------------------------------------------------
    def begin_episode(self, episode: int, rng: random.Random) -> None:
        self.episode, self.rng = episode, rng
        self.plan = EpisodePlan.draw(rng)
        self._fault_writes = -1

    def before_fault(self) -> None:
        held = self.plan.hold and sum(t.held for t in self.open) < HELD_MAX
        taken = self.take(self.plan.before, "before the fault",
                          self.plan.hold_episodes if held else 0)
        if taken is not None and held:
            self.counts["held_begun"] += 1
        self._fault_writes = 0
        self._in_fault = True

    def during_fault_write(self) -> None:
        """After each workload write of the fault: the planned mid-fault snapshot."""
        if self._fault_writes < 0:
            return
        self._fault_writes += 1
        if self._fault_writes == self.plan.during_at:
            self.take(self.plan.during, "during the fault")
        before = next((t for t in self.open if t.episode == self.episode
                       and t.phase == "before the fault" and t.trans is not None), None)
        if self.lookups is not None and before is not None and before.trans is not None:
            self.lookups.during_fault(before.trans, before.images, self.rng,
                                      f"in the transaction of {before.label()}, after the "
                                      f"fault's write {self._fault_writes}")

    def _lookups_as_of(self, trans: tpb.BeginTransResponse,
                       images: dict[str, TableImage]) -> None:
        """Now and then, keys looked up in an AS OF transaction that answered exactly."""
        if self.lookups is not None and self.rng.random() < AS_OF_P:
            self.lookups.check(trans, images, self.rng, "AS OF", prefix="as_of_")

    def after_fault(self, text: str) -> None:
        """What the fault did (told in a snapshot_changed's detail)."""
        self._fault_writes = -1
        self._in_fault = False
        self._history.append((self.episode, text))
        del self._history[:-HISTORY_MAX]

    def after_healing(self, compared_equal: bool = True) -> None:
        """Once healed and compared (``compared_equal``: the comparison found every table
        equal to the source, so the episode's image is compared with it too)."""
        # Every comparison read is at or below it.
        hwm = self.readers.high_watermark() if compared_equal else None
        self.reread("after healing")
        self._reread_as_of()
        if self.pins is not None:
            self.pins.episode(self.episode, self.rng, self.history_since(0))
        self._episode_image(hwm)

    def history_since(self, episode: int) -> str:
        return "; ".join(f"episode {e}: {t}" for e, t in self._history if e >= episode)

    def drain(self) -> list[str]:
        out = list(self.anomalies)
        self.anomalies.clear()  # the list is shared with the AS OF reader and the pins
        return out

    def close(self) -> None:
        for taken in list(self.open):
            self._end(taken)
        if self.pins is not None:
            self.pins.close()
        self.open, self.remembered = [], []

    # --- taking -------------------------------------------------------------------------
    def take(self, via: str, phase: str, hold_episodes: int = 0) -> Taken | None:
        """A snapshot of every table under a gated transaction of its own, kept open
        until this episode's re-reads (``hold_episodes`` more with a hold); None if
        refused (the gate, a node away: counted)."""
        try:
            trans = self.readers.begin()
        except ReadRefused as exc:
            self._refused("take", exc)
            return None
        try:
            images = self.readers.read(via, trans, tables_taken())
        except ReadRefused as exc:
            self._refused("take", exc)
            self.readers.end(trans.trans_id)
            return None
        return self.adopt(via, trans, phase, images, hold_episodes)

    def _episode_image(self, hwm: int | None) -> None:
        """The episode's image (module docstring): every table and the application
        writer's, compared with the source when S is at or above ``hwm``, pinned now and
        then, its transaction ended at once."""
        time_ms = int(time.time() * 1000) - BY_TIME_LAG_MS if self.plan.by_time else 0
        taking = self._take_image(time_ms)
        if taking is None and time_ms:
            # A moment ago may lie in history a node's recovery rebuilt (refused
            # snapshot_expired, HISTORY_REBUILT_IS_REFUSED): the image is taken at the
            # newest snapshot instead, so every episode has one (and its lookups).
            self.counts["images_by_time_fell_back"] += 1
            time_ms = 0
            taking = self._take_image(time_ms)
        if taking is None:
            return
        trans, images = taking
        taken = self._remember(self.plan.after, trans.timestamp, "once healed", images)
        taken.time_ms = time_ms
        self.counts["images_by_time" if time_ms else "images"] += 1
        expected = None
        if hwm is not None and trans.timestamp >= hwm:
            expected = self._compare_with_expected(taken)
        elif hwm is not None:  # AS OF a time before the comparison's reads: moved since
            self.counts["images_below_comparison"] += 1
        else:  # the comparison found differences (reported): nothing to compare with
            self.counts["images_not_compared"] += 1
        if self.lookups is not None:
            self.lookups.check(trans, images, self.rng, "once healed", expected)
        if self.pins is not None and self.plan.pin and len(self.pins.held) < PIN_MAX:
            self.pins.create(taken, self.episode, self.rng)
        self.readers.end(trans.trans_id)
        self._keep(taken)

    def _take_image(self, time_ms: int
                    ) -> tuple[tpb.BeginTransResponse, dict[str, TableImage]] | None:
        """The image's transaction (AS OF ``time_ms`` when set) and every table read in
        it; None when refused (counted, the transaction ended)."""
        try:
            trans = self.readers.begin(as_of_time_ms=time_ms)
        except ReadRefused as exc:
            self._refused("take", exc)
            return None
        try:
            return trans, self.readers.read(self.plan.after, trans, tables_imaged())
        except ReadRefused as exc:
            self._refused("take", exc)
            self.readers.end(trans.trans_id)
            return None

    def _compare_with_expected(self, taken: Taken) -> Expected | None:
        """``taken`` against what the source (and the writer's model) hold now; returns
        that (None: not known)."""
        if self.expected is None:
            return None
        try:
            expected = self.expected()
        except Exception as exc:  # the source just back from an outage: not compared
            self.counts["images_not_compared"] += 1
            self.counts[f"images_not_compared_{type(exc).__name__}"] += 1
            return None
        self.counts["images_compared"] += 1
        problems = differences_from(expected, taken.images)
        if problems:
            self.anomalies.append(f"image_differs_from_source: {taken.label()}, read once "
                                  f"the comparison found the source equal: "
                                  f"{'; '.join(problems)}")
        return expected

    def adopt(self, via: str, trans: tpb.BeginTransResponse, phase: str,
              images: dict[str, TableImage], hold_episodes: int = 0) -> Taken:
        """A snapshot read in ``trans`` (a split read's reference, say), which the book
        now owns: kept open until its re-read once healed."""
        taken = self._remember(via, trans.timestamp, phase, images)
        taken.trans, taken.until_episode = trans, self.episode + hold_episodes
        taken.held = hold_episodes > 0
        self.open.append(taken)
        return taken

    def _remember(self, via: str, ts: int, phase: str,
                  images: dict[str, TableImage]) -> Taken:
        taken = Taken(self._next_sid, via, ts, self.episode, phase, images)
        self._next_sid += 1
        if self.lookups is not None:
            self.lookups.saw(images)
        self.counts[f"taken_{via}"] += 1
        self.counts["rows_taken"] += sum(i.count for i in images.values())
        if found := duplicates_in(images, taken.label()):
            self.anomalies.append(found)
        return taken

    def _keep(self, taken: Taken) -> None:
        """``taken``, its transaction ended, read again AS OF its point later."""
        if taken.reported or taken in self.remembered:
            return
        self.remembered.append(taken)
        del self.remembered[:-REMEMBER_MAX]

    def _refused(self, what: str, exc: ReadRefused) -> None:
        self.counts[f"{what}_refused_{exc.code}"] += 1
        marker = exc.detail.split(":", 1)[0]
        if marker in (SNAPSHOT_EXPIRED, AS_OF_TIME_UNMAPPED):  # an image AS OF a time
            self.counts[f"{what}_refused_{marker}"] += 1
        if not is_refusal(exc):
            self.anomalies.append(f"snapshot_read_error: a {what} answered {exc.code}: "
                                  f"{exc.detail}")

    # --- reading again --------------------------------------------------------------------
    def reread(self, phase: str, end_all: bool = False) -> None:
        """Every open snapshot at its S, in its own transaction or under a new one; then
        the transactions that are due (or all) are ended."""
        own, new = [], []
        for taken in self.open:
            (own if self.rng.random() < 0.5 else new).append(taken)
        self.reread_taken(own, phase)
        for taken in new:
            outcome = self.as_of.read(
                taken, AsOfPoint("ts", ts=taken.ts), self.rng,
                f"in episode {self.episode} {phase}, its own transaction still open",
                self._history_of(taken))
            if outcome != "identical":  # S no longer readable in it, or found once
                self._end(taken)
        for taken in list(self.open):
            if end_all or taken.until_episode <= self.episode or \
                    time.monotonic() - taken.begun_at > HELD_MAX_S:
                self._end(taken)

    def reread_taken(self, taken: list[Taken], phase: str, end: bool = False) -> None:
        """``taken`` (still open) read again now, each in its own transaction; then
        ended (``end``) or left open for the re-reads once healed."""
        for first in taken:
            if first.trans is not None:
                via = self.rng.choice(VIAS)
                self.readers.extend(first.trans.trans_id)
                self._reread(first, first.trans, via, f"re-read {via} in its own transaction "
                                                      f"in episode {self.episode} {phase}")
            if end:
                self._end(first)

    def release(self, phase: str) -> None:
        """Read every open snapshot again and end its transaction now, and take no
        mid-fault snapshot: before a fault that restarts a node and then needs GC passes
        on it."""
        self._fault_writes = -1
        self.reread(phase, end_all=True)
        if self.pins is not None:  # a pin holds safeGcTs too
            self.pins.episode(self.episode, self.rng, "", release=True)

    def _reread_as_of(self) -> None:
        """AS OF re-reads of remembered snapshots: the newest and one more drawn."""
        self.remembered = [t for t in self.remembered if not t.reported
                           and t.episode >= self.episode - REMEMBER_EPISODES]
        if not self.remembered:
            return
        chosen = [self.remembered[-1]]
        others = self.remembered[:-1]
        by_time = [t for t in others if t.time_ms]
        if by_time and self.rng.random() < BY_TIME_PICK_P:  # else they come up rarely
            others = by_time
        chosen += self.rng.sample(others, min(AS_OF_REREADS - 1, len(others)))
        for taken in chosen:
            by_time = taken.time_ms and self.rng.random() < BY_TIME_REREAD_P
            point = AsOfPoint("time", time_ms=taken.time_ms) if by_time else \
                AsOfPoint("ts", ts=taken.ts)
            self.as_of.read(taken, point, self.rng, f"in episode {self.episode} after "
                            "healing", self._history_of(taken), pinned=bool(taken.pin))

    def _history_of(self, taken: Taken) -> str:
        history = self.history_since(taken.episode)
        if self._in_fault:  # read again by the fault itself (a stall)
            history = "; ".join(filter(None, (history, f"episode {self.episode}: its "
                                                       "fault, under way")))
        return history

    def _reread(self, first: Taken, trans: tpb.BeginTransResponse, via: str,
                how: str) -> None:
        self.counts["rereads"] += 1
        try:
            again = self.readers.read(via, trans, list(first.images))
        except ReadRefused as exc:
            self.counts[f"reread_refused_{exc.code}"] += 1
            if not is_refusal(exc):
                self.anomalies.append(f"snapshot_read_error: a re-read answered "
                                      f"{exc.code}: {exc.detail}")
            if first in self.open:  # S is no longer readable: do not pin it
                self._end(first)
            return
        self.counts["rows_reread"] += sum(i.count for i in again.values())
        found = compare_taken(first, again, how, self._history_of(first))
        self.counts["reread_changed" if found else "reread_identical"] += 1
        if found:
            self.anomalies.append(found)
            first.reported = True
            if first in self.open:  # found once: later re-reads would only repeat it
                self._end(first)

    def _end(self, taken: Taken) -> None:
        """End ``taken``'s transaction (a refusal: it ended already, e.g. a TransServer
        restart, counted apart)."""
        if taken in self.open:
            self.open.remove(taken)
        if taken.trans is None:
            return
        self._keep(taken)
        ended_by_us = self.readers.end(taken.trans.trans_id)
        taken.trans = None
        if taken.held:
            self.counts["held_ended" if ended_by_us else "held_ended_by_server"] += 1
        elif not ended_by_us:
            self.counts["ended_by_server"] += 1
