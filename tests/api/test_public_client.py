"""The public Python client (`from plugsearch import SearchClient`) and the MCP server, against the real
searcher app (scripted fake policy LLM, fake retriever app: `tests.api.test_searcher_api.Stack`).

- `AsyncSearchClient` over ASGI: typed results, options, batch, API key, 4xx as exceptions, retries.
- `SearchClient` (blocking) over a real localhost socket (uvicorn in a thread), also from inside a running
  event loop; a timeout raises `UpstreamTimeout`.
- the MCP server, through the `mcp` SDK's own client (in-process): the tools are listed with their schemas and
  called (s3 with a document budget, naive; a mark on what helped), and a failing searcher gives an error result,
  not a crash.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from fastapi import FastAPI

import plugsearch
from plugsearch import AsyncSearchClient, SearchClient, SearchResponse
from plugsearch.mcp_server import create_server
from tests.api.test_searcher_api import Q, Stack
from tests.asgi import app_client, served_in_thread

KEY = "client-test-key-123"


@pytest.fixture()
async def stack() -> AsyncIterator[Stack]:
    s = Stack(api_keys=KEY)
    yield s
    await s.aclose()


async def test_async_client_typed_results_options_batch_and_auth(stack: Stack) -> None:
    async with app_client(stack.app):
        transport = httpx.ASGITransport(app=stack.app)
        async with AsyncSearchClient("http://searcher", api_key=KEY, transport=transport) as client:
            result = await client.search(Q, mode="s3", max_turns=1, retrieve_k=4, select_k=2)
            assert isinstance(result, SearchResponse) and result.mode == "s3" and len(result.queries) == 1
            assert result.documents[0].id == f"{Q}#1" and result.context.startswith("Doc 1(Title: T1)")
            assert stack.retriever_app.state.requests[0].k == 4
            batch = await client.search_batch([Q, "another question"], mode="naive", retrieve_k=2)
            assert [len(r.documents) for r in batch] == [2, 2] and batch[1].question == "another question"
            assert await client.ready()
            assert (await client.version())["service"] == "searcher"
            with pytest.raises(plugsearch.BadRequest, match="select_k"):  # refused before any request
                await client.search(Q, retrieve_k=2, select_k=3)
            with pytest.raises(plugsearch.ValidationFailed) as refused:  # refused by the server (422)
                await client.search(plugsearch.SearchRequest.model_construct(question=" ", mode="naive"))
            assert refused.value.param == "question" and refused.value.status == 422
        async with AsyncSearchClient("http://searcher", api_key="wrong-key-456", transport=transport) as client:
            with pytest.raises(plugsearch.Unauthorized):
                await client.search(Q)


async def test_async_client_retries_a_503_and_reads_the_key_from_the_environment(
        monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[httpx.Request] = []

    def flaky(request: httpx.Request) -> httpx.Response:
        calls.append(request)
        if len(calls) == 1:
            return httpx.Response(503, json={"error": {"type": "not_ready", "message": "warming up"}},
                                  headers={"Retry-After": "0"})
        body = json.loads(request.content)
        return httpx.Response(200, json=SearchResponse(
            question=body["question"], mode="naive", documents=[], context="", queries=[], turns=0,
            stop_reason="naive", timings={"total_ms": 1, "retrieval_ms": 1, "policy_ms": 0, "overhead_ms": 0,
                                          "policy_calls": 0, "retrieval_calls": 1},
            valid_actions=0, invalid_actions=0, prompt_version="v1").model_dump(mode="json"))

    monkeypatch.setenv("PLUGSEARCH_API_KEY", KEY)
    monkeypatch.setenv("PLUGSEARCH_URL", "http://from-env:9000")
    async with AsyncSearchClient(transport=httpx.MockTransport(flaky), backoff=0.01) as client:
        assert client.base_url == "http://from-env:9000"
        assert (await client.search("q", mode="naive")).question == "q"
    assert len(calls) == 2 and calls[1].headers["authorization"] == f"Bearer {KEY}"
    async with AsyncSearchClient(transport=httpx.MockTransport(flaky), max_retries=0) as client:
        calls.clear()
        with pytest.raises(plugsearch.UpstreamUnavailable, match="warming up"):
            await client.search("q")


def test_sync_client_over_a_real_socket(stack: Stack) -> None:
    with served_in_thread(stack.app) as url, SearchClient(url, api_key=KEY, timeout=30) as client:
        result = client.search(Q, mode="naive", retrieve_k=3)
        assert [d.id for d in result.documents] == [f"{Q}#1", f"{Q}#2", f"{Q}#3"]
        assert client.search(Q).stop_reason == "complete"  # s3 with the scripted policy
        assert len(client.search_batch([Q, Q], mode="naive")) == 2
        assert client.ready()

        async def from_a_running_loop() -> SearchResponse:  # Jupyter-like: a loop already runs here
            return client.search(Q, mode="naive")

        assert asyncio.run(from_a_running_loop()).cached
    with pytest.raises(RuntimeError, match="closed"):
        client.search(Q)


def test_sync_client_times_out() -> None:
    slow = FastAPI()

    @slow.post("/search")
    async def search() -> dict[str, Any]:
        await asyncio.sleep(5)
        return {}

    with served_in_thread(slow) as url, SearchClient(url, timeout=0.3, max_retries=0) as client:
        with pytest.raises(plugsearch.UpstreamTimeout):
            client.search("q")


# ------------------------------------------------------------------------------------------- MCP
async def test_mcp_sdk_client_lists_and_calls_the_search_tool(stack: Stack) -> None:
    from mcp import Client

    async with app_client(stack.app):
        searcher = AsyncSearchClient("http://searcher", api_key=KEY, transport=httpx.ASGITransport(app=stack.app))
        try:
            async with Client(create_server(searcher)) as mcp_client:
                tools = (await mcp_client.list_tools()).tools
                assert [t.name for t in tools] == ["search", "feedback"]
                schema = tools[0].input_schema
                assert set(schema["properties"]) == {"question", "mode", "budget"} and schema["required"] == [
                    "question"]
                assert set(tools[0].output_schema["properties"]) >= {"context", "documents", "search_id"}
                marking = tools[1].input_schema
                assert set(marking["properties"]) == {"search_id", "helpful", "not_helpful", "answer", "comment"}
                assert marking["required"] == ["search_id"]

                s3 = await mcp_client.call_tool("search", {"question": Q, "mode": "s3", "budget": 3})
                assert not s3.is_error
                found = s3.structured_content
                assert found is not None and len(found["documents"]) == 3 and len(found["queries"]) == 3
                assert found["context"].count("Doc ") == 3 and found["context"].startswith("Doc 1(Title: T1)")
                assert json.loads(s3.content[0].text)["documents"] == found["documents"]  # type: ignore[union-attr]

                naive = await mcp_client.call_tool("search", {"question": Q, "mode": "naive", "budget": 5})
                assert naive.structured_content is not None and len(naive.structured_content["documents"]) == 5
                assert stack.retriever_app.state.requests[-1].k == 5

                blank = await mcp_client.call_tool("search", {"question": "   "})
                assert blank.is_error and "blank" in blank.content[0].text  # type: ignore[union-attr]

                # the agent marks what its answer used: stored as the key's mark on that search
                used = found["documents"][1]["id"]
                marked = await mcp_client.call_tool("feedback", {"search_id": found["search_id"], "helpful": [used],
                                                                 "answer": "Big Stone Gap is in Virginia"})
                assert not marked.is_error and marked.structured_content is not None
                assert marked.structured_content["helpful"] == [used]
                stored = [m async for m in searcher.marks() if m.search_id == found["search_id"]]
                assert [(m.helpful, m.answer) for m in stored] == [([used], "Big Stone Gap is in Virginia")]
                wrong = await mcp_client.call_tool("feedback", {"search_id": found["search_id"],
                                                                "helpful": ["not-returned"]})
                assert wrong.is_error and "feedback failed (422)" in wrong.content[0].text  # type: ignore[union-attr]
        finally:
            await searcher.aclose()


async def test_mcp_tool_reports_a_failing_searcher_as_an_error_result() -> None:
    from mcp import Client

    down = Stack(retriever_down=True)
    try:
        async with app_client(down.app):
            searcher = AsyncSearchClient("http://searcher", transport=httpx.ASGITransport(app=down.app),
                                         max_retries=0)
            async with Client(create_server(searcher)) as mcp_client:
                result = await mcp_client.call_tool("search", {"question": Q})
            await searcher.aclose()
    finally:
        await down.aclose()
    assert result.is_error
    assert "search failed (503)" in result.content[0].text  # type: ignore[union-attr]
