"""``retina-cluster``: start, inspect and stop a private local cluster.

    retina-cluster start  [--state-dir DIR] [--nodes h:p,h:p] [--virtual-nodes N]
    retina-cluster status [--state-dir DIR]
    retina-cluster stop   [--state-dir DIR]

``start`` prints where each component listens and writes ``DIR/retina.toml``
(use it with ``RETINA_CONFIG=DIR/retina.toml``).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from devtools.cluster import (
    ClusterError,
    ClusterState,
    grpc_serving,
    pid_alive,
    start_cluster,
    start_retina_servers,
    stop_cluster,
)


def _running(state: ClusterState) -> dict[str, bool]:
    def trans_up() -> bool:
        try:
            return bool(state.trans_pid) and pid_alive(state.trans_pid) and \
                grpc_serving(state.trans_listen)
        except Exception:
            return False

    def etcd_up() -> bool:
        try:
            return bool(state.etcd.pid) and state.etcd.healthy()
        except Exception:
            return False

    def pg_up() -> bool:
        try:
            return state.postgres.accepting()
        except Exception:
            return False

    return {"etcd": etcd_up(), "postgresql": pg_up(), "transserver": trans_up()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="retina-cluster", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", choices=["start", "status", "stop"])
    parser.add_argument("--state-dir", default=".retina-cluster")
    parser.add_argument("--nodes", help="expected Retina nodes, comma-separated host:port")
    parser.add_argument("--virtual-nodes", type=int, default=8)
    parser.add_argument("--retina", action="store_true",
                        help="also start one retina-server per topology node")
    args = parser.parse_args(argv)
    state_dir = Path(args.state_dir)
    state = ClusterState.load(state_dir)
    try:
        if args.command == "start":
            if state is not None and any(_running(state).values()):
                print(f"a cluster is already running under {state_dir} "
                      "(retina-cluster stop first)", file=sys.stderr)
                return 1
            nodes = args.nodes.split(",") if args.nodes else None
            state = start_cluster(state_dir, nodes=nodes, virtual_nodes=args.virtual_nodes)
            if args.retina:
                start_retina_servers(state)
                print(f"retina      {', '.join(state.nodes)}")
            print(f"\nexport RETINA_CONFIG={state_dir.resolve() / 'retina.toml'}")
            return 0
        if state is None:
            print(f"no cluster under {state_dir}", file=sys.stderr)
            return 1
        if args.command == "status":
            up = _running(state)
            print(f"etcd        {'up' if up['etcd'] else 'down'}  http://{state.etcd.endpoint}")
            print(f"postgresql  {'up' if up['postgresql'] else 'down'}  {state.postgres.dsn()}")
            print(f"transserver {'up' if up['transserver'] else 'down'}  {state.trans_listen}")
            return 0 if all(up.values()) else 1
        stop_cluster(state)
        return 0
    except ClusterError as exc:
        print(f"retina-cluster: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
