"""One policy for every upstream call: a service client (`ServiceClient`) and the LLM client
(`OpenAIChatClient`) retry, count in the breaker, map failures to statuses and label the metrics alike, over
an injected httpx transport ("mock") and over the production wire (aiohttp) on real localhost sockets. No
wall-clock sleeps: pauses go to a recording `sleep`, the breaker reads an injected clock."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import httpx
import orjson
import pytest

from plugsearch.common.errors import Overloaded, ServiceError, UpstreamError, UpstreamTimeout
from plugsearch.common.http import MAX_RETRY_PAUSE_S, ClientSettings, ServiceClient, UpstreamUnavailable
from plugsearch.common.llm import ChatMessage, LLMSettings, OpenAIChatClient
from plugsearch.common.metrics import ServiceMetrics
from plugsearch.common.workers import free_port

REPLY = {"choices": [{"message": {"content": "ok"}, "finish_reason": "stop"}],
         "usage": {"prompt_tokens": 1, "completion_tokens": 1}}
OK = (200, {}, REPLY)
BUSY = {"error": {"type": "overloaded", "message": "busy"}}
REFUSED, HANGUP, SILENT = "refused", "hang-up", "silent"  # no answer: nothing listens, closed unanswered, mute
NO_ROUTE = "no route"  # nothing accepts the connection in time (injected transports only)
Answer = tuple[int, dict[str, str], dict[str, Any]] | str | bytes  # (status, headers, JSON body) | no answer | events


def _parts(answer: tuple[int, dict[str, str], dict[str, Any]] | bytes) -> tuple[int, dict[str, str], bytes]:
    """(status, headers, content) of an answer: a JSON one, or bytes as a 200 event stream."""
    if isinstance(answer, bytes):
        return 200, {"Content-Type": "text/event-stream"}, answer
    status, headers, body = answer
    return status, {"Content-Type": "application/json", **headers}, orjson.dumps(body)


@asynccontextmanager
async def http_server(answers: list[Answer]) -> AsyncIterator[str]:
    """A localhost HTTP/1.1 server on asyncio streams answering in order (the last repeats)."""
    calls = 0
    release = asyncio.Event()
    handlers: set[asyncio.Task[Any]] = set()

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal calls
        task = asyncio.current_task()
        assert task is not None
        handlers.add(task)
        head = await reader.readuntil(b"\r\n\r\n")
        length = next((int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                       if line.lower().startswith(b"content-length:")), 0)
        await reader.readexactly(length)
        answer = answers[min(calls, len(answers) - 1)]
        calls += 1
        if answer == SILENT:
            await release.wait()
        elif not isinstance(answer, str):
            status, headers, content = _parts(answer)
            lines = [f"HTTP/1.1 {status} X", f"Content-Length: {len(content)}", "Connection: close",
                     *(f"{k}: {v}" for k, v in headers.items())]
            writer.write(("\r\n".join(lines) + "\r\n\r\n").encode() + content)
            await writer.drain()
        writer.close()
        await writer.wait_closed()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    try:
        yield f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    finally:
        release.set()
        server.close()
        await server.wait_closed()
        await asyncio.wait_for(asyncio.gather(*handlers, return_exceptions=True), 5)  # none left to cancel


def scripted(answers: list[Answer]) -> httpx.MockTransport:
    """The same answers as an httpx transport; no answer is the wire's exception for it."""
    calls = 0
    failures = {REFUSED: httpx.ConnectError, HANGUP: httpx.RemoteProtocolError, SILENT: httpx.ReadTimeout,
                NO_ROUTE: httpx.ConnectTimeout}

    def handler(request: httpx.Request) -> httpx.Response:
        nonlocal calls
        answer = answers[min(calls, len(answers) - 1)]
        calls += 1
        if isinstance(answer, str):
            raise failures[answer](answer, request=request)
        status, headers, content = _parts(answer)
        return httpx.Response(status, headers=headers, content=content)

    return httpx.MockTransport(handler)


