"""App factory pieces every service uses: `build_app` (the guard, error handlers, health, version, metrics),
route wiring, OpenAPI helpers.

`build_app` puts the guard (`plugsearch.common.guard`) in front of every route but the open ones, and adds
`/health/live`, `/health/ready`, `/version` and `/metrics`; its lifespan exports pending spans on exit and, in a
served process, tunes the garbage collector (`tune_gc`). Routes: a module-level `service_router(tag)` per
service, state read through `from_state` (503 until the lifespan built it); errors are documented only through
route `responses` (`error_responses`). Running the process: `plugsearch.common.process`.
"""

from __future__ import annotations

import asyncio
import gc
import os
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Iterable, Mapping
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import Any, TypeVar, cast

from fastapi import APIRouter, FastAPI, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel
from starlette.types import Receive, Scope, Send

from plugsearch.common import sse, tracing
from plugsearch.common.error_handlers import install_error_handlers
from plugsearch.common.errors import NotReady, error_responses
from plugsearch.common.guard import GUARD_ERRORS, OPEN_PATHS, GuardMiddleware
from plugsearch.common.metrics import (
    MULTIPROCESS_ENV,
    ServiceMetrics,
    forget_dead_workers,
    multiprocess_registry,
)
from plugsearch.common.settings import ServiceSettings
from plugsearch.version import __version__

T = TypeVar("T")

ReadinessCheck = Callable[[], Awaitable[dict[str, str]]]
"""Returns {check name: "ok" or a reason}; the service is ready when every value is "ok"."""


class HealthStatus(BaseModel):
    status: str
    checks: dict[str, str] = {}


class VersionInfo(BaseModel):
    service: str
    version: str
    details: dict[str, Any] = {}


# ------------------------------------------------------------------ routes, their state, their documented errors
def service_router(tag: str) -> APIRouter:
    """The router of a service's guarded operations (every service builds one at import; `create_app`
    includes it). Each operation documents `GUARD_ERRORS`; its own `responses=error_responses(...)` adds
    the statuses of its domain, or says one of these more precisely."""
    return APIRouter(tags=[tag], responses=error_responses(GUARD_ERRORS))


def from_state(request: Request, name: str, kind: type[T], *, starting: str | None = None) -> T:
    """What the lifespan stored as `app.state.<name>` (an instance of `kind`, unchecked: tests inject fakes).
    Until it has, 503 + Retry-After: `app.state.startup_error` when starting failed, else `starting`."""
    value = getattr(request.app.state, name, None)
    if value is None:
        reason = getattr(request.app.state, "startup_error", None) or starting or f"{name} is still starting"
        raise NotReady(reason, retry_after=2)
    return cast(T, value)


def add_component_schemas(schema: dict[str, Any], *models: type[BaseModel]) -> dict[str, Any]:
    """Put `models` (and the models they use) into the OpenAPI document's components, for operations to
    refer to (`#/components/schemas/<Model>`) where FastAPI would not list them itself (server-sent
    events); returns the components' schemas."""
    components: dict[str, Any] = schema.setdefault("components", {}).setdefault("schemas", {})
    for model in models:
        definition = model.model_json_schema(ref_template="#/components/schemas/{model}")
        for name, nested in definition.pop("$defs", {}).items():
            components.setdefault(name, nested)
        components.setdefault(model.__name__, definition)
    return components


def document_auth(schema: dict[str, Any], open_paths: frozenset[str]) -> dict[str, Any]:
    """The two ways to present a key (Bearer or X-API-Key), on every guarded operation."""
    schema.setdefault("components", {})["securitySchemes"] = {
        "bearer": {"type": "http", "scheme": "bearer"},
        "apiKey": {"type": "apiKey", "in": "header", "name": "X-API-Key"}}
    for path, operations in schema.get("paths", {}).items():
        if path not in open_paths:
            for operation in operations.values():
                operation["security"] = [{"bearer": []}, {"apiKey": []}]
    return schema


