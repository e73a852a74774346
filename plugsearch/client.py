"""The public Python client of the searcher: `SearchClient` (blocking) and `AsyncSearchClient` (asyncio).

    from plugsearch import SearchClient

    with SearchClient("http://127.0.0.1:8000", api_key="...") as client:
        result = client.search("who wrote the call of the wild", mode="s3")
        prompt = f"{result.context}\\n\\nQuestion: {result.question}"
        client.feedback(result.search_id, helpful=[result.documents[0].id])  # what helped: training data

Both return the searcher's pydantic models and call it through the `ServiceClient` the services use
between themselves (timeouts, retries, Retry-After honoured); errors raise `plugsearch.ServiceError`
subclasses with the server's status, message and parameter. Defaults: `PLUGSEARCH_URL` (else
http://127.0.0.1:8000) and `PLUGSEARCH_API_KEY`. See docs/integrations.md.
"""

from __future__ import annotations

import os
from collections.abc import AsyncGenerator, AsyncIterator, Coroutine, Iterator, Sequence
from typing import Any, TypeVar

import httpx
from pydantic import SecretStr

from plugsearch.common.aio import AsyncRunner
from plugsearch.common.clients import SearcherClient
from plugsearch.common.errors import BadRequest
from plugsearch.common.http import ClientSettings
from plugsearch.common.schemas.feedback import (
    FeedbackPage,
    FeedbackQuery,
    FeedbackRecord,
    FeedbackRequest,
    FeedbackResponse,
)
from plugsearch.common.schemas.searcher import (
    Method,
    SearchMode,
    SearchRequest,
    SearchResponse,
    SearchStreamEvent,
)

T = TypeVar("T")

DEFAULT_URL = "http://127.0.0.1:8000"
URL_ENV = "PLUGSEARCH_URL"
API_KEY_ENV = "PLUGSEARCH_API_KEY"


def _request(question: str | SearchRequest, options: dict[str, Any]) -> SearchRequest:
    if isinstance(question, SearchRequest):
        return question.model_copy(update=options) if options else question
    try:
        return SearchRequest(question=question, **options)
    except ValueError as exc:  # refused here, before any network call, with the server's own rules
        raise BadRequest(f"invalid search request: {exc}") from exc


class AsyncSearchClient:
    """asyncio client of `POST /search`. Use `async with`, or call `aclose()` when done."""

    def __init__(self, base_url: str | None = None, *, api_key: str | None = None, timeout: float = 120.0,
                 connect_timeout: float = 5.0, max_retries: int = 2, backoff: float = 0.5,
                 max_connections: int = 16, transport: httpx.AsyncBaseTransport | None = None) -> None:
        """`transport`: an httpx transport instead of the network (tests: `httpx.ASGITransport(app)`)."""
        key = api_key if api_key is not None else os.environ.get(API_KEY_ENV) or None
        self.base_url = (base_url or os.environ.get(URL_ENV) or DEFAULT_URL).rstrip("/")
        settings = ClientSettings(url=self.base_url, timeout_s=timeout, connect_timeout_s=connect_timeout,
                                  max_retries=max_retries, backoff_s=backoff, max_connections=max_connections,
                                  token=SecretStr(key) if key else None,
                                  # httpx's pool: all the client install has (aiohttp is the services' wire)
                                  http_transport="httpx")
        self._client = SearcherClient(settings, transport=transport, name="searcher")

    async def search(self, question: str | SearchRequest, *, mode: SearchMode | None = None,
                     max_turns: int | None = None, retrieve_k: int | None = None, select_k: int | None = None,
                     method: Method | None = None, constrained: bool | None = None,
                     return_trace: bool | None = None) -> SearchResponse:
        """Search for the documents an LLM needs to answer `question`; unset options take the server's
        defaults (s3, 3 turns, 8 retrieved and 3 selected per turn)."""
        options = {k: v for k, v in (("mode", mode), ("max_turns", max_turns), ("retrieve_k", retrieve_k),
                                     ("select_k", select_k), ("method", method), ("constrained", constrained),
                                     ("return_trace", return_trace)) if v is not None}
        return await self._client.search(_request(question, {**options, "stream": False}))

    async def search_stream(self, question: str | SearchRequest, **options: Any) -> AsyncGenerator[SearchStreamEvent, None]:
        """The same search, as it goes (`"stream": true`): `RetrievalEvent` (documents arrived),
        `ActionEvent` (the policy searched, marked documents or stopped), `EndEvent`, and last the
        `SearchResponse` that `search` returns. Options as for `search`. Leaving the loop early (or closing
        the generator: `contextlib.aclosing`) closes the connection, which cancels the search."""
        async for event in self._client.search_stream(_request(question, options)):
            yield event

    async def search_batch(self, questions: Sequence[str | SearchRequest], *, mode: SearchMode | None = None,
                           **options: Any) -> list[SearchResponse]:
        """Many searches in one request (at most 64), run concurrently by the server; results in order."""
        if mode is not None:
            options["mode"] = mode
        return await self._client.search_batch([_request(q, options) for q in questions])

    async def feedback(self, search_id: str, *, helpful: Sequence[str] = (), not_helpful: Sequence[str] = (),
                       answer: str | None = None, comment: str | None = None) -> FeedbackResponse:
        """Mark which documents of a search (its `search_id`) helped, and optionally which did not, the answer your
        LLM gave from them and a comment. A second mark on the same search replaces the first; once this returns
        the mark is stored. Raises `NotFound` (unknown or expired id), `Forbidden` (another key's search),
        `ValidationFailed` (ids the search did not return), `BadRequest` (refused here, before the network)."""
        try:
            request = FeedbackRequest(search_id=search_id, helpful=list(helpful), not_helpful=list(not_helpful),
                                      answer=answer, comment=comment)
        except ValueError as exc:
            raise BadRequest(f"invalid feedback: {exc}") from exc
        return await self._client.feedback(request)

    async def feedback_page(self, *, after: int = 0, limit: int = 100, since: float | None = None) -> FeedbackPage:
        """One page of marks (`GET /feedback`): the key's own, or every key's for an admin key or the internal
        token; oldest first; the next page is `after=page.next_after`."""
        try:
            query = FeedbackQuery(after=after, limit=limit, since=since)
        except ValueError as exc:
            raise BadRequest(f"invalid page: {exc}") from exc
        return await self._client.feedback_page(query)

    async def marks(self, *, since: float | None = None, page: int = 500) -> AsyncIterator[FeedbackRecord]:
        """Every mark this key may read (`feedback_page`, page after page), oldest first."""
        after = 0
        while True:
            found = await self.feedback_page(after=after, limit=page, since=since)
            for record in found.marks:
                yield record
            if found.next_after is None:
                return
            after = found.next_after

    async def ready(self) -> bool:
        """True when the searcher and its retriever answer (`GET /health/ready`)."""
        return await self._client.ready() == "ok"

    async def version(self) -> dict[str, Any]:
        """The searcher's `GET /version`: version, prompt version, policy model and search defaults."""
        body: dict[str, Any] = (await self._client.request("GET", "/version")).json()
        return body

    async def aclose(self) -> None:
        await self._client.aclose()

    async def __aenter__(self) -> AsyncSearchClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


