"""``retina-cluster``: start, inspect and stop a private local cluster and its Retina nodes.

    retina-cluster start  [--state-dir DIR] [--nodes h:p,h:p] [--virtual-nodes N]
                          [--retina [N]]
    retina-cluster status [--state-dir DIR]
    retina-cluster stop   [--state-dir DIR]
    retina-cluster start-node | stop-node | restart-node NODE [--state-dir DIR]
    retina-cluster kill-node NODE [--signal KILL] [--state-dir DIR]

``start`` prints where each component listens and writes ``DIR/retina.toml``
(use it with ``RETINA_CONFIG=DIR/retina.toml``). ``--retina`` also starts one
Retina node per topology entry; ``--retina N`` makes the topology N loopback
nodes and starts them all. A node keeps its address, metrics address and state
directory across ``stop-node`` / ``kill-node`` / ``restart-node`` (all read
from ``DIR/cluster.json``).
"""

from __future__ import annotations

import argparse
import contextlib
import signal
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from devtools.cluster import (
    ClusterError,
    ClusterState,
    free_ports,
    grpc_serving,
    node_status,
    pid_alive,
    retina_log_path,
    retina_state_dir,
    start_cluster,
    start_retina_server,
    stop_cluster,
    stop_retina_server,
    wait_for,
)
from retina_common import exit_codes

if TYPE_CHECKING:
    from retina_common.pb.retina_pb2 import GetRetinaStatusResponse

# ``--retina`` without a count: one node per topology entry.
EVERY_TOPOLOGY_NODE = 0
# Phases in which a starting node stops moving by itself (until MarkReady or a restart).
SETTLED_PHASES = ("AWAITING_REPLAY", "BARRIER", "READY", "FAILED")
NODE_COMMANDS = ("start-node", "stop-node", "restart-node", "kill-node")


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


# --- what a node line says ----------------------------------------------------------------
def _phase_text(status: GetRetinaStatusResponse | None) -> str:
    if status is None:
        return "down"
    from retina_common.pb import retina_pb2

    text = f"{retina_pb2.LifecycleState.Name(status.state)}/{status.phase}"
    return text + (f" ({status.failure_reason})" if status.failure_reason else "")


def node_lines(state: ClusterState, node: str,
               status: GetRetinaStatusResponse | None) -> list[str]:
    """Address, state/phase (``status``: its GetRetinaStatus answer), pid and metrics;
    then its state directory and log file."""
    pid = state.retina_pids.get(node, 0)
    pid_text = str(pid) if pid and pid_alive(pid) else "-"
    metrics = state.retina_metrics.get(node)
    metrics_text = f"http://{metrics}/metrics" if metrics else "-"
    return [f"retina      {node}  {_phase_text(status)}  pid {pid_text}  "
            f"metrics {metrics_text}",
            f"              state {retina_state_dir(state, node)}  "
            f"log {retina_log_path(state, node)}"]


def _print_node(state: ClusterState, node: str) -> None:
    print("\n".join(node_lines(state, node, node_status(node))))


def _wait_settled(node: str, timeout_s: float = 60) -> None:
    """Until the node has left start-up (cleansing, loading a checkpoint), so the line
    printed next shows where it waits; a slow start is shown as it is, not an error."""
    def settled() -> bool:
        status = node_status(node)
        return status is not None and status.phase in SETTLED_PHASES
    with contextlib.suppress(ClusterError):
        wait_for(settled, timeout_s, f"{node} to finish starting")


def _recover_command(state: ClusterState, node: str) -> str | None:
    """The ``retina-admin recover`` line for a node waiting for replay, else None."""
    status = node_status(node)
    if status is None or status.phase not in ("AWAITING_REPLAY", "BARRIER"):
        return None
    return f"  retina-admin --config {state.config_path} recover --node {node}"


def print_replay_hint(state: ClusterState, nodes: list[str]) -> None:
    """Why started nodes do not turn READY by themselves, and what brings them there."""
    if state.cdc_pid and pid_alive(state.cdc_pid):
        print(f"note        the CDC connector (pid {state.cdc_pid}) replays recovering nodes "
              "and brings them READY")
        return
    commands = [c for c in (_recover_command(state, n) for n in nodes) if c]
    if not commands:
        return
    print("note        no replay driver runs here: a node stays RECOVERING (AWAITING_REPLAY) "
          "until the CDC connector (retina-cdc, docs/cdc.md) replays it and calls MarkReady; "
          "without a connector, this replays every registered writer's changelog into it "
          "(nothing, for a fresh node) and brings it READY:")
    for command in commands:
        print(command)


# --- commands --------------------------------------------------------------------------
def _topology_nodes(args: argparse.Namespace) -> list[str] | None:
    nodes = args.nodes.split(",") if args.nodes else None
    count = args.retina
    if count is None or count == EVERY_TOPOLOGY_NODE:
        return nodes
    if nodes is not None and len(nodes) != count:
        raise ClusterError(f"--retina {count} but --nodes names {len(nodes)} nodes")
    return nodes or [f"127.0.0.1:{port}" for port in free_ports(count)]


