"""Static Retina topology: expected nodes, virtual nodes, routing, topologyHash.

The topology file (TOML, the analogue of ``$PIXELS_HOME/etc/retina``)::

    virtual_nodes = 16
    nodes = ["127.0.0.1:18890", "127.0.0.1:18891"]

Routing is deterministic and documented in ``docs/routing.md``:

* a row goes to virtual node ``BLAKE2b-64(primary-key bytes) mod virtual_nodes``
  (the digest read as an unsigned big-endian integer);
* virtual node ``v`` belongs to ``sorted(nodes)[v mod len(nodes)]``.

``topology_hash`` is SHA-256 over a canonical JSON document of the sorted node
list, the virtual node count and the full vnode → node mapping; a checkpoint
or a recovery attempt under a different hash fails closed.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import numpy as np

from retina_common.config import (
    NO_CONFIG_GIVEN,
    Config,
    ConfigError,
    config_named,
    load_config,
    read_toml,
    split_host_port,
)


class TopologyError(ConfigError):
    """The topology file is missing or inconsistent."""


@dataclass(frozen=True)
class Topology:
    nodes: tuple[str, ...]
    virtual_nodes: int

    def __post_init__(self) -> None:
        if self.virtual_nodes < 1:
            raise TopologyError("virtual_nodes must be at least 1")
        if not self.nodes:
            raise TopologyError("the topology lists no Retina node")
        for node in self.nodes:
            try:
                split_host_port(node)
            except ConfigError as exc:
                raise TopologyError(f"bad node id: {exc}") from None
        if len(set(self.nodes)) != len(self.nodes):
            raise TopologyError("the topology lists a node twice")
        if self.virtual_nodes < len(self.nodes):
            raise TopologyError(
                f"{self.virtual_nodes} virtual nodes cannot cover {len(self.nodes)} nodes")
        object.__setattr__(self, "nodes", tuple(sorted(self.nodes)))

    def vnode_of_key(self, key: bytes) -> int:
        digest = hashlib.blake2b(key, digest_size=8).digest()
        return int.from_bytes(digest, "big") % self.virtual_nodes

    def vnodes_of_keys(self, keys: list[bytes]) -> np.ndarray:
        """``vnode_of_key`` of many keys (a bulk load's): the digests joined and read as
        one big-endian array, so only the hashing is a Python loop."""
        blake2b = hashlib.blake2b
        digests = b"".join([blake2b(k, digest_size=8).digest() for k in keys])
        return (np.frombuffer(digests, ">u8") % np.uint64(self.virtual_nodes)).astype(np.int32)

    def node_of_vnode(self, vnode: int) -> str:
        if not 0 <= vnode < self.virtual_nodes:
            raise ValueError(f"virtual node {vnode} out of range [0, {self.virtual_nodes})")
        return self.nodes[vnode % len(self.nodes)]

    def vnodes_of(self, node: str) -> tuple[int, ...]:
        if node not in self.nodes:
            raise ValueError(f"{node} is not in the topology")
        index = self.nodes.index(node)
        return tuple(range(index, self.virtual_nodes, len(self.nodes)))

    @cached_property
    def topology_hash(self) -> str:
        document = {
            "nodes": list(self.nodes),
            "virtualNodes": self.virtual_nodes,
            "mapping": [self.node_of_vnode(v) for v in range(self.virtual_nodes)],
        }
        canonical = json.dumps(document, sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(canonical.encode()).hexdigest()

    def to_toml(self) -> str:
        nodes = ", ".join(json.dumps(n) for n in self.nodes)
        return f"virtual_nodes = {self.virtual_nodes}\nnodes = [{nodes}]\n"


def load_topology(path: str | Path) -> Topology:
    p = Path(path)
    data = read_toml(p, "topology file", TopologyError)
    unknown = set(data) - {"virtual_nodes", "nodes"}
    if unknown:
        raise TopologyError(f"topology file {p}: unknown keys {sorted(unknown)}")
    nodes = data.get("nodes")
    vnodes = data.get("virtual_nodes")
    if not isinstance(nodes, list) or not all(isinstance(n, str) for n in nodes):
        raise TopologyError(f"topology file {p}: 'nodes' must be a list of host:port strings")
    if not isinstance(vnodes, int) or isinstance(vnodes, bool):
        raise TopologyError(f"topology file {p}: 'virtual_nodes' must be an integer")
    return Topology(nodes=tuple(nodes), virtual_nodes=vnodes)


def load_config_and_topology(path: str | os.PathLike[str] | None = None,
                             env: Mapping[str, str] | None = None) -> tuple[Config, Topology]:
    """The config (``path`` or ``$RETINA_CONFIG``, with environment overrides) and its
    topology, as every client of the cluster loads them. When nothing named a config and
    the default topology file is absent, the error says that no config was given (the
    missing file is only a consequence); a named config whose topology file is missing
    keeps the topology file's message."""
    env = os.environ if env is None else env
    config = load_config(path, env)
    try:
        return config, load_topology(config.topology_file)
    except TopologyError:
        if not config_named(path, env) and not Path(config.topology_file).exists():
            raise ConfigError(NO_CONFIG_GIVEN) from None
        raise
