"""The OpenAI-compatible client: concurrency limit, request id, usage metrics, retries, breaker."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from plugsearch.common.errors import UpstreamError
from plugsearch.common.llm import ChatMessage, LLMSettings, OpenAIChatClient
from plugsearch.common.logging import reset_request_id, set_request_id
from plugsearch.common.metrics import ServiceMetrics
from tests.gate import Gate

Q = [ChatMessage(role="user", content="q")]


def completion(text: str = "ok") -> httpx.Response:
    return httpx.Response(200, json={"choices": [{"message": {"content": text}, "finish_reason": "stop"}],
                                     "usage": {"prompt_tokens": 7, "completion_tokens": 3}, "model": "m"})


async def test_concurrency_limit_is_honoured() -> None:
    active = peak = 0
    gate = Gate(4)

    async def handler(request: httpx.Request) -> httpx.Response:
        nonlocal active, peak
        active += 1
        peak = max(peak, active)
        await gate.wait(active)
        await asyncio.sleep(0.02)
        active -= 1
        return completion()

    llm = OpenAIChatClient(LLMSettings(base_url="http://llm/v1", max_concurrency=4),
                           transport=httpx.MockTransport(handler))
    results = await asyncio.gather(*(llm.chat(Q) for _ in range(20)))
    assert len(results) == 20 and peak == 4
    await llm.aclose()


async def test_request_id_and_token_usage() -> None:
    seen: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return completion("Paris")

    metrics = ServiceMetrics("demo")
    llm = OpenAIChatClient(LLMSettings(base_url="http://llm/v1", model="m1"), name="gen_llm", metrics=metrics,
                           transport=httpx.MockTransport(handler))
    token = set_request_id("rid-9")
    try:
        result = await llm.chat(Q, max_tokens=5, stop=["\n"])
    finally:
        reset_request_id(token)
    assert (result.text, result.prompt_tokens, result.completion_tokens) == ("Paris", 7, 3)
    assert seen[0].headers["x-request-id"] == "rid-9" and str(seen[0].url) == "http://llm/v1/chat/completions"
    registry = metrics.registry
    assert registry.get_sample_value("demo_llm_tokens_total", {"llm": "gen_llm", "kind": "prompt"}) == 7
    assert registry.get_sample_value("demo_llm_tokens_total", {"llm": "gen_llm", "kind": "completion"}) == 3
    await llm.aclose()


async def test_5xx_retried_4xx_not_and_breaker_fails_fast() -> None:
    calls = 0

    def flaky(request: httpx.Request) -> httpx.Response:
        nonlocal calls
        calls += 1
        return completion() if calls == 3 else httpx.Response(503, json={"error": {"message": "busy"}})

    llm = OpenAIChatClient(LLMSettings(base_url="http://llm/v1", max_retries=2, backoff_s=0.001),
                           transport=httpx.MockTransport(flaky))
    assert (await llm.chat(Q)).text == "ok" and calls == 3

    refused = 0

    def bad_request(request: httpx.Request) -> httpx.Response:
        nonlocal refused
        refused += 1
        return httpx.Response(400, json={"error": {"message": "context too long"}})

    llm4 = OpenAIChatClient(LLMSettings(base_url="http://llm/v1", max_retries=3, backoff_s=0.001),
                            transport=httpx.MockTransport(bad_request))
    with pytest.raises(UpstreamError, match=r"refused the request \(HTTP 400\)") as failed:
        await llm4.chat(Q)
    assert refused == 1 and "context too long" not in failed.value.message  # the LLM's text: logged only

    attempts = 0

    def down(request: httpx.Request) -> httpx.Response:
        nonlocal attempts
        attempts += 1
        raise httpx.ConnectError("refused", request=request)

    dead = OpenAIChatClient(LLMSettings(base_url="http://llm/v1", max_retries=0, breaker_failures=3,
                                        breaker_reset_s=60), transport=httpx.MockTransport(down))
    for _ in range(5):
        with pytest.raises(UpstreamError):
            await dead.chat(Q)
    assert attempts == 3  # the breaker opened: the last two failed without a call
    for client in (llm, llm4, dead):
        await client.aclose()