@dataclass
class Caller:
    """One client under test: `call()` makes one logical call; `policy` is the `ServiceClient` that carries
    it (the client itself, or the one the LLM client holds); `pauses` records every pause between attempts."""

    client: Any
    policy: ServiceClient
    call: Callable[[], Awaitable[Any]]
    metrics: ServiceMetrics
    pauses: list[float] = field(default_factory=list)

    def errors(self, kind: str) -> float:
        return self.metrics.registry.get_sample_value("t_upstream_errors_total",
                                                      {"upstream": "up", "kind": kind}) or 0.0


@asynccontextmanager
async def caller(kind: str, wire: str, answers: list[Answer], **policy: Any) -> AsyncIterator[Caller]:
    """A `kind` client ("service" or "llm") whose upstream answers `answers`, over `wire` ("mock" or "aiohttp")."""
    async with _upstream(wire, answers) as (url, transport):
        metrics = ServiceMetrics("t")
        policy = {"backoff_s": 0.0, "timeout_s": 0.3, **policy}
        if kind == "service":
            client: Any = ServiceClient(ClientSettings(url=url, **policy), transport=transport, metrics=metrics,
                                        name="up")
            made = Caller(client, client, lambda: client.request("POST", "/chat/completions", json={}), metrics)
        else:
            client = OpenAIChatClient(LLMSettings(base_url=f"{url}/v1", **policy), name="up", metrics=metrics,
                                      transport=transport)
            made = Caller(client, client.upstream, lambda: client.chat([ChatMessage(role="user", content="q")]),
                          metrics)

        async def record(seconds: float) -> None:
            made.pauses.append(seconds)

        made.policy.sleep = record
        assert type(made.policy._wire).__name__ == ("HttpxWire" if wire == "mock" else "AiohttpWire")
        try:
            yield made
        finally:
            await client.aclose()


@asynccontextmanager
async def _upstream(wire: str, answers: list[Answer]) -> AsyncIterator[tuple[str, httpx.MockTransport | None]]:
    if wire == "mock":
        yield "http://up", scripted(answers)
    elif answers == [REFUSED]:
        yield f"http://127.0.0.1:{free_port()}", None
    else:
        async with http_server(answers) as url:
            yield url, None


BOTH = pytest.mark.parametrize(("kind", "wire"), [(k, w) for k in ("service", "llm") for w in ("mock", "aiohttp")])


@BOTH
async def test_429_is_retried_after_its_retry_after_and_is_no_breaker_failure(kind: str, wire: str) -> None:
    async with caller(kind, wire, [(429, {"Retry-After": "3"}, BUSY), OK], breaker_failures=1) as c:
        await c.call()
        assert c.pauses == [3.0]  # the Retry-After, not the (zero) backoff
        assert c.policy.breaker.state == "closed" and c.policy.breaker.failures == 0
        assert c.errors("429") == 1.0


@BOTH
async def test_retry_after_is_capped_and_a_last_429_is_overloaded_with_its_retry_after(kind: str, wire: str) -> None:
    async with caller(kind, wire, [(429, {"Retry-After": "600"}, BUSY)], max_retries=2) as c:
        with pytest.raises(Overloaded) as caught:
            await c.call()
        assert c.pauses == [MAX_RETRY_PAUSE_S] * 2 and caught.value.retry_after == 600.0
        assert caught.value.status == 429


@BOTH
async def test_an_open_circuit_is_503_with_retry_after_and_a_trial_after_reset(kind: str, wire: str) -> None:
    now = [100.0]
    async with caller(kind, wire, [HANGUP, OK], max_retries=0, breaker_failures=1, breaker_reset_s=5.0) as c:
        c.policy.breaker.clock = lambda: now[0]
        with pytest.raises(UpstreamUnavailable, match="unreachable"):
            await c.call()
        now[0] += 1.0
        with pytest.raises(UpstreamUnavailable, match="circuit open") as caught:
            await c.call()
        assert caught.value.status == 503 and caught.value.retry_after == 4.0
        now[0] += 4.0  # reset_s after opening: one trial call goes through and closes the breaker
        await c.call()
        assert c.policy.breaker.state == "closed"


