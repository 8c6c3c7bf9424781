"""The etcd keys of docs/architecture.md ("etcd keys"), in one place."""

from __future__ import annotations

from urllib.parse import quote

LIFECYCLE_PREFIX = "/pixels/retina/lifecycle/"
CHECKPOINT_PREFIX = "/pixels/retina/recovery/checkpoint/"
# Exclusive upper bounds of every timestamp / transaction id ever reserved.
TRANS_TIMESTAMP_KEY = "/pixels/trans/timestamp/upper"
TRANS_ID_KEY = "/pixels/trans/transid/upper"
# History (trans_gate/history.py, pins.py, time_map.py, consumers.py; docs/history.md).
# The GC horizon: the largest safeGcTs ever handed out (a decimal integer).
GC_HORIZON_KEY = "/pixels/trans/history/horizon"
PIN_PREFIX = "/pixels/trans/history/pins/"
TIME_MAP_PREFIX = "/pixels/trans/history/timemap/"
CONSUMER_PREFIX = "/pixels/trans/history/consumers/"


def pin_key(name: str) -> str:
    """``/pixels/trans/history/pins/<url-encoded name>``: a named pin (JSON)."""
    return PIN_PREFIX + quote(name, safe="")


def consumer_key(name: str) -> str:
    """``/pixels/trans/history/consumers/<url-encoded name>``: a registered change-feed
    consumer and its cursor (JSON, trans_gate/consumers.py)."""
    return CONSUMER_PREFIX + quote(name, safe="")


def time_map_chunk_key(first_wall_ms: int) -> str:
    """``/pixels/trans/history/timemap/<first sample's wall ms, 16 digits>``: one chunk of
    the time map; zero-padded, so key order is time order."""
    return f"{TIME_MAP_PREFIX}{first_wall_ms:016d}"


def lifecycle_key(node_id: str) -> str:
    """``/pixels/retina/lifecycle/<host:port>`` (leased, written by the Retina node)."""
    return LIFECYCLE_PREFIX + node_id


def node_of_lifecycle_key(key: str) -> str:
    if not key.startswith(LIFECYCLE_PREFIX):
        raise ValueError(f"{key} is not a lifecycle key")
    return key[len(LIFECYCLE_PREFIX):]


def checkpoint_slot_key(node_id: str, slot: str) -> str:
    """``.../checkpoint/<url-encoded node id>/current`` or ``.../previous``."""
    if slot not in ("current", "previous"):
        raise ValueError(f"unknown checkpoint slot {slot}")
    return f"{CHECKPOINT_PREFIX}{quote(node_id, safe='')}/{slot}"


CDC_PREFIX = "/pixels/cdc/"


def cdc_position_key(connector: str) -> str:
    """``/pixels/cdc/<connector>/position``: the last committed source position
    and timestamp, CAS-fenced so two connectors of one name cannot interleave."""
    return f"{CDC_PREFIX}{quote(connector, safe='')}/position"


REPLAY_SOURCE_PREFIX = "/pixels/retina/writers/"


def replay_source_key(writer_id: str) -> str:
    """``/pixels/retina/writers/<url-encoded writer id>``: a registered replay source
    (retina_common/replay_sources.py), not leased: it outlives its writer's process."""
    return REPLAY_SOURCE_PREFIX + quote(writer_id, safe="")
