"""The query prober: gated snapshot reads all through the campaign, and the rule that
decides whether a served read could only have been served while a node was not READY.

Soundness of the rule. A node the controller killed is not READY from the moment its
process is confirmed gone (``down_at``). The first process started for it afterwards
moves only forward: RECOVERING, then READY. So if that process (still alive, the same
pid) *answers* RECOVERING or FAILED to a status request *sent* at ``t``, the node was not
READY during all of ``[down_at, t]``. A read that began at or after ``down_at`` and ended at
or before such a ``t`` was served entirely while that node was not READY: a gate breach.
No answer at all proves nothing (a busy READY node may be slow), and once a second process
was started the window stops growing (the first may have been READY, unobserved).
Reads refused by the gate (or failing while a node is down) are normal; they are counted.
"""

from __future__ import annotations

import random
import threading
import time
from dataclasses import dataclass

import grpc

from retina_common.pb import retina_pb2 as rpb
from retina_common.reader import SnapshotReader
from retina_common.topology import Topology

from .workload import SCHEMA, TABLES


@dataclass
class Window:
    node: str
    down_at: float
    last_not_ready: float  # send time of the latest proving "not READY" answer
    closed: bool = False
    first_pid: int = 0  # the first process started after down_at
    frozen: bool = False  # a second process was started: stop growing


class ReadinessTracker:
    """Not-READY windows per node, fed by the controller's kills, starts and status polls."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._open: dict[str, Window] = {}
        self._windows: list[Window] = []

    def down(self, node: str) -> None:
        """The controller confirmed ``node``'s process is gone."""
        now = time.monotonic()
        with self._lock:
            window = self._open.get(node)
            if window is not None and window.first_pid:
                window.closed = True  # a started process died: a new window begins
                window = None
            if window is None:
                window = Window(node, now, now)
                self._open[node] = window
                self._windows.append(window)

    def started(self, node: str, pid: int) -> None:
        with self._lock:
            window = self._open.get(node)
            if window is None:
                return
            if not window.first_pid:
                window.first_pid = pid
            elif window.first_pid != pid:
                window.frozen = True

    def observed(self, node: str, sent_at: float, state: int | None, pid: int) -> None:
        """A status answer: ``pid`` is the node's process, if still alive after it."""
        with self._lock:
            window = self._open.get(node)
            if window is None:
                return
            if state == rpb.READY:
                window.closed = True
                del self._open[node]
            elif (state in (rpb.RECOVERING, rpb.FAILED) and not window.frozen
                  and pid and pid == window.first_pid and sent_at >= window.down_at):
                window.last_not_ready = max(window.last_not_ready, sent_at)

    def breaches(self, reads: list[tuple[float, float]]) -> list[tuple[str, float, float]]:
        """Served reads that lie inside a not-READY window; forgets closed windows."""
        with self._lock:
            found = [(w.node, s, e) for s, e in reads for w in self._windows
                     if s >= w.down_at and e <= w.last_not_ready]
            self._windows = [w for w in self._windows if not w.closed]
        return found


class Prober:
    """A thread doing gated snapshot reads of random tables until stopped."""

    def __init__(self, trans_listen: str, topology: Topology, seed: int) -> None:
        self._reader = SnapshotReader(trans_listen, topology, timeout_s=5)
        self._rng = random.Random(seed)
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._served: list[tuple[float, float]] = []
        self.served = 0
        self.refused = 0  # BeginTrans refused: the gate (or the TransServer is down)
        self.failed = 0  # admitted, then a node or file could not be read
        self._thread = threading.Thread(target=self._run, name="prober", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(30)
        self._reader.close()

    def take_served(self) -> list[tuple[float, float]]:
        """The (start, end) of reads served since the last call."""
        with self._lock:
            out, self._served = self._served, []
        return out

    def _run(self) -> None:
        while not self._stop.is_set():
            self._one()
            self._stop.wait(0.05)  # pacing: the prober must not starve the cluster

    def _one(self) -> None:
        table = self._rng.choice(TABLES).name
        started = ended = time.monotonic()
        admitted = served = False
        try:
            with self._reader.transaction() as trans:
                admitted = True
                self._reader.read_in(trans, SCHEMA, table)
                ended = time.monotonic()
                served = True  # the rows were returned; ending the transaction is apart
        except (grpc.RpcError, RuntimeError, OSError):
            pass
        with self._lock:
            if served:
                self.served += 1
                self._served.append((started, ended))
            elif admitted:
                self.failed += 1
            else:
                self.refused += 1
