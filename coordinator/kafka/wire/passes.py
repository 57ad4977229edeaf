"""A pass of the wire control plane: the EndTxn (or InitProducerId) calls over a batch's
transactions as one coroutine on the connection's IO thread, in rounds.

Calling `commit` once per transaction from the service's threads cost each EndTxn a thread
hand-off to kafka-python's IO thread and back (an Event per call, a wake-up of the IO loop, 16
threads contending for the GIL): about twice the coordinator's CPU per EndTxn of one coroutine for
the whole pass (bench/end_txn_bench.py measures both on a real broker). A pass is:

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
import threading
import time
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from typing import Protocol

from ..control_plane import NOT_TRIED, CallOutcome, ControlPlaneError, KafkaTarget, Reach
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
             parallelism: int, budget_ms: int | None = None) -> list[CallOutcome]:
    """Each transaction's outcome, in the order of `keys` (their transactional ids); transient
    failures retried for `budget_ms` (None: the plane's retry budget)."""
    n = len(keys)
    started = time.monotonic()
    deadline = started + (plane.retry_budget_ms if budget_ms is None else budget_ms) / 1000
    first_try: list[float | None] = [None] * n
    outcomes: list[CallOutcome | None] = [None] * n
    tries = [0] * n
    last: dict[int, tuple[str, str]] = {}
    todo = list(range(n))
    reach = Reach()
    silenced: ControlPlaneError | None = None  # what a try the round stopped before gets (NOT_TRIED)
    rounds = 0
    while todo:
        rounds += 1
        timeout_ms = max(100, min(plane.request_timeout_ms, int((deadline - time.monotonic()) * 1000)))
        client: _BrokerClient | None = None
        try:
            client = plane._client(target.bootstrap_servers)
            client.ensure_bootstrapped(timeout_ms)
            now = time.monotonic()
            failures, stopped = client.run(_round, client, todo, attempt, parallelism, timeout_ms, reach)
            silenced = silenced or stopped
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
            error = _as_error(exc)
            silenced = silenced or (reach.give_up(reach.note(error)) if error is not None else None)
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
            elapsed = time.monotonic() - started
            for i in retry:
                if i not in last:  # never tried: the broker answered none of the pass's tries
                    outcomes[i] = CallOutcome(silenced or _not_tried())
                    continue
                code, detail = last[i]
                outcomes[i] = CallOutcome(ControlPlaneError(
                    f"{what} of {keys[i]!r} on {target.bootstrap_servers} did not succeed within {elapsed:.1f} s "
                    f"({tries[i]} tries); last: {detail}", retriable=True, code=code), _since(first_try[i]))
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
                 reach: Reach) -> tuple[dict[int, Exception | None], ControlPlaneError | None]:
    """On the IO thread: each of `todo` tried once, at most `parallelism` at once, until the pass's
    rule (`reach`) says to start no other. Answers each started try's failure (None: it succeeded),
    and what the tries not started get if it said so."""
    queue = deque(todo)
    failures: dict[int, Exception | None] = {}
    stopped: list[ControlPlaneError] = []

    async def worker() -> None:
        while queue and not stopped:
            i = queue.popleft()
            try:
                await client.take_slot(timeout_ms)
                try:
                    await attempt(client, i, timeout_ms)
                finally:
                    client.slots.release()
            except Exception as exc:  # noqa: BLE001 - the calling thread classifies it
                failures[i] = exc
                error = _as_error(exc)
                instead = reach.give_up(reach.note(error)) if error is not None else None
                if instead is not None and not stopped:
                    stopped.append(instead)
            else:
                failures[i] = None
                reach.note(None)

    await client.all_of([worker] * min(parallelism, len(todo)))
    return failures, stopped[0] if stopped else None


def _as_error(exc: Exception) -> ControlPlaneError | None:
    """A failed try as the ControlPlaneError a single call would note (None for a failure no try is
    expected to have: the calling thread raises it)."""
    try:
        code, detail, _ = classify_failure(exc, "a try", "")
    except ControlPlaneError as refused:
        return refused
    except Exception:  # noqa: BLE001
        return None
    return ControlPlaneError(detail, retriable=True, code=code)


def _not_tried() -> ControlPlaneError:
    return ControlPlaneError("not tried in this pass", retriable=True, code=NOT_TRIED)


def _since(started: float | None) -> float:
    return 0.0 if started is None else time.monotonic() - started


def _all(outcomes: list[CallOutcome | None]) -> list[CallOutcome]:
    assert all(x is not None for x in outcomes)
    return outcomes  # type: ignore[return-value]
