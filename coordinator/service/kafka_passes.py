"""A pass of Kafka calls over a batch's transactions (the commits of its winners, the aborts of
its losers or of a stage's first tries): each transaction's outcome in order, and no call started
once the broker has answered none (`kafka.control_plane.Reach`).

A control plane that makes a whole pass itself (`PassingControlPlane`'s `commit_all`, `abort_all`:
the wire plane, on its connection's IO thread) gets it in one call, off the event loop. Any other is called one
transaction at a time by `run_pass`, at most `parallelism` at once on the service's threads.

An unreachable broker costs each call its whole retry budget (8 s by default): 4,096 winners, 16
at a time, would hold a commit call or the recovery loop for 34 minutes. Once a call got no answer
and no call got one, the calls not started yet are reported NOT_TRIED (retriable): their
transactions stay pending and the next pass tries them.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from .. import on_loop
from ..kafka.control_plane import (
    CallOutcome,
    ControlPlaneError,
    KafkaControlPlane,
    KafkaTarget,
    PreparedTransaction,
    Reach,
)

T = TypeVar("T")
Item = TypeVar("Item")


def commit_pass(pool: ThreadPoolExecutor, parallelism: int, plane: KafkaControlPlane, target: KafkaTarget,
                txns: Sequence[PreparedTransaction]) -> list[CallOutcome]:
    """Each transaction committed by resume (EndTxn), its outcome in order."""
    return _pass(pool, parallelism, getattr(plane, "commit_all", None), lambda txn: plane.commit(target, txn),
                 target, txns)


def abort_pass(pool: ThreadPoolExecutor, parallelism: int, plane: KafkaControlPlane, target: KafkaTarget,
               transactional_ids: Sequence[str]) -> list[CallOutcome]:
    """Whatever transaction each id may hold ended (InitProducerId fences it), outcome in order."""
    return _pass(pool, parallelism, getattr(plane, "abort_all", None), lambda tid: plane.abort(target, tid),
                 target, transactional_ids)


def _pass(pool: ThreadPoolExecutor, parallelism: int, whole: Callable[..., list[CallOutcome]] | None,
          single: Callable[[Item], None], target: KafkaTarget, items: Sequence[Item]) -> list[CallOutcome]:
    """The plane's own pass (`whole`) off the event loop if it has one, else `single` per item."""
    if whole is not None:
        return off_loop(pool, whole, target, list(items), parallelism)
    return _call_by_call(pool, parallelism, single, items)


def _call_by_call(pool: ThreadPoolExecutor, parallelism: int, call: Callable[[Item], None],
                  items: Sequence[Item]) -> list[CallOutcome]:
    reach = Reach()

    def one(item: Item) -> CallOutcome:
        started = time.monotonic()
        try:
            call(item)
        except ControlPlaneError as exc:
            return CallOutcome(reach.note(exc), time.monotonic() - started)
        return CallOutcome(reach.note(None), time.monotonic() - started)

    def give_up(outcome: CallOutcome) -> CallOutcome | None:
        instead = reach.give_up(outcome.error)
        return None if instead is None else CallOutcome(instead)

    return run_pass(pool, parallelism, one, items, give_up)


def off_loop(pool: ThreadPoolExecutor, fn: Callable[..., T], *args: Any) -> T:
    """fn(*args), which waits on Kafka: in a call running on the event loop, in a thread."""
    if not on_loop.on_loop():
        return fn(*args)
    future = pool.submit(fn, *args)
    on_loop.wait_futures([future])
    return future.result()


def run_pass(pool: ThreadPoolExecutor, parallelism: int, fn: Callable[[Item], T], items: Sequence[Item],
             stop: Callable[[T], T | None] = lambda _: None) -> list[T]:
    """fn over items, at most `parallelism` at once, results in order. Each worker takes the next
    item until none is left: as balanced as one future per item, without 200 futures (which cost
    more than the work itself at P=200 on a fast control plane). fn waits on Kafka: in a call
    running on the event loop (`on_loop`), every worker is a thread of the pool. `stop(result)`:
    what every item not started yet gets instead of fn, once a result says they would fare no
    better (None: go on)."""
    here = not on_loop.on_loop()  # the calling thread is one of the workers
    workers = min(len(items), parallelism)
    out: list[Any] = [None] * len(items)
    started = [False] * len(items)
    stopped: list[T] = []
    todo = iter(range(len(items)))
    lock = threading.Lock()

    def work() -> None:
        while True:
            with lock:
                i = None if stopped else next(todo, None)
                if i is None:
                    return
                started[i] = True
            out[i] = fn(items[i])
            instead = stop(out[i])
            if instead is not None:
                with lock:
                    stopped[:] = stopped or [instead]

    if workers <= 1 and here:
        work()
    else:
        futures = [pool.submit(work) for _ in range(workers - here)]
        try:
            if here:
                work()  # one thread hand-off fewer per call
        finally:
            on_loop.wait_futures(futures)  # none left running, whatever work() raised
        for f in futures:
            f.result()  # re-raises what fn raised there
    return [x if ran else stopped[0] for x, ran in zip(out, started)]


def failure_report(failures: dict[str, str], not_tried: set[str]) -> dict[str, Any]:
    """An event's or an answer's account of a pass's failed calls: each tried one's error by
    transactional id, and how many were not tried (still pending; a wide batch has thousands)."""
    report: dict[str, Any] = {"failures": {t: why for t, why in failures.items() if t not in not_tried}}
    if left := len(not_tried & failures.keys()):
        report["not_tried"] = left
    return report
