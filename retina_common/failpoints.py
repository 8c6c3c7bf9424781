"""The failpoint catalogue: one named point before and after every durable step.

Names follow one scheme, ``<path>.<step>.before|after`` (the point is just
before or just after the step), and each constant is its name in capitals with
dots as underscores (``catalog.swap.commit.before`` is
``CATALOG_SWAP_COMMIT_BEFORE``); tests/test_failpoints.py checks both.

Call sites import the point objects (``from retina_common.failpoints import
TRANS_TS_BLOCK_PERSIST_BEFORE``), so a misspelt name fails at import. Points are
inert unless ``RETINA_FAILPOINTS`` names them::

    RETINA_FAILPOINTS="trans.ts_block.persist.after=exit(137);catalog.swap.commit.before=sleep(2)"

Actions: ``exit(code)`` (``os._exit``: no cleanup, no flush, like a kill),
``raise`` / ``raise(message)`` (raises :class:`FailpointTriggered`),
``sleep(seconds)``, ``block`` (see below), ``off``. A suffix ``@K`` lets the first K-1 hits pass
and acts from the K-th hit on (``exit(137)@2``: crash at the second block);
``*N`` acts on N hits only (``sleep(2)*1``: slow down the first hit alone).
``+once`` acts once across every process that shares ``$RETINA_FAILPOINT_DIR`` (below).
A name not in the catalogue, or a malformed action, is an error at process
start, never silently ignored.

``block`` parks the hitting thread until a test releases it, so a test
synchronises on the window itself instead of on a sleep: the point writes
``$RETINA_FAILPOINT_DIR/<name>.hit`` and waits until ``<name>.release``
appears in that directory (:func:`wait_hit` and :func:`release` do both sides).

``+once`` is for work that is run again in a new process, where the hit counter starts
again: a Spark task retried in a new Python worker, a child process started again with the
same environment. The process about to act first creates ``<name>.once`` in
``$RETINA_FAILPOINT_DIR`` (``O_EXCL``: of processes racing, one wins); a process that finds
it there lets the hit pass. ``exit(137)@3+once``: the first process to reach its third hit
dies there, and its retry runs through.

The same names appear in the crash-window tables of ``docs/``.
"""

from __future__ import annotations

import os
import re
import sys
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

ENV_VAR = "RETINA_FAILPOINTS"
DIR_VAR = "RETINA_FAILPOINT_DIR"


class FailpointError(Exception):
    """RETINA_FAILPOINTS names an unknown point or a malformed action."""


class FailpointTriggered(RuntimeError):
    """Raised by a point configured with ``raise``."""


@dataclass(frozen=True)
class Action:
    kind: str  # "exit" | "raise" | "sleep" | "block" | "off"
    arg: str = ""
    from_hit: int = 1
    times: int = 0  # 0 = every hit from from_hit on
    once: bool = False  # across processes: see _claim


_CATALOGUE: dict[str, Failpoint] = {}
_active: dict[str, Action] = {}
_hits: dict[str, int] = {}
_loaded = False
_lock = threading.Lock()
_block_dir = ""


class Failpoint:
    """A named crash window. ``hit()`` runs the configured action, if any."""

    __slots__ = ("description", "name")

    def __init__(self, name: str, description: str) -> None:
        if name in _CATALOGUE:
            raise FailpointError(f"failpoint {name} declared twice")
        self.name = name
        self.description = description
        _CATALOGUE[name] = self

    def hit(self) -> None:
        if not _loaded:
            load_from_env()
        action = _active.get(self.name)
        if action is None or action.kind == "off":
            return
        with _lock:
            _hits[self.name] = hit = _hits.get(self.name, 0) + 1
        if hit < action.from_hit or (action.times and hit >= action.from_hit + action.times):
            return
        if action.once and not _claim(self.name, hit):
            return
        if action.kind == "sleep":
            time.sleep(float(action.arg))
        elif action.kind == "block":
            _park(self.name, hit)
        elif action.kind == "raise":
            raise FailpointTriggered(action.arg or f"failpoint {self.name}")
        elif action.kind == "exit":
            # A crash, not a shutdown: nothing is flushed, no handler runs.
            sys.stderr.write(f"failpoint {self.name}: exit({action.arg})\n")
            sys.stderr.flush()
            os._exit(int(action.arg))

    def __repr__(self) -> str:
        return f"Failpoint({self.name!r})"


