"""Bad input never reaches a 500 (issue 17), one test per class, through a real uvicorn process on a
real Postgres: integers beyond what their columns hold, NUL, lone surrogates and invalid UTF-8 in
bodies, paths and query strings, bodies that are not UTF-8 / not JSON / too deep / too large / hold
huge numbers, the statuses the OpenAPI document lists, and one answer for "no such sink" and
"not your sink". Every refusal is checked to be in the one error format and documented."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy import text

from coordinator.http.input import MAX_BODY_BYTES
from coordinator.http.schemas import CommitRequest
from coordinator.protocol.model import FIRST_OFFSETS_KEPT, PartitionResult, PrecommitRecord
from coordinator.store.db import make_engine
from fixtures.postgres import migrated_database
from fixtures.servers import ServiceProcess

ADMIN = "input-admin-token-93c1"
SINK, OTHER = "orders", "payments"
I32, I64 = 2**31, 2**63  # one past the largest Postgres integer / bigint


@dataclass
class World:
    url: str
    doc: dict[str, Any]
    writer: str  # SINK's writer token
    other_writer: str
    generation: int
    lease_id: int
    http: httpx.Client

    def call(self, method: str, path: str, body: Any = None, *, token: str | None = None,
             content: bytes | None = None, headers: dict[str, str] | None = None) -> httpx.Response:
        h = {"Authorization": f"Bearer {token or self.writer}", **(headers or {})}
        if content is not None:
            h.setdefault("Content-Type", "application/json")
            return self.http.request(method, path, content=content, headers=h)
        return self.http.request(method, path, json=body, headers=h)


@pytest.fixture(scope="module")
def world(postgres_server_url: str, template_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    with migrated_database(postgres_server_url, "input") as url, ServiceProcess(
        url, ADMIN, tmp_path_factory.mktemp("input"), env={"COORDINATOR_RECOVERY_ENABLED": "false"}
    ) as svc:
        admin = svc.client(ADMIN)
        writer = admin.with_token(admin.register_sink(SINK, "orders-tx", expect=201)["writer_token"])
        other = admin.register_sink(OTHER, "payments-tx", expect=201)["writer_token"]
        gen = writer.start_generation(SINK, "query-1", "run-1")["generation"]
        writer.begin(SINK, 0, gen)
        lease = writer.lease(SINK, 0, 1, gen, partition=0, task_attempt_id=1)
        with httpx.Client(base_url=svc.url, timeout=60) as http:
            doc = http.get("/openapi.json").json()
            yield World(svc.url, doc, writer.token or "", other, gen, lease["lease_id"], http)
        admin.close()
        assert svc.alive, svc.log()
        assert "Traceback" not in svc.log(10_000), svc.log(200)


def operation_of(doc: dict[str, Any], method: str, path: str) -> dict[str, Any]:
    """The document's operation whose template matches this concrete path."""
    path = path.split("?")[0]
    for template, ops in doc["paths"].items():
        if re.fullmatch(re.sub(r"\{[^}]+\}", "[^/]+", template), path) and method.lower() in ops:
            return ops[method.lower()]
    raise AssertionError(f"{method} {path} is not in the OpenAPI document")


def refused(w: World, resp: httpx.Response, method: str, path: str, status: int, reason: str) -> dict[str, Any]:
    """The answer is `status` in the one error format with `reason`, and the document lists it."""
    assert resp.status_code == status, f"{method} {path}: expected {status}, got {resp.status_code}: {resp.text}"
    body = resp.json()
    assert set(body) == {"error"} and {"reason", "message"} <= set(body["error"]), body
    assert body["error"]["reason"] == reason, body
    assert isinstance(body["error"]["message"], str) and body["error"]["message"], body
    responses = operation_of(w.doc, method, path)["responses"]
    assert str(status) in responses, f"{method} {path} answered {status}, documented {sorted(responses)}"
    assert responses[str(status)]["content"]["application/json"]["schema"] == {"$ref": "#/components/schemas/ErrorOut"}
    return body["error"]


