"""Monitoring as deployed: the Prometheus configuration and alert rules pass
``promtool`` (check and unit tests), the Grafana dashboards are well formed, and
every metric an alert or a panel queries is one the processes really export,
scraped from a running TransServer, Retina node and CDC connector.

promtool comes from Debian's ``prometheus`` package (scripts/setup.sh); without
it these tests fail rather than skip, so CI cannot pass without checking the rules.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import requests
import yaml
from prometheus_client.parser import text_string_to_metric_families

from devtools.cluster import PostgresInstance, free_port
from retina_common.catalog import Catalog
from retina_common.config import RetinaConfig
from retina_common.etcd import EtcdStore

from .cdc import CdcPlane, SourceDb
from .dataplane import DataPlane
from .support import eventually

REPO = Path(__file__).resolve().parent.parent
DEPLOY = REPO / "deploy"
PROMETHEUS_CONFIG = DEPLOY / "prometheus.yml"
ALERTS = DEPLOY / "prometheus" / "alerts.yml"
ALERTS_TEST = DEPLOY / "prometheus" / "alerts_test.yml"
DASHBOARDS = DEPLOY / "grafana" / "dashboards"
GRAFANA_PROVISIONING = DEPLOY / "grafana" / "provisioning"
COMPOSE = DEPLOY / "docker-compose.yml"
# Series Prometheus records itself for every scrape target; no process exports them.
PROMETHEUS_OWN = frozenset({"up"})
# Where the prom/prometheus image reads its configuration unless told otherwise.
PROMETHEUS_DEFAULT_CONFIG = "/etc/prometheus/prometheus.yml"


# --- reading PromQL ----------------------------------------------------------------------------
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'')
_MATCHERS = re.compile(r"\{[^}]*\}")
_RANGES = re.compile(r"\[[^\]]*\]")
_GROUPING = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)")
_IDENT = re.compile(r"(?<![\w.$])[a-zA-Z_:][a-zA-Z0-9_:]*")
_KEYWORDS = frozenset({"and", "or", "unless", "bool", "offset", "inf", "nan", "group_left",
                       "group_right"})
_SELECTOR = re.compile(r"([a-zA-Z_:][a-zA-Z0-9_:]*)\s*\{([^}]*)\}")
_EQUAL_MATCHER = re.compile(r'(\w+)\s*=(?![~=])\s*"([^"]*)"')


def metric_names(expr: str) -> set[str]:
    """Metric names a PromQL expression selects: identifiers left once strings, label
    matchers, ranges and grouping clauses are gone, except functions and keywords."""
    rest = _GROUPING.sub(" ", _RANGES.sub(" ", _MATCHERS.sub(" ", _STRING.sub('""', expr))))
    return {m.group() for m in _IDENT.finditer(rest)
            if m.group().lower() not in _KEYWORDS and not rest[m.end():].lstrip().startswith("(")}


def equality_matchers(expr: str) -> set[tuple[str, str, str]]:
    """(metric, label, value) for every ``metric{label="value"}`` in the expression."""
    return {(name, label, value) for name, body in _SELECTOR.findall(expr)
            for label, value in _EQUAL_MATCHER.findall(body)}


def test_metric_names_reads_promql() -> None:
    expr = ('sum by (job, instance) (rate(a_total{x="y", z=~"b_.*"}[5m])) > 3 * b '
            'and on (job) c{phase="READY"} == 1 or histogram_quantile(0.99, d_bucket) '
            'unless e offset 1m > 1e3')
    assert metric_names(expr) == {"a_total", "b", "c", "d_bucket", "e"}
    assert equality_matchers(expr) == {("a_total", "x", "y"), ("c", "phase", "READY")}


# --- the deployed files ------------------------------------------------------------------------
def alert_rules() -> list[dict[str, Any]]:
    groups = yaml.safe_load(ALERTS.read_text())["groups"]
    return [rule for group in groups for rule in group["rules"]]


def dashboards() -> dict[str, dict[str, Any]]:
    return {path.name: json.loads(path.read_text()) for path in sorted(DASHBOARDS.glob("*.json"))}


def panel_exprs() -> dict[str, list[str]]:
    """Each dashboard's PromQL expressions, by file name."""
    return {name: [target["expr"] for panel in board["panels"] for target in panel["targets"]]
            for name, board in dashboards().items()}


