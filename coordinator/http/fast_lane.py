"""A fast lane for the two calls every micro-batch makes (begin and commit, issue 12).

Through FastAPI each call costs about a millisecond of CPU on the event loop (routing, dependency
solving, parameter validation, the thread-pool hand-off through anyio), as much as the service's
own work. This ASGI layer answers the common case of the routes it is given with the same pieces
and far less machinery: it matches the route with the route's own pattern, applies the API's URL
and body checks (`check_url`, `JsonRequest`: content type, size limit), validates the path
parameters and the body with the endpoint's own annotated types (the body as below), authenticates
without I/O (the `principal` callable: the admin token or a fresh token-cache entry), then calls
the route's endpoint, so the service call and the answer's serialisation are the endpoint's. The
call runs on the event loop in a greenlet (`coordinator/on_loop.py`: its waits for Postgres are
awaited) while fewer than `on_loop_calls` do, else in a thread; one that would block the loop (a
SQLAlchemy statement, a Kafka request) rolls back and runs again in a thread. An exception the
endpoint raises is answered by the app's own handler for it (found by the exception's MRO, as
Starlette's ExceptionMiddleware does); any other is re-raised for ServerErrorMiddleware (500).

What it does not handle: anything that is not exactly that happy path before the service call (no
match, another method, a bad parameter or body, no or an unknown token, a token-cache miss, a
disconnect, anything unusual). Such a request goes to the FastAPI app unchanged, with the body
messages already read given to it again, so every refusal comes from the code that makes it.

The body is parsed and validated in one pass by pydantic's core (`model_validate_json`): a
200-partition commit (~75 KB with 8 first offsets per partition) costs the event loop ~1.3 ms so,
against ~3.3 ms through `json.loads` and a validation of the Python objects. Every body it accepts,
the API's own path (`parse_json_body`, strict JSON, then the model) accepts as the same model; it
refuses more (NaN, a byte order mark, JSON with comments...) only in ways the API refuses too, and
any body it refuses goes to the API, whose answer names the problem (tests/test_fast_lane.py sends
both apps such bodies).
FastAPI's own per-endpoint telemetry spans are not produced for the calls it answers.

Installed inside `HttpMetricsMiddleware` (which reads `scope["route"]`, set here as the router
sets it) and inside ServerErrorMiddleware."""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import functools
import inspect
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import anyio.to_thread
from fastapi import FastAPI, Request
from fastapi.routing import APIRoute
from pydantic import BaseModel, TypeAdapter
from sqlalchemy import Engine
from starlette.concurrency import run_in_threadpool
from starlette.routing import Match
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .. import on_loop
from .auth import Principal
from .input import JsonRequest, _is_json, check_url
from .metrics import CALLS_RUN_AGAIN_IN_THREAD

# Off the loop, the endpoint runs on this pool through loop.run_in_executor. On the loop or off it,
# a call holds a token of anyio's default limiter: at most as many calls at once as before
# (FastAPI's sync routes share that limiter; the database pool is sized for it). run_in_executor
# costs less CPU per hand-off than anyio's to_thread (measured under 8-24 concurrent calls on
# uvloop: 25-36 µs against 41-51 µs).
THREADS = 40

class _Lane:
    """One route served by the lane: its pattern and how to build its endpoint's arguments."""

    def __init__(self, route: APIRoute, principal_annotation: Any) -> None:
        self.route = route
        self.endpoint = route.endpoint
        self.path_params: dict[str, TypeAdapter[Any]] = {}
        self.body: tuple[str, type[BaseModel]] | None = None
        self.principal_arg: str | None = None
        for p in inspect.signature(route.endpoint).parameters.values():
            if p.name in route.param_convertors:
                self.path_params[p.name] = TypeAdapter(p.annotation)
            elif inspect.isclass(p.annotation) and issubclass(p.annotation, BaseModel) and self.body is None:
                self.body = (p.name, p.annotation)
            elif p.annotation == principal_annotation and self.principal_arg is None:
                self.principal_arg = p.name
            else:
                raise TypeError(f"the fast lane cannot give {route.path}'s endpoint its parameter {p.name!r}")
        if self.body is None or self.principal_arg is None or "name" not in self.path_params:
            raise TypeError(f"the fast lane serves endpoints that take the sink's name, a body and the principal, "
                            f"not {route.path}")


