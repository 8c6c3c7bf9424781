"""The drivers' result accumulator, in a module of its own so that the jobs' pure parts
(grouping, rewriting, the chaos campaign's use of them) import without pyspark."""

from __future__ import annotations

from pyspark.accumulators import AccumulatorParam


class KeyedResults(AccumulatorParam):
    """key → a task's result. Merging replaces by key: a re-run task reports the same
    key again, so a task retried by Spark can never add its figures twice."""

    def zero(self, value: dict) -> dict:
        return {}

    def addInPlace(self, value1: dict, value2: dict) -> dict:
        # A new dict, so the driver can read a snapshot while updates arrive.
        return {**value1, **value2}
