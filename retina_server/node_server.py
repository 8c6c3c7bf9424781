"""The Retina server process: ``retina-server --config retina.toml``.

``main`` parses the configuration; :func:`wire` builds and connects the node's
components (catalog, etcd, node-local index, data plane, lifecycle, checkpoint
store, recovery coordinator, GC, gRPC) and returns them (:class:`NodeParts`);
:func:`serve` runs them and :func:`shut_down` stops them. The process starts
RECOVERING: the gRPC server comes up (GetRetinaStatus answers at once), the
recovery coordinator loads and cleanses the checkpoint and derives the replay
starts, and the node waits for the CDC side's replay and MarkReady. Background
work (flush timer, periodic checkpoints) starts only from the READY hooks
(recovery/mark_ready.py).

On SIGTERM: health NOT_SERVING, gRPC stops; if READY, the write buffers are
flushed through the publisher and a final checkpoint is taken; the
lifecycle lease is revoked, so the gate refuses at once.

Exit codes: 0 stopped, 2 configuration, 4 a dependency unreachable at start,
5 the shutdown did not finish within its deadline (the next start recovers).
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from types import FrameType

import structlog

from retina_common import exit_codes, failpoints, tls
from retina_common.catalog import Catalog, CatalogError
from retina_common.checkpoint_store import CheckpointBody, CheckpointStore
from retina_common.config import Config, ConfigError, split_host_port
from retina_common.etcd import EtcdError, EtcdStore
from retina_common.grpc_server import ServerHandle
from retina_common.lifecycle_record import LifecycleState
from retina_common.log import configure_logging, get_logger
from retina_common.metrics import serve_metrics
from retina_common.pb import retina_pb2, retina_pb2_grpc, trans_pb2_grpc
from retina_common.process_config import load_process_config
from retina_common.replay_ts import derive
from retina_common.storage import root_uri
from retina_common.topology import Topology, load_topology
from retina_server.bulk_load import BulkLoads, LoadSettings
from retina_server.change_feed import ChangeFeed
from retina_server.gc.gc_job import GcJobLauncher, require_spark
from retina_server.gc.gc_journal import GcJournal
from retina_server.gc.gc_scheduler import GcScheduler, ReplayFloor
from retina_server.gc.lineage import Lineage
from retina_server.gc.rewrites import GcSettings, StorageGc
from retina_server.gc.sweeper import Sweeper, SweeperSettings
from retina_server.index import LocalIndexService
from retina_server.lifecycle import LifecycleAnnouncer, LifecycleStateMachine, Phase
from retina_server.load_journal import LoadJournal
from retina_server.node import BufferSettings, RetinaNode
from retina_server.read_guard import ReadTransactionGuard
from retina_server.recovery.coordinator import RecoveryCoordinator
from retina_server.recovery.mark_ready import MarkReadyBarrier, ReadyHooks, RestartFence
from retina_server.recovery.registered_writers import RegisteredWriters
from retina_server.row_lookup import row_lookup
from retina_server.source_positions import SourcePositions
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


@dataclass(frozen=True)
class NodeParts:
    """A Retina node's components, wired by :func:`wire`: what serving and stopping use."""

    node_id: str
    topology: Topology
    catalog: Catalog
    index: LocalIndexService
    node: RetinaNode
    handle: ServerHandle
    machine: LifecycleStateMachine
    announcer: LifecycleAnnouncer
    recovery: RecoveryCoordinator
    replay_floor: ReplayFloor
    stop: threading.Event
    metrics_listen: str


