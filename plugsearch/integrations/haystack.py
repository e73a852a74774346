"""A Haystack retriever component over the searcher (`pip install 'plugsearch[haystack]'`).

    from haystack import Pipeline
    from plugsearch.integrations.haystack import PlugsearchRetriever

    pipeline = Pipeline()
    pipeline.add_component("retriever", PlugsearchRetriever(url="http://127.0.0.1:8000", mode="s3"))
    # ... pipeline.connect("retriever.documents", "prompt_builder.documents")
    result = pipeline.run({"retriever": {"query": "who wrote the call of the wild"}})
    result["retriever"]["documents"][0].content, ...meta["title"], ...score

Each `run` (or `run_async`) is one `POST /search`; the output is `documents`, Haystack `Document`s (`id`,
`content` = the text, `score`, `meta`: title, turn, query and the search's mode, queries, policy, degraded,
stop_reason). The key is a Haystack `Secret` (default: the PLUGSEARCH_API_KEY variable, if set), so a
serialized pipeline never holds it. A refused or failed search raises `PlugsearchRetrieverError` (a
`ComponentError`; a pipeline wraps it in its `PipelineRuntimeError`).
"""

from __future__ import annotations

from typing import Any

from haystack import Document, component, default_from_dict, default_to_dict
from haystack.core.errors import ComponentError
from haystack.utils import Secret, deserialize_secrets_inplace

from plugsearch.client import AsyncSearchClient, SearchClient
from plugsearch.common.errors import ServiceError
from plugsearch.common.schemas.searcher import Method, SearchMode, SearchResponse
from plugsearch.integrations._common import (
    Clients,
    FailedSearch,
    SearchOptions,
    document_metadata,
    make_clients,
    search_metadata,
)


class PlugsearchRetrieverError(ComponentError, FailedSearch):
    """The searcher refused or failed the search: the envelope's message, and `status`, `error_type`,
    `param`, `retry_after`; the client's `ServiceError` is the `__cause__`."""

    def __init__(self, exc: ServiceError) -> None:
        super().__init__(exc.message)
        self._set(exc)


@component
class PlugsearchRetriever:
    """Documents for a query from a plugsearch searcher (one search per run)."""

    def __init__(self, url: str | None = None, *,
                 api_key: Secret | None = Secret.from_env_var("PLUGSEARCH_API_KEY", strict=False),
                 mode: SearchMode = "s3", max_turns: int | None = None, retrieve_k: int | None = None,
                 select_k: int | None = None, method: Method | None = None, timeout: float = 120.0,
                 client: SearchClient | None = None, async_client: AsyncSearchClient | None = None) -> None:
        """`url`: default PLUGSEARCH_URL, else http://127.0.0.1:8000; unset budget: the searcher's
        defaults (3 turns, 8 retrieved, 3 selected). `client` / `async_client`: clients to use instead of
        its own (not serialized)."""
        self.url = url
        self.api_key = api_key
        self.options = SearchOptions(mode, max_turns, retrieve_k, select_k, method)
        self.timeout = timeout
        self._given = (client, async_client)
        self._clients: Clients | None = None

    def warm_up(self) -> None:
        """Make the clients (the pipeline calls this before the first run)."""
        if self._clients is None:
            key = self.api_key.resolve_value() if self.api_key is not None else None
            self._clients = make_clients(self.url, key, self.timeout, *self._given)

    def _warm(self) -> Clients:
        self.warm_up()
        assert self._clients is not None
        return self._clients

    @component.output_types(documents=list[Document])
    def run(self, query: str, mode: SearchMode | None = None, max_turns: int | None = None,
            retrieve_k: int | None = None, select_k: int | None = None) -> dict[str, list[Document]]:
        """Search for `query` (the options override the component's for this run)."""
        options = self.options.merged(mode=mode, max_turns=max_turns, retrieve_k=retrieve_k, select_k=select_k)
        return {"documents": _documents(self._warm().search(query, options, PlugsearchRetrieverError))}

    @component.output_types(documents=list[Document])
    async def run_async(self, query: str, mode: SearchMode | None = None, max_turns: int | None = None,
                        retrieve_k: int | None = None, select_k: int | None = None) -> dict[str, list[Document]]:
        """`run`, on asyncio (`AsyncPipeline`)."""
        options = self.options.merged(mode=mode, max_turns=max_turns, retrieve_k=retrieve_k, select_k=select_k)
        return {"documents": _documents(await self._warm().asearch(query, options, PlugsearchRetrieverError))}

    def close(self) -> None:
        """Close the blocking client it made (`aclose` for the asyncio one of the running loop)."""
        if self._clients is not None:
            self._clients.close()

    async def aclose(self) -> None:
        if self._clients is not None:
            await self._clients.aclose()

    def to_dict(self) -> dict[str, Any]:
        o = self.options
        return default_to_dict(self, url=self.url, api_key=self.api_key.to_dict() if self.api_key else None,
                               mode=o.mode, max_turns=o.max_turns, retrieve_k=o.retrieve_k, select_k=o.select_k,
                               method=o.method, timeout=self.timeout)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> PlugsearchRetriever:
        deserialize_secrets_inplace(data["init_parameters"], keys=["api_key"])
        return default_from_dict(cls, data)  # type: ignore[no-any-return]


def _documents(response: SearchResponse) -> list[Document]:
    search = search_metadata(response)
    out = []
    for doc in response.documents:
        meta = document_metadata(doc, search)
        del meta["id"], meta["score"]  # a Haystack Document has them as fields
        out.append(Document(id=doc.id, content=doc.text, meta=meta, score=doc.score))
    return out
