"""Executor side: one Spark task try writes one partition of a batch in one Kafka transaction.

The same core serves the foreachBatch writer and the native sink; both hand it the partition as
Arrow record batches. Per task try (DESIGN §3 with its Revisions):

- a partition with no row takes no lease and opens no transaction;
- otherwise the try asks the lease route for its id with Spark's task attempt id
  (`TaskContext.taskAttemptId()`, unique per SparkContext): the coordinator answers a partition's
  pre-lease to the first try that claims it and a fresh id to every other, so two tries never
  share one (PySpark's TaskContext has no stage attempt number: only the coordinator can tell);
- it refuses to start `init_transactions` on a lease older than the coordinator's bound, the age
  being the lease's age by the database's clock when answered plus this process's monotonic time
  since the answer arrived (no wall clock of another machine in the bound);
- it writes the transaction (sparkclient/transaction.py), checks that it is not already inside the
  commit margin of its deadline, and returns its pre-commit record (TaskResult) to the driver,
  which sends the accepted ones with the commit.

A reused Python worker keeps one coordinator client per sink (keep-alive), and a task freezes
the long-lived objects the worker holds (what it imported) out of the garbage collector's reach:
PySpark's daemon runs `gc.collect()` after every task, which otherwise walks every one of them
(10-40 ms a task).
"""

from __future__ import annotations

import gc
import logging
import math
import os
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from .client import CoordinatorClient
from .options import WriterOptionError
from .produce import Columns, ProduceTarget, non_empty, provenance_headers
from .transaction import KAFKA_CALL_TIMEOUT_S, ProducerSettings, write

log = logging.getLogger(__name__)

FaultHook = Callable[..., None]


class LeaseTooOld(RuntimeError):
    """The lease is older than the coordinator's bound for starting init_transactions (its id may
    already be in quarantine and leased again after it); the task fails, the retry leases anew."""


class DeadlineTooClose(RuntimeError):
    """The transaction is already inside the commit margin of its deadline: the commit gate would
    refuse it, so the task fails and Spark retries it with a fresh transaction."""


@dataclass(frozen=True)
class Coordinator:
    """How a task reaches the coordinator."""

    url: str
    token: str
    sink: str
    request_timeout_ms: int
    retry_budget_ms: int

    def client(self) -> CoordinatorClient:
        """This process's client for the sink (kept across tasks: a reused Python worker keeps its
        connection to the coordinator instead of opening one per task)."""
        key = (self.url, self.token, self.sink, self.request_timeout_ms, self.retry_budget_ms)
        with _CLIENTS_LOCK:
            client = _CLIENTS.get(key)
            if client is None:
                client = _CLIENTS[key] = CoordinatorClient(
                    self.url, self.token, self.sink, timeout_s=self.request_timeout_ms / 1000,
                    retry_budget_s=self.retry_budget_ms / 1000)
            return client


@dataclass(frozen=True)
class WriteSettings:
    """What every task of a writer needs, whatever the batch (shipped to executors)."""

    coordinator: Coordinator
    bootstrap_servers: str
    producer_config: dict[str, Any]
    topic: str | None
    columns: tuple[str, ...]
    provenance_headers: bool
    fault_hook: FaultHook | None = field(default=None, compare=False)
    transaction_timeout_ms: int | None = None  # option transaction.timeout.ms: the sink's must be this


@dataclass(frozen=True)
class BatchAttempt:
    """The attempt a batch is written under, and the rules its tasks keep (from `begin`)."""

    batch_id: int
    generation: int
    attempt: int
    commit_margin_ms: int = 0
    producer_init_timeout_ms: int = int(KAFKA_CALL_TIMEOUT_S * 1000)
    producer_request_timeout_ms: int | None = None

    @classmethod
    def of_begin(cls, batch_id: int, generation: int, answer: dict[str, Any]) -> BatchAttempt:
        return cls(batch_id, generation, int(answer["attempt"]), int(answer.get("commit_margin_ms") or 0),
                   int(answer.get("producer_init_timeout_ms") or KAFKA_CALL_TIMEOUT_S * 1000),
                   answer.get("producer_request_timeout_ms"))


