"""A fault-injecting TCP proxy in front of the real Kafka broker (tests/real_kafka.py starts
one per broker, on the port its PROXIED listener advertises, so every connection of a client that
bootstraps from `RealKafka.proxied_bootstrap` -- bootstrap, coordinator, leader -- goes through it).

It forwards everything and counts requests per api key; on request it
- drops the answer of a request the broker applied (`action="drop"`: a lost answer, the
  connection dies with it),
- holds a request until `release()` (`action="hold"`: a request delayed in the network; never
  forwarded if the client gives up first), or delays it by `delay_s` (`action="delay"`),
- answers a request itself with a Kafka error code (`action="error"`, encoded with kafka-python's
  protocol classes) for the transient answers a healthy single broker rarely sends on cue
  (CONCURRENT_TRANSACTIONS, NOT_COORDINATOR, COORDINATOR_LOAD_IN_PROGRESS, ...). The refusals
  (fenced, wrong producer id, unknown id, timed out) come from the real broker in the tests, not
  from here.
"""

from __future__ import annotations

import socket
import struct
import threading
import time
from collections import Counter, deque
from dataclasses import dataclass
from typing import Any

API_FIND_COORDINATOR = 10
API_INIT_PRODUCER_ID = 22
API_END_TXN = 26

_DROP = object()


@dataclass
class _Rule:
    api_key: int
    action: str  # "error": answer with error_code instead of forwarding; "drop": forward, lose the answer;
    # "hold": forward only after release(); "delay": forward after delay_s
    error_code: int
    remaining: int
    delay_s: float = 0.0


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
        self.refuse_connections = False
        threading.Thread(target=self._accept, name="kafka-proxy-accept", daemon=True).start()

    def inject(self, api_key: int, *, error_code: int = 0, times: int = 1, action: str = "error",
               delay_s: float = 0.0) -> None:
        # "hold": keep the request (never forwarded) until release(); dropped if the client goes away
        assert action in ("error", "drop", "hold", "delay")
        if action == "hold":
            self._release.clear()
        with self._lock:
            self._rules.append(_Rule(api_key, action, error_code, times, delay_s))

    def clear(self) -> None:
        with self._lock:
            self._rules.clear()
            self.refuse_connections = False
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
            if self.refuse_connections:  # as if nothing listened at the advertised address
                _close(client)
                continue
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
                elif rule is not None and rule.action == "delay":
                    time.sleep(rule.delay_s)  # this connection's later requests wait behind it, as on a slow link
                    rule = None
                with self.lock:
                    if rule is not None and rule.action == "error":
                        answer = _error_response(api_key, version, correlation_id, rule.error_code, frame[4:])
                        self.pending.append([correlation_id, answer])
                        self._flush_injected()
                        continue
                    self.pending.append([correlation_id, _DROP if rule is not None else None])
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

