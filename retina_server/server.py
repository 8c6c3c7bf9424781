"""The Retina server process: ``retina-server --config retina.toml``.

This is the process shell every later part plugs into: configuration,
topology membership, JSON logs, ``/metrics``, gRPC health and reflection.
The RetinaWorkerService RPCs answer UNIMPLEMENTED until their server side
exists (data plane and recovery issues); health stays NOT_SERVING, and no
lifecycle key is written, so the query gate sees this node as missing and
refuses queries: fail closed, never a made-up READY.
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from types import FrameType

from retina_common import failpoints
from retina_common.config import ConfigError, load_config, split_host_port
from retina_common.grpc_server import ServerHandle
from retina_common.log import configure_logging
from retina_common.metrics import serve_metrics
from retina_common.pb import retina_pb2, retina_pb2_grpc
from retina_common.topology import load_topology

SERVICE_NAME = retina_pb2.DESCRIPTOR.services_by_name["RetinaWorkerService"].full_name


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="retina-server", description=__doc__)
    parser.add_argument("--config", help="TOML config file (default: $RETINA_CONFIG)")
    args = parser.parse_args(argv)
    try:
        config = load_config(args.config)
        failpoints.load_from_env()
        topology = load_topology(config.topology_file)
        node_id = config.retina.node_id or config.retina.listen
        split_host_port(node_id)
        if node_id not in topology.nodes:
            raise ConfigError(f"node {node_id} is not in the topology {list(topology.nodes)}")
    except (ConfigError, failpoints.FailpointError) as exc:
        print(f"retina-server: {exc}", file=sys.stderr)
        return 2
    log = configure_logging("retina", config.log_level, node=node_id)
    try:
        handle = ServerHandle(config.retina.listen, max_workers=16, service_names=[SERVICE_NAME])
    except OSError as exc:
        log.error("retina_server_start_failed", error=str(exc))
        return 4
    # The generated base servicer answers UNIMPLEMENTED for every RPC.
    retina_pb2_grpc.add_RetinaWorkerServiceServicer_to_server(
        retina_pb2_grpc.RetinaWorkerServiceServicer(), handle.server)
    metrics_port = serve_metrics(config.retina.metrics_listen)
    handle.start()
    log.info("retina_server_started", listen=handle.address, metrics_port=metrics_port,
             vnodes=list(topology.vnodes_of(node_id)), topology_hash=topology.topology_hash[:16],
             state="NOT_READY", note="data plane and recovery not built yet: RPCs UNIMPLEMENTED")
    stop = threading.Event()

    def on_signal(signum: int, _frame: FrameType | None) -> None:
        log.info("retina_server_signal", signal=signal.Signals(signum).name)
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    stop.wait()
    handle.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