def invalid_field(w: World, resp: httpx.Response, method: str, path: str, field: str) -> str:
    err = refused(w, resp, method, path, 422, "invalid_request")
    fields = {f["field"]: f["message"] for f in err["detail"]["fields"]}
    assert field in fields, err
    return fields[field]


# --- integers --------------------------------------------------------------------------------


def lease_path(batch: int = 0, attempt: int = 1) -> str:
    return f"/v1/sinks/{SINK}/checkpoints/{batch}/attempts/{attempt}/leases"


def test_integers_beyond_their_columns_are_refused_naming_the_field(world: World) -> None:
    w, gen, lid = world, world.generation, world.lease_id
    lease = {"generation": gen, "partition": 0, "task_attempt_id": 1}
    record = {"partition": 0, "lease_id": lid, "task_attempt_id": 1, "producer_id": 1, "producer_epoch": 0,
              "records": 1, "bytes": 1}
    commit = f"/v1/sinks/{SINK}/checkpoints/0/attempts/1/commit"
    cases: list[tuple[str, str, Any, str]] = [
        ("POST", f"/v1/sinks/{SINK}/checkpoints/{I64}/begin", {"generation": gen}, "batch_id"),
        ("POST", f"/v1/sinks/{SINK}/checkpoints/-1/begin", {"generation": gen}, "batch_id"),
        ("POST", f"/v1/sinks/{SINK}/checkpoints/0/begin", {"generation": I32}, "generation"),
        ("POST", f"/v1/sinks/{SINK}/checkpoints/0/begin", {"generation": gen, "partitions": I32}, "partitions"),
        ("POST", lease_path(attempt=I32), lease, "attempt"),
        ("POST", lease_path(), {**lease, "partition": I32}, "partition"),
        ("POST", lease_path(), {**lease, "task_attempt_id": I64}, "task_attempt_id"),
        *[("POST", commit, {"generation": gen, "partitions": [{**record, k: v}]}, f"partitions.0.{k}") for k, v in (
            ("lease_id", I64), ("task_attempt_id", I64), ("records", I64), ("bytes", I64), ("write_ms", I64),
            ("producer_id", I64), ("producer_epoch", 2**15))],
        ("POST", commit, {"generation": gen, "partitions": [record], "job_ms": I64}, "job_ms"),
        ("GET", f"/v1/sinks/{SINK}/events?after_id={I64}", None, "after_id"),
        ("GET", f"/v1/sinks/{SINK}/events?batch_id={I64}", None, "batch_id"),
        ("GET", f"/v1/sinks/{SINK}/checkpoints?before_batch={I64}", None, "before_batch"),
        ("GET", f"/v1/sinks/{SINK}/checkpoints/{I64}", None, "batch_id"),
        ("POST", "/v1/sinks", {"name": "n", "transactional_id_prefix": "n", "bootstrap_servers": "k:9",
                               "commit_margin_ms": I32}, "commit_margin_ms"),
        ("POST", "/v1/sinks", {"name": "n", "transactional_id_prefix": "n", "bootstrap_servers": "k:9",
                               "max_pool_size": I32}, "max_pool_size"),
    ]
    for method, path, body, field in cases:
        token = ADMIN if path == "/v1/sinks" else None
        invalid_field(w, w.call(method, path, body, token=token), method, path, field)


