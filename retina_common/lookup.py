"""Primary-key lookups from a client: route keys to their nodes, merge the answers.

    reader = SnapshotReader(trans_address, topology)
    lookup = reader.key_lookup()
    got = lookup.get("shop", "orders", encode_keys(table, [1, 2, 3]), columns=["note"])
    got.rows        # the found keys' rows, in the keys' order (the columns asked for)
    got.found       # one bool per key
    got.commit_ts   # per key, the commit timestamp of its row (0: not found)
    got.by_key()    # per key, its row as a dict, or None

Keys are primary-key bytes (docs/routing.md); :func:`encode_keys` builds them from key
values. Each key goes to the node that owns its virtual node, by the routing every
write uses (retina_common/topology.py); the requests to all nodes are in flight at
once, and the answers are merged back into the caller's key order.

The snapshot: pass a live gated read transaction (``trans``, e.g. one of
``SnapshotReader.transaction()``: lookups and snapshot reads in one transaction see
one snapshot), or none, and a read transaction is begun for the call and ended after
it (the newest snapshot the query gate grants). Refusals arrive as ``grpc.RpcError``
with the node's status (docs/data-plane.md, "Primary-key lookups"); a node that does
not answer raises :class:`retina_common.refusal.Unreachable`.
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from datetime import date, datetime
from decimal import Decimal, InvalidOperation
from typing import Any

import numpy as np
import pyarrow as pa

from retina_common.catalog import TableRecord
from retina_common.codec import EncodingError, encode_primary_key
from retina_common.pb import retina_pb2 as rpb
from retina_common.pb import retina_pb2_grpc
from retina_common.pb import trans_pb2 as tpb
from retina_common.refusal import reaching_node
from retina_common.topology import Topology

# Keys per LookupRows request (a node refuses more than its retina.max_rows_per_request).
KEYS_PER_REQUEST = 10_000


@dataclass(frozen=True)
class Lookup:
    """The answer for every key, in the order the keys were given."""

    keys: list[bytes]
    found: np.ndarray  # bool per key
    commit_ts: np.ndarray  # int64 per key: the commit timestamp of its row (0: not found)
    rows: pa.Table  # the found keys' rows, in key order
    timestamp: int  # the snapshot answered

    def by_key(self) -> list[dict[str, Any] | None]:
        """Per key, its row as a dict, or None."""
        rows = iter(self.rows.to_pylist())
        return [next(rows) if hit else None for hit in self.found.tolist()]


def encode_keys(table: TableRecord,
                keys: Iterable[Mapping[str, Any] | Sequence[Any] | Any]) -> list[bytes]:
    """Primary-key bytes of key values: each key a mapping with the key columns, a list or
    tuple of the key values in key order, or (a key of one column) the value itself.
    Raises EncodingError (a ValueError) for a key that does not fit the key columns."""
    names = table.primary_key
    by_name = {c.name: c.type for c in table.columns}
    types = [by_name[c] for c in names]
    out = []
    for key in keys:
        if isinstance(key, Mapping):
            missing = [c for c in names if c not in key]
            if missing:
                raise EncodingError(f"key {key} lacks the key column(s) {missing}")
            values = [key[c] for c in names]
        elif isinstance(key, list | tuple):
            values = list(key)
        else:
            values = [key]
        if len(values) != len(names):
            raise EncodingError(f"key {key!r} has {len(values)} values; the key is "
                                f"({', '.join(names)})")
        out.append(encode_primary_key(types, values))
    return out


def key_from_text(table: TableRecord, text: str) -> bytes:
    """One key given as text (a command line, a line of a file): a JSON object of the key
    columns, a JSON array of the key values in key order, or (a key of one column) its
    value as JSON or as plain text. Decimals, dates and timestamps may be strings
    (``"12.50"``, ``"2024-05-01"``, ``"2024-05-01T09:00:00+00:00"``), binary values
    are the UTF-8 bytes of a string. Raises EncodingError."""
    names = table.primary_key
    by_name = {c.name: c.type for c in table.columns}
    try:
        value: Any = json.loads(text)
    except json.JSONDecodeError:
        value = text
    if isinstance(value, dict):
        values = [value.get(c) for c in names]
    elif isinstance(value, list):
        values = value
    else:
        values = [text if by_name[names[0]] == "string" and len(names) == 1 else value]
    if len(values) != len(names):
        raise EncodingError(f"{text!r} has {len(values)} values; the key is "
                            f"({', '.join(names)})")
    return encode_primary_key([by_name[c] for c in names],
                              [_typed(by_name[c], v) for c, v in zip(names, values,
                                                                     strict=True)])


def _typed(type_name: str, value: Any) -> Any:
    """A JSON value as the codec takes it for ``type_name``."""
    try:
        if isinstance(value, str | int | float) and type_name.startswith("decimal"):
            return Decimal(str(value))
        if isinstance(value, str):
            if type_name == "binary":
                return value.encode()
            if type_name == "date32":
                return date.fromisoformat(value)
            if type_name == "timestamp_us":
                return datetime.fromisoformat(value)
        if type_name == "string" and isinstance(value, int | float) \
                and not isinstance(value, bool):
            return str(value)
    except (InvalidOperation, ValueError) as exc:
        raise EncodingError(f"{value!r} is not a {type_name} value: {exc}") from None
    return value


class KeyLookup:
    """Lookups over the nodes of ``topology``; ``node(address)`` gives a node's stub,
    ``begin()`` a gated read-only transaction for the length of a block."""

    def __init__(self, topology: Topology,
                 node: Callable[[str], retina_pb2_grpc.RetinaWorkerServiceStub],
                 begin: Callable[[], AbstractContextManager[tpb.BeginTransResponse]], *,
                 timeout_s: float = 30, keys_per_request: int = KEYS_PER_REQUEST) -> None:
        self._topology = topology
        self._node = node
        self._begin = begin
        self._timeout_s = timeout_s
        self._keys_per_request = keys_per_request

    def get(self, schema: str, table: str, keys: Sequence[bytes], *,
            columns: Sequence[str] = (), trans: tpb.BeginTransResponse | None = None
            ) -> Lookup:
        """The rows of ``keys`` (primary-key bytes) at ``trans``'s snapshot, or at a new
        read transaction's when none is given."""
        with self._snapshot(trans) as snapshot:
            return self._get(schema, table, list(keys), list(columns), snapshot)

    @contextmanager
    def _snapshot(self, trans: tpb.BeginTransResponse | None
                  ) -> Iterator[tpb.BeginTransResponse]:
        if trans is not None:
            yield trans
            return
        with self._begin() as begun:
            yield begun

    def _get(self, schema: str, table: str, keys: list[bytes], columns: list[str],
             trans: tpb.BeginTransResponse) -> Lookup:
        requests = []
        for node, positions in self._route(keys).items():
            for at in range(0, len(positions), self._keys_per_request):
                part = positions[at:at + self._keys_per_request]
                requests.append((node, part, rpb.LookupRowsRequest(
                    schema_name=schema, table_name=table, keys=[keys[i] for i in part],
                    columns=columns, trans_id=trans.trans_id, timestamp=trans.timestamp)))
        if len(requests) == 1:  # one node: no future to wait on
            node, part, request = requests[0]
            with reaching_node(node):
                reply = self._node(node).LookupRows(request, timeout=self._timeout_s)
            return merge_answers(keys, [(part, reply)], trans.timestamp)
        calls = [(node, part, self._node(node).LookupRows.future(request,
                                                                 timeout=self._timeout_s))
                 for node, part, request in requests]
        answers = []
        for node, part, future in calls:  # every request is in flight before the first wait
            with reaching_node(node):
                answers.append((part, future.result()))
        return merge_answers(keys, answers, trans.timestamp)

    def _route(self, keys: Sequence[bytes]) -> dict[str, np.ndarray]:
        """Key positions by owning node: the routing of every write."""
        vnode_of, node_of = self._topology.vnode_of_key, self._topology.node_of_vnode
        by_node: dict[str, list[int]] = defaultdict(list)
        for i, key in enumerate(keys):
            by_node[node_of(vnode_of(key))].append(i)
        return {n: np.array(p, np.int64) for n, p in sorted(by_node.items())}


def merge_answers(keys: list[bytes],
                  answers: list[tuple[np.ndarray, rpb.LookupRowsResponse]],
                  timestamp: int) -> Lookup:
    """The nodes' answers (each with the positions of its keys among ``keys``) in the
    caller's key order."""
    found = np.zeros(len(keys), bool)
    commit_ts = np.zeros(len(keys), np.int64)
    where, parts = [], []
    for part, reply in answers:
        hits = np.array(reply.found, bool)
        found[part] = hits
        commit_ts[part] = np.array(reply.commit_ts, np.int64)
        where.append(part[hits])
        parts.append(pa.ipc.open_stream(reply.rows_arrow).read_all())
    if not parts:
        return Lookup(keys, found, commit_ts, pa.table({}), timestamp)
    # A node whose table record predates an added column answers without it: NULL there.
    rows = pa.concat_tables(parts, promote_options="default") if len(parts) > 1 else parts[0]
    at = np.concatenate(where)
    if (at[1:] < at[:-1]).any():
        rows = rows.take(pa.array(np.argsort(at, kind="stable")))
    return Lookup(keys, found, commit_ts, rows, timestamp)
