"""One policy for every upstream call: a service client (`ServiceClient`) and the LLM client
(`OpenAIChatClient`) retry, count in the breaker, map failures to statuses and label the metrics alike, over
an injected transport and over the production wire (aiohttp) on real sockets. No wall-clock sleeps: pauses
go to a recording `sleep`, the breaker reads an injected clock."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import httpx
import orjson
import pytest

from services.common.errors import Overloaded, ServiceError, UpstreamError, UpstreamTimeout
from services.common.http import MAX_RETRY_PAUSE_S, ClientSettings, ServiceClient, UpstreamUnavailable
from services.common.llm import ChatMessage, LLMSettings, OpenAIChatClient
from services.common.metrics import ServiceMetrics

REPLY = {"choices": [{"message": {"content": "ok"}, "finish_reason": "stop"}],
         "usage": {"prompt_tokens": 1, "completion_tokens": 1}}
BUSY = {"error": {"type": "overloaded", "message": "busy"}}


@dataclass
class Caller:
    """One client under test: `call()` makes one logical call; `policy` is the `ServiceClient` that carries
    it (the client itself, or the one the LLM client holds); `pauses` records every pause between attempts."""

    kind: str
    client: Any
    policy: ServiceClient
    call: Callable[[], Awaitable[Any]]
    metrics: ServiceMetrics
    pauses: list[float] = field(default_factory=list)

    def errors(self, kind: str) -> float:
        return self.metrics.registry.get_sample_value("t_upstream_errors_total",
                                                      {"upstream": "up", "kind": kind}) or 0.0


def make_caller(kind: str, url: str, transport: httpx.AsyncBaseTransport | None = None, **policy: Any) -> Caller:
    metrics = ServiceMetrics("t")
    policy = {"backoff_s": 0.0, **policy}
    if kind == "service":
        client: Any = ServiceClient(ClientSettings(url=url, **policy), transport=transport, metrics=metrics, name="up")
        caller = Caller(kind, client, client, lambda: client.request("POST", "/chat/completions", json={}), metrics)
    else:
        client = OpenAIChatClient(LLMSettings(base_url=url, **policy), name="up", metrics=metrics, transport=transport)
        caller = Caller(kind, client, client.upstream, lambda: client.chat([ChatMessage(role="user", content="q")]),
                        metrics)

    async def record(seconds: float) -> None:
        caller.pauses.append(seconds)

    caller.policy.sleep = record
    return caller


def scripted(answers: list[httpx.Response | Exception]) -> httpx.MockTransport:
    """Answers in order (the last one repeats); an exception is raised as the wire's failure."""
    calls = 0

    def handler(request: httpx.Request) -> httpx.Response:
        nonlocal calls
        item = answers[min(calls, len(answers) - 1)]
        calls += 1
        if isinstance(item, Exception):
            raise item
        return item

    return httpx.MockTransport(handler)


KINDS = pytest.mark.parametrize("kind", ["service", "llm"])


@KINDS
async def test_429_is_retried_after_its_retry_after_and_is_no_breaker_failure(kind: str) -> None:
    caller = make_caller(kind, "http://up", scripted([httpx.Response(429, headers={"Retry-After": "3"}, json=BUSY),
                                                      httpx.Response(200, json=REPLY)]), breaker_failures=1)
    await caller.call()
    assert caller.pauses == [3.0]  # the Retry-After, not the (zero) backoff
    assert caller.policy.breaker.state == "closed" and caller.policy.breaker.failures == 0
    assert caller.errors("429") == 1.0
    await caller.client.aclose()


@KINDS
async def test_retry_after_is_capped_and_a_last_429_is_overloaded_with_its_retry_after(kind: str) -> None:
    caller = make_caller(kind, "http://up", scripted([httpx.Response(429, headers={"Retry-After": "600"}, json=BUSY)]),
                         max_retries=2)
    with pytest.raises(Overloaded) as caught:
        await caller.call()
    assert caller.pauses == [MAX_RETRY_PAUSE_S] * 2 and caught.value.retry_after == 600.0
    assert caught.value.status == 429
    await caller.client.aclose()


@KINDS
async def test_an_open_circuit_is_503_with_retry_after_and_a_trial_after_reset(kind: str) -> None:
    now = [100.0]
    caller = make_caller(kind, "http://up", scripted([httpx.ConnectError("refused"), httpx.Response(200, json=REPLY)]),
                         max_retries=0, breaker_failures=1, breaker_reset_s=5.0)
    caller.policy.breaker.clock = lambda: now[0]
    with pytest.raises(UpstreamUnavailable, match="unreachable"):
        await caller.call()
    now[0] += 1.0
    with pytest.raises(UpstreamUnavailable, match="circuit open") as caught:
        await caller.call()
    assert caught.value.status == 503 and caught.value.retry_after == 4.0
    now[0] += 4.0  # reset_s after opening: one trial call goes through and closes the breaker
    await caller.call()
    assert caller.policy.breaker.state == "closed"
    await caller.client.aclose()


