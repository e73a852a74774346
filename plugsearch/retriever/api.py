"""The retriever's HTTP API: a thin router over `RetrieverService` (`POST /retrieve`, and `POST
/searchr1/retrieve` in the Search-R1 / veRL search-tool shape). The manifests are checked before the app
serves; the heavy loading runs in the background and `/health/ready` turns green once it is done. A dense
index still pending (RETRIEVER_DENSE_MISSING wait / build) is loaded when it appears, BM25 serving meanwhile;
with `build` this service builds it itself in a child process (`plugsearch-index build`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import sys
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import PurePosixPath
from typing import Annotated, Any

from fastapi import FastAPI, Query, Request, Response

from plugsearch.common import tracing
from plugsearch.common.admission import CALLER_STATE, COST_STATE, Caller
from plugsearch.common.app import build_app, from_state, service_router
from plugsearch.common.errors import (
    BadRequest,
    Conflict,
    Forbidden,
    NotReady,
    ServiceError,
    ValidationFailed,
    error_responses,
)
from plugsearch.common.schemas.retriever import (
    ChangeResponse,
    DeleteDocumentsRequest,
    DocumentIn,
    DocumentList,
    FileResult,
    IndexState,
    ListDocumentsQuery,
    ListedDocument,
    PutDocumentsRequest,
    PutFilesRequest,
    PutFilesResponse,
    RetrieveRequest,
    RetrieveResponse,
    SampleRequest,
    SampleResponse,
    SearchR1Request,
    SearchR1Response,
)
from plugsearch.retriever.ingest.passages import DEFAULT_WORDS, Passage
from plugsearch.retriever.ingest.pool import ParsePool
from plugsearch.retriever.live.changelog import Change, ChangeNotWritten
from plugsearch.retriever.live.listing import DocumentListing
from plugsearch.retriever.live.overlay import LiveIndex
from plugsearch.retriever.serving import (
    IndexCheck,
    RetrieverService,
    SearchMetrics,
    check_dense,
    check_indexes,
    load_dense,
)
from plugsearch.retriever.settings import RetrieverSettings
from plugsearch.retriever.store.manifest import IndexMismatch, IndexMissing

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


@router.post("/passages/sample", response_class=Response,
             responses={200: {"model": SampleResponse, "content": {JSON: {}}}, **ERRORS})
async def sample_passages(body: SampleRequest, request: Request) -> Response:
    """`n` passages drawn at random from the served corpus (the same `seed`, the same passages): what the
    searcher's corpus check makes its pseudo-questions of."""
    setattr(request.state, COST_STATE, float(max(1, body.n // 100)))
    svc = _service(request)
    return Response(await asyncio.to_thread(svc.sample, body.n, body.seed), media_type=JSON)


CUT_ERRORS = error_responses({
    422: "a bad request, or a document's text over the parse pool's CPU budget (RETRIEVER_PARSE__CPU_S)",
    429: "more texts wait to be cut than RETRIEVER_PARSE__QUEUE: retry after Retry-After"})
CHANGE_ERRORS = error_responses({
    403: "the caller may not change documents (the internal token or a RETRIEVER_ADMIN_KEYS key may; a search key "
         "never)", 409: "documents cannot change on this retriever (RETRIEVER_CHANGES=off, or a backend that cannot)",
    503: "indexes still loading, or the change log cannot be written (nothing changed); retry after Retry-After"})


def _may_change(request: Request) -> None:
    """Refuse (403) a caller who may not change documents: neither the internal token nor an admin key."""
    caller = getattr(request.state, CALLER_STATE, None)
    settings: RetrieverSettings = request.app.state.settings
    allowed = isinstance(caller, Caller) and (caller.kind == "internal"
                                              or (caller.kind == "key" and caller.id in settings.admin_ids()))
    if not allowed:
        raise Forbidden("changing documents needs the internal token or an admin key (RETRIEVER_ADMIN_KEYS); "
                        + ("a search key may only search" if isinstance(caller, Caller) and caller.kind == "key"
                           else "this retriever has none configured"))


def _changing(request: Request) -> LiveIndex:
    """The live index of a caller who may change documents: the internal token, or an admin key."""
    _may_change(request)
    svc = _service(request)
    if svc.live is None:
        raise Conflict(f"documents cannot change on this retriever: {svc.changes_off}")
    return svc.live


def _pool(request: Request) -> ParsePool:
    pool: ParsePool = request.app.state.parse_pool
    return pool


async def passages_of(pool: ParsePool, documents: list[DocumentIn]) -> list[Passage]:
    """Each document's passages, `<id>#0`, `<id>#1`, ...: as given (normalised as every reader's text is), or its
    text read and cut as `plugsearch-index ingest` reads and cuts a text file (paragraphs, then sentences packed to
    about 100 words: `cut_file`), by a worker of the parse pool, never on the event loop."""
    from plugsearch.retriever.ingest.formats import SkipFile
    from plugsearch.retriever.ingest.pool import ParseRefused

    jobs = [(d.id, d.title, d.text, None if d.passages is None else [(p.title, p.text) for p in d.passages])
            for d in documents]
    size = sum(len(d.text or "") + sum(len(p.text) for p in d.passages or ()) for d in documents)
    try:
        cut: list[list[Passage]] = await pool.run("documents", jobs, DEFAULT_WORDS, size=size)
    except SkipFile as exc:
        raise BadRequest(exc.reason, param="documents") from exc
    except ParseRefused as exc:
        raise ValidationFailed(f"the documents' text was not cut: {exc.reason}", param="documents") from exc
    for doc, passages in zip(documents, cut, strict=True):
        if not passages:
            raise BadRequest(f"document {doc.id!r} has no text", param="documents")
    return [p for passages in cut for p in passages]


WRITE_RETRY_AFTER_S = 30.0
"""Retry-After of the 503 answered when the change log cannot take a change (a full or read-only disk)."""


async def _write(live: LiveIndex, put: list[Passage], delete: list[str]) -> Change | None:
    """One change logged and applied (None: nothing to change, nothing logged); a log that cannot be written (a full
    or read-only disk, a damaged log) is a 503 with the reason and Retry-After, the change not acknowledged (and
    never half there: `plugsearch.retriever.live.changelog`)."""
    try:
        return await asyncio.to_thread(live.write, put, delete)
    except (ChangeNotWritten, OSError) as exc:
        reason = exc.reason if isinstance(exc, ChangeNotWritten) else (exc.strerror or str(exc))
        logger.error("the change log could not be written: %s", reason)
        raise NotReady(f"the change could not be written to the change log ({reason}); nothing was changed",
                       retry_after=WRITE_RETRY_AFTER_S) from exc


@router.put("/documents", response_model=ChangeResponse, responses={**ERRORS, **CHANGE_ERRORS, **CUT_ERRORS})
async def put_documents(body: PutDocumentsRequest, request: Request) -> ChangeResponse:
    """Add documents, or replace them whole (every passage of a document already served, by its id): durable
    before this answers, searched by every worker within RETRIEVER_CHANGES_POLL_S (this one at once). A document's
    text is cut by a worker process of the parse pool (RETRIEVER_PARSE__*), under its CPU budget."""
    live = _changing(request)
    t0 = time.perf_counter()
    passages = await passages_of(_pool(request), body.documents)
    setattr(request.state, COST_STATE, float(max(1, len(passages) // 10)))
    change = await _write(live, passages, [])
    return ChangeResponse(seq=change.seq if change is not None else live.seq, documents=len(body.documents),
                          passages=len(passages),
                          index_id=_service(request).index_id, took_ms=round((time.perf_counter() - t0) * 1000, 3))


async def files_of(pool: ParsePool, body: PutFilesRequest) -> tuple[list[Passage], list[FileResult]]:
    """The passages of the files that read fine, and each file's outcome: a file refused (bad base64, an
    extension no reader takes, not what its extension says, a PDF with no text layer, over the size limit or its
    CPU budget, a document id another file of the request took first, ...) is skipped with its reason, the others
    go on. Each file is read by a worker of the parse pool (`plugsearch.retriever.ingest.pool`), several at once."""
    from plugsearch.retriever.ingest.formats import FORMATS, SkipFile, format_of
    from plugsearch.retriever.ingest.pool import ParseRefused
    from plugsearch.retriever.ingest.reading import MB
    from plugsearch.retriever.ingest.run import DEFAULT_MAX_MB

    words, max_bytes = body.words or DEFAULT_WORDS, int(DEFAULT_MAX_MB * MB)
    results: list[FileResult] = []
    claimed: dict[str, str] = {}  # document id -> the file that claims it first (a later one is never read)
    jobs: list[Any] = []
    for file in body.files:
        kind = format_of(PurePosixPath(file.name))
        corpus = kind is not None and FORMATS[kind].is_corpus  # its rows name their documents
        result = FileResult(name=file.name, id=None if corpus else file.id or file.name, status="skipped",
                            format=kind)
        results.append(result)
        if result.id is not None and result.id in claimed:
            result.reason = f"duplicate document id {result.id!r}: already taken by {claimed[result.id]}"
            jobs.append(None)
            continue
        if result.id is not None:
            claimed[result.id] = file.name
        jobs.append(pool.run("upload", file.name, file.content_base64, file.id, file.title, words, max_bytes,
                             size=len(file.content_base64) * 3 // 4))
    outcomes = iter(await _all_read([job for job in jobs if job is not None]))
    taken: dict[str, str] = {}  # document id -> the file that put it
    passages: list[Passage] = []
    for result, job in zip(results, jobs, strict=True):
        if job is None:
            continue
        outcome = next(outcomes)
        try:
            if isinstance(outcome, Exception):
                raise outcome
            found, hashes = outcome
            documents = list(hashes)
            if clash := next((d for d in documents if d in taken), None):
                raise SkipFile(f"duplicate document id {clash!r}: already taken by {taken[clash]}")
        except (SkipFile, ParseRefused) as exc:
            result.reason = exc.reason
        except Exception as exc:  # a reader's failure on one file never fails the others
            logger.warning("file %r could not be read", result.name, exc_info=exc)
            result.reason = f"could not be read ({type(exc).__name__}); the retriever's log has the details"
        else:
            taken.update(dict.fromkeys(documents, result.name))
            passages += found
            result.status, result.documents, result.passages = "put", len(documents), len(found)
            result.sha256 = hashes[result.id] if result.id is not None else None
    return passages, results


async def _all_read(jobs: list[Any]) -> list[Any]:
    """Each job's result, or the exception that refused its file; a refusal of the whole request (the pool's queue
    full: 429) stops the request's other jobs, their workers killed."""
    async def one(job: Any) -> Any:
        try:
            return await job
        except ServiceError:
            raise
        except Exception as exc:  # this file's: the others go on
            return exc

    try:
        async with asyncio.TaskGroup() as group:
            tasks = [group.create_task(one(job)) for job in jobs]
    except* ServiceError as refused:
        raise refused.exceptions[0] from None
    return [task.result() for task in tasks]


FILE_ERRORS = error_responses({
    413: "the request body is over RETRIEVER_MAX_BODY_BYTES (2 MiB by default): send fewer files per request, "
         "raise the limit, or use `plugsearch-index ingest` then `plugsearch-index put`",
    422: "a bad request, or no file could be read (every file's reason in the message; nothing changed)",
    429: "more files wait to be read than RETRIEVER_PARSE__QUEUE: retry after Retry-After"})


@router.post("/documents/files", response_model=PutFilesResponse, responses={**ERRORS, **CHANGE_ERRORS, **FILE_ERRORS})
async def put_files(body: PutFilesRequest, request: Request) -> PutFilesResponse:
    """Add or replace documents given as files (base64 in JSON): each read by the reader its name's extension
    asks for (text, Markdown, HTML's main text, PDF's text layer, JSONL passages) and cut into passages of about
    `words` words, exactly as `plugsearch-index ingest` reads and cuts them, by a worker process of the parse pool
    under its CPU budget (RETRIEVER_PARSE__*; a request that ends stops its files' workers); a document's id is the
    file's `id`, else its `name`. The files that read fine are put in one change (durable before this answers,
    applied whole or not at all); each file refused is reported with its reason and the others are still put; when
    none reads fine this answers 422 and nothing changes. A file may hold up to `plugsearch-index ingest`'s default
    --max-mb once decoded, but the whole request must fit the retriever's request body limit
    (RETRIEVER_MAX_BODY_BYTES, 2 MiB by default; base64 adds a third): for large files raise it, or ingest
    them with `plugsearch-index ingest` and send the corpus with `plugsearch-index put`."""
    live = _changing(request)
    t0 = time.perf_counter()
    passages, results = await files_of(_pool(request), body)
    setattr(request.state, COST_STATE, float(max(1, len(passages) // 10)))
    if not passages:
        raise ValidationFailed("no file could be read (nothing changed): "
                               + "; ".join(f"{r.name}: {r.reason}" for r in results), param="files")
    change = await _write(live, passages, [])
    return PutFilesResponse(seq=change.seq if change is not None else live.seq, index_id=_service(request).index_id,
                            documents=sum(r.documents for r in results), passages=len(passages),
                            took_ms=round((time.perf_counter() - t0) * 1000, 3), files=results)


def _listing(request: Request) -> DocumentListing:
    svc = _service(request)
    listing: DocumentListing | None = getattr(request.app.state, "listing", None)
    if listing is None:
        listing = request.app.state.listing = DocumentListing(svc.corpus, svc.live)
    return listing


@router.post("/documents/delete", response_model=ChangeResponse, responses={**ERRORS, **CHANGE_ERRORS})
async def delete_documents(body: DeleteDocumentsRequest, request: Request) -> ChangeResponse:
    """Delete documents (every passage of each); durable before this answers. `documents` and `passages`: those
    deleted (ids not served change nothing: no change is logged and the index id stays)."""
    live = _changing(request)
    t0 = time.perf_counter()
    ids = list(dict.fromkeys(body.ids))
    listing = _listing(request)
    removed = await asyncio.to_thread(listing.served_passages, ids)
    change = await _write(live, [], ids)
    if change is None:
        removed = 0
    return ChangeResponse(seq=change.seq if change is not None else live.seq,
                          documents=len(change.delete) if change is not None else 0, passages=removed,
                          index_id=_service(request).index_id, took_ms=round((time.perf_counter() - t0) * 1000, 3))


@router.get("/documents", response_model=DocumentList, responses={**ERRORS, **CHANGE_ERRORS})
async def list_documents(query: Annotated[ListDocumentsQuery, Query()], request: Request) -> DocumentList:
    """The documents served, in id order, each with its passage count and its content hash (`sha256` over its
    passages: what `plugsearch-index sync` compares a folder's files with); `prefix` keeps the ids that start with
    it, a page holds `limit` (at most 10,000), `next` is the `after` of the next page (null: the last page). The
    first listing reads the built corpus once. Needs the internal token or an admin key."""
    _may_change(request)
    await _catch_up(request)
    listing = _listing(request)
    found, following = await asyncio.to_thread(listing.page, after=query.after, prefix=query.prefix,
                                               limit=query.limit)
    return DocumentList(documents=[ListedDocument(id=d.id, passages=d.passages, sha256=d.sha256) for d in found],
                        next=following, index_id=_service(request).index_id)


async def _catch_up(request: Request) -> None:
    svc = _service(request)
    if svc.live is not None:
        await svc.catch_up()


@router.get("/index", response_model=IndexState, responses=ERRORS)
async def index_state(request: Request) -> IndexState:
    """The served index's identity now (`index_id`; `seq`, the last change applied), every change acknowledged
    by any worker before this request applied first: what the searcher reads before it answers from its cache,
    so no cached result from before an acknowledged change is served."""
    await _catch_up(request)
    svc = _service(request)
    return IndexState(index_id=svc.index_id, seq=svc.live.seq if svc.live is not None else 0)


async def follow_changes(service: RetrieverService, settings: RetrieverSettings) -> None:
    """Apply the changes other workers acknowledge, every RETRIEVER_CHANGES_POLL_S (each worker follows the log, and
    moves to a generation compaction made); start a compaction when the overlay has grown past
    RETRIEVER_COMPACT_AFTER."""
    live = service.live
    if live is None:
        return
    compactor = Compactor(service, settings)
    try:
        while True:
            await asyncio.sleep(settings.changes_poll_s)
            try:
                await asyncio.to_thread(live.poll)
            except Exception:  # a bad read is retried at the next poll; the log keeps the trace
                logger.exception("reading the change log failed")
            await compactor.check()
    finally:
        await compactor.stop()


COMPACT_RETRY_S = 60.0
"""How long after a compaction child ended (or found another running) before this worker may start another."""
COMPACT_REFUSED_S = 600.0
"""How long after a compaction was refused (exit 3: the reason is in the log) before it is tried again."""
COMPACT_NICE = 5
"""CPU priority of the compaction child: it is background work beside the searches."""


class Compactor:
    """Starts `plugsearch-index compact` in a child process when the overlay holds RETRIEVER_COMPACT_AFTER passages or
    more (one at a time per log: a second child finds the first's lock and exits); every worker moves to the new
    generation at its next poll."""

    def __init__(self, service: RetrieverService, settings: RetrieverSettings) -> None:
        self.service, self.settings = service, settings
        self.child: asyncio.subprocess.Process | None = None
        self.next_try = 0.0

    def due(self) -> bool:
        live, threshold = self.service.live, self.settings.compact_after
        if live is None or not threshold or not live.writable or time.monotonic() < self.next_try:
            return False
        if self.settings.dense and "dense" not in self.service.retrievers:
            return False  # the dense index is still pending: compaction needs its vectors
        return live.state.overlay_passages >= threshold

    async def check(self) -> None:
        child = self.child
        if child is not None:
            if child.returncode is None:
                return
            self.child = None
            refused = child.returncode == 3
            self.next_try = time.monotonic() + (COMPACT_REFUSED_S if refused else COMPACT_RETRY_S)
            if child.returncode:
                logger.error("the compaction child exited with %s (its reason is in the lines above): tried again "
                             "in %.0f s", child.returncode, COMPACT_REFUSED_S if refused else COMPACT_RETRY_S)
            return
        if not self.due():
            return
        live = self.service.live
        assert live is not None
        argv = [sys.executable, "-m", "plugsearch.retriever.cli", "compact", "--quiet", "--nice", str(COMPACT_NICE)]
        self.child = await asyncio.create_subprocess_exec(
            *argv, env={**os.environ, **build_env(self.settings, COMPACT_SETTINGS)}, stdin=asyncio.subprocess.DEVNULL)
        logger.info("the changes hold %d passages beside the indexes (RETRIEVER_COMPACT_AFTER=%d): compacting in the "
                    "background (pid %s)", live.state.overlay_passages, self.settings.compact_after, self.child.pid)

    async def stop(self) -> None:
        child = self.child
        if child is not None and child.returncode is None:
            child.terminate()  # its temporary folder is removed by the next compaction
            try:
                await asyncio.wait_for(child.wait(), BUILDER_STOP_S)
            except TimeoutError:
                child.kill()
                await child.wait()


BUILDER_STOP_S = 10.0
"""How long the dense build child gets to stop (SIGTERM) when the service stops; its finished chunks stay on
disk and the next build resumes from them."""


BUILD_SETTINGS = {"corpus", "index_dir", "dense_backend", "encoder", "faiss", "milvus", "log_level"}
"""The settings a dense build reads (`plugsearch-index build`), handed to the build child as RETRIEVER_* variables."""
COMPACT_SETTINGS = BUILD_SETTINGS | {"bm25", "bm25_backend", "bm25_k1", "bm25_b", "dense", "changes_dir"}
"""The settings compaction reads (`plugsearch-index compact`)."""


def build_env(settings: RetrieverSettings, keys: set[str] = BUILD_SETTINGS) -> dict[str, str]:
    """`settings`' index settings (`keys`) as the environment `RetrieverSettings` reads (RETRIEVER_ENCODER__NAME,
    ...), so a child builds exactly the index this service serves or waits for, however the service got its
    settings."""
    env: dict[str, str] = {}

    def put(name: str, value: Any) -> None:
        if isinstance(value, dict):
            for key, item in value.items():
                put(f"{name}__{key.upper()}", item)
        elif value is not None:
            env[name] = value if isinstance(value, str) else json.dumps(value)

    for key, value in settings.model_dump(mode="json", include=keys).items():
        put(f"RETRIEVER_{key.upper()}", value)
    token = settings.milvus.token
    env.pop("RETRIEVER_MILVUS__TOKEN", None)  # dumped masked
    if token is not None:
        env["RETRIEVER_MILVUS__TOKEN"] = token.get_secret_value()
    return env


async def pending_dense(service: RetrieverService, settings: RetrieverSettings, checked: IndexCheck) -> None:
    """Serve the dense index once it is there: with RETRIEVER_DENSE_MISSING=build, build it first in a child
    process (its output, progress lines included, in this service's log); then look for it every
    `dense_poll_s` and load it into `service`. A failed build leaves BM25 serving, said in /version."""
    builder: asyncio.subprocess.Process | None = None
    if settings.dense_missing == "build":
        argv = [sys.executable, "-m", "plugsearch.retriever.cli", "build", "--bm25", "none", "--dense", "--quiet"]
        builder = await asyncio.create_subprocess_exec(*argv, env={**os.environ, **build_env(settings)},
                                                       stdin=asyncio.subprocess.DEVNULL)
        logger.info("building the dense index in the background (pid %s): BM25 serves until it is loaded",
                    builder.pid)
    else:
        logger.info("waiting for the dense index (built elsewhere): BM25 serves until it is loaded")
    try:
        while True:
            done = builder is not None and builder.returncode is not None
            try:
                manifest = await asyncio.to_thread(check_dense, settings, checked.corpus_checksum)
            except (IndexMissing, IndexMismatch):
                if done and builder is not None:
                    service.dense_status = f"build failed (exit {builder.returncode}): serving BM25 alone"
                    logger.error("the dense index build failed (exit %s): serving BM25 alone; see the lines "
                                 "above, fix, and restart to build it again", builder.returncode)
                    return
                if builder is not None:
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(builder.wait(), settings.dense_poll_s)
                else:
                    await asyncio.sleep(settings.dense_poll_s)
                continue
            t0 = time.perf_counter()
            dense = await asyncio.to_thread(load_dense, settings)
            await asyncio.to_thread(service.add_dense, dense, manifest)
            logger.info("dense index loaded in %.1f s: serving %s (index_id %s)", time.perf_counter() - t0,
                        ", ".join(service.methods), service.index_id)
            return
    finally:
        if builder is not None and builder.returncode is None:
            builder.terminate()
            try:
                await asyncio.wait_for(builder.wait(), BUILDER_STOP_S)
            except TimeoutError:
                builder.kill()
                await builder.wait()


def create_app(settings: RetrieverSettings, *, check: IndexCheck | None = None) -> FastAPI:
    """The retriever app; `check` reuses a start-up index check (else the lifespan runs one)."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        metrics = SearchMetrics(app.state.metrics.registry)
        checked = check if check is not None else await asyncio.to_thread(check_indexes, settings)

        async def load() -> None:
            try:
                service = await asyncio.to_thread(RetrieverService.load, settings, checked, metrics=metrics)
            except Exception as exc:  # readiness reports it; the log has the trace
                logger.exception("loading the indexes failed")
                app.state.startup_error = f"loading failed: {type(exc).__name__}: {exc}"
                return
            pending = checked.dense_pending is not None and "dense" not in service.retrievers  # (a generation
            # compaction built holds its own)
            if pending:
                service.dense_status = "building" if settings.dense_missing == "build" else "waiting"
            app.state.retriever = service
            following = asyncio.create_task(follow_changes(service, settings))
            try:
                if pending:
                    await pending_dense(service, settings, checked)
                await following
            finally:
                following.cancel()

        loading = asyncio.create_task(load())

        async def ready() -> dict[str, str]:
            loaded: RetrieverService | None = app.state.retriever
            if loaded is not None:
                return {"indexes": await loaded.health()}
            return {"indexes": app.state.startup_error or "loading"}

        app.state.readiness = ready
        app.state.parse_pool = ParsePool(settings.parse)
        try:
            yield
        finally:
            app.state.parse_pool.close()
            if not loading.done() and app.state.retriever is not None:
                loading.cancel()  # following the change log, or waiting for (or building) the dense index:
                # stops (a build resumes at the next start)
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
