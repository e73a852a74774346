"""`POST /search` with `"stream": true`: server-sent events as the search goes, against the real searcher app
(scripted fake policy LLM, fake retriever app: `tests.api.test_searcher_api.Stack`).

- the events of an s3 search (retrieval, action, end) agree with the trace, and `result` is the same body
  as without streaming; a cache hit is `result` alone;
- bad input and a retriever down before the first event are JSON errors with their status; a failure after
  the stream began is an `error` event with the envelope (a bug: a generic message);
- a client that disconnects cancels the search: the policy call in flight is cancelled;
- the public client's `search_stream` yields the typed events and raises the `error` event's type.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator
from typing import Any

import httpx
import orjson
import pytest

import plugsearch
from plugsearch import AsyncSearchClient, SearchClient
from plugsearch.common import sse
from plugsearch.common.llm import ChatMessage, ChatResult
from plugsearch.common.schemas.base import Document
from plugsearch.common.schemas.searcher import ActionEvent, EndEvent, RetrievalEvent, SearchResponse
from plugsearch.searcher.api import create_app
from plugsearch.searcher.settings import SearcherSettings
from tests.api.test_searcher_api import Q, Stack
from tests.asgi import app_client, served_in_thread
from tests.support.chat_policy import chat as chat_policy


async def lines_of(text: str) -> AsyncIterator[str]:
    for line in text.splitlines():
        yield line


async def events_of(response: httpx.Response) -> list[tuple[str, Any]]:
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("text/event-stream")
    return [(name, orjson.loads(data)) async for name, data in sse.parse(lines_of(response.text))]


@pytest.fixture()
async def stack() -> AsyncIterator[Stack]:
    s = Stack()
    yield s
    await s.aclose()


async def test_events_follow_the_search_and_end_with_the_same_body(stack: Stack) -> None:
    async with app_client(stack.app) as client:
        streamed = await events_of(await client.post("/search", json={"question": Q, "stream": True,
                                                                      "return_trace": True}))
        plain = (await client.post("/search", json={"question": Q, "return_trace": True})).json()
    names = [name for name, _ in streamed]
    # initial top-k, then per search: the action, its block; the last step only marks and stops
    assert names == ["retrieval"] + ["action", "retrieval"] * 3 + ["action", "end", "result"]
    result = streamed[-1][1]
    assert not result["cached"] and plain["cached"]  # the streamed search filled the cache the plain one hit
    assert {k: v for k, v in result.items() if k not in ("cached", "timings", "search_id")} == \
        {k: v for k, v in plain.items() if k not in ("cached", "timings", "search_id")}
    assert result["search_id"] and plain["search_id"] and result["search_id"] != plain["search_id"]  # each its own
    SearchResponse.model_validate(result)
    blocks = result["trace"]["blocks"]
    retrievals = [RetrievalEvent.model_validate(data) for name, data in streamed if name == "retrieval"]
    assert [(r.block, r.turn, r.queries, [d.id for d in r.documents]) for r in retrievals] == \
        [(i, b["turn"], b["queries"], b["document_ids"]) for i, b in enumerate(blocks)]
    actions = [ActionEvent.model_validate(data) for name, data in streamed if name == "action"]
    assert [a.kind for a in actions] == ["search", "search", "search", "complete"]
    assert [a.queries for a in actions[:3]] == [[q] for q in result["queries"]]
    assert [a.step for a in actions] == [1, 2, 3, 4]
    # every action marks documents 1 and 2 of the newest block: the trace's selection, by position and id
    for action, block in zip(actions, blocks, strict=True):
        assert action.block == blocks.index(block) and action.selected == block["selected"] == [1, 2]
        assert action.selected_ids == [block["document_ids"][i - 1] for i in block["selected"]]
    end = EndEvent.model_validate(streamed[-2][1])
    assert end.stop_reason == "complete" and not end.degraded and end.step == 4
    elapsed = [data["elapsed_ms"] for name, data in streamed if name != "result"]
    assert elapsed == sorted(elapsed)


async def test_a_cache_hit_streams_the_result_at_once(stack: Stack) -> None:
    async with app_client(stack.app) as client:
        first = (await client.post("/search", json={"question": Q, "mode": "naive"})).json()
        streamed = await events_of(await client.post("/search", json={"question": Q, "mode": "naive",
                                                                      "stream": True}))
    assert [name for name, _ in streamed] == ["result"]
    assert streamed[0][1]["cached"] and streamed[0][1]["documents"] == first["documents"]


@pytest.mark.parametrize("body, status, type_", [
    ({"question": Q, "stream": True, "select_k": 9}, 400, "bad_request"),  # over the service's retrieve_k
    ({"question": " ", "stream": True}, 422, "validation_error"),
    ({"question": Q, "stream": "yes please"}, 422, "validation_error"),
])
async def test_bad_input_is_a_json_error_before_the_stream(stack: Stack, body: dict[str, Any], status: int,
                                                           type_: str) -> None:
    async with app_client(stack.app) as client:
        response = await client.post("/search", json=body)
        batch = await client.post("/search/batch", json={"items": [{"question": Q, "stream": True}]})
    assert response.status_code == status and response.headers["content-type"] == "application/json"
    assert response.json()["error"]["type"] == type_
    assert batch.status_code == 422 and "stream" in batch.json()["error"]["message"]
    assert stack.llm.state.calls == 0 and stack.retriever_app.state.requests == []


async def test_retriever_down_before_the_first_event_is_a_503() -> None:
    stack = Stack(retriever_down=True)
    try:
        async with app_client(stack.app) as client:
            response = await client.post("/search", json={"question": Q, "stream": True})
    finally:
        await stack.aclose()
    assert response.status_code == 503 and response.json()["error"]["type"] == "upstream_unavailable"
    assert int(response.headers["retry-after"]) >= 1


async def test_a_failure_after_the_stream_began_is_an_error_event() -> None:
    # QAgent's first event is the policy's first action; its retrieval then fails (the search ends
    # degraded), and the naive fallback fails too: nothing to return, after the stream began.
    stack = Stack(retriever_down=True)
    try:
        async with app_client(stack.app) as client:
            streamed = await events_of(await client.post("/search", json={
                "question": Q, "mode": "qagent", "stream": True}))
    finally:
        await stack.aclose()
    assert [name for name, _ in streamed] == ["action", "end", "error"]
    assert streamed[1][1]["stop_reason"] == "retriever_error" and streamed[1][1]["degraded"]
    error = streamed[-1][1]["error"]
    assert error["type"] == "upstream_unavailable" and "retriever" in error["message"] and error["request_id"]


class FlakyRetriever:
    """The first retrieval answers, the second one hits a bug."""

    def __init__(self) -> None:
        self.calls = 0

    async def retrieve(self, queries: list[str], k: int, method: str | None) -> list[list[Document]]:
        self.calls += 1
        if self.calls > 1:
            raise RuntimeError("secret internal detail")
        return [[Document(id=f"{q}#{i}", title=f"T{i}", text=f"passage {i}", score=1.0) for i in range(1, k + 1)]
                for q in queries]


async def test_a_bug_after_the_stream_began_is_a_generic_error_event() -> None:
    stack = Stack()
    app = create_app(SearcherSettings(), policy=chat_policy(stack.policy), retriever=FlakyRetriever(), cache=stack.cache)
    try:
        async with app_client(app) as client:
            streamed = await events_of(await client.post("/search", json={"question": Q, "stream": True}))
    finally:
        await stack.aclose()
    assert [name for name, _ in streamed] == ["retrieval", "action", "error"]
    assert streamed[-1][1]["error"]["type"] == "internal_error"
    assert "secret" not in str(streamed[-1][1])


class BlockingPolicy:
    """A policy whose call never answers; it records (across threads) that it was called and cancelled."""

    model = "blocking-policy"

    def __init__(self) -> None:
        self.called = threading.Event()
        self.cancelled = threading.Event()

    async def chat(self, messages: list[ChatMessage], **options: Any) -> ChatResult:
        self.called.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            self.cancelled.set()
            raise
        raise AssertionError("unreachable")

    async def check_health(self) -> str:
        return "ok"

    async def aclose(self) -> None:
        return None


async def test_a_client_that_disconnects_cancels_the_search() -> None:
    stack = Stack()
    policy = BlockingPolicy()
    app = create_app(SearcherSettings(search_timeout_s=60), policy=chat_policy(policy),
                     retriever=FlakyRetriever(), cache=stack.cache)
    try:
        with served_in_thread(app) as url:
            async with httpx.AsyncClient(base_url=url, timeout=30) as client, \
                    client.stream("POST", "/search", json={"question": Q, "stream": True}) as response:
                assert response.status_code == 200
                async for name, _ in sse.parse(response.aiter_lines()):
                    assert name == "retrieval"  # the first event; the policy is thinking now
                    break
                assert await asyncio.to_thread(policy.called.wait, 10)
                assert not policy.cancelled.is_set()
            # leaving the block closed the connection mid-stream
            assert await asyncio.to_thread(policy.cancelled.wait, 10), "the policy call was not cancelled"
    finally:
        await stack.aclose()


async def test_public_client_streams_typed_events(stack: Stack) -> None:
    async with app_client(stack.app):
        transport = httpx.ASGITransport(app=stack.app)
        async with AsyncSearchClient("http://searcher", transport=transport) as client:
            events = [e async for e in client.search_stream(Q, max_turns=1, return_trace=True)]
            assert [type(e) for e in events] == [RetrievalEvent, ActionEvent, RetrievalEvent, ActionEvent,
                                                 EndEvent, SearchResponse]
            final = events[-1]
            assert isinstance(final, SearchResponse) and final.trace is not None and len(final.queries) == 1
            again = await client.search(Q, max_turns=1)
            assert again == final.model_copy(update={"cached": True, "trace": None, "timings": again.timings,
                                                     "search_id": again.search_id})
            assert final.search_id is not None and again.search_id != final.search_id
            with pytest.raises(plugsearch.BadRequest):  # refused by the server before the stream
                [e async for e in client.search_stream(Q, select_k=9)]
    down = Stack(retriever_down=True)
    try:
        async with app_client(down.app):
            transport = httpx.ASGITransport(app=down.app)
            async with AsyncSearchClient("http://searcher", transport=transport, max_retries=0) as client:
                with pytest.raises(plugsearch.UpstreamUnavailable):  # the `error` event, by its type
                    [e async for e in client.search_stream(Q, mode="qagent")]
    finally:
        await down.aclose()


def test_blocking_client_streams_over_a_real_socket(stack: Stack) -> None:
    with served_in_thread(stack.app) as url, SearchClient(url, timeout=30) as client:
        events = list(client.search_stream(Q, mode="naive", retrieve_k=2))
        assert [type(e) for e in events] == [RetrievalEvent, EndEvent, SearchResponse]
        for event in client.search_stream(Q, max_turns=2):  # leave early: the connection closes
            assert isinstance(event, RetrievalEvent)
            break
        assert client.search(Q, mode="naive", retrieve_k=2).cached
