"""The Retina server process: ``retina-server --config retina.toml``.

Wiring only: configuration, topology membership, the catalog, the node-local
index, the data plane (``RetinaNode``), the gRPC service, ``/metrics``,
health and reflection. On start, this node's published files are adopted
(see ``RetinaNode.adopt_published_files``); on SIGTERM, writes stop, every
appended row goes through the publisher (shutdown flush), then the process exits.

The lifecycle (RECOVERING/READY/FAILED, MarkReady) is not built yet: health
stays NOT_SERVING and no lifecycle key is written, so the query gate keeps
queries refused unless something else vouches for the node.

Exit codes: 0 stopped, 2 configuration, 4 a dependency unreachable at start.
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
import time
from pathlib import Path
from types import FrameType

from retina_common import failpoints
from retina_common.catalog import Catalog, CatalogError
from retina_common.config import ConfigError, load_config, split_host_port
from retina_common.grpc_server import ServerHandle
from retina_common.log import configure_logging
from retina_common.metrics import serve_metrics
from retina_common.pb import retina_pb2, retina_pb2_grpc
from retina_common.storage import root_uri
from retina_common.topology import load_topology
from retina_server.index import LocalIndexService
from retina_server.node import BufferSettings, RetinaNode
from retina_server.service import RetinaService

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
        host, port = split_host_port(node_id)
        if node_id not in topology.nodes:
            raise ConfigError(f"node {node_id} is not in the topology {list(topology.nodes)}")
    except (ConfigError, failpoints.FailpointError) as exc:
        print(f"retina-server: {exc}", file=sys.stderr)
        return 2
    rc = config.retina
    log = configure_logging("retina", config.log_level, node=node_id)
    catalog = Catalog(config.catalog.dsn, pool_max=config.catalog.pool_max,
                      connect_timeout_s=config.catalog.connect_timeout_s)
    try:
        catalog.bootstrap()
        index = LocalIndexService(Path(rc.state_dir) / f"{host}-{port}" / "index")
        node = RetinaNode(node_id, topology, catalog, index, root_uri(config.storage.root),
                          BufferSettings(rc.block_rows, rc.blocks_per_file, rc.flush_interval_ms,
                                         rc.close_workers), lambda: int(time.time() * 1000))
        node.adopt_published_files()
        handle = ServerHandle(rc.listen, max_workers=16, service_names=[SERVICE_NAME])
    except (CatalogError, OSError) as exc:
        log.error("retina_server_start_failed", error=str(exc), error_type=type(exc).__name__)
        return 4
    retina_pb2_grpc.add_RetinaWorkerServiceServicer_to_server(
        RetinaService(node, rc.max_rows_per_request), handle.server)
    metrics_port = serve_metrics(rc.metrics_listen)
    node.start()
    handle.start()
    log.info("retina_server_started", listen=handle.address, metrics_port=metrics_port,
             vnodes=list(topology.vnodes_of(node_id)), topology_hash=topology.topology_hash[:16])
    stop = threading.Event()

    def on_signal(signum: int, _frame: FrameType | None) -> None:
        log.info("retina_server_signal", signal=signal.Signals(signum).name)
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    stop.wait()
    handle.stop()
    node.shutdown()
    index.close()
    catalog.close()
    log.info("retina_server_stopped", failure=node.failure)
    return 0


if __name__ == "__main__":
    sys.exit(main())
