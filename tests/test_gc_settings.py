"""The garbage collector's settings of a process that serves the protocol (coordinator/app.py)."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from typing import Any

import pytest

from coordinator.app import GC_THRESHOLD, settle_gc


@pytest.fixture
def restored_gc() -> Iterator[list[int]]:
    """The process's collector as it was, afterwards; the generations each collection ran on."""
    threshold, ran = gc.get_threshold(), []

    def record(phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            ran.append(info["generation"])

    gc.callbacks.append(record)
    try:
        yield ran
    finally:
        gc.callbacks.remove(record)
        gc.unfreeze()
        gc.set_threshold(*threshold)


def test_a_call_s_records_start_no_collection_once_the_process_is_settled(restored_gc: list[int]) -> None:
    settle_gc()
    assert gc.get_threshold()[0] == GC_THRESHOLD
    assert gc.get_freeze_count() > 0  # what the process was built with is left out of collections
    restored_gc.clear()
    records = [{"partition": p, "lease_id": p} for p in range(20_000)]  # a 200-partition call's ~100x
    assert restored_gc == []
    del records


def test_python_s_default_would_have_started_collections_in_the_middle_of_such_a_call(restored_gc: list[int]) -> None:
    """The check above can fail: with the default threshold the same records start collections."""
    gc.set_threshold(700, *gc.get_threshold()[1:])
    restored_gc.clear()
    records = [{"partition": p, "lease_id": p} for p in range(20_000)]
    assert len(restored_gc) >= 10
    del records


def test_an_executor_worker_freezes_its_heap_once_after_its_first_task(restored_gc: list[int]) -> None:
    """PySpark's daemon runs gc.collect() after every task of a reused Python worker, walking every
    object the worker imported (10-25 ms a task). The writer's first task in a worker moves what is
    alive then out of the collector's reach (sparkclient/executor.py); later tasks freeze nothing
    more, so their own garbage is still collected."""
    from sparkclient import executor

    gc.unfreeze()
    executor._GC_FROZEN_IN = None  # a fresh worker
    assert gc.get_freeze_count() == 0
    executor.settle_worker_gc()
    frozen = gc.get_freeze_count()
    assert frozen > 1000  # the modules, their functions and caches
    later_task = [[i] for i in range(1000)]
    executor.settle_worker_gc()  # the worker's next task
    assert gc.get_freeze_count() == frozen and later_task
