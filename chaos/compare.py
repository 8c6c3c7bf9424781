"""Compare every table's gated snapshot with the source tables, and the tables the
campaign keeps a model of with it: the application writer's (``chaos/app_model.py``),
the bulk loader's (``chaos/bulk_loads.py``) and the wide table the routed sources fill
(``chaos/wide.py``)."""

from __future__ import annotations

import json
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Protocol

import grpc
import psycopg2
import pyarrow as pa

from retina_common.etcd import EtcdError, EtcdStore
from retina_common.keys import cdc_position_key
from retina_common.pb import trans_pb2 as tpb
from retina_common.reader import SnapshotReader
from retina_common.topology import Topology

from .snapshots import Expected, TableImage
from .workload import SCHEMA, Key, Row, TableSpec, current_tables, normalise, source_rows


class FastSnapshotReader(SnapshotReader):
    """``SnapshotReader`` whose per-file reads (a QueryVisibility call and a Parquet read
    each) run in parallel: with tiny ingest files a table has many. Every other step, and
    the snapshot's assembly, is ``SnapshotReader``'s own, so its rules stay in one place."""

    def __init__(self, trans_address: str, topology: Topology, timeout_s: float = 30,
                 workers: int = 8) -> None:
        super().__init__(trans_address, topology, timeout_s)
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="chaos-read")

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        super().close()

    def read_files(self, files: Sequence[tpb.QueryFile],
                   trans: tpb.BeginTransResponse) -> list[pa.Table]:
        futures = [self._pool.submit(self.read_file, f, trans) for f in files]
        try:
            return [f.result() for f in futures]
        except BaseException:
            # Refused (a folded or restarted node): the reads still queued would only
            # delay the next read.
            for f in futures:
                f.cancel()
            raise


@dataclass
class TableDiff:
    rows: int = 0  # rows in the source
    lost: int = 0  # in the source, not in the snapshot
    duplicated: int = 0  # extra copies of a key in the snapshot
    phantom: int = 0  # in the snapshot, not in the source
    mismatched: int = 0  # same key, other values
    # Keys that may hold any one of several values (a model's undecided transactions), and
    # of them those found holding a value other than the expected one (undecided applied).
    undecided: int = 0
    undecided_applied: int = 0
    examples: list[str] = field(default_factory=list)

    @property
    def clean(self) -> bool:
        return not (self.lost or self.duplicated or self.phantom or self.mismatched)


@dataclass
class Comparison:
    tables: dict[str, TableDiff]
    error: str = ""  # the snapshot could not be read at all

    @property
    def clean(self) -> bool:
        return not self.error and all(d.clean for d in self.tables.values())

    def total(self, attr: str) -> int:
        return sum(getattr(d, attr) for d in self.tables.values())


class ModelTable(Protocol):
    """A table compared with a model kept by the campaign instead of the source."""

    table: TableSpec

    def expected(self) -> tuple[dict[Key, Row], dict[Key, frozenset[Row | None]]]: ...


def diff_table(table: TableSpec, want: dict[Key, Row], got_rows: list[Row],
               either: Mapping[Key, frozenset[Row | None]] | None = None) -> TableDiff:
    """``got_rows`` against ``want``; a key of ``either`` may instead hold any one of its
    values (None: absent), whatever ``want`` says of it."""
    either = either or {}
    width = len(table.pk)
    counts = Counter(r[:width] for r in got_rows)
    got = {r[:width]: r for r in got_rows}
    diff = TableDiff(rows=len(want))
    diff.duplicated = sum(c - 1 for c in counts.values() if c > 1)
    for key, row in want.items():
        if key in either:
            continue
        if key not in got:
            diff.lost += 1
            _example(diff, f"lost {key}")
        elif got[key] != row:
            diff.mismatched += 1
            _example(diff, f"mismatch {key}: source {row} snapshot {got[key]}")
    for key in got.keys() - want.keys() - either.keys():
        diff.phantom += 1
        _example(diff, f"phantom {key}")
    for key, allowed in either.items():
        _diff_either(diff, key, allowed, got.get(key))
        diff.undecided += 1
        diff.undecided_applied += got.get(key) != want.get(key)
    for key, c in counts.items():
        if c > 1:
            _example(diff, f"duplicate {key} x{c}")
    return diff


def _diff_either(diff: TableDiff, key: Key, allowed: frozenset[Row | None],
                 have: Row | None) -> None:
    if have in allowed:
        return
    if have is None:
        diff.lost += 1
        _example(diff, f"lost {key} (one of {sorted(map(str, allowed))})")
    elif allowed == {None}:
        diff.phantom += 1
        _example(diff, f"phantom {key}")
    else:
        diff.mismatched += 1
        _example(diff, f"mismatch {key}: one of {sorted(map(str, allowed))} expected, "
                       f"snapshot {have}")


def _example(diff: TableDiff, text: str) -> None:
    if len(diff.examples) < 5:
        diff.examples.append(text)


def snapshot_rows(reader: SnapshotReader, table: TableSpec) -> list[Row]:
    """The snapshot's rows in the order of ``table.all_columns``. A column the source
    added but the Retina table does not have reads NULL: the connector adds it when the
    first change that carries it arrives, and until then the source holds NULL in it for
    every row (it was added nullable, without a default)."""
    cols = table.all_columns
    snap = reader.read(SCHEMA, table.name).table
    if snap.num_rows == 0:
        return []
    present = [c for c in cols if c in snap.column_names]
    return widen(snap.select(present).to_pylist(), cols)


