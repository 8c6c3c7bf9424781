"""The application writer's workload: a second, non-connector writer in every episode.

``chaos/app_writer.py`` runs as a child process of the campaign (the cluster's process
``writer``, writer id ``chaos-app``: a registered replay source beside the connector)
and writes the Retina table ``chaos.app_items`` (``workload.APP_TABLE``), which nothing
else writes. Every workload step of the campaign (``FaultContext.write``) also hands
it one or two transactions, one at a time, drawn from the episode's own stream for it
(upserts and deletes of keys from a small key space, one in twenty a large one), when it
is open and idle, and waits up to ``ANSWER_WAIT_S`` for each answer: most steps end with
their transactions acknowledged, so the node kills that follow a step find acknowledged
rows of this writer above the killed node's checkpoint, which its recovery must replay
from this writer's changelog. A transaction still running when the step gives up (a
node down: the writer waits for it) is answered later.

The answers keep the model (``chaos/app_model.py``), which the comparison after every
episode checks the whole table against (``compare.compare_once``). A writer process that
ended (its failpoint, an error after its log append) is started again at the next step
(unless ``held``: the writer failpoint episode may leave it down through the comparison,
so that the in-doubt rule is what the comparison checks), and after healing
(:meth:`AppWriter.settle`), whose successful open applies what it left in doubt.
"""

from __future__ import annotations

import contextlib
import json
import queue
import random
import threading
import time
from collections import Counter
from collections.abc import Callable
from typing import IO, Any

from retina_common import exit_codes
from retina_common.checkpoint_store import CorruptCheckpoint, Pointer
from retina_common.codec import encode_primary_key
from retina_common.etcd import EtcdError, EtcdStore
from retina_common.keys import checkpoint_slot_key
from retina_common.log import logged_events
from retina_common.topology import Topology

from .app_model import AppModel, Expected, Txn
from .campaign_cluster import APP_WRITER_ID, CDC, WRITER, ChaosCluster, Proc
from .workload import APP_TABLE, Key, Row

# The episode's stream for the application writer: random.Random(episode seed ^ this).
APP_STREAM = 0xA4417
# An answer takes 10 to 70 ms while every node is READY (35 ms median); a node down makes
# the writer retry until it is back, and the step must not wait for that.
ANSWER_WAIT_S = 0.5
# A step that finds the writer just started waits this long for its open (a process
# start and an open take one to two seconds).
OPEN_WAIT_S = 5.0
SETTLE_S = 30.0  # after healing: open, its last transaction answered
STOP_S = 30.0  # a stop lets the running transaction finish (a node may be restarting)
# End of input, in doubt after an error (as retina-write), a failpoint.
EXPECTED_EXITS = (0, 1, exit_codes.KILLED_AT_FAILPOINT)
LARGE_P = 0.05
DELETE_P = 0.25
Answer = dict[str, Any] | None  # None: end of the process's output


def _read_answers(stream: IO[bytes], answers: queue.Queue[Answer]) -> None:
    for line in stream:
        try:
            answers.put(json.loads(line))
        except ValueError:
            answers.put({"garbled": line.decode(errors="replace")[:200]})
    answers.put(None)