def test_a_commits_partitions_become_the_records_the_rules_read() -> None:
    """CommitRequest.results() builds the records the rules read, with and without a pre-commit
    record and its optional fields; the coordinator keeps the first FIRST_OFFSETS_KEPT offsets."""
    body = {"generation": 3, "partitions": [
        {"partition": 0, "lease_id": None},
        {"partition": 1, "lease_id": 11, "task_attempt_id": 4, "producer_id": 7, "producer_epoch": 2, "records": 5,
         "bytes": 50},
        {"partition": 2, "lease_id": 12, "task_attempt_id": 0, "producer_id": 8, "producer_epoch": 0, "records": 1,
         "bytes": 9, "write_ms": 40, "first_offsets": [["t", 0, 5], ["u", 3, 0]]},
        {"partition": 3, "lease_id": 13, "task_attempt_id": 9, "producer_id": 9, "producer_epoch": 0, "records": 1,
         "bytes": 9, "first_offsets": [["t", p, p] for p in range(FIRST_OFFSETS_KEPT + 3)]},
    ]}
    assert CommitRequest.model_validate_json(json.dumps(body)).results() == [
        PartitionResult(0, None, None),
        PartitionResult(1, 11, PrecommitRecord(4, 7, 2, 5, 50, None, None)),
        PartitionResult(2, 12, PrecommitRecord(0, 8, 0, 1, 9, 40, [("t", 0, 5), ("u", 3, 0)])),
        PartitionResult(3, 13, PrecommitRecord(9, 9, 0, 1, 9, None, [("t", p, p) for p in range(FIRST_OFFSETS_KEPT)])),
    ]


def test_a_commits_partitions_are_checked_whole_naming_the_partition(world: World) -> None:
    """Each refusal of a commit's partition names it (and an unknown field is refused, not
    dropped): a winner comes with its whole record, an empty partition with none."""
    w, gen, lid = world, world.generation, world.lease_id
    path = f"/v1/sinks/{SINK}/checkpoints/0/attempts/1/commit"
    record = {"task_attempt_id": 1, "producer_id": 7, "producer_epoch": 0, "records": 3, "bytes": 30}
    empty = {"partition": 0, "lease_id": None}
    cases: list[tuple[dict[str, Any], str, str]] = [
        ({"partition": 1, "lease_id": lid, **record, "bytes": None}, "partitions.1", "a winning lease comes with "
         "its whole pre-commit record: task_attempt_id, producer_id, producer_epoch, records and bytes"),
        ({"partition": 1, "lease_id": lid, **record, "task_attempt_id": None}, "partitions.1", "a winning lease comes "
         "with its whole pre-commit record"),
        ({"partition": 1, "lease_id": None, **record}, "partitions.1", "an empty partition (lease_id null) has no "
         "pre-commit record"),
        ({"partition": 1, "lease_id": lid, **record, "oops": 1}, "partitions.1.oops", "Extra inputs are not permitted"),
        ({"partition": 1, "lease_id": lid, **record, "first_offsets": [["bad topic", 0, 1]]},
         "partitions.1.first_offsets.0.0", "String should match pattern"),
    ]
    for partition, field, says in cases:
        body = {"generation": gen, "partitions": [empty, partition]}
        assert says in invalid_field(w, w.call("POST", path, body), "POST", path, field), (partition, field)


def test_the_largest_values_storage_holds_are_accepted(world: World) -> None:
    w = world
    top = I64 - 1
    assert w.call("GET", f"/v1/sinks/{SINK}/events?after_id={top}&batch_id=0").json() == []
    assert w.call("GET", f"/v1/sinks/{SINK}/checkpoints?before_batch={top}").status_code == 200
    begun = w.call("POST", f"/v1/sinks/{SINK}/checkpoints/{top}/begin", {"generation": w.generation})
    assert begun.status_code == 200 and begun.json()["batch_id"] == top, begun.text
    attempt = begun.json()["attempt"]
    lease = w.call("POST", lease_path(top, attempt),
                   {"generation": w.generation, "partition": 0, "task_attempt_id": top})
    assert lease.status_code == 200 and lease.json()["task_attempt_id"] == top, lease.text
    done = w.call("POST", f"/v1/sinks/{SINK}/checkpoints/{top}/attempts/{attempt}/commit", {
        "generation": w.generation, "job_ms": top, "partitions": [{
            "partition": 0, "lease_id": lease.json()["lease_id"], "task_attempt_id": top, "producer_id": top,
            "producer_epoch": 2**15 - 1, "records": top, "bytes": top, "write_ms": top,
            "first_offsets": [["out", I32 - 1, top]]}]})
    assert done.status_code == 200 and done.json()["state"] == "COMMITTED", done.text
    assert [(c["producer_id"], c["producer_epoch"], c["records"], c["bytes"]) for c in done.json()["committed"]] == [
        (top, 2**15 - 1, top, top)]
    (stored,) = w.call("GET", f"/v1/sinks/{SINK}/checkpoints/{top}").json()["leases"]
    assert (stored["task_attempt_id"], stored["records"], stored["bytes"], stored["write_ms"]) == (top, top, top, top)


