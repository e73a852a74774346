"""The searcher's HTTP API: `POST /search` (JSON, or server-sent events with `"stream": true`),
`POST /search/batch`, the marks on their answers (`POST` / `GET /feedback`: `plugsearch.searcher.feedback.api`),
and the opt-in playground page at `/ui` (thin: parse, call serving, return)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request, Response
from pydantic import BaseModel

from plugsearch.common import sse
from plugsearch.common.admission import CALLER_STATE, COST_STATE, Caller, RateLimiter
from plugsearch.common.app import (
    EventStreamResponse,
    add_component_schemas,
    build_app,
    from_state,
    service_router,
)
from plugsearch.common.cache import ResultCache, make_cache
from plugsearch.common.clients import RetrieverClient
from plugsearch.common.errors import ErrorEnvelope, error_responses
from plugsearch.common.llm import OpenAIChatClient
from plugsearch.common.schemas.searcher import (
    STREAM_EVENT_MODELS,
    SearchBatchRequest,
    SearchBatchResponse,
    SearchRequest,
    SearchResponse,
)
from plugsearch.searcher.chat import AnswerBackend, ChatProxy
from plugsearch.searcher.chat_api import router as chat_router
from plugsearch.searcher.compact import CompactPolicy
from plugsearch.searcher.corpus_check import CorpusGate, Sampler, read_labelled
from plugsearch.searcher.env import RetrieverBackend
from plugsearch.searcher.feedback.api import router as feedback_router
from plugsearch.searcher.feedback.service import open_store
from plugsearch.searcher.index_identity import IndexIdentity
from plugsearch.searcher.policy import ChatPolicy, SearcherPolicy
from plugsearch.searcher.prompts import PromptSet
from plugsearch.searcher.retrieval import ServiceRetriever
from plugsearch.searcher.serving import PreparedSearch, SearcherMetrics, SearchService
from plugsearch.searcher.settings import SearcherSettings
from plugsearch.searcher.ui import OPEN_PATHS as UI_PATHS
from plugsearch.searcher.ui import add_ui_routes

JSON = "application/json"

STREAM_DESCRIPTION = (
    "With `stream: true`: server-sent events as the search goes, each `event: <name>` + `data: <JSON>`: "
    "`retrieval` (RetrievalEvent), `action` (ActionEvent), `end` (EndEvent), then `result` (this same "
    "SearchResponse), or `error` (ErrorEnvelope) when the search fails after the stream began. A cache hit "
    "sends `result` alone; closing the connection cancels the search.")
STREAM_EVENTS: dict[str, type[BaseModel]] = {**STREAM_EVENT_MODELS, "error": ErrorEnvelope}


def event_schema(name: str, model: type[BaseModel]) -> dict[str, Any]:
    """One server-sent event as OpenAPI 3.2 (and schemathesis) describe them: the event's fields, `data`
    a JSON document of `model`."""
    return {"type": "object", "required": ["event", "data"], "properties": {
        "event": {"const": name},
        "data": {"type": "string", "contentMediaType": JSON,
                 "contentSchema": {"$ref": f"#/components/schemas/{model.__name__}"}}}}

ERRORS = error_responses({
    400: "bad input", 401: "missing or invalid API key",
    422: "invalid request, or one costing more than a request may (cost_limit_exceeded)",
    429: "overloaded, or the key's rate limit spent (rate_limited); retry after Retry-After",
    503: "the retriever is unavailable; retry after Retry-After", 504: "request deadline exceeded"})


def accounted(request: Request, items: Sequence[PreparedSearch]) -> Caller | None:
    """Who asks (as the guard authenticated it), after telling the guard what the request costs, its
    searches' prices (its latency is judged per cost unit by the adaptive admission limit)."""
    setattr(request.state, COST_STATE, sum(item.cost for item in items))
    caller = getattr(request.state, CALLER_STATE, None)
    return caller if isinstance(caller, Caller) else None


SHOWN_DEFAULTS = ("max_turns", "retrieve_k", "select_k", "method", "constrained")
"""The defaults `/version` shows per mode."""


def _service(request: Request) -> SearchService:
    return from_state(request, "service", SearchService, starting="searcher is still starting")


