"""A Spark driver for the crash tests (tests/test_spark_crash.py), run as a subprocess in its own
session: a file-source streaming query (one file per micro-batch, availableNow) written through
the exactly-once writer, each batch repartitioned to 3 partitions. With a kill step it SIGKILLs
its whole process group (driver, JVM, Python workers) at that protocol step.

    python tests/spark_crash_driver.py '<json: bootstrap, url, token, sink, topic, source, checkpoint,
                                         kill (step or null), kill_batch (int or null)>'
Kill steps: after_lease (an executor task, after its lease), before_commit (the driver, after every
pre-commit), decided (the driver, once the coordinator recorded the commit decision), after_commit
(the driver, after the commit and before Spark writes its commit log).
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any


def main() -> int:
    args = json.loads(sys.argv[1])
    os.environ["SPARK_CRASH_TEST_GROUP"] = str(os.getpgrp())  # inherited by the JVM and its workers
    assert os.getpgrp() == os.getpid(), "start the crash driver in its own session"
    from pyspark.errors import StreamingQueryException
    from pyspark.sql import functions as F

    from spark_support import KillGroup, KillWhenDecided, spark_session
    from sparkclient import ExactlyOnceKafkaWriter

    kill, batch = args.get("kill"), args.get("kill_batch")
    hook: Any = None
    if kill == "decided":
        hook = KillWhenDecided(args["url"], args["token"], args["sink"], batch)
    elif kill:
        hook = KillGroup(kill, batch)
    spark = spark_session("crash-driver")
    writer = ExactlyOnceKafkaWriter({
        "kafka.bootstrap.servers": args["bootstrap"], "topic": args["topic"], "coordinator.url": args["url"],
        "coordinator.token": args["token"], "coordinator.sink": args["sink"],
        "checkpointLocation": args["checkpoint"], "provenance.headers": "true",
    }, fault_hook=hook, on_batch=lambda r: print(f"[driver] {r.line()}", flush=True))

    def each_batch(df: Any, batch_id: int) -> None:
        writer(df.repartition(3), batch_id)

    rows = spark.readStream.schema("n INT").option("maxFilesPerTrigger", 1).json(args["source"])
    out = rows.select(F.col("n").cast("string").alias("key"), F.col("n").cast("string").alias("value"))
    query = (out.writeStream.foreachBatch(each_batch).option("checkpointLocation", args["checkpoint"])
             .trigger(availableNow=True).start())
    try:
        query.awaitTermination()
    except StreamingQueryException as exc:
        print(f"[driver] query failed: {exc}", flush=True)
        return 1
    print("[driver] done", flush=True)
    spark.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
