"""The protocol's calls (docs/protocol.md): a generation, begin, a try's lease, commit, resume and
abort. Each is one operation of the coordinator; the answer is its result as the schema says."""

from __future__ import annotations

from fastapi import APIRouter

from ...protocol import errors as e
from ..dependencies import Service, Writer
from ..input import AttemptNumber, BatchId, InputRoute, SinkName, error_responses
from ..schemas import (
    AbortOut,
    AbortRequest,
    BeginCheckpointRequest,
    BeginOut,
    CommitOut,
    CommitRequest,
    GenerationOut,
    GenerationRequest,
    LeaseGranted,
    LeaseRequest,
)

PROTOCOL = error_responses(401, 403, 404, 409, 503)
ATTEMPT = "/v1/sinks/{name}/checkpoints/{batch_id}/attempts/{attempt}"

router = APIRouter(route_class=InputRoute, tags=["protocol"], responses=PROTOCOL)


@router.post("/v1/sinks/{name}/generations")
def start_generation(name: SinkName, body: GenerationRequest, who: Writer, coordinator: Service) -> GenerationOut:
    """A Spark query (re)started: returns a new generation that fences every older driver."""
    generation, aborts = coordinator.start_generation(name, body.query_id, body.run_id, who.actor)
    return GenerationOut(generation=generation, aborted=aborts.aborted, abort_pending=aborts.pending)


@router.post("/v1/sinks/{name}/checkpoints/{batch_id}/begin")
def begin_checkpoint(name: SinkName, batch_id: BatchId, body: BeginCheckpointRequest, who: Writer,
                     coordinator: Service) -> BeginOut:
    return BeginOut.of(coordinator.begin_checkpoint(name, batch_id, body.generation, who.actor,
                                                    partitions=body.partitions, offsets_digest=body.offsets))


@router.post(f"{ATTEMPT}/leases")
def lease(name: SinkName, batch_id: BatchId, attempt: AttemptNumber, body: LeaseRequest, _: Writer,
          coordinator: Service) -> LeaseGranted:
    """A task try's lease (Spark's task attempt id names the try): its partition's pre-lease if no
    try claimed it yet, else a fresh id; a retried request answers the same lease."""
    return LeaseGranted.of_grant(coordinator.lease(name, batch_id, attempt, body.generation, body.partition,
                                                   body.task_attempt_id))


@router.post(f"{ATTEMPT}/commit")
def commit(name: SinkName, batch_id: BatchId, attempt: AttemptNumber, body: CommitRequest, who: Writer,
           coordinator: Service) -> CommitOut:
    return CommitOut.of(coordinator.commit(name, batch_id, attempt, body.generation, body.results(), who.actor,
                                           body.job_ms))


@router.post(f"{ATTEMPT}/abort")
def abort(name: SinkName, batch_id: BatchId, attempt: AttemptNumber, body: AbortRequest, who: Writer,
          coordinator: Service) -> AbortOut:
    if not who.is_admin and body.generation is None:
        raise e.Invalid("generation_required", "a writer must name its generation", field="generation")
    result, outcome = coordinator.abort_attempt(name, batch_id, attempt, body.generation, body.reason, who.actor)
    return AbortOut.of(result, outcome)


@router.post("/v1/sinks/{name}/checkpoints/{batch_id}/resume")
def resume(name: SinkName, batch_id: BatchId, _: Writer, coordinator: Service) -> CommitOut:
    """Finish a decided commit; answers from the record if it is already finished."""
    return CommitOut.of(coordinator.resume(name, batch_id))
