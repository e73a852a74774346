"""The searcher app in-process: real OpenAIChatClient against the fake LLM server (scripted s3/QAgent
policy), real RetrieverClient against a tiny fake retriever app, both over ASGI transports."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi import FastAPI

from plugsearch.common.cache import MemoryCache, ResultCache
from plugsearch.common.clients import RetrieverClient, SearcherClient
from plugsearch.common.http import ClientSettings
from plugsearch.common.llm import LLMSettings, OpenAIChatClient
from plugsearch.common.schemas.base import Document
from plugsearch.common.schemas.retriever import RetrieveRequest, RetrieveResponse
from plugsearch.common.schemas.searcher import SearchRequest
from plugsearch.searcher.api import create_app
from plugsearch.searcher.retrieval import ServiceRetriever
from plugsearch.searcher.settings import SearcherSettings
from tests.asgi import app_client
from tests.support import fake_policy
from tests.support.chat_policy import chat as chat_policy
from tests.support.fake_llm import create_fake_llm_app

Q = "Which city is the director of Big Stone Gap based in?"


def fake_retriever_app() -> FastAPI:
    app = FastAPI()
    app.state.requests = []

    @app.post("/retrieve")
    async def retrieve(body: RetrieveRequest) -> RetrieveResponse:
        app.state.requests.append(body)
        results = [[Document(id=f"{q}#{i}", title=f"T{i}", text=f"passage {i} for {q}", score=1.0 / i)
                    for i in range(1, body.k + 1)] for q in body.queries]
        methods = [m or "bm25" for m in body.methods] if body.methods is not None else None
        return RetrieveResponse(method=methods[0] if methods else body.method or "bm25", methods=methods,
                                results=results, took_ms=0.1)

    return app


class Stack:
    def __init__(self, *, llm_fail: int | None = None, retriever_down: bool = False,
                 **settings: Any) -> None:
        self.llm = create_fake_llm_app(fake_policy.respond, fail_status=llm_fail)
        self.retriever_app = fake_retriever_app()
        if retriever_down:
            def refuse(request: httpx.Request) -> httpx.Response:
                raise httpx.ConnectError("connection refused", request=request)
            transport: httpx.AsyncBaseTransport = httpx.MockTransport(refuse)
        else:
            transport = httpx.ASGITransport(app=self.retriever_app)
        self.retriever_client = RetrieverClient(ClientSettings(url="http://retriever", max_retries=0),
                                                transport=transport)
        self.policy = OpenAIChatClient(LLMSettings(base_url="http://llm/v1", model="fake-policy", max_retries=0),
                                       transport=httpx.ASGITransport(app=self.llm))
        self.cache = ResultCache(MemoryCache(), name="search")
        self.app = create_app(SearcherSettings(**settings), policy=chat_policy(self.policy),
                              retriever=ServiceRetriever(self.retriever_client), cache=self.cache)

    async def aclose(self) -> None:
        await self.policy.aclose()
        await self.retriever_client.aclose()


@pytest.fixture()
async def stack() -> AsyncIterator[Stack]:
    s = Stack()
    yield s
    await s.aclose()


async def test_s3_search_returns_selected_documents_context_and_timings(stack: Stack) -> None:
    async with app_client(stack.app) as client:
        response = await client.post("/search", json={"question": Q})
        assert response.status_code == 200, response.text
        body = response.json()
    assert body["mode"] == "s3" and body["stop_reason"] == "complete" and not body["degraded"]
    assert body["queries"] == [f"{Q} (aspect 1)", f"{Q} (aspect 2)", f"{Q} (aspect 3)"]
    assert body["turns"] == 4 and body["valid_actions"] == 4 and body["invalid_actions"] == 0
    # the scripted policy marks docs 1 and 2 of every block; it also marks the initial block
    ids = [d["id"] for d in body["documents"]]
    assert ids == [f"{Q}#1", f"{Q}#2"] + [f"{q}#{i}" for q in body["queries"] for i in (1, 2)]
    assert body["documents"][2]["turn"] == 1 and body["documents"][2]["query"] == body["queries"][0]
    assert body["context"].startswith(f"Doc 1(Title: T1) passage 1 for {Q}\n")
    timings = body["timings"]
    assert timings["policy_calls"] == 4 and timings["retrieval_calls"] == 4
    assert timings["total_ms"] >= timings["policy_ms"] + timings["retrieval_ms"]
    assert body["trace"] is None and body["policy_model"] == "fake-policy"
    assert [r.k for r in stack.retriever_app.state.requests] == [8, 8, 8, 8]
    assert stack.llm.state.calls == 4
    assert stack.llm.state.bodies[0]["stop"] == ["</query>"] and "grammar" not in stack.llm.state.bodies[0]


async def test_trace_per_request_overrides_and_constrained_flag(stack: Stack) -> None:
    async with app_client(stack.app) as client:
        response = await client.post("/search", json={
            "question": Q, "max_turns": 1, "retrieve_k": 4, "select_k": 2, "method": "dense",
            "constrained": True, "return_trace": True})
        body = response.json()
    assert response.status_code == 200
    assert len(body["queries"]) == 1 and body["stop_reason"] == "complete"
    trace = body["trace"]
    assert [m["role"] for m in trace["messages"]] == ["system", "user", "assistant", "user", "assistant"]
    assert [b["selected"] for b in trace["blocks"]] == [[1, 2], [1, 2]]
    assert all(r.k == 4 and r.method == "dense" for r in stack.retriever_app.state.requests)
    assert 'id ::= "1" | "2" | "3" | "4"' in stack.llm.state.bodies[0]["grammar"]


async def test_qagent_and_naive_modes(stack: Stack) -> None:
    async with app_client(stack.app) as client:
        qagent = (await client.post("/search", json={"question": Q, "mode": "qagent", "retrieve_k": 2})).json()
        naive = (await client.post("/search", json={"question": Q, "mode": "naive", "retrieve_k": 3})).json()
    assert qagent["stop_reason"] == "complete" and len(qagent["queries"]) == 4
    assert len(qagent["documents"]) == 8
    assert [d["id"] for d in naive["documents"]] == [f"{Q}#1", f"{Q}#2", f"{Q}#3"]
    assert naive["turns"] == 0 and naive["stop_reason"] == "naive"


@pytest.mark.parametrize("body, status, param", [
    ({"question": ""}, 422, "question"),
    ({"question": "   "}, 422, "question"),
    ({"question": Q, "mode": "magic"}, 422, "mode"),
    ({"question": Q, "max_turns": 11}, 422, "max_turns"),
    ({"question": Q, "retrieve_k": 0}, 422, "retrieve_k"),
    ({"question": Q, "retrieve_k": 2, "select_k": 3}, 422, None),
    ({"question": Q, "select_k": 9}, 400, "select_k"),  # over the service's default retrieve_k
    ({"question": Q, "unknown": 1}, 422, "unknown"),
    ({"question": "x" * 5000}, 422, "question"),
])
async def test_bad_input_is_refused_before_any_work(stack: Stack, body: dict[str, Any], status: int,
                                                    param: str | None) -> None:
    async with app_client(stack.app) as client:
        response = await client.post("/search", json=body)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["request_id"] == response.headers["x-request-id"]
    if param is not None:
        assert error["param"] == param
    assert stack.llm.state.calls == 0 and stack.retriever_app.state.requests == []


async def test_policy_failure_degrades_to_naive_top_k_not_an_error() -> None:
    stack = Stack(llm_fail=500)
    try:
        async with app_client(stack.app) as client:
            response = await client.post("/search", json={"question": Q})
            metrics = (await client.get("/metrics")).text
    finally:
        await stack.aclose()
    assert response.status_code == 200
    body = response.json()
    assert body["degraded"] and body["stop_reason"] == "policy_error" and "policy" in body["degraded_reason"]
    # naive top-k at the search's document budget (select_k 3 of the 8 retrieved), as for every policy
    assert [d["id"] for d in body["documents"]] == [f"{Q}#{i}" for i in range(1, 4)]
    assert 'searcher_degraded_total{mode="s3",reason="policy_error"} 1.0' in metrics


async def test_retriever_down_is_503_with_retry_after() -> None:
    stack = Stack(retriever_down=True)
    try:
        async with app_client(stack.app) as client:
            response = await client.post("/search", json={"question": Q})
    finally:
        await stack.aclose()
    assert response.status_code == 503
    assert response.json()["error"]["type"] == "upstream_unavailable"
    assert int(response.headers["retry-after"]) >= 1
    assert stack.llm.state.calls == 0


async def test_second_identical_search_is_served_from_cache(stack: Stack) -> None:
    async with app_client(stack.app) as client:
        first = (await client.post("/search", json={"question": Q})).json()
        calls = stack.llm.state.calls
        second = (await client.post("/search", json={"question": Q, "return_trace": True})).json()
        other = (await client.post("/search", json={"question": Q, "max_turns": 2})).json()
    assert not first["cached"] and second["cached"] and not other["cached"]
    assert second["documents"] == first["documents"] and second["trace"]["messages"]
    assert stack.llm.state.calls > calls  # only the search with other parameters reached the policy
    assert stack.llm.state.calls == calls + 3


async def test_batch_runs_every_item_in_order(stack: Stack) -> None:
    items = [{"question": f"{Q} {i}", "mode": mode} for i, mode in enumerate(["s3", "naive", "qagent"])]
    async with app_client(stack.app) as client:
        response = await client.post("/search/batch", json={"items": items})
        too_many = await client.post("/search/batch", json={"items": [{"question": Q}] * 65})
    assert response.status_code == 200
    results = response.json()["results"]
    assert [r["question"] for r in results] == [i["question"] for i in items]
    assert [r["mode"] for r in results] == ["s3", "naive", "qagent"]
    assert too_many.status_code == 422


async def test_typed_client_round_trip_and_ops_endpoints(stack: Stack) -> None:
    async with stack.app.router.lifespan_context(stack.app):
        client = SearcherClient(ClientSettings(url="http://searcher"), transport=httpx.ASGITransport(app=stack.app))
        try:
            result = await client.search(SearchRequest(question=Q, mode="naive", retrieve_k=2))
            batch = await client.search_batch([SearchRequest(question=Q, mode="naive", retrieve_k=1)] * 2)
            assert [d.id for d in result.documents] == [f"{Q}#1", f"{Q}#2"]
            assert len(batch) == 2
            assert await client.ready() == "ok"
            version = (await client.request("GET", "/version")).json()
            assert version["details"]["prompt_version"] == result.prompt_version
        finally:
            await client.aclose()


def test_settings_from_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SEARCHER_RETRIEVER__URL", "http://retriever:8001")
    monkeypatch.setenv("SEARCHER_POLICY__BASE_URL", "http://vllm:8000/v1")
    monkeypatch.setenv("SEARCHER_CONSTRAINED", "true")
    monkeypatch.setenv("SEARCHER_MAX_TURNS", "2")
    settings = SearcherSettings()
    assert settings.port == 8000 and settings.retrieve_k == 8 and settings.select_k == 3
    assert settings.retriever.url == "http://retriever:8001"
    assert settings.policy.base_url == "http://vllm:8000/v1"
    assert settings.constrained and settings.max_turns == 2
    monkeypatch.setenv("SEARCHER_SELECT_K", "9")
    with pytest.raises(ValueError):
        SearcherSettings()


def test_openapi_contract() -> None:
    """The wire contract users, the trainer and the stack rely on; a change here must be deliberate."""
    doc = create_app(SearcherSettings()).openapi()
    assert {p for p in doc["paths"] if not p.startswith(("/health", "/version"))} == {
        "/search", "/search/batch", "/feedback"}
    assert set(doc["paths"]["/feedback"]) == {"get", "post"}
    schemas = doc["components"]["schemas"]
    assert set(schemas["SearchRequest"]["properties"]) == {
        "question", "mode", "max_turns", "retrieve_k", "select_k", "method", "constrained", "return_trace",
        "stream"}
    assert set(schemas["SearchResponse"]["properties"]) == {
        "search_id", "question", "mode", "documents", "context", "queries", "turns", "stop_reason", "degraded",
        "degraded_reason", "timings", "valid_actions", "invalid_actions", "cached", "policy_model",
        "prompt_version", "fallback", "trace"}
    assert set(schemas["SearchedDocument"]["properties"]) == {"id", "title", "text", "score", "turn", "query"}
    assert {"422", "503"} <= set(doc["paths"]["/search"]["post"]["responses"])
    # `stream: true`: server-sent events, each payload a documented model
    content = doc["paths"]["/search"]["post"]["responses"]["200"]["content"]
    assert set(content) == {"application/json", "text/event-stream"}
    events = content["text/event-stream"]["schema"]["oneOf"]
    assert [(e["properties"]["event"]["const"], e["properties"]["data"]["contentSchema"]["$ref"].rsplit("/", 1)[1])
            for e in events] == [("retrieval", "RetrievalEvent"), ("action", "ActionEvent"), ("end", "EndEvent"),
                                 ("result", "SearchResponse"), ("error", "ErrorEnvelope")]
    assert set(schemas["RetrievalEvent"]["properties"]) == {"block", "method", "turn", "queries", "documents", "step",
                                                           "elapsed_ms"}
    assert set(schemas["ActionEvent"]["properties"]) == {"step", "kind", "queries", "block", "selected",
                                                        "selected_ids", "elapsed_ms"}
    assert set(schemas["EndEvent"]["properties"]) == {"step", "stop_reason", "degraded", "elapsed_ms"}
    # marks from use (docs/training.md): what a mark says, what a page of marks holds
    assert set(schemas["FeedbackRequest"]["properties"]) == {"search_id", "helpful", "not_helpful", "answer",
                                                             "comment"}
    assert schemas["FeedbackRequest"]["required"] == ["search_id"]
    assert set(schemas["FeedbackResponse"]["properties"]) == {"search_id", "helpful", "not_helpful", "replaced",
                                                              "marked_at"}
    assert set(schemas["FeedbackPage"]["properties"]) == {"marks", "next_after"}
    assert set(schemas["FeedbackRecord"]["properties"]) == {
        "seq", "search_id", "owner", "question", "mode", "policy_model", "documents", "helpful", "not_helpful",
        "answer", "comment", "searched_at", "marked_at"}
    assert {"403", "404", "409", "422", "429", "503"} <= set(doc["paths"]["/feedback"]["post"]["responses"])
    assert [p["name"] for p in doc["paths"]["/feedback"]["get"]["parameters"]] == ["after", "limit", "since"]
    # the playground page is not part of the API
    assert create_app(SearcherSettings(ui=True)).openapi()["paths"].keys() == doc["paths"].keys()


class ManifestStack(Stack):
    """The fake LLM served as a trained LLM searcher: its manifest's setting, as the stack passes it."""

    def __init__(self, manifest: Path, **settings: Any) -> None:
        super().__init__(**settings)
        from plugsearch.searcher.policy import ChatPolicy

        served = SearcherSettings(policy_manifest=manifest, **settings)
        self.app = create_app(served, policy=ChatPolicy(self.policy, manifest=served.chat_manifest()),
                              retriever=ServiceRetriever(self.retriever_client), cache=self.cache)