class SearchClient:
    """Blocking client with the same methods as `AsyncSearchClient` (it runs one on a private event loop in a
    background thread, `plugsearch.common.aio.AsyncRunner`, so it also works where an event loop is already
    running, as in Jupyter). Use `with`, or call `close()` when done."""

    def __init__(self, base_url: str | None = None, **options: Any) -> None:
        self._async = AsyncSearchClient(base_url, **options)  # first: bad options start no thread
        self.base_url = self._async.base_url
        self._runner = AsyncRunner("plugsearch-client")
        self._closed = False

    def _run(self, call: Coroutine[Any, Any, T]) -> T:
        if self._closed:
            call.close()
            raise RuntimeError("the client is closed")
        return self._runner.run(call)

    def search(self, question: str | SearchRequest, **options: Any) -> SearchResponse:
        """See `AsyncSearchClient.search`."""
        return self._run(self._async.search(question, **options))

    def search_batch(self, questions: Sequence[str | SearchRequest], **options: Any) -> list[SearchResponse]:
        """See `AsyncSearchClient.search_batch`."""
        return self._run(self._async.search_batch(questions, **options))

    def search_stream(self, question: str | SearchRequest, **options: Any) -> Iterator[SearchStreamEvent]:
        """See `AsyncSearchClient.search_stream` (events as they arrive; leaving the loop early cancels)."""
        events = self._async.search_stream(question, **options)

        async def next_event() -> SearchStreamEvent:
            return await anext(events)

        try:
            while True:
                try:
                    yield self._run(next_event())
                except StopAsyncIteration:
                    return
        finally:
            if not self._closed:
                self._run(events.aclose())

    def feedback(self, search_id: str, **options: Any) -> FeedbackResponse:
        """See `AsyncSearchClient.feedback`."""
        return self._run(self._async.feedback(search_id, **options))

    def feedback_page(self, **options: Any) -> FeedbackPage:
        """See `AsyncSearchClient.feedback_page`."""
        return self._run(self._async.feedback_page(**options))

    def marks(self, *, since: float | None = None, page: int = 500) -> Iterator[FeedbackRecord]:
        """See `AsyncSearchClient.marks`."""
        after = 0
        while True:
            found = self.feedback_page(after=after, limit=page, since=since)
            yield from found.marks
            if found.next_after is None:
                return
            after = found.next_after

    def ready(self) -> bool:
        return self._run(self._async.ready())

    def version(self) -> dict[str, Any]:
        return self._run(self._async.version())

    def close(self) -> None:
        if self._closed:
            return
        try:
            self._run(self._async.aclose())
        finally:
            self._closed = True
            self._runner.close()

    def __enter__(self) -> SearchClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
