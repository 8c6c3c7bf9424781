"""Intake: the source is read and translated on its own thread.

Reading and decoding the source (and translating rows into the CDC replace
encoding) overlaps with the previous batch's changelog write, sends and
commit, instead of waiting for them. The intake thread is the only user of
the source object: acknowledgements are handed to it (:meth:`ack`) and it
sends them between polls, since a replication connection is not safe to use
from two threads.

A malformed transaction, or a broken source stream, is queued as an error in
its place, so the connector commits everything before it and then stops.
"""

from __future__ import annotations

import queue
import threading
from dataclasses import dataclass

import structlog

from cdc_client.schema_change import UnsupportedSchemaChange
from cdc_client.source import Source, SourceError, SourceTransaction
from cdc_client.translate import MalformedChange, TableMap, translate
from retina_common.changelog import ChangeRow
from retina_common.topology import Topology

log = structlog.get_logger("cdc")
_POLL_S = 0.05  # how long an acknowledgement may wait for the intake thread


class SourceLost(Exception):
    """The source connection broke (e.g. the source database restarted)."""


@dataclass(frozen=True)
class Item:
    trans: SourceTransaction | None
    rows: list[ChangeRow]
    error: Exception | None = None


class Intake:
    def __init__(self, source: Source, tables: TableMap, topology: Topology,
                 max_queued: int = 5000) -> None:
        self._source = source
        self._tables = tables
        self._topology = topology
        self._queue: queue.Queue[Item] = queue.Queue(max_queued)
        self._ack: str | None = None
        self._ack_lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="intake", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)

    def ack(self, position: str) -> None:
        with self._ack_lock:
            self._ack = position

    def get(self, timeout_s: float) -> Item | None:
        try:
            return self._queue.get(timeout=max(0.0, timeout_s))
        except queue.Empty:
            return None

    def queued(self) -> int:
        return self._queue.qsize()

    def _send_ack(self) -> None:
        with self._ack_lock:
            position, self._ack = self._ack, None
        if position is not None:
            self._source.ack(position)

    def _put(self, item: Item) -> None:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=_POLL_S)
                return
            except queue.Full:
                self._send_ack()  # the connector is behind: keep the source alive

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self._send_ack()
                trans = self._source.poll(_POLL_S)
                if trans is None:
                    continue
                try:
                    item = Item(trans, translate(trans, self._tables, self._topology))
                except (MalformedChange, UnsupportedSchemaChange) as exc:
                    self._put(Item(trans, [], exc))
                    return
                self._put(item)
        except (SourceError, UnsupportedSchemaChange) as exc:
            # UnsupportedSchemaChange here: a table or column a source read names is gone.
            self._put(Item(None, [], exc))
        except Exception as exc:  # a dropped source connection, a bug: stop, do not hang
            log.error("cdc_intake_failed", error=str(exc), error_type=type(exc).__name__)
            # Not a SourceError: nothing is wrong with the events, so this is a crash
            # (exit 1) that a restart resumes from the committed position, not a stop.
            self._put(Item(None, [], SourceLost(f"source failed: {exc}")))
        finally:
            self._send_ack()
