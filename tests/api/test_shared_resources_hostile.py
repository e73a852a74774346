"""Hostile clients against what callers share (issue 31): the chat proxy's answer is charged and bounded, a
caller's bad parameters never open the answer LLM's breaker nor leak its error text, a credentials fault
upstream is the service's 502 (not the caller's 400), the public schemas take JSON types as they are, and
one key cannot hold the LLM while another waits. The real searcher app in-process, fake LLMs and retriever."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx
import orjson
import pytest

from plugsearch.common.errors import UpstreamTimeout
from plugsearch.common.llm import ChatMessage, LLMSettings, OpenAIChatClient
from plugsearch.searcher.settings import ChatProxySettings
from tests.api.test_chat_proxy import KEY, ChatStack
from tests.api.test_searcher_api import Q, Stack
from tests.asgi import app_client

OTHER_KEY = "another-key-456789"
AUTH = {"Authorization": f"Bearer {KEY}"}
OTHER = {"Authorization": f"Bearer {OTHER_KEY}"}


async def until(condition: Callable[[], bool], timeout_s: float = 30.0) -> None:
    for _ in range(int(timeout_s / 0.01)):
        if condition():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("the condition was never reached")


def chat_body(**fields: Any) -> dict[str, Any]:
    return {"model": "m", "messages": [{"role": "user", "content": Q}], "search": {"mode": "naive"}, **fields}


@pytest.fixture()
async def chat() -> AsyncIterator[tuple[ChatStack, httpx.AsyncClient]]:
    stack = ChatStack()
    async with app_client(stack.app) as client:
        yield stack, client
    await stack.aclose()


# ------------------------------------------------------------------------ 5: strict public schemas
@pytest.mark.parametrize("field", [{"retrieve_k": "5"}, {"max_turns": True}, {"stream": "yes"},
                                   {"return_trace": 1}, {"mode": "naive", "retrieve_k": 5.0}])
async def test_search_refuses_lax_types(field: dict[str, Any]) -> None:
    stack = Stack()
    try:
        async with app_client(stack.app) as client:
            response = await client.post("/search", json={"question": Q, **field})
            assert response.status_code == 422, response.text
            param = response.json()["error"]["param"]
            assert param == next(iter(field)) or param == "retrieve_k", response.text
            batch = await client.post("/search/batch", json={"items": [{"question": Q, **field}]})
            assert batch.status_code == 422, batch.text
    finally:
        await stack.aclose()


@pytest.mark.parametrize("field", [{"stream": "yes"}, {"max_tokens": "5"}, {"temperature": "0.5"},
                                   {"max_tokens": True}, {"n": 2}])
async def test_chat_refuses_lax_types(chat: tuple[ChatStack, httpx.AsyncClient], field: dict[str, Any]) -> None:
    stack, client = chat
    response = await client.post("/v1/chat/completions", headers=AUTH, json=chat_body(**field))
    assert response.status_code == 422, response.text
    assert response.json()["error"]["param"] == next(iter(field))
    assert stack.answer_llm.state.calls == 0


async def test_nul_in_a_chat_message_is_reported_on_the_message(chat: tuple[ChatStack, httpx.AsyncClient]) -> None:
    stack, client = chat
    for content in ("who wrote \x00 the call of the wild", [{"type": "text", "text": "a\x00b"}]):
        response = await client.post("/v1/chat/completions", headers=AUTH, json={
            "messages": [{"role": "user", "content": content}]})
        assert response.status_code == 422, response.text
        assert response.json()["error"]["param"].startswith("messages.0.content"), response.text
    assert stack.answer_llm.state.calls == 0


# ------------------------------------------------------------- 2: breakers trip on upstream faults only
async def test_bad_logit_bias_is_the_callers_422_and_never_reaches_the_llm(
        chat: tuple[ChatStack, httpx.AsyncClient]) -> None:
    stack, client = chat
    for bias in ({"abc": "x"}, {"abc": 1}, {"12": 500}, {"-1": 1}):
        response = await client.post("/v1/chat/completions", headers=AUTH, json=chat_body(logit_bias=bias))
        assert response.status_code == 422, response.text
    assert stack.answer_llm.state.calls == 0
    good = await client.post("/v1/chat/completions", headers=AUTH, json=chat_body(logit_bias={"12": -100}))
    assert good.status_code == 200 and stack.answer_llm.state.bodies[-1]["logit_bias"] == {"12": -100.0}


async def test_upstream_500s_to_callers_bodies_do_not_open_the_breaker_nor_leak_text(
        chat: tuple[ChatStack, httpx.AsyncClient]) -> None:
    """llama.cpp answers 500 (with its traceback) to parameters it chokes on: that caller gets a generic
    502, and however often it does so, the next caller is still served (no circuit open)."""
    stack, client = chat
    stack.answer_llm.state.fail_status = 500  # the fake's body: {"error": {"message": "injected failure"}}
    for stream in (False, True) * 6:  # more than breaker_failures (5)
        response = await client.post("/v1/chat/completions", headers=AUTH, json=chat_body(stream=stream))
        assert response.status_code == 502, response.text
        assert "injected failure" not in response.text and "answer" in response.json()["error"]["message"]
    stack.answer_llm.state.fail_status = None
    response = await client.post("/v1/chat/completions", headers=AUTH, json=chat_body())
    assert response.status_code == 200, response.text


# ---------------------------------------------------------- 3: a credentials fault is ours, not the caller's
@pytest.mark.parametrize("status", [401, 403])
async def test_answer_llm_refusing_our_key_is_a_502_not_the_callers_400(
        chat: tuple[ChatStack, httpx.AsyncClient], status: int) -> None:
    stack, client = chat
    stack.answer_llm.state.fail_status = status
    for stream in (False, True):
        response = await client.post("/v1/chat/completions", headers=AUTH, json=chat_body(stream=stream))
        assert response.status_code == 502, response.text
        error = response.json()["error"]
        assert error["type"] == "upstream_error" and "credentials" in error["message"], error
        assert "injected failure" not in response.text


# ------------------------------------------------------------------- 1: the answer is bounded and charged
async def test_answer_tokens_are_bounded_before_any_work(chat: tuple[ChatStack, httpx.AsyncClient]) -> None:
    stack, client = chat
    for fields, param in (({"max_tokens": 4000}, "max_tokens"), ({"max_completion_tokens": 4000}, "max_tokens"),
                          ({"min_tokens": 4000}, "min_tokens"), ({"max_tokens": 100, "min_tokens": 200}, "min_tokens")):
        response = await client.post("/v1/chat/completions", headers=AUTH, json=chat_body(**fields))
        assert response.status_code == 422, response.text
        error = response.json()["error"]
        assert error["type"] == "cost_limit_exceeded" and error["param"] == param, error
    assert stack.answer_llm.state.calls == 0 and stack.retriever_app.state.requests == []
    response = await client.post("/v1/chat/completions", headers=AUTH, json=chat_body())
    assert response.status_code == 200
    assert stack.answer_llm.state.bodies[-1]["max_tokens"] == 256  # a bound is always forwarded
    await client.post("/v1/chat/completions", headers=AUTH, json=chat_body(max_completion_tokens=40))
    sent = stack.answer_llm.state.bodies[-1]
    assert sent["max_tokens"] == 40 and "max_completion_tokens" not in sent


async def test_the_answer_is_charged_to_the_callers_budget() -> None:
    """A naive chat costs its search (1) and its answer (1 + max_tokens / 160 + ...): with a budget of 12
    units, two answers of 1024 tokens (~7.4 units each, the second one's search a cache hit) cannot both be
    afforded at once."""
    stack = ChatStack(max_request_cost=12, rate_limit_burst=12, rate_limit_per_s=0.01)
    try:
        async with app_client(stack.app) as client:
            first = await client.post("/v1/chat/completions", headers=AUTH, json=chat_body(max_tokens=1024))
            assert first.status_code == 200, first.text
            second = await client.post("/v1/chat/completions", headers=AUTH, json=chat_body(max_tokens=1024))
            assert second.status_code == 429, second.text
            assert second.json()["error"]["type"] == "rate_limited" and int(second.headers["retry-after"]) >= 1
            assert stack.answer_llm.state.calls == 1
            # the per-request bound counts the answer too
            big = await client.post("/v1/chat/completions", headers=AUTH, json={
                **chat_body(max_tokens=1024), "search": {"mode": "s3"}})
            assert big.status_code == 422 and big.json()["error"]["type"] == "cost_limit_exceeded", big.text
    finally:
        await stack.aclose()


class SlowChunks(httpx.AsyncByteStream):
    """A streamed completion that never ends on its own; records whether the client closed it."""

    def __init__(self) -> None:
        self.sent = 0
        self.closed = False

    async def __aiter__(self) -> AsyncIterator[bytes]:
        while True:
            self.sent += 1
            chunk = {"id": "c", "object": "chat.completion.chunk", "created": 0, "model": "m",
                     "choices": [{"index": 0, "delta": {"content": "word "}, "finish_reason": None}]}
            yield b"data: " + orjson.dumps(chunk) + b"\n\n"
            await asyncio.sleep(0.02)

    async def aclose(self) -> None:
        self.closed = True


async def test_a_caller_leaving_stops_the_generation() -> None:
    """The proxy asks the answer LLM for a stream even for a non-streaming caller, so that cancelling the
    caller's request closes the connection the LLM generates into (vLLM and llama.cpp's server stop then)."""
    seen: list[dict[str, Any]] = []
    body = SlowChunks()

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(orjson.loads(request.content))
        return httpx.Response(200, headers={"content-type": "text/event-stream"}, stream=body)

    client = OpenAIChatClient(LLMSettings(base_url="http://answer/v1", model="m"), name="answer",
                              transport=httpx.MockTransport(handler))
    task = asyncio.create_task(client.complete({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 9}))
    await until(lambda: body.sent >= 3)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert seen[0]["stream"] is True and body.closed
    await client.aclose()


async def test_a_generation_that_timed_out_is_not_sent_again() -> None:
    calls = 0

    def handler(request: httpx.Request) -> httpx.Response:
        nonlocal calls
        calls += 1
        raise httpx.ReadTimeout("no answer in time", request=request)

    client = OpenAIChatClient(LLMSettings(base_url="http://answer/v1", model="m", max_retries=2, backoff_s=0),
                              name="answer", transport=httpx.MockTransport(handler))
    try:
        with pytest.raises(UpstreamTimeout):
            await client.complete({"messages": [{"role": "user", "content": "hi"}]})
        assert calls == 1
        with pytest.raises(UpstreamTimeout):
            await client.chat([ChatMessage(role="user", content="hi")])
        assert calls == 2
    finally:
        await client.aclose()


# ------------------------------------------------------------- 4: one key cannot hold the LLM for others
async def test_one_key_cannot_hold_the_llm_while_another_waits() -> None:
    stack = Stack(api_keys=f"{KEY},{OTHER_KEY}", llm_slots=1)
    stack.llm.state.latency_s = 0.3  # each policy call: a search holds the LLM ~1.2 s
    try:
        async with app_client(stack.app) as client:
            s3 = {"question": Q, "mode": "s3", "max_turns": 1}
            flood = asyncio.create_task(client.post("/search", headers=AUTH, json=s3))
            await until(lambda: stack.llm.state.calls > 0)
            again = await client.post("/search", headers=AUTH, json=s3)
            assert again.status_code == 429, again.text
            assert again.json()["error"]["type"] == "rate_limited" and int(again.headers["retry-after"]) >= 1
            other = await client.post("/search", headers=OTHER, json=s3)
            assert other.status_code == 200 and not other.json()["degraded"], other.text
            naive = await client.post("/search", headers=AUTH, json={"question": Q, "mode": "naive"})
            assert naive.status_code == 200  # no LLM: never held back by the LLM's share
            assert (await flood).status_code == 200
            after = await client.post("/search", headers=AUTH, json=s3)  # the slot was given back
            assert after.status_code == 200, after.text
    finally:
        await stack.aclose()


async def test_chat_holds_the_llm_slot_until_its_answer_ends() -> None:
    stack = ChatStack(llm_slots=1)
    stack.answer_llm.state.latency_s = 0.5
    try:
        async with app_client(stack.app) as client:
            first = asyncio.create_task(client.post("/v1/chat/completions", headers=AUTH, json=chat_body()))
            await until(lambda: stack.answer_llm.state.calls > 0)
            second = await client.post("/v1/chat/completions", headers=AUTH, json=chat_body())
            assert second.status_code == 429, second.text
            assert (await first).status_code == 200
            third = await client.post("/v1/chat/completions", headers=AUTH, json=chat_body(stream=True))
            assert third.status_code == 200 and third.text.endswith("data: [DONE]\n\n")
            fourth = await client.post("/v1/chat/completions", headers=AUTH, json=chat_body())
            assert fourth.status_code == 200, fourth.text  # the stream gave its slot back
    finally:
        await stack.aclose()


def test_chat_settings_refuse_a_default_over_the_limit() -> None:
    with pytest.raises(ValueError, match="max_tokens_limit"):
        ChatProxySettings(answer=LLMSettings(), max_tokens=2048, max_tokens_limit=1024)


async def test_callers_without_keys_are_not_held_to_llm_shares() -> None:
    """Callers the budgets do not apply to (no keys configured: the trainer, a local stack) are not held
    to LLM shares either."""
    stack = Stack(llm_slots=1)
    try:
        async with app_client(stack.app) as client:
            results = await asyncio.gather(*(client.post("/search", json={"question": Q, "max_turns": 1})
                                             for _ in range(3)))
            assert [r.status_code for r in results] == [200, 200, 200]
    finally:
        await stack.aclose()
