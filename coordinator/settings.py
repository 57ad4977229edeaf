"""Configuration from the environment (prefix COORDINATOR_), read once at start-up."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, SecretStr, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from . import DEFAULT_DATA_DIR
from .protocol import configuration as rules


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="COORDINATOR_", extra="ignore")

    # Postgres URL (postgresql://user:pass@host:5432/db). Unset: `coordinator serve` starts an
    # embedded Postgres in data_dir.
    database_url: str | None = None
    data_dir: Path = Path(DEFAULT_DATA_DIR)
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=1, le=65535)
    workers: int = Field(1, ge=1, le=64)
    # `coordinator serve` applies the migrations before serving. Deployments with several replicas
    # set false and run `coordinator migrate` once (a compose service, a Kubernetes Job); until
    # then /readyz answers 503 schema_not_current.
    migrate_on_start: bool = True
    # Required with an external database. Unset with the embedded one: generated once and kept
    # in data_dir/admin-token.
    admin_token: SecretStr | None = None
    # Key from which per-sink writer tokens are derived; defaults to one derived from the admin
    # token (then rotating the admin token rotates every writer token too).
    token_secret: SecretStr | None = None
    # How the coordinator acts on Kafka. "kafka" (default): commits and aborts go to each sink's
    # brokers. "none": record-only test mode that never touches Kafka (logged loudly).
    kafka_control_plane: Literal["none", "kafka"] = "kafka"
    # The "kafka" control plane: per-request timeout, total retry time for one commit or abort,
    # and kafka-python client settings for security (JSON, e.g. {"security_protocol":
    # "SASL_SSL", "sasl_mechanism": "SCRAM-SHA-512", "sasl_plain_username": "coordinator"}).
    # Together with the recovery leader's TTL and interval these bound how late a decided commit
    # may reach Kafka (configuration.CommitReach, 22 s with the defaults); every sink's commit margin
    # must exceed it (registration refuses it otherwise), so the defaults are kept small: the default
    # margin of a 60 s transaction is then 25 s, leaving 35 s from a lease to the commit decision.
    kafka_request_timeout_ms: int = Field(4_000, ge=100)
    kafka_retry_budget_ms: int = Field(8_000, ge=0)
    kafka_client_config: dict[str, Any] = {}
    kafka_sasl_password: SecretStr | None = None
    max_partitions: int = Field(4096, ge=1, le=100_000)
    broker_max_transaction_timeout_ms: int = Field(900_000, ge=1_000)
    # How long a crashed driver takes to come back and resume a decided commit. A commit warns
    # when the batch's duration plus this exceeds the sink's transaction timeout; kept well below
    # the default timeout (60 s) so that the warning fires only for slow batches.
    restart_budget_ms: int = Field(20_000, ge=0)
    # No quick reuse (DESIGN §3 Revisions): executors start init_transactions only on a lease
    # younger than lease_max_init_age_ms and give it producer_init_timeout_ms (its requests
    # producer_request_timeout_ms); an id freed from an undecided try is leased again only after
    # transactional_id_quarantine_ms, which must exceed the three together (checked at start).
    lease_max_init_age_ms: int = Field(30_000, ge=1_000)
    producer_init_timeout_ms: int = Field(60_000, ge=1_000)
    producer_request_timeout_ms: int = Field(60_000, ge=1_000)
    transactional_id_quarantine_ms: int = Field(180_000, ge=1_000)
    db_pool_size: int = Field(20, ge=1, le=500)
    # The recovery loop (one leader among replicas): finishes decided commits, aborts expired
    # leases and lingering transactions, warns before timeouts. The leader's lease lasts
    # recovery_leader_ttl_ms (the database's clock); a replica takes over within TTL + interval.
    recovery_enabled: bool = True
    recovery_interval_ms: int = Field(2_000, ge=10)
    recovery_leader_ttl_ms: int = Field(6_000, ge=50)
    # how often the recovery loop lists each Kafka cluster's open transactions (one request per
    # cluster, whatever the number of sinks) to abort those no lease explains
    recovery_sweep_interval_ms: int = Field(30_000, ge=100)
    # The recovery loop's leader prunes the history (attempts, leases, events) of COMMITTED batches
    # committed longer ago than this (service/history.py; `coordinator prune-history` does it by
    # hand). Unset: the whole history is kept.
    history_retention_hours: int | None = Field(None, ge=1)
    # Read-only token for the operator dashboard (/dashboard); the admin token can view and act.
    # Unset: only the admin token logs in.
    dashboard_viewer_token: SecretStr | None = None
    # Mark the dashboard's session cookie Secure (set it when the service is reached over HTTPS).
    dashboard_secure_cookie: bool = False
    log_level: Literal["debug", "info", "warning", "error"] = "info"

    @model_validator(mode="after")
    def _keeps_i4(self) -> Settings:
        if self.recovery_leader_ttl_ms <= self.recovery_interval_ms:
            raise ValueError(
                f"COORDINATOR_RECOVERY_LEADER_TTL_MS={self.recovery_leader_ttl_ms} must exceed "
                f"COORDINATOR_RECOVERY_INTERVAL_MS={self.recovery_interval_ms}, or the leader's lease lapses "
                "between its renewals")
        reach = self.commit_reach()
        if reach.total_ms + rules.REACH_SLACK_MS >= self.broker_max_transaction_timeout_ms:
            raise ValueError(
                f"no sink could keep I4 under these settings: a decided commit may reach Kafka up to "
                f"{reach.total_ms} ms after its decision ({reach.describe()}), so every commit margin must "
                "exceed that, but "
                f"transaction timeouts end at COORDINATOR_BROKER_MAX_TRANSACTION_TIMEOUT_MS="
                f"{self.broker_max_transaction_timeout_ms}. Lower COORDINATOR_KAFKA_REQUEST_TIMEOUT_MS, "
                "COORDINATOR_KAFKA_RETRY_BUDGET_MS, COORDINATOR_RECOVERY_LEADER_TTL_MS or "
                "COORDINATOR_RECOVERY_INTERVAL_MS")
        return self

    def commit_reach(self) -> rules.CommitReach:
        return rules.CommitReach(self.kafka_request_timeout_ms, self.kafka_retry_budget_ms,
                                 self.recovery_leader_ttl_ms, self.recovery_interval_ms)

    def kafka_options(self) -> dict[str, Any]:
        client = dict(self.kafka_client_config)
        if self.kafka_sasl_password is not None:
            client["sasl_plain_password"] = self.kafka_sasl_password.get_secret_value()
        return {
            "request_timeout_ms": self.kafka_request_timeout_ms,
            "retry_budget_ms": self.kafka_retry_budget_ms,
            "client_config": client,
        }

    def writer_token_secret(self) -> bytes:
        if self.token_secret is not None:
            return self.token_secret.get_secret_value().encode()
        if self.admin_token is None:
            raise ValueError("COORDINATOR_ADMIN_TOKEN (or COORDINATOR_TOKEN_SECRET) must be set")
        return hashlib.sha256(b"writer-token-secret:" + self.admin_token.get_secret_value().encode()).digest()
