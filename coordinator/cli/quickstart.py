"""`coordinator quickstart`: the whole path on one machine, with real parts only.

  1. checks what it needs: Java 17 (Kafka and Spark run on it), pyspark (the [spark] extra), and
     Kafka's jars (resolved by Maven into ~/.m2 the first time: Maven, or a warmed ~/.m2);
  2. starts a real Kafka node (localkafka/) and the coordinator (`coordinator serve`: embedded
     Postgres, the real Kafka control plane) on this machine;
  3. writes the input topic (records "0".."N-1") and runs the example pipeline
     (python -m sparkclient.example_job: Kafka topic in -> Spark -> the exactly-once writer -> Kafka
     topic out; its Spark session sets spark.python.unix.domain.socket.enabled=true, the setting
     small batches need, docs/spark.md#small-batches) until its input is done;
  4. reads the output topic with a read_committed consumer and checks every record is there once;
  5. prints a summary (records in/out, duplicates, missing, batches, the dashboard's URL and login),
     then keeps the coordinator and Kafka up until Ctrl-C (or stops at once with --exit).

Every run starts fresh in its directory (default .coordinator-quickstart/): Kafka's data, the
database and the Spark checkpoint of the previous run are removed first.
"""

from __future__ import annotations

import argparse
import fcntl
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

SINK = "quickstart"
INPUT_TOPIC = "quickstart-in"
OUTPUT_TOPIC = "quickstart-out"
PARTITIONS = 3
T = TypeVar("T")


class QuickstartError(Exception):
    """A step failed; the message says what and what to do."""


@dataclass
class Summary:
    records_in: int
    records_out: int
    distinct_out: int
    duplicates: int
    missing: int
    batches: int
    dashboard: str
    admin_token: str
    token_file: Path
    job_seconds: float

    @property
    def exactly_once(self) -> bool:
        return self.records_out == self.records_in == self.distinct_out and not self.duplicates and not self.missing

    def text(self) -> str:
        verdict = "exactly once: every input record is in the output once" if self.exactly_once else \
            "NOT exactly once: see the counts above"
        return "\n".join([
            "",
            "== quickstart summary ==",
            f"records in         {self.records_in} (topic {INPUT_TOPIC})",
            f"records out        {self.records_out} (topic {OUTPUT_TOPIC}, read_committed)",
            f"duplicates         {self.duplicates}",
            f"missing            {self.missing}",
            f"batches committed  {self.batches} (sink {SINK}, {self.job_seconds:.0f} s)",
            f"result             {verdict}",
            f"dashboard          {self.dashboard}  (log in with the admin token: {self.admin_token} ; "
            f"kept in {self.token_file})",
        ])


class Progress:
    """One line per step ('[2/6] starting Kafka ... done in 9 s'); on a terminal, a live status line."""

    def __init__(self, steps: int, out: Any = sys.stdout) -> None:
        self.steps, self.n, self.out = steps, 0, out
        self.tty = out.isatty()

    def step(self, what: str, fn: Callable[[], T]) -> T:
        self.n += 1
        self.out.write(f"[{self.n}/{self.steps}] {what} ...")
        self.out.flush()
        started = time.monotonic()
        try:
            result = fn()
        except BaseException:
            self.out.write(" failed\n")
            self.out.flush()
            raise
        self.out.write(f" done in {time.monotonic() - started:.0f} s\n")
        self.out.flush()
        return result

    def status(self, text: str) -> None:
        if self.tty:
            self.out.write("\r      " + text + "\033[K")
            self.out.flush()


