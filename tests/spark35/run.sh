#!/usr/bin/env bash
# The writer's representative tests on classic PySpark 3.5 (Java 17), next to the pinned 4.x:
# retries, empty batches and partitions, changing partition counts, replay after a commit, lineage
# refusal, every Kafka-sink column, the Kafka source with both triggers.
#
#   bash tests/spark35/run.sh [pytest args...]
#
# Builds (once) a venv on top of the project's environment (`pip install -e '.[test]'` first) in
# which pyspark 3.5.7 replaces the pinned 4.x (3.5.7: the newest 3.5 whose Kafka connector Maven
# Central serves), then runs the subset with this checkout first on the path. Exits non-zero when
# a test fails or none ran.
set -euo pipefail
cd "$(dirname "$0")/../.."
REPO=$PWD
PYSPARK35=3.5.7
VENV=${SPARK35_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/spark-kafka-eos/venv-pyspark-$PYSPARK35}
PYTHON=${PYTHON:-python3}

if [ ! -x "$VENV/bin/python" ] || ! "$VENV/bin/python" -c "import pyspark, sys; sys.exit(pyspark.__version__ != '$PYSPARK35')" 2>/dev/null; then
    rm -rf "$VENV"
    "$PYTHON" -m venv --system-site-packages "$VENV"
    "$VENV/bin/pip" install -q "pyspark==$PYSPARK35"
fi
"$VENV/bin/python" -c "import pyspark; print('pyspark', pyspark.__version__, pyspark.__file__)"
java -version 2>&1 | head -1

START=$(date +%s)
set +e
PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}" "$VENV/bin/python" -m pytest -p no:cacheprovider -q -ra \
    tests/spark/test_spark_writer.py tests/spark/test_spark_triggers.py \
    -k "several_batches or same_checkpoint_continues or wrong_or_missing_columns or every_kafka_sink_column or trigger" \
    "$@"
CODE=$?
set -e
echo "spark 3.5 subset: exit $CODE in $(( $(date +%s) - START )) s"
# pytest's 5 (no test ran) is a failure here too
exit $CODE
