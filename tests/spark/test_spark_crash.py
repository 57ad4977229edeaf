"""Crash tests: the Spark driver (a subprocess: Python driver, JVM and Python workers in one process
group) is SIGKILLed at each protocol step and restarted from the same checkpoint location, against
the real coordinator (uvicorn on Postgres, committing by EndTxn over the wire) and a real Kafka
broker behind the fault-injecting proxy.

One query, four input files (batches 0-3, three partitions each), five runs:
  1. killed after an executor task took its lease (batch 1),
  2. killed after every pre-commit of batch 1, before the commit call,
  3. killed once the commit of batch 1 was decided, while its EndTxn requests are held by the proxy,
  4. killed after batch 2 was committed, before Spark wrote its commit log,
  5. runs to the end.
After them, every input record is in exactly one committed winner transaction and no batch was
committed twice: what a read_committed consumer sees, cross-checked with the coordinator's winners
(lease ids in the provenance headers) and the COMMIT markers in the broker's log.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from fixtures.kafka_proxy import API_END_TXN
from fixtures.real_kafka import RealKafka
from fixtures.servers import REPO_ROOT, ServiceProcess
from fixtures.spark_support import (
    ADMIN,
    assert_exactly_once,
    module_database_url,  # noqa: F401 - fixture
    service,  # noqa: F401 - fixture
    outcome,
    register,
    write_input_files,
)
from sparkclient import CoordinatorClient

pytestmark = pytest.mark.slow

DRIVER = "fixtures.spark_crash_driver"  # run with -m from tests/


def run_driver(args: dict[str, Any], log: Path, timeout_s: float = 240) -> tuple[int, str]:
    """Run the driver in its own session (so its kill takes its JVM and workers with it)."""
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", DRIVER, json.dumps(args)], cwd=REPO_ROOT / "tests",
                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            code = proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
            raise AssertionError(f"the driver did not finish in {timeout_s} s:\n{log.read_text()[-4000:]}") from None
    text = log.read_text()
    return code, "\n".join(line for line in text.splitlines() if line.startswith("[driver]"))


@pytest.mark.timeout(900)  # five Spark driver starts; batches took 40 s each at load average 30 on 2 cores
def test_driver_killed_at_every_protocol_step_and_restarted(
    kafka_faults: RealKafka, service: ServiceProcess, tmp_path: Path
) -> None:
    broker, proxy = kafka_faults, kafka_faults.proxy
    topic = broker.create_topic(3)
    bootstrap = broker.proxied_bootstrap  # every client through the proxy, which holds EndTxn in run 3
    token = register(service, "crash", bootstrap, topic)
    batches = [list(range(0, 30)), list(range(30, 70)), list(range(70, 100)), list(range(100, 140))]
    write_input_files(tmp_path / "in", batches)
    base = {"bootstrap": bootstrap, "url": service.url, "token": token, "sink": "crash", "topic": topic,
            "source": str(tmp_path / "in"), "checkpoint": str(tmp_path / "chk")}
    admin = CoordinatorClient(service.url, ADMIN, "crash")

    def detail(batch: int) -> dict[str, Any]:
        return admin.checkpoint(batch)

    # 1. killed in an executor task right after its lease
    code, out = run_driver({**base, "kill": "after_lease", "kill_batch": 1}, tmp_path / "run1.log")
    assert code == -9, out
    assert "batch=0 action=committed" in out and "batch=1" not in out, out
    assert detail(0)["checkpoint"]["state"] == "COMMITTED"
    assert detail(1)["checkpoint"]["state"] == "OPEN" and {x["state"] for x in detail(1)["leases"]} == {"LEASED"}

    # 2. killed after every pre-commit of the replayed batch 1, before the commit call
    code, out = run_driver({**base, "kill": "before_commit", "kill_batch": 1}, tmp_path / "run2.log")
    assert code == -9, out
    d1 = detail(1)
    assert [a["state"] for a in d1["attempts"]] == ["ABORTED", "OPEN"]  # the new generation fenced attempt 1
    # the tasks' pre-commit records die with the driver (they travel only with the commit)
    attempt2 = [x for x in d1["leases"] if x["attempt"] == 2]
    assert [x["state"] for x in attempt2].count("LEASED") >= 3 and {x["producer_id"] for x in attempt2} == {None}

    # 3. killed once the commit of batch 1 is decided, its EndTxn requests held on the way to Kafka
    proxy.inject(API_END_TXN, action="hold", times=1_000_000)
    try:
        code, out = run_driver({**base, "kill": "decided", "kill_batch": 1}, tmp_path / "run3.log")
    finally:
        proxy.clear()
        proxy.release()
    assert code == -9, out
    d1 = detail(1)
    assert d1["checkpoint"]["state"] in ("COMMITTING", "COMMITTED") and d1["checkpoint"]["committed_attempt"] == 3, d1

    # 4. killed after the commit of batch 2, before Spark's commit log
    code, out = run_driver({**base, "kill": "after_commit", "kill_batch": 2}, tmp_path / "run4.log")
    assert code == -9, out
    assert "killing process group at after_commit (batch 2)" in out, out
    assert "batch=1 action=skipped" in out or "batch=1 action=resumed" in out, out  # the loop may finish it first
    assert detail(1)["checkpoint"]["state"] == "COMMITTED"
    assert detail(2)["checkpoint"]["state"] == "COMMITTED"

    # 5. to the end: batch 2 is replayed and skipped, batch 3 is written
    code, out = run_driver(base, tmp_path / "run5.log")
    assert code == 0, out
    assert "batch=2 action=skipped" in out and "batch=3 action=committed" in out and "batch=1" not in out, out

    result = outcome(service, "crash", broker.bootstrap, topic)
    assert_exactly_once(result, [str(v) for b in batches for v in b], "crash", broker.bootstrap, topic)
    assert sorted(result.details) == [0, 1, 2, 3]
    assert [a["state"] for a in result.details[1]["attempts"]] == ["ABORTED", "ABORTED", "COMMITTED"]
    assert all(len(d["attempts"]) == 1 for b, d in result.details.items() if b != 1)
    # the killed attempts' pre-committed transactions were aborted, never committed
    attempt2 = [x for x in result.details[1]["leases"] if x["attempt"] == 2]
    assert attempt2 and all(x["state"] == "ABORTED" for x in attempt2), attempt2
    admin.close()
