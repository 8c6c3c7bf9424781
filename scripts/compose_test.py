"""`make compose-test`: the containerised cluster, for real.

Brings the compose cluster up (by default with the registry-free local override)
without the connector, creates the Retina tables and the source tables, and
writes a first workload to the source; then starts the connector, which loads
those rows from its initial snapshot and streams from its slot (Debezium's
snapshot.mode=initial), and waits until every service is healthy (both Retina
nodes READY). The workload is inserts, updates, primary-key changes and deletes
over two tables, one of them with a composite key. Then it kills a Retina
container (SIGKILL) while the workload is still writing, lets it come back, waits
for it to be READY again (recovery: replay by the connector, MarkReady), writes
more, adds a nullable column at the source and truncates a table, and compares
the gated snapshot of every table (`retina-query`) with the source table itself,
the oracle, after each step. The cluster is always
torn down with its volumes (unless --keep). Prints the timings.

Needs only the Python standard library, Docker and docker-compose (v1
`docker-compose` or the v2 `docker compose` plugin; $COMPOSE picks one).
Exit code 0: the snapshots equal the source; 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shlex
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from decimal import Decimal
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
BASE_FILE = ROOT / "deploy" / "docker-compose.yml"
LOCAL_FILE = ROOT / "deploy" / "docker-compose.local.yml"
BASE_IMAGE = "retina-base:bookworm"
SCHEMA = "app"
KILLED = "retina-2"
SERVICES = ["etcd", "postgres", "trans", "retina-1", "retina-2", "source-db", "cdc",
            "prometheus"]
# What must be healthy before the connector starts (the nodes wait for it: READY
# only once it has driven their replay and MarkReady).
BEFORE_CDC = ["etcd", "postgres", "trans", "source-db", "prometheus"]
# Only the registry images have them (the local override has no MinIO or Grafana).
UPSTREAM_ONLY = ["minio", "grafana"]
SOURCE_DDL = """
CREATE TABLE orders (id int8 PRIMARY KEY, customer text, amount numeric(12,2),
                     status text, qty int4);
CREATE TABLE items (order_id int8, line int4, sku text, qty int4,
                    PRIMARY KEY (order_id, line));
"""
# Retina columns per table (catalog types) and the primary key.
TABLES: dict[str, tuple[list[str], list[str]]] = {
    "orders": (["id:int64", "customer:string", "amount:decimal(12,2)", "status:string",
                "qty:int32"], ["id"]),
    "items": (["order_id:int64", "line:int32", "sku:string", "qty:int32"],
              ["order_id", "line"]),
}
DECIMAL_COLUMNS = {"amount"}


class Failed(Exception):
    """The cluster did not do what the test needs; the message says what."""


def log(message: str) -> None:
    print(f"[compose-test {time.strftime('%H:%M:%S')}] {message}", flush=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def compose_command() -> list[str]:
    if os.environ.get("COMPOSE"):
        return shlex.split(os.environ["COMPOSE"])
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    return ["docker", "compose"]


def poll(condition: Callable[[], Any], timeout_s: float, what: str,
         interval_s: float = 1.0) -> Any:
    """Call ``condition`` until it returns something truthy, or fail after the deadline."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise Failed(f"timed out after {timeout_s:.0f}s waiting for {what}")
        time.sleep(interval_s)  # polling an external system with a deadline


