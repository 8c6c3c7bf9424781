"""Primary-key lookups in the fault campaign (chaos/key_lookups.py): which keys are
looked up and what an answer must agree with. Pure logic over fakes; the campaign itself
runs in tests/test_chaos.py's sample."""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Sequence

from chaos.key_lookups import (
    DELETED,
    NEVER,
    NEVER_OFFSET,
    PRESENT,
    Answer,
    KeyLookups,
    judge,
    never_written,
    sample_keys,
)
from chaos.snapshots import ReadRefused, TableImage
from chaos.workload import APP_TABLE, TABLES, Key
from retina_common.pb import trans_pb2 as tpb

from .chaos_fakes import image

INT32_MAX = 2**31 - 1


def test_never_written_keys_lie_outside_every_key_space_and_fit_their_columns() -> None:
    rng = random.Random(5)
    for table in (*TABLES, APP_TABLE):
        written = {table.key(rng) for _ in range(2000)}
        for _ in range(50):
            key = never_written(table, rng)
            assert key not in written and len(key) == len(table.pk)
            for value in key:
                assert (isinstance(value, str) and value.startswith("never-")) or \
                    NEVER_OFFSET < value <= INT32_MAX


def test_a_sample_holds_present_deleted_and_never_written_keys() -> None:
    table = TABLES[0]
    now = image(*({"id": i, "v": "a"} for i in range(1, 20)))
    seen = {(i,) for i in range(1, 40)}
    picked = sample_keys(random.Random(1), table, now, seen)
    kinds = Counter(kind for kind, _ in picked)
    assert kinds == {"present": PRESENT, "deleted": DELETED, "never": NEVER}
    assert all(key in now.rows for kind, key in picked if kind == "present")
    assert all(key in seen and key not in now.rows for kind, key in picked
               if kind == "deleted")
    empty = sample_keys(random.Random(1), table, image(), set())
    assert Counter(kind for kind, _ in empty) == {"never": NEVER}


ROW = {"id": 1, "v": "a"}
SNAP = image(ROW)


def test_an_answer_must_agree_with_the_snapshot_read_in_its_transaction() -> None:
    assert judge((1,), Answer((1,), True, ROW, 7), SNAP, 9) == ""
    assert judge((2,), Answer((2,), False), SNAP, 9) == ""
    assert judge((1,), Answer((1,), False), SNAP, 9) == "not found, the snapshot holds it"
    assert judge((2,), Answer((2,), True, {"id": 2, "v": "b"}, 3), SNAP, 9) == \
        "found, the snapshot does not hold it"
    assert judge((1,), Answer((1,), True, {"id": 1, "v": "b"}, 3), SNAP, 9).startswith(
        "found with other values than the snapshot")
    # A NULL column is left out of the digest either way.
    assert judge((1,), Answer((1,), True, {**ROW, "x1": None}, 3), SNAP, 9) == ""
    assert judge((1,), Answer((1,), True, ROW, 10), SNAP, 9) == \
        "found at commit timestamp 10, not in (0, S=9]"
    assert judge((1,), Answer((1,), True, ROW, 0), SNAP, 9).startswith("found at commit")
    assert judge((1,), Answer((2,), False), SNAP, 9) == "answered for key (2,) when asked (1,)"


def test_an_answer_must_agree_with_the_source_unless_the_model_leaves_it_undecided() -> None:
    source = image({"id": 1, "v": "new"})
    assert judge((1,), Answer((1,), True, ROW, 5), SNAP, 9, source).startswith(
        "found with other values than the source")
    assert judge((1,), Answer((1,), True, ROW, 5), SNAP, 9, source, frozenset({(1,)})) == ""


class _Lookup:
    """LookupRows over dicts: S -> table -> key -> (record, commit ts); or a refusal."""

    def __init__(self, rows: dict[Key, dict[str, object]], refuse: str = "") -> None:
        self.rows = rows
        self.refuse = refuse
        self.calls: list[tuple[int, str, list[Key]]] = []

    def __call__(self, trans: tpb.BeginTransResponse, table: str,
                 keys: Sequence[Key]) -> list[Answer]:
        self.calls.append((trans.timestamp, table, list(keys)))
        if self.refuse:
            raise ReadRefused(self.refuse, "a node is down")
        return [Answer(k, k in self.rows, self.rows.get(k), 4 if k in self.rows else 0)
                for k in keys]


def test_lookups_are_counted_and_a_wrong_answer_is_reported_with_its_keys() -> None:
    images = {"accounts": TableImage.of([{"id": i, "v": "a"} for i in range(1, 9)], ("id",))}
    lookup = _Lookup({(i,): {"id": i, "v": "a"} for i in range(1, 9)})
    anomalies: list[str] = []
    lookups = KeyLookups(lookup, Counter(), anomalies)
    trans = tpb.BeginTransResponse(trans_id=1, timestamp=9)
    lookups.check(trans, images, random.Random(2), "once healed")
    assert anomalies == [] and lookups.counts["answered"] == 1
    assert lookups.counts["keys"] == PRESENT + NEVER and lookups.counts["found"] == PRESENT
    # Key 3 deleted since: looked up as a deleted key, still answered found.
    later = {"accounts": TableImage.of([{"id": i, "v": "a"} for i in range(4, 9)], ("id",))}
    lookups.check(trans, later, random.Random(2), "once healed")
    (text,) = anomalies
    assert text.startswith("lookup_wrong: accounts at S=9 once healed: deleted key")
    assert "found, the snapshot does not hold it" in text and lookups.counts["wrong"] >= 1


def test_lookups_during_a_fault_may_be_refused_and_are_counted_by_the_nodes_state() -> None:
    images = {"accounts": image(ROW)}
    anomalies: list[str] = []
    down = KeyLookups(_Lookup({}, refuse="UNAVAILABLE"), Counter(), anomalies,
                      all_ready=lambda: False)
    down.during_fault(tpb.BeginTransResponse(trans_id=1, timestamp=9), images,
                      random.Random(1), "in the before-fault transaction")
    assert anomalies == [] and down.counts["fault_down_refused_UNAVAILABLE"] == 1
    up = KeyLookups(_Lookup({}), Counter(), anomalies)
    up.during_fault(tpb.BeginTransResponse(trans_id=1, timestamp=9), images,
                    random.Random(1), "in the before-fault transaction")
    (text,) = anomalies  # key 1 not found, but the snapshot holds it
    assert text.startswith("lookup_wrong: accounts at S=9 in the before-fault transaction "
                           "(all READY): present key (1,): not found")
    assert up.counts["fault_up_wrong"] == 1