def tune_gc(threshold: int) -> None:
    """The garbage collector of a served process (`ServiceSettings.gc_threshold`), once it has started: what
    startup built (modules, the app, indexes, policies) collected once and frozen out of later collections, and
    the young generation collected every `threshold` net allocations instead of 700. 0: left as it is."""
    if threshold <= 0:
        return
    gc.collect()
    gc.freeze()
    _, middle, oldest = gc.get_threshold()
    gc.set_threshold(threshold, middle, oldest)


def _flushing_traces(lifespan: Callable[[FastAPI], AbstractAsyncContextManager[None]] | None
                     ) -> Callable[[FastAPI], AbstractAsyncContextManager[None]]:
    """The service's lifespan, then the spans still pending exported (uvicorn ends on the signal that
    stopped it, so the SDK's own exit hook never runs). A served app (`process.entrypoint`: `app.state.tune_gc`) tunes
    its process's garbage collector once the lifespan has started it (`tune_gc`)."""
    @asynccontextmanager
    async def run(app: FastAPI) -> AsyncIterator[None]:
        try:
            if lifespan is None:
                _tuned(app)
                yield
            else:
                async with lifespan(app):
                    _tuned(app)
                    yield
        finally:
            if tracing.enabled():
                await asyncio.to_thread(tracing.flush)

    return run


def _tuned(app: FastAPI) -> None:
    if getattr(app.state, "tune_gc", False):  # the process is the service's (not a test's, nor a bench's)
        tune_gc(app.state.settings.gc_threshold)


def build_app(
    settings: ServiceSettings,
    *,
    service: str,
    description: str,
    lifespan: Callable[[FastAPI], AbstractAsyncContextManager[None]] | None = None,
    version_details: Callable[[FastAPI], dict[str, Any]] | None = None,
    open_paths: Iterable[str] = (),
) -> FastAPI:
    """A FastAPI app with the shared middleware, error handlers and operational endpoints. The lifespan
    must set `app.state.readiness` (a ReadinessCheck) once it can answer, and may set
    `app.state.startup_error`. `open_paths`: more paths without auth or limits, besides `OPEN_PATHS`."""
    forget_dead_workers()
    metrics = ServiceMetrics(service)
    app = FastAPI(title=f"plugsearch {service}", description=description, version=__version__,
                  lifespan=_flushing_traces(lifespan), **tracing.fastapi_options())
    app.state.settings = settings
    app.state.metrics = metrics
    app.state.readiness = None
    app.state.startup_error = None
    install_error_handlers(app)
    unguarded = OPEN_PATHS | set(open_paths)
    app.add_middleware(GuardMiddleware, settings=settings, metrics=metrics, open_paths=unguarded)
    if settings.api_keys or settings.internal_token is not None:  # keys checked: document them
        default_openapi = app.openapi

        def openapi() -> dict[str, Any]:
            if app.openapi_schema is None:
                app.openapi_schema = document_auth(default_openapi(), unguarded)
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
        return VersionInfo(service=service, version=__version__, details=details)

    @app.get("/metrics", tags=["ops"], include_in_schema=False)
    async def metrics_endpoint() -> Response:
        if os.environ.get(MULTIPROCESS_ENV):  # one of several workers: report all of them
            return Response(generate_latest(multiprocess_registry()), media_type=CONTENT_TYPE_LATEST)
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return app


class EventStreamResponse(StreamingResponse):
    """A `text/event-stream` response over an async generator that is closed when the response ends for
    any reason (a client that went away included), so whatever work the generator owns stops with it."""

    def __init__(self, events: AsyncGenerator[bytes, None], headers: Mapping[str, str] | None = None) -> None:
        super().__init__(events, media_type=sse.MEDIA_TYPE, headers={**sse.HEADERS, **(headers or {})})
        self._events = events

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._events.aclose()
