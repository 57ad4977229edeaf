"""The checks and decisions of the protocol (DESIGN.md §3), as pure functions over plain records.

Nothing here reads a clock, a database or a network: callers pass `now` and the rows they read,
and act on the returned decision inside their own transaction. Every function either returns a
decision or raises a ProtocolError whose reason the client can branch on.

Long because the protocol's rules are kept in one file, in protocol order (sinks and ids,
generations, begin, leases and pre-commits, commit, lost data), so that they read as one
specification; each section is short and the states they move are in states.py.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from enum import StrEnum

from . import errors as e
from .model import Attempt, Checkpoint, Lease, PartitionResult, PrecommitRecord, Sink
from .states import UNDECIDED_LEASE_STATES, AttemptState, CheckpointState, LeaseState

# Kafka accepts any string as transactional.id; we keep to the characters Kafka allows in topic
# names so ids are safe in logs, ACL patterns and shell commands.
_PREFIX_RE = re.compile(r"^[A-Za-z0-9._-]+$")
MAX_PREFIX_LENGTH = 200
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
MAX_NAME_LENGTH = 100


# --- sinks and transactional ids -------------------------------------------------------------


def validate_sink_name(name: str) -> None:
    if not (1 <= len(name) <= MAX_NAME_LENGTH) or not _NAME_RE.fullmatch(name):
        raise e.Invalid(
            "invalid_sink_name",
            f"sink name must be 1-{MAX_NAME_LENGTH} characters of A-Z a-z 0-9 . _ - "
            "and start with a letter or digit",
            field="name",
        )


def validate_prefix(prefix: str) -> None:
    if not (1 <= len(prefix) <= MAX_PREFIX_LENGTH) or not _PREFIX_RE.fullmatch(prefix):
        raise e.Invalid(
            "invalid_transactional_id_prefix",
            f"transactional_id_prefix must be 1-{MAX_PREFIX_LENGTH} characters of A-Z a-z 0-9 . _ -",
            field="transactional_id_prefix",
        )


def prefixes_clash(a: str, b: str) -> bool:
    """Two sinks clash if one prefix starts the other: a broker-side sweep by prefix could then
    not tell their transactions apart."""
    return a.startswith(b) or b.startswith(a)


def transactional_id_stem(prefix: str) -> str:
    """What every pooled id of a sink starts with: the prefix and one separator ("orders" ->
    "orders-"; a prefix that already ends in "-", "." or "_" is used as it is, so "demo-" gives
    "demo-0", not "demo--0"). Prefix-free prefixes give prefix-free stems: a stem is the prefix or
    the prefix plus "-", so one stem starting another means one prefix starts the other."""
    return prefix if prefix.endswith(("-", ".", "_")) else prefix + "-"


def transactional_id_for(prefix: str, ordinal: int) -> str:
    return f"{transactional_id_stem(prefix)}{ordinal}"


@dataclass(frozen=True)
class CommitReach:
    """How long after a commit is decided its EndTxn may still reach the broker, from the
    coordinator's settings: the deciding replica's tries (the commit retry budget, the last
    request in flight up to the Kafka request timeout), or, if that replica dies, the recovery
    leader's after a failover (the leader TTL plus one loop interval). The timeout gate keeps
    I4 only if the commit margin exceeds this (DESIGN.md §3 Revisions, "Defaults that keep I4")."""

    request_timeout_ms: int
    retry_budget_ms: int
    leader_ttl_ms: int
    recovery_interval_ms: int

    @property
    def failover_ms(self) -> int:
        return self.leader_ttl_ms + self.recovery_interval_ms

    @property
    def total_ms(self) -> int:
        return self.request_timeout_ms + self.retry_budget_ms + self.failover_ms

    @property
    def recovery_grace_ms(self) -> int:
        """How young a decided commit the recovery loop leaves to the call that decided it (which
        retries its EndTxn that long): the loop's own EndTxn would race that call's. Waiting this
        long keeps the reach: the loop starts by grace + failover after the decision, its request
        lands within the request timeout, the sum `total_ms` already counts."""
        return self.retry_budget_ms

    def describe(self) -> str:
        return (f"Kafka request timeout {self.request_timeout_ms} + commit retry budget {self.retry_budget_ms} + "
                f"recovery-leader failover {self.failover_ms} (leader TTL {self.leader_ttl_ms} + loop interval "
                f"{self.recovery_interval_ms}) = {self.total_ms} ms")


# the default margin exceeds the commit reach by at least this much (a request's own latency)
REACH_SLACK_MS = 3_000


def validate_commit_reach(transaction_timeout_ms: int, commit_margin_ms: int, reach: CommitReach) -> None:
    """Refuse a sink whose margin lets a decided commit's EndTxn land after the broker's timeout."""
    if transaction_timeout_ms <= reach.total_ms + REACH_SLACK_MS:
        raise e.Invalid(
            "transaction_timeout_below_commit_reach",
            f"transaction_timeout_ms={transaction_timeout_ms} leaves no time for a batch: the commit margin must "
            f"exceed how long a decided commit may still reach Kafka ({reach.describe()}), so the timeout must be "
            f"well above {reach.total_ms + REACH_SLACK_MS} ms (at least twice that is sensible), or those settings lower.",
            field="transaction_timeout_ms",
            commit_reach_ms=reach.total_ms,
            transaction_timeout_ms=transaction_timeout_ms,
        )
    if commit_margin_ms <= reach.total_ms:
        raise e.Invalid(
            "commit_margin_below_commit_reach",
            f"commit_margin_ms={commit_margin_ms} must exceed how long a decided commit may still reach Kafka: "
            f"{reach.describe()}; otherwise a commit decided just inside the margin can land after the broker "
            f"aborted the transaction (I4). Use commit_margin_ms >= {reach.total_ms + REACH_SLACK_MS} (with "
            f"transaction_timeout_ms above it), or lower those settings.",
            field="commit_margin_ms",
            commit_margin_ms=commit_margin_ms,
            commit_reach_ms=reach.total_ms,
            transaction_timeout_ms=transaction_timeout_ms,
        )


def validate_timeouts(transaction_timeout_ms: int, commit_margin_ms: int, broker_max_ms: int) -> None:
    if transaction_timeout_ms > broker_max_ms:
        raise e.Invalid(
            "transaction_timeout_above_broker_max",
            f"transaction_timeout_ms={transaction_timeout_ms} exceeds the broker's "
            f"transaction.max.timeout.ms={broker_max_ms}; the producer would be refused at "
            "InitProducerId. Lower the sink's timeout or raise the broker maximum.",
            field="transaction_timeout_ms",
        )
    if commit_margin_ms < 0:
        raise e.Invalid(
            "commit_margin_negative",
            f"commit_margin_ms={commit_margin_ms} must not be negative: the timeout gate would then "
            "decide commits of transactions the broker has already aborted",
            field="commit_margin_ms",
        )
    if commit_margin_ms >= transaction_timeout_ms:
        raise e.Invalid(
            "commit_margin_too_large",
            f"commit_margin_ms={commit_margin_ms} must be below transaction_timeout_ms="
            f"{transaction_timeout_ms}, or no commit could ever pass the timeout gate",
            field="commit_margin_ms",
        )


def default_commit_margin_ms(transaction_timeout_ms: int, reach: CommitReach | None = None) -> int:
    """A tenth of the timeout, at least 5 s (but never the whole timeout); with the coordinator's
    commit reach, at least the reach plus REACH_SLACK_MS (validation refuses it if that leaves no
    time for a batch)."""
    margin = min(max(transaction_timeout_ms // 10, 5_000), transaction_timeout_ms // 2)
    if reach is not None:
        margin = max(margin, reach.total_ms + REACH_SLACK_MS)
    return margin


# --- generations and lineage -----------------------------------------------------------------


def check_generation(current: int, given: int) -> None:
    if given < current:
        raise e.Conflict(
            e.STALE_GENERATION,
            f"generation {given} was fenced by generation {current}: a newer driver of this "
            "query has registered, this one must stop",
            current_generation=current,
            given_generation=given,
        )
    if given > current:
        raise e.Conflict(
            e.UNKNOWN_GENERATION,
            f"generation {given} was never started for this sink (current is {current})",
            current_generation=current,
            given_generation=given,
        )


def check_lineage(bound_query_id: str | None, query_id: str) -> None:
    """A sink belongs to the query (checkpoint location) that first registered with it."""
    if bound_query_id is not None and bound_query_id != query_id:
        raise e.Conflict(
            e.LINEAGE_MISMATCH,
            f"this sink belongs to Spark query {bound_query_id}, but query {query_id} is "
            "registering: it was started from a fresh checkpoint location, so its batch ids "
            "restart at 0 and would collide with batches already committed. Restore the original "
            "checkpoint location, use a new sink, or have an operator reset the sink's lineage.",
            bound_query_id=bound_query_id,
            query_id=query_id,
        )


# --- begin checkpoint ------------------------------------------------------------------------


class BeginAction(StrEnum):
    SKIP = "skip"  # already committed (or lost and acknowledged): do not write
    RESUME = "resume"  # commit decided but unfinished: finish it, then do not write
    CONTINUE = "continue"  # an open attempt of this generation exists: same answer as before
    NEW_ATTEMPT = "new_attempt"  # write under a new attempt; older ones are aborted


def decide_begin(
    checkpoint_state: CheckpointState, latest: Attempt | None, generation: int
) -> BeginAction:
    if checkpoint_state in (CheckpointState.COMMITTED, CheckpointState.LOST):
        # LOST: reached only after an operator acknowledged the loss (the sink is halted until
        # then); rewriting the batch would duplicate the partitions whose commits succeeded
        return BeginAction.SKIP
    if checkpoint_state is CheckpointState.COMMITTING:
        return BeginAction.RESUME
    if latest is not None and latest.state is AttemptState.OPEN and latest.generation == generation:
        return BeginAction.CONTINUE
    return BeginAction.NEW_ATTEMPT


def check_offsets(bound_digest: str | None, given_digest: str | None, batch_id: int) -> None:
    """A batch is its offsets: a begin over other offsets than the ones bound at the first begin
    (a checkpoint location restored from an older backup re-plans committed batch ids over new
    offsets) is refused, never skipped as already committed. A begin without a digest (an older
    client) is not checked."""
    if bound_digest is None or given_digest is None or bound_digest == given_digest:
        return
    raise e.Conflict(
        e.OFFSETS_MISMATCH,
        f"batch {batch_id} was begun over other offsets (digest {bound_digest[:16]}...) than this begin "
        f"names ({given_digest[:16]}...): Spark re-planned a batch id it had already planned, typically "
        "because the checkpoint location was restored from an older backup. Skipping it would lose the "
        "new offsets' data and rewriting it would duplicate the old batch's. Restore the newest checkpoint "
        "location; or, to start the query over from this checkpoint, have an operator reset the sink's "
        "lineage (POST /v1/sinks/{sink}/lineage/reset) and start the query from a fresh checkpoint location.",
        batch_id=batch_id,
        bound_digest=bound_digest,
        given_digest=given_digest,
    )


# --- leases and pre-commits ------------------------------------------------------------------


def validate_quarantine(quarantine_ms: int, max_lease_age_ms: int, init_timeout_ms: int, request_timeout_ms: int) -> None:
    """No quick reuse: an id freed from an undecided try stays out of the pool until no try of it
    can still reach the broker. A try starts InitProducerId only on a lease younger than
    max_lease_age_ms, and init_transactions gives up after init_timeout_ms (a request already sent
    may still arrive up to a request timeout later), so the quarantine must exceed their sum."""
    reach_ms = max_lease_age_ms + init_timeout_ms + request_timeout_ms
    if quarantine_ms <= reach_ms:
        raise e.Invalid(
            "transactional_id_quarantine_too_short",
            f"transactional_id_quarantine_ms={quarantine_ms} must exceed lease_max_init_age_ms "
            f"({max_lease_age_ms}) + producer_init_timeout_ms ({init_timeout_ms}) + "
            f"producer_request_timeout_ms ({request_timeout_ms}) = {reach_ms}: a stalled task try could "
            "otherwise initialise its id after the id was leased again and fence the new lease's transaction",
            field="transactional_id_quarantine_ms",
        )


def is_first_try(stage_attempt: int, task_attempt: int) -> bool:
    """Only the first try of a partition (stage attempt 0, task attempt 0) uses the id pre-leased at
    begin; every other try leases its own, so no two tries ever share an id."""
    return stage_attempt == 0 and task_attempt == 0




def check_attempt_writable(attempt: Attempt, current_attempt: int, generation: int) -> None:
    """Leases and pre-commits are only for the current, open attempt of the caller's generation."""
    if attempt.generation != generation:
        raise e.Conflict(
            e.STALE_GENERATION if generation < attempt.generation else e.STALE_ATTEMPT,
            f"attempt {attempt.number} belongs to generation {attempt.generation}, not {generation}",
            attempt=attempt.number,
            attempt_generation=attempt.generation,
        )
    if attempt.number != current_attempt:
        raise e.Conflict(
            e.STALE_ATTEMPT,
            f"attempt {attempt.number} was superseded by attempt {current_attempt}",
            attempt=attempt.number,
            current_attempt=current_attempt,
        )
    if attempt.state is AttemptState.ABORTED:
        raise e.Conflict(
            e.ATTEMPT_ABORTED,
            f"attempt {attempt.number} was aborted ({attempt.abort_reason})",
            attempt=attempt.number,
            abort_reason=attempt.abort_reason,
        )
    if attempt.state is not AttemptState.OPEN:
        raise e.Conflict(
            e.COMMIT_DECIDED,
            f"attempt {attempt.number} is {attempt.state}: its commit was already decided",
            attempt=attempt.number,
        )