def requirements() -> list[str]:
    """What is missing to run the quickstart, each with how to get it (empty: nothing)."""
    import importlib.util

    missing = []
    java = shutil.which("java")
    if java is None:
        missing.append("Java 17 (Kafka and Spark run on it): Debian/Ubuntu `apt-get install -y openjdk-17-jre-headless`, "
                       "macOS `brew install openjdk@17`")
    else:
        out = subprocess.run([java, "-version"], capture_output=True, text=True).stderr
        m = re.search(r'version "(\d+)', out)
        if m and int(m.group(1)) < 17:
            missing.append(f"Java 17 or newer (found Java {m.group(1)} at {java})")
    if importlib.util.find_spec("pyspark") is None:
        missing.append("pyspark (the example pipeline): pip install -e '.[spark]' (keep -e in a checkout: a plain "
                       "install would replace the editable one)")
    if importlib.util.find_spec("confluent_kafka") is None:
        missing.append("confluent-kafka: pip install -e .")
    if shutil.which("mvn") is None and not (Path.home() / ".m2" / "repository" / "org" / "apache" / "kafka").is_dir():
        missing.append("Kafka's jars: they are resolved by Maven into ~/.m2 the first time; install Maven "
                       "(`apt-get install -y maven`, `brew install maven`) or copy a warmed ~/.m2/repository")
    return missing


@contextmanager
def exclusive(directory: Path) -> Iterator[None]:
    directory.mkdir(parents=True, exist_ok=True)
    with open(directory / ".lock", "w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise QuickstartError(f"another quickstart is running in {directory}; stop it (Ctrl-C) or pass --dir") \
                from None
        yield


def _free_port(preferred: int) -> int:
    import socket

    for port in (preferred, 0):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return int(s.getsockname()[1])
    raise QuickstartError("no free TCP port on 127.0.0.1")


def _wait_ready(url: str, proc: subprocess.Popen[bytes], log_path: Path, timeout_s: float = 120.0) -> None:
    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise QuickstartError(f"the coordinator exited with {proc.returncode}; its log: {log_path}")
        try:
            if httpx.get(url + "/readyz", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise QuickstartError(f"the coordinator did not become ready in {timeout_s:.0f} s; its log: {log_path}")


def produce_input(bootstrap: str, records: int) -> None:
    from confluent_kafka import Producer
    from confluent_kafka.admin import AdminClient, NewTopic

    admin = AdminClient({"bootstrap.servers": bootstrap})
    for f in admin.create_topics([NewTopic(t, PARTITIONS) for t in (INPUT_TOPIC, OUTPUT_TOPIC)]).values():
        f.result(30)
    # log_level 3: librdkafka's retriable warnings of a broker just started ("coordinator load in
    # progress") are not the user's business; errors still show
    producer = Producer({"bootstrap.servers": bootstrap, "enable.idempotence": True, "linger.ms": 5, "log_level": 3})
    for i in range(records):
        producer.produce(INPUT_TOPIC, key=str(i), value=str(i))
        producer.poll(0)
    if producer.flush(30) != 0:
        raise QuickstartError(f"could not write the {records} input records to {INPUT_TOPIC} within 30 s")


def read_committed(bootstrap: str, topic: str, idle_s: float = 5.0, timeout_s: float = 60.0) -> list[str]:
    """Every value a read_committed consumer sees in `topic`, read to the end."""
    import uuid

    from confluent_kafka import OFFSET_BEGINNING, Consumer, TopicPartition

    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": f"quickstart-verify-{uuid.uuid4()}",
                         "isolation.level": "read_committed", "enable.auto.commit": False,
                         "auto.offset.reset": "earliest", "log_level": 3})
    try:
        parts = consumer.list_topics(topic, timeout=30).topics[topic].partitions
        consumer.assign([TopicPartition(topic, p, OFFSET_BEGINNING) for p in parts])
        ends = {p: consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=30)[1] for p in parts}
        values: list[str] = []
        deadline, last = time.monotonic() + timeout_s, time.monotonic()
        while time.monotonic() < deadline and time.monotonic() - last < idle_s:
            msg = consumer.poll(0.5)
            if msg is not None and msg.error() is None:
                values.append(msg.value().decode())
                last = time.monotonic()
            positions = consumer.position([TopicPartition(topic, p) for p in parts])
            if all(tp.offset >= ends[tp.partition] for tp in positions if tp.offset >= 0) and \
                    all(tp.offset >= 0 or ends[tp.partition] == 0 for tp in positions):
                break
        return values
    finally:
        consumer.close()


