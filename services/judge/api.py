"""HTTP layer of the judge: `create_app(settings)`; POST /judge and POST /judge/batch."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
from fastapi import FastAPI, Request

from services.common.app import build_app, from_state, service_router
from services.common.cache import make_cache
from services.common.errors import error_responses
from services.common.llm import LLMBackend, OpenAIChatClient
from services.common.schemas.judge import JudgeBatchRequest, JudgeBatchResponse, JudgeRequest, JudgeResult
from services.judge.prompts import load_prompt
from services.judge.serving import Judge
from services.judge.settings import JudgeSettings

ERRORS = error_responses({502: "`llm` mode: the judge LLM failed or is unreachable", 503: "not ready",
                          504: "`llm` mode: the judge LLM timed out"})

router = service_router("judge")


@router.post("/judge", response_model=JudgeResult, responses=ERRORS,
             summary="Score one prediction against gold answers (GenAcc, EM, F1)")
async def judge(body: JudgeRequest, request: Request) -> JudgeResult:
    return await from_state(request, "judge", Judge).judge(body)


@router.post("/judge/batch", response_model=JudgeBatchResponse, responses=ERRORS,
             summary="Score many predictions concurrently (results in request order)")
async def judge_batch(body: JudgeBatchRequest, request: Request) -> JudgeBatchResponse:
    return JudgeBatchResponse(results=await from_state(request, "judge", Judge).judge_batch(body.items))


def create_app(settings: JudgeSettings | None = None, *, llm: LLMBackend | None = None,
               llm_transport: httpx.AsyncBaseTransport | None = None) -> FastAPI:
    """The judge app. Tests inject `llm` (a scripted fake) or `llm_transport` (a fake server)."""
    settings = settings or JudgeSettings()
    prompt = load_prompt(settings.prompt_version)  # a bad version fails here, at startup

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        metrics = app.state.metrics
        backend: LLMBackend = llm or OpenAIChatClient(settings.llm, name="judge_llm", metrics=metrics,
                                                      transport=llm_transport)
        cache = make_cache(settings.redis_dsn(), name="judge", ttl_s=settings.cache_ttl_s,
                           max_items=settings.cache_max_items, metrics=metrics)
        try:
            app.state.judge = Judge(backend, cache, prompt, verdict_max_tokens=settings.verdict_max_tokens,
                                    metrics=metrics)

            async def readiness() -> dict[str, str]:
                if not settings.llm_required:
                    return {"judge": "ok"}
                return {"llm": await backend.check_health()}

            app.state.readiness = readiness
            yield
        finally:
            app.state.readiness = None
            app.state.judge = None
            await cache.aclose()
            if llm is None:  # injected backends belong to the caller
                await backend.aclose()

    def version_details(app: FastAPI) -> dict[str, Any]:
        return {"model": settings.llm.model, "prompt_version": prompt.version,
                "llm_required": settings.llm_required}

    app = build_app(settings, service="judge", lifespan=lifespan, version_details=version_details,
                    description="GenAcc judge: span check (pyserini has_answers), then an LLM judge; EM, F1.")
    app.state.judge = None
    app.include_router(router)
    return app