class FastLane:
    """ASGI middleware: see the module's docstring. `api.state.fast_lane` is this object (its
    `answered` and `passed_on` counts are for tests and diagnostics)."""

    def __init__(
        self,
        app: ASGIApp,
        *,
        api: FastAPI,
        endpoints: Iterable[Callable[..., Any]],
        principal_annotation: Any,
        principal: Callable[[Request, str], Awaitable[Principal | None]],
        on_loop_calls: int = 0,
    ) -> None:
        self.app = app
        wanted = list(endpoints)
        routes = [r for r in api.routes if isinstance(r, APIRoute) and r.endpoint in wanted]
        if len(routes) != len(wanted):
            raise ValueError("the fast lane's endpoints must each be one route of the app")
        self.lanes = [_Lane(r, principal_annotation) for r in routes]
        self.principal = principal
        # the app's handlers by exception class (int keys are for HTTPException statuses only;
        # Exception/500 is ServerErrorMiddleware's)
        self.handlers = {k: v for k, v in api.exception_handlers.items() if isinstance(k, type) and k is not Exception}
        self.pool = ThreadPoolExecutor(THREADS, thread_name_prefix="fast-lane")
        self.on_loop_free = on_loop_calls
        self.answered = 0
        self.passed_on = 0
        self.rerun_in_thread = 0
        api.state.fast_lane = self

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "POST":
            await self.app(scope, receive, send)
            return
        for lane in self.lanes:
            match, child_scope = lane.route.matches(scope)
            if match is Match.FULL:
                break
        else:
            await self.app(scope, receive, send)
            return
        recorded = _Recorded(receive)
        try:
            call = await self._prepare(lane, scope, child_scope, recorded)
        except Exception:  # whatever refuses or fails here, the app answers it as it does today
            call = None
        if call is None:
            self.passed_on += 1
            await self.app(scope, recorded.replay(), send)
            return
        self.answered += 1
        scope.update(child_scope)  # as the router does: the route (for the metrics), endpoint, path params
        try:
            async with _token_of(anyio.to_thread.current_default_thread_limiter()):
                response = await self._run(call)
        except Exception as exc:
            handler = next((self.handlers[c] for c in type(exc).__mro__ if c in self.handlers), None)
            if handler is None:
                raise
            request = Request(scope, receive)
            if inspect.iscoroutinefunction(handler):
                response = await handler(request, exc)
            else:
                response = await run_in_threadpool(handler, request, exc)
            if response is None:
                return
        await response(scope, receive, send)

    async def _run(self, call: Callable[[], Any]) -> Any:
        """The endpoint's call on the event loop (`on_loop`) while fewer than `on_loop_calls` run
        there, else (or when it would block the loop) in a thread."""
        if self.on_loop_free > 0:
            self.on_loop_free -= 1
            try:
                return await on_loop.run_on_loop(call)
            except on_loop.MustNotBlock:
                self.rerun_in_thread += 1  # its transaction rolled back; a retry is safe
                CALLS_RUN_AGAIN_IN_THREAD.inc()
            finally:
                self.on_loop_free += 1
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self.pool, contextvars.copy_context().run, call)

    async def _prepare(
        self, lane: _Lane, scope: Scope, child_scope: Scope, recorded: _Recorded
    ) -> Callable[[], Any] | None:
        """The endpoint call with its arguments, or None if this is not the happy path."""
        check_url(scope)
        request = JsonRequest(scope, recorded)
        if not _is_json(request.headers.get("content-type")):
            return None
        body = await request.body()  # within the API's size limit
        raw = child_scope["path_params"]
        args = {name: adapter.validate_python(raw[name]) for name, adapter in lane.path_params.items()}
        who = await self.principal(request, args["name"])
        if who is None:
            return None
        assert lane.body is not None and lane.principal_arg is not None
        body_arg, model = lane.body
        args[body_arg] = model.model_validate_json(body)
        args[lane.principal_arg] = who
        return functools.partial(lane.endpoint, **args)


def calls_on_loop_for(engine: Engine) -> int:
    """How many calls may run on the event loop at once: half the connection pool. A call holds
    at most two pooled connections at a time, so however many of them wait suspended on the loop,
    a checkout made there never waits for a connection that only one of them could give back (it
    waits, at worst, for a thread's)."""
    size = getattr(engine.pool, "size", None)
    return size() // 2 if callable(size) else 0


@contextlib.asynccontextmanager
async def _token_of(limiter: anyio.CapacityLimiter) -> AsyncIterator[None]:
    """One of the limiter's tokens, held by a borrower of its own. `async with limiter` passes
    through two cancellation checkpoints even when a token is free, one of them a turn of the event
    loop (~7 µs of a ~58 µs hand-off); a free token is taken at once here, and only a full limiter
    waits (its `acquire`)."""
    borrower = object()
    try:
        limiter.acquire_on_behalf_of_nowait(borrower)
    except anyio.WouldBlock:
        await limiter.acquire_on_behalf_of(borrower)
    try:
        yield
    finally:
        limiter.release_on_behalf_of(borrower)


class _Recorded:
    """The request's receive channel, keeping what was read so the app can be given it again."""

    def __init__(self, receive: Receive) -> None:
        self.receive = receive
        self.messages: list[Message] = []

    async def __call__(self) -> Message:
        message = await self.receive()
        self.messages.append(message)
        return message

    def replay(self) -> Receive:
        pending = deque(self.messages)

        async def receive() -> Message:
            return pending.popleft() if pending else await self.receive()

        return receive
