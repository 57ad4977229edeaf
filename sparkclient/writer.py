"""Driver side: the foreachBatch function that makes a micro-batch one exactly-once checkpoint.

    writer = ExactlyOnceKafkaWriter({...options...})
    df.writeStream.foreachBatch(writer).option("checkpointLocation", path).start()

Per batch (DESIGN §3): check the schema (before anything is written); on the first batch of a run,
read the lineage (Spark's query id in the checkpoint location's `metadata` file) and start a
generation; a batch with no row ends there (no transaction, no checkpoint: a replay of it is
empty too); `begin` the checkpoint (skip a batch already committed, finishing a decided commit
first); run the write job over the executors (one task per partition, sparkclient/executor.py;
classic PySpark or Spark Connect, sparkclient/jobs.py); take the winner of each partition from
the task results Spark accepted; commit. A refused commit or a failed job raises, so the query
stops and Spark replays the batch when it is restarted.
"""

from __future__ import annotations

import hashlib
import logging
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from .client import CoordinatorClient, CoordinatorError
from .executor import KAFKA_CALL_TIMEOUT_S, FaultHook, TaskResult, TaskSpec
from .jobs import LineageError, batch_is_empty, current_run_id, query_identity, write_job
from .options import WriterOptionError, WriterOptions
from .schema import check_schema

log = logging.getLogger(__name__)

__all__ = ["BatchReport", "ExactlyOnceKafkaWriter", "LineageError", "winners_of"]


@dataclass(frozen=True)
class BatchReport:
    """What one foreachBatch call did, with its figures (also logged, one line per batch)."""

    batch_id: int
    action: str  # "committed", "skipped" (already committed), "resumed" (a decided commit finished, then
    # skipped), "empty" (no row: nothing asked of the coordinator beyond the run's generation)
    attempt: int | None
    partitions: int = 0
    records: int = 0
    bytes: int = 0
    job_ms: int = 0
    commit_ms: int = 0
    total_ms: int = 0
    winners: dict[int, int | None] = field(default_factory=dict)

    def line(self) -> str:
        return (f"batch={self.batch_id} action={self.action} attempt={self.attempt} partitions={self.partitions} "
                f"records={self.records} bytes={self.bytes} job_ms={self.job_ms} commit_ms={self.commit_ms} "
                f"total_ms={self.total_ms}")


MAX_STAGE_RETRY_REDOS = 3


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

    # --- the foreachBatch call ----------------------------------------------------------------

    def __call__(self, df: Any, batch_id: int, _redo: int = 0) -> None:
        started = time.monotonic()
        o = self.options
        columns = check_schema(df.schema, topic_option=o.topic)  # before anything is written
        client = self._driver_client()
        generation = self._ensure_generation(df)
        if o.skip_empty_batches and batch_is_empty(df):
            self._report(BatchReport(batch_id, "empty", None, total_ms=_ms_since(started)))
            return
        job = write_job(df.select(*columns.columns))
        # the partition count, when known before the job runs (classic), gets first tries pre-leased
        # ids; on Spark Connect it is known only after, so every task leases its own
        partitions = job.partitions
        offsets = read_offsets_digest(df.sparkSession, o.checkpoint_location, batch_id)
        begun = client.begin(batch_id, generation, partitions=partitions, offsets=offsets)
        received_at = time.time()  # the pre-leases' age is measured from here (plus their age when answered)
        if begun.get("action") not in ("write", "skip") or (begun["action"] == "write" and begun.get("attempt") is None):
            raise _unexpected("begin", batch_id, f"action {begun.get('action')!r} (attempt {begun.get('attempt')})",
                              "action 'write' with an attempt, or 'skip'")
        if begun["action"] == "skip":
            report = BatchReport(batch_id, "resumed" if begun["resumed"] else "skipped", None,
                                 total_ms=_ms_since(started))
            self._report(report)
            return
        attempt = int(begun["attempt"])
        spec = TaskSpec(
            coordinator_url=o.coordinator_url, coordinator_token=o.coordinator_token, sink=o.sink,
            request_timeout_ms=o.request_timeout_ms, retry_budget_ms=o.retry_budget_ms, batch_id=batch_id,
            attempt=attempt, generation=generation, bootstrap_servers=o.bootstrap_servers,
            producer_config=o.producer_config, topic=o.topic, columns=columns.columns,
            provenance_headers=o.provenance_headers, fault_hook=self.fault_hook,
            pre_leases={int(x["partition"]): x for x in begun.get("pre_leases", [])},
            leases_received_at=received_at,
            commit_margin_ms=int(begun.get("commit_margin_ms") or 0),
            max_lease_init_age_ms=begun.get("max_lease_init_age_ms"),
            producer_init_timeout_ms=int(begun.get("producer_init_timeout_ms") or KAFKA_CALL_TIMEOUT_S * 1000),
            producer_request_timeout_ms=begun.get("producer_request_timeout_ms"),
        )
        job_started = time.monotonic()
        try:
            results = job.run(spec)
            partitions = job.partitions if job.partitions is not None else len(results)
        except BaseException as exc:
            # the job failed (a task exhausted its retries, or the query is stopping): end this
            # attempt's transactions now rather than wait for the next begin or the recovery loop
            try:
                client.abort(batch_id, attempt, generation, f"spark write job failed: {type(exc).__name__}")
            except CoordinatorError as abort_error:
                log.warning("batch %d: could not abort attempt %d after the job failed: %s", batch_id, attempt,
                            abort_error)
            raise
        if job.stage_retried:
            # two first tries of a partition may have written on its pre-lease: never commit
            # this attempt; abort it (its ids are quarantined) and begin the batch again
            client.abort(batch_id, attempt, generation, "stage_retried")
            if _redo + 1 >= MAX_STAGE_RETRY_REDOS:
                raise CoordinatorError(None, "stage_retried", f"batch {batch_id}: a stage of the write job was "
                                       f"retried in {MAX_STAGE_RETRY_REDOS} attempts in a row; the query stops "
                                       "and replays the batch when restarted", call="write job")
            log.warning("batch %d attempt %d: a stage of the write job was retried; attempt aborted, batch "
                        "begun again", batch_id, attempt)
            return self(df, batch_id, _redo + 1)
        job_ms = _ms_since(job_started)
        accepted = accepted_results(results, partitions)
        winners = {p: r.lease_id for p, r in accepted.items()}
        self._hook("before_commit", batch_id=batch_id, attempt=attempt, generation=generation, winners=winners)
        commit_started = time.monotonic()
        # the winners' pre-commit records travel with the commit (stored with the decision); a refusal raises
        answer = client.commit(batch_id, attempt, generation, winners, job_ms,
                               records={p: r.precommit_record() for p, r in accepted.items() if r.lease_id is not None})
        if answer.get("state") != "COMMITTED" or answer.get("attempt") != attempt:
            raise _unexpected("commit", batch_id, f"state {answer.get('state')!r} for attempt {answer.get('attempt')}",
                              f"state 'COMMITTED' for attempt {attempt}")
        committed = {c["partition"]: c["lease_id"] for c in answer.get("committed", [])}
        named = {p: lease for p, lease in winners.items() if lease is not None}
        if committed != named:
            raise _unexpected("commit", batch_id, f"winners {committed}", f"the winners the driver named, {named}")
        commit_ms = _ms_since(commit_started)
        for warning in answer.get("warnings", []):
            log.warning("batch %d: %s", batch_id, warning)
        self._hook("after_commit", batch_id=batch_id, attempt=attempt, generation=generation, winners=winners)
        written = [r for r in accepted.values() if r.lease_id is not None]
        self._report(BatchReport(
            batch_id, "committed", attempt, partitions, sum(r.records for r in written),
            sum(r.bytes for r in written), job_ms, commit_ms, _ms_since(started), winners,
        ))

    # --- driver helpers -----------------------------------------------------------------------

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


