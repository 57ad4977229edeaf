"""Reads of a sink's record: its batches, one batch with its leases (in pages), the transactions
that may be open, the audit trail."""

from __future__ import annotations

from fastapi import APIRouter

from ...protocol.states import CheckpointState, LeaseState
from ..dependencies import Service, Writer
from ..input import AfterLeaseId, BatchId, EventId, InputRoute, PageSize, SinkName, error_responses
from ..schemas import CheckpointDetailOut, CheckpointOut, EventOut, LeaseOut

router = APIRouter(route_class=InputRoute, tags=["reads"], responses=error_responses(401, 403, 404, 409, 503))


@router.get("/v1/sinks/{name}/checkpoints")
def list_checkpoints(name: SinkName, _: Writer, coordinator: Service, state: CheckpointState | None = None,
                     before_batch: BatchId | None = None, limit: PageSize = 50) -> list[CheckpointOut]:
    """Checkpoints of the sink's current lineage, newest first; page with before_batch."""
    return [CheckpointOut.of(c) for c in coordinator.list_checkpoints(name, state=state, before_batch=before_batch,
                                                                      limit=limit)]


@router.get("/v1/sinks/{name}/checkpoints/{batch_id}")
def checkpoint_detail(name: SinkName, batch_id: BatchId, _: Writer, coordinator: Service,
                      lease_state: LeaseState | None = None, after_lease_id: AfterLeaseId = 0,
                      lease_limit: PageSize = 1000) -> CheckpointDetailOut:
    """The checkpoint, its attempts, what its decided attempt's winners wrote (records, bytes),
    and its leases by id: at most lease_limit (of lease_state, if given) after after_lease_id.
    lease_counts has its lease count by state; the next page starts after next_after_lease_id
    (null: this page is the last). A wide batch has a lease per partition and try."""
    page = coordinator.checkpoint_leases(name, batch_id, state=lease_state, after_id=after_lease_id,
                                         limit=lease_limit)
    # read after the page, so every listed lease's attempt is in it
    return CheckpointDetailOut.of(coordinator.batch_summary(name, batch_id), page)


@router.get("/v1/sinks/{name}/transactions/open")
def open_transactions(name: SinkName, _: Writer, coordinator: Service) -> list[LeaseOut]:
    """Every transactional id that may hold an unresolved transaction, with its lease."""
    return [LeaseOut.of(x) for x in coordinator.possibly_open_transactions(name)]


@router.get("/v1/sinks/{name}/events")
def list_events(name: SinkName, _: Writer, coordinator: Service, after_id: EventId = 0,
                batch_id: BatchId | None = None, limit: PageSize = 100) -> list[EventOut]:
    """The audit trail, oldest first; page with after_id. A batch on the common path has one
    event, `commit_decided`; its start and commit are on its attempt and checkpoint rows
    (GET …/checkpoints/{batch_id}). Anything else has its own event (docs/protocol.md)."""
    return [EventOut(**ev) for ev in coordinator.list_events(name, after_id=after_id, batch_id=batch_id, limit=limit)]
