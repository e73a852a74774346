"""HTTP layer of the judge: `create_app(settings)`; POST /judge and POST /judge/batch."""

from __future__ import annotations

import httpx
from fastapi import FastAPI

from plugsearch.common.cache import ResultCache
from plugsearch.common.errors import error_responses
from plugsearch.common.llm import LLMBackend
from plugsearch.common.llm_app import item_router, llm_service_app
from plugsearch.common.metrics import ServiceMetrics
from plugsearch.common.schemas.judge import JudgeBatchRequest, JudgeBatchResponse, JudgeRequest, JudgeResult
from plugsearch.judge.prompts import load_prompt
from plugsearch.judge.serving import Judge
from plugsearch.judge.settings import JudgeSettings

ERRORS = error_responses({502: "`llm` mode: the judge LLM failed or is unreachable", 503: "not ready",
                          504: "`llm` mode: the judge LLM timed out"})

router = item_router("judge", "judge", (JudgeRequest, JudgeResult, JudgeBatchRequest, JudgeBatchResponse), ERRORS,
                     ("Score one prediction against gold answers (GenAcc, EM, F1)",
                      "Score many predictions concurrently (results in request order)"))


def create_app(settings: JudgeSettings | None = None, *, llm: LLMBackend | None = None,
               llm_transport: httpx.AsyncBaseTransport | None = None) -> FastAPI:
    """The judge app. Tests inject `llm` (a scripted fake) or `llm_transport` (a fake server)."""
    settings = settings or JudgeSettings()
    prompt = load_prompt(settings.prompt_version)  # a bad version fails here, at startup

    async def build(backend: LLMBackend, cache: ResultCache, metrics: ServiceMetrics) -> Judge:
        return Judge(backend, cache, prompt, verdict_max_tokens=settings.verdict_max_tokens, metrics=metrics)

    return llm_service_app(
        settings, service="judge", router=router, llm=llm, llm_transport=llm_transport, build=build,
        llm_required=settings.llm_required,
        version_details=lambda _: {"prompt_version": prompt.version, "llm_required": settings.llm_required},
        description="GenAcc judge: span check (pyserini has_answers), then an LLM judge; EM, F1.")