def accepted_results(results: list[TaskResult], partitions: int) -> dict[int, TaskResult]:
    """Partition -> the task result Spark accepted, for every partition 0..N-1."""
    accepted: dict[int, TaskResult] = {}
    for r in results:
        if r.partition in accepted:
            raise RuntimeError(f"two accepted results for partition {r.partition}: {accepted[r.partition].lease_id} "
                               f"and {r.lease_id}")
        accepted[r.partition] = r
    missing = [p for p in range(partitions) if p not in accepted]
    if missing:
        raise RuntimeError(f"no task result for partitions {missing} of {partitions}")
    return accepted


def winners_of(results: list[TaskResult], partitions: int) -> dict[int, int | None]:
    """Partition -> winning lease id (None when empty), for every partition 0..N-1."""
    return {p: r.lease_id for p, r in accepted_results(results, partitions).items()}


def read_offsets_digest(spark: Any, checkpoint_location: str, batch_id: int) -> str | None:
    """A digest of the offsets Spark planned for the batch: its `offsets/<batch_id>` entry without
    the first two lines (the log version and the batch's metadata, whose timestamp is not part of
    what the batch reads), read with Spark's text reader (classic and Connect, any file system).
    None when the entry cannot be read (the coordinator then checks nothing)."""
    path = f"{checkpoint_location.rstrip('/')}/offsets/{batch_id}"
    try:
        rows = spark.read.text(path, wholetext=True).collect()
    except Exception as exc:  # noqa: BLE001 - AnalysisException (PATH_NOT_FOUND): the check is optional
        log.debug("batch %d: offsets entry not readable (%s); begin names no offsets", batch_id, exc)
        return None
    if len(rows) != 1:
        return None
    return offsets_digest(str(rows[0][0]).splitlines())


def offsets_digest(entry_lines: list[str]) -> str:
    return "sha256:" + hashlib.sha256("\n".join(entry_lines[2:]).encode()).hexdigest()


def _unexpected(call: str, batch_id: int, got: str, expected: str) -> CoordinatorError:
    """An answer this driver cannot act on safely: stop the query rather than guess."""
    return CoordinatorError(None, "unexpected_answer", f"{call} of batch {batch_id} answered {got}; expected "
                            f"{expected}. Check that coordinator.url points at a coordinator of a compatible version; "
                            "the query stops and replays the batch when restarted", call=call)


def _ms_since(t: float) -> int:
    return int((time.monotonic() - t) * 1000)
