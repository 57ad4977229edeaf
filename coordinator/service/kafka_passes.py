"""A pass of Kafka calls over a batch's transactions (the commits of its winners, the aborts of
its losers or of a stage's first tries): at most `parallelism` at once, results in order, and no
call started once the broker has answered none.

An unreachable broker costs each call its whole retry budget (8 s by default): 4,096 winners, 16
at a time, would hold a commit call or the recovery loop for 34 minutes. Once a call got no answer
and no call got one, the calls not started yet are reported NOT_TRIED (retriable): their
transactions stay pending and the next pass tries them. A success or a refusal is an answer; after
one, every call is made, so trouble at one transaction coordinator never holds the others back
toward their timeout.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from .. import on_loop
from ..kafka.control_plane import ControlPlaneError

T = TypeVar("T")
Item = TypeVar("Item")

NOT_TRIED = "not_tried"  # the code of a call not made: the broker answered none in its pass


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


class Reach:
    """Whether the broker has answered any call of one pass (`note` each call's outcome as soon as
    it is known); `give_up` is run_pass's `stop` for the pass."""

    def __init__(self) -> None:
        self.reached = False

    def note(self, error: ControlPlaneError | None) -> ControlPlaneError | None:
        if error is None or not error.unanswered:
            self.reached = True  # a success or a refusal is an answer
        return error

    def give_up(self, error: ControlPlaneError | None) -> ControlPlaneError | None:
        if error is None or not error.unanswered or self.reached:
            return None
        return ControlPlaneError(f"not tried in this pass: the broker answered none of its calls ({error.code})",
                                 retriable=True, code=NOT_TRIED)


def failure_report(failures: dict[str, str], not_tried: set[str]) -> dict[str, Any]:
    """An event's or an answer's account of a pass's failed calls: each tried one's error by
    transactional id, and how many were not tried (still pending; a wide batch has thousands)."""
    report: dict[str, Any] = {"failures": {t: why for t, why in failures.items() if t not in not_tried}}
    if left := len(not_tried & failures.keys()):
        report["not_tried"] = left
    return report
