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
        value = json.dumps({"position": committed.position, "ts": committed.ts,
                            "source": committed.source}, separators=(",", ":"))
        try:
            revision = self._etcd.compare_and_put(self._key, value, self._revision)
        except EtcdOutcomeUnknown:
            # Re-read before deciding: our own write may have landed.
            kv = self._etcd.get(self._key)
            revision = kv.mod_revision if kv is not None and kv.value == value.encode() else None
        if revision is None:
            raise ConnectorFenced(f"{self._key} changed under this connector: "
                                  "another connector of the same name is running")
        self._revision = revision
