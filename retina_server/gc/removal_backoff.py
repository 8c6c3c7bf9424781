"""Per-file backoff of the sweepers' removals (ONE_FAILURE_NEVER_STALLS_A_SWEEP).

A removal that raises (an object store or catalog error, a damaged object)
used to abort the whole round, and the next round started with the same file:
one bad file stopped every later removal for good. Now the failing file is
skipped with a WARN line (``sweeper_removal_failed``) and a metric, the pass
goes on with the rest, and the file sits out rounds of its pass before it is
tried again: 1 round after its first failure, then 2, 4, ... at most
MAX_BACKOFF_ROUNDS in a row (about an hour at the default round interval of
60 s). A success forgets the file.

Backoff counts rounds of the pass, not wall time: a round is when the pass
looks at its files again, whether the background round or an on-demand
RunSweeper, so the retry comes with a round either way. A dry run neither
counts as a round nor tries anything. The state is memory only: a restarted
node tries every file again, which is safe because every removal step is
idempotent.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TypeVar

from prometheus_client import Counter, Gauge

from retina_common.log import get_logger

log = get_logger(component="sweeper")
T = TypeVar("T")

FAILURES = Counter("retina_sweeper_removal_failures_total",
                   "Removals that failed; the file is skipped and retried after its backoff",
                   ["pass"])
IN_BACKOFF = Gauge("retina_sweeper_files_in_backoff",
                   "Files whose last removal failed, waiting out their backoff", ["pass"])
MAX_BACKOFF_ROUNDS = 64
REMOVAL_FAILED = "removal_failed"
REMOVAL_BACKOFF = "removal_backoff"


@dataclass(frozen=True)
class _Failed:
    failures: int  # in a row
    retry_round: int  # the first round that tries the file again


class RemovalBackoff:
    """The backoff of one pass; keys name its files (a file id, or path and name)."""

    def __init__(self, pass_name: str) -> None:
        self.pass_name = pass_name
        self._round = 0
        self._failed: dict[str, _Failed] = {}

    def begin_round(self, candidates: Iterable[str], dry_run: bool) -> None:
        """A round of the pass over these keys; a file no longer a candidate (removed
        by other means, not due any more) is forgotten."""
        if not dry_run:
            self._round += 1
        keep = set(candidates)
        self._failed = {k: v for k, v in self._failed.items() if k in keep}
        IN_BACKOFF.labels(self.pass_name).set(len(self._failed))

    def waiting(self, key: str) -> bool:
        failed = self._failed.get(key)
        return failed is not None and self._round < failed.retry_round

    def attempt(self, key: str, remove: Callable[[], T], **context: object) -> T | None:
        """Run one removal and return its result; None if it raised: the failure is
        logged (with ``context``), counted and backed off, and the caller goes on."""
        try:
            result = remove()
        except Exception as exc:  # skip this file; the rest of the pass goes on
            self._fail(key, exc, context)
            return None
        self._failed.pop(key, None)
        IN_BACKOFF.labels(self.pass_name).set(len(self._failed))
        return result

    def _fail(self, key: str, exc: Exception, context: dict[str, object]) -> None:
        before = self._failed.get(key)
        failures = 1 if before is None else before.failures + 1
        rounds = min(2 ** (failures - 1), MAX_BACKOFF_ROUNDS)
        self._failed[key] = _Failed(failures, self._round + rounds + 1)
        FAILURES.labels(self.pass_name).inc()
        IN_BACKOFF.labels(self.pass_name).set(len(self._failed))
        log.warning("sweeper_removal_failed", **{"pass": self.pass_name}, **context,
                    error=str(exc), error_type=type(exc).__name__, failures=failures,
                    skipped_rounds=rounds)
