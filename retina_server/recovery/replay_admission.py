"""Replay admission: which recovery-replay writes a node accepts, and which it applies.

A replay write (UpdateRecord with a RecoveryReplayContext) is admitted only
while the lifecycle admits REPLAY_WRITE (AWAITING_REPLAY), through the open
replay entry, with this attempt's token and checkpointId, at or above the
start of the chosen mode (the vnode's start in VNODE mode, the node's in NODE
mode), and with no standalone INSERT. Admitted requests are counted in flight
until they finish, so that the MarkReady barrier can close the entry and
drain them.

Invariant REWIND_MATCHES_REPLAY: an admitted update is *applied* only at or
above its own scope's start; below it (between the mode's start and the
scope's start) its effect is already in the checkpointed state, and it is
acknowledged without being applied. Otherwise the replay would write a
durable primary-index version for a row held only in the write buffer, below
the point the next start's rewind drops from: after a crash before the READY
checkpoint that version would hide the checkpointed row from every later
DELETE, and the next replay would duplicate the row (docs/recovery.md, window
R4).

Invariant APPLIED_OR_LIVE (applied_writes.py): an update of (table, vnode) at a
timestamp t, at or above its scope's start, is applied only if this node applied that
stream part before (its applied-writes log holds it), or t's write transaction is still
live at the TransServer (asked once per timestamp and request; only for timestamps the
log does not hold: a transaction given up before it reached this node, or one still in
flight, whose writer relies on the replay: the connector's "a node found RECOVERING is
replayed from the changelog"). Otherwise no reader of this node ever saw it, and it is
acknowledged without being applied: counted (``retina_replay_unapplied_skipped_total``)
and logged (``replay_unapplied_write_skipped``).

Invariant REFUSED_IS_NOT_REPLAYED: an update at a timestamp this node's write fence
refused before the crash, with nothing of it applied (refused_writes.py), is
acknowledged without being applied: its writer redid it at a new timestamp, which the
replay applies, and no reader of this node ever saw it at the old one. APPLIED_OR_LIVE
alone would skip it too (nothing of it is in the log, and a refused timestamp's
transaction has ended: the floor that refused it is at most the HWM); the refusal
records are kept because they also say where the rebuilt history is inexact: a
timestamp refused *partial* (another request of it was applied here) may have had its
stream part split between the applied request and the refused one, and the replay
applies the whole part (``Admission.inexact_from``; read_history.py). The match is on
the timestamp alone (one timestamp, one transaction of one writer; replay requests do
not name their writer). Counted (``retina_replay_refused_skipped_total``) and logged
(``replay_refused_write_skipped``).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import grpc
from prometheus_client import Counter

from retina_common.log import get_logger
from retina_common.refusal import Refusal
from retina_common.replay_ts import ReplayStarts
from retina_server.applied_writes import AppliedWrites
from retina_server.refused_writes import RefusedWrites
from retina_server.update_record import PreparedUpdate

log = get_logger(component="replay_admission")

REFUSED_SKIPPED = Counter("retina_replay_refused_skipped_total",
                          "Replayed table updates acknowledged without applying: their "
                          "timestamp was refused by this node's write fence before the crash")
UNAPPLIED_SKIPPED = Counter("retina_replay_unapplied_skipped_total",
                            "Replayed table updates acknowledged without applying: this node "
                            "never applied them and their transaction had ended "
                            "(APPLIED_OR_LIVE)")
SKIPPED = Counter("retina_replay_already_durable_total",
                  "Replayed table updates acknowledged without applying: below their scope's "
                  "start, already in the checkpointed state")


class ReplayEntry:
    """The replay write entry: open in AWAITING_REPLAY, closed by MarkReady."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._open = False
        self._inflight = 0

    def open(self) -> None:
        with self._cond:
            self._open = True

    def close(self) -> None:
        with self._cond:
            self._open = False

    @contextlib.contextmanager
    def request(self) -> Iterator[None]:
        """Count one replay request in flight; refused once the entry is closed."""
        with self._cond:
            if not self._open:
                raise Refusal(grpc.StatusCode.FAILED_PRECONDITION,
                              "replay write refused: the replay entry is closed")
            self._inflight += 1
        try:
            yield
        finally:
            with self._cond:
                self._inflight -= 1
                self._cond.notify_all()

    def drain(self) -> None:
        """Wait until no admitted replay request is in flight (the entry is closed)."""
        with self._cond:
            self._cond.wait_for(lambda: self._inflight == 0)


@dataclass(frozen=True)
class Admission:
    """What a replay request applies, and from which timestamp on (None: nowhere) the
    history it rebuilds may differ from what readers saw (read_history.py)."""

    apply: list[PreparedUpdate]
    inexact_from: int | None = None


def to_apply(updates: list[PreparedUpdate], starts: ReplayStarts, mode: str,
             refused: RefusedWrites, applied: AppliedWrites,
             write_live_at: Callable[[int], bool]) -> Admission:
    """Check every update against the replay rules (raises Refusal, nothing applied)
    and return those at or above their scope's start (REWIND_MATCHES_REPLAY) that this
    node did not refuse (REFUSED_IS_NOT_REPLAYED) and either applied before or whose
    transaction is still live (APPLIED_OR_LIVE). ``write_live_at`` may raise
    Refusal(UNAVAILABLE): nothing is applied, the replay retries."""
    for u in updates:
        floor = starts.mode_start(mode, u.vnode)
        if u.ts < floor:
            raise Refusal(grpc.StatusCode.FAILED_PRECONDITION,
                          f"timestamp {u.ts} is below the replay start {floor} of virtual node "
                          f"{u.vnode} ({mode} mode)")
        if not set(u.insert_keys) <= set(u.delete_keys):
            raise Refusal(grpc.StatusCode.FAILED_PRECONDITION,
                          "a standalone INSERT during replay: send DELETE + INSERT")
    due = [u for u in updates if u.ts >= starts.scope_start(u.table.table_id, u.vnode)]
    SKIPPED.inc(len(updates) - len(due))
    due = [u for u in due if not _refused(u, refused)]
    logged = applied.applied_among((u.table.table_id, u.vnode, u.ts) for u in due)
    live: dict[int, bool] = {}  # per request: only timestamps the log lacks are asked
    out: list[PreparedUpdate] = []
    inexact: list[int] = []
    for u in due:
        if (u.table.table_id, u.vnode, u.ts) in logged:
            out.append(u)
            if refused.partial(u.ts):  # maybe split: part of it refused (module doc)
                inexact.append(u.ts)
            continue
        if u.ts not in live:
            live[u.ts] = write_live_at(u.ts)
        if live[u.ts]:
            out.append(u)
            continue
        UNAPPLIED_SKIPPED.inc()
        log.info("replay_unapplied_write_skipped", ts=u.ts, table=u.table.name, vnode=u.vnode)
    return Admission(out, min(inexact, default=None))


def _refused(u: PreparedUpdate, refused: RefusedWrites) -> bool:
    writer = refused.skips(u.ts)
    if writer is None:
        return False
    REFUSED_SKIPPED.inc()
    log.info("replay_refused_write_skipped", ts=u.ts, writer_id=writer,
             table=u.table.name, vnode=u.vnode)
    return True
