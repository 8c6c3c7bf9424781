"""Process configuration: a TOML file with environment overrides.

Every process reads the same file format; sections it does not use are
ignored. An override is ``RETINA__<SECTION>__<KEY>=value`` (for example
``RETINA__TRANS__LISTEN=127.0.0.1:18888``); lists are comma-separated. Unknown
sections or keys, in the file or the environment, are configuration errors:
a typo must not silently fall back to a default.
"""

from __future__ import annotations

import dataclasses
import os
import tomllib
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ENV_PREFIX = "RETINA__"
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}
CONFIG_ENV = "RETINA_CONFIG"
# ORPHAN_GRACE_ABOVE_ANY_COMMIT: the orphan pass removes an object nothing names only
# this long after it was written, at least. Every write path names its object in the
# catalog before the object exists, so the grace is what still protects an object
# whose name shows up late: a durable write's ``.tmp`` until its rename, a catalog
# commit whose outcome is unknown and is re-read (60 s) or retried (the publisher:
# 300 s). An hour is well above all of them. A smaller grace is refused: as a
# setting (retina.orphan_grace_ms, a configuration error) and per run (RunSweeper,
# INVALID_ARGUMENT).
MIN_ORPHAN_GRACE_MS = 3_600_000


# What a client of the cluster says when nothing names a config: the defaults alone
# point at a topology.toml in the working directory, and "topology file ... does not
# exist" would send a newcomer looking for the wrong file.
NO_CONFIG_GIVEN = (f"no config given: pass --config FILE or set {CONFIG_ENV}=FILE (the local "
                   f"cluster's is .retina-cluster/retina.toml)")


class ConfigError(Exception):
    """The configuration cannot be used; the message names the offending setting."""


@dataclass(frozen=True)
class EtcdConfig:
    endpoints: tuple[str, ...] = ("127.0.0.1:2379",)
    timeout_s: float = 5.0
    # TLS to etcd (docs/operations.md "TLS"): a CA bundle switches the client to
    # https and verifies etcd's certificate; cert/key are this client's own
    # certificate for an etcd started with --client-cert-auth.
    ca_file: str = ""
    cert_file: str = ""
    key_file: str = ""


@dataclass(frozen=True)
class CatalogConfig:
    dsn: str = "host=127.0.0.1 port=5432 dbname=retina user=retina"
    pool_max: int = 8
    connect_timeout_s: int = 5
    # libpq TLS parameters merged into the DSN at load (they win over the same
    # keys written in the DSN); empty: whatever the DSN says (libpq's default
    # sslmode is "prefer", which does not verify the server).
    sslmode: str = ""
    sslrootcert: str = ""
    sslcert: str = ""
    sslkey: str = ""


@dataclass(frozen=True)
class StorageConfig:
    # A local directory or any URI pyarrow.fs understands (s3://..., file://...).
    root: str = "/var/lib/retina/data"


@dataclass(frozen=True)
class TransConfig:
    listen: str = "127.0.0.1:18888"
    metrics_listen: str = "127.0.0.1:9464"
    write_lease_ms: int = 60_000
    read_lease_ms: int = 600_000
    max_lease_ms: int = 3_600_000
    ts_block_size: int = 10_000
    lease_sweep_interval_ms: int = 200
    # Ended transactions remembered with their outcome (for clear refusals).
    ended_cache_size: int = 100_000
    # History (docs/history.md): AS OF reads reach back at least this far; safeGcTs
    # stays below the snapshot of this long ago. The default is Paimon's
    # snapshot.time-retained: an hour keeps "before the bad batch" readable for a
    # person who notices it, at the cost of one deletion-chain item per row deleted in
    # the hour (in the nodes' memory and checkpoints) and of the primary-index versions
    # written in it (on disk). 0: only live reads and pins hold history.
    history_retention_ms: int = 3_600_000
    # The time -> timestamp map behind as_of_time_ms: a (wall ms, HWM) sample this
    # often while the HWM moves (the precision of an AS OF time), written to etcd this
    # often (what a crash can leave unmapped).
    time_map_sample_ms: int = 100
    time_map_flush_ms: int = 1000
    # Change-feed consumers (docs/change-feed.md): a registered consumer's cursor holds
    # safeGcTs until the HWM passed it longer ago than this; then the consumer is
    # dropped (its hold released), so one dead consumer cannot stop all cleanup. An hour,
    # like history_retention_ms: what a restarted consumer or a paged person needs.
    max_consumer_lag_ms: int = 3_600_000


