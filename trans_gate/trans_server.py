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
from retina_common.etcd import EtcdError, EtcdStore, EtcdUnavailable
from retina_common.grpc_server import ServerHandle
from retina_common.keys import GC_HORIZON_KEY, TRANS_ID_KEY, TRANS_TIMESTAMP_KEY
from retina_common.log import configure_logging
from retina_common.metrics import serve_metrics
from retina_common.pb import trans_pb2, trans_pb2_grpc
from retina_common.process_config import load_process_config
from retina_common.topology import load_topology
from trans_gate.as_of import AsOfPoints
from trans_gate.consumers import ConsumerCorrupt, Consumers, ConsumerStore
from trans_gate.gate import LifecycleWatcher, NodeAvailability, QueryAvailabilityGate
from trans_gate.history import GcHorizon, HorizonCorrupt, retained_snapshot
from trans_gate.pins import PinCorrupt, Pins, PinStore
from trans_gate.time_map import TimeMap
from trans_gate.timestamps import CounterCorrupt, DurableCounter
from trans_gate.trans_service import HWM_GAUGE, TransService
from trans_gate.transactions import TransactionTable

SERVICE_NAME = trans_pb2.DESCRIPTOR.services_by_name["TransService"].full_name

LIVE_TRANS = Gauge("trans_live_transactions", "Live transactions", ["kind"])
WATCH_UP = Gauge("trans_gate_watch_up", "1 while the lifecycle watch is initialised and healthy")
NODE_READY = Gauge("trans_gate_node_ready", "1 if the gate sees the node READY and fresh", ["node"])
SAFE_GC = Gauge("trans_safe_gc_ts", "Current safe GC timestamp")
HORIZON = Gauge("trans_gc_horizon_ts", "The GC horizon: the largest safeGcTs handed out")
EARLIEST_READABLE = Gauge("trans_earliest_readable_ts",
                          "The earliest snapshot an AS OF read is admitted at")
EARLIEST_READABLE_TIME = Gauge("trans_earliest_readable_time_ms",
                               "The earliest wall-clock time an AS OF read resolves (0: none)")
PINS = Gauge("trans_pins", "Named pins")
OLDEST_PIN = Gauge("trans_oldest_pin_ts", "The lowest pinned timestamp (-1: no pin)")
HISTORY_RETENTION = Gauge("trans_history_retention_ms", "trans.history_retention_ms as configured")
CONSUMERS = Gauge("retina_consumers", "Registered change-feed consumers")
CONSUMER_LAG_MS = Gauge("retina_consumer_lag_ms",
                        "How long ago the high watermark passed a consumer's cursor",
                        ["consumer"])
CONSUMER_LAG_COMMITS = Gauge("retina_consumer_lag_commits",
                             "Write transactions committed above a consumer's cursor "
                             "(since the TransServer's start)", ["consumer"])
