"""The operator dashboard's HTTP side: login, pages, operator actions. Mounted by
coordinator/http/api.py under /dashboard as its own small app (its session cookie never touches the API).

Auth: a login form takes the admin token, or the read-only viewer token
(COORDINATOR_DASHBOARD_VIEWER_TOKEN), and the operator's name. The session lives in a signed
cookie (Starlette's SessionMiddleware: itsdangerous, HttpOnly, SameSite=Strict, path /dashboard),
keyed with a secret derived from the token secret; it holds the role, the name, a fingerprint of
the token (a session ends when its token changes) and a per-session CSRF token. Actions need an
admin session, a confirmation page that says what will happen, and that page's CSRF token; each
calls the service operation with actor `dashboard:<name>`, so it lands in the event trail.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from datetime import UTC
from pathlib import Path
from typing import Any
from urllib.parse import quote

from fastapi import FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, RedirectResponse, Response
from fastapi.staticfiles import StaticFiles
from fastapi.templating import Jinja2Templates
from starlette.concurrency import run_in_threadpool
from starlette.middleware.sessions import SessionMiddleware

from ..auth import tokens_equal
from ..input import (
    AbortReason,
    AfterLeaseId,
    AttemptNumber,
    BatchId,
    InputRoute,
    OperatorName,
    Reason,
    SinkName,
    parse_as,
    parse_form,
    read_body,
)
from ...protocol import errors as e
from ...protocol.states import LeaseState
from ...service import Coordinator
from .broker_watch import BrokerWatch
from .health import Thresholds
from .views import Views, brief

HERE = Path(__file__).parent
SESSION_COOKIE = "coordinator_dashboard"
SESSION_MAX_AGE_S = 12 * 3600
REFRESH_S = 5
FORM_MAX_BYTES = 64 * 1024  # a login or an action: a token, a name, a reason


def session_secret(token_secret: bytes) -> str:
    return hmac.new(token_secret, b"dashboard-session", hashlib.sha256).hexdigest()


def _fingerprint(secret: str, token: str) -> str:
    """Ties a session to the token it logged in with (keyed: the cookie is signed, not encrypted)."""
    return hmac.new(secret.encode(), b"token:" + token.encode(), hashlib.sha256).hexdigest()[:32]


@dataclass(frozen=True)
class Operator:
    who: str
    is_admin: bool
    csrf: str

    @property
    def actor(self) -> str:
        return f"dashboard:{self.who}"


# --- actions ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Action:
    title: str
    needs: tuple[str, ...]  # of PARAMETERS' keys
    describe: Callable[[dict[str, Any]], str]  # what will happen, for the confirmation page
    perform: Callable[[Coordinator, dict[str, Any], Operator, str], str]  # -> what happened
    reason: Any = Reason  # the type of the reason the form asks for (coordinator/http/input.py)


PARAMETERS = {"sink": SinkName, "batch": BatchId, "attempt": AttemptNumber}  # the API's own types


def _abort(c: Coordinator, p: dict[str, Any], op: Operator, reason: str) -> str:
    attempt, outcome = c.abort_attempt(p["sink"], p["batch"], p["attempt"], None, reason, op.actor)
    pending = f"; still to abort on Kafka: {', '.join(outcome.pending)}" if outcome.pending else ""
    return f"attempt {attempt.number} of batch {p['batch']} is {attempt.state}; aborted transactions: " \
           f"{', '.join(outcome.aborted) or 'none'}{pending}"


def _retry_commit(c: Coordinator, p: dict[str, Any], op: Operator, reason: str) -> str:
    # resume finishes a decided commit (or answers from the record if it is finished)
    result = c.resume(p["sink"], p["batch"])
    c.record_operator_event(p["sink"], "commit_retried", op.actor, batch_id=p["batch"], reason=reason,
                            state=str(result.checkpoint.state))
    return f"batch {p['batch']} is {result.checkpoint.state}"


def _acknowledge(c: Coordinator, p: dict[str, Any], op: Operator, reason: str) -> str:
    _, acknowledged, lost = c.acknowledge_lost_data(p["sink"], op.actor, reason, op.who)
    if not acknowledged:
        return "the sink was not halted: nothing changed"
    return f"lost data of batch(es) {lost} acknowledged; the sink accepts new batches again"


def _reset_lineage(c: Coordinator, p: dict[str, Any], op: Operator, reason: str) -> str:
    sink = c.reset_lineage(p["sink"], op.actor, reason)
    return f"lineage of {sink.name} reset; generation is now {sink.generation}; the next query to start binds the sink"


def _retire(c: Coordinator, p: dict[str, Any], op: Operator, reason: str) -> str:
    sink, _ = c.retire_sink(p["sink"], op.actor, reason)
    return f"sink {sink.name} is retired; its records and event trail are kept"


ACTIONS: dict[str, Action] = {
    "abort-attempt": Action(
        "Abort an attempt", ("sink", "batch", "attempt"),
        lambda p: f"Abort attempt {p['attempt']} of batch {p['batch']} of sink {p['sink']}: the attempt becomes "
                  "ABORTED and every transaction it opened is aborted on Kafka. A driver still writing it gets 409 "
                  "and Spark replays the batch.",
        _abort, reason=AbortReason),
    "retry-commit": Action(
        "Retry a commit", ("sink", "batch"),
        lambda p: f"Finish the decided commit of batch {p['batch']} of sink {p['sink']} now: commit its winning "
                  "transactions on Kafka by resume (producer id and epoch as pre-committed) and mark it COMMITTED.",
        _retry_commit),
    "acknowledge-lost-data": Action(
        "Acknowledge lost data", ("sink",),
        lambda p: f"Acknowledge the lost data of sink {p['sink']}: its halt is cleared, new batches are accepted, "
                  "and the LOST batches are skipped when Spark replays them. Make sure the lost records were "
                  "re-delivered or are accepted as lost.",
        _acknowledge),
    "reset-lineage": Action(
        "Reset the sink's lineage", ("sink",),
        lambda p: f"Reset the lineage of sink {p['sink']}: the current driver is fenced, its open attempt aborted, "
                  "and the next Spark query to start (even from a fresh checkpoint location, whose batch ids restart "
                  "at 0) takes the sink over.",
        _reset_lineage),
    "retire-sink": Action(
        "Retire the sink", ("sink",),
        lambda p: f"Retire sink {p['sink']}: refused while anything of it may be open (an undecided attempt, a "
                  "commit unfinished on Kafka, an id that may hold a transaction). Once retired it takes no more "
                  "calls and leaves the overview; its records, event trail, name and prefix are kept.",
        _retire),
}


def _params(action: Action, raw: dict[str, str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key in action.needs:
        value = raw.get(key, "").strip()
        if not value:
            raise HTTPException(422, f"missing {key!r}: this action needs {', '.join(action.needs)}")
        try:
            out[key] = parse_as(PARAMETERS[key], value, key)
        except ValueError as exc:
            raise HTTPException(422, str(exc)) from None
    return out


# --- the app ---------------------------------------------------------------------------------


def create_dashboard(
    coordinator: Coordinator,
    *,
    admin_token: str,
    token_secret: bytes,
    viewer_token: str | None = None,
    broker: BrokerWatch | None = None,
    thresholds: Thresholds = Thresholds(),
    secure_cookie: bool = False,
) -> FastAPI:
    broker = broker or BrokerWatch(coordinator)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        try:
            yield
        finally:
            broker.close()

    # (mounted, this lifespan runs only from the parent's: coordinator/http/api.py enters it)
    app = FastAPI(docs_url=None, redoc_url=None, openapi_url=None, lifespan=lifespan)
    app.router.route_class = InputRoute  # the API's checks of path and query strings
    secret = session_secret(token_secret)
    app.add_middleware(
        SessionMiddleware, secret_key=secret, session_cookie=SESSION_COOKIE,
        max_age=SESSION_MAX_AGE_S, path="/dashboard", same_site="strict", https_only=secure_cookie,
    )
    app.mount("/static", StaticFiles(directory=HERE / "static"), name="static")
    templates = Jinja2Templates(directory=HERE / "templates")
    templates.env.filters["ts"] = lambda d: "" if d is None else d.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S")
    templates.env.filters["age"] = _age
    templates.env.filters["brief"] = brief
    templates.env.filters["num"] = lambda n: "" if n is None else f"{n:,}"
    views = Views(coordinator, broker, thresholds)
    roles = {"admin": admin_token, "viewer": viewer_token}

    def operator(request: Request) -> Operator | None:
        s = request.session
        token = roles.get(s.get("role", ""))
        if token is None or not hmac.compare_digest(s.get("fp", ""), _fingerprint(secret, token)):
            return None
        return Operator(s.get("who", "?"), s["role"] == "admin", s.get("csrf", ""))

    def base(request: Request) -> str:
        return request.scope.get("root_path", "").rstrip("/")

    def page(request: Request, template: str, op: Operator | None, status: int = 200, **context: Any) -> HTMLResponse:
        tv = request.query_params.get("tv") == "1"
        return templates.TemplateResponse(request, template, {
            "op": op, "base": base(request), "tv": tv, "refresh_s": REFRESH_S, "now": coordinator.clock.now(),
            **context,
        }, status_code=status)

    def viewer_or_login(request: Request) -> Operator | Response:
        op = operator(request)
        if op is None:
            target = request.url.path + (f"?{request.url.query}" if request.url.query else "")
            return RedirectResponse(f"{base(request)}/login?next={quote(target)}", status_code=303)
        return op

    async def form(request: Request) -> dict[str, str]:
        return parse_form(await read_body(request, FORM_MAX_BYTES))

    def admin_with_csrf(request: Request, fields: dict[str, str]) -> Operator:
        op = operator(request)
        if op is None:
            raise HTTPException(401, "log in first")
        if not op.is_admin:
            raise HTTPException(403, "actions need an admin session (log in with the admin token)")
        if not op.csrf or not hmac.compare_digest(fields.get("csrf", ""), op.csrf):
            raise HTTPException(403, "missing or wrong CSRF token: start the action again from the dashboard")
        return op

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> HTMLResponse:
        return page(request, "error.html", operator(request), exc.status_code, message=exc.detail)

    @app.exception_handler(e.ProtocolError)  # NotFound, and InputError from the input checks
    async def refused(request: Request, exc: e.ProtocolError) -> HTMLResponse:
        return page(request, "error.html", operator(request), exc.status, message=exc.message)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> HTMLResponse:
        message = "; ".join(f"{err['loc'][-1]}: {err['msg']}" for err in exc.errors())
        return page(request, "error.html", operator(request), 422, message=message)

    # --- login ----------------------------------------------------------------------------

    @app.get("/login", response_class=HTMLResponse)
    def login_form(request: Request, next: str = "") -> HTMLResponse:
        return page(request, "login.html", None, next=_safe_next(next, base(request)), error=None,
                    viewer_enabled=viewer_token is not None)

    @app.post("/login", response_class=HTMLResponse)
    async def login(request: Request) -> Response:
        fields = await form(request)
        token, who = fields.get("token", "").strip(), fields.get("operator", "").strip()
        role = next((r for r, t in roles.items() if t is not None and token and tokens_equal(token, t)), None)
        error = None
        if not who:
            error = "enter your name: it is recorded with every action you take"
        elif (bad_name := _invalid(OperatorName, who, "your name")) is not None:
            error = bad_name
        elif role is None:
            error = "wrong token: use the admin token or the dashboard viewer token"
        target = _safe_next(fields.get("next", ""), base(request))
        if error:
            return page(request, "login.html", None, 401, next=target, error=error, viewer_enabled=viewer_token is not None)
        request.session.clear()
        request.session.update(role=role, who=who, fp=_fingerprint(secret, token), csrf=secrets.token_urlsafe(32))
        return RedirectResponse(target, status_code=303)

    @app.post("/logout")
    async def logout(request: Request) -> Response:
        fields = await form(request)
        op = operator(request)
        if op is not None and hmac.compare_digest(fields.get("csrf", ""), op.csrf):
            request.session.clear()
        return RedirectResponse(f"{base(request)}/login", status_code=303)

    # --- pages ----------------------------------------------------------------------------

    @app.get("/", response_class=HTMLResponse)
    def overview(request: Request) -> Response:
        op = viewer_or_login(request)
        if isinstance(op, Response):
            return op
        return page(request, "overview.html", op, sinks=views.overview())

    @app.get("/sinks/{name}", response_class=HTMLResponse)
    def sink(request: Request, name: SinkName) -> Response:
        op = viewer_or_login(request)
        if isinstance(op, Response):
            return op
        return page(request, "sink.html", op, p=views.sink_page(name))

    @app.get("/sinks/{name}/checkpoints/{batch_id}", response_class=HTMLResponse)
    def checkpoint(request: Request, name: SinkName, batch_id: BatchId, lease_state: LeaseState | None = None,
                   after: AfterLeaseId = 0) -> Response:
        op = viewer_or_login(request)
        if isinstance(op, Response):
            return op
        return page(request, "checkpoint.html", op, p=views.checkpoint_page(name, batch_id, lease_state, after))

    # --- actions --------------------------------------------------------------------------

    def action_of(name: str) -> Action:
        action = ACTIONS.get(name)
        if action is None:
            raise HTTPException(404, f"no action {name!r}; actions: {', '.join(ACTIONS)}")
        return action

    @app.get("/actions/{name}", response_class=HTMLResponse)
    def confirm(request: Request, name: str) -> Response:
        op = viewer_or_login(request)
        if isinstance(op, Response):
            return op
        if not op.is_admin:
            raise HTTPException(403, "actions need an admin session (log in with the admin token)")
        action = action_of(name)
        params = _params(action, dict(request.query_params))
        coordinator.get_sink(params["sink"])  # 404 for an unknown sink before asking to confirm
        return page(request, "confirm.html", op, name=name, action=action, params=params,
                    description=action.describe(params))

    @app.post("/actions/{name}", response_class=HTMLResponse)
    async def act(request: Request, name: str) -> Response:
        fields = await form(request)
        op = admin_with_csrf(request, fields)
        action = action_of(name)
        params = _params(action, fields)
        reason = fields.get("reason", "").strip()
        if not reason:
            raise HTTPException(422, "give a reason: it is recorded in the event trail")
        if (bad_reason := _invalid(action.reason, reason, "the reason")) is not None:
            raise HTTPException(422, bad_reason)
        try:
            outcome = await run_in_threadpool(action.perform, coordinator, params, op, reason)
        except e.ProtocolError as exc:
            return page(request, "done.html", op, exc.status, action=action, params=params, ok=False,
                        message=f"{exc.reason}: {exc.message}")
        return page(request, "done.html", op, action=action, params=params, ok=True, message=outcome)

    return app


def _invalid(type_: Any, value: str, name: str) -> str | None:
    try:
        parse_as(type_, value, name)
    except ValueError as exc:
        return str(exc)
    return None


def _safe_next(target: str, base: str) -> str:
    """Only a path inside the dashboard (no open redirect)."""
    if target.startswith(base + "/") and not target.startswith("//") and "\\" not in target:
        return target
    return base + "/"


def _age(ms: int | None) -> str:
    if ms is None:
        return ""
    s = ms / 1000
    if s < 120:
        return f"{s:.0f} s"
    if s < 7200:
        return f"{s / 60:.0f} min"
    if s < 172800:
        return f"{s / 3600:.1f} h"
    return f"{s / 86400:.1f} d"
