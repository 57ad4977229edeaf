"""Input at the HTTP edge, one place for every route of the API (and the types the dashboard's
forms and the CLI reuse):

- bounded types: every integer within what its column holds and what makes sense, every string
  free of NUL and lone surrogates (Postgres refuses both; a lone surrogate cannot even be encoded);
- `InputRoute`: the route class of the API. Before a handler runs it refuses a path or query
  string that is not UTF-8 once percent-decoded, a body over the body limit (413), a body that is
  not JSON by its content type (415), and parses the body strictly (`parse_json_body`): UTF-8,
  RFC 8259 JSON (no NaN/Infinity), at most MAX_JSON_DEPTH deep, numbers Python can hold. It
  documents the 413/415/422 it can answer in the OpenAPI document;
- `install_error_handlers`: every error in the one format {"error": {"reason", "message",
  "detail"}}, including pydantic's 422s, Starlette's own 404/405 and a database that is down (503).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Coroutine
from email.message import Message
from typing import Annotated, Any
from urllib.parse import parse_qsl, unquote_to_bytes

from fastapi import FastAPI, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi.routing import APIRoute
from fastapi.utils import create_model_field
from pydantic import BaseModel, BeforeValidator, Field, TypeAdapter, ValidationError
from sqlalchemy.exc import OperationalError
from sqlalchemy.exc import TimeoutError as PoolTimeout
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..protocol import errors as e
from ..protocol.configuration import _NAME_RE, _PREFIX_RE, MAX_NAME_LENGTH, MAX_PREFIX_LENGTH

# --- limits ------------------------------------------------------------------------------------

INT16_MAX = 2**15 - 1  # Kafka's producer epoch
INT32_MAX = 2**31 - 1  # Postgres integer; Spark's partition ids and attempt numbers are Java ints
INT64_MAX = 2**63 - 1  # Postgres bigint
MAX_BODY_BYTES = 8 * 1024 * 1024  # the least body limit: a service taking wider attempts has a higher one
# What one partition may take in a commit's body: its lease id and pre-commit record with four first
# offsets, ~320 bytes with a 40-character topic name; 1 KiB holds names of up to ~160 characters.
COMMIT_BYTES_PER_PARTITION = 1024
MAX_JSON_DEPTH = 32  # the deepest request body is 3 levels deep


# --- text --------------------------------------------------------------------------------------


def clean_text(value: Any) -> Any:
    """Refuse NUL (Postgres text cannot hold it) and lone surrogates (not Unicode: no UTF-8 for
    them). Runs before the length and pattern checks, so the message names the real problem."""
    if isinstance(value, str):
        if "\x00" in value:
            raise ValueError("must not contain a NUL character")
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise ValueError("must be valid Unicode text (it holds a lone UTF-16 surrogate)") from None
    return value


_CleanText = BeforeValidator(clean_text)
_NO_CONTROLS = r"^[^\x00-\x1f\x7f]*$"  # one line: no control characters


def text(max_length: int, *, min_length: int = 1, pattern: str | None = None, description: str | None = None) -> Any:
    """A string type: clean (see clean_text), bounded, optionally matching `pattern`."""
    # the validator after the constraints wraps them, so it runs first (and they stay in the JSON schema)
    return Annotated[
        str, Field(min_length=min_length, max_length=max_length, pattern=pattern, description=description), _CleanText
    ]


SinkName = text(MAX_NAME_LENGTH, pattern=_NAME_RE.pattern, description="A-Z a-z 0-9 . _ -, starting with a letter or digit")
TransactionalIdPrefix = text(MAX_PREFIX_LENGTH, pattern=_PREFIX_RE.pattern)
BootstrapServers = text(2000, pattern=_NO_CONTROLS, description="host:port[,host:port...]")
_TOPIC = r"^[A-Za-z0-9._-]+$"
Topic = text(249, pattern=_TOPIC, description="a Kafka topic name (Kafka's legal characters)")
# A topic of a commit's first offsets (1,600 in a 200-partition commit): the pattern alone, checked
# in pydantic's core, without clean_text's Python call per string (0.4 of ~1.3 ms of such a body's
# validation). The pattern refuses NUL and lone surrogates too; only its message is less specific.
OffsetTopic = Annotated[str, Field(min_length=1, max_length=249, pattern=_TOPIC)]
Id = text(100, pattern=r"^[A-Za-z0-9._:-]+$")
Reason = text(500, description="recorded in the event trail")
AbortReason = text(200, description="recorded with the attempt")  # attempts.abort_reason is varchar(200)
OperatorName = text(100, pattern=_NO_CONTROLS, description="who acts (recorded in the event trail)")
TransactionalId = text(255, pattern=_NO_CONTROLS)  # leases.transactional_id is varchar(255)


# --- integers ----------------------------------------------------------------------------------


def integer(ge: int, le: int, description: str | None = None) -> Any:
    return Annotated[int, Field(ge=ge, le=le, description=description)]


BatchId = integer(0, INT64_MAX, "Spark's micro-batch id")
AttemptNumber = integer(1, INT32_MAX)
LeaseId = integer(1, INT64_MAX)
AfterLeaseId = integer(0, INT64_MAX, "the leases listed follow this lease id")
EventId = integer(0, INT64_MAX)
Partition = integer(0, INT32_MAX, "the Spark partition (task) index")
Generation = integer(1, INT32_MAX, "the generation returned by start-generation")
TaskAttemptId = integer(0, INT64_MAX, "Spark's TaskContext.taskAttemptId()")
ProducerId = integer(0, INT64_MAX)
ProducerEpoch = integer(0, INT16_MAX)
Count = integer(0, INT64_MAX)
Millis = integer(0, INT64_MAX)
TransactionTimeoutMs = integer(1_000, 86_400_000)
CommitMarginMs = integer(0, 86_400_000)
PoolSize = integer(1, 1_000_000)
PageSize = integer(1, 1000)
RequestTimeoutMs = integer(1, 3_600_000)
Port = integer(1, 65_535)
Workers = integer(1, 1024)

def parse_as(type_: Any, raw: Any, name: str) -> Any:
    """Validate one value against a type above outside a model (the dashboard's forms, the CLI's
    arguments); raises ValueError with a message naming `name`."""
    try:
        return TypeAdapter(type_).validate_python(raw)
    except ValidationError as exc:
        raise ValueError(f"{name}: {_printable(exc.errors()[0]['msg'])}") from None


# --- errors ------------------------------------------------------------------------------------


class InputError(e.ProtocolError):
    """A request refused before it reaches its handler; status per instance (413, 415, 422)."""

    def __init__(self, status: int, reason: str, message: str, **detail: Any) -> None:
        super().__init__(reason, message, **detail)
        self.status = status


class ErrorBody(BaseModel):
    reason: str = Field(description="machine-readable; clients branch on it")
    message: str = Field(description="for people")
    detail: dict[str, Any] | None = Field(None, description="per reason; a 422 names its fields in detail.fields")


class ErrorOut(BaseModel):
    error: ErrorBody


STATUS_MEANING = {
    401: "no bearer token",
    403: "the token may not do this (wrong token, another sink's writer token, or not the admin token)",
    404: "no such sink, batch, attempt or lease",
    409: "the call is stale or contradicts the recorded state (error.reason says which); nothing changed",
    413: "the body is larger than 8 MiB",
    415: "the body is not sent as application/json",
    422: "invalid input: error.detail.fields names each offending field (body errors: error.reason says which)",
    503: "temporarily unable (the database or the Kafka control plane); retry later",
}


def error_responses(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """OpenAPI `responses` for these error statuses, in the one error format."""
    return {s: {"model": ErrorOut, "description": STATUS_MEANING[s]} for s in statuses}


def error_response(status: int, reason: str, message: str, detail: dict[str, Any] | None = None) -> JSONResponse:
    body: dict[str, Any] = {"reason": reason, "message": message}
    if detail:
        body["detail"] = detail
    return JSONResponse(status_code=status, content={"error": body})


def _printable(s: str, limit: int = 300) -> str:
    """Echoed input (a field name, a message) made encodable: lone surrogates as escapes, cut."""
    s = s.encode("utf-8", "backslashreplace").decode("utf-8")
    return s if len(s) <= limit else s[:limit] + "..."


def install_error_handlers(app: FastAPI, on_protocol_error: Callable[[e.ProtocolError], None] | None = None) -> None:
    @app.exception_handler(e.ProtocolError)
    async def protocol_error(_: Request, exc: e.ProtocolError) -> JSONResponse:
        if on_protocol_error is not None:
            on_protocol_error(exc)
        detail = dict(exc.detail)
        field = detail.get("field")
        if exc.status == 422 and isinstance(field, str) and "fields" not in detail:
            # every 422 names its fields in one shape, whether pydantic, the body parser or the service refused
            detail["fields"] = [{"field": field, "message": exc.message}]
        return error_response(exc.status, exc.reason, exc.message, detail)

    @app.exception_handler(RequestValidationError)
    async def invalid_request(_: Request, exc: RequestValidationError) -> JSONResponse:
        fields = []
        for err in exc.errors():
            loc = ".".join(_printable(str(p), 100) for p in err["loc"] if p not in ("body", "path", "query", "header"))
            fields.append({"field": loc, "message": _printable(err["msg"])})
        message = "; ".join(f"{f['field'] or 'body'}: {f['message']}" for f in fields[:10])
        return error_response(422, "invalid_request", message, {"fields": fields[:100]})

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException) -> Response:
        # Starlette's own answers: no such route (404), a method the route lacks (405)
        reasons = {404: "not_found", 405: "method_not_allowed"}
        response = error_response(exc.status_code, reasons.get(exc.status_code, f"http_{exc.status_code}"), str(exc.detail))
        for k, v in (exc.headers or {}).items():
            response.headers[k] = v
        return response

    @app.exception_handler(OperationalError)
    @app.exception_handler(PoolTimeout)
    async def database_unavailable(_: Request, exc: Exception) -> JSONResponse:
        return error_response(503, "database_unavailable", f"the database did not answer: {type(exc).__name__}")


# --- the request: path, query, body ------------------------------------------------------------


def check_url(scope: dict[str, Any]) -> None:
    """The path and query string, percent-decoded, must be UTF-8 (Starlette would silently turn
    invalid bytes into U+FFFD)."""
    raw_path = scope.get("raw_path") or scope["path"].encode("utf-8", "surrogateescape")
    for where, raw in (("path", raw_path), ("query", scope.get("query_string", b""))):
        if b"%" not in raw and raw.isascii():  # the common case: nothing to decode
            continue
        if where == "query":
            raw = raw.replace(b"+", b" ")
        try:
            unquote_to_bytes(raw).decode("utf-8")
        except UnicodeDecodeError as exc:
            raise InputError(422, "invalid_url_encoding", f"the {where} is not UTF-8 once percent-decoded "
                             f"(byte {exc.start})", fields=[{"field": where, "message": "not UTF-8"}]) from None


def _is_json(content_type: str | None) -> bool:
    """As FastAPI decides it: application/json or application/*+json, any parameters."""
    if not content_type:
        return False
    if content_type == "application/json" or content_type.startswith("application/json;"):
        return True
    m = Message()
    m["content-type"] = content_type
    subtype = m.get_content_subtype()
    return m.get_content_maintype() == "application" and (subtype == "json" or subtype.endswith("+json"))


def _refuse_constant(name: str) -> Any:
    raise InputError(422, "body_not_json", f"the body is not JSON: {name} is not a JSON number",
                     fields=[{"field": "body", "message": f"{name} is not JSON"}])


def _finite_float(s: str) -> float:
    f = float(s)
    if not math.isfinite(f):
        raise _number_too_large(s)
    return f


def _number_too_large(s: str) -> InputError:
    shown = s if len(s) <= 40 else f"{s[:20]}...({len(s)} characters)"
    return InputError(422, "body_number_too_large", f"the body holds a number too large to handle: {shown}",
                      fields=[{"field": "body", "message": "number too large"}])


_BRACKETS_AND_QUOTES = bytes(range(256)).translate(None, b'[]{}"')  # every other byte: deleted
_INNERMOST_PAIR = re.compile(rb"\[\]|\{\}")


def depth_exceeds(raw: bytes, limit: int) -> bool:
    """Whether a valid JSON document nests arrays and objects deeper than `limit`, read from its
    bytes at C speed (walking the parsed value cost ~2 ms at 200 partitions with their first
    offsets). Escapes go first (backslash pairs from the left, as JSON reads them, then escaped
    quotes: no other escape holds a quote or a bracket), then every byte but brackets and quotes.
    The quotes left delimit the strings, whose brackets do not count. Any two adjacent quotes can
    go first (an empty string, or two strings whose separator was removed: nothing between them
    was outside). Each pass removing the innermost pairs then removes one level."""
    if b"\\" in raw:
        raw = raw.replace(b"\\\\", b"").replace(b'\\"', b"")
    outside_strings = raw.translate(None, _BRACKETS_AND_QUOTES).replace(b'""', b"")
    if b'"' in outside_strings:  # strings holding brackets
        outside_strings = b"".join(outside_strings.split(b'"')[::2])
    for _ in range(limit):
        if not outside_strings:
            return False
        outside_strings = _INNERMOST_PAIR.sub(b"", outside_strings)
    return bool(outside_strings)


def parse_json_body(raw: bytes) -> Any:
    """Strict JSON: UTF-8, RFC 8259 (no NaN/Infinity), finite numbers Python can convert, at most
    MAX_JSON_DEPTH nested. Each failure is an InputError with its own reason."""

    def refused(reason: str, message: str, **where: Any) -> InputError:
        return InputError(422, reason, message, **where, fields=[{"field": "body", "message": message}])

    try:
        text_ = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise refused("body_not_utf8", f"the body is not UTF-8: invalid byte at offset {exc.start}",
                      offset=exc.start) from None
    too_deep = f"the body is nested deeper than {MAX_JSON_DEPTH} levels"
    try:
        value = json.loads(text_, parse_constant=_refuse_constant, parse_float=_finite_float)
    except json.JSONDecodeError as exc:
        raise refused("body_not_json", f"the body is not JSON: {exc.msg} at line {exc.lineno} column {exc.colno}",
                      line=exc.lineno, column=exc.colno, offset=exc.pos) from None
    except RecursionError:
        raise refused("body_too_deep", too_deep) from None
    except ValueError as exc:  # an integer beyond Python's conversion limit (4,300 digits)
        raise _number_too_large(str(exc)) from None
    # only a body with more containers than the limit can be too deep: skip the check otherwise
    if raw.count(b"[") + raw.count(b"{") > MAX_JSON_DEPTH and depth_exceeds(raw, MAX_JSON_DEPTH):
        raise refused("body_too_deep", too_deep)
    return value


def body_limit(max_partitions: int) -> int:
    """The body limit of a service that takes attempts of up to `max_partitions` partitions: its
    widest commit fits (at the 4,096 default, MAX_BODY_BYTES; at 100,000, ~98 MiB)."""
    return max(MAX_BODY_BYTES, max_partitions * COMMIT_BYTES_PER_PARTITION)


async def read_body(request: Request, limit: int = MAX_BODY_BYTES) -> bytes:
    """The body, refused with 413 past `limit` bytes (by Content-Length, or while reading)."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise _too_large(limit)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise _too_large(limit)
        chunks.append(chunk)
    return b"".join(chunks)


def _too_large(limit: int) -> InputError:
    return InputError(413, "body_too_large", f"the body is larger than {limit} bytes", limit=limit)


def parse_form(raw: bytes) -> dict[str, str]:
    """An application/x-www-form-urlencoded body (the dashboard's forms): strict UTF-8, clean text,
    the first value of each field."""
    try:
        pairs = parse_qsl(raw.decode("utf-8"), keep_blank_values=True, encoding="utf-8", errors="strict")
    except UnicodeDecodeError:
        raise InputError(422, "body_not_utf8", "the form is not UTF-8") from None
    fields: dict[str, str] = {}
    for k, v in pairs:
        try:
            clean_text(k)
            fields.setdefault(k, clean_text(v))
        except ValueError as exc:
            raise InputError(422, "invalid_request", f"{_printable(k, 100)}: {exc}", field=_printable(k, 100)) from None
    return fields


class JsonRequest(Request):
    """A request whose body is read within the app's body limit (`app.state.body_limit`, set from
    the coordinator's largest attempt; MAX_BODY_BYTES without) and parsed by `parse_json_body`."""

    async def body(self) -> bytes:
        if not hasattr(self, "_body"):
            self._body = await read_body(self, getattr(self.app.state, "body_limit", MAX_BODY_BYTES))
        return self._body

    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            self._json = parse_json_body(await self.body())
        return self._json


class InputRoute(APIRoute):
    """The API's route class (`app.router.route_class`): the checks above before every handler,
    and the statuses they add in the route's OpenAPI responses."""

    def __init__(self, path: str, endpoint: Callable[..., Any], **kwargs: Any) -> None:
        super().__init__(path, endpoint, **kwargs)
        # every route checks its URL (422 invalid_url_encoding); a route with a body its body too
        added: tuple[int, ...] = (413, 415, 422) if self.body_field is not None else (422,)
        # a route may describe a status itself; the rest get the generic meaning (and FastAPI's
        # serialisation field for their model, as it makes for the responses it was given)
        for status, response in error_responses(*added).items():
            if status not in self.responses:
                self.responses[status] = response
                self.response_fields[status] = create_model_field(
                    name=f"Response_{status}_{self.unique_id}", type_=ErrorOut, mode="serialization"
                )

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()
        takes_body = self.body_field is not None

        async def checked(request: Request) -> Response:
            check_url(request.scope)
            request = JsonRequest(request.scope, request.receive)
            if takes_body:
                raw = await request.body()
                if raw:
                    if not _is_json(request.headers.get("content-type")):
                        raise InputError(415, "unsupported_media_type", "send the body as JSON with "
                                         "Content-Type: application/json")
                    await request.json()  # parsed (or refused) here, outside FastAPI's generic 400
            return await handler(request)

        return checked
