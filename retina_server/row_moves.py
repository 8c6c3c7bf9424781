"""RowMoves: a sequence number around every change that moves rows between files.

A key's row is found in three steps that read three structures one after the
other (its version in the primary index, its row id's location in the
MainIndex, its file's visibility and data). Writes never move a row, and a
publish keeps a row where it is (the file id stays; the file is registered
before it leaves the write buffer), so any moment's three answers agree. Four
changes do move rows or take a file away, in several steps: a Storage GC
commit's switch, its rollback, a revert, and the sweeper's removal of a
replaced file. A reader that runs through one of them can pair a version of
one moment with a location or a visibility of another (a row switched to a
file not yet registered, an old file's visibility frozen before a revert
brought it back).

So every such change runs inside :meth:`RowMoves.moving`, which makes the
sequence number odd while it runs and even again after it; a point reader
takes :meth:`settled` before it starts and asks :meth:`unchanged_since`
afterwards, and answers only when nothing moved in between
(ROW_READS_SEE_NO_MOVE); otherwise it reads again. Moves are rare (a GC
commit, a revert, a sweep), so a reader almost never repeats, and writers
never wait for readers.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import TypeVar

import grpc

T = TypeVar("T")


class MovesInProgress(Exception):
    """Rows kept moving for longer than a reader waits: nothing was answered; retry."""

    grpc_status = grpc.StatusCode.UNAVAILABLE


class RowMoves:
    def __init__(self) -> None:
        self._sequence = 0  # odd while a change runs
        self._running = 0  # changes running now (they may overlap: different streams)
        self._lock = threading.Lock()
        self._settled = threading.Condition(self._lock)
        # Told the files a change took away (their cached row groups can go).
        self.on_files_gone: Callable[[list[int]], None] = lambda _files: None

    @contextmanager
    def moving(self, files_gone: Iterable[int] = ()) -> Iterator[None]:
        """Run a change that moves rows or takes files away (``files_gone``: the files
        whose rows no reader can reach any more once it is done)."""
        with self._lock:
            self._running += 1
            if self._running == 1:
                self._sequence += 1  # odd: moving
        try:
            yield
        finally:
            with self._lock:
                self._running -= 1
                if self._running == 0:
                    self._sequence += 1  # even: settled
                    self._settled.notify_all()
            gone = list(files_gone)
            if gone:
                self.on_files_gone(gone)

    def settled(self, timeout_s: float = 5.0) -> int:
        """The sequence number once no change runs (waits at most ``timeout_s``)."""
        deadline = time.monotonic() + timeout_s
        with self._lock:
            while self._running:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise MovesInProgress(f"rows kept moving for {timeout_s:.0f} s")
                self._settled.wait(left)
            return self._sequence

    def now(self) -> tuple[int, bool]:
        """The sequence number and whether a change runs, without waiting (a reader
        that holds stream locks must not wait for a change that may need them)."""
        with self._lock:
            return self._sequence, bool(self._running)

    def unchanged_since(self, sequence: int) -> bool:
        """True when no change started since :meth:`settled` returned ``sequence``."""
        return self._sequence == sequence

    def read_unmoved(self, read: Callable[[], T], on_reread: Callable[[], None], *,
                     settle_timeout_s: float = 5.0, attempts: int = 20) -> T:
        """ROW_READS_SEE_NO_MOVE: ``read()`` again until no change ran while it read, at
        most ``attempts`` times (then MovesInProgress). A read that failed while a change
        ran is read again too (a file the change took away, say); the same failure with
        nothing moved is the answer."""
        for _ in range(attempts):
            sequence = self.settled(settle_timeout_s)
            try:
                answer = read()
            except Exception:
                if self.unchanged_since(sequence):
                    raise
                on_reread()
                continue
            if self.unchanged_since(sequence):
                return answer
            on_reread()
        raise MovesInProgress(f"rows moved under {attempts} reads in a row")
