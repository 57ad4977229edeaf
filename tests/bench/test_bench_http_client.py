"""The protocol benchmark's HTTP client (bench/protocol_clients.py, HttpSink), against a real HTTP/1.1
server on a socket: it speaks HTTP on a plain socket, so these check what http.client did for it
(keep-alive, answers read by their length, a connection the server closed, error answers)."""

from __future__ import annotations

import json
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from fixtures.servers import REPO_ROOT

sys.path.insert(0, str(REPO_ROOT / "bench"))

from protocol_clients import HttpSink, Rejected  # noqa: E402


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive unless a side closes
    server: _Server

    def do_POST(self) -> None:  # noqa: N802 - http.server's name
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.server.requests.append((self.path, self.headers["Authorization"], body))
        mode = self.server.mode
        status, answer = (409, {"error": {"reason": "generation_fenced", "message": "fenced"}}) if mode == "refuse" \
            else (200, {"generation": len(self.server.requests), "echo": body})
        raw = json.dumps(answer).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(raw)))
        if mode == "close":
            self.send_header("Connection", "close")
        self.end_headers()
        # written in two parts: the client reads an answer by its length, whatever the segments
        self.wfile.write(raw[:5])
        self.wfile.flush()
        self.wfile.write(raw[5:])
        if mode == "drop":  # closes after answering without saying so, as an idle keep-alive timeout does
            self.close_connection = True

    def setup(self) -> None:
        super().setup()
        self.server.connections += 1

    def log_message(self, *args: object) -> None:
        pass


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.requests: list[tuple[str, str, object]] = []
        self.connections = 0
        self.mode = "keep"


@pytest.fixture
def server() -> Iterator[_Server]:
    s = _Server()
    t = threading.Thread(target=s.serve_forever, daemon=True)
    t.start()
    yield s
    s.shutdown()
    s.server_close()


def _sink(server: _Server) -> HttpSink:
    host, port = server.server_address[:2]
    return HttpSink(f"http://{host}:{port}", "orders", "tok")


def test_calls_share_one_keep_alive_connection_and_read_each_answer_whole(server: _Server) -> None:
    sink = _sink(server)
    big = "x" * 200_000  # an answer longer than one read
    for i in range(3):
        answer = sink._post("/generations", {"query_id": big if i == 1 else "q", "run_id": str(i)})
        assert answer["generation"] == i + 1
        assert answer["echo"]["run_id"] == str(i)
    assert server.connections == 1
    assert [(p, auth) for p, auth, _ in server.requests] == [("/v1/sinks/orders/generations", "Bearer tok")] * 3
    assert server.requests[1][2] == {"query_id": big, "run_id": "1"}
    sink.close()


def test_a_connection_the_server_closed_is_opened_again_and_the_call_retried(server: _Server) -> None:
    sink = _sink(server)
    server.mode = "drop"
    assert sink.start_generation("q", "r1") == 1
    server.mode = "keep"
    assert sink.start_generation("q", "r2") == 2  # its first try finds the connection closed
    assert server.connections == 2
    assert len(server.requests) == 2  # the closed connection got nothing to answer


def test_an_answer_with_connection_close_ends_the_connection(server: _Server) -> None:
    sink = _sink(server)
    server.mode = "close"
    assert sink.start_generation("q", "r1") == 1
    assert sink._local.connection is None  # dropped at once, not found closed by the next call
    assert sink.start_generation("q", "r2") == 2
    assert server.connections == 2


def test_an_error_answer_is_rejected_with_its_reason(server: _Server) -> None:
    sink = _sink(server)
    server.mode = "refuse"
    with pytest.raises(Rejected) as refused:
        sink.start_generation("q", "r1")
    assert refused.value.reason == "generation_fenced"
