"""Stalled writes: an UpdateRecord parked past its write lease while the connector
expires its batch and redoes it at new timestamps (issue 25, section 1).

A process is restarted with a ``block`` failpoint for one hit (``block@K*1``) on the way
of a write:

- ``update_record.fence.before`` (a Retina node; when the catalogue has it): the request
  validated, not yet admitted by the write fence, no stream lock held: the write reaches
  the fence late;
- ``index.primary_commit.before`` (a Retina node): admitted and applied, its
  primary-index commit not done yet, its stream locks held (reads of its streams wait);
- ``cdc.batch.begin.after`` (the connector): the batch's transactions begun, nothing of
  it sent yet: its UpdateRecords leave after their lease ran out (the issue's
  reproduction (a), a late write, seen from the node's side exactly like the first).

``block`` rather than ``sleep``: the point announces its hit (``<name>.hit`` in the
node's RETINA_FAILPOINT_DIR), so the campaign knows when the write is parked instead of
guessing, and releases it (``<name>.release``) after the drawn stall. The workload keeps
writing until the hit; then, while the write is parked, the connector's transactions run
out (its write lease is 2 s here; polled: the HWM passes the one it was at when the write
parked) and a snapshot is taken (its S lies above the stalled write's timestamp); the
write is released at the end of the stall, another snapshot is taken after it, both are
read again once the connector has caught up (the parked write answered, its batch done
again; before the clean restart, whose floor would refuse them), and the process is
restarted clean. What
checks the fault: the snapshots' re-reads after healing (SNAPSHOT_IS_IMMUTABLE) and the
comparison with the source (the connector must redo the expired batch, once).
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import grpc
import psycopg2

from devtools.cluster import node_state
from retina_common import failpoints
from retina_common.client import channel
from retina_common.etcd import EtcdStore
from retina_common.pb import retina_pb2 as rpb
from retina_common.pb import trans_pb2 as tpb
from retina_common.pb import trans_pb2_grpc

from . import workload
from .campaign_cluster import CDC, CDC_NAME
from .compare import committed_lsn
from .snapshots import VIAS

if TYPE_CHECKING:  # faults.py registers the fault; this module only fills its result
    from .faults import FaultContext, FaultResult

STALL_POINTS = ("update_record.fence.before", "index.primary_commit.before",
                "cdc.batch.begin.after")
# The stall, from the hit to the release: above the connector's 2 s write lease
# (cluster.CDC_SETTINGS) and the TransServer's lease sweep, so its batch expires.
STALL_S = (3.0, 5.0)
# The K-th hit parks. The restarted node's recovery replay reaches the point too (a replay
# write is applied like any other), in one streamed request in the campaigns: K is drawn
# above that; a hit while the node is not READY yet is counted apart.
HIT_K = (2, 5)
HIT_DEADLINE_S = 20.0
CAUGHT_UP_S = 30.0


def stall_points() -> list[str]:
    """The stall points the catalogue has (the fence's joins it with the write fence)."""
    return [p for p in STALL_POINTS if p in failpoints.catalogue()]


def wait_until(condition: Callable[[], bool], timeout_s: float,
               between: Callable[[], None] | None = None) -> bool:
    """Poll ``condition`` until true or the deadline; ``between`` runs between polls
    (e.g. a workload step), else a short pause."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        if between is not None:
            between()
        else:
            time.sleep(0.05)  # polling interval, bounded by the deadline
    return condition()


def high_watermark(trans_address: str) -> int:
    """The TransServer's HWM (-1 if it does not answer)."""
    try:
        with channel(trans_address) as ch:
            return int(trans_pb2_grpc.TransServiceStub(ch).GetHighWatermark(
                tpb.GetHighWatermarkRequest(), timeout=5).high_watermark)
    except grpc.RpcError:
        return -1


def stall(ctx: FaultContext, result: FaultResult) -> None:
    """The stalled-write fault (module docstring); its counts go to ``result.reads``."""
    assert ctx.cluster.state is not None
    point = ctx.rng.choice(stall_points())
    name = CDC if point.startswith("cdc.") else ctx.node()
    spec = f"{point}=block@{ctx.rng.randint(*HIT_K)}*1"
    stall_s = ctx.rng.uniform(*STALL_S)
    result.detail = f"{name} {spec} for {stall_s:.1f}s"
    result.reads["stalls"] += 1
    result.reads[f"stall_at_{point}"] += 1
    directory = ctx.cluster.failpoint_dir(name)
    for stale in directory.glob(f"{point}.*"):  # a release left by an earlier stall
        stale.unlink()
    ctx.write()
    ctx.kill(name, signal.SIGKILL)
    ctx.cluster.start(name, spec)
    started = time.monotonic()
    hit = directory / f"{point}.hit"
    if not wait_until(hit.exists, HIT_DEADLINE_S, ctx.write):
        result.reads["stall_not_reached"] += 1
        result.notes.append(f"{point} not reached within {HIT_DEADLINE_S:.0f}s")
    else:
        result.detail += f", hit after {time.monotonic() - started:.1f}s"
        _parked(ctx, name, point, directory, stall_s, result)
    failpoints.release(directory, point)  # idempotent; never leave a write parked
    ctx.kill(name, signal.SIGKILL)  # then clean: the point disarmed
    ctx.cluster.start(name)


def _parked(ctx: FaultContext, name: str, point: str, directory: Path, stall_s: float,
            result: FaultResult) -> None:
    """While the write is parked: its batch expires, a snapshot is taken; then the release
    at the end of the stall, and another snapshot."""
    assert ctx.cluster.state is not None
    parked_at = time.monotonic()
    release = threading.Timer(stall_s, failpoints.release, (directory, point))
    release.start()
    try:
        if name != CDC and node_state(name) != rpb.READY:
            # A recovery replay write (its node not READY yet): a slow replay, no reader
            # can see it; counted apart.
            result.reads["stall_in_replay"] += 1
            return
        result.reads["stall_parked"] += 1
        trans_address = ctx.cluster.state.trans_listen
        hwm = high_watermark(trans_address)
        # The parked write's transactions are the lowest live ones: the HWM passes its
        # value only when they end (lease expiry, the connector still waiting).
        expired = wait_until(lambda: high_watermark(trans_address) > hwm, stall_s)
        if expired:
            result.detail += f", its batch expired after {time.monotonic() - parked_at:.1f}s"
        else:
            result.notes.append(f"the HWM stayed at {hwm} during the {stall_s:.1f}s stall")
        ctx.write()  # the source moves on; the connector is stuck in the parked batch
        book = ctx.snapshots
        taken = [book.take(ctx.rng.choice(VIAS), "during a stalled write")] if book else []
        release.join()  # the stall's end (a read of a locked stream may have waited for it)
        ctx.write()
        if book is None:
            return
        taken.append(book.take(ctx.rng.choice(VIAS), "after a stalled write"))
        # Read both again, and end them, before the clean restart: a node's restart floor
        # would refuse them after it. Once the connector committed past the source's last
        # write, the parked write has been answered and its batch done again.
        released_at = time.monotonic()
        if caught_up(ctx, CAUGHT_UP_S):
            result.detail += f", caught up {time.monotonic() - released_at:.1f}s later"
        else:
            result.notes.append(f"the connector did not catch up within {CAUGHT_UP_S:.0f}s "
                                "after the stall")
        book.reread_taken([t for t in taken if t is not None], "once the stalled batch "
                          "was done again", end=True)
    finally:
        release.cancel()


def caught_up(ctx: FaultContext, timeout_s: float) -> bool:
    """Write the marker and wait until the connector's committed position passes it."""
    assert ctx.cluster.state is not None and ctx.source is not None
    try:
        after = workload.mark(ctx.source(), -1)
    except psycopg2.Error:
        return False
    etcd = EtcdStore([ctx.cluster.state.etcd.endpoint], 5)
    return wait_until(lambda: committed_lsn(etcd, CDC_NAME) > after, timeout_s)
