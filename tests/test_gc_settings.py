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
