"""What the routes depend on: the coordinator of the app, and who calls (the admin token, or a
sink's writer token). Without the admin token, an unknown sink, a retired one and another sink's
are refused alike (403): the answer does not tell which names exist."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Annotated

from fastapi import Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from starlette.concurrency import run_in_threadpool

from ..protocol import errors as e
from ..service import Coordinator
from .auth import Principal, tokens_equal, writer_token
from .input import SinkName

bearer_scheme = HTTPBearer(
    auto_error=False, description="the admin token, or a sink's writer token for that sink's protocol calls and reads"
)


@dataclass
class Tokens:
    """The admin token, the writer tokens' secret, and the writer tokens this process computed
    (name -> (when, sink id, token)), kept a few seconds so a protocol call needs no database round
    trip to authenticate. A rotation in this process forgets its entry at once, others' after ttl_s."""

    admin: str
    secret: bytes
    ttl_s: float = 5.0

    def __post_init__(self) -> None:
        self._cache: dict[str, tuple[float, str]] = {}

    def cached(self, name: str) -> str | None:
        hit = self._cache.get(name)
        return hit[1] if hit is not None and time.monotonic() - hit[0] < self.ttl_s else None

    def writer(self, coordinator: Coordinator, name: str) -> str | None:
        """The sink's writer token (None for an unknown sink); reads the database on a cache miss."""
        hit = self.cached(name)
        if hit is not None:
            return hit
        try:
            sink = coordinator.get_sink(name, retired=True)  # a retired sink's token is compared too (403 first)
        except e.NotFound:
            return None
        token = writer_token(self.secret, sink.id, sink.writer_token_version)
        self._cache[name] = (time.monotonic(), token)
        return token

    def forget(self, name: str) -> None:
        self._cache.pop(name, None)


# The dependencies are coroutines: FastAPI would run a plain function in its thread pool, a hand-off
# per dependency and call; only a writer token missing from the cache reads the database (in a thread).

async def coordinator_of(request: Request) -> Coordinator:
    return request.app.state.coordinator  # type: ignore[no-any-return]


async def tokens_of(request: Request) -> Tokens:
    return request.app.state.tokens  # type: ignore[no-any-return]


async def bearer(credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(bearer_scheme)]) -> str:
    if credentials is None:
        raise Unauthorized()
    return credentials.credentials.strip()


async def admin(token: Annotated[str, Depends(bearer)], tokens: Annotated[Tokens, Depends(tokens_of)]) -> Principal:
    if not tokens_equal(token, tokens.admin):
        raise Forbidden("this action needs the admin token")
    return Principal(is_admin=True)


async def writer(name: SinkName, token: Annotated[str, Depends(bearer)], tokens: Annotated[Tokens, Depends(tokens_of)],
           coordinator: Annotated[Coordinator, Depends(coordinator_of)]) -> Principal:
    """The sink's writer token, or the admin token."""
    if tokens_equal(token, tokens.admin):
        return Principal(is_admin=True)
    expected = tokens.cached(name) or await run_in_threadpool(tokens.writer, coordinator, name)
    if expected is None or not tokens_equal(token, expected):
        raise Forbidden("the token is neither the admin token nor this sink's writer token")
    return Principal(is_admin=False, sink_name=name)


Admin = Annotated[Principal, Depends(admin)]
Writer = Annotated[Principal, Depends(writer)]
Service = Annotated[Coordinator, Depends(coordinator_of)]
TokenKeeper = Annotated[Tokens, Depends(tokens_of)]


class Unauthorized(e.ProtocolError):
    status = 401

    def __init__(self) -> None:
        super().__init__("unauthenticated", "send `Authorization: Bearer <token>`")


class Forbidden(e.ProtocolError):
    status = 403

    def __init__(self, message: str) -> None:
        super().__init__("forbidden", message)
