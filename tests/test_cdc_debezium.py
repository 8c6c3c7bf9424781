"""The connector with a Debezium-file source: a round trip, and malformed
events that must stop the connector with a clear error and apply nothing of
the offending transaction."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from collections.abc import Callable, Iterator
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest

from retina_common.catalog import Catalog
from retina_common.etcd import EtcdStore

from .cdc import CdcPlane, normalise
from .dataplane import DataPlane
from .support import ROOT, eventually

pytestmark = pytest.mark.integration

Model = dict[str, dict[bytes, dict[str, Any]]]


@pytest.fixture
def make_cdc(tmp_path: Path, etcd: EtcdStore, catalog: Catalog,
             catalog_dsn: str) -> Iterator[Callable[..., CdcPlane]]:
    made: list[CdcPlane] = []
    planes: list[DataPlane] = []

    def make(**settings: object) -> CdcPlane:
        plane = DataPlane(tmp_path / "plane", etcd, catalog, catalog_dsn, nodes=2)
        planes.append(plane)
        plane.start(recover=False)
        (tmp_path / "events").mkdir()
        made.append(CdcPlane(plane, None, tmp_path, source="debezium-file",
                             debezium_dir=str(tmp_path / "events"), **settings))
        return made[-1]

    yield make
    for cdc in made:
        cdc.cdc.kill9()
    for plane in planes:
        plane.stop(kill=True)


def change(table: str, op: str, before: dict | None, after: dict | None, txid: str,
           order: int) -> dict:
    return {"schema": {"type": "struct"}, "payload": {
        "before": before, "after": after, "op": op, "ts_ms": 1_700_000_000_000,
        "source": {"connector": "postgresql", "db": "src", "schema": "public", "table": table,
                   "ts_ms": 1_700_000_000_000, "lsn": order},
        "transaction": {"id": txid, "total_order": order, "data_collection_order": order}}}


def transaction(txid: str, events: list[dict]) -> list[dict]:
    return [{"status": "BEGIN", "id": txid, "event_count": None, "ts_ms": 1},
            *events,
            {"status": "END", "id": txid, "event_count": len(events), "ts_ms": 2,
             "data_collections": []}]


def workload(cdc: CdcPlane, count: int, seed: int = 3) -> tuple[list[dict], Model]:
    """Debezium messages for ``count`` random transactions, and the state they lead to."""
    rng = random.Random(seed)
    model: Model = {t: {} for t in cdc.plane.tables}
    orders = cdc.plane.writers["orders"]
    messages: list[dict] = []
    live: dict[int, dict] = {}
    next_id = 1
    for n in range(count):
        txid = f"tx{n}"
        events = []
        for i in range(rng.randint(1, 5)):
            if live and rng.random() < 0.3:
                key = rng.choice(sorted(live))
                before = live.pop(key)
                if rng.random() < 0.5:
                    events.append(change("orders", "d", before, None, txid, i))
                    model["orders"].pop(orders.key(before))
                    continue
                after = {**before, "id": next_id, "note": "moved"}  # a key change
                next_id += 1
                events.append(change("orders", "u", before, after, txid, i))
                model["orders"].pop(orders.key(before))
            else:
                after = {"id": next_id, "customer": f"c{rng.randint(1, 9)}",
                         "amount": f"{rng.randint(0, 99999) / 100:.2f}", "note": None}
                next_id += 1
                events.append(change("orders", "c", None, after, txid, i))
            live[after["id"]] = after
            model["orders"][orders.key(after)] = normalise("orders", after)
        messages.extend(transaction(txid, events))
    return messages, model


def write(path: Path, messages: list[dict]) -> None:
    with open(path, "a") as out:
        for message in messages:
            out.write(json.dumps(message) + "\n")


def test_debezium_round_trip(make_cdc: Callable[..., CdcPlane]) -> None:
    cdc = make_cdc()
    messages, model = workload(cdc, 60)
    events = Path(cdc.cdc.settings["debezium_dir"])
    write(events / "0001.json", messages[: len(messages) // 2])
    cdc.cdc.start()
    eventually(cdc.all_ready, 60, "both nodes READY")
    write(events / "0002.json", messages[len(messages) // 2:])
    cdc.converged(model)
    # A restart resumes after the committed position: nothing is applied twice.
    cdc.cdc.terminate()
    cdc.cdc.start()
    eventually(lambda: len(cdc.cdc.logged("cdc_start")) == 2, 30, "the restarted connector")
    assert cdc.cdc.logged("cdc_start")[-1]["resume_after"]
    extra = {"id": 10_000, "customer": "late", "amount": "5.00", "note": "after restart"}
    write(events / "0002.json", transaction("late", [change("orders", "c", None, extra,
                                                            "late", 0)]))
    model["orders"][cdc.plane.writers["orders"].key(extra)] = normalise("orders", extra)
    cdc.converged(model)


GOOD = {"id": 1, "customer": "a", "amount": "1.00", "note": None}
MALFORMED = {
    "unknown table": change("nosuch", "c", None, GOOD, "bad", 1),
    "missing key": change("orders", "c", None, {k: v for k, v in GOOD.items() if k != "id"},
                          "bad", 1),
    "schema mismatch": change("orders", "c", None, {**GOOD, "id": 2, "colour": "red"}, "bad", 1),
    "type mismatch": change("orders", "c", None, {**GOOD, "id": 2, "amount": "lots"}, "bad", 1),
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_malformed_event_stops_connector(make_cdc: Callable[..., CdcPlane], case: str) -> None:
    cdc = make_cdc()
    events = Path(cdc.cdc.settings["debezium_dir"])
    good = transaction("ok", [change("orders", "c", None, GOOD, "ok", 0)])
    # The offending transaction also carries a valid row: it must not be applied either.
    valid_in_bad = change("orders", "c", None, {**GOOD, "id": 3}, "bad", 0)
    write(events / "0001.json", good + transaction("bad", [valid_in_bad, MALFORMED[case]]))
    cdc.cdc.start()
    assert cdc.cdc.wait_exit(90) == 3, cdc.cdc.log_tail()
    stopped = cdc.cdc.logged("cdc_stopped_malformed")
    assert stopped and "bad" in stopped[-1]["error"], cdc.cdc.log_tail()
    key = cdc.plane.writers["orders"].key(GOOD)
    cdc.converged({"orders": {key: normalise("orders", {**GOOD, "amount": Decimal("1.00")})},
                   "events": {}})


@pytest.mark.parametrize(("override", "message"), [
    ({"RETINA__CDC__SOURCE": "kafka"}, "cdc.source: expected postgres or debezium-file"),
    ({"RETINA__CDC__SOURCE": "postgres"}, "cdc.source_dsn is required"),
    ({"RETINA__CDC__REPLAY_MODE": "scope"}, "cdc.replay_mode"),
    ({"RETINA__CDC__NO_SUCH_KEY": "1"}, "no_such_key"),
])
def test_bad_configuration_exits_2_with_the_setting_named(
        tmp_path: Path, override: dict[str, str], message: str) -> None:
    config = tmp_path / "retina.toml"
    (tmp_path / "topology.toml").write_text('virtual_nodes = 4\nnodes = ["127.0.0.1:1"]\n')
    config.write_text('topology_file = "topology.toml"\n[etcd]\nendpoints = ["127.0.0.1:1"]\n')
    result = subprocess.run([sys.executable, "-m", "cdc_client", "--config", str(config)],
                            cwd=ROOT, capture_output=True, text=True, timeout=60,
                            env={**os.environ, "RETINA__CDC__SOURCE_DSN": "", **override})
    assert result.returncode == 2, result.stderr
    assert message in result.stderr


def test_a_catalog_outage_is_never_an_unknown_table(catalog: Catalog,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """Only a table the catalog does not have makes an event malformed (exit 3); a
    catalog that is away is waited for and then is a crash (exit 1, a restart resumes).
    Found by the fault campaign (seed 101, episode 550)."""
    import cdc_client.connector_main as cdc_main
    from cdc_client.translate import MalformedChange
    from devtools.cluster import free_port
    from retina_common.catalog import CatalogUnavailable

    with pytest.raises(MalformedChange, match="unknown table"):
        cdc_main.table_map(catalog, "shop").table("public.nope", "test")
    monkeypatch.setattr(cdc_main, "CATALOG_LOOKUP_RETRY_S", 0.5)
    away = Catalog(f"host=127.0.0.1 port={free_port()} dbname=none user=postgres",
                   connect_timeout_s=1)
    with pytest.raises(CatalogUnavailable):
        cdc_main.table_map(away, "shop").table("public.orders", "test")
