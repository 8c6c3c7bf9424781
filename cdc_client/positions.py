"""The connector's committed source position, in etcd (``keys.cdc_position_key``).

Written after a batch is committed at the TransServer and before the source
is acknowledged: on restart the connector resumes right after it, and a
source that re-delivers older transactions has them skipped. Every write is
a compare-and-swap on the key's revision, so a second connector with the same
name (a stale process, a split brain) is fenced off instead of interleaving.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from retina_common.etcd import EtcdOutcomeUnknown, EtcdStore
from retina_common.keys import cdc_position_key


class ConnectorFenced(Exception):
    """Another connector of the same name wrote the position since we read it."""


@dataclass(frozen=True)
class CommittedPosition:
    position: str
    ts: int
    source: str


class PositionStore:
    def __init__(self, etcd: EtcdStore, connector: str) -> None:
        self._etcd = etcd
        self._key = cdc_position_key(connector)
        self._revision = 0

    def load(self) -> CommittedPosition | None:
        kv = self._etcd.get(self._key)
        if kv is None:
            self._revision = 0
            return None
        self._revision = kv.mod_revision
        d = json.loads(kv.value)
        return CommittedPosition(str(d["position"]), int(d["ts"]), str(d["source"]))

    def store(self, committed: CommittedPosition) -> None:
        """Compare-and-swap the position at the revision this connector last wrote or read.

        A failed compare is not yet a second connector: the write may be our own. An
        earlier attempt of this same store can have landed with its answer lost (etcd
        restarting under it: an unknown outcome, then a re-read that failed, so the caller
        sent the same store again with the revision from before it). The value names the
        batch's commit timestamp, which no other connector writes, so finding it is
        finding our own write. A key still at our revision means the attempt did not land:
        it is sent again. Anything else is another connector of the same name."""
        value = json.dumps({"position": committed.position, "ts": committed.ts,
                            "source": committed.source}, separators=(",", ":"))
        while True:
            try:
                revision = self._etcd.compare_and_put(self._key, value, self._revision)
            except EtcdOutcomeUnknown:
                revision = None  # decided by the re-read below
            if revision is not None:
                break
            kv = self._etcd.get(self._key)  # EtcdUnavailable: the caller sends it again
            if kv is not None and kv.value == value.encode():
                revision = kv.mod_revision  # our own write, its answer lost
                break
            if (kv.mod_revision if kv is not None else 0) != self._revision:
                raise ConnectorFenced(f"{self._key} changed under this connector: "
                                      "another connector of the same name is running")
        self._revision = revision