# --- NUL, lone surrogates, invalid UTF-8 -----------------------------------------------------


def text_cases(w: World, bad: str) -> list[tuple[str, str, Any, str, str | None]]:
    reg = {"name": "n1", "transactional_id_prefix": "n1", "bootstrap_servers": "k:9", "check_broker": False}
    return [
        ("POST", "/v1/sinks", {**reg, "bootstrap_servers": f"k{bad}:9"}, "bootstrap_servers", ADMIN),
        ("POST", "/v1/sinks", {**reg, "topics": [f"t{bad}"]}, "topics.0", ADMIN),
        ("POST", "/v1/sinks", {**reg, "transactional_id_prefix": f"p{bad}"}, "transactional_id_prefix", ADMIN),
        ("POST", f"/v1/sinks/{SINK}/lineage/reset", {"reason": f"moved{bad}"}, "reason", ADMIN),
        ("POST", f"/v1/sinks/{SINK}/lost-data/acknowledge", {"reason": "r", "operator": f"a{bad}"}, "operator", ADMIN),
        ("POST", f"/v1/sinks/{SINK}/checkpoints/0/attempts/1/abort",
         {"generation": w.generation, "reason": f"gone{bad}"}, "reason", None),
        ("POST", f"/v1/sinks/{SINK}/generations", {"query_id": f"q{bad}", "run_id": "r"}, "query_id", None),
    ]


@pytest.mark.parametrize("bad,says", [("\x00", "NUL"), ("\ud800", "surrogate")], ids=["nul", "lone-surrogate"])
def test_text_with_nul_or_a_lone_surrogate_is_refused_in_bodies(world: World, bad: str, says: str) -> None:
    w = world
    for method, path, body, field, token in text_cases(w, bad):
        content = json.dumps(body).encode()  # ensure_ascii: the surrogate travels as \\ud800
        message = invalid_field(w, w.call(method, path, content=content, token=token), method, path, field)
        assert says in message, (field, message)
    # a topic of a commit's first offsets: refused by its pattern (Kafka's legal characters) or, a lone
    # surrogate, as not text
    path = f"/v1/sinks/{SINK}/checkpoints/0/attempts/1/commit"
    commit = {"generation": w.generation, "partitions": [{
        "partition": 0, "lease_id": w.lease_id, "task_attempt_id": 1, "producer_id": 1, "producer_epoch": 0,
        "records": 1, "bytes": 1, "first_offsets": [["out", 0, 1], [f"t{bad}", 0, 1]]}]}
    message = invalid_field(w, w.call("POST", path, content=json.dumps(commit).encode()), "POST", path,
                            "partitions.0.first_offsets.1.0")
    assert ("pattern" if says == "NUL" else "unicode") in message, message
    # in a field's name too (the answer cannot echo it raw: it would not encode)
    content = json.dumps({"generation": 1, f"x{bad}": 1}).encode()
    refused(w, w.call("POST", f"/v1/sinks/{SINK}/checkpoints/0/begin", content=content), "POST",
            f"/v1/sinks/{SINK}/checkpoints/0/begin", 422, "invalid_request")
    # nothing was written: the sink and its events are as before
    sinks = {s["name"]: s for s in w.call("GET", "/v1/sinks", token=ADMIN).json()}
    assert "n1" not in sinks and sinks[SINK]["bootstrap_servers"] == "kafka-1:9092"