@dataclass(frozen=True)
class GateConfig:
    # With Retina disabled there is nothing to gate (a plain lakehouse).
    retina_enabled: bool = True
    # A lifecycle value whose updatedAtMs is older than this is stale.
    stale_after_ms: int = 15_000
    # Back-off between re-establishing a broken lifecycle watch.
    watch_retry_ms: int = 500


@dataclass(frozen=True)
class RetinaConfig:
    listen: str = "127.0.0.1:18890"
    metrics_listen: str = "127.0.0.1:9465"
    # host:port as listed in the topology file; defaults to `listen`.
    node_id: str = ""
    lifecycle_ttl_s: int = 10
    # Node-local durable state (primary index, MainIndex, sequences).
    state_dir: str = "/var/lib/retina/state"
    # Rows per write-buffer block (one row group) and blocks per ingest file.
    block_rows: int = 4096
    blocks_per_file: int = 4
    # An open file older than this is sealed and published even if not full.
    flush_interval_ms: int = 1000
    close_workers: int = 2
    # Also the most keys one LookupRows request may carry.
    max_rows_per_request: int = 100_000
    # LookupRows keeps decoded row groups of published files in memory up to this size
    # (least recently used go first).
    lookup_cache_mb: int = 256
    # Recovery checkpoints while READY (also on demand: CreateCheckpoint).
    checkpoint_interval_ms: int = 60_000
    # Storage GC on this node: the maintenance round (fold deletion chains, prune
    # primary-index versions) runs this often while READY; files replaced by a GC
    # rewrite are kept this long for readers whose file list predates the swap
    # (their cleanupAt); a prepared rewrite must be committed within the TTL.
    gc_interval_ms: int = 30_000
    gc_retired_retention_ms: int = 600_000
    gc_prepare_ttl_ms: int = 1_800_000
    # Bulk load (docs/write-paths/bulk-load.md): a prepared load must commit within
    # load_prepare_ttl_ms; a committed load's journal record stays at least
    # load_record_min_age_ms (so a loader's retried commit is answered from it) and until
    # both checkpoint slots start above it.
    load_prepare_ttl_ms: int = 1_800_000
    load_record_min_age_ms: int = 600_000
    # The node runs the Spark rewrite job for its own streams this often while READY
    # (0: never; an operator's scheduler runs `make gc` / spark-submit instead), with
    # these extra arguments (e.g. "--master spark://host:7077 --deleted-threshold 0.3").
    gc_job_interval_ms: int = 0
    gc_job_args: str = ""
    # The job runs under `nice -n` this (0-19): on a machine it shares with the node, Spark
    # takes the CPU the write path leaves (docs/performance.md, "Storage GC beside writers").
    gc_job_nice: int = 10
    # Sweepers (docs/write-paths/sweepers.md): a round this often while READY (0:
    # never; RunSweeper / `retina-gc sweep` on demand). TEMPORARY_* files older than
    # the TTL (by their name's time; it must exceed gc_prepare_ttl_ms) are removed
    # unless something still names them; objects nothing knows, after the orphan grace
    # (only when asked: `retina-gc orphans`); final GC journal records (the rewrite
    # lineage) after the lineage retention.
    sweeper_interval_ms: int = 60_000
    temporary_file_ttl_ms: int = 86_400_000
    orphan_grace_ms: int = 86_400_000
    gc_lineage_retention_ms: int = 604_800_000
    # Development only, NOT crash-safe: apply an UpdateRecord that names no registered
    # writer (retina_common/replay_sources.py). Its rows live only in the node's memory
    # until the next checkpoint, and no recovery can replay them.
    anonymous_writes: bool = False


# cdc.unchanged_toast: leave an unchanged TOAST value out (a partial update) or read it.
UNCHANGED_TOAST_MODES = ("keep-current", "read-source")


