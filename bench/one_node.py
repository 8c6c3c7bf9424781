"""The private cluster of the one-node benchmarks (bench_dataplane.py, bench_lookup.py):
etcd, PostgreSQL and the TransServer on this machine, one Retina node that owns all 8
virtual nodes (started by the benchmark, with its own settings), and the ``bench.orders``
table (int64 key, a string, a decimal, a string)."""

from __future__ import annotations

import os
import platform
import shutil
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from decimal import Decimal
from pathlib import Path

import grpc

from devtools.cluster import (
    ClusterState,
    free_port,
    start_cluster,
    start_retina_server,
    stop_cluster,
)
from retina_common.catalog import Catalog, ColumnSpec, TableRecord
from retina_common.pb import retina_pb2_grpc, trans_pb2_grpc
from retina_common.recovery_driver import drive_recovery
from retina_common.topology import Topology


def row(i: int, version: int = 0) -> dict:
    return {"id": i, "customer": f"customer-{i % 997}", "amount": Decimal(i % 100000) / 100,
            "note": f"v{version}"}


def machine() -> str:
    """The first words of every setup line."""
    return (f"setup: {platform.platform()}, {os.cpu_count()} cores, Python "
            f"{platform.python_version()}; one Retina node (all 8 vnodes), TransServer, etcd "
            "and PostgreSQL on this machine; loopback gRPC")


@dataclass
class OneNode:
    work: Path
    node: str
    state: ClusterState
    topology: Topology
    catalog: Catalog
    table: TableRecord
    _channels: list[grpc.Channel] = field(default_factory=list)

    def ready_node(self, env: Mapping[str, str]) -> retina_pb2_grpc.RetinaWorkerServiceStub:
        """Start the Retina node with ``env`` and drive it READY (a fresh node: nothing
        to replay, then MarkReady); its stub."""
        start_retina_server(self.state, self.node, env)
        channel = grpc.insecure_channel(self.node)
        grpc.channel_ready_future(channel).result(timeout=60)
        self._channels.append(channel)
        stub = retina_pb2_grpc.RetinaWorkerServiceStub(channel)
        drive_recovery(stub)
        return stub

    def trans(self) -> trans_pb2_grpc.TransServiceStub:
        self._channels.append(grpc.insecure_channel(self.state.trans_listen))
        return trans_pb2_grpc.TransServiceStub(self._channels[-1])

    def stop(self) -> None:
        for channel in self._channels:
            channel.close()
        self.catalog.close()
        stop_cluster(self.state, log=lambda _m: None)
        shutil.rmtree(self.work, ignore_errors=True)


def start(prefix: str) -> OneNode:
    """The cluster without its Retina node (``start_retina_server(one.state, one.node,
    env)`` starts it) and the orders table."""
    work = Path(tempfile.mkdtemp(prefix=prefix))
    node = f"127.0.0.1:{free_port()}"
    state = start_cluster(work, nodes=[node], virtual_nodes=8, log=lambda _m: None)
    catalog = Catalog(state.postgres.dsn())
    catalog.create_schema("bench")
    table = catalog.create_table("bench", "orders", [
        ColumnSpec("id", "int64"), ColumnSpec("customer", "string"),
        ColumnSpec("amount", "decimal(12,2)"), ColumnSpec("note", "string")], ["id"])
    return OneNode(work, node, state, Topology((node,), 8), catalog, table)