def check_partition(partition: int, max_partitions: int) -> None:
    if not 0 <= partition < max_partitions:
        raise e.Invalid(
            "partition_out_of_range",
            f"partition must be in [0, {max_partitions}) (COORDINATOR_MAX_PARTITIONS)",
            field="partition",
        )


def transaction_deadline(leased_at: datetime, transaction_timeout_ms: int) -> datetime:
    """The latest the broker can abort this lease's transaction. The lease exists before its
    producer, so the broker's clock for the transaction starts no earlier than this."""
    return leased_at + timedelta(milliseconds=transaction_timeout_ms)


def remaining_ms(lease: Lease, now: datetime) -> int:
    return int((lease.deadline_at - now) / timedelta(milliseconds=1))


def deadline_too_close(lease: Lease, now: datetime, margin_ms: int) -> bool:
    # compare exactly: rounding the remaining time to whole milliseconds could let a transaction
    # up to 1 ms past its deadline through a zero margin
    return lease.deadline_at - now < timedelta(milliseconds=margin_ms)


PrecommitRequest = PrecommitRecord  # the pre-commit route's name for it


def precommit_already_recorded(lease: Lease, request: PrecommitRecord) -> bool:
    """True if this is a retry of the pre-commit that was stored; a different one is refused."""
    if lease.state not in (LeaseState.PRECOMMITTED, LeaseState.COMMITTING, LeaseState.COMMITTED):
        return False
    stored = (lease.producer_id, lease.producer_epoch, lease.records, lease.bytes)
    given = request.identity()
    if stored != given:
        raise e.Conflict(
            e.PRECOMMIT_MISMATCH,
            f"lease {lease.id} was already pre-committed with different values",
            stored=dict(zip(("producer_id", "producer_epoch", "records", "bytes"), stored)),
        )
    return True


