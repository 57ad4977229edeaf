"""A sink's health as the dashboard shows it, decided from plain records (no I/O, unit tested in
tests/http/test_dashboard_health.py).

One verdict per sink, the worst of its findings:
- lost      (critical) the sink is halted: a decided commit was refused by Kafka for good and an
                       operator must acknowledge it (`Sink.halted`);
- stuck     (critical) a partition's last stable offset stopped below its high watermark: an open
                       transaction freezes every read_committed consumer of it (coordinator/kafka/broker.py);
- near_timeout (warn)  a pre-committed or decided transaction is past 80 % of its transaction
                       timeout (recovery_rules.near_timeout, the rule the recovery loop warns with);
- lingering (warn)     open transactions under the sink's prefix that no unresolved lease explains
                       (recovery_rules.lingering, decided by the caller);
- slow      (warn)     a decided commit is still not finished after `slow_commit_ms`, or the last
                       decided batch took more than `slow_batch_fraction` of the transaction timeout
                       from its attempt's start to its decision.
No finding: "committing normally".
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from enum import IntEnum

from ...protocol import recovery_rules, rules
from ...protocol.model import Attempt, Checkpoint, Lease, Sink
from ...protocol.states import CheckpointState


class Level(IntEnum):
    OK = 0
    WARN = 1
    CRITICAL = 2

    @property
    def css(self) -> str:
        return self.name.lower()


@dataclass(frozen=True)
class Thresholds:
    near_timeout_fraction: float = recovery_rules.WARN_FRACTION
    slow_commit_ms: int = 30_000  # a decided commit unfinished for longer is slow (Kafka failing?)
    slow_batch_fraction: float = 0.5  # attempt start -> decision, as a fraction of the timeout


@dataclass(frozen=True)
class Finding:
    kind: str  # lost | stuck | near_timeout | lingering | slow
    level: Level
    message: str


@dataclass(frozen=True)
class Health:
    level: Level
    label: str
    findings: tuple[Finding, ...]

    @property
    def kinds(self) -> set[str]:
        return {f.kind for f in self.findings}


LABELS = {
    "lost": "lost data awaiting acknowledgement",
    "stuck": "stuck consumers",
    "near_timeout": "transactions near timeout",
    "lingering": "lingering transactions",
    "slow": "slow",
}
ORDER = ["lost", "stuck", "near_timeout", "lingering", "slow"]
NEAR_TIMEOUT_NAMED = 3  # transactions named one by one; the others counted (a wide batch has thousands)


def ms_between(start: datetime, end: datetime) -> int:
    return int((end - start) / timedelta(milliseconds=1))


def sink_health(
    sink: Sink,
    recent: Sequence[tuple[Checkpoint, Sequence[Attempt]]],
    unresolved: Iterable[Lease],
    now: datetime,
    *,
    stuck_partitions: int = 0,
    lingering: int = 0,
    thresholds: Thresholds = Thresholds(),
) -> Health:
    """`recent`: the sink's newest checkpoints (newest first) with their attempts; `unresolved`:
    the leases whose ids may hold a transaction; the broker findings counted by the caller."""
    found: list[Finding] = []
    if sink.halted:
        found.append(Finding("lost", Level.CRITICAL, f"sink halted since {sink.halted_at:%Y-%m-%d %H:%M:%S}Z: "
                                                     f"{sink.halted_reason}"))
    if stuck_partitions:
        found.append(Finding("stuck", Level.CRITICAL, f"{stuck_partitions} partition(s) with a stuck last stable "
                                                      "offset: read_committed consumers are frozen"))
    near = sorted(((rules.transaction_age_fraction(x, now, sink.transaction_timeout_ms), x) for x in
                   recovery_rules.near_timeout(unresolved, now, sink.transaction_timeout_ms,
                                               thresholds.near_timeout_fraction)), key=lambda t: -t[0])
    for fraction, x in near[:NEAR_TIMEOUT_NAMED]:
        where = "past" if fraction >= 1 else "at"
        found.append(Finding("near_timeout", Level.WARN, f"{x.transactional_id} ({x.state}, lease {x.id}) is {where} "
                                                         f"{fraction * 100:.0f}% of its {sink.transaction_timeout_ms} ms "
                                                         "timeout"))
    if len(near) > NEAR_TIMEOUT_NAMED:
        found.append(Finding("near_timeout", Level.WARN, f"and {len(near) - NEAR_TIMEOUT_NAMED} more transaction(s) "
                                                         f"past {thresholds.near_timeout_fraction:.0%} of the timeout"))
    if lingering:
        found.append(Finding("lingering", Level.WARN, f"{lingering} open transaction(s) under the prefix that no "
                                                      "lease explains"))
    for cp, _ in recent:
        if cp.state is CheckpointState.COMMITTING and cp.decided_at is not None:
            waited = ms_between(cp.decided_at, now)
            if waited > thresholds.slow_commit_ms:
                found.append(Finding("slow", Level.WARN, f"batch {cp.batch_id} was decided {waited // 1000} s ago "
                                                         "and is not committed on Kafka yet"))
    last = last_decided_attempt(recent)
    if last is not None and last.decided_at is not None:
        took = ms_between(last.started_at, last.decided_at)
        if took > thresholds.slow_batch_fraction * sink.transaction_timeout_ms:
            found.append(Finding("slow", Level.WARN, f"the last batch took {took} ms from begin to commit decision, "
                                                     f"over {thresholds.slow_batch_fraction:.0%} of the "
                                                     f"{sink.transaction_timeout_ms} ms transaction timeout"))
    if not found:
        label = "committing normally" if recent else "no batch yet"
        return Health(Level.OK, label, ())
    found.sort(key=lambda f: (-f.level, ORDER.index(f.kind)))
    return Health(found[0].level, LABELS[found[0].kind], tuple(found))


def last_decided_attempt(recent: Sequence[tuple[Checkpoint, Sequence[Attempt]]]) -> Attempt | None:
    for cp, attempts in recent:  # newest first
        if cp.committed_attempt is not None:
            for a in attempts:
                if a.number == cp.committed_attempt:
                    return a
    return None


@dataclass(frozen=True)
class TimeoutBar:
    """One open transaction's age against its timeout (the per-sink page's bars)."""

    lease: Lease
    age_ms: int
    timeout_ms: int
    percent: float  # may exceed 100: the broker has aborted it (or will at once)
    level: Level

    @property
    def width(self) -> float:
        return min(self.percent, 100.0)


def timeout_bars(unresolved: Iterable[Lease], now: datetime, transaction_timeout_ms: int,
                 near_fraction: float = recovery_rules.WARN_FRACTION) -> list[TimeoutBar]:
    bars = []
    for x in unresolved:
        fraction = rules.transaction_age_fraction(x, now, transaction_timeout_ms)
        level = Level.CRITICAL if fraction >= 1 else Level.WARN if fraction >= near_fraction else Level.OK
        bars.append(TimeoutBar(x, ms_between(x.leased_at, now), transaction_timeout_ms, round(fraction * 100, 1), level))
    return sorted(bars, key=lambda b: -b.percent)
