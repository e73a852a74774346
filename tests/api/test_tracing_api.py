"""Tracing through the real apps in-process (spans kept in memory): one s3 search is one trace, from the
guard's server span through the search, its policy steps (each with its LLM call), its retrievals (each
with its call to the retriever) and the admission; a caller's traceparent is continued; the trainer's
generator and judge calls are one trace; with tracing off nothing is recorded or sent."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from fastapi import FastAPI, Request
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.trace import SpanKind

from plugsearch.common.llm import LLMSettings
from plugsearch.common.schemas.base import Document
from plugsearch.common.schemas.retriever import RetrieveRequest, RetrieveResponse
from tests.api import test_searcher_api as searcher_api_tests
from tests.api.test_searcher_api import Q, Stack
from tests.asgi import app_client
from tests.support.fake_llm import create_fake_llm_app, yes
from tests.support.tracing import by_name, captured_spans, parent_of, tracing_off

CALLER_TRACE = "0af7651916cd43dd8448eb211c80319c"
CALLER_SPAN = "b7ad6b7169203331"


def recording_retriever_app() -> FastAPI:
    """The fake retriever, keeping each request's headers."""
    app = FastAPI()
    app.state.headers = []

    @app.post("/retrieve")
    async def retrieve(body: RetrieveRequest, request: Request) -> RetrieveResponse:
        app.state.headers.append(dict(request.headers))
        results = [[Document(id=f"{q}#{i}", title=f"T{i}", text=f"passage {i} for {q}", score=1.0 / i)
                    for i in range(1, body.k + 1)] for q in body.queries]
        return RetrieveResponse(method="bm25", results=results, took_ms=0.1)

    return app


