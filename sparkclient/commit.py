"""Driver side, after the write job: the batch's commit from the task results Spark accepted.

Shared by the foreachBatch writer and the native sink. The driver names, for every partition
0..N-1, the winner (the accepted task try's lease, None for an empty partition) and sends each
winner's pre-commit record with the commit (the try that claimed the lease, producer id and epoch,
counts, first offsets); the coordinator stores them with the decision, commits every winner by
resume and aborts every other lease of the attempt. An answer the driver cannot act on (another
state, other winners) stops the query rather than pass the batch as committed.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from .client import CoordinatorClient, CoordinatorError
from .executor import TaskResult

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class BatchReport:
    """What one batch did on the driver, with its figures (also logged, one line per batch)."""

    batch_id: int
    action: str  # "committed"; "empty" (no row: committed without a transaction); "skipped" (already
    # committed); "resumed" (a decided commit finished, then skipped)
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


def commit_batch(client: CoordinatorClient, batch_id: int, generation: int, attempt: int,
                 results: list[TaskResult], job_ms: int | None,
                 hook: Callable[..., None] = lambda step, **info: None) -> BatchReport:
    """Commit the attempt with the accepted results; raises CoordinatorError on a refusal."""
    accepted = accepted_results(results, len(results))
    for r in accepted.values():
        if r.lease_id is not None and (r.generation, r.attempt, r.batch_id) != (generation, attempt, batch_id):
            raise unexpected("write job", batch_id, f"a result of generation {r.generation} attempt {r.attempt} "
                              f"batch {r.batch_id}", f"generation {generation} attempt {attempt}")
    winners = {p: r.lease_id for p, r in accepted.items()}
    hook("before_commit", batch_id=batch_id, attempt=attempt, generation=generation, winners=winners)
    started = time.monotonic()
    answer = client.commit(batch_id, attempt, generation, winners, job_ms,
                           records={p: r.precommit_record() for p, r in accepted.items() if r.lease_id is not None})
    if answer.get("state") != "COMMITTED" or answer.get("attempt") != attempt:
        raise unexpected("commit", batch_id, f"state {answer.get('state')!r} for attempt {answer.get('attempt')}",
                          f"state 'COMMITTED' for attempt {attempt}")
    committed = {c["partition"]: c["lease_id"] for c in answer.get("committed", [])}
    named = {p: lease for p, lease in winners.items() if lease is not None}
    if committed != named:
        raise unexpected("commit", batch_id, f"winners {committed}", f"the winners the driver named, {named}")
    commit_ms = int((time.monotonic() - started) * 1000)
    for warning in answer.get("warnings", []):
        log.warning("batch %d: %s", batch_id, warning)
    hook("after_commit", batch_id=batch_id, attempt=attempt, generation=generation, winners=winners)
    written = [r for r in accepted.values() if r.lease_id is not None]
    return BatchReport(batch_id, "committed" if written else "empty", attempt, len(accepted),
                       sum(r.records for r in written), sum(r.bytes for r in written), job_ms or 0, commit_ms,
                       winners=winners)


def abort_attempt(client: CoordinatorClient, batch_id: int, generation: int, attempt: int, why: str) -> None:
    """End an attempt whose write job failed now, rather than at the next begin or by the recovery
    loop; a refusal is logged (the failure being raised matters more)."""
    try:
        client.abort(batch_id, attempt, generation, why)
    except CoordinatorError as error:
        log.warning("batch %d: could not abort attempt %d after the job failed: %s", batch_id, attempt, error)


def unexpected(call: str, batch_id: int, got: str, expected: str) -> CoordinatorError:
    """An answer this driver cannot act on safely: stop the query rather than guess."""
    return CoordinatorError(None, "unexpected_answer", f"{call} of batch {batch_id} answered {got}; expected "
                            f"{expected}. Check that coordinator.url points at a coordinator of a compatible version; "
                            "the query stops and replays the batch when restarted", call=call)

