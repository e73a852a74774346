"""Typed async clients of every service, built on `ServiceClient` (timeouts, retries, breaker)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

from services.common import sse
from services.common.errors import BadRequest
from services.common.http import ServiceClient, UpstreamError, decode_error_event
from services.common.schemas.generator import MAX_BATCH as GENERATE_MAX_BATCH
from services.common.schemas.generator import (
    GenerateBatchRequest,
    GenerateBatchResponse,
    GenerateRequest,
    GenerateResponse,
)
from services.common.schemas.judge import MAX_BATCH as JUDGE_MAX_BATCH
from services.common.schemas.judge import JudgeBatchRequest, JudgeBatchResponse, JudgeRequest, JudgeResult
from services.common.schemas.retriever import Method, RetrieveRequest, RetrieveResponse
from services.common.schemas.searcher import (
    STREAM_EVENT_MODELS,
    SearchBatchRequest,
    SearchBatchResponse,
    SearchRequest,
    SearchResponse,
    SearchStreamEvent,
)

Batch = TypeVar("Batch", GenerateBatchResponse, JudgeBatchResponse)


class RetrieverClient(ServiceClient):
    name = "retriever"

    async def retrieve(self, queries: Sequence[str], k: int = 10, method: Method | None = None) -> RetrieveResponse:
        """Raises `BadRequest` (never pydantic's error) when the arguments break the request's limits."""
        try:
            request = RetrieveRequest(queries=list(queries), k=k, method=method)
        except ValidationError as exc:
            first = exc.errors()[0]
            raise BadRequest(f"{self.name}: request refused before sending: {first['msg']}",
                             param=".".join(str(p) for p in first["loc"])) from exc
        return await self.post_model("/retrieve", request, RetrieveResponse)


class GeneratorClient(ServiceClient):
    name = "generator"

    async def generate(self, request: GenerateRequest, *, timeout: float | None = None) -> GenerateResponse:
        return await self.post_model("/generate", request, GenerateResponse, timeout=timeout)

    async def generate_batch(self, items: Sequence[GenerateRequest], *, chunk_size: int = GENERATE_MAX_BATCH,
                             timeout: float | None = None) -> list[GenerateResponse]:
        """Results in item order. More items than one request may carry go as concurrent chunks."""
        return await _post_in_chunks(self, "/generate/batch", list(items), min(chunk_size, GENERATE_MAX_BATCH),
                                     GenerateBatchRequest, GenerateBatchResponse, timeout)


class JudgeClient(ServiceClient):
    name = "judge"

    async def judge(self, request: JudgeRequest, *, timeout: float | None = None) -> JudgeResult:
        return await self.post_model("/judge", request, JudgeResult, timeout=timeout)

    async def judge_batch(self, items: Sequence[JudgeRequest], *, chunk_size: int = JUDGE_MAX_BATCH,
                          timeout: float | None = None) -> list[JudgeResult]:
        """Results in item order. More items than one request may carry go as concurrent chunks."""
        return await _post_in_chunks(self, "/judge/batch", list(items), min(chunk_size, JUDGE_MAX_BATCH),
                                     JudgeBatchRequest, JudgeBatchResponse, timeout)


async def _post_in_chunks(client: ServiceClient, path: str, items: list[Any], size: int,
                          request: Callable[..., BaseModel], response: type[Batch], timeout: float | None) -> list[Any]:
    """POST `items` as `request(items=chunk)`, at most `size` a request, the chunks concurrently; the
    `results` of every `response` in item order."""
    async def one(chunk: list[Any]) -> list[Any]:
        return list((await client.post_model(path, request(items=chunk), response, timeout=timeout)).results)

    if not items:
        return []
    if len(items) <= size:
        return await one(items)
    parts = await asyncio.gather(*(one(items[i:i + size]) for i in range(0, len(items), size)))
    return [result for part in parts for result in part]


class SearcherClient(ServiceClient):
    name = "searcher"

    async def search(self, request: SearchRequest) -> SearchResponse:
        return await self.post_model("/search", request, SearchResponse)

    async def search_batch(self, items: Sequence[SearchRequest]) -> list[SearchResponse]:
        response = await self.post_model("/search/batch", SearchBatchRequest(items=list(items)), SearchBatchResponse)
        return response.results

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