def test_nul_and_invalid_utf8_in_paths_and_query_strings_are_refused(world: World) -> None:
    w = world
    invalid_field(w, w.call("GET", "/v1/sinks/ord%00ers"), "GET", "/v1/sinks/x", "name")
    invalid_field(w, w.call("GET", f"/v1/sinks/{SINK}/events?batch_id=1%00"), "GET", f"/v1/sinks/{SINK}/events",
                  "batch_id")
    invalid_field(w, w.call("GET", f"/v1/sinks/{SINK}/checkpoints?state=OPEN%00"), "GET",
                  f"/v1/sinks/{SINK}/checkpoints", "state")
    # a UTF-8-encoded surrogate (ED A0 80) and a stray byte are not UTF-8 at all
    for path in ("/v1/sinks/%ED%A0%80", "/v1/sinks/ord%FFers", f"/v1/sinks/{SINK}/events?after_id=%FF"):
        err = refused(w, w.call("GET", path), "GET", path, 422, "invalid_url_encoding")
        assert "not UTF-8" in err["message"]


# --- bodies ----------------------------------------------------------------------------------


def test_every_body_error_has_its_own_reason_in_the_one_format(world: World) -> None:
    w = world
    path = f"/v1/sinks/{SINK}/checkpoints/0/begin"
    deep = b'{"generation": ' + b"[" * 40 + b"1" + b"]" * 40 + b"}"
    cases = [
        (b'\xff\xfe{"generation": 1}', 422, "body_not_utf8"),
        (b'{"generation": 1,', 422, "body_not_json"),
        (b'{"generation": NaN}', 422, "body_not_json"),
        (b'{"generation": Infinity}', 422, "body_not_json"),
        (deep, 422, "body_too_deep"),
        (b"[" * 100_000 + b"]" * 100_000, 422, "body_too_deep"),
        (b'{"generation": 1' + b"0" * 5000 + b"}", 422, "body_number_too_large"),
        (b'{"generation": 1e400}', 422, "body_number_too_large"),
        (b'{"generation": ' + b"1" * (9 * 1024 * 1024) + b"}", 413, "body_too_large"),
    ]
    for content, status, reason in cases:
        err = refused(w, w.call("POST", path, content=content), "POST", path, status, reason)
        if status == 422:
            assert err["detail"]["fields"][0]["field"] == "body", err
    # issue 13 item 7: not JSON says so, with line and column, not a byte offset as the field name
    err = refused(w, w.call("POST", path, content=b'{"generation": 1, oops}'), "POST", path, 422, "body_not_json")
    assert err["message"].startswith("the body is not JSON: ") and "line 1 column 19" in err["message"], err
    assert (err["detail"]["line"], err["detail"]["column"], err["detail"]["offset"]) == (1, 19, 18)
    # streamed without a Content-Length, the limit still holds
    chunks = (b"[" + b"1," * 500_000 for _ in range(10))
    resp = w.http.post(path, content=chunks, headers={"Authorization": f"Bearer {w.writer}",
                                                      "Content-Type": "application/json"})
    refused(w, resp, "POST", path, 413, "body_too_large")
    # a body sent as something else than JSON
    resp = w.call("POST", path, content=b'{"generation": 1}', headers={"Content-Type": "text/plain"})
    refused(w, resp, "POST", path, 415, "unsupported_media_type")
    # no body at all: the missing body is the field
    resp = w.http.post(path, headers={"Authorization": f"Bearer {w.writer}"})
    refused(w, resp, "POST", path, 422, "invalid_request")


# --- statuses --------------------------------------------------------------------------------