@pytest.fixture()
async def stack(monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[Stack]:
    monkeypatch.setattr(searcher_api_tests, "fake_retriever_app", recording_retriever_app)
    s = Stack()
    yield s
    await s.aclose()


def attrs(span: ReadableSpan) -> dict[str, Any]:
    return dict(span.attributes or {})


async def test_one_search_is_one_trace_with_its_steps(stack: Stack) -> None:
    with captured_spans() as exporter:
        async with app_client(stack.app) as client:
            response = await client.post("/search", json={"question": Q},
                                         headers={"traceparent": f"00-{CALLER_TRACE}-{CALLER_SPAN}-01"})
        assert response.status_code == 200, response.text
        spans = exporter.get_finished_spans()
    assert {format(s.context.trace_id, "032x") for s in spans} == {CALLER_TRACE}  # the caller's trace, continued
    (server,) = by_name(spans, "POST /search")
    assert server.kind is SpanKind.SERVER and server.parent is not None
    assert format(server.parent.span_id, "016x") == CALLER_SPAN
    assert attrs(server)["plugsearch.request_id"] == response.headers["x-request-id"]
    assert attrs(server)["http.response.status_code"] == 200 and attrs(server)["plugsearch.cached"] is False
    (admission,) = by_name(spans, "searcher.admission")
    (search,) = by_name(spans, "searcher.search")
    assert parent_of(admission, spans) is server and parent_of(search, spans) is server
    assert attrs(search) | {"plugsearch.mode": "s3", "plugsearch.stop_reason": "complete", "plugsearch.turns": 4,
                            "plugsearch.queries": 3, "plugsearch.policy": "fake-policy"} == attrs(search)
    steps = by_name(spans, "searcher.policy_step")
    retrievals = by_name(spans, "searcher.retrieve")
    assert len(steps) == 4 and len(retrievals) == 4
    assert [attrs(s)["plugsearch.step"] for s in sorted(steps, key=lambda s: s.start_time or 0)] == [1, 2, 3, 4]
    # the first retrieval belongs to the search itself, each later one to the step that asked for it
    first = min(retrievals, key=lambda s: s.start_time or 0)
    assert parent_of(first, spans) is search
    assert {parent_of(r, spans).name for r in retrievals if r is not first} == {"searcher.policy_step"}  # type: ignore[union-attr]
    for retrieval in retrievals:
        assert attrs(retrieval) | {"plugsearch.queries": 1, "plugsearch.k": 8, "plugsearch.documents": 8} == attrs(retrieval)
        (call,) = [s for s in spans if parent_of(s, spans) is retrieval]
        assert call.name == "POST /retrieve" and call.kind is SpanKind.CLIENT
        assert attrs(call)["peer.service"] == "retriever" and attrs(call)["http.response.status_code"] == 200
    chats = by_name(spans, "chat fake-policy")
    assert len(chats) == 4 and {parent_of(c, spans) for c in chats} == set(steps)
    for chat in chats:
        assert attrs(chat)["gen_ai.request.model"] == "fake-policy" and attrs(chat)["gen_ai.usage.input_tokens"] > 0
        (call,) = [s for s in spans if parent_of(s, spans) is chat]
        assert call.name == "POST /chat/completions"
    # what went to the retriever: its call's span as the parent, and the request id beside it
    calls = sorted(by_name(spans, "POST /retrieve"), key=lambda s: s.start_time or 0)
    for headers, call in zip(stack.retriever_app.state.headers, calls, strict=True):
        assert headers["traceparent"].split("-")[1:3] == [CALLER_TRACE, format(call.context.span_id, "016x")]
        assert headers["x-request-id"] == response.headers["x-request-id"]


async def test_a_refused_request_is_a_span_with_its_status(stack: Stack) -> None:
    with captured_spans() as exporter:
        async with app_client(stack.app) as client:
            response = await client.post("/search", json={"question": Q, "select_k": 9, "retrieve_k": 3})
        assert response.status_code == 422
        (server,) = exporter.get_finished_spans()
    assert server.name == "POST /search" and attrs(server)["http.response.status_code"] == 422
    assert server.parent is None  # no caller's trace: a trace of its own


async def test_tracing_off_records_and_sends_nothing(stack: Stack) -> None:
    with tracing_off():
        async with app_client(stack.app) as client:
            response = await client.post("/search", json={"question": Q},
                                         headers={"traceparent": f"00-{CALLER_TRACE}-{CALLER_SPAN}-01"})
    assert response.status_code == 200
    assert stack.retriever_app.state.headers and all("traceparent" not in h for h in stack.retriever_app.state.headers)
    assert all(h["x-request-id"] == response.headers["x-request-id"] for h in stack.retriever_app.state.headers)


async def test_the_trainers_generator_and_judge_calls_are_one_trace() -> None:
    from plugsearch.generator.api import create_app as generator_app
    from plugsearch.generator.settings import GeneratorSettings
    from plugsearch.judge.api import create_app as judge_app
    from plugsearch.judge.settings import JudgeSettings
    from plugsearch.trainer.common.settings import TrainerSettings
    from plugsearch.trainer.common.upstreams import ServiceStack

    llm = LLMSettings(base_url="http://fake-llm/v1", model="fake-gen", max_retries=0)
    generator = generator_app(GeneratorSettings(llm=llm, tokenizer_from_gguf=False),
                              llm_transport=httpx.ASGITransport(app=create_fake_llm_app(lambda body: "Jack London")))
    judge = judge_app(JudgeSettings(llm=llm), llm_transport=httpx.ASGITransport(app=create_fake_llm_app(yes)))
    docs = [Document(id="d1", title="The Call of the Wild", text="a novel by Jack London")]
    with captured_spans() as exporter:
        async with generator.router.lifespan_context(generator), judge.router.lifespan_context(judge):
            async with ServiceStack(TrainerSettings(), transports={"generator": httpx.ASGITransport(app=generator),
                                                                   "judge": httpx.ASGITransport(app=judge)}) as stack:
                (answered,) = await stack.answer_and_judge([("who wrote the call of the wild", docs, ["Jack London"])])
        assert answered.genacc == 1.0
        spans = exporter.get_finished_spans()
    (root,) = [s for s in spans if s.parent is None]
    assert root.name == "trainer.answer_and_judge" and len({s.context.trace_id for s in spans}) == 1
    (generate,) = by_name(spans, "trainer.generate")
    (judging,) = by_name(spans, "trainer.judge")
    assert parent_of(generate, spans) is root and parent_of(judging, spans) is root
    for step, path in ((generate, "/generate/batch"), (judging, "/judge/batch")):
        (call,) = [s for s in spans if parent_of(s, spans) is step]
        assert call.name == f"POST {path}" and call.kind is SpanKind.CLIENT
        (served,) = [s for s in spans if parent_of(s, spans) is call]  # the service's own span, in its trace
        assert served.kind is SpanKind.SERVER and served.name == f"POST {path}"
    assert by_name(spans, "chat fake-gen")  # the generator's LLM call, inside the same trace
