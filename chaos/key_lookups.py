"""Primary-key lookups in the campaign (issue 27): keys looked up in a read transaction
(``LookupRows`` through the client helper ``retina_common.lookup``, which routes keys to
their nodes and merges the answers), each answer compared with the full snapshot read in
the same transaction, and with the source.

Per episode (chaos/repeatable_reads.py calls it):

- **once healed**, in the episode image's transaction (every table and the application
  writer's, read whole, compared with the source and the writer's model): per table a
  sample of keys from the campaign's model: ``PRESENT`` keys the image holds,
  ``DELETED`` keys an earlier image held and this one does not (deleted since, or moved
  by a primary-key change), ``NEVER`` keys no workload statement can write (outside the
  key spaces of chaos/workload.py); every answer must agree with the image: found
  exactly when the image holds the key, with the same row (every column, by digest), at
  a commit timestamp at or below S; and with the source (the expected image), except
  for keys the writer's model leaves undecided;
- **AS OF**, now and then (``AS_OF_P``), in an AS OF transaction of chaos/as_of_reads.py
  that answered exactly: the keys looked up at that past point against its image;
- **during the fault**, after a workload write, in the transaction of the snapshot taken
  before the fault (still open): while a node is down the lookup of its keys must be
  refused, never answered wrongly; an answer must agree with that snapshot's image.

``judge`` is the rule; counts go to the report's ``lookups`` counter: ``lookups`` (calls),
``keys``, ``keys_<present|deleted|never>``, ``answered``, ``found``, ``refused_<CODE>``,
``wrong`` (keys), ``errors``, under the prefixes ``as_of_``, ``fault_down_`` and
``fault_up_``. A wrong answer is the anomaly ``lookup_wrong``; a refusal with a code
that does not refuse a read (``snapshots.is_refusal``: INTERNAL, INVALID_ARGUMENT, a
NOT_FOUND other than a forgotten transaction, no status at all) is ``lookup_error``.
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from retina_common.catalog import TableRecord
from retina_common.lookup import encode_keys
from retina_common.pb import trans_pb2 as tpb
from retina_common.reader import SnapshotReader

from .snapshots import (
    SPECS,
    Expected,
    ReadRefused,
    TableImage,
    is_refusal,
    refusal_of,
    row_digest,
)
from .workload import SCHEMA, Key, TableSpec

PRESENT = 6
DELETED = 3
NEVER = 2
AS_OF_P = 0.5
# Keys no workload statement writes: every integer key column shifted past its key space
# (the largest is 3000; int32 columns stay in range), every text one renamed.
NEVER_OFFSET = 1_000_000_000


@dataclass(frozen=True)
class Answer:
    """One key's answer: found or not, the row (column -> value) and its version's
    commit timestamp."""

    key: Key
    found: bool
    record: Mapping[str, Any] | None = None
    commit_ts: int = 0


# A lookup: (transaction, table, keys) -> one Answer per key, in order; raises ReadRefused.
Lookup = Callable[[tpb.BeginTransResponse, str, Sequence[Key]], list[Answer]]


def lookup_over(reader: SnapshotReader, tables: Mapping[str, TableRecord]) -> Lookup:
    """The campaign's Lookup through the client helper (retina_common/lookup.py) over
    ``reader``'s channels; ``tables``: the catalog's records (the key columns' types)."""
    helper = reader.key_lookup()

    def lookup(trans: tpb.BeginTransResponse, table: str, keys: Sequence[Key]
               ) -> list[Answer]:
        try:
            got = helper.get(SCHEMA, table, encode_keys(tables[table], keys), trans=trans)
        except Exception as exc:  # a status (a node away, expired), or anything else
            raise refusal_of(exc) from None
        return [Answer(key, bool(found), row, int(ts)) for key, found, row, ts in
                zip(keys, got.found.tolist(), got.by_key(), got.commit_ts.tolist(),
                    strict=True)]
    return lookup


def never_written(table: TableSpec, rng: random.Random) -> Key:
    """A key of ``table``'s shape that no workload statement can write."""
    return tuple(v + NEVER_OFFSET if isinstance(v, int) else f"never-{v}"
                 for v in table.key(rng))


def sample_keys(rng: random.Random, table: TableSpec, image: TableImage,
                seen: Iterable[Key]) -> list[tuple[str, Key]]:
    """(kind, key) to look up: present, deleted (seen before, not in ``image``), never."""
    present = sorted(image.rows, key=repr)
    deleted = sorted(set(seen) - image.rows.keys(), key=repr)
    picked = [("present", k) for k in rng.sample(present, min(PRESENT, len(present)))]
    picked += [("deleted", k) for k in rng.sample(deleted, min(DELETED, len(deleted)))]
    picked += [("never", never_written(table, rng)) for _ in range(NEVER)]
    return picked


def judge(key: Key, answer: Answer, image: TableImage, snapshot_ts: int,
          expected: TableImage | None = None, undecided: frozenset[Key] = frozenset()
          ) -> str:
    """What is wrong with ``answer`` for ``key`` ("" if nothing): against ``image`` (the
    full read in the same transaction) and ``expected`` (the source), unless undecided."""
    if answer.key != key:
        return f"answered for key {answer.key} when asked {key}"
    problem = _against(answer, image.rows.get(key, ()), snapshot_ts, "the snapshot")
    if problem or expected is None or key in undecided:
        return problem
    return _against(answer, expected.rows.get(key, ()), snapshot_ts, "the source")


def _against(answer: Answer, digests: tuple[bytes, ...], snapshot_ts: int,
             what: str) -> str:
    if not answer.found:
        return f"not found, {what} holds it" if digests else ""
    if not digests:
        return f"found, {what} does not hold it"
    if answer.record is None or row_digest(dict(answer.record)) not in digests:
        return f"found with other values than {what}: {dict(answer.record or {})}"
    if not 0 < answer.commit_ts <= snapshot_ts:
        return f"found at commit timestamp {answer.commit_ts}, not in (0, S={snapshot_ts}]"
    return ""


class KeyLookups:
    """One cluster's lookups: the keys seen per table (for deleted keys) and counts."""

    def __init__(self, lookup: Lookup, counts: Counter[str], anomalies: list[str],
                 all_ready: Callable[[], bool] = lambda: True) -> None:
        self.lookup = lookup
        self.counts = counts
        self.anomalies = anomalies
        self._all_ready = all_ready
        self.seen: dict[str, set[Key]] = {}

    def saw(self, images: Mapping[str, TableImage]) -> None:
        """Keys held by a snapshot the campaign read (the deleted keys of later ones)."""
        for table, image in images.items():
            self.seen.setdefault(table, set()).update(image.rows)

    def check(self, trans: tpb.BeginTransResponse, images: Mapping[str, TableImage],
              rng: random.Random, how: str,
              expected: Expected | None = None,
              prefix: str = "") -> None:
        """Look up a sample of every table's keys in ``trans`` (reading at
        ``trans.timestamp``); judge each answer against ``images`` (read in ``trans``)
        and ``expected``. Counts are named ``prefix`` + the plain names."""
        for table in sorted(images):
            picked = sample_keys(rng, SPECS[table], images[table], self.seen.get(table, ()))
            want, undecided = (expected or {}).get(table, (None, frozenset()))
            self._table(trans, table, picked, images[table], want, undecided, how, prefix)
        self.saw(images)

    def during_fault(self, trans: tpb.BeginTransResponse,
                     images: Mapping[str, TableImage], rng: random.Random, how: str) -> None:
        """Lookups in a transaction begun before the fault (its images read then), while
        the fault goes on: counted apart as ``fault_down_*`` when some node (or the
        TransServer) is away, ``fault_up_*`` otherwise."""
        down = not self._all_ready()
        self.check(trans, images, rng, f"{how} ({'a node away' if down else 'all READY'})",
                   prefix=f"fault_{'down' if down else 'up'}_")

    def _table(self, trans: tpb.BeginTransResponse, table: str,
               picked: list[tuple[str, Key]], image: TableImage, want: TableImage | None,
               undecided: frozenset[Key], how: str, prefix: str) -> None:
        counts = self.counts
        counts[f"{prefix}lookups"] += 1
        counts[f"{prefix}keys"] += len(picked)
        counts.update(f"{prefix}keys_{kind}" for kind, _ in picked)
        keys = [k for _, k in picked]
        try:
            answers = self.lookup(trans, table, keys)
        except ReadRefused as exc:
            counts[f"{prefix}refused_{exc.code}"] += 1
            if not is_refusal(exc):  # INTERNAL, INVALID_ARGUMENT, not a status...
                counts[f"{prefix}errors"] += 1
                self.anomalies.append(f"lookup_error: {table} at S={trans.timestamp} {how}: "
                                      f"{exc.code}: {exc.detail}")
            return
        counts[f"{prefix}answered"] += 1
        if len(answers) != len(keys):
            counts[f"{prefix}wrong"] += len(keys)
            self.anomalies.append(f"lookup_wrong: {table} {how}: {len(answers)} answers for "
                                  f"{len(keys)} keys")
            return
        wrong = []
        for (kind, key), answer in zip(picked, answers, strict=True):
            counts[f"{prefix}found"] += answer.found
            problem = judge(key, answer, image, trans.timestamp, want, undecided)
            if problem:
                wrong.append(f"{kind} key {key}: {problem}")
        if wrong:
            counts[f"{prefix}wrong"] += len(wrong)
            self.anomalies.append(f"lookup_wrong: {table} at S={trans.timestamp} {how}: "
                                  f"{'; '.join(wrong[:4])}")
