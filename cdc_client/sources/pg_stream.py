"""The logical replication stream, read and acknowledged by us, not by psycopg2.

Why not psycopg2's ``ReplicationCursor.read_message`` / ``send_feedback``:
on every keepalive, psycopg2 moves the flush position it reports to the
keepalive's ``wal_end`` once the flush position we gave it is at or past the
*start* of the last message it read (``pqpath.c``,
``explicitly_flushed_lsn >= last_msg_data_start``). That start is not
monotonic: a transaction that began before an acknowledged commit carries
change LSNs below it. With transactions read ahead of what the connector has
committed, such a keepalive confirms the read-ahead ones, the slot skips them
after a crash, and they are lost (the fault campaign's seed 1132; the
regression test ``test_read_ahead_is_never_confirmed_by_a_keepalive``).

So psycopg2 only opens the connection (authentication, TLS) and sends
``START_REPLICATION``; this module then speaks the CopyBoth sub-protocol on
the same libpq connection through ctypes: it reads XLogData and keepalive
messages and sends standby status updates whose flush position is exactly
what its caller confirmed, and nothing else.
"""

from __future__ import annotations

import ctypes
import struct
import threading
import time
from dataclasses import dataclass
from typing import Any, NamedTuple

import psycopg2

# Standby status update times count microseconds from 2000-01-01 UTC.
_PG_EPOCH_S = 946_684_800
_XLOGDATA_END = 1 + 8 + 8 + 8  # 'w', data start, WAL end, send time: then the payload
_KEEPALIVE = struct.Struct("!QQB")  # WAL end, send time, reply requested
_STATUS = struct.Struct("!cQQQQB")  # 'r', write, flush, apply, send time, reply


class XLogData(NamedTuple):  # one per row read: a tuple is the cheapest record
    payload: bytes


class Keepalive(NamedTuple):
    wal_end: int


@dataclass(frozen=True)
class _LibPq:
    """The libpq calls the stream makes. Those that never block (reading what has
    arrived, freeing, error text) keep the GIL (``PyDLL``): a call that releases it
    per message would wait for the GIL back behind the connector's busy threads, up
    to the 5 ms switch interval each time, for every row of a transaction. Those
    that may block on a full socket (sending a status update) release it (``CDLL``)."""

    keep_gil: ctypes.PyDLL
    release_gil: ctypes.CDLL  # also PQgetResult, which may wait for the server


def _load_libpq() -> _LibPq:
    # libpq as psycopg2's extension module resolves it: dlsym through a handle on
    # that module searches its own dependencies, so this is the very libpq (bundled
    # or the system's) that made psycopg2's PGconn, whatever other libpq the process
    # may load.
    import psycopg2._psycopg as extension

    keep, release = ctypes.PyDLL(extension.__file__), ctypes.CDLL(extension.__file__)
    conn, buf = ctypes.c_void_p, ctypes.c_void_p
    for lib, name, argtypes, restype in (
            (keep, "PQgetCopyData", [conn, ctypes.POINTER(buf), ctypes.c_int], ctypes.c_int),
            (keep, "PQconsumeInput", [conn], ctypes.c_int),
            (keep, "PQerrorMessage", [conn], ctypes.c_char_p),
            (keep, "PQfreemem", [buf], None),
            (release, "PQgetResult", [conn], ctypes.c_void_p),  # may wait for the server
            (keep, "PQresultErrorMessage", [ctypes.c_void_p], ctypes.c_char_p),
            (keep, "PQclear", [ctypes.c_void_p], None),
            (release, "PQputCopyData", [conn, ctypes.c_char_p, ctypes.c_int], ctypes.c_int),
            (release, "PQflush", [conn], ctypes.c_int)):
        function = getattr(lib, name)
        function.argtypes, function.restype = argtypes, restype
    return _LibPq(keep, release)


_libpq: _LibPq | None = None


def _lib() -> _LibPq:
    global _libpq
    if _libpq is None:
        _libpq = _load_libpq()  # psycopg2, imported above, has loaded its libpq
    return _libpq