class AppWriter:
    """The writer process of one cluster, its model and its counts (``app`` in the
    report)."""

    table = APP_TABLE

    def __init__(self, cluster: ChaosCluster, topology: Topology, etcd: EtcdStore) -> None:
        self.cluster = cluster
        self.topology = topology
        self.etcd = etcd
        self.model = AppModel(len(APP_TABLE.pk))
        self.counts: Counter[str] = Counter()
        self.held = False  # left down on purpose: not started again until release()
        self.exit_code: int | None = None  # of the last process that ended
        self._findings: list[tuple[str, str]] = []  # (anomaly kind, detail)
        self._notes: list[str] = []
        self._proc: Proc | None = None
        self._answers: queue.Queue[Answer] = queue.Queue()
        self._opened = False
        self._killed = False  # the campaign killed it (a stop that timed out)
        self._seq = 0
        types = {c.name: c.type for c in APP_TABLE.columns}
        self._key_types = [types[c] for c in APP_TABLE.pk]

    # --- the process ----------------------------------------------------------------------
    def start(self, failpoints: str = "") -> None:
        proc = self.cluster.start_writer(failpoints)
        assert proc.popen.stdout is not None
        answers: queue.Queue[Answer] = queue.Queue()
        threading.Thread(target=_read_answers, args=(proc.popen.stdout, answers),
                         name="chaos-app-answers", daemon=True).start()
        self._proc, self._answers, self._opened, self._killed = proc, answers, False, False
        self.exit_code = None
        self.counts["starts"] += 1

    def running(self) -> bool:
        self._drain()
        return self._proc is not None

    def stop(self, timeout_s: float = STOP_S) -> None:
        """End the process the way it ends by itself: its input closed, it finishes the
        running transaction and exits 0. Killed (its transaction then unknown) only if
        it has not within ``timeout_s``."""
        self._drain()
        if self._proc is None:
            return
        assert self._proc.popen.stdin is not None
        with contextlib.suppress(OSError):
            self._proc.popen.stdin.close()
        if not self._wait(lambda: self._proc is None, timeout_s):
            self.counts["stop_killed"] += 1
            self._notes.append(f"the application writer did not stop within {timeout_s:.0f}s: "
                               "killed")
            self._killed = True
            self.cluster.kill(WRITER)
            self._wait(lambda: self._proc is None, 10)

    def restart(self, failpoints: str = "") -> None:
        self.stop()
        self.start(failpoints)

    def hold(self) -> None:
        self.held = True

    def release(self) -> None:
        self.held = False

    def wait_opened(self, timeout_s: float = SETTLE_S) -> bool:
        """Until the running process is open (False: it ended or the deadline passed)."""
        return self._wait(lambda: self._opened or self._proc is None, timeout_s) and \
            self._opened

    def settle(self, timeout_s: float = SETTLE_S) -> str:
        """After healing: the writer running and open (started again if it ended, unless
        held), its last transaction answered. Returns what is wrong, or ""."""
        deadline = time.monotonic() + timeout_s
        while True:
            self._drain()
            if self.held:
                return ""
            if self._proc is None:
                self.start()
            elif self._opened and self.model.pending is None:
                return ""
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                state = "not open" if not self._opened else \
                    f"transaction {self.model.pending.seq if self.model.pending else '?'} " \
                    "unanswered"
                return (f"the application writer is {state} {timeout_s:.0f}s after healing "
                        f"(starts {self.counts['starts']}, last exit {self.exit_code})")
            self._drain(min(remaining, 0.5))

    def close(self) -> None:
        """At the cluster's end: stop the writer, count the connector's replays."""
        self.stop(5)
        events = logged_events(self.cluster.log_path(CDC), "cdc_replay_start")
        self.counts["cdc_replays"] += len(events)
        self.counts["cdc_replays_with_writer"] += sum(
            APP_WRITER_ID in e.get("writers", []) for e in events)

    # --- the workload ---------------------------------------------------------------------
    def step(self, rng: random.Random) -> None:
        """One or two transactions while the writer is open and idle, each answer awaited
        for up to ANSWER_WAIT_S; else nothing. A process that ended is started again
        (unless held), and its open awaited for up to OPEN_WAIT_S."""
        self._drain()
        if self._proc is None and not self.held:
            self.start()
        if self._proc is not None and not self._opened:
            self.wait_opened(OPEN_WAIT_S)
        for _ in range(rng.randint(1, 2)):
            if self._proc is None or not self._opened or self.model.pending is not None:
                return
            self._send(self._draw(rng))
            self._wait(lambda: self.model.pending is None, ANSWER_WAIT_S)

    def _draw(self, rng: random.Random) -> Txn:
        """Upserts of keys from the key space, deletes of present keys (mostly) or of any."""
        self._seq += 1
        size = rng.randint(40, 120) if rng.random() < LARGE_P else rng.randint(1, 6)
        present = sorted(self.model.rows)
        changes: dict[Key, Row | None] = {}
        for _ in range(size):
            if rng.random() < DELETE_P:
                key = rng.choice(present) if present and rng.random() < 0.7 else \
                    APP_TABLE.key(rng)
                changes[key] = None
            else:
                key = APP_TABLE.key(rng)
                changes[key] = key + APP_TABLE.values(rng)
        return Txn(self._seq, tuple(r for r in changes.values() if r is not None),
                   tuple(k for k, r in changes.items() if r is None))

    def _send(self, txn: Txn) -> None:
        assert self._proc is not None and self._proc.popen.stdin is not None
        columns, pk = APP_TABLE.all_columns, APP_TABLE.pk
        line = json.dumps({"seq": txn.seq,
                           "upserts": [dict(zip(columns, r, strict=True)) for r in txn.upserts],
                           "deletes": [dict(zip(pk, k, strict=True)) for k in txn.deletes]})
        self.model.sent(txn)
        self.counts["sent"] += 1
        self.counts["rows_upserted"] += len(txn.upserts)
        self.counts["rows_deleted"] += len(txn.deletes)
        try:
            self._proc.popen.stdin.write(line.encode() + b"\n")
            self._proc.popen.stdin.flush()
        except OSError:
            pass  # it is gone; its end arrives with its output's (and decides the model)

    # --- answers --------------------------------------------------------------------------
    def _wait(self, done: Callable[[], bool], timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while not done():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            self._drain(remaining)
        return True

    def _drain(self, timeout_s: float = 0.0) -> None:
        """Handle every answer there is; with ``timeout_s``, wait that long for the first."""
        try:
            message = self._answers.get(timeout=timeout_s) if timeout_s > 0 else \
                self._answers.get_nowait()
        except queue.Empty:
            return
        self._handle(message)
        while True:
            try:
                message = self._answers.get_nowait()
            except queue.Empty:
                return
            self._handle(message)

    def _handle(self, message: Answer) -> None:
        if message is None:
            self._ended()
        elif "opened" in message:
            self._opened = True
            self.counts["opens"] += 1
            self.counts["in_doubt_resolved"] += self.model.opened()
        elif "open_failed" in message:
            self.counts["open_failed"] += 1
            self._notes.append(f"application writer: open failed: {message['open_failed']}")
        elif "ts" in message:
            self.model.acknowledged(int(message["seq"]), int(message["ts"]))
            self.counts["acknowledged"] += 1
        elif "error" in message:
            self._failed(int(message["seq"]), str(message["error"]), bool(message["logged"]))
        else:
            self._findings.append(("app_writer_garbled", f"answer {message}"))

    def _failed(self, seq: int, error: str, logged: bool) -> None:
        if logged:  # in doubt: the process exits 1 now; the next one's open applies it
            self.model.logged_not_acknowledged(seq)
            self.counts["in_doubt_error"] += 1
            self._opened = False
        else:
            self.model.not_sent(seq)
            self.counts["not_sent"] += 1
            if "UNAVAILABLE" in error:
                return  # the TransServer restarting: counted, routine
        self._notes.append(f"application writer: transaction {seq} "
                           f"{'in doubt' if logged else 'not sent'}: {error[:200]}")

    def _ended(self) -> None:
        assert self._proc is not None
        code = self._proc.popen.wait()
        self.exit_code = code
        self.counts[f"exit_{code}"] += 1
        at_failpoint = code == exit_codes.KILLED_AT_FAILPOINT
        txn = self.model.died(at_failpoint=at_failpoint)
        if txn is not None:
            self.counts["in_doubt_killed" if at_failpoint else "unknown"] += 1
        if code not in EXPECTED_EXITS and not self._killed:
            self._findings.append(("unexpected_exit",
                                   f"the application writer exited {code}"
                                   + (f" running transaction {txn.seq}" if txn else "")))
        self._proc, self._opened = None, False

    # --- what the campaign reads ----------------------------------------------------------
    def expected(self) -> Expected:
        return self.model.expected()

    def drain(self) -> tuple[list[tuple[str, str]], list[str]]:
        """The anomalies (kind, detail) and notes since the last call."""
        self._drain()
        findings, notes = self._findings, self._notes
        self._findings, self._notes = [], []
        return findings, notes

    def node_killed(self, node: str) -> None:
        """Count a node killed with acknowledged rows of this writer above its checkpoint
        (its ``current`` slot's checkpointAppliedTs): its recovery must replay them from
        this writer's changelog."""
        self._drain()
        self.counts["node_kills"] += 1
        try:
            kv = self.etcd.get(checkpoint_slot_key(node, "current"))
            applied = Pointer.parse(kv.value).checkpoint_applied_ts if kv is not None else 0
        except (EtcdError, CorruptCheckpoint):
            return
        keys = [k for k in self.model.acknowledged_after(applied) if self._owner(k) == node]
        if keys:
            self.counts["node_kills_with_rows_to_replay"] += 1
            self.counts["rows_to_replay"] += len(keys)

    def _owner(self, key: Key) -> str:
        encoded = encode_primary_key(self._key_types, list(key))
        return self.topology.node_of_vnode(self.topology.vnode_of_key(encoded))
