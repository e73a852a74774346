"""The searcher app served by the compact policy (`SEARCHER_COMPACT_POLICY`): the same `POST /search` response,
server-sent events, trace and `/version`, with `policy_model` naming the compact policy; a bad folder is
refused at start-up."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from pydantic import ValidationError

from services.common.cache import MemoryCache, ResultCache
from services.common.clients import RetrieverClient
from services.common.http import ClientSettings
from services.searcher.api import create_app
from services.searcher.compact import CompactPolicy
from services.searcher.retrieval import ServiceRetriever
from services.searcher.settings import SearcherSettings
from tests.api.test_searcher_api import Q, fake_retriever_app
from tests.api.test_searcher_stream import events_of
from tests.asgi import app_client
from tests.unit.test_searcher_compact import weights


@pytest.fixture()
def policy_dir(tmp_path: Path) -> Path:
    # prefers the documents whose title the question contains, then BM25's order; never searches again
    policy = CompactPolicy(weights(doc={"title_in_q": 4.0, "score_rel": 1.0}, query={"stop": 5.0}), name="compact-t")
    policy.save(tmp_path / "compact", {"search": {"retrieve_k": 5, "select_k": 2, "max_turns": 1}})
    return tmp_path / "compact"


def app_for(policy_dir: Path) -> tuple[object, RetrieverClient]:
    retriever = fake_retriever_app()
    client = RetrieverClient(ClientSettings(url="http://retriever", max_retries=0),
                             transport=httpx.ASGITransport(app=retriever))
    settings = SearcherSettings(compact_policy=policy_dir, retrieve_k=5, select_k=2, max_turns=1)
    app = create_app(settings, retriever=ServiceRetriever(client), cache=ResultCache(MemoryCache(), name="search"))
    return app, client


async def test_search_and_stream_with_the_compact_policy(policy_dir: Path) -> None:
    app, retriever = app_for(policy_dir)
    digest = CompactPolicy.load(policy_dir).digest
    try:
        async with app_client(app) as client:  # type: ignore[arg-type]
            body = (await client.post("/search", json={"question": Q, "return_trace": True})).json()
            streamed = await events_of(await client.post("/search", json={"question": Q + " ?", "stream": True}))
            version = (await client.get("/version")).json()
    finally:
        await retriever.aclose()
    assert body["policy_model"] == f"compact-t@{digest[:12]}" == version["details"]["policy_model"]
    assert body["mode"] == "s3" and body["stop_reason"] == "complete" and not body["degraded"]
    assert [d["id"] for d in body["documents"]] == [f"{Q}#1", f"{Q}#2"]  # select_k of the pool, BM25's order
    assert body["queries"] == [] and body["timings"]["policy_calls"] == 1
    assert body["trace"]["blocks"][0]["selected"] == [1, 2]
    names = [name for name, _ in streamed]
    assert names == ["retrieval", "action", "action", "end", "result"]
    select = streamed[1][1]
    assert select["kind"] == "select" and select["block"] == 0 and len(select["selected_ids"]) == 2
    assert streamed[-1][1]["policy_model"] == body["policy_model"]


def test_a_bad_compact_policy_folder_is_refused_at_start_up(tmp_path: Path) -> None:
    with pytest.raises(ValidationError, match="not a compact policy folder"):
        SearcherSettings(compact_policy=tmp_path)


def test_the_packaged_policy_is_shipped_and_named_by_packaged() -> None:
    from services.searcher.trained import COMPACT_DIR

    settings = SearcherSettings(compact_policy="packaged", retrieve_k=30)
    assert settings.compact_policy == COMPACT_DIR
    shipped = CompactPolicy.load(COMPACT_DIR)  # its weights match the manifest's digest
    assert (COMPACT_DIR / "weights.npz").stat().st_size < 20 * 1024 * 1024
    evaluation = shipped.manifest["evaluation"]
    assert evaluation["beats_naive"] is True and set(evaluation["gains_at_3"]) == {
        "hotpotqa", "2wikimultihopqa", "nq", "popqa"}
    assert shipped.manifest["config"]["offset"] >= 200  # trained on rows 200 and later only


async def test_qagent_is_refused_and_a_compact_search_costs_one_unit_per_retrieval(policy_dir: Path) -> None:
    app, retriever = app_for(policy_dir)
    try:
        async with app_client(app) as client:  # type: ignore[arg-type]
            refused = await client.post("/search", json={"question": Q, "mode": "qagent"})
            service = app.state.service  # type: ignore[attr-defined]
    finally:
        await retriever.aclose()
    assert refused.status_code == 400, refused.text
    assert refused.json()["error"]["param"] == "mode" and "qagent" in refused.json()["error"]["message"]
    from services.common.schemas.searcher import SearchRequest

    assert service.cost([SearchRequest(question=Q)]) == 2.0  # the first retrieval + max_turns 1
    assert service.cost([SearchRequest(question=Q, mode="naive")]) == 1.0


# ------------------------------------------------------------------- the dense block of the first retrieval
@pytest.fixture()
def dense_policy_dir(tmp_path: Path) -> Path:
    policy = CompactPolicy(weights(doc={"score_rel": 1.0}, query={"stop": 5.0}, dense={"cosine": 1.0}),
                           name="compact-d")
    policy.save(tmp_path / "dense", {"search": {"retrieve_k": 5, "select_k": 2, "max_turns": 1},
                                     "dense": {"encoder": "all-MiniLM-L6-v2"}})
    return tmp_path / "dense"


async def test_compact_dense_on_adds_a_dense_block_to_the_trace_the_stream_and_the_cost(
        dense_policy_dir: Path) -> None:
    retriever = fake_retriever_app()
    client = RetrieverClient(ClientSettings(url="http://retriever", max_retries=0),
                             transport=httpx.ASGITransport(app=retriever))
    settings = SearcherSettings(compact_policy=dense_policy_dir, retrieve_k=5, select_k=2, max_turns=1,
                                compact_dense="on")
    app = create_app(settings, retriever=ServiceRetriever(client), cache=ResultCache(MemoryCache(), name="search"))
    try:
        async with app_client(app) as http:
            body = (await http.post("/search", json={"question": Q, "return_trace": True})).json()
            streamed = await events_of(await http.post("/search", json={"question": Q + " ?", "stream": True}))
            service = app.state.service
    finally:
        await client.aclose()
    assert [(b["turn"], b["method"]) for b in body["trace"]["blocks"]] == [(0, "bm25"), (0, "dense")]
    assert body["queries"] == [] and body["timings"]["retrieval_calls"] == 2
    assert [e["method"] for name, e in streamed if name == "retrieval"] == ["bm25", "dense"]
    requests = retriever.state.requests
    assert [r.methods for r in requests] == [["bm25", "dense"]] * 2  # each search's pool: one request
    from services.common.schemas.searcher import SearchRequest

    assert service.cost([SearchRequest(question=Q)]) == 3.0  # BM25 + dense + max_turns 1


async def test_compact_dense_auto_follows_what_the_retriever_serves(dense_policy_dir: Path) -> None:
    from fastapi.responses import JSONResponse

    from services.common.schemas.searcher import SearchRequest
    from services.searcher.index_identity import IndexIdentity
    from services.searcher.serving import SearchService

    retriever = fake_retriever_app()
    retriever.state.details = {"index_id": "i1", "methods": ["bm25", "dense", "hybrid"], "encoder": "all-MiniLM-L6-v2"}

    @retriever.get("/version")
    async def version() -> JSONResponse:
        return JSONResponse({"service": "retriever", "version": "0", "details": retriever.state.details})

    client = RetrieverClient(ClientSettings(url="http://retriever", max_retries=0),
                             transport=httpx.ASGITransport(app=retriever))
    settings = SearcherSettings(compact_policy=dense_policy_dir, retrieve_k=5, select_k=2, max_turns=1)
    service = SearchService(settings, policy=CompactPolicy.load(dense_policy_dir), retriever=ServiceRetriever(client),
                            index_identity=IndexIdentity(client, ttl_s=0))

    async def methods(question: str) -> list[str | None]:
        response = await service.search(SearchRequest(question=question, return_trace=True))
        assert response.trace is not None
        return [b.method for b in response.trace.blocks]

    try:
        assert await methods(Q) == ["bm25", "dense"]
        retriever.state.details = {**retriever.state.details, "encoder": "intfloat/e5-base-v2"}  # other cosines
        assert await methods(Q + " 2") == ["bm25"]
        retriever.state.details = {"index_id": "i2", "methods": ["bm25"], "encoder": None}  # no dense index
        assert await methods(Q + " 3") == ["bm25"]
    finally:
        await client.aclose()
