"""The coordinator's operations: each one reads the durable state, asks the protocol rules what
to do, writes the decision with compare-and-set in one Postgres transaction, and only then acts
on Kafka through the control plane. No database transaction is held open across a Kafka call.

Every operation is safe to retry: the same request finds its own earlier effect and answers
from it (natural keys: run id, (checkpoint, generation), (attempt, partition, task attempt id),
the stored pre-commit values, the decided winners).

One module per concern, composed into the one `Coordinator` everyone imports from here:
- `results.py`: the values the operations take and answer with (Limits, SinkSpec, BeginResult...);
- `base.py`: the shared state (engine, control plane, clock, limits), the transaction helper,
  and the Kafka steps both the driver's calls and recovery run (finish a decided commit, abort
  on Kafka);
- `kafka_passes.py`: a pass of Kafka calls over a batch's transactions (the control plane's own
  pass where it has one, else parallel calls; cut short when the broker answers none);
- `protocol_operations.py`: what a driver and its executors call (sinks, generations and lineage,
  begin, leases, pre-commit, commit, resume, abort);
- `recovery_operations.py`: what the recovery loop runs (coordinator/service/recovery.py);
- `retirement.py`: retiring a sink once nothing of it can be open;
- `history.py`: pruning old committed batches' history (the retention);
- `reads.py`: the reads (the API, the dashboard, the CLI, the tests).
"""

from .base import CoordinatorBase
from .history import HistoryOperations, PruneOutcome
from .protocol_operations import ProtocolOperations
from .reads import Reads
from .recovery_operations import RecoveryOperations
from .retirement import RetirementOperations
from .results import (
    AbortOutcome,
    BatchSummary,
    BeginResult,
    CheckpointDetail,
    CommitResult,
    FinishOutcome,
    LeasePage,
    OpenTransactions,
    Limits,
    PoolUsage,
    SinkOverview,
    SinkSpec,
    SweepOutcome,
)


class Coordinator(ProtocolOperations, RecoveryOperations, RetirementOperations, HistoryOperations, Reads):
    """The coordinator service. Split by concern into parts over one shared state (engine,
    control plane, clock, limits, `_tx`, `_parallel` in CoordinatorBase), so that each concern has
    one place a newcomer can read on its own; the public surface is the same as one class."""


__all__ = [
    "AbortOutcome",
    "BatchSummary",
    "BeginResult",
    "CheckpointDetail",
    "CommitResult",
    "Coordinator",
    "CoordinatorBase",
    "FinishOutcome",
    "HistoryOperations",
    "LeasePage",
    "OpenTransactions",
    "Limits",
    "PoolUsage",
    "ProtocolOperations",
    "PruneOutcome",
    "Reads",
    "RecoveryOperations",
    "SinkOverview",
    "SinkSpec",
    "SweepOutcome",
]
