"""Fixtures: private etcd and PostgreSQL servers on free loopback ports.

One etcd and one PostgreSQL server per test session (started exactly like
``retina-cluster`` starts them); every test gets a fresh catalog database and
an empty ``/pixels/`` key space. ``make_plane`` starts a data plane (a
TransServer and Retina nodes, tests/dataplane.py) with small blocks and files.

The ``integration`` marker: every test that starts a process (etcd, PostgreSQL,
a TransServer, a node, Spark, a CLI, any subprocess) carries it, and
``make test-fast`` runs the others. ``tests/process_guard.py`` keeps the marker
honest: an unmarked test that asks for a process fixture, or starts a process
itself, fails.
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
from .process_guard import pytest_runtest_call, pytest_runtest_setup  # noqa: F401 (hooks)
from .support import delete_prefix

# Test data (etcd's WAL, the nodes' LMDB/SQLite indexes, changelogs, Parquet files) on a
# tmpfs when there is one: an fsync there returns at once, where on a shared disk each
# costs milliseconds, and etcd and the indexes fsync every write. What the tests check
# survives it: a killed process leaves its writes in the page cache either way, and no
# test cuts the power. The processes the tests start inherit TMPDIR.
TMPFS = Path("/dev/shm")
if TMPFS.is_dir() and os.access(TMPFS, os.W_OK) and shutil.disk_usage(TMPFS).free > 2 << 30:
    tempfile.tempdir = str(TMPFS)
    os.environ["TMPDIR"] = str(TMPFS)
# Spark's JVMs (every job a test runs, and the in-process session) live for seconds: the
# client compiler alone and one GC thread cost them about a third less CPU than the
# server compiler's background compiles, on a machine of two cores. Same Spark, same jobs.
os.environ.setdefault("JAVA_TOOL_OPTIONS", "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC")


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
        dp.stop(kill=True)


@pytest.fixture(scope="session")
def spark() -> Iterator[object]:
    """One Spark session (local mode) for every test that runs Spark work in this process
    (the jobs run as operators run them start their own)."""
    from spark_jobs.common import spark_session

    session = spark_session("retina-tests", "local[2]",
                            {"spark.ui.enabled": "false", "spark.driver.memory": "1g"})
    yield session
    session.stop()


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
