"""Sweepers, lineage and revert inside the campaign (issue 11): the RPCs, the planted
leftovers the sweepers must remove (orphan objects, temporary files of a dead job) and the
storage audit after every episode.

Planted leftovers imitate a crash, never a live file: an orphan is an object in this
node's file-name format (or its ``.<name>.tmp`` sibling) under a table path, named and
modified two days ago, that no catalog row, journal entry or rewrite names; a temporary
leftover is a TEMPORARY_GC or TEMPORARY_INGEST catalog row with an object, named two hours
ago (past any TTL), that nothing else names (what a GC task or an ingest that died between
registering and publishing leaves). A foreign name and a fresh orphan are planted too:
both must be held.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import random
import time
from collections import Counter
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from urllib.parse import urlparse

import grpc

from retina_common import file_names
from retina_common.catalog import Catalog, CatalogError, FileType
from retina_common.client import channel
from retina_common.pb import retina_pb2 as rpb
from retina_common.pb import retina_pb2_grpc
from retina_common.storage import write_durably

RPC_TIMEOUT_S = 60.0
# Orphans are removed only this long after they were written (the later of the name's
# time and the mtime): planted ones are two days old, anything a live node writes now is
# younger, so a real pass with this grace can only remove leftovers.
ORPHAN_GRACE_MS = 3_600_000
ORPHAN_AGE = timedelta(days=2)
TEMPORARY_AGE = timedelta(hours=2)
# A RETIRED file still there this long after its cleanupAt, at this many post-episode
# checks in a row, is the anomaly ``retired_not_swept`` (sweeper rounds every 2 s, two
# checkpoints 3 s; a reader's lease or a node's restarts can hold a file for a while).
RETIRED_OVERDUE_S = 90.0
RETIRED_OVERDUE_CHECKS = 5
_SEQ = itertools.count(int(time.time()) % 100_000 * 1_000 + 7_000_000_000)


def stub_call(node: str, method: str, request: object, timeout: float = RPC_TIMEOUT_S
              ) -> object:
    with channel(node) as ch:
        stub = retina_pb2_grpc.RetinaWorkerServiceStub(ch)
        return getattr(stub, method)(request, timeout=timeout)


def run_sweeper(node: str, passes: list[str], dry_run: bool = False,
                grace_ms: int = 0) -> rpb.RunSweeperResponse:
    reply = stub_call(node, "RunSweeper", rpb.RunSweeperRequest(
        passes=passes, dry_run=dry_run, orphan_grace_ms=grace_ms))
    assert isinstance(reply, rpb.RunSweeperResponse)
    return reply


# Guard reasons that hold every file for a moment (the prober's listing in flight, the
# TransServer not answering): an orphan pass that met one is run again.
TRANSIENT_HOLDS = frozenset({"listing_in_flight", "read_holds_unknown"})


def run_orphan_pass(node: str, names: set[str], dry_run: bool = False, tries: int = 10
                    ) -> rpb.RunSweeperResponse:
    """An orphan pass, run again (up to ``tries`` times) while one of ``names`` is held
    for a reason that holds every file: the retention guard, not the pass, kept it."""
    for _ in range(tries - 1):
        reply = run_sweeper(node, ["orphans"], dry_run=dry_run, grace_ms=ORPHAN_GRACE_MS)
        if not any(o.name in names and o.reason in TRANSIENT_HOLDS for o in reply.objects):
            return reply
        time.sleep(0.2)
    return run_sweeper(node, ["orphans"], dry_run=dry_run, grace_ms=ORPHAN_GRACE_MS)


def lineage(node: str) -> list[rpb.GcLineageRecord]:
    reply = stub_call(node, "ListGcLineage", rpb.ListGcLineageRequest(), timeout=15)
    assert isinstance(reply, rpb.ListGcLineageResponse)
    return list(reply.records)


def revert(node: str, rewrite_id: str) -> rpb.RevertGcRewriteResponse:
    reply = stub_call(node, "RevertGcRewrite", rpb.RevertGcRewriteRequest(rewrite_id=rewrite_id))
    assert isinstance(reply, rpb.RevertGcRewriteResponse)
    return reply


def local_dir(uri: str) -> Path:
    return Path(urlparse(uri).path) if uri.startswith("file:") else Path(uri)


def _aged(path: Path, age: timedelta) -> None:
    then = (datetime.now(UTC) - age).timestamp()
    os.utime(path, (then, then))


@dataclass
class Planted:
    """Objects the campaign put under table paths for an orphan pass."""

    node: str
    orphans: list[tuple[str, str]] = field(default_factory=list)  # (path uri, name): must go
    held: list[tuple[str, str, str]] = field(default_factory=list)  # (uri, name, reason)

    def remove_held(self) -> None:
        """The held ones (a foreign name, a fresh orphan) are the campaign's to clean."""
        for uri, name, _why in self.held:
            with contextlib.suppress(OSError):
                (local_dir(uri) / name).unlink()