async def test_a_trained_llm_searcher_carries_its_setting_in_its_manifest(tmp_path: Path) -> None:
    """Like a compact policy: the manifest's `search` is the default of its s3 searches (not environment
    variables set by the stack), /version shows it, and qagent keeps the service's own defaults."""
    manifest = tmp_path / "manifest.json"
    manifest.write_text(json.dumps({"model_alias": "s", "search": {"mode": "s3", "max_turns": 1, "retrieve_k": 5,
                                                                    "select_k": 2, "method": None}}))
    stack = ManifestStack(manifest)
    try:
        async with app_client(stack.app) as client:
            version = (await client.get("/version")).json()
            body = (await client.post("/search", json={"question": Q})).json()
            await client.post("/search", json={"question": Q, "mode": "qagent"})
    finally:
        await stack.aclose()
    assert version["details"]["policy_setting"]["retrieve_k"] == 5
    assert version["details"]["policy_setting"]["max_turns"] == 1
    assert len(body["queries"]) == 1 and [r.k for r in stack.retriever_app.state.requests][:2] == [5, 5]
    assert stack.retriever_app.state.requests[-1].k == 8  # qagent: the service's retrieve_k
    manifest.write_text(json.dumps({"search": {"retrieve_k": 5}}))
    with pytest.raises(ValueError, match="policy_manifest .*lacks select_k, max_turns"):
        SearcherSettings(policy_manifest=manifest)
    with pytest.raises(ValueError, match="policy_manifest"):
        SearcherSettings(policy_manifest=tmp_path / "missing.json")
