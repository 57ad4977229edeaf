"""Crash test of the native sink (`.format("kafka_eos")`): the Spark driver (a subprocess: Python
driver, JVM and Python workers in one process group) is SIGKILLed mid-batch, from an executor task
and from the driver's commit, and restarted from the same checkpoint location, against the real
coordinator (uvicorn on Postgres, committing by EndTxn over the wire) and a real Kafka broker behind
the fault-injecting proxy.

One query, four input files (batches 0-3, three partitions each), four runs:
  1. killed in an executor task right after it took its lease (batch 1): the tasks had begun the
     batch themselves, so the coordinator holds an open attempt with leased ids;
  2. killed in the driver's commit once the coordinator decided batch 1 (its EndTxn requests held
     by the proxy): the next begin of the batch (from a task) finishes the decided commit;
  3. killed in the driver's commit after the coordinator committed batch 2, before Spark's commit
     log: batch 2 is replayed and its tasks write nothing;
  4. runs to the end.
Afterwards every input record is in exactly one committed winner transaction and no batch was
committed twice: what a read_committed consumer sees, cross-checked with the coordinator's winners
(lease ids in the provenance headers) and the COMMIT markers in the broker's log.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from fixtures.kafka_proxy import API_END_TXN
from fixtures.real_kafka import RealKafka
from fixtures.servers import ServiceProcess
from fixtures.spark_support import (
    ADMIN,
    assert_exactly_once,
    module_database_url,  # noqa: F401 - fixture
    service,  # noqa: F401 - fixture
    outcome,
    read_topic,
    register,
    write_input_files,
)
from sparkclient import CoordinatorClient
from test_spark_crash import run_driver

pytest.importorskip("pyspark.sql.datasource", reason="the Python Data Source API (pyspark 4.x)")
pytestmark = pytest.mark.slow


@pytest.mark.timeout(900)
def test_the_native_sink_killed_in_a_task_and_in_the_driver_s_commit_then_restarted(
    kafka_faults: RealKafka, service: ServiceProcess, tmp_path: Path
) -> None:
    broker, proxy = kafka_faults, kafka_faults.proxy
    topic = broker.create_topic(3)
    bootstrap = broker.proxied_bootstrap  # every client through the proxy, which holds EndTxn in run 2
    token = register(service, "native-crash", bootstrap, topic)
    batches = [list(range(0, 30)), list(range(30, 70)), list(range(70, 100)), list(range(100, 140))]
    write_input_files(tmp_path / "in", batches)
    base = {"bootstrap": bootstrap, "url": service.url, "token": token, "sink": "native-crash", "topic": topic,
            "source": str(tmp_path / "in"), "checkpoint": str(tmp_path / "chk"), "native": True}
    admin = CoordinatorClient(service.url, ADMIN, "native-crash")

    def detail(batch: int) -> dict[str, Any]:
        return admin.checkpoint(batch)

    # 1. killed in an executor task right after its lease
    code, out = run_driver({**base, "kill": "after_lease", "kill_batch": 1}, tmp_path / "run1.log")
    assert code == -9, out
    assert detail(0)["checkpoint"]["state"] == "COMMITTED"
    d1 = detail(1)
    assert d1["checkpoint"]["state"] == "OPEN" and {x["state"] for x in d1["leases"]} == {"LEASED"}, d1

    # 2. killed in the driver's commit once batch 1's commit is decided, its EndTxn requests held
    proxy.inject(API_END_TXN, action="hold", times=1_000_000)
    try:
        code, out = run_driver({**base, "kill": "decided", "kill_batch": 1}, tmp_path / "run2.log")
    finally:
        proxy.clear()
        proxy.release()
    assert code == -9, out
    d1 = detail(1)
    assert d1["checkpoint"]["state"] in ("COMMITTING", "COMMITTED") and d1["checkpoint"]["committed_attempt"] == 2, d1

    # 3. killed in the driver's commit after the coordinator committed batch 2, before Spark's commit log
    code, out = run_driver({**base, "kill": "after_commit", "kill_batch": 2}, tmp_path / "run3.log")
    assert code == -9, out
    assert detail(1)["checkpoint"]["state"] == "COMMITTED"
    assert detail(2)["checkpoint"]["state"] == "COMMITTED"
    assert not (tmp_path / "chk" / "commits" / "2").exists()  # Spark never logged it: batch 2 is replayed
    written = len(read_topic(broker.bootstrap, topic))
    leases_2 = detail(2)["leases"]

    # 4. to the end: batch 2 is replayed and writes nothing, batch 3 is written
    code, out = run_driver(base, tmp_path / "run4.log")
    assert code == 0, out
    result = outcome(service, "native-crash", broker.bootstrap, topic)
    assert_exactly_once(result, [str(v) for b in batches for v in b], "native-crash", broker.bootstrap, topic)
    assert sorted(result.details) == [0, 1, 2, 3]
    assert [a["state"] for a in result.details[1]["attempts"]] == ["ABORTED", "COMMITTED"]
    assert result.details[2]["leases"] == leases_2 and len(result.details[2]["attempts"]) == 1  # the replay: nothing
    assert len(result.records) == written + 40  # only batch 3's records were added to the log
    assert all(len(d["attempts"]) == 1 for b, d in result.details.items() if b not in (1,))
    admin.close()
