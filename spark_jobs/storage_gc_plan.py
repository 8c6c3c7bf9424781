"""Storage GC's plan (spark_jobs/storage_gc.py, step 2): which files of a table are
rewritten together. Pure: the driver gathers each listed file's stream, place, size
and deleted rows (:class:`FileStats`), and :func:`plan_table` groups them, run by run
inside one stream, never across a file whose place is unknown.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from retina_common import file_names
from spark_jobs.common import FileRef

MiB = 1 << 20
DEFAULT_DELETED_THRESHOLD = 0.2
DEFAULT_SMALL_FILE_BYTES = 8 * MiB
DEFAULT_TARGET_FILE_BYTES = 128 * MiB


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
    """The groups of ONE stream. ``files`` are every listed, usable file of the stream;
    a file that is neither small nor over the threshold separates runs, so every group
    is consecutive in the stream's order."""
    ordered = sorted(files, key=lambda f: f.position)
    if len({(f.node, f.vnode) for f in ordered}) > 1:
        raise ValueError("plan_stream expects the files of one stream")
    groups: list[Group] = []
    run: list[FileStats] = []

    def dirty(f: FileStats) -> bool:
        # A file with nothing deleted is never rewritten for its deletions, even at a
        # threshold of 0: the rewrite would reclaim nothing.
        return f.deleted > 0 and f.deleted_fraction >= thresholds.deleted_threshold

    def close_run() -> None:
        if len(run) >= 2:
            groups.append(Group(schema, table, run[0].node, run[0].vnode, tuple(run), "small"))
        elif len(run) == 1 and dirty(run[0]):
            groups.append(Group(schema, table, run[0].node, run[0].vnode, tuple(run), "deleted"))
        run.clear()

    previous: int | None = None
    for f in ordered:
        if previous is not None and f.position == previous:
            raise ValueError(f"two files of stream ({f.node}, {f.vnode}) share position "
                             f"{f.position}")
        previous = f.position
        if f.size_bytes < thresholds.small_file_bytes:
            if run and sum(map(_estimated_bytes, run)) + _estimated_bytes(f) \
                    > thresholds.target_file_bytes:
                close_run()
            run.append(f)
            continue
        close_run()
        if dirty(f):
            groups.append(Group(schema, table, f.node, f.vnode, (f,), "deleted"))
    close_run()
    return groups


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


