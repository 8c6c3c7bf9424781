"""structlog set-up shared by every process: JSON lines on stdout.

One event name per line; ``node``, ``state``, ``table``, ``vnode`` are bound
where they apply. Secrets (the recovery token) are never logged: use
:func:`token_hash` for the 8-hex-digit prefix that is.
"""

from __future__ import annotations

import hashlib
import json
import logging
import sys
from pathlib import Path
from typing import Any, TextIO

import structlog

_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING,
           "error": logging.ERROR}


def configure_logging(process: str, level: str = "info", *, file: TextIO | None = None,
                      **bound: Any) -> structlog.BoundLogger:
    """Configure JSON logging for this process (to ``file``, default standard output)
    and return its root logger."""
    if level.lower() not in _LEVELS:
        raise ValueError(f"unknown log level {level!r}")
    # One line at a time even into a file or a pipe: a crash must not eat the
    # last lines, which are the ones an operator needs.
    out = file or sys.stdout
    if hasattr(out, "reconfigure"):
        out.reconfigure(line_buffering=True)
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            structlog.processors.JSONRenderer(sort_keys=False),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(_LEVELS[level.lower()]),
        logger_factory=structlog.PrintLoggerFactory(file=out),
        cache_logger_on_first_use=True,
    )
    return structlog.get_logger().bind(process=process, **bound)


def get_logger(**bound: Any) -> Any:
    """A lazy logger: safe at import time, rendered by whatever configure_logging set."""
    return structlog.get_logger(**bound)


def token_hash(token: str) -> str:
    """First 8 hex digits of SHA-256 of a secret: safe for logs, metrics, etcd."""
    return hashlib.sha256(token.encode()).hexdigest()[:8]


def logged_events(path: str | Path, event: str) -> list[dict[str, Any]]:
    """Every record of ``event`` in a process's JSON log file, oldest first
    (the demo, tests and tools read what a process reported this way)."""
    path = Path(path)
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        if f'"{event}"' not in line:
            continue
        try:
            record = json.loads(line)
        except ValueError:  # a line torn by a crash, or not ours
            continue
        if record.get("event") == event:
            out.append(record)
    return out