def promtool(*args: str) -> subprocess.CompletedProcess[str]:
    path = shutil.which("promtool")
    assert path, ("promtool is missing: scripts/setup.sh installs it (Debian package "
                  "'prometheus'); the alert rules cannot be checked without it")
    return subprocess.run([path, *args], cwd=REPO, capture_output=True, text=True, timeout=120,
                          check=False)


@pytest.mark.parametrize("args", [
    ("check", "config", "deploy/prometheus.yml"),
    ("check", "rules", "deploy/prometheus/alerts.yml"),
    ("test", "rules", "deploy/prometheus/alerts_test.yml"),
], ids=["check-config", "check-rules", "test-rules"])
@pytest.mark.integration
def test_promtool_accepts_the_deployed_files(args: tuple[str, ...]) -> None:
    result = promtool(*args)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.integration
def test_promtool_rejects_a_broken_rule(tmp_path: Path) -> None:
    """The checks above can fail: a rule with a PromQL syntax error does not pass."""
    broken = tmp_path / "alerts.yml"
    broken.write_text("groups:\n  - name: g\n    rules:\n      - alert: Broken\n"
                      "        expr: rate(trans_gate_refusals_total[1m] > 0\n")
    result = promtool("check", "rules", str(broken))
    assert result.returncode != 0, result.stdout


def test_every_alert_has_firing_and_quiet_unit_tests() -> None:
    """alerts_test.yml checks each alert both ways: firing once its condition has held
    long enough, and not firing before (or for look-alike series)."""
    cases = [case for test in yaml.safe_load(ALERTS_TEST.read_text())["tests"]
             for case in test["alert_rule_test"]]
    for rule in alert_rules():
        name = rule["alert"]
        mine = [case for case in cases if case["alertname"] == name]
        assert any(case.get("exp_alerts") for case in mine), f"{name}: no firing case"
        assert any(not case.get("exp_alerts") for case in mine), f"{name}: no quiet case"
        assert rule["labels"]["severity"] in ("warning", "critical"), name
        assert rule["annotations"]["runbook"].startswith("docs/operations.md#"), name


def test_every_alert_is_documented() -> None:
    operations = (REPO / "docs" / "operations.md").read_text()
    assert "## Monitoring and alerts" in operations
    for rule in alert_rules():
        assert f"`{rule['alert']}`" in operations, f"{rule['alert']} is not in operations.md"


def test_dashboards_are_well_formed() -> None:
    datasources = yaml.safe_load(
        (GRAFANA_PROVISIONING / "datasources" / "prometheus.yml").read_text())["datasources"]
    uids = {ds["uid"] for ds in datasources if ds["type"] == "prometheus"}
    boards = dashboards()
    assert {"retina-nodes.json", "cdc-connector.json", "storage-gc.json"} <= set(boards)
    assert len({board["uid"] for board in boards.values()}) == len(boards), "duplicate uid"
    for name, board in boards.items():
        assert board["schemaVersion"] >= 36 and board["title"], name
        ids = [panel["id"] for panel in board["panels"]]
        assert len(ids) == len(set(ids)), f"{name}: duplicate panel ids"
        for panel in board["panels"]:
            where = f"{name} panel {panel['id']} ({panel['title']})"
            assert panel["datasource"]["uid"] in uids, where
            assert {"h", "w", "x", "y"} <= set(panel["gridPos"]), where
            assert panel["targets"], where
            ref_ids = [target["refId"] for target in panel["targets"]]
            assert len(ref_ids) == len(set(ref_ids)), where
            for target in panel["targets"]:
                assert metric_names(target["expr"]), f"{where}: no metric in {target['expr']}"
                if "datasource" in target:
                    assert target["datasource"]["uid"] in uids, where