@dataclass(frozen=True)
class CdcRoute:
    """One ``[[cdc.routes]]`` entry: the changes of source table ``source``
    (``schema.table``) go to Retina table ``target`` (in ``cdc.schema``), each of its
    ``columns`` (source column, target column) renamed; other source columns are
    left out. A route that names only some of the target's columns writes partial
    updates (docs/cdc.md, "Routes: one wide table from several sources")."""

    source: str
    target: str
    columns: tuple[tuple[str, str], ...]


@dataclass(frozen=True)
class CdcConfig:
    # Names the committed-position key in etcd; one running connector per name.
    name: str = "retina-cdc"
    metrics_listen: str = "127.0.0.1:9466"
    source: str = "postgres"  # "postgres" | "debezium-file"
    source_dsn: str = ""
    slot: str = "retina_cdc"
    publication: str = "retina_cdc"
    # Source tables as schema.table; empty: every table of the publication.
    source_tables: tuple[str, ...] = ()
    # postgres: "initial" loads the existing rows first (a new connector, one
    # without a committed position, creates the slot and reads the snapshot it
    # exports); "never" streams changes only. Snapshot chunks of this many rows.
    snapshot_mode: str = "initial"
    snapshot_chunk_rows: int = 5000
    # Snapshot chunks go through the bulk load path (Parquet files written by the
    # connector, published by the nodes: docs/write-paths/bulk-load.md); false: through
    # UpdateRecord like streamed changes.
    snapshot_bulk_load: bool = True
    debezium_dir: str = ""
    # Debezium's unavailable.value.placeholder (an unchanged TOASTed value it did not
    # receive); never stored (docs/cdc.md). Empty: no placeholder is recognised.
    debezium_unavailable_placeholder: str = "__debezium_unavailable_value"
    # The Retina schema the source tables map to (same table names).
    schema: str = "public"
    # Empty: <storage.root>/_changelog
    changelog_root: str = ""
    batch_max_transactions: int = 500
    batch_max_rows: int = 5000
    # A batch closes when no further source transaction is queued (after waiting
    # batch_idle_gap_ms for one; 0: no wait), when full, or batch_max_delay_ms after
    # its first transaction.
    batch_max_delay_ms: int = 50
    batch_idle_gap_ms: int = 0
    write_lease_ms: int = 15_000
    replay_mode: str = "vnode"  # "vnode" | "node"
    # false: an operator replays recovering nodes (spark_jobs/cdc_replay.py);
    # the connector then only waits for them to become READY.
    drive_recovery: bool = True
    # Delete and insert items per UpdateRecord request (a replace is two): twice
    # batch_max_rows, so a full batch of replaces is one request per node.
    request_max_rows: int = 10_000
    node_check_interval_ms: int = 1000
    retention_interval_s: int = 60
    # postgres: an UPDATE that left a TOASTed value alone does not carry it.
    # "keep-current" sends it as a partial update without that column (the node keeps
    # the row's value); "read-source" reads the value from the source at commit, for
    # nodes built before partial updates (docs/cdc.md).
    unchanged_toast: str = "keep-current"
    # [[cdc.routes]]: source tables (or column subsets) mapped onto a target table;
    # a source table with no route goes to the table of its own name.
    routes: tuple[CdcRoute, ...] = ()


@dataclass(frozen=True)
class TlsConfig:
    """TLS for every gRPC server and client of the cluster (off by default)."""

    enabled: bool = False
    # PEM files. cert/key: the certificate a server (TransServer, Retina node)
    # presents; ca_file: the CA bundle every client verifies servers with, and
    # servers verify client certificates with.
    cert_file: str = ""
    key_file: str = ""
    ca_file: str = ""
    # Servers demand a client certificate signed by ca_file (mutual TLS); every
    # client then presents client_cert_file/client_key_file.
    client_cert_required: bool = False
    client_cert_file: str = ""
    client_key_file: str = ""
    # The name clients check the server certificate against instead of the
    # host in the address (a certificate without the addresses as SANs).
    server_name_override: str = ""


@dataclass(frozen=True)
class Config:
    topology_file: str = "topology.toml"
    log_level: str = "info"
    etcd: EtcdConfig = field(default_factory=EtcdConfig)
    catalog: CatalogConfig = field(default_factory=CatalogConfig)
    storage: StorageConfig = field(default_factory=StorageConfig)
    trans: TransConfig = field(default_factory=TransConfig)
    gate: GateConfig = field(default_factory=GateConfig)
    retina: RetinaConfig = field(default_factory=RetinaConfig)
    cdc: CdcConfig = field(default_factory=CdcConfig)
    tls: TlsConfig = field(default_factory=TlsConfig)


