"""Kafka in, Kafka out, on the real broker: the example job (sparkclient/example_job.py) reads a topic
with Spark's own Kafka source (`kafka.isolation.level=read_committed`, the connector's jars from
Maven through localkafka's pom) and writes through the exactly-once writer.

- The example run again on its checkpoint says so, reads only what is new, and a run with nothing
  new says so and exits 0 (issue 13: it must not commit empty batches forever).
- A chain of two exactly-once jobs, A -> B -> C, each killed (SIGKILL of its process group: the
  Python driver, its JVM, its Python workers) on a seeded schedule and restarted on its checkpoint:
  C read_committed holds every record of A exactly once. Counts per seed are printed (run with -s;
  more seeds with CHAIN_SEEDS=1,2,3).
"""

from __future__ import annotations

import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from fixtures.real_kafka import RealKafka, read_committed
from fixtures.servers import ServiceProcess
from fixtures.spark_support import ADMIN, kafka_service, module_database_url  # noqa: F401 - fixture

REPO_ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.slow]
CHAIN_SEEDS = [int(s) for s in os.environ.get("CHAIN_SEEDS", "1").split(",")]  # more: CHAIN_SEEDS=1,2,3


@pytest.fixture(scope="module")
def service(module_database_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServiceProcess]:  # noqa: F811
    # the coordinator's default Kafka timeouts: the 2 s of kafka_service's made registration's broker
    # check fail on 2 busy cores
    with kafka_service(module_database_url, tmp_path_factory.mktemp("coordinator"),
                       COORDINATOR_KAFKA_REQUEST_TIMEOUT_MS="10000", COORDINATOR_KAFKA_RETRY_BUDGET_MS="30000") as s:
        yield s


@pytest.fixture(scope="module")
def connector_jars() -> str:
    from localkafka.maven import spark_kafka_jars

    return ",".join(spark_kafka_jars())


def example_command(service: ServiceProcess, bootstrap: str, jars: str, source: str, target: str, checkpoint: Path,
                    *extra: str) -> list[str]:
    return [sys.executable, "-m", "sparkclient.example_job", "--kafka-bootstrap-servers", bootstrap,
            "--input-topic", source, "--output-topic", target, "--coordinator-url", service.url,
            "--coordinator-admin-token", ADMIN, "--checkpoint-location", str(checkpoint), "--spark-jars", jars,
            "--topic-partitions", "3", *extra]


def job_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("COORDINATOR_")} | extra
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT), *filter(None, env.get("PYTHONPATH", "").split(os.pathsep))])
    env["PYSPARK_PYTHON"] = sys.executable
    return env