def check_precommit(lease: Lease, now: datetime, margin_ms: int) -> None:
    """A new pre-commit needs a live lease whose transaction can still pass the commit gate."""
    if lease.state is not LeaseState.LEASED:
        raise e.Conflict(e.STALE_LEASE, f"lease {lease.id} is {lease.state}", lease_state=str(lease.state))
    if deadline_too_close(lease, now, margin_ms):
        raise e.Conflict(
            e.DEADLINE_TOO_CLOSE,
            f"lease {lease.id}'s transaction has {remaining_ms(lease, now)} ms left before the "
            f"broker may abort it, below the safety margin of {margin_ms} ms; the task must fail "
            "so Spark retries it with a fresh transaction",
            remaining_ms=remaining_ms(lease, now),
            margin_ms=margin_ms,
        )


# --- commit ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class CommitPlan:
    winners: tuple[Lease, ...]
    losers: tuple[Lease, ...]  # undecided leases of the attempt that must end aborted (on Kafka)
    # winners whose pre-commit record came with the commit: stored with the decision
    records: tuple[tuple[Lease, PrecommitRecord], ...] = ()
    # first-try pre-leases of partitions that were empty: no producer ever used them, so they are
    # freed without touching Kafka
    unused: tuple[Lease, ...] = ()


def validate_partition_results(results: Sequence[PartitionResult], max_partitions: int) -> None:
    numbers = sorted(r.partition for r in results)
    if len(numbers) > max_partitions:
        raise e.Invalid("too_many_partitions", f"at most {max_partitions} partitions", field="partitions")
    if numbers != list(range(len(numbers))):
        raise e.Invalid(
            "partitions_incomplete",
            "partitions must list every partition 0..N-1 exactly once (lease_id null for an "
            "empty partition)",
            field="partitions",
        )


