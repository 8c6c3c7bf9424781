"""Changelog retention's horizon: the lowest timestamp any checkpoint could still
replay from, for every replay source's changelog (the CDC connector's and each
application writer's, ``retina_common/writer.py``).

A node's replay starts derive from the checkpoint it loads, and it may load
its ``previous`` slot if ``current`` is unusable. So the horizon is the
minimum, over every expected node and both slots, of that checkpoint's
node-level replay start (``replay_ts.derive`` on its own segment chain). A
node without a checkpoint, or a slot that cannot be read, pins the horizon at
0: nothing is dropped. Batches ending below the horizon may be removed.
"""

from __future__ import annotations

from retina_common.checkpoint_store import CheckpointError, CheckpointStore
from retina_common.etcd import EtcdStore
from retina_common.replay_ts import derive
from retina_common.topology import Topology


def _slot_start(store: CheckpointStore, node: str, topology: Topology, slot: str) -> int | None:
    """The slot's node replay start; None if the slot is empty; 0 if unreadable."""
    try:
        found = store.read_slot(slot)
    except (CheckpointError, OSError, ValueError):
        return 0
    if found is None:
        return None
    body = found[1]
    return derive(body.header.checkpoint_applied_ts, body.segments, topology.vnodes_of(node),
                  ()).node_replay_from_ts


def horizon(etcd: EtcdStore, topology: Topology) -> int:
    low = None
    for node in topology.nodes:
        # Pointers name their bodies by full path: the storage root is not needed.
        store = CheckpointStore(etcd, node, "", topology.topology_hash)
        current = _slot_start(store, node, topology, "current")
        if current is None:
            return 0  # never checkpointed: it replays from the beginning
        previous = _slot_start(store, node, topology, "previous")
        for start in (current, previous):
            if start is not None:
                low = start if low is None else min(low, start)
    return low or 0
