"""What a decided winner's EndTxn outcome means, in one ladder (as Flink's committer states it):
committed; still pending (retry later, the decision stands); committed after all (the log shows
it); or lost (Kafka refused it for good and the log does not show it committed).

Only refusals that mean "this transaction is gone" (rules.TRANSACTION_GONE_CODES) can end a
commit, and before one is declared lost the partition log is read at the transaction's first
offsets (DESIGN.md §3 Revisions, "Loss is declared only when true")."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum

from ..kafka.control_plane import NOT_TRIED, ControlPlaneError, FirstOffset, TransactionOutcome
from ..protocol.model import Lease
from .context import log


class Verdict(StrEnum):
    COMMITTED = "committed"
    COMMITTED_AFTER_ALL = "committed_after_all"  # refused, yet the log shows its records committed
    PENDING = "pending"  # may still commit: stays COMMITTING, retried with backoff
    LOST = "lost"  # refused for good: the data is lost


@dataclass(frozen=True)
class CommitVerdict:
    lease: Lease
    verdict: Verdict
    code: str | None = None  # Kafka's (or the control plane's) code, when not committed
    message: str = ""
    confirmed: bool = False  # LOST: the log showed the records aborted (else: the log could not tell)
    not_tried: bool = False  # PENDING: the pass never sent it (the broker answered none of its calls)


def judge(lease: Lease, error: ControlPlaneError | None, read_log: Callable[[Lease], TransactionOutcome]
          ) -> CommitVerdict:
    """The one ladder. `read_log` reads the lease's first offsets read_committed (only asked
    after a refusal that means the transaction is gone)."""
    if error is None:
        return CommitVerdict(lease, Verdict.COMMITTED)
    if not error.transaction_gone:
        if not error.retriable:
            log.error("commit of %s answered %s: not a refusal that ends a transaction, so it stays decided and is "
                      "retried; check the coordinator's ACLs and the broker's logs", lease.transactional_id, error.code)
        return CommitVerdict(lease, Verdict.PENDING, error.code, str(error), not_tried=error.code == NOT_TRIED)
    outcome = read_log(lease)
    if outcome is TransactionOutcome.COMMITTED:  # e.g. EndTxn applied, its answer lost, id re-initialised
        return CommitVerdict(lease, Verdict.COMMITTED_AFTER_ALL, error.code, str(error))
    if outcome is TransactionOutcome.ABORTED or not first_offsets(lease):
        return CommitVerdict(lease, Verdict.LOST, error.code, str(error), confirmed=outcome is TransactionOutcome.ABORTED)
    return CommitVerdict(lease, Verdict.PENDING, error.code, f"{error}; the partition log does not show the outcome yet")


def first_offsets(lease: Lease) -> list[FirstOffset]:
    """The (topic, partition, offset) of the transaction's first record per partition, as the
    executor reported them with its record."""
    return [tuple(x) for x in json.loads(lease.first_offsets or "[]")]  # type: ignore[misc]