def wire(config: Config, config_path: str, node_id: str, topology: Topology) -> NodeParts:
    """Build the node's components and connect them. Nothing runs yet: no thread, no
    RPC served, nothing announced. Raises CatalogError or OSError when a dependency
    cannot be opened (the catalog, the node's state directory, its listen address)."""
    rc = config.retina
    log = get_logger(component="node_server")
    host, port = split_host_port(node_id)
    catalog = Catalog(config.catalog.dsn, pool_max=config.catalog.pool_max,
                      connect_timeout_s=config.catalog.connect_timeout_s)
    etcd = EtcdStore.from_config(config.etcd)
    trans = TransClient(trans_pb2_grpc.TransServiceStub(
        tls.open_channel(config.trans.listen, config.tls)))
    catalog.bootstrap()
    state_dir = Path(rc.state_dir) / f"{host}-{port}"
    index = LocalIndexService(state_dir / "index")
    positions = SourcePositions(index.primary)  # in the index's LMDB environment
    journal = GcJournal(state_dir / "gc_journal")
    load_journal = LoadJournal(state_dir / "load_journal")
    storage = root_uri(config.storage.root)
    node = RetinaNode(node_id, topology, catalog, index, storage,
                      BufferSettings(rc.block_rows, rc.blocks_per_file, rc.flush_interval_ms,
                                     rc.close_workers), lambda: int(time.time() * 1000),
                      source_positions=positions)
    handle = ServerHandle(rc.listen, max_workers=16, service_names=[SERVICE_NAME],
                          tls=config.tls)
    machine = LifecycleStateMachine()
    announcer = LifecycleAnnouncer(
        etcd, node_id, rc.lifecycle_ttl_s,
        on_put=lambda state: handle.set_serving(state == LifecycleState.READY))
    stop = threading.Event()

    def is_ready() -> bool:
        return machine.phase == Phase.READY

    checkpoint_store = CheckpointStore(etcd, node_id, storage, topology.topology_hash)
    # The lowest replay start a restart could use: it bounds the prune horizon and every
    # Storage GC cutoff (GC_CUTOFF_BELOW_REPLAY_FLOOR).
    replay_floor = ReplayFloor()
    gc = StorageGc(node, catalog, journal, trans.safe_gc_ts,
                   GcSettings(rc.gc_retired_retention_ms, rc.gc_prepare_ttl_ms),
                   trans_live=trans.trans_live, replay_floor=replay_floor.floor)

    def previous_slot_empty() -> bool:
        """Whether the install just done left ``previous`` empty: then a restart can load
        that checkpoint or none. Read under the checkpoint lock, so no other install runs
        meanwhile; unknown counts as not empty (the floor stays lower, never higher)."""
        try:
            return checkpoint_store.previous_empty()
        except EtcdError as exc:
            log.warning("checkpoint_previous_slot_unread", node=node_id, error=str(exc))
            return False
    loads = BulkLoads(node, catalog, load_journal,
                      LoadSettings(prepare_ttl_ms=rc.load_prepare_ttl_ms,
                                   record_min_age_ms=rc.load_record_min_age_ms))
    gc.load_files = loads.journal.protected_files

    def observe_checkpoint(body: CheckpointBody) -> None:
        starts = derive(body.header.checkpoint_applied_ts, body.segments, node.owned_vnodes, [])
        only_slot = previous_slot_empty()
        replay_floor.observe(body.header.checkpoint_id, starts.node_replay_from_ts,
                             only_slot=only_slot)
        log.info("replay_floor_observed", node=node_id,
                 checkpoint_id=body.header.checkpoint_id,
                 node_replay_from_ts=starts.node_replay_from_ts, only_slot=only_slot,
                 replay_floor_ts=replay_floor.floor())
        loads.observe_checkpoint(starts)

    recovery = RecoveryCoordinator(
        node, catalog, checkpoint_store, machine, announcer, trans.high_watermark,
        index.sequences.allocate("recovery_epoch") + 1, journal,
        retired_retention_ms=rc.gc_retired_retention_ms,
        # Observed before promotion: a crash in between leaves a lower floor, never a
        # higher one.
        loaded_listeners=[gc.observe_loaded],
        checkpoint_listeners=[observe_checkpoint,
                              lambda body: gc.promote({f.file_id for f in body.files})],
        loads=loads)
    scheduler = GcScheduler(node, trans.safe_gc_ts, gc.gc_floor, replay_floor.floor,
                            rc.gc_interval_ms / 1000, stop, is_ready=is_ready)
    # The two cycles of the wiring close here, once both ends exist: a node failing closed
    # fails its recovery's lifecycle, and a GC prepare reads the scheduler's FOLD_FENCE.
    node.on_fail_closed = recovery.fail
    gc.fold_fence = scheduler.fold_fence
    lineage = Lineage(node, catalog, journal, gc, rc.gc_retired_retention_ms)
    sweeper = Sweeper(node, catalog, journal, checkpoint_store, trans.read_holds,
                      gc.pending_file_names, lineage.lock,
                      SweeperSettings(rc.sweeper_interval_ms / 1000, rc.temporary_file_ttl_ms,
                                      rc.orphan_grace_ms, rc.gc_lineage_retention_ms),
                      stop, is_ready=is_ready)
    sweeper.load_files = loads.protected_files
    job = GcJobLauncher(node_id, config_path, rc.gc_job_interval_ms / 1000, rc.gc_job_args,
                        stop, is_ready=is_ready, nice=rc.gc_job_nice)

    def start_gc() -> None:
        scheduler.start()
        job.start()
        sweeper.start()

    hooks = ReadyHooks(node, recovery.create_checkpoint, rc.checkpoint_interval_ms / 1000, stop,
                       start_gc=start_gc)
    writers = RegisteredWriters(etcd, anonymous_writes=rc.anonymous_writes)
    barrier = MarkReadyBarrier(machine, recovery.entry, recovery.check_attempt, hooks,
                               recovery.announce_ready,
                               RestartFence(node, trans.fresh_timestamp,
                                            writers.replay_complete),
                               check_sources=writers.check_replayed)
    lookup = row_lookup(node, catalog, rc.lookup_cache_mb << 20)
    retina_pb2_grpc.add_RetinaWorkerServiceServicer_to_server(
        RetinaService(node, recovery, barrier, machine,
                      ReadTransactionGuard(trans.trans_status),
                      rc.max_rows_per_request, gc, scheduler, sweeper, lineage, writers,
                      lookup, ChangeFeed(node, lookup, node.source_positions.positions),
                      trans.write_live_at, loads),
        handle.server)
    return NodeParts(node_id, topology, catalog, index, node, handle, machine, announcer,
                     recovery, replay_floor, stop, rc.metrics_listen)