def plan_commit(
    attempt_leases: Iterable[Lease], results: Sequence[PartitionResult], max_partitions: int
) -> CommitPlan:
    """Choose winners from the driver's partition results; every other undecided lease loses."""
    validate_partition_results(results, max_partitions)
    by_id = {lease.id: lease for lease in attempt_leases}
    winners: list[Lease] = []
    records: list[tuple[Lease, PrecommitRecord]] = []
    for result in results:
        if result.lease_id is None:
            continue
        lease = by_id.get(result.lease_id)
        if lease is None:
            raise e.Conflict(
                e.STALE_LEASE,
                f"lease {result.lease_id} is not a lease of this attempt",
                lease_id=result.lease_id,
            )
        if lease.partition != result.partition:
            raise e.Conflict(
                e.LEASE_MISMATCH,
                f"lease {lease.id} was taken for partition {lease.partition}, not {result.partition}",
                lease_id=lease.id,
            )
        if result.precommit is not None and lease.state is LeaseState.LEASED:
            records.append((lease, result.precommit))
        elif lease.state is LeaseState.PRECOMMITTED:
            if result.precommit is not None:
                precommit_already_recorded(lease, result.precommit)  # the same transaction, or refused
        else:
            raise e.Conflict(
                e.WINNER_NOT_PRECOMMITTED,
                f"lease {lease.id} of partition {lease.partition} is {lease.state}, not PRECOMMITTED"
                + ("" if lease.state is not LeaseState.LEASED else " (and the commit carries no pre-commit record for it)"),
                lease_id=lease.id,
                lease_state=str(lease.state),
            )
        winners.append(lease)
    winner_ids = {w.id for w in winners}
    empty = {r.partition for r in results if r.lease_id is None}
    undecided = [x for x in by_id.values() if x.id not in winner_ids and x.state in UNDECIDED_LEASE_STATES]
    unused = tuple(x for x in undecided if x.first_try and x.state is LeaseState.LEASED and x.partition in empty)
    losers = tuple(x for x in undecided if x not in unused)
    return CommitPlan(winners=tuple(winners), losers=losers, records=tuple(records), unused=unused)