def plant_orphans(catalog: Catalog, node: str, rng: random.Random, count: int = 0,
                  with_held: bool = True) -> Planted:
    """``count`` orphans (1 to 3 when 0), one per table path; ``with_held``: also a fresh
    orphan and a foreign name, which must be held."""
    paths = [p for p in catalog.list_paths() if local_dir(p.uri).is_dir()]
    planted = Planted(node)
    if not paths:
        return planted
    old = datetime.now(UTC) - ORPHAN_AGE
    for path in rng.sample(paths, min(len(paths), count or rng.randint(1, 3))):
        directory = local_dir(path.uri)
        name = file_names.make(node, old, next(_SEQ), rng.randrange(4))
        if rng.random() < 0.3:  # a durable write that never reached its rename
            name = f".{name}.tmp"
        write_durably(path.uri, name, b"chaos: an orphan of a crash")
        _aged(directory / name, ORPHAN_AGE)
        planted.orphans.append((path.uri, name))
    if not with_held:
        return planted
    path = rng.choice(paths)
    fresh = file_names.make(node, datetime.now(UTC), next(_SEQ), rng.randrange(4))
    write_durably(path.uri, fresh, b"chaos: a fresh orphan")
    planted.held.append((path.uri, fresh, "grace_not_passed"))
    foreign = f"chaos-foreign-{next(_SEQ)}.txt"
    write_durably(path.uri, foreign, b"chaos: not a Retina name")
    _aged(local_dir(path.uri) / foreign, ORPHAN_AGE)
    planted.held.append((path.uri, foreign, "foreign_name"))
    return planted


def plant_temporary(catalog: Catalog, node: str, rng: random.Random, count: int = 3
                    ) -> list[int]:
    """TEMPORARY_GC / TEMPORARY_INGEST rows with objects, named two hours ago (a dead GC
    task's new file, an ingest file of a crash): the temporary sweeper must remove them."""
    paths = catalog.list_paths()
    out = []
    old = datetime.now(UTC) - TEMPORARY_AGE
    for _ in range(count):
        path = rng.choice(paths)
        kind = rng.choice([FileType.TEMPORARY_GC, FileType.TEMPORARY_INGEST])
        name = file_names.make(node, old, next(_SEQ), rng.randrange(4))
        out.append(catalog.add_file(name, kind, 0, path.path_id).file_id)
        write_durably(path.uri, name, b"chaos: a leftover of a crash")
    return out


def code_of(exc: grpc.RpcError) -> str:
    return str(exc.code().name)


# --- the storage audit after every episode ---------------------------------------------------
@dataclass
class StorageAudit:
    """REGULAR files must have their objects; RETIRED files must go once due.

    ``overdue`` counts, per RETIRED file id, the post-episode checks in a row at which its
    cleanupAt had passed."""

    dsn: str
    overdue: dict[int, int] = field(default_factory=dict)
    reported: set[int] = field(default_factory=set)
    counts: Counter[str] = field(default_factory=Counter)

    def check(self, ready: set[str]) -> tuple[list[str], list[str]]:
        """(anomalies, notes). ``ready``: the nodes READY now (a dry run asks the owner
        of an overdue file why it is held)."""
        anomalies: list[str] = []
        notes: list[str] = []
        catalog = Catalog(self.dsn, pool_max=1)
        try:
            paths = {p.path_id: p.uri for p in catalog.list_paths()}
            files = catalog.get_files_by_type(None, [FileType.REGULAR, FileType.RETIRED])
            now_ms = int(time.time() * 1000)
            missing = []
            retired = {}
            for f in files:
                uri = paths.get(f.path_id, "")
                if f.type == FileType.REGULAR:
                    self.counts["regular_objects_checked"] += 1
                    if not (local_dir(uri) / f.name).exists():
                        missing.append(f)
                else:
                    retired[f.file_id] = f
            for f in missing:  # re-read: a file may have changed type since the listing
                again = catalog.get_file(f.file_id)
                uri = paths.get(f.path_id, "")
                if again is not None and again.type == FileType.REGULAR and \
                        not (local_dir(uri) / f.name).exists() and \
                        f.file_id not in self.reported:
                    self.reported.add(f.file_id)
                    anomalies.append(f"regular_object_missing: file {f.file_id} {f.name} is "
                                     f"REGULAR but its object is not under {uri}")
        except CatalogError as exc:
            notes.append(f"storage audit: catalog unreadable: {exc}")
            return anomalies, notes
        finally:
            catalog.close()
        gone = set(self.overdue) - set(retired)
        self.counts["retired_swept_seen"] += len(gone)
        for file_id in gone:
            self.overdue.pop(file_id, None)
        for f in retired.values():
            assert f.cleanup_at is not None  # the catalog's constraint
            if f.cleanup_at > now_ms:
                self.overdue.pop(f.file_id, None)
                continue
            self.overdue[f.file_id] = self.overdue.get(f.file_id, 0) + 1
            late_s = (now_ms - f.cleanup_at) / 1000
            if self.overdue[f.file_id] < RETIRED_OVERDUE_CHECKS or late_s < RETIRED_OVERDUE_S \
                    or f.file_id in self.reported:
                continue
            self.reported.add(f.file_id)
            why = self._why_held(f.name, f.file_id, ready)
            anomalies.append(f"retired_not_swept: file {f.file_id} {f.name} RETIRED, cleanupAt "
                             f"passed {late_s:.0f}s ago, at {self.overdue[f.file_id]} checks in "
                             f"a row; the owner's dry run: {why}")
        return anomalies, notes

    @staticmethod
    def _why_held(name: str, file_id: int, ready: set[str]) -> str:
        try:
            owner = file_names.parse(name).node_id
        except ValueError:
            return "not a Retina name"
        node = next((n for n in ready if n.replace(":", "-") == owner or n == owner), "")
        if not node:
            return f"owner {owner} not READY"
        try:
            reply = run_sweeper(node, ["retired"], dry_run=True)
        except grpc.RpcError as exc:
            return f"RunSweeper {code_of(exc)}"
        for o in reply.objects:
            if o.file_id == file_id:
                return f"{o.action} ({o.reason})"
        return "not listed (not due, or not this node's)"
