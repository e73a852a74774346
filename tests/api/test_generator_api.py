"""The generator app in-process (lifespan running) with the real OpenAI client against the fake LLM server."""

from __future__ import annotations

import httpx
import pytest

from plugsearch.common.llm import LLMSettings
from plugsearch.generator.api import create_app
from plugsearch.generator.settings import GeneratorSettings
from tests.asgi import app_client
from tests.conftest import free_port
from tests.support.fake_llm import create_fake_llm_app


def read_timeout(request: httpx.Request) -> httpx.Response:
    """A transport that times out the way httpx does when the LLM is too slow."""
    raise httpx.ReadTimeout("timed out", request=request)


def settings(**kw: object) -> GeneratorSettings:
    llm = kw.pop("llm", LLMSettings(base_url="http://fake-llm/v1", model="fake-gen", max_retries=0))
    return GeneratorSettings(llm=llm, tokenizer_from_gguf=False, **kw)  # type: ignore[arg-type]


DOCS = [{"id": "d1", "title": "Paris", "text": "Paris is the capital of France."},
        {"id": "d2", "title": "Lyon", "text": "Lyon is in France."}]


async def test_generate_single_and_batch_through_the_openai_wire_format() -> None:
    fake = create_fake_llm_app(lambda body: "Paris")
    app = create_app(settings(), llm_transport=httpx.ASGITransport(app=fake))
    async with app_client(app) as client:
        one = await client.post("/generate", json={"question": "capital of France?", "documents": DOCS},
                                headers={"X-Request-ID": "req-42"})
        assert one.status_code == 200, one.text
        body = one.json()
        assert body["answer"] == "Paris" and body["documents_used"] == 2 and body["model"] == "fake-gen"
        assert body["cached"] is False and body["prompt_tokens"] > 0
        sent = fake.state.bodies[0]
        assert sent["model"] == "fake-gen" and sent["temperature"] == 0.0 and sent["max_tokens"] == 64
        assert [m["role"] for m in sent["messages"]] == ["system", "user"]
        assert "Doc 1 (Title: Paris)" in sent["messages"][0]["content"]

        again = await client.post("/generate", json={"question": "capital of France?", "documents": DOCS})
        assert again.json()["cached"] is True and fake.state.calls == 1

        items = [{"question": f"q{i}", "documents": DOCS[:1], "max_tokens": 8} for i in range(6)]
        batch = await client.post("/generate/batch", json={"items": items})
        assert batch.status_code == 200
        assert [r["answer"] for r in batch.json()["results"]] == ["Paris"] * 6
        assert fake.state.calls == 7 and fake.state.bodies[-1]["max_tokens"] == 8

        version = (await client.get("/version")).json()
        assert version["details"]["tokenizer"] == "estimate" and version["details"]["prompt_version"].startswith("v1-")
        assert (await client.get("/health/ready")).status_code == 200
        metrics = (await client.get("/metrics")).text
        assert 'generator_answers_total{source="cache"} 1.0' in metrics
        assert 'generator_llm_tokens_total{kind="prompt",llm="generator_llm"}' in metrics


@pytest.mark.parametrize("payload", [
    {}, {"question": ""}, {"question": "   "}, {"question": "q", "documents": [{"title": "t"}]},
    {"question": "q", "documents": [{"text": "t"}] * 65}, {"question": "q", "max_tokens": 0},
    {"question": "q", "temperature": 1}, {"question": "x" * 5000},
])
async def test_bad_input_is_4xx(payload: dict) -> None:
    fake = create_fake_llm_app()
    async with app_client(create_app(settings(), llm_transport=httpx.ASGITransport(app=fake))) as client:
        response = await client.post("/generate", json=payload)
        assert response.status_code == 422, response.text
        assert response.json()["error"]["type"] == "validation_error"
        bad_batch = await client.post("/generate/batch", json={"items": []})
        assert bad_batch.status_code == 422
        assert fake.state.calls == 0


async def test_llm_down_is_503_and_not_ready() -> None:
    """An unreachable LLM is unavailable (503 + Retry-After), as any unreachable upstream is."""
    llm = LLMSettings(base_url=f"http://127.0.0.1:{free_port()}/v1", max_retries=0, connect_timeout_s=0.5)
    async with app_client(create_app(settings(llm=llm))) as client:
        response = await client.post("/generate", json={"question": "q"})
        assert response.status_code == 503 and response.json()["error"]["type"] == "upstream_unavailable"
        assert "retry-after" in response.headers
        ready = await client.get("/health/ready")
        assert ready.status_code == 503 and "unreachable" in ready.json()["checks"]["llm"]


async def test_llm_timeout_is_504() -> None:
    async with app_client(create_app(settings(), llm_transport=httpx.MockTransport(read_timeout))) as client:
        response = await client.post("/generate", json={"question": "q"})
        assert response.status_code == 504 and response.json()["error"]["type"] == "upstream_timeout"


def test_bad_prompt_version_fails_at_startup() -> None:
    with pytest.raises(ValueError, match="v9"):
        create_app(settings(prompt_version="v9"))


def test_openapi_contract() -> None:
    """The wire contract other services and the trainer rely on; a change here must be deliberate."""
    doc = create_app(settings()).openapi()
    assert {p for p in doc["paths"] if not p.startswith(("/health", "/version"))} == {"/generate", "/generate/batch"}
    schemas = doc["components"]["schemas"]
    assert set(schemas["GenerateRequest"]["properties"]) == {"question", "documents", "max_tokens"}
    assert set(schemas["GenDocument"]["properties"]) == {"id", "title", "text"}
    assert set(schemas["GenerateResponse"]["properties"]) == {
        "answer", "cached", "model", "prompt_version", "documents_used", "prompt_tokens", "completion_tokens"}
    assert {"422", "502", "504"} <= set(doc["paths"]["/generate"]["post"]["responses"])
