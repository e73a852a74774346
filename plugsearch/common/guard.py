"""The request guard every service runs in front of its routes: one pure-ASGI middleware (cheap on the hot path).

Its small steps, in this order: `request_id_of`; open paths pass untouched; `single_headers` (400); `KeyCheck`
(401; the `Caller` into the scope's state); `door_refusal` (429 for a caller the app keeps out, before its body is
read); `BodyReader` (413, 408; before the request counts as in flight); `body_refusal` (415, 422); `Admission`
(429 + Retry-After); `GuardMiddleware._respond` (504, 499 for a client that hangs up, 500); `record_request`.
With tracing on (`plugsearch.common.tracing`), each guarded request is one server span that continues the
caller's W3C `traceparent` and ends with the request's final status. `GUARD_ERRORS`: what it may answer, as
every guarded operation documents it (`plugsearch.common.app.service_router`).
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import logging
import math
import re
import time
from collections.abc import Callable
from typing import Any, NamedTuple

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from plugsearch.common import tracing
from plugsearch.common.admission import (
    CALLER_STATE,
    COST_STATE,
    AdaptiveLimit,
    Caller,
    FairAdmission,
    address_id,
    key_id,
)
from plugsearch.common.errors import ErrorDetail, ErrorEnvelope
from plugsearch.common.logging import (
    REQUEST_ID_HEADER,
    new_request_id,
    reset_request_id,
    set_request_id,
)
from plugsearch.common.metrics import ServiceMetrics
from plugsearch.common.settings import ServiceSettings

logger = logging.getLogger(__name__)

OPEN_PATHS = frozenset({"/health/live", "/health/ready", "/version", "/metrics", "/docs", "/redoc",
                        "/openapi.json", "/docs/oauth2-redirect"})

_REQUEST_ID_RE = re.compile(r"[A-Za-z0-9._:@/+=-]{1,128}")
"""Accepted caller-supplied request ids: printable ASCII without spaces, quotes or control characters."""

SINGLE_HEADERS = frozenset({b"content-type", b"content-length", b"transfer-encoding", b"authorization",
                            b"x-api-key", b"x-request-id"})
"""Headers a request may carry once: two Content-Type headers were read one way here and another by the
framework; two keys, or two lengths, are as ambiguous."""

JSON_CHECK_BYTES = 16 * 1024
"""Bodies above this size have their JSON structure checked before the framework validates it."""
MAX_JSON_MEMBERS = 1024
"""No request model has an object with more members: 150k unknown fields took the validator 1.3 s to list."""
MAX_JSON_ITEMS = 8192
"""Above every list limit of every request model (the retriever's 4,096 queries), so that limit still answers."""

CLIENT_CLOSED = 499
"""nginx's "client closed request": the status recorded for a client that hung up before its answer."""


class Refusal(NamedTuple):
    """An answer the guard gives instead of the app (in the error envelope)."""

    status: int
    type: str
    message: str
    headers: tuple[tuple[bytes, bytes], ...] = ()


UNAUTHORIZED = Refusal(401, "unauthorized", "missing or invalid API key", ((b"www-authenticate", b"Bearer"),))
NOT_JSON = Refusal(415, "unsupported_media_type", "request body must be JSON (Content-Type: application/json)")
INTERNAL_ERROR = Refusal(500, "internal_error", "internal server error")


# ------------------------------------------------------------------ the guard's steps, each doing one thing
def request_id_of(scope: Scope) -> str:
    """The caller's `X-Request-ID` when it is safe to log and echo, else a fresh one."""
    for name, value in scope.get("headers", ()):
        if name == b"x-request-id":
            request_id = value.decode("latin-1")[:128]
            # characters that could forge log lines or break headers: mint our own
            return request_id if _REQUEST_ID_RE.fullmatch(request_id) else new_request_id()
    return new_request_id()


def single_headers(scope: Scope) -> dict[bytes, bytes] | Refusal:
    """The request's `SINGLE_HEADERS`, or a 400 when one of them is given twice."""
    headers: dict[bytes, bytes] = {}
    for name, value in scope.get("headers", ()):
        if name in SINGLE_HEADERS:
            if name in headers:
                return Refusal(400, "duplicate_header", f"more than one {name.decode()} header")
            headers[name] = value
    return headers


class KeyCheck:
    """Auth: who presents which key (Bearer or X-API-Key), compared in constant time."""

    def __init__(self, settings: ServiceSettings) -> None:
        self.key_digests = [hashlib.sha256(k.get_secret_value().encode()).digest() for k in settings.api_keys]
        self.internal_digest = (None if settings.internal_token is None
                                else hashlib.sha256(settings.internal_token.get_secret_value().encode()).digest())

    def caller(self, scope: Scope, headers: dict[bytes, bytes]) -> Caller | None:
        """Who this is, or None when keys are configured and none of them was presented."""
        if not self.key_digests and self.internal_digest is None:
            return Caller("anonymous", address_id(scope))
        presented = headers.get(b"x-api-key", b"").strip()
        authorization = headers.get(b"authorization", b"")
        if authorization[:7].lower() == b"bearer ":
            presented = authorization[7:].strip()
        if not presented:
            return None
        # Compare fixed-size digests against every key: the time depends neither on which key matched
        # nor on how long the presented or the accepted keys are.
        digest = hashlib.sha256(presented).digest()
        public = any([hmac.compare_digest(digest, key) for key in self.key_digests])  # a list: compare all
        if self.internal_digest is not None and hmac.compare_digest(digest, self.internal_digest):
            return Caller("internal", "internal")
        return Caller("key", key_id(digest)) if public else None


class BodyReader:
    """The whole request body, at most `max_bytes` of it, within `timeout_s`. Buffered here, a chunked body
    over the limit gets the same 413 as a large Content-Length; a client that trickles its body holds no
    in-flight slot (admission comes after) and gets 408 past the timeout."""

    def __init__(self, max_bytes: int, timeout_s: float) -> None:
        self.max_bytes = max_bytes
        self.timeout_s = timeout_s
        self.too_large = Refusal(413, "payload_too_large", f"request body over {max_bytes} bytes")

    def declared_too_large(self, headers: dict[bytes, bytes]) -> bool:
        try:
            return int(headers.get(b"content-length", b"0")) > self.max_bytes
        except ValueError:
            return False

    async def read(self, receive: Receive) -> bytes | Refusal | None:
        """The body, a refusal (413, 408), or None when the client hung up first."""
        try:
            async with asyncio.timeout(self.timeout_s):
                return await self._read(receive)
        except TimeoutError:
            return Refusal(408, "request_timeout", f"request body not received within {self.timeout_s:g} s",
                           ((b"connection", b"close"),))

    async def _read(self, receive: Receive) -> bytes | Refusal | None:
        chunks: list[bytes] = []
        received = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            if message["type"] != "http.request":
                continue
            chunk = message.get("body", b"")
            received += len(chunk)
            if received > self.max_bytes:
                return self.too_large
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)


