"""The writer's coordinator client against a scripted HTTP server (real sockets, stdlib
http.server), for answers the coordinator itself does not give on purpose: other 5xx from a proxy
in between, a 200 that is not the coordinator's JSON, a redirect; and a URL without a scheme.
No Spark, no Postgres: these tests take well under a second each."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator

import pytest

from fixtures.servers import Script, scripted_http
from sparkclient import CoordinatorClient, CoordinatorError, WriterOptionError
from sparkclient.options import WriterOptions


@pytest.fixture
def scripted() -> Iterator[tuple[str, Script]]:
    with scripted_http() as served:
        yield served


SINK = json.dumps({"name": "s", "transaction_timeout_ms": 60000})


def error(reason: str) -> str:
    return json.dumps({"error": {"reason": reason, "message": f"{reason} happened"}})


def client(url: str, budget_s: float = 10.0) -> CoordinatorClient:
    return CoordinatorClient(url, "t", "s", timeout_s=5, retry_budget_s=budget_s, backoff_base_s=0.01,
                             backoff_max_s=0.02)


def test_any_5xx_and_429_from_a_proxy_are_retried(scripted: tuple[str, Script]) -> None:
    url, script = scripted
    script.answers = [(507, "<html>insufficient storage</html>", {"Content-Type": "text/html"}),
                      (501, "", {}), (429, "slow down", {"Content-Type": "text/plain"}), (200, SINK, {})]
    with client(url) as c:
        assert c.describe_sink()["name"] == "s"
    assert len(script.requests) == 4


def test_a_4xx_is_not_retried(scripted: tuple[str, Script]) -> None:
    url, script = scripted
    script.answers = [(409, error("stale_generation"), {}), (200, SINK, {})]
    with client(url) as c, pytest.raises(CoordinatorError) as refused:
        c.describe_sink()
    assert refused.value.status == 409 and "this driver is fenced" in str(refused.value)
    assert len(script.requests) == 1


def test_an_answer_that_is_not_the_coordinators_says_to_check_the_url(scripted: tuple[str, Script]) -> None:
    url, script = scripted
    script.answers = [(200, "<html>login</html>", {"Content-Type": "text/html"})]
    with client(url) as c, pytest.raises(CoordinatorError, match="not JSON.*check coordinator.url"):
        c.describe_sink()
    script.answers = [(308, "", {"Location": "https://elsewhere/v1/sinks/s"})]
    with client(url) as c, pytest.raises(CoordinatorError, match="redirect.*https://elsewhere.*coordinator.url"):
        c.describe_sink()
    assert len(script.requests) == 2  # neither is retried: repeating the call answers the same


def test_a_url_without_http_scheme_fails_at_once_naming_the_option() -> None:
    started = time.monotonic()
    with client("localhost:8000", budget_s=30) as c, pytest.raises(CoordinatorError, match="coordinator.url"):
        c.describe_sink()
    assert time.monotonic() - started < 20  # not retried for the whole budget
    base = {"kafka.bootstrap.servers": "k:9092", "topic": "t", "coordinator.token": "x", "coordinator.sink": "s",
            "checkpointLocation": "/tmp/chk"}
    for bad in ("localhost:8000", "ftp://c:8000", "http//c"):
        with pytest.raises(WriterOptionError, match="'coordinator.url' must start with http:// or https://"):
            WriterOptions.parse({**base, "coordinator.url": bad})
    assert WriterOptions.parse({**base, "coordinator.url": "HTTPS://c:8000"}).coordinator_url == "HTTPS://c:8000"


def test_executor_tasks_share_one_client_per_process_and_a_forked_worker_makes_its_own() -> None:
    """PySpark reuses a Python worker for many tasks (one client, one keep-alive connection) and
    forks workers from a daemon: a child must not talk over its parent's connections."""
    import os

    from sparkclient.executor import TaskSpec

    def spec(batch: int, timeout_ms: int = 30_000) -> TaskSpec:
        return TaskSpec("http://c:8000", "tok", "s", timeout_ms, 60_000, batch, 1, 1, "k:9092", {}, "t", ("value",),
                        False)

    first = spec(0).client()
    assert spec(1).client() is first  # another batch, same sink and options: the same client
    assert spec(1, timeout_ms=5_000).client() is not first
    read, write = os.pipe()
    child = os.fork()
    if child == 0:  # the child answers whether it got a client of its own
        try:
            os.write(write, b"own" if spec(2).client() is not first else b"shared")
        finally:
            os._exit(0)
    os.close(write)
    answer = os.read(read, 10)
    os.waitpid(child, 0)
    os.close(read)
    assert answer == b"own"
    assert spec(3).client() is first  # the parent keeps its own


# --- the task's own checks (two-call protocol) -------------------------------------------------


def test_a_task_refuses_init_on_a_lease_older_than_the_bound_and_a_transaction_inside_the_margin() -> None:
    from sparkclient.executor import (
        DeadlineTooClose,
        LeaseTooOld,
        check_deadline_outside_margin,
        check_lease_young_enough,
        is_first_try,
    )

    now = 1_000_000.0
    lease = {"lease_id": 7, "transactional_id": "p-3", "age_ms": 2_000, "received_at": now - 27.0,
             "transaction_timeout_ms": 60_000}
    check_lease_young_enough(lease, 30_000, now)  # 2 s old when answered + 27 s since = 29 s
    with pytest.raises(LeaseTooOld, match="31000 ms old, above the 30000 ms bound"):
        check_lease_young_enough(lease, 30_000, now + 2.0)
    check_deadline_outside_margin(lease, 6_000, now + 25.0)  # 54 s old: 6 s left, not inside
    with pytest.raises(DeadlineTooClose, match="5999 ms left"):
        check_deadline_outside_margin(lease, 6_000, now + 25.001)
    assert is_first_try(0, 0) and not is_first_try(0, 1) and not is_first_try(1, 0)


class _Tracker:
    """Stands in for Spark's status tracker: a stage retry needs a fetch failure, which local mode
    cannot be made to produce on demand (the real tracker is read in test_spark_writer's jobs)."""

    def __init__(self, attempts: dict[int, int]) -> None:
        self.attempts = attempts

    def getJobIdsForGroup(self, group: str | None) -> list[int]:  # noqa: N802 - Spark's name
        return [1]

    def getJobInfo(self, job_id: int) -> object:  # noqa: N802
        return type("JobInfo", (), {"stageIds": list(self.attempts)})()

    def getStageInfo(self, stage_id: int) -> object:  # noqa: N802
        return type("StageInfo", (), {"currentAttemptId": self.attempts[stage_id]})()


def test_the_driver_sees_a_retried_stage_of_its_write_job() -> None:
    from sparkclient.stages import StageRetries

    def jobs(attempts: dict[int, int]) -> StageRetries:
        sc = type("Sc", (), {"statusTracker": lambda self: _Tracker(attempts),
                             "getLocalProperty": lambda self, key: "run-1"})()
        return StageRetries(sc)

    assert jobs({3: 0}).job_ids() == {1}
    assert not jobs({3: 0, 4: 0}).retried({1})
    assert jobs({3: 0, 4: 1}).retried({1})
    assert not jobs({3: 1}).retried(set())  # another job's retry is not this one's
