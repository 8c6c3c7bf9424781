"""AS OF reads in the campaign: earlier snapshots read again in transactions begun at
their past point (docs/history.md), by timestamp, by the wall-clock time they were taken
at, or through a named pin (chaos/pinned_snapshots.py).

The rule (issue 27): a read AS OF S returns exactly the rows the first read of S
returned (its ``TableImage``s, compared whole), whenever it runs, through node kills,
TransServer restarts, GC passes, sweeps and reverts, as long as S is above the earliest
readable point; below it, the refusal is ``FAILED_PRECONDITION snapshot_expired`` naming
``earliest_readable_ts``. ``judge_refusal`` decides what a refusal is:

| refusal | benign when |
|---|---|
| ``snapshot_expired ... earliest_readable_ts=E`` | S < E, and S is not pinned |
| the same by a node, for history its recovery rebuilt | S < E, even if S is pinned |
| ``as_of_time_unmapped`` (by time) | the TransServer restarted since (a crash gap) |
| UNAVAILABLE, DEADLINE_EXCEEDED, CANCELLED at BeginTrans | always (the query gate: counted) |
| the same codes during the read | a node or the TransServer is away at that moment |
| NOT_FOUND "transaction N does not exist" | the TransServer restarted during the read |

Anything else (ABORTED below a node's restart floor or a visibility base, a missing
file, OUT_OF_RANGE for an old S, INTERNAL, an expired refusal at or above the point it
names, a pinned S refused) is the anomaly ``as_of_refused_wrongly``; an answer that
differs is ``snapshot_changed`` (SNAPSHOT_IS_IMMUTABLE, chaos/snapshots.py), a time or
pin that resolves to another timestamp than it did first ``as_of_point_moved``.
"""

from __future__ import annotations

import random
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

from retina_common.pb import trans_pb2 as tpb
from retina_common.refusal import AS_OF_TIME_UNMAPPED, SNAPSHOT_EXPIRED, earliest_readable

from .snapshots import VIAS, ReadRefused, SnapshotReaders, TableImage, Taken, compare_taken

# A node's refusal of history its recovery rebuilt from the changelogs
# (retina_server/read_history.py): the one refusal a pinned S may get.
REBUILT = "HISTORY_REBUILT_IS_REFUSED"
# Codes that say "away" (a node, the gate or the TransServer), nothing about history.
AWAY = frozenset({"UNAVAILABLE", "DEADLINE_EXCEEDED", "CANCELLED"})
BY = ("ts", "time", "pin")


@dataclass(frozen=True)
class AsOfPoint:
    """How a read names its past point: a timestamp, a wall-clock time or a pin."""

    by: str  # one of BY
    ts: int = 0
    time_ms: int = 0
    pin: str = ""

    def request(self) -> dict[str, int | str]:
        """BeginTransRequest's AS OF field for this point."""
        return {"ts": {"as_of_ts": self.ts}, "time": {"as_of_time_ms": self.time_ms},
                "pin": {"as_of_pin": self.pin}}[self.by]

    def describe(self) -> str:
        return {"ts": f"AS OF ts {self.ts}", "time": f"AS OF time {self.time_ms}",
                "pin": f"AS OF pin {self.pin}"}[self.by]


@dataclass(frozen=True)
class Circumstances:
    """What the campaign knows when a refusal arrives."""

    at_begin: bool  # BeginTrans refused (else: the read, once begun)
    pinned: bool  # a pin the campaign holds names S
    trans_restarted: bool  # the TransServer restarted since S was first read
    all_ready: bool  # every node READY and the TransServer up, now


def judge_refusal(s: int, point: AsOfPoint, exc: ReadRefused, how: Circumstances) -> str:
    """``expired``, ``unmapped`` or ``away`` (benign), or the anomaly's text."""
    wrong = f"as_of_refused_wrongly: {point.describe()} of S={s} refused {exc.code}: " \
            f"{exc.detail}"
    if exc.code == "FAILED_PRECONDITION" and exc.detail.startswith(SNAPSHOT_EXPIRED):
        earliest = earliest_readable(exc.detail)
        if earliest is None:
            return wrong + " (no earliest readable point named)"
        if s >= earliest[0]:
            return wrong + f" (S is at or above the earliest readable {earliest[0]} it names)"
        if how.pinned and (how.at_begin or REBUILT not in exc.detail):
            return wrong + " (S is pinned)"
        # A pinned S a node's recovery rebuilt: refused by design (docs/history.md).
        return "rebuilt" if how.pinned else "expired"
    if exc.code == "FAILED_PRECONDITION" and exc.detail.startswith(AS_OF_TIME_UNMAPPED):
        return "unmapped" if point.by == "time" and how.trans_restarted else \
            wrong + " (no TransServer restart since the time was mapped)"
    if exc.code in AWAY and (how.at_begin or not how.all_ready):
        return "away"
    if exc.code == "NOT_FOUND" and "does not exist" in exc.detail and how.trans_restarted:
        return "away"  # the TransServer restarted during the read: it forgot the reader
    return wrong


