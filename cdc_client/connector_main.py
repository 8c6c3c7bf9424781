"""``retina-cdc --config retina.toml``: the CDC connector process.

Wires a source (``cdc.source``: ``postgres`` logical replication or
``debezium-file``), the durable changelog, the committed-position store, the
TransServer and every Retina node of the topology into a
:class:`~cdc_client.connector.Connector`, watches the Retina lifecycle keys
(a change triggers the recovery driver at once), runs changelog retention,
and serves ``/metrics``.

Exit codes: 0 stopped by a signal; 1 an unexpected failure (restart it: it
resumes from the committed position); 2 configuration; 3 stopped by a refusal
or a malformed source event (the log says which; nothing of the offending
transaction was applied; a restart stops at the same event again, so exit 3
needs an operator, not a supervisor's restart); 4 a dependency unreachable
at start; 5 a recovering node needs changelog batches retention has dropped (a replay gap:
nothing was replayed, MarkReady was not sent, the node stays RECOVERING;
restarting does not help, see docs/operations.md); 6 stopped by a source
schema change Retina cannot follow (a dropped, renamed or retyped column, a
new NOT NULL column or one with a default, a changed primary key: nothing of
that transaction was applied; docs/cdc.md, "Schema changes", is the procedure).
"""

from __future__ import annotations

import functools
import signal
import sys
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from types import FrameType

import structlog

from cdc_client.changelog_pruning import run_retention
from cdc_client.connector import Connector, ConnectorStopped, ReplayGap, Settings
from cdc_client.positions import ConnectorFenced, PositionStore
from cdc_client.routes import RouteError, Routes
from cdc_client.schema_change import UnsupportedSchemaChange
from cdc_client.source import Source, SourceError
from cdc_client.translate import MalformedChange, TableMap
from retina_common import exit_codes, failpoints, replay_sources
from retina_common.catalog import (
    Catalog,
    CatalogOutcomeUnknown,
    CatalogUnavailable,
    NotFound,
    TableRecord,
)
from retina_common.changelog import Changelog, CorruptChangelog, changelog_root
from retina_common.changelog_replay import registered_logs
from retina_common.client import channel
from retina_common.config import UNCHANGED_TOAST_MODES, CdcConfig, CdcRoute, ConfigError
from retina_common.etcd import EtcdError, EtcdStore
from retina_common.keys import LIFECYCLE_PREFIX
from retina_common.log import configure_logging
from retina_common.metrics import serve_metrics
from retina_common.pb import retina_pb2 as pb
from retina_common.pb import retina_pb2_grpc, trans_pb2_grpc
from retina_common.process_config import load_process_config
from retina_common.replay_sources import ReplaySourceError
from retina_common.retry import until_deadline
from retina_common.topology import Topology, load_topology

log = structlog.get_logger("cdc")


def settings_of(cdc: CdcConfig, retina_max_rows: int) -> Settings:
    modes = {"vnode": pb.VNODE, "node": pb.NODE}
    if cdc.replay_mode not in modes:
        raise ConfigError(f"cdc.replay_mode: expected vnode or node, got {cdc.replay_mode!r}")
    return Settings(schema=cdc.schema, batch_max_transactions=cdc.batch_max_transactions,
                    batch_max_rows=cdc.batch_max_rows, batch_max_delay_ms=cdc.batch_max_delay_ms,
                    batch_idle_gap_ms=cdc.batch_idle_gap_ms,
                    write_lease_ms=cdc.write_lease_ms, replay_mode=modes[cdc.replay_mode],
                    request_max_rows=min(cdc.request_max_rows, retina_max_rows),
                    drive_recovery=cdc.drive_recovery,
                    node_check_interval_s=cdc.node_check_interval_ms / 1000,
                    writer_id=cdc.name, snapshot_bulk_load=cdc.snapshot_bulk_load)


def check_source(cdc: CdcConfig) -> None:
    """Refuse a source configuration before any dependency is contacted."""
    if cdc.source not in ("postgres", "debezium-file"):
        raise ConfigError(f"cdc.source: expected postgres or debezium-file, got {cdc.source!r}")
    if cdc.source == "postgres" and not cdc.source_dsn:
        raise ConfigError("cdc.source_dsn is required for the postgres source")
    if cdc.source == "debezium-file" and not cdc.debezium_dir:
        raise ConfigError("cdc.debezium_dir is required for the debezium-file source")
    if cdc.snapshot_mode not in ("initial", "never"):
        raise ConfigError(f"cdc.snapshot_mode: expected initial or never, "
                          f"got {cdc.snapshot_mode!r}")
    if cdc.snapshot_chunk_rows < 1:
        raise ConfigError("cdc.snapshot_chunk_rows must be at least 1")
    if cdc.unchanged_toast not in UNCHANGED_TOAST_MODES:
        raise ConfigError(f"cdc.unchanged_toast: expected one of {UNCHANGED_TOAST_MODES}, "
                          f"got {cdc.unchanged_toast!r}")