def test_the_body_limit_grows_with_the_widest_attempt_so_its_commit_fits(
    postgres_server_url: str, template_url: str, tmp_path: Path
) -> None:
    """A service taking attempts of up to 20,000 partitions takes a commit body past the default
    8 MiB limit: 13,000 winners with their records, each with four first offsets of a 100-character
    topic name (~9 MB), commit. (At the default 4,096 partitions a 9 MiB body is 413: above.)"""
    topic = "t" * 100
    with migrated_database(postgres_server_url, "wide") as url, ServiceProcess(
        url, ADMIN, tmp_path, env={"COORDINATOR_RECOVERY_ENABLED": "false", "COORDINATOR_MAX_PARTITIONS": "20000"}
    ) as svc:
        admin = svc.client(ADMIN)
        registered = admin.register_sink(SINK, "orders-tx", transaction_timeout_ms=300_000, expect=201)
        writer = admin.with_token(registered["writer_token"])
        gen = writer.start_generation(SINK, "query-1", "run-1")["generation"]
        with httpx.Client(base_url=svc.url, timeout=300,
                          headers={"Authorization": f"Bearer {writer.token}"}) as http:
            begun = http.post(f"/v1/sinks/{SINK}/checkpoints/0/begin", json={"generation": gen, "partitions": 13_000})
            assert begun.status_code == 200 and begun.json()["pre_leased"] == 13_000, begun.text[:500]
            # each partition's first try claims its pre-lease (task attempt id = partition): one
            # statement here instead of 13,000 lease calls, which this test is not about
            engine = make_engine(url, pool_size=1)
            try:
                with engine.begin() as conn:
                    claimed = conn.execute(text(
                        "UPDATE leases SET state = 'LEASED', task_attempt_id = partition "
                        "WHERE state = 'PRELEASED' RETURNING id, partition")).all()
            finally:
                engine.dispose()
            assert len(claimed) == 13_000
            body = json.dumps({"generation": gen, "partitions": [
                {"partition": partition, "lease_id": lease_id, "task_attempt_id": partition,
                 "producer_id": 10**6 + partition, "producer_epoch": 7, "records": 1000, "bytes": 10**6,
                 "write_ms": 1000, "first_offsets": [[topic, k, 10**9 + k] for k in range(4)]}
                for lease_id, partition in claimed]}).encode()
            assert len(body) > MAX_BODY_BYTES
            answer = http.post(f"/v1/sinks/{SINK}/checkpoints/0/attempts/{begun.json()['attempt']}/commit",
                               content=body, headers={"Content-Type": "application/json"})
            assert answer.status_code == 200, answer.text[:500]
            assert answer.json()["state"] == "COMMITTED" and len(answer.json()["committed"]) == 13_000
        admin.close()


def test_the_depth_check_reads_the_nesting_of_any_json_document_from_its_bytes() -> None:
    # compared with a walk of the parsed value, on documents whose strings hold brackets, quotes
    # and backslashes (which must not count)
    import random

    from coordinator.http.input import depth_exceeds

    def depth(v: Any) -> int:
        children = v.values() if isinstance(v, dict) else v if isinstance(v, list) else ()
        return 1 + max(map(depth, children), default=0) if isinstance(v, dict | list) else 0

    rng = random.Random(7)
    pieces = ["[", "]", "{", "}", '"', "\\", '\\"', "x", "[]", "é", "\n", '""', '"[']

    def value(level: int) -> Any:
        kind = rng.randrange(5 if level < 9 else 3)
        if kind == 0:
            return rng.randrange(-5, 1000)
        if kind in (1, 2):
            return "".join(rng.choice(pieces) for _ in range(rng.randrange(6)))
        if kind == 3:
            return [value(level + 1) for _ in range(rng.randrange(4))]
        return {"".join(rng.choice(pieces) for _ in range(3)) + str(i): value(level + 1) for i in range(rng.randrange(4))}

    seen = set()
    for _ in range(3000):
        doc = value(0)
        raw = json.dumps(doc, ensure_ascii=rng.random() < 0.5).encode()
        d = depth(doc)
        seen.add(d)
        for limit in (max(d - 1, 0), d, d + 1):
            assert depth_exceeds(raw, limit) is (d > limit), (raw, d, limit)
    assert seen >= set(range(0, 9)), seen


