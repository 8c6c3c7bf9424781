"""PySpark drivers over Retina: the parallel CDC changelog replay / backfill
(:mod:`spark_jobs.cdc_replay`) and gated snapshot reads into DataFrames
(:mod:`spark_jobs.snapshot_query`). See docs/spark.md."""
