"""The campaign's bulk loader: loads through ``retina_common.bulk_loader`` into a table of
its own, beside the connector and the application writer.

Every workload step (``FaultContext.write``) may load one small chunk (a few hundred
rows of keys never loaded before, across every virtual node, so every node commits a
part) into ``chaos.loaded_items`` (``LOADED_TABLE``), drawn from a stream of its own
(``LOAD_STREAM``: adding the loads moved no other draw). The ``load.*`` failpoint episodes
load a chunk at every turn of their wait, and arm ``load.reapply.*`` after a load that
no checkpoint holds yet, so that the node's next start re-applies it.

The model (``ModelTable``, compared after every episode with the rest): a chunk the
loader saw committed is expected exactly; one every node refused definitely (LoadRefused:
never journaled) is expected absent; one whose outcome the loader could not learn (a node
away past the loader's deadline, a partial load, an error before the commit) leaves its
keys undecided: present or absent, never anything else, never twice.
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Callable
from typing import Any

import grpc
import pyarrow as pa

from retina_common.bulk_loader import BulkLoader, LoadFailed, LoadRefused
from retina_common.catalog import TableRecord
from retina_common.pb import retina_pb2_grpc, trans_pb2_grpc
from retina_common.tls import open_channel
from retina_common.topology import Topology

from .workload import LOADED_TABLE, SCHEMA, Key, Row

LOAD_STREAM = 0x10AD5
LOAD_P = 0.3  # a workload step loads a chunk this often
CHUNK_ROWS = (50, 400)
# A loader whose node is away retries its commit this long, then leaves the chunk
# undecided; its write transaction's lease is the connector's (it must not hold the
# high-water mark for long once the loader gave up on it).
DEADLINE_S = 8.0
LEASE_MS = 2000


class BulkLoads:
    """The loader and its model (see the module docstring)."""

    table = LOADED_TABLE

    def __init__(self, record: TableRecord, topology: Topology, trans_address: str,
                 nodes: list[str]) -> None:
        self._record = record
        self._topology = topology
        self._channels = [open_channel(trans_address)]
        trans = trans_pb2_grpc.TransServiceStub(self._channels[0])
        stubs = {}
        for node in nodes:
            self._channels.append(open_channel(node))
            stubs[node] = retina_pb2_grpc.RetinaWorkerServiceStub(self._channels[-1])
        self._loader = BulkLoader(SCHEMA, record, topology, trans, stubs,
                                  chunk_rows=CHUNK_ROWS[1], row_group_rows=128,
                                  timeout_s=DEADLINE_S, lease_ms=LEASE_MS)
        self.rows: dict[Key, Row] = {}
        self.either: dict[Key, frozenset[Row | None]] = {}
        self.counts: Counter[str] = Counter()
        self._next_id = 1

    def close(self) -> None:
        for channel in self._channels:
            channel.close()

    def maybe_load(self, rng: random.Random, ready: Callable[[], bool]) -> None:
        """A workload step's load: one chunk, ``LOAD_P`` of the time, while every node is
        READY (a step must not wait out a node's restart; the ``load.*`` failpoint episodes
        kill nodes inside loads)."""
        if rng.random() < LOAD_P:
            if ready():
                self.load(rng)
            else:
                self.counts["skipped_node_down"] += 1

    def load(self, rng: random.Random) -> str:
        """Load one chunk of new keys; returns its outcome (committed, refused, undecided)."""
        count = rng.randint(*CHUNK_ROWS)
        chunk = {(self._next_id + i,): (f"l{rng.randint(0, 10**6)}", rng.randint(-10**9, 10**9))
                 for i in range(count)}
        self._next_id += count
        data = pa.table({"id": pa.array([k[0] for k in chunk], pa.int64()),
                         "label": [v[0] for v in chunk.values()],
                         "amount": pa.array([v[1] for v in chunk.values()], pa.int64())})
        outcome = "committed"
        try:
            self._loader.load(data)
        except LoadRefused:  # every node said it never committed it
            outcome = "refused"
        except LoadFailed:  # in doubt, or partial: each row there or absent
            outcome = "undecided"
        except grpc.RpcError:  # BeginTrans, a prepare, the commit at the TransServer
            outcome = "undecided"
        self.counts[outcome] += 1
        self.counts["rows_" + outcome] += count
        for key, values in chunk.items():
            row = (*key, *values)
            if outcome == "committed":
                self.rows[key] = row
            elif outcome == "undecided":
                self.either[key] = frozenset({None, row})
        return outcome

    def expected(self) -> tuple[dict[Key, Row], dict[Key, frozenset[Row | None]]]:
        return dict(self.rows), dict(self.either)

    def report(self) -> dict[str, Any]:
        return dict(self.counts)