def test_every_status_the_service_answers_is_documented(world: World) -> None:
    w = world
    reg = {"name": "retried", "transactional_id_prefix": "retried-tx", "bootstrap_servers": "k:9",
           "check_broker": False}
    first, again = (w.call("POST", "/v1/sinks", reg, token=ADMIN) for _ in range(2))
    assert (first.status_code, again.status_code) == (201, 200)
    assert again.json()["writer_token"] == first.json()["writer_token"]
    responses = operation_of(w.doc, "POST", "/v1/sinks")["responses"]
    assert {"200", "201", "401", "403", "409", "413", "415", "422", "503"} <= set(responses)
    assert responses["200"]["content"]["application/json"]["schema"] == {"$ref": "#/components/schemas/SinkRegistered"}
    for template, ops in w.doc["paths"].items():
        for method, op in ops.items():
            statuses = set(op["responses"])
            if "requestBody" in op:
                assert {"413", "415", "422"} <= statuses, (method, template)
            if op.get("security") or template.startswith("/v1/"):
                assert {"401", "403", "503"} <= statuses, (method, template)
            if "{name}" in template:
                assert "404" in statuses, (method, template)
            for status, answer in op["responses"].items():
                if status.startswith(("4", "5")):
                    assert answer["content"]["application/json"]["schema"]["$ref"].endswith("/ErrorOut"), (
                        method, template, status)
    assert "HTTPValidationError" not in w.doc["components"]["schemas"]
    # answers no operation documents still come in the one format
    for method, path, status, reason in (("GET", "/v1/nothing-here", 404, "not_found"),
                                         ("DELETE", "/v1/sinks", 405, "method_not_allowed")):
        resp = w.http.request(method, path)
        assert resp.status_code == status and resp.json()["error"]["reason"] == reason, resp.text


def test_every_route_documents_the_422_of_its_url_check(world: World) -> None:
    """InputRoute checks the URL before any route's handler: a query string that is not UTF-8
    once percent-decoded is refused (422 invalid_url_encoding) whatever the route, so every
    operation of the document must list that 422 (issue 50 §5: the document describes the
    answers the service gives)."""
    w = world
    answered = []
    for template, ops in w.doc["paths"].items():
        path = template.format(name=SINK, batch_id=0, attempt=1) + "?x=%FF"
        for method in ops:
            resp = w.call(method.upper(), path, token=ADMIN)
            assert resp.status_code == 422 and resp.json()["error"]["reason"] == "invalid_url_encoding", resp.text
            answered.append((method.upper(), template))
    undocumented = [(m, t) for m, t in answered if "422" not in operation_of(w.doc, m, t)["responses"]]
    assert undocumented == [], f"answered 422 without documenting it: {undocumented}"
    for method, template in answered:
        path = template.format(name=SINK, batch_id=0, attempt=1) + "?x=%FF"
        refused(w, w.call(method, path, token=ADMIN), method, path, 422, "invalid_url_encoding")


def test_a_database_that_does_not_answer_is_503(tmp_path: Path) -> None:
    down = "postgresql+psycopg://nobody@127.0.0.1:9/none?connect_timeout=2"
    with ServiceProcess(down, ADMIN, tmp_path, env={"COORDINATOR_RECOVERY_ENABLED": "false"}) as svc:
        resp = httpx.get(f"{svc.url}/v1/sinks", headers={"Authorization": f"Bearer {ADMIN}"}, timeout=60)
        assert resp.status_code == 503 and resp.json()["error"]["reason"] == "database_unavailable", resp.text


# --- one answer for "no such sink" and "not your sink" ---------------------------------------


