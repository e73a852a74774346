"""The searcher's logic behind the API: request -> loop parameters -> cached search -> response + metrics.

Knows nothing of FastAPI. The loop itself lives in `services.searcher.loop` (shared with the trainer).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from pydantic import ValidationError

from services.common.cache import ResultCache, cache_key
from services.common.errors import BadRequest
from services.common.llm import LLMBackend
from services.common.metrics import LATENCY_BUCKETS
from services.common.schemas.searcher import (
    SearchParams,
    SearchRequest,
    SearchResponse,
    SearchTrace,
    TraceBlock,
    TraceMessage,
)
from services.searcher import parsing
from services.searcher.env import RetrieverBackend, SearchOutcome
from services.searcher.index_identity import IndexIdentity
from services.searcher.loop import run_search
from services.searcher.prompts import PromptSet
from services.searcher.settings import SearcherSettings

logger = logging.getLogger(__name__)

CACHE_NAMESPACE = "search"


class SearcherMetrics:
    """Search-level metrics, registered in the app's registry next to the HTTP ones."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.turns = Histogram("searcher_turns", "policy steps per search", ["mode"],
                               buckets=(0, 1, 2, 3, 4, 5, 6, 8, 11), registry=registry)
        self.queries = Histogram("searcher_queries", "queries issued per search", ["mode"],
                                 buckets=(0, 1, 2, 3, 4, 6, 9, 12, 20, 30), registry=registry)
        self.documents = Histogram("searcher_documents_returned", "documents returned per search", ["mode"],
                                   buckets=(0, 1, 2, 3, 5, 8, 12, 16, 24, 32, 64), registry=registry)
        self.stops = Counter("searcher_stop_total", "searches by stop reason", ["mode", "reason"],
                             registry=registry)
        self.degraded = Counter("searcher_degraded_total", "degraded searches", ["mode", "reason"],
                                registry=registry)
        self.actions = Counter("searcher_actions_total", "policy actions by validity", ["mode", "validity"],
                               registry=registry)
        self.stage_seconds = Histogram("searcher_stage_seconds", "time per stage of one search", ["stage"],
                                       buckets=LATENCY_BUCKETS, registry=registry)

    def observe(self, outcome: SearchOutcome) -> None:
        mode = outcome.mode
        self.turns.labels(mode).observe(outcome.turns)
        self.queries.labels(mode).observe(len(outcome.queries))
        self.documents.labels(mode).observe(len(outcome.documents))
        self.stops.labels(mode, outcome.stop_reason).inc()
        if outcome.degraded:
            self.degraded.labels(mode, outcome.stop_reason).inc()
        self.actions.labels(mode, "valid").inc(outcome.valid_actions)
        self.actions.labels(mode, "invalid").inc(outcome.invalid_actions)
        t = outcome.timings
        for stage, ms in (("total", t.total_ms), ("retrieval", t.retrieval_ms), ("policy", t.policy_ms),
                          ("overhead", t.overhead_ms)):
            self.stage_seconds.labels(stage).observe(ms / 1000)


def to_response(outcome: SearchOutcome, *, return_trace: bool) -> SearchResponse:
    trace = None
    if return_trace:
        trace = SearchTrace(
            messages=[TraceMessage(role=m.role, content=m.content) for m in outcome.messages],
            blocks=[TraceBlock(turn=b.turn, queries=b.queries, document_ids=[d.id for d in b.documents],
                               selected=b.selected) for b in outcome.blocks])
    return SearchResponse(
        question=outcome.question, mode=outcome.mode, documents=outcome.documents,
        context=parsing.format_documents(outcome.documents), queries=outcome.queries, turns=outcome.turns,
        stop_reason=outcome.stop_reason, degraded=outcome.degraded, degraded_reason=outcome.degraded_reason,
        timings=outcome.timings, valid_actions=outcome.valid_actions,
        invalid_actions=outcome.invalid_actions, policy_model=outcome.policy_model,
        prompt_version=outcome.prompt_version, trace=trace)


