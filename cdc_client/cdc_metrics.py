"""The connector's Prometheus metrics (``cdc_`` prefix: docs/architecture.md, "Observability
conventions")."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

TRANSACTIONS = Counter("cdc_transactions_total", "Source transactions committed to Retina")
ROWS = Counter("cdc_rows_total", "Row effects (net, per transaction) committed to Retina")
BATCH_SECONDS = Histogram("cdc_batch_seconds", "Poll-to-acknowledge time of one batch",
                          buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10))
BATCH_PHASE_SECONDS = Histogram("cdc_batch_phase_seconds",
                                "Time one batch spent in each phase (collect, begin, changelog, "
                                "send, commit_ack: the cdc_batch_committed log line's ms)",
                                ["phase"],
                                buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
                                         1, 2.5, 5, 10))
SNAPSHOT_LOADS = Counter("cdc_snapshot_bulk_loads_total",
                         "Initial-snapshot chunks by path: loaded (the bulk load path) or "
                         "fallback (the ordinary path at the same timestamp)", ["outcome"])
PENDING = Gauge("cdc_pending_transactions", "Source transactions read, not yet committed")
LAG_SECONDS = Gauge("cdc_lag_seconds",
                    "Source commit to Retina commit of the last batch, in seconds")
COMMITTED_TS = Gauge("cdc_committed_ts", "Timestamp of the last committed source transaction")
# Wall-clock time, unlike cdc_lag_seconds (set per batch, so it cannot grow while nothing
# commits): freshness on the dashboard and the "connector stalled" alert read this one.
LAST_COMMIT_TIME = Gauge("cdc_last_commit_timestamp_seconds",
                         "Unix time the last batch was committed to Retina (0: none yet)")
LAG_TIMESTAMPS = Gauge("cdc_lag_timestamps",
                       "How far the HWM trails the last committed timestamp (queries do not "
                       "see it yet: another writer's transaction is still open)")
REPLAY_ROWS = Counter("cdc_replay_rows_total", "Rows replayed into a recovering node", ["node"])
REPLAY_IN_PROGRESS = Gauge("cdc_replay_in_progress", "1 while a node is being replayed",
                           ["node"])
RETENTION_HORIZON_TS = Gauge("cdc_retention_horizon_ts",
                             "Changelog batches ending below this timestamp may be dropped")
RETAINED_FROM_TS = Gauge("cdc_changelog_retained_from_ts",
                         "The changelog low-watermark: it holds every batch at or above this "
                         "timestamp (read before and after every replay)")
REPLAY_GAP = Gauge("cdc_replay_gap",
                   "1 once a recovering node needed changelog batches retention had dropped "
                   "(the connector stopped, exit code 5)", ["node"])
SNAPSHOT_ROWS = Counter("cdc_snapshot_rows_total",
                        "Rows the PostgreSQL initial snapshot has read (handed to the batch loop)")
SNAPSHOT_IN_PROGRESS = Gauge("cdc_snapshot_in_progress",
                             "1 while the PostgreSQL initial snapshot is being read")
UNCHANGED_KEPT = Counter("cdc_unchanged_values_kept_total",
                         "Source values left out of a row (an unchanged TOAST value, a "
                         "Debezium placeholder) and sent as a partial update: the node keeps "
                         "the row's current value", ["source"])
PARTIAL_ROWS = Counter("cdc_partial_update_rows_total",
                       "Partial updates the connector committed (a row with some columns)")