class ReplicationStream:
    """CopyBoth messages of a started logical replication connection.

    ``confirmed`` is the flush position reported to the server: it only moves
    by :meth:`confirm`. A keepalive is handed to the caller (who alone knows
    whether its ``wal_end`` is safe to confirm) and, when the server asks for
    a reply, answered at once with ``confirmed``."""

    def __init__(self, conn: Any, confirmed: int) -> None:
        self._conn = conn  # keeps the psycopg2 connection, so the PGconn, alive
        self._pgconn = ctypes.c_void_p(conn.pgconn_ptr)
        lib = _lib()
        self._pq, self._pq_send = lib.keep_gil, lib.release_gil
        # psycopg2 locks its connection for its own calls; ours take this lock, so
        # close() from another thread never frees the PGconn under a read.
        self._lock = threading.Lock()
        self._closed = False
        self._buffer = ctypes.c_void_p()  # PQgetCopyData's out parameter, reused
        self._buffer_ref = ctypes.byref(self._buffer)
        self.confirmed = confirmed

    def fileno(self) -> int:
        return int(self._conn.fileno())

    def close(self) -> None:
        """Close the connection; later calls raise OperationalError."""
        with self._lock:
            self._closed = True
            self._conn.close()

    def read(self) -> XLogData | Keepalive | None:
        """The next message, or None if none has arrived yet (never blocks)."""
        with self._lock:
            self._check_open()
            data = self._read_copy_data()
        return None if data is None else self._decode(data)

    def _check_open(self) -> None:
        if self._closed:
            raise psycopg2.OperationalError("replication stream closed")

    def _read_copy_data(self) -> bytes | None:
        buffer, get = self._buffer, self._pq.PQgetCopyData
        length = get(self._pgconn, self._buffer_ref, 1)
        if length == 0:
            if not self._pq.PQconsumeInput(self._pgconn):
                self._lost("reading")
            length = get(self._pgconn, self._buffer_ref, 1)
            if length == 0:
                return None
        if length < 0:
            self._lost("reading")
        try:
            return ctypes.string_at(buffer, length)
        finally:
            self._pq.PQfreemem(buffer)

    def _decode(self, data: bytes) -> XLogData | Keepalive:
        kind = data[0] if data else 0
        if kind == 0x77 and len(data) >= _XLOGDATA_END:  # 'w'
            return XLogData(data[_XLOGDATA_END:])
        if kind == 0x6B and len(data) >= 1 + _KEEPALIVE.size:  # 'k'
            wal_end, _sent, reply = _KEEPALIVE.unpack_from(data, 1)
            if reply:
                self.send_status()
            return Keepalive(wal_end)
        raise psycopg2.OperationalError(
            f"unrecognized replication message {data[:1]!r} of {len(data)} bytes")

    def confirm(self, lsn: int, reply: bool = False) -> None:
        """Report ``lsn`` as written and flushed (the slot may release WAL up to it)."""
        self.confirmed = max(self.confirmed, lsn)
        self.send_status(reply)

    def send_status(self, reply: bool = False) -> None:
        now_us = int((time.time() - _PG_EPOCH_S) * 1_000_000)
        lsn = self.confirmed
        message = _STATUS.pack(b"r", lsn, lsn, 0, now_us, 1 if reply else 0)
        with self._lock:
            self._check_open()
            if self._pq_send.PQputCopyData(self._pgconn, message, len(message)) != 1:
                self._lost("sending feedback")
            while (flushed := self._pq_send.PQflush(self._pgconn)) == 1:
                pass  # a blocking connection: PQflush only returns 1 on a full socket
            if flushed < 0:
                self._lost("sending feedback")

    def _lost(self, doing: str) -> None:
        reasons = [self._pq.PQerrorMessage(self._pgconn) or b""]
        # A server that ends the copy (an error, a shutdown) says why in the results
        # that follow it; PQerrorMessage is empty until they are read.
        for _ in range(8):  # a bounded drain: one error result and the final NULL
            result = self._pq_send.PQgetResult(self._pgconn)
            if not result:
                break
            reasons.append(self._pq.PQresultErrorMessage(result) or b"")
            self._pq.PQclear(result)
        message = "; ".join(dict.fromkeys(
            r.decode("utf-8", "replace").strip() for r in reasons if r.strip()))
        raise psycopg2.OperationalError(
            f"replication stream lost while {doing}: {message or 'copy ended'}")
