"""A pass of the wire control plane: the EndTxn (or InitProducerId) calls over a batch's
transactions as one coroutine on the connection's IO thread, in rounds.

Calling `commit` once per transaction from the service's threads cost each EndTxn a thread
hand-off to kafka-python's IO thread and back (an Event per call, a wake-up of the IO loop, 16
threads contending for the GIL): ~0.8-1.0 ms of the coordinator's CPU per EndTxn on a real broker,
where one coroutine for the pass takes ~0.45-0.55 ms (bench/end_txn_bench.py). A pass is:

- a round: every transaction still to do tried once, at most `parallelism` at once (each try holds
  one of the connection's request slots, as a single call does), on the IO thread; its result per
  transaction is the try's failure or None;
- between rounds, in the calling thread, what a single call does between its tries
  (`errors.classify_failure`): a refusal ends that transaction's call, a transient failure is tried
  again after the backoff (the coordinator looked up again, or the connection started afresh, as
  the failure says), all within the retry budget of the pass;
- the pass's rule (`Reach`): once a try got no answer while no try of the pass got one, the round
  starts no other try. A transaction never tried by the end of the budget is NOT_TRIED; the others
  end with their last failure, retriable, as a single call gives up.
"""

from __future__ import annotations

import logging
import time
from collections import deque
import threading
from collections.abc import Awaitable, Callable, Sequence
from typing import Protocol

from ..control_plane import NO_ANSWER_CODES, NOT_TRIED, CallOutcome, ControlPlaneError, KafkaTarget
from .connection import _BrokerClient
from .errors import classify_failure

log = logging.getLogger(__name__)

# one try of the i-th transaction of the pass, on the IO thread: raises what a try of a single call raises
Attempt = Callable[[_BrokerClient, int, int], Awaitable[None]]


class _Plane(Protocol):
    """What a pass uses of the wire control plane (control_plane.py)."""

    request_timeout_ms: int
    retry_budget_ms: int
    _closing: threading.Event

    def _client(self, bootstrap_servers: str) -> _BrokerClient: ...

    def _before_next_try(self, client: _BrokerClient | None, action: str | None, keys: Sequence[str]) -> None: ...

    def _backoff(self, tries: int) -> float: ...


def run_pass(plane: _Plane, target: KafkaTarget, keys: Sequence[str], what: str, attempt: Attempt,
             parallelism: int) -> list[CallOutcome]:
    """Each transaction's outcome, in the order of `keys` (their transactional ids)."""
    n = len(keys)
    started = time.monotonic()
    deadline = started + plane.retry_budget_ms / 1000
    first_try: list[float | None] = [None] * n
    outcomes: list[CallOutcome | None] = [None] * n
    tries = [0] * n
    last: dict[int, tuple[str, str]] = {}
    todo = list(range(n))
    reached = False
    rounds = 0
    while todo:
        rounds += 1
        timeout_ms = max(100, min(plane.request_timeout_ms, int((deadline - time.monotonic()) * 1000)))
        client: _BrokerClient | None = None
        try:
            client = plane._client(target.bootstrap_servers)
            client.ensure_bootstrapped(timeout_ms)
            now = time.monotonic()
            failures, reached = client.run(_round, client, todo, attempt, parallelism, timeout_ms, reached)
            for i in failures:
                first_try[i] = first_try[i] or now
        except ControlPlaneError as exc:  # the plane is closed: nothing of it can be tried
            for i in todo:
                outcomes[i] = CallOutcome(exc, _since(first_try[i]))
            return _all(outcomes)
        except Exception as exc:  # noqa: BLE001 - a failure of the whole round (bootstrap, the IO loop)
            # counted as a try of as many transactions as the round would have started
            now = time.monotonic()
            failures = {i: exc for i in todo[:parallelism]}
            for i in failures:
                first_try[i] = first_try[i] or now
        retry: list[int] = []
        actions: dict[str | None, list[str]] = {}
        for i in todo:
            if i not in failures:
                retry.append(i)  # not started in this round: the broker answered none of its tries
                continue
            tries[i] += 1
            failure = failures[i]
            if failure is None:
                outcomes[i] = CallOutcome(None, _since(first_try[i]))
                continue
            try:
                code, detail, action = classify_failure(failure, what, keys[i])
            except ControlPlaneError as refused:  # ends this transaction's call
                outcomes[i] = CallOutcome(refused, _since(first_try[i]))
                continue
            last[i] = (code, detail)
            actions.setdefault(action, []).append(keys[i])
            retry.append(i)
        for action, of in actions.items():
            plane._before_next_try(client, action, of)
        if not retry:
            break
        backoff = plane._backoff(rounds)
        if time.monotonic() + backoff >= deadline:
            _give_up(outcomes, retry, keys, tries, last, first_try, what, target, time.monotonic() - started)
            break
        example = next((last[i][1] for i in retry if i in last), "the broker answered none of the pass's tries")
        log.warning("%s of %d transaction(s): retrying in %.2f s after %s", what, len(retry), backoff, example)
        if plane._closing.wait(backoff):
            closed = ControlPlaneError(f"{what}: the Kafka control plane is closed (last: {example})",
                                       retriable=True, code="closed")
            for i in retry:
                outcomes[i] = CallOutcome(closed, _since(first_try[i]))
            break
        todo = retry
    again = sum(1 for i in range(n) if tries[i] > 1 and (x := outcomes[i]) is not None and x.error is None)
    if again:
        log.info("%s of %d transaction(s) succeeded after more than one try", what, again)
    return _all(outcomes)


