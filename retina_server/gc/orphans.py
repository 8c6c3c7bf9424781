"""Orphan reconciliation: objects on storage that nothing knows.

For every catalog path, the objects under it are listed (pyarrow.fs: a local
directory or an S3-compatible prefix alike) and compared with what knows a
file: the catalog (a row of any type, in that path, with that name), this
node's GC journal (new and old file names of every entry) and prepared
rewrites (the name a job is writing). An object is an orphan candidate when
none of them names it and its name says it belongs to this node (a data file
name, or the ``.<name>.tmp`` of a durable write that never reached its
rename). Orphans come from crashes between an object's write and its catalog
row, or between a failed cleanup's steps.

A candidate is removed only if all of these hold:

* KNOWN_READ_AFTER_LISTING: the objects are listed *first*, and the names are
  read after. Every write path names its object (a catalog row, a prepared
  rewrite) before the object exists, so an object in the listing whose row
  exists at the later read is always seen as known.
* The retention guard (retention_guard.py, ``hold_reason(None, ...)``) lets it go:
  its grace has passed (the later of its name's time and its modification
  time, plus the grace, which is never below MIN_ORPHAN_GRACE_MS), and nothing
  holds every file (read holds unknown, a listing in flight, a slot unreadable).
* RECHECKED_BEFORE_DELETE: just before the delete, the catalog (by path and
  name), the journal and the prepared rewrites are asked again; a name that
  appeared since the first read keeps the object.

Checkpoint slots name files by id, and every id is a catalog row: an object
without a row cannot be in a slot or in a reader's listing (the retired-file
sweeper deletes the object before the row). Objects whose names are not ours
are reported held ("foreign_name") and never removed.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass

from retina_common import failpoints as fp
from retina_common import file_names
from retina_common.catalog import Catalog, FileType, PathRecord
from retina_common.log import get_logger
from retina_common.storage import StoredObject, delete_object, list_objects
from retina_server.gc.gc_journal import GcJournal
from retina_server.gc.removal_backoff import REMOVAL_FAILED, RemovalBackoff
from retina_server.gc.retention_guard import Holds, hold_reason
from retina_server.gc.swept import BYTES_REMOVED, REMOVED, Swept, check_orphan_grace, why_held
from retina_server.node import RetinaNode

log = get_logger(component="orphans")

WHY_REMOVED = "no catalog row, journal entry or rewrite names it"


def _owner(name: str) -> tuple[str | None, int | None]:
    """(node id, name time in ms) of a data file name or its temporary sibling."""
    inner = name[1:-4] if name.startswith(".") and name.endswith(".tmp") else name
    with contextlib.suppress(ValueError):
        parsed = file_names.parse(inner)
        return parsed.node_id, file_names.created_at_ms(inner)
    return None, None


def _journal_names(journal: GcJournal) -> set[str]:
    return {n for e in journal.entries() for n in (e.new_file_name, *(o.name for o in e.old_files))}


@dataclass(frozen=True)
class Namers:
    """Whatever can name an object: read once after the listing, asked again per delete."""

    catalog: Catalog
    journal: GcJournal
    pending_names: Callable[[], set[str]]

    def known_now(self) -> Callable[[int, str], bool]:
        """One read of every name, as a test of (path id, name)."""
        by_path: dict[int, set[str]] = {}
        for f in self.catalog.get_files_by_type(None, list(FileType)):
            by_path.setdefault(f.path_id, set()).add(f.name)
        anywhere = _journal_names(self.journal) | self.pending_names()
        return lambda path_id, name: name in anywhere or name in by_path.get(path_id, ())

    def names(self, path_id: int, name: str) -> bool:
        """RECHECKED_BEFORE_DELETE: this one name, asked again."""
        return (name in self.pending_names() or name in _journal_names(self.journal)
                or self.catalog.get_file_by_name(path_id, name) is not None)


@dataclass(frozen=True)
class _Pass:
    node: RetinaNode
    namers: Namers
    holds: Holds
    grace_ms: int
    dry_run: bool
    backoff: RemovalBackoff


def reconcile(node: RetinaNode, namers: Namers, read_holds: Callable[[], Holds],
              grace_ms: int, dry_run: bool, backoff: RemovalBackoff) -> list[Swept]:
    check_orphan_grace(grace_ms)
    # KNOWN_READ_AFTER_LISTING: objects first, then the names, then the holds.
    listed = [(path, list_objects(path.uri)) for path in namers.catalog.list_paths()]
    known = namers.known_now()
    run = _Pass(node, namers, read_holds(), grace_ms, dry_run, backoff)
    candidates = [(path, obj) for path, objects in listed for obj in objects
                  if not known(path.path_id, obj.name)]
    backoff.begin_round((_key(path, obj) for path, obj in candidates), dry_run)
    out: list[Swept] = []
    for path, obj in candidates:
        swept = _candidate(run, path, obj)
        if swept is not None:
            out.append(swept)
    return out


def _key(path: PathRecord, obj: StoredObject) -> str:
    return f"{path.path_id}/{obj.name}"


def _candidate(run: _Pass, path: PathRecord, obj: StoredObject) -> Swept | None:
    """What happens to one object nothing named at the first read (None: not ours)."""
    owner, named_ms = _owner(obj.name)
    if owner is None:
        return Swept("orphans", -1, obj.name, path.uri, "held", "foreign_name", obj.size)
    if owner != run.node.node_id:
        return None  # its own node reconciles it
    written = max(t for t in (named_ms, obj.mtime_ms, 0) if t is not None)
    held = why_held(hold_reason(None, run.holds, due_at_ms=written + run.grace_ms),
                    run.backoff, _key(path, obj))
    if held:
        return Swept("orphans", -1, obj.name, path.uri, "held", held, obj.size)
    if run.dry_run:
        return Swept("orphans", -1, obj.name, path.uri, "would_remove", WHY_REMOVED, obj.size)
    removed = run.backoff.attempt(_key(path, obj), lambda: _remove(run.namers, path, obj),
                                  path=path.uri, name=obj.name)
    return removed or Swept("orphans", -1, obj.name, path.uri, "held", REMOVAL_FAILED,
                            obj.size)


def _remove(namers: Namers, path: PathRecord, obj: StoredObject) -> Swept:
    fp.SWEEPER_ORPHAN_DELETE_BEFORE.hit()
    if namers.names(path.path_id, obj.name):
        log.warning("orphan_named_since_listing", path=path.uri, name=obj.name)
        return Swept("orphans", -1, obj.name, path.uri, "held", "named_since_listing",
                     obj.size)
    delete_object(path.uri, obj.name)
    fp.SWEEPER_ORPHAN_DELETE_AFTER.hit()
    REMOVED.labels("orphans").inc()
    BYTES_REMOVED.labels("orphans").inc(obj.size)
    log.info("orphan_removed", path=path.uri, name=obj.name, bytes=obj.size)
    return Swept("orphans", -1, obj.name, path.uri, "removed", WHY_REMOVED, obj.size)
