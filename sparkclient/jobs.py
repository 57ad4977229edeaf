"""How the driver runs a batch's write job and learns the query's identity, on classic PySpark
(3.5, 4.x: the RDD API and the JVM) and on Spark Connect (4.x: DataFrame operations only).

The write job: one task per partition of the batch runs `executor.write_partition` and returns one
TaskResult; the driver's `collect()` keeps exactly one result per partition, the one of the task
attempt Spark accepted (a retried or speculative copy's result is discarded).
- classic: `df.rdd.mapPartitionsWithIndex(...).collect()`; the partition count is known before
  the job runs.
- Connect: `df.mapInArrow(...)` (`df.rdd` does not exist there); the task's partition comes from
  `TaskContext`, its result travels as one pickled binary cell, and `mapInArrow` calls the
  function for empty partitions too, so `collect()` answers one row per partition and the count
  is known once the job ran.

The identity (DESIGN §3 step 1): the query id is read from `<checkpointLocation>/metadata` with
Spark's own reader (any file system Spark can use; no JVM access needed). The run id, and the check
that the checkpoint location belongs to the running query:
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
from typing import Any, Protocol

from .executor import TaskResult, TaskSpec, write_partition
from .stages import StageRetries

# local properties Spark (classic) sets on the thread that runs foreachBatch
QUERY_ID_PROPERTY = "sql.streaming.queryId"
RUN_ID_PROPERTY = "spark.jobGroup.id"  # StreamExecution runs every batch in a job group named by its run id
RESULT_COLUMN = "task_result"  # Connect: the pickled TaskResult of one task


class LineageError(RuntimeError):
    """The checkpoint location does not belong to the running query, or has no metadata."""


class WriteJob(Protocol):
    partitions: int | None  # known before the job runs (classic), else None (Connect)
    stage_retried: bool  # after run: a stage of the job was retried (sparkclient/stages.py)

    def run(self, spec: TaskSpec) -> list[TaskResult]: ...


def is_connect(df: Any) -> bool:
    """A Spark Connect DataFrame (checked by module: importing Connect's classes needs its extras)."""
    return type(df).__module__.startswith("pyspark.sql.connect")


def write_job(df: Any) -> WriteJob:
    return ConnectWriteJob(df) if is_connect(df) else ClassicWriteJob(df)


class ClassicWriteJob:
    def __init__(self, df: Any) -> None:
        self._rdd = df.rdd
        self.partitions: int | None = self._rdd.getNumPartitions()
        self._stages = StageRetries.of(df)
        # a stage of the job ran twice: two first tries of a partition may have used its pre-lease
        self.stage_retried = False

    def run(self, spec: TaskSpec) -> list[TaskResult]:
        if self.partitions == 0:
            return []
        known = self._stages.job_ids() if self._stages else set()
        results = self._rdd.mapPartitionsWithIndex(lambda index, rows: write_partition(spec, index, rows)).collect()
        self.stage_retried = bool(self._stages and self._stages.retried(self._stages.job_ids() - known))
        return results


class ConnectWriteJob:
    def __init__(self, df: Any) -> None:
        self._df = df
        self.partitions: int | None = None
        self.stage_retried = False  # no pre-leases on Connect: every task leases its own id

    def run(self, spec: TaskSpec) -> list[TaskResult]:
        columns = list(self._df.columns)

        def task(batches: Iterator[Any]) -> Iterator[Any]:
            import pyarrow as pa
            from pyspark import TaskContext

            partition = TaskContext.get().partitionId()
            for result in write_partition(spec, partition, arrow_rows(batches, columns)):
                yield pa.RecordBatch.from_pylist([{RESULT_COLUMN: pickle.dumps(result)}])

        rows = self._df.mapInArrow(task, f"{RESULT_COLUMN} binary").collect()
        results = [pickle.loads(row[RESULT_COLUMN]) for row in rows]
        self.partitions = len(results)
        return results


def arrow_rows(batches: Iterator[Any], columns: list[str]) -> Iterator[tuple[Any, ...]]:
    """Arrow record batches as row tuples shaped like classic PySpark's rows (a `headers` entry is
    a (key, value) pair, not Arrow's {"key", "value"} struct dict)."""
    i_headers = columns.index("headers") if "headers" in columns else None
    for batch in batches:
        cells = [batch.column(i).to_pylist() for i in range(batch.num_columns)]
        if i_headers is not None:
            cells[i_headers] = [None if hs is None else [(h["key"], h["value"]) for h in hs]
                                for hs in cells[i_headers]]
        yield from zip(*cells)


def batch_is_empty(df: Any) -> bool:
    """Whether the batch has no row: a Spark job that stops at the first row it finds (on both
    APIs). The write job reads the batch again; a micro-batch reads the same offsets both times."""
    return bool(df.isEmpty())


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
    """Spark's query id from `<checkpointLocation>/metadata` (a JSON line {"id": ...}), read with
    Spark's text reader so any location Spark can use (local, HDFS, S3A...) works."""
    path = checkpoint_location.rstrip("/") + "/metadata"
    try:
        lines = [row[0] for row in spark.read.text(path).limit(1).collect()]
    except Exception as exc:  # AnalysisException (PATH_NOT_FOUND) on both APIs
        if "PATH_NOT_FOUND" in str(exc) or "does not exist" in str(exc):
            raise LineageError(f"{path} does not exist: is checkpointLocation the query's checkpoint "
                               "location?") from None
        raise
    try:
        return str(json.loads(lines[0])["id"])
    except (IndexError, TypeError, ValueError, KeyError):
        raise LineageError(f"{path} has no query id: {lines[:1]!r}") from None
