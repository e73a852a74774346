"""The judge app in-process with the real OpenAI client: fake LLM server, unreachable and slow LLMs."""

from __future__ import annotations

import httpx
import pytest

from plugsearch.common.llm import LLMSettings
from plugsearch.judge.api import create_app
from plugsearch.judge.settings import JudgeSettings
from tests.asgi import app_client
from tests.conftest import free_port
from tests.support.fake_llm import create_fake_llm_app


def read_timeout(request: httpx.Request) -> httpx.Response:
    """A transport that times out the way httpx does when the LLM is too slow."""
    raise httpx.ReadTimeout("timed out", request=request)


def fake_settings(**kw: object) -> JudgeSettings:
    llm = kw.pop("llm", LLMSettings(base_url="http://fake-llm/v1", model="fake-judge", max_retries=0))
    return JudgeSettings(llm=llm, **kw)  # type: ignore[arg-type]


def down_settings(**kw: object) -> JudgeSettings:
    llm = LLMSettings(base_url=f"http://127.0.0.1:{free_port()}/v1", max_retries=0, connect_timeout_s=0.5)
    return JudgeSettings(llm=llm, **kw)  # type: ignore[arg-type]


async def test_judge_single_and_batch() -> None:
    fake = create_fake_llm_app(lambda body: "yes")
    async with app_client(create_app(fake_settings(), llm_transport=httpx.ASGITransport(app=fake))) as client:
        span = await client.post("/judge", json={"prediction": "It was Barack Obama.", "golden_answers": ["Obama"]})
        assert span.status_code == 200
        assert span.json() == {"score": 1.0, "genacc": 1.0, "em": 0.0, "f1": 0.4, "decided_by": "span",
                               "reason": None, "cached": False}
        assert fake.state.calls == 0
        items = [{"prediction": "twenty-five", "golden_answers": ["25"]},
                 {"prediction": "Paris", "golden_answers": ["Paris"], "mode": "em"},
                 {"prediction": "x", "golden_answers": ["y"], "mode": "llm", "question": "q?"}]
        batch = await client.post("/judge/batch", json={"items": items})
        assert batch.status_code == 200, batch.text
        results = batch.json()["results"]
        assert [(r["score"], r["decided_by"]) for r in results] == [(1.0, "llm"), (1.0, "em"), (1.0, "llm")]
        assert fake.state.calls == 2
        sent = fake.state.bodies[0]
        assert sent["model"] == "fake-judge" and sent["max_tokens"] == 10 and sent["temperature"] == 0.0
        assert "Golden answers: ['25']" in sent["messages"][0]["content"]
        metrics = (await client.get("/metrics")).text
        assert 'judge_decisions_total{decided_by="llm",mode="genacc"} 1.0' in metrics


@pytest.mark.parametrize("payload", [
    {"prediction": "Paris", "golden_answers": []},
    {"prediction": "Paris"},
    {"prediction": "", "golden_answers": ["Paris"]},
    {"prediction": "  \n", "golden_answers": ["Paris"]},
    {"prediction": "x" * (1024 * 1024), "golden_answers": ["Paris"]},
    {"prediction": "Paris", "golden_answers": ["Paris"], "mode": "bleu"},
    {"prediction": "Paris", "golden_answers": [""]},
    {"prediction": "Paris", "golden_answers": "Paris"},
])
async def test_bad_input_is_4xx(payload: dict) -> None:
    fake = create_fake_llm_app(lambda body: "yes")
    async with app_client(create_app(fake_settings(), llm_transport=httpx.ASGITransport(app=fake))) as client:
        response = await client.post("/judge", json=payload)
        assert 400 <= response.status_code < 500, response.text
        assert response.json()["error"]["request_id"]
        batch = await client.post("/judge/batch", json={"items": [payload]})
        assert 400 <= batch.status_code < 500
        assert fake.state.calls == 0