def _park(name: str, hit: int) -> None:
    """Announce the hit, then wait (unbounded: the test decides) for the release."""
    directory = Path(_block_dir)
    (directory / f"{name}.hit").write_text(str(hit))
    release = directory / f"{name}.release"
    while not release.exists():
        time.sleep(0.02)


def _claim(name: str, hit: int) -> bool:
    """``+once``: whether this process is the first to act at ``name``. The marker is
    created exclusively, so of processes racing to the point exactly one acts."""
    try:
        fd = os.open(Path(_block_dir) / f"{name}.once", os.O_WRONLY | os.O_CREAT | os.O_EXCL)
    except FileExistsError:
        return False
    # Closed before the action runs: an exit(code) that follows loses nothing of it.
    with os.fdopen(fd, "w") as marker:
        marker.write(f"{os.getpid()} {hit}")  # who acted, and at which hit (acted_once)
    return True


def acted_once(directory: Path, name: str) -> tuple[int, int] | None:
    """Test side: (pid, hit) of the process that acted at a ``+once`` point, or None."""
    marker = directory / f"{name}.once"
    if not marker.exists():
        return None
    pid, hit = marker.read_text().split()
    return int(pid), int(hit)


def wait_hit(directory: Path, name: str, timeout_s: float = 60) -> None:
    """Test side: wait until a ``block`` point named ``name`` has been reached."""
    deadline = time.monotonic() + timeout_s
    while not (directory / f"{name}.hit").exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"failpoint {name} was not reached within {timeout_s}s")
        time.sleep(0.02)


def release(directory: Path, name: str) -> None:
    """Test side: let every thread parked at ``name`` (and later hits) go on."""
    (directory / f"{name}.release").write_text("")


_ACTION = re.compile(
    r"^(exit|raise|sleep|block|off)(?:\((.*?)\))?(?:@(\d+))?(?:\*(\d+))?(\+once)?$")


def parse_spec(spec: str) -> dict[str, Action]:
    """Parse ``name=action;name=action``; raises FailpointError on any defect."""
    result: dict[str, Action] = {}
    for item in filter(None, (part.strip() for part in spec.split(";"))):
        name, sep, action_text = item.partition("=")
        name = name.strip()
        if not sep:
            raise FailpointError(f"{ENV_VAR}: '{item}' is not name=action")
        if name not in _CATALOGUE:
            raise FailpointError(f"{ENV_VAR}: unknown failpoint '{name}'")
        match = _ACTION.match(action_text.strip())
        if not match:
            raise FailpointError(f"{ENV_VAR}: bad action '{action_text}' for {name}")
        kind, arg = match.group(1), (match.group(2) or "").strip()
        from_hit = int(match.group(3) or 1)
        if from_hit < 1:
            raise FailpointError(f"{ENV_VAR}: @K needs K >= 1 ({name})")
        if kind == "exit" and not arg.lstrip("-").isdigit():
            raise FailpointError(f"{ENV_VAR}: exit needs an integer code ({name})")
        if kind == "sleep":
            try:
                float(arg)
            except ValueError:
                raise FailpointError(f"{ENV_VAR}: sleep needs seconds ({name})") from None
        result[name] = Action(kind, arg, from_hit, int(match.group(4) or 0),
                              bool(match.group(5)))
    return result


def load_from_env(env: Mapping[str, str] | None = None) -> dict[str, Action]:
    """(Re)load the active points; processes call this first thing in main()."""
    global _loaded, _block_dir
    env = os.environ if env is None else env
    actions = parse_spec(env.get(ENV_VAR, ""))
    needs_dir = any(a.kind == "block" or a.once for a in actions.values())
    if needs_dir and (not env.get(DIR_VAR) or not Path(env[DIR_VAR]).is_dir()):
        raise FailpointError(f"{ENV_VAR}: block and +once need {DIR_VAR} to name a directory")
    _block_dir = env.get(DIR_VAR, "")
    with _lock:
        _active.clear()
        _active.update(actions)
        _hits.clear()
        _loaded = True
    return dict(actions)


def catalogue() -> dict[str, str]:
    """Every known failpoint name with its description."""
    return {name: fp.description for name, fp in sorted(_CATALOGUE.items())}


# --- TransServer: durable timestamp / transaction-id block allocation -------
TRANS_TS_BLOCK_PERSIST_BEFORE = Failpoint(
    "trans.ts_block.persist.before",
    "a new timestamp block is chosen but not yet written to etcd")
TRANS_TS_BLOCK_PERSIST_AFTER = Failpoint(
    "trans.ts_block.persist.after",
    "the new timestamp block is durable in etcd, no timestamp of it handed out yet")
