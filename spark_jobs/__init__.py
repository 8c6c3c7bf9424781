"""PySpark drivers over Retina: the parallel CDC changelog replay / backfill
(:mod:`spark_jobs.cdc_replay`), gated snapshot reads into DataFrames
(:mod:`spark_jobs.snapshot_query`) and Storage GC rewrites committed by the owning
nodes (:mod:`spark_jobs.storage_gc`). See docs/spark.md."""