def serve(parts: NodeParts, log: structlog.BoundLogger) -> None:
    """Serve from RECOVERING until SIGTERM or SIGINT."""
    metrics_port = serve_metrics(parts.metrics_listen)
    received: list[str] = []

    def on_signal(signum: int, _frame: FrameType | None) -> None:
        # Nothing but a flag here: logging from a signal handler can deadlock on
        # a lock another thread holds.
        received.append(signal.Signals(signum).name)
        parts.stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    recovery = parts.recovery
    try:
        # RECOVERING replaces a crashed predecessor's READY value before anything
        # else, so the gate closes as early as this process can make it.
        recovery.announce()
    except EtcdError as exc:
        log.error("lifecycle_announce_failed", error=str(exc))
    parts.handle.start()
    log.info("retina_server_started", listen=parts.handle.address, metrics_port=metrics_port,
             vnodes=list(parts.topology.vnodes_of(parts.node_id)),
             topology_hash=parts.topology.topology_hash[:16],
             recovery_epoch=recovery.recovery_epoch)
    parts.announcer.start()
    try:
        recovery.run_startup()
    except Exception as exc:  # whatever it is, the node must say FAILED, not hang
        log.error("recovery_start_failed", error=str(exc), error_type=type(exc).__name__)
        recovery.fail(f"start-up failed: {exc}")
    if recovery.attempt.starts is not None:  # the loaded checkpoint bounds the prune horizon
        parts.replay_floor.observe(recovery.attempt.checkpoint_id,
                                   recovery.attempt.starts.node_replay_from_ts)
    # Wait in slices: a process-directed signal may land on one of gRPC's threads,
    # and then only a main thread that wakes up runs the Python handler.
    while not parts.stop.wait(0.2):
        pass
    log.info("retina_server_stopping", signal=received[0] if received else None,
             phase=parts.machine.phase.value)


def shut_down(parts: NodeParts, log: structlog.BoundLogger) -> None:
    """Stop serving; if READY, flush the write buffers and take a final checkpoint; revoke
    the lifecycle lease (the gate refuses at once)."""
    parts.handle.set_serving(False)
    parts.handle.stop()
    if parts.machine.phase == Phase.READY and parts.node.failure is None:
        parts.node.shutdown()
        try:
            parts.recovery.create_checkpoint()
        except Exception as exc:
            log.error("checkpoint_failed", error=str(exc), error_type=type(exc).__name__)
    parts.announcer.stop(revoke=True)


def main(argv: list[str] | None = None) -> int:
    try:
        config, config_arg = load_process_config("retina-server", __doc__, argv)
        # The GC job the node may launch reads the same file.
        config_path = os.path.abspath(config_arg or os.environ.get("RETINA_CONFIG", ""))
        node_id, topology = _settings(config)
    except (ConfigError, failpoints.FailpointError) as exc:
        print(f"retina-server: {exc}", file=sys.stderr)
        return exit_codes.USAGE
    log = configure_logging("retina", config.log_level, node=node_id)
    try:
        parts = wire(config, config_path, node_id, topology)
    except (CatalogError, OSError) as exc:
        log.error("retina_server_start_failed", error=str(exc), error_type=type(exc).__name__)
        return exit_codes.UNAVAILABLE
    serve(parts, log)
    worker = threading.Thread(target=shut_down, args=(parts, log), name="shutdown", daemon=True)
    worker.start()
    worker.join(SHUTDOWN_DEADLINE_S)
    if worker.is_alive():
        # Whatever blocks, a stop must not hang: exiting now is a crash, and the
        # next start recovers from it like from any other.
        log.error("shutdown_forced", deadline_s=SHUTDOWN_DEADLINE_S)
        os._exit(exit_codes.SHUTDOWN_FORCED)
    parts.index.close()
    parts.catalog.close()
    log.info("retina_server_stopped", phase=parts.machine.phase.value,
             failure=parts.node.failure)
    return exit_codes.OK


if __name__ == "__main__":
    sys.exit(main())
