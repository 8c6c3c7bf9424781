"""Fixtures: private etcd and PostgreSQL servers on free loopback ports.

One etcd and one PostgreSQL server per test session (started exactly like
``retina-cluster`` starts them); every test gets a fresh catalog database and
an empty ``/pixels/`` key space. ``make_plane`` starts a data plane (a
TransServer and Retina nodes, tests/dataplane.py) with small blocks and files.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from devtools.cluster import (
    EtcdInstance,
    PostgresInstance,
    start_etcd,
    start_postgres,
    stop_postgres,
    terminate,
)
from retina_common import failpoints
from retina_common.catalog import Catalog
from retina_common.etcd import EtcdStore

from .dataplane import DataPlane
from .support import delete_prefix


@pytest.fixture(scope="session")
def base_dir() -> Iterator[Path]:
    # Not pytest's tmp_path: it is 0700 under root and the postgres user must
    # be able to reach its data directory.
    path = Path(tempfile.mkdtemp(prefix="retina-test-"))
    os.chmod(path, 0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="session")
def etcd_server(base_dir: Path) -> Iterator[EtcdInstance]:
    inst = start_etcd(base_dir / "etcd", base_dir / "etcd.log")
    yield inst
    terminate(inst.pid)


@pytest.fixture(scope="session")
def pg_server(base_dir: Path) -> Iterator[PostgresInstance]:
    inst = start_postgres(base_dir / "pg", base_dir / "postgres.log", durable=False)
    yield inst
    stop_postgres(inst.data_dir)


@pytest.fixture
def etcd(etcd_server: EtcdInstance) -> Iterator[EtcdStore]:
    store = EtcdStore([etcd_server.endpoint], timeout_s=5)
    delete_prefix(store, "/pixels/")
    yield store
    delete_prefix(store, "/pixels/")


@pytest.fixture
def catalog_dsn(pg_server: PostgresInstance) -> Iterator[str]:
    name = f"t_{uuid.uuid4().hex[:12]}"
    pg_server.create_database(name)
    yield pg_server.dsn(name)
    pg_server.drop_database(name)


@pytest.fixture
def catalog(catalog_dsn: str) -> Iterator[Catalog]:
    cat = Catalog(catalog_dsn)
    cat.bootstrap()
    yield cat
    cat.close()


@pytest.fixture
def make_plane(tmp_path: Path, etcd: EtcdStore, catalog: Catalog,
               catalog_dsn: str) -> Iterator[Callable[..., DataPlane]]:
    planes: list[DataPlane] = []

    def make(nodes: int = 1, failpoints: str = "", recover: bool = True,
             trans: dict[str, object] | None = None, **retina: object) -> DataPlane:
        dp = DataPlane(tmp_path / f"plane{len(planes)}", etcd, catalog, catalog_dsn,
                       nodes=nodes, retina={"block_rows": 16, "blocks_per_file": 2,
                                            "flush_interval_ms": 200, **retina}, trans=trans)
        planes.append(dp)
        return dp.start({n: failpoints for n in dp.nodes}, recover=recover)

    yield make
    for dp in planes:
        dp.stop()


@pytest.fixture
def failpoint_dir(tmp_path: Path) -> Path:
    """Where ``block`` failpoints announce hits and wait for their release."""
    directory = tmp_path / "failpoints"
    directory.mkdir(exist_ok=True)
    return directory


@pytest.fixture
def active_failpoints(failpoint_dir: Path) -> Iterator[callable]:
    """Enable failpoints in this test process; all are cleared afterwards."""

    def enable(spec: str) -> None:
        failpoints.load_from_env({failpoints.ENV_VAR: spec,
                                  failpoints.DIR_VAR: str(failpoint_dir)})

    yield enable
    failpoints.load_from_env({})
