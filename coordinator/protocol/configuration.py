"""What a sink's configuration must satisfy, as pure functions: names, transactional id
prefixes and the ids made from them, and the time bounds that keep I4 and "no quick reuse" (the
commit reach, the commit margin, the quarantine). Registration and the service's start-up check
them; nothing here reads a clock, a database or a network."""

from __future__ import annotations

import re
from dataclasses import dataclass

from . import errors as e

# Kafka accepts any string as transactional.id; we keep to the characters Kafka allows in topic
# names so ids are safe in logs, ACL patterns and shell commands.
_PREFIX_RE = re.compile(r"^[A-Za-z0-9._-]+$")
MAX_PREFIX_LENGTH = 200
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
MAX_NAME_LENGTH = 100
MAX_ORDINAL = 2**31 - 1  # a pool ordinal is a Postgres integer


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
    coordinator's settings. The timeout gate keeps I4 only if every sink's commit margin exceeds
    `total_ms` (DESIGN.md §3 Revisions, "Defaults that keep I4").

    Every finisher of a decision retries its EndTxn only until `retry_window_ms` after the
    decision, counted from the decision (not from when a finisher started):
    - the deciding call tries at once, for up to its retry budget;
    - the recovery loop leaves a decision younger than `recovery_grace_ms` to that call (by then
      the call's last request has landed), then finishes it on its next pass; if the replica that
      decided died and it also led the loop, another replica leads within the leader TTL plus an
      interval, and passes come every interval;
    - each finisher's last request lands within a request timeout of its last try.
    So the latest an EndTxn of a decided commit lands is the window plus a request timeout. The
    loop runs each sink's decided commits in their own worker, so no other sink's Kafka calls
    delay them (service/recovery.py)."""

    request_timeout_ms: int
    retry_budget_ms: int
    leader_ttl_ms: int
    recovery_interval_ms: int

    @property
    def recovery_grace_ms(self) -> int:
        """The recovery loop leaves a decision this young to the call that decided it."""
        return self.retry_budget_ms + self.request_timeout_ms

    @property
    def retry_window_ms(self) -> int:
        """Every finisher stops retrying a decided commit's EndTxn this long after the decision:
        long enough for a failed-over loop's pass (TTL + interval) and the pass's own interval to
        leave a whole retry budget, and never before the loop's first look at an orphaned decision
        (its grace plus an interval), which then makes one try."""
        return self.retry_budget_ms + self.recovery_interval_ms + max(
            self.leader_ttl_ms + self.recovery_interval_ms, self.request_timeout_ms)

    @property
    def total_ms(self) -> int:
        return self.retry_window_ms + self.request_timeout_ms

    def describe(self) -> str:
        return (f"commit retry budget {self.retry_budget_ms} + recovery interval {self.recovery_interval_ms} + the "
                f"later of a leader failover (TTL {self.leader_ttl_ms} + interval) and a Kafka request timeout "
                f"({self.request_timeout_ms}), then a request timeout = {self.total_ms} ms")


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



def validate_quarantine(quarantine_ms: int, max_lease_age_ms: int, init_timeout_ms: int, request_timeout_ms: int,
                        abort_reach_ms: int = 0) -> None:
    """No quick reuse: an id freed from a try that did not win stays out of the pool until no try
    of it can still reach the broker. A try starts InitProducerId only on a lease younger than
    max_lease_age_ms, and init_transactions gives up after init_timeout_ms (a request already sent
    may still arrive up to a request timeout later), so the quarantine must exceed their sum. It
    must also exceed `abort_reach_ms`, how late the coordinator's own abort of the id may land
    (two finishers may abort the same lease; the later abort must not fence the id's next lease)."""
    reach_ms = max(max_lease_age_ms + init_timeout_ms + request_timeout_ms, abort_reach_ms)
    if quarantine_ms <= reach_ms:
        raise e.Invalid(
            "transactional_id_quarantine_too_short",
            f"transactional_id_quarantine_ms={quarantine_ms} must exceed lease_max_init_age_ms "
            f"({max_lease_age_ms}) + producer_init_timeout_ms ({init_timeout_ms}) + "
            f"producer_request_timeout_ms ({request_timeout_ms}) = {max_lease_age_ms + init_timeout_ms + request_timeout_ms}"
            f" and the coordinator's abort reach ({abort_reach_ms}): a stalled try could otherwise initialise its id "
            "after the id was leased again and fence the new lease's transaction",
            field="transactional_id_quarantine_ms",
        )


def ordinal_of(prefix: str, transactional_id: str) -> int | None:
    """The pool ordinal a transactional id of this sink names, or None if it is no id of its pool."""
    stem = transactional_id_stem(prefix)
    rest = transactional_id[len(stem):] if transactional_id.startswith(stem) else ""
    if not (rest.isascii() and rest.isdigit()) or rest != str(int(rest)) or int(rest) > MAX_ORDINAL:
        return None
    return int(rest)