TRANS_TXID_BLOCK_PERSIST_BEFORE = Failpoint(
    "trans.txid_block.persist.before",
    "a new transaction-id block is chosen but not yet written to etcd")
TRANS_TXID_BLOCK_PERSIST_AFTER = Failpoint(
    "trans.txid_block.persist.after",
    "the new transaction-id block is durable in etcd, no id of it handed out yet")

# --- TransServer: history (docs/write-paths/history.md) ---
TRANS_HORIZON_PERSIST_BEFORE = Failpoint(
    "trans.horizon.persist.before",
    "a higher safeGcTs is chosen and raised in memory (no AS OF read at or below it is "
    "admitted from now on), not yet written to etcd nor answered")
TRANS_HORIZON_PERSIST_AFTER = Failpoint(
    "trans.horizon.persist.after",
    "the higher GC horizon is durable in etcd, the safeGcTs not yet answered")
TRANS_PIN_CREATE_BEFORE = Failpoint(
    "trans.pin.create.before",
    "a pin is admitted and holds safeGcTs in memory, not yet written to etcd")
TRANS_PIN_CREATE_AFTER = Failpoint(
    "trans.pin.create.after",
    "the pin is durable in etcd, CreatePin not yet answered")
TRANS_PIN_DROP_BEFORE = Failpoint(
    "trans.pin.drop.before",
    "a pin is about to be deleted from etcd; it still holds safeGcTs")
TRANS_PIN_DROP_AFTER = Failpoint(
    "trans.pin.drop.after",
    "the pin is gone from etcd, still held in memory, DropPin not yet answered")
TRANS_CONSUMER_REGISTER_BEFORE = Failpoint(
    "trans.consumer.register.before",
    "a consumer is admitted and its cursor holds safeGcTs in memory, not yet written to etcd")
TRANS_CONSUMER_REGISTER_AFTER = Failpoint(
    "trans.consumer.register.after",
    "the consumer is durable in etcd, RegisterConsumer not yet answered")
TRANS_CONSUMER_COMMIT_BEFORE = Failpoint(
    "trans.consumer.commit.before",
    "a consumer's new cursor is about to be written to etcd; the old one still holds safeGcTs")
TRANS_CONSUMER_COMMIT_AFTER = Failpoint(
    "trans.consumer.commit.after",
    "the new cursor is durable in etcd, the old one still held in memory, CommitConsumer "
    "not yet answered")
TRANS_CONSUMER_DROP_BEFORE = Failpoint(
    "trans.consumer.drop.before",
    "a consumer is about to be deleted from etcd (DropConsumer); it still holds safeGcTs")
TRANS_CONSUMER_DROP_AFTER = Failpoint(
    "trans.consumer.drop.after",
    "the consumer is gone from etcd, still held in memory, DropConsumer not yet answered")
TRANS_CONSUMER_LAG_DROP_BEFORE = Failpoint(
    "trans.consumer.lag_drop.before",
    "a consumer lagging past trans.max_consumer_lag_ms is about to be deleted from etcd; "
    "it still holds safeGcTs")
TRANS_CONSUMER_LAG_DROP_AFTER = Failpoint(
    "trans.consumer.lag_drop.after",
    "the lagging consumer is gone from etcd, still held in memory, not yet logged")
TRANS_TIME_MAP_FLUSH_BEFORE = Failpoint(
    "trans.time_map.flush.before",
    "time-map samples taken since the last flush are in memory only")
TRANS_TIME_MAP_FLUSH_AFTER = Failpoint(
    "trans.time_map.flush.after",
    "the time map's open chunk (its samples and how far it covers) is durable in etcd")

# --- etcd ---
ETCD_TXN_COMMIT_AFTER = Failpoint(
    "etcd.txn.commit.after",
    "an etcd transaction (compare-and-swap) applied, its answer not yet returned; "
    "'raise' makes it an outcome-unknown error")

# --- Catalog (PostgreSQL) ---
CATALOG_BOOTSTRAP_COMMIT_BEFORE = Failpoint(
    "catalog.bootstrap.commit.before",
    "schema DDL executed inside the bootstrap transaction, not committed")
CATALOG_BOOTSTRAP_COMMIT_AFTER = Failpoint(
    "catalog.bootstrap.commit.after", "catalog schema committed, caller not yet told")
CATALOG_ADD_FILE_COMMIT_BEFORE = Failpoint(
    "catalog.add_file.commit.before", "file row inserted, transaction not committed")