CONSUMER_MAX_LAG = Gauge("retina_consumer_max_lag_ms",
                         "trans.max_consumer_lag_ms: a consumer lagging more is dropped")


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
        self.horizon = GcHorizon(store, GC_HORIZON_KEY, failpoints.TRANS_HORIZON_PERSIST_BEFORE,
                                 failpoints.TRANS_HORIZON_PERSIST_AFTER)
        self.time_map = TimeMap(store, now_ms)
        self._pin_store = PinStore(store)
        self._consumer_store = ConsumerStore(store)
        self.table: TransactionTable | None = None
        self.pins: Pins | None = None
        self.consumers: Consumers | None = None
        self._lag_labels: set[str] = set()

    def start(self) -> None:
        self.catalog.bootstrap()
        self.timestamps.open()
        self.trans_ids.open()
        tc = self._config.trans
        self.horizon.load()
        self.time_map.load()
        self.table = TransactionTable(
            self.timestamps, self.trans_ids, now_ms, write_lease_ms=tc.write_lease_ms,
            read_lease_ms=tc.read_lease_ms, max_lease_ms=tc.max_lease_ms,
            horizon=self.horizon, ended_cache_size=tc.ended_cache_size,
            retained=retained_snapshot(tc.history_retention_ms,
                                       self.time_map.hwm_at_or_before, now_ms),
            time_of=self.time_map.earliest_time_at_or_above)
        HISTORY_RETENTION.set(tc.history_retention_ms)
        self.time_map.start(self.table.high_watermark())
        # This incarnation's start is durable before anything commits: a crash before the
        # next flush leaves a gap from here, never a stretch read as quiet.
        if not self.time_map.flush():
            raise EtcdUnavailable("the time map's first chunk could not be written")
        # Before anything is served: every stored pin holds safeGcTs again.
        self.pins = Pins(self._pin_store, self.table)
        pins = self.pins.load()
        self.consumers = Consumers(self._consumer_store, self.table,
                                   self.time_map.earliest_time_at_or_above,
                                   tc.max_consumer_lag_ms, now_ms)
        consumers = self.consumers.load()
        CONSUMER_MAX_LAG.set(tc.max_consumer_lag_ms)
        service = TransService(self.table, self.gate, self.catalog, on_fenced=self._fenced,
                               as_of=AsOfPoints(self.time_map, self.pins, self.table.horizon),
                               pins=self.pins, consumers=self.consumers,
                               time_map=self.time_map,
                               history_retention_ms=tc.history_retention_ms)
        trans_pb2_grpc.add_TransServiceServicer_to_server(service, self.handle.server)
        if self._config.gate.retina_enabled:
            self.watcher.start()
        else:
            self._log.warning("gate_disabled", reason="gate.retina_enabled = false")
        metrics_port = serve_metrics(tc.metrics_listen)
        self.handle.start()
        self.handle.set_serving(True)
        threading.Thread(target=self._housekeeping, name="lease-reaper", daemon=True).start()
        threading.Thread(target=self._time_map_loop, name="time-map", daemon=True).start()
        self._log.info("trans_server_started", listen=self.handle.address,
                       metrics_port=metrics_port, expected_nodes=list(self.gate.expected_nodes),
                       first_timestamp=self.timestamps.session_start,
                       high_watermark=self.table.high_watermark(),
                       gc_horizon=self.horizon.durable, pins=[p.name for p in pins],
                       consumers={c.name: c.cursor_ts for c in consumers},
                       history_retention_ms=tc.history_retention_ms)

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
            SAFE_GC.set(self.table.peek_safe_gc_ts())
            self._history_gauges()
            try:
                self._check_consumers()
            except Exception as exc:  # never stop the lease reaper; a consumer kept holds more
                self._log.error("consumer_check_failed", error=str(exc),
                                error_type=type(exc).__name__)
            snapshot, now = self.gate.snapshot, now_ms()
            for node in self.gate.expected_nodes:
                ready = self.gate.availability(node, snapshot, now) == NodeAvailability.READY
                NODE_READY.labels(node=node).set(1 if ready else 0)

    def _history_gauges(self) -> None:
        assert self.table is not None and self.pins is not None
        horizon = self.table.horizon()
        HORIZON.set(horizon)
        EARLIEST_READABLE.set(horizon + 1)
        EARLIEST_READABLE_TIME.set(self.time_map.earliest_time_at_or_above(horizon + 1))
        pins = self.pins.all()
        PINS.set(len(pins))
        OLDEST_PIN.set(min((p.ts for p in pins), default=-1))

    def _check_consumers(self) -> None:
        """Drop the consumers lagging past trans.max_consumer_lag_ms; export the others'
        lag (a dropped consumer's labels go with it)."""
        assert self.consumers is not None
        self.consumers.drop_lagging()
        listed = self.consumers.all()
        CONSUMERS.set(len(listed))
        names = {c.name for c, _lag in listed}
        for gone in self._lag_labels - names:
            CONSUMER_LAG_MS.remove(gone)
            CONSUMER_LAG_COMMITS.remove(gone)
        for consumer, lag in listed:
            CONSUMER_LAG_MS.labels(consumer=consumer.name).set(lag.ms)
            CONSUMER_LAG_COMMITS.labels(consumer=consumer.name).set(lag.commits)
        self._lag_labels = names

    def _time_map_loop(self) -> None:
        """Sample the HWM; flush (after pruning what the durable horizon made unreadable)."""
        tc = self._config.trans
        assert self.table is not None
        flushed = time.monotonic()
        while not self._stop.wait(tc.time_map_sample_ms / 1000):
            self.time_map.sample(self.table.high_watermark())
            if time.monotonic() - flushed >= tc.time_map_flush_ms / 1000:
                self.time_map.prune(self.horizon.durable)
                self.time_map.flush()
                flushed = time.monotonic()

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
        if self._config.gate.retina_enabled:  # not started otherwise
            self.watcher.stop()
        self.handle.stop()
        if self.table is not None and self.exit_code == 0:
            self.time_map.close(self.table.high_watermark())  # nothing commits after this
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
    except (EtcdError, CatalogError, CounterCorrupt, HorizonCorrupt, PinCorrupt,
            ConsumerCorrupt, OSError) as exc:
        log.error("trans_server_start_failed", error=str(exc), error_type=type(exc).__name__)
        return exit_codes.UNAVAILABLE

    def on_signal(_signum: int, _frame: FrameType | None) -> None:
        server.request_stop()  # only a flag: no logging from a signal handler

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    return server.wait()


if __name__ == "__main__":
    sys.exit(main())
