"""The native sink's tasks learn their batch's attempt themselves.

PySpark's Python Data Source API gives the driver nothing to act on before a batch's write: per
batch, Spark calls `DataSource.streamWriter(schema, overwrite)` in a short-lived Python process on
the driver with only the options and the schema (`PythonStreamingWrite.createStreamingWriterFactory`
-> `write_into_data_source.py`); the batch id arrives with `commit(messages, batchId)` after the
job. Only the tasks know, from the local properties Spark gives every task of a micro-batch: the
query id (`sql.streaming.queryId`), the run id (`spark.jobGroup.id`, StreamExecution's job group)
and the batch id (`streaming.sql.batchId`).

So a task with rows asks for the run's generation (`start_generation(query_id, run_id)`: the first
call of a run starts it and fences older runs, every later call of the same run answers the same)
and begins the batch itself (`begin` answers the same open attempt of the same generation to every
caller, or skip when the batch is already committed). Both answers are kept per Python worker, so
a worker that runs several tasks of a batch asks once; a refused lease forgets them, so Spark's
retry of that task asks again.

The lineage is Spark's own query id (no metadata file to read); the offsets digest is read by the
task (sparkclient/checkpoint_files.py: local or pyarrow file systems), or the batch fails loudly
unless `offsets.binding=off`.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from typing import Any

from .client import CoordinatorError
from .executor import BatchAttempt, Coordinator

QUERY_ID_PROPERTY = "sql.streaming.queryId"
RUN_ID_PROPERTY = "spark.jobGroup.id"
BATCH_ID_PROPERTY = "streaming.sql.batchId"


class NotAStreamingTask(RuntimeError):
    """The sink's task runs outside a streaming micro-batch (no query, run or batch id)."""


@dataclass(frozen=True)
class MicroBatch:
    """Which query, run and batch a task belongs to (Spark's local properties)."""

    query_id: str
    run_id: str
    batch_id: int

    @classmethod
    def of_task(cls) -> MicroBatch:
        from pyspark import TaskContext

        ctx = TaskContext.get()
        values = {p: ctx.getLocalProperty(p) if ctx else None
                  for p in (QUERY_ID_PROPERTY, RUN_ID_PROPERTY, BATCH_ID_PROPERTY)}
        missing = [p for p, v in values.items() if not v]
        if missing:
            raise NotAStreamingTask(f"the task has no {missing} local properties: the exactly-once sink writes "
                                    "streaming micro-batches only (writeStream...start(), not a batch write)")
        return cls(values[QUERY_ID_PROPERTY], values[RUN_ID_PROPERTY], int(values[BATCH_ID_PROPERTY]))


@dataclass(frozen=True)
class Begun:
    """A batch's begin answer as a task acts on it."""

    skip: bool
    resumed: bool
    batch: BatchAttempt | None  # with skip False


class Runs:
    """Generations by run and begin answers by batch, per process and sink."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._generations: dict[tuple[Any, str], int] = {}
        self._begun: dict[tuple[Any, int, int], Begun] = {}

    def generation(self, coordinator: Coordinator, batch: MicroBatch) -> int:
        key = (_sink_key(coordinator), batch.run_id)
        with self._lock:
            known = self._generations.get(key)
        if known is None:
            answer = coordinator.client().start_generation(batch.query_id, batch.run_id)
            known = int(answer["generation"])
            with self._lock:
                self._generations[key] = known
        return known

    def begin(self, coordinator: Coordinator, generation: int, batch: MicroBatch, offsets: str | None) -> Begun:
        key = (_sink_key(coordinator), generation, batch.batch_id)
        with self._lock:
            known = self._begun.get(key)
        if known is not None:
            return known
        answer = coordinator.client().begin(batch.batch_id, generation, offsets=offsets)
        action = answer.get("action")
        if action == "skip":
            begun = Begun(True, bool(answer.get("resumed")), None)
        elif action == "write" and answer.get("attempt") is not None:
            begun = Begun(False, False, BatchAttempt.of_begin(batch.batch_id, generation, answer))
        else:
            raise CoordinatorError(None, "unexpected_answer", f"begin of batch {batch.batch_id} answered action "
                                   f"{action!r} (attempt {answer.get('attempt')}); expected 'write' with an attempt, "
                                   "or 'skip'. Check that coordinator.url points at a compatible coordinator",
                                   call="begin")
        with self._lock:
            if len(self._begun) > 256:  # a long-running worker: only recent batches matter
                self._begun.clear()
            self._begun[key] = begun
        return begun

    def forget(self, coordinator: Coordinator, batch: MicroBatch) -> None:
        """After a refusal: the task's retry asks the coordinator again."""
        sink = _sink_key(coordinator)
        with self._lock:
            self._generations.pop((sink, batch.run_id), None)
            for key in [k for k in self._begun if k[0] == sink and k[2] == batch.batch_id]:
                del self._begun[key]


def _sink_key(coordinator: Coordinator) -> tuple[str, str]:
    return coordinator.url, coordinator.sink


RUNS = Runs()


def _fresh_runs() -> None:
    global RUNS
    RUNS = Runs()


os.register_at_fork(after_in_child=_fresh_runs)
