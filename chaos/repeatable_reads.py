"""Repeatable reads: every episode's snapshots, held open across its fault and read again
once it is healed (SNAPSHOT_IS_IMMUTABLE, chaos/snapshots.py).

Per episode, drawn up front from the episode's own random stream (``EpisodePlan``, so
neither the faults' nor the workload's draws moved):

- **before the fault**, after the episode's first writes: a snapshot (gated or the Spark
  path); its read transaction stays open through the fault;
- sometimes a **held** snapshot (``HOLD_P``; at most ``HELD_MAX`` at once): its
  transaction stays open for the next two to four episodes (never past ``HELD_MAX_S``);
- sometimes **during the fault**, after its n-th workload write (the gate refuses it while
  a node is down: counted); the stall and split-read faults take theirs besides;
- **once healed** (every table compared equal to the source): every open snapshot is read
  again at its S, in its own transaction or under a new one (drawn; the open one pins S
  either way: safeGcTs stays below it, so no fold or rewrite may drop what S sees), by a
  reader drawn anew (so the two readers are checked against each other too); the
  episode's transactions are then ended, the held ones when due;
- then sometimes an **unpinned** snapshot (``AFTER_P``: its transaction ended at once),
  read again in later episodes under new transactions: by then a fold, a rewrite or a
  restart has usually made S unreadable, and the read must be refused, never answered
  differently.

An open transaction whose re-read is refused is ended (S is no longer readable: a node
restarted since, its floor above S; kept, it would only hold safeGcTs below that floor,
where every GC pass's QueryVisibility is refused). For the same reason every open one is
read again and ended before a fault that restarts a node and then needs GC passes on it
(``release``).
"""

from __future__ import annotations

import random
import time
from collections import Counter
from dataclasses import dataclass

from retina_common.pb import trans_pb2 as tpb

from .snapshots import (
    VIAS,
    ReadRefused,
    SnapshotReaders,
    TableImage,
    Taken,
    at_timestamp,
    compare_taken,
    duplicates_in,
    is_refusal,
    tables_taken,
)

HOLD_P = 0.3
HELD_MAX = 2
HELD_EPISODES = (2, 4)
# Held transactions keep their listed files from the sweepers; the storage audit reports
# a RETIRED file still there 90 s past its cleanupAt.
HELD_MAX_S = 60.0
AFTER_P = 1 / 3
# The fault's workload write a mid-fault snapshot follows (0: none).
DURING_AT = (0, 0, 0, 0, 1, 2)
# Unpinned snapshots: read again for this many episodes, at most REMEMBER_MAX kept, at
# most REREAD_UNPINNED of them per episode. A full read of the five tables takes 0.5 to
# 1 s on the loaded 2-core machine (a refused one much less): an episode does about four.
REMEMBER_EPISODES = 5
REMEMBER_MAX = 8
REREAD_UNPINNED = 1
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
    after: str  # the reader of the unpinned snapshot taken once healed ("": none)

    @classmethod
    def draw(cls, rng: random.Random) -> EpisodePlan:
        return cls(rng.choice(VIAS), rng.choice(DURING_AT), rng.choice(VIAS),
                   rng.random() < HOLD_P, rng.randint(*HELD_EPISODES),
                   rng.choice(VIAS) if rng.random() < AFTER_P else "")


class SnapshotBook:
    """One cluster's snapshots: open (pinned), held, unpinned; re-reads; counts (the
    report's ``snapshots`` counter) and anomaly texts (drained by the campaign)."""

    def __init__(self, readers: SnapshotReaders, counts: Counter[str]) -> None:
        self.readers = readers
        self.counts = counts
        self.open: list[Taken] = []  # transactions still open: this episode's and held
        self.unpinned: list[Taken] = []
        self.anomalies: list[str] = []
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

    def after_fault(self, text: str) -> None:
        """What the fault did (told in a snapshot_changed's detail)."""
        self._fault_writes = -1
        self._in_fault = False
        self._history.append((self.episode, text))
        del self._history[:-HISTORY_MAX]

    def after_healing(self) -> None:
        self.reread("after healing")
        self._reread_unpinned()
        if self.plan.after:
            self.take(self.plan.after, "after healing", pin=False)

    def history_since(self, episode: int) -> str:
        return "; ".join(f"episode {e}: {t}" for e, t in self._history if e >= episode)

    def drain(self) -> list[str]:
        out, self.anomalies = self.anomalies, []
        return out

    def close(self) -> None:
        for taken in list(self.open):
            self._end(taken)
        self.open, self.unpinned = [], []

    # --- taking -------------------------------------------------------------------------
    def take(self, via: str, phase: str, hold_episodes: int = 0,
             pin: bool = True) -> Taken | None:
        """A snapshot of every table under a gated transaction of its own, kept open
        until this episode's re-reads (``hold_episodes`` more with a hold), or ended at
        once (``pin=False``); None if refused (the gate, a node away: counted)."""
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
        if not pin:
            self.readers.end(trans.trans_id)
            return self._unpinned(self._remember(via, trans.timestamp, phase, images))
        return self.adopt(via, trans, phase, images, hold_episodes)

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
        self.counts[f"taken_{via}"] += 1
        self.counts["rows_taken"] += sum(i.count for i in images.values())
        if found := duplicates_in(images, taken.label()):
            self.anomalies.append(found)
        return taken

    def _unpinned(self, taken: Taken) -> Taken:
        self.unpinned.append(taken)
        del self.unpinned[:-REMEMBER_MAX]
        return taken

    def _refused(self, what: str, exc: ReadRefused) -> None:
        self.counts[f"{what}_refused_{exc.code}"] += 1
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
        self._reread_new(new, phase)
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

    def _reread_unpinned(self) -> None:
        self.unpinned = [t for t in self.unpinned
                         if t.episode >= self.episode - REMEMBER_EPISODES]
        older = [t for t in self.unpinned if t.episode < self.episode]
        self._reread_new(self.rng.sample(older, min(REREAD_UNPINNED, len(older))),
                         "after healing")

    def _reread_new(self, taken: list[Taken], phase: str) -> None:
        """Each of ``taken`` at its own S, under one new gated transaction."""
        if not taken:
            return
        try:
            with self.readers.transaction() as trans:
                for first in taken:
                    via = self.rng.choice(VIAS)
                    self._reread(first, at_timestamp(trans, first.ts), via,
                                 f"re-read {via} under a new transaction (its S="
                                 f"{trans.timestamp}) in episode {self.episode} {phase}")
        except ReadRefused as exc:  # the gate: nothing re-read this time
            self.counts[f"reread_gate_{exc.code}"] += 1

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
        history = self.history_since(first.episode)
        if self._in_fault:  # read again by the fault itself (a stall)
            history = "; ".join(filter(None, (history, f"episode {self.episode}: its fault, "
                                                        "under way")))
        found = compare_taken(first, again, how, history)
        self.counts["reread_changed" if found else "reread_identical"] += 1
        if found:
            self.anomalies.append(found)
            if first in self.open:  # found once: later re-reads would only repeat it
                self._end(first)

    def _end(self, taken: Taken) -> None:
        """End ``taken``'s transaction (a refusal: it ended already, e.g. a TransServer
        restart, counted apart)."""
        if taken in self.open:
            self.open.remove(taken)
        if taken.trans is None:
            return
        ended_by_us = self.readers.end(taken.trans.trans_id)
        taken.trans = None
        if taken.held:
            self.counts["held_ended" if ended_by_us else "held_ended_by_server"] += 1
        elif not ended_by_us:
            self.counts["ended_by_server"] += 1
