"""A stand-in lifecycle announcer for the demo's query-gate walkthrough.

It writes READY (or any state) lifecycle values for a set of node ids on its
own lease and refreshes them, the way a Retina node does, so the gate can be
shown before any Retina process runs. Real nodes announce their own state
(``retina_server.lifecycle.LifecycleAnnouncer``) and reach READY only
through MarkReady.
"""

from __future__ import annotations

import threading
import time

from retina_common.etcd import EtcdStore
from retina_common.keys import lifecycle_key
from retina_common.lifecycle_record import LifecycleRecord, LifecycleState


class StandInLifecycle:
    def __init__(self, store: EtcdStore, nodes: list[str], ttl_s: int = 10,
                 refresh_s: float = 1.0) -> None:
        self._store = store
        self._states = dict.fromkeys(nodes, LifecycleState.READY)
        self._lease = store.grant_lease(ttl_s)
        self._refresh_s = refresh_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="standin-lifecycle", daemon=True)

    def set(self, node: str, state: LifecycleState) -> None:
        self._states[node] = state
        self._announce()

    def _announce(self) -> None:
        now = int(time.time() * 1000)
        for node, state in list(self._states.items()):
            record = LifecycleRecord(state, node, None, 1, "", now)
            self._store.put(lifecycle_key(node), record.to_json(), lease_id=self._lease)

    def _run(self) -> None:
        while not self._stop.wait(self._refresh_s):
            self._store.keepalive(self._lease)
            self._announce()

    def start(self) -> StandInLifecycle:
        self._announce()
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        self._store.revoke_lease(self._lease)
