"""Building UpdateRecord requests from rows (used by drivers, tools and tests).

``TableWriter`` encodes rows with :mod:`retina_common.codec`, routes every row
by its primary key to a virtual node and so to a node, and groups one
transaction's effects into one ``TableUpdateData`` per virtual node. A
replace (CDC INSERT/UPDATE/upsert) is a DELETE and an INSERT of the same key
in the same ``TableUpdateData``; Retina applies the DELETE first.

Rows are sent in the columnar form (``retina_common.columnar``, Arrow IPC) by
default, except a virtual node's part smaller than ``min_columnar_rows`` (the
row form is cheaper there); ``columnar=False`` sends the row form (one message
per row) always. A node says it takes the columnar form in
``GetRetinaStatus.accepts_columnar``; a node built before it would ignore the
columnar fields, so use ``columnar=False`` while such nodes run.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc

from retina_common.catalog import TableRecord
from retina_common.codec import EncodingError, decode_column, encode_primary_key, value_encoder
from retina_common.columnar import (
    COLUMNAR_MIN_ROWS,
    ROW_FORM_ONLY,
    ColumnarError,
    encode_delete_keys,
    encode_insert_values,
    encode_partial_rows,
)
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
    def __init__(self, table: TableRecord, topology: Topology, *, columnar: bool = True,
                 min_columnar_rows: int = COLUMNAR_MIN_ROWS) -> None:
        self.table = table
        self.topology = topology
        self.columnar = columnar
        self.min_columnar_rows = min_columnar_rows
        self._types = {c.name: c.type for c in table.columns}
        self._pk = table.primary_key
        self._encoders: list[tuple[str, Callable[[Any], bytes]]] | None = None
        self._encoder_of: dict[str, Callable[[Any], bytes]] | None = None

    def key(self, row: Row) -> bytes:
        return encode_primary_key([self._types[c] for c in self._pk], [row[c] for c in self._pk])

    def values(self, row: Row) -> tuple[bytes, ...]:
        """A full row's column values in the row form's encoding (NULL: empty)."""
        if self._encoders is None:
            self._encoders = [(c.name, value_encoder(c.type)) for c in self.table.columns]
        return tuple(b"" if (v := row.get(name)) is None else encode(v)
                     for name, encode in self._encoders)

    def partial_values(self, row: Row) -> tuple[tuple[str, ...], list[bytes]]:
        """A partial update's target columns (the row's, in its order) and their values
        in the row form's encoding (NULL: empty)."""
        if self._encoders is None:
            self._encoders = [(c.name, value_encoder(c.type)) for c in self.table.columns]
        if self._encoder_of is None:
            self._encoder_of = dict(self._encoders)
        encoders = self._encoder_of
        unknown = [name for name in row if name not in encoders]
        if unknown:
            raise EncodingError(f"{self.table.name} has no column {unknown[0]!r}")
        return tuple(row), [b"" if v is None else encoders[name](v) for name, v in row.items()]

    def updates(self, ts: int, *, deletes: Iterable[Row] = (), inserts: Iterable[Row] = (),
                replaces: Iterable[Row] = (), partials: Iterable[Row] = ()
                ) -> dict[str, list[pb.TableUpdateData]]:
        """node id -> TableUpdateData (one per virtual node) for one transaction at ``ts``.

        ``deletes`` need only the key columns; ``replaces`` are full rows sent
        as DELETE + INSERT; ``partials`` are partial updates: rows of their target
        columns only (every key column among them; docs/encoding.md, "Partial updates").
        """
        by_vnode: dict[int, _Stream] = {}
        routes: dict[bytes, int] = {}  # a replaced key is routed once, not twice

        def stream(key: bytes) -> _Stream:
            vnode = routes.get(key)
            if vnode is None:
                vnode = routes[key] = self.topology.vnode_of_key(key)
            if vnode not in by_vnode:
                by_vnode[vnode] = _Stream()
            return by_vnode[vnode]

        # Rows are taken in the order they always were (deletes, replaces; then inserts,
        # replaces), so a bad row is reported the same way; a replace's key is computed
        # once and each column's encoder resolved once.
        replaces = list(replaces)
        replaced_keys: list[bytes] = []
        for row in deletes:
            key = self.key(row)
            stream(key).deletes.append(key)
        for row in replaces:
            key = self.key(row)
            replaced_keys.append(key)
            stream(key).deletes.append(key)

        def insert(key: bytes, row: Row) -> None:
            s = stream(key)
            s.insert_keys.append(key)
            s.insert_values.append(list(self.values(row)))

        for row in inserts:
            insert(self.key(row), row)
        for key, row in zip(replaced_keys, replaces, strict=True):
            insert(key, row)
        for row in partials:
            key = self.key(row)
            stream(key).partials.append((key, *self.partial_values(row)))
        per_node: dict[str, list[pb.TableUpdateData]] = defaultdict(list)
        for vnode, s in sorted(by_vnode.items()):
            data = pb.TableUpdateData(table_name=self.table.name,
                                      primary_index_id=self.table.primary_index_id,
                                      timestamp=ts, virtual_node_id=vnode)
            fill_update(data, self.table, s.deletes, s.insert_keys, s.insert_values,
                        self.min_columnar_rows if self.columnar else ROW_FORM_ONLY,
                        s.partials)
            per_node[self.topology.node_of_vnode(vnode)].append(data)
        return dict(per_node)