CATALOG_ADD_FILE_COMMIT_AFTER = Failpoint(
    "catalog.add_file.commit.after", "file row committed, caller not yet told")
CATALOG_UPDATE_FILE_COMMIT_BEFORE = Failpoint(
    "catalog.update_file.commit.before", "file row updated, transaction not committed")
CATALOG_UPDATE_FILE_COMMIT_AFTER = Failpoint(
    "catalog.update_file.commit.after", "file update committed, caller not yet told")
CATALOG_DELETE_FILES_COMMIT_BEFORE = Failpoint(
    "catalog.delete_files.commit.before", "file rows deleted, transaction not committed")
CATALOG_DELETE_FILES_COMMIT_AFTER = Failpoint(
    "catalog.delete_files.commit.after", "file deletion committed, caller not yet told")
CATALOG_SWAP_COMMIT_BEFORE = Failpoint(
    "catalog.swap.commit.before",
    "atomicSwapFiles: new file REGULAR and old files RETIRED inside the transaction, not committed")
CATALOG_SWAP_COMMIT_AFTER = Failpoint(
    "catalog.swap.commit.after", "atomicSwapFiles committed, caller not yet told")
CATALOG_ADD_COLUMN_COMMIT_BEFORE = Failpoint(
    "catalog.add_column.commit.before",
    "schema evolution: column row inserted and schema version bumped, not committed")
CATALOG_ADD_COLUMN_COMMIT_AFTER = Failpoint(
    "catalog.add_column.commit.after", "added column committed, caller not yet told")

# --- Retina ingest publish (docs/write-paths/ingest-publish.md) -----------------
INGEST_ALLOC_CATALOG_BEFORE = Failpoint(
    "ingest.alloc.catalog.before", "a new ingest file is chosen, not yet in the catalog")
INGEST_ALLOC_CATALOG_AFTER = Failpoint(
    "ingest.alloc.catalog.after", "the ingest file is TEMPORARY_INGEST in the catalog, no row yet")
INGEST_CLOSE_BEFORE = Failpoint(
    "ingest.close.before", "file bytes built in memory, nothing written to storage")
INGEST_CLOSE_AFTER = Failpoint(
    "ingest.close.after", "file written, fsynced and renamed into place, not yet checked")
INGEST_INDEX_FLUSH_BEFORE = Failpoint(
    "ingest.index_flush.before", "file closed and checked, MainIndex ranges only in memory")
INGEST_INDEX_FLUSH_AFTER = Failpoint(
    "ingest.index_flush.after",
    "MainIndex ranges of the file durable, catalog still TEMPORARY_INGEST")
INGEST_CATALOG_REGULAR_BEFORE = Failpoint(
    "ingest.catalog_regular.before", "about to mark the file REGULAR in the catalog")
INGEST_CATALOG_REGULAR_AFTER = Failpoint(
    "ingest.catalog_regular.after", "the file is REGULAR in the catalog, not yet registered")
INGEST_REGISTRY_BEFORE = Failpoint(
    "ingest.registry.before", "about to register the file in the ingest registry")
INGEST_REGISTRY_AFTER = Failpoint(
    "ingest.registry.after", "registered and its visibility adopted, blocks still in the buffer")
INGEST_CLEANUP_BEFORE = Failpoint(
    "ingest.cleanup.before", "about to drop the file's blocks from the write buffer")
INGEST_CLEANUP_AFTER = Failpoint(
    "ingest.cleanup.after", "the file's blocks are gone from the write buffer; publish complete")

# --- Retina UpdateRecord ---------------------------------------------------------
UPDATE_RECORD_FENCE_BEFORE = Failpoint(
    "update_record.fence.before",
    "an ordinary write validated, not yet admitted by the write fence, no stream lock held "
    "('sleep' here makes it reach the fence late)")
UPDATE_RECORD_FENCE_AFTER = Failpoint(
    "update_record.fence.after",
    "an ordinary write admitted by the write fence under its stream locks, nothing applied")
INDEX_PRIMARY_COMMIT_BEFORE = Failpoint(
    "index.primary_commit.before",
    "a request's primary-index writes staged in LMDB, not committed; inserts not visible")
INDEX_PRIMARY_COMMIT_AFTER = Failpoint(
    "index.primary_commit.after",
    "a request's primary-index writes durable; its inserts not yet settled visible")
