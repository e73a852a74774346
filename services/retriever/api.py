"""The retriever's HTTP API: a thin router over `RetrieverService`.

`POST /retrieve` (batch of queries, k, method -> ranked `{id, title, text, score}` per query) and
`POST /searchr1/retrieve` (Search-R1 / veRL search-tool shape: point their `search_url` here).
Start-up refuses a corpus/index mismatch (the manifests are checked before the app serves); the heavy
loading then runs in the background and `/health/ready` turns green when every index is loaded.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request, Response

from services.common.admission import COST_STATE
from services.common.app import build_app
from services.common.errors import ErrorEnvelope, NotReady
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

_ERROR_TEXTS = {400: "bad input (for example k over RETRIEVER_MAX_K)",
                404: "the requested method is not served by this retriever (param `method`)",
                429: "too many queries queued; retry after Retry-After",
                503: "indexes still loading, or the dense index's Milvus not answering; retry after Retry-After"}


def _errors(*codes: int) -> dict[int | str, dict[str, Any]]:
    return {code: {"model": ErrorEnvelope, "description": _ERROR_TEXTS[code]} for code in codes}


class _State:
    def __init__(self) -> None:
        self.service: RetrieverService | None = None
        self.error: str | None = None
        self.task: asyncio.Task[None] | None = None


def _service(request: Request) -> RetrieverService:
    state: _State = request.app.state.retriever
    if state.service is None:
        raise NotReady(state.error or "indexes are still loading", retry_after=2.0)
    return state.service


def create_app(settings: RetrieverSettings, *, service: RetrieverService | None = None,
               check: IndexCheck | None = None) -> FastAPI:
    """The retriever app. Inject `service` to skip loading (tests); `check` to reuse a start-up check."""
    state = _State()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        metrics = SearchMetrics(app.state.metrics.registry)
        if service is not None:
            state.service = service
            service.metrics = metrics
        else:
            checked = check if check is not None else await asyncio.to_thread(check_indexes, settings)

            async def load() -> None:
                try:
                    state.service = await asyncio.to_thread(RetrieverService.load, settings, checked,
                                                            metrics=metrics)
                except Exception as exc:  # readiness reports it; the log has the trace
                    logger.exception("loading the indexes failed")
                    state.error = f"loading failed: {type(exc).__name__}: {exc}"

            state.task = asyncio.create_task(load())

        async def ready() -> dict[str, str]:
            if state.service is not None:
                return {"indexes": await state.service.health()}
            return {"indexes": state.error or "loading"}

        app.state.readiness = ready
        try:
            yield
        finally:
            if state.task is not None and not state.task.done():
                await asyncio.wait({state.task}, timeout=60)
            if state.service is not None and service is None:
                await state.service.aclose()

    def version_details(app: FastAPI) -> dict[str, Any]:
        return state.service.describe() if state.service is not None else {"loading": True}

    app = build_app(settings, service="retriever", lifespan=lifespan, version_details=version_details,
                    description="BM25 (bm25s / pyserini), dense (sentence-transformers + FAISS) and hybrid "
                                "(RRF) search over one corpus.")
    app.state.retriever = state

    @app.post("/retrieve", tags=["retrieval"], response_class=Response,
              responses={200: {"model": RetrieveResponse, "content": {JSON: {}}}, **_errors(400, 404, 429, 503)})
    async def retrieve(body: RetrieveRequest, request: Request) -> Response:
        """Search a batch of queries; returns per query the top `k` passages, best first."""
        setattr(request.state, COST_STATE, float(len(body.queries)))  # admission judges latency per query
        svc = _service(request)
        t0 = time.perf_counter()
        method, hits = await svc.search(body.queries, body.k, body.method)
        return Response(svc.render(method, hits, (time.perf_counter() - t0) * 1000), media_type=JSON)

    @app.post("/searchr1/retrieve", tags=["retrieval"], response_class=Response,
              responses={200: {"model": SearchR1Response, "content": {JSON: {}}}, **_errors(400, 429, 503)})
    async def retrieve_searchr1(body: SearchR1Request, request: Request) -> Response:
        """Search-R1 `retrieval_server.py` compatible: `{queries, topk, return_scores}` ->
        `{"result": [[{"document": {"id", "contents"}, "score"}]]}` (documents only without scores).
        A blank query gets an empty list, as on Search-R1's server."""
        setattr(request.state, COST_STATE, float(len(body.queries)))
        svc = _service(request)
        hits = await svc.search_skipping_blank(body.queries, body.topk or settings.searchr1_topk, None)
        return Response(svc.render_searchr1(hits, body.return_scores), media_type=JSON)

    return app