def test_no_such_sink_and_not_your_sink_answer_alike(world: World) -> None:
    """Nor a retired one (issue 50 §4; every route: tests/http/test_api_auth.py)."""
    w = world
    retired = w.call("POST", "/v1/sinks", {"name": "retired-one", "transactional_id_prefix": "retired-tx",
                                           "bootstrap_servers": "k:9", "check_broker": False}, token=ADMIN)
    assert retired.status_code == 201, retired.text
    assert w.call("POST", "/v1/sinks/retired-one/retire", {"reason": "gone"}, token=ADMIN).status_code == 200
    for token in (w.other_writer, "wt_forged-token"):
        unknown = w.call("GET", "/v1/sinks/no-such-sink/checkpoints", token=token)
        foreign = w.call("GET", f"/v1/sinks/{SINK}/checkpoints", token=token)
        gone = w.call("GET", "/v1/sinks/retired-one/checkpoints", token=token)
        assert unknown.status_code == foreign.status_code == gone.status_code == 403
        assert unknown.json() == foreign.json() == gone.json(), (unknown.text, foreign.text, gone.text)
    own = w.call("GET", "/v1/sinks/retired-one/checkpoints", token=retired.json()["writer_token"])
    assert own.status_code == 409 and own.json()["error"]["reason"] == "sink_retired", own.text
    unknown = w.http.post("/v1/sinks/no-such-sink/checkpoints/0/begin", json={"generation": 1})
    foreign = w.http.post(f"/v1/sinks/{SINK}/checkpoints/0/begin", json={"generation": 1})
    assert unknown.status_code == foreign.status_code == 401 and unknown.json() == foreign.json()
    # the admin may know which sinks exist
    assert w.call("GET", "/v1/sinks/no-such-sink", token=ADMIN).status_code == 404


# --- the dashboard's forms and pages get the same treatment ----------------------------------


def test_dashboard_pages_and_forms_use_the_same_types(world: World) -> None:
    w = world
    before = w.call("GET", f"/v1/sinks/{SINK}/checkpoints/0").json()
    with httpx.Client(base_url=w.url, timeout=60) as page:
        r = page.post("/dashboard/login", data={"token": ADMIN, "operator": "ali\x07ce", "next": "/dashboard/"})
        assert r.status_code == 401 and "your name: String should match pattern" in r.text
        r = page.post("/dashboard/login", data={"token": ADMIN, "operator": "alice", "next": "/dashboard/"},
                      follow_redirects=False)
        assert r.status_code == 303, r.text
        for path, says in ((f"/dashboard/sinks/{SINK}/checkpoints/{I64}", "less than or equal to"),
                           ("/dashboard/sinks/ord%00ers", "NUL"),
                           ("/dashboard/sinks/ord%FFers", "not UTF-8"),
                           (f"/dashboard/actions/abort-attempt?sink={SINK}&batch={I64}&attempt=1", "batch:"),
                           (f"/dashboard/actions/abort-attempt?sink={SINK}&batch=0&attempt={I32}", "attempt:")):
            r = page.get(path)
            assert r.status_code == 422 and says in r.text and 'data-testid="error"' in r.text, (path, r.text[-800:])
        confirm = page.get(f"/dashboard/actions/abort-attempt?sink={SINK}&batch=0&attempt=1")
        csrf = re.search(r'name="csrf" value="([^"]+)"', confirm.text).group(1)  # type: ignore[union-attr]
        fields = {"csrf": csrf, "sink": SINK, "batch": "0", "attempt": "1"}
        # an abort reason longer than its column (varchar 200) was a 500; now the form says so
        r = page.post("/dashboard/actions/abort-attempt", data={**fields, "reason": "x" * 201})
        assert r.status_code == 422 and "the reason: String should have at most 200 characters" in r.text, r.text[-800:]
        r = page.post("/dashboard/actions/abort-attempt", content=f"csrf={csrf}&sink={SINK}&batch=0&attempt=1&reason=%FF",
                      headers={"Content-Type": "application/x-www-form-urlencoded"})
        assert r.status_code == 422 and "not UTF-8" in r.text
        r = page.post("/dashboard/actions/abort-attempt", data={**fields, "reason": "x" * 70_000})
        assert r.status_code == 413
    assert w.call("GET", f"/v1/sinks/{SINK}/checkpoints/0").json() == before  # none of it aborted anything
