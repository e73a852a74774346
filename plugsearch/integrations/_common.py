"""What the framework retrievers share: the search options they take, the metadata each document carries,
the clients they call the searcher with, and what a failed search says."""

from __future__ import annotations

import asyncio
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from plugsearch.client import AsyncSearchClient, SearchClient
from plugsearch.common.errors import ServiceError
from plugsearch.common.schemas.searcher import Method, SearchedDocument, SearchMode, SearchResponse


@dataclass(frozen=True)
class SearchOptions:
    """The search each retriever runs: its mode and budget (unset: the searcher's defaults, s3 with 3
    turns, 8 documents retrieved and 3 selected per turn)."""

    mode: SearchMode = "s3"
    max_turns: int | None = None
    retrieve_k: int | None = None
    select_k: int | None = None
    method: Method | None = None

    def merged(self, **overrides: Any) -> dict[str, Any]:
        """The keywords of `SearchClient.search`: these options, with the non-None `overrides` on top."""
        options = {"mode": self.mode, "max_turns": self.max_turns, "retrieve_k": self.retrieve_k,
                   "select_k": self.select_k, "method": self.method}
        options.update({k: v for k, v in overrides.items() if v is not None})
        return {k: v for k, v in options.items() if v is not None}


def search_metadata(response: SearchResponse) -> dict[str, Any]:
    """The search's own facts, on every document it returned: `mode`, `queries` (what the policy searched),
    `policy` (its model; None for naive top-k), `degraded` (+ why), `stop_reason`, `cached`."""
    return {"mode": response.mode, "queries": list(response.queries), "policy": response.policy_model,
            "degraded": response.degraded, "degraded_reason": response.degraded_reason,
            "stop_reason": response.stop_reason, "cached": response.cached}


def document_metadata(doc: SearchedDocument, search: dict[str, Any]) -> dict[str, Any]:
    """A document's metadata: `id`, `title`, `score`, where the search found it (`turn`, `query`) and the
    search's metadata (`search_metadata`)."""
    return {"id": doc.id, "title": doc.title, "score": doc.score, "turn": doc.turn, "query": doc.query, **search}


def passage(doc: SearchedDocument) -> str:
    """A document as one passage of text ("title | text", the form DSPy's retrievers hand a prompt)."""
    return f"{doc.title} | {doc.text}" if doc.title else doc.text


def failure(exc: ServiceError) -> dict[str, Any]:
    """What a framework error carries from the searcher's error envelope: `status`, `error_type`, `param`,
    `retry_after` (the message is the envelope's, prefixed with the service that answered)."""
    return {"status": exc.upstream_status or exc.status, "error_type": exc.type, "param": exc.param,
            "retry_after": exc.retry_after}


class FailedSearch:
    """The fields a framework's error class gets from a failed search (mixed into each one)."""

    status: int
    error_type: str
    param: str | None
    retry_after: float | None

    def _set(self, exc: ServiceError) -> None:
        for name, value in failure(exc).items():
            setattr(self, name, value)


@dataclass
class Clients:
    """The searcher's clients a retriever calls: one blocking `SearchClient`, and one `AsyncSearchClient`
    per event loop (an asyncio client belongs to the loop it first ran in), each made on first use; or
    the ones given."""

    base_url: str | None = None
    api_key: str | None = None
    timeout: float = 120.0
    client: SearchClient | None = None
    async_client: AsyncSearchClient | None = None
    _owned: bool = field(default=True, repr=False)
    _by_loop: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, AsyncSearchClient] = field(
        default_factory=weakref.WeakKeyDictionary, repr=False)

    def blocking(self) -> SearchClient:
        if self.client is None:
            self.client = SearchClient(self.base_url, api_key=self.api_key, timeout=self.timeout)
        return self.client

    def for_loop(self) -> AsyncSearchClient:
        if self.async_client is not None:
            return self.async_client
        loop = asyncio.get_running_loop()
        client = self._by_loop.get(loop)
        if client is None:
            client = self._by_loop[loop] = AsyncSearchClient(self.base_url, api_key=self.api_key,
                                                             timeout=self.timeout)
        return client

    def search(self, query: str, options: dict[str, Any], error: Callable[[ServiceError], Exception]
               ) -> SearchResponse:
        """One search on the blocking client; a failed one raises `error(exc)` (the framework's error class),
        the client's `ServiceError` as its cause."""
        try:
            return self.blocking().search(query, **options)
        except ServiceError as exc:
            raise error(exc) from exc

    async def asearch(self, query: str, options: dict[str, Any], error: Callable[[ServiceError], Exception]
                      ) -> SearchResponse:
        """`search` on the running loop's asyncio client."""
        try:
            return await self.for_loop().search(query, **options)
        except ServiceError as exc:
            raise error(exc) from exc

    def close(self) -> None:
        """Close the blocking client this made (asyncio ones: `aclose`, from their loop)."""
        if self.client is not None and self._owned:
            self.client.close()
            self.client = None

    async def aclose(self) -> None:
        """Close the asyncio client this made for the running loop."""
        client = self._by_loop.pop(asyncio.get_running_loop(), None)
        if client is not None:
            await client.aclose()


def make_clients(base_url: str | None, api_key: str | None, timeout: float, client: SearchClient | None,
                 async_client: AsyncSearchClient | None) -> Clients:
    """`Clients` for a retriever: the given clients (closed by their owner), else its own."""
    return Clients(base_url=base_url, api_key=api_key, timeout=timeout, client=client, async_client=async_client,
                   _owned=client is None)
