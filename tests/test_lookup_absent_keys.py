"""LookupRows of a batch none of whose keys the node holds (found by the fault campaign,
seed 2703, issue 27: every lookup of only absent keys on a node was refused INTERNAL,
``zip() argument 2 is longer than argument 1`` in row_lookup.RowLookup._read)."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from retina_common.lookup import encode_keys

from .dataplane import SCHEMA, DataPlane
from .test_recovery_protocol import order


@pytest.mark.integration
def test_a_batch_of_only_absent_keys_is_answered_not_found(
        make_plane: Callable[..., DataPlane]) -> None:
    plane = make_plane(nodes=1)
    plane.commit({"orders": {"inserts": [order(i) for i in range(5)]}})
    assert plane.reader is not None
    keys = encode_keys(plane.tables["orders"], [10_000, 10_001, 3])
    with plane.reader.transaction() as trans:
        absent = plane.reader.key_lookup().get(SCHEMA, "orders", keys[:2], trans=trans)
        mixed = plane.reader.key_lookup().get(SCHEMA, "orders", keys, trans=trans)
    assert absent.found.tolist() == [False, False] and absent.commit_ts.tolist() == [0, 0]
    assert absent.rows.num_rows == 0
    assert mixed.found.tolist() == [False, False, True]