class AsOfReader:
    """AS OF reads of ``Taken`` snapshots: counts (the report's ``history`` counter) and
    anomaly texts (appended to ``anomalies``, drained with the book's)."""

    def __init__(self, readers: SnapshotReaders, counts: Counter[str], anomalies: list[str],
                 trans_started_at: Callable[[], float] = lambda: 0.0,
                 all_ready: Callable[[], bool] = lambda: True) -> None:
        self.readers = readers
        self.counts = counts
        self.anomalies = anomalies
        self._trans_started_at = trans_started_at
        self._all_ready = all_ready
        # Told of every AS OF transaction that answered, with the images it was compared
        # with (the key lookups run there too, chaos/key_lookups.py).
        self.on_answered: Callable[[tpb.BeginTransResponse, dict[str, TableImage]],
                                   None] | None = None

    def read(self, taken: Taken, point: AsOfPoint, rng: random.Random, how: str,
             history: str, pinned: bool = False) -> str:
        """``taken`` read again AS OF ``point``: ``identical``, ``changed``, ``moved``,
        ``expired``, ``rebuilt``, ``unmapped``, ``away`` or ``wrong``."""
        self.counts["as_of_reads"] += 1
        self.counts[f"as_of_by_{point.by}"] += 1
        try:
            trans = self.readers.begin(**point.request())  # type: ignore[arg-type]
        except ReadRefused as exc:
            return self._refused(taken, point, exc, True, pinned)
        try:
            if trans.timestamp != taken.ts:
                self.counts["as_of_point_moved"] += 1
                self.anomalies.append(
                    f"as_of_point_moved: {point.describe()} began at S={trans.timestamp}, "
                    f"but it named S={taken.ts} when {taken.label()} was taken; between: "
                    f"{history or 'nothing recorded'}")
                taken.reported = True
                return "moved"
            via = rng.choice(VIAS)
            try:
                again = self.readers.read(via, trans, list(taken.images))
            except ReadRefused as exc:
                return self._refused(taken, point, exc, False, pinned)
            self.counts["as_of_answered"] += 1
            self.counts["as_of_answered_age_s"] += int(time.monotonic() - taken.begun_at)
            self.counts["as_of_rows"] += sum(i.count for i in again.values())
            found = compare_taken(taken, again, f"read {via} {point.describe()} {how}",
                                  history)
            if found:
                self.counts["as_of_changed"] += 1
                self.anomalies.append(found)
                taken.reported = True
                return "changed"
            self.counts["as_of_identical"] += 1
            if self.on_answered is not None:
                self.on_answered(trans, taken.images)
            return "identical"
        finally:
            self.readers.end(trans.trans_id)

    def _refused(self, taken: Taken, point: AsOfPoint, exc: ReadRefused, at_begin: bool,
                 pinned: bool) -> str:
        how = Circumstances(at_begin, pinned,
                            self._trans_started_at() > taken.begun_at, self._all_ready())
        verdict = judge_refusal(taken.ts, point, exc, how)
        if verdict == "away":
            self.counts[f"as_of_{'gate' if at_begin else 'away'}_{exc.code}"] += 1
            return "away"
        if verdict == "rebuilt":  # counted with the expired ones, and apart
            self.counts["as_of_refused_pinned_rebuilt"] += 1
            verdict = "expired"
        if verdict in ("expired", "unmapped"):
            self.counts[f"as_of_refused_{verdict}"] += 1
            if not at_begin:  # by a node (history a recovery rebuilt), not the TransServer
                self.counts[f"as_of_refused_{verdict}_by_node"] += 1
            self.counts[f"as_of_refused_{verdict}_age_s"] += int(
                time.monotonic() - taken.begun_at)
            return verdict
        self.counts["as_of_refused_wrongly"] += 1
        self.anomalies.append(f"{verdict}; {taken.label()}")
        taken.reported = True
        return "wrong"
