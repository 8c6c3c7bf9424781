"""Snapshot reads: the exact content of a table at one gated snapshot timestamp.

The order of the steps is what makes the result exact while files are being
published concurrently:

1. begin a read-only transaction at the TransServer (the query gate);
2. GetWriteBuffer from every Retina node: rows of unpublished files visible
   at the snapshot, each tagged with its file id;
3. ListQueryFiles: the REGULAR files (gated, under the same transaction);
4. read each file, keep rows with ``_commit_ts <= snapshot`` that the owning
   node's QueryVisibility does not report deleted;
5. add the write-buffer rows whose file is *not* in the REGULAR list.

A file is dropped from a write buffer only after it became REGULAR, so a
row is in step 2 or in step 3 (or both, when the publish happened between
them, and then step 5 keeps one copy).

AS OF reads (docs/history.md) are the same steps in a transaction begun at a past
point (``as_of``: a timestamp, a wall-clock time or a pin): the current files hold
every row visible at any readable past snapshot (Storage GC drops only rows deleted
at or below the GC horizon). A point whose history is gone is refused
FAILED_PRECONDITION ``snapshot_expired`` (``refusal.earliest_readable`` reads the
earliest readable point from the details), never answered partially.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterable, Iterator, Sequence
from contextlib import closing, contextmanager
from dataclasses import dataclass

import grpc
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from retina_common import exit_codes, file_names
from retina_common.as_of_point import NEWEST, AsOf, BadPoint, format_ms, parse_as_of
from retina_common.catalog import Catalog, CatalogError, NotFound
from retina_common.change_reader import (
    CHANGE_TYPE,
    ORDINAL,
    SNAPSHOT,
    SOURCE_POSITION,
    BadCursor,
    ChangeFeedReader,
    ChangesExpired,
    decode_cursor,
    encode_cursor,
)
from retina_common.change_reader import COMMIT_TS as CHANGE_TS
from retina_common.client import channel
from retina_common.codec import COMMIT_TS, EncodingError
from retina_common.config import ConfigError, TlsConfig
from retina_common.consumer_client import ConsumerClient
from retina_common.lookup import KEYS_PER_REQUEST, KeyLookup, key_from_text
from retina_common.pb import retina_pb2 as rpb
from retina_common.pb import retina_pb2_grpc, trans_pb2_grpc
from retina_common.pb import trans_pb2 as tpb
from retina_common.refusal import earliest_readable, reaching_node, reaching_trans_server
from retina_common.schema_evolution import conform
from retina_common.storage import read_bytes
from retina_common.topology import Topology, load_config_and_topology

FILE_ID = "_file_id"
HIDDEN = (COMMIT_TS, FILE_ID)


@dataclass(frozen=True)
class Snapshot:
    table: pa.Table
    timestamp: int
    files_read: int
    buffer_rows: int


class SnapshotReader:
    def __init__(self, trans_address: str, topology: Topology, timeout_s: float = 30, *,
                 tls: TlsConfig | None = None) -> None:
        self._timeout = timeout_s
        self.topology = topology
        self._trans_address = trans_address
        self._trans_channel = channel(trans_address, tls)
        self._trans = trans_pb2_grpc.TransServiceStub(self._trans_channel)
        self._channels = {n: channel(n, tls) for n in topology.nodes}
        self._retina = {n: retina_pb2_grpc.RetinaWorkerServiceStub(c)
                        for n, c in self._channels.items()}

    def node(self, address: str) -> retina_pb2_grpc.RetinaWorkerServiceStub:
        """The stub of the node at ``address`` (one of the topology's)."""
        return self._retina[address]

    def key_lookup(self, keys_per_request: int = KEYS_PER_REQUEST) -> KeyLookup:
        """Primary-key lookups over this reader's channels and read transactions."""
        return KeyLookup(self.topology, self.node, self.transaction, timeout_s=self._timeout,
                         keys_per_request=keys_per_request)

    @property
    def trans(self) -> trans_pb2_grpc.TransServiceStub:
        """The TransServer's stub (this reader's channel)."""
        return self._trans

    def change_feed(self) -> ChangeFeedReader:
        """Change-feed reads over this reader's channels (retina_common/change_reader.py)."""
        return ChangeFeedReader(self.topology, self._trans_address, self._trans, self.node,
                                timeout_s=max(self._timeout, 60))

    def close(self) -> None:
        self._trans_channel.close()
        for node_channel in self._channels.values():
            node_channel.close()

    @contextmanager
    def transaction(self, as_of: AsOf = NEWEST) -> Iterator[tpb.BeginTransResponse]:
        """A gated read-only transaction (at the newest snapshot, or ``as_of`` a past
        point), ended when the block exits."""
        with reaching_trans_server(self._trans_address):
            trans = self._trans.BeginTrans(as_of.begin_request(), timeout=self._timeout)
        try:
            yield trans
        finally:
            with reaching_trans_server(self._trans_address):
                self._trans.CommitTrans(tpb.CommitTransRequest(trans_id=trans.trans_id),
                                        timeout=self._timeout)

    def read(self, schema: str, table: str, *, keep_hidden: bool = False, as_of_ts: int = 0,
             as_of_time_ms: int = 0, as_of_pin: str = "") -> Snapshot:
        """The table at the newest snapshot, or AS OF a past timestamp, wall-clock time or
        pin (at most one)."""
        with self.transaction(AsOf(as_of_ts, as_of_time_ms, as_of_pin)) as trans:
            return self.read_in(trans, schema, table, keep_hidden=keep_hidden)

    def read_in(self, trans: tpb.BeginTransResponse, schema: str, table: str, *,
                keep_hidden: bool = False) -> Snapshot:
        buffered = self.fetch_buffers(trans, schema, table)  # before the file list
        files = self.list_files(trans, schema, table)
        return self.assemble(trans, buffered.values(), files, keep_hidden=keep_hidden)

    # The steps of ``read_in``, callable apart (a test or the fault campaign can pause a
    # read between them); their order is what makes a read exact (module docstring).
    def fetch_buffers(self, trans: tpb.BeginTransResponse, schema: str,
                      table: str) -> dict[str, pa.Table]:
        """Step 2: every node's write-buffer rows visible at ``trans``'s snapshot, with
        their ``_file_id``, by node."""
        buffered = {}
        for node, stub in self._retina.items():
            with reaching_node(node):
                reply = stub.GetWriteBuffer(rpb.GetWriteBufferRequest(
                    schema_name=schema, table_name=table, timestamp=trans.timestamp,
                    trans_id=trans.trans_id), timeout=self._timeout)
            buffered[node] = pa.ipc.open_stream(reply.arrow_ipc_stream).read_all()
        return buffered

    def list_files(self, trans: tpb.BeginTransResponse, schema: str,
                   table: str) -> list[tpb.QueryFile]:
        """Step 3: the REGULAR files, listed under the same transaction."""
        with reaching_trans_server(self._trans_address):
            listing = self._trans.ListQueryFiles(tpb.ListQueryFilesRequest(
                trans_id=trans.trans_id, schema_name=schema, table_name=table),
                timeout=self._timeout)
        return list(listing.files)

    def read_files(self, files: Sequence[tpb.QueryFile],
                   trans: tpb.BeginTransResponse) -> list[pa.Table]:
        """Step 4 for every listed file, in order."""
        return [self.read_file(f, trans) for f in files]

    def assemble(self, trans: tpb.BeginTransResponse, buffered: Iterable[pa.Table],
                 files: Sequence[tpb.QueryFile], *, keep_hidden: bool = False) -> Snapshot:
        """Steps 4 and 5: the listed files at the snapshot, plus the buffered rows whose
        file is not in the listing."""
        regular = {f.file_id for f in files}
        parts = self.read_files(files, trans)
        buffer_rows = 0
        for rows in buffered:
            keep = pc.invert(pc.is_in(rows.column(FILE_ID), pa.array(sorted(regular),
                                                                     pa.int64())))
            rows = rows.filter(keep)
            buffer_rows += rows.num_rows
            parts.append(rows.drop_columns([FILE_ID]))
        # Schema evolution: parts written before a column was added lack it. Columns are
        # only appended, so the widest part (an empty one counts) has every column, and
        # the others read the missing ones as NULL.
        widest = max((p.schema for p in parts), key=len, default=None)
        parts = [p for p in parts if p.num_rows] or parts[:1]
        result = pa.concat_tables(parts, promote_options="default") if parts else pa.table({})
        if widest is not None:
            result = conform(result, widest.remove_metadata())
        if not keep_hidden:
            result = result.drop_columns([c for c in HIDDEN if c in result.column_names])
        return Snapshot(result, trans.timestamp, len(files), buffer_rows)

    def read_file(self, f: tpb.QueryFile, trans: tpb.BeginTransResponse) -> pa.Table:
        """One file's rows visible at ``trans``'s snapshot (its owner answers the
        deletions only while the read transaction is live)."""
        ts = trans.timestamp
        node = file_names.parse(f.name).node_id
        stub = self._retina.get(node)
        if stub is None:
            raise RuntimeError(f"file {f.name} belongs to {node}, which is not in the topology")
        with reaching_node(node):
            visibility = stub.QueryVisibility(rpb.QueryVisibilityRequest(
                file_id=f.file_id, timestamp=ts, trans_id=trans.trans_id),
                timeout=self._timeout)
        deleted = {g.rg_id: g for g in visibility.row_groups}
        parquet = pq.ParquetFile(pa.BufferReader(read_bytes(f.path_uri, f.name)))
        groups = []
        for rg in range(parquet.metadata.num_row_groups):
            rows = parquet.read_row_group(rg)
            keep = pc.less_equal(rows.column(COMMIT_TS), pa.scalar(ts, pa.int64()))
            vis = deleted.get(rg)
            if vis is None:
                raise RuntimeError(f"{node} sent no visibility for file {f.file_id} rg {rg}")
            bits = np.unpackbits(np.frombuffer(vis.deleted_bitmap, dtype=np.uint8),
                                 bitorder="little")[: rows.num_rows].astype(bool)
            keep = pc.and_(keep, pa.array(~bits))
            groups.append(rows.filter(keep))
        schema = parquet.schema_arrow.remove_metadata()
        return pa.concat_tables([g.cast(schema) for g in groups]) if groups \
            else schema.empty_table()


def format_rows(rows: pa.Table) -> str:
    """A plain aligned text table."""
    if not rows.num_rows:
        return "(empty)"
    cells = [rows.column_names] + [["" if v is None else str(v) for v in r.values()]
                                   for r in rows.to_pylist()]
    widths = [max(len(row[i]) for row in cells) for i in range(len(cells[0]))]
    lines = ["  ".join(v.ljust(w) for v, w in zip(row, widths, strict=True)) for row in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """``retina-query SCHEMA.TABLE``: print a gated snapshot of a table.
    ``retina-query get SCHEMA.TABLE KEY...``: look up keys (see ``get --help``).
    ``retina-query changes SCHEMA.TABLE --from CURSOR``: the change feed (``changes --help``)."""
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["get"]:
        return get_main(argv[1:])
    if argv[:1] == ["changes"]:
        return changes_main(argv[1:])
    parser = argparse.ArgumentParser(
        prog="retina-query", description=main.__doc__,
        epilog="Exit codes: 0 printed; 1 not answered: refused (e.g. the query gate is "
               "closed, or an --as-of point older than the history kept: snapshot_expired) "
               "or a node or the TransServer unreachable (e.g. restarting); "
               "2 configuration.")
    parser.add_argument("table", help="schema.table")
    parser.add_argument("--config", help="TOML config file (default: $RETINA_CONFIG)")
    parser.add_argument("--format", choices=["table", "json", "count"], default="table")
    parser.add_argument("--limit", type=int, default=50)
    parser.add_argument("--hidden", action="store_true", help="include _commit_ts")
    args, schema, table, as_of = _parse_table_and_point(parser, argv)
    try:
        config, topology = load_config_and_topology(args.config)
    except ConfigError as exc:
        print(f"retina-query: {exc}", file=sys.stderr)
        return exit_codes.USAGE
    reader = SnapshotReader(config.trans.listen, topology, tls=config.tls)
    try:
        snap = reader.read(schema, table, keep_hidden=args.hidden, as_of_ts=as_of.ts,
                           as_of_time_ms=as_of.time_ms, as_of_pin=as_of.pin)
    except grpc.RpcError as exc:
        return _not_answered("retina-query", exc)
    finally:
        reader.close()
    rows = snap.table.sort_by([(c, "ascending") for c in snap.table.column_names[:1]])
    if args.format == "count":
        print(rows.num_rows)
    elif args.format == "json":
        for row in rows.slice(0, args.limit).to_pylist():
            print(json.dumps(row, default=str))
    else:
        print(format_rows(rows.slice(0, args.limit)))
    past = "" if as_of == NEWEST else f" (as of {as_of.describe()})"
    print(f"-- {rows.num_rows} rows at snapshot {snap.timestamp}{past} ({snap.files_read} "
          f"files, {snap.buffer_rows} write-buffer rows)", file=sys.stderr)
    return exit_codes.OK


def _point_arguments(parser: argparse.ArgumentParser) -> None:
    point = parser.add_mutually_exclusive_group()
    point.add_argument("--as-of", metavar="TS|TIME",
                       help="read a past snapshot: a timestamp (81234) or an ISO 8601 time "
                            "(2026-11-27T09:00:00Z; no zone: local time); docs/history.md")
    point.add_argument("--pin", metavar="NAME", help="read the snapshot a named pin holds")


def _parse_table_and_point(parser: argparse.ArgumentParser, argv: list[str] | None
                           ) -> tuple[argparse.Namespace, str, str, AsOf]:
    """Both commands' common part: the point arguments added, ``argv`` parsed, the
    ``schema.table`` argument split, the snapshot named."""
    _point_arguments(parser)
    args = parser.parse_args(argv)
    schema, dot, table = args.table.partition(".")
    if not dot:
        parser.error("give the table as schema.table")
    return args, schema, table, _point(parser, args)


def _point(parser: argparse.ArgumentParser, args: argparse.Namespace) -> AsOf:
    """The snapshot ``--as-of`` / ``--pin`` name (NEWEST without either)."""
    try:
        return parse_as_of(args.as_of) if args.as_of else AsOf(pin=args.pin or "")
    except BadPoint as exc:
        parser.error(str(exc))


def _not_answered(prog: str, exc: grpc.RpcError) -> int:
    """Say why a read was not answered (and, past the history kept, from where it can be)."""
    print(f"{prog}: {exc.code().name}: {exc.details()}", file=sys.stderr)
    earliest = earliest_readable(exc.details() or "")
    if earliest is not None:
        print(f"{prog}: the earliest readable point is timestamp {earliest[0]} "
              f"(time {format_ms(earliest[1])})", file=sys.stderr)
    return exit_codes.FAILED


def get_main(argv: list[str]) -> int:
    """``retina-query get SCHEMA.TABLE KEY...``: the rows of primary keys at one gated
    snapshot (LookupRows on the nodes that own them), in the keys' order."""
    parser = argparse.ArgumentParser(
        prog="retina-query get", description=get_main.__doc__,
        epilog="A key is a JSON object of the key columns ('{\"id\": 7}'), a JSON array "
               "of the key values in key order ('[3, 42]'), or the value of a one-column "
               "key ('7', 'abc'). Exit codes: 0 answered (found or not, per key); 1 not "
               "answered: refused or a node or the TransServer unreachable; 2 usage or "
               "configuration (an unknown table, a key that does not fit).")
    parser.add_argument("table", help="schema.table")
    parser.add_argument("keys", nargs="*", help="keys (or --keys-file)")
    parser.add_argument("--keys-file", help="one key per line ('-': standard input)")
    parser.add_argument("--columns", default="", help="comma-separated columns (default: all)")
    parser.add_argument("--config", help="TOML config file (default: $RETINA_CONFIG)")
    parser.add_argument("--format", choices=["table", "json"], default="table",
                        help="json: one line per key: key, found, commit_ts, row")
    args, schema, table_name, as_of = _parse_table_and_point(parser, argv)
    texts = list(args.keys)
    if args.keys_file:
        with sys.stdin if args.keys_file == "-" else open(args.keys_file) as lines:
            texts += [line.strip() for line in lines if line.strip()]
    if not texts:
        parser.error("no keys given (KEY... or --keys-file)")
    columns = [c for c in args.columns.split(",") if c]
    try:
        config, topology = load_config_and_topology(args.config)
        catalog = Catalog(config.catalog.dsn, pool_max=1,
                          connect_timeout_s=config.catalog.connect_timeout_s)
        try:
            table = catalog.get_table(schema, table_name)
        finally:
            catalog.close()
        keys = [key_from_text(table, t) for t in texts]
    except (ConfigError, NotFound, EncodingError) as exc:
        print(f"retina-query get: {exc}", file=sys.stderr)
        return exit_codes.USAGE
    except CatalogError as exc:  # the catalog is down: not answered
        print(f"retina-query get: catalog: {exc}", file=sys.stderr)
        return exit_codes.FAILED
    reader = SnapshotReader(config.trans.listen, topology, tls=config.tls)
    try:
        with reader.transaction(as_of) as trans:
            got = reader.key_lookup().get(schema, table_name, keys, columns=columns,
                                          trans=trans)
    except grpc.RpcError as exc:
        return _not_answered("retina-query get", exc)
    finally:
        reader.close()
    if args.format == "json":
        for text, hit, ts, row in zip(texts, got.found.tolist(), got.commit_ts.tolist(),
                                      got.by_key(), strict=True):
            print(json.dumps({"key": text, "found": hit, "commit_ts": ts, "row": row},
                             default=str))
    else:
        print(format_rows(got.rows))
        for text, hit in zip(texts, got.found.tolist(), strict=True):
            if not hit:
                print(f"-- not found: {text}", file=sys.stderr)
    past = "" if as_of == NEWEST else f" (as of {as_of.describe()})"
    print(f"-- {int(got.found.sum())} of {len(keys)} keys found at snapshot {got.timestamp}"
          f"{past}", file=sys.stderr)
    return exit_codes.OK


def changes_main(argv: list[str]) -> int:
    """``retina-query changes SCHEMA.TABLE --from CURSOR``: every change committed after
    the cursor, commit by commit, in commit order (docs/change-feed.md); with --follow, and
    on as changes come, until interrupted."""
    parser = argparse.ArgumentParser(
        prog="retina-query changes", description=changes_main.__doc__,
        epilog="CURSOR: a cursor printed by an earlier run, a commit timestamp (changes "
               "after it), or 'now'. Exit codes: 0 read (interrupted while following: "
               "the cursor to resume from is printed); 1 not answered: refused (a cursor "
               "older than the history kept: changes_expired, naming the earliest cursor) "
               "or a node or the TransServer unreachable; 2 usage or configuration.")
    parser.add_argument("table", help="schema.table")
    parser.add_argument("--from", dest="cursor", metavar="CURSOR",
                        help="required unless --consumer names a registered consumer")
    parser.add_argument("--consumer", default="", metavar="NAME",
                        help="a registered consumer (retina-admin consumer): registered at "
                             "--from (or the newest commit) if it is not yet, then read from "
                             "its cursor, which is committed after what was printed")
    parser.add_argument("--to", type=int, default=0, metavar="TS",
                        help="last commit timestamp to read (default: the newest snapshot)")
    parser.add_argument("--follow", action="store_true", help="keep reading as commits come")
    parser.add_argument("--snapshot-first", action="store_true",
                        help="with --from now: first the table's rows at that snapshot "
                             "(change type 'snapshot'), then the changes after it")
    parser.add_argument("--columns", default="",
                        help="comma-separated columns besides the key (default: all)")
    parser.add_argument("--keep-unchanged", action="store_true",
                        help="also updates that changed no column")
    parser.add_argument("--max-commits", type=int, default=0,
                        help="stop after this many commits with changes (0: no limit)")
    parser.add_argument("--config", help="TOML config file (default: $RETINA_CONFIG)")
    parser.add_argument("--format", choices=["table", "json"], default="json")
    args = parser.parse_args(argv)
    schema, dot, table = args.table.partition(".")
    if not dot:
        parser.error("give the table as schema.table")
    if args.snapshot_first and args.cursor != "now":
        parser.error("--snapshot-first starts at the newest snapshot: use --from now")
    if args.cursor is None and not args.consumer:
        parser.error("give --from CURSOR (or --consumer NAME)")
    try:
        config, topology = load_config_and_topology(args.config)
        start = None if args.cursor == "now" else \
            decode_cursor(args.cursor or "0", schema, table)
    except (ConfigError, BadCursor) as exc:
        print(f"retina-query changes: {exc}", file=sys.stderr)
        return exit_codes.USAGE
    reader = SnapshotReader(config.trans.listen, topology, tls=config.tls)
    try:
        cursor = _print_changes(reader, args, schema, table, start)
    except ChangesExpired as exc:
        print(f"retina-query changes: {exc}", file=sys.stderr)
        print(f"retina-query changes: the earliest cursor is {exc.earliest} "
              f"({encode_cursor(schema, table, exc.earliest)}); or start again with "
              "--from now --snapshot-first", file=sys.stderr)
        return exit_codes.FAILED
    except grpc.RpcError as exc:
        return _not_answered("retina-query changes", exc)
    finally:
        reader.close()
    print(f"-- cursor {encode_cursor(schema, table, cursor)} (timestamp {cursor})",
          file=sys.stderr)
    return exit_codes.OK


def _print_changes(reader: SnapshotReader, args: argparse.Namespace, schema: str, table: str,
                   start: int | None) -> int:
    """Print the commits ``args`` ask for; returns the cursor to resume from (committed
    for ``--consumer``)."""
    feed = reader.change_feed()
    columns = [c for c in args.columns.split(",") if c]
    cursor = start or 0
    if start is None:
        cursor = _start_now(reader, schema, table, args.snapshot_first, args.format)
    registry = ConsumerClient(reader.trans, 30) if args.consumer else None
    if registry is not None:
        cursor = registry.register(args.consumer, cursor or registry.high_watermark(),
                                   f"{schema}.{table}").cursor_ts
    commits = feed.follow(schema, table, cursor, columns=columns,
                          keep_unchanged=args.keep_unchanged,
                          consumer=args.consumer) if args.follow else \
        feed.read(schema, table, cursor, to_ts=args.to, columns=columns,
                  keep_unchanged=args.keep_unchanged, heartbeat=True)
    shown = 0
    try:
        with closing(commits):  # its read transactions end before the channels close
            for commit in commits:
                cursor = commit.ts
                if commit.heartbeat:
                    continue
                _print_commit(commit.changes, args.format)
                shown += 1
                if shown == args.max_commits:
                    break
    except KeyboardInterrupt:
        pass
    if registry is not None:  # what was printed was delivered
        registry.commit(args.consumer, cursor)
    return cursor


def _start_now(reader: SnapshotReader, schema: str, table: str, snapshot_first: bool,
               fmt: str) -> int:
    """The newest snapshot's timestamp; with ``snapshot_first``, its rows printed first."""
    with reader.transaction() as trans:
        if snapshot_first:
            rows = reader.read_in(trans, schema, table).table
            rows = rows.sort_by([(c, "ascending") for c in rows.column_names[:1]])
            head = {CHANGE_TYPE: pa.array([SNAPSHOT] * rows.num_rows, pa.string()),
                    CHANGE_TS: pa.array([trans.timestamp] * rows.num_rows, pa.int64()),
                    ORDINAL: pa.array(np.arange(rows.num_rows, dtype=np.int64)),
                    SOURCE_POSITION: pa.nulls(rows.num_rows, pa.string())}
            columns = [*head.values(), *rows.columns]
            _print_commit(pa.Table.from_arrays(columns, [*head, *rows.column_names]), fmt)
        return trans.timestamp


def _print_commit(changes: pa.Table, fmt: str) -> None:
    if fmt == "table":
        print(format_rows(changes))
        return
    head = (CHANGE_TYPE, CHANGE_TS, ORDINAL, SOURCE_POSITION)
    for row in changes.to_pylist():
        print(json.dumps({"change_type": row[CHANGE_TYPE], "commit_ts": row[CHANGE_TS],
                          "ordinal": row[ORDINAL], "source_position": row[SOURCE_POSITION],
                          "row": {k: v for k, v in row.items() if k not in head}},
                         default=str), flush=True)


if __name__ == "__main__":
    sys.exit(main())
