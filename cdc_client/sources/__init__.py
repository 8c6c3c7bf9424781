"""CDC sources: PostgreSQL logical replication (pgoutput) and Debezium JSON-lines files."""
