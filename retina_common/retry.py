"""Trying again: which gRPC answers may be sent again, and the pauses in between.

:data:`RETRYABLE_CODES` is the one set of gRPC codes after which a client sends the same
request again. :class:`Backoff` is the one exponential pause between two attempts.
``until_deadline`` runs a call again while it fails with one of the *transient* error
types (the catalog, etcd briefly away), for at most ``deadline_s``; ``rpc_with_retry``
sends a gRPC call again while it answers one of ``retry_on``, at most ``attempts``
times. Then the last error propagates and the caller fails closed or crashes. Only
for idempotent steps: an "outcome unknown" error is retried like any other.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import TypeVar

import grpc

T = TypeVar("T")

# The gRPC codes after which the same request may simply be sent again: nothing was
# applied, or what was applied converges under a resend (every write is a DELETE +
# INSERT of one key at one timestamp). DEADLINE_EXCEEDED: the answer was lost, the
# outcome is unknown. CANCELLED: a Retina node shutting down (SIGTERM) cancels the
# calls in flight; the outcome is unknown exactly as for a lost connection.
RETRYABLE_CODES: tuple[grpc.StatusCode, ...] = (
    grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED)


class Backoff:
    """Pauses between attempts: ``first_s``, doubled after each, at most ``max_s``."""

    def __init__(self, first_s: float, max_s: float) -> None:
        self.next_s = first_s
        self._max_s = max_s

    def pause(self, stop: threading.Event | None = None) -> bool:
        """Wait the next pause, or until ``stop`` is set; True if it was set."""
        pause_s, self.next_s = self.next_s, min(self.next_s * 2, self._max_s)
        if stop is not None:
            return stop.wait(pause_s)
        time.sleep(pause_s)  # backoff between attempts, not synchronisation
        return False


def until_deadline(call: Callable[[], T], *, transient: tuple[type[BaseException], ...],
                   deadline_s: float, on_retry: Callable[[BaseException], None],
                   first_pause_s: float = 0.2, max_pause_s: float = 2.0) -> T:
    deadline = time.monotonic() + deadline_s
    backoff = Backoff(first_pause_s, max_pause_s)
    while True:
        try:
            return call()
        except transient as exc:
            if time.monotonic() + backoff.next_s > deadline:
                raise
            on_retry(exc)
            backoff.pause()


def rpc_with_retry(call: Callable[[], T], *, attempts: int = 5,
                   retry_on: tuple[grpc.StatusCode, ...] = RETRYABLE_CODES,
                   first_pause_s: float = 0.2, max_pause_s: float = 5.0) -> T:
    """``call()``, sent again after a pause while it answers a code in ``retry_on``, at
    most ``attempts`` times in all; the last error propagates."""
    backoff = Backoff(first_pause_s, max_pause_s)
    for attempt in range(1, attempts + 1):
        try:
            return call()
        except grpc.RpcError as exc:
            if exc.code() not in retry_on or attempt == attempts:
                raise
        backoff.pause()
    raise AssertionError("unreachable")