async def test_llm_unreachable_llm_mode_503_genacc_undecided() -> None:
    async with app_client(create_app(down_settings())) as client:
        llm_mode = await client.post("/judge", json={"prediction": "Lutetia", "golden_answers": ["Paris"],
                                                     "mode": "llm"})
        assert llm_mode.status_code == 503 and llm_mode.json()["error"]["type"] == "upstream_unavailable"
        items = [{"prediction": "Paris, France", "golden_answers": ["Paris"]},
                 {"prediction": "Lutetia", "golden_answers": ["Paris"]}]
        batch = await client.post("/judge/batch", json={"items": items})
        assert batch.status_code == 200
        decided, undecided = batch.json()["results"]
        assert (decided["score"], decided["decided_by"]) == (1.0, "span")
        assert (undecided["score"], undecided["genacc"], undecided["decided_by"]) == (None, None, "undecided")
        assert undecided["reason"]
        mixed = await client.post("/judge/batch", json={"items": [*items, {**items[1], "mode": "llm"}]})
        assert mixed.status_code == 503
        assert (await client.get("/health/ready")).status_code == 503


async def test_llm_timeout_is_504_in_llm_mode() -> None:
    async with app_client(create_app(fake_settings(), llm_transport=httpx.MockTransport(read_timeout))) as client:
        response = await client.post("/judge", json={"prediction": "a", "golden_answers": ["b"], "mode": "llm"})
        assert response.status_code == 504
        genacc = await client.post("/judge", json={"prediction": "a", "golden_answers": ["b"]})
        assert genacc.status_code == 200 and genacc.json()["decided_by"] == "undecided"


async def test_ready_without_llm_when_not_required() -> None:
    async with app_client(create_app(down_settings(llm_required=False))) as client:
        assert (await client.get("/health/ready")).status_code == 200
        span = await client.post("/judge", json={"prediction": "Paris", "golden_answers": ["Paris"], "mode": "span"})
        assert span.json()["score"] == 1.0


async def test_clients_chunk_large_batches_and_keep_order() -> None:
    from plugsearch.common.clients import GeneratorClient, JudgeClient
    from plugsearch.common.http import ClientSettings
    from plugsearch.common.schemas.generator import GenerateRequest
    from plugsearch.common.schemas.judge import JudgeRequest
    from plugsearch.generator.api import create_app as create_generator
    from plugsearch.generator.settings import GeneratorSettings

    fake = create_fake_llm_app(lambda body: "no")
    judge_app = create_app(fake_settings(), llm_transport=httpx.ASGITransport(app=fake))
    items = [JudgeRequest(prediction=f"answer {i}", golden_answers=[f"answer {i}" if i % 2 else "other"],
                          mode="span") for i in range(7)]
    async with judge_app.router.lifespan_context(judge_app):
        client = JudgeClient(ClientSettings(url="http://judge"), transport=httpx.ASGITransport(app=judge_app))
        results = await client.judge_batch(items, chunk_size=3)
        assert [r.score for r in results] == [float(i % 2) for i in range(7)]
        assert await client.judge_batch([]) == []
        await client.aclose()
    echo = create_fake_llm_app()  # echoes the first line of the user message: the question
    gen_settings = GeneratorSettings(llm=LLMSettings(base_url="http://fake-llm/v1"), tokenizer_from_gguf=False)
    gen_app = create_generator(gen_settings, llm_transport=httpx.ASGITransport(app=echo))
    async with gen_app.router.lifespan_context(gen_app):
        client2 = GeneratorClient(ClientSettings(url="http://gen"), transport=httpx.ASGITransport(app=gen_app))
        answers = await client2.generate_batch([GenerateRequest(question=f"q{i}") for i in range(5)], chunk_size=2)
        assert [a.answer for a in answers] == [f"q{i}" for i in range(5)]
        await client2.aclose()


def test_openapi_contract() -> None:
    """The wire contract other services and the trainer rely on; a change here must be deliberate."""
    doc = create_app(fake_settings()).openapi()
    assert {p for p in doc["paths"] if not p.startswith(("/health", "/version"))} == {"/judge", "/judge/batch"}
    schemas = doc["components"]["schemas"]
    assert set(schemas["JudgeRequest"]["properties"]) == {"prediction", "golden_answers", "question", "mode"}
    assert schemas["JudgeRequest"]["properties"]["mode"]["enum"] == ["genacc", "span", "llm", "em", "f1"]
    assert set(schemas["JudgeResult"]["properties"]) == {"score", "genacc", "em", "f1", "decided_by", "reason",
                                                         "cached"}
    assert {"422", "502", "504"} <= set(doc["paths"]["/judge"]["post"]["responses"])
