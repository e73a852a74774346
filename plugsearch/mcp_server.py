"""`plugsearch-mcp`: the searcher as an MCP tool, for agents (Claude Desktop, IDEs, any MCP client).

Two tools over a running searcher through `plugsearch.AsyncSearchClient`: `search(question, mode, budget)`, returning
the ready-to-paste `context`, the `documents` and the answer's `search_id`; and `feedback(search_id, helpful, ...)`,
which marks the documents that helped (marks become training data: docs/training.md, "Marks from use"). Transports: stdio (what desktop clients
launch) or streamable HTTP (`--transport http`: /mcp, GET /health; no authentication of its own, so it
binds 127.0.0.1 unless told otherwise). Settings: `McpSettings` (env `PLUGSEARCH_MCP_*`, or the flags);
logs go to stderr. See docs/integrations.md.
"""

from __future__ import annotations

import argparse
import logging
from typing import TYPE_CHECKING, Annotated, Any, Literal

import anyio
from pydantic import BaseModel, Field, SecretStr
from pydantic_settings import BaseSettings, SettingsConfigDict

from plugsearch.client import AsyncSearchClient
from plugsearch.common.errors import ServiceError
from plugsearch.common.logging import configure_logging
from plugsearch.common.schemas.feedback import (
    MAX_ANSWER_CHARS,
    MAX_COMMENT_CHARS,
    MAX_MARKED_IDS,
    SEARCH_ID_PATTERN,
    FeedbackResponse,
)
from plugsearch.common.schemas.searcher import (
    MAX_QUESTION_CHARS,
    MAX_RETRIEVE_K,
    SearchedDocument,
    SearchMode,
)
from plugsearch.searcher.parsing import format_documents

if TYPE_CHECKING:
    from mcp.server.mcpserver import MCPServer

logger = logging.getLogger(__name__)

INSTRUCTIONS = (
    "plugsearch finds the documents an LLM needs to answer a question. Call `search` with the user's "
    "question; put the returned `context` into your prompt and answer from it, citing document titles. "
    "Modes: `s3` (a trained searcher issues and selects queries; default), `qagent` (plan, search, reflect), "
    "`naive` (plain top-k retrieval, fastest). After answering, call `feedback` with the search's `search_id` and the "
    "ids of the documents your answer used (`helpful`), and of those that did not help (`not_helpful`): the searcher "
    "learns from these marks.")

TOOL_DESCRIPTION = (
    "Search a document collection for what is needed to answer `question`. Returns `context` (the found "
    "documents, formatted to paste into a prompt) and `documents` (id, title, text, score, and the turn and "
    "query that found each). `budget` caps the number of documents returned (naive mode retrieves exactly "
    "that many); leave it unset for the searcher's own choice. `search_id` names this answer for `feedback`.")

FEEDBACK_DESCRIPTION = (
    "Mark which documents of a search helped answer its question: `search_id` from `search`, `helpful` the ids of "
    "the documents the answer used, optionally `not_helpful` (ids that did not help), `answer` (the answer given) "
    "and `comment`. Marking the same search again replaces the earlier mark.")


class McpSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="PLUGSEARCH_MCP_", extra="ignore")

    searcher_url: str | None = Field(None, description="the searcher; None = PLUGSEARCH_URL or 127.0.0.1:8000")
    api_key: SecretStr | None = Field(None, description="the searcher's API key; None = PLUGSEARCH_API_KEY")
    timeout_s: float = Field(120.0, gt=0, description="one search (s3 with a local LLM can take a minute)")
    max_retries: int = Field(2, ge=0, le=10)
    default_mode: SearchMode = "s3"
    transport: Literal["stdio", "http"] = "stdio"
    host: str = "127.0.0.1"
    port: int = Field(8010, ge=1, le=65535)
    path: str = "/mcp"
    log_level: str = Field("INFO", pattern=r"^(?i)(debug|info|warning|error|critical)$")


class SearchToolResult(BaseModel):
    """What the `search` tool returns."""

    search_id: str | None = Field(None, description="this answer's id, for `feedback` (null: the searcher keeps "
                                                    "no marks)")
    question: str
    mode: SearchMode
    context: str = Field(..., description="the documents, formatted to paste into a prompt")
    documents: list[SearchedDocument]
    queries: list[str] = Field(..., description="the queries the searcher issued")
    degraded: bool = Field(False, description="the search fell back (policy or retriever trouble)")
    cached: bool = False


async def run_search_tool(client: AsyncSearchClient, question: str, mode: SearchMode,
                          budget: int | None) -> SearchToolResult:
    """The tool's work, independent of MCP: one search, cut to `budget` documents."""
    response = await client.search(question, mode=mode, retrieve_k=budget if mode == "naive" else None)
    documents = response.documents if budget is None else response.documents[:budget]
    context = response.context if len(documents) == len(response.documents) else format_documents(documents)
    return SearchToolResult(search_id=response.search_id, question=response.question, mode=response.mode,
                            context=context, documents=documents, queries=response.queries,
                            degraded=response.degraded, cached=response.cached)


