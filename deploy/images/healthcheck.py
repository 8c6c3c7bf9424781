"""Container healthcheck for the Retina processes (installed as retina-healthcheck).

    retina-healthcheck grpc HOST:PORT [SERVICE]   # grpc.health.v1: SERVING → exit 0
    retina-healthcheck http URL                    # an HTTP 200 → exit 0

The TransServer is SERVING once started; a Retina node only once READY, so a
node's container is healthy exactly when it serves reads and writes. The
connector has no gRPC port: its /metrics answering means the process is up.
Any other answer, or none within the timeout, exits 1 with a one-line reason.
The gRPC check speaks TLS when ``$RETINA_CONFIG`` sets ``tls.enabled`` (the same
channel the processes open, so a healthy container is one a client can reach).
"""

from __future__ import annotations

import sys
import urllib.request
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import grpc

TIMEOUT_S = 3.0


def _channel(address: str) -> grpc.Channel:
    import os

    from retina_common.config import load_config
    from retina_common.tls import open_channel

    config = load_config(os.environ["RETINA_CONFIG"]) if os.environ.get("RETINA_CONFIG") else None
    return open_channel(address, config.tls if config else None)


def check_grpc(address: str, service: str) -> str | None:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with _channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            answer = stub.Check(health_pb2.HealthCheckRequest(service=service),
                                timeout=TIMEOUT_S)
        except grpc.RpcError as exc:
            return f"{address}: {exc.code().name}"
    if answer.status != health_pb2.HealthCheckResponse.SERVING:
        return f"{address}: {health_pb2.HealthCheckResponse.ServingStatus.Name(answer.status)}"
    return None


def check_http(url: str) -> str | None:
    try:
        with urllib.request.urlopen(url, timeout=TIMEOUT_S) as response:
            status = response.status
    except OSError as exc:
        return f"{url}: {exc}"
    return None if status == 200 else f"{url}: HTTP {status}"


def main(argv: list[str]) -> int:
    if len(argv) >= 2 and argv[0] == "grpc":
        problem = check_grpc(argv[1], argv[2] if len(argv) > 2 else "")
    elif len(argv) == 2 and argv[0] == "http":
        problem = check_http(argv[1])
    else:
        print("usage: retina-healthcheck grpc HOST:PORT [SERVICE] | http URL", file=sys.stderr)
        return 2
    if problem:
        print(f"unhealthy: {problem}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