def check_commit_deadlines(winners: Iterable[Lease], now: datetime, margin_ms: int) -> None:
    """The timeout gate (I4): no commit is decided for a transaction the broker may abort soon."""
    limit = now + timedelta(milliseconds=margin_ms)  # deadline_too_close for each, the sum done once
    close = [w for w in winners if w.deadline_at < limit]
    if close:
        worst = min(close, key=lambda w: w.deadline_at)
        raise e.Conflict(
            e.DEADLINE_TOO_CLOSE,
            f"{len(close)} winning transaction(s) are within {margin_ms} ms of their broker "
            f"timeout (lease {worst.id} has {remaining_ms(worst, now)} ms left); the attempt is "
            "aborted and the batch must be replayed. Raise transaction.timeout.ms or shorten batches.",
            lease_ids=[w.id for w in close],
            margin_ms=margin_ms,
        )


def check_same_winners(requested: Sequence[PartitionResult], durable_winners: Iterable[Lease]) -> None:
    """A retried commit of a decided checkpoint must name the winners that were decided."""
    asked = {(r.partition, r.lease_id) for r in requested if r.lease_id is not None}
    decided = {(w.partition, w.id) for w in durable_winners}
    if asked != decided:
        raise e.Conflict(
            e.WINNER_MISMATCH,
            "this checkpoint's commit was already decided with other winners",
            decided=sorted([p, lid] for p, lid in decided),
        )


