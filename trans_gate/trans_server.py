"""The TransServer process: ``retina-trans --config retina.toml``.

Wiring only: every part gets its dependencies (etcd, catalog, clock,
topology) passed in. Exit codes: 0 clean stop, 2 configuration error,
3 fenced by another TransServer, 4 a dependency unreachable at start.
"""

from __future__ import annotations

import signal
import sys
import threading
import time
from types import FrameType
from typing import Any

from prometheus_client import Gauge

from retina_common import exit_codes, failpoints, tls
from retina_common.catalog import Catalog, CatalogError
from retina_common.config import Config, ConfigError
from retina_common.etcd import EtcdError, EtcdStore
from retina_common.grpc_server import ServerHandle
from retina_common.keys import TRANS_ID_KEY, TRANS_TIMESTAMP_KEY
from retina_common.log import configure_logging
from retina_common.metrics import serve_metrics
from retina_common.pb import trans_pb2, trans_pb2_grpc
from retina_common.process_config import load_process_config
from retina_common.topology import load_topology
from trans_gate.gate import LifecycleWatcher, NodeAvailability, QueryAvailabilityGate
from trans_gate.timestamps import CounterCorrupt, DurableCounter
from trans_gate.trans_service import HWM_GAUGE, TransService
from trans_gate.transactions import TransactionTable

SERVICE_NAME = trans_pb2.DESCRIPTOR.services_by_name["TransService"].full_name

LIVE_TRANS = Gauge("trans_live_transactions", "Live transactions", ["kind"])
WATCH_UP = Gauge("trans_gate_watch_up", "1 while the lifecycle watch is initialised and healthy")
NODE_READY = Gauge("trans_gate_node_ready", "1 if the gate sees the node READY and fresh", ["node"])
SAFE_GC = Gauge("trans_safe_gc_ts", "Current safe GC timestamp")


def now_ms() -> int:
    return int(time.time() * 1000)


class TransServer:
    def __init__(self, config: Config, log: Any) -> None:
        self._config = config
        self._log = log
        self._stop = threading.Event()
        self.exit_code = exit_codes.OK
        tls.check_server(config.tls)
        store = EtcdStore.from_config(config.etcd)
        tc = config.trans
        self.timestamps = DurableCounter(store, TRANS_TIMESTAMP_KEY, tc.ts_block_size,
                                         failpoints.TRANS_TS_BLOCK_PERSIST_BEFORE,
                                         failpoints.TRANS_TS_BLOCK_PERSIST_AFTER)
        self.trans_ids = DurableCounter(store, TRANS_ID_KEY, tc.ts_block_size,
                                        failpoints.TRANS_TXID_BLOCK_PERSIST_BEFORE,
                                        failpoints.TRANS_TXID_BLOCK_PERSIST_AFTER)
        expected = load_topology(config.topology_file).nodes if config.gate.retina_enabled else ()
        self.gate = QueryAvailabilityGate(expected, config.gate.stale_after_ms, now_ms,
                                          enabled=config.gate.retina_enabled)
        self.watcher = LifecycleWatcher(store, self.gate, config.gate.watch_retry_ms,
                                        on_state=lambda up: WATCH_UP.set(1 if up else 0))
        self.catalog = Catalog(config.catalog.dsn, pool_max=config.catalog.pool_max,
                               connect_timeout_s=config.catalog.connect_timeout_s)
        self.handle = ServerHandle(tc.listen, max_workers=16, service_names=[SERVICE_NAME],
                                   tls=config.tls)
        self.table: TransactionTable | None = None

    def start(self) -> None:
        self.catalog.bootstrap()
        self.timestamps.open()
        self.trans_ids.open()
        tc = self._config.trans
        self.table = TransactionTable(self.timestamps, self.trans_ids, now_ms,
                                      write_lease_ms=tc.write_lease_ms,
                                      read_lease_ms=tc.read_lease_ms,
                                      max_lease_ms=tc.max_lease_ms,
                                      ended_cache_size=tc.ended_cache_size)
        service = TransService(self.table, self.gate, self.catalog, on_fenced=self._fenced)
        trans_pb2_grpc.add_TransServiceServicer_to_server(service, self.handle.server)
        if self._config.gate.retina_enabled:
            self.watcher.start()
        else:
            self._log.warning("gate_disabled", reason="gate.retina_enabled = false")
        metrics_port = serve_metrics(tc.metrics_listen)
        self.handle.start()
        self.handle.set_serving(True)
        threading.Thread(target=self._housekeeping, name="lease-reaper", daemon=True).start()
        self._log.info("trans_server_started", listen=self.handle.address,
                       metrics_port=metrics_port, expected_nodes=list(self.gate.expected_nodes),
                       first_timestamp=self.timestamps.session_start,
                       high_watermark=self.table.high_watermark())

    def _housekeeping(self) -> None:
        interval = self._config.trans.lease_sweep_interval_ms / 1000
        assert self.table is not None
        while not self._stop.wait(interval):
            for trans in self.table.expire_leases():
                self._log.info("transaction_lease_expired", trans_id=trans.trans_id,
                               kind=trans.kind.value, timestamp=trans.timestamp)
            for kind, count in self.table.live_counts().items():
                LIVE_TRANS.labels(kind=kind.value).set(count)
            HWM_GAUGE.set(self.table.high_watermark())
            SAFE_GC.set(self.table.safe_gc_ts())
            snapshot, now = self.gate.snapshot, now_ms()
            for node in self.gate.expected_nodes:
                ready = self.gate.availability(node, snapshot, now) == NodeAvailability.READY
                NODE_READY.labels(node=node).set(1 if ready else 0)

    def _fenced(self) -> None:
        self._log.critical("trans_server_fenced", action="stopping")
        self.exit_code = exit_codes.REFUSED
        self._stop.set()

    def request_stop(self, *_: object) -> None:
        self._stop.set()

    def wait(self) -> int:
        # In slices: a signal delivered to a gRPC thread is only handled once
        # the main thread runs Python code again.
        while not self._stop.wait(0.2):
            pass
        self._log.info("trans_server_stopping")
        self.handle.set_serving(False)
        self.watcher.stop()
        self.handle.stop()
        self.catalog.close()
        self._log.info("trans_server_stopped", exit_code=self.exit_code)
        return self.exit_code


def main(argv: list[str] | None = None) -> int:
    try:
        config, _config_arg = load_process_config("retina-trans", __doc__, argv)
    except (ConfigError, failpoints.FailpointError) as exc:
        print(f"retina-trans: {exc}", file=sys.stderr)
        return exit_codes.USAGE
    log = configure_logging("trans", config.log_level)
    try:
        server = TransServer(config, log)
        server.start()
    except ConfigError as exc:
        log.error("trans_server_config_error", error=str(exc))
        return exit_codes.USAGE
    except (EtcdError, CatalogError, CounterCorrupt, OSError) as exc:
        log.error("trans_server_start_failed", error=str(exc), error_type=type(exc).__name__)
        return exit_codes.UNAVAILABLE

    def on_signal(_signum: int, _frame: FrameType | None) -> None:
        server.request_stop()  # only a flag: no logging from a signal handler

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    return server.wait()


if __name__ == "__main__":
    sys.exit(main())
