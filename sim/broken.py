"""Deliberately broken variants of the system under test, each the behaviour a fix removed: the
simulation's tests run schedules with one in place and require the checker to find it. Those of
the coordinator are context managers that patch it for the schedules run inside them (the
simulation is one process; nothing else runs the coordinator meanwhile); those of the deployment
are the Sim's own settings:

- `Sim(serial_recovery=True)`: one worker runs every step of every sink in turn, as the landed
  loop walked the sinks in name order (issue 50 §1);
- `Sim(guessed_first_tries=True)`: the landed client, which named a try by what it could see: a
  try of task attempt number 0 was its partition's first try and took the pre-lease, a try of a
  resubmitted stage too (PySpark's TaskContext has no stage attempt number, and the driver's check
  of Spark's status tracker can miss it), so two tries could write on one id (issue 50 §2).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from types import SimpleNamespace
from typing import Any

import pytest
from sqlalchemy import Connection

from coordinator.service import begin as begin_module
from coordinator.store import sinks as store_sinks


@contextmanager
def begin_without_the_sink_lock() -> Iterator[None]:
    """The landed begin (issue 50 §3): it read the sink's row without a lock, so a new generation
    or a retirement could commit between its check of the generation and its writes."""

    def sink_by_name(conn: Connection, name: str, *, lock: Any = None, retired: bool = False) -> Any:
        return store_sinks.sink_by_name(conn, name, retired=retired)

    with pytest.MonkeyPatch.context() as m:
        m.setattr(begin_module, "sinks", SimpleNamespace(sink_by_name=sink_by_name))
        yield