def is_json_media_type(value: bytes) -> bool:
    """`application/json` or any `application/*+json`, parameters (charset) ignored."""
    media = value.split(b";", 1)[0].strip().lower()
    return media == b"application/json" or (media.startswith(b"application/") and media.endswith(b"+json"))


def absurd_json(body: bytes) -> str | None:
    """Why `body` is too absurd to hand to the validator (an object with more than `MAX_JSON_MEMBERS`
    members, an array longer than `MAX_JSON_ITEMS`), or None. Invalid JSON is None too: the framework
    answers it with the usual 400."""
    import orjson

    try:
        stack: list[Any] = [orjson.loads(body)]
    except orjson.JSONDecodeError:
        return None
    while stack:
        value = stack.pop()
        if isinstance(value, dict):
            if len(value) > MAX_JSON_MEMBERS:
                return f"a JSON object with {len(value)} members (at most {MAX_JSON_MEMBERS})"
            stack.extend(v for v in value.values() if isinstance(v, dict | list))
        elif isinstance(value, list):
            if len(value) > MAX_JSON_ITEMS:
                return f"a JSON array with {len(value)} items (at most {MAX_JSON_ITEMS})"
            stack.extend(v for v in value if isinstance(v, dict | list))
    return None


DoorCheck = Callable[[Caller], float]
"""`app.state.door` (set by a service that keeps budgets: the searcher): the seconds for which a caller is
refused before its body is read (it cannot afford even one cost unit), 0.0 when it may come in."""


def door_refusal(scope: Scope, caller: Caller) -> Refusal | None:
    """429 + Retry-After for a caller the app's door check keeps out: refused before its body is read, so a
    caller that spent its budget and keeps sending costs next to nothing."""
    app = scope.get("app")
    door: DoorCheck | None = getattr(getattr(app, "state", None), "door", None)
    wait = door(caller) if door is not None else 0.0
    if wait <= 0:
        return None
    seconds = str(max(1, math.ceil(wait))).encode()
    return Refusal(429, "rate_limited", "this key's budget is spent: retry after Retry-After",
                   ((b"retry-after", seconds),))


def body_refusal(body: bytes, content_type: bytes) -> Refusal | None:
    """A body that is not declared JSON (415: another Content-Type, or none at all), or JSON too absurd to
    validate (422); None for any other."""
    if body and not is_json_media_type(content_type):
        return NOT_JSON
    problem = absurd_json(body) if len(body) > JSON_CHECK_BYTES else None
    return None if problem is None else Refusal(422, "validation_error", f"request body refused: {problem}")


