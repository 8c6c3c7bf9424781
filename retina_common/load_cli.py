"""``retina-load``: load Parquet files into a Retina table through the bulk load path.

    retina-load SCHEMA.TABLE FILE.parquet [FILE.parquet ...] [--chunk-rows N]

Every row must be for a key that has no live version in the table (a new table, a
backfill of keys the table never had, a table emptied by a TRUNCATE): the files are read
as Arrow batches, cut into chunks of ``--chunk-rows`` rows, and each chunk is written as
one Parquet file per virtual node by this process and published by the nodes at one
commit timestamp (docs/write-paths/bulk-load.md). A chunk with a live key is refused
(ALREADY_EXISTS): load those rows with ``retina-write`` (an upsert) instead.
The files' columns are the table's, by name (extra columns are an error; types are cast).

Prints rows, chunks, files, seconds and rows/s. Exit codes: 0 loaded; 1 a chunk did
not load whole: refused (nothing of it changed), in doubt or partial (each of its rows
there or absent, never twice); the message says which and how many rows were committed
before (each exactly once); 2 usage or configuration error.
"""

from __future__ import annotations

import argparse
import sys

import grpc

from retina_common import exit_codes, failpoints
from retina_common.bulk_loader import (
    DEFAULT_CHUNK_ROWS,
    BulkLoader,
    LoadFailed,
    parquet_batches,
)
from retina_common.catalog import Catalog, CatalogError, NotFound
from retina_common.config import ConfigError
from retina_common.log import configure_logging
from retina_common.pb import retina_pb2_grpc, trans_pb2_grpc
from retina_common.tls import open_channel
from retina_common.topology import load_config_and_topology

PROG = "retina-load"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", help="TOML config file (default: $RETINA_CONFIG)")
    parser.add_argument("table", help="SCHEMA.TABLE")
    parser.add_argument("files", nargs="+", help="Parquet files with the table's columns")
    parser.add_argument("--chunk-rows", type=int, default=DEFAULT_CHUNK_ROWS,
                        help="rows per commit (default %(default)s)")
    args = parser.parse_args(argv)
    try:
        failpoints.load_from_env()
        config, topology = load_config_and_topology(args.config)
        schema, _, name = args.table.partition(".")
        if not schema or not name:
            raise ValueError(f"table {args.table!r}: expected SCHEMA.TABLE")
        if args.chunk_rows <= 0:
            raise ValueError(f"--chunk-rows {args.chunk_rows}: must be positive")
        catalog = Catalog(config.catalog.dsn, pool_max=1)
        try:
            table = catalog.get_table(schema, name)
        finally:
            catalog.close()
    except NotFound:
        print(f"{PROG}: no table {args.table} in the catalog", file=sys.stderr)
        return exit_codes.USAGE
    except (ValueError, ConfigError, CatalogError, failpoints.FailpointError) as exc:
        print(f"{PROG}: {exc}", file=sys.stderr)
        return exit_codes.USAGE
    configure_logging(PROG, "warning", file=sys.stderr)
    channels = [open_channel(config.trans.listen)]
    nodes = {}
    for node in topology.nodes:
        channels.append(open_channel(node))
        nodes[node] = retina_pb2_grpc.RetinaWorkerServiceStub(channels[-1])
    loader = BulkLoader(schema, table, topology, trans_pb2_grpc.TransServiceStub(channels[0]),
                        nodes, chunk_rows=args.chunk_rows)
    try:
        report = loader.load(parquet_batches(args.files))
    except (ValueError, OSError) as exc:
        print(f"{PROG}: {exc} (commits before it stand; rows it did not reach are not "
              "loaded)", file=sys.stderr)
        return exit_codes.USAGE
    except LoadFailed as exc:
        done = exc.report
        print(f"{PROG}: {exc}; loaded before it: {done.rows if done else 0} row(s) in "
              f"{done.chunks if done else 0} commit(s)", file=sys.stderr)
        return exit_codes.FAILED
    except grpc.RpcError as exc:
        print(f"{PROG}: {exc.code().name}: {exc.details()}", file=sys.stderr)
        return exit_codes.FAILED
    finally:
        for channel in channels:
            channel.close()
    print(f"loaded {report.rows} row(s) into {args.table} in {report.chunks} commit(s), "
          f"{report.files} file(s), {report.seconds:.2f} s ({report.rows_per_s:,.0f} rows/s)")
    return exit_codes.OK


if __name__ == "__main__":
    sys.exit(main())
