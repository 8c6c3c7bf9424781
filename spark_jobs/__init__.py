"""PySpark drivers: CDC replay, Storage GC rewrites and snapshot queries."""
