"""`create_app` of a service built on one LLM and a result cache: the generator and the judge."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import httpx
from fastapi import APIRouter, FastAPI

from services.common.app import build_app
from services.common.cache import ResultCache, make_cache
from services.common.llm import LLMBackend, LLMServiceSettings, OpenAIChatClient
from services.common.metrics import ServiceMetrics


def llm_service_app(settings: LLMServiceSettings, *, service: str, router: APIRouter, description: str,
                    llm: LLMBackend | None, llm_transport: httpx.AsyncBaseTransport | None,
                    build: Callable[[LLMBackend, ResultCache, ServiceMetrics], Awaitable[Any]],
                    version_details: Callable[[Any], dict[str, Any]], llm_required: bool = True) -> FastAPI:
    """The lifespan builds the LLM client (unless `llm` is injected: then it belongs to the caller) and the
    cache, and stores `await build(llm, cache, metrics)` as `app.state.<service>`; readiness asks the LLM
    when `llm_required`; `/version` shows the model and `version_details(<what build made, or None>)`."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        metrics = app.state.metrics
        backend: LLMBackend = llm or OpenAIChatClient(settings.llm, name=f"{service}_llm", metrics=metrics,
                                                      transport=llm_transport)
        cache = make_cache(settings.redis_dsn(), name=service, ttl_s=settings.cache_ttl_s,
                           max_items=settings.cache_max_items, metrics=metrics)
        try:
            setattr(app.state, service, await build(backend, cache, metrics))

            async def readiness() -> dict[str, str]:
                return {"llm": await backend.check_health()} if llm_required else {service: "ok"}

            app.state.readiness = readiness
            yield
        finally:
            app.state.readiness = None
            setattr(app.state, service, None)
            await cache.aclose()
            if llm is None:
                await backend.aclose()

    def details(app: FastAPI) -> dict[str, Any]:
        return {"model": settings.llm.model, **version_details(getattr(app.state, service))}

    app = build_app(settings, service=service, lifespan=lifespan, version_details=details, description=description)
    setattr(app.state, service, None)
    app.include_router(router)
    return app
