"""The test clusters' port choice: distinct, outside the ephemeral range, one slice per
pytest-xdist worker (two workers never hand out the same port)."""

from __future__ import annotations

import pytest

from devtools import cluster


@pytest.mark.parametrize("worker", [0, 1, 2])
def test_each_worker_draws_from_its_own_slice(monkeypatch: pytest.MonkeyPatch, worker: int) -> None:
    monkeypatch.setenv("PYTEST_XDIST_WORKER", f"gw{worker}")
    monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", "3")
    monkeypatch.setattr(cluster, "_handed_out", {})
    low, high = cluster._port_range()
    width = (cluster._ephemeral_low() - cluster._PORT_FLOOR) // 3
    assert (low, high) == (cluster._PORT_FLOOR + worker * width,
                           cluster._PORT_FLOOR + (worker + 1) * width)
    ports = cluster.free_ports(50)
    assert len(set(ports)) == 50
    assert all(low <= port < high for port in ports)


def test_a_long_run_forgets_the_oldest_ports_instead_of_running_dry(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw0")
    monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", "3")
    monkeypatch.setattr(cluster, "_handed_out", {})
    low, high = cluster._port_range()
    handed = [port for _ in range(high - low) for port in cluster.free_ports(1)]
    assert len(handed) == high - low  # more than the slice could give without recycling
    assert len(cluster._handed_out) <= (high - low) // 2
    # What is remembered is the newest half: never handed out twice within it.
    recent = handed[-len(cluster._handed_out):]
    assert len(set(recent)) == len(recent)


def test_outside_xdist_the_whole_range_is_drawn_from(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PYTEST_XDIST_WORKER", raising=False)
    monkeypatch.delenv("PYTEST_XDIST_WORKER_COUNT", raising=False)
    assert cluster._port_range() == (cluster._PORT_FLOOR, cluster._ephemeral_low())


def test_too_many_workers_for_slices_say_so_and_share_the_range(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw5")
    monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", "200")
    with pytest.warns(UserWarning, match="200 test workers share"):
        assert cluster._port_range() == (cluster._PORT_FLOOR, cluster._ephemeral_low())
