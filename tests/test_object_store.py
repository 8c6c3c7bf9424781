"""Storage on an S3-compatible object store (issue 11): listing, deleting and the removal
of old checkpoint bodies run the same code path as on a local directory, here against a
real S3 protocol endpoint (moto's server on loopback, a private bucket per test)."""

from __future__ import annotations

import subprocess
import sys
import uuid
from collections.abc import Iterator

import pyarrow.fs as pafs
import pytest

from devtools.cluster import free_ports
from retina_common.checkpoint_store import CheckpointStore
from retina_common.etcd import EtcdStore
from retina_common.storage import delete_object, list_objects, read_bytes, write_durably

from .support import eventually
from .test_checkpoint import NODE, TOPO, body

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def s3_endpoint() -> Iterator[str]:
    port = free_ports(1)[0]
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1",
                             "-p", str(port)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    endpoint = f"127.0.0.1:{port}"

    def up() -> bool:
        try:
            _fs(endpoint).get_file_info(pafs.FileSelector("", recursive=False))
            return True
        except OSError:
            return False
    try:
        eventually(up, 60, "the S3-compatible endpoint to answer")
        yield endpoint
    finally:
        proc.terminate()
        proc.wait(30)


def _fs(endpoint: str) -> pafs.S3FileSystem:
    return pafs.S3FileSystem(access_key="test", secret_key="test", region="us-east-1",
                             scheme="http", endpoint_override=endpoint,
                             allow_bucket_creation=True)


@pytest.fixture
def bucket_root(s3_endpoint: str, monkeypatch: pytest.MonkeyPatch) -> str:
    # Credentials the way an operator gives them to every process: the environment.
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "test")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "test")
    bucket = f"retina-{uuid.uuid4().hex[:10]}"
    _fs(s3_endpoint).create_dir(bucket)
    return f"s3://{bucket}/lake?endpoint_override={s3_endpoint}&scheme=http&region=us-east-1"


def test_objects_are_listed_and_deleted_on_an_s3_endpoint(bucket_root: str) -> None:
    assert list_objects(bucket_root) == []
    for name, size in (("a.parquet", 3), ("b.parquet", 5)):
        write_durably(bucket_root, name, b"x" * size)
    listed = list_objects(bucket_root)
    assert [(o.name, o.size) for o in listed] == [("a.parquet", 3), ("b.parquet", 5)]
    assert delete_object(bucket_root, "a.parquet") is True
    assert delete_object(bucket_root, "a.parquet") is False  # a repeated step
    assert [o.name for o in list_objects(bucket_root)] == ["b.parquet"]
    assert read_bytes(bucket_root, "b.parquet") == b"xxxxx"


def test_old_checkpoint_bodies_are_removed_on_an_s3_endpoint(bucket_root: str,
                                                             etcd: EtcdStore) -> None:
    store = CheckpointStore(etcd, NODE, bucket_root, TOPO)
    for checkpoint_id in range(1, 5):
        store.install(body(checkpoint_id))
    directory = f"{bucket_root.partition('?')[0]}/_checkpoints/{NODE.replace(':', '-')}" \
        f"?{bucket_root.partition('?')[2]}"
    names = [o.name for o in list_objects(directory)]
    assert names == [f"ckpt-{i:020d}.bin" for i in (3, 4)]  # install removes the rest
    stale, ahead = f"ckpt-{1:020d}.bin", f"ckpt-{99:020d}.bin"
    write_durably(directory, stale, b"left by a crash")
    write_durably(directory, ahead, b"an install under way")
    assert store.cleanup(dry_run=True) == [stale]
    assert stale in [o.name for o in list_objects(directory)]
    assert store.cleanup() == [stale]
    assert [o.name for o in list_objects(directory)] == \
        [f"ckpt-{i:020d}.bin" for i in (3, 4)] + [ahead]
    loaded = store.load()
    assert loaded is not None and loaded.body.header.checkpoint_id == 4
    assert store.slot_file_ids() == frozenset(f.file_id for f in body(4).files) | \
        frozenset(s.file_id for s in body(4).segments) | \
        frozenset(f.file_id for f in body(3).files) | frozenset(s.file_id for s in
                                                                body(3).segments)