async def _round(client: _BrokerClient, todo: list[int], attempt: Attempt, parallelism: int, timeout_ms: int,
                 reached: bool) -> tuple[dict[int, Exception | None], bool]:
    """On the IO thread: each of `todo` tried once, at most `parallelism` at once, until the broker
    has answered none of the pass's tries and one went unanswered. Answers each started try's
    failure (None: it succeeded) and whether the broker has answered any try of the pass."""
    queue = deque(todo)
    failures: dict[int, Exception | None] = {}
    state = {"reached": reached, "stopped": False}

    async def worker() -> None:
        while queue and not state["stopped"]:
            i = queue.popleft()
            try:
                await client.take_slot(timeout_ms)
                try:
                    await attempt(client, i, timeout_ms)
                finally:
                    client.slots.release()
            except Exception as exc:  # noqa: BLE001 - the calling thread classifies it
                failures[i] = exc
                if not _unanswered(exc):
                    state["reached"] = True
                elif not state["reached"]:
                    state["stopped"] = True
            else:
                failures[i] = None
                state["reached"] = True

    await client.all_of([worker] * min(parallelism, len(todo)))
    return failures, state["reached"]


def _unanswered(exc: Exception) -> bool:
    """Whether a failed try got no answer from the broker (unreachable, timed out)."""
    try:
        code, _, _ = classify_failure(exc, "", "")
    except ControlPlaneError as refused:
        return refused.unanswered
    except Exception:  # noqa: BLE001 - not a failure a try is expected to have: not the broker's silence
        return False
    return code in NO_ANSWER_CODES


def _give_up(outcomes: list[CallOutcome | None], retry: list[int], keys: Sequence[str], tries: list[int],
             last: dict[int, tuple[str, str]], first_try: list[float | None], what: str, target: KafkaTarget,
             elapsed: float) -> None:
    silent = next((last[i][0] for i in retry if i in last and last[i][0] in NO_ANSWER_CODES), "broker_unreachable")
    for i in retry:
        if i not in last:  # never tried: the broker answered none of the pass's tries
            outcomes[i] = CallOutcome(ControlPlaneError(
                f"not tried in this pass: the broker answered none of its calls ({silent})",
                retriable=True, code=NOT_TRIED))
            continue
        code, detail = last[i]
        outcomes[i] = CallOutcome(ControlPlaneError(
            f"{what} of {keys[i]!r} on {target.bootstrap_servers} did not succeed within {elapsed:.1f} s "
            f"({tries[i]} tries); last: {detail}", retriable=True, code=code), _since(first_try[i]))


def _since(started: float | None) -> float:
    return 0.0 if started is None else time.monotonic() - started


def _all(outcomes: list[CallOutcome | None]) -> list[CallOutcome]:
    assert all(x is not None for x in outcomes)
    return outcomes  # type: ignore[return-value]
