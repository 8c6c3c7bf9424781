"""bench/bench_peers.py's oracle: the workload it generates and the model every system's
final table is compared with. A wrong model would pass a wrong system or fail a right one.
Pure logic, but for the last test, which runs the benchmark's Retina systems small."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from collections import Counter
from pathlib import Path
from types import ModuleType

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest

from .support import ROOT


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench_peers", ROOT / "bench" / "bench_peers.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def replay_every_change(changes: list) -> dict:
    table: dict = {}
    for key, row in changes:
        if row is None:
            table.pop(key, None)
        else:
            table[key] = tuple(row[c] for c in ("c1", "c2", "c3", "c4", "c5"))
    return table


def test_the_workload_has_the_asked_mix_and_only_touches_live_keys(bench: ModuleType) -> None:
    changes = bench.generate(20_000, seed=3)
    assert changes == bench.generate(20_000, seed=3)  # a fixed seed is the same workload
    live: set[int] = set()
    kinds: Counter[str] = Counter()
    for key, row in changes:
        if row is None:
            assert key in live, "a delete of a key that is not live"
            live.remove(key)
            kinds["delete"] += 1
        elif key in live:
            kinds["update"] += 1
        else:
            assert key > max(live, default=0), "an insert reuses a key"
            live.add(key)
            kinds["insert"] += 1
    assert abs(kinds["insert"] / 20_000 - 0.7) < 0.02
    assert abs(kinds["update"] / 20_000 - 0.2) < 0.02
    assert abs(kinds["delete"] / 20_000 - 0.1) < 0.02


@pytest.mark.parametrize("size", [1, 7, 100, 5000])
def test_collapsed_micro_batches_model_every_change_in_order(bench: ModuleType,
                                                             size: int) -> None:
    changes = bench.generate(12_000, seed=11)
    batches = bench.micro_batches(changes, size)
    assert sum(b.changes for b in batches) == len(changes)
    for b in batches:  # MERGE and upsert refuse a key twice in one source
        keys = [r["id"] for r in b.upserts] + b.deletes
        assert len(keys) == len(set(keys))
    assert bench.model(batches) == replay_every_change(changes)
    # A prefix of the batches (a run stopped at its budget) models that prefix.
    half = len(batches) // 2
    applied = sum(b.changes for b in batches[:half])
    assert bench.model(batches[:half]) == replay_every_change(changes[:applied])


def test_the_peer_workload_file_holds_the_collapsed_batches(bench: ModuleType,
                                                           tmp_path: Path) -> None:
    batches = bench.micro_batches(bench.generate(3_000, seed=5), 250)
    bench.workload_file(batches, tmp_path / "w.parquet")
    table = pq.read_table(tmp_path / "w.parquet")
    assert table.column("batch").to_pylist() == sorted(table.column("batch").to_pylist())
    upserts = table.filter(pc.invert(table.column("deleted")))
    written = list(zip(*(upserts.column(c).to_pylist() for c in ("batch", "id", *bench.VALUES)),
                       strict=True))
    assert written == [(i, r["id"], *(r[c] for c in bench.VALUES))
                       for i, b in enumerate(batches) for r in b.upserts]
    assert sorted(table.filter(table.column("deleted")).column("id").to_pylist()) == sorted(
        k for b in batches for k in b.deletes)


def test_a_final_table_with_a_key_twice_is_never_equal(bench: ModuleType) -> None:
    """Two versions of one row (an old one a DELETE missed) must fail the comparison, not
    collapse into one dict entry."""
    batches = bench.micro_batches(bench.generate(500, seed=2), 100)
    rows = {k: v for k, v in bench.model(batches).items()}
    key, values = next(iter(rows.items()))
    ids = [*rows, key]
    columns = {"id": pa.array(ids, pa.int64())}
    for i, c in enumerate(bench.VALUES):
        columns[c] = pa.array([rows[k][i] for k in rows] + [values[i]])
    result = bench.Result("x", 100)
    bench.compare(result, lambda: bench.as_model(pa.table(columns)), batches)
    assert result.equal is False and f"e.g. [{key}]" in result.detail
    clean = bench.Result("x", 100)
    bench.compare(clean, lambda: dict(rows), batches)
    assert clean.equal is True


@pytest.mark.integration
def test_the_retina_configurations_run_end_to_end_and_end_equal_to_the_model(
        tmp_path: Path) -> None:
    """The benchmark's own Retina systems, small: a real cluster, the connector through
    its durable changelog and the direct client; every final table equal to the model.
    (The connector here once lacked a registered replay source, and every
    retina-changelog run failed.)"""
    out = tmp_path / "peers.json"
    done = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "bench_peers.py"), "--systems",
         "retina-direct,retina-changelog", "--rows", "3000", "--batch", "500", "--batch", "100",
         "--budget-s", "120", "--json", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    results = json.loads(out.read_text())["results"]
    assert {(r["system"], r["batch"]) for r in results} == {
        (system, batch) for system in ("retina-direct", "retina-changelog")
        for batch in (500, 100)}
    for r in results:
        assert r["equal"] is True and r["changes"] == 3000, r