def open_source(cdc: CdcConfig, start_after: str | None,
                tables: TableMap | None = None) -> Source:
    check_source(cdc)
    if cdc.source == "postgres":
        from cdc_client.sources.postgres import PostgresSource
        return PostgresSource(cdc.source_dsn, slot=cdc.slot, publication=cdc.publication,
                              tables=list(cdc.source_tables) or None, start_after=start_after,
                              snapshot_mode=cdc.snapshot_mode,
                              snapshot_chunk_rows=cdc.snapshot_chunk_rows,
                              unchanged_toast=cdc.unchanged_toast)
    from cdc_client.sources.debezium import DebeziumFileSource
    return DebeziumFileSource(Path(cdc.debezium_dir), start_after=start_after,
                              unavailable_placeholder=cdc.debezium_unavailable_placeholder,
                              primary_key=None if tables is None else primary_keys(tables))


def primary_keys(tables: TableMap) -> Callable[[str], tuple[str, ...] | None]:
    """Source table -> the primary key of the Retina table it maps to, in source column
    names (None: no such table, which translate reports): the Debezium source finds a
    transaction's earlier write of a row by it."""
    def keys(source_table: str) -> tuple[str, ...] | None:
        if tables.routes is not None and tables.routes.routed(source_table):
            return tables.routes.source_key(source_table, tables.lookup)
        record = tables.lookup(tables.schema, source_table.rsplit(".", 1)[-1])
        return None if record is None else tuple(record.primary_key)
    return keys


CATALOG_LOOKUP_RETRY_S = 60.0


def table_map(catalog: Catalog, schema: str, routes: Sequence[CdcRoute] = ()) -> TableMap:
    """The connector's view of the catalog: tables by name, cached; schema evolution;
    and ``[[cdc.routes]]``, checked against the catalog here (RouteError)."""
    @functools.cache
    def lookup(schema_name: str, name: str) -> TableRecord | None:
        # Only "no such table" makes an event malformed. A catalog that is away is
        # waited for, and past the bound it is a crash (exit 1: a restart resumes),
        # never a stop that blames the event (found by the fault campaign).
        try:
            return until_deadline(
                lambda: catalog.get_table(schema_name, name),
                transient=(CatalogUnavailable, CatalogOutcomeUnknown),
                deadline_s=CATALOG_LOOKUP_RETRY_S,
                on_retry=lambda exc: log.warning("cdc_catalog_lookup_retry",
                                                 table=f"{schema_name}.{name}",
                                                 error=str(exc)))
        except NotFound:
            return None

    def add_column(schema_name: str, name: str, column: str, type_name: str) -> TableRecord:
        # Idempotent, so an outcome lost with the connection is simply tried again.
        return until_deadline(
            lambda: catalog.add_column(schema_name, name, column, type_name),
            transient=(CatalogUnavailable, CatalogOutcomeUnknown),
            deadline_s=CATALOG_LOOKUP_RETRY_S,
            on_retry=lambda exc: log.warning("cdc_catalog_add_column_retry",
                                             table=f"{schema_name}.{name}", column=column,
                                             error=str(exc)))
    routed = Routes(schema, routes) if routes else None
    if routed is not None:
        routed.check(lookup)
    return TableMap(schema, lookup, add_column, routed)


def node_stubs(topology: Topology) -> dict[str, retina_pb2_grpc.RetinaWorkerServiceStub]:
    return {n: retina_pb2_grpc.RetinaWorkerServiceStub(channel(n))
            for n in topology.nodes}


class _Background:
    """The lifecycle watch (re-opened when it breaks) and the retention timer."""

    def __init__(self, etcd: EtcdStore, connector: Connector, changelog: Changelog,
                 topology: Topology, retention_interval_s: int, stop: threading.Event) -> None:
        self._etcd = etcd
        self._connector = connector
        self._changelog = changelog
        self._topology = topology
        self._interval = retention_interval_s
        self._stop = stop

    def start(self) -> None:
        threading.Thread(target=self._watch, name="lifecycle-watch", daemon=True).start()
        threading.Thread(target=self._retention, name="retention", daemon=True).start()

    def _watch(self) -> None:
        while not self._stop.is_set():
            broken = threading.Event()

            def on_broken(_reason: str, b: threading.Event = broken) -> None:
                b.set()
            try:
                _kvs, revision = self._etcd.get_prefix(LIFECYCLE_PREFIX)
                watch = self._etcd.watch_prefix(
                    LIFECYCLE_PREFIX, revision + 1,
                    lambda _e: self._connector.nodes_changed(),
                    on_broken)
            except EtcdError as exc:
                log.warning("cdc_watch_failed", error=str(exc))
                self._stop.wait(1)
                continue
            while not self._stop.is_set() and not broken.wait(0.5):
                pass
            watch.cancel()
            self._connector.nodes_changed()  # events may have been missed

    def _retention(self) -> None:
        while not self._stop.wait(self._interval):
            try:
                run_retention(self._changelog, self._etcd, self._topology)
            except (EtcdError, OSError, CorruptChangelog) as exc:
                log.warning("cdc_retention_failed", error=str(exc))