class SearchService:
    def __init__(self, settings: SearcherSettings, *, policy: LLMBackend, retriever: RetrieverBackend,
                 cache: ResultCache | None = None, metrics: SearcherMetrics | None = None,
                 index_identity: IndexIdentity | None = None) -> None:
        self.settings = settings
        self.index_identity = index_identity
        self.policy = policy
        self.retriever = retriever
        self.cache = cache if settings.cache_enabled else None
        self.metrics = metrics
        self.prompts = PromptSet.load(settings.prompts_dir)

    def params_for(self, request: SearchRequest) -> SearchParams:
        s = self.settings
        return SearchParams(
            mode=request.mode,
            max_turns=s.max_turns if request.max_turns is None else request.max_turns,
            retrieve_k=s.retrieve_k if request.retrieve_k is None else request.retrieve_k,
            select_k=s.select_k if request.select_k is None else request.select_k,
            method=request.method, temperature=s.temperature, max_new_tokens=s.max_new_tokens,
            constrained=s.constrained if request.constrained is None else request.constrained,
            constraint_style=s.constraint_style, max_invalid=s.max_invalid,
            max_queries_per_round=s.max_queries_per_round, doc_chars=s.doc_chars, timeout_s=s.search_timeout_s)

    def key(self, question: str, params: SearchParams, index_id: str | None = None) -> str:
        payload: dict[str, Any] = {
            "question": question,
            "index": index_id,
            "params": params.model_dump(exclude={"timeout_s"}),
            "policy_model": self.policy.model if params.mode != "naive" else None,
            "prompt_version": self.prompts.version,
        }
        return cache_key(CACHE_NAMESPACE, payload)

    async def search(self, request: SearchRequest) -> SearchResponse:
        """One search. Raises (-> 503) only when the retriever cannot give even the naive top-k."""
        try:
            params = self.params_for(request)
        except ValidationError as exc:  # e.g. select_k over the service's default retrieve_k
            errors = exc.errors()
            raise BadRequest(str(errors[0].get("msg", "invalid parameters")) if errors else "invalid parameters",
                             param="select_k") from exc
        cache, index_id = self.cache, None
        if cache is not None and self.index_identity is not None:
            index_id = await self.index_identity.current()
            cache = cache if index_id is not None else None  # which index would answer is unknown: no cache
        key = self.key(request.question, params, index_id)
        if cache is not None:
            hit = await cache.get_json(key)
            if hit is not None:
                response = SearchResponse.model_validate(hit)
                return response.model_copy(update={"cached": True,
                                                   "trace": response.trace if request.return_trace else None})
        outcome = await run_search(request.question, params, policy=self.policy, retriever=self.retriever,
                                   prompts=self.prompts)
        if self.metrics is not None:
            self.metrics.observe(outcome)
        if outcome.degraded:
            logger.warning("search degraded (%s): %s", outcome.stop_reason, outcome.degraded_reason)
        logger.info("search mode=%s turns=%d queries=%d docs=%d stop=%s valid=%d invalid=%d total_ms=%.0f "
                    "policy_ms=%.0f retrieval_ms=%.0f", outcome.mode, outcome.turns, len(outcome.queries),
                    len(outcome.documents), outcome.stop_reason, outcome.valid_actions, outcome.invalid_actions,
                    outcome.timings.total_ms, outcome.timings.policy_ms, outcome.timings.retrieval_ms)
        store = None if outcome.degraded else cache
        # the cached entry keeps the trace (a later request may ask for it); build it only when needed
        full = to_response(outcome, return_trace=store is not None or request.return_trace)
        if store is not None:
            await store.set_json(key, full.model_dump(mode="json"))
        return full if request.return_trace or full.trace is None else full.model_copy(update={"trace": None})

    async def search_batch(self, items: Sequence[SearchRequest]) -> list[SearchResponse]:
        """Many searches at once (bounded concurrency); fails as a whole only if the retriever is down."""
        sem = asyncio.Semaphore(self.settings.batch_concurrency)

        async def one(item: SearchRequest) -> SearchResponse:
            async with sem:
                return await self.search(item)

        results = await asyncio.gather(*(one(item) for item in items), return_exceptions=True)
        for result in results:
            if isinstance(result, BaseException):
                raise result
        return [r for r in results if isinstance(r, SearchResponse)]
