"""A LlamaIndex retriever over the searcher (`pip install 'plugsearch[llamaindex]'`).

    from plugsearch.integrations.llamaindex import PlugsearchRetriever

    retriever = PlugsearchRetriever("http://127.0.0.1:8000", mode="s3", max_turns=3)
    nodes = retriever.retrieve("who wrote the call of the wild")      # or: await retriever.aretrieve(...)
    nodes[0].score, nodes[0].node.text, nodes[0].node.metadata["title"]
    # in a query engine: RetrieverQueryEngine.from_args(retriever, llm=...)

Each query is one `POST /search`; the result is LlamaIndex `NodeWithScore`s around `TextNode`s (`id_` = the
document's id, `text`, `metadata`: id, title, score, turn, query and the search's mode, queries, policy,
degraded, stop_reason). LlamaIndex has no error hierarchy of its own: a refused or failed search raises
`PlugsearchRetrieverError` (a `RuntimeError`).
"""

from __future__ import annotations

from typing import Any

from llama_index.core.callbacks import CallbackManager
from llama_index.core.retrievers import BaseRetriever
from llama_index.core.schema import NodeWithScore, QueryBundle, TextNode

from plugsearch.client import AsyncSearchClient, SearchClient
from plugsearch.common.errors import ServiceError
from plugsearch.common.schemas.searcher import Method, SearchMode, SearchResponse
from plugsearch.integrations._common import (
    FailedSearch,
    SearchOptions,
    document_metadata,
    make_clients,
    search_metadata,
)

SHOWN_METADATA = ("title",)
"""The metadata an LLM sees beside a node's text (LlamaIndex puts metadata into prompts): the title only."""


class PlugsearchRetrieverError(RuntimeError, FailedSearch):
    """The searcher refused or failed the search: the envelope's message, and `status`, `error_type`,
    `param`, `retry_after`; the client's `ServiceError` is the `__cause__`."""

    def __init__(self, exc: ServiceError) -> None:
        super().__init__(exc.message)
        self._set(exc)


class PlugsearchRetriever(BaseRetriever):
    """Nodes for a query from a plugsearch searcher (one search per query)."""

    def __init__(self, base_url: str | None = None, *, api_key: str | None = None, mode: SearchMode = "s3",
                 max_turns: int | None = None, retrieve_k: int | None = None, select_k: int | None = None,
                 method: Method | None = None, timeout: float = 120.0, client: SearchClient | None = None,
                 async_client: AsyncSearchClient | None = None, callback_manager: CallbackManager | None = None,
                 verbose: bool = False) -> None:
        """`base_url`: default PLUGSEARCH_URL, else http://127.0.0.1:8000; `api_key`: default
        PLUGSEARCH_API_KEY; unset budget: the searcher's defaults (3 turns, 8 retrieved, 3 selected)."""
        self.options = SearchOptions(mode, max_turns, retrieve_k, select_k, method)
        self._clients = make_clients(base_url, api_key, timeout, client, async_client)
        super().__init__(callback_manager=callback_manager, verbose=verbose)

    def _retrieve(self, query_bundle: QueryBundle) -> list[NodeWithScore]:
        return _nodes(self._clients.search(query_bundle.query_str, self.options.merged(), PlugsearchRetrieverError))

    async def _aretrieve(self, query_bundle: QueryBundle) -> list[NodeWithScore]:
        return _nodes(await self._clients.asearch(query_bundle.query_str, self.options.merged(),
                                                  PlugsearchRetrieverError))

    def close(self) -> None:
        """Close the blocking client it made (`aclose` for the asyncio one of the running loop)."""
        self._clients.close()

    async def aclose(self) -> None:
        await self._clients.aclose()


def _nodes(response: SearchResponse) -> list[NodeWithScore]:
    search = search_metadata(response)
    nodes = []
    for doc in response.documents:
        metadata: dict[str, Any] = document_metadata(doc, search)
        hidden = [key for key in metadata if key not in SHOWN_METADATA]
        node = TextNode(id_=doc.id, text=doc.text, metadata=metadata, excluded_llm_metadata_keys=hidden,
                        excluded_embed_metadata_keys=hidden)
        nodes.append(NodeWithScore(node=node, score=doc.score))
    return nodes
