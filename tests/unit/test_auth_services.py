"""Auth on every service: 401 (error envelope, WWW-Authenticate) without a key or with a wrong one on
every guarded endpoint, several keys and the internal token accepted, health/metrics/version open, the
internal clients send the token from their settings, and no key ever reaches the logs."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi import FastAPI

from plugsearch.common.app import build_app
from plugsearch.common.clients import RetrieverClient
from plugsearch.common.errors import Unauthorized
from plugsearch.common.http import ClientSettings, UpstreamUnavailable
from plugsearch.common.logging import RequestIdFilter
from plugsearch.common.schemas.base import StrictModel
from plugsearch.common.settings import ServiceSettings
from tests.asgi import app_client

KEY_A = "public-key-aaaaaaaa-0123456789"
KEY_B = "public-key-bbbbbbbb-9876543210"
INTERNAL = "internal-token-cccccccc-4242"
WRONG = "public-key-aaaaaaaa-0123456780"  # one character off
SECRETS = (KEY_A, KEY_B, INTERNAL, WRONG)

GUARDED: dict[str, list[str]] = {
    "searcher": ["/search", "/search/batch", "/feedback"],
    "retriever": ["/retrieve", "/searchr1/retrieve"],
    "generator": ["/generate", "/generate/batch"],
    "judge": ["/judge", "/judge/batch"],
}
OPEN = ["/health/live", "/metrics", "/version", "/openapi.json"]


def service_app(name: str, **auth: Any) -> FastAPI:
    """The service's real app with auth settings (no lifespan needed: the guard answers first)."""
    if name == "searcher":
        from plugsearch.searcher.api import create_app as searcher_app
        from plugsearch.searcher.settings import SearcherSettings

        return searcher_app(SearcherSettings(**auth))
    if name == "retriever":
        from plugsearch.retriever.api import create_app as retriever_app
        from plugsearch.retriever.settings import RetrieverSettings

        return retriever_app(RetrieverSettings(**auth))
    if name == "generator":
        from plugsearch.generator.api import create_app as generator_app
        from plugsearch.generator.settings import GeneratorSettings

        return generator_app(GeneratorSettings(**auth))
    from plugsearch.judge.api import create_app as judge_app
    from plugsearch.judge.settings import JudgeSettings

    return judge_app(JudgeSettings(**auth))


def no_lifespan_client(app: FastAPI) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test")


@pytest.mark.parametrize("service", list(GUARDED))
async def test_every_guarded_endpoint_refuses_missing_and_wrong_keys(service: str) -> None:
    app = service_app(service, api_keys=f"{KEY_A},{KEY_B}", internal_token=INTERNAL)
    async with no_lifespan_client(app) as client:
        for path in GUARDED[service]:
            for headers in ({}, {"Authorization": f"Bearer {WRONG}"}, {"X-API-Key": WRONG},
                            {"Authorization": f"Basic {KEY_A}"}, {"Authorization": "Bearer "},
                            {"Authorization": KEY_A}):
                response = await client.post(path, json={}, headers=headers)
                assert response.status_code == 401, (path, headers, response.text)
                assert response.headers["www-authenticate"] == "Bearer"
                error = response.json()["error"]
                assert error["type"] == "unauthorized" and error["request_id"] == response.headers["x-request-id"]
                assert not any(secret in response.text for secret in SECRETS)
            # Accepted keys get past the guard: the empty body is then the handler's 422, not a 401.
            for headers in ({"Authorization": f"Bearer {KEY_A}"}, {"authorization": f"bearer {KEY_B}"},
                            {"X-API-Key": KEY_B}, {"Authorization": f"Bearer {INTERNAL}"}):
                response = await client.post(path, json={}, headers=headers)
                assert response.status_code == 422, (path, headers, response.text)
        for path in OPEN:
            response = await client.get(path)
            assert response.status_code == 200, (path, response.text)
        schema = (await client.get("/openapi.json")).json()
        assert set(schema["components"]["securitySchemes"]) == {"bearer", "apiKey"}


@pytest.mark.parametrize("service", list(GUARDED))
async def test_internal_token_alone_guards_internal_services(service: str) -> None:
    app = service_app(service, internal_token=INTERNAL)
    async with no_lifespan_client(app) as client:
        path = GUARDED[service][0]
        assert (await client.post(path, json={})).status_code == 401
        assert (await client.post(path, json={}, headers={"Authorization": f"Bearer {KEY_A}"})).status_code == 401
        assert (await client.post(path, json={}, headers={"Authorization": f"Bearer {INTERNAL}"})).status_code == 422


@pytest.mark.parametrize("service", list(GUARDED))
async def test_without_keys_services_are_open(service: str) -> None:
    async with no_lifespan_client(service_app(service)) as client:
        assert (await client.post(GUARDED[service][0], json={})).status_code == 422


