"""The real-Kafka e2e suite: the compose stack (docker-compose.yml + docker-compose.e2e.yml: three
KRaft brokers, Postgres, two coordinator replicas behind nginx), the example PySpark job writing
TOTAL_RECORDS rows through the coordinator while a seeded schedule kills (SIGKILL) and restarts its
driver, an executor (the PySpark Python workers inside the job's container), a coordinator replica
and a Kafka broker at random points; then the read_committed verifier must PASS: the topic holds
"0".."TOTAL_RECORDS-1" exactly once each, and no transaction under the sink's prefix is left open.

Runs on Podman (what .ci/e2e installs: the images built locally by `python -m localimages`, no
registry) or on Docker (`docker compose build`, the official images); selected only with `-m e2e`:

    python -m pytest -m e2e tests/e2e/test_e2e_compose.py -ra -s   # E2E_SEED=N replays a schedule

Skipped only where neither Podman nor a Docker engine is installed. Output (compose logs, the topic
dump, the schedule, the step times) goes to $E2E_OUT_DIR (default .e2e-out/). The last lines
printed are the verdict (`exactly-once: in=N out=N duplicates=0 missing=0 open_transactions=0
kills=K`) and the kills the run survived.
"""

from __future__ import annotations

import os
import random
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
from fixtures.compose_stack import Stack, no_engine, output_dir, selected_engine
from fixtures.servers import free_port

from e2e.checker import check, expected_range, read_dump
from e2e.crash_suite import verdict_line

COMPOSE_FILES = ("docker-compose.yml", "docker-compose.e2e.yml")
TOTAL_RECORDS = int(os.environ.get("E2E_TOTAL_RECORDS", "9000"))
ROWS_PER_SECOND = int(os.environ.get("E2E_ROWS_PER_SECOND", "60"))
PREFIX = "demo-"
JOB_DEADLINE_S = 30 * 60
MAX_JOB_RESTARTS = 20
KINDS = ("driver", "executor", "coordinator", "broker")

_NO_ENGINE = no_engine()

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(_NO_ENGINE is not None, reason=f"compose e2e suite: {_NO_ENGINE}"),
]


@pytest.fixture
def stack(request: pytest.FixtureRequest) -> Iterator[Stack]:
    engine = selected_engine(request, "tests/e2e/test_e2e_compose.py")
    seed = int(os.environ.get("E2E_SEED", str(random.randrange(1_000_000))))
    out_dir = output_dir()
    (out_dir / "topic-dump.jsonl").unlink(missing_ok=True)
    env = {**engine.env, "TOTAL_RECORDS": str(TOTAL_RECORDS), "ROWS_PER_SECOND": str(ROWS_PER_SECOND),
           "E2E_DUMP_DIR": str(out_dir), "E2E_SEED": str(seed), "PUBLISHED_PORT": str(free_port())}
    s = Stack(engine, f"eos-e2e-{seed}", COMPOSE_FILES, env)
    s.note(f"{engine.name}: seed {seed} (replay: E2E_SEED={seed}), {TOTAL_RECORDS} records at {ROWS_PER_SECOND}/s")
    try:
        yield s
    finally:
        logs = s.compose("logs", "--timestamps", check=False, timeout=300)
        (out_dir / "compose.log").write_text(logs.stdout + logs.stderr)
        started = time.monotonic()
        s.down()
        s.note(f"step teardown: {time.monotonic() - started:.0f} s")
        (out_dir / "schedule.log").write_text("\n".join(s.log) + "\n")


def kill_and_restart(s: Stack, rng: random.Random, kind: str, fired: Counter[str]) -> None:
    """One fault: SIGKILL something, leave it dead a few seconds, start it again."""
    if kind == "executor":
        # PySpark's Python workers (forked from pyspark.daemon, reused between tasks) run the
        # writer's tasks: lease, produce, flush, pre-commit. Killing them fails the running tasks;
        # Spark retries them (local[2,4]). Three kills a second or two apart, to hit a task mid-way.
        hit = 0
        for _ in range(3):
            proc = s.exec("spark-job", "pkill", "-9", "-f", r"pyspark\.(daemon|worker)")
            s.note(f"kill executor: python workers {'killed' if proc.returncode == 0 else 'not running at that moment'}")
            hit += proc.returncode == 0
            time.sleep(rng.uniform(0.5, 2.5))
        fired[kind] += hit > 0  # one fault, however many of its three tries found workers
        return
    service = {"driver": "spark-job",
               "coordinator": rng.choice(["coordinator-1", "coordinator-2"]),
               "broker": rng.choice(["kafka", "kafka-2", "kafka-3"])}[kind]
    if kind == "driver" and s.status(service)[0] != "running":
        s.note("kill driver: the job is not running at that moment")
        return
    s.kill(service)
    fired[kind] += 1
    down_s = rng.uniform(2, 12)
    s.note(f"kill {kind}: {service} (SIGKILL), restart in {down_s:.1f} s")
    time.sleep(down_s)
    s.start(service)
    if kind == "broker":
        s.wait_healthy(service)
        s.note(f"{service} healthy again")