class Admission:
    """The adaptive in-flight limit, shared fairly between callers (`FairAdmission`): admits or refuses,
    counts who is in, learns from their latency."""

    def __init__(self, settings: ServiceSettings, metrics: ServiceMetrics) -> None:
        self.limit = AdaptiveLimit(settings.max_in_flight, min_limit=settings.min_in_flight,
                                   tolerance=settings.latency_tolerance, adaptive=settings.adaptive_concurrency)
        self.fair = FairAdmission(self.limit)
        self.overloaded = Refusal(429, "overloaded", "too many requests in flight; retry later",
                                  ((b"retry-after", str(settings.retry_after_s).encode()),))
        self.metrics = metrics
        metrics.admission_limit.set(self.limit.current)

    @property
    def in_flight(self) -> int:
        return self.fair.in_flight

    def admits(self, caller: str = "") -> bool:
        return self.fair.admits(caller)

    def enter(self, caller: str = "") -> tuple[int, int]:
        """Count one more in flight; returns what `leave` needs (the others in flight, the limit's epoch)."""
        others = self.fair.enter(caller)
        self.metrics.in_flight.inc()
        return others, self.limit.epoch

    def leave(self, entered: tuple[int, int], status: int, seconds: float, cost: float, caller: str = "") -> None:
        """One fewer in flight; a success's latency (per cost unit) feeds the limit."""
        self.fair.leave(caller)
        self.metrics.in_flight.dec()
        if 200 <= status < 300:
            others, epoch = entered
            self.limit.observe(seconds, cost, epoch, others)
            self.metrics.admission_limit.set(self.limit.current)


def caller_id(scope: Scope) -> str:
    """Who the guard authenticated (`Caller.kind:id`), for fair admission; "" before it has."""
    caller = scope.get("state", {}).get(CALLER_STATE)
    return f"{caller.kind}:{caller.id}" if isinstance(caller, Caller) else ""


class Exchange:
    """The app's side of one admitted request: the body replayed, the answer's start and status noted
    (with the request id header added), and the client's hang-up watched: before any answer, it cancels
    the work done for it."""

    def __init__(self, receive: Receive, send: Send, body: bytes, rid_header: tuple[bytes, bytes]) -> None:
        self._receive = receive
        self._send = send
        self._body: bytes | None = body
        self._rid_header = rid_header
        self._gone = asyncio.Event()
        self.started = False
        self.status = 500
        self.client_left = False

    async def receive(self) -> Message:
        if self._body is not None:
            body, self._body = self._body, None
            return {"type": "http.request", "body": body, "more_body": False}
        await self._gone.wait()  # streaming responses listen for the client leaving
        return {"type": "http.disconnect"}

    async def send(self, message: Message) -> None:
        if message["type"] == "http.response.start":
            self.started = True
            self.status = message["status"]
            message["headers"] = [*message.get("headers", []), self._rid_header]
        await self._send(message)

    async def watch(self, task: asyncio.Task[Any]) -> None:
        while (await self._receive())["type"] != "http.disconnect":
            pass
        self._gone.set()
        if not self.started:
            self.client_left = True
            task.cancel()


def record_request(metrics: ServiceMetrics, scope: Scope, status: int, seconds: float) -> None:
    """Request metrics: count by route, method and final status; latency by route."""
    route = getattr(scope.get("route"), "path", "unmatched")
    metrics.requests.labels(route, scope.get("method", ""), str(status)).inc()
    metrics.latency.labels(route).observe(seconds)


