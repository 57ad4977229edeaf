"""Property-based fuzzing of REST API v1 from its own /openapi.json (schemathesis), through a real
uvicorn process on a real, freshly migrated Postgres (Kafka control plane `none`: no test here
is about Kafka; the recovery loop is off so only requests change the database).

Every operation, positive and negative data, with no token, a wrong token and another sink's
writer token (phase 1), then with the sink's writer token and the admin token (phase 2):
- no 5xx, no status the document does not list, answers matching their documented schema;
- negative data (violating the document) refused with a 4xx;
- every 422 read strictly (issue 50 §5): documented as the project's ErrorOut (never FastAPI's
  HTTPValidationError) and answered as exactly {"error": {"reason", "message", "detail":
  {"fields": [{"field", "message"}, ...], ...}}};
- phase 1 changes nothing: a snapshot of every table is the same before and after.
Bounded in time (FUZZ_BUDGET_S, default 40 s in all); the number of generated requests is printed.

`fuzz` is itself tested against a deliberately broken service (an unbounded integer reaching
Postgres, a write without authentication, FastAPI's own 422s): it must report all three.
"""

from __future__ import annotations

import os
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any

import pytest
import schemathesis
from fastapi import FastAPI, Header, Path as PathParam
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.core.failures import FailureGroup
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    negative_data_rejection,
    response_schema_conformance,
    status_code_conformance,
)
from sqlalchemy import create_engine, text

from fixtures.servers import ServiceProcess, uvicorn_in_thread

ADMIN = "fuzz-admin-token-5be1"
SINK = "orders"
OTHER = "zz-other"
BUDGET_S = float(os.environ.get("FUZZ_BUDGET_S", "40"))
BATCH = 10  # examples per Hypothesis run; runs repeat until the time share is spent
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance,
          negative_data_rejection]


# --- the harness -----------------------------------------------------------------------------


@dataclass
class FuzzReport:
    requests: int = 0
    statuses: Counter[int] = field(default_factory=Counter)
    per_operation: Counter[str] = field(default_factory=Counter)
    failures: list[str] = field(default_factory=list)

    def summary(self) -> str:
        return (f"{self.requests} generated requests over {len(self.per_operation)} operations; "
                f"statuses {dict(sorted(self.statuses.items()))}; {len(self.failures)} failure(s)")


def fuzz(
    base_url: str, tokens: dict[str, str | None], budget_s: float, report: FuzzReport, *,
    sink: str | None = None, avoid_sinks: tuple[str, ...] = (),
) -> None:
    """Fuzz every operation of the service's document for about `budget_s`, in positive and
    negative mode, each request with one of `tokens` (label -> bearer token, None for no header).
    Positive cases name `sink` half the time (so requests get past "no such sink"); a path never
    names one of `avoid_sinks`. Check failures are collected in `report`, not raised."""
    schema = schemathesis.openapi.from_url(f"{base_url}/openapi.json")
    operations = [r.ok() for r in schema.get_all_operations()]
    runs = [(op, mode) for op in operations for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE)
            if mode is GenerationMode.POSITIVE or len(op.path_parameters) + len(op.query) + len(op.body) > 0]
    start = time.monotonic()
    for i, (op, mode) in enumerate(runs):
        # an equal share of what is left, so a slow operation does not starve the others
        stop_at = time.monotonic() + (budget_s - (time.monotonic() - start)) / (len(runs) - i)

        @given(case=op.as_strategy(generation_mode=mode), token=st.sampled_from(sorted(tokens)), real=st.booleans())
        @settings(max_examples=BATCH, deadline=None, database=None, phases=[Phase.generate],
                  suppress_health_check=list(HealthCheck))
        def run(case: Any, token: str, real: bool) -> None:
            name = (case.path_parameters or {}).get("name")
            if name is not None and (name in avoid_sinks or (real and sink and mode is GenerationMode.POSITIVE)):
                case.path_parameters["name"] = sink
            secret = tokens[token]
            headers = {"Authorization": f"Bearer {secret}"} if secret is not None else {}
            report.requests += 1
            report.per_operation[op.label] += 1
            try:
                response = case.call(base_url=base_url, headers=headers, timeout=30)
            except Exception as exc:  # the service dropped the connection: as bad as a 500
                report.failures.append(f"{op.label} [{token}]: no answer: {type(exc).__name__}: {exc}")
                return
            report.statuses[response.status_code] += 1
            try:
                case.validate_response(response, checks=CHECKS, headers=headers)
            except (Exception, FailureGroup) as exc:  # FailureGroup: a BaseExceptionGroup
                report.failures.append(f"{op.label} [{mode.value}, {token}]: {str(exc)[:1500]}")
            wrong = strict_422(op.definition.raw["responses"], response)
            if wrong is not None:
                report.failures.append(f"{op.label} [{mode.value}, {token}]: 422 {wrong}: {response.text[:500]}")

        # batches of fresh random examples until this run's share of the budget is spent (one at least)
        failures_before = len(report.failures)
        while len(report.failures) - failures_before < 3:  # a broken operation: enough said, go on
            t0, n0 = time.monotonic(), report.requests
            try:
                run()
            except Unsatisfiable:  # negative mode for an operation with nothing to negate (no parameters)
                assert mode is GenerationMode.NEGATIVE, op.label
                break
            if os.environ.get("FUZZ_DEBUG"):
                print(f"{op.label} {mode.value}: {report.requests - n0} in {time.monotonic() - t0:.2f}s")
            if time.monotonic() >= stop_at:
                break


