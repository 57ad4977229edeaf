"""How the foreachBatch writer's driver runs a batch's write job and learns the query's identity,
on classic PySpark (3.5, 4.x) and on Spark Connect (4.x).

The write job: `df.mapInArrow(...)` on both APIs (no `df.rdd`: rows are not pickled for Python);
each task takes its partition from `TaskContext`, gets its rows as Arrow record batches
(sparkclient/executor.py) and returns one TaskResult as one pickled binary cell. `mapInArrow`
calls the function for empty partitions too, so `collect()` answers exactly one result per
partition, the one of the task try Spark accepted (a retried or speculative copy's is dropped),
and the partition count is the number of results. Nothing else runs a Spark job per batch: no
emptiness check (an empty batch is begun and committed without a transaction), and the checkpoint
files are read without one where the API allows it (sparkclient/checkpoint_files.py).

The identity (DESIGN §3 step 1): the query id is read from `<checkpointLocation>/metadata`. The
run id, and the check that the checkpoint location belongs to the running query:
- classic: the local properties Spark sets on the thread that runs foreachBatch (the running
  query's id, and the job group named by the run id);
- Connect: no local properties reach the foreachBatch function (it runs in a Python process of the
  Connect server, attached to the client's session). The query whose id the checkpoint holds must
  be active in that session (`spark.streams.get`), and its `runId` is the run id. Kept: a
  checkpoint location of no running query, or of a query of another session, is refused; a fresh
  checkpoint is a new query id, refused by the coordinator's lineage check. Not kept: with two
  queries running in one session, a writer given the OTHER query's checkpoint location is not
  detected (classic detects it).
"""

from __future__ import annotations

import json
import pickle
from collections.abc import Iterator
from typing import Any

from .checkpoint_files import metadata_path, read_on_driver
from .executor import TaskResult, TaskSpec, TaskTry, write_task

# local properties Spark (classic) sets on the thread that runs foreachBatch, and on its tasks
QUERY_ID_PROPERTY = "sql.streaming.queryId"
RUN_ID_PROPERTY = "spark.jobGroup.id"  # StreamExecution runs every batch in a job group named by its run id
BATCH_ID_PROPERTY = "streaming.sql.batchId"  # set by MicroBatchExecution for its tasks
RESULT_COLUMN = "task_result"  # the pickled TaskResult of one task


class LineageError(RuntimeError):
    """The checkpoint location does not belong to the running query, or has no metadata."""


def is_connect(df: Any) -> bool:
    """A Spark Connect DataFrame (checked by module: importing Connect's classes needs its extras)."""
    return type(df).__module__.startswith("pyspark.sql.connect")


def coalesced(df: Any, max_tasks: int) -> Any:
    """`df` with at most `max_tasks` partitions (0: as it is). Each write task is one Kafka
    transaction (its markers, its EndTxn, its lease and record at the coordinator): more tasks
    than the executors have slots only add transactions. `coalesce` merges partitions without a
    shuffle and never adds any."""
    return df.coalesce(max_tasks) if max_tasks > 0 else df


def run_write_job(df: Any, spec: TaskSpec) -> list[TaskResult]:
    """One task per partition of `df` writes it; the accepted result of every partition."""

    def task(batches: Iterator[Any]) -> Iterator[Any]:
        import pyarrow as pa

        result = write_task(spec, TaskTry.current(), batches)
        yield pa.RecordBatch.from_pylist([{RESULT_COLUMN: pickle.dumps(result)}])

    rows = df.mapInArrow(task, f"{RESULT_COLUMN} binary").collect()
    return [pickle.loads(row[RESULT_COLUMN]) for row in rows]


# --- identity ---------------------------------------------------------------------------------


def query_identity(df: Any, checkpoint_location: str, fallback_run_id: str) -> tuple[str, str]:
    """(query id, run id) of the query running this batch, after checking that the writer's
    checkpoint location is that query's. Raises LineageError. Reads the metadata file: once per run."""
    spark = df.sparkSession
    query_id = read_query_id(spark, checkpoint_location)
    if not is_connect(df):
        running_query = spark.sparkContext.getLocalProperty(QUERY_ID_PROPERTY)
        if running_query and running_query != query_id:
            raise LineageError(
                f"option checkpointLocation={checkpoint_location!r} holds query id {query_id}, but the "
                f"running query is {running_query}: give the writer the same checkpointLocation as the query")
    run_id = current_run_id(df, query_id, fallback_run_id)
    if run_id is None:
        raise LineageError(
            f"option checkpointLocation={checkpoint_location!r} holds query id {query_id}, which is not running "
            "in this Spark Connect session: give the writer the same checkpointLocation as the query")
    return query_id, run_id


def current_run_id(df: Any, query_id: str | None, fallback_run_id: str) -> str | None:
    """The run id of the query running this batch (cheap: asked at every batch). Connect: the run
    of query `query_id` in the session, None if it is not running there."""
    if not is_connect(df):
        return df.sparkSession.sparkContext.getLocalProperty(RUN_ID_PROPERTY) or fallback_run_id
    query = df.sparkSession.streams.get(query_id) if query_id else None
    return None if query is None else str(query.runId)


def read_query_id(spark: Any, checkpoint_location: str) -> str:
    """Spark's query id from `<checkpointLocation>/metadata` (a JSON line {"id": ...}), read so
    that any location Spark can use (local, HDFS, S3A...) works (sparkclient/checkpoint_files.py)."""
    path = metadata_path(checkpoint_location)
    text = read_on_driver(spark, path)
    if text is None:
        raise LineageError(f"{path} does not exist: is checkpointLocation the query's checkpoint location?")
    lines = text.splitlines()
    try:
        return str(json.loads(lines[0])["id"])
    except (IndexError, TypeError, ValueError, KeyError):
        raise LineageError(f"{path} has no query id: {lines[:1]!r}") from None