@dataclass(frozen=True)
class TaskSpec:
    settings: WriteSettings
    batch: BatchAttempt


@dataclass(frozen=True)
class TaskTry:
    """Which try of which task this is (Spark's TaskContext)."""

    partition: int
    task_attempt_id: int  # unique per SparkContext: the lease claim's identity
    attempt_number: int  # 0 for a task's first try (a stage retry starts at 0 again)

    @classmethod
    def current(cls, partition: int | None = None) -> TaskTry:
        from pyspark import TaskContext

        ctx = TaskContext.get()
        if ctx is None:
            return cls(partition or 0, 0, 0)
        return cls(ctx.partitionId() if partition is None else partition, ctx.taskAttemptId(), ctx.attemptNumber())


@dataclass(frozen=True)
class TaskResult:
    """One task try's answer; Spark keeps exactly one per partition (the winner)."""

    partition: int
    lease_id: int | None  # None: empty partition, no transaction
    task_attempt_id: int
    batch_id: int
    generation: int
    attempt: int
    records: int = 0
    bytes: int = 0
    write_ms: int = 0
    transactional_id: str | None = None
    producer_id: int | None = None
    producer_epoch: int | None = None
    first_offsets: list[list[Any]] | None = None  # [[topic, partition, first offset written], ...], a few

    def precommit_record(self) -> dict[str, Any]:
        """What the commit carries for this winner: the try that claimed the lease and what it wrote."""
        return {"task_attempt_id": self.task_attempt_id, "producer_id": self.producer_id,
                "producer_epoch": self.producer_epoch, "records": self.records, "bytes": self.bytes,
                "write_ms": self.write_ms, "first_offsets": self.first_offsets}


@dataclass(frozen=True)
class Lease:
    """A lease answer, with the monotonic time it arrived at (this process's clock)."""

    lease_id: int
    transactional_id: str
    transaction_timeout_ms: int
    age_ms: int  # by the database's clock, when answered
    max_init_age_ms: int | None
    received_at: float  # time.monotonic() when the answer arrived

    @classmethod
    def of_answer(cls, answer: dict[str, Any], received_at: float) -> Lease:
        return cls(int(answer["lease_id"]), str(answer["transactional_id"]), int(answer["transaction_timeout_ms"]),
                   int(answer.get("age_ms") or 0), answer.get("max_lease_init_age_ms"), received_at)

    def age_ms_at(self, now: float) -> int:
        return self.age_ms + max(0, math.ceil((now - self.received_at) * 1000))  # rounded up: a bound


def check_lease_young_enough(lease: Lease, now: float) -> None:
    age = lease.age_ms_at(now)
    if lease.max_init_age_ms is not None and age > lease.max_init_age_ms:
        raise LeaseTooOld(f"lease {lease.lease_id} ({lease.transactional_id}) is {age} ms old, above the "
                          f"{lease.max_init_age_ms} ms bound for starting init_transactions; the task fails and "
                          "its retry leases a fresh id")


def check_deadline_outside_margin(lease: Lease, margin_ms: int, now: float) -> None:
    left = lease.transaction_timeout_ms - lease.age_ms_at(now)
    if left < margin_ms:
        raise DeadlineTooClose(f"lease {lease.lease_id}'s transaction has {left} ms left before the broker may "
                               f"abort it, below the commit margin of {margin_ms} ms; the task fails so Spark "
                               "retries it with a fresh transaction")


