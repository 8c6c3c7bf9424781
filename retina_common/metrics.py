"""Prometheus endpoint shared by every process (``/metrics`` on ``metrics_listen``)."""

from __future__ import annotations

from prometheus_client import start_http_server

from retina_common.config import split_host_port


def serve_metrics(listen: str) -> int:
    """Start the ``/metrics`` HTTP endpoint; returns the bound port (0 = disabled)."""
    if not listen or listen.lower() == "off":
        return 0
    host, port = split_host_port(listen)
    server, _thread = start_http_server(port, addr=host)
    return int(server.server_port)
