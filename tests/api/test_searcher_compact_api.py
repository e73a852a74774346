"""The searcher app served by the compact policy (`SEARCHER_COMPACT_POLICY`): the same `POST /search` response,
server-sent events, trace and `/version`, with `policy_model` naming the compact policy; the setting its
manifest records applied by the service (s3 only: naive keeps the service's defaults), the trained follow-up
method kept, a failing or hanging policy degrading to naive documents, a bad folder or manifest refused at
start-up."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import numpy as np
import pytest
from fastapi import FastAPI
from pydantic import ValidationError

from plugsearch.common.cache import MemoryCache, ResultCache
from plugsearch.common.clients import RetrieverClient
from plugsearch.common.http import ClientSettings
from plugsearch.common.schemas.searcher import SearchParams, search_cost
from plugsearch.searcher.api import create_app
from plugsearch.searcher.compact import CompactPolicy
from plugsearch.searcher.env import Action, SearchEnv
from plugsearch.searcher.retrieval import ServiceRetriever
from plugsearch.searcher.settings import SearcherSettings
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
    from plugsearch.searcher.trained import COMPACT_DIR

    settings = SearcherSettings(compact_policy="packaged", retrieve_k=30)
    assert settings.compact_policy == COMPACT_DIR
    shipped = CompactPolicy.load(COMPACT_DIR)  # its weights match the manifest's digest
    assert (COMPACT_DIR / "weights.npz").stat().st_size < 20 * 1024 * 1024
    evaluation = shipped.manifest["evaluation"]
    assert evaluation["beats_naive"] is True and set(evaluation["gains_at_3"]) == {
        "hotpotqa", "2wikimultihopqa", "nq", "popqa"}
    assert shipped.manifest["config"]["offset"] >= 200  # trained on rows 200 and later only


async def test_qagent_is_refused_and_a_compact_search_costs_its_retrievals(policy_dir: Path) -> None:
    app, retriever = app_for(policy_dir)
    try:
        async with app_client(app) as client:  # type: ignore[arg-type]
            refused = await client.post("/search", json={"question": Q, "mode": "qagent"})
            service = app.state.service  # type: ignore[attr-defined]
    finally:
        await retriever.aclose()
    assert refused.status_code == 400, refused.text
    assert refused.json()["error"]["param"] == "mode" and "qagent" in refused.json()["error"]["message"]
    from plugsearch.common.schemas.searcher import Retrieval, SearchRequest, retrieval_cost

    first = retrieval_cost(Retrieval(None, len(Q), 5))  # BM25 (the default method), k 5: 0.85
    follow_up = retrieval_cost(Retrieval(None, len(Q) + 64, 5))
    assert (await service.prepare(SearchRequest(question=Q))).cost == first + follow_up == 1.7  # max_turns 1, no LLM call
    assert (await service.prepare(SearchRequest(question=Q, mode="naive"))).cost == first


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
    from plugsearch.common.schemas.searcher import Retrieval, SearchRequest, retrieval_cost

    dense = retrieval_cost(Retrieval("dense", len(Q), 5))  # it encodes the question: dearer than BM25's
    assert dense > retrieval_cost(Retrieval("bm25", len(Q), 5))
    assert (await service.prepare(SearchRequest(question=Q))).cost == (  # BM25 + dense + max_turns 1
        retrieval_cost(Retrieval("bm25", len(Q), 5)) + dense + retrieval_cost(Retrieval(None, len(Q) + 64, 5)))


async def test_compact_dense_auto_follows_what_the_retriever_serves(dense_policy_dir: Path) -> None:
    from fastapi.responses import JSONResponse

    from plugsearch.common.schemas.searcher import SearchRequest
    from plugsearch.searcher.index_identity import IndexIdentity
    from plugsearch.searcher.serving import SearchService

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
        response = await service.search(await service.prepare(SearchRequest(question=question, return_trace=True)))
        assert response.trace is not None
        return [b.method for b in response.trace.blocks]

    async def charged(question: str) -> float:
        return (await service.prepare(SearchRequest(question=question))).cost

    try:
        assert await methods(Q) == ["bm25", "dense"]
        # its one price (the guard's, the bound's and the budget's): the trained pool (bm25 + dense, k 5) and
        # one bm25 follow-up, no LLM call
        price = search_cost(SearchParams(retrieve_k=5, select_k=2, max_turns=1, method="bm25",
                                         pool_methods=["bm25", "dense"]), len(Q), llm_policy=False)
        assert await charged(Q) == pytest.approx(price)
        retriever.state.details = {**retriever.state.details, "encoder": "intfloat/e5-base-v2"}  # other cosines
        assert await methods(Q + " 2") == ["bm25"]
        retriever.state.details = {"index_id": "i2", "methods": ["bm25"], "encoder": None}  # no dense index
        assert await methods(Q + " 3") == ["bm25"]
        # the same price whatever the retriever serves now: the pool it was trained on is what is priced
        assert await charged(Q + " 4") == pytest.approx(
            search_cost(SearchParams(retrieve_k=5, select_k=2, max_turns=1, method="bm25",
                                     pool_methods=["bm25", "dense"]), len(Q + " 4"), llm_policy=False))
    finally:
        await client.aclose()


# ------------------------------------------------------------------ the policy carries its setting (issue 38)
def sent(requests: list) -> list[tuple[int, str | None]]:
    """(k, method) of every query the fake retriever was asked, however the searcher merged them into requests
    (a request's `methods`, one per query, or its one `method`)."""
    return [(r.k, m) for r in requests for m in (r.methods or [r.method] * len(r.queries))]


def searcher(settings: SearcherSettings, policy: CompactPolicy | None = None) -> tuple[object, FastAPI,
                                                                                       RetrieverClient]:
    """The searcher app on a fake retriever (no `/version`: the pool is `method` alone, bm25), its policy the
    one `settings` names unless `policy` is given."""
    retriever = fake_retriever_app()
    client = RetrieverClient(ClientSettings(url="http://retriever", max_retries=0),
                             transport=httpx.ASGITransport(app=retriever))
    app = create_app(settings, policy=policy, retriever=ServiceRetriever(client),
                     cache=ResultCache(MemoryCache(), name="search"))
    return app, retriever, client


@pytest.fixture()
def searching_dir(tmp_path: Path) -> Path:
    """A policy that always searches again (a question + title candidate) while it may, trained in a setting
    unlike the service's defaults: pool 5, 2 documents, 2 follow-up searches, bm25 follow-ups."""
    policy = CompactPolicy(weights(doc={"score_rel": 1.0}, query={"title_query": 5.0}), name="compact-s")
    policy.save(tmp_path / "searching", {"search": {"mode": "s3", "retrieve_k": 5, "select_k": 2, "max_turns": 2,
                                                    "method": "bm25", "pool_methods": ["bm25"]}})
    return tmp_path / "searching"


async def test_the_service_applies_the_setting_of_the_policys_manifest(searching_dir: Path) -> None:
    # nothing but the policy folder: the service's own defaults are the LLM loop's (8 retrieved, 3 turns)
    settings = SearcherSettings(compact_policy=searching_dir)
    assert (settings.retrieve_k, settings.max_turns, settings.policy_kind) == (8, 3, "compact")
    app, retriever, client = searcher(settings)
    try:
        async with app_client(app) as http:  # type: ignore[arg-type]
            body = (await http.post("/search", json={"question": Q, "return_trace": True})).json()
            version = (await http.get("/version")).json()["details"]
    finally:
        await client.aclose()
    # the pool of 5, two follow-up searches, 2 documents: the manifest's setting, not the service's defaults
    assert [len(b["document_ids"]) for b in body["trace"]["blocks"]] == [5, 5, 5], body["trace"]
    assert len(body["queries"]) == 2 and len(body["documents"]) == 2 and body["stop_reason"] == "complete"
    assert sent(retriever.state.requests) == [(5, "bm25")] * 3
    assert version["defaults"]["s3"] == {"retrieve_k": 5, "select_k": 2, "max_turns": 2, "method": "bm25",
                                         "constrained": False}
    assert version["policy_setting"]["pool_methods"] == ["bm25"]


async def test_a_bare_searcher_serves_the_packaged_policy_in_its_setting_and_naive_keeps_its_defaults() -> None:
    from plugsearch.searcher.trained import COMPACT_DIR

    shipped = CompactPolicy.load(COMPACT_DIR)
    app, retriever, client = searcher(SearcherSettings())  # as `python -m plugsearch.searcher` with its URLs only
    try:
        async with app_client(app) as http:  # type: ignore[arg-type]
            version = (await http.get("/version")).json()["details"]
            compact = (await http.post("/search", json={"question": Q, "return_trace": True})).json()
            naive = (await http.post("/search", json={"question": Q, "mode": "naive"})).json()
    finally:
        await client.aclose()
    assert version["policy_model"] == shipped.model == compact["policy_model"]
    assert version["defaults"]["s3"] == {"retrieve_k": 30, "select_k": 3, "max_turns": 2, "method": "bm25",
                                         "constrained": False}
    assert version["defaults"]["naive"]["retrieve_k"] == 8 and version["defaults"]["naive"]["method"] is None
    assert "qagent" not in version["defaults"]  # the compact policy does not search in QAgent's mode
    assert len(compact["trace"]["blocks"][0]["document_ids"]) == 30 and len(compact["documents"]) == 3
    # a default naive search is the service's: 8 documents at the retriever's default method, not the pool of 30
    assert len(naive["documents"]) == 8 and naive["mode"] == "naive"
    assert (retriever.state.requests[-1].k, retriever.state.requests[-1].method) == (8, None)
    assert all(r.method == "bm25" for r in retriever.state.requests[:-1])  # the compact search's retrievals


async def test_settings_set_explicitly_win_over_the_trained_setting(searching_dir: Path) -> None:
    app, retriever, client = searcher(SearcherSettings(compact_policy=searching_dir, max_turns=1))
    try:
        async with app_client(app) as http:  # type: ignore[arg-type]
            body = (await http.post("/search", json={"question": Q})).json()
            version = (await http.get("/version")).json()["details"]
    finally:
        await client.aclose()
    assert len(body["queries"]) == 1 and version["defaults"]["s3"]["max_turns"] == 1
    assert version["defaults"]["s3"]["retrieve_k"] == 5  # the ones not set explicitly stay the policy's


async def test_follow_up_searches_use_the_trained_method_and_other_methods_are_refused(searching_dir: Path) -> None:
    app, retriever, client = searcher(SearcherSettings(compact_policy=searching_dir))
    try:
        async with app_client(app) as http:  # type: ignore[arg-type]
            refused = {m: await http.post("/search", json={"question": Q, "method": m}) for m in ("dense", "hybrid")}
            batch = await http.post("/search/batch", json={"items": [{"question": Q, "method": "hybrid"}]})
            assert not retriever.state.requests  # refused before any work
            same = await http.post("/search", json={"question": Q, "method": "bm25"})
            naive_dense = await http.post("/search", json={"question": Q, "mode": "naive", "method": "dense"})
    finally:
        await client.aclose()
    for method, response in refused.items():
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["param"] == "method" and f"'{method}'" in error["message"] and "bm25" in error["message"]
    assert batch.status_code == 400 and batch.json()["error"]["param"] == "method"
    assert same.status_code == 200 and len(same.json()["queries"]) == 2
    assert [m for _, m in sent(retriever.state.requests[:-1])] == ["bm25", "bm25", "bm25"]  # pool + 2 follow-ups
    # naive top-k is not the policy's: any method the retriever serves
    assert naive_dense.status_code == 200 and retriever.state.requests[-1].method == "dense"


async def test_the_follow_up_method_does_not_follow_the_retrievers_default(searching_dir: Path) -> None:
    """With RETRIEVER_DEFAULT_METHOD=hybrid, a search that left `method` to the retriever would read RRF scores
    as BM25 evidence: the compact policy's retrievals name bm25 (the dense block, dense) every time."""
    from fastapi.responses import JSONResponse

    retriever = fake_retriever_app()

    @retriever.get("/version")
    async def version() -> JSONResponse:
        return JSONResponse({"service": "retriever", "version": "0", "details": {
            "index_id": "i1", "methods": ["bm25", "dense", "hybrid"], "default_method": "hybrid",
            "encoder": "all-MiniLM-L6-v2"}})

    client = RetrieverClient(ClientSettings(url="http://retriever", max_retries=0),
                             transport=httpx.ASGITransport(app=retriever))
    settings = SearcherSettings(compact_policy=searching_dir)
    from plugsearch.common.schemas.searcher import SearchRequest
    from plugsearch.searcher.index_identity import IndexIdentity
    from plugsearch.searcher.serving import SearchService

    service = SearchService(settings, policy=CompactPolicy.load(searching_dir), retriever=ServiceRetriever(client),
                            index_identity=IndexIdentity(client, ttl_s=0))
    try:
        response = await service.search(await service.prepare(SearchRequest(question=Q)))
    finally:
        await client.aclose()
    assert len(response.queries) == 2
    assert [m for _, m in sent(retriever.state.requests)] == ["bm25", "bm25", "bm25"]


# ------------------------------------------------------------------------------------ degrade, never fail
class FailingPolicy(CompactPolicy):
    async def act(self, env: SearchEnv) -> Action:
        raise RuntimeError("a bug in the policy")


class HangingPolicy(CompactPolicy):
    async def act(self, env: SearchEnv) -> Action:
        await asyncio.sleep(3600)
        raise AssertionError("unreachable")


class FailingLaterPolicy(CompactPolicy):
    """Searches once, then fails: the follow-up block is there, the answer is still the first retrieval's."""

    async def act(self, env: SearchEnv) -> Action:
        if len(env.blocks) > 1:
            raise ValueError("features of a block it cannot read")
        return await super().act(env)


@pytest.mark.parametrize(("kind", "stop_reason"), [(FailingPolicy, "policy_error"), (HangingPolicy, "deadline"),
                                                   (FailingLaterPolicy, "policy_error")])
async def test_a_failing_or_hanging_policy_answers_200_degraded_with_naive_documents(
        searching_dir: Path, kind: type[CompactPolicy], stop_reason: str) -> None:
    settings = SearcherSettings(compact_policy=searching_dir, search_timeout_s=0.5)
    app, retriever, client = searcher(settings, policy=kind.load(searching_dir))
    try:
        async with app_client(app) as http:  # type: ignore[arg-type]
            response = await http.post("/search", json={"question": Q, "return_trace": True})
            streamed = await events_of(await http.post("/search", json={"question": Q + " ?", "stream": True}))
            again = await http.post("/search", json={"question": Q})
            metrics = (await http.get("/metrics")).text
    finally:
        await client.aclose()
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["degraded"] is True and body["stop_reason"] == stop_reason and body["degraded_reason"]
    assert "a bug" not in body["degraded_reason"]  # the exception's text stays in the log
    # naive top-k of the first retrieval at the policy's document budget (2), nothing of a later block
    assert [d["id"] for d in body["documents"]] == [f"{Q}#1", f"{Q}#2"]
    assert body["policy_model"].startswith("compact-s@")
    assert streamed[-1][0] == "result" and streamed[-1][1]["degraded"] is True
    assert [d["id"] for d in streamed[-1][1]["documents"]] == [f"{Q} ?#1", f"{Q} ?#2"]
    # a degraded answer is not cached: the next one runs (and degrades) again
    assert again.status_code == 200 and again.json()["cached"] is False and again.json()["degraded"] is True
    assert f'searcher_degraded_total{{mode="s3",reason="{stop_reason}"}} 3.0' in metrics


# ------------------------------------------------------------------------------------- a bad manifest
def bad_policy(tmp_path: Path, problem: str) -> Path:
    folder = tmp_path / problem
    search: dict[str, object] = {"mode": "s3", "retrieve_k": 5, "select_k": 2, "max_turns": 1, "method": "bm25",
                                 "pool_methods": ["bm25"]}
    w = weights(doc={"score_rel": 1.0}, query={"stop": 5.0})
    manifest: dict[str, object] = {"search": search}
    if problem == "no_setting":
        manifest = {}
    elif problem == "no_select_k":
        del search["select_k"]
    elif problem == "unknown_method":
        search["method"] = "rrf"
    elif problem == "dense_follow_ups":
        search["method"] = "dense"
    elif problem == "dense_pool_without_scorer":
        search["pool_methods"] = ["bm25", "dense"]
    elif problem == "shapes":
        w["qv"] = np.zeros(3, np.float32)
    CompactPolicy(w, name="bad").save(folder, manifest)
    if problem == "digest":
        data = json.loads((folder / "manifest.json").read_text())
        (folder / "manifest.json").write_text(json.dumps({**data, "weights_sha256": "0" * 64}))
    return folder


BAD_MANIFESTS = {
    "no_setting": "no `search` setting", "no_select_k": "lacks select_k", "unknown_method": "method",
    "dense_follow_ups": "follow-up method is 'dense'", "dense_pool_without_scorer": "no dense scorer",
    "shapes": "candidate features", "digest": "does not match the manifest",
}


@pytest.mark.parametrize("problem", list(BAD_MANIFESTS))
def test_a_bad_manifest_is_refused_at_start_with_a_clear_message(tmp_path: Path, problem: str) -> None:
    folder = bad_policy(tmp_path, problem)
    with pytest.raises(ValidationError, match=BAD_MANIFESTS[problem]):
        SearcherSettings(compact_policy=folder)
    SearcherSettings(compact_policy=folder, policy_kind="llm")  # not the served policy: not read


def test_the_service_started_with_a_bad_manifest_exits_2_with_one_line(tmp_path: Path) -> None:
    folder = bad_policy(tmp_path, "no_select_k")
    from plugsearch.common.workers import free_port

    env = {**os.environ, "SEARCHER_COMPACT_POLICY": str(folder), "SEARCHER_PORT": str(free_port())}
    done = subprocess.run([sys.executable, "-m", "plugsearch.searcher"], env=env, capture_output=True, text=True,
                          timeout=120, check=False)
    assert done.returncode == 2, (done.stdout, done.stderr)
    assert done.stderr.startswith("searcher: invalid configuration: ") and "lacks select_k" in done.stderr
    assert "Traceback" not in done.stderr