class Cluster:
    """docker-compose for one project, with the helpers the test needs."""

    def __init__(self, project: str, local: bool) -> None:
        files = [BASE_FILE] + ([LOCAL_FILE] if local else [])
        self.base = [*compose_command(), "-p", project]
        for f in files:
            self.base += ["-f", str(f)]
        # Host ports of this project: free ones, so a running cluster is not disturbed.
        self.env = dict(os.environ)
        for name in ("RETINA_TRANS_PORT", "RETINA_SOURCE_DB_PORT", "RETINA_MINIO_CONSOLE_PORT",
                     "RETINA_PROMETHEUS_PORT", "RETINA_GRAFANA_PORT"):
            self.env[name] = str(free_port())

    def run(self, *args: str, input_text: str | None = None, timeout_s: float = 600,
            check: bool = True, quiet: bool = False) -> subprocess.CompletedProcess[str]:
        result = subprocess.run([*self.base, *args], input=input_text, text=True,
                                capture_output=True, env=self.env, timeout=timeout_s,
                                cwd=ROOT)
        if check and result.returncode != 0:
            raise Failed(f"`{' '.join(args[:4])}` exited {result.returncode}: "
                         f"{(result.stderr or result.stdout).strip()[-2000:]}")
        if not quiet and result.stderr.strip() and result.returncode != 0:
            log(result.stderr.strip()[-500:])
        return result

    def stream(self, *args: str, timeout_s: float = 1800) -> None:
        """Run with the output on the terminal (builds, so progress is visible)."""
        done = subprocess.run([*self.base, *args], env=self.env, timeout=timeout_s, cwd=ROOT)
        if done.returncode != 0:
            raise Failed(f"`{' '.join(args)}` exited {done.returncode}")

    def container(self, service: str) -> str:
        cid = self.run("ps", "-q", service).stdout.strip()
        if not cid:
            raise Failed(f"no container for service {service}")
        return cid

    def state(self, service: str) -> tuple[str, str, int]:
        """(status, health, exit code) of the service's container."""
        out = subprocess.run(
            ["docker", "inspect", "-f",
             "{{.State.Status}} {{if .State.Health}}{{.State.Health.Status}}{{else}}-{{end}} "
             "{{.State.ExitCode}}", self.container(service)],
            capture_output=True, text=True, check=True).stdout.split()
        return out[0], out[1], int(out[2])

    def healthy(self, services: list[str]) -> bool:
        waiting = []
        for service in services:
            status, health, _code = self.state(service)
            if health != "healthy":
                waiting.append(f"{service}={status}/{health}")
        status, _health, code = self.state("storage-init")
        if status == "exited" and code != 0:
            raise Failed(f"storage-init exited {code}")
        if status != "exited":
            waiting.append(f"storage-init={status}")
        if waiting:
            log("waiting: " + ", ".join(waiting))
        return not waiting

    def psql(self, sql: str, timeout_s: float = 600) -> str:
        return self.run("exec", "-T", "source-db", "psql", "-U", "app", "-d", "app", "-q",
                        "-A", "-t", "-v", "ON_ERROR_STOP=1", input_text=sql,
                        timeout_s=timeout_s).stdout

    def psql_background(self, sql: str) -> subprocess.Popen[str]:
        proc = subprocess.Popen([*self.base, "exec", "-T", "source-db", "psql", "-U", "app",
                                 "-d", "app", "-q", "-v", "ON_ERROR_STOP=1"],
                                stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE, text=True, env=self.env, cwd=ROOT)
        assert proc.stdin is not None
        proc.stdin.write(sql)
        proc.stdin.close()
        return proc

    def retina(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        """A Retina command inside a Retina node's container (the image, the config,
        the storage and the TransServer address; up before the connector is)."""
        return self.run("exec", "-T", "retina-1", *args, check=check, quiet=True)


class Workload:
    """Shop orders in the source database: every transaction inserts an order with
    items, and most also pay, re-price, re-key or cancel an earlier one."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.next_id = 1
        self.ids: list[int] = []

    def transaction(self) -> str:
        rng = self.rng
        oid = self.next_id
        self.next_id += 1
        self.ids.append(oid)
        stmts = [f"INSERT INTO orders VALUES ({oid}, 'customer {rng.randint(1, 50)}', "
                 f"{rng.randint(100, 99999) / 100:.2f}, 'new', {rng.randint(1, 9)});"]
        stmts += [f"INSERT INTO items VALUES ({oid}, {line}, 'sku-{rng.randint(1, 500)}', "
                  f"{rng.randint(1, 5)});" for line in range(1, rng.randint(2, 5))]
        other = rng.choice(self.ids)
        choice = rng.random()
        if choice < 0.35:
            stmts.append(f"UPDATE orders SET status = 'paid', amount = amount + 1 "
                         f"WHERE id = {other};")
        elif choice < 0.45:
            stmts.append(f"DELETE FROM items WHERE order_id = {other};")
            stmts.append(f"DELETE FROM orders WHERE id = {other};")
            self.ids.remove(other)
        elif choice < 0.55:  # a primary-key change: the old key disappears
            new_id = 1_000_000 + self.next_id
            stmts.append(f"UPDATE orders SET id = {new_id} WHERE id = {other};")
            stmts.append(f"UPDATE items SET order_id = {new_id} WHERE order_id = {other};")
            self.ids.remove(other)
            self.ids.append(new_id)
        elif choice < 0.7:
            stmts.append(f"UPDATE items SET qty = qty + 1 WHERE order_id = {other};")
        return "BEGIN;\n" + "\n".join(stmts) + "\nCOMMIT;\n"

    def script(self, transactions: int, pause_s: float = 0.0) -> str:
        # The pause paces the source workload so that the kill lands mid-stream.
        pause = f"SELECT pg_sleep({pause_s});\n" if pause_s else ""
        return "".join(self.transaction() + pause for _ in range(transactions))


def _norm(row: dict[str, Any]) -> dict[str, Any]:
    return {k: (Decimal(str(v)).quantize(Decimal("0.01"))
                if k in DECIMAL_COLUMNS and v is not None else v)
            for k, v in row.items()}


def source_rows(cluster: Cluster, table: str) -> dict[tuple[Any, ...], dict[str, Any]]:
    keys = TABLES[table][1]
    out = cluster.psql(f"SELECT row_to_json(t) FROM {table} t;")
    rows = [_norm(json.loads(line, parse_float=Decimal)) for line in out.splitlines() if line]
    return {tuple(r[k] for k in keys): r for r in rows}


def snapshot_rows(cluster: Cluster,
                  table: str) -> dict[tuple[Any, ...], dict[str, Any]] | None:
    """The gated snapshot, or None while the query gate refuses (a node not READY)."""
    keys = TABLES[table][1]
    result = cluster.retina("retina-query", f"{SCHEMA}.{table}", "--format", "json",
                            "--limit", "100000000", check=False)
    if result.returncode != 0:
        log(f"retina-query {SCHEMA}.{table}: {result.stderr.strip()[-300:]}")
        return None
    rows = [_norm(json.loads(line)) for line in result.stdout.splitlines() if line]
    return {tuple(r[k] for k in keys): r for r in rows}


def differences(want: dict[tuple[Any, ...], Any], got: dict[tuple[Any, ...], Any]) -> str:
    missing = [k for k in want if k not in got]
    extra = [k for k in got if k not in want]
    changed = [k for k in want if k in got and want[k] != got[k]]
    sample = [(k, want[k], got[k]) for k in changed[:2]]
    return (f"{len(missing)} missing (e.g. {missing[:3]}), {len(extra)} extra "
            f"(e.g. {extra[:3]}), {len(changed)} different (e.g. {sample})")


def snapshot_equals_source(cluster: Cluster, report: dict[str, str]) -> bool:
    report.clear()
    for table in TABLES:
        got = snapshot_rows(cluster, table)
        want = source_rows(cluster, table)
        if got is None:
            report[table] = "gate closed"
        elif got != want:
            report[table] = differences(want, got)
    if report:
        log(f"not converged yet: {report}")
    return not report


def converge(cluster: Cluster, timeout_s: float, what: str) -> dict[str, int]:
    report: dict[str, str] = {}
    try:
        poll(lambda: snapshot_equals_source(cluster, report), timeout_s, what, interval_s=2)
    except Failed as exc:
        raise Failed(f"{exc}: {report}") from None
    return {t: len(source_rows(cluster, t)) for t in TABLES}


def create_tables(cluster: Cluster) -> None:
    cluster.retina("retina-catalog", "create-schema", SCHEMA)
    for table, (columns, keys) in TABLES.items():
        args = ["retina-catalog", "create-table", SCHEMA, table]
        for column in columns:
            args += ["--column", column]
        cluster.retina(*args, "--primary-key", ",".join(keys))
    cluster.psql(SOURCE_DDL)


def schema_change_and_truncate(cluster: Cluster, workload: Workload, transactions: int) -> None:
    """ALTER TABLE ... ADD COLUMN (nullable) with rows that set it and rows that do not,
    then a TRUNCATE followed by inserts in the same transaction, then more workload."""
    script = "ALTER TABLE orders ADD COLUMN note text;\n"
    script += workload.script(transactions // 4)
    noted = workload.ids[-20:]
    script += (f"UPDATE orders SET note = 'noted ' || id "
               f"WHERE id IN ({','.join(map(str, noted))});\n")
    script += "BEGIN;\nTRUNCATE items;\n"
    script += "".join(f"INSERT INTO items VALUES ({oid}, 1, 'after-truncate', 1);\n"
                      for oid in workload.ids[-10:])
    script += "COMMIT;\n"
    script += workload.script(transactions // 4)
    cluster.psql(script)


def kill_and_recover(cluster: Cluster, timings: dict[str, float],
                     workload: Workload, transactions: int) -> None:
    before = int(cluster.psql("SELECT count(*) FROM orders;").strip())
    writer = cluster.psql_background(workload.script(transactions, pause_s=0.02))
    # Kill once the source has moved on, so the node dies with changes in flight.
    poll(lambda: int(cluster.psql("SELECT count(*) FROM orders;").strip()) > before + 20,
         120, "the workload to get going", interval_s=0.3)
    cid = cluster.container(KILLED)
    subprocess.run(["docker", "kill", "--signal", "KILL", cid], check=True,
                   capture_output=True)
    killed = time.monotonic()
    log(f"docker kill {KILLED} ({cid[:12]}) mid-workload")
    # restart: unless-stopped brings a crashed container back; a `docker kill` counts as
    # a manual stop for some Docker versions, and then we start it as an operator would.
    try:
        poll(lambda: cluster.state(KILLED)[0] == "running", 10,
             f"{KILLED} to be restarted by its restart policy")
        log(f"{KILLED} restarted by its restart policy")
    except Failed:
        log(f"{KILLED} not restarted by the restart policy (a kill counts as a manual "
            f"stop); `start {KILLED}`")
        cluster.run("start", KILLED)
    poll(lambda: cluster.state(KILLED)[1] == "healthy", 300,
         f"{KILLED} to recover (READY again)", interval_s=0.5)
    timings["kill -> READY again (recovery)"] = time.monotonic() - killed
    state_files = cluster.run("exec", "-T", KILLED, "ls", "-A", "/var/lib/retina/state").stdout
    log(f"{KILLED} READY again; its state volume holds: {' '.join(state_files.split())}")
    replays = [line for line in cluster.run("logs", "--no-color", "cdc").stdout.splitlines()
               if "cdc_replay_done" in line and KILLED in line]
    if replays:
        log(f"connector: {replays[-1].split('|', 1)[-1].strip()}")
    try:
        writer.wait(timeout=600)
    except subprocess.TimeoutExpired:
        writer.kill()
        raise Failed("the background workload did not finish") from None
    assert writer.stderr is not None
    if writer.returncode != 0:
        raise Failed(f"the background workload failed: {writer.stderr.read().strip()[-1000:]}")


def prometheus_api(cluster: Cluster, path: str) -> dict[str, Any]:
    out = cluster.run("exec", "-T", "prometheus", "wget", "-q", "-O", "-",
                      f"http://127.0.0.1:9090/api/v1/{path}").stdout
    return dict(json.loads(out)["data"])


def scraped(cluster: Cluster) -> bool:
    """Prometheus scrapes every Retina process (the TransServer, both nodes, cdc)."""
    targets = prometheus_api(cluster, "targets")["activeTargets"]
    health = {t["labels"]["instance"]: t["health"] for t in targets}
    if len(health) < 4 or any(h != "up" for h in health.values()):
        log(f"prometheus targets: {health}")
        return False
    rules = sum(len(g["rules"]) for g in prometheus_api(cluster, "rules")["groups"])
    log(f"prometheus scrapes {sorted(health)}; {rules} alerting/recording rules loaded")
    return True


def run(cluster: Cluster, args: argparse.Namespace, timings: dict[str, float]) -> None:
    def timed(name: str, step: Callable[[], Any]) -> Any:
        t0 = time.monotonic()
        value = step()
        timings[name] = time.monotonic() - t0
        return value

    services = SERVICES + (UPSTREAM_ONLY if args.upstream else [])
    if not args.no_build:
        timed("build images", lambda: cluster.stream("build"))
    # Everything but the connector first: the source gets rows before any slot exists.
    timed("up (without the connector)", lambda: cluster.run(
        "up", "-d", "--no-build", *[s for s in services if s != "cdc"], timeout_s=900))
    timed("up -> healthy (without the connector)", lambda: poll(
        lambda: cluster.healthy(BEFORE_CDC), 600, "the services the connector needs",
        interval_s=2))
    timed("create tables", lambda: create_tables(cluster))
    workload = Workload(args.seed)
    timed("workload 0 (source, before the connector)",
          lambda: cluster.psql(workload.script(args.transactions)))
    timed("up cdc (initial snapshot) -> every service healthy", lambda: (
        cluster.run("up", "-d", "--no-build", timeout_s=900),
        poll(lambda: cluster.healthy(services), 600, "every service to be healthy",
             interval_s=2)))
    timed("prometheus scrapes every process",
          lambda: poll(lambda: scraped(cluster), 90, "prometheus to scrape every process"))
    counts = timed("initial snapshot -> snapshot = source",
                   lambda: converge(cluster, 180, "the gated snapshot to equal the source "
                                                  "after the initial snapshot"))
    snapshot_logs = [line for line in cluster.run("logs", "--no-color", "cdc").stdout
                     .splitlines() if "cdc_snapshot_" in line]
    if not snapshot_logs:
        raise Failed("the connector logged no initial snapshot (cdc_snapshot_*)")
    log(f"converged after the initial snapshot: {counts}; connector: "
        f"{snapshot_logs[-1].split('|', 1)[-1].strip()[:300]}")
    timed("workload 1 (source)", lambda: cluster.psql(workload.script(args.transactions)))
    counts = timed("workload 1 -> snapshot = source",
                   lambda: converge(cluster, 180, "the gated snapshot to equal the source"))
    log(f"converged after workload 1: {counts}")
    kill_and_recover(cluster, timings, workload, args.transactions)
    timed("workload 3 (after recovery)",
          lambda: cluster.psql(workload.script(args.transactions // 2)))
    counts = timed("workload 3 -> snapshot = source",
                   lambda: converge(cluster, 180, "the gated snapshot to equal the source "
                                                  "after the recovery"))
    log(f"converged after the recovery: {counts}")
    timed("ADD COLUMN, TRUNCATE (source)",
          lambda: schema_change_and_truncate(cluster, workload, args.transactions))
    counts = timed("ADD COLUMN, TRUNCATE -> snapshot = source",
                   lambda: converge(cluster, 180, "the gated snapshot to equal the source "
                                                  "after ADD COLUMN and TRUNCATE"))
    columns = snapshot_rows(cluster, "orders")
    if not columns or not any("note" in row for row in columns.values()):
        raise Failed("the Retina table orders did not gain the source's column note")
    log(f"PASS: the gated snapshot equals the source after the initial snapshot, a "
        f"{KILLED} kill, ADD COLUMN and TRUNCATE: {counts}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="compose_test", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--upstream", action="store_true",
                        help="use deploy/docker-compose.yml alone (registry images)")
    parser.add_argument("--project", default="retina-compose-test")
    parser.add_argument("--transactions", type=int, default=300)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--no-build", action="store_true", help="use the built images")
    parser.add_argument("--keep", action="store_true", help="leave the cluster running")
    args = parser.parse_args(argv)
    local = not args.upstream
    if local and subprocess.run(["docker", "image", "inspect", BASE_IMAGE],
                                capture_output=True).returncode != 0:
        print(f"compose-test: no {BASE_IMAGE} image; run `make compose-base` first",
              file=sys.stderr)
        return 2
    cluster = Cluster(args.project, local)
    timings: dict[str, float] = {}
    started = time.monotonic()
    ok = False
    try:
        run(cluster, args, timings)
        ok = True
    except (Failed, subprocess.SubprocessError) as exc:
        log(f"FAIL: {exc}")
        logs = cluster.run("logs", "--no-color", "--tail", "60", check=False).stdout
        print(logs, flush=True)
    finally:
        if args.keep:
            log(f"--keep: the cluster stays up; `{' '.join(cluster.base)} down -v` removes it")
        else:
            t0 = time.monotonic()
            cluster.run("down", "-v", "--remove-orphans", check=False, timeout_s=300)
            timings["down -v"] = time.monotonic() - t0
        timings["total"] = time.monotonic() - started
        for name, seconds in timings.items():
            print(f"  {name:<36} {seconds:8.1f} s")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
