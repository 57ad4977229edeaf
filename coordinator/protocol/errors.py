"""Errors of the protocol, each with a machine-readable reason.

The HTTP adapter maps the class to a status code (Conflict 409, NotFound 404, Invalid 422,
Unavailable 503); clients branch on `reason`, people read `message`.
"""

from __future__ import annotations

from typing import Any


class ProtocolError(Exception):
    status = 400

    def __init__(self, reason: str, message: str, **detail: Any) -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message
        self.detail = detail

    def to_dict(self) -> dict[str, Any]:
        body: dict[str, Any] = {"reason": self.reason, "message": self.message}
        if self.detail:
            body["detail"] = self.detail
        return body


class Conflict(ProtocolError):
    """The call is stale or contradicts the durable state; nothing was changed by it."""

    status = 409


class NotFound(ProtocolError):
    status = 404


class Invalid(ProtocolError):
    status = 422


class Unavailable(ProtocolError):
    """Temporarily impossible (pool exhausted, no Kafka control plane); retry later or fix config."""

    status = 503


class IllegalTransition(AssertionError):
    """A bug: the code tried a move its state machine does not have."""


# Reasons (the stable vocabulary of 409 answers).
STALE_GENERATION = "stale_generation"
UNKNOWN_GENERATION = "unknown_generation"
LINEAGE_MISMATCH = "lineage_mismatch"
LINEAGE_NOT_BOUND = "lineage_not_bound"
STALE_ATTEMPT = "stale_attempt"
ATTEMPT_ABORTED = "attempt_aborted"
STALE_LEASE = "stale_lease"
LEASE_MISMATCH = "lease_mismatch"
LEASE_NOT_CLAIMED = "lease_not_claimed"
PRECOMMIT_MISMATCH = "precommit_mismatch"
OFFSETS_MISMATCH = "batch_offsets_mismatch"
WINNER_NOT_PRECOMMITTED = "winner_not_precommitted"
WINNER_MISMATCH = "winner_mismatch"
DEADLINE_TOO_CLOSE = "transaction_deadline_too_close"
TRANSACTION_TIMED_OUT = "transaction_timed_out"
COMMIT_DECIDED = "commit_decided"
NOT_COMMITTING = "not_committing"
COMMIT_IN_PROGRESS = "commit_in_progress"
SINK_EXISTS = "sink_exists"
PREFIX_CLASH = "transactional_id_prefix_clash"
POOL_EXHAUSTED = "pool_exhausted"
NO_CONTROL_PLANE = "kafka_control_plane_unconfigured"
SINK_HALTED_LOST_DATA = "sink_halted_lost_data"
DATA_LOST = "data_lost"
SINK_RETIRED = "sink_retired"
HISTORY_PRUNED = "history_pruned"
RETIREMENT_BLOCKED = "sink_has_open_transactions"