ERROR_OUT = {"$ref": "#/components/schemas/ErrorOut"}


def strict_422(documented: dict[str, Any], response: Any) -> str | None:
    """What is wrong with a 422 answer, read strictly (None: nothing, or not a 422): the operation
    documents it as ErrorOut, and the body is the one error format with the fields it names."""
    if response.status_code != 422:
        return None
    schema = documented.get("422", {}).get("content", {}).get("application/json", {}).get("schema")
    if schema != ERROR_OUT:
        return f"documented as {schema}, not ErrorOut"
    try:
        body = response.json()
    except ValueError:
        return "not JSON"
    if not isinstance(body, dict) or set(body) != {"error"} or not isinstance(body["error"], dict):
        return "not {\"error\": {...}}"
    error = body["error"]
    if set(error) - {"reason", "message", "detail"} or not all(
            isinstance(error.get(k), str) and error[k] for k in ("reason", "message")):
        return "error is not {reason, message, detail}"
    fields = error.get("detail", {}).get("fields") if isinstance(error.get("detail"), dict) else None
    if not isinstance(fields, list) or not fields or not all(
            isinstance(f, dict) and set(f) == {"field", "message"} and isinstance(f["field"], str)
            and isinstance(f["message"], str) and f["message"] for f in fields):
        return "error.detail.fields does not name the offending fields"
    return None


def snapshot(database_url: str) -> dict[str, list[tuple[Any, ...]]]:
    """Every row of every table of the public schema, in a stable order."""
    engine = create_engine(database_url)
    try:
        with engine.connect() as conn:
            names = conn.execute(text(
                "SELECT table_name FROM information_schema.tables WHERE table_schema = 'public' ORDER BY 1"
            )).scalars().all()
            return {n: sorted(map(tuple, conn.execute(text(f'SELECT * FROM "{n}"'))), key=repr) for n in names}
    finally:
        engine.dispose()


def changed_tables(before: dict[str, list[Any]], after: dict[str, list[Any]]) -> list[str]:
    return sorted(t for t in before.keys() | after.keys() if before.get(t) != after.get(t))


# --- the real service ------------------------------------------------------------------------


@pytest.fixture
def service(database_url: str, tmp_path: Path) -> Iterator[ServiceProcess]:
    with ServiceProcess(database_url, ADMIN, tmp_path, env={"COORDINATOR_RECOVERY_ENABLED": "false"}) as svc:
        yield svc


def seed(svc: ServiceProcess) -> tuple[str, str]:
    """A sink with a generation, an open batch with its pre-leases, one claimed (so calls reach
    past "not found"), and another sink; returns both writer tokens."""
    admin = svc.client(ADMIN)
    tokens = []
    for name, prefix in ((SINK, "orders-tx"), (OTHER, "other-tx")):
        tokens.append(admin.register_sink(name, prefix, expect=201)["writer_token"])
    w = admin.with_token(tokens[0])
    gen = w.start_generation(SINK, "query-1", "run-1")["generation"]
    assert w.begin(SINK, 0, gen, partitions=2)["pre_leased"] == 2
    w.lease(SINK, 0, 1, gen, partition=0, task_attempt_id=1)  # claims partition 0's pre-lease
    admin.close()
    return tokens[0], tokens[1]


