"""The retriever's HTTP API: a thin router over `RetrieverService` (`POST /retrieve`, and `POST
/searchr1/retrieve` in the Search-R1 / veRL search-tool shape). The manifests are checked before the app
serves; the heavy loading runs in the background and `/health/ready` turns green once it is done. A dense
index still pending (RETRIEVER_DENSE_MISSING wait / build) is loaded when it appears, BM25 serving meanwhile;
with `build` this service builds it itself in a child process (`plugsearch-index build`).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import json
import logging
import os
import sys
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import PurePosixPath
from typing import Any

from fastapi import FastAPI, Request, Response
from pydantic import TypeAdapter, ValidationError

from plugsearch.common import tracing
from plugsearch.common.admission import CALLER_STATE, COST_STATE, Caller
from plugsearch.common.app import build_app, from_state, service_router
from plugsearch.common.errors import (
    BadRequest,
    Conflict,
    Forbidden,
    NotReady,
    ValidationFailed,
    error_responses,
)
from plugsearch.common.schemas.retriever import (
    MAX_PUT_PASSAGES,
    ChangeResponse,
    DeleteDocumentsRequest,
    DocumentId,
    DocumentIn,
    FileIn,
    FileResult,
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
from plugsearch.retriever.ingest.passages import Passage
from plugsearch.retriever.live.changelog import Change, ChangeNotWritten
from plugsearch.retriever.live.overlay import LiveIndex, doc_id_of
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


CHANGE_ERRORS = error_responses({
    403: "the caller may not change documents (the internal token or a RETRIEVER_ADMIN_KEYS key may; a search key "
         "never)", 409: "documents cannot change on this retriever (RETRIEVER_CHANGES=off, or a backend that cannot)",
    503: "indexes still loading, or the change log cannot be written (nothing changed); retry after Retry-After"})


def _changing(request: Request) -> LiveIndex:
    """The live index of a caller who may change documents: the internal token, or an admin key."""
    caller = getattr(request.state, CALLER_STATE, None)
    settings: RetrieverSettings = request.app.state.settings
    allowed = isinstance(caller, Caller) and (caller.kind == "internal"
                                              or (caller.kind == "key" and caller.id in settings.admin_ids()))
    if not allowed:
        raise Forbidden("changing documents needs the internal token or an admin key (RETRIEVER_ADMIN_KEYS); "
                        + ("a search key may only search" if isinstance(caller, Caller) and caller.kind == "key"
                           else "this retriever has none configured"))
    svc = _service(request)
    if svc.live is None:
        raise Conflict(f"documents cannot change on this retriever: {svc.changes_off}")
    return svc.live


def passages_of(documents: list[DocumentIn]) -> list[Passage]:
    """Each document's passages, `<id>#0`, `<id>#1`, ...: as given, or its text read and cut as `plugsearch-index
    ingest` reads and cuts a text file (paragraphs, then sentences packed to about 100 words: `cut_file`)."""
    from plugsearch.retriever.ingest.formats import SkipFile
    from plugsearch.retriever.ingest.passages import numbered
    from plugsearch.retriever.ingest.run import cut_file

    out: list[Passage] = []
    for doc in documents:
        if doc.passages is not None:
            passages = numbered(doc.id, [(p.title or doc.title, p.text) for p in doc.passages])
        else:
            try:
                passages = cut_file("text", (doc.text or "").encode(), name=doc.title, doc_id=doc.id, source=doc.id)
            except SkipFile as exc:
                raise BadRequest(f"document {doc.id!r}: {exc}", param="documents") from exc
        if not passages:
            raise BadRequest(f"document {doc.id!r} has no text", param="documents")
        out.extend(passages)
    return out


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


@router.put("/documents", response_model=ChangeResponse, responses={**ERRORS, **CHANGE_ERRORS})
async def put_documents(body: PutDocumentsRequest, request: Request) -> ChangeResponse:
    """Add documents, or replace them whole (every passage of a document already served, by its id): durable
    before this answers, searched by every worker within RETRIEVER_CHANGES_POLL_S (this one at once)."""
    live = _changing(request)
    passages = passages_of(body.documents)
    setattr(request.state, COST_STATE, float(max(1, len(passages) // 10)))
    t0 = time.perf_counter()
    change = await _write(live, passages, [])
    return ChangeResponse(seq=change.seq if change is not None else live.seq, documents=len(body.documents),
                          passages=len(passages),
                          index_id=_service(request).index_id, took_ms=round((time.perf_counter() - t0) * 1000, 3))


_DOCUMENT_ID: TypeAdapter[str] = TypeAdapter(DocumentId)


def _read_one(file: FileIn, words: int, max_bytes: int) -> list[Passage]:
    """One file's passages, read and cut as `plugsearch-index ingest` does (`ingest.run.read_data`); SkipFile
    when it is refused. A .jsonl file's rows are grouped into documents by their ids (`<doc>#<n>`), each
    document's passages numbered again from 0, as `plugsearch-index put` sends them."""
    from plugsearch.retriever.ingest.formats import FORMATS, SkipFile
    from plugsearch.retriever.ingest.passages import numbered
    from plugsearch.retriever.ingest.run import kind_of, read_data

    jsonl = FORMATS[kind_of(file.name)].is_corpus
    if jsonl and (file.id is not None or file.title is not None):
        raise SkipFile("a .jsonl file's rows name their own documents and titles: give it no `id` or `title`")
    try:
        data = base64.b64decode("".join(file.content_base64.split()), validate=True)
    except binascii.Error as exc:
        raise SkipFile(f"content_base64 is not valid base64 ({exc})") from exc
    doc_id = file.id or file.name
    _, read = read_data(file.name, data, doc_id=doc_id, words=words, max_bytes=max_bytes, title=file.title)
    documents: dict[str, list[tuple[str, str]]] = {}
    for p in read:
        documents.setdefault(doc_id_of(p.id) if jsonl else doc_id, []).append((p.title, p.text))
    for doc, parts in documents.items():
        try:
            _DOCUMENT_ID.validate_python(doc)
        except ValidationError as exc:
            raise SkipFile(f"{doc!r} is not a document id (1 to 512 characters, no spaces, not starting with "
                           "'#')" + ("" if jsonl else ": give the file an `id`")) from exc
        if len(parts) > MAX_PUT_PASSAGES:
            raise SkipFile(f"document {doc!r} has {len(parts):,} passages, over the limit of {MAX_PUT_PASSAGES:,}")
    return [passage for doc, parts in documents.items() for passage in numbered(doc, parts)]


