"""Replay sources: every writer whose writes a crashed node can get back.

A Retina node keeps rows applied since its last checkpoint only in memory (the
write buffer); after a crash, recovery gets them back by replaying the durable
changelog of whoever wrote them. So a write is crash-safe only if its writer
logged it durably before sending it, and the log can be found at recovery. A
*replay source* is such a writer, registered in etcd under
``/pixels/retina/writers/<writer id>`` with the root of its changelog (the CDC
connector's format, ``retina_common/changelog.py``), so that any recovery driver
(the connector, ``retina-admin recover``, the Spark replay job) can replay it,
whether the writer's process is alive or not.

Invariants (checked by the node, ``retina_server/recovery/registered_writers.py``):

* **WRITES_HAVE_A_REPLAY_SOURCE**: an ordinary UpdateRecord names an ACTIVE
  registered writer (``writer_id``), or it is refused FAILED_PRECONDITION with
  nothing applied. Only ``retina.anonymous_writes = true`` (development, not
  crash-safe) lets an UpdateRecord without a writer id through.
* **EVERY_SOURCE_REPLAYED**: MarkReady names, in ``replayed_writers``, every
  ACTIVE replay source; otherwise it is refused FAILED_PRECONDITION and the node
  stays AWAITING_REPLAY. A source whose changelog is lost can only be taken out
  by an operator, who declares it GONE (``retina-admin writers gone``): its
  writes since the nodes' checkpoints are then lost on a crash, knowingly.

A registration is never deleted and a GONE writer never comes back: a writer id
names one changelog for ever. The record::

    {"writerId", "kind": "cdc"|"app"|"spark", "changelogRoot", "schema",
     "state": "ACTIVE"|"GONE", "registeredAtMs", "goneAtMs", "goneReason"}
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Mapping
from dataclasses import dataclass, replace
from enum import StrEnum

from retina_common import storage
from retina_common.etcd import EtcdOutcomeUnknown, EtcdStore
from retina_common.keys import REPLAY_SOURCE_PREFIX, replay_source_key

# A writer id goes into an etcd key, a log line and a storage path: keep it plain.
WRITER_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}$")
KINDS = ("cdc", "app", "spark")


class SourceState(StrEnum):
    ACTIVE = "ACTIVE"
    GONE = "GONE"


class ReplaySourceError(Exception):
    """A registration that cannot be made as asked (bad id, another root, GONE)."""


@dataclass(frozen=True)
class ReplaySource:
    writer_id: str
    kind: str
    changelog_root: str
    schema: str
    state: SourceState = SourceState.ACTIVE
    registered_at_ms: int = 0
    gone_at_ms: int = 0
    gone_reason: str = ""

    @property
    def active(self) -> bool:
        return self.state == SourceState.ACTIVE

    def to_json(self) -> str:
        return json.dumps({"writerId": self.writer_id, "kind": self.kind,
                           "changelogRoot": self.changelog_root, "schema": self.schema,
                           "state": self.state.value, "registeredAtMs": self.registered_at_ms,
                           "goneAtMs": self.gone_at_ms, "goneReason": self.gone_reason},
                          separators=(",", ":"))

    @classmethod
    def from_json(cls, data: bytes | str) -> ReplaySource:
        d = json.loads(data)
        return cls(writer_id=str(d["writerId"]), kind=str(d["kind"]),
                   changelog_root=str(d["changelogRoot"]), schema=str(d.get("schema", "")),
                   state=SourceState(d["state"]),
                   registered_at_ms=int(d.get("registeredAtMs", 0)),
                   gone_at_ms=int(d.get("goneAtMs", 0)),
                   gone_reason=str(d.get("goneReason", "")))


def check_writer_id(writer_id: str) -> str:
    if not WRITER_ID.match(writer_id):
        raise ReplaySourceError(
            f"writer id {writer_id!r} is not valid: 1-128 characters of letters, digits and "
            "'.', '_', ':', '-', starting with a letter or digit")
    return writer_id


def default_root(storage_root: str, writer_id: str) -> str:
    """An application writer's changelog: ``<storage.root>/_writers/<writer id>``, where
    every node and recovery driver can read it (a local directory only on one machine)."""
    return storage.file_uri(storage.root_uri(storage_root), f"_writers/{writer_id}")


def load(etcd: EtcdStore) -> dict[str, ReplaySource]:
    """Every registered replay source, ACTIVE or GONE, by writer id."""
    kvs, _revision = etcd.get_prefix(REPLAY_SOURCE_PREFIX)
    sources = (ReplaySource.from_json(kv.value) for kv in kvs)
    return {s.writer_id: s for s in sources}


def get(etcd: EtcdStore, writer_id: str) -> ReplaySource | None:
    kv = etcd.get(replay_source_key(writer_id))
    return None if kv is None else ReplaySource.from_json(kv.value)


def register(etcd: EtcdStore, writer_id: str, *, kind: str, changelog_root: str,
             schema: str, clock_ms: int | None = None) -> ReplaySource:
    """Register ``writer_id`` (create-if-absent), or confirm its registration.

    Idempotent for the same root and schema; refuses another root or schema (two
    changelogs under one id would make one of them never replayed) and a GONE writer."""
    check_writer_id(writer_id)
    if kind not in KINDS:
        raise ReplaySourceError(f"kind {kind!r} is not one of {', '.join(KINDS)}")
    root = storage.root_uri(changelog_root)
    wanted = ReplaySource(writer_id, kind, root, schema,
                          registered_at_ms=clock_ms if clock_ms is not None
                          else int(time.time() * 1000))
    while True:
        existing = get(etcd, writer_id)
        if existing is not None:
            return _confirm(existing, wanted)
        try:
            if etcd.compare_and_put(replay_source_key(writer_id), wanted.to_json(), 0):
                return wanted
        except EtcdOutcomeUnknown:
            pass  # the re-read above decides: our own record, or another's


def _confirm(existing: ReplaySource, wanted: ReplaySource) -> ReplaySource:
    if not existing.active:
        raise ReplaySourceError(
            f"writer {existing.writer_id} was declared GONE ({existing.gone_reason!r}); a "
            "writer id names one changelog for ever: register under a new id")
    if (existing.changelog_root, existing.schema) != (wanted.changelog_root, wanted.schema):
        raise ReplaySourceError(
            f"writer {existing.writer_id} is registered with changelog "
            f"{existing.changelog_root} (schema {existing.schema!r}), not "
            f"{wanted.changelog_root} (schema {wanted.schema!r}): one id, one changelog")
    return existing


def declare_gone(etcd: EtcdStore, writer_id: str, reason: str,
                 clock_ms: int | None = None) -> ReplaySource:
    """Take a writer out of recovery for good (its changelog is lost): nodes no longer
    wait for its replay, and refuse its writes. Idempotent."""
    if not reason.strip():
        raise ReplaySourceError("say why the writer is gone (--reason): it is kept "
                                "with the record for whoever reads it later")
    while True:
        kv = etcd.get(replay_source_key(writer_id))
        if kv is None:
            raise ReplaySourceError(f"writer {writer_id} is not registered")
        source = ReplaySource.from_json(kv.value)
        if not source.active:
            return source
        gone = replace(source, state=SourceState.GONE, gone_reason=reason.strip(),
                       gone_at_ms=clock_ms if clock_ms is not None else int(time.time() * 1000))
        try:
            if etcd.compare_and_put(replay_source_key(writer_id), gone.to_json(),
                                    kv.mod_revision):
                return gone
        except EtcdOutcomeUnknown:
            pass  # re-read: GONE now is our own write


def unreplayed(sources: Mapping[str, ReplaySource], replayed: set[str]) -> list[str]:
    """EVERY_SOURCE_REPLAYED: the ACTIVE sources a MarkReady did not replay."""
    return sorted(w for w, s in sources.items() if s.active and w not in replayed)