def _failures() -> list[Any]:
    cases = [(REFUSED, UpstreamUnavailable, 503, "connect", 2),
             (HANGUP, UpstreamUnavailable, 503, "connect", 2),
             (SILENT, UpstreamTimeout, 504, "timeout", 2),
             ((500, {}, {"error": {"message": "boom"}}), UpstreamError, 502, "500", 1),  # a bug: not retried
             ((502, {}, {"error": {"message": "bad gateway"}}), UpstreamError, 502, "502", 2),
             ((503, {}, {"error": {"message": "loading"}}), UpstreamUnavailable, 503, "503", 2),
             ((504, {}, {"error": {"message": "slow"}}), UpstreamTimeout, 504, "504", 2)]
    # an LLM generation that timed out is not sent again (it may still be running upstream)
    return [pytest.param(kind, wire, *case[:4], 1 if kind == "llm" and case[3] == "timeout" else case[4],
                         id=f"{kind}-{wire}-{case[3]}")
            for kind in ("service", "llm") for wire in ("mock", "aiohttp") for case in cases]


@pytest.mark.parametrize(("kind", "wire", "answer", "error", "status", "label", "attempts"), _failures())
async def test_failures_map_to_one_status_count_in_the_breaker_and_label_alike(
        kind: str, wire: str, answer: Answer, error: type[ServiceError], status: int, label: str,
        attempts: int) -> None:
    async with caller(kind, wire, [answer], max_retries=1, breaker_failures=10) as c:
        with pytest.raises(error) as caught:
            await c.call()
        assert type(caught.value) is error and caught.value.status == status
        assert c.policy.breaker.failures == attempts
        assert c.pauses == [0.0] * (attempts - 1)  # no Retry-After came: the (zero) backoff alone
        assert c.errors(label) == attempts


@pytest.mark.parametrize("kind", ["service", "llm"])
async def test_a_connect_timeout_is_unavailable_not_timed_out(kind: str) -> None:
    async with caller(kind, "mock", [NO_ROUTE], max_retries=0) as c:
        with pytest.raises(UpstreamUnavailable, match="no connection within") as caught:
            await c.call()
        assert caught.value.retry_after and c.errors("connect") == 1.0


@BOTH
async def test_a_4xx_is_not_retried_and_keeps_the_breaker_closed(kind: str, wire: str) -> None:
    async with caller(kind, wire, [(400, {}, {"error": {"message": "bad"}})], breaker_failures=1) as c:
        with pytest.raises(ServiceError, match="bad" if kind == "service" else "HTTP 400") as caught:
            await c.call()
        # a service's 400 is the caller's; an LLM's 400 to a request the service built is the service's 502
        # (an LLM's error text is logged, never passed on)
        assert caught.value.status == (400 if kind == "service" else 502)
        assert c.pauses == [] and c.policy.breaker.state == "closed" and c.errors("400") == 1.0


@pytest.mark.parametrize("wire", ["mock", "aiohttp"])
async def test_llm_streams_after_a_retried_503_and_a_proxied_400_is_the_callers(wire: str) -> None:
    events = (b'data: {"choices": [{"delta": {"content": "o"}, "finish_reason": "stop"}]}\n\n'
              b'data: {"usage": {"prompt_tokens": 2}}\n\ndata: [DONE]\n\n')
    async with caller("llm", wire, [(503, {"Retry-After": "1"}, {"error": {"message": "warming"}}), events]) as c:
        chunks = [chunk async for chunk in c.client.stream({"model": "m", "messages": []})]
        assert chunks[0]["choices"][0]["delta"]["content"] == "o" and len(chunks) == 2
        assert c.pauses == [1.0] and c.errors("503") == 1.0
    async with caller("llm", wire, [(400, {}, {"error": {"message": "too long", "param": "messages"}})]) as c:
        with pytest.raises(ServiceError, match="HTTP 400") as caught:  # the caller's own parameters: its 422
            await c.client.complete({"model": "m", "messages": []})
        assert caught.value.status == 422 and caught.value.param == "messages" and c.pauses == []
    async with caller("llm", wire, [(500, {}, {"error": {"message": "boom"}})]) as c:
        with pytest.raises(UpstreamError, match="HTTP 500") as failed:  # the LLM's own failure stays a 502
            await c.client.complete({"model": "m", "messages": []})
        assert failed.value.status == 502
