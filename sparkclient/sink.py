"""The native streaming sink for Spark 4.1+ (PySpark's Python Data Source API): the one-line switch
from Spark's own Kafka sink.

    from sparkclient.sink import register_sink
    register_sink(spark)                                   # once per session
    (df.writeStream.format("kafka_eos")                    # was: .format("kafka")
       .option("kafka.bootstrap.servers", "kafka-1:9092").option("topic", "orders-out")
       .option("coordinator.url", url).option("coordinator.token", token).option("coordinator.sink", "orders")
       .option("checkpointLocation", "s3a://bucket/chk/orders").start())

The input schema and options are Spark's Kafka sink's (sparkclient/schema.py, options.py) plus
the coordinator's; `checkpointLocation` is the query's own (Spark passes it on). Executors get the
partition as Arrow record batches (`DataSourceStreamArrowWriter`) and write it with the same core
as the foreachBatch writer (sparkclient/executor.py); each task also learns the batch's attempt
itself (sparkclient/sink_runs.py says why). The driver gets `commit(messages, batchId)` after the
job, with one message per partition, and commits the batch with the coordinator
(sparkclient/commit.py); `abort(messages, batchId)` ends the attempt when the job failed.

Per batch, with P non-empty partitions run by W Python workers: W `begin` calls (and, at a run's
first batch, W `start_generation` calls) and P `lease` calls from the tasks, one `commit` from the
driver. A batch with no row asks nothing; a batch already committed (a replay after the driver
died between the coordinator's commit and Spark's commit log) writes nothing.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from pyspark.sql.datasource import DataSource, DataSourceStreamArrowWriter, WriterCommitMessage

from .checkpoint_files import batch_offsets_digest, offsets_path, read_on_executor
from .client import CoordinatorError
from .commit import abort_attempt, commit_batch, unexpected
from .executor import Coordinator, FaultHook, TaskResult, TaskSpec, TaskTry, WriteSettings, settle_worker_gc, write_task
from .options import WriterOptions
from .produce import non_empty
from .schema import check_schema
from .session_settings import say_socket_setting_is_off, worker_socket_is_off
from .sink_runs import RUNS, MicroBatch

log = logging.getLogger(__name__)

SINK_NAME = "kafka_eos"
WRITE, EMPTY, SKIP = "write", "empty", "skip"


@dataclass
class PartitionMessage(WriterCommitMessage):
    """One task's answer to the driver's commit."""

    partition: int
    action: str  # WRITE, EMPTY (no row: no lease), SKIP (the batch is already committed)
    result: TaskResult | None = None  # with WRITE
    resumed: bool = False  # with SKIP: this task's begin finished a decided commit


class ExactlyOnceKafkaSink(DataSource):
    """`.format("kafka_eos")`: registered by `register_sink(spark)`."""

    fault_hook: FaultHook | None = None  # tests only (register_sink(..., fault_hook=...))

    @classmethod
    def name(cls) -> str:
        return SINK_NAME

    def streamWriter(self, schema: Any, overwrite: bool) -> ExactlyOnceStreamWriter:  # noqa: N802 - Spark's name
        return ExactlyOnceStreamWriter(self.options, schema, type(self).fault_hook)


class ExactlyOnceStreamWriter(DataSourceStreamArrowWriter):
    """Made on the driver for each batch (and again for its commit); pickled to the executors."""

    def __init__(self, options: Any, schema: Any, fault_hook: FaultHook | None = None) -> None:
        settle_worker_gc()  # in Spark's planner and commit processes on the driver, reused batch after batch
        self.options = WriterOptions.parse(dict(options), from_spark=True)
        columns = check_schema(schema, topic_option=self.options.topic)
        o = self.options
        self.settings = WriteSettings(
            Coordinator(o.coordinator_url, o.coordinator_token, o.sink, o.request_timeout_ms, o.retry_budget_ms),
            o.bootstrap_servers, o.producer_config, o.topic, columns.columns, o.provenance_headers, fault_hook,
            o.transaction_timeout_ms)

    # --- executors --------------------------------------------------------------------------

    def write(self, iterator: Iterator[Any]) -> PartitionMessage:
        task = TaskTry.current()
        first, rest = non_empty(iterator)
        if first is None:
            for _ in rest:
                pass
            return PartitionMessage(task.partition, EMPTY)
        micro = MicroBatch.of_task()
        coordinator = self.settings.coordinator
        try:
            generation = RUNS.generation(coordinator, micro)
            begun = RUNS.begin(coordinator, generation, micro, self._offsets_digest(micro))
            if begun.skip:
                for _ in rest:
                    pass
                return PartitionMessage(task.partition, SKIP, resumed=begun.resumed)
            assert begun.batch is not None
            result = write_task(TaskSpec(self.settings, begun.batch), task, _chain(first, rest))
        except CoordinatorError:
            RUNS.forget(coordinator, micro)  # the retry asks again (a newer attempt, a fenced run)
            raise
        return PartitionMessage(task.partition, WRITE, result)

    def _offsets_digest(self, micro: MicroBatch) -> str | None:
        o = self.options
        if o.offsets_binding == "off" or not o.checkpoint_location:
            entry, path = None, offsets_path(o.checkpoint_location or "<no checkpointLocation option>", micro.batch_id)
        else:
            path = offsets_path(o.checkpoint_location, micro.batch_id)
            entry = read_on_executor(path)
        return batch_offsets_digest(entry, path, o.offsets_binding, (o.sink, micro.run_id))

    # --- driver -------------------------------------------------------------------------------

    def commit(self, messages: list[PartitionMessage | None], batchId: int) -> None:  # noqa: N803 - Spark's name
        if worker_socket_is_off():
            say_socket_setting_is_off()
        got = [m for m in messages if m is not None]
        skips = [m for m in got if m.action == SKIP]
        writes = [m.result for m in got if m.action == WRITE and m.result is not None]
        if skips and writes:
            raise unexpected("begin", batchId, "skip to some tasks and write to others", "the same to every task")
        if skips:
            log.info("sink %s batch=%d action=%s", self.options.sink, batchId,
                     "resumed" if any(m.resumed for m in skips) else "skipped")
            return
        if not writes:
            log.info("sink %s batch=%d action=empty partitions=%d", self.options.sink, batchId, len(messages))
            return
        misplaced = [(p, m.partition) for p, m in enumerate(messages) if m is not None and m.partition != p]
        if misplaced:
            raise unexpected("write job", batchId, f"messages of other partitions at {misplaced}",
                             "one message per partition, in partition order")
        first = writes[0]
        results = [m.result if m is not None and m.result is not None else
                   TaskResult(p, None, 0, batchId, first.generation, first.attempt)
                   for p, m in enumerate(messages)]
        report = commit_batch(self.settings.coordinator.client(), batchId, first.generation, first.attempt,
                              results, None, self._hook)
        log.info("sink %s %s", self.options.sink, report.line())

    def abort(self, messages: list[PartitionMessage | None], batchId: int) -> None:  # noqa: N803 - Spark's name
        writes = [m.result for m in messages if m is not None and m.action == WRITE and m.result is not None]
        if not writes:
            log.warning("sink %s batch %d: the write job failed before any task returned its attempt; its open "
                        "transactions end at the next run's generation or by the coordinator's recovery loop",
                        self.options.sink, batchId)
            return
        abort_attempt(self.settings.coordinator.client(), batchId, writes[0].generation, writes[0].attempt,
                      "spark write job failed")

    def _hook(self, step: str, **info: Any) -> None:
        if self.settings.fault_hook is not None:
            self.settings.fault_hook(step, **info)


def _chain(first: Any, rest: Iterator[Any]) -> Iterator[Any]:
    yield first
    yield from rest


def register_sink(spark: Any, *, fault_hook: FaultHook | None = None) -> str:
    """Register the sink with the session (classic or Spark Connect); returns its short name.
    `fault_hook` is for tests only: a sink class that calls it at the writer's named steps."""
    source: type[ExactlyOnceKafkaSink] = ExactlyOnceKafkaSink
    if fault_hook is not None:
        source = type("ExactlyOnceKafkaSinkWithHook", (ExactlyOnceKafkaSink,), {
            "fault_hook": staticmethod(fault_hook), "__qualname__": "ExactlyOnceKafkaSinkWithHook"})
    spark.dataSource.register(source)
    return SINK_NAME
