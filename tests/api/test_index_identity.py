"""The searcher's cache key includes the identity of the index the retriever serves.

The retriever reports `index_id` in `/version` (corpus checksum + index manifests + ranking settings);
after a re-index the same question is searched again instead of being answered from the old corpus.
The searcher side runs the real SearchService, RetrieverClient and IndexIdentity against a fake
retriever app over ASGI (its `index_id` switched by the test).
"""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from fastapi import FastAPI
from fastapi.responses import JSONResponse

from plugsearch.common.cache import MemoryCache, ResultCache
from plugsearch.common.clients import RetrieverClient
from plugsearch.common.http import ClientSettings
from plugsearch.common.schemas.base import Document
from plugsearch.common.schemas.retriever import RetrieveRequest, RetrieveResponse
from plugsearch.common.schemas.searcher import SearchRequest
from plugsearch.retriever.serving import index_identity
from plugsearch.retriever.settings import RetrieverSettings
from plugsearch.retriever.store.manifest import Manifest
from plugsearch.searcher.index_identity import IndexIdentity
from plugsearch.searcher.policy import ChatPolicy
from plugsearch.searcher.retrieval import ServiceRetriever
from plugsearch.searcher.serving import SearchService
from plugsearch.searcher.settings import SearcherSettings
from tests.support.chat_policy import NoPolicy


def retriever_app() -> FastAPI:
    app = FastAPI()
    app.state.index_id = "idx-old"
    app.state.corpus = "old"
    app.state.retrievals = 0
    app.state.version_status = 200

    @app.get("/version")
    async def version() -> JSONResponse:
        if app.state.version_status != 200:
            return JSONResponse({"error": {"type": "x", "message": "down"}}, status_code=app.state.version_status)
        return JSONResponse({"service": "retriever", "version": "0", "details": {"index_id": app.state.index_id}})

    @app.post("/retrieve")
    async def retrieve(body: RetrieveRequest) -> RetrieveResponse:
        app.state.retrievals += 1
        corpus = app.state.corpus
        return RetrieveResponse(method="bm25", took_ms=0.1, results=[
            [Document(id=f"{corpus}-{i}", text=f"{corpus} passage {i}") for i in range(body.k)] for _ in body.queries])

    return app


@pytest.fixture()
async def setup() -> tuple[FastAPI, SearchService, RetrieverClient]:
    app = retriever_app()
    client = RetrieverClient(ClientSettings(url="http://retriever", max_retries=0, breaker_failures=100),
                             transport=httpx.ASGITransport(app=app))
    service = SearchService(SearcherSettings(), policy=ChatPolicy(NoPolicy()),  # type: ignore[arg-type]
                            retriever=ServiceRetriever(client),
                            cache=ResultCache(MemoryCache(), name="search"),
                            index_identity=IndexIdentity(client, ttl_s=0))
    return app, service, client


async def test_a_reindex_changes_the_key_so_old_results_are_not_served(
        setup: tuple[FastAPI, SearchService, RetrieverClient]) -> None:
    app, service, client = setup
    request = SearchRequest(question="who wrote it", mode="naive", retrieve_k=2)
    try:
        first = await service.search(await service.prepare(request))
        again = await service.search(await service.prepare(request))
        assert not first.cached and again.cached and app.state.retrievals == 1
        app.state.index_id, app.state.corpus = "idx-new", "new"  # the retriever now serves a new index
        after = await service.search(await service.prepare(request))
        assert not after.cached and [d.id for d in after.documents] == ["new-0", "new-1"]
        assert app.state.retrievals == 2
        assert (await service.search(await service.prepare(request))).cached
    finally:
        await client.aclose()


async def test_without_a_known_identity_searches_bypass_the_cache(
        setup: tuple[FastAPI, SearchService, RetrieverClient]) -> None:
    app, service, client = setup
    app.state.version_status = 503
    request = SearchRequest(question="who wrote it", mode="naive", retrieve_k=2)
    try:
        assert not (await service.search(await service.prepare(request))).cached
        assert not (await service.search(await service.prepare(request))).cached  # nothing stored while the index is unknown
        assert app.state.retrievals == 2
    finally:
        await client.aclose()


async def test_identity_is_kept_while_the_retriever_cannot_say_and_read_again_after_ttl() -> None:
    app = retriever_app()
    client = RetrieverClient(ClientSettings(url="http://retriever", max_retries=0, breaker_failures=100),
                             transport=httpx.ASGITransport(app=app))
    identity = IndexIdentity(client, ttl_s=3600)
    try:
        assert await identity.current() == "idx-old"
        app.state.index_id = "idx-new"
        assert await identity.current() == "idx-old"  # within the TTL: not asked again
        identity.ttl_s = 0
        assert await identity.current() == "idx-new"
        app.state.version_status = 503
        assert await identity.current() == "idx-new"  # restarting retriever: the last known one
    finally:
        await client.aclose()


def test_retriever_index_id_follows_corpus_manifests_and_ranking_settings(tmp_path: Path) -> None:
    settings = RetrieverSettings(corpus=tmp_path / "c.jsonl", index_dir=tmp_path)
    manifest = Manifest(kind="bm25", backend="bm25s", corpus_path="a.jsonl", corpus_checksum="sha256:1",
                        doc_count=3, params={"k1": 1.5}, created_at="2026-01-01T00:00:00Z")
    base = index_identity(settings, "sha256:1", {"bm25": manifest})
    moved = manifest.model_copy(update={"corpus_path": "elsewhere/a.jsonl", "build_seconds": 9.0})
    assert index_identity(settings, "sha256:1", {"bm25": moved}) == base  # same index, other path or timing
    rebuilt = manifest.model_copy(update={"created_at": "2026-02-01T00:00:00Z"})
    assert index_identity(settings, "sha256:1", {"bm25": rebuilt}) != base
    assert index_identity(settings, "sha256:2", {"bm25": manifest}) != base
    other_k1 = settings.model_copy(update={"bm25_k1": 0.9})
    assert index_identity(other_k1, "sha256:1", {"bm25": manifest}) != base
    ivf = Manifest(kind="dense", backend="faiss", corpus_path="a.jsonl", corpus_checksum="sha256:1", doc_count=3,
                   index_type="ivfsq8", created_at="2026-01-01T00:00:00Z")
    more_lists = settings.model_copy(update={"faiss": settings.faiss.model_copy(update={"nprobe": 64})})
    assert index_identity(more_lists, "sha256:1", {"dense": ivf}) != index_identity(settings, "sha256:1", {"dense": ivf})
    flat = ivf.model_copy(update={"index_type": "flat"})  # exact search: nprobe changes nothing
    assert index_identity(more_lists, "sha256:1", {"dense": flat}) == index_identity(settings, "sha256:1", {"dense": flat})
    lucene = manifest.model_copy(update={"backend": "pyserini"})
    topk = settings.model_copy(update={"lucene_search": "topk"})
    assert index_identity(topk, "sha256:1", {"bm25": lucene}) != index_identity(settings, "sha256:1", {"bm25": lucene})
    assert index_identity(topk, "sha256:1", {"bm25": manifest}) == base  # bm25s: no such setting
