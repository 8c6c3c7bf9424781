"""The Retina server process: ``retina-server --config retina.toml``.

The constructor-like part of ``main`` only wires parts together (catalog,
etcd, node-local index, data plane, lifecycle, checkpoint store, recovery
coordinator, gRPC). Then the process starts RECOVERING: the gRPC server comes
up (GetRetinaStatus answers at once), the recovery coordinator loads and
cleanses the checkpoint and derives the replay starts, and the node waits
for the CDC side's replay and MarkReady. Background work (flush timer,
periodic checkpoints) starts only from the READY hooks (mark_ready.py).

On SIGTERM: health NOT_SERVING, gRPC stops; if READY, the write buffers are
flushed through the publisher and a final checkpoint is taken; the
lifecycle lease is revoked, so the gate refuses at once.

Exit codes: 0 stopped, 2 configuration, 4 a dependency unreachable at start,
5 the shutdown did not finish within its deadline (the next start recovers).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
import time
from pathlib import Path
from types import FrameType

from retina_common import failpoints, tls
from retina_common.catalog import Catalog, CatalogError
from retina_common.checkpoint_store import CheckpointBody, CheckpointStore
from retina_common.config import Config, ConfigError, load_config, split_host_port
from retina_common.etcd import EtcdError, EtcdStore
from retina_common.grpc_server import ServerHandle
from retina_common.lifecycle_record import LifecycleState
from retina_common.log import configure_logging
from retina_common.metrics import serve_metrics
from retina_common.pb import retina_pb2, retina_pb2_grpc, trans_pb2_grpc
from retina_common.replay_ts import derive
from retina_common.storage import root_uri
from retina_common.topology import Topology, load_topology
from retina_server.gc.gc_job import GcJobLauncher, require_spark
from retina_server.gc.gc_journal import GcJournal
from retina_server.gc.gc_scheduler import GcScheduler, ReplayFloor
from retina_server.gc.lineage import Lineage
from retina_server.gc.rewrites import GcSettings, StorageGc
from retina_server.gc.sweeper import Sweeper, SweeperSettings
from retina_server.index import LocalIndexService
from retina_server.lifecycle import LifecycleAnnouncer, LifecycleStateMachine, Phase
from retina_server.node import BufferSettings, RetinaNode
from retina_server.read_guard import ReadTransactionGuard
from retina_server.recovery.coordinator import RecoveryCoordinator
from retina_server.recovery.mark_ready import MarkReadyBarrier, ReadyHooks, RestartFence
from retina_server.recovery.registered_writers import RegisteredWriters
from retina_server.row_lookup import row_lookup
from retina_server.trans_client import TransClient
from retina_server.worker_service import RetinaService

SERVICE_NAME = retina_pb2.DESCRIPTOR.services_by_name["RetinaWorkerService"].full_name
SHUTDOWN_DEADLINE_S = 25.0


def _settings(config: Config) -> tuple[str, Topology]:
    topology = load_topology(config.topology_file)
    node_id = config.retina.node_id or config.retina.listen
    split_host_port(node_id)
    tls.check_server(config.tls)
    if node_id not in topology.nodes:
        raise ConfigError(f"node {node_id} is not in the topology {list(topology.nodes)}")
    if config.retina.gc_job_interval_ms > 0:
        require_spark()
    return node_id, topology


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="retina-server", description=__doc__)
    parser.add_argument("--config", help="TOML config file (default: $RETINA_CONFIG)")
    args = parser.parse_args(argv)
    try:
        config = load_config(args.config)
        tls.configure(config.tls)
        # The GC job the node may launch reads the same file.
        config_path = os.path.abspath(args.config or os.environ.get("RETINA_CONFIG", ""))
        failpoints.load_from_env()
        node_id, topology = _settings(config)
    except (ConfigError, failpoints.FailpointError) as exc:
        print(f"retina-server: {exc}", file=sys.stderr)
        return 2
    rc = config.retina
    host, port = split_host_port(node_id)
    log = configure_logging("retina", config.log_level, node=node_id)
    catalog = Catalog(config.catalog.dsn, pool_max=config.catalog.pool_max,
                      connect_timeout_s=config.catalog.connect_timeout_s)
    etcd = EtcdStore.from_config(config.etcd)
    trans = TransClient(trans_pb2_grpc.TransServiceStub(
        tls.open_channel(config.trans.listen, config.tls)))
    try:
        catalog.bootstrap()
        state_dir = Path(rc.state_dir) / f"{host}-{port}"
        index = LocalIndexService(state_dir / "index")
        journal = GcJournal(state_dir / "gc_journal")
        storage = root_uri(config.storage.root)
        node = RetinaNode(node_id, topology, catalog, index, storage,
                          BufferSettings(rc.block_rows, rc.blocks_per_file, rc.flush_interval_ms,
                                         rc.close_workers), lambda: int(time.time() * 1000))
        handle = ServerHandle(rc.listen, max_workers=16, service_names=[SERVICE_NAME],
                              tls=config.tls)
    except (CatalogError, OSError) as exc:
        log.error("retina_server_start_failed", error=str(exc), error_type=type(exc).__name__)
        return 4
    machine = LifecycleStateMachine()
    announcer = LifecycleAnnouncer(
        etcd, node_id, rc.lifecycle_ttl_s,
        on_put=lambda state: handle.set_serving(state == LifecycleState.READY))
    stop = threading.Event()
    checkpoint_store = CheckpointStore(etcd, node_id, storage, topology.topology_hash)
    recovery = RecoveryCoordinator(
        node, catalog, checkpoint_store,
        machine, announcer, trans.high_watermark, index.sequences.allocate("recovery_epoch") + 1,
        journal)
    node.on_fail_closed = recovery.fail
    gc = StorageGc(node, catalog, journal, trans.safe_gc_ts,
                   GcSettings(rc.gc_retired_retention_ms, rc.gc_prepare_ttl_ms),
                   trans_live=lambda trans_id: trans.trans_status(trans_id).live)
    replay_floor = ReplayFloor()

    def observe_checkpoint(body: CheckpointBody) -> None:
        start = derive(body.header.checkpoint_applied_ts, body.segments, node.owned_vnodes, [])
        replay_floor.observe(body.header.checkpoint_id, start.node_replay_from_ts)

    # Observed before promotion: a crash in between leaves a lower floor, never a higher one.
    recovery.loaded_listeners.append(gc.observe_loaded)
    recovery.checkpoint_listeners += [
        observe_checkpoint, lambda body: gc.promote({f.file_id for f in body.files})]
    scheduler = GcScheduler(node, trans.safe_gc_ts, gc.gc_floor, replay_floor.floor,
                            rc.gc_interval_ms / 1000, stop,
                            is_ready=lambda: machine.phase == Phase.READY)
    gc.fold_fence = scheduler.fold_fence
    lineage = Lineage(node, catalog, journal, gc, rc.gc_retired_retention_ms)
    recovery.retired_retention_ms = rc.gc_retired_retention_ms

    sweeper = Sweeper(node, catalog, journal, checkpoint_store, trans.read_holds,
                      gc.pending_file_names, lineage.lock,
                      SweeperSettings(rc.sweeper_interval_ms / 1000, rc.temporary_file_ttl_ms,
                                      rc.orphan_grace_ms, rc.gc_lineage_retention_ms),
                      stop, is_ready=lambda: machine.phase == Phase.READY)
    job = GcJobLauncher(node_id, config_path, rc.gc_job_interval_ms / 1000, rc.gc_job_args,
                        stop, is_ready=lambda: machine.phase == Phase.READY)
    def start_gc() -> None:
        scheduler.start()
        job.start()
        sweeper.start()

    hooks = ReadyHooks(node, recovery.create_checkpoint, rc.checkpoint_interval_ms / 1000, stop,
                       start_gc=start_gc)
    writers = RegisteredWriters(etcd, anonymous_writes=rc.anonymous_writes)
    barrier = MarkReadyBarrier(machine, recovery.entry, recovery.check_attempt, hooks,
                               recovery.announce_ready,
                               RestartFence(node, trans.fresh_timestamp),
                               check_sources=writers.check_replayed)
    retina_pb2_grpc.add_RetinaWorkerServiceServicer_to_server(
        RetinaService(node, recovery, barrier, machine,
                      ReadTransactionGuard(trans.trans_status),
                      rc.max_rows_per_request, gc, scheduler, sweeper, lineage, writers,
                      row_lookup(node, catalog, rc.lookup_cache_mb << 20)),
        handle.server)
    metrics_port = serve_metrics(rc.metrics_listen)

    received: list[str] = []

    def on_signal(signum: int, _frame: FrameType | None) -> None:
        # Nothing but a flag here: logging from a signal handler can deadlock on
        # a lock another thread holds.
        received.append(signal.Signals(signum).name)
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        # RECOVERING replaces a crashed predecessor's READY value before anything
        # else, so the gate closes as early as this process can make it.
        recovery.announce()
    except EtcdError as exc:
        log.error("lifecycle_announce_failed", error=str(exc))
    handle.start()
    log.info("retina_server_started", listen=handle.address, metrics_port=metrics_port,
             vnodes=list(topology.vnodes_of(node_id)), topology_hash=topology.topology_hash[:16],
             recovery_epoch=recovery.recovery_epoch)
    announcer.start()
    try:
        recovery.run_startup()
    except Exception as exc:  # whatever it is, the node must say FAILED, not hang
        log.error("recovery_start_failed", error=str(exc), error_type=type(exc).__name__)
        recovery.fail(f"start-up failed: {exc}")
    if recovery.attempt.starts is not None:  # the loaded checkpoint bounds the prune horizon
        replay_floor.observe(recovery.attempt.checkpoint_id,
                             recovery.attempt.starts.node_replay_from_ts)
    # Wait in slices: a process-directed signal may land on one of gRPC's threads,
    # and then only a main thread that wakes up runs the Python handler.
    while not stop.wait(0.2):
        pass
    log.info("retina_server_stopping", signal=received[0] if received else None,
             phase=machine.phase.value)

    def shut_down() -> None:
        handle.set_serving(False)
        handle.stop()
        if machine.phase == Phase.READY and node.failure is None:
            node.shutdown()
            try:
                recovery.create_checkpoint()
            except Exception as exc:
                log.error("checkpoint_failed", error=str(exc), error_type=type(exc).__name__)
        announcer.stop(revoke=True)

    worker = threading.Thread(target=shut_down, name="shutdown", daemon=True)
    worker.start()
    worker.join(SHUTDOWN_DEADLINE_S)
    if worker.is_alive():
        # Whatever blocks, a stop must not hang: exiting now is a crash, and the
        # next start recovers from it like from any other.
        log.error("shutdown_forced", deadline_s=SHUTDOWN_DEADLINE_S)
        os._exit(5)
    index.close()
    catalog.close()
    log.info("retina_server_stopped", phase=machine.phase.value, failure=node.failure)
    return 0


if __name__ == "__main__":
    sys.exit(main())
