"""Configuration, topology routing and file names (pure logic)."""

from __future__ import annotations

import os
import subprocess
import sys
from datetime import UTC, datetime
from pathlib import Path

import pytest

from retina_common import file_names
from retina_common.config import ConfigError, load_config
from retina_common.topology import (
    Topology,
    TopologyError,
    load_config_and_topology,
    load_topology,
)

from .support import ROOT


def test_config_file_then_environment_overrides(tmp_path: Path) -> None:
    path = tmp_path / "retina.toml"
    path.write_text('topology_file = "topo.toml"\n[trans]\nlisten = "127.0.0.1:1"\n'
                    'ts_block_size = 7\n[etcd]\nendpoints = ["a:1"]\n')
    env = {"RETINA__TRANS__TS_BLOCK_SIZE": "99", "RETINA__ETCD__ENDPOINTS": "a:1, b:2",
           "RETINA__GATE__RETINA_ENABLED": "false"}
    config = load_config(path, env)
    assert config.trans.listen == "127.0.0.1:1"
    assert config.trans.ts_block_size == 99
    assert config.etcd.endpoints == ("a:1", "b:2")
    assert config.gate.retina_enabled is False
    assert config.topology_file == str(tmp_path / "topo.toml")


@pytest.mark.parametrize("text, env, message", [
    ("[trans]\nlistn = 'x'\n", {}, "unknown setting trans.listn"),
    ("", {"RETINA__TRANS__NOPE": "1"}, "unknown setting trans.nope"),
    ("[trans]\nts_block_size = 'many'\n", {}, "trans.ts_block_size"),
    ("[gate]\nretina_enabled = 'perhaps'\n", {}, "gate.retina_enabled"),
    ("not toml = = =", {}, "not valid TOML"),
    ("[retina]\norphan_grace_ms = 1\n", {}, "orphan_grace_ms: 1 ms is below the minimum"),
    ("", {"RETINA__RETINA__ORPHAN_GRACE_MS": "3599999"}, "below the minimum orphan grace"),
    ("[retina]\ngc_job_nice = 20\n", {}, "gc_job_nice must be between 0 and 19, not 20"),
])
def test_config_refuses_unknown_or_malformed_settings(tmp_path: Path, text: str,
                                                      env: dict[str, str], message: str) -> None:
    path = tmp_path / "retina.toml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=message):
        load_config(path, env)


def test_missing_config_file_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "absent.toml", {})


