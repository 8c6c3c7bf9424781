"""Building UpdateRecord requests from rows (used by drivers, tools and tests).

``TableWriter`` encodes rows with :mod:`retina_common.codec`, routes every row
by its primary key to a virtual node and so to a node, and groups one
transaction's effects into one ``TableUpdateData`` per virtual node. A
replace (CDC INSERT/UPDATE/upsert) is a DELETE and an INSERT of the same key
in the same ``TableUpdateData``; Retina applies the DELETE first.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping
from typing import Any

import grpc

from retina_common.catalog import TableRecord
from retina_common.codec import encode_primary_key, value_encoder
from retina_common.config import TlsConfig
from retina_common.pb import retina_pb2 as pb
from retina_common.tls import open_channel
from retina_common.topology import Topology

Row = Mapping[str, Any]
# A write buffer or a visibility answer can be large; gRPC's default 4 MiB
# reply cap is too small for a client that reads them.
CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", 1 << 30),
    # gRPC's reconnect backoff grows to minutes by default: a node restarted after a crash
    # would be noticed late (the connector took 15 s to replay a recovering node). Retry
    # the connection at least every second instead.
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 1000),
]


def channel(address: str, tls: TlsConfig | None = None) -> grpc.Channel:
    """A client channel for reads of Retina or TransServer answers of any size;
    TLS as ``tls`` (default: the process's settings, retina_common.tls) says."""
    return open_channel(address, tls, CHANNEL_OPTIONS)


class TableWriter:
    def __init__(self, table: TableRecord, topology: Topology) -> None:
        self.table = table
        self.topology = topology
        self._types = {c.name: c.type for c in table.columns}
        self._pk = table.primary_key

    def key(self, row: Row) -> bytes:
        return encode_primary_key([self._types[c] for c in self._pk], [row[c] for c in self._pk])

    def _index_key(self, key: bytes, ts: int) -> pb.IndexKey:
        return pb.IndexKey(table_id=self.table.table_id, index_id=self.table.primary_index_id,
                           key=key, timestamp=ts)

    def updates(self, ts: int, *, deletes: Iterable[Row] = (), inserts: Iterable[Row] = (),
                replaces: Iterable[Row] = ()) -> dict[str, list[pb.TableUpdateData]]:
        """node id -> TableUpdateData (one per virtual node) for one transaction at ``ts``.

        ``deletes`` need only the key columns; ``replaces`` are full rows sent
        as DELETE + INSERT.
        """
        by_vnode: dict[int, pb.TableUpdateData] = {}
        routes: dict[bytes, int] = {}  # a replaced key is routed once, not twice

        def tud(key: bytes) -> pb.TableUpdateData:
            vnode = routes.get(key)
            if vnode is None:
                vnode = routes[key] = self.topology.vnode_of_key(key)
            if vnode not in by_vnode:
                by_vnode[vnode] = pb.TableUpdateData(
                    table_name=self.table.name, primary_index_id=self.table.primary_index_id,
                    timestamp=ts, virtual_node_id=vnode)
            return by_vnode[vnode]

        # Rows are taken in the order they always were (deletes, replaces; then inserts,
        # replaces), so a bad row is reported the same way; a replace's key is computed
        # once and each column's encoder resolved once.
        replaces = list(replaces)
        replaced_keys: list[bytes] = []
        for row in deletes:
            key = self.key(row)
            tud(key).delete_data.add().index_keys.append(self._index_key(key, ts))
        for row in replaces:
            key = self.key(row)
            replaced_keys.append(key)
            tud(key).delete_data.add().index_keys.append(self._index_key(key, ts))
        encoders = [(c.name, value_encoder(c.type)) for c in self.table.columns]

        def insert(key: bytes, row: Row) -> None:
            item = tud(key).insert_data.add()
            item.index_keys.append(self._index_key(key, ts))
            item.col_values.extend(b"" if (v := row.get(name)) is None else encode(v)
                                   for name, encode in encoders)

        for row in inserts:
            insert(self.key(row), row)
        for key, row in zip(replaced_keys, replaces, strict=True):
            insert(key, row)
        per_node: dict[str, list[pb.TableUpdateData]] = defaultdict(list)
        for vnode, data in sorted(by_vnode.items()):
            per_node[self.topology.node_of_vnode(vnode)].append(data)
        return dict(per_node)


def requests_by_node(schema: str, updates: Iterable[dict[str, list[pb.TableUpdateData]]]
                     ) -> dict[str, pb.UpdateRecordRequest]:
    """Merge several tables' updates into one request per node."""
    merged: dict[str, pb.UpdateRecordRequest] = {}
    for per_node in updates:
        for node, datas in per_node.items():
            request = merged.setdefault(node, pb.UpdateRecordRequest(schema_name=schema))
            request.table_update_data.extend(datas)
    return merged
