"""The frozen generator: question + documents -> a short answer (s3's generator prompt, temperature 0,
documents cut to a token budget; see plugsearch/generator/README.md). Knows nothing of FastAPI.

Answers are cached by (model, prompt version, question, document ids, limits); a batch runs its items
concurrently (the LLM client's semaphore bounds how many reach the LLM at once) and computes duplicate
items once.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from collections.abc import Sequence
from dataclasses import KW_ONLY, InitVar, dataclass

from prometheus_client import Counter
from pydantic import ValidationError

from plugsearch.common.aio import run_all
from plugsearch.common.cache import ResultCache, cache_key
from plugsearch.common.llm import ChatMessage, LLMBackend
from plugsearch.common.metrics import ServiceMetrics
from plugsearch.common.schemas.generator import GenDocument, GenerateRequest, GenerateResponse
from plugsearch.generator.prompts import AnswerPrompt
from plugsearch.generator.tokens import TokenCounter

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Context:
    text: str
    documents_used: int
    truncated: bool


def document_key(doc: GenDocument) -> str:
    if doc.id:
        return f"id:{doc.id}"
    return "sha:" + hashlib.sha256(f"{doc.title}\0{doc.text}".encode()).hexdigest()[:32]


@dataclass(eq=False)
class Generator:
    llm: LLMBackend
    cache: ResultCache
    tokens: TokenCounter
    prompt: AnswerPrompt
    _: KW_ONLY
    metrics: InitVar[ServiceMetrics]
    context_token_budget: int = 3000
    min_document_tokens: int = 16
    max_answer_tokens: int = 64

    def __post_init__(self, metrics: ServiceMetrics) -> None:
        self._answers = Counter("generator_answers_total", "answers returned", ["source"], registry=metrics.registry)
        self._truncated = Counter("generator_context_truncated_total",
                                  "requests whose documents were cut to the token budget", registry=metrics.registry)

    def build_context(self, documents: Sequence[GenDocument]) -> Context:
        """Format documents in order until the token budget is spent; cut the one that crosses it."""
        parts: list[str] = []
        remaining = self.context_token_budget
        truncated = False
        for doc in documents:
            index = len(parts) + 1
            formatted = self.prompt.render_document(index, doc.title, doc.text)
            cost = self.tokens.count(formatted) + 1  # +1: the blank line between documents
            if cost <= remaining:
                parts.append(formatted)
                remaining -= cost
                continue
            truncated = True
            header_cost = self.tokens.count(self.prompt.render_document(index, doc.title, "")) + 1
            room = remaining - header_cost
            if room >= self.min_document_tokens:
                parts.append(self.prompt.render_document(index, doc.title, self.tokens.truncate(doc.text, room)))
            break
        return Context(text="\n\n".join(parts), documents_used=len(parts), truncated=truncated)

    def messages(self, question: str, context: Context) -> list[ChatMessage]:
        template = self.prompt.system if context.documents_used else self.prompt.no_context
        system = template.substitute(context=context.text)  # no_context has no $context
        return [ChatMessage(role="system", content=system), ChatMessage(role="user", content=question)]

    def key(self, request: GenerateRequest) -> str:
        return cache_key("generator", {
            "model": self.llm.model,
            "prompt": self.prompt.version,
            "question": request.question,
            "documents": [document_key(d) for d in request.documents],
            "max_tokens": request.max_tokens or self.max_answer_tokens,
            "budget": [self.context_token_budget, self.min_document_tokens, self.tokens.kind],
        })

    async def generate(self, request: GenerateRequest) -> GenerateResponse:
        key = self.key(request)
        hit = await self.cache.get_json(key)
        if hit is not None:
            try:
                cached = GenerateResponse.model_validate({**hit, "cached": True})
            except (ValidationError, TypeError):
                logger.warning("ignoring a malformed cached answer under %s", key)
            else:
                self._answers.labels("cache").inc()
                return cached
        context = await asyncio.to_thread(self.build_context, request.documents)
        if context.truncated:
            self._truncated.inc()
        result = await self.llm.chat(self.messages(request.question, context), temperature=0.0,
                                     max_tokens=request.max_tokens or self.max_answer_tokens)
        response = GenerateResponse(answer=result.text.strip(), cached=False, model=self.llm.model,
                                    prompt_version=self.prompt.version, documents_used=context.documents_used,
                                    prompt_tokens=result.prompt_tokens, completion_tokens=result.completion_tokens)
        await self.cache.set_json(key, response.model_dump(exclude={"cached"}))
        self._answers.labels("llm").inc()
        return response

    async def generate_batch(self, requests: Sequence[GenerateRequest]) -> list[GenerateResponse]:
        """All items at once (bounded by the LLM client's concurrency); equal items are computed once.

        One failed item fails the batch (the others are cancelled): the caller retries or splits it.
        """
        keys = [self.key(r) for r in requests]
        unique: dict[str, GenerateRequest] = {}
        for key, request in zip(keys, requests, strict=True):
            unique.setdefault(key, request)
        results = dict(zip(unique, await run_all([self.generate(r) for r in unique.values()]), strict=True))
        return [results[key] for key in keys]