REFUSED_WRITES_RECORD_BEFORE = Failpoint(
    "refused_writes.record.before",
    "an ordinary write refused by the write fence, its (writer, timestamps) not yet recorded; "
    "nothing applied, not yet answered")
REFUSED_WRITES_RECORD_AFTER = Failpoint(
    "refused_writes.record.after",
    "the refusal recorded durably (recovery replay skips those timestamps); not yet answered "
    "ABORTED")
REFUSED_WRITES_PRUNE_BEFORE = Failpoint(
    "refused_writes.prune.before",
    "refusal records below the replay floor about to be deleted; none deleted")
REFUSED_WRITES_PRUNE_AFTER = Failpoint(
    "refused_writes.prune.after", "refusal records below the replay floor deleted")
INDEX_PRUNE_HORIZON_BEFORE = Failpoint(
    "index.prune_horizon.before",
    "a prune about to record its horizon (pruned_below); nothing of it durable")
INDEX_PRUNE_HORIZON_AFTER = Failpoint(
    "index.prune_horizon.after",
    "a prune's horizon durable (reads below it are refused); no version below it removed")

# --- Retina recovery checkpoint (docs/write-paths/checkpoint.md) -----------------
CHECKPOINT_BODY_WRITE_BEFORE = Failpoint(
    "checkpoint.body_write.before", "checkpoint body encoded in memory, nothing on storage")
CHECKPOINT_BODY_WRITE_AFTER = Failpoint(
    "checkpoint.body_write.after", "body durable on storage, no slot points at it")
CHECKPOINT_POINTER_SWAP_BEFORE = Failpoint(
    "checkpoint.pointer_swap.before", "about to swap current/previous in etcd")
CHECKPOINT_POINTER_SWAP_AFTER = Failpoint(
    "checkpoint.pointer_swap.after", "current is the new body, previous the old current")
CHECKPOINT_CLEANUP_BEFORE = Failpoint(
    "checkpoint.cleanup.before", "slots swapped; bodies no slot references not yet deleted")

# --- Retina recovery (docs/recovery.md) -------------------------------------------
RECOVERY_CLEANSING_BEFORE = Failpoint(
    "recovery.cleansing.before", "checkpoint loaded, nothing cleansed or retired yet")
RECOVERY_CLEANSING_AFTER = Failpoint(
    "recovery.cleansing.after", "cleansing done (files retired, leftovers deleted), "
    "replay starts not yet derived")
RECOVERY_MARK_READY_BARRIER_AFTER = Failpoint(
    "recovery.mark_ready.barrier.after", "MarkReady accepted: replay entry closed, not yet READY")
RECOVERY_MARK_READY_DRAIN_AFTER = Failpoint(
    "recovery.mark_ready.drain.after",
    "replay requests drained, the node not yet READY inside (no hook has run)")
RECOVERY_MARK_READY_ANNOUNCE_BEFORE = Failpoint(
    "recovery.mark_ready.announce.before",
    "READY inside and READY hooks done (READY checkpoint taken); READY not yet in etcd")
RECOVERY_MARK_READY_ANNOUNCE_AFTER = Failpoint(
    "recovery.mark_ready.announce.after", "READY announced and health SERVING")
RECOVERY_REWIND_BEFORE = Failpoint(
    "recovery.rewind.before", "cleansing done, replay starts derived, nothing rewound")
RECOVERY_REWIND_AFTER = Failpoint(
    "recovery.rewind.after", "index versions dropped and kept rows hidden; replay entry closed")

# --- Application writers (retina_common/writer.py; docs/write-paths/application-writes.md)
WRITER_APPEND_AFTER = Failpoint(
    "writer.append.after", "a transaction durable in the writer's changelog, nothing sent")
WRITER_COMMIT_BEFORE = Failpoint(
    "writer.commit.before", "every node applied the transaction, not committed at the "
    "TransServer")
WRITER_ACKNOWLEDGE_BEFORE = Failpoint(
    "writer.acknowledge.before", "committed at the TransServer, the acknowledged mark not "
    "yet moved to it (commit() has not returned)")

# --- CDC connector (docs/write-paths/cdc-changelog.md) ------------------------------
CDC_BATCH_BEGIN_AFTER = Failpoint(
    "cdc.batch.begin.after", "timestamps allocated for a batch, nothing in the changelog")
CDC_CHANGELOG_SEGMENTS_AFTER = Failpoint(
    "cdc.changelog.segments.after", "segments durable, no batch record names them")
CDC_CHANGELOG_RECORD_AFTER = Failpoint(
    "cdc.changelog.record.after", "batch durable in the changelog, nothing sent")
