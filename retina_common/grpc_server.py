"""gRPC server plumbing shared by every process: health checking and reflection."""

from __future__ import annotations

from collections.abc import Iterable
from concurrent import futures

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from retina_common import tls as tls_mod
from retina_common.config import TlsConfig, split_host_port

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class ServerHandle:
    """A started-to-be gRPC server with its health servicer and bound port."""

    def __init__(self, listen: str, max_workers: int, service_names: Iterable[str],
                 tls: TlsConfig | None = None) -> None:
        host, port = split_host_port(listen)
        self.server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=max_workers),
            options=[("grpc.max_receive_message_length", 64 * 1024 * 1024),
                     ("grpc.so_reuseport", 0)])
        # TLS as ``tls`` (default: the process's settings) says; health and
        # reflection share the port, so they need TLS too.
        self.port = tls_mod.add_port(self.server, f"{host}:{port}", tls)
        if self.port == 0:
            raise OSError(f"cannot listen on {listen}")
        self.address = f"{host}:{self.port}"
        self.health = health.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        self._names = tuple(service_names)
        reflection.enable_server_reflection(
            (*self._names, health.SERVICE_NAME, reflection.SERVICE_NAME), self.server)
        self.set_serving(False)

    def set_serving(self, serving: bool) -> None:
        """Overall ("") and per-service health status."""
        status = SERVING if serving else NOT_SERVING
        for name in ("", *self._names):
            self.health.set(name, status)

    def start(self) -> None:
        self.server.start()

    def stop(self, grace_s: float = 2.0) -> None:
        self.health.enter_graceful_shutdown()
        self.server.stop(grace_s).wait()
