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
from typing import Any

import psycopg2

# Standby status update times count microseconds from 2000-01-01 UTC.
_PG_EPOCH_S = 946_684_800
_XLOGDATA = struct.Struct("!QQQ")  # data start, WAL end, send time
_KEEPALIVE = struct.Struct("!QQB")  # WAL end, send time, reply requested
_STATUS = struct.Struct("!cQQQQB")  # 'r', write, flush, apply, send time, reply


@dataclass(frozen=True)
class XLogData:
    data_start: int
    wal_end: int
    payload: bytes


@dataclass(frozen=True)
class Keepalive:
    wal_end: int
    reply_requested: bool


def _libpq_of_psycopg2() -> ctypes.CDLL:
    """libpq as psycopg2's extension module resolves it: dlsym through a handle on
    that module searches its own dependencies, so this is the very libpq (bundled
    or the system's) that made psycopg2's PGconn, whatever other libpq the process
    may load."""
    import psycopg2._psycopg as extension

    return ctypes.CDLL(extension.__file__)


def _load_libpq() -> ctypes.CDLL:
    lib = _libpq_of_psycopg2()
    conn, buf = ctypes.c_void_p, ctypes.c_void_p
    lib.PQgetCopyData.argtypes = [conn, ctypes.POINTER(buf), ctypes.c_int]
    lib.PQgetCopyData.restype = ctypes.c_int
    lib.PQputCopyData.argtypes = [conn, ctypes.c_char_p, ctypes.c_int]
    lib.PQputCopyData.restype = ctypes.c_int
    lib.PQflush.argtypes = [conn]
    lib.PQflush.restype = ctypes.c_int
    lib.PQconsumeInput.argtypes = [conn]
    lib.PQconsumeInput.restype = ctypes.c_int
    lib.PQerrorMessage.argtypes = [conn]
    lib.PQerrorMessage.restype = ctypes.c_char_p
    lib.PQfreemem.argtypes = [buf]
    lib.PQfreemem.restype = None
    lib.PQgetResult.argtypes = [conn]
    lib.PQgetResult.restype = ctypes.c_void_p
    lib.PQresultErrorMessage.argtypes = [ctypes.c_void_p]
    lib.PQresultErrorMessage.restype = ctypes.c_char_p
    lib.PQclear.argtypes = [ctypes.c_void_p]
    lib.PQclear.restype = None
    return lib


_libpq: ctypes.CDLL | None = None


def _lib() -> ctypes.CDLL:
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
        self._lib = _lib()
        # psycopg2 locks its connection for its own calls; ours take this lock, so
        # close() from another thread never frees the PGconn under a read.
        self._lock = threading.Lock()
        self._closed = False
        self.confirmed = confirmed
        self.wal_end = 0  # the latest WAL end the server reported

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
        buffer = ctypes.c_void_p()
        length = self._lib.PQgetCopyData(self._pgconn, ctypes.byref(buffer), 1)
        if length == 0:
            if not self._lib.PQconsumeInput(self._pgconn):
                self._lost("reading")
            length = self._lib.PQgetCopyData(self._pgconn, ctypes.byref(buffer), 1)
            if length == 0:
                return None
        if length < 0:
            self._lost("reading")
        try:
            return ctypes.string_at(buffer, length)
        finally:
            self._lib.PQfreemem(buffer)

    def _decode(self, data: bytes) -> XLogData | Keepalive:
        kind = data[:1]
        if kind == b"w" and len(data) >= 1 + _XLOGDATA.size:
            data_start, wal_end, _sent = _XLOGDATA.unpack_from(data, 1)
            self.wal_end = max(self.wal_end, wal_end)
            return XLogData(data_start, wal_end, data[1 + _XLOGDATA.size:])
        if kind == b"k" and len(data) >= 1 + _KEEPALIVE.size:
            wal_end, _sent, reply = _KEEPALIVE.unpack_from(data, 1)
            self.wal_end = max(self.wal_end, wal_end)
            if reply:
                self.send_status()
            return Keepalive(wal_end, bool(reply))
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
            if self._lib.PQputCopyData(self._pgconn, message, len(message)) != 1:
                self._lost("sending feedback")
            while (flushed := self._lib.PQflush(self._pgconn)) == 1:
                pass  # a blocking connection: PQflush only returns 1 on a full socket
            if flushed < 0:
                self._lost("sending feedback")

    def _lost(self, doing: str) -> None:
        reasons = [self._lib.PQerrorMessage(self._pgconn) or b""]
        # A server that ends the copy (an error, a shutdown) says why in the results
        # that follow it; PQerrorMessage is empty until they are read.
        for _ in range(8):  # a bounded drain: one error result and the final NULL
            result = self._lib.PQgetResult(self._pgconn)
            if not result:
                break
            reasons.append(self._lib.PQresultErrorMessage(result) or b"")
            self._lib.PQclear(result)
        message = "; ".join(dict.fromkeys(
            r.decode("utf-8", "replace").strip() for r in reasons if r.strip()))
        raise psycopg2.OperationalError(
            f"replication stream lost while {doing}: {message or 'copy ended'}")
