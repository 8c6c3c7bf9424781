"""The periodic Storage GC rewrite, launched by the node itself (``retina.gc_job_interval_ms``).

The rewrite is Spark's work (spark_jobs/storage_gc.py); without an external
scheduler (cron, Airflow) a deployment would never reclaim space. So a READY
node can run the job for its own streams (``--node <self>``) every interval,
one run at a time, as a child process: ``python -m spark_jobs.storage_gc
--config <this config> --node <self> --all-tables <retina.gc_job_args>``
(``--master spark://...`` in ``gc_job_args`` sends the work to a cluster), under
``nice -n <retina.gc_job_nice>`` (default 10).
Off by default (interval 0): the job is as often run by an operator's
scheduler. A run's exit code and summary line are logged and counted; a
failed run is retried at the next interval, never sooner.
"""

from __future__ import annotations

import importlib.util
import shlex
import subprocess
import sys
import threading
from collections.abc import Callable

from prometheus_client import Counter

from retina_common.config import ConfigError
from retina_common.log import get_logger

log = get_logger(component="gc_job")
RUNS = Counter("retina_gc_job_runs_total", "Storage GC job runs launched by this node",
               ["exit_code"])


def require_spark() -> None:
    """A node set to launch the job needs pyspark in its own environment (the ``spark``
    extra); found missing at start, not an interval later as a failed run."""
    if importlib.util.find_spec("pyspark") is None:
        raise ConfigError("retina.gc_job_interval_ms > 0 launches the Spark GC job, but pyspark "
                          "is not installed: pip install 'retina[spark]', or set the interval "
                          "to 0 and schedule spark_jobs.storage_gc elsewhere")


class GcJobLauncher:
    def __init__(self, node_id: str, config_path: str, interval_s: float, extra_args: str,
                 stop: threading.Event, is_ready: Callable[[], bool],
                 timeout_s: float = 3600.0, nice: int = 0) -> None:
        # Under nice: in local mode Spark shares the node's cores, and the write path must
        # not wait behind it (`nice` is coreutils, on every Linux the node runs on).
        self._argv = ["nice", "-n", str(nice)] if nice else []
        self._argv += [sys.executable, "-m", "spark_jobs.storage_gc", "--config", config_path,
                       "--node", node_id, "--all-tables", *shlex.split(extra_args)]
        self._interval = interval_s
        self._stop = stop
        self._is_ready = is_ready
        self._timeout = timeout_s
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def start(self) -> None:
        """Idempotent; does nothing when the interval is 0 (off)."""
        with self._lock:
            if self._interval <= 0 or self._thread is not None:
                return
            self._thread = threading.Thread(target=self._loop, name="gc-job", daemon=True)
            self._thread.start()

    def _loop(self) -> None:
        while not self._stop.wait(self._interval):
            if self._is_ready():
                self.run_once()

    def run_once(self) -> int:
        try:
            done = subprocess.run(self._argv, capture_output=True, text=True,
                                  timeout=self._timeout)
        except (OSError, subprocess.TimeoutExpired) as exc:
            RUNS.labels(exit_code="launch_failed").inc()
            log.error("gc_job_failed_to_run", error=str(exc))
            return -1
        summary = next((line for line in reversed(done.stdout.splitlines())
                        if line.startswith(("done:", "dry run:"))), "")
        RUNS.labels(exit_code=str(done.returncode)).inc()
        (log.info if done.returncode == 0 else log.warning)(
            "gc_job_run", exit_code=done.returncode, summary=summary,
            stderr=done.stderr[-500:] if done.returncode else "")
        return done.returncode