class GuardMiddleware:
    """The guard (pure ASGI): the steps above in order; the first that refuses answers (`Refusal`)."""

    def __init__(self, app: ASGIApp, *, settings: ServiceSettings, metrics: ServiceMetrics,
                 open_paths: frozenset[str] = OPEN_PATHS) -> None:
        self.app = app
        self.open_paths = open_paths
        self.metrics = metrics
        self.keys = KeyCheck(settings)
        self.body = BodyReader(settings.max_body_bytes, settings.body_timeout_s)
        self.admission = Admission(settings, metrics)
        self.limit = self.admission.limit
        self.deadline = settings.request_timeout_s
        self.deadline_exceeded = Refusal(504, "deadline_exceeded", f"request took longer than {self.deadline:g} s")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request_id = request_id_of(scope)
        token = set_request_id(request_id)
        rid_header = (REQUEST_ID_HEADER.lower().encode(), request_id.encode("latin-1"))
        try:
            if scope.get("path", "") in self.open_paths:
                await self.app(scope, receive, _with_header(send, rid_header))
                return
            with tracing.server_span(scope, request_id) as span:
                status = await self._guarded(scope, receive, send, request_id, rid_header)
                tracing.finish_server_span(span, scope, status)
        finally:
            reset_request_id(token)

    async def _guarded(self, scope: Scope, receive: Receive, send: Send, request_id: str,
                       rid_header: tuple[bytes, bytes]) -> int:
        """The steps from `_screen` on; returns the request's final status."""
        t0 = time.perf_counter()
        screened = await self._screen(scope, receive)
        if screened is None:  # the client hung up while sending its body
            record_request(self.metrics, scope, CLIENT_CLOSED, time.perf_counter() - t0)
            return CLIENT_CLOSED
        if isinstance(screened, Refusal):
            await self._refuse(send, screened, request_id)
            return screened.status
        if not self.admission.admits(caller_id(scope)):
            await self._refuse(send, self.admission.overloaded, request_id)
            return self.admission.overloaded.status
        exchange = Exchange(receive, send, screened, rid_header)
        await self._admitted(scope, exchange, send, request_id)
        return exchange.status

    async def _screen(self, scope: Scope, receive: Receive) -> bytes | Refusal | None:
        """Headers, auth, size, body, media type and JSON shape: the body, a refusal, or None (client gone)."""
        headers = single_headers(scope)
        if isinstance(headers, Refusal):
            return headers
        caller = self.keys.caller(scope, headers)
        if caller is None:
            return UNAUTHORIZED
        if self.body.declared_too_large(headers):
            return self.body.too_large
        scope.setdefault("state", {})[CALLER_STATE] = caller
        closed = door_refusal(scope, caller)
        if closed is not None:
            return closed
        body = await self.body.read(receive)
        if not isinstance(body, bytes):
            return body
        return body_refusal(body, headers.get(b"content-type", b"")) or body

    async def _admitted(self, scope: Scope, exchange: Exchange, send: Send, request_id: str) -> None:
        caller = caller_id(scope)
        entered = self.admission.enter(caller)
        t0 = time.perf_counter()
        try:
            await self._respond(scope, exchange, send, request_id)
        finally:
            seconds = time.perf_counter() - t0
            self.admission.leave(entered, exchange.status, seconds,
                                 float(scope.get("state", {}).get(COST_STATE, 1.0)), caller)
            record_request(self.metrics, scope, exchange.status, seconds)

    async def _respond(self, scope: Scope, exchange: Exchange, send: Send, request_id: str) -> None:
        """Run the app within the deadline; what escapes it gets its final status here: 504 past the
        deadline, `CLIENT_CLOSED` when the client left, 500 for a bug (trace in the log, never to the caller)."""
        task = asyncio.current_task()
        assert task is not None  # an ASGI app always runs in a task
        watcher = asyncio.create_task(exchange.watch(task))
        try:
            async with asyncio.timeout(self.deadline):
                await self.app(scope, exchange.receive, exchange.send)
        except TimeoutError:
            if not exchange.started:
                exchange.status = 504
                await self._refuse(send, self.deadline_exceeded, request_id)
        except asyncio.CancelledError:
            if not exchange.client_left:
                raise
            task.uncancel()
            exchange.status = CLIENT_CLOSED  # nothing is sent to nobody
            logger.info("client went away: %s %s cancelled", scope.get("method"), scope.get("path"))
        except Exception:
            logger.exception("unhandled error on %s %s", scope.get("method"), scope.get("path"))
            if not exchange.started:
                exchange.status = 500
                await self._refuse(send, INTERNAL_ERROR, request_id)
        finally:
            watcher.cancel()

    async def _refuse(self, send: Send, refusal: Refusal, request_id: str) -> None:
        self.metrics.rejected.labels(refusal.type).inc()
        env = ErrorEnvelope(error=ErrorDetail(type=refusal.type, message=refusal.message, request_id=request_id))
        body = json.dumps(env.model_dump()).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                   (b"x-request-id", request_id.encode("latin-1")), *refusal.headers]
        await send({"type": "http.response.start", "status": refusal.status, "headers": headers})
        await send({"type": "http.response.body", "body": body})


def _with_header(send: Send, header: tuple[bytes, bytes]) -> Send:
    async def wrapped(message: Message) -> None:
        if message["type"] == "http.response.start":
            message["headers"] = [*message.get("headers", []), header]
        await send(message)

    return wrapped


# ------------------------------------------------------------------ what the guard answers, documented
GUARD_ERRORS: dict[int, str] = {
    400: "invalid JSON body, or a header given twice",
    401: "missing or invalid API key (when keys are configured)",
    408: "request body not received in time",
    413: "request body over the size limit",
    415: "request body is not JSON",
    422: "request failed validation",
    429: "too many requests in flight; retry after Retry-After",
    500: "internal error (a bug; details only in the server log)",
    504: "request deadline exceeded",
}
"""What the guard and the error handlers may answer on every guarded operation."""
