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


def test_a_python_worker_freezes_what_it_keeps_so_pyspark_s_collect_after_each_task_stays_small(
    restored_gc: list[int],
) -> None:
    """PySpark's daemon runs gc.collect() after every task of a reused Python worker, walking every
    object not frozen. A task of the writer freezes the oldest generation when it holds more than
    UNFROZEN_LIMIT objects (the modules a worker imports during its first tasks); a few long-lived
    objects more do not freeze again, a worker's later imports do."""
    from sparkclient import executor

    gc.unfreeze()
    gc.collect()  # what the daemon did after the previous task: the survivors are old now
    assert len(gc.get_objects(generation=2)) > executor.UNFROZEN_LIMIT  # pytest, pyspark, ... imported
    executor.settle_worker_gc()
    frozen = gc.get_freeze_count()
    # (other threads of the pytest process may free or promote a few objects meanwhile)
    assert frozen > executor.UNFROZEN_LIMIT and len(gc.get_objects(generation=2)) < 100
    kept_a_little = [[i] for i in range(executor.UNFROZEN_LIMIT // 2)]
    gc.collect()
    executor.settle_worker_gc()
    assert gc.get_freeze_count() < frozen + executor.UNFROZEN_LIMIT // 4  # not worth a freeze
    imported_later = [[i] for i in range(executor.UNFROZEN_LIMIT * 2)]  # stands for pandas, imported by task 2
    gc.collect()
    executor.settle_worker_gc()
    assert gc.get_freeze_count() > frozen + executor.UNFROZEN_LIMIT and len(gc.get_objects(generation=2)) < 100
    assert kept_a_little and imported_later