def batch_duration_warning(
    started_at: datetime, decided_at: datetime, restart_budget_ms: int, transaction_timeout_ms: int
) -> str | None:
    """Warn when the timeout is below the observed batch duration plus the restart budget: a
    crash after pre-commit could then lose the batch's transactions to the broker's timeout."""
    took_ms = int((decided_at - started_at) / timedelta(milliseconds=1))
    if took_ms + restart_budget_ms > transaction_timeout_ms:
        return (
            f"batch took {took_ms} ms; with a restart budget of {restart_budget_ms} ms this exceeds "
            f"transaction.timeout.ms={transaction_timeout_ms}; raise the timeout or shorten batches"
        )
    return None


def transaction_age_fraction(lease: Lease, now: datetime, transaction_timeout_ms: int) -> float:
    age = (now - lease.leased_at) / timedelta(milliseconds=1)
    return age / transaction_timeout_ms


def winner_expired(lease: Lease, now: datetime, margin_ms: int) -> bool:
    """A named winner that was aborted because its transaction could no longer pass the timeout
    gate (the recovery loop aborts such leases): the commit is refused as the gate would refuse it."""
    return lease.state in (LeaseState.ABORTING, LeaseState.ABORTED) and deadline_too_close(lease, now, margin_ms)


# --- lost data -------------------------------------------------------------------------------


# Kafka's answers to a resume-commit (EndTxn) that mean "this transaction is gone": it can never
# be committed any more (Kafka's TransactionCoordinator.endTransaction: another producer id on the
# id, a newer epoch after a fence or the broker's timeout abort, a completed abort, or a broker that
# forgot the producer; KafkaApis answers INVALID_PRODUCER_EPOCH for PRODUCER_FENCED to EndTxn < v2).
# Every other answer -- UNKNOWN_SERVER_ERROR, authorization failures after an ACL change, codes we
# do not know, timeouts, an unreachable broker -- may pass: the commit stays decided and is retried.
TRANSACTION_GONE_CODES = frozenset({
    "producer_fenced",
    "invalid_producer_epoch",
    "invalid_producer_id_mapping",
    "invalid_txn_state",
    "unknown_producer_id",
})