def test_fuzz_api_from_its_openapi_document(service: ServiceProcess, database_url: str,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    writer, other_writer = seed(service)
    report = FuzzReport()

    before = snapshot(database_url)
    fuzz(service.url, {"none": None, "wrong": "wt_not-a-token", "other-sink": other_writer}, BUDGET_S * 0.5,
         report, sink=SINK, avoid_sinks=(OTHER,))
    unauthorised = report.requests
    after = snapshot(database_url)
    assert not changed_tables(before, after), f"requests without a valid token changed {changed_tables(before, after)}"

    fuzz(service.url, {"writer": writer, "admin": ADMIN}, BUDGET_S * 0.5, report, sink=SINK)
    with capsys.disabled():  # the count goes to the terminal (and CI's log) even when the test passes
        print(f"\nfuzz: {report.summary()} ({unauthorised} without a valid token)")
        for label, n in sorted(report.per_operation.items()):
            print(f"  {n:5d}  {label}")
    assert service.alive, service.log()
    assert not report.failures, "\n\n".join(report.failures[:10])
    # the runs reached the service's logic, not only its input checks
    assert report.statuses[200] + report.statuses[201] > 0 and report.statuses[403] > 0, report.summary()
    assert len(report.per_operation) == sum(1 for _ in schemathesis.openapi.from_url(
        f"{service.url}/openapi.json").get_all_operations())


# --- the harness catches what it is for ------------------------------------------------------


def broken_app(database_url: str) -> FastAPI:
    """Three deliberate bugs: an integer without an upper bound goes to a Postgres integer (a 500
    past 2^31), a write that ignores a wrong token, and FastAPI's own 422s ({"detail": [...]},
    documented as HTTPValidationError) for a path parameter out of its bounds."""
    engine = create_engine(database_url)
    app = FastAPI()

    @app.get("/things/{thing_id}", responses={404: {"description": "no such thing"}})
    def read(thing_id: Annotated[int, PathParam(ge=0)]) -> dict[str, int]:
        with engine.connect() as conn:
            conn.execute(text("SELECT CAST(:v AS integer)"), {"v": thing_id})
        return {"thing_id": thing_id}

    @app.post("/things/{thing_id}", responses={403: {"description": "wrong token"}})
    def write(thing_id: Annotated[int, PathParam(ge=0, le=1000)],
              authorization: Annotated[str | None, Header()] = None) -> dict[str, int]:
        with engine.begin() as conn:
            conn.execute(text("CREATE TABLE IF NOT EXISTS things (id integer)"))
            conn.execute(text("INSERT INTO things VALUES (:v)"), {"v": thing_id})
        return {"thing_id": thing_id}

    return app


def test_fuzz_harness_catches_a_broken_service(database_url: str) -> None:
    with uvicorn_in_thread(broken_app(database_url)) as url:
        before = snapshot(database_url)
        report = FuzzReport()
        fuzz(url, {"none": None, "wrong": "nope"}, 8, report)
        after = snapshot(database_url)
    print(f"\nbroken service: {report.summary()}")
    assert any("GET /things/{thing_id}" in f and "500" in f for f in report.failures), report.failures
    assert any(": 422 documented as" in f and "HTTPValidationError" in f for f in report.failures), report.failures
    assert changed_tables(before, after) == ["things"], "the unauthenticated write went unnoticed"


def test_the_strict_422_check_refuses_every_other_shape() -> None:
    """strict_422 on answers the service must never give: each broken variant is named."""
    import httpx

    documented = {"422": {"content": {"application/json": {"schema": ERROR_OUT}}}}
    good = {"error": {"reason": "invalid_request", "message": "x: bad", "detail": {"fields": [
        {"field": "x", "message": "bad"}]}}}

    def check(body: Any, responses: dict[str, Any] = documented, status: int = 422) -> str | None:
        return strict_422(responses, httpx.Response(status, json=body))

    assert check(good) is None and check({"anything": 1}, status=409) is None
    fastapi_own = {"422": {"content": {"application/json": {"schema": {
        "$ref": "#/components/schemas/HTTPValidationError"}}}}}
    assert "HTTPValidationError" in (check(good, fastapi_own) or "")
    assert check(good, {}) is not None  # not documented at all
    for broken in ({"detail": [{"loc": ["body", "x"], "msg": "bad", "type": "value_error"}]},
                   {"error": {"reason": "invalid_request", "message": "x"}},  # no fields
                   {"error": {"reason": "invalid_request", "message": "x", "detail": {"fields": []}}},
                   {"error": {"reason": "", "message": "x", "detail": good["error"]["detail"]}},
                   {"error": {**good["error"], "extra": 1}},
                   {"error": good["error"], "detail": []},
                   {"error": {**good["error"], "detail": {"fields": [{"field": "x"}]}}}):
        assert check(broken) is not None, broken
