"""The retriever's HTTP API: a thin router over `RetrieverService` (`POST /retrieve`, and `POST
/searchr1/retrieve` in the Search-R1 / veRL search-tool shape). The manifests are checked before the app
serves; the heavy loading runs in the background and `/health/ready` turns green once it is done.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request, Response

from services.common import tracing
from services.common.admission import COST_STATE
from services.common.app import build_app, from_state, service_router
from services.common.errors import error_responses
from services.common.schemas.retriever import (
    RetrieveRequest,
    RetrieveResponse,
    SearchR1Request,
    SearchR1Response,
)
from services.retriever.serving import IndexCheck, RetrieverService, SearchMetrics, check_indexes
from services.retriever.settings import RetrieverSettings

logger = logging.getLogger(__name__)

JSON = "application/json"

ERRORS = error_responses({
    400: "bad input (for example k over RETRIEVER_MAX_K)", 429: "too many queries queued; retry after Retry-After",
    503: "indexes still loading, or the dense index's Milvus not answering; retry after Retry-After"})
UNSERVED_METHOD = error_responses({400: "bad input (for example k over RETRIEVER_MAX_K), or a method this "
                                        "retriever does not serve (param `method`)"})

router = service_router("retrieval")


def _service(request: Request) -> RetrieverService:
    return from_state(request, "retriever", RetrieverService, starting="indexes are still loading")


@router.post("/retrieve", response_class=Response,
             responses={200: {"model": RetrieveResponse, "content": {JSON: {}}}, **ERRORS, **UNSERVED_METHOD})
async def retrieve(body: RetrieveRequest, request: Request) -> Response:
    """Search a batch of queries; returns per query the top `k` passages, best first. `methods` (one per query)
    searches each query with its own method, in the one round trip."""
    setattr(request.state, COST_STATE, float(len(body.queries)))  # admission judges latency per query
    svc = _service(request)
    t0 = time.perf_counter()
    methods: list[str] | None = None
    with tracing.span("retriever.search", {"plugsearch.queries": len(body.queries), "plugsearch.k": body.k}) as span:
        if body.methods is not None:
            methods, hits = await svc.search_each(body.queries, body.k, body.methods)
            method = methods[0]
        else:
            method, hits = await svc.search(body.queries, body.k, body.method)
        if span.is_recording():
            span.set_attributes({"plugsearch.method": ",".join(sorted(set(methods))) if methods else method,
                                 "plugsearch.documents": int((hits.ids >= 0).sum())})
    return Response(svc.render(method, hits, (time.perf_counter() - t0) * 1000, methods), media_type=JSON)


@router.post("/searchr1/retrieve", response_class=Response,
             responses={200: {"model": SearchR1Response, "content": {JSON: {}}}, **ERRORS})
async def retrieve_searchr1(body: SearchR1Request, request: Request) -> Response:
    """Search-R1 `retrieval_server.py` compatible: `{queries, topk, return_scores}` ->
    `{"result": [[{"document": {"id", "contents"}, "score"}]]}` (documents only without scores).
    A blank query gets an empty list, as on Search-R1's server."""
    setattr(request.state, COST_STATE, float(len(body.queries)))
    svc = _service(request)
    topk = body.topk or request.app.state.settings.searchr1_topk
    hits = await svc.search_skipping_blank(body.queries, topk, None)
    return Response(svc.render_searchr1(hits, body.return_scores), media_type=JSON)


def create_app(settings: RetrieverSettings, *, check: IndexCheck | None = None) -> FastAPI:
    """The retriever app; `check` reuses a start-up index check (else the lifespan runs one)."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        metrics = SearchMetrics(app.state.metrics.registry)
        checked = check if check is not None else await asyncio.to_thread(check_indexes, settings)

        async def load() -> None:
            try:
                app.state.retriever = await asyncio.to_thread(RetrieverService.load, settings, checked,
                                                              metrics=metrics)
            except Exception as exc:  # readiness reports it; the log has the trace
                logger.exception("loading the indexes failed")
                app.state.startup_error = f"loading failed: {type(exc).__name__}: {exc}"

        loading = asyncio.create_task(load())

        async def ready() -> dict[str, str]:
            loaded: RetrieverService | None = app.state.retriever
            if loaded is not None:
                return {"indexes": await loaded.health()}
            return {"indexes": app.state.startup_error or "loading"}

        app.state.readiness = ready
        try:
            yield
        finally:
            if not loading.done():
                await asyncio.wait({loading}, timeout=60)
            if app.state.retriever is not None:
                await app.state.retriever.aclose()

    def version_details(app: FastAPI) -> dict[str, Any]:
        loaded: RetrieverService | None = app.state.retriever
        return loaded.describe() if loaded is not None else {"loading": True}

    app = build_app(settings, service="retriever", lifespan=lifespan, version_details=version_details,
                    description="BM25 (bm25s / pyserini), dense (sentence-transformers + FAISS) and hybrid "
                                "(RRF) search over one corpus.")
    app.state.retriever = None
    app.include_router(router)
    return app
