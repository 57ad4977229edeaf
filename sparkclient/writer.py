"""Driver side of the foreachBatch writer: a micro-batch becomes one exactly-once checkpoint.

    writer = ExactlyOnceKafkaWriter({...options...})
    df.writeStream.foreachBatch(writer).option("checkpointLocation", path).start()

Per batch (DESIGN §3): check the schema (before anything is written); on the first batch of a run,
read the lineage (Spark's query id in the checkpoint location's `metadata` file) and start a
generation; read the batch's `offsets/<batch_id>` entry (its digest binds the batch to what it
reads; a missing entry fails the batch unless `offsets.binding=off`); `begin` the checkpoint (skip a
batch already committed, finishing a decided commit first); run the write job over the executors
(one task per partition on Arrow batches, sparkclient/jobs.py and executor.py; a batch with more
partitions than the context has task slots is coalesced to that many first: each task is one Kafka
transaction, and a transaction costs the broker and the coordinator alike); commit the results
Spark accepted (sparkclient/commit.py). A batch with no row is begun and committed without a
transaction: checking emptiness first would cost a Spark job on every batch. A refused commit or a
failed job raises, so the query stops and Spark replays the batch when it is restarted.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import Any

from .checkpoint_files import batch_offsets_digest, offsets_path, read_on_driver
from .client import CoordinatorClient
from .commit import BatchReport, abort_attempt, commit_batch, unexpected
from .executor import BatchAttempt, Coordinator, FaultHook, TaskSpec, WriteSettings
from .jobs import LineageError, coalesced, current_run_id, is_connect, query_identity, run_write_job
from .options import WriterOptionError, WriterOptions
from .schema import check_schema
from .session_settings import warn_if_slow_worker_socket

log = logging.getLogger(__name__)

__all__ = ["BatchReport", "ExactlyOnceKafkaWriter", "LineageError"]


class ExactlyOnceKafkaWriter:
    """The foreachBatch function. Options are spelled like Spark's Kafka sink plus the
    coordinator's, given as one mapping (sparkclient/options.py).

    `on_batch` is called on the driver with each BatchReport. `fault_hook` is for tests only: it
    is called at named steps (driver: "before_commit", "after_commit"; executor: "after_lease",
    "before_precommit", "after_precommit") and may raise or kill the process there.
    """

    def __init__(self, options: Mapping[str, Any], *, on_batch: Callable[[BatchReport], None] | None = None,
                 fault_hook: FaultHook | None = None) -> None:
        self.options = WriterOptions.parse(options)
        self.on_batch = on_batch
        self.fault_hook = fault_hook
        self._query_id: str | None = None
        self._run_id: str | None = None
        self._generation: int | None = None
        self._fallback_run_id = str(uuid.uuid4())  # if Spark does not say (not seen with Spark 4.x)
        self._client: CoordinatorClient | None = None
        self._sink_checked = False

    def __call__(self, df: Any, batch_id: int) -> None:
        started = time.monotonic()
        o = self.options
        columns = check_schema(df.schema, topic_option=o.topic)  # before anything is written
        client = self._driver_client()
        fresh_run = self._generation is None
        generation = self._ensure_generation(df)
        if fresh_run:
            warn_if_slow_worker_socket(df.sparkSession)
        path = offsets_path(o.checkpoint_location, batch_id)
        entry = read_on_driver(df.sparkSession, path) if o.offsets_binding != "off" else None
        digest = batch_offsets_digest(entry, path, o.offsets_binding, (o.sink, self._run_id))
        begun = client.begin(batch_id, generation, offsets=digest)
        if begun.get("action") not in ("write", "skip") or (begun["action"] == "write" and begun.get("attempt") is None):
            raise unexpected("begin", batch_id, f"action {begun.get('action')!r} (attempt {begun.get('attempt')})",
                             "action 'write' with an attempt, or 'skip'")
        if begun["action"] == "skip":
            self._report(BatchReport(batch_id, "resumed" if begun["resumed"] else "skipped", None,
                                     total_ms=_ms_since(started)))
            return
        batch = BatchAttempt.of_begin(batch_id, generation, begun)
        spec = TaskSpec(self._settings(columns.columns), batch)
        job_started = time.monotonic()
        try:
            results = run_write_job(coalesced(df.select(*columns.columns), self._max_write_tasks(df)), spec)
        except BaseException as exc:
            # the job failed (a task exhausted its retries, or the query is stopping): end this
            # attempt's transactions now rather than wait for the next begin or the recovery loop
            abort_attempt(client, batch_id, generation, batch.attempt, f"spark write job failed: {type(exc).__name__}")
            raise
        report = commit_batch(client, batch_id, generation, batch.attempt, results, _ms_since(job_started),
                              self._hook)
        self._report(replace(report, total_ms=_ms_since(started)))

    # --- driver helpers -----------------------------------------------------------------------

    def _max_write_tasks(self, df: Any) -> int:
        """How many tasks (transactions) may write a batch: the option, else every task slot of
        the Spark context (classic; under Connect there is none to ask: 0, keep the partitions)."""
        if self.options.max_write_tasks is not None:
            return self.options.max_write_tasks
        if is_connect(df):
            return 0
        return int(df.sparkSession.sparkContext.defaultParallelism)

    def _settings(self, columns: tuple[str, ...]) -> WriteSettings:
        o = self.options
        return WriteSettings(Coordinator(o.coordinator_url, o.coordinator_token, o.sink, o.request_timeout_ms,
                                         o.retry_budget_ms),
                             o.bootstrap_servers, o.producer_config, o.topic, columns, o.provenance_headers,
                             self.fault_hook)

    def _driver_client(self) -> CoordinatorClient:
        if self._client is None:
            o = self.options
            self._client = CoordinatorClient(o.coordinator_url, o.coordinator_token, o.sink,
                                             timeout_s=o.request_timeout_ms / 1000,
                                             retry_budget_s=o.retry_budget_ms / 1000)
        if not self._sink_checked:
            sink = self._client.describe_sink()
            expected = self.options.transaction_timeout_ms
            if expected is not None and sink["transaction_timeout_ms"] != expected:
                raise WriterOptionError(
                    f"option 'transaction.timeout.ms' is {expected} but sink {self.options.sink!r} is registered "
                    f"with transaction_timeout_ms={sink['transaction_timeout_ms']}; the producers use the sink's. "
                    "Drop the option or register the sink with the timeout you want")
            self._sink_checked = True
        return self._client

    def _ensure_generation(self, df: Any) -> int:
        """A generation per run of the query: the first batch of a run starts one, fencing every
        older driver. The run id is new at every start of the query (sparkclient/jobs.py says
        where it comes from), so a query restarted in the same process starts a new generation."""
        run_id = current_run_id(df, self._query_id, self._fallback_run_id)
        if self._generation is not None and run_id == self._run_id:
            return self._generation
        query_id, run_id = query_identity(df, self.options.checkpoint_location, self._fallback_run_id)
        answer = self._driver_client().start_generation(query_id, run_id)
        self._generation, self._query_id, self._run_id = int(answer["generation"]), query_id, run_id
        log.info("sink %s: generation %d for query %s run %s (older transactions aborted: %d, pending: %d)",
                 self.options.sink, self._generation, query_id, run_id, len(answer["aborted"]),
                 len(answer["abort_pending"]))
        return self._generation

    def _hook(self, step: str, **info: Any) -> None:
        if self.fault_hook is not None:
            self.fault_hook(step, **info)

    def _report(self, report: BatchReport) -> None:
        log.info("sink %s %s", self.options.sink, report.line())
        if self.on_batch is not None:
            self.on_batch(report)

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None


def _ms_since(t: float) -> int:
    return int((time.monotonic() - t) * 1000)