router = service_router("search")

# The bodies are built as response models already: serialise them once (FastAPI's `response_model`
# would validate every document again), and still document the model in OpenAPI.
EVENTS = {"schema": {"oneOf": [event_schema(name, model) for name, model in STREAM_EVENTS.items()]}}


@router.post("/search", response_class=Response, responses={
    200: {"model": SearchResponse, "description": STREAM_DESCRIPTION,
          "content": {JSON: {}, sse.MEDIA_TYPE: EVENTS}}, **ERRORS})
async def search(body: SearchRequest, request: Request) -> Response:
    """Search for the documents an LLM needs to answer `question` (`stream: true`: as server-sent events)."""
    service = _service(request)
    prepared = await service.prepare(body)
    caller = accounted(request, [prepared])
    if body.stream:
        return EventStreamResponse(await service.open_stream(prepared, caller))
    return Response((await service.search(prepared, caller)).model_dump_json(), media_type=JSON)


@router.post("/search/batch", response_class=Response,
             responses={200: {"model": SearchBatchResponse, "content": {JSON: {}}}, **ERRORS})
async def search_batch(body: SearchBatchRequest, request: Request) -> Response:
    """Many searches in one call, run concurrently; results in request order."""
    service = _service(request)
    items = [await service.prepare(item) for item in body.items]  # in order: the first bad item is the answer
    caller = accounted(request, items)
    results = SearchBatchResponse(results=await service.search_batch(items, caller))
    return Response(results.model_dump_json(), media_type=JSON)


def checkable(policy: SearcherPolicy) -> bool:
    """Whether the corpus check measures this policy: one that searches s3 without an LLM (seconds for the
    check's searches; an LLM policy's would take minutes to hours on a CPU)."""
    return "s3" in policy.modes and not policy.uses_llm("s3")


def sampler(client: RetrieverClient) -> Sampler:
    """Passages drawn from the retriever's corpus (`POST /passages/sample`), for the corpus check."""

    async def sample(n: int, seed: int) -> list[tuple[str, str, str]]:
        found = await client.sample(n, seed)
        return [(d.id, d.title, d.text) for d in found.passages]

    return sample


