#!/usr/bin/env bash
# A Spark standalone cluster on this machine from the pip package's spark-class: one
# master and one worker (2 cores), their logs and work directories under $DIR, and the
# Spark replay benchmark against it. Stops both however the benchmark ends.
#
#   bash bench/spark_standalone.sh [bench_spark_replay.py arguments]
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
DIR=${SPARK_STANDALONE_DIR:-$(mktemp -d /tmp/retina-spark-standalone-XXXXXX)}
MASTER_PORT=${SPARK_MASTER_PORT:-7077}
SPARK_HOME=$($PY -c "import os, pyspark; print(os.path.dirname(pyspark.__file__))")
export SPARK_HOME PYSPARK_PYTHON=$PWD/$PY SPARK_WORKER_DIR=$DIR/work SPARK_LOG_DIR=$DIR
master=spark://127.0.0.1:$MASTER_PORT

stop() {
    [[ -n ${worker_pid:-} ]] && kill "$worker_pid" 2>/dev/null || true
    [[ -n ${master_pid:-} ]] && kill "$master_pid" 2>/dev/null || true
    wait 2>/dev/null || true
}
trap stop EXIT

"$SPARK_HOME/bin/spark-class" org.apache.spark.deploy.master.Master --host 127.0.0.1 \
    --port "$MASTER_PORT" --webui-port 0 > "$DIR/master.log" 2>&1 &
master_pid=$!
for _ in $(seq 120); do  # our master, not one left over on the port, must be up
    grep -q "Starting Spark master at $master" "$DIR/master.log" && break
    kill -0 "$master_pid" 2>/dev/null || { echo "the Spark master exited (port $MASTER_PORT taken?):"; tail -n 20 "$DIR/master.log"; exit 1; }
    sleep 0.5
done
grep -q "Starting Spark master at $master" "$DIR/master.log" || { echo "the Spark master did not start in 60 s"; exit 1; }
"$SPARK_HOME/bin/spark-class" org.apache.spark.deploy.worker.Worker --host 127.0.0.1 --cores 2 \
    --memory 4g --webui-port 0 "$master" > "$DIR/worker.log" 2>&1 &
worker_pid=$!
for _ in $(seq 120); do  # the worker registers with the master within seconds
    grep -q "Successfully registered with master" "$DIR/worker.log" && break
    kill -0 "$worker_pid" 2>/dev/null || { echo "the Spark worker exited:"; tail -n 20 "$DIR/worker.log"; exit 1; }
    sleep 0.5
done
grep -q "Successfully registered with master" "$DIR/worker.log" || { echo "the Spark worker did not register in 60 s"; exit 1; }
echo "spark standalone: master $master, worker 2 cores, logs in $DIR"
$PY bench/bench_spark_replay.py --master "$master" "$@"
