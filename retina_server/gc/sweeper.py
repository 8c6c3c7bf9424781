"""The sweepers (specification C08.1, C08.2): nothing deleted too early, nothing kept forever.

One round, every ``retina.sweeper_interval_ms`` while READY (or on demand:
RunSweeper, ``retina-gc sweep``), runs these passes over this node's files
(the node id in a file's name says whose it is):

* **temporary** (C08.1): ``listTemporaryFilesDue(ttl)``: TEMPORARY_INGEST and
  TEMPORARY_GC files whose name time + TTL has passed. A TEMPORARY_INGEST file
  still in a write buffer stays; a TEMPORARY_GC file stays while a GC journal
  entry or a prepared rewrite names it. Removal: MainIndex ranges (an ingest
  file's) and object → catalog row.
* **retired** (C08.2): ``listRetiredFilesDue()``, each file in this order:
  frozen visibility → MainIndex range → object → catalog row
  (``deleteFiles``). Every step is idempotent and sits between two failpoints;
  a crash anywhere leaves a RETIRED row the next round finishes.
* **checkpoints**: bodies neither slot references and older than ``current``,
  on every storage backend (CheckpointStore.cleanup).
* **journal**: final GC journal records (CHECKPOINTED, ABORTED, REVERTED)
  older than the lineage retention whose files are all settled.
* **orphans** (only when asked; orphans.py): objects no catalog row, journal
  entry or prepared rewrite names, listed before the names are read, after a
  grace of at least an hour, if the guard lets them go and nothing names them
  when asked again just before the delete; ``dry_run`` reports them.

ONE_FAILURE_NEVER_STALLS_A_SWEEP (removal_backoff.py): a temporary, retired or
orphan removal that raises is skipped (WARN ``sweeper_removal_failed``,
``retina_sweeper_removal_failures_total``), the pass goes on with the rest, and
the file sits out 1, 2, 4, ... (at most 64) rounds of its pass before it is
tried again; every step being idempotent, the retry finishes what the failed
attempt began.

Every file removal asks the retention guard (retention_guard.py) first. Holds are
read *after* the candidates (a hold taken after the candidate listing is
still seen), and a revert (lineage.py) and a retired-file removal never
interleave (one lock): a file a revert made REGULAR again is re-read and kept.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import Counter as Tally
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from functools import partial

from prometheus_client import Counter, Gauge

from retina_common import failpoints as fp
from retina_common import file_names
from retina_common.catalog import Catalog, FileRecord, FileType, NotFound
from retina_common.checkpoint_store import CheckpointStore
from retina_common.log import get_logger
from retina_common.storage import delete_object, object_size
from retina_server.gc.gc_journal import FINAL_STATES, GcJournal, JournalState
from retina_server.gc.orphans import Namers, reconcile
from retina_server.gc.removal_backoff import REMOVAL_FAILED, RemovalBackoff
from retina_server.gc.retention_guard import HoldReason, Holds, hold_reason
from retina_server.gc.swept import (  # noqa: F401  (check_orphan_grace: worker_service.py)
    BYTES_REMOVED,
    REMOVED,
    Swept,
    check_orphan_grace,
    why_held,
)
from retina_server.node import RetinaNode

log = get_logger(component="sweeper")

HELD = Gauge("retina_sweeper_held_files", "Files due but held back in the last round, by reason",
             ["reason"])
ROUNDS = Counter("retina_sweeper_rounds_total", "Sweeper rounds by outcome", ["outcome"])
LAST_ROUND = Gauge("retina_sweeper_last_round_timestamp_seconds",
                   "When the last sweeper round finished")
RETIRED_DUE = Gauge("retina_sweeper_retired_files", "RETIRED files of this node in the catalog")

PASSES = ("temporary", "retired", "checkpoints", "journal", "orphans")
ROUND_PASSES = ("temporary", "retired", "checkpoints", "journal")


@dataclass(frozen=True)
class SweeperSettings:
    interval_s: float = 60.0
    # Long-hanging temporary files: a TEMPORARY_* file older than this (by its name's
    # UTC time) is removed unless something still names it. Must exceed the GC prepare
    # TTL (a job may still be writing its new file) and any ingest file's open time.
    temporary_ttl_ms: int = 86_400_000
    # Objects nothing knows are removed only this long after they were written.
    orphan_grace_ms: int = 86_400_000
    # Final GC journal records (the lineage) are kept this long.
    lineage_retention_ms: int = 604_800_000


@dataclass(frozen=True)
class ReaderHolds:
    file_ids: frozenset[int]
    listings_in_flight: int


class Sweeper:
    def __init__(self, node: RetinaNode, catalog: Catalog, journal: GcJournal,
                 checkpoints: CheckpointStore, read_holds: Callable[[], ReaderHolds],
                 pending_gc_names: Callable[[], set[str]], revert_lock: threading.Lock,
                 settings: SweeperSettings, stop: threading.Event,
                 is_ready: Callable[[], bool],
                 clock_ms: Callable[[], int] = lambda: int(time.time() * 1000)) -> None:
        self._node = node
        self._catalog = catalog
        self._journal = journal
        self._checkpoints = checkpoints
        self._read_holds = read_holds
        self._pending_gc_names = pending_gc_names
        self._revert_lock = revert_lock
        self.settings = settings
        self._stop = stop
        self._is_ready = is_ready
        self._clock_ms = clock_ms
        self._round_lock = threading.Lock()
        self._thread: threading.Thread | None = None
        # Files of prepared and journaled bulk loads (bulk_load.py), set by the wiring:
        # held like a journal anchor (LOAD_FILES_OUTLIVE_THEIR_ENTRY).
        self.load_files: Callable[[], set[int]] = set
        # ONE_FAILURE_NEVER_STALLS_A_SWEEP (removal_backoff.py), one per removing pass.
        self.backoff = {name: RemovalBackoff(name) for name in ("temporary", "retired",
                                                                "orphans")}

    # --- the background round ----------------------------------------------------------------
    def start(self) -> None:
        if self.settings.interval_s <= 0 or self._thread is not None:
            return
        self._thread = threading.Thread(target=self._loop, name="sweeper", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.wait(self.settings.interval_s):
            if not self._is_ready() or self._node.failure is not None:
                continue
            try:
                self.run(ROUND_PASSES)
                ROUNDS.labels(outcome="ok").inc()
            except Exception as exc:  # the next round retries; every step is idempotent
                ROUNDS.labels(outcome="error").inc()
                log.warning("sweeper_round_failed", error=str(exc),
                            error_type=type(exc).__name__)

    def run(self, passes: Iterable[str] = ROUND_PASSES, dry_run: bool = False,
            orphan_grace_ms: int | None = None) -> list[Swept]:
        wanted = list(passes) or list(ROUND_PASSES)
        unknown = sorted(set(wanted) - set(PASSES))
        if unknown:
            raise ValueError(f"unknown sweeper passes {unknown}; known: {list(PASSES)}")
        out: list[Swept] = []
        with self._round_lock:
            if "temporary" in wanted:
                out += self.sweep_temporary(dry_run)
            if "retired" in wanted:
                out += self.sweep_retired(dry_run)
            if "checkpoints" in wanted:
                out += [Swept("checkpoints", -1, name, "", "would_remove" if dry_run
                              else "removed", "unreferenced")
                        for name in self._checkpoints.cleanup(dry_run)]
                if not dry_run:
                    REMOVED.labels("checkpoints").inc(sum(s.pass_name == "checkpoints"
                                                          for s in out))
            if "journal" in wanted:
                out += self.sweep_journal(dry_run)
            if "orphans" in wanted:
                out += reconcile(self._node, Namers(self._catalog, self._journal,
                                                    self._pending_gc_names), self.holds,
                                 self.settings.orphan_grace_ms if orphan_grace_ms is None
                                 else orphan_grace_ms, dry_run, self.backoff["orphans"])
        held = Tally(s.reason for s in out if s.action == "held")
        for reason in HoldReason:
            HELD.labels(reason=reason.value).set(held.get(reason.value, 0))
        LAST_ROUND.set(time.time())
        removed = [s for s in out if s.action == "removed"]
        if removed or held:
            log.info("sweeper_round", node=self._node.node_id, dry_run=dry_run,
                     removed=len(removed), bytes=sum(s.bytes for s in removed),
                     held=dict(held))
        return out

    # --- holds ---------------------------------------------------------------------------------
    def holds(self) -> Holds:
        """Read after the candidates (see the module docstring)."""
        try:
            readers = self._read_holds()
            reader_files: frozenset[int] | None = readers.file_ids
            in_flight = readers.listings_in_flight
        except Exception as exc:  # the TransServer is away: hold everything
            log.warning("sweeper_read_holds_unavailable", error=str(exc))
            reader_files, in_flight = None, 0
        return Holds(self._clock_ms(), reader_files, in_flight,
                     self._checkpoints.slot_file_ids(), frozenset(self._journal.protected_files()),
                     frozenset(self.load_files()))

    def _mine(self, files: Iterable[FileRecord]) -> list[FileRecord]:
        out = []
        for f in files:
            try:
                owner = file_names.parse(f.name).node_id
            except ValueError:
                continue  # listTemporaryFilesDue already warned; never deleted by guesswork
            if owner == self._node.node_id:
                out.append(f)
        return out

    def _paths(self) -> dict[int, str]:
        return {p.path_id: p.uri for p in self._catalog.list_paths()}

    # --- temporary files (C08.1) -----------------------------------------------------------------
    def sweep_temporary(self, dry_run: bool) -> list[Swept]:
        ttl = self.settings.temporary_ttl_ms
        due = self._mine(self._catalog.list_temporary_files_due(ttl, self._clock_ms()))
        backoff = self.backoff["temporary"]
        backoff.begin_round((str(f.file_id) for f in due), dry_run)
        if not due:
            return []
        holds = self.holds()
        pending = self._pending_gc_names()
        with_ranges = self._node.index.main.files_with_ranges()
        paths = self._paths()
        out = []
        for f in due:
            why = ""
            if f.type == FileType.TEMPORARY_INGEST and self._node.in_baseline(f.file_id):
                why = "in_write_buffer"
            elif f.type == FileType.TEMPORARY_GC and f.name in pending:
                why = HoldReason.JOURNAL_ANCHOR.value  # a job may still be writing it
            elif f.type == FileType.TEMPORARY_GC and f.file_id in with_ranges:
                # Only a rewrite that reached its MainIndex step has ranges; recovery's
                # GC_ROWS_HAVE_A_JOURNAL check decides those, never the sweeper.
                why = "has_main_index_ranges"
            if why:
                out.append(Swept("temporary", f.file_id, f.name, paths.get(f.path_id, ""),
                                 "held", why))
                continue
            reason = hold_reason(f, holds, due_at_ms=file_names.created_at_ms(f.name) + ttl)
            out.append(self._remove_temporary(f, paths[f.path_id], reason, dry_run))
        return out

    def _remove_temporary(self, f: FileRecord, path_uri: str, reason: HoldReason | None,
                          dry_run: bool) -> Swept:
        backoff = self.backoff["temporary"]
        held = why_held(reason, backoff, str(f.file_id))
        if held:
            return Swept("temporary", f.file_id, f.name, path_uri, "held", held)
        size = _size(path_uri, f.name)
        if dry_run:
            return Swept("temporary", f.file_id, f.name, path_uri, "would_remove",
                         f"{f.type.name} past its TTL", size)
        removed = backoff.attempt(str(f.file_id), lambda: self._delete_temporary(f, path_uri, size),
                                  file_id=f.file_id, name=f.name, type=f.type.name)
        return removed or Swept("temporary", f.file_id, f.name, path_uri, "held",
                                REMOVAL_FAILED, size)

    def _delete_temporary(self, f: FileRecord, path_uri: str, size: int) -> Swept:
        """Data (MainIndex ranges, object), then catalog row; each step idempotent."""
        fp.SWEEPER_TEMPORARY_OBJECT_BEFORE.hit()
        if f.type == FileType.TEMPORARY_INGEST:
            # LEFTOVER_RANGES_GO_WITH_THE_FILE: ranges flushed before a crash kept the
            # file from its REGULAR step go before the row (a failure in between leaves
            # the row, and the next round deletes again). A TEMPORARY_GC file with
            # ranges never gets here (held: recovery decides it).
            self._node.index.main.delete_main_index_range(f.file_id)
        delete_object(path_uri, f.name)
        fp.SWEEPER_TEMPORARY_OBJECT_AFTER.hit()
        fp.SWEEPER_TEMPORARY_CATALOG_BEFORE.hit()
        _delete_row(self._catalog, f.file_id)
        fp.SWEEPER_TEMPORARY_CATALOG_AFTER.hit()
        REMOVED.labels("temporary").inc()
        BYTES_REMOVED.labels("temporary").inc(size)
        log.info("sweeper_temporary_removed", file_id=f.file_id, name=f.name,
                 type=f.type.name, bytes=size)
        return Swept("temporary", f.file_id, f.name, path_uri, "removed",
                     f"{f.type.name} past its TTL", size)

    # --- retired files (C08.2) -------------------------------------------------------------------
    def sweep_retired(self, dry_run: bool) -> list[Swept]:
        retired = self._mine(self._catalog.get_files_by_type(None, [FileType.RETIRED]))
        RETIRED_DUE.set(len(retired))
        now = self._clock_ms()
        due = [f for f in retired if f.cleanup_at is not None and f.cleanup_at <= now]
        backoff = self.backoff["retired"]
        backoff.begin_round((str(f.file_id) for f in due), dry_run)
        if not due:
            return []
        holds = self.holds()
        paths = self._paths()
        out = []
        for f in due:
            reason = hold_reason(f, holds)
            held = why_held(reason, backoff, str(f.file_id))
            if held:
                out.append(Swept("retired", f.file_id, f.name, paths.get(f.path_id, ""),
                                 "held", held))
                continue
            size = _size(paths[f.path_id], f.name)
            if dry_run:
                out.append(Swept("retired", f.file_id, f.name, paths[f.path_id],
                                 "would_remove", "cleanupAt passed, unheld", size))
                continue
            path_uri = paths[f.path_id]
            removed = backoff.attempt(
                str(f.file_id),
                partial(self._remove_unless_reverted, f, path_uri, size),
                file_id=f.file_id, name=f.name)
            out.append(removed or Swept("retired", f.file_id, f.name, path_uri, "held",
                                        REMOVAL_FAILED, size))
        return out

    def _remove_unless_reverted(self, f: FileRecord, path_uri: str, size: int) -> Swept:
        """One due, unheld RETIRED file, unless a revert made it REGULAR again."""
        with self._revert_lock:
            current = self._catalog.get_file(f.file_id)
            if current is not None and current.type != FileType.RETIRED:
                return Swept("retired", f.file_id, f.name, path_uri, "held",
                             f"now {current.type.name}")
            self.remove_retired(f, path_uri)
        REMOVED.labels("retired").inc()
        BYTES_REMOVED.labels("retired").inc(size)
        return Swept("retired", f.file_id, f.name, path_uri, "removed",
                     "cleanupAt passed, unheld", size)

    def remove_retired(self, f: FileRecord, path_uri: str) -> None:
        """The four steps of C08.2, in order, each idempotent."""
        node = self._node
        # ROW_READS_SEE_NO_MOVE: the file's rows become unreachable step by step.
        with node.row_moves.moving(files_gone=[f.file_id]):
            fp.SWEEPER_RETIRED_VISIBILITY_BEFORE.hit()
            node.visibility.forget_retired(f.file_id)
            if f.file_id not in node.registry:  # never a served file's live visibility
                node.visibility.remove_file(f.file_id)
            fp.SWEEPER_RETIRED_VISIBILITY_AFTER.hit()
            fp.SWEEPER_RETIRED_MAIN_INDEX_BEFORE.hit()
            node.index.main.delete_main_index_range(f.file_id)
            fp.SWEEPER_RETIRED_MAIN_INDEX_AFTER.hit()
            fp.SWEEPER_RETIRED_OBJECT_BEFORE.hit()
            delete_object(path_uri, f.name)
            fp.SWEEPER_RETIRED_OBJECT_AFTER.hit()
        fp.SWEEPER_RETIRED_CATALOG_BEFORE.hit()
        _delete_row(self._catalog, f.file_id)
        fp.SWEEPER_RETIRED_CATALOG_AFTER.hit()
        log.info("sweeper_retired_removed", file_id=f.file_id, name=f.name,
                 cleanup_at=f.cleanup_at)

    # --- final journal records -------------------------------------------------------------------
    def sweep_journal(self, dry_run: bool) -> list[Swept]:
        """A final record goes once it is older than the lineage retention and nothing
        it names is left to settle: no file of it RETIRED or TEMPORARY_GC, and (for a
        REVERTED one) no checkpoint slot holding its new file, which recovery would
        otherwise have to map back to the old files."""
        now = self._clock_ms()
        old = [e for e in self._journal.entries()
               if (e.state in FINAL_STATES or e.state == JournalState.CHECKPOINTED)
               and e.updated_at_ms + self.settings.lineage_retention_ms <= now]
        if not old:
            return []
        unsettled = {f.file_id for f in self._catalog.get_files_by_type(
            None, [FileType.RETIRED, FileType.TEMPORARY_GC])}
        slots = self._checkpoints.slot_file_ids()
        out = []
        for e in old:
            files = {e.new_file_id, *e.old_file_ids}
            if files & unsettled:
                reason = "files_unsettled"
            elif e.state == JournalState.REVERTED and (slots is None or e.new_file_id in slots):
                reason = HoldReason.CHECKPOINT_SLOT.value
            else:
                reason = ""
            if reason:
                out.append(Swept("journal", e.new_file_id, e.rewrite_id, "", "held", reason))
                continue
            if not dry_run:
                fp.SWEEPER_JOURNAL_REMOVE_BEFORE.hit()
                self._journal.remove(e.rewrite_id)
                fp.SWEEPER_JOURNAL_REMOVE_AFTER.hit()
                REMOVED.labels("journal").inc()
            out.append(Swept("journal", e.new_file_id, e.rewrite_id, "",
                             "would_remove" if dry_run else "removed",
                             f"{e.state.value} past the lineage retention"))
        return out


def _size(path_uri: str, name: str) -> int:
    with contextlib.suppress(OSError, ValueError):
        return object_size(path_uri, name)
    return 0


def _delete_row(catalog: Catalog, file_id: int) -> None:
    """deleteFiles for one file; a row already gone is a repeated step, not an error."""
    with contextlib.suppress(NotFound):
        catalog.delete_files([file_id])
