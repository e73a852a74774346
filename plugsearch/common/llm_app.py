"""`create_app` of a service built on one LLM and a result cache: the generator and the judge."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import httpx
from fastapi import APIRouter, FastAPI, Request
from pydantic import BaseModel

from plugsearch.common.app import build_app, from_state, service_router
from plugsearch.common.cache import ResultCache, make_cache
from plugsearch.common.llm import LLMBackend, LLMServiceSettings, OpenAIChatClient
from plugsearch.common.metrics import ServiceMetrics


def item_router(service: str, method: str, models: tuple[type[BaseModel], ...],
                responses: dict[int | str, dict[str, Any]], summaries: tuple[str, str]) -> APIRouter:
    """`service_router(service)` with POST /<method> (`models`: its request and response) answered by
    `app.state.<service>.<method>(body)`, and POST /<method>/batch (`models`: its request, with `items`, and
    response, with `results` in request order) answered by `app.state.<service>.<method>_batch(body.items)`."""
    request_model, response_model, batch_request, batch_response = models

    async def one(body: Any, request: Request) -> Any:
        return await getattr(from_state(request, service, object), method)(body)

    async def batch(body: Any, request: Request) -> Any:
        answer = getattr(from_state(request, service, object), f"{method}_batch")
        return batch_response(results=await answer(body.items))

    one.__annotations__["body"] = request_model  # the models are known only here, at run time
    batch.__annotations__["body"] = batch_request
    router = service_router(service)
    router.add_api_route(f"/{method}", one, methods=["POST"], name=method, response_model=response_model,
                         responses=responses, summary=summaries[0])
    router.add_api_route(f"/{method}/batch", batch, methods=["POST"], name=f"{method}_batch",
                         response_model=batch_response, responses=responses, summary=summaries[1])
    return router


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
