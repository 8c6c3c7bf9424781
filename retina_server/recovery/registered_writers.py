"""Which writers a node takes writes from, and whose replay MarkReady waits for.

The node's side of ``retina_common/replay_sources.py``:

* WRITES_HAVE_A_REPLAY_SOURCE (:meth:`RegisteredWriters.admit`, every ordinary
  UpdateRecord): the request's ``writer_id`` is an ACTIVE registered replay source,
  so the rows it applies are in a durable changelog that recovery replays. Otherwise
  FAILED_PRECONDITION, before anything is applied. The registry is cached and read
  again when it is older than ``refresh_s`` or names no such writer (a writer that
  registered a moment ago); an etcd outage keeps the cached registry, and refuses
  UNAVAILABLE only a writer the cache does not know.
* EVERY_SOURCE_REPLAYED (:meth:`RegisteredWriters.check_replayed`, MarkReady from
  AWAITING_REPLAY): the driver replayed every ACTIVE source, read afresh from etcd
  (an outage: UNAVAILABLE, retry). A node never becomes READY without the rows of a
  writer it did not replay.

``retina.anonymous_writes = true`` (development only) lets an UpdateRecord with no
writer id through: its rows are applied but no changelog holds them, so a crash of
the node before its next checkpoint loses them. The node says so at start and every
minute such writes arrive (``anonymous_writes_not_crash_safe``), and counts them.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable

import grpc
from prometheus_client import Counter, Gauge

from retina_common import replay_sources
from retina_common.etcd import EtcdError, EtcdStore
from retina_common.log import get_logger
from retina_common.refusal import SOURCES_NOT_REPLAYED, Refusal
from retina_common.replay_sources import ReplaySource

log = get_logger(component="registered_writers")

ANONYMOUS = Counter("retina_anonymous_writes_total",
                    "UpdateRecord requests without a writer id, applied because "
                    "retina.anonymous_writes is on (not crash-safe)")
UNREGISTERED = Counter("retina_unregistered_writes_refused_total",
                       "UpdateRecord requests refused: no ACTIVE registered writer")
UNREPLAYED = Gauge("retina_replay_sources_unreplayed",
                   "ACTIVE replay sources the last refused MarkReady had not replayed "
                   "(0 once MarkReady passed)")
SOURCES = Gauge("retina_replay_sources", "Registered replay sources by state, as this node "
                "last read them", ["state"])

# How stale a node's view of the registry may be: a writer declared GONE is refused by
# every node at most this long after the declaration.
REFRESH_S = 5.0
HOW_TO_REGISTER = ("write through retina_common.writer.DurableWriter (or the CDC connector), "
                   "which logs every transaction durably and registers its writer id")


class RegisteredWriters:
    def __init__(self, etcd: EtcdStore, *, anonymous_writes: bool, refresh_s: float = REFRESH_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._etcd = etcd
        self.anonymous_writes = anonymous_writes
        self._refresh_s = refresh_s
        self._clock = clock
        self._lock = threading.Lock()
        self._sources: dict[str, ReplaySource] = {}
        self._read_at: float | None = None
        self._warned_at: float | None = None
        self._anonymous = 0
        if anonymous_writes:
            log.warning("anonymous_writes_not_crash_safe", setting="retina.anonymous_writes",
                        detail="UpdateRecord without a writer id is applied; a crash of this "
                               "node before its next checkpoint loses those rows")

    # --- WRITES_HAVE_A_REPLAY_SOURCE ---------------------------------------------------
    def admit(self, writer_id: str) -> None:
        if not writer_id:
            self._admit_anonymous()
            return
        source = self._cached(writer_id)
        if source is None or not source.active:
            UNREGISTERED.inc()
            raise Refusal(grpc.StatusCode.FAILED_PRECONDITION, _not_admitted(writer_id, source))

    def _admit_anonymous(self) -> None:
        if not self.anonymous_writes:
            UNREGISTERED.inc()
            raise Refusal(grpc.StatusCode.FAILED_PRECONDITION,
                          "UpdateRecord without writer_id: WRITES_HAVE_A_REPLAY_SOURCE: a write "
                          "no durable changelog holds would be lost by a crash of the node; "
                          f"{HOW_TO_REGISTER}")
        ANONYMOUS.inc()
        self._anonymous += 1
        now = self._clock()
        if self._warned_at is None or now - self._warned_at >= 60:
            self._warned_at = now
            log.warning("anonymous_writes_not_crash_safe", setting="retina.anonymous_writes",
                        applied_so_far=self._anonymous)

    def _cached(self, writer_id: str) -> ReplaySource | None:
        with self._lock:
            stale = self._read_at is None or self._clock() - self._read_at >= self._refresh_s
            source = self._sources.get(writer_id)
            if source is not None and not stale:
                return source
            try:
                self._store(replay_sources.load(self._etcd))
            except EtcdError as exc:
                if source is not None:
                    return source  # known before the outage; still ACTIVE as far as we know
                raise Refusal(grpc.StatusCode.UNAVAILABLE,
                              f"cannot read the replay-source registry ({exc}); retry") from exc
            return self._sources.get(writer_id)

    def _store(self, sources: dict[str, ReplaySource]) -> None:
        self._sources = sources
        self._read_at = self._clock()
        active = sum(s.active for s in sources.values())
        SOURCES.labels(state="ACTIVE").set(active)
        SOURCES.labels(state="GONE").set(len(sources) - active)

    # --- EVERY_SOURCE_REPLAYED ------------------------------------------------------------
    def check_replayed(self, replayed: Iterable[str]) -> None:
        try:
            sources = replay_sources.load(self._etcd)
        except EtcdError as exc:
            raise Refusal(grpc.StatusCode.UNAVAILABLE,
                          f"cannot read the replay-source registry ({exc}); retry MarkReady"
                          ) from exc
        with self._lock:
            self._store(sources)
        missing = replay_sources.unreplayed(sources, set(replayed))
        UNREPLAYED.set(len(missing))
        if missing:
            log.warning("mark_ready_sources_unreplayed", missing=missing)
            raise Refusal(grpc.StatusCode.FAILED_PRECONDITION,
                          f"{SOURCES_NOT_REPLAYED}: {', '.join(missing)}; replay every "
                          "registered writer's changelog "
                          "(the CDC connector and `retina-admin recover` do), or, if a "
                          "changelog is lost, declare its writer gone: `retina-admin writers "
                          "gone WRITER --reason ...`; the node stays AWAITING_REPLAY")


    def replay_complete(self) -> bool:
        """REPLAY_IS_COMPLETE (read_history.py), as of the last EVERY_SOURCE_REPLAYED
        check: no anonymous writes taken, and no writer declared GONE (a changelog not
        replayed). Conservative: a GONE writer that wrote nothing since this node's
        checkpoint counts too."""
        with self._lock:
            gone = any(not s.active for s in self._sources.values())
        return not self.anonymous_writes and not gone and self._read_at is not None


def _not_admitted(writer_id: str, source: ReplaySource | None) -> str:
    if source is None:
        return (f"writer {writer_id!r} is not a registered replay source "
                f"(WRITES_HAVE_A_REPLAY_SOURCE); {HOW_TO_REGISTER}")
    return (f"writer {writer_id!r} was declared GONE ({source.gone_reason!r}): its writes "
            "would never be replayed; register a new writer id")
