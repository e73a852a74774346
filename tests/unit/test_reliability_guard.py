"""The shared reliability mechanisms against the holes they close: chunked bodies over the limit, non-JSON
bodies, forged request ids, overload 429 + Retry-After with nothing queued, hostile Retry-After values,
a circuit breaker whose trial call is cancelled, and Redis going away under the cache."""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from fastapi import FastAPI

from plugsearch.common.app import build_app
from plugsearch.common.cache import RedisCache, ResultCache
from plugsearch.common.errors import UpstreamError
from plugsearch.common.http import (
    CircuitBreaker,
    ClientSettings,
    ServiceClient,
    UpstreamUnavailable,
    parse_retry_after,
)
from plugsearch.common.schemas.base import StrictModel
from plugsearch.common.settings import ServiceSettings
from tests.asgi import app_client


class Echo(StrictModel):
    text: str


def make_app(**settings: Any) -> FastAPI:
    app = build_app(ServiceSettings(**settings), service="demo", description="demo")
    app.state.release = asyncio.Event()

    @app.post("/echo")
    async def echo(body: Echo) -> Echo:
        if body.text == "wait":
            await app.state.release.wait()
        return body

    return app


async def test_chunked_body_over_the_limit_is_413_like_a_large_content_length() -> None:
    async def chunks() -> AsyncIterator[bytes]:
        yield b'{"text": "'
        for _ in range(4):
            yield b"x" * 1024
        yield b'"}'

    async with app_client(make_app(max_body_bytes=2048)) as client:
        response = await client.post("/echo", content=chunks(), headers={"content-type": "application/json"})
        assert "content-length" not in response.request.headers  # really streamed
        assert response.status_code == 413 and response.json()["error"]["type"] == "payload_too_large"
        big = await client.post("/echo", json={"text": "x" * 4096})
        assert big.status_code == 413
        assert (await client.post("/echo", json={"text": "fits"})).status_code == 200


async def test_a_client_that_hangs_up_mid_body_is_recorded_as_gone_not_refused() -> None:
    app = make_app()
    arriving = iter([{"type": "http.request", "body": b'{"te', "more_body": True}, {"type": "http.disconnect"}])
    sent: list[dict[str, Any]] = []
    scope = {"type": "http", "method": "POST", "path": "/echo", "raw_path": b"/echo", "query_string": b"",
             "headers": [(b"content-type", b"application/json"), (b"host", b"t")], "client": ("10.0.0.9", 1),
             "server": ("t", 80), "scheme": "http", "http_version": "1.1", "root_path": ""}

    async def receive() -> dict[str, Any]:
        return next(arriving)

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    async with app_client(app) as client:
        await app(scope, receive, send)  # type: ignore[arg-type]
        metrics = (await client.get("/metrics")).text
    assert sent == []  # nobody is left to answer
    assert 'demo_http_requests_total{method="POST",route="unmatched",status="499"} 1.0' in metrics
    assert "demo_http_rejected_total{" not in metrics  # not counted as a refusal (413 or any other)


async def test_non_json_content_types_are_415_and_json_variants_pass() -> None:
    async with app_client(make_app()) as client:
        for content_type in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x",
                             "application/xml"):
            response = await client.post("/echo", content=b'{"text": "hi"}', headers={"content-type": content_type})
            assert response.status_code == 415, content_type
            assert response.json()["error"]["type"] == "unsupported_media_type"
        for content_type in ("application/json", "application/json; charset=utf-8", "Application/JSON",
                             "application/merge-patch+json"):
            response = await client.post("/echo", content=b'{"text": "hi"}', headers={"content-type": content_type})
            assert response.status_code == 200, content_type


async def test_forged_request_ids_are_replaced() -> None:
    async with app_client(make_app()) as client:
        ok = await client.post("/echo", json={"text": "a"}, headers={"X-Request-ID": "trace-1234.abc"})
        assert ok.headers["x-request-id"] == "trace-1234.abc"
        for forged in (b"evil\tid", b"a b", b'quote"', "é-latin1".encode(), b"\x7f" + b"x" * 10):
            response = await client.post("/echo", json={"text": "a"}, headers={"X-Request-ID": forged})
            assert response.status_code == 200
            minted = response.headers["x-request-id"]
            assert minted.encode() != forged and len(minted) == 32 and minted.isalnum()


async def test_overload_answers_429_with_retry_after_at_once_and_loses_nothing() -> None:
    app = make_app(max_in_flight=3, retry_after_s=2)
    async with app_client(app) as client:
        waiting = [asyncio.create_task(client.post("/echo", json={"text": "wait"})) for _ in range(3)]
        for _ in range(500):  # until the three are inside the handler
            if app.state.metrics.in_flight._value.get() >= 3:
                break
            await asyncio.sleep(0.01)
        refused = await asyncio.gather(*[client.post("/echo", json={"text": "x"}) for _ in range(5)])
        assert [r.status_code for r in refused] == [429] * 5
        assert all(r.headers["retry-after"] == "2" for r in refused)
        assert all(r.json()["error"]["type"] == "overloaded" for r in refused)
        assert all(not t.done() for t in waiting)  # refusing did not disturb the admitted requests
        app.state.release.set()
        assert [r.status_code for r in await asyncio.gather(*waiting)] == [200] * 3
        assert (await client.post("/echo", json={"text": "after"})).status_code == 200
        # Health stays answerable while overloaded (it is not counted).
        assert (await client.get("/health/live")).status_code == 200