@pytest.mark.integration
def test_dashboard_queries_parse_as_promql(tmp_path: Path) -> None:
    """Each panel query is valid PromQL: promtool parses it as a recording rule's."""
    rules = [{"record": f"dashboard_check:query_{i}", "expr": expr}
             for i, expr in enumerate(e for exprs in panel_exprs().values() for e in exprs)]
    path = tmp_path / "panels.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "panels", "rules": rules}]}))
    result = promtool("check", "rules", str(path))
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"{len(rules)} rules found" in result.stdout


def compose_service(name: str) -> dict[str, Any]:
    return yaml.safe_load(COMPOSE.read_text())["services"][name]


def host_path(service: dict[str, Any], container_path: str) -> Path | None:
    """The file on the host (under deploy/) the service sees at ``container_path``."""
    for volume in service.get("volumes", []):
        if isinstance(volume, dict):
            source, target = volume.get("source", ""), volume.get("target", "")
        else:
            source, target = [*volume.split(":"), ""][:2]
        if not source.startswith("."):
            continue  # a named volume
        if container_path == target or container_path.startswith(target.rstrip("/") + "/"):
            return (DEPLOY / source / Path(container_path).relative_to(target)).resolve()
    return None


def test_compose_mounts_what_the_configurations_name() -> None:
    """Prometheus finds its rule files, and Grafana its dashboards, inside the containers."""
    prometheus = compose_service("prometheus")
    flags = [arg for arg in prometheus.get("command", []) if arg.startswith("--config.file=")]
    config_in_container = flags[-1].split("=", 1)[1] if flags else PROMETHEUS_DEFAULT_CONFIG
    assert host_path(prometheus, config_in_container) == PROMETHEUS_CONFIG.resolve()
    config_dir = Path(config_in_container).parent
    for rule_file in yaml.safe_load(PROMETHEUS_CONFIG.read_text())["rule_files"]:
        assert (PROMETHEUS_CONFIG.parent / rule_file).resolve() == ALERTS.resolve()
        assert host_path(prometheus, str(config_dir / rule_file)) == ALERTS.resolve(), (
            f"docker-compose.yml does not mount {rule_file} next to prometheus.yml")
    grafana = compose_service("grafana")
    providers = yaml.safe_load(
        (GRAFANA_PROVISIONING / "dashboards" / "retina.yml").read_text())["providers"]
    for provider in providers:
        assert host_path(grafana, provider["options"]["path"]) == DASHBOARDS.resolve()


# --- every queried metric is exported ----------------------------------------------------------
def exported_series(text: str) -> tuple[set[str], set[tuple[str, str, str]]]:
    """Series names a /metrics page offers (counters as ``_total``, histograms as
    ``_bucket``/``_sum``/``_count``, families without samples yet included), and the
    (name, label, value) of every sample."""
    names: set[str] = set()
    labels: set[tuple[str, str, str]] = set()
    suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"),
                "summary": ("", "_sum", "_count"), "gauge": ("",), "unknown": ("",)}
    for family in text_string_to_metric_families(text):
        names.update(family.name + suffix for suffix in suffixes.get(family.type, ("",)))
        for sample in family.samples:
            names.add(sample.name)
            labels.update((sample.name, k, v) for k, v in sample.labels.items())
    return names, labels


@pytest.fixture
def cdc_cluster(tmp_path: Path, etcd: EtcdStore, catalog: Catalog, catalog_dsn: str,
                pg_server: PostgresInstance) -> Iterator[CdcPlane]:
    """A TransServer, two Retina nodes serving /metrics, a source database and the
    connector (which drives both nodes to READY)."""
    plane = DataPlane(tmp_path / "plane", etcd, catalog, catalog_dsn, nodes=2,
                      retina={"block_rows": 16, "blocks_per_file": 2, "flush_interval_ms": 200})
    for proc in plane.retinas.values():
        proc.metrics_listen = f"127.0.0.1:{free_port()}"
    source = SourceDb(pg_server)
    cdc: CdcPlane | None = None
    try:
        plane.start(recover=False)  # the connector drives both nodes to READY (a replay)
        cdc = CdcPlane(plane, source, tmp_path)
        cdc.cdc.start()
        yield cdc
    finally:
        if cdc is not None:
            cdc.cdc.terminate()
        plane.stop()
        source.drop()