def main(argv: list[str] | None = None) -> int:
    try:
        # Its TLS settings apply to every channel below (client.channel).
        config, _config_arg = load_process_config("retina-cdc", __doc__, argv)
        topology = load_topology(config.topology_file)
        settings = settings_of(config.cdc, config.retina.max_rows_per_request)
        check_source(config.cdc)
        replay_sources.check_writer_id(config.cdc.name)
    except (ConfigError, failpoints.FailpointError, ReplaySourceError) as exc:
        print(f"retina-cdc: {exc}", file=sys.stderr)
        return exit_codes.USAGE
    configure_logging("cdc", config.log_level, connector=config.cdc.name)
    stop = threading.Event()
    try:
        etcd = EtcdStore.from_config(config.etcd)
        positions = PositionStore(etcd, config.cdc.name)
        committed = positions.load()
        catalog = Catalog(config.catalog.dsn, pool_max=2,
                          connect_timeout_s=config.catalog.connect_timeout_s)
        # WRITES_HAVE_A_REPLAY_SOURCE: the nodes take this connector's writes only once
        # its changelog is registered for every recovery driver to replay.
        replay_sources.register(etcd, config.cdc.name, kind="cdc",
                                changelog_root=changelog_root(config), schema=config.cdc.schema)
        tables = table_map(catalog, config.cdc.schema, config.cdc.routes)
        source = open_source(config.cdc, committed.position if committed else None, tables)
    except (ConfigError, ReplaySourceError, RouteError) as exc:
        print(f"retina-cdc: {exc}", file=sys.stderr)
        return exit_codes.USAGE
    except SourceError as exc:  # the source is reachable but not usable as it is (a slot)
        log.error("cdc_stopped_malformed", error=str(exc), error_type=type(exc).__name__)
        print(f"retina-cdc: stopped (exit {exit_codes.REFUSED}, needs an operator): {exc}",
              file=sys.stderr, flush=True)
        return exit_codes.REFUSED
    except Exception as exc:  # etcd, catalog, storage, the source connection (psycopg2)
        log.error("cdc_start_failed", error=str(exc), error_type=type(exc).__name__)
        return exit_codes.UNAVAILABLE
    changelog = Changelog(changelog_root(config))
    trans = trans_pb2_grpc.TransServiceStub(channel(config.trans.listen))
    connector = Connector(source=source, changelog=changelog, positions=positions, trans=trans,
                          nodes=node_stubs(topology), tables=tables,
                          topology=topology, settings=settings,
                          other_logs=lambda: registered_logs(
                              replay_sources.load(etcd).values(), catalog))
    try:
        serve_metrics(config.cdc.metrics_listen)
    except (ConfigError, OSError) as exc:
        log.error("cdc_start_failed", error=f"cdc.metrics_listen: {exc}")
        source.close()
        return exit_codes.USAGE

    def on_signal(_signum: int, _frame: FrameType | None) -> None:
        stop.set()  # only a flag, as in the Retina server's signal handler
        connector.stop()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    _Background(etcd, connector, changelog, topology, config.cdc.retention_interval_s,
                stop).start()
    exit_code = [exit_codes.OK]
    worker = threading.Thread(target=_run, args=(connector, stop, exit_code), name="connector")
    worker.start()
    while worker.is_alive():
        worker.join(0.2)  # a signal delivered to another thread must still be seen
    source.close()
    return exit_code[0]


def _run(connector: Connector, stop: threading.Event, exit_code: list[int]) -> None:
    try:
        connector.run()
    except ReplayGap as exc:  # before ConnectorStopped, which it is
        log.error("cdc_stopped_replay_gap", node=exc.node, error=str(exc))
        exit_code[0] = exit_codes.REPLAY_GAP
    except UnsupportedSchemaChange as exc:
        log.error("cdc_stopped_schema_change", error=str(exc))
        print(f"retina-cdc: stopped (exit {exit_codes.SCHEMA_CHANGE}, needs an operator; "
              f"docs/cdc.md, 'Schema changes'): {exc}", file=sys.stderr, flush=True)
        exit_code[0] = exit_codes.SCHEMA_CHANGE
    except (MalformedChange, SourceError, ConnectorFenced, CorruptChangelog) as exc:
        log.error("cdc_stopped_malformed", error=str(exc), error_type=type(exc).__name__)
        # Also on stderr, plainly: a restart stops at the same event again, so a
        # supervisor must not restart on 3; an operator reads this line.
        print(f"retina-cdc: stopped (exit {exit_codes.REFUSED}, needs an operator): {exc}",
              file=sys.stderr, flush=True)
        exit_code[0] = exit_codes.REFUSED
    except ConnectorStopped as exc:
        if not stop.is_set():
            log.error("cdc_stopped_refused", error=str(exc))
            exit_code[0] = exit_codes.REFUSED
    except Exception as exc:  # a dependency failed in a way not retried, or a bug
        log.exception("cdc_crashed", error=str(exc), error_type=type(exc).__name__)
        exit_code[0] = exit_codes.FAILED
    finally:
        stop.set()


if __name__ == "__main__":
    sys.exit(main())
