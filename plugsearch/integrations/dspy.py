"""A DSPy retriever over the searcher (`pip install 'plugsearch[dspy]'`).

    import dspy
    from plugsearch.integrations.dspy import PlugsearchRM

    search = PlugsearchRM("http://127.0.0.1:8000", mode="s3", max_turns=3)
    found = search("who wrote the call of the wild")          # or: await search.acall(...)
    found.passages          # ["title | text", ...]: what a DSPy program puts into its prompt
    found.documents[0]      # {"id", "title", "text", "score", "turn", "query"}
    found.queries, found.mode, found.policy, found.degraded
    # in a program: call it from a dspy.Module's forward, and put found.passages into the prompt

`PlugsearchRM` is a `dspy.Retrieve` whose `forward` runs one `POST /search` and returns a `dspy.Prediction`
(DSPy's own result type: it has no document class) with `passages`, `documents`, `ids`, `scores` and the
search's metadata. `k`, when given, keeps the first k documents (the searcher decides how many it returns:
its budget is `max_turns`, `retrieve_k`, `select_k`). A refused or failed search raises
`PlugsearchRetrieverError` (a `dspy.DSPyError` with the searcher's `status`).
"""

from __future__ import annotations

from typing import Any

import dspy

from plugsearch.client import AsyncSearchClient, SearchClient
from plugsearch.common.errors import ServiceError
from plugsearch.common.schemas.searcher import Method, SearchMode, SearchResponse
from plugsearch.integrations._common import (
    FailedSearch,
    SearchOptions,
    make_clients,
    passage,
    search_metadata,
)


class PlugsearchRetrieverError(dspy.DSPyError, FailedSearch):
    """The searcher refused or failed the search: the envelope's message, and `status`, `error_type`,
    `param`, `retry_after` (DSPyError's `status`, `retry_after` and `code`); the client's `ServiceError` is
    the `__cause__`."""

    default_code = "plugsearch_search_failed"

    def __init__(self, exc: ServiceError) -> None:
        super().__init__(exc.message, provider="plugsearch", status=exc.upstream_status or exc.status,
                         retry_after=exc.retry_after, provider_code=exc.type)
        self._set(exc)


class PlugsearchRM(dspy.Retrieve):
    """Passages for a query from a plugsearch searcher (one search per call)."""

    def __init__(self, base_url: str | None = None, *, api_key: str | None = None, mode: SearchMode = "s3",
                 max_turns: int | None = None, retrieve_k: int | None = None, select_k: int | None = None,
                 method: Method | None = None, k: int | None = None, timeout: float = 120.0,
                 client: SearchClient | None = None, async_client: AsyncSearchClient | None = None,
                 callbacks: list[Any] | None = None) -> None:
        """`base_url`: default PLUGSEARCH_URL, else http://127.0.0.1:8000; `api_key`: default
        PLUGSEARCH_API_KEY; `k`: keep at most k documents (None: all the search returned)."""
        super().__init__(k=k, callbacks=callbacks)  # type: ignore[arg-type]
        self.options = SearchOptions(mode, max_turns, retrieve_k, select_k, method)
        self._clients = make_clients(base_url, api_key, timeout, client, async_client)

    def forward(self, query: str, k: int | None = None, **overrides: Any) -> dspy.Prediction:  # type: ignore[override]
        response = self._clients.search(query, self.options.merged(**overrides), PlugsearchRetrieverError)
        return _prediction(response, self.k if k is None else k)

    async def aforward(self, query: str, k: int | None = None, **overrides: Any) -> dspy.Prediction:
        response = await self._clients.asearch(query, self.options.merged(**overrides), PlugsearchRetrieverError)
        return _prediction(response, self.k if k is None else k)

    async def acall(self, query: str, k: int | None = None, **overrides: Any) -> dspy.Prediction:
        """`await search.acall(query)`: the asyncio search."""
        return await self.aforward(query, k, **overrides)

    def close(self) -> None:
        """Close the blocking client it made (`aclose` for the asyncio one of the running loop)."""
        self._clients.close()

    async def aclose(self) -> None:
        await self._clients.aclose()


def _prediction(response: SearchResponse, k: int | None) -> dspy.Prediction:
    docs = response.documents if k is None else response.documents[:k]
    return dspy.Prediction(
        passages=[passage(d) for d in docs],
        documents=[{"id": d.id, "title": d.title, "text": d.text, "score": d.score, "turn": d.turn, "query": d.query}
                   for d in docs],
        ids=[d.id for d in docs], scores=[d.score for d in docs], **search_metadata(response))
