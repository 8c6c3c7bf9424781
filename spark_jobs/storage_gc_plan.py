"""Storage GC's plan (spark_jobs/storage_gc.py, step 2): which files of a table are
rewritten together. Pure: the driver gathers each listed file's stream, place, size
and deleted rows (:class:`FileStats`), and :func:`plan_table` groups them, run by run
inside one stream, never across a file whose place is unknown.

**The compaction policy is size-tiered** (MERGES_ONLY_COMPARABLE_SIZES). Small files are
merged with neighbours of comparable size only: walking a run of consecutive small files
from the newest, an older file joins the group only while it is at most ``size_ratio``
times what the group already holds (and the newest at most that times the second; the
group stays under the target), so no file of a group is more than ``size_ratio`` times
the rest of it; below
``min_tier_bytes`` (256 KiB) every file counts as that size, so the smallest files, mostly
Parquet footer, are one tier. A merged file past that floor is therefore rewritten again
only once at least ``1 / size_ratio`` of its size has arrived beside it: a row is
rewritten about min_tier_bytes / (what arrives between runs) times below the floor, then
at most log_(1 + 1/size_ratio)(small_file_bytes / min_tier_bytes) + 1 times (6 at the
defaults) before its file stops being small; one run rewrites what arrived since the last
one plus at most min_tier_bytes per stream and the tiers that doubled, never the whole
table. The rule is RocksDB's and Paimon's universal compaction (their
size ratio of 1 %). A file over the deleted threshold is still rewritten for its deleted
rows whatever its size: each such rewrite reclaims at least that fraction of it.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

from retina_common import file_names
from spark_jobs.common import FileRef

MiB = 1 << 20
DEFAULT_DELETED_THRESHOLD = 0.2
DEFAULT_SMALL_FILE_BYTES = 8 * MiB
DEFAULT_TARGET_FILE_BYTES = 128 * MiB
DEFAULT_SIZE_RATIO = 1.0
DEFAULT_MIN_TIER_BYTES = 256 * 1024


# --- what the plan is made of: plain, picklable data ------------------------------------------
@dataclass(frozen=True)
class FileStats:
    """One listed file with what the plan needs: its stream, order, size and deletions."""

    ref: FileRef
    node: str
    vnode: int
    # Its place in the stream: the node's firstBlockId (QueryVisibility). Not the name's
    # sequence number: a GC output takes the place of the files it replaced.
    position: int
    size_bytes: int
    rows: int  # every row of the file (QueryVisibility's row counts)
    deleted: int  # rows deleted at safeGcTs
    # Why its node would refuse a rewrite of it now (QueryVisibility's gc_hold): such a
    # file is in no group this run and separates runs like a large file.
    hold: str = ""

    @property
    def deleted_fraction(self) -> float:
        return self.deleted / self.rows if self.rows else 0.0


@dataclass(frozen=True)
class Skipped:
    """A listed file the plan leaves alone this run, and why."""

    table: str
    file_id: int
    name: str
    reason: str


@dataclass(frozen=True)
class Thresholds:
    deleted_threshold: float = DEFAULT_DELETED_THRESHOLD
    small_file_bytes: int = DEFAULT_SMALL_FILE_BYTES
    target_file_bytes: int = DEFAULT_TARGET_FILE_BYTES
    # An older small file joins a group only while it is at most this times the group's
    # size so far (MERGES_ONLY_COMPARABLE_SIZES).
    size_ratio: float = DEFAULT_SIZE_RATIO
    # Files and groups below this count as this size in that comparison: the smallest
    # files (a flush's worth, mostly Parquet footer) are one tier, whatever rows of them
    # were deleted (Cassandra's size-tiered min_sstable_size).
    min_tier_bytes: int = DEFAULT_MIN_TIER_BYTES


@dataclass(frozen=True)
class Group:
    """Files of one stream, consecutive in its order, rewritten into one new file."""

    schema: str
    table: str
    node: str
    vnode: int
    files: tuple[FileStats, ...]
    kind: str  # "deleted" (one file over the threshold) or "small" (a merged run)

    @property
    def bytes_before(self) -> int:
        return sum(f.size_bytes for f in self.files)

    @property
    def rows(self) -> int:
        return sum(f.rows for f in self.files)

    @property
    def deleted(self) -> int:
        return sum(f.deleted for f in self.files)


# --- planning: pure -------------------------------------------------------------------------
def _estimated_bytes(f: FileStats) -> float:
    """What a file contributes to a merged file: its share of surviving rows."""
    return f.size_bytes * (1.0 - f.deleted_fraction)


def plan_stream(schema: str, table: str, files: Sequence[FileStats],
                thresholds: Thresholds) -> list[Group]:
    """The groups of ONE stream, in its order. ``files`` are every listed, usable file of
    the stream; a file that is not small separates runs (and is a group of its own when it
    is over the deleted threshold), so every group is consecutive in the stream's order.
    A held file (``hold``: its node would refuse it now) is in no group and separates
    runs too."""
    ordered = sorted(files, key=lambda f: f.position)
    if len({(f.node, f.vnode) for f in ordered}) > 1:
        raise ValueError("plan_stream expects the files of one stream")
    for before, after in itertools.pairwise(ordered):
        if before.position == after.position:
            raise ValueError(f"two files of stream ({after.node}, {after.vnode}) share "
                             f"position {after.position}")
    groups: list[Group] = []
    run: list[FileStats] = []

    def close_run() -> None:
        for members in _tiers(run, thresholds):
            groups.extend(_group(schema, table, members, thresholds))
        run.clear()

    for f in ordered:
        if f.size_bytes < thresholds.small_file_bytes and not f.hold:
            run.append(f)
            continue
        close_run()
        if not f.hold:
            groups.extend(_group(schema, table, [f], thresholds))
    close_run()
    return groups


def _dirty(f: FileStats, thresholds: Thresholds) -> bool:
    # A file with nothing deleted is never rewritten for its deletions, even at a
    # threshold of 0: the rewrite would reclaim nothing.
    return f.deleted > 0 and f.deleted_fraction >= thresholds.deleted_threshold


def _group(schema: str, table: str, files: Sequence[FileStats],
           thresholds: Thresholds) -> list[Group]:
    """``files`` (in the stream's order) as one rewrite, if they make one: two or more are
    merged; one alone is rewritten only for its deleted rows."""
    first = files[0]
    if len(files) >= 2:
        return [Group(schema, table, first.node, first.vnode, tuple(files), "small")]
    if _dirty(first, thresholds):
        return [Group(schema, table, first.node, first.vnode, tuple(files), "deleted")]
    return []


def _tiers(run: Sequence[FileStats], thresholds: Thresholds) -> list[list[FileStats]]:
    """MERGES_ONLY_COMPARABLE_SIZES: one run of consecutive small files cut into groups,
    each in the stream's order. From the newest, an older file joins the group while it is
    at most ``size_ratio`` times the group's size so far (both counted as at least
    ``min_tier_bytes``), the second file only if the newest is at most ``size_ratio``
    times it too, and the group stays within the target; otherwise it starts the next
    group. So every file of a group is at most ``size_ratio`` times the rest of it."""
    cut: list[list[FileStats]] = []
    members: list[FileStats] = []
    held = 0.0
    floor, ratio = thresholds.min_tier_bytes, thresholds.size_ratio
    for f in reversed(run):
        size = _estimated_bytes(f)
        # The newest member is held to the same rule by the second: a large new file
        # (a bulk load's, a file rewritten alone) takes in no small older neighbour.
        newest_too_big = len(members) == 1 and max(held, floor) > ratio * max(size, floor)
        if members and (max(size, floor) > ratio * max(held, floor) or newest_too_big
                        or held + size > thresholds.target_file_bytes):
            cut.append(members[::-1])
            members, held = [], 0.0
        members.append(f)
        held += size
    if members:
        cut.append(members[::-1])
    return cut[::-1]


def plan_table(schema: str, table: str, files: Sequence[FileStats], listed: Sequence[FileRef],
               thresholds: Thresholds) -> list[Group]:
    """Every group of one table. ``listed`` is the whole ListQueryFiles answer. A stream
    with a listed file that has no stats (skipped) is left alone this run: the skipped
    file's place in the stream is unknown, so no run around it is sure to be
    consecutive (the node would refuse it)."""
    usable = {f.ref.file_id for f in files}
    blocked: set[tuple[str, int]] = set()
    for ref in listed:
        if ref.file_id in usable:
            continue
        try:
            parsed = file_names.parse(ref.name)
        except ValueError:
            continue  # no stream: it cannot sit between files of one
        blocked.add((parsed.node_id, parsed.vnode))
    streams: dict[tuple[str, int], list[FileStats]] = {}
    for f in files:
        streams.setdefault((f.node, f.vnode), []).append(f)
    groups: list[Group] = []
    for key in sorted(streams):
        if key not in blocked:
            groups.extend(plan_stream(schema, table, streams[key], thresholds))
    return groups


