"""Object storage access: a local directory or any URI pyarrow.fs understands.

Local writes follow the durability convention: write a temporary file, fsync,
rename into place, fsync the directory. An object store put is atomic.
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pyarrow.fs as pafs
import pyarrow.parquet as pq


def root_uri(root: str) -> str:
    """A storage root as a URI (plain paths become ``file://``)."""
    if "://" in root:
        return root.rstrip("/")
    return "file://" + str(Path(root).resolve())


_LOCAL_FS = pafs.LocalFileSystem()


@functools.lru_cache(maxsize=4096)
def local_dir(path_uri: str) -> Path | None:
    """The local directory behind a path URI, or None for a remote file system.
    Cached: resolving a URI costs ~20 µs, and a node start opens every file of its
    checkpoint (10,000 in a few paths)."""
    if "://" not in path_uri:
        return Path(path_uri)
    fs, base = pafs.FileSystem.from_uri(path_uri)
    return Path(base) if isinstance(fs, pafs.LocalFileSystem) else None


def file_uri(path_uri: str, name: str) -> str:
    """``name`` under ``path_uri``; options of an object-store URI
    (``s3://bucket/dir?endpoint_override=...``) stay at the end."""
    base, sep, query = path_uri.partition("?")
    return base.rstrip("/") + "/" + name + sep + query


def split_file_uri(uri: str) -> tuple[str, str]:
    """The inverse of :func:`file_uri`: (directory URI with its options, name)."""
    base, sep, query = uri.partition("?")
    directory, _, name = base.rpartition("/")
    return directory + sep + query, name


def fsync_dir(directory: Path) -> None:
    """Make a rename or an unlink in ``directory`` durable."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def local_records(directory: Path, suffix: str) -> Iterator[tuple[str, bytes]]:
    """(name, bytes) of every ``*suffix`` file of a local journal directory, in name
    order. A leftover ``*.tmp`` is a write that never reached its rename: the step after
    it never started, so it is removed unread."""
    for path in sorted(directory.iterdir()):
        if path.name.endswith(".tmp"):
            path.unlink()
        elif path.name.endswith(suffix):
            yield path.name, path.read_bytes()


def write_durably(path_uri: str, name: str, data: bytes) -> None:
    directory = local_dir(path_uri)
    if directory is None:
        fs, path = pafs.FileSystem.from_uri(file_uri(path_uri, name))
        with fs.open_output_stream(path) as out:
            out.write(data)
        return
    directory.mkdir(parents=True, exist_ok=True)
    tmp = directory / f".{name}.tmp"
    with open(tmp, "wb") as out:
        out.write(data)
        out.flush()
        os.fsync(out.fileno())
    os.replace(tmp, directory / name)
    fsync_dir(directory)


def read_bytes(path_uri: str, name: str) -> bytes:
    directory = local_dir(path_uri)
    if directory is not None:
        return (directory / name).read_bytes()
    fs, path = pafs.FileSystem.from_uri(file_uri(path_uri, name))
    with fs.open_input_stream(path) as stream:
        return stream.read()


def open_parquet(path_uri: str, name: str) -> pq.ParquetFile:
    """A Parquet file opened for random access: reading its footer, or one column of
    one row group, reads only those bytes (never the whole object)."""
    directory = local_dir(path_uri)
    if directory is not None:
        # The file system given: a bare path string would be resolved to one again.
        return pq.ParquetFile(os.path.join(directory, name), filesystem=_LOCAL_FS)
    fs, path = pafs.FileSystem.from_uri(file_uri(path_uri, name))
    return pq.ParquetFile(fs.open_input_file(path))


def object_size(path_uri: str, name: str) -> int:
    """Size in bytes of a stored object (raises OSError if it is not there)."""
    directory = local_dir(path_uri)
    if directory is not None:
        return (directory / name).stat().st_size
    fs, path = pafs.FileSystem.from_uri(file_uri(path_uri, name))
    info = fs.get_file_info(path)
    if info.type != pafs.FileType.File:
        raise FileNotFoundError(file_uri(path_uri, name))
    return int(info.size)


def delete_quietly(path_uri: str, name: str) -> None:
    """Best-effort removal of an object and its temporary sibling."""
    directory = local_dir(path_uri)
    if directory is not None:
        for candidate in (directory / name, directory / f".{name}.tmp"):
            with contextlib.suppress(FileNotFoundError):
                candidate.unlink()
        return
    fs, path = pafs.FileSystem.from_uri(file_uri(path_uri, name))
    with contextlib.suppress(OSError):
        fs.delete_file(path)


@dataclass(frozen=True)
class StoredObject:
    name: str
    size: int
    mtime_ms: int | None  # None where the store does not say


def _filesystem(path_uri: str) -> tuple[pafs.FileSystem, str]:
    if "://" not in path_uri:
        return pafs.LocalFileSystem(), str(Path(path_uri).resolve())
    return pafs.FileSystem.from_uri(path_uri)  # URI options configure the file system


def list_objects(path_uri: str) -> list[StoredObject]:
    """The objects directly under ``path_uri`` (not recursive), through pyarrow.fs, so
    the same code lists a local directory and an S3-compatible bucket prefix. A
    directory that does not exist lists as empty."""
    fs, base = _filesystem(path_uri)
    selector = pafs.FileSelector(base, recursive=False, allow_not_found=True)
    out = []
    for info in fs.get_file_info(selector):
        if info.type != pafs.FileType.File:
            continue
        mtime = info.mtime_ns
        out.append(StoredObject(info.base_name, int(info.size or 0),
                                None if mtime is None else mtime // 1_000_000))
    return sorted(out, key=lambda o: o.name)


def delete_object(path_uri: str, name: str) -> bool:
    """Remove one object; True if it was there, False if it was already gone (a
    repeated sweep step). Any other failure raises OSError: the caller retries."""
    directory = local_dir(path_uri)
    if directory is not None:
        try:
            (directory / name).unlink()
        except FileNotFoundError:
            return False
        fsync_dir(directory)
        return True
    fs, path = pafs.FileSystem.from_uri(file_uri(path_uri, name))
    if fs.get_file_info(path).type == pafs.FileType.NotFound:
        return False
    fs.delete_file(path)
    return True
