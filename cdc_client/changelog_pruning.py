"""Changelog retention: drop only what no checkpoint could still ask for
(the horizon: ``retina_common/changelog_retention.py``). Batches ending below
the horizon are removed.
"""

from __future__ import annotations

import structlog

from cdc_client import cdc_metrics as m
from retina_common.changelog import Changelog
from retina_common.changelog_retention import horizon
from retina_common.etcd import EtcdStore
from retina_common.topology import Topology

log = structlog.get_logger("cdc.retention")


def run_retention(changelog: Changelog, etcd: EtcdStore, topology: Topology) -> int:
    ts = horizon(etcd, topology)
    m.RETENTION_HORIZON_TS.set(ts)
    removed = changelog.drop_before(ts) if ts > 0 else 0
    if removed:
        log.info("cdc_retention", horizon_ts=ts, batches_removed=removed)
    return removed