def cmd_start(args: argparse.Namespace, state_dir: Path, state: ClusterState | None) -> int:
    if state is not None and any(_running(state).values()):
        print(f"a cluster is already running under {state_dir} "
              "(retina-cluster stop first)", file=sys.stderr)
        return exit_codes.FAILED
    state = start_cluster(state_dir, nodes=_topology_nodes(args),
                          virtual_nodes=args.virtual_nodes)
    if args.retina is None:
        print("retina      not started (`make cluster-up RETINA=N` / `retina-cluster start "
              "--retina` starts them with the cluster, `retina-cluster start-node NODE` one)")
    else:
        for node in state.nodes:
            start_retina_server(state, node)
        for node in state.nodes:
            _wait_settled(node)
            _print_node(state, node)
        print_replay_hint(state, state.nodes)
    print(f"\nexport RETINA_CONFIG={state_dir.resolve() / 'retina.toml'}")
    return exit_codes.OK


def cmd_status(state: ClusterState) -> int:
    up = _running(state)
    print(f"etcd        {'up' if up['etcd'] else 'down'}  http://{state.etcd.endpoint}")
    print(f"postgresql  {'up' if up['postgresql'] else 'down'}  {state.postgres.dsn()}")
    print(f"transserver {'up' if up['transserver'] else 'down'}  {state.trans_listen}")
    healthy = all(up.values())
    for node in state.nodes:
        status = node_status(node)
        print("\n".join(node_lines(state, node, status)))
        # A node started and not stopped on purpose (stop-node, kill-node) must answer.
        if node in state.retina_pids and status is None:
            healthy = False
    return exit_codes.OK if healthy else exit_codes.FAILED


def _signal(name: str) -> int:
    """``KILL``, ``SIGKILL`` or ``9``."""
    if name.isdigit():
        return int(name)
    try:
        return int(signal.Signals["SIG" + name.upper().removeprefix("SIG")])
    except KeyError:
        raise argparse.ArgumentTypeError(f"unknown signal {name}") from None


def cmd_node(args: argparse.Namespace, state: ClusterState) -> int:
    node = args.node
    if node is None:
        raise ClusterError(f"{args.command} needs NODE (host:port; `retina-cluster status` "
                           "lists them)")
    if node not in state.nodes:
        raise ClusterError(f"{node} is not a node of this cluster ({', '.join(state.nodes)})")
    pid = state.retina_pids.get(node, 0)
    running = bool(pid) and pid_alive(pid)
    if args.command == "start-node" and running:
        raise ClusterError(f"{node} is already running (pid {pid}; restart-node restarts it)")
    if args.command in ("stop-node", "restart-node", "kill-node"):
        sig = args.signal if args.command == "kill-node" else signal.SIGTERM
        if stop_retina_server(state, node, sig):
            print(f"retina      {node} pid {pid} stopped ({signal.Signals(sig).name})")
        elif args.command != "restart-node":
            print(f"retina      {node} was not running")
    if args.command in ("start-node", "restart-node"):
        start_retina_server(state, node)
        _wait_settled(node)
        _print_node(state, node)
        print_replay_hint(state, [node])
    return exit_codes.OK


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="retina-cluster", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("command", choices=["start", "status", "stop", *NODE_COMMANDS])
    p.add_argument("node", nargs="?", metavar="NODE",
                   help="host:port of a topology node (the *-node commands)")
    p.add_argument("--state-dir", default=".retina-cluster")
    p.add_argument("--nodes", help="expected Retina nodes, comma-separated host:port")
    p.add_argument("--virtual-nodes", type=int, default=8)
    p.add_argument("--retina", nargs="?", type=_node_count, const=EVERY_TOPOLOGY_NODE,
                   metavar="N", help="also start the Retina nodes: one per topology entry, "
                   "or a topology of N loopback nodes")
    p.add_argument("--signal", type=_signal, default=signal.SIGKILL,
                   help="kill-node: the signal (default KILL)")
    return p


def _node_count(text: str) -> int:
    count = int(text)
    if count < 1:
        raise argparse.ArgumentTypeError("at least 1")
    return count


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    state_dir = Path(args.state_dir)
    state = ClusterState.load(state_dir)
    try:
        if args.command == "start":
            return cmd_start(args, state_dir, state)
        if state is None:
            print(f"no cluster under {state_dir}", file=sys.stderr)
            return exit_codes.FAILED
        if args.command == "status":
            return cmd_status(state)
        if args.command in NODE_COMMANDS:
            return cmd_node(args, state)
        stop_cluster(state)
        return exit_codes.OK
    except ClusterError as exc:
        print(f"retina-cluster: {exc}", file=sys.stderr)
        return exit_codes.FAILED


if __name__ == "__main__":
    sys.exit(main())
