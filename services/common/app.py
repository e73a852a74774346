"""App factory pieces every service uses: guard middleware, health, version and metrics endpoints.

The guard is one pure-ASGI middleware (cheap on the hot path) that, in this order: mints or accepts
`X-Request-ID`; leaves open paths alone (health, metrics, docs); refuses a header given twice (400);
checks auth and records who the caller is (`services.common.admission.Caller` in the scope's state);
refuses bodies over the limit (413) and reads the body within `body_timeout_s` (408) before the request
counts as in flight; refuses absurd JSON (422) and non-JSON bodies (415); refuses work past the adaptive
admission limit (429 + Retry-After); enforces the per-request deadline (504); cancels the work when the
client hangs up before the answer; records request metrics and feeds latency back to the limit.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import logging
import os
import re
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from contextlib import AbstractAsyncContextManager
from typing import Any

from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel
from starlette.types import ASGIApp, Message, Receive, Scope, Send

import services
from services.common.admission import CALLER_STATE, COST_STATE, AdaptiveLimit, Caller, address_id, key_id
from services.common.errors import ErrorDetail, ErrorEnvelope, install_error_handlers
from services.common.logging import (
    REQUEST_ID_HEADER,
    new_request_id,
    reset_request_id,
    set_request_id,
)
from services.common.metrics import (
    MULTIPROCESS_ENV,
    ServiceMetrics,
    forget_dead_workers,
    multiprocess_registry,
)
from services.common.settings import ServiceSettings

logger = logging.getLogger(__name__)

OPEN_PATHS = frozenset({"/health/live", "/health/ready", "/version", "/metrics", "/docs", "/redoc",
                        "/openapi.json", "/docs/oauth2-redirect"})

_REQUEST_ID_RE = re.compile(r"[A-Za-z0-9._:@/+=-]{1,128}")
"""Accepted caller-supplied request ids: printable ASCII without spaces, quotes or control characters."""

ReadinessCheck = Callable[[], Awaitable[dict[str, str]]]
"""Returns {check name: "ok" or a reason}; the service is ready when every value is "ok"."""


class HealthStatus(BaseModel):
    status: str
    checks: dict[str, str] = {}


class VersionInfo(BaseModel):
    service: str
    version: str
    details: dict[str, Any] = {}


def _error_body(status: int, type_: str, message: str, request_id: str) -> bytes:
    env = ErrorEnvelope(error=ErrorDetail(type=type_, message=message, request_id=request_id))
    return json.dumps(env.model_dump()).encode()


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


class GuardMiddleware:
    def __init__(self, app: ASGIApp, *, settings: ServiceSettings, metrics: ServiceMetrics,
                 open_paths: frozenset[str] = OPEN_PATHS) -> None:
        self.app = app
        self.open_paths = open_paths
        self.metrics = metrics
        self.key_digests = [hashlib.sha256(k.get_secret_value().encode()).digest() for k in settings.api_keys]
        self.internal_digest = (None if settings.internal_token is None
                                else hashlib.sha256(settings.internal_token.get_secret_value().encode()).digest())
        self.max_body = settings.max_body_bytes
        self.limit = AdaptiveLimit(settings.max_in_flight, min_limit=settings.min_in_flight,
                                   tolerance=settings.latency_tolerance, adaptive=settings.adaptive_concurrency)
        self.deadline = settings.request_timeout_s
        self.body_timeout = settings.body_timeout_s
        self.retry_after = str(settings.retry_after_s).encode()
        self.in_flight = 0
        metrics.admission_limit.set(self.limit.current)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request_id = ""
        for name, value in scope.get("headers", ()):
            if name == b"x-request-id":
                request_id = value.decode("latin-1")[:128]
                break
        if not _REQUEST_ID_RE.fullmatch(request_id):
            # Absent, or characters that could forge log lines or break headers: mint our own.
            request_id = new_request_id()
        token = set_request_id(request_id)
        rid_header = (REQUEST_ID_HEADER.lower().encode(), request_id.encode("latin-1"))
        try:
            path = scope.get("path", "")
            if path in self.open_paths:
                await self.app(scope, receive, self._with_header(send, rid_header))
                return
            await self._guarded(scope, receive, send, request_id, rid_header)
        finally:
            reset_request_id(token)

    @staticmethod
    def _with_header(send: Send, header: tuple[bytes, bytes]) -> Send:
        async def wrapped(message: Message) -> None:
            if message["type"] == "http.response.start":
                message.setdefault("headers", [])
                message["headers"] = [*message["headers"], header]
            await send(message)

        return wrapped

    async def _reject(self, send: Send, status: int, type_: str, message: str, request_id: str,
                      extra: list[tuple[bytes, bytes]] | None = None) -> None:
        self.metrics.rejected.labels(type_).inc()
        body = _error_body(status, type_, message, request_id)
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                   (b"x-request-id", request_id.encode("latin-1"))]
        await send({"type": "http.response.start", "status": status, "headers": headers + (extra or [])})
        await send({"type": "http.response.body", "body": body})

    def _caller(self, scope: Scope, headers: dict[bytes, bytes]) -> Caller | None:
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
        public = False
        for key_digest in self.key_digests:
            public |= hmac.compare_digest(digest, key_digest)
        internal = self.internal_digest is not None and hmac.compare_digest(digest, self.internal_digest)
        if internal:
            return Caller("internal", "internal")
        return Caller("key", key_id(digest)) if public else None

    async def _read_body(self, receive: Receive, send: Send, request_id: str) -> bytes | None:
        """The whole request body (at most `max_body` bytes), or None once a rejection was sent.

        Buffering here (instead of counting inside the app's receive) means a chunked body over the
        limit gets the same 413 as one with a large Content-Length; the framework never sees it.
        """
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
            if received > self.max_body:
                await self._reject(send, 413, "payload_too_large", f"request body over {self.max_body} bytes",
                                   request_id)
                return None
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)

    async def _guarded(self, scope: Scope, receive: Receive, send: Send, request_id: str,
                       rid_header: tuple[bytes, bytes]) -> None:
        headers: dict[bytes, bytes] = {}
        for name, value in scope.get("headers", ()):
            if name in SINGLE_HEADERS:
                if name in headers:
                    await self._reject(send, 400, "duplicate_header", f"more than one {name.decode()} header",
                                       request_id)
                    return
                headers[name] = value
        caller = self._caller(scope, headers)
        if caller is None:
            await self._reject(send, 401, "unauthorized", "missing or invalid API key", request_id,
                               [(b"www-authenticate", b"Bearer")])
            return
        try:
            too_big = int(headers.get(b"content-length", b"0")) > self.max_body
        except ValueError:
            too_big = False
        if too_big:
            await self._reject(send, 413, "payload_too_large", f"request body over {self.max_body} bytes",
                               request_id)
            return
        scope.setdefault("state", {})[CALLER_STATE] = caller
        # The body first: a client that trickles it holds no in-flight slot, and gets 408 past the timeout.
        try:
            async with asyncio.timeout(self.body_timeout):
                body = await self._read_body(receive, send, request_id)
        except TimeoutError:
            await self._reject(send, 408, "request_timeout",
                               f"request body not received within {self.body_timeout:g} s", request_id,
                               [(b"connection", b"close")])
            return
        if body is None:
            return  # refused (413) or the client left
        content_type = headers.get(b"content-type", b"")
        if body and content_type and not is_json_media_type(content_type):
            await self._reject(send, 415, "unsupported_media_type",
                               "request body must be JSON (Content-Type: application/json)", request_id)
            return
        if len(body) > JSON_CHECK_BYTES:
            problem = absurd_json(body)
            if problem is not None:
                await self._reject(send, 422, "validation_error", f"request body refused: {problem}", request_id)
                return
        if not self.limit.admits(self.in_flight):
            await self._reject(send, 429, "overloaded", "too many requests in flight; retry later",
                               request_id, [(b"retry-after", self.retry_after)])
            return
        await self._admitted(scope, receive, send, request_id, rid_header, body)

    async def _admitted(self, scope: Scope, receive: Receive, send: Send, request_id: str,
                        rid_header: tuple[bytes, bytes], body: bytes) -> None:
        started = False
        status = 500
        client_left = False
        task = asyncio.current_task()
        gone = asyncio.Event()

        async def tracking_send(message: Message) -> None:
            nonlocal started, status
            if message["type"] == "http.response.start":
                started = True
                status = message["status"]
                message["headers"] = [*message.get("headers", []), rid_header]
            await send(message)

        async def watch() -> None:
            """The client hanging up before any answer cancels the work done for it."""
            nonlocal client_left
            while (await receive())["type"] != "http.disconnect":
                pass
            gone.set()
            if not started and task is not None:
                client_left = True
                task.cancel()

        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            await gone.wait()  # streaming responses listen for the client leaving
            return {"type": "http.disconnect"}

        others = self.in_flight
        self.in_flight += 1
        self.metrics.in_flight.inc()
        epoch = self.limit.epoch
        watcher = asyncio.create_task(watch())
        t0 = time.perf_counter()
        try:
            async with asyncio.timeout(self.deadline):
                await self.app(scope, replay, tracking_send)
        except TimeoutError:
            if not started:
                status = 504
                await self._reject(send, 504, "deadline_exceeded",
                                   f"request took longer than {self.deadline:g} s", request_id)
        except asyncio.CancelledError:
            if not client_left or task is None:
                raise
            task.uncancel()
            status = 499  # nginx's "client closed request": nothing is sent to nobody
            logger.info("client went away: %s %s cancelled", scope.get("method"), scope.get("path"))
        except Exception:
            # A bug: the trace goes to the log, the caller gets a generic 500 (never the exception text).
            logger.exception("unhandled error on %s %s", scope.get("method"), scope.get("path"))
            if not started:
                status = 500
                await self._reject(send, 500, "internal_error", "internal server error", request_id)
        finally:
            watcher.cancel()
            elapsed = time.perf_counter() - t0
            self.in_flight -= 1
            self.metrics.in_flight.dec()
            if 200 <= status < 300:
                self.limit.observe(elapsed, float(scope.get("state", {}).get(COST_STATE, 1.0)), epoch,
                                   others)
                self.metrics.admission_limit.set(self.limit.current)
            route = scope.get("route")
            route_name = getattr(route, "path", "unmatched")
            self.metrics.requests.labels(route_name, scope.get("method", ""), str(status)).inc()
            self.metrics.latency.labels(route_name).observe(elapsed)


def is_json_media_type(value: bytes) -> bool:
    """`application/json` or any `application/*+json`, parameters (charset) ignored."""
    media = value.split(b";", 1)[0].strip().lower()
    return media == b"application/json" or (media.startswith(b"application/") and media.endswith(b"+json"))


GUARD_RESPONSES: dict[str, str] = {
    "400": "invalid JSON body, or a header given twice",
    "401": "missing or invalid API key (when keys are configured)",
    "408": "request body not received in time",
    "413": "request body over the size limit",
    "415": "request body is not JSON",
    "422": "request failed validation",
    "429": "too many requests in flight; retry after Retry-After",
    "500": "internal error (a bug; details only in the server log)",
    "504": "request deadline exceeded",
}
"""What the guard middleware and the error handlers may answer on every guarded operation."""


def add_component_schemas(schema: dict[str, Any], *models: type[BaseModel]) -> dict[str, Any]:
    """Put `models` (and the models they use) into the OpenAPI document's components, for operations to
    refer to (`#/components/schemas/<Model>`) where FastAPI would not list them itself (error envelopes,
    server-sent events); returns the components' schemas."""
    components: dict[str, Any] = schema.setdefault("components", {}).setdefault("schemas", {})
    for model in models:
        definition = model.model_json_schema(ref_template="#/components/schemas/{model}")
        for name, nested in definition.pop("$defs", {}).items():
            components.setdefault(name, nested)
        components.setdefault(model.__name__, definition)
    return components


def document_errors(schema: dict[str, Any], *, auth: bool = False) -> dict[str, Any]:
    """Make the OpenAPI document say what the service really answers on errors: the error envelope
    (not FastAPI's default `HTTPValidationError`) for every status the guard or handlers produce;
    with `auth`, the two ways to present a key (Bearer or X-API-Key) on every guarded operation."""
    if auth:
        schema.setdefault("components", {})["securitySchemes"] = {
            "bearer": {"type": "http", "scheme": "bearer"},
            "apiKey": {"type": "apiKey", "in": "header", "name": "X-API-Key"}}
    components = add_component_schemas(schema, ErrorEnvelope)
    ref = {"$ref": "#/components/schemas/ErrorEnvelope"}
    for path, operations in schema.get("paths", {}).items():
        if path in OPEN_PATHS:
            continue
        for operation in operations.values():
            if not isinstance(operation, dict) or "responses" not in operation:
                continue
            responses = operation["responses"]
            if auth:
                operation["security"] = [{"bearer": []}, {"apiKey": []}]
            for status, description in GUARD_RESPONSES.items():
                current = responses.get(status)
                content = (current or {}).get("content", {}).get("application/json", {})
                if current is None or content.get("schema", {}).get("$ref", "").endswith("/HTTPValidationError"):
                    responses[status] = {"description": description,
                                         "content": {"application/json": {"schema": ref}}}
    used = json.dumps(schema.get("paths", {}))
    if "HTTPValidationError" not in used:
        components.pop("HTTPValidationError", None)
        if "/ValidationError" not in json.dumps(components):
            components.pop("ValidationError", None)
    return schema


def build_app(
    settings: ServiceSettings,
    *,
    service: str,
    description: str,
    lifespan: Callable[[FastAPI], AbstractAsyncContextManager[None]] | None = None,
    version_details: Callable[[FastAPI], dict[str, Any]] | None = None,
    open_paths: Iterable[str] = (),
) -> FastAPI:
    """A FastAPI app with the shared middleware, error handlers and operational endpoints.

    The service's lifespan must set `app.state.readiness` (a ReadinessCheck) once it can answer.
    `open_paths`: more paths served without auth or request limits (static pages), besides `OPEN_PATHS`.
    """
    forget_dead_workers()
    metrics = ServiceMetrics(service)
    app = FastAPI(title=f"plugsearch {service}", description=description, version=services.__version__,
                  lifespan=lifespan)
    app.state.settings = settings
    app.state.metrics = metrics
    app.state.readiness = None
    install_error_handlers(app)
    app.add_middleware(GuardMiddleware, settings=settings, metrics=metrics, open_paths=OPEN_PATHS | set(open_paths))
    default_openapi = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = document_errors(default_openapi(), auth=bool(settings.accepted_tokens()))
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]

    @app.get("/health/live", response_model=HealthStatus, tags=["ops"])
    async def live() -> HealthStatus:
        return HealthStatus(status="ok")

    @app.get("/health/ready", response_model=HealthStatus, tags=["ops"],
             responses={503: {"model": HealthStatus}})
    async def ready(request: Request) -> Response:
        check: ReadinessCheck | None = request.app.state.readiness
        if check is None:
            body = HealthStatus(status="not_ready", checks={"startup": "still starting"})
            return JSONResponse(body.model_dump(), status_code=503, headers={"Retry-After": "2"})
        try:
            checks = await asyncio.wait_for(check(), timeout=5.0)
        except Exception as exc:  # readiness must answer, whatever broke
            checks = {"readiness": f"check failed: {type(exc).__name__}"}
        ok = all(v == "ok" for v in checks.values())
        body = HealthStatus(status="ready" if ok else "not_ready", checks=checks)
        return JSONResponse(body.model_dump(), status_code=200 if ok else 503,
                            headers=None if ok else {"Retry-After": "2"})

    @app.get("/version", response_model=VersionInfo, tags=["ops"])
    async def version(request: Request) -> VersionInfo:
        details = version_details(request.app) if version_details else {}
        return VersionInfo(service=service, version=services.__version__, details=details)

    @app.get("/metrics", tags=["ops"], include_in_schema=False)
    async def metrics_endpoint() -> Response:
        if os.environ.get(MULTIPROCESS_ENV):  # one of several workers: report all of them
            return Response(generate_latest(multiprocess_registry()), media_type=CONTENT_TYPE_LATEST)
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return app


