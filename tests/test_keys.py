"""The fixed etcd keys of docs/architecture.md ("etcd keys") and the secret-hash convention."""

from __future__ import annotations

import hashlib

import pytest

from retina_common.keys import (
    checkpoint_slot_key,
    lifecycle_key,
    node_of_lifecycle_key,
)
from retina_common.log import token_hash


def test_lifecycle_key_round_trip() -> None:
    key = lifecycle_key("10.0.0.1:18890")
    assert key == "/pixels/retina/lifecycle/10.0.0.1:18890"
    assert node_of_lifecycle_key(key) == "10.0.0.1:18890"
    with pytest.raises(ValueError):
        node_of_lifecycle_key("/pixels/trans/x")


def test_checkpoint_slots_url_encode_the_node_id() -> None:
    assert checkpoint_slot_key("10.0.0.1:18890", "current") == \
        "/pixels/retina/recovery/checkpoint/10.0.0.1%3A18890/current"
    assert checkpoint_slot_key("h:1", "previous").endswith("/h%3A1/previous")
    with pytest.raises(ValueError):
        checkpoint_slot_key("h:1", "next")


def test_token_hash_is_an_eight_hex_prefix_and_never_the_token() -> None:
    token = "a-recovery-attempt-token"
    assert token_hash(token) == hashlib.sha256(token.encode()).hexdigest()[:8]
    assert token not in token_hash(token)
