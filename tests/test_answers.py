"""The hot protocol answers are encoded from plain values (`answers.answer_fields`, `api._answer`),
not from validated models: for every shape an answer takes, those bytes must be the ones the
model's own `model_dump_json` gives (what FastAPI would send for the route's response model)."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone
from typing import Any

import pytest
from pydantic import BaseModel
from pydantic_core import to_json

from coordinator.http.answers import answer_fields
from coordinator.http.schemas import BeginOut, CommitOut
from coordinator.protocol.model import FIRST_TRY_TASK_ATTEMPT, Attempt, Checkpoint, Lease
from coordinator.protocol.rules import BeginAction
from coordinator.protocol.states import AttemptState, CheckpointState, LeaseState
from coordinator.service import AbortOutcome, BeginResult, CommitResult

T0 = datetime(2026, 11, 27, 11, 0, 0, 123456, tzinfo=timezone.utc)
RULES = {"commit_margin_ms": 6000, "max_lease_init_age_ms": 30000, "producer_init_timeout_ms": 60000,
         "producer_request_timeout_ms": 60000}


def checkpoint(state: CheckpointState) -> Checkpoint:
    return Checkpoint(id=7, sink_id=1, query_id="q", batch_id=41, state=state, current_attempt=2,
                      committed_attempt=2 if state is not CheckpointState.OPEN else None, created_at=T0,
                      decided_at=None, committed_at=None)


def attempt(state: AttemptState) -> Attempt:
    return Attempt(id=9, checkpoint_id=7, number=2, generation=3, state=state, partitions=3, started_at=T0,
                   decided_at=None, finished_at=None, abort_reason=None)


def lease(partition: int, *, leased_at: datetime = T0, record: bool = False) -> Lease:
    return Lease.from_fields(
        id=2**50 + 9 * 2**17 + partition, sink_id=1, checkpoint_id=7, attempt_id=9, partition=partition,
        task_attempt_id=FIRST_TRY_TASK_ATTEMPT, transactional_id=f"orders-tx-{partition}",
        state=LeaseState.COMMITTED if record else LeaseState.LEASED, leased_at=leased_at,
        deadline_at=leased_at + timedelta(seconds=60), producer_id=1000 + partition if record else None,
        producer_epoch=0 if record else None, records=5 if record else None, bytes=500 if record else None,
        precommitted_at=None, resolved_at=None, write_ms=None, first_offsets=None,
    )


BEGINS = {
    "write, pre-leases": BeginResult(
        BeginAction.NEW_ATTEMPT, checkpoint(CheckpointState.OPEN), attempt(AttemptState.OPEN), [], [],
        [lease(0), lease(1), lease(2, leased_at=T0 + timedelta(microseconds=1500))],
        T0 + timedelta(milliseconds=3), RULES),
    "write, older attempt aborted, no partition count": BeginResult(
        BeginAction.NEW_ATTEMPT, checkpoint(CheckpointState.OPEN), attempt(AttemptState.OPEN),
        ["orders-tx-4", "orders-tx-5"], ["orders-tx-6"], [], None, RULES),
    "skip (no attempt, no rules)": BeginResult(
        BeginAction.SKIP, checkpoint(CheckpointState.COMMITTED), None, [], []),
    "resume": BeginResult(BeginAction.RESUME, checkpoint(CheckpointState.COMMITTED), attempt(AttemptState.COMMITTED),
                          [], []),
}

COMMITS = {
    "committed, winners out of order": CommitResult(
        checkpoint(CheckpointState.COMMITTED), attempt(AttemptState.COMMITTED),
        [lease(2, record=True), lease(0, record=True)], AbortOutcome(["orders-tx-8"], [])),
    "a winner without its record, warnings, aborts pending": CommitResult(
        checkpoint(CheckpointState.COMMITTING), attempt(AttemptState.COMMITTING), [lease(1)],
        AbortOutcome([], ["orders-tx-9"]), ["a warning", "another"]),
    "no winner": CommitResult(checkpoint(CheckpointState.COMMITTED), attempt(AttemptState.COMMITTED), [],
                              AbortOutcome()),
}


@pytest.mark.parametrize("model, fields", [
    *[pytest.param(BeginOut, BeginOut.fields_of(r), id=f"begin: {name}") for name, r in BEGINS.items()],
    *[pytest.param(CommitOut, CommitOut.fields_of(r), id=f"commit: {name}") for name, r in COMMITS.items()],
])
def test_an_answer_encoded_from_plain_values_is_the_models_json(model: type[BaseModel], fields: dict[str, Any]) -> None:
    assert to_json(fields) == model.model_validate(fields).model_dump_json(by_alias=True).encode()


def test_the_pre_leases_times_are_each_leases_own() -> None:
    out = BeginOut.fields_of(BEGINS["write, pre-leases"])
    assert [(x["transaction_timeout_ms"], x["age_ms"]) for x in out["pre_leases"]] == [(60000, 3), (60000, 3), (60000, 1)]


def test_answer_fields_fills_defaults_in_the_models_order_and_refuses_other_fields() -> None:
    class Out(BaseModel):
        a: int
        b: list[int] = []
        c: str | None = None

    assert list(answer_fields(Out, {"c": "x", "a": 1}).items()) == [("a", 1), ("b", []), ("c", "x")]
    with pytest.raises(TypeError, match="not fields of Out"):
        answer_fields(Out, {"a": 1, "d": 2})
