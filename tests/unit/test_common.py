"""The shared pieces: envelope, guard middleware, client retries and breaker, caches, LLM client."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import httpx
import pytest
from fastapi import FastAPI
from pydantic import SecretStr

from plugsearch.common.answers import (
    exact_match,
    f1_score,
    has_answers,
    is_yes_no,
    normalize_answer,
    span_match,
)
from plugsearch.common.app import build_app
from plugsearch.common.cache import MemoryCache, ResultCache, make_cache
from plugsearch.common.errors import BadRequest, UpstreamError, UpstreamTimeout
from plugsearch.common.http import CircuitBreaker, ClientSettings, ServiceClient, UpstreamUnavailable
from plugsearch.common.llm import ChatMessage, LLMSettings, OpenAIChatClient
from plugsearch.common.schemas.base import StrictModel, bounded_text
from plugsearch.common.settings import ServiceSettings
from tests.asgi import app_client


class Echo(StrictModel):
    text: bounded_text(16)  # type: ignore[valid-type]


def make_app(**overrides: object) -> FastAPI:
    settings = ServiceSettings(**overrides)  # type: ignore[arg-type]

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async def ready() -> dict[str, str]:
            return {"index": "ok"}

        app.state.readiness = ready
        yield

    app = build_app(settings, service="demo", description="demo", lifespan=lifespan)
    app.state.entered = asyncio.Event()

    @app.post("/echo")
    async def echo(body: Echo) -> Echo:
        if body.text == "bad":
            raise BadRequest("bad text", param="text")
        if body.text == "boom":
            raise RuntimeError("secret internal detail")
        if body.text == "slow":
            app.state.entered.set()
            await asyncio.Event().wait()  # until the deadline cancels it
        return body

    return app


async def test_envelope_for_every_failure_kind() -> None:
    async with app_client(make_app()) as client:
        ok = await client.post("/echo", json={"text": "hi"})
        assert ok.status_code == 200 and ok.headers["x-request-id"]
        cases = [
            (client.post("/echo", content=b"{not json", headers={"content-type": "application/json"}), 400),
            (client.post("/echo", json={"text": ""}), 422),
            (client.post("/echo", json={"text": "x" * 17}), 422),
            (client.post("/echo", json={"text": "hi", "extra": 1}), 422),
            (client.post("/echo", json={"text": "bad"}), 400),
            (client.get("/nope"), 404),
            (client.get("/echo"), 405),
        ]
        for coro, status in cases:
            response = await coro
            assert response.status_code == status, response.text
            err = response.json()["error"]
            assert set(err) == {"type", "message", "param", "request_id"}
            assert err["request_id"] == response.headers["x-request-id"]


async def test_unexpected_error_is_generic_500() -> None:
    async with app_client(make_app()) as client:
        response = await client.post("/echo", json={"text": "boom"})
        assert response.status_code == 500
        assert "secret" not in response.text
        assert response.json()["error"]["type"] == "internal_error"


async def test_request_id_is_accepted_and_echoed() -> None:
    async with app_client(make_app()) as client:
        response = await client.post("/echo", json={"text": "hi"}, headers={"X-Request-ID": "abc-123"})
        assert response.headers["x-request-id"] == "abc-123"


async def test_auth_body_limit_deadline_and_overload() -> None:
    app = make_app(api_keys="key-one-123,key-two-456", max_body_bytes=1024, request_timeout_s=0.5,
                   max_in_flight=1)
    async with app_client(app) as client:
        assert (await client.get("/health/live")).status_code == 200  # open path
        assert (await client.post("/echo", json={"text": "hi"})).status_code == 401
        wrong = await client.post("/echo", json={"text": "hi"}, headers={"Authorization": "Bearer nope-nope"})
        assert wrong.status_code == 401 and wrong.json()["error"]["type"] == "unauthorized"
        auth = {"Authorization": "Bearer key-two-456"}
        assert (await client.post("/echo", json={"text": "hi"}, headers=auth)).status_code == 200
        assert (await client.post("/echo", json={"text": "hi"}, headers={"X-API-Key": "key-one-123"})).status_code == 200
        big = await client.post("/echo", content=b"x" * 2048, headers={**auth, "content-type": "application/json"})
        assert big.status_code == 413
        slow = asyncio.create_task(client.post("/echo", json={"text": "slow"}, headers=auth))
        await app.state.entered.wait()  # the one slot is taken
        busy = await client.post("/echo", json={"text": "hi"}, headers=auth)
        assert busy.status_code == 429 and busy.headers["retry-after"] == "1"
        late = await slow
        assert late.status_code == 504 and late.json()["error"]["type"] == "deadline_exceeded"
        metrics = await client.get("/metrics")
        assert 'demo_http_rejected_total{reason="overloaded"} 1.0' in metrics.text


async def test_health_ready_and_version() -> None:
    async with app_client(make_app()) as client:
        ready = await client.get("/health/ready")
        assert ready.status_code == 200 and ready.json()["checks"] == {"index": "ok"}
        version = await client.get("/version")
        assert version.json()["service"] == "demo"


async def test_a_served_app_tunes_its_garbage_collector_once_started_and_a_test_app_leaves_it() -> None:
    import gc

    before = gc.get_threshold()
    try:
        async with app_client(make_app(gc_threshold=12_345)) as client:  # built by a test: left as it is
            assert (await client.get("/health/ready")).status_code == 200
            assert gc.get_threshold() == before
        served = make_app(gc_threshold=12_345)
        served.state.tune_gc = True  # what `entrypoint` sets on the app its process serves
        frozen = gc.get_freeze_count()
        async with app_client(served) as client:
            assert (await client.get("/health/ready")).status_code == 200
            assert gc.get_threshold() == (12_345, *before[1:])
            assert gc.get_freeze_count() > frozen  # what startup built is out of the collections
    finally:
        gc.unfreeze()
        gc.set_threshold(*before)


def test_settings_refuse_short_keys() -> None:
    with pytest.raises(ValueError):
        ServiceSettings(api_keys="short")  # type: ignore[arg-type]
    s = ServiceSettings(api_keys="longenough1, longenough2")  # type: ignore[arg-type]
    assert [k.get_secret_value() for k in s.api_keys] == ["longenough1", "longenough2"]
    assert "longenough1" not in repr(s)


class Flaky(httpx.AsyncBaseTransport):
    def __init__(self, statuses: list[int | Exception]) -> None:
        self.statuses = statuses
        self.calls = 0

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        item = self.statuses[min(self.calls, len(self.statuses) - 1)]
        self.calls += 1
        if isinstance(item, Exception):
            raise item
        body = {"ok": True} if item < 400 else {"error": {"type": "x", "message": f"status {item}"}}
        return httpx.Response(item, json=body, request=request)


async def test_client_retries_then_succeeds() -> None:
    transport = Flaky([503, httpx.ConnectError("refused"), 200])
    client = ServiceClient(ClientSettings(url="http://up", backoff_s=0.001), transport=transport)
    response = await client.request("GET", "/x")
    assert response.status_code == 200 and transport.calls == 3
    await client.aclose()


async def test_client_does_not_retry_client_errors_and_decodes_envelope() -> None:
    transport = Flaky([400])
    client = ServiceClient(ClientSettings(url="http://up", backoff_s=0.001), transport=transport, name="up")
    with pytest.raises(BadRequest, match="up: status 400"):
        await client.request("GET", "/x")
    assert transport.calls == 1
    await client.aclose()


async def test_client_breaker_opens_and_fails_fast() -> None:
    transport = Flaky([httpx.ConnectError("refused")])
    settings = ClientSettings(url="http://up", backoff_s=0.001, max_retries=0, breaker_failures=2,
                              breaker_reset_s=60)
    client = ServiceClient(settings, transport=transport)
    for _ in range(2):
        with pytest.raises(UpstreamUnavailable):
            await client.request("GET", "/x")
    with pytest.raises(UpstreamUnavailable, match="circuit open"):
        await client.request("GET", "/x")
    assert transport.calls == 2
    await client.aclose()


def test_breaker_half_open_allows_one_trial() -> None:
    breaker = CircuitBreaker(failures=1, reset_s=0.0)
    breaker.record_failure()
    assert breaker.allow() is True
    assert breaker.allow() is False  # one trial at a time
    breaker.record_success()
    assert breaker.state == "closed" and breaker.allow()


async def test_memory_cache_lru_and_ttl() -> None:
    cache = ResultCache(MemoryCache(max_items=2), name="t")
    await cache.set_json("a", 1)
    await cache.set_json("b", 2)
    assert await cache.get_json("a") == 1
    await cache.set_json("c", 3)
    assert await cache.get_json("b") is None  # least recently used dropped
    expired = ResultCache(MemoryCache(ttl_s=-1), name="t")  # entries expire a second before they are written
    await expired.set_json("d", 4)
    assert await expired.get_json("d") is None


async def test_redis_cache_roundtrip_and_bypass(redis_url: str) -> None:
    cache = make_cache(redis_url, name="t")
    await cache.set_json("k", {"x": [1, 2]})
    assert await cache.get_json("k") == {"x": [1, 2]}
    await cache.aclose()
    dead = make_cache("redis://127.0.0.1:1/0", name="t")
    assert await dead.get_json("k") is None  # bypassed, not raised
    await dead.set_json("k", 1)
    await dead.aclose()


def _chat_reply(text: str) -> dict[str, object]:
    return {"choices": [{"message": {"role": "assistant", "content": text}, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 5, "completion_tokens": 2}, "model": "m"}


async def test_llm_client_parses_retries_and_maps_errors() -> None:
    seen: list[dict[str, object]] = []

    def handler(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        seen.append(body)
        if len(seen) == 1:
            return httpx.Response(503, json={"error": {"message": "warming up"}})
        return httpx.Response(200, json=_chat_reply("Paris"))

    llm = OpenAIChatClient(LLMSettings(base_url="http://llm/v1", backoff_s=0.001, api_key=SecretStr("sk-x")),
                           transport=httpx.MockTransport(handler))
    result = await llm.chat([ChatMessage(role="user", content="q")], max_tokens=8, extra={"grammar": "g"})
    assert result.text == "Paris" and result.completion_tokens == 2
    assert seen[-1]["grammar"] == "g" and seen[-1]["temperature"] == 0.0
    await llm.aclose()

    for failure, error, retries in ((httpx.ConnectError("refused"), UpstreamError, 1),
                                    (httpx.ReadTimeout("slow"), UpstreamTimeout, 0)):
        def fail(request: httpx.Request, failure: Exception = failure) -> httpx.Response:
            raise failure

        failing = OpenAIChatClient(LLMSettings(base_url="http://llm/v1", backoff_s=0.001, max_retries=retries),
                                   transport=httpx.MockTransport(fail))
        with pytest.raises(error):
            await failing.chat([ChatMessage(role="user", content="q")])
        await failing.aclose()


def test_answer_normalisation_and_scores() -> None:
    assert normalize_answer("The  Eiffel-Tower!") == "eiffeltower"
    assert span_match("It was Barack Obama, in 2009.", ["Barack Obama"])
    assert span_match("not true", ["true"])  # the documented false positive
    assert not span_match("Marseille", ["Paris"])
    assert has_answers("café au lait", ["cafe\u0301"])  # NFD on both sides
    assert exact_match("the Paris", ["Paris"]) == 1.0
    assert f1_score("Paris France", ["Paris"]) == pytest.approx(2 / 3)
    assert is_yes_no(["Yes"]) and not is_yes_no(["Yes", "Paris"])


async def test_service_client_connect_timeout_is_unavailable_read_timeout_is_504() -> None:
    """No connection at all (a stopped container's cached address) is 503 + Retry-After, like refused;
    a connection that never answers is 504."""
    def no_connection(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectTimeout("no route")

    def silent(request: httpx.Request) -> httpx.Response:
        raise httpx.ReadTimeout("slow")

    for handler, error in ((no_connection, UpstreamUnavailable), (silent, UpstreamTimeout)):
        client = ServiceClient(ClientSettings(url="http://retriever:8001", max_retries=1, backoff_s=0.001),
                               transport=httpx.MockTransport(handler))
        with pytest.raises(error) as caught:
            await client.request("GET", "/x")
        await client.aclose()
        assert caught.value.status == (503 if error is UpstreamUnavailable else 504)
        if error is UpstreamUnavailable:
            assert caught.value.retry_after


async def test_default_transport_maps_refused_and_timeouts_apart() -> None:
    """The aiohttp wire (default) keeps httpx's error kinds: refused is unreachable, silence is a timeout."""
    from tests.conftest import free_port

    refused = ServiceClient(ClientSettings(url=f"http://127.0.0.1:{free_port()}", max_retries=0))
    assert type(refused._wire).__name__ == "AiohttpWire"  # aiohttp's pool, not httpcore's
    with pytest.raises(UpstreamUnavailable):
        await refused.request("GET", "/x")
    await refused.aclose()

    release = asyncio.Event()

    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await release.wait()  # never answers while the client waits
        writer.close()
        await writer.wait_closed()

    server = await asyncio.start_server(silent, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    llm = OpenAIChatClient(LLMSettings(base_url=f"http://127.0.0.1:{port}/v1", timeout_s=0.3, max_retries=0))
    try:
        with pytest.raises(UpstreamTimeout):
            await llm.chat([ChatMessage(role="user", content="q")])
    finally:
        await llm.aclose()
        release.set()
        await asyncio.sleep(0.05)  # let the handler close its writer inside the loop
        server.close()
        await server.wait_closed()


async def _raw_server(answer: bytes | None) -> tuple[asyncio.Server, list[bytes]]:
    """A one-route HTTP/1.1 server on asyncio streams: records each request, answers `answer` (None: hangs up)."""
    seen: list[bytes] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        length = next((int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                       if line.lower().startswith(b"content-length:")), 0)
        seen.append(head + await reader.readexactly(length))
        if answer is not None:
            writer.write(answer)
            await writer.drain()
        writer.close()
        await writer.wait_closed()

    return await asyncio.start_server(handle, "127.0.0.1", 0), seen


async def test_aiohttp_wire_sends_json_token_and_request_id_and_decodes_answers() -> None:
    from plugsearch.common.logging import reset_request_id, set_request_id

    body = b'{"ok": true, "big": 1}'
    server, seen = await _raw_server(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: "
                                     + str(len(body)).encode() + b"\r\nConnection: close\r\n\r\n" + body)
    port = server.sockets[0].getsockname()[1]
    client = ServiceClient(ClientSettings(url=f"http://127.0.0.1:{port}/", token=SecretStr("t0k"), max_retries=0))
    token = set_request_id("rid-42")
    try:
        response = await client.request("POST", "/x", json={"q": "café", "n": 2**70})
        assert response.status_code == 200 and response.json() == {"ok": True, "big": 1}
        head, _, sent = seen[0].partition(b"\r\n\r\n")
        assert head.startswith(b"POST /x HTTP/1.1")
        lowered = head.lower()
        assert b"authorization: bearer t0k" in lowered and b"x-request-id: rid-42" in lowered
        assert b"content-type: application/json" in lowered
        assert json.loads(sent) == {"q": "café", "n": 2**70}  # over 64 bits: the stdlib fallback
    finally:
        reset_request_id(token)
        await client.aclose()
        server.close()
        await server.wait_closed()


async def test_aiohttp_wire_maps_hangups_and_error_envelopes() -> None:
    hangup, _ = await _raw_server(None)
    client = ServiceClient(ClientSettings(url=f"http://127.0.0.1:{hangup.sockets[0].getsockname()[1]}",
                                          max_retries=0))
    with pytest.raises(UpstreamUnavailable, match="unreachable"):  # connection closed before any answer
        await client.request("GET", "/x")
    await client.aclose()
    hangup.close()
    await hangup.wait_closed()

    envelope = b'{"error": {"type": "upstream_unavailable", "message": "index loading", "param": "k"}}'
    busy, seen = await _raw_server(b"HTTP/1.1 503 Service Unavailable\r\nRetry-After: 7\r\nContent-Length: "
                                   + str(len(envelope)).encode() + b"\r\nConnection: close\r\n\r\n" + envelope)
    client = ServiceClient(ClientSettings(url=f"http://127.0.0.1:{busy.sockets[0].getsockname()[1]}",
                                          max_retries=0), name="retriever")
    with pytest.raises(UpstreamUnavailable, match="retriever: index loading") as info:
        await client.request("GET", "/x")
    assert info.value.retry_after == 7.0 and info.value.param == "k" and len(seen) == 1
    await client.aclose()
    busy.close()
    await busy.wait_closed()
