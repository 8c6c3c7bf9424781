"""The read-only query gate (specification section 7, C05.5).

The gate keeps a local ``QueryAvailabilitySnapshot``: the topology's expected
Retina nodes and what their lifecycle keys said, kept current by a watch on
``/pixels/retina/lifecycle/``. A read-only transaction is admitted only if
the watch is initialised and healthy and every expected node is present,
well-formed, READY and fresh. Anything else fails closed with a reason per
node. Decisions read the snapshot only: no etcd round trip per call.

Invariant GATE_FAIL_CLOSED: whenever the gate cannot prove every expected
node READY from a live watch, it refuses.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from types import MappingProxyType

from retina_common.etcd import EtcdError, EtcdStore, KeyValue, PrefixWatch, WatchEvent
from retina_common.keys import LIFECYCLE_PREFIX, node_of_lifecycle_key
from retina_common.lifecycle_record import LifecycleRecord, LifecycleState, MalformedLifecycleValue
from retina_common.log import get_logger

log = get_logger(component="gate")


class NodeAvailability(StrEnum):
    READY = "READY"
    RECOVERING = "RECOVERING"
    FAILED = "FAILED"
    MISSING = "missing"
    STALE = "stale"
    MALFORMED = "malformed"


@dataclass(frozen=True)
class NodeEntry:
    """What the lifecycle key of one node said, as parsed at watch time."""

    record: LifecycleRecord | None
    error: str = ""
    mod_revision: int = 0


@dataclass(frozen=True)
class QueryAvailabilitySnapshot:
    initialized: bool
    watch_healthy: bool
    entries: Mapping[str, NodeEntry] = field(default_factory=dict)
    revision: int = 0
    note: str = "lifecycle watch not initialised yet"


@dataclass(frozen=True)
class GateDecision:
    admitted: bool
    # expected node -> its availability (READY for admitted nodes)
    nodes: Mapping[str, NodeAvailability]
    message: str

    @property
    def refusal_reasons(self) -> dict[str, NodeAvailability]:
        return {n: a for n, a in self.nodes.items() if a != NodeAvailability.READY}


class QueryAvailabilityGate:
    """The decision side. Thread-safe: the snapshot is immutable and swapped whole."""

    def __init__(self, expected_nodes: Iterable[str], stale_after_ms: int,
                 clock_ms: Callable[[], int], *, enabled: bool = True) -> None:
        self._expected = tuple(sorted(expected_nodes))
        if enabled and not self._expected:
            raise ValueError("the query gate needs at least one expected Retina node")
        self._stale_after_ms = stale_after_ms
        self._clock_ms = clock_ms
        self._enabled = enabled
        self._lock = threading.Lock()
        self._snapshot = QueryAvailabilitySnapshot(initialized=False, watch_healthy=False)

    @property
    def expected_nodes(self) -> tuple[str, ...]:
        return self._expected

    @property
    def snapshot(self) -> QueryAvailabilitySnapshot:
        return self._snapshot

    # --- snapshot maintenance (called by the watcher) --------------------------------
    def reset(self, kvs: Iterable[KeyValue], revision: int) -> None:
        """Replace the snapshot with a full listing taken at ``revision``."""
        entries = {node_of_lifecycle_key(kv.key): _entry(kv.key, kv.value, kv.mod_revision)
                   for kv in kvs}
        with self._lock:
            self._snapshot = QueryAvailabilitySnapshot(
                initialized=True, watch_healthy=True, entries=MappingProxyType(entries),
                revision=revision, note="")

    def apply(self, events: Iterable[WatchEvent]) -> None:
        with self._lock:
            current = self._snapshot
            entries = dict(current.entries)
            revision = current.revision
            for event in events:
                if event.mod_revision and event.mod_revision <= revision and event.kind == "PUT":
                    continue  # already part of the listing
                node = node_of_lifecycle_key(event.key)
                if event.kind == "DELETE":
                    entries.pop(node, None)
                else:
                    entries[node] = _entry(event.key, event.value, event.mod_revision)
                revision = max(revision, event.mod_revision)
            self._snapshot = QueryAvailabilitySnapshot(
                initialized=current.initialized, watch_healthy=current.watch_healthy,
                entries=MappingProxyType(entries), revision=revision, note=current.note)

    def mark_watch_broken(self, reason: str) -> None:
        with self._lock:
            current = self._snapshot
            self._snapshot = QueryAvailabilitySnapshot(
                initialized=current.initialized, watch_healthy=False, entries=current.entries,
                revision=current.revision, note=f"lifecycle watch lost: {reason}")

    # --- decision ----------------------------------------------------------------------
    def availability(self, node: str, snapshot: QueryAvailabilitySnapshot,
                     now_ms: int) -> NodeAvailability:
        entry = snapshot.entries.get(node)
        if entry is None:
            return NodeAvailability.MISSING
        if entry.record is None:
            return NodeAvailability.MALFORMED
        if entry.record.state != LifecycleState.READY:
            return NodeAvailability(entry.record.state.value)
        if now_ms - entry.record.updated_at_ms > self._stale_after_ms:
            return NodeAvailability.STALE
        return NodeAvailability.READY

    def check(self, snapshot: QueryAvailabilitySnapshot | None = None) -> GateDecision:
        """Decide from the local snapshot (or ``snapshot``, one the caller took, so what it
        reports beside the decision is what the decision saw) whether a read-only
        transaction may begin."""
        if not self._enabled:
            return GateDecision(True, {}, "Retina disabled: nothing to gate")
        snapshot = self._snapshot if snapshot is None else snapshot
        now_ms = self._clock_ms()
        nodes = {n: self.availability(n, snapshot, now_ms) for n in self._expected}
        if not snapshot.initialized or not snapshot.watch_healthy:
            return GateDecision(False, nodes, f"query gate closed: {snapshot.note}")
        bad = {n: a for n, a in nodes.items() if a != NodeAvailability.READY}
        if bad:
            detail = "; ".join(f"{n} is {_describe(a, snapshot.entries.get(n))}"
                               for n, a in bad.items())
            return GateDecision(False, nodes, f"query gate closed: {detail}")
        return GateDecision(True, nodes, "every expected Retina node is READY")


def _describe(availability: NodeAvailability, entry: NodeEntry | None) -> str:
    if availability == NodeAvailability.MALFORMED and entry is not None:
        return f"malformed ({entry.error})"
    if availability == NodeAvailability.STALE and entry is not None and entry.record:
        return f"stale (last update at {entry.record.updated_at_ms} ms)"
    return availability.value


def _entry(key: str, value: bytes, mod_revision: int) -> NodeEntry:
    node = node_of_lifecycle_key(key)
    try:
        return NodeEntry(LifecycleRecord.parse(node, value), mod_revision=mod_revision)
    except MalformedLifecycleValue as exc:
        return NodeEntry(None, error=str(exc), mod_revision=mod_revision)


class LifecycleWatcher:
    """Keeps a gate's snapshot current: list, then watch from the next revision.

    When the watch breaks the gate is told at once (and refuses); the watcher
    lists again and re-watches after a short back-off.
    """

    def __init__(self, store: EtcdStore, gate: QueryAvailabilityGate, retry_ms: int,
                 on_state: Callable[[bool], None] | None = None) -> None:
        self._store = store
        self._gate = gate
        self._retry_s = retry_ms / 1000
        self._on_state = on_state or (lambda _healthy: None)
        self._stop = threading.Event()
        self._broken = threading.Event()
        self._watch: PrefixWatch | None = None
        self._thread = threading.Thread(target=self._run, name="lifecycle-watcher", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._broken.set()
        if self._watch is not None:
            self._watch.cancel()
        self._thread.join(timeout=5)

    def _on_broken(self, reason: str) -> None:
        self._gate.mark_watch_broken(reason)
        self._on_state(False)
        self._broken.set()

    def _run(self) -> None:
        while not self._stop.is_set():
            self._broken.clear()
            try:
                kvs, revision = self._store.get_prefix(LIFECYCLE_PREFIX)
            except EtcdError as exc:
                self._gate.mark_watch_broken(f"cannot list lifecycle keys: {exc}")
                self._on_state(False)
                self._stop.wait(self._retry_s)
                continue
            self._gate.reset(kvs, revision)
            self._watch = self._store.watch_prefix(
                LIFECYCLE_PREFIX, revision + 1, self._gate.apply, self._on_broken)
            self._on_state(True)
            log.info("lifecycle_watch_started", revision=revision, nodes=len(kvs))
            self._broken.wait()
            self._watch.cancel()
            if not self._stop.is_set():
                self._stop.wait(self._retry_s)
