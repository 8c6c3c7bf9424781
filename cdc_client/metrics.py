"""The connector's Prometheus metrics (``cdc_`` prefix, ARCHITECTURE.md)."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

TRANSACTIONS = Counter("cdc_transactions_total", "Source transactions committed to Retina")
ROWS = Counter("cdc_rows_total", "Row effects (net, per transaction) committed to Retina")
BATCH_SECONDS = Histogram("cdc_batch_seconds", "Poll-to-acknowledge time of one batch",
                          buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10))
PENDING = Gauge("cdc_pending_transactions", "Source transactions read, not yet committed")
LAG_SECONDS = Gauge("cdc_lag_seconds",
                    "Source commit to Retina commit of the last batch, in seconds")
COMMITTED_TS = Gauge("cdc_committed_ts", "Timestamp of the last committed source transaction")
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