def create_app(settings: SearcherSettings | None = None, *, policy: SearcherPolicy | None = None,
               retriever: RetrieverBackend | None = None, cache: ResultCache | None = None,
               answer: AnswerBackend | None = None) -> FastAPI:
    """The searcher app. Backends are built in the lifespan unless injected (tests, benches): `policy` (a
    `SearcherPolicy`: a chat LLM is served as `ChatPolicy(llm)`) replaces the one `policy_kind` names; `answer`:
    the answer LLM of the chat proxy (used only when `settings.chat` turns the proxy on)."""
    settings = settings or SearcherSettings()
    # the compact policy is a few kB of weights: loaded here, so /version names it before the lifespan ran
    served: SearcherPolicy | None = policy if policy is not None else \
        CompactPolicy.load(settings.compact_policy) if settings.policy_kind == "compact" else None
    policy_model = served.model if served is not None else settings.policy.model

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        metrics = app.state.metrics
        async with AsyncExitStack() as stack:

            def owned(resource: Any) -> Any:  # built here, not injected: closed on exit
                stack.push_async_callback(resource.aclose)
                return resource

            the_policy: SearcherPolicy = served if served is not None else ChatPolicy(
                owned(OpenAIChatClient(settings.policy, name="policy", metrics=metrics)),
                manifest=settings.chat_manifest())
            client: RetrieverClient | None = None
            the_retriever = retriever
            if the_retriever is None:
                client = owned(RetrieverClient(settings.retriever, metrics=metrics))
                the_retriever = ServiceRetriever(client, max_batch=settings.retriever_max_batch,
                                                 wait_s=settings.retriever_wait_s)
            the_cache = cache if cache is not None else owned(make_cache(
                settings.redis_dsn(), name="search", ttl_s=settings.cache_ttl_s,
                max_items=settings.cache_max_items, metrics=metrics))
            limiter = None if settings.rate_limit_per_s <= 0 else owned(RateLimiter(
                settings.rate_limit_per_s, settings.rate_limit_burst, redis_url=settings.redis_dsn()))
            identity = None if client is None else IndexIdentity(client, ttl_s=settings.index_id_ttl_s)
            gate = None
            if client is not None and settings.corpus_check == "auto" and checkable(the_policy):
                labelled = None if settings.corpus_check_qa is None else \
                    read_labelled(settings.corpus_check_qa, settings.corpus_check_questions)
                gate = owned(CorpusGate(the_policy, the_retriever, sampler(client),
                                        questions=settings.corpus_check_questions,
                                        margin=settings.corpus_check_margin, manifest=the_policy.manifest,
                                        recheck_share=settings.corpus_check_recheck_share,
                                        min_interval_s=settings.corpus_check_min_interval_s, labelled=labelled))
            store, unusable = await asyncio.to_thread(open_store, settings)
            app.state.service = SearchService(
                settings, policy=the_policy, retriever=the_retriever, cache=the_cache,
                metrics=SearcherMetrics(metrics.registry), index_identity=identity, rate_limiter=limiter,
                corpus_gate=gate, feedback_store=store, feedback_reason=unusable)
            stack.push_async_callback(app.state.service.feedback.aclose)  # what is queued is written, then closed
            stack.push_async_callback(app.state.service.aclose)  # closed before the clients it uses
            app.state.service.start_corpus_check()
            app.state.door = app.state.service.admission.door  # a key that spent its budget: 429 before its body is read
            if settings.chat is not None:
                the_answer = answer if answer is not None else owned(
                    OpenAIChatClient(settings.chat.answer, name="answer", metrics=metrics))
                app.state.chat = ChatProxy(app.state.service, the_answer, settings.chat)

            async def readiness() -> dict[str, str]:
                # The policy is not required: without it searches degrade to naive top-k, they do not fail.
                checks = {"retriever": await client.ready() if client is not None else "ok"}
                if gate is not None:  # the first verdict on the served corpus (seconds): until then naive answers
                    if not gate.ready and checks["retriever"] == "ok":
                        app.state.service.start_corpus_check()
                    checks["corpus_check"] = "ok" if gate.ready else "running: the policy is measured on the " \
                        "served corpus (naive top-k answers s3 searches until it ends)"
                return checks

            app.state.readiness = readiness
            yield

    def details(app: FastAPI) -> dict[str, Any]:
        service: SearchService | None = getattr(app.state, "service", None)
        info: dict[str, Any] = {"prompt_version": PromptSet.load(settings.prompts_dir).version,
                                "policy_model": policy_model}
        policy = service.policy if service is not None else served  # the LLM's is built in the lifespan
        setting = policy.setting if policy is not None else None
        if setting is not None:
            info["policy_setting"] = setting.model_dump()
        if service is not None and service.drift is not None:
            info["corpus_drift"] = service.drift
        if service is not None and service.corpus_gate is not None:
            info["corpus_check"] = service.corpus_gate.describe()
        if service is not None:
            info["feedback"] = service.feedback.describe()
        elif served is not None and checkable(served):
            info["corpus_check"] = {"state": "off" if settings.corpus_check == "off" else "not run"}
        if service is not None:  # per mode: what a request that sets nothing gets (s3: the policy's setting)
            modes = [m for m in ("s3", "qagent") if m in service.policy.modes] + ["naive"]
            info["defaults"] = {mode: {k: v for k, v in service.defaults(mode).items() if k in SHOWN_DEFAULTS}
                                for mode in modes}
        return info

    app = build_app(settings, service="searcher", lifespan=lifespan, version_details=details,
                    description="Plug-in search agent: s3 / QAgent / naive search loops over the retriever.",
                    open_paths=UI_PATHS if settings.ui else ())
    if settings.chat is not None:
        app.include_router(chat_router)
    if settings.ui:
        add_ui_routes(app)
    app.include_router(router)
    app.include_router(feedback_router)
    document = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:  # the event payloads, for the text/event-stream answer to refer to
            add_component_schemas(document(), *STREAM_EVENTS.values())
        return document()

    app.openapi = openapi  # type: ignore[method-assign]
    return app