def value(page: str, name: str, **labels: str) -> float:
    """The one sample ``name{labels}`` on a /metrics page."""
    found = [sample.value for family in text_string_to_metric_families(page)
             for sample in family.samples
             if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items())]
    assert len(found) == 1, f"{name}{labels}: {found}"
    return found[0]


def scrape(address: str) -> str:
    response = requests.get(f"http://{address}/metrics", timeout=10)
    response.raise_for_status()
    return response.text


def _assert_alert_inputs(trans: str, retina: str, connector: str) -> None:
    """The inputs the alerts compute with hold what they claim on a healthy cluster."""
    assert value(trans, "trans_gate_watch_up") == 1
    assert value(retina, "retina_lifecycle_state", phase="READY") == 1
    # The READY checkpoint was installed; the interval is the configured one.
    assert 0 < value(retina, "retina_checkpoint_last_success_timestamp_seconds") <= time.time()
    assert value(retina, "retina_checkpoint_interval_seconds") == \
        RetinaConfig().checkpoint_interval_ms / 1000
    assert value(retina, "retina_gc_journal_state_age_seconds",
                 state="SWAPPED_NOT_CHECKPOINTED") == 0  # no Storage GC has run
    assert 0 < value(connector, "cdc_last_commit_timestamp_seconds") <= time.time()
    assert value(connector, "cdc_pending_transactions") == 0
    # Every committed batch was timed in each of its phases.
    batches = value(connector, "cdc_batch_seconds_count")
    assert batches > 0
    for phase in ("collect", "begin", "changelog", "send", "commit_ack"):
        assert value(connector, "cdc_batch_phase_seconds_count", phase=phase) == batches, phase


@pytest.mark.integration
def test_alerts_and_dashboards_query_exported_metrics(cdc_cluster: CdcPlane) -> None:
    cdc = cdc_cluster
    eventually(cdc.all_ready, 60, "the connector to drive both nodes to READY")
    assert cdc.source is not None
    cdc.source.run(20)
    cdc.converged()
    retina = next(iter(cdc.plane.retinas.values()))
    addresses = [cdc.plane.trans.metrics, retina.metrics_listen,
                 cdc.cdc.settings["metrics_listen"]]

    def settled() -> list[str]:
        # The connector updates its metrics just after a batch is visible: scrape again
        # until the last batch's are in.
        pages = [scrape(address) for address in addresses]
        _assert_alert_inputs(*pages)
        return pages

    pages = eventually(settled, 30, "the metrics of the last batch")
    names: set[str] = set(PROMETHEUS_OWN)
    samples: set[tuple[str, str, str]] = set()
    for page in pages:
        page_names, page_samples = exported_series(page)
        names |= page_names
        samples |= page_samples

    used = {f"alerts.yml: {rule['alert']}": rule["expr"] for rule in alert_rules()}
    used.update({f"{board} expr {i}": expr for board, exprs in panel_exprs().items()
                 for i, expr in enumerate(exprs)})
    unknown = {where: sorted(metric_names(expr) - names) for where, expr in used.items()
               if metric_names(expr) - names}
    assert not unknown, f"metrics no process exports: {unknown}"
    # A selector on a label value matches a series the processes really produce.
    missing = {where: sorted(matcher for matcher in equality_matchers(expr)
                             if matcher[0] not in PROMETHEUS_OWN and matcher not in samples)
               for where, expr in used.items()}
    assert not {w: m for w, m in missing.items() if m}, f"label values never exported: {missing}"