@pytest.mark.parametrize(("header", "expected"), [
    ("3", 3.0), ("0.5", 0.5), ("nan", None), ("inf", None), ("-inf", None), ("-5", 0.0), ("1e308", 3600.0),
    ("Wed, 21 Oct 2015 07:28:00 GMT", None), ("", None), (None, None)])
def test_retry_after_is_parsed_finite_and_clamped(header: str | None, expected: float | None) -> None:
    assert parse_retry_after(header) == expected


async def test_hostile_upstream_retry_after_never_makes_a_5xx_of_our_own_or_a_long_sleep() -> None:
    calls = 0

    def upstream(request: httpx.Request) -> httpx.Response:
        nonlocal calls
        calls += 1
        return httpx.Response(503, headers={"retry-after": "nan" if calls == 1 else "1e308"},
                              json={"error": {"type": "not_ready", "message": "loading", "param": None}})

    client = ServiceClient(ClientSettings(url="http://up", max_retries=1, backoff_s=0.0),
                           transport=httpx.MockTransport(upstream))
    try:
        with pytest.raises(UpstreamUnavailable) as caught:
            async with asyncio.timeout(10):  # a 1e308 s Retry-After is clamped to the 5 s retry cap
                await client.request("POST", "/x", json={})
        assert caught.value.retry_after == 3600.0 and calls == 2
    finally:
        await client.aclose()


class BreakerClock:
    """`time.monotonic` as the breaker's module reads it, moved forward by `advance` instead of waiting
    (the module's other uses of `time` are left alone, and so is the event loop's clock)."""

    def __init__(self) -> None:
        self.offset = 0.0

    def monotonic(self) -> float:
        return time.monotonic() + self.offset

    def advance(self, seconds: float) -> None:
        self.offset += seconds

    def __getattr__(self, name: str) -> Any:
        return getattr(time, name)


@pytest.fixture()
def clock(monkeypatch: pytest.MonkeyPatch) -> BreakerClock:
    fake = BreakerClock()
    monkeypatch.setattr(sys.modules[CircuitBreaker.__module__], "time", fake)
    return fake


def test_breaker_trial_that_never_reports_expires(clock: BreakerClock) -> None:
    """A trial call cancelled by a deadline records nothing; the breaker must not stay open forever."""
    breaker = CircuitBreaker(failures=1, reset_s=60, trial_timeout_s=60)
    breaker.record_failure()
    assert not breaker.allow()  # open
    clock.advance(61)
    assert breaker.allow()  # half-open: the trial (then cancelled: nothing recorded)
    assert not breaker.allow()  # a trial is in flight
    clock.advance(61)
    assert breaker.allow()  # the silent trial expired: a new one is allowed
    breaker.record_success()
    assert breaker.state == "closed"


async def test_cancelled_trial_does_not_wedge_the_client_breaker(clock: BreakerClock) -> None:
    healthy = asyncio.Event()
    trial_sent = asyncio.Event()

    async def upstream(request: httpx.Request) -> httpx.Response:
        if not healthy.is_set():
            raise httpx.ConnectError("refused", request=request)
        return httpx.Response(200, json={"ok": True})

    class Hanging(httpx.AsyncBaseTransport):
        async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
            if request.url.path == "/hang":
                trial_sent.set()
                await asyncio.Event().wait()  # until the caller gives up
            return await upstream(request)

    client = ServiceClient(ClientSettings(url="http://up", max_retries=0, breaker_failures=1,
                                          breaker_reset_s=60), transport=Hanging())
    try:
        with pytest.raises(UpstreamUnavailable):
            await client.request("GET", "/x")  # opens the breaker
        clock.advance(61)
        trial = asyncio.create_task(client.request("GET", "/hang"))
        await trial_sent.wait()
        trial.cancel()  # the trial call is cancelled (the caller's deadline): nothing is recorded
        with pytest.raises(asyncio.CancelledError):
            await trial
        healthy.set()
        clock.advance(61)  # the trial expires after max(reset_s, 1 s)
        assert (await client.request("GET", "/x")).status_code == 200
        assert client.breaker.state == "closed"
    finally:
        await client.aclose()


async def test_redis_going_away_bypasses_the_cache(redis_url: str) -> None:
    cache = ResultCache(RedisCache(redis_url, timeout_s=0.2), name="t")
    await cache.set_json("k", {"v": 1})
    assert await cache.get_json("k") == {"v": 1}
    dead = ResultCache(RedisCache("redis://127.0.0.1:1/0", timeout_s=0.2), name="dead")
    assert await dead.get_json("k") is None  # refused: a miss, not an exception
    await dead.set_json("k", {"v": 2})
    await cache.aclose()
    await dead.aclose()


async def test_upstream_error_status_is_not_retried_forever() -> None:
    """A 502 is worth a retry, but only `max_retries` of them: then the caller gets the 502 itself."""
    sent: list[httpx.Request] = []
    down = {"error": {"type": "upstream_error", "message": "down"}}
    transport = httpx.MockTransport(lambda request: sent.append(request) or httpx.Response(502, json=down))
    client = ServiceClient(ClientSettings(url="http://up", max_retries=2, backoff_s=0.0, breaker_failures=100),
                           transport=transport)
    with pytest.raises(UpstreamError) as caught:
        await client.request("POST", "/x", json={})
    await client.aclose()
    assert len(sent) == 3 and caught.value.status == 502 and "down" in caught.value.message
