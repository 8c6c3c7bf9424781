"""The value of a Retina lifecycle key (docs/architecture.md, "etcd keys").

``{"state", "node", "checkpointId", "recoveryEpoch", "tokenHash", "updatedAtMs"}``.
Parsing is strict: a value that does not match exactly is *malformed*, and a
malformed value means "not READY" to every reader.

Freshness contract: a Retina node re-writes its value (same state, new
``updatedAtMs``) at least every ``lifecycle_ttl_s / 3`` seconds while its
lease is alive; a reader treats a value older than its ``stale_after_ms`` as
stale. This catches a writer that kept its lease but stopped making progress,
and a reader whose watch silently stopped delivering.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from enum import StrEnum


class LifecycleState(StrEnum):
    RECOVERING = "RECOVERING"
    READY = "READY"
    FAILED = "FAILED"


class MalformedLifecycleValue(ValueError):
    """The value is not a well-formed lifecycle record for its key."""


_TOKEN_HASH = re.compile(r"^[0-9a-f]{8}$")
_FIELDS = {"state", "node", "checkpointId", "recoveryEpoch", "tokenHash", "updatedAtMs"}


@dataclass(frozen=True)
class LifecycleRecord:
    state: LifecycleState
    node: str
    checkpoint_id: int | None
    recovery_epoch: int
    token_hash: str
    updated_at_ms: int

    def to_json(self) -> str:
        return json.dumps({
            "state": self.state.value,
            "node": self.node,
            "checkpointId": self.checkpoint_id,
            "recoveryEpoch": self.recovery_epoch,
            "tokenHash": self.token_hash,
            "updatedAtMs": self.updated_at_ms,
        }, separators=(",", ":"))

    @classmethod
    def parse(cls, node_id: str, raw: bytes) -> LifecycleRecord:
        """Parse the value stored under ``node_id``'s key; raise if malformed."""
        try:
            data = json.loads(raw)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise MalformedLifecycleValue(f"not JSON: {exc}") from None
        if not isinstance(data, dict):
            raise MalformedLifecycleValue("not a JSON object")
        missing = _FIELDS - data.keys()
        if missing:
            raise MalformedLifecycleValue(f"missing fields {sorted(missing)}")
        try:
            state = LifecycleState(data["state"])
        except ValueError:
            raise MalformedLifecycleValue(f"unknown state {data['state']!r}") from None
        if data["node"] != node_id:
            raise MalformedLifecycleValue(f"node field {data['node']!r} does not match the key")
        checkpoint_id = data["checkpointId"]
        if checkpoint_id is not None and not _is_int(checkpoint_id):
            raise MalformedLifecycleValue("checkpointId is not an integer or null")
        if not _is_int(data["recoveryEpoch"]) or not _is_int(data["updatedAtMs"]):
            raise MalformedLifecycleValue("recoveryEpoch/updatedAtMs must be integers")
        token_hash = data["tokenHash"]
        if not isinstance(token_hash, str) or (token_hash and not _TOKEN_HASH.match(token_hash)):
            raise MalformedLifecycleValue("tokenHash must be empty or 8 lowercase hex digits")
        return cls(state=state, node=node_id, checkpoint_id=checkpoint_id,
                   recovery_epoch=data["recoveryEpoch"], token_hash=token_hash,
                   updated_at_ms=data["updatedAtMs"])


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
