"""HTTP layer of the generator: `create_app(settings)`; POST /generate and POST /generate/batch."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
from fastapi import FastAPI

from plugsearch.common.cache import ResultCache
from plugsearch.common.errors import error_responses
from plugsearch.common.llm import LLMBackend
from plugsearch.common.llm_app import item_router, llm_service_app
from plugsearch.common.metrics import ServiceMetrics
from plugsearch.common.schemas.generator import (
    GenerateBatchRequest,
    GenerateBatchResponse,
    GenerateRequest,
    GenerateResponse,
)
from plugsearch.generator.prompts import load_prompt
from plugsearch.generator.serving import Generator
from plugsearch.generator.settings import GeneratorSettings
from plugsearch.generator.tokens import TokenCounter, load_token_counter

ERRORS = error_responses({502: "the generator LLM failed or is unreachable", 503: "not ready",
                          504: "the generator LLM timed out"})

router = item_router("generator", "generate", (GenerateRequest, GenerateResponse, GenerateBatchRequest,
                                                 GenerateBatchResponse), ERRORS,
                     ("Answer one question from documents",
                      "Answer many questions concurrently (results in request order)"))


def create_app(settings: GeneratorSettings | None = None, *, llm: LLMBackend | None = None,
               llm_transport: httpx.AsyncBaseTransport | None = None,
               tokens: TokenCounter | None = None) -> FastAPI:
    """The generator app. Tests inject `llm` (a scripted fake) or `llm_transport` (a fake server)."""
    settings = settings or GeneratorSettings()
    prompt = load_prompt(settings.prompt_version)  # a bad version fails here, at startup

    async def build(backend: LLMBackend, cache: ResultCache, metrics: ServiceMetrics) -> Generator:
        counter = tokens
        if counter is None:
            counter = await asyncio.to_thread(
                load_token_counter, settings.llm.tokenizer, model=settings.llm.model,
                from_gguf=settings.tokenizer_from_gguf, cache_dir=settings.tokenizer_cache_dir)
        return Generator(backend, cache, counter, prompt, context_token_budget=settings.context_token_budget,
                         min_document_tokens=settings.min_document_tokens,
                         max_answer_tokens=settings.max_answer_tokens, metrics=metrics)

    def version_details(generator: Generator | None) -> dict[str, Any]:
        return {"prompt_version": prompt.version, "tokenizer": generator.tokens.kind if generator else None,
                "cache": generator.cache.backend.kind if generator else None,
                "context_token_budget": settings.context_token_budget}

    return llm_service_app(
        settings, service="generator", router=router, llm=llm, llm_transport=llm_transport, build=build,
        version_details=version_details,
        description="Frozen generator: answers a question from documents (s3's generator prompt).")
