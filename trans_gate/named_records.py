"""Named records kept in etcd, one JSON value a key: the pins (pins.py) and the change-feed
consumers (consumers.py). Writes are create-only or whole-record puts; a write or delete
whose answer was lost is settled by reading the key back, never guessed."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import asdict
from typing import Generic, Protocol, TypeVar

import grpc

from retina_common.etcd import EtcdOutcomeUnknown, EtcdStore, EtcdUnavailable
from retina_common.refusal import Refusal

RECORD_NAME = re.compile(r"^[A-Za-z0-9._-]{1,128}$")


def check_name(what: str, name: str) -> None:
    if not RECORD_NAME.match(name):
        raise Refusal(grpc.StatusCode.INVALID_ARGUMENT,
                      f"{what} name {name!r}: 1..128 characters of A-Z a-z 0-9 . _ -")


class JsonRecord:
    """A frozen dataclass stored as its fields in compact JSON."""

    def to_json(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"))  # type: ignore[call-overload]


class Named(Protocol):
    @property
    def name(self) -> str: ...

    def to_json(self) -> str: ...


R = TypeVar("R", bound=Named)


class NamedRecords(Generic[R]):
    """The records under ``prefix``; ``parse(key, raw)`` raises on anything malformed
    (the caller's start refuses to guess)."""

    def __init__(self, store: EtcdStore, prefix: str, key_of: Callable[[str], str],
                 parse: Callable[[str, bytes], R], what: str) -> None:
        self._store = store
        self._prefix = prefix
        self._key_of = key_of
        self._parse = parse
        self._what = what

    def load(self) -> dict[str, R]:
        kvs, _revision = self._store.get_prefix(self._prefix)
        records = [self._parse(kv.key, kv.value) for kv in kvs]
        return {r.name: r for r in records}

    def create(self, record: R) -> R:
        """Create-only; returns the stored record (``record``, or the one of that name
        that was there: the caller compares)."""
        key = self._key_of(record.name)
        try:
            if self._store.compare_and_put(key, record.to_json(), 0) is not None:
                return record
        except EtcdOutcomeUnknown:
            pass  # re-read below: ours, another, or absent (not applied)
        kv = self._store.get(key)
        if kv is None:
            raise EtcdUnavailable(f"{key}: the {self._what} write did not land; retry")
        return self._parse(key, kv.value)

    def put(self, record: R) -> None:
        """Replace the record. EtcdOutcomeUnknown passes: the caller keeps its old state
        in memory and its client retries."""
        self._store.put(self._key_of(record.name), record.to_json())

    def delete(self, name: str) -> None:
        key = self._key_of(name)
        try:
            self._store.delete(key)
        except EtcdOutcomeUnknown:
            if self._store.get(key) is not None:
                raise EtcdUnavailable(f"{key}: the {self._what} delete did not land; "
                                      "retry") from None
