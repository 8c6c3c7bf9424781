"""Exit codes: one name for each number a Retina process or tool exits with.

The servers (``retina-trans``, ``retina-server``, ``retina-cdc``), the command-line
tools (``retina-admin``, ``retina-gc``, ``retina-write``, ``retina-query``,
``retina-catalog``, ``retina-cluster``, ``retina-chaos``) and the Spark jobs exit with
these; docs/operations.md ("Processes and exit codes") says what each command means
by them. A number means the same everywhere; 3 and 5 have a second name where one
command gives them a meaning of its own.
"""

from __future__ import annotations

OK = 0
# Failed: run it again (retina-cdc: restart it, it resumes from its committed position;
# retina-write: the transaction is logged, the next run with the same writer applies it).
FAILED = 1
# Configuration or arguments the process cannot use; nothing was done.
USAGE = 2
# Refused: a plain restart or rerun fails again, an operator or a fixed input is needed
# (a node's refusal, a TransServer fenced by another, a connector stopped by an event).
REFUSED = 3
# retina-catalog: the connection broke during COMMIT; read the catalog before retrying.
OUTCOME_UNKNOWN = 3
# A dependency unreachable (at start, or the query gate closed): run it again later.
UNAVAILABLE = 4
# retina-cdc and spark_jobs.cdc_replay: a node needs changelog retention has dropped.
REPLAY_GAP = 5
# retina-server: the shutdown missed its deadline and the process exited anyway (a crash,
# the next start recovers).
SHUTDOWN_FORCED = 5
# retina-cdc: a source schema change Retina cannot follow (docs/cdc.md, "Schema changes").
SCHEMA_CHANGE = 6
# A failpoint's ``exit(137)`` (retina_common/failpoints.py): as if killed by SIGKILL.
KILLED_AT_FAILPOINT = 137
# Stopped by SIGTERM before finishing (retina-chaos): 128 + SIGTERM.
TERMINATED = 143
