"""Progress bars on stderr for long operations (retina-admin, the Spark drivers).

A bar is drawn only when stderr is a terminal, ``--no-progress`` was not given and
``RETINA_NO_PROGRESS`` is unset: it never reaches stdout, a pipe or a log file, so
what a command prints and its exit code are the same with or without it. tqdm
draws it (``leave=False``: the bar clears itself, the command's own report stays).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import TypeVar

from tqdm import tqdm

T = TypeVar("T")
ENV_DISABLE = "RETINA_NO_PROGRESS"


def wanted(disabled: bool = False) -> bool:
    """Whether to draw: not disabled by flag or environment, and stderr is a terminal."""
    if disabled or os.environ.get(ENV_DISABLE, "") not in ("", "0"):
        return False
    return sys.stderr.isatty()


def bar(total: int | None = None, desc: str = "", unit: str = "it",
        disabled: bool = False) -> tqdm:
    """A bar to advance by hand (``update(n)``, ``set_postfix_str``); a no-op when not
    :func:`wanted`. Use it as a context manager so it is closed on every path."""
    return tqdm(total=total, desc=desc, unit=unit, file=sys.stderr, leave=False,
                dynamic_ncols=True, disable=not wanted(disabled))


def track(items: Iterable[T], total: int | None = None, desc: str = "", unit: str = "it",
          disabled: bool = False) -> Iterator[T]:
    """``items`` unchanged, with a bar advancing once per item while they are consumed."""
    if total is None and hasattr(items, "__len__"):
        total = len(items)  # type: ignore[arg-type]
    with bar(total, desc, unit, disabled) as b:
        for item in items:
            yield item
            b.update(1)


@contextmanager
def printing() -> Iterator[None]:
    """Around a print to stdout while a bar may be drawn: the bar is cleared and redrawn
    rather than torn by the line (what is printed is unchanged)."""
    with tqdm.external_write_mode(file=sys.stdout):
        yield


def reporting(b: tqdm, report: Callable[[T], None]) -> Callable[[T], None]:
    """``report`` (a per-item callback that prints) that also advances ``b`` by one."""
    def done(item: T) -> None:
        with printing():
            report(item)
        b.update(1)
    return done
