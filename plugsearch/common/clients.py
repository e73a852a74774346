"""Typed async clients of every service, built on `ServiceClient` (timeouts, retries, breaker)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any, Generic, NamedTuple, TypeVar, cast
from urllib.parse import urlencode

from pydantic import BaseModel, ValidationError

from plugsearch.common import sse
from plugsearch.common.errors import BadRequest
from plugsearch.common.http import ServiceClient, UpstreamError, decode_error_event
from plugsearch.common.schemas.feedback import FeedbackPage, FeedbackQuery, FeedbackRequest, FeedbackResponse
from plugsearch.common.schemas.generator import MAX_BATCH as GENERATE_MAX_BATCH
from plugsearch.common.schemas.generator import (
    GenerateBatchRequest,
    GenerateBatchResponse,
    GenerateRequest,
    GenerateResponse,
)
from plugsearch.common.schemas.judge import MAX_BATCH as JUDGE_MAX_BATCH
from plugsearch.common.schemas.judge import JudgeBatchRequest, JudgeBatchResponse, JudgeRequest, JudgeResult
from plugsearch.common.schemas.retriever import (
    Method,
    RetrieveRequest,
    RetrieveResponse,
    SampleRequest,
    SampleResponse,
)
from plugsearch.common.schemas.searcher import (
    STREAM_EVENT_MODELS,
    SearchBatchRequest,
    SearchBatchResponse,
    SearchRequest,
    SearchResponse,
    SearchStreamEvent,
)

Item = TypeVar("Item", bound=BaseModel)
Result = TypeVar("Result", bound=BaseModel)


class RetrieverClient(ServiceClient):
    name = "retriever"

    async def retrieve(self, queries: Sequence[str], k: int = 10, method: Method | None = None, *,
                       methods: Sequence[Method | None] | None = None) -> RetrieveResponse:
        """`methods`: one method per query instead of `method` (a query may come twice, with two methods).
        Raises `BadRequest` (never pydantic's error) when the arguments break the request's limits."""
        try:
            request = RetrieveRequest(queries=list(queries), k=k, method=method,
                                      methods=list(methods) if methods is not None else None)
        except ValidationError as exc:
            first = exc.errors()[0]
            raise BadRequest(f"{self.name}: request refused before sending: {first['msg']}",
                             param=".".join(str(p) for p in first["loc"])) from exc
        return await self.post_model("/retrieve", request, RetrieveResponse)

    async def sample(self, n: int, seed: int = 0) -> SampleResponse:
        """`n` passages drawn at random from the served corpus (`POST /passages/sample`)."""
        return await self.post_model("/passages/sample", SampleRequest(n=n, seed=seed), SampleResponse)


class Routes(NamedTuple):
    """Where a service answers one item (`path`) and a list (`path/batch`), and the models of both."""

    path: str
    result: type[BaseModel]
    batch_request: Callable[..., BaseModel]
    batch_response: type[BaseModel]
    max_batch: int


class BatchingClient(ServiceClient, Generic[Item, Result]):
    routes: Routes

    async def one(self, request: Item, *, timeout: float | None = None) -> Result:
        return cast(Result, await self.post_model(self.routes.path, request, self.routes.result, timeout=timeout))

    async def batch(self, items: Sequence[Item], *, chunk_size: int | None = None,
                    timeout: float | None = None) -> list[Result]:
        """Results in item order. More items than one request may carry (or than `chunk_size`) go as
        concurrent chunks."""
        path, _, request, response, max_batch = self.routes
        size = min(chunk_size or max_batch, max_batch)

        async def post(chunk: Sequence[Item]) -> list[Result]:
            answer: Any = await self.post_model(f"{path}/batch", request(items=list(chunk)), response,
                                               timeout=timeout)
            return list(answer.results)

        parts = await asyncio.gather(*(post(items[i:i + size]) for i in range(0, len(items), size)))
        return [result for part in parts for result in part]


class GeneratorClient(BatchingClient[GenerateRequest, GenerateResponse]):
    name = "generator"
    routes = Routes("/generate", GenerateResponse, GenerateBatchRequest, GenerateBatchResponse, GENERATE_MAX_BATCH)
    generate = BatchingClient.one
    generate_batch = BatchingClient.batch


class JudgeClient(BatchingClient[JudgeRequest, JudgeResult]):
    name = "judge"
    routes = Routes("/judge", JudgeResult, JudgeBatchRequest, JudgeBatchResponse, JUDGE_MAX_BATCH)
    judge = BatchingClient.one
    judge_batch = BatchingClient.batch


class SearcherClient(ServiceClient):
    name = "searcher"

    async def search(self, request: SearchRequest) -> SearchResponse:
        return await self.post_model("/search", request, SearchResponse)

    async def search_batch(self, items: Sequence[SearchRequest]) -> list[SearchResponse]:
        response = await self.post_model("/search/batch", SearchBatchRequest(items=list(items)), SearchBatchResponse)
        return response.results

    async def feedback(self, request: FeedbackRequest) -> FeedbackResponse:
        """`POST /feedback`: safe to retry (a mark on the same search replaces the last one)."""
        return await self.post_model("/feedback", request, FeedbackResponse)

    async def feedback_page(self, query: FeedbackQuery) -> FeedbackPage:
        """`GET /feedback`: one page of marks."""
        response = await self.request("GET", f"/feedback?{urlencode(query.model_dump(exclude_none=True))}")
        try:
            return FeedbackPage.model_validate_json(response.content)
        except ValueError as exc:
            raise UpstreamError(f"{self.name} returned an unexpected response shape") from exc

    async def search_stream(self, request: SearchRequest) -> AsyncIterator[SearchStreamEvent]:
        """`POST /search` with `stream: true`: each event as its model, the `SearchResponse` last; an
        `error` event raises (as its type's `ServiceError`), and so does a stream that ends without result."""
        body = request.model_copy(update={"stream": True}).model_dump(mode="json", exclude_none=True)
        async with self.stream("POST", "/search", json=body) as response:
            async for event, data in sse.parse(response.aiter_lines()):
                if event == "error":
                    raise decode_error_event(self.name, data)
                model = STREAM_EVENT_MODELS.get(event)
                if model is None:
                    continue  # an event this client does not know (a newer server)
                try:
                    item = model.model_validate_json(data)
                except ValueError as exc:
                    raise UpstreamError(f"{self.name} streamed an unexpected {event} event") from exc
                yield item  # type: ignore[misc]  # one of SearchStreamEvent's models, by the table
                if isinstance(item, SearchResponse):
                    return
        raise UpstreamError(f"{self.name}: the stream ended before its result")