def run_job(cmd: list[str], log: Path, kill_after_batches: tuple[int, float] | None = None,
            timeout_s: float = 300, env: dict[str, str] | None = None) -> tuple[int | None, str]:
    """Run the example job to its end, or SIGKILL its process group (the driver, its JVM, its Python
    workers) `delay` seconds after its `n`-th batch line, `kill_after_batches=(n, delay)`.
    Returns (exit code, None if killed; its output)."""
    start = log.stat().st_size if log.exists() else 0
    with open(log, "ab") as out:
        proc = subprocess.Popen(cmd, cwd=REPO_ROOT, env=env or job_env(), stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
    deadline = time.monotonic() + timeout_s
    try:
        while proc.poll() is None:
            if time.monotonic() > deadline:
                raise AssertionError(f"the job did not end within {timeout_s} s; log {log}")
            if kill_after_batches is not None:
                batches = log.read_bytes()[start:].count(b"[example_job] batch=")
                if batches >= kill_after_batches[0]:
                    time.sleep(kill_after_batches[1])
                    break
            time.sleep(0.05)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    killed = proc.returncode == -signal.SIGKILL
    return None if killed else proc.returncode, log.read_bytes()[start:].decode(errors="replace")


def values(messages: list[Any]) -> Counter[str]:
    return Counter(m.value().decode() for m in messages)


@pytest.mark.timeout(900)  # three runs of the example, each starting Spark (~10-60 s on 2 busy cores)
def test_the_example_continues_its_checkpoint_and_says_when_nothing_is_left(
    service: ServiceProcess, real_kafka: RealKafka, connector_jars: str, tmp_path: Path
) -> None:
    """The first run is configured by environment variables only, as docker-compose runs it
    (TOTAL_RECORDS, the older name of INPUT_RECORDS); the later ones by flags."""
    source, target = real_kafka.create_topic(3), real_kafka.create_topic(3)
    checkpoint = tmp_path / "chk"
    env = job_env(KAFKA_BOOTSTRAP_SERVERS=real_kafka.bootstrap, COORDINATOR_URL=service.url,
                  COORDINATOR_ADMIN_TOKEN=ADMIN, INPUT_TOPIC=source, OUTPUT_TOPIC=target, SINK_NAME="example",
                  CHECKPOINT_LOCATION=str(checkpoint), TOTAL_RECORDS="150", MAX_RECORDS_PER_BATCH="60",
                  SPARK_JARS=connector_jars)
    code, out = run_job([sys.executable, "-m", "sparkclient.example_job"], tmp_path / "job.log", env=env)
    assert code == 0, out
    assert f"checkpoint {checkpoint} (new query" in out and "appended records 0..149" in out
    assert "done: 3 batches (3 committed" in out and "150 records written" in out, out
    assert values(read_committed(real_kafka.bootstrap, target)) == Counter(str(i) for i in range(150))

    cmd = example_command(service, real_kafka.bootstrap, connector_jars, source, target, checkpoint,
                          "--max-records-per-batch", "60", "--sink-name", "example")
    code, out = run_job([*cmd, "--input-records", "150"], tmp_path / "job.log")  # nothing new
    assert code == 0, out
    assert f"reusing checkpoint {checkpoint} of query" in out and "holds 150 records already" in out
    assert "nothing left to do" in out and "action=" not in out, out

    # 40 new records, paced as the quickstart and docker-compose ask (ROWS_PER_SECOND: a 1 s
    # processingTime trigger, 20 records a batch); it ends once the input is caught up
    paced = {k: v for k, v in env.items() if k != "MAX_RECORDS_PER_BATCH"} | {"TOTAL_RECORDS": "190",
                                                                             "ROWS_PER_SECOND": "20"}
    code, out = run_job([sys.executable, "-m", "sparkclient.example_job"], tmp_path / "job.log", env=paced)
    assert code == 0, out
    assert "(trigger 1 second)" in out and "appended records 150..189" in out, out
    # 20 offsets a batch over 3 partitions: Spark splits them per partition, so 2 or 3 batches
    assert re.search(r"done: (\d) batches \(\1 committed, 0 empty", out) and "40 records written" in out, out
    assert values(read_committed(real_kafka.bootstrap, target)) == Counter(str(i) for i in range(190))


# --- the chain under crashes ----------------------------------------------------------------------


@dataclass
class JobLog:
    name: str
    runs: int = 0
    kills: int = 0
    exits: list[int | None] = field(default_factory=list)


def run_with_crashes(job: JobLog, cmd: list[str], log: Path, rng: random.Random, crashes: int,
                     upstream_done: threading.Event | None, done: threading.Event, errors: list[str]) -> None:
    """`crashes` runs killed at a random moment (0-1.5 s after the 1st-3rd batch line of the run:
    in the next batch's job or commit, or between batches), then runs to the end; a downstream job
    runs again until one run started after its upstream finished has ended."""
    try:
        for _ in range(crashes):
            job.runs += 1
            code, out = run_job(cmd, log, kill_after_batches=(rng.randint(1, 3), rng.uniform(0.0, 1.5)))
            job.exits.append(code)
            if code is None:
                job.kills += 1
            elif code != 0:
                errors.append(f"{job.name} exited {code}:\n{out[-3000:]}")
                return
        while True:
            final = upstream_done is None or upstream_done.is_set()
            job.runs += 1
            code, out = run_job(cmd, log)
            job.exits.append(code)
            if code != 0:
                errors.append(f"{job.name} exited {code}:\n{out[-3000:]}")
                return
            if final:
                return
    finally:
        done.set()


def run_chain(service: ServiceProcess, kafka: RealKafka, jars: str, work: Path, seed: int, records: int = 400,
              crashes: int = 2) -> dict[str, Any]:
    rng = random.Random(seed)
    a, b, c = (kafka.create_topic(3) for _ in range(3))
    job1, job2 = JobLog("job1 A->B"), JobLog("job2 B->C")
    cmd1 = example_command(service, kafka.bootstrap, jars, a, b, work / f"s{seed}-chk1", "--input-records",
                           str(records), "--max-records-per-batch", "40")
    cmd2 = example_command(service, kafka.bootstrap, jars, b, c, work / f"s{seed}-chk2", "--max-records-per-batch",
                           "40")
    done1, done2, errors = threading.Event(), threading.Event(), []
    rng1, rng2 = random.Random(rng.random()), random.Random(rng.random())
    t1 = threading.Thread(target=run_with_crashes, args=(job1, cmd1, work / f"s{seed}-job1.log", rng1, crashes,
                                                          None, done1, errors))
    t2 = threading.Thread(target=run_with_crashes, args=(job2, cmd2, work / f"s{seed}-job2.log", rng2, crashes,
                                                          done1, done2, errors))
    started = time.monotonic()
    t1.start()
    time.sleep(4)  # job 1 fills A first
    t2.start()
    t1.join()
    t2.join()
    assert not errors, errors[0]
    got_b, got_c = values(read_committed(kafka.bootstrap, b)), values(read_committed(kafka.bootstrap, c))
    expected = Counter(str(i) for i in range(records))
    return {
        "seed": seed, "a": records, "b": sum(got_b.values()), "c": sum(got_c.values()),
        "c_duplicates": sum(n - 1 for n in got_c.values() if n > 1), "c_missing": len(set(expected) - set(got_c)),
        "b_exact": got_b == expected, "c_exact": got_c == expected,
        "job1": f"{job1.runs} runs, {job1.kills} killed", "job2": f"{job2.runs} runs, {job2.kills} killed",
        "seconds": round(time.monotonic() - started),
    }


@pytest.mark.timeout(1800)  # 4-6 runs of each job, two at a time
@pytest.mark.parametrize("seed", CHAIN_SEEDS)
def test_a_chain_of_two_jobs_keeps_every_record_once_under_crashes(
    service: ServiceProcess, real_kafka: RealKafka, connector_jars: str, tmp_path: Path, seed: int
) -> None:
    counts = run_chain(service, real_kafka, connector_jars, tmp_path, seed)
    print(f"\nchain seed {seed}: {counts}")
    assert counts["b_exact"] and counts["c_exact"], counts
    assert counts["c"] == counts["a"]

