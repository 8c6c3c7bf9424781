"""Refused writes: the timestamps this node's write fence refused, so that replay skips them.

A write the fence refuses (write_fence.py, LATE_WRITES_FENCED) changes nothing here, and
its writer redoes the batch at a new timestamp T'. Both T and T' are in the writer's
durable changelog (a writer logs before it sends), so a recovery replay would apply the
batch at T as well, and the rebuilt history would hold a change at T that no reader of
this node ever saw (docs/history.md, "Restarts"). So before the node answers ABORTED it
records every timestamp of the request at or below the floor that refused it, durably
(one LMDB write transaction in the primary index's environment, database
``refused_writes``), and recovery replay skips those timestamps (replay_admission.py).
A timestamp of the request above the floor (a CDC batch spans several) is not recorded:
nothing stops it from being admitted later.

Invariants:

* REFUSED_IS_RECORDED_BEFORE_ANSWERED: ABORTED for a fenced ordinary write is answered
  only after its record is durable; a record that cannot be written is UNAVAILABLE (the
  writer retries; nothing was applied). A crash in between leaves a record and no answer:
  the writer's retry is refused again (the floor rises to the HWM at MarkReady), so the
  record stands for what happened.
* SKIP_ONLY_WHAT_CHANGED_NOTHING: a timestamp is skipped by replay only if, when it was
  refused, no version at it existed in the primary index: a refusal that follows a part
  of the same transaction applied here (an earlier request of it admitted before the
  floor rose; or the replay of a process before this one) is recorded as *partial*, and
  replay applies it as it always did. Every applied write leaves a version at its
  timestamp unless it changed nothing, and after the refusal nothing is applied at that
  timestamp any more on this node (it is at or below the floor, which never falls while
  the process lives; a later process raises its floor to the HWM at MarkReady, and every
  floor is at most the HWM of its time; replays skip it by the record), so skipping a
  non-partial timestamp rebuilds exactly what readers saw. The check waits for every
  admitted write at or below the request's timestamps first (FENCE_WAITS_FOR_ADMITTED),
  so an earlier part still in its apply is seen.
* A timestamp identifies one transaction of one writer (the TransServer issues each
  timestamp once), so replay matches on the timestamp alone: replay requests do not
  name their writer (changelog_replay.merged_replay_requests), and needn't. The writer
  id is kept for the log lines and the operator.

Records are facts about what happened before a crash, not state a replay rebuilds:
cleansing leaves them. They are pruned below the replay floor (the lowest replay start
a restart can still use: gc_scheduler.ReplayFloor), where no replay asks for them.
"""

from __future__ import annotations

import struct
import threading
from collections.abc import Iterable

import grpc
import lmdb
from prometheus_client import Counter, Gauge

from retina_common import failpoints as fp
from retina_common.log import get_logger
from retina_common.refusal import Refusal
from retina_server.primary_index import PrimaryIndex

log = get_logger(component="refused_writes")

RECORDED = Counter("retina_refused_writes_recorded_total",
                   "Timestamps of fenced ordinary writes recorded before answering ABORTED",
                   ["kind"])
RECORDS = Gauge("retina_refused_writes", "Refusal records kept (pruned below the replay floor)")

_TS = struct.Struct(">Q")
_WHOLE, _PARTIAL = b"W", b"P"


class RefusedWrites:
    """The node's refusal records: durable in LMDB, mirrored in memory (they are few: one
    per fenced timestamp, pruned below the replay floor). Thread-safe."""

    def __init__(self, primary: PrimaryIndex) -> None:
        self._primary = primary
        self._db = primary.env.open_db(b"refused_writes")
        self._lock = threading.Lock()
        self._records: dict[int, tuple[bool, str]] = {}  # ts -> (partial, writer id)
        with primary.env.begin(db=self._db) as txn:
            for key, value in txn.cursor(db=self._db):
                self._records[_TS.unpack(key)[0]] = (value[:1] == _PARTIAL,
                                                      value[1:].decode())
        RECORDS.set(len(self._records))

    def record(self, writer_id: str, timestamps: Iterable[int]) -> None:
        """Record the fenced request's timestamps (REFUSED_IS_RECORDED_BEFORE_ANSWERED).
        The caller has waited for the admitted writes at or below them."""
        stamps = sorted(set(timestamps))
        partial = {ts: self._primary.has_versions_at(ts) for ts in stamps}
        fp.REFUSED_WRITES_RECORD_BEFORE.hit()
        try:
            with self._primary.env.begin(write=True, db=self._db) as txn:
                for ts in stamps:
                    txn.put(_TS.pack(ts), (_PARTIAL if partial[ts] else _WHOLE)
                            + writer_id.encode(), db=self._db)
        except lmdb.Error as exc:
            raise Refusal(grpc.StatusCode.UNAVAILABLE,
                          f"write fenced, and its refusal could not be recorded ({exc}); "
                          "nothing applied: retry") from exc
        fp.REFUSED_WRITES_RECORD_AFTER.hit()
        with self._lock:
            for ts in stamps:
                self._records[ts] = (partial[ts], writer_id)
            RECORDS.set(len(self._records))
        for ts in stamps:
            RECORDED.labels(kind="partial" if partial[ts] else "whole").inc()
        log.info("refused_write_recorded", writer_id=writer_id, timestamps=stamps,
                 partial=[ts for ts in stamps if partial[ts]])

    def skips(self, ts: int) -> str | None:
        """The writer whose write at ``ts`` this node refused with nothing of it applied
        (replay skips it: SKIP_ONLY_WHAT_CHANGED_NOTHING); None: replay applies ``ts``."""
        with self._lock:
            found = self._records.get(ts)
        return found[1] if found is not None and not found[0] else None

    def records(self) -> dict[int, tuple[bool, str]]:
        """ts -> (partial, writer id), for status and tests."""
        with self._lock:
            return dict(self._records)

    def prune_below(self, floor: int) -> int:
        """Drop the records below ``floor`` (the replay floor: no replay starts below it).
        One LMDB transaction: a crash leaves all or none of them. Returns how many went;
        a storage failure is logged and the next GC round tries again (a record kept
        longer only costs space)."""
        with self._lock:
            doomed = sorted(ts for ts in self._records if ts < floor)
        if not doomed:
            return 0
        fp.REFUSED_WRITES_PRUNE_BEFORE.hit()
        try:
            with self._primary.env.begin(write=True, db=self._db) as txn:
                for ts in doomed:
                    txn.delete(_TS.pack(ts), db=self._db)
        except lmdb.Error as exc:
            log.warning("refused_writes_prune_failed", floor=floor, error=str(exc))
            return 0
        fp.REFUSED_WRITES_PRUNE_AFTER.hit()
        with self._lock:
            for ts in doomed:
                self._records.pop(ts, None)
            RECORDS.set(len(self._records))
        return len(doomed)