CDC_SEND_NODE_ACK_AFTER = Failpoint(
    "cdc.send.node_ack.after", "a Retina node acknowledged the batch, another has not yet")
CDC_SEND_ALL_ACKS_AFTER = Failpoint(
    "cdc.send.all_acks.after", "every Retina node acknowledged, transactions not committed")
CDC_COMMIT_AFTER = Failpoint(
    "cdc.commit.after", "batch committed at the TransServer, position not stored")
CDC_POSITION_STORE_AFTER = Failpoint(
    "cdc.position.store.after", "committed position stored in etcd, source not acknowledged")
CDC_REPLAY_REQUEST_AFTER = Failpoint(
    "cdc.replay.request.after", "one recovery replay request acknowledged, more to send")
CDC_REPLAY_MARK_READY_BEFORE = Failpoint(
    "cdc.replay.mark_ready.before", "replay of a node complete, MarkReady not sent")
CDC_RETENTION_WATERMARK_BEFORE = Failpoint(
    "cdc.retention.watermark.before",
    "retention chose batches to drop, low-watermark not yet raised, nothing deleted")
CDC_RETENTION_WATERMARK_AFTER = Failpoint(
    "cdc.retention.watermark.after",
    "low-watermark durable above the batches to drop, none of them deleted yet")

# --- Retina bulk load (docs/write-paths/bulk-load.md) -----------------------------
LOAD_PREPARE_CATALOG_BEFORE = Failpoint(
    "load.prepare.catalog.before", "a load's file names chosen, none in the catalog")
LOAD_PREPARE_CATALOG_AFTER = Failpoint(
    "load.prepare.catalog.after", "the load's files are TEMPORARY_INGEST rows, no bytes")
LOAD_JOURNAL_BEFORE = Failpoint(
    "load.journal.before", "the loader's files checked, block and row ids reserved, no "
    "journal record: nothing of the load is durable but its files")
LOAD_JOURNAL_AFTER = Failpoint(
    "load.journal.after", "journal COMMITTED durable; no index entry, files TEMPORARY_INGEST")
LOAD_INDEX_BEFORE = Failpoint(
    "load.index.before", "journal durable, MainIndex ranges and primary versions not written")
LOAD_INDEX_AFTER = Failpoint(
    "load.index.after", "MainIndex ranges and primary versions at the load's timestamp durable, "
    "files still TEMPORARY_INGEST")
LOAD_CATALOG_REGULAR_BEFORE = Failpoint(
    "load.catalog_regular.before", "index durable, the load's files not yet REGULAR")
LOAD_CATALOG_REGULAR_AFTER = Failpoint(
    "load.catalog_regular.after", "the load's files REGULAR, not yet registered")
LOAD_REGISTRY_BEFORE = Failpoint(
    "load.registry.before", "files REGULAR, registry and visibility not yet told")
LOAD_REGISTRY_AFTER = Failpoint(
    "load.registry.after", "load registered and visible at its timestamp, caller not yet told")
LOAD_PROMOTE_BEFORE = Failpoint(
    "load.promote.before", "both checkpoint slots start above the load, its record still there")
LOAD_PROMOTE_AFTER = Failpoint(
    "load.promote.after", "the load's journal record removed")
LOAD_REAPPLY_BEFORE = Failpoint(
    "load.reapply.before", "recovery: a journaled load's rows not yet re-applied")
LOADER_COMMIT_TRANS_BEFORE = Failpoint(
    "loader.commit_trans.before", "the loader: every node committed its part of a chunk, "
    "the chunk's write transaction not yet committed")
LOADER_COMMIT_TRANS_AFTER = Failpoint(
    "loader.commit_trans.after", "the loader: a chunk's write transaction committed, the "
    "next chunk not yet asked for")
LOAD_REAPPLY_AFTER = Failpoint(
    "load.reapply.after", "recovery: a journaled load's rows re-applied (write buffer and "
    "index), not durable in any checkpoint")

# --- Storage GC commit, promotion and rollback (docs/write-paths/storage-gc.md) ---------
CATALOG_REVERT_SWAP_COMMIT_BEFORE = Failpoint(
    "catalog.revert_swap.commit.before",
    "revertSwap: old files REGULAR again and the new file RETIRED inside the transaction, "
    "not committed")
CATALOG_REVERT_SWAP_COMMIT_AFTER = Failpoint(
    "catalog.revert_swap.commit.after", "revertSwap committed, caller not yet told")
