"""The connector's committed position in etcd (cdc_client/positions.py), on a real etcd:
a second connector of the same name is fenced off, and a write of our own whose answer was
lost is never taken for one (seen in the campaign: etcd restarted under a position write,
the connector stopped with exit 3)."""

from __future__ import annotations

import pytest

from cdc_client.positions import CommittedPosition, ConnectorFenced, PositionStore
from retina_common.etcd import EtcdOutcomeUnknown, EtcdStore, EtcdUnavailable

pytestmark = pytest.mark.integration


class AnswersLost(EtcdStore):
    """The real etcd, with the next compare-and-put's answer lost after etcd applied it
    and the re-read after it failing, as when etcd restarts under the write
    (``lose_next``), or lost before etcd got it (``drop_next``)."""

    def __init__(self, endpoint: str) -> None:
        super().__init__([endpoint], timeout_s=5)
        self.lose_next = self.drop_next = False
        self._fail_get = False

    def compare_and_put(self, key: str, value: str | bytes, expected_mod_revision: int,
                        lease_id: int = 0) -> int | None:
        if self.drop_next:
            self.drop_next = False
            raise EtcdOutcomeUnknown("etcd /kv/txn timed out")
        revision = super().compare_and_put(key, value, expected_mod_revision, lease_id)
        if self.lose_next:
            self.lose_next, self._fail_get = False, True
            raise EtcdOutcomeUnknown("etcd /kv/txn: the client connection is closing")
        return revision

    def get(self, key: str):  # type: ignore[no-untyped-def]
        if self._fail_get:
            self._fail_get = False
            raise EtcdUnavailable("etcd unreachable: connection refused")
        return super().get(key)


def position(ts: int) -> CommittedPosition:
    return CommittedPosition(f"0/{ts:X}", ts, "postgres")


def stored(etcd: EtcdStore) -> CommittedPosition | None:
    return PositionStore(etcd, "c").load()


def test_a_second_connector_of_the_same_name_is_fenced(etcd: EtcdStore) -> None:
    first, second = PositionStore(etcd, "c"), PositionStore(etcd, "c")
    assert first.load() is None and second.load() is None
    first.store(position(10))
    with pytest.raises(ConnectorFenced):
        second.store(position(11))
    assert stored(etcd) == position(10)
    first.store(position(12))  # the first one goes on
    assert stored(etcd) == position(12)


def test_a_write_whose_answer_was_lost_is_not_taken_for_another_connector(
        etcd: EtcdStore) -> None:
    lossy = AnswersLost(etcd.endpoint)
    store = PositionStore(lossy, "c")
    store.load()
    store.store(position(10))
    lossy.lose_next = True
    # The connector's retry: EtcdUnavailable means "send the same store again".
    with pytest.raises(EtcdUnavailable):
        store.store(position(20))
    store.store(position(20))  # its own write is there: no fence
    assert stored(etcd) == position(20)
    store.store(position(30))  # and the revision it holds is the current one
    assert stored(etcd) == position(30)
    # A write whose outcome was unknown and that did not land (the key still at our
    # revision) is sent again, not taken for another connector's.
    lossy.drop_next = True
    store.store(position(35))
    assert stored(etcd) == position(35)
    other = PositionStore(etcd, "c")
    other.load()
    other.store(position(40))
    with pytest.raises(ConnectorFenced):  # while a real second writer is still fenced
        store.store(position(50))
    assert stored(etcd) == position(40)
