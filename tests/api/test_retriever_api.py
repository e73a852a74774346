"""The retriever app in-process (lifespan running) over a tiny real index: bm25s + MiniLM/FAISS flat.

The tiny corpus is ~300 real passages from ../shared/data; its indexes are cached under var/ (keyed by
corpus checksum and encoder through the manifests), so only the first run pays for encoding.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi import FastAPI

from plugsearch.common.clients import RetrieverClient
from plugsearch.common.errors import BadRequest
from plugsearch.common.http import ClientSettings
from plugsearch.retriever.api import create_app
from plugsearch.retriever.settings import RetrieverSettings
from plugsearch.retriever.store.corpus import Corpus
from plugsearch.retriever.store.manifest import IndexMismatch
from tests.asgi import app_client
from tests.support.retriever import cached_index_dir, ensure_tiny_indexes, tiny_settings, write_tiny_corpus


@pytest.fixture(scope="module")
def tiny(data_dir: Path, var_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> RetrieverSettings:
    corpus = write_tiny_corpus(data_dir, tmp_path_factory.mktemp("retriever") / "tiny.jsonl")
    settings = tiny_settings(corpus, cached_index_dir(var_dir, corpus))
    ensure_tiny_indexes(settings, bm25=["bm25s"], dense=True)
    return settings


async def wait_ready(client: httpx.AsyncClient) -> None:
    for _ in range(3000):  # loading = MiniLM + numba compile: slow on a busy 2-core machine
        response = await client.get("/health/ready")
        if response.status_code == 200:
            return
        assert response.json()["checks"]["indexes"] == "loading", response.text
        await asyncio.sleep(0.1)
    raise AssertionError("retriever never became ready")


@pytest.fixture()
async def client(tiny: RetrieverSettings) -> AsyncIterator[httpx.AsyncClient]:
    async with app_client(create_app(tiny)) as c:
        await wait_ready(c)
        yield c


def assert_envelope(response: httpx.Response, status: int) -> dict[str, Any]:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"type", "message", "param", "request_id"}
    assert error["request_id"] == response.headers["x-request-id"]
    return error


async def test_every_method_returns_ranked_documents(client: httpx.AsyncClient, tiny: RetrieverSettings) -> None:
    corpus = Corpus.load(tiny.corpus)
    target = 42
    query = corpus.texts[target][:200]  # a verbatim slice: its own passage must come first
    for method in ("bm25", "dense", "hybrid"):
        response = await client.post("/retrieve", json={"queries": [query, "capital of France"], "k": 5,
                                                        "method": method})
        assert response.status_code == 200, response.text
        body = response.json()
        assert body["method"] == method and body["took_ms"] >= 0
        assert len(body["results"]) == 2
        for ranked in body["results"]:
            assert len(ranked) == 5
            assert set(ranked[0]) == {"id", "title", "text", "score"}
            scores = [d["score"] for d in ranked]
            assert scores == sorted(scores, reverse=True)
        top = body["results"][0][0]
        assert top["id"] == corpus.ids[target], method
        assert top["title"] == corpus.titles[target] and top["text"] == corpus.texts[target]


async def test_a_method_per_query_answers_as_separate_requests_would(client: httpx.AsyncClient) -> None:
    """`methods`: the same question with bm25 and with dense (the compact searcher's pool) in one round trip,
    each ranking the one its own request gets."""
    queries = ["Nobel prize in physics", "Nobel prize in physics", "history of film", "history of film"]
    methods = ["bm25", "dense", "hybrid", "bm25"]
    response = await client.post("/retrieve", json={"queries": queries, "k": 4, "methods": methods})
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["methods"] == methods and body["method"] == "bm25"
    for query, method, ranked in zip(queries, methods, body["results"], strict=True):
        alone = await client.post("/retrieve", json={"queries": [query], "k": 4, "method": method})
        assert ranked == alone.json()["results"][0], method
    assert "methods" not in (await client.post("/retrieve", json={"queries": ["film"]})).json()
    default = await client.post("/retrieve", json={"queries": ["film"], "k": 2, "methods": [None]})
    assert default.status_code == 200 and default.json()["methods"] == ["bm25"]  # the service's default


async def test_repeated_dense_queries_are_encoded_once(tiny: RetrieverSettings) -> None:
    """The encoder's query-vector cache: a query asked again (alone, or twice in one batch) gives the same
    ranking without being encoded again; with the cache off, the same rankings."""
    from plugsearch.retriever.backends.dense import DenseRetriever

    body = {"queries": ["who founded the film studio", "who founded the film studio", "a new question"], "k": 5,
            "method": "dense"}
    app = create_app(tiny)
    async with app_client(app) as c:
        await wait_ready(c)
        dense = app.state.retriever.retrievers["dense"]
        assert isinstance(dense, DenseRetriever) and dense.encoder.query_cache is not None
        cache = dense.encoder.query_cache
        size, misses = len(cache), cache.misses
        first = (await c.post("/retrieve", json=body)).json()["results"]
        assert first[0] == first[1] and len(cache) == size + 2  # the repeat in the batch: encoded once
        again = (await c.post("/retrieve", json={**body, "queries": body["queries"][:1]})).json()["results"]
        assert again == first[:1] and cache.misses == misses + 3 and cache.hits == 1
    off = tiny.model_copy(update={"encoder": tiny.encoder.model_copy(update={"query_cache": 0})})
    app = create_app(off)
    async with app_client(app) as c:
        await wait_ready(c)
        assert app.state.retriever.retrievers["dense"].encoder.query_cache is None
        assert (await c.post("/retrieve", json=body)).json()["results"] == first


async def test_one_query_and_a_large_batch_rank_alike(client: httpx.AsyncClient) -> None:
    """A small batch searches on one OpenMP thread, a large one on every thread: the same rankings."""
    queries = [f"question {i} about the history of film and music" for i in range(40)]
    batch = (await client.post("/retrieve", json={"queries": queries, "k": 5, "method": "dense"})).json()["results"]
    for i in (0, 17, 39):
        alone = (await client.post("/retrieve", json={"queries": [queries[i]], "k": 5, "method": "dense"})).json()
        assert [d["id"] for d in alone["results"][0]] == [d["id"] for d in batch[i]]


async def test_passages_are_sampled_from_the_served_corpus_by_seed(client: httpx.AsyncClient,
                                                                  tiny: RetrieverSettings) -> None:
    corpus = Corpus.load(tiny.corpus)
    first = (await client.post("/passages/sample", json={"n": 20, "seed": 7})).json()
    again = (await client.post("/passages/sample", json={"n": 20, "seed": 7})).json()
    other = (await client.post("/passages/sample", json={"n": 20, "seed": 8})).json()
    ids = [p["id"] for p in first["passages"]]
    assert ids == [p["id"] for p in again["passages"]] != [p["id"] for p in other["passages"]]
    assert len(set(ids)) == 20 and first["total"] == len(corpus) and first["index_id"]
    by_id = dict(zip(corpus.ids, corpus.texts, strict=True))
    assert all(p["text"] == by_id[p["id"]] for p in first["passages"])
    everything = (await client.post("/passages/sample", json={"n": 4000})).json()
    assert sorted(p["id"] for p in everything["passages"]) == sorted(corpus.ids)  # all of them, at most
    for bad in ({"n": 0}, {"n": 4001}, {"n": 5, "seed": -1}, {"n": 5, "extra": 1}):
        assert_envelope(await client.post("/passages/sample", json=bad), 422)


async def test_default_method_and_k_larger_than_corpus(client: httpx.AsyncClient, tiny: RetrieverSettings) -> None:
    response = await client.post("/retrieve", json={"queries": ["Nobel prize physics"]})
    assert response.status_code == 200
    assert response.json()["method"] == tiny.default_method
    assert 0 < len(response.json()["results"][0]) <= 10  # BM25 returns only documents sharing a term
    response = await client.post("/retrieve", json={"queries": ["Nobel prize physics"], "method": "dense"})
    assert len(response.json()["results"][0]) == 10  # default k
    n = len(Corpus.load(tiny.corpus))
    response = await client.post("/retrieve", json={"queries": ["the history of film"], "k": 1000, "method": "dense"})
    assert response.status_code == 200
    assert len(response.json()["results"][0]) == n


async def test_query_without_known_terms_returns_no_bm25_hits(client: httpx.AsyncClient) -> None:
    response = await client.post("/retrieve", json={"queries": ["zzqxv qqqzzx", "the of and"], "method": "bm25"})
    assert response.status_code == 200
    assert response.json()["results"] == [[], []]


async def test_searchr1_compatible_shapes(client: httpx.AsyncClient) -> None:
    with_scores = await client.post("/searchr1/retrieve", json={"queries": ["Nobel prize physics", "film"],
                                                                "topk": 4, "return_scores": True})
    assert with_scores.status_code == 200
    result = with_scores.json()["result"]
    assert len(result) == 2 and len(result[0]) == 4
    hit = result[0][0]
    assert set(hit) == {"document", "score"} and set(hit["document"]) == {"id", "contents"}
    assert hit["document"]["contents"].startswith('"')
    plain = await client.post("/searchr1/retrieve", json={"queries": ["Nobel prize physics"]})
    docs = plain.json()["result"][0]
    assert len(docs) == 3 and set(docs[0]) == {"id", "contents"}  # Search-R1's default topk is 3
    assert docs[0]["id"] == hit["document"]["id"]


async def test_searchr1_blank_query_gets_an_empty_list_not_a_failed_batch(client: httpx.AsyncClient) -> None:
    """A policy that writes `<search> </search>` sends a blank query; Search-R1's server answers 200 with
    that query's empty list, and so must we, or a training run through us dies on it."""
    queries = ["Nobel prize physics", " ", "", "film"]
    response = await client.post("/searchr1/retrieve", json={"queries": queries, "topk": 3, "return_scores": True})
    assert response.status_code == 200, response.text
    result = response.json()["result"]
    assert [len(r) for r in result] == [3, 0, 0, 3]
    alone = (await client.post("/searchr1/retrieve", json={"queries": ["Nobel prize physics", "film"], "topk": 3,
                                                           "return_scores": True})).json()["result"]
    assert [result[0], result[3]] == alone
    blank_only = await client.post("/searchr1/retrieve", json={"queries": ["  \t"]})
    assert blank_only.status_code == 200 and blank_only.json() == {"result": [[]]}
    assert_envelope(await client.post("/searchr1/retrieve", json={"queries": ["a\x00b"]}), 422)
    assert_envelope(await client.post("/retrieve", json={"queries": [" "]}), 422)  # our own API stays strict


BAD_INPUTS: list[tuple[str, Any, int]] = [
    ("empty query", {"queries": [""]}, 422),
    ("blank query", {"queries": ["   "]}, 422),
    ("100 KB query", {"queries": ["word " * 20_000]}, 422),
    ("empty batch", {"queries": []}, 422),
    ("batch over the limit", {"queries": ["q"] * 4097}, 422),
    ("k = 0", {"queries": ["q"], "k": 0}, 422),
    ("k negative", {"queries": ["q"], "k": -3}, 422),
    ("k huge", {"queries": ["q"], "k": 10**9}, 422),
    ("unknown method", {"queries": ["q"], "method": "splade"}, 422),
    ("queries not a list", {"queries": "q"}, 422),
    ("unknown field", {"queries": ["q"], "topk": 3}, 422),
    ("NUL byte", {"queries": ["a\x00b"]}, 422),
    ("k as a string", {"queries": ["q"], "k": "5"}, 422),
    ("k as a boolean", {"queries": ["q"], "k": True}, 422),
    ("queries x k over the response bound", {"queries": ["q"] * 4096, "k": 1000}, 422),
    ("41 queries at k 1000", {"queries": ["q"] * 41, "k": 1000}, 422),
    ("method and methods", {"queries": ["q"], "method": "bm25", "methods": ["dense"]}, 422),
    ("a method per query, one short", {"queries": ["q", "r"], "methods": ["bm25"]}, 422),
    ("unknown method in methods", {"queries": ["q"], "methods": ["splade"]}, 422),
]


@pytest.mark.parametrize(("case", "body", "status"), BAD_INPUTS, ids=[c[0] for c in BAD_INPUTS])
async def test_bad_input_is_4xx_envelope_and_service_keeps_serving(client: httpx.AsyncClient, case: str,
                                                                   body: Any, status: int) -> None:
    assert_envelope(await client.post("/retrieve", json=body), status)
    ok = await client.post("/retrieve", json={"queries": ["still serving"], "k": 2})
    assert ok.status_code == 200 and len(ok.json()["results"][0]) == 2


async def test_malformed_json_and_searchr1_bad_input(client: httpx.AsyncClient) -> None:
    error = assert_envelope(await client.post("/retrieve", content=b'{"queries": [', headers={
        "content-type": "application/json"}), 400)
    assert error["type"] == "invalid_json"
    assert_envelope(await client.post("/searchr1/retrieve", json={"queries": ["q"], "topk": 0}), 422)
    assert_envelope(await client.post("/searchr1/retrieve", json={"queries": []}), 422)
    assert_envelope(await client.post("/searchr1/retrieve", json={"queries": ["q"] * 4096, "topk": 1000}), 422)
    assert_envelope(await client.post("/searchr1/retrieve", json={"queries": ["q"], "topk": "3"}), 422)


async def test_method_not_loaded_is_400(tiny: RetrieverSettings) -> None:
    """The caller's choice of a method this retriever does not serve: bad input, the status the searcher
    passes on unchanged."""
    settings = tiny.model_copy(update={"dense": False})
    async with app_client(create_app(settings)) as c:
        await wait_ready(c)
        for method in ("dense", "hybrid"):
            error = assert_envelope(await c.post("/retrieve", json={"queries": ["q"], "method": method}), 400)
            assert error["param"] == "method" and error["type"] == "bad_request"
            error = assert_envelope(await c.post("/retrieve", json={"queries": ["q", "q"],
                                                                    "methods": ["bm25", method]}), 400)
            assert error["param"] == "methods" and error["type"] == "bad_request"
        version = (await c.get("/version")).json()
        assert version["details"]["methods"] == ["bm25"]
        assert version["details"]["encoder_backend"] is None  # no dense index, no encoder


async def test_ops_endpoints(client: httpx.AsyncClient, tiny: RetrieverSettings) -> None:
    assert (await client.get("/health/live")).status_code == 200
    ready = await client.get("/health/ready")
    assert ready.json() == {"status": "ready", "checks": {"indexes": "ok"}}
    details = (await client.get("/version")).json()["details"]
    assert details["methods"] == ["bm25", "dense", "hybrid"] and details["dense_index"] == "flat"
    assert details["index_id"].startswith("idx-")  # searchers put it in their cache keys
    # the default encoder backend (auto) serves MiniLM on ONNX Runtime, and says so
    assert details["encoder_backend"] == "onnx" and details["encoder_fallback"] is None
    await client.post("/retrieve", json={"queries": ["a", "b"], "method": "dense"})
    metrics = (await client.get("/metrics")).text
    assert 'retriever_search_seconds_count{method="dense"}' in metrics
    assert 'retriever_batch_queries_sum{method="dense"}' in metrics
    schema = (await client.get("/openapi.json")).json()
    assert {"/retrieve", "/searchr1/retrieve"} <= set(schema["paths"])
    assert "RetrieveResponse" in json.dumps(schema)


async def test_concurrent_requests_all_answered_correctly(client: httpx.AsyncClient) -> None:
    queries = [f"question number {i} about film" for i in range(40)]
    alone = (await client.post("/retrieve", json={"queries": queries, "k": 3})).json()["results"]
    responses = await asyncio.gather(*(client.post("/retrieve", json={"queries": [q], "k": 3}) for q in queries))
    assert [r.json()["results"][0] for r in responses] == alone


async def test_startup_refuses_a_corpus_index_mismatch(tiny: RetrieverSettings, tmp_path: Path) -> None:
    other = tmp_path / "other.jsonl"
    lines = tiny.corpus.read_text().splitlines()
    other.write_text("\n".join(lines[:-1]) + "\n")  # one passage fewer: another checksum
    app: FastAPI = create_app(tiny.model_copy(update={"corpus": other}))
    with pytest.raises(IndexMismatch, match="corpus checksum"):
        async with app_client(app):
            pass


async def test_typed_client_against_the_app(tiny: RetrieverSettings) -> None:
    app = create_app(tiny)
    async with app_client(app) as c:
        await wait_ready(c)
        client = RetrieverClient(ClientSettings(url="http://testserver", max_retries=0),
                                 transport=httpx.ASGITransport(app=app))
        try:
            response = await client.retrieve(["Nobel prize in physics", "film director"], k=3, method="hybrid")
            assert response.method == "hybrid" and [len(r) for r in response.results] == [3, 3]
            assert response.results[0][0].id and response.results[0][0].score is not None
            with pytest.raises(BadRequest):  # limits live in the shared schema: refused before sending
                await client.retrieve(["q"], k=0)
        finally:
            await client.aclose()


async def test_admission_judges_a_retrieval_by_its_number_of_queries(client: httpx.AsyncClient,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """A batch of 32 queries is 32 cost units to the adaptive limit: otherwise a baseline learnt on single
    queries would read every large batch as overload and refuse it."""
    from plugsearch.common.admission import AdaptiveLimit

    costs: list[float] = []
    observe = AdaptiveLimit.observe

    def recording(self: AdaptiveLimit, seconds: float, cost: float = 1.0, *args: Any, **kwargs: Any) -> None:
        costs.append(cost)
        observe(self, seconds, cost, *args, **kwargs)

    monkeypatch.setattr(AdaptiveLimit, "observe", recording)
    queries = [f"question number {i}" for i in range(32)]
    assert (await client.post("/retrieve", json={"queries": queries[:1], "k": 3})).status_code == 200
    assert (await client.post("/retrieve", json={"queries": queries, "k": 3})).status_code == 200
    assert (await client.post("/searchr1/retrieve", json={"queries": queries[:5]})).status_code == 200
    assert costs == [1.0, 32.0, 5.0]


async def test_version_says_when_the_encoder_falls_back_to_torch(tiny: RetrieverSettings, tmp_path: Path) -> None:
    """The default backend cannot export here (its folder is a file): the service serves torch, and /version
    says so and why."""
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    settings = tiny.model_copy(update={"encoder": tiny.encoder.model_copy(update={"onnx_dir": blocker})})
    async with app_client(create_app(settings)) as c:
        await wait_ready(c)
        details = (await c.get("/version")).json()["details"]
        assert details["encoder_backend"] == "torch"
        assert "RETRIEVER_ENCODER__ONNX_DIR at a writable folder" in details["encoder_fallback"]
        response = await c.post("/retrieve", json={"queries": ["capital of France"], "method": "dense", "k": 3})
        assert response.status_code == 200 and len(response.json()["results"][0]) == 3


# ------------------------------------------------------------- serve what is ready first (issue 38)
def bm25_only_dir(tiny: RetrieverSettings, tmp_path: Path) -> RetrieverSettings:
    """A fresh index folder for the tiny corpus with its document store and BM25 index only."""
    from plugsearch.retriever.indexing.build import build

    settings = tiny.model_copy(update={"index_dir": tmp_path / "indexes"})
    build(settings, bm25=["bm25s"], dense=False, force=False, show_progress=False)
    return settings


async def wait_for_dense(client: httpx.AsyncClient, seconds: float = 600.0) -> dict[str, Any]:
    for _ in range(int(seconds / 0.2)):
        details = (await client.get("/version")).json()["details"]
        if "dense" in details.get("methods", []):
            return details
        await asyncio.sleep(0.2)
    raise AssertionError(f"the dense index was never served: {details}")


async def test_a_pending_dense_index_is_served_once_a_build_elsewhere_writes_it(
        tiny: RetrieverSettings, tmp_path: Path) -> None:
    """RETRIEVER_DENSE_MISSING=wait: BM25 serves at once; the index another process builds (here: copied in
    place the way a build finishes, its folder renamed in) is loaded without a restart, and /version says so
    (methods, a new index_id: cached results of the BM25-only time are not served for it)."""
    import shutil

    from plugsearch.retriever.backends.faiss_index import dense_folder

    settings = bm25_only_dir(tiny, tmp_path).model_copy(update={"dense_missing": "wait", "dense_poll_s": 0.2})
    async with app_client(create_app(settings)) as client:
        await wait_ready(client)
        before = (await client.get("/version")).json()["details"]
        assert before["methods"] == ["bm25"] and before["dense_pending"] == "waiting"
        refused = await client.post("/retrieve", json={"queries": ["capital of France"], "method": "dense"})
        assert_envelope(refused, 400)
        bm25 = await client.post("/retrieve", json={"queries": ["capital of France"], "k": 3})
        assert bm25.status_code == 200 and bm25.json()["method"] == "bm25"
        staged = tmp_path / "staged"
        shutil.copytree(dense_folder(tiny.index_dir, "flat"), staged)
        staged.rename(dense_folder(settings.index_dir, "flat"))
        after = await wait_for_dense(client)
        dense = await client.post("/retrieve", json={"queries": ["capital of France"], "k": 3, "method": "dense"})
    assert after["methods"] == ["bm25", "dense", "hybrid"] and after["dense_pending"] is None
    assert after["index_id"] != before["index_id"] and after["encoder"] == "all-MiniLM-L6-v2"
    assert dense.status_code == 200 and len(dense.json()["results"][0]) == 3


async def test_a_missing_dense_index_is_built_by_the_service_while_bm25_serves(
        tiny: RetrieverSettings, tmp_path: Path) -> None:
    """RETRIEVER_DENSE_MISSING=build: the service starts on BM25 and builds the dense index in a child process
    (`plugsearch-index build`, with this service's settings), then serves it; the same index as a build by
    hand (the same passages' nearest neighbours)."""
    settings = bm25_only_dir(tiny, tmp_path).model_copy(update={"dense_missing": "build", "dense_poll_s": 0.2})
    query = {"queries": ["Nobel prize physics"], "k": 5, "method": "dense"}
    async with app_client(create_app(settings)) as client:
        await wait_ready(client)
        first = (await client.get("/version")).json()["details"]
        assert first["methods"] == ["bm25"] and first["dense_pending"] == "building"
        await wait_for_dense(client)
        built = (await client.post("/retrieve", json=query)).json()["results"][0]
    async with app_client(create_app(tiny)) as reference:
        await wait_ready(reference)
        expected = (await reference.post("/retrieve", json=query)).json()["results"][0]
    assert [d["id"] for d in built] == [d["id"] for d in expected]
    assert (settings.index_dir / "dense-flat" / "manifest.json").is_file()


def test_waiting_for_the_dense_index_needs_bm25_to_serve_meanwhile(tiny: RetrieverSettings) -> None:
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="RETRIEVER_DENSE_MISSING=build serves BM25"):
        tiny.model_validate({**tiny.model_dump(), "bm25": False, "default_method": "dense",
                             "dense_missing": "build"})
    with pytest.raises(ValidationError, match="RETRIEVER_DEFAULT_METHOD=hybrid is not served"):
        tiny.model_validate({**tiny.model_dump(), "default_method": "hybrid", "dense_missing": "wait"})