def _convert(name: str, kind: Any, raw: Any) -> Any:
    """Coerce a TOML value or an environment string to the field's type."""
    origin = typing.get_origin(kind)
    if origin is tuple and typing.get_args(kind)[0] is CdcRoute:
        return _routes(name, raw)
    if origin is tuple:
        items = raw.split(",") if isinstance(raw, str) else raw
        if not isinstance(items, list | tuple):
            raise ConfigError(f"{name}: expected a list, got {raw!r}")
        return tuple(str(i).strip() for i in items if str(i).strip())
    if kind is bool:
        if isinstance(raw, bool):
            return raw
        if isinstance(raw, str) and raw.lower() in _TRUE | _FALSE:
            return raw.lower() in _TRUE
        raise ConfigError(f"{name}: expected a boolean, got {raw!r}")
    if kind in (int, float):
        if isinstance(raw, bool):
            raise ConfigError(f"{name}: expected a number, got {raw!r}")
        try:
            return kind(raw)
        except (TypeError, ValueError):
            raise ConfigError(f"{name}: expected {kind.__name__}, got {raw!r}") from None
    if kind is str:
        if not isinstance(raw, str | int | float):
            raise ConfigError(f"{name}: expected a string, got {raw!r}")
        return str(raw)
    raise ConfigError(f"{name}: unsupported setting type {kind!r}")


def _routes(name: str, raw: Any) -> tuple[CdcRoute, ...]:
    """``[[cdc.routes]]``: ``source``, ``target`` and ``columns``, either a list of
    column names (the same name on both sides) or a table source column -> target
    column. Checked here for shape; against the catalog when the connector starts."""
    if not isinstance(raw, list):
        raise ConfigError(f"{name}: expected [[{name}]] tables in the config file "
                          f"(routes cannot be set from the environment), got {raw!r}")
    routes, seen = [], set()
    for i, entry in enumerate(raw):
        where = f"{name}[{i}]"
        if not isinstance(entry, Mapping):
            raise ConfigError(f"{where}: expected a table with source, target and columns")
        unknown = sorted(set(entry) - {"source", "target", "columns"})
        if unknown:
            raise ConfigError(f"{where}: unknown setting(s) {unknown}")
        source, target, columns = entry.get("source"), entry.get("target"), \
            entry.get("columns")
        if not isinstance(source, str) or source.count(".") != 1 or "" in source.split("."):
            raise ConfigError(f"{where}.source: expected schema.table, got {source!r}")
        if not isinstance(target, str) or not target or "." in target:
            raise ConfigError(f"{where}.target: expected a table name (of cdc.schema), "
                              f"got {target!r}")
        pairs = _route_columns(f"{where}.columns", columns)
        targets = [t for _s, t in pairs]
        if len(set(targets)) != len(targets):
            raise ConfigError(f"{where}.columns: a target column is named twice: {targets}")
        if (source, target) in seen:
            raise ConfigError(f"{where}: a second route from {source} to {target}; "
                              "name all its columns in one")
        seen.add((source, target))
        routes.append(CdcRoute(source, target, pairs))
    return tuple(routes)


def _route_columns(where: str, raw: Any) -> tuple[tuple[str, str], ...]:
    if isinstance(raw, list) and raw and all(isinstance(c, str) and c for c in raw):
        return tuple((c, c) for c in raw)
    if isinstance(raw, Mapping) and raw and \
            all(isinstance(k, str) and k and isinstance(v, str) and v for k, v in raw.items()):
        return tuple(raw.items())
    raise ConfigError(f"{where}: expected a non-empty list of column names or a table "
                      f"source column = \"target column\", got {raw!r}")