def test_services_and_trainer_read_the_internal_token_from_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """What the stack and the deployments set: each caller's upstream token, each callee's accepted token."""
    from plugsearch.searcher.settings import SearcherSettings
    from plugsearch.trainer.common.settings import TrainerSettings

    monkeypatch.setenv("SEARCHER_RETRIEVER__TOKEN", INTERNAL)
    monkeypatch.setenv("SEARCHER_API_KEYS", f"{KEY_A},{KEY_B}")
    monkeypatch.setenv("SEARCHER_INTERNAL_TOKEN", INTERNAL)
    for upstream in ("RETRIEVER", "GENERATOR", "JUDGE", "SEARCHER"):
        monkeypatch.setenv(f"TRAINER_{upstream}__TOKEN", INTERNAL)
    searcher = SearcherSettings()
    assert searcher.retriever.token is not None and searcher.retriever.token.get_secret_value() == INTERNAL
    assert [k.get_secret_value() for k in searcher.api_keys] == [KEY_A, KEY_B]
    trainer = TrainerSettings()
    for client in (trainer.retriever, trainer.generator, trainer.judge, trainer.searcher):
        assert client.token is not None and client.token.get_secret_value() == INTERNAL
    # Secrets never show in reprs or dumps (what a startup log line would print).
    for text in (repr(searcher), str(searcher), searcher.model_dump_json(), repr(trainer)):
        assert not any(secret in text for secret in SECRETS)


class Echo(StrictModel):
    text: str


def echo_app(**settings: Any) -> FastAPI:
    app = build_app(ServiceSettings(**settings), service="demo", description="demo")

    @app.post("/echo")
    async def echo(body: Echo) -> Echo:
        if body.text == "boom":
            raise RuntimeError("unexpected failure")
        return body

    return app


async def test_internal_client_sends_its_token_and_fails_fast_without() -> None:
    from plugsearch.retriever.api import create_app
    from plugsearch.retriever.settings import RetrieverSettings

    app = create_app(RetrieverSettings(internal_token=INTERNAL))
    transport = httpx.ASGITransport(app=app)
    with_token = RetrieverClient(ClientSettings(url="http://retriever", token=INTERNAL, max_retries=2),
                                 transport=transport)
    without = RetrieverClient(ClientSettings(url="http://retriever", max_retries=2), transport=transport)
    try:
        # With the token the guard lets it through; the app (no lifespan here) answers 503 not ready.
        with pytest.raises(UpstreamUnavailable, match="^retriever: "):  # the answer, not a failed connection
            await with_token.request("POST", "/retrieve", json={"queries": ["q"]}, retries=0)
        with pytest.raises(Unauthorized):  # a 401 is not retried and not a breaker failure
            await without.retrieve(["q"])
        assert without.breaker.state == "closed"
    finally:
        await with_token.aclose()
        await without.aclose()


@asynccontextmanager
async def captured_logs(caplog: pytest.LogCaptureFixture) -> AsyncIterator[list[str]]:
    """Every log record of every logger at DEBUG, formatted the way the services format them."""
    lines: list[str] = []
    root = logging.getLogger()
    handler = logging.StreamHandler()
    handler.addFilter(RequestIdFilter())
    formatter = logging.Formatter("%(asctime)s %(levelname)s [%(request_id)s] %(name)s: %(message)s")
    old_level = root.level
    root.setLevel(logging.DEBUG)
    noisy = {name: logging.getLogger(name).level for name in ("httpx", "httpcore", "uvicorn", "fastapi")}
    for name in noisy:
        logging.getLogger(name).setLevel(logging.DEBUG)
    with caplog.at_level(logging.DEBUG):
        try:
            yield lines
        finally:
            for record in caplog.records:
                handler.filter(record)
                lines.append(formatter.format(record))
            root.setLevel(old_level)
            for name, level in noisy.items():
                logging.getLogger(name).setLevel(level)


async def test_keys_never_reach_the_logs(caplog: pytest.LogCaptureFixture, tmp_path: Path) -> None:
    """Successful, refused, failing and upstream calls at DEBUG level: no key or token in any log line."""
    async with captured_logs(caplog) as lines:
        app = echo_app(api_keys=f"{KEY_A},{KEY_B}", internal_token=INTERNAL, log_level="DEBUG")
        async with app_client(app) as client:
            assert (await client.post("/echo", json={"text": "hi"},
                                      headers={"Authorization": f"Bearer {KEY_A}"})).status_code == 200
            assert (await client.post("/echo", json={"text": "hi"},
                                      headers={"Authorization": f"Bearer {WRONG}"})).status_code == 401
            assert (await client.post("/echo", json={"text": "hi"}, headers={"X-API-Key": WRONG})).status_code == 401
            assert (await client.post("/echo", json={"text": "boom"},
                                      headers={"X-API-Key": KEY_B})).status_code == 500
            assert (await client.post("/echo", content=b"{bad", headers={
                "Authorization": f"Bearer {INTERNAL}", "content-type": "application/json"})).status_code == 400
        # An internal client with a token, against an upstream that keeps failing (retries, breaker).
        def failing(request: httpx.Request) -> httpx.Response:
            raise httpx.ConnectError("refused", request=request)

        client_settings = ClientSettings(url="http://retriever", token=INTERNAL, max_retries=2, backoff_s=0.0)
        retriever = RetrieverClient(client_settings, transport=httpx.MockTransport(failing))
        try:
            with pytest.raises(Exception):  # noqa: B017 - any failure; the log content is what is checked
                await retriever.retrieve(["q"])
        finally:
            await retriever.aclose()
        logging.getLogger("services").debug("settings at startup: %s", ServiceSettings(
            api_keys=f"{KEY_A},{KEY_B}", internal_token=INTERNAL))  # type: ignore[arg-type]
        logging.getLogger("services").debug("client settings: %r", client_settings)
        await asyncio.sleep(0)
    assert len(lines) >= 3, lines  # the capture works: the 500 trace and the debug lines are there
    assert any("unexpected failure" in line or "unhandled error" in line for line in lines)
    leaked = [line for line in lines if any(secret in line for secret in SECRETS)]
    assert not leaked, leaked