# A partial update: its key, target columns and their values in the row form's encoding.
Partial = tuple[bytes, tuple[str, ...], list[bytes]]


def fill_update(data: pb.TableUpdateData, table: TableRecord, deletes: Sequence[bytes],
                insert_keys: Sequence[bytes], insert_values: Sequence[Sequence[bytes]],
                min_columnar_rows: int, partials: Sequence[Partial] = ()) -> None:
    """Put one update's deleted keys, inserted rows (values in the row form's encoding)
    and partial updates into ``data``: in the columnar form from ``min_columnar_rows``
    items on if the partial updates share their targets (the columnar form holds one
    target list), else, or if a value does not decode or a row is wider than ``table``,
    in the row form (the node then refreshes its table record, or refuses the row with
    the row form's message)."""
    items = len(deletes) + len(insert_keys) + len(partials)
    if items >= min_columnar_rows and len({p[1] for p in partials}) <= 1:
        try:
            rows = encode_insert_values(table, insert_values) if insert_values else b""
            partial_rows = _partial_rows(table, partials) if partials else b""
        except (EncodingError, ColumnarError):
            pass
        else:
            data.delete_keys_arrow = encode_delete_keys(deletes) if deletes else b""
            data.insert_rows_arrow = rows
            data.partial_rows_arrow = partial_rows
            return

    def index_key(key: bytes) -> pb.IndexKey:
        return pb.IndexKey(table_id=table.table_id, index_id=table.primary_index_id, key=key,
                           timestamp=data.timestamp)

    for key in deletes:
        data.delete_data.add().index_keys.append(index_key(key))
    for key, values in zip(insert_keys, insert_values, strict=True):
        item = data.insert_data.add()
        item.index_keys.append(index_key(key))
        item.col_values.extend(values)
    for key, targets, values in partials:
        partial = data.partial_data.add(target_columns=targets, col_values=values)
        partial.index_keys.append(index_key(key))


def _partial_rows(table: TableRecord, partials: Sequence[Partial]) -> bytes:
    """``partial_rows_arrow`` of partial updates that share their targets."""
    targets = partials[0][1]
    types = {c.name: c.type for c in table.columns}
    unknown = [name for name in targets if name not in types]
    if unknown:  # a column added since ``table`` was read: the row form, the node re-reads
        raise ColumnarError(f"{table.name} has no column {unknown[0]!r}")
    columns = [decode_column(types[name], values) for name, values in
               zip(targets, zip(*(p[2] for p in partials), strict=True), strict=True)]
    return encode_partial_rows(table, targets, columns)


@dataclass
class _Stream:
    """One virtual node's part of a transaction, before it is encoded."""

    deletes: list[bytes] = field(default_factory=list)
    insert_keys: list[bytes] = field(default_factory=list)
    insert_values: list[list[bytes]] = field(default_factory=list)
    partials: list[Partial] = field(default_factory=list)


def requests_by_node(schema: str, updates: Iterable[dict[str, list[pb.TableUpdateData]]]
                     ) -> dict[str, pb.UpdateRecordRequest]:
    """Merge several tables' updates into one request per node."""
    merged: dict[str, pb.UpdateRecordRequest] = {}
    for per_node in updates:
        for node, datas in per_node.items():
            request = merged.setdefault(node, pb.UpdateRecordRequest(schema_name=schema))
            request.table_update_data.extend(datas)
    return merged
