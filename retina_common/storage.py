"""Object storage access: a local directory or any URI pyarrow.fs understands.

Local writes follow the durability convention: write a temporary file, fsync,
rename into place, fsync the directory. An object store put is atomic.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import pyarrow.fs as pafs
import pyarrow.parquet as pq


def root_uri(root: str) -> str:
    """A storage root as a URI (plain paths become ``file://``)."""
    if "://" in root:
        return root.rstrip("/")
    return "file://" + str(Path(root).resolve())


def local_dir(path_uri: str) -> Path | None:
    """The local directory behind a path URI, or None for a remote file system."""
    if "://" not in path_uri:
        return Path(path_uri)
    fs, base = pafs.FileSystem.from_uri(path_uri)
    return Path(base) if isinstance(fs, pafs.LocalFileSystem) else None


def file_uri(path_uri: str, name: str) -> str:
    """``name`` under ``path_uri``; options of an object-store URI
    (``s3://bucket/dir?endpoint_override=...``) stay at the end."""
    base, sep, query = path_uri.partition("?")
    return base.rstrip("/") + "/" + name + sep + query


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


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
    _fsync_dir(directory)


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
        return pq.ParquetFile(str(directory / name))
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
