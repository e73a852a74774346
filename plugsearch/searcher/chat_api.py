"""Routes of the OpenAI-compatible answering proxy (mounted only when `SEARCHER_CHAT__...` configures it):
`POST /v1/chat/completions` (JSON, or server-sent events with `stream: true`) and `GET /v1/models`."""

from __future__ import annotations

import orjson
from fastapi import Request, Response

from plugsearch.common.admission import CALLER_STATE, COST_STATE
from plugsearch.common.app import EventStreamResponse, from_state, service_router
from plugsearch.common.errors import CostLimitExceeded, error_responses
from plugsearch.common.schemas.chat import ChatCompletionRequest, ChatCompletionResponse, ModelCard, ModelList
from plugsearch.searcher.chat import ChatProxy

ERRORS = error_responses({
    400: "bad input (no user message, bad search options, or parameters the answer LLM refused)",
    401: "missing or invalid API key",
    422: "invalid request, or max_tokens / min_tokens over the proxy's limit (cost_limit_exceeded)",
    429: "overloaded, the key's budget spent, or the key holds its share of the LLM; retry after Retry-After",
    502: "the answer LLM failed or refused this service's credentials",
    503: "the retriever or the answer LLM is unavailable; retry after Retry-After",
    504: "the answer LLM or the request timed out"})

router = service_router("openai")
"""Included by the searcher's `create_app` when `settings.chat` is set."""


@router.get("/v1/models", response_model=ModelList)
async def models(request: Request) -> ModelList:
    """The one model this proxy answers as (chat UIs list it)."""
    return ModelList(data=[ModelCard(id=request.app.state.settings.chat.model_name)])


@router.post("/v1/chat/completions", response_class=Response, responses={
    200: {"model": ChatCompletionResponse, "content": {"application/json": {}, "text/event-stream": {}}},
    **ERRORS})
async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
    """OpenAI chat completions, search-augmented: the last user message is searched and answered from
    the documents found by the configured answer LLM (`stream: true` streams server-sent events)."""
    proxy = from_state(request, "chat", ChatProxy, starting="searcher is still starting")
    caller = getattr(request.state, CALLER_STATE, None)
    try:
        prepared = await proxy.prepare(body)
    except CostLimitExceeded:
        await proxy.search.admission.charge_refusal(caller)  # refusing it was work too (see SearchAdmission.check_cost)
        raise
    setattr(request.state, COST_STATE, prepared.cost)  # admission judges latency per cost unit
    if body.stream:
        return EventStreamResponse(await proxy.open_stream(prepared, caller))
    return Response(orjson.dumps(await proxy.complete(prepared, caller)), media_type="application/json")
