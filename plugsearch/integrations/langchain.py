"""A LangChain retriever over the searcher (`pip install 'plugsearch[langchain]'`).

    from plugsearch.integrations.langchain import PlugsearchRetriever

    retriever = PlugsearchRetriever(base_url="http://127.0.0.1:8000", mode="s3", max_turns=3)
    docs = retriever.invoke("who wrote the call of the wild")        # or: await retriever.ainvoke(...)
    docs[0].page_content, docs[0].metadata["title"], docs[0].metadata["queries"]

Each query is one `POST /search`; the documents are LangChain `Document`s (`id`, `page_content` = the text,
`metadata`: id, title, score, turn, query and the search's mode, queries, policy, degraded, stop_reason).
A refused or failed search raises `PlugsearchRetrieverError` (a `LangChainException`).
"""

from __future__ import annotations

from typing import Any

from langchain_core.callbacks import AsyncCallbackManagerForRetrieverRun, CallbackManagerForRetrieverRun
from langchain_core.documents import Document
from langchain_core.exceptions import LangChainException
from langchain_core.retrievers import BaseRetriever
from pydantic import ConfigDict, Field, PrivateAttr, SecretStr

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


class PlugsearchRetrieverError(LangChainException, FailedSearch):
    """The searcher refused or failed the search: the envelope's message, and `status`, `error_type`,
    `param`, `retry_after`; the client's `ServiceError` is the `__cause__`."""

    def __init__(self, exc: ServiceError) -> None:
        super().__init__(exc.message)
        self._set(exc)


class PlugsearchRetriever(BaseRetriever):
    """Documents for a query from a plugsearch searcher (one search per query)."""

    model_config = ConfigDict(arbitrary_types_allowed=True)

    base_url: str | None = Field(None, description="the searcher; default PLUGSEARCH_URL, else http://127.0.0.1:8000")
    api_key: SecretStr | None = Field(None, description="default PLUGSEARCH_API_KEY")
    mode: SearchMode = "s3"
    max_turns: int | None = Field(None, description="search turns (s3) or rounds (qagent); default 3")
    retrieve_k: int | None = Field(None, description="documents retrieved per query; default 8")
    select_k: int | None = Field(None, description="s3: documents kept per turn; default 3")
    method: Method | None = Field(None, description="bm25, dense or hybrid; default the retriever's")
    timeout: float = Field(120.0, gt=0, description="seconds for one search")
    client: SearchClient | None = Field(None, exclude=True, description="a client to use instead of its own")
    async_client: AsyncSearchClient | None = Field(None, exclude=True)
    _clients: Clients = PrivateAttr()

    def model_post_init(self, context: Any) -> None:
        key = self.api_key.get_secret_value() if self.api_key is not None else None
        self._clients = make_clients(self.base_url, key, self.timeout, self.client, self.async_client)

    def _options(self, overrides: dict[str, Any]) -> dict[str, Any]:
        options = SearchOptions(self.mode, self.max_turns, self.retrieve_k, self.select_k, self.method)
        return options.merged(**overrides)

    def _get_relevant_documents(self, query: str, *, run_manager: CallbackManagerForRetrieverRun,
                                **overrides: Any) -> list[Document]:
        return _documents(self._clients.search(query, self._options(overrides), PlugsearchRetrieverError))

    async def _aget_relevant_documents(self, query: str, *, run_manager: AsyncCallbackManagerForRetrieverRun,
                                       **overrides: Any) -> list[Document]:
        return _documents(await self._clients.asearch(query, self._options(overrides), PlugsearchRetrieverError))

    def close(self) -> None:
        """Close the blocking client it made (`aclose` for the asyncio one of the running loop)."""
        self._clients.close()

    async def aclose(self) -> None:
        await self._clients.aclose()


def _documents(response: SearchResponse) -> list[Document]:
    search = search_metadata(response)
    return [Document(id=doc.id, page_content=doc.text, metadata=document_metadata(doc, search))
            for doc in response.documents]