def uvicorn_options(settings: ServiceSettings) -> dict[str, Any]:
    """How every service runs under uvicorn: its address, quiet logs, the keep-alive timeout, and the
    guarded HTTP protocol (`services.common.protocol`: header timeouts and size limit, enveloped parse
    errors)."""
    from services.common.protocol import GuardedHttpToolsProtocol

    return dict(host=settings.host, port=settings.port, log_level=settings.log_level.lower(), access_log=False,
                timeout_graceful_shutdown=10, log_config=None, timeout_keep_alive=int(settings.keep_alive_s),
                http=GuardedHttpToolsProtocol)


def serve(app: FastAPI, settings: ServiceSettings, *, worker_factory: str) -> None:
    """Run one service with uvicorn (used by every `python -m services.X` entrypoint).

    `settings.workers` > 1: that many worker processes on the port, each with its own SO_REUSEPORT socket
    so the kernel spreads connections evenly (`services.common.workers`: one that dies is replaced; on
    other systems than Linux uvicorn's supervisor and its one shared socket), each
    built by `worker_factory` ("module:function", no arguments, settings from the same environment), each
    with its own state (a retriever loads its index in every worker: RAM x workers). Their metrics go
    through prometheus_client's multiprocess mode, so `/metrics` from any worker reports the sum over all
    of them. `app` serves alone when `workers` is 1.
    """
    import uvicorn

    options = uvicorn_options(settings)
    if settings.workers == 1:
        uvicorn.run(app, **options)
        return
    import shutil
    import tempfile

    from services.common.workers import Supervisor

    # A fresh directory per run: files left by an earlier run would add their counts to this one's.
    metrics_dir = tempfile.mkdtemp(prefix="plugsearch-metrics-")
    os.environ[MULTIPROCESS_ENV] = metrics_dir
    try:
        if sys.platform == "linux":
            code = Supervisor(worker_factory, options, settings.workers).run()
        else:  # SO_REUSEPORT spreads connections over sockets only on Linux: uvicorn's shared socket
            uvicorn.run(worker_factory, factory=True, workers=settings.workers, **options)
            code = 0
    finally:
        shutil.rmtree(metrics_dir, ignore_errors=True)
    if code:
        sys.exit(code)


async def noop_lifespan(app: FastAPI) -> AsyncIterator[None]:  # pragma: no cover - helper for tests
    yield