def _apply(obj: Any, values: Mapping[str, Any], where: str) -> Any:
    hints = typing.get_type_hints(type(obj))
    changes: dict[str, Any] = {}
    for key, raw in values.items():
        if key not in hints:
            raise ConfigError(f"unknown setting {where}{key}")
        current = getattr(obj, key)
        if dataclasses.is_dataclass(current):
            if not isinstance(raw, Mapping):
                raise ConfigError(f"{where}{key}: expected a section")
            changes[key] = _apply(current, raw, f"{where}{key}.")
        else:
            changes[key] = _convert(f"{where}{key}", hints[key], raw)
    return dataclasses.replace(obj, **changes)


def _env_overrides(env: Mapping[str, str]) -> dict[str, Any]:
    tree: dict[str, Any] = {}
    for name, value in env.items():
        if not name.startswith(ENV_PREFIX):
            continue
        parts = [p.lower() for p in name[len(ENV_PREFIX):].split("__")]
        if not all(parts):
            raise ConfigError(f"malformed override {name}")
        node = tree
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override {name} conflicts with another override")
        node[parts[-1]] = value
    return tree


def load_config(path: str | os.PathLike[str] | None = None,
                env: Mapping[str, str] | None = None) -> Config:
    """Load ``path`` (or ``$RETINA_CONFIG``), then apply environment overrides.

    The topology file path, when relative, is resolved against the config
    file's directory so that a config and its topology travel together.
    """
    env = os.environ if env is None else env
    path = path or env.get(CONFIG_ENV)
    config = Config()
    base_dir = Path.cwd()
    if path:
        config = _apply(config, read_toml(path, "config file"), "")
        base_dir = Path(path).resolve().parent
    config = _apply(config, _env_overrides(env), "")
    _check(config)
    _check_tls(config)
    config = _with_catalog_ssl(config)
    topo = Path(config.topology_file)
    if not topo.is_absolute():
        config = dataclasses.replace(config, topology_file=str(base_dir / topo))
    return config


def config_named(path: str | os.PathLike[str] | None, env: Mapping[str, str]) -> bool:
    """Whether a config file (``path`` or ``$RETINA_CONFIG``) or a topology override names
    where the cluster is; with neither, only the built-in defaults do."""
    return bool(path or env.get(CONFIG_ENV) or f"{ENV_PREFIX}TOPOLOGY_FILE" in env)


def _check(config: Config) -> None:
    tc = config.trans
    if tc.history_retention_ms < 0:
        raise ConfigError("trans.history_retention_ms must not be negative")
    for name in ("time_map_sample_ms", "time_map_flush_ms", "max_consumer_lag_ms"):
        if getattr(tc, name) <= 0:
            raise ConfigError(f"trans.{name} must be positive")
    rc = config.retina
    if rc.temporary_file_ttl_ms <= rc.gc_prepare_ttl_ms:
        raise ConfigError(
            f"retina.temporary_file_ttl_ms ({rc.temporary_file_ttl_ms}) must exceed "
            f"retina.gc_prepare_ttl_ms ({rc.gc_prepare_ttl_ms}): a GC job may still be "
            "writing a TEMPORARY_GC file until its rewrite lapses")
    for name in ("sweeper_interval_ms", "orphan_grace_ms", "gc_lineage_retention_ms",
                 "gc_retired_retention_ms"):
        if getattr(rc, name) < 0:
            raise ConfigError(f"retina.{name} must not be negative")
    if not 0 <= rc.gc_job_nice <= 19:
        raise ConfigError(f"retina.gc_job_nice must be between 0 and 19, not {rc.gc_job_nice}")
    problem = orphan_grace_problem(rc.orphan_grace_ms)
    if problem:
        raise ConfigError(f"retina.orphan_grace_ms: {problem}")


def orphan_grace_problem(grace_ms: int) -> str:
    """Why an orphan grace may not be used ("" if it may): ORPHAN_GRACE_ABOVE_ANY_COMMIT."""
    if grace_ms >= MIN_ORPHAN_GRACE_MS:
        return ""
    return (f"{grace_ms} ms is below the minimum orphan grace {MIN_ORPHAN_GRACE_MS} ms (one "
            "hour): a shorter grace could take an object whose catalog row is still being "
            "committed for a crash's leftover")


_SSLMODES = ("disable", "allow", "prefer", "require", "verify-ca", "verify-full")


