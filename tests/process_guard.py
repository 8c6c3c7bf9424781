"""The ``integration`` marker, kept honest (``make test-fast`` runs the unmarked tests).

A test not marked ``integration`` fails if it asks for a fixture that starts a process
(directly or through another fixture), or if it starts one itself while it is set up or
runs: ``subprocess`` (every CLI, Spark's JVM, docker, promtool, git), ``os.fork`` and
``os.system`` raise for it. Teardown is left alone: the last test of a session tears
down the session's etcd and PostgreSQL, whatever its marker.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest

# Fixtures that start a process: the shared etcd and PostgreSQL (and so every fixture
# built on them: etcd, catalog, make_plane, ...), and the private ones of some modules.
PROCESS_FIXTURES = frozenset({
    "etcd_server", "pg_server", "private_etcd", "private_pg", "tls_etcd", "tls_postgres",
    "s3_endpoint", "spark", "wheel",
})

MARKER = "integration"


class ProcessStarted(AssertionError):
    """A test not marked integration started a process."""


def _is_integration(item: pytest.Item) -> bool:
    return item.get_closest_marker(MARKER) is not None


@contextmanager
def _no_processes(nodeid: str) -> Iterator[None]:
    refusals: list[str] = []

    def refuse(what: str) -> Callable[..., Any]:
        def refused(*args: Any, **kwargs: Any) -> Any:
            refusals.append(f"{nodeid} starts a process ({what}) but is not marked "
                            f"@pytest.mark.{MARKER}")
            raise ProcessStarted(refusals[-1])
        return refused

    saved: list[tuple[object, str, object]] = [
        (subprocess.Popen, "_execute_child", subprocess.Popen._execute_child),  # type: ignore[attr-defined]
        (os, "fork", os.fork), (os, "system", os.system),
        (os, "posix_spawn", os.posix_spawn), (os, "posix_spawnp", os.posix_spawnp)]
    for owner, name, _original in saved:
        setattr(owner, name, refuse(f"{getattr(owner, '__name__', owner)}.{name}"))
    try:
        yield
    finally:
        for owner, name, original in saved:
            setattr(owner, name, original)
    if refusals:  # even if the code under test caught the exception
        raise ProcessStarted(refusals[0])


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item: pytest.Item) -> Iterator[None]:
    if _is_integration(item):
        return (yield)
    starting = sorted(PROCESS_FIXTURES.intersection(getattr(item, "fixturenames", ())))
    if starting:
        raise ProcessStarted(f"{item.nodeid} uses {', '.join(starting)}, which start "
                             f"processes, but is not marked @pytest.mark.{MARKER}")
    with _no_processes(item.nodeid):
        return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Iterator[None]:
    if _is_integration(item):
        return (yield)
    with _no_processes(item.nodeid):
        return (yield)
