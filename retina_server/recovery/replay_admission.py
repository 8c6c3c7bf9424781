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

Invariant REFUSED_IS_NOT_REPLAYED: an update at a timestamp this node's write fence
refused before the crash, with nothing of it applied (refused_writes.py), is
acknowledged without being applied: its writer redid it at a new timestamp, which the
replay applies, and no reader of this node ever saw it at the old one. The match is on
the timestamp alone (one timestamp, one transaction of one writer; replay requests do
not name their writer). Counted (``retina_replay_refused_skipped_total``) and logged
(``replay_refused_write_skipped``).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import grpc
from prometheus_client import Counter

from retina_common.log import get_logger
from retina_common.refusal import Refusal
from retina_common.replay_ts import ReplayStarts
from retina_server.refused_writes import RefusedWrites
from retina_server.update_record import PreparedUpdate

log = get_logger(component="replay_admission")

REFUSED_SKIPPED = Counter("retina_replay_refused_skipped_total",
                          "Replayed table updates acknowledged without applying: their "
                          "timestamp was refused by this node's write fence before the crash")
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


def to_apply(updates: list[PreparedUpdate], starts: ReplayStarts, mode: str,
             refused: RefusedWrites) -> list[PreparedUpdate]:
    """Check every update against the replay rules (raises Refusal, nothing applied)
    and return those at or above their scope's start (REWIND_MATCHES_REPLAY) whose
    timestamp this node did not refuse (REFUSED_IS_NOT_REPLAYED)."""
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
    applied = []
    for u in due:
        writer = refused.skips(u.ts)
        if writer is None:
            applied.append(u)
            continue
        REFUSED_SKIPPED.inc()
        log.info("replay_refused_write_skipped", ts=u.ts, writer_id=writer,
                 table=u.table.name, vnode=u.vnode)
    return applied