@KINDS
@pytest.mark.parametrize(("failure", "error", "status", "label", "attempts"), [
    (httpx.ConnectError("refused"), UpstreamUnavailable, 503, "connect", 2),
    (httpx.ConnectTimeout("no route"), UpstreamUnavailable, 503, "connect", 2),
    (httpx.ReadTimeout("silent"), UpstreamTimeout, 504, "timeout", 2),
    (httpx.Response(500, json={"error": {"message": "boom"}}), UpstreamError, 502, "500", 1),  # a bug: not retried
    (httpx.Response(502, json={"error": {"message": "bad gateway"}}), UpstreamError, 502, "502", 2),
    (httpx.Response(503, json={"error": {"message": "loading"}}), UpstreamUnavailable, 503, "503", 2),
    (httpx.Response(504, json={"error": {"message": "slow"}}), UpstreamTimeout, 504, "504", 2),
])
async def test_failures_map_to_one_status_count_in_the_breaker_and_label_alike(
        kind: str, failure: httpx.Response | Exception, error: type[ServiceError], status: int, label: str,
        attempts: int) -> None:
    caller = make_caller(kind, "http://up", scripted([failure]), max_retries=1, breaker_failures=10)
    with pytest.raises(error) as caught:
        await caller.call()
    assert type(caught.value) is error and caught.value.status == status
    assert caller.policy.breaker.failures == attempts and len(caller.pauses) == attempts - 1
    assert caller.pauses == [0.0] * (attempts - 1)  # no Retry-After came: the (zero) backoff alone
    assert caller.errors(label) == attempts
    await caller.client.aclose()


@KINDS
async def test_a_4xx_is_not_retried_and_keeps_the_breaker_closed(kind: str) -> None:
    caller = make_caller(kind, "http://up", scripted([httpx.Response(400, json={"error": {"message": "bad"}})]),
                         breaker_failures=1)
    with pytest.raises(ServiceError, match="bad") as caught:
        await caller.call()
    # a service's 400 is the caller's; an LLM's 400 to a request the service built is the service's 502
    assert caught.value.status == (400 if kind == "service" else 502)
    assert caller.pauses == [] and caller.policy.breaker.state == "closed" and caller.errors("400") == 1.0
    await caller.client.aclose()


# ------------------------------------------------------------------ the production wire, real sockets
@asynccontextmanager
async def http_server(answers: list[tuple[int, dict[str, str], bytes] | None]) -> AsyncIterator[str]:
    """A localhost HTTP/1.1 server on asyncio streams answering in order (the last repeats); None hangs up."""
    calls = 0

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal calls
        head = await reader.readuntil(b"\r\n\r\n")
        length = next((int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                       if line.lower().startswith(b"content-length:")), 0)
        await reader.readexactly(length)
        answer = answers[min(calls, len(answers) - 1)]
        calls += 1
        if answer is not None:
            status, headers, body = answer
            lines = [f"HTTP/1.1 {status} X", f"Content-Length: {len(body)}", "Connection: close",
                     *(f"{k}: {v}" for k, v in headers.items())]
            writer.write(("\r\n".join(lines) + "\r\n\r\n").encode() + body)
            await writer.drain()
        writer.close()
        await writer.wait_closed()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    try:
        yield f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    finally:
        server.close()
        await server.wait_closed()


@KINDS
async def test_the_production_wire_runs_the_same_policy(kind: str) -> None:
    """aiohttp on a real socket: a hang-up is unavailable (retried after the backoff alone), a 429's
    Retry-After is honoured, then success."""
    async with http_server([None, (429, {"Retry-After": "2"}, orjson.dumps(BUSY)),
                            (200, {"Content-Type": "application/json"}, orjson.dumps(REPLY))]) as url:
        caller = make_caller(kind, url if kind == "service" else url + "/v1", max_retries=2)
        assert type(caller.policy._wire).__name__ == "AiohttpWire"
        await caller.call()
        assert caller.pauses == [0.0, 2.0]
        assert caller.errors("connect") == 1.0 and caller.errors("429") == 1.0
        assert caller.policy.breaker.state == "closed"
        await caller.client.aclose()


async def test_the_production_wire_streams_llm_chunks_and_maps_a_refusal() -> None:
    events = b'data: {"choices": [{"delta": {"content": "o"}}]}\n\ndata: {"usage": {"prompt_tokens": 2}}\n\n' \
             b"data: [DONE]\n\n"
    async with http_server([(503, {"Retry-After": "1"}, b'{"error": {"message": "warming"}}'),
                            (200, {"Content-Type": "text/event-stream"}, events)]) as url:
        caller = make_caller("llm", url + "/v1")
        chunks = [chunk async for chunk in caller.client.stream({"model": "m", "messages": []})]
        assert chunks[0]["choices"][0]["delta"]["content"] == "o" and len(chunks) == 2
        assert caller.pauses == [1.0] and caller.errors("503") == 1.0
        await caller.client.aclose()
    async with http_server([(400, {}, b'{"error": {"message": "too long", "param": "messages"}}')]) as url:
        caller = make_caller("llm", url + "/v1")
        with pytest.raises(ServiceError, match="too long") as caught:  # the caller's own request: its 400
            await caller.client.complete({"model": "m", "messages": []})
        assert caught.value.status == 400 and caught.value.param == "messages" and caller.pauses == []
        await caller.client.aclose()
