# Retina: the two commands a newcomer needs are `make demo` and `make test`.
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
STATE ?= .retina-cluster

.PHONY: setup demo test test-fast lint typecheck bench chaos gc proto cluster-up cluster-down cluster-status cluster-restart-node clean

setup:
	@bash scripts/setup.sh

proto: setup
	@$(PY) -m retina_common.codegen

demo: setup
	@$(PY) scripts/demo.py $(DEMO_ARGS)

# TEST_WORKERS: pytest-xdist workers, each with its own etcd and PostgreSQL (0: one process).
TEST_WORKERS ?= 2

test: setup
	@$(PY) -m pytest -n $(TEST_WORKERS) --dist worksteal $(PYTEST_ARGS)

# The tests that start no process (not marked `integration`; tests/process_guard.py fails
# an unmarked test that starts one): pure logic, under two minutes.
test-fast: setup
	@$(PY) -m pytest -m "not integration" $(PYTEST_ARGS)

# A seeded fault campaign on a private cluster (docs/chaos.md). Default: a short one;
# e.g. `make chaos CHAOS_ARGS="--seed 7 --episodes 1000 --json chaos.json"`.
CHAOS_ARGS ?= --seed 1 --episodes 20

chaos: setup
	@$(PY) -m chaos $(CHAOS_ARGS)

# Storage GC rewrites with Spark over the local cluster (docs/spark.md, "storage_gc");
# e.g. `make gc GC_ARGS="--schema shop --table orders --dry-run"`.
GC_ARGS ?= --schema shop --all-tables

gc: setup
	@$(PY) -m spark_jobs.storage_gc --config $(STATE)/retina.toml $(GC_ARGS)

lint: setup
	@$(VENV)/bin/ruff check .

# mypy on the runtime packages (retina_common, retina_server, trans_gate, cdc_client,
# spark_jobs; settings in pyproject.toml, [tool.mypy]).
typecheck: setup
	@$(VENV)/bin/mypy

# The figures of docs/performance.md; the 100M-row start is apart (it builds its state for
# about two minutes): `.venv/bin/python bench/bench_recovery.py --files 10000 --runs 3`.
bench: setup
	@$(PY) bench/bench_trans.py
	@$(PY) bench/bench_dataplane.py
	@$(PY) bench/bench_dataplane.py --batch 5000 --batches 20
	@$(PY) bench/bench_lookup.py
	@$(PY) bench/bench_partial_updates.py
	@$(PY) bench/bench_apply_stages.py
	@$(PY) bench/bench_connector_stages.py
	@$(PY) bench/bench_write_fence.py
	@$(PY) bench/bench_history.py
	@$(PY) bench/bench_consumers.py
	@$(PY) bench/bench_writer.py
	@$(PY) bench/bench_recovery.py
	@$(PY) bench/bench_cdc.py
	@$(PY) bench/bench_change_feed.py
	@$(PY) bench/bench_spark_replay.py

# Sweepers under steady CDC load with Storage GC on (bench/bench_sweepers.py): footprint over
# time and a held read transaction; e.g. `make bench-sweepers SWEEPERS_ARGS="--minutes 10 --json"`.
SWEEPERS_ARGS ?= --minutes 5 --sample-s 10

.PHONY: bench-sweepers
bench-sweepers: setup
	@$(PY) bench/bench_sweepers.py $(SWEEPERS_ARGS)

# Storage GC beside a steady write load (bench/bench_gc_writers.py, docs/performance.md
# "Storage GC beside writers"): writer and freshness p99 with and without three GC runs.
GC_WRITERS_ARGS ?= --seconds 90

.PHONY: bench-gc-writers
bench-gc-writers: setup
	@$(PY) bench/bench_gc_writers.py $(GC_WRITERS_ARGS)

# Retina beside Delta Lake, Iceberg and Paimon on one CDC workload (bench/bench_peers.py,
# docs/performance.md). The peers run in their own virtual environment, .venv-peers
# (pypaimon pins pyarrow below Retina's), made here once; e.g.
# `make bench-peers PEERS_ARGS="--rows 50000 --budget-s 60"`.
PEERS_VENV ?= .venv-peers
PEERS_PACKAGES := deltalake==1.6.6 pyiceberg[sql-sqlite]==0.12.0 pypaimon==2.1.0 matplotlib==3.11.2
PEERS_ARGS ?=

# Bulk load beside Delta's and Paimon's batch writes (bench/bench_bulk_load.py,
# docs/performance.md "Bulk load"); the peers in .venv-peers, as bench-peers makes it.
LOAD_ARGS ?=