def commit_refusal_is_final(code: str) -> bool:
    """True only for a refusal after which the transaction can never commit (TRANSACTION_GONE_CODES)."""
    return code in TRANSACTION_GONE_CODES


@dataclass(frozen=True)
class RefusedCommit:
    """A decided winner whose commit Kafka refused for good."""

    lease: Lease
    code: str
    message: str
    # True: a read_committed read at the transaction's first offsets showed its records dropped.
    # False: the log could not tell (no first offsets recorded): the loss is not established.
    confirmed: bool = False


def lost_reason(batch_id: int, refused: Sequence[RefusedCommit]) -> str:
    parts = "; ".join(
        f"partition {r.lease.partition} ({r.lease.transactional_id}, producer {r.lease.producer_id} epoch "
        f"{r.lease.producer_epoch}, {r.lease.records} records): {r.code}, "
        + ("loss confirmed in the partition log" if r.confirmed else "NOT verified in the partition log")
        for r in sorted(refused, key=lambda r: r.lease.partition)
    )
    return f"batch {batch_id}: Kafka refused the decided commit for good: {parts}"[:2000]


def check_not_halted(sink: Sink) -> None:
    """A sink that lost data refuses new batches until an operator acknowledges the loss."""
    if sink.halted_at is None:
        return
    raise e.Conflict(
        e.SINK_HALTED_LOST_DATA,
        f"sink {sink.name!r} is halted since {sink.halted_at.isoformat()} because data was lost: "
        f"{sink.halted_reason}. Those records were written and pre-committed but Kafka refused "
        "their commit (typically the transaction outlived transaction.timeout.ms, or its producer "
        "was fenced). Find the batch in the sink's events (kind data_lost). Re-deliver records "
        "only of partitions whose loss is confirmed in the partition log; where it says NOT "
        "verified, read the partition with a read_committed consumer first (re-delivering "
        "records that did commit duplicates them). Then acknowledge with "
        f"POST /v1/sinks/{sink.name}/lost-data/acknowledge (admin token, body {{\"reason\": ...}}); "
        "new batches are accepted again after that.",
        halted_reason=sink.halted_reason,
        halted_at=sink.halted_at.isoformat(),
        acknowledge=f"/v1/sinks/{sink.name}/lost-data/acknowledge",
    )


def data_lost(cp: Checkpoint) -> e.Conflict:
    """The answer to commit and resume of a LOST checkpoint (every retry answers the same)."""
    return e.Conflict(
        e.DATA_LOST,
        f"the commit of batch {cp.batch_id} was decided but Kafka refused it for good: "
        f"{cp.lost_reason}. The sink is halted until an operator acknowledges the loss.",
        batch_id=cp.batch_id,
        lost_reason=cp.lost_reason,
    )


def retirement_blockers(open_attempts: int, committing_checkpoints: int, unresolved_leases: int) -> list[str]:
    """Why a sink cannot be retired yet (empty: it can). Nothing of it may still be open: an
    undecided attempt (a driver may be writing), a decided commit not finished on Kafka, or a lease
    whose id may hold a transaction (one left open would freeze read_committed consumers, and no
    recovery loop would look at a retired sink again)."""
    blockers = []
    if open_attempts:
        blockers.append(f"{open_attempts} undecided attempt(s): stop the query, or abort them "
                        "(`coordinator abort SINK BATCH ATTEMPT`)")
    if committing_checkpoints:
        blockers.append(f"{committing_checkpoints} decided commit(s) not finished on Kafka: let the recovery loop "
                        "finish them (`coordinator commit SINK BATCH`)")
    if unresolved_leases:
        blockers.append(f"{unresolved_leases} transactional id(s) that may hold a transaction: wait for their "
                        "aborts (`coordinator transactions SINK`)")
    return blockers
