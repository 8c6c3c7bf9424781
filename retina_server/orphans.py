"""Orphan reconciliation: objects on storage that nothing knows.

For every catalog path, the objects under it are listed (pyarrow.fs: a local
directory or an S3-compatible prefix alike) and compared with what knows a
file: the catalog (a row of any type, in that path, with that name), this
node's GC journal (new and old file names of every entry) and prepared
rewrites (the name a job is writing). An object is an orphan when none of
them names it, its name says it belongs to this node (a data file name, or
the ``.<name>.tmp`` of a durable write that never reached its rename), and
it is older than the grace period (the later of its name's time and its
modification time). Orphans come from crashes between an object's write and
its catalog row, or between a failed cleanup's steps.

Checkpoint slots name files by id, and every id is a catalog row: an object
without a row cannot be in a slot or in a reader's listing (the retired-file
sweeper deletes the object before the row). Objects whose names are not ours
are reported held ("foreign_name") and never removed.
"""

from __future__ import annotations

import contextlib

from retina_common import failpoints as fp
from retina_common import file_names
from retina_common.catalog import Catalog, FileType
from retina_common.log import get_logger
from retina_common.storage import delete_object, list_objects
from retina_server.gc_journal import GcJournal
from retina_server.node import RetinaNode
from retina_server.sweeper import BYTES_REMOVED, REMOVED, Swept

log = get_logger(component="orphans")


def _owner(name: str) -> tuple[str | None, int | None]:
    """(node id, name time in ms) of a data file name or its temporary sibling."""
    inner = name[1:-4] if name.startswith(".") and name.endswith(".tmp") else name
    with contextlib.suppress(ValueError):
        parsed = file_names.parse(inner)
        return parsed.node_id, file_names.created_at_ms(inner)
    return None, None


def reconcile(node: RetinaNode, catalog: Catalog, journal: GcJournal, pending_names: set[str],
              now_ms: int, grace_ms: int, dry_run: bool) -> list[Swept]:
    known_by_path: dict[int, set[str]] = {}
    for f in catalog.get_files_by_type(None, list(FileType)):
        known_by_path.setdefault(f.path_id, set()).add(f.name)
    journal_names = {n for e in journal.entries()
                     for n in (e.new_file_name, *(o.name for o in e.old_files))}
    out: list[Swept] = []
    for path in catalog.list_paths():
        known = known_by_path.get(path.path_id, set()) | journal_names | pending_names
        for obj in list_objects(path.uri):
            if obj.name in known:
                continue
            owner, named_ms = _owner(obj.name)
            if owner is None:
                out.append(Swept("orphans", -1, obj.name, path.uri, "held", "foreign_name",
                                 obj.size))
                continue
            if owner != node.node_id:
                continue  # its own node reconciles it
            written = max(t for t in (named_ms, obj.mtime_ms, 0) if t is not None)
            if written + grace_ms > now_ms:
                out.append(Swept("orphans", -1, obj.name, path.uri, "held",
                                 "grace_not_passed", obj.size))
                continue
            if dry_run:
                out.append(Swept("orphans", -1, obj.name, path.uri, "would_remove",
                                 "no catalog row, journal entry or rewrite names it", obj.size))
                continue
            fp.SWEEPER_ORPHAN_DELETE_BEFORE.hit()
            delete_object(path.uri, obj.name)
            fp.SWEEPER_ORPHAN_DELETE_AFTER.hit()
            REMOVED.labels("orphans").inc()
            BYTES_REMOVED.labels("orphans").inc(obj.size)
            log.info("orphan_removed", path=path.uri, name=obj.name, bytes=obj.size)
            out.append(Swept("orphans", -1, obj.name, path.uri, "removed",
                             "no catalog row, journal entry or rewrite names it", obj.size))
    return out
