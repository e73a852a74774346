"""The guard and the connection protocol against hostile clients (issue 21): trickled bodies hold no
in-flight slot and time out, silent connections and slow headers are closed, oversized headers are 431,
the parser's refusals and duplicated headers answer the error envelope, absurd JSON is refused before the
validator, a client that hangs up cancels its request, and admission adapts to latency."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import httpx
import pytest
from fastapi import FastAPI, Request

from plugsearch.common.admission import COST_STATE, AdaptiveLimit
from plugsearch.common.app import build_app
from plugsearch.common.guard import MAX_JSON_MEMBERS
from plugsearch.common.schemas.base import StrictModel
from plugsearch.common.settings import ServiceSettings
from plugsearch.searcher.api import create_app as create_searcher
from plugsearch.searcher.settings import SearcherSettings
from tests.api.test_searcher_stream import BlockingPolicy, FlakyRetriever
from tests.asgi import app_client, served_in_thread
from tests.support.chat_policy import chat as chat_policy


class Echo(StrictModel):
    text: str


def make_app(**settings: Any) -> FastAPI:
    app = build_app(ServiceSettings(**settings), service="demo", description="demo")
    app.state.release = asyncio.Event()
    app.state.cancelled = threading.Event()

    @app.post("/echo")
    async def echo(body: Echo, request: Request) -> Echo:
        if body.text == "wait":
            try:
                await app.state.release.wait()
            except asyncio.CancelledError:
                app.state.cancelled.set()
                raise
        if body.text.startswith("cost="):
            request.state.plugsearch_cost = float(body.text[5:])
        return body

    return app


# ------------------------------------------------------------------------------ raw sockets, real server
@contextmanager
def raw(url: str) -> Iterator[socket.socket]:
    host, port = url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=10)
    try:
        yield sock
    finally:
        sock.close()


def read_all(sock: socket.socket) -> bytes:
    """Everything until the server closes the connection; fails when it keeps it open for 10 s."""
    chunks = []
    try:
        while chunk := sock.recv(65536):
            chunks.append(chunk)
    except TimeoutError:
        raise AssertionError(f"the server kept the connection open (got {b''.join(chunks)[:80]!r})") from None
    except ConnectionResetError:
        pass
    return b"".join(chunks)


def envelope(response: bytes) -> tuple[int, dict[str, Any]]:
    head, _, body = response.partition(b"\r\n\r\n")
    assert b"content-type: application/json" in head.lower(), head
    return int(head.split(b" ", 2)[1]), json.loads(body)


POST = b"POST /echo HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"


def test_silent_connections_and_slow_headers_are_closed_and_big_headers_refused() -> None:
    app = make_app(header_timeout_s=0.3, max_header_bytes=4096)
    with served_in_thread(app) as url:
        with raw(url) as silent:
            assert read_all(silent) == b""  # closed without a word: it never said anything
        with raw(url) as slow:
            slow.sendall(b"POST /echo HTTP/1.1\r\nHost: t\r\n")  # ... and never the rest
            status, body = envelope(read_all(slow))
            assert status == 408 and body["error"]["type"] == "request_timeout"
        with raw(url) as big:
            # (sent whole: a header of any size was buffered until it ended; the server now stops at the limit)
            big.sendall(b"GET /health/live HTTP/1.1\r\nHost: t\r\nX-Big: " + b"a" * 64 * 1024 + b"\r\n\r\n")
            status, body = envelope(read_all(big))
            assert status == 431 and body["error"]["type"] == "headers_too_large"
        with raw(url) as garbage:
            garbage.sendall(b"NOT HTTP AT ALL\r\n\r\n")
            status, body = envelope(read_all(garbage))
            assert status == 400 and body["error"]["type"] == "invalid_http" and body["error"]["request_id"]
        with raw(url) as fine:  # keep-alive: two requests on one connection, the second after a pause
            fine.sendall(POST + b"Content-Length: 13\r\n\r\n" + b'{"text": "a"}')
            assert fine.recv(65536).startswith(b"HTTP/1.1 200")
        response = httpx.post(f"{url}/echo", json={"text": "b"}, headers={"x-pad": "p" * 2000})
        assert response.status_code == 200


async def test_a_trickled_body_holds_no_slot_and_times_out() -> None:
    app = make_app(max_in_flight=1, adaptive_concurrency=False, body_timeout_s=0.5)
    more = asyncio.Event()
    sent: list[dict[str, Any]] = []
    scope = {"type": "http", "method": "POST", "path": "/echo", "raw_path": b"/echo", "query_string": b"",
             "headers": [(b"content-type", b"application/json"), (b"host", b"t")], "client": ("10.0.0.9", 1),
             "server": ("t", 80), "scheme": "http", "http_version": "1.1", "root_path": ""}

    async def trickle() -> dict[str, Any]:
        if not sent and not more.is_set():
            more.set()
            return {"type": "http.request", "body": b'{"te', "more_body": True}
        await asyncio.Event().wait()  # the rest never comes
        raise AssertionError("unreachable")

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    async with app_client(app) as client:
        trickler = asyncio.create_task(app(scope, trickle, send))  # type: ignore[arg-type]
        await more.wait()
        # the one slot is free for a real request while the body trickles
        assert (await client.post("/echo", json={"text": "x"})).status_code == 200
        assert app.state.metrics.in_flight._value.get() == 0
        await asyncio.wait_for(trickler, 10)
    assert sent[0]["status"] == 408
    assert json.loads(sent[1]["body"])["error"]["type"] == "request_timeout"


async def test_duplicated_headers_and_absurd_json_are_refused_by_the_guard() -> None:
    app = make_app()
    async with app_client(app) as client:
        twice = await client.post("/echo", content=b'{"text": "a"}', headers=[
            ("content-type", "application/json"), ("content-type", "text/plain")])
        assert twice.status_code == 400 and twice.json()["error"]["type"] == "duplicate_header"
        keys = await client.post("/echo", json={"text": "a"}, headers=[("x-api-key", "k1"), ("x-api-key", "k2")])
        assert keys.status_code == 400
        fields = {"text": "a", **{f"{i:x}": 0 for i in range(150_000)}}  # ~1.7 MB
        absurd = await client.post("/echo", json=fields)
        assert absurd.status_code == 422
        assert absurd.json()["error"]["message"].startswith("request body refused: a JSON object with 150001"), absurd.text
        nested = await client.post("/echo", json={"text": "a", "x": [{"y": list(range(20_000))}]})
        assert nested.status_code == 422 and "array with 20000 items" in nested.json()["error"]["message"]
        wide = {"text": "a", **{f"f{i}": i for i in range(MAX_JSON_MEMBERS - 1)}}
        ordinary = await client.post("/echo", json=wide)  # at the limit: the validator's own 422
        assert ordinary.status_code == 422 and ordinary.json()["error"]["message"].startswith("f0")
        assert (await client.post("/echo", json={"text": "fine"})).status_code == 200


async def test_a_client_that_hangs_up_cancels_its_request() -> None:
    app = make_app()
    with served_in_thread(app) as url:
        async with httpx.AsyncClient(base_url=url, timeout=30) as client:
            request = asyncio.create_task(client.post("/echo", json={"text": "wait"}))
            for _ in range(1000):
                if app.state.metrics.in_flight._value.get() == 1:
                    break
                await asyncio.sleep(0.01)
            request.cancel()  # closes the connection
            with pytest.raises(asyncio.CancelledError):
                await request
        assert await asyncio.to_thread(app.state.cancelled.wait, 10), "the handler was not cancelled"
        metrics = (await asyncio.to_thread(httpx.get, f"{url}/metrics")).text
    assert 'demo_http_requests_total{method="POST",route="/echo",status="499"} 1.0' in metrics


async def test_a_search_whose_client_hangs_up_is_cancelled() -> None:
    policy = BlockingPolicy()
    app = create_searcher(SearcherSettings(search_timeout_s=60), policy=chat_policy(policy), retriever=FlakyRetriever())
    with served_in_thread(app) as url:
        async with httpx.AsyncClient(base_url=url, timeout=30) as client:
            request = asyncio.create_task(client.post("/search", json={"question": "who wrote it?"}))
            assert await asyncio.to_thread(policy.called.wait, 10)
            request.cancel()
            with pytest.raises(asyncio.CancelledError):
                await request
        assert await asyncio.to_thread(policy.cancelled.wait, 10), "the policy call went on without a client"


# ------------------------------------------------------------------------------------ adaptive admission
class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def knee(at: int, service_s: float = 0.1) -> Callable[[int], float]:
    """Latency of a service that runs `at` requests at once at full speed and queues the rest."""
    return lambda running: service_s * max(1.0, running / at)


def drive(limit: AdaptiveLimit, clock: Clock, latency: float | Callable[[int], float], samples: int, *,
          in_flight: int, pressed: bool = False, cost: float = 1.0) -> None:
    """`samples` requests completing 60 ms apart, each admitted with `in_flight` clients wanting in (at most
    the limit run); more clients than the limit, or `pressed`: one finds the limit full each time."""
    for _ in range(samples):
        epoch = limit.epoch
        running = min(in_flight, limit.current)
        assert limit.admits(running - 1)
        if pressed or in_flight > limit.current:
            assert not limit.admits(limit.current)
        clock.now += 0.06
        limit.observe(latency(running) if callable(latency) else latency, cost, epoch, running - 1)


def test_the_limit_follows_latency_and_holds_it_under_overload() -> None:
    clock = Clock()
    limit = AdaptiveLimit(100, min_limit=4, tolerance=2.0, clock=clock)
    service = knee(10)  # full speed up to 10 at once
    drive(limit, clock, service, 30, in_flight=2)  # low load: the baseline
    assert limit.baseline == pytest.approx(0.1)
    drive(limit, clock, service, 100, in_flight=15)  # 1.5x the knee: latency within tolerance, all admitted
    assert 15 <= limit.current <= 25  # with headroom over what is used (1.5 x 15 + 2), not the ceiling
    drive(limit, clock, service, 300, in_flight=100)  # 10x the knee: the limit holds the latency
    assert 10 <= limit.current <= 30  # latency within 2x the baseline means at most ~20-25 running
    assert limit.baseline == pytest.approx(0.1)  # no drift towards the overload's latency
    drive(limit, clock, knee(40), 300, in_flight=100)  # the service got faster (say, a second worker): grow
    assert limit.current >= 40
    drive(limit, clock, knee(400), 400, in_flight=200)
    assert limit.current == 100  # the ceiling (MAX_IN_FLIGHT) holds
    drive(limit, clock, service, 100, in_flight=2)  # quiet again: back to headroom over the floor
    assert limit.current == 12  # a burst of an eighth of the ceiling is always admitted
    drive(limit, clock, knee(10, 0.3), 100, in_flight=2)  # slower at low load too (a slower upstream): learnt
    assert limit.baseline == pytest.approx(0.3, rel=0.01)
    drive(limit, clock, 5.0, 400, in_flight=100, pressed=True)
    assert limit.current >= 4  # never below the floor


def test_requests_admitted_before_a_decrease_do_not_shrink_it_again() -> None:
    clock = Clock()
    limit = AdaptiveLimit(100, clock=clock)
    drive(limit, clock, 0.1, 20, in_flight=2)
    drive(limit, clock, 0.1, 20, in_flight=60)
    backlog = limit.epoch
    drive(limit, clock, 1.0, 10, in_flight=60, pressed=True)  # one decrease
    after = limit.current
    assert limit.epoch == backlog + 1 and after < 60
    for _ in range(100):  # the backlog drains, slowly: its latency is the old limit's, not the new one's
        clock.now += 0.06
        limit.observe(1.0, 1.0, backlog, 50)
    assert limit.current == after


def test_cost_normalises_latency_and_a_fixed_limit_never_moves() -> None:
    clock = Clock()
    limit = AdaptiveLimit(50, clock=clock)
    drive(limit, clock, 0.1, 20, in_flight=2)
    drive(limit, clock, 0.1, 20, in_flight=40)
    before = limit.current
    drive(limit, clock, 1.0, 100, in_flight=40, pressed=True, cost=10)  # ten times the work, ten times the time
    assert limit.current >= before
    fixed = AdaptiveLimit(50, adaptive=False, clock=clock)
    drive(fixed, clock, 0.1, 20, in_flight=10)
    drive(fixed, clock, 5.0, 200, in_flight=50, pressed=True)
    assert fixed.current == 50


async def test_the_guard_admits_against_the_adaptive_limit_and_exports_it() -> None:
    app = make_app(max_in_flight=40, min_in_flight=2)
    guard_limit = None
    async with app_client(app) as client:
        for _ in range(20):  # learn a baseline (cost 1)
            assert (await client.post("/echo", json={"text": "fast"})).status_code == 200
        guard = app.middleware_stack
        while not hasattr(guard, "limit"):
            guard = guard.app  # type: ignore[union-attr]
        guard_limit = guard.limit  # type: ignore[union-attr]
        guard_limit.limit = 2.0  # as if latency had squeezed it
        waiting = [asyncio.create_task(client.post("/echo", json={"text": "wait"})) for _ in range(2)]
        for _ in range(500):
            if app.state.metrics.in_flight._value.get() >= 2:
                break
            await asyncio.sleep(0.01)
        refused = await client.post("/echo", json={"text": "x"})
        assert refused.status_code == 429 and refused.headers["retry-after"] == "1"
        app.state.release.set()
        assert [r.status_code for r in await asyncio.gather(*waiting)] == [200, 200]
        metrics = (await client.get("/metrics")).text
    assert "demo_admission_limit 2.0" in metrics
    assert COST_STATE == "plugsearch_cost"