@pytest.mark.timeout(3600)
def test_exactly_once_through_driver_executor_coordinator_and_broker_kills(stack: Stack) -> None:
    s = stack
    rng = random.Random(int(s.env["E2E_SEED"]))
    steps: dict[str, float] = {}
    t = time.monotonic()
    s.build()
    steps["images"] = time.monotonic() - t
    t = time.monotonic()
    # each depends_on condition waited for: postgres and the brokers healthy, migrations run once,
    # both replicas ready, then nginx; the topic created
    s.up("coordinator")
    s.up("kafka-init")
    s.wait_completed("kafka-init")
    s.wait_healthy("coordinator")
    steps["stack up"] = time.monotonic() - t
    s.note(f"step stack up: {steps['stack up']:.0f} s")
    t = time.monotonic()
    s.up("spark-job")
    s.note("job started")

    # every kind once, in a seeded order, first (so all four land while the job runs), then two more
    faults = rng.sample(KINDS, len(KINDS)) + [rng.choice(KINDS) for _ in range(2)]
    fired: Counter[str] = Counter()
    expected_s = TOTAL_RECORDS / ROWS_PER_SECOND
    deadline = time.monotonic() + JOB_DEADLINE_S
    restarts = 0
    next_fault_at = time.monotonic() + rng.uniform(20, max(25, expected_s / (len(faults) + 1)))
    while True:
        status, code = s.status("spark-job")
        if status == "exited":
            if code == 0:
                s.note(f"job finished (exit 0); faults not reached: {faults or 'none'}")
                break
            restarts += 1
            assert restarts <= MAX_JOB_RESTARTS, f"the job failed {restarts} times; see {s.env['E2E_DUMP_DIR']}/compose.log"
            s.note(f"job exited {code}: restart {restarts} (the operator's restart)")
            s.start("spark-job")
        if faults and time.monotonic() >= next_fault_at:
            kill_and_restart(s, rng, faults.pop(0), fired)
            next_fault_at = time.monotonic() + rng.uniform(5, 12)
        assert time.monotonic() < deadline, f"the job did not finish within {JOB_DEADLINE_S} s"
        time.sleep(2)
    steps["job run"] = time.monotonic() - t
    s.note(f"step job run: {steps['job run']:.0f} s")

    assert set(KINDS) <= set(fired), (f"only {sorted(fired)} were killed before the job finished: a longer run "
                                      "(E2E_TOTAL_RECORDS) gives the schedule room")

    t = time.monotonic()
    verified = s.compose("run", "--rm", "--no-deps", "verifier", check=False, timeout=900)
    steps["verify"] = time.monotonic() - t
    s.note("verifier: " + verified.stdout.strip().replace("\n", " | ")[:2000])
    assert verified.returncode == 0, verified.stdout + verified.stderr
    assert "PASS" in verified.stdout
    # the same verdict from the dump with the checker the unit tests cover
    records, listed = read_dump(Path(s.env["E2E_DUMP_DIR"]) / "topic-dump.jsonl")
    verdict = check(records, expected_range(TOTAL_RECORDS), listed, prefix=PREFIX, key_equals_value=True)
    line, ok = verdict_line(verdict, TOTAL_RECORDS, sum(fired.values()))
    s.note(line)
    s.note("kills survived: " + ", ".join(f"{kind} x{n}" for kind, n in sorted(fired.items())))
    s.note("steps: " + ", ".join(f"{name} {secs:.0f} s" for name, secs in steps.items()))
    assert verdict.ok and ok, verdict.report()
    assert not listed, f"open transactions left: {listed}"
