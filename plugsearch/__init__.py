"""plugsearch: plug-in search agents for any LLM.

`from plugsearch import SearchClient` (or `AsyncSearchClient`) calls a running searcher; see
docs/integrations.md for the client, the MCP server (`plugsearch-mcp`), the OpenAI-compatible answering
proxy and the Search-R1 / veRL recipes.

The names below are read on first use (PEP 562), so importing a service's package (`plugsearch.retriever`)
does not import the client, and the client needs only what `pip install plugsearch` brings (httpx, pydantic).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from plugsearch.version import __version__

_EXPORTS: dict[str, str] = {
    "AsyncSearchClient": "plugsearch.client",
    "SearchClient": "plugsearch.client",
    "BadRequest": "plugsearch.common.errors",
    "Forbidden": "plugsearch.common.errors",
    "NotFound": "plugsearch.common.errors",
    "Overloaded": "plugsearch.common.errors",
    "ServiceError": "plugsearch.common.errors",
    "Unauthorized": "plugsearch.common.errors",
    "UpstreamError": "plugsearch.common.errors",
    "UpstreamTimeout": "plugsearch.common.errors",
    "ValidationFailed": "plugsearch.common.errors",
    "UpstreamUnavailable": "plugsearch.common.http",
    "FeedbackPage": "plugsearch.common.schemas.feedback",
    "FeedbackRecord": "plugsearch.common.schemas.feedback",
    "FeedbackResponse": "plugsearch.common.schemas.feedback",
    "ActionEvent": "plugsearch.common.schemas.searcher",
    "EndEvent": "plugsearch.common.schemas.searcher",
    "RetrievalEvent": "plugsearch.common.schemas.searcher",
    "SearchedDocument": "plugsearch.common.schemas.searcher",
    "SearchRequest": "plugsearch.common.schemas.searcher",
    "SearchResponse": "plugsearch.common.schemas.searcher",
    "SearchTrace": "plugsearch.common.schemas.searcher",
    "StageTimings": "plugsearch.common.schemas.searcher",
}

__all__ = [
    "ActionEvent",
    "AsyncSearchClient",
    "BadRequest",
    "EndEvent",
    "FeedbackPage",
    "FeedbackRecord",
    "FeedbackResponse",
    "Forbidden",
    "NotFound",
    "Overloaded",
    "RetrievalEvent",
    "SearchClient",
    "SearchRequest",
    "SearchResponse",
    "SearchTrace",
    "SearchedDocument",
    "ServiceError",
    "StageTimings",
    "Unauthorized",
    "UpstreamError",
    "UpstreamTimeout",
    "UpstreamUnavailable",
    "ValidationFailed",
    "__version__",
]

if TYPE_CHECKING:
    from plugsearch.client import AsyncSearchClient, SearchClient
    from plugsearch.common.errors import (
        BadRequest,
        Forbidden,
        NotFound,
        Overloaded,
        ServiceError,
        Unauthorized,
        UpstreamError,
        UpstreamTimeout,
        ValidationFailed,
    )
    from plugsearch.common.http import UpstreamUnavailable
    from plugsearch.common.schemas.feedback import FeedbackPage, FeedbackRecord, FeedbackResponse
    from plugsearch.common.schemas.searcher import (
        ActionEvent,
        EndEvent,
        RetrievalEvent,
        SearchedDocument,
        SearchRequest,
        SearchResponse,
        SearchTrace,
        StageTimings,
    )


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'plugsearch' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