async def run_feedback_tool(client: AsyncSearchClient, search_id: str, helpful: list[str], not_helpful: list[str],
                            answer: str | None, comment: str | None) -> FeedbackResponse:
    """The `feedback` tool's work, independent of MCP: one mark."""
    return await client.feedback(search_id, helpful=helpful, not_helpful=not_helpful, answer=answer,
                                 comment=comment)


def searcher_client(settings: McpSettings) -> AsyncSearchClient:
    return AsyncSearchClient(settings.searcher_url,
                             api_key=settings.api_key.get_secret_value() if settings.api_key else None,
                             timeout=settings.timeout_s, max_retries=settings.max_retries)


def create_server(client: AsyncSearchClient, settings: McpSettings | None = None) -> MCPServer:
    """The MCP server over a searcher client (which the caller closes)."""
    from mcp.server.mcpserver import MCPServer
    from mcp.server.mcpserver.exceptions import ToolError

    from plugsearch.version import __version__

    settings = settings or McpSettings()
    server: MCPServer[Any] = MCPServer("plugsearch", title="plugsearch search agent", instructions=INSTRUCTIONS,
                                       version=__version__)

    @server.custom_route("/health", methods=["GET"], include_in_schema=False)
    async def health(request: Any) -> Any:  # the HTTP transport's liveness probe (no MCP session needed)
        from starlette.responses import JSONResponse

        return JSONResponse({"status": "ok"})

    @server.tool(name="search", title="Search documents", description=TOOL_DESCRIPTION)
    async def search(
        question: Annotated[str, Field(min_length=1, max_length=MAX_QUESTION_CHARS,
                                       description="the question to find documents for")],
        mode: Annotated[SearchMode, Field(description="s3 | qagent | naive")] = settings.default_mode,
        budget: Annotated[int | None, Field(ge=1, le=MAX_RETRIEVE_K,
                                            description="at most this many documents")] = None,
    ) -> SearchToolResult:
        if not question.strip():
            raise ToolError("question must not be blank")
        try:
            return await run_search_tool(client, question, mode, budget)
        except ServiceError as exc:  # the searcher's own message (bad input, overloaded, unavailable ...)
            logger.warning("search tool failed: %s %s", exc.status, exc.message)
            raise ToolError(f"search failed ({exc.status}): {exc.message}") from exc

    @server.tool(name="feedback", title="Mark what helped", description=FEEDBACK_DESCRIPTION)
    async def feedback(
        search_id: Annotated[str, Field(pattern=SEARCH_ID_PATTERN, description="the `search_id` `search` returned")],
        helpful: Annotated[list[str], Field(max_length=MAX_MARKED_IDS,
                                            description="ids of the documents that helped")] = [],  # noqa: B006
        not_helpful: Annotated[list[str], Field(max_length=MAX_MARKED_IDS,
                                                description="ids of the documents that did not help")] = [],  # noqa: B006
        answer: Annotated[str | None, Field(max_length=MAX_ANSWER_CHARS, description="the answer given")] = None,
        comment: Annotated[str | None, Field(max_length=MAX_COMMENT_CHARS, description="a note")] = None,
    ) -> FeedbackResponse:
        try:
            return await run_feedback_tool(client, search_id, helpful, not_helpful, answer, comment)
        except ServiceError as exc:  # unknown id, another key's search, ids the search did not return ...
            logger.warning("feedback tool failed: %s %s", exc.status, exc.message)
            raise ToolError(f"feedback failed ({exc.status}): {exc.message}") from exc

    return server


async def serve(settings: McpSettings) -> None:
    """Run the server on the configured transport until it stops; the searcher client is closed after."""
    client = searcher_client(settings)
    try:
        server = create_server(client, settings)
        configure_logging(settings.log_level, service="plugsearch-mcp")  # after the SDK set up its own
        logger.info("plugsearch MCP server (%s) for the searcher at %s", settings.transport, client.base_url)
        if settings.transport == "stdio":
            await server.run_stdio_async()
        else:
            await server.run_streamable_http_async(host=settings.host, port=settings.port,
                                                   streamable_http_path=settings.path)
    finally:
        await client.aclose()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="plugsearch-mcp", description=__doc__.split("\n")[0] if __doc__ else None)
    parser.add_argument("--transport", choices=["stdio", "http"], help="PLUGSEARCH_MCP_TRANSPORT (default stdio)")
    parser.add_argument("--searcher-url", help="PLUGSEARCH_MCP_SEARCHER_URL")
    parser.add_argument("--host", help="http transport: bind address (default 127.0.0.1)")
    parser.add_argument("--port", type=int, help="http transport: port (default 8010)")
    parser.add_argument("--path", help="http transport: endpoint path (default /mcp)")
    args = parser.parse_args(argv)
    settings = McpSettings(**{k: v for k, v in vars(args).items() if v is not None})
    anyio.run(serve, settings)


if __name__ == "__main__":
    main()