GC_JOURNAL_SWITCHING_BEFORE = Failpoint(
    "gc.journal.switching.before",
    "new file written and registered TEMPORARY_GC, row ids reserved, no journal record yet")
GC_JOURNAL_SWITCHING_AFTER = Failpoint(
    "gc.journal.switching.after", "journal INDEX_SWITCHING durable; index, visibility, "
    "catalog untouched")
GC_VISIBILITY_BEFORE = Failpoint(
    "gc.visibility.before", "stream locked, new-file visibility not built")
GC_VISIBILITY_AFTER = Failpoint(
    "gc.visibility.after", "new-file visibility built (base = cutoff, chain items for later "
    "deletes), not installed")
GC_MAIN_INDEX_BEFORE = Failpoint(
    "gc.main_index.before", "MainIndex ranges of the new file not yet written")
GC_MAIN_INDEX_AFTER = Failpoint(
    "gc.main_index.after", "MainIndex ranges of the new file durable (flush marker written)")
GC_PRIMARY_SWITCH_BEFORE = Failpoint(
    "gc.primary_switch.before", "primary entries still point at the old rows")
GC_PRIMARY_SWITCH_AFTER = Failpoint(
    "gc.primary_switch.after", "primary entries durable on the new rows, catalog not swapped")
GC_SWAP_BEFORE = Failpoint(
    "gc.swap.before", "index switched; atomicSwapFiles not called")
GC_SWAP_AFTER = Failpoint(
    "gc.swap.after", "atomicSwapFiles committed (new REGULAR, old RETIRED); journal still "
    "INDEX_SWITCHING")
GC_JOURNAL_SWAPPED_BEFORE = Failpoint(
    "gc.journal.swapped.before", "swap committed, SWAPPED_NOT_CHECKPOINTED not written")
GC_JOURNAL_SWAPPED_AFTER = Failpoint(
    "gc.journal.swapped.after", "journal SWAPPED_NOT_CHECKPOINTED durable; registry still "
    "holds the old files")
GC_REGISTRY_BEFORE = Failpoint(
    "gc.registry.before", "registry and visibility index not yet switched to the new file")
GC_REGISTRY_AFTER = Failpoint(
    "gc.registry.after", "registry holds the new file, old files retired in memory")
GC_JOURNAL_CHECKPOINTED_BEFORE = Failpoint(
    "gc.journal.checkpointed.before", "a durable checkpoint holds the new file; journal still "
    "SWAPPED_NOT_CHECKPOINTED")
GC_JOURNAL_CHECKPOINTED_AFTER = Failpoint(
    "gc.journal.checkpointed.after", "journal CHECKPOINTED durable")
GC_ROLLBACK_PRIMARY_BEFORE = Failpoint(
    "gc.rollback.primary.before", "rollback: primary entries still on the new rows")
GC_ROLLBACK_PRIMARY_AFTER = Failpoint(
    "gc.rollback.primary.after", "rollback: primary entries durable back on the old rows")
GC_ROLLBACK_CATALOG_BEFORE = Failpoint(
    "gc.rollback.catalog.before", "rollback: catalog not yet reverted")
GC_ROLLBACK_CATALOG_AFTER = Failpoint(
    "gc.rollback.catalog.after", "rollback: old files REGULAR, the new file no longer REGULAR")
GC_ROLLBACK_MAIN_INDEX_BEFORE = Failpoint(
    "gc.rollback.main_index.before", "rollback: new file's MainIndex ranges still there")
GC_ROLLBACK_MAIN_INDEX_AFTER = Failpoint(
    "gc.rollback.main_index.after", "rollback: new file's MainIndex ranges deleted")
GC_JOURNAL_ABORTED_BEFORE = Failpoint(
    "gc.journal.aborted.before", "rollback done, journal not yet ABORTED")
GC_JOURNAL_ABORTED_AFTER = Failpoint(
    "gc.journal.aborted.after", "journal ABORTED durable")
GC_REWRITE_WRITE_BEFORE = Failpoint(
    "gc.rewrite.write.before", "Spark task: new file registered TEMPORARY_GC, its bytes not "
    "written")
GC_REWRITE_WRITE_AFTER = Failpoint(
    "gc.rewrite.write.after", "Spark task: new file durable on storage, commit not yet asked")

# --- Sweepers (docs/write-paths/sweepers.md) --------------------------------------------------
SWEEPER_RETIRED_VISIBILITY_BEFORE = Failpoint(
    "sweeper.retired.visibility.before", "retired file due and unheld; its frozen visibility "
    "still in memory")
