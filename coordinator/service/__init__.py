"""The coordinator's operations. Each one reads and locks what the rules need (the clock read after
the locks), asks the protocol's pure rules (coordinator/protocol/) what to do, writes the decision
with compare-and-set in one Postgres transaction, and only then acts on Kafka through the control
plane. No database transaction is held open across a Kafka call. Every operation is safe to
retry: the same request finds its own earlier effect and answers from it.

`Coordinator` is the one object the HTTP API, the CLI, the recovery loop and the tests use: each
method below is one operation, implemented in the module it names.

- `sinks.py`: registration, writer tokens, generations and lineage, lost data, retirement;
- `begin.py`, `leasing.py`, `commit.py`: the protocol's calls of a batch (begin, a try's lease,
  commit, resume, abort);
- `committer.py` and `commit_outcomes.py`: finishing a decided commit on Kafka, and what each
  outcome means; `aborts.py`: ending an attempt, and aborts on Kafka;
- `recovery_steps.py` (what the recovery loop runs) and `recovery.py` (the loop);
- `history.py` (pruning), `reads.py`, `broker_checks.py`, `metrics.py`, `clock.py`;
- `context.py`: what they share (engine, control plane, clock, limits, the transaction helper);
  `results.py`: the values they answer with.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta

from sqlalchemy import Engine

from ..kafka.control_plane import KafkaControlPlane
from ..protocol import configuration as config
from ..protocol.model import Attempt, Lease, PartitionResult, Sink
from . import begin, commit, history, leasing, sinks
from .aborts import Aborter
from .clock import Clock, DatabaseClock
from .committer import Committer
from .context import ServiceContext
from .history import PruneOutcome
from .reads import Reads
from .recovery_steps import RecoverySteps
from .results import (
    AbortOutcome,
    BatchSummary,
    BeginResult,
    CheckpointDetail,
    CommitResult,
    FinishOutcome,
    LeaseGrant,
    LeasePage,
    Limits,
    OpenTransactions,
    PoolUsage,
    SinkOverview,
    SinkSpec,
    SweepOutcome,
)


class Coordinator(Reads, RecoverySteps):
    """The coordinator service: the protocol's operations (below), the reads (`Reads`) and what
    the recovery loop runs (`RecoverySteps`), over one `ServiceContext`."""

    def __init__(self, engine: Engine, control_plane: KafkaControlPlane | None, clock: Clock | None = None,
                 limits: Limits | None = None) -> None:
        limits = limits or Limits()
        reach = limits.commit_reach
        config.validate_quarantine(limits.transactional_id_quarantine_ms, limits.lease_max_init_age_ms,
                                   limits.producer_init_timeout_ms, limits.producer_request_timeout_ms,
                                   reach.retry_budget_ms + reach.request_timeout_ms if reach else 0)
        self.ctx = ServiceContext(engine, control_plane, clock or DatabaseClock(engine), limits)
        self.aborter = Aborter(self.ctx)
        self.committer = Committer(self.ctx, self.aborter)
        Reads.__init__(self, self.ctx)
        RecoverySteps.__init__(self, self.ctx, self.committer, self.aborter)

    @property
    def engine(self) -> Engine:
        return self.ctx.engine

    @property
    def control_plane(self) -> KafkaControlPlane | None:
        return self.ctx.control_plane

    @property
    def clock(self) -> Clock:
        return self.ctx.clock

    @property
    def limits(self) -> Limits:
        return self.ctx.limits

    def close(self) -> None:
        if self.ctx.control_plane is not None:
            self.ctx.control_plane.close()

    # --- sinks, generations, lineage (sinks.py) --------------------------------------------------

    def register_sink(self, spec: SinkSpec, actor: str, *, check_broker: bool = True) -> tuple[Sink, bool]:
        return sinks.register_sink(self.ctx, spec, actor, check_broker=check_broker)

    def rotate_writer_token(self, name: str, actor: str) -> Sink:
        return sinks.rotate_writer_token(self.ctx, name, actor)

    def start_generation(self, name: str, query_id: str, run_id: str, actor: str) -> tuple[int, AbortOutcome]:
        return sinks.start_generation(self.ctx, self.aborter, name, query_id, run_id, actor)

    def reset_lineage(self, name: str, actor: str, reason: str) -> Sink:
        return sinks.reset_lineage(self.ctx, self.aborter, name, actor, reason)

    def acknowledge_lost_data(self, name: str, actor: str, reason: str,
                              operator: str | None = None) -> tuple[Sink, bool, list[int]]:
        return sinks.acknowledge_lost_data(self.ctx, name, actor, reason, operator)

    def retire_sink(self, name: str, actor: str, reason: str) -> tuple[Sink, bool]:
        return sinks.retire_sink(self.ctx, name, actor, reason)

    # --- a batch: begin, leases, commit (begin.py, leasing.py, commit.py) ------------------------

    def begin_checkpoint(self, name: str, batch_id: int, generation: int, actor: str, partitions: int | None = None,
                         offsets_digest: str | None = None) -> BeginResult:
        return begin.begin_checkpoint(self.ctx, self.committer, self.aborter, name, batch_id, generation, actor,
                                      partitions, offsets_digest)

    def lease(self, name: str, batch_id: int, attempt_number: int, generation: int, partition: int,
              task_attempt_id: int) -> LeaseGrant:
        """A task try's lease: its partition's pre-lease if no try claimed it yet, else a fresh id."""
        return leasing.lease_for_try(self.ctx, name, batch_id, attempt_number, generation, partition, task_attempt_id)

    def begin_partition(self, name: str, batch_id: int, attempt_number: int, generation: int, partition: int,
                        task_attempt_id: int) -> Lease:
        """`lease`, the lease alone."""
        return self.lease(name, batch_id, attempt_number, generation, partition, task_attempt_id).lease

    def commit(self, name: str, batch_id: int, attempt_number: int, generation: int,
               results: Sequence[PartitionResult], actor: str, job_ms: int | None = None) -> CommitResult:
        return commit.commit(self.ctx, self.committer, self.aborter, name, batch_id, attempt_number, generation,
                             results, actor, job_ms)

    def resume(self, name: str, batch_id: int) -> CommitResult:
        return commit.resume(self.ctx, self.committer, self.aborter, name, batch_id)

    def abort_attempt(self, name: str, batch_id: int, attempt_number: int, generation: int | None, reason: str,
                      actor: str) -> tuple[Attempt, AbortOutcome]:
        return commit.abort_attempt(self.ctx, self.aborter, name, batch_id, attempt_number, generation, reason, actor)

    # --- history (history.py) --------------------------------------------------------------------

    def prune_history(self, older_than: timedelta, actor: str, *, sink: str | None = None, limit: int = 500,
                      dry_run: bool = False) -> PruneOutcome:
        return history.prune_history(self.ctx, older_than, actor, sink=sink, limit=limit, dry_run=dry_run)


__all__ = [
    "AbortOutcome", "BatchSummary", "BeginResult", "CheckpointDetail", "CommitResult", "Coordinator", "FinishOutcome",
    "LeaseGrant", "LeasePage", "Limits", "OpenTransactions", "PoolUsage", "PruneOutcome", "SinkOverview", "SinkSpec",
    "SweepOutcome",
]
