"""The checks and decisions of the protocol (DESIGN.md §3), as pure functions over plain records.

Nothing here reads a clock, a database or a network: callers pass `now` and the rows they read,
and act on the returned decision inside their own transaction. Every function either returns a
decision or raises a ProtocolError whose reason the client can branch on.

The rules are kept in protocol order (generations, begin, the id pool and leases, commit, lost
data), so that they read as one specification; what a sink's configuration must satisfy is in
configuration.py, what the recovery loop decides in recovery_rules.py, and the states they move
in states.py.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence, Set
from dataclasses import dataclass
from datetime import datetime, timedelta
from enum import StrEnum

from . import errors as e
from .model import Attempt, Checkpoint, IdPool, Lease, PartitionResult, PrecommitRecord, Sink
from .states import AttemptState, CheckpointState, LeaseState

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


def check_offsets(bound_digest: str | None, given_digest: str | None, batch_id: int, *, replay: bool) -> bool:
    """A batch is its offsets: a begin over other offsets than the ones bound at the first begin
    (a checkpoint location restored from an older backup re-plans committed batch ids over new
    offsets) is refused, never skipped as already committed. Returns whether the begin was checked:
    a replay (the batch was begun before) where either side has no digest cannot be, and is said
    loudly (the writer sends none only when its user chose so)."""
    if bound_digest is not None and given_digest is not None and bound_digest != given_digest:
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
    return not replay or (bound_digest is not None and given_digest is not None)


# --- the id pool and leases ------------------------------------------------------------------


@dataclass(frozen=True)
class PoolPick:
    """The ids a grant takes, and the pool after it."""

    ordinals: tuple[int, ...]
    pool: IdPool


def pick_ids(pool: IdPool, busy: Set[int], count: int, max_size: int) -> PoolPick:
    """`count` free ids of the pool, round-robin from its cursor (the least recently leased first),
    growing the pool up to `max_size` when too few are free. `busy`: the ordinals held by an
    unresolved lease or in quarantine (I3, no quick reuse)."""
    cursor = pool.cursor if pool.cursor < pool.size else 0
    rotation = [*range(cursor, pool.size), *range(0, cursor)]
    taken = [n for n in rotation if n not in busy][:count]
    size = pool.size
    while len(taken) < count and size < max_size:
        if size not in busy:
            taken.append(size)
        size += 1
    if len(taken) < count:
        raise e.Unavailable(
            e.POOL_EXHAUSTED,
            f"the sink's transactional id pool is exhausted: {count} id(s) asked, {len(taken)} free of at most "
            f"{max_size} (max_pool_size); ids come back when their transactions are resolved (and, after an abort, "
            "their quarantine ends): retry later, or raise max_pool_size",
            asked=count, free=len(taken), max_pool_size=max_size,
        )
    after = taken[-1] + 1 if taken else cursor
    return PoolPick(tuple(taken), IdPool(pool.sink_id, size, after if after < size else 0))


class LeaseAction(StrEnum):
    AGAIN = "again"  # this try asked before: the same lease
    CLAIM = "claim"  # the partition's pre-lease, which no try holds yet: this try takes it
    GRANT = "grant"  # a fresh id from the pool


def decide_lease(own: Lease | None, pre_lease: Lease | None) -> LeaseAction:
    """A task try's lease for its partition. A pre-lease is single-use: the first try to ask
    claims it with its task attempt id, and every other try (a retry, a speculative copy, a try of
    a resubmitted stage, which PySpark's TaskContext cannot tell from a first try) gets its own id,
    so no two tries ever share one."""
    if own is not None:
        if own.state is not LeaseState.LEASED:
            raise e.Conflict(e.STALE_LEASE, f"lease {own.id} of this try is {own.state}", lease_id=own.id,
                             lease_state=str(own.state))
        return LeaseAction.AGAIN
    if pre_lease is not None and pre_lease.state is LeaseState.PRELEASED:
        return LeaseAction.CLAIM
    return LeaseAction.GRANT


def check_attempt_writable(attempt: Attempt, current_attempt: int, generation: int) -> None:
    """Leases and commits are only for the current, open attempt of the caller's generation."""
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
    """The latest the broker can abort this lease's transaction. A try gets its lease before its
    producer exists, so the broker's clock for the transaction starts no earlier than this."""
    return leased_at + timedelta(milliseconds=transaction_timeout_ms)


def remaining_ms(lease: Lease, now: datetime) -> int:
    return int((lease.deadline_at - now) / timedelta(milliseconds=1))


def deadline_too_close(lease: Lease, now: datetime, margin_ms: int) -> bool:
    # compare exactly: rounding the remaining time to whole milliseconds could let a transaction
    # up to 1 ms past its deadline through a zero margin
    return lease.deadline_at - now < timedelta(milliseconds=margin_ms)


def same_record(lease: Lease, record: PrecommitRecord) -> bool:
    """Whether a decided winner's stored record is this one (a retried commit names it again)."""
    return (lease.producer_id, lease.producer_epoch, lease.records, lease.bytes) == (
        record.producer_id, record.producer_epoch, record.records, record.bytes)


# --- commit ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class CommitPlan:
    # each partition's winner with the pre-commit record its try reported (stored with the decision)
    winners: tuple[tuple[Lease, PrecommitRecord], ...]
    losers: tuple[Lease, ...]  # leases tries held that did not win: their transactions end aborted on Kafka
    # pre-leases no try claimed: no producer ever used them, so they are freed without touching Kafka
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


def plan_commit(attempt_leases: Iterable[Lease], results: Sequence[PartitionResult], max_partitions: int, *,
                now: datetime, margin_ms: int) -> CommitPlan:
    """Choose winners from the driver's partition results (every other undecided lease loses),
    and pass them through the timeout gate (I4)."""
    validate_partition_results(results, max_partitions)
    by_id = {lease.id: lease for lease in attempt_leases}
    winners: list[tuple[Lease, PrecommitRecord]] = []
    for result in results:
        if result.lease_id is None:
            continue
        lease = by_id.get(result.lease_id)
        if lease is None:
            raise e.Conflict(e.STALE_LEASE, f"lease {result.lease_id} is not a lease of this attempt",
                             lease_id=result.lease_id)
        if lease.partition != result.partition:
            raise e.Conflict(e.LEASE_MISMATCH,
                             f"lease {lease.id} was taken for partition {lease.partition}, not {result.partition}",
                             lease_id=lease.id)
        if winner_expired(lease, now, margin_ms):  # the recovery loop aborted it: the gate refuses it as well
            check_commit_deadlines([lease], now, margin_ms)
        if result.precommit is None or lease.state not in (LeaseState.LEASED, LeaseState.PRELEASED):
            raise e.Conflict(
                e.WINNER_NOT_PRECOMMITTED,
                f"lease {lease.id} of partition {lease.partition} is {lease.state}"
                + (", and the commit carries no pre-commit record for it" if result.precommit is None else ""),
                lease_id=lease.id,
                lease_state=str(lease.state),
            )
        if result.precommit.task_attempt_id != lease.task_attempt_id:  # a pre-lease no try claimed too
            raise e.Conflict(
                e.LEASE_NOT_CLAIMED,
                f"the record for lease {lease.id} of partition {lease.partition} comes from task try "
                f"{result.precommit.task_attempt_id}, but the lease is held by try {lease.task_attempt_id}: a try "
                "writes only on the lease it was given",
                lease_id=lease.id, holder=lease.task_attempt_id, reported_by=result.precommit.task_attempt_id,
            )
        winners.append((lease, result.precommit))
    check_commit_deadlines([w for w, _ in winners], now, margin_ms)
    winner_ids = {w.id for w, _ in winners}
    others = [x for x in by_id.values() if x.id not in winner_ids]
    return CommitPlan(
        winners=tuple(winners),
        losers=tuple(x for x in others if x.state is LeaseState.LEASED),
        unused=tuple(x for x in others if x.state is LeaseState.PRELEASED),
    )


def check_commit_deadlines(winners: Iterable[Lease], now: datetime, margin_ms: int) -> None:
    """The timeout gate (I4): no commit is decided for a transaction the broker may abort soon."""
    limit = now + timedelta(milliseconds=margin_ms)
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
    """A retried commit of a decided checkpoint must name the winners, and records, that were decided."""
    decided = {w.id: w for w in durable_winners}
    asked = {(r.partition, r.lease_id) for r in requested if r.lease_id is not None}
    if asked != {(w.partition, w.id) for w in decided.values()} or any(
            r.precommit is not None and not same_record(decided[r.lease_id], r.precommit)
            for r in requested if r.lease_id is not None):
        raise e.Conflict(
            e.WINNER_MISMATCH,
            "this checkpoint's commit was already decided with other winners",
            decided=sorted([w.partition, w.id] for w in decided.values()),
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