SWEEPER_RETIRED_VISIBILITY_AFTER = Failpoint(
    "sweeper.retired.visibility.after", "retired file's visibility dropped; MainIndex range "
    "still there")
SWEEPER_RETIRED_MAIN_INDEX_BEFORE = Failpoint(
    "sweeper.retired.main_index.before", "retired file's MainIndex range not yet deleted")
SWEEPER_RETIRED_MAIN_INDEX_AFTER = Failpoint(
    "sweeper.retired.main_index.after", "retired file's MainIndex range deleted (durable); "
    "object still on storage")
SWEEPER_RETIRED_OBJECT_BEFORE = Failpoint(
    "sweeper.retired.object.before", "retired file's object not yet deleted")
SWEEPER_RETIRED_OBJECT_AFTER = Failpoint(
    "sweeper.retired.object.after", "retired file's object deleted; catalog row still RETIRED")
SWEEPER_RETIRED_CATALOG_BEFORE = Failpoint(
    "sweeper.retired.catalog.before", "retired file's catalog row not yet deleted")
SWEEPER_RETIRED_CATALOG_AFTER = Failpoint(
    "sweeper.retired.catalog.after", "retired file's catalog row deleted: the file is gone")
SWEEPER_TEMPORARY_OBJECT_BEFORE = Failpoint(
    "sweeper.temporary.object.before", "temporary file past its TTL, unreferenced; object "
    "not yet deleted")
SWEEPER_TEMPORARY_OBJECT_AFTER = Failpoint(
    "sweeper.temporary.object.after", "temporary file's object deleted; catalog row still there")
SWEEPER_TEMPORARY_CATALOG_BEFORE = Failpoint(
    "sweeper.temporary.catalog.before", "temporary file's catalog row not yet deleted")
SWEEPER_TEMPORARY_CATALOG_AFTER = Failpoint(
    "sweeper.temporary.catalog.after", "temporary file's catalog row deleted")
SWEEPER_ORPHAN_DELETE_BEFORE = Failpoint(
    "sweeper.orphan.delete.before", "an object nothing knows, past its grace; not yet deleted")
SWEEPER_ORPHAN_DELETE_AFTER = Failpoint(
    "sweeper.orphan.delete.after", "orphan object deleted")
SWEEPER_JOURNAL_REMOVE_BEFORE = Failpoint(
    "sweeper.journal.remove.before", "a final GC journal record past its retention, its "
    "files gone; not yet removed")
SWEEPER_JOURNAL_REMOVE_AFTER = Failpoint(
    "sweeper.journal.remove.after", "final GC journal record removed")
CHECKPOINT_BODY_DELETE_BEFORE = Failpoint(
    "checkpoint.body_delete.before", "a body no slot references, older than current; not yet "
    "deleted")
CHECKPOINT_BODY_DELETE_AFTER = Failpoint(
    "checkpoint.body_delete.after", "one unreferenced checkpoint body deleted")

# --- Storage GC revert (docs/write-paths/sweepers.md, "Lineage and revert") -------------------
GC_REVERT_JOURNAL_REVERTING_BEFORE = Failpoint(
    "gc.revert.journal_reverting.before", "revert checked; journal REVERTING not yet written")
GC_REVERT_JOURNAL_REVERTING_AFTER = Failpoint(
    "gc.revert.journal_reverting.after", "journal REVERTING durable; nothing switched back")
GC_REVERT_PRIMARY_BEFORE = Failpoint(
    "gc.revert.primary.before", "revert: primary entries still on the new file's rows")
GC_REVERT_PRIMARY_AFTER = Failpoint(
    "gc.revert.primary.after", "revert: primary entries durable on the old rows; catalog "
    "not reverted")
GC_REVERT_CATALOG_BEFORE = Failpoint(
    "gc.revert.catalog.before", "revert: catalog not yet swapped back")
GC_REVERT_CATALOG_AFTER = Failpoint(
    "gc.revert.catalog.after", "revert: old files REGULAR again, new file RETIRED (one "
    "transaction); journal still REVERTING")
GC_REVERT_JOURNAL_REVERTED_BEFORE = Failpoint(
    "gc.revert.journal_reverted.before", "revert swapped back; journal REVERTED not written")
GC_REVERT_JOURNAL_REVERTED_AFTER = Failpoint(
    "gc.revert.journal_reverted.after", "journal REVERTED durable; registry still holds the "
    "new file")
