"""plugsearch: plug-in search agents for any LLM.

`from plugsearch import SearchClient` (or `AsyncSearchClient`) calls a running searcher; see
docs/INTEGRATIONS.md for the client, the MCP server (`plugsearch-mcp`), the OpenAI-compatible answering
proxy and the Search-R1 / veRL recipes.
"""

from plugsearch.client import AsyncSearchClient, SearchClient
from services import __version__
from services.common.errors import (
    BadRequest,
    NotFound,
    Overloaded,
    ServiceError,
    Unauthorized,
    UpstreamError,
    UpstreamTimeout,
    ValidationFailed,
)
from services.common.http import UpstreamUnavailable
from services.common.schemas.searcher import (
    ActionEvent,
    EndEvent,
    RetrievalEvent,
    SearchedDocument,
    SearchRequest,
    SearchResponse,
    SearchTrace,
    StageTimings,
)

__all__ = [
    "ActionEvent",
    "AsyncSearchClient",
    "BadRequest",
    "EndEvent",
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
