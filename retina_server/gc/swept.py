"""What a sweeper pass reports and counts, shared by the sweeper (sweeper.py) and its
orphan pass (orphans.py), which sits below it: one file or object removed, held or
would be removed (a dry run), and why."""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import Counter

from retina_common.config import orphan_grace_problem
from retina_server.gc.removal_backoff import REMOVAL_BACKOFF, RemovalBackoff
from retina_server.gc.retention_guard import HoldReason

REMOVED = Counter("retina_sweeper_files_removed_total", "Files and objects removed by pass",
                  ["pass"])
BYTES_REMOVED = Counter("retina_sweeper_bytes_removed_total", "Bytes removed by pass", ["pass"])


@dataclass(frozen=True)
class Swept:
    pass_name: str
    file_id: int
    name: str
    path_uri: str
    action: str  # "removed" | "would_remove" | "held"
    reason: str
    bytes: int = 0


def why_held(reason: HoldReason | None, backoff: RemovalBackoff, key: str) -> str:
    """The retention guard's reason first, then a removal backoff ("" if neither)."""
    if reason is not None:
        return reason.value
    return REMOVAL_BACKOFF if backoff.waiting(key) else ""


def check_orphan_grace(grace_ms: int) -> None:
    """ORPHAN_GRACE_ABOVE_ANY_COMMIT (retina_common/config.py); raises ValueError."""
    problem = orphan_grace_problem(grace_ms)
    if problem:
        raise ValueError(problem)
