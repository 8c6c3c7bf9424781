"""One GC rewrite task in a process of its own: ``python -m chaos.gc_task``.

The campaign's GC passes rewrite in-process (chaos/gc.py), except when a failpoint of the
rewrite task itself is armed (``gc.rewrite.write.*``, hit inside the job's
``rewrite_group``, i.e. inside a Spark task): then each group's rewrite runs here, with
``RETINA_FAILPOINTS`` set for this process alone, so the point kills this process (a dead
Spark task) and never the campaign. Reads the TaskSpec and RewriteTask as JSON on stdin,
writes the RewriteResult as JSON on stdout.
"""

from __future__ import annotations

import json
import sys
from dataclasses import asdict
from typing import Any

from spark_jobs.storage_gc import FileRef, RewriteResult, RewriteTask, TaskSpec, rewrite_group


def encode(spec: TaskSpec, task: RewriteTask) -> str:
    return json.dumps({"spec": asdict(spec), "task": asdict(task)})


def decode(text: str) -> tuple[TaskSpec, RewriteTask]:
    data: dict[str, Any] = json.loads(text)
    task = dict(data["task"])
    task["files"] = tuple(FileRef(**f) for f in task["files"])
    return TaskSpec(**data["spec"]), RewriteTask(**task)


def result_of(text: str) -> RewriteResult:
    return RewriteResult(**json.loads(text))


def main() -> int:
    spec, task = decode(sys.stdin.read())
    json.dump(asdict(rewrite_group(spec, task)), sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