def files_of(body: PutFilesRequest) -> tuple[list[Passage], list[FileResult]]:
    """The passages of the files that read fine, and each file's outcome: a file refused (bad base64, an
    extension no reader takes, not what its extension says, a PDF with no text layer, over the size limit, a
    document id another file of the request took first, ...) is skipped with its reason, the others go on."""
    from plugsearch.retriever.ingest.formats import FORMATS, SkipFile, format_of
    from plugsearch.retriever.ingest.passages import DEFAULT_WORDS
    from plugsearch.retriever.ingest.run import DEFAULT_MAX_MB, MB

    words, max_bytes = body.words or DEFAULT_WORDS, int(DEFAULT_MAX_MB * MB)
    taken: dict[str, str] = {}  # document id -> the file that put it
    passages: list[Passage] = []
    results: list[FileResult] = []
    for file in body.files:
        kind = format_of(PurePosixPath(file.name))
        corpus = kind is not None and FORMATS[kind].is_corpus  # its rows name their documents
        result = FileResult(name=file.name, id=None if corpus else file.id or file.name, status="skipped",
                            format=kind)
        try:
            if result.id is not None and result.id in taken:  # before reading it
                raise SkipFile(f"duplicate document id {result.id!r}: already taken by {taken[result.id]}")
            read = _read_one(file, words, max_bytes)
            documents = list(dict.fromkeys(p.doc_id for p in read))
            if clash := next((d for d in documents if d in taken), None):
                raise SkipFile(f"duplicate document id {clash!r}: already taken by {taken[clash]}")
        except SkipFile as exc:
            result.reason = exc.reason
        except Exception as exc:  # a reader's failure on one file never fails the others
            logger.warning("file %r could not be read", file.name, exc_info=True)
            result.reason = f"could not be read ({type(exc).__name__}); the retriever's log has the details"
        else:
            taken.update(dict.fromkeys(documents, file.name))
            passages += read
            result.status, result.documents, result.passages = "put", len(documents), len(read)
        results.append(result)
    return passages, results


FILE_ERRORS = error_responses({
    413: "the request body is over RETRIEVER_MAX_BODY_BYTES (2 MiB by default): send fewer files per request, "
         "raise the limit, or use `plugsearch-index ingest` then `plugsearch-index put`",
    422: "a bad request, or no file could be read (every file's reason in the message; nothing changed)"})


@router.post("/documents/files", response_model=PutFilesResponse, responses={**ERRORS, **CHANGE_ERRORS, **FILE_ERRORS})
async def put_files(body: PutFilesRequest, request: Request) -> PutFilesResponse:
    """Add or replace documents given as files (base64 in JSON): each read by the reader its name's extension
    asks for (text, Markdown, HTML, PDF's text layer, JSONL passages) and cut into passages of about `words`
    words, exactly as `plugsearch-index ingest` reads and cuts them; a document's id is the file's `id`, else
    its `name`. The files that read fine are put in one change (durable before this answers, applied whole or
    not at all); each file refused is reported with its reason and the others are still put; when none reads
    fine this answers 422 and nothing changes. A file may hold up to `plugsearch-index ingest`'s default
    --max-mb once decoded, but the whole request must fit the retriever's request body limit
    (RETRIEVER_MAX_BODY_BYTES, 2 MiB by default; base64 adds a third): for large files raise it, or ingest
    them with `plugsearch-index ingest` and send the corpus with `plugsearch-index put`."""
    live = _changing(request)
    t0 = time.perf_counter()
    passages, results = await asyncio.to_thread(files_of, body)  # parsing PDFs and HTML is CPU work
    setattr(request.state, COST_STATE, float(max(1, len(passages) // 10)))
    if not passages:
        raise ValidationFailed("no file could be read (nothing changed): "
                               + "; ".join(f"{r.name}: {r.reason}" for r in results), param="files")
    change = await _write(live, passages, [])
    return PutFilesResponse(seq=change.seq if change is not None else live.seq, index_id=_service(request).index_id,
                            documents=sum(r.documents for r in results), passages=len(passages),
                            took_ms=round((time.perf_counter() - t0) * 1000, 3), files=results)


@router.post("/documents/delete", response_model=ChangeResponse, responses={**ERRORS, **CHANGE_ERRORS})
async def delete_documents(body: DeleteDocumentsRequest, request: Request) -> ChangeResponse:
    """Delete documents (every passage of each); durable before this answers. `documents`: those deleted (ids not
    served change nothing: no change is logged and the index id stays)."""
    live = _changing(request)
    t0 = time.perf_counter()
    change = await _write(live, [], list(dict.fromkeys(body.ids)))
    return ChangeResponse(seq=change.seq if change is not None else live.seq,
                          documents=len(change.delete) if change is not None else 0, passages=0,
                          index_id=_service(request).index_id, took_ms=round((time.perf_counter() - t0) * 1000, 3))


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
        try:
            yield
        finally:
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