def test_no_config_at_all_says_so_before_any_default_file(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # no topology.toml here: the defaults name nothing real
    with pytest.raises(ConfigError, match=r"^no config given: pass --config FILE or set "
                                          r"RETINA_CONFIG=FILE"):
        load_config_and_topology(None, {})


def test_a_named_config_whose_topology_is_missing_names_the_topology_file(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    config = tmp_path / "retina.toml"
    config.write_text('topology_file = "topo.toml"\n')
    for path, env in ((config, {}), (None, {"RETINA_CONFIG": str(config)}),
                      (None, {"RETINA__TOPOLOGY_FILE": str(tmp_path / "topo.toml")})):
        with pytest.raises(TopologyError, match=f"topology file {tmp_path / 'topo.toml'} "
                                                "does not exist"):
            load_config_and_topology(path, env)


@pytest.mark.parametrize("prog, module, args", [
    ("retina-gc", "retina_common.gc_cli", ["lineage"]),
    ("retina-admin", "retina_common.admin_cli", ["status"]),
    ("retina-query", "retina_common.reader", ["shop.orders"]),
    ("storage_gc", "spark_jobs.storage_gc", ["--schema", "shop", "--all-tables"]),
    ("snapshot_query", "spark_jobs.snapshot_query", ["--table", "shop.orders"]),
    ("changes_query", "spark_jobs.changes_query", ["--table", "shop.orders", "--from", "0"]),
    ("retina-write", "retina_common.write_cli", ["--writer", "w", "shop.orders", "--rows",
                                                 '[{"id": 1}]']),
])
@pytest.mark.integration
def test_every_cluster_cli_without_a_config_says_no_config_given(
        tmp_path: Path, prog: str, module: str, args: list[str]) -> None:
    env = {k: v for k, v in os.environ.items()
           if k != "RETINA_CONFIG" and not k.startswith("RETINA__")}
    env["PYTHONPATH"] = str(ROOT)  # run from an empty directory, as a newcomer might
    done = subprocess.run([sys.executable, "-m", module, *args], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert done.stderr.splitlines()[0].startswith(
        f"{prog}: no config given: pass --config FILE or set RETINA_CONFIG=FILE"), done.stderr


def test_routing_is_deterministic_and_covers_every_vnode() -> None:
    topo = Topology(("127.0.0.1:2", "127.0.0.1:1"), 8)
    assert topo.nodes == ("127.0.0.1:1", "127.0.0.1:2")
    assert [topo.node_of_vnode(v) for v in range(8)] == ["127.0.0.1:1", "127.0.0.1:2"] * 4
    assert topo.vnodes_of("127.0.0.1:2") == (1, 3, 5, 7)
    # BLAKE2b-64, big-endian, mod vnodes: pinned so that a change of the
    # documented hash cannot slip in unnoticed.
    assert topo.vnode_of_key(b"key-1") == int.from_bytes(
        __import__("hashlib").blake2b(b"key-1", digest_size=8).digest(), "big") % 8
    spread = {topo.vnode_of_key(f"k{i}".encode()) for i in range(200)}
    assert spread == set(range(8))


def test_topology_hash_changes_with_membership_and_vnodes() -> None:
    base = Topology(("127.0.0.1:1", "127.0.0.1:2"), 8)
    same = Topology(("127.0.0.1:2", "127.0.0.1:1"), 8)
    assert base.topology_hash == same.topology_hash
    assert base.topology_hash != Topology(("127.0.0.1:1", "127.0.0.1:3"), 8).topology_hash
    assert base.topology_hash != Topology(("127.0.0.1:1", "127.0.0.1:2"), 16).topology_hash


@pytest.mark.parametrize("text, message", [
    ("virtual_nodes = 4\nnodes = []\n", "no Retina node"),
    ("virtual_nodes = 1\nnodes = ['a:1', 'b:2']\n", "cannot cover"),
    ("virtual_nodes = 4\nnodes = ['a:1', 'a:1']\n", "twice"),
    ("virtual_nodes = 4\nnodes = ['nohostport']\n", "bad node id"),
    ("virtual_nodes = 0\nnodes = ['a:1']\n", "at least 1"),
    ("virtual_nodes = 4\nnodes = ['a:1']\nextra = 1\n", "unknown keys"),
])
def test_bad_topology_files_are_refused(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "topology.toml"
    path.write_text(text)
    with pytest.raises(TopologyError, match=message):
        load_topology(path)


def test_topology_round_trips_through_its_file(tmp_path: Path) -> None:
    topo = Topology(("10.0.0.2:7000", "10.0.0.1:7000"), 12)
    path = tmp_path / "topology.toml"
    path.write_text(topo.to_toml())
    assert load_topology(path) == topo


def test_file_names_embed_node_time_seq_vnode() -> None:
    created = datetime(2026, 3, 4, 5, 6, 7, tzinfo=UTC)
    name = file_names.make("my_host-a:18890", created, 42, 3)
    assert name == "my_host-a-18890_20260304050607_42_3.parquet"
    parsed = file_names.parse(name)
    assert (parsed.node_id, parsed.created_at, parsed.seq, parsed.vnode) == (
        "my_host-a:18890", created, 42, 3)
    assert file_names.created_at_ms(name) == int(created.timestamp() * 1000)


@pytest.mark.parametrize("name", [
    "x.parquet", "h-1_2026_1_1.parquet", "h-1_20261399000000_1_1.parquet",
    "h-1_20260101000000_a_1.parquet", "h_20260101000000_1_1.parquet", "h-1_20260101000000_1_1.pxl",
    # Fourteen digits, but not ASCII ones, or with a trailing newline: no file has that name.
    "h-1_\u0662\u0660\u0662\u0666\u0660\u0661\u0660\u0661\u0660\u0660\u0660\u0660\u0660\u0660_1_1.parquet",
    "h-1_20260101000000\n_1_1.parquet", "h-1_20260230000000_1_1.parquet",
    "h-1_20260101000060_1_1.parquet",
])
def test_unparsable_file_names_raise(name: str) -> None:
    with pytest.raises(ValueError):
        file_names.parse(name)