def _check_files(section: str, tls: Any, names: tuple[str, ...]) -> None:
    for name in names:
        path = getattr(tls, name)
        if path and not os.access(path, os.R_OK):
            raise ConfigError(f"{section}.{name}: cannot read {path!r}")


def _check_pair(section: str, tls: Any, cert: str, key: str) -> None:
    if bool(getattr(tls, cert)) != bool(getattr(tls, key)):
        raise ConfigError(f"{section}.{cert} and {section}.{key} go together: set both or neither")


def _check_tls(config: Config) -> None:
    """TLS settings that cannot work are start-up errors, not handshake failures later."""
    tls = config.tls
    _check_pair("tls", tls, "cert_file", "key_file")
    _check_pair("tls", tls, "client_cert_file", "client_key_file")
    if tls.enabled:
        if not tls.ca_file:
            raise ConfigError("tls.enabled = true needs tls.ca_file (the CA bundle clients "
                              "verify servers with)")
        if tls.client_cert_required and not tls.client_cert_file:
            raise ConfigError("tls.client_cert_required = true needs tls.client_cert_file and "
                              "tls.client_key_file (every process is also a client)")
        _check_files("tls", tls, ("cert_file", "key_file", "ca_file", "client_cert_file",
                                  "client_key_file"))
    elif tls.client_cert_required:
        raise ConfigError("tls.client_cert_required = true needs tls.enabled = true")
    else:
        # Certificates without `enabled` would run plaintext while looking secured.
        named = [n for n in ("cert_file", "key_file", "ca_file", "client_cert_file",
                             "client_key_file") if getattr(tls, n)]
        if named:
            raise ConfigError(f"tls.{named[0]} is set but tls.enabled = false: gRPC would run "
                              "in plaintext; set tls.enabled = true or remove the file settings")
    _check_pair("etcd", config.etcd, "cert_file", "key_file")
    if config.etcd.cert_file and not config.etcd.ca_file:
        raise ConfigError("etcd.cert_file needs etcd.ca_file (the client certificate is sent "
                          "over https only)")
    _check_files("etcd", config.etcd, ("ca_file", "cert_file", "key_file"))
    cat = config.catalog
    if cat.sslmode and cat.sslmode not in _SSLMODES:
        raise ConfigError(f"catalog.sslmode: expected one of {', '.join(_SSLMODES)}, "
                          f"got {cat.sslmode!r}")
    if (cat.sslrootcert or cat.sslcert) and not cat.sslmode:
        # libpq's default (prefer) encrypts but verifies nothing: a CA given without a mode
        # would look verified and not be.
        raise ConfigError("catalog.sslrootcert / catalog.sslcert need catalog.sslmode "
                          "(verify-full to check the server's certificate and name)")
    _check_pair("catalog", cat, "sslcert", "sslkey")
    _check_files("catalog", cat, ("sslrootcert", "sslcert", "sslkey"))


def _with_catalog_ssl(config: Config) -> Config:
    """``catalog.dsn`` with the explicit libpq TLS keys merged in (they win)."""
    cat = config.catalog
    extra = {k: getattr(cat, k) for k in ("sslmode", "sslrootcert", "sslcert", "sslkey")
             if getattr(cat, k)}
    if not extra:
        return config
    from psycopg2.extensions import make_dsn  # only processes that set them need libpq

    try:
        dsn = make_dsn(cat.dsn, **extra)
    except Exception as exc:  # make_dsn parses the DSN: a malformed one is a config error
        raise ConfigError(f"catalog.dsn: {exc}") from None
    return dataclasses.replace(config, catalog=dataclasses.replace(cat, dsn=dsn))


def read_toml(path: str | os.PathLike[str], what: str,
              error: type[ConfigError] = ConfigError) -> dict[str, Any]:
    """Parse a TOML file; a missing or invalid file raises ``error`` naming it."""
    p = Path(path)
    try:
        return tomllib.loads(p.read_text())
    except FileNotFoundError:
        raise error(f"{what} {p} does not exist") from None
    except tomllib.TOMLDecodeError as exc:
        raise error(f"{what} {p} is not valid TOML: {exc}") from None


def split_host_port(address: str) -> tuple[str, int]:
    """``host:port`` → (host, port); raises ConfigError on anything else."""
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"expected host:port, got {address!r}")
    return host.strip("[]"), int(port)