def widen(records: list[dict[str, Any]], cols: tuple[str, ...]) -> list[Row]:
    """Records as rows over ``cols``, NULL where a record lacks a column."""
    return [normalise(tuple(r.get(c) for c in cols)) for r in records]


def compare_once(reader: SnapshotReader, source: Callable[[], Any],
                 models: Sequence[ModelTable] = ()) -> Comparison:
    """Every source table, then every table ``models`` keep, against a gated snapshot."""
    tables: dict[str, TableDiff] = {}
    try:
        current = current_tables(source())
    except psycopg2.Error as exc:
        return Comparison(tables, f"source columns: {exc}".strip())
    for table in current:
        try:
            want = source_rows(source(), table)
        except psycopg2.Error as exc:  # the source is just back from an outage
            return Comparison(tables, f"source {table.name}: {exc}".strip())
        try:
            got = snapshot_rows(reader, table)
        except grpc.RpcError as exc:
            return Comparison(tables, f"{table.name}: {exc.code().name}: {exc.details()}")
        tables[table.name] = diff_table(table, want, got)
    for model in models:
        try:
            want, either = model.expected()
        except (psycopg2.Error, ValueError) as exc:  # the wide model asks the source
            return Comparison(tables, f"model of {model.table.name}: {exc}".strip())
        try:
            got = snapshot_rows(reader, model.table)
        except grpc.RpcError as exc:
            return Comparison(tables, f"{model.table.name}: {exc.code().name}: "
                                      f"{exc.details()}")
        tables[model.table.name] = diff_table(model.table, want, got, either)
    return Comparison(tables)


def image_of(table: TableSpec, rows: Mapping[Key, Row]) -> TableImage:
    """Rows over ``table.all_columns`` as a snapshot's image (chaos/snapshots.py)."""
    return TableImage.of((dict(zip(table.all_columns, row, strict=True))
                          for row in rows.values()), table.pk)


def expected_images(source: Callable[[], Any], models: Sequence[ModelTable] = ()
                    ) -> Expected:
    """What a snapshot must hold now, as images: every source table (nothing undecided),
    then every table ``models`` keep, with the keys they leave undecided. Raises
    psycopg2.Error when the source does not answer."""
    out: Expected = {}
    for table in current_tables(source()):
        out[table.name] = (image_of(table, source_rows(source(), table)), frozenset())
    for model in models:
        want, either = model.expected()
        out[model.table.name] = (image_of(model.table, want), frozenset(either))
    return out


def lsn(text: str) -> int:
    high, _, low = text.partition("/")
    return (int(high, 16) << 32) | int(low, 16)


def committed_lsn(etcd: EtcdStore, connector: str) -> int:
    """The connector's committed source position (0 if none or unreadable)."""
    try:
        kv = etcd.get(cdc_position_key(connector))
    except EtcdError:
        return 0
    if kv is None:
        return 0
    try:
        return position_lsn(str(json.loads(kv.value)["position"]))
    except (ValueError, KeyError):
        return 0


def position_lsn(position: str) -> int:
    """A committed position's LSN. An initial snapshot chunk's position
    (``snapshot:<consistent point>:<chunk>:<json>``) counts as its consistent point: the
    snapshot holds every transaction committed before it. A connector killed before its
    first chunk committed takes a new snapshot whose consistent point lies past the
    episode's marker; the stream has nothing to commit beyond it until the next writes,
    so without this the connector would never seem to catch up. While the snapshot's
    later chunks are still on their way the comparison keeps polling until equal."""
    if position.startswith("snapshot:"):
        return lsn(position.split(":")[1])
    return lsn(position)


def wait_caught_up(etcd: EtcdStore, connector: str, after_lsn: int, deadline: float,
                   alive: Callable[[], bool]) -> bool:
    """Wait until the committed position passes ``after_lsn`` (the WAL insert position
    read inside the episode's last source transaction, so its commit lies beyond it).
    False at the deadline or as soon as the connector is no longer ``alive``."""
    while time.monotonic() < deadline:
        if committed_lsn(etcd, connector) > after_lsn:
            return True
        if not alive():
            return False
        time.sleep(0.05)  # polling interval, bounded by the deadline
    return False


def converge(reader: SnapshotReader, source: Callable[[], Any], timeout_s: float,
             etcd: EtcdStore, connector: str, after_lsn: int, alive: Callable[[], bool],
             interval_s: float = 0.2, models: Sequence[ModelTable] = ()
             ) -> tuple[Comparison, float, bool]:
    """Wait for the connector to commit the last source transaction, then compare (the
    ``models``' tables too); poll the comparison until equal or the deadline (a
    difference is only an anomaly if it persists). Returns the last comparison, the
    seconds taken and whether the connector's committed position caught up."""
    started = time.monotonic()
    deadline = started + timeout_s
    caught_up = wait_caught_up(etcd, connector, after_lsn, deadline, alive)
    while True:
        result = compare_once(reader, source, models)
        if result.clean or time.monotonic() >= deadline or not alive():
            return result, time.monotonic() - started, caught_up
        time.sleep(interval_s)  # polling interval, bounded by the deadline