def _interrupt(_signum: int, _frame: object) -> None:
    """SIGTERM ends the run like Ctrl-C: through the `finally` that stops everything."""
    raise KeyboardInterrupt


def run(args: argparse.Namespace) -> int:
    if args.records < 1:
        print("coordinator quickstart: --records must be at least 1", file=sys.stderr)
        return 2
    directory = Path(args.dir).resolve()
    missing = requirements()
    if missing:
        print("coordinator quickstart needs:\n" + "\n".join(f"  - {m}" for m in missing), file=sys.stderr)
        return 2
    try:
        with exclusive(directory):
            return _run(args, directory)
    except QuickstartError as exc:
        print(f"\ncoordinator quickstart: {exc}", file=sys.stderr)
        return 1


def _run(args: argparse.Namespace, directory: Path) -> int:
    from localkafka.cluster import LocalKafka, LocalKafkaError
    from localkafka.maven import MavenError

    from .operator_commands import AdminApi

    for stale in ("kafka", "coordinator", "checkpoint"):
        shutil.rmtree(directory / stale, ignore_errors=True)
    progress = Progress(6)
    kafka = LocalKafka(directory / "kafka", nodes=1)
    coordinator: subprocess.Popen[bytes] | None = None
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        try:
            progress.step("starting Kafka (a real single node, Java; the jars from ~/.m2)", kafka.start)
        except (LocalKafkaError, MavenError) as exc:
            raise QuickstartError(f"Kafka did not start: {exc}") from exc
        bootstrap = kafka.bootstrap_servers

        port = _free_port(args.port)
        url = f"http://127.0.0.1:{port}"
        data_dir = directory / "coordinator"
        log_path = directory / "coordinator.log"
        env = {k: v for k, v in os.environ.items() if not k.startswith("COORDINATOR_")}
        env.update(COORDINATOR_DATA_DIR=str(data_dir), COORDINATOR_PORT=str(port),
                   COORDINATOR_KAFKA_CONTROL_PLANE="kafka", COORDINATOR_LOG_LEVEL="warning")

        def start_coordinator() -> subprocess.Popen[bytes]:
            with open(log_path, "wb") as log:
                proc = subprocess.Popen([sys.executable, "-m", "coordinator.cli", "serve"], env=env, stdout=log,
                                        stderr=subprocess.STDOUT, start_new_session=True)
            _wait_ready(url, proc, log_path)
            return proc

        coordinator = progress.step(f"starting the coordinator on {url} (embedded Postgres, Kafka control plane)",
                                    start_coordinator)
        token_file = data_dir / "admin-token"
        token = token_file.read_text().strip()

        progress.step(f"writing {args.records} records to topic {INPUT_TOPIC}",
                      lambda: produce_input(bootstrap, args.records))

        job_log = directory / "example-job.log"
        api = AdminApi(url, token, timeout_s=10)

        def committed_batches() -> int:
            try:
                rows = api.call("GET", f"/v1/sinks/{SINK}/checkpoints", state="COMMITTED", limit=1000)
            except Exception:  # noqa: BLE001 - not registered yet, or a slow answer: only the live status line
                return 0
            return len(rows)

        def run_job() -> float:
            job_env = {**env, "KAFKA_BOOTSTRAP_SERVERS": bootstrap, "COORDINATOR_URL": url,
                       "COORDINATOR_ADMIN_TOKEN": token, "SINK_NAME": SINK, "TRANSACTIONAL_ID_PREFIX": f"{SINK}-",
                       "INPUT_TOPIC": INPUT_TOPIC, "OUTPUT_TOPIC": OUTPUT_TOPIC,
                       "TOPIC_PARTITIONS": str(PARTITIONS), "OUTPUT_TOPIC_PARTITIONS": str(PARTITIONS),
                       # the job reads the input with availableNow, about five batches; the records'
                       # count is given under both names the example job has had (INPUT_, TOTAL_RECORDS)
                       "TRIGGER": "availableNow", "MAX_RECORDS_PER_BATCH": str(max(args.records // 5, 1)),
                       "INPUT_RECORDS": str(args.records), "TOTAL_RECORDS": str(args.records),
                       "ROWS_PER_SECOND": str(max(args.records // 5, 1)),
                       "CHECKPOINT_LOCATION": str(directory / "checkpoint"), "PYSPARK_PYTHON": sys.executable}
            started = time.monotonic()
            with open(job_log, "wb") as log:
                job = subprocess.Popen([sys.executable, "-m", "sparkclient.example_job"], env=job_env, stdout=log,
                                       stderr=subprocess.STDOUT)
                try:
                    while job.poll() is None:
                        progress.status(f"{time.monotonic() - started:.0f} s, {committed_batches()} batches committed")
                        try:
                            job.wait(2)
                        except subprocess.TimeoutExpired:
                            pass
                        if time.monotonic() - started > args.job_timeout:
                            raise QuickstartError(f"the example job did not finish in {args.job_timeout} s; its log: "
                                                  f"{job_log}")
                finally:
                    if job.poll() is None:
                        job.terminate()
                        job.wait(30)
            if job.returncode != 0:
                raise QuickstartError(f"the example job exited with {job.returncode}; its log: {job_log}")
            return time.monotonic() - started

        job_seconds = progress.step(f"running the example pipeline ({INPUT_TOPIC} -> Spark -> exactly-once writer -> "
                                    f"{OUTPUT_TOPIC}; log in {job_log.name})", run_job)
        values = progress.step(f"reading {OUTPUT_TOPIC} with a read_committed consumer",
                               lambda: read_committed(bootstrap, OUTPUT_TOPIC))
        counts = Counter(values)
        expected = {str(i) for i in range(args.records)}
        summary = progress.step("counting the coordinator's committed batches", lambda: Summary(
            records_in=args.records, records_out=len(values), distinct_out=len(counts),
            duplicates=sum(c - 1 for c in counts.values() if c > 1), missing=len(expected - set(counts)),
            batches=committed_batches(), dashboard=f"{url}/dashboard", admin_token=token, token_file=token_file,
            job_seconds=job_seconds))
        api.http.close()
        print(summary.text(), flush=True)
        if not summary.exactly_once:
            return 1
        if args.exit:
            print("\nstopping (--exit)", flush=True)
            return 0
        print(f"\nthe coordinator ({url}) and Kafka ({bootstrap}) keep running; Ctrl-C stops both", flush=True)
        while coordinator.poll() is None and all(n.alive for n in kafka.nodes):
            time.sleep(0.5)
        raise QuickstartError(f"the coordinator or Kafka stopped on its own; logs: {log_path}, {directory / 'kafka'}")
    except KeyboardInterrupt:
        print("\nstopping ...", flush=True)
        return 0
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        if coordinator is not None and coordinator.poll() is None:
            coordinator.send_signal(signal.SIGTERM)
            try:
                coordinator.wait(30)
            except subprocess.TimeoutExpired:
                coordinator.kill()
        kafka.stop()
        print(f"stopped the coordinator and Kafka (logs in {directory})", flush=True)


def add_parser(sub: Any) -> None:
    p = sub.add_parser("quickstart", help="a local end-to-end run with real Kafka, the coordinator and Spark",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dir", default=".coordinator-quickstart", help="where everything runs (removed state first)")
    p.add_argument("--records", type=int, default=1000, help="input records (1000)")
    p.add_argument("--port", type=int, default=8000, help="the coordinator's port (8000; a free one if taken)")
    p.add_argument("--job-timeout", type=float, default=600, help="seconds the example job may take (600)")
    p.add_argument("--exit", action="store_true", help="stop everything after the summary")
    p.set_defaults(func=run)