def write_task(spec: TaskSpec, task: TaskTry, batches: Iterable[Any]) -> TaskResult:
    """The body of one task try over its partition's Arrow record batches."""
    settle_worker_gc()
    settings, batch = spec.settings, spec.batch
    hook = _hook(settings, batch.batch_id, task)
    first, rest = non_empty(batches)
    if first is None:
        for _ in rest:  # nothing to read, but the input is consumed to its end
            pass
        return TaskResult(task.partition, None, task.task_attempt_id, batch.batch_id, batch.generation, batch.attempt)
    answer = settings.coordinator.client().lease(batch.batch_id, batch.attempt, batch.generation, task.partition,
                                                 task.task_attempt_id)
    lease = Lease.of_answer(answer, time.monotonic())
    hook("after_lease", lease=lease)
    expected = settings.transaction_timeout_ms
    if expected is not None and lease.transaction_timeout_ms != expected:
        raise WriterOptionError(f"option 'transaction.timeout.ms' is {expected} but sink {settings.coordinator.sink!r} "
                                f"is registered with transaction_timeout_ms={lease.transaction_timeout_ms}; the "
                                "producers use the sink's. Drop the option or register the sink with the timeout "
                                "you want")
    # no InitProducerId on an old lease: its id may be past its quarantine and leased again
    check_lease_young_enough(lease, time.monotonic())
    where = f"batch {batch.batch_id} partition {task.partition} (lease {lease.lease_id})"

    def before_handing_on() -> None:
        check_deadline_outside_margin(lease, batch.commit_margin_ms, time.monotonic())
        hook("before_precommit", lease=lease)

    written = write(
        ProducerSettings(settings.bootstrap_servers, settings.producer_config, lease.transactional_id,
                         lease.transaction_timeout_ms, batch.producer_init_timeout_ms,
                         batch.producer_request_timeout_ms),
        first, rest, Columns(settings.columns),
        ProduceTarget(settings.topic, provenance_headers(settings.coordinator.sink, batch.batch_id, batch.attempt,
                                                         lease.lease_id) if settings.provenance_headers else None),
        batch.batch_id, where, before_handing_on)
    result = TaskResult(task.partition, lease.lease_id, task.task_attempt_id, batch.batch_id, batch.generation,
                        batch.attempt, written.produced.records, written.produced.bytes, written.write_ms,
                        lease.transactional_id, written.producer_id, written.producer_epoch, written.first_offsets)
    hook("after_precommit", result=result)
    return result


def _hook(settings: WriteSettings, batch_id: int, task: TaskTry) -> Callable[..., None]:
    def call(step: str, **info: Any) -> None:
        if settings.fault_hook is not None:
            settings.fault_hook(step, batch_id=batch_id, partition=task.partition, task_attempt=task.attempt_number,
                                **info)
    return call


# --- per Python worker process ------------------------------------------------------------------

# One coordinator client per process and sink options (Coordinator.client); httpx clients are
# thread-safe. A forked child (PySpark forks its workers) starts with none: it must not use its
# parent's connections (dropping them there only closes the child's copies of the sockets).
_CLIENTS: dict[tuple[Any, ...], CoordinatorClient] = {}
_CLIENTS_LOCK = threading.Lock()
# More long-lived objects than this outside the frozen set: freeze them (a worker's first tasks
# import pyarrow, pandas, numpy: ~35,000 objects that every later gc.collect() would walk).
UNFROZEN_LIMIT = 2_000


def settle_worker_gc() -> None:
    """Called as a task starts: PySpark's daemon ran `gc.collect()` after the worker's previous
    task, so what the oldest generation holds now is alive and long-lived (the modules the worker
    imported, their caches); when there is much of it, move it to the collector's permanent
    generation, so the `gc.collect()` after every later task walks only what that task made
    (measured: 10-40 ms a task before, most of a small task's Python CPU). Garbage of later tasks
    is still collected; a frozen object is only kept if it was alive when frozen."""
    if len(gc.get_objects(generation=2)) > UNFROZEN_LIMIT:
        gc.freeze()


def _forget_parent_state() -> None:
    global _CLIENTS_LOCK
    _CLIENTS_LOCK = threading.Lock()
    _CLIENTS.clear()


os.register_at_fork(after_in_child=_forget_parent_state)


# the module that names it since the Arrow core: sparkclient/produce.py (bench/ imports it from here)
from .produce import FIRST_OFFSETS_REPORTED  # noqa: E402,F401
