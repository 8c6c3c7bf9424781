"""The lifecycle key value: strict parsing (a malformed value means not READY)."""

from __future__ import annotations

import json

import pytest

from retina_common.lifecycle_record import (
    LifecycleRecord,
    LifecycleState,
    MalformedLifecycleValue,
)

NODE = "127.0.0.1:18890"


def valid(**changes: object) -> bytes:
    value = {"state": "READY", "node": NODE, "checkpointId": 3, "recoveryEpoch": 2,
             "tokenHash": "deadbeef", "updatedAtMs": 1_700_000_000_000}
    value.update(changes)
    return json.dumps(value).encode()


def test_round_trip() -> None:
    record = LifecycleRecord.parse(NODE, valid())
    assert record.state == LifecycleState.READY and record.checkpoint_id == 3
    assert LifecycleRecord.parse(NODE, record.to_json().encode()) == record
    assert LifecycleRecord.parse(NODE, valid(checkpointId=None, tokenHash="")).checkpoint_id is None


@pytest.mark.parametrize("raw, message", [
    (b"not json", "not JSON"),
    (b"[1, 2]", "not a JSON object"),
    (valid(state="ALMOST_READY"), "unknown state"),
    (valid(node="127.0.0.1:1"), "does not match the key"),
    (valid(updatedAtMs="soon"), "integers"),
    (valid(recoveryEpoch=True), "integers"),
    (valid(checkpointId="7"), "checkpointId"),
    (valid(tokenHash="secret-token-in-clear"), "tokenHash"),
    (json.dumps({"state": "READY", "node": NODE}).encode(), "missing fields"),
])
def test_malformed_values_are_refused(raw: bytes, message: str) -> None:
    with pytest.raises(MalformedLifecycleValue, match=message):
        LifecycleRecord.parse(NODE, raw)
