"""Waiting out a dependency that is briefly away (the catalog, etcd).

``until_deadline`` runs a call again, with exponential backoff, while it
fails with one of the *transient* error types, for at most ``deadline_s``;
then the last error propagates and the caller fails closed or crashes. Only
for idempotent steps: an "outcome unknown" error is retried like any other.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def until_deadline(call: Callable[[], T], *, transient: tuple[type[BaseException], ...],
                   deadline_s: float, on_retry: Callable[[BaseException], None],
                   first_pause_s: float = 0.2, max_pause_s: float = 2.0) -> T:
    deadline = time.monotonic() + deadline_s
    pause = first_pause_s
    while True:
        try:
            return call()
        except transient as exc:
            if time.monotonic() + pause > deadline:
                raise
            on_retry(exc)
            time.sleep(pause)  # backoff between attempts, not synchronisation
            pause = min(pause * 2, max_pause_s)
