"""The coordinator's Prometheus metrics, all in one place (served at /metrics).

Counters are per process: with several replicas, sum them in Prometheus. The recovery loop's
metrics come only from the replica that leads it (`coordinator_recovery_leader` is 1 there).
"""

from __future__ import annotations

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    REGISTRY,
    Counter,
    Gauge,
    generate_latest,
)

CHECKPOINTS_LOST = Counter(
    "coordinator_checkpoints_lost",
    "Checkpoints whose decided commit Kafka refused for good (data lost; the sink is halted)",
    ["sink"],
)
TRANSACTIONS_LOST = Counter(
    "coordinator_transactions_lost",
    "Winning transactions whose commit Kafka refused for good (fenced, timed out, unknown producer)",
    ["sink"],
)
LOST_DATA_ACKNOWLEDGED = Counter(
    "coordinator_lost_data_acknowledged",
    "Operator acknowledgements that cleared a sink's lost-data halt",
    ["sink"],
)
SINK_HALTED = Gauge(
    "coordinator_sink_halted",
    "1 while the sink refuses new batches because of lost data, as last seen by this process",
    ["sink"],
)
LINGERING_FOUND = Counter(
    "coordinator_lingering_transactions_found",
    "Open transactions under a sink's prefix that the database does not explain",
    ["sink"],
)
LINGERING_ABORTED = Counter(
    "coordinator_lingering_transactions_aborted",
    "Lingering transactions the recovery loop aborted",
    ["sink"],
)
TRANSACTION_TIMEOUT_WARNINGS = Counter(
    "coordinator_transaction_timeout_warnings",
    "Pre-committed transactions seen past the warning fraction (80%) of their timeout",
    ["sink"],
)
TRANSACTIONS_NEAR_TIMEOUT = Gauge(
    "coordinator_transactions_near_timeout",
    "Pre-committed or committing transactions now past the warning fraction of their timeout",
    ["sink"],
)
EXPIRED_LEASES_ABORTED = Counter(
    "coordinator_expired_leases_aborted",
    "Leases of open attempts marked for abort because their transaction can no longer be committed",
    ["sink"],
)
RECOVERED_COMMITS = Counter(
    "coordinator_recovery_commits_finished",
    "Decided commits the recovery loop finished",
    ["sink"],
)
RECOVERY_LEADER = Gauge("coordinator_recovery_leader", "1 while this process leads the recovery loop")
RECOVERY_ITERATIONS = Counter("coordinator_recovery_iterations", "Recovery loop iterations run as leader")
RECOVERY_ERRORS = Counter("coordinator_recovery_errors", "Recovery loop steps that failed", ["step"])


def render() -> tuple[bytes, str]:
    """The exposition text and its content type."""
    return generate_latest(REGISTRY), CONTENT_TYPE_LATEST
