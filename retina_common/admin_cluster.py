"""The cluster an operator's command talks to: ``retina-admin`` and its sub-commands
(``admin_writers.py``) share it, so it sits below both."""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field

import grpc

from retina_common.catalog import Catalog
from retina_common.client import channel
from retina_common.config import Config
from retina_common.etcd import EtcdStore
from retina_common.pb import retina_pb2_grpc, trans_pb2_grpc
from retina_common.topology import Topology


@dataclass
class Cluster:
    config: Config
    topology: Topology
    nodes: list[str]
    timeout_s: float
    no_progress: bool = False
    _channels: dict[str, grpc.Channel] = field(default_factory=dict)

    def _channel(self, address: str) -> grpc.Channel:
        if address not in self._channels:
            self._channels[address] = channel(address, self.config.tls)
        return self._channels[address]

    def node(self, address: str) -> retina_pb2_grpc.RetinaWorkerServiceStub:
        return retina_pb2_grpc.RetinaWorkerServiceStub(self._channel(address))

    @property
    def trans(self) -> trans_pb2_grpc.TransServiceStub:
        return trans_pb2_grpc.TransServiceStub(self._channel(self.config.trans.listen))

    def etcd(self) -> EtcdStore:
        return EtcdStore.from_config(self.config.etcd)

    def catalog(self) -> Catalog:
        return Catalog(self.config.catalog.dsn,
                       connect_timeout_s=self.config.catalog.connect_timeout_s)

    def close(self) -> None:
        for ch in self._channels.values():
            ch.close()


def rpc_failed(exc: grpc.RpcError, what: str) -> int:
    """Say on stderr which call was refused and how; the exit code of a refusal (1)."""
    print(f"retina-admin: {what}: {exc.code().name}: {exc.details()}", file=sys.stderr)
    return 1


def report_dropped(kind: str, name: str, dropped: bool, as_json: bool) -> int:
    """The answer of a ``... drop NAME`` command: 0 dropped, 1 no such ``kind``."""
    if as_json:
        print(json.dumps({"name": name, "dropped": dropped}))
    elif dropped:
        print(f"{kind} {name} dropped")
    else:
        print(f"retina-admin: no {kind} named {name}", file=sys.stderr)
    return 0 if dropped else 1
