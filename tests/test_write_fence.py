"""The write fence and the commit's cutoff re-check as pure logic (write_fence.py,
gc/rewrites.py): the rules the integration tests in test_snapshot_immutable.py drive through
real processes, pinned here case by case, threads included."""

from __future__ import annotations

import threading
from pathlib import Path

import grpc
import pytest

from retina_common.refusal import Refusal
from retina_server.gc.gc_journal import GcJournal
from retina_server.gc.rewrites import PendingRewrite, StorageGc
from retina_server.registry import IngestFileMeta
from retina_server.write_fence import WriteFence

from .support import eventually
from .test_gc_scheduler import bare_node


def refused(fence: WriteFence, ts: int) -> Refusal:
    with pytest.raises(Refusal) as info, fence.admit(ts):
        pass
    return info.value


def test_writes_at_or_below_the_floor_are_refused_and_the_floor_never_falls() -> None:
    fence = WriteFence("n1")
    with fence.admit(1):  # nothing read yet: every positive timestamp passes
        pass
    fence.raise_to(10, "a read at 10")
    for ts in (1, 9, 10):
        refusal = refused(fence, ts)
        assert refusal.code == grpc.StatusCode.ABORTED
        assert "write fence" in str(refusal) and "a read at 10" in str(refusal)
    with fence.admit(11):
        pass
    fence.raise_to(5, "an older read")
    assert fence.floor == 10
    assert refused(fence, 10).code == grpc.StatusCode.ABORTED


def test_a_raise_waits_for_admitted_writes_at_or_below_it_only() -> None:
    fence = WriteFence("n1")
    inside, leave = threading.Event(), threading.Event()
    raised = threading.Event()

    def write(ts: int) -> None:
        with fence.admit(ts):
            inside.set()
            leave.wait(30)

    writer = threading.Thread(target=write, args=(7,))
    writer.start()
    assert inside.wait(30)
    fence.raise_to(6, "a read below the write")  # does not wait for it
    riser = threading.Thread(target=lambda: (fence.raise_to(7, "a read at it"), raised.set()))
    riser.start()
    eventually(lambda: fence.floor == 7, 30, "the floor to rise")  # at once, before waiting
    assert refused(fence, 7).code == grpc.StatusCode.ABORTED
    assert not raised.is_set()  # ... and the riser waits for the write admitted below it
    leave.set()
    writer.join(30)
    riser.join(30)
    assert raised.is_set()


def test_a_raise_that_waits_too_long_is_unavailable() -> None:
    fence = WriteFence("n1", wait_s=0.2)
    with fence.admit(3), pytest.raises(Refusal) as info:
        fence.raise_to(3, "a read")
    assert info.value.code == grpc.StatusCode.UNAVAILABLE
    assert fence.floor == 3  # risen all the same: later writes at 3 are fenced


def test_the_commit_refuses_a_cutoff_whose_deleted_rows_changed_since_prepare(
        tmp_path: Path) -> None:
    """CUTOFF_UNCHANGED_SINCE_PREPARE: the commit compares every old row group's rows
    deleted at or below the cutoff with what prepare took (the new file left those out)."""
    node = bare_node(tmp_path)
    node.visibility.add_file(10, [8, 8])
    node.visibility.get(10, 0).delete([1], 4)
    gc = StorageGc(node, None, GcJournal(tmp_path / "journal"),  # type: ignore[arg-type]
                   safe_gc_ts=lambda: 100)
    cutoff = 5
    dropped = {(10, rg): node.visibility.get(10, rg).deleted_at(cutoff) for rg in (0, 1)}
    pending = PendingRewrite("r1", None, None,  # type: ignore[arg-type]
                             [IngestFileMeta(10, 1, 0, 0, 1, 4, 16, 0, 15, 2, 2)], ["f"],
                             [(8, 8)], cutoff, "new", 0, dropped)
    node.visibility.get(10, 1).delete([2], 6)  # after the cutoff: carried as a chain item
    gc._check_cutoff_unchanged(pending)
    node.visibility.get(10, 1).delete([3], 5)  # at the cutoff, after the prepare
    with pytest.raises(Refusal) as info:
        gc._check_cutoff_unchanged(pending)
    assert info.value.code == grpc.StatusCode.ABORTED
    assert "file 10 row group 1" in str(info.value)