.PHONY: bench-load
bench-load: setup
	@if [ ! -x $(PEERS_VENV)/bin/python ] || ! $(PEERS_VENV)/bin/python -c "import deltalake, pypaimon" 2>/dev/null; then \
		echo "bench-load: creating $(PEERS_VENV) ($(PEERS_PACKAGES))"; \
		python3 -m venv $(PEERS_VENV) && \
		$(PEERS_VENV)/bin/pip install -q --disable-pip-version-check $(PEERS_PACKAGES); \
	fi
	@$(PY) bench/bench_bulk_load.py --peers-python $(PEERS_VENV)/bin/python $(LOAD_ARGS)

# The Spark replay on a real standalone cluster (a master and a worker from the pip package's
# spark-class, started and stopped around the run): bench/spark_standalone.sh.
.PHONY: bench-spark-standalone
bench-spark-standalone: setup
	@bash bench/spark_standalone.sh $(SPARK_ARGS)

.PHONY: bench-peers
bench-peers: setup
	@if [ ! -x $(PEERS_VENV)/bin/python ] || ! $(PEERS_VENV)/bin/python -c "import deltalake, pyiceberg, pypaimon, matplotlib" 2>/dev/null; then \
		echo "bench-peers: creating $(PEERS_VENV) ($(PEERS_PACKAGES))"; \
		python3 -m venv $(PEERS_VENV) && \
		$(PEERS_VENV)/bin/pip install -q --disable-pip-version-check $(PEERS_PACKAGES); \
	fi
	@$(PY) bench/bench_peers.py --peers-python $(PEERS_VENV)/bin/python --json peers.json $(PEERS_ARGS)
	@$(PEERS_VENV)/bin/python bench/peers/plot.py peers.json peers.png && echo "bench-peers: figures in peers.json, plot in peers.png"

# The local cluster under $(STATE) (docs/operations.md, "A local cluster"): etcd, PostgreSQL,
# the TransServer and, with RETINA=N, a topology of N Retina nodes started with it
# (`retina-cluster start --retina N`); e.g. `make cluster-up RETINA=2`.
RETINA ?= 0

cluster-up: setup
	@$(VENV)/bin/retina-cluster start --state-dir $(STATE) \
		$(if $(filter-out 0,$(RETINA)),--retina $(RETINA))

cluster-down: setup
	@$(VENV)/bin/retina-cluster stop --state-dir $(STATE)

cluster-status: setup
	@$(VENV)/bin/retina-cluster status --state-dir $(STATE)

# Stop (SIGTERM) and start one Retina node at its address, metrics address and state
# directory; e.g. `make cluster-restart-node NODE=127.0.0.1:24001` (`make cluster-status`
# lists the nodes).
cluster-restart-node: setup
	@$(VENV)/bin/retina-cluster restart-node $(NODE) --state-dir $(STATE)

# constraints.txt: every Python package pinned (scripts/update_constraints.sh). `constraints`
# pins what .venv holds; `constraints-upgrade` resolves the newest releases pyproject.toml
# allows in a throw-away venv (then `make setup` installs them here; run `make test`).
.PHONY: constraints constraints-upgrade
constraints:
	@bash scripts/update_constraints.sh

constraints-upgrade:
	@bash scripts/update_constraints.sh --upgrade

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .mypy_cache retina_common/pb/*_pb2*.py retina_common/pb/*_pb2*.pyi

# The containerised cluster (docs/operations.md, "Containerised cluster"), built
# without an image registry: compose-base debootstraps Debian bookworm into the
# retina-base:bookworm image; the local override builds every service from it.
# COMPOSE: docker-compose (v1, Debian's package) if installed, else `docker compose`.
COMPOSE ?= $(shell command -v docker-compose >/dev/null 2>&1 && echo docker-compose || echo docker compose)
COMPOSE_FILES := -p retina -f deploy/docker-compose.yml -f deploy/docker-compose.local.yml

.PHONY: compose-prereqs compose-base compose-up compose-down compose-test
compose-prereqs:
	@deploy/images/prereqs.sh

compose-base: compose-prereqs
	@deploy/images/build-base.sh

compose-up: compose-base
	$(COMPOSE) $(COMPOSE_FILES) up -d --build

compose-down:
	$(COMPOSE) $(COMPOSE_FILES) down

# Up, a CDC workload, a Retina container killed and recovered, the gated snapshot
# compared with the source, down -v; e.g. COMPOSE_TEST_ARGS="--keep".
compose-test: compose-base
	@COMPOSE="$(COMPOSE)" python3 scripts/compose_test.py $(COMPOSE_TEST_ARGS)
