"""A Spark job's task in a process of its own: ``python -m chaos.spark_task``.

The campaign runs the Spark jobs' drivers in its own process, without a JVM (chaos/gc_driver.py,
chaos/spark_replay.py), and their tasks (``storage_gc_task.rewrite_group``,
``cdc_replay.replay_vnode``) here, one process per task attempt, as a Spark executor's
Python worker runs them: the task's function and its plain arguments are pickled (as Spark
pickles them, by reference to the module), the failpoints are set for this process alone,
so a point of the task kills that process (a dead Spark task, exit 137) and never the
campaign. Running the same task again in a new process is Spark's task retry.

Reads ``(function, args)`` as a pickle on stdin, writes the function's result as a pickle
on stdout (anything the task prints goes to stderr).
"""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

TIMEOUT_S = 300.0


@dataclass(frozen=True)
class TaskRun:
    """One attempt: its exit code, its result (None unless it exited 0), its stderr tail."""

    exit_code: int
    result: Any = None
    stderr: str = ""


def run(function: Callable[..., Any], *args: Any, failpoints: str = "",
        failpoint_dir: str = "") -> TaskRun:
    """``function(*args)`` in a child process with ``RETINA_FAILPOINTS=failpoints`` (and
    ``RETINA_FAILPOINT_DIR``, which ``block`` and ``+once`` need)."""
    env = {**os.environ, "RETINA_FAILPOINTS": failpoints}
    if failpoint_dir:
        env["RETINA_FAILPOINT_DIR"] = failpoint_dir
    done = subprocess.run([sys.executable, "-m", "chaos.spark_task"],
                          input=pickle.dumps((function, args)), capture_output=True, env=env,
                          timeout=TIMEOUT_S, check=False)
    stderr = done.stderr.decode(errors="replace")[-2000:]
    if done.returncode != 0:
        return TaskRun(done.returncode, None, stderr)
    return TaskRun(0, pickle.loads(done.stdout), stderr)


def main() -> int:
    function, args = pickle.load(sys.stdin.buffer)
    out = sys.stdout.buffer
    sys.stdout = sys.stderr  # the pickle alone goes to stdout
    result = function(*args)
    pickle.dump(result, out)
    out.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
