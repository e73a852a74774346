"""The retriever's logic, independent of FastAPI: `check_indexes` (the cheap startup gate: the corpus
checksum against every manifest), `RetrieverService.load` (the heavy part), searches through one
`MicroBatcher` per backend (hybrid fuses the BM25 and dense results), response bodies (documents read from
the document store, `plugsearch.retriever.store.docstore`).

Every query is normalised as every reader normalises the text it reads (`plugsearch.common.text.normalize`: NFKC,
ligatures, control characters, whitespace; ASCII text is only whitespace-normalised), so `ﬁle` finds `file` and
the other way round; a query that normalises to nothing gets no hits. With several workers, a search first applies
the changes other workers acknowledged (`catch_up`), so no search sees the corpus from before a change that was
acknowledged before it began.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson
from prometheus_client import CollectorRegistry, Gauge, Histogram

from plugsearch.common.errors import BadRequest
from plugsearch.common.schemas.retriever import check_results
from plugsearch.common.text import normalize
from plugsearch.retriever.backends import registry
from plugsearch.retriever.backends.base import Hits, Retriever
from plugsearch.retriever.backends.dense import DenseRetriever
from plugsearch.retriever.backends.fusion import rrf_fuse
from plugsearch.retriever.batching import MicroBatcher
from plugsearch.retriever.encoders.encoder import Encoder
from plugsearch.retriever.live import carry
from plugsearch.retriever.live.changelog import (
    LEGACY_FILE,
    NO_GENERATION,
    ChangeLog,
    ChangeLogDamaged,
    ChangeLogError,
    Generation,
    log_folder,
    read_legacy,
)
from plugsearch.retriever.live.generations import Base, generation_settings
from plugsearch.retriever.live.overlay import LiveCorpus, LiveIndex
from plugsearch.retriever.settings import RetrieverSettings
from plugsearch.retriever.store.docstore import (
    DiskStore,
    DocumentStore,
    check_store,
    corpus_checksum,
    open_store,
    store_folder,
)
from plugsearch.retriever.store.manifest import IndexMismatch, IndexMissing, Manifest

logger = logging.getLogger(__name__)

BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 4096, 16384)
SEARCH_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)


@dataclass(frozen=True)
class IndexCheck:
    corpus_checksum: str
    manifests: dict[str, Manifest]
    dense_pending: str | None = None
    """Why the dense index is not there yet, when RETRIEVER_DENSE_MISSING lets the service start without it
    (BM25 serves meanwhile); None when it is there, or not configured."""


def check_indexes(settings: RetrieverSettings) -> IndexCheck:
    """Read every configured manifest and compare it with the corpus and settings (raises on mismatch; a
    missing or stale dense index only with RETRIEVER_DENSE_MISSING=refuse, else it is pending)."""
    checksum = corpus_checksum(settings.corpus, settings.index_dir)
    manifests: dict[str, Manifest] = {}
    pending: str | None = None
    if settings.bm25:
        manifests["bm25"] = registry.lexical(settings.bm25_backend).check(settings, checksum)
    if settings.dense:
        try:
            manifests["dense"] = check_dense(settings, checksum)
        except (IndexMissing, IndexMismatch) as exc:
            if settings.dense_missing == "refuse":
                raise
            pending = str(exc)
            logger.info("dense index not ready (%s): serving BM25 until it is (RETRIEVER_DENSE_MISSING=%s)",
                        pending, settings.dense_missing)
    return IndexCheck(checksum, manifests, pending)


def check_dense(settings: RetrieverSettings, checksum: str) -> Manifest:
    """The configured dense index's manifest, checked against the corpus, the encoder, its files (and what its
    store holds)."""
    return registry.dense(settings.dense_backend).check(settings, checksum)


def load_dense(settings: RetrieverSettings, encoder: Encoder | None = None) -> DenseRetriever:
    """The dense retriever of the configured index, its encoder loaded (or `encoder`, already loaded) and warmed up
    (blocking)."""
    dense = DenseRetriever(encoder or Encoder(settings.encoder), registry.dense(settings.dense_backend).open(settings))
    dense.batch_search(["warm up"], 1)
    return dense


def index_identity(settings: RetrieverSettings, corpus_checksum: str, manifests: dict[str, Manifest],
                   generation: int = 0) -> str:
    """What the served results depend on: the corpus, every loaded index (its manifest, build time included; for a
    generation compaction built, its own), the settings that change rankings. Callers put it in their cache keys
    (`/version` -> `index_id`), so a re-index never serves results cached from the old one."""
    payload: dict[str, Any] = {
        "corpus": corpus_checksum,
        **({"generation": generation} if generation else {}),
        "indexes": {name: m.model_dump(mode="json", exclude={"corpus_path", "build_seconds"})
                    for name, m in sorted(manifests.items())},
        "default_method": settings.default_method, "bm25": [settings.bm25_k1, settings.bm25_b],
        "query_prefix": settings.encoder.query_prefix if "dense" in manifests else None,
        "fusion": [settings.rrf_k, settings.fusion_depth],
    }
    if "dense" in manifests:  # query-time knobs of approximate search
        payload.update(registry.dense(settings.dense_backend).identity(settings, manifests["dense"].index_type))
    if "bm25" in manifests and (lexical := registry.LEXICAL.get(manifests["bm25"].backend)) is not None:
        payload.update(lexical.identity(settings))  # e.g. equal scores in another order
    digest = hashlib.sha256(orjson.dumps(payload, option=orjson.OPT_SORT_KEYS)).hexdigest()
    return f"idx-{digest[:20]}"


class SearchMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.seconds = Histogram("retriever_search_seconds", "one library call (a micro-batch)", ["method"],
                                 buckets=SEARCH_BUCKETS, registry=registry)
        self.batch = Histogram("retriever_batch_queries", "queries per library call", ["method"],
                               buckets=BATCH_BUCKETS, registry=registry)
        self.queued = Gauge("retriever_queued_queries", "queries waiting for a library call", ["method"],
                            registry=registry, multiprocess_mode="livesum")

    def observer(self, method: str) -> Callable[[int, float], None]:
        def observe(n: int, seconds: float) -> None:
            self.seconds.labels(method).observe(seconds)
            self.batch.labels(method).observe(n)

        return observe


class RetrieverService:
    def __init__(self, corpus: DocumentStore, retrievers: dict[str, Retriever], settings: RetrieverSettings,
                 *, index_id: str, metrics: SearchMetrics | None = None, check: IndexCheck | None = None,
                 live: LiveIndex | None = None) -> None:
        self.live = live
        """The changes made while serving (None: RETRIEVER_CHANGES off, or not servable here); with it, the
        retrievers and documents are those of its base (the built indexes, or the generation compaction built)."""
        if live is None:
            for name, retriever in retrievers.items():
                self._check_count(name, retriever, corpus)
        self._retrievers = retrievers
        self.changes_off: str | None = None
        """Why documents cannot be changed here (None: they can)."""
        self.corpus: DocumentStore = LiveCorpus(live) if live is not None else corpus  # type: ignore[assignment]
        self.settings = settings
        self.metrics = metrics
        self.base_index_id = index_id
        self._identities: dict[int, str] = {}
        self.check = check
        self.dense_status: str | None = None
        """While the dense index is pending: `waiting` for it, `building` it, or why its build failed."""
        self.batchers = {name: self._batcher(name, r) for name, r in self.retrievers.items()}
        self._polls = 0
        self._poll_lock: asyncio.Lock | None = None

    async def catch_up(self) -> None:
        """Apply the changes any worker acknowledged before this call (`LiveIndex.poll`, in a thread). Calls that
        arrive while a read runs share the next one: a read that began after they arrived, one at a time."""
        if self.live is None:
            return
        if self._poll_lock is None:
            self._poll_lock = asyncio.Lock()
        wanted = self._polls + 1
        async with self._poll_lock:
            if self._polls >= wanted:  # a read that began after this call arrived has finished meanwhile
                return
            self._polls += 1
            await asyncio.to_thread(self.live.poll)

    @property
    def retrievers(self) -> dict[str, Retriever]:
        """The served retrievers by method (with live changes: its base's, which compaction replaces)."""
        return self.live.view.base.retrievers if self.live is not None else self._retrievers

    @staticmethod
    def _check_count(name: str, retriever: Retriever, corpus: DocumentStore) -> None:
        if retriever.doc_count != len(corpus):
            raise IndexMismatch(f"{name} index holds {retriever.doc_count} documents, corpus "
                                f"{corpus.path} has {len(corpus)}")

    def _batcher(self, name: str, retriever: Retriever) -> MicroBatcher:
        metrics = self.metrics
        search = retriever.batch_search if self.live is None else self.live.retriever(name).batch_search
        return MicroBatcher(name, search, max_batch=self.settings.max_batch_queries,
                            max_chars=self.settings.max_batch_chars,
                            max_queue=self.settings.max_queue, workers=self._workers(name),
                            observe=metrics.observer(name) if metrics is not None else None)

    def add_dense(self, dense: DenseRetriever, manifest: Manifest) -> None:
        """Serve the dense index that was pending (built while BM25 served): `dense` and `hybrid` join
        `methods`, and `index_id` changes (callers' cache keys of the BM25-only time are left behind). The passages
        put meanwhile are encoded by the live index's catch-up, in batches, off the event loop (blocking: run it in a
        thread)."""
        if self.live is not None:
            self._check_count("dense", dense, self.live.view.base.store)
            self.live.add_dense(dense, dense.encoder, dense.index.mirror())
        else:
            self._check_count("dense", dense, self.corpus)
            self._retrievers["dense"] = dense
        self.batchers["dense"] = self._batcher("dense", dense)
        if self.check is not None:
            self.check = IndexCheck(self.check.corpus_checksum, {**self.check.manifests, "dense": manifest})
            self.base_index_id = index_identity(self.settings, self.check.corpus_checksum, self.check.manifests)
            if self.live is not None:
                self.live.view.base.manifests["dense"] = manifest
        self.dense_status = None

    @property
    def index_id(self) -> str:
        """The served indexes' identity (the built ones, or the generation compaction built), and the changes
        applied over them (a cache keyed on it never serves a result from before a change)."""
        live = self.live
        if live is None:
            return self.base_index_id
        base = live.view.base
        generation = base.generation.gen
        identity = self.base_index_id if generation == 0 else self._identities.get(generation)
        if identity is None:
            identity = self._identities[generation] = index_identity(self.settings, live.corpus_checksum,
                                                                     base.manifests, generation)
        tag = live.tag
        return f"{identity}-{tag}" if tag else identity

    def _workers(self, method: str) -> int:
        """Library calls run at once for `method` (as its backend's registry entry says)."""
        if method == "bm25":
            return registry.lexical(self.settings.bm25_backend).search_workers(self.settings)
        return 1

    @property
    def methods(self) -> list[str]:
        return list(self.retrievers) + (["hybrid"] if {"bm25", "dense"} <= self.retrievers.keys() else [])

    @classmethod
    def load(cls, settings: RetrieverSettings, check: IndexCheck, *,
             metrics: SearchMetrics | None = None) -> RetrieverService:
        """Heavy start-up: the document store opened (built when missing), indexes opened, encoder loaded
        (blocking; run it in a thread)."""
        t0 = step = time.perf_counter()

        def opened(what: str) -> None:  # start-up prints each part as it is ready (minutes at wiki-18's size)
            nonlocal step
            logger.info("%s ready in %.1f s", what, time.perf_counter() - step)
            step = time.perf_counter()

        corpus = open_store(settings.corpus, settings.index_dir, check.corpus_checksum, mode=settings.docstore)
        opened(f"document store ({len(corpus):,} passages, {settings.docstore})")
        off = changes_refusal(settings)
        log, log_error = (None, None) if off is not None else open_change_log(settings, corpus)
        generation = _generation(log, settings)
        try:
            if generation.gen:
                assert log is not None
                corpus.close()
                base = load_generation(settings, log.folder, generation)
                opened(f"generation {generation.gen} of the changes ({log.folder / str(generation.body['folder'])}: "
                       f"{len(base.store):,} passages, changes up to {generation.folded} folded in)")
            else:
                base = _load_built(settings, check, corpus, opened, with_live=off is None)
            live: LiveIndex | None = None
            if off is None:
                live = LiveIndex(log, base, loader=_loader(settings, log), on_error=settings.changes_on_error,
                                 wait_s=settings.changes_poll_s,
                                 error=refused_reason(log_error) if log_error is not None else None,
                                 changes=log_error.changes if log_error is not None and log is None else ())
                _report(live)
        except ChangeLogError as exc:
            if log is not None:
                log.close()
            raise ChangesRefused(refused_reason(exc)) from exc
        served = live.view.state.served if live is not None else len(base.store)
        logger.info("retriever ready in %.1f s: %s over %s documents%s", time.perf_counter() - t0,
                    ", ".join(base.retrievers), served,
                    " (the dense index is not ready: BM25 serves until it is)" if check.dense_pending else "")
        service = cls(base.store, base.retrievers, settings, metrics=metrics, check=check, live=live,
                      index_id=index_identity(settings, check.corpus_checksum, check.manifests))
        service.changes_off = off
        return service

    def _check_size(self, queries: int, k: int) -> None:
        if k > self.settings.max_k:
            raise BadRequest(f"k must be at most {self.settings.max_k}", param="k")
        try:
            check_results(queries, k)  # the schemas check it too; here for a default k (Search-R1's topk)
        except ValueError as exc:
            raise BadRequest(str(exc), param="k") from exc

    async def search(self, queries: Sequence[str], k: int, method: str | None) -> tuple[str, Hits]:
        """The top `k` of each query (normalised first: module docstring)."""
        method = method or self.settings.default_method
        self._check_size(len(queries), k)
        queries = [normalize(q) for q in queries]
        if not all(q.strip() for q in queries):  # nothing searchable left (only invisible characters): no hits
            return method, await self.search_skipping_blank(queries, k, method)
        if self.settings.workers > 1:
            await self.catch_up()
        return method, await self._search(queries, k, method)

    async def _search(self, queries: list[str], k: int, method: str) -> Hits:
        if method == "hybrid" and "hybrid" in self.methods:
            depth = max(k, self.settings.fusion_depth)
            for _ in range(2):  # both runs from one generation (positions of two would fuse a passage twice)
                generation = self.live.generation if self.live is not None else 0
                sparse, dense = await asyncio.gather(self.batchers["bm25"].submit(queries, depth),
                                                     self.batchers["dense"].submit(queries, depth))
                if self.live is None or self.live.generation == generation:
                    break
            return await asyncio.to_thread(rrf_fuse, [sparse, dense], k, self.settings.rrf_k)
        if method not in self.batchers:
            raise BadRequest(f"method {method!r} is not served here (available: {', '.join(self.methods)})",
                             param="method")
        batcher = self.batchers[method]
        if self.metrics is not None:
            self.metrics.queued.labels(method).set(batcher.queued)
        return await batcher.submit(queries, k)

    async def search_each(self, queries: Sequence[str], k: int, methods: Sequence[str | None]
                          ) -> tuple[list[str], Hits]:
        """Each query with its own method (None: the default): one search per method, run together, the
        rows back in query order. Returns the methods searched, per query."""
        self._check_size(len(queries), k)
        default = self.settings.default_method
        wanted = [m or default for m in methods]
        groups: dict[str, list[int]] = {}
        for i, method in enumerate(wanted):
            groups.setdefault(method, []).append(i)
        unserved = [m for m in groups if m not in self.methods]
        if unserved:
            raise BadRequest(f"method {unserved[0]!r} is not served here (available: {', '.join(self.methods)})",
                             param="methods")
        if len(groups) == 1:
            method, hits = await self.search(queries, k, wanted[0])
            return [method] * len(queries), hits
        found = await asyncio.gather(*(self.search([queries[i] for i in rows], k, method)
                                       for method, rows in groups.items()))
        hits = Hits.empty(len(queries), k)
        for rows, (_, part) in zip(groups.values(), found, strict=True):
            width = min(k, part.k)
            hits.ids[rows, :width] = part.ids[:, :width]
            hits.scores[rows, :width] = part.scores[:, :width]
        return wanted, hits

    async def search_skipping_blank(self, queries: Sequence[str], k: int, method: str | None) -> Hits:
        """`search`, where a blank query gets no hits instead of failing the batch (Search-R1's server
        answers a `<search> </search>` with an empty list; a training run must not die on one)."""
        self._check_size(len(queries), k)
        queries = [normalize(q) for q in queries]
        live = [i for i, q in enumerate(queries) if q.strip()]
        if len(live) == len(queries):
            return (await self.search(queries, k, method))[1]
        hits = Hits.empty(len(queries), k)
        if live:
            _, found = await self.search([queries[i] for i in live], k, method)
            width = min(k, found.k)
            hits.ids[live, :width] = found.ids[:, :width]
            hits.scores[live, :width] = found.scores[:, :width]
        return hits

    def _rows(self, hits: Hits) -> list[list[tuple[tuple[str, str, str], float]]]:
        """Per query, ((id, title, text), score) of its hits: one read of the store for the whole batch."""
        ids, scores = hits.ids.tolist(), hits.scores.tolist()
        docs = iter(self.corpus.documents([d for row in ids for d in row if d >= 0]))
        return [[(next(docs), s) for d, s in zip(row_ids, row_scores, strict=True) if d >= 0]
                for row_ids, row_scores in zip(ids, scores, strict=True)]

    def documents(self, hits: Hits) -> list[list[dict[str, Any]]]:
        return [[{"id": doc_id, "title": title, "text": text, "score": s} for (doc_id, title, text), s in row]
                for row in self._rows(hits)]

    def render(self, method: str, hits: Hits, took_ms: float, methods: Sequence[str] | None = None) -> bytes:
        body: dict[str, Any] = {"method": method, "results": self.documents(hits), "took_ms": round(took_ms, 3)}
        if methods is not None:
            body["methods"] = list(methods)
        return orjson.dumps(body)

    def render_searchr1(self, hits: Hits, return_scores: bool) -> bytes:
        result = []
        for row in self._rows(hits):
            docs = [({"id": doc_id, "contents": f'"{title}"\n{text}'}, s) for (doc_id, title, text), s in row]
            result.append([{"document": doc, "score": s} for doc, s in docs] if return_scores
                          else [doc for doc, _ in docs])
        return orjson.dumps({"result": result})

    def sample(self, n: int, seed: int) -> bytes:
        """`n` passages drawn at random (by `seed`) from the served corpus (`SampleResponse`): what the searcher
        makes its pseudo-questions of when it checks its policy on this corpus."""
        if self.live is not None:
            positions, total = self.live.sample(n, seed)
        else:
            total = len(self.corpus)
            positions = random.Random(seed).sample(range(total), min(n, total))
        docs = self.corpus.documents(positions)
        return orjson.dumps({"passages": [{"id": i, "title": t, "text": x} for i, t, x in docs],
                             "total": total, "index_id": self.index_id})

    def describe(self) -> dict[str, Any]:
        live = self.live
        state = live.state if live is not None else None
        return {"methods": self.methods, "default_method": self.settings.default_method,
                "documents": state.served if state is not None else len(self.corpus),
                "corpus_checksum": self.corpus.checksum, "index_id": self.index_id,
                "changes": None if live is None or state is None else {
                    "seq": state.seq, **state.changed, "generation": live.generation,
                    "built_index_id": self.base_index_id,
                    "overlay_passages": state.overlay_passages, "pending_vectors": live.pending_vectors(),
                    "writable": live.writable},
                "changes_off": self.changes_off,
                "changes_error": live.error if live is not None else None,
                "bm25_backend": self.settings.bm25_backend if "bm25" in self.retrievers else None,
                "dense_index": self.settings.dense_index_type() if "dense" in self.retrievers else None,
                "dense_backend": self.settings.dense_backend if "dense" in self.retrievers else None,
                "encoder": self.settings.encoder.name if "dense" in self.retrievers else None,
                "dense_pending": self.dense_status if self.settings.dense and "dense" not in self.retrievers
                else None,
                **self._encoder_details()}

    def _encoder_details(self) -> dict[str, Any]:
        """Which encoder backend serves the dense queries (auto: onnx, or torch and why)."""
        dense = self.retrievers.get("dense")
        return {"encoder_backend": None, "encoder_fallback": None, **(dense.describe() if dense is not None else {})}

    async def health(self) -> str:
        """Readiness of the loaded indexes: "ok", or why not (a dense store that does not answer, a change log found
        damaged while serving, with RETRIEVER_CHANGES_ON_ERROR=refuse)."""
        live = self.live
        if live is not None and live.error is not None and self.settings.changes_on_error == "refuse":
            return f"the change log: {live.error}"
        dense = self.retrievers.get("dense")
        if dense is not None and not await asyncio.to_thread(dense.ping):
            return f"the dense index's {self.settings.dense_backend.capitalize()} does not answer"
        return "ok"

    async def aclose(self) -> None:
        for batcher in self.batchers.values():
            await batcher.aclose()
        if self.live is not None:
            await asyncio.to_thread(self.live.close)  # its bases: retrievers and documents
            return
        for retriever in self.retrievers.values():
            retriever.close()
        self.corpus.close()


class ChangesRefused(RuntimeError):
    """The change log cannot be served as it is, and RETRIEVER_CHANGES_ON_ERROR=refuse: the retriever is not ready
    (the message says why, which record, and what to do)."""


def refused_reason(exc: ChangeLogError) -> str:
    where = f" (record {exc.record})" if exc.record is not None else ""
    served = (f"the {len(exc.changes)} changes read before it" if isinstance(exc, ChangeLogDamaged)
              else "what it holds")
    return (f"{exc.reason}{where}. Not serving the built corpus as if no change had been acknowledged: repair or "
            f"restore the log (docs/operations.md, 'Changes: durability and recovery'), or serve {served} read-only "
            "(RETRIEVER_CHANGES_ON_ERROR=read-only)")


def change_log_folder(settings: RetrieverSettings, checksum: str) -> Path:
    """One log per corpus checksum."""
    return log_folder(settings.index_dir, settings.changes_dir, checksum)


def changes_refusal(settings: RetrieverSettings) -> str | None:
    """Why documents cannot change here at all (None: they can)."""
    if settings.changes == "off":
        return "RETRIEVER_CHANGES=off"
    if settings.bm25 and not registry.lexical(settings.bm25_backend).live_changes:
        return registry.live_changes_refusal()
    return None


def open_change_log(settings: RetrieverSettings, corpus: DocumentStore
                    ) -> tuple[ChangeLog | None, ChangeLogError | None]:
    """The corpus's change log. When it cannot be used as it is: ChangesRefused (RETRIEVER_CHANGES_ON_ERROR=refuse),
    or, with read-only, the log opened for reading only (None when even that fails) and why."""
    folder = change_log_folder(settings, corpus.checksum)
    try:
        registry = carry.registry_path(settings.index_dir, settings.changes_dir)
        why = carry.refusal(registry, settings.corpus, corpus.checksum)
        if why is not None:
            raise carry.ChangesNotCarried(why)
        log = ChangeLog(folder)
        carry.register(registry, settings.corpus, corpus.checksum, folder)
        return log, None
    except ChangeLogError as exc:
        if settings.changes_on_error == "refuse":
            raise ChangesRefused(refused_reason(exc)) from exc
        logger.error("the change log cannot be used as it is (%s): serving what it holds read-only "
                     "(RETRIEVER_CHANGES_ON_ERROR=read-only), changes refused", exc.reason)
        try:
            return ChangeLog(folder, writable=False), exc
        except ChangeLogError as unreadable:
            return None, _legacy_read_only(folder, exc, unreadable)


def _legacy_read_only(folder: Path, exc: ChangeLogError, unreadable: ChangeLogError) -> ChangeLogError:
    """Why a log cannot be read either, with the changes of a legacy JSONL log that could not be migrated (a
    read-only file system at the first start after the upgrade): those are served."""
    legacy = folder / LEGACY_FILE
    changes = []
    if legacy.is_file():
        try:
            changes = [change for change, _ in read_legacy(legacy)[0]]
        except ChangeLogDamaged as damaged:
            changes = damaged.changes
        except OSError:
            changes = []
    if changes:
        logger.error("the change log cannot be migrated (%s): serving the %d changes of %s read-only", exc.reason,
                     len(changes), legacy)
        return type(exc)(exc.reason, record=exc.record, changes=changes)
    logger.error("the change log cannot be read either (%s): serving the built corpus read-only, its index id marked "
                 "partial", unreadable.reason)
    return exc


def _generation(log: ChangeLog | None, settings: RetrieverSettings) -> Generation:
    if log is None:
        return NO_GENERATION
    try:
        return log.generation()
    except ChangeLogError as exc:
        if settings.changes_on_error == "refuse":
            log.close()
            raise ChangesRefused(refused_reason(exc)) from exc
        return NO_GENERATION


def _load_built(settings: RetrieverSettings, check: IndexCheck, corpus: DocumentStore,
                opened: Callable[[str], None], *, with_live: bool) -> Base:
    """The built indexes (generation 0)."""
    retrievers: dict[str, Retriever] = {}
    lexical = None
    dense: DenseRetriever | None = None
    if settings.bm25:
        entry = registry.lexical(settings.bm25_backend)
        retrievers["bm25"] = bm25 = entry.load(settings, corpus)
        lexical = entry.overlay(bm25) if with_live else None
        opened(f"BM25 ({settings.bm25_backend})")
    if settings.dense and "dense" in check.manifests:
        retrievers["dense"] = dense = load_dense(settings)
        opened(f"dense index ({settings.dense_backend} {settings.dense_index_type()}) and its encoder")
    return Base(NO_GENERATION, corpus, retrievers, dict(check.manifests), lexical,
                dense.encoder if dense is not None else None,
                dense.index.mirror() if dense is not None and with_live else None)


def load_generation(settings: RetrieverSettings, log_folder: Path, generation: Generation, *,
                    encoder: Encoder | None = None) -> Base:
    """The indexes of a generation compaction built (`plugsearch.retriever.live.compaction`), checked against the
    settings as the built ones are (blocking)."""
    folder = log_folder / str(generation.body["folder"])
    gs = generation_settings(settings, folder)
    checksum = str(generation.body["corpus_checksum"])
    retrievers: dict[str, Retriever] = {}
    manifests: dict[str, Manifest] = {}
    lexical = None
    dense: DenseRetriever | None = None
    store: DocumentStore | None = None
    try:
        check_store(store_folder(folder), checksum)
        store = DiskStore(store_folder(folder), gs.corpus, checksum)
        if settings.bm25:
            entry = registry.lexical(settings.bm25_backend)
            manifests["bm25"] = entry.check(gs, checksum)
            retrievers["bm25"] = bm25 = entry.load(gs, store)
            lexical = entry.overlay(bm25)
        if settings.dense:
            manifests["dense"] = check_dense(gs, checksum)
            retrievers["dense"] = dense = load_dense(gs, encoder)
        for name, retriever in retrievers.items():
            RetrieverService._check_count(name, retriever, store)
    except (IndexMissing, IndexMismatch) as exc:
        for retriever in retrievers.values():
            retriever.close()
        if store is not None:
            store.close()
        raise IndexMismatch(f"generation {generation.gen} of the changes ({folder}) does not hold what the settings "
                            f"ask for: {exc}. Run `plugsearch-index compact` with these settings: it builds the next "
                            "generation as they say") from exc
    return Base(generation, store, retrievers, manifests, lexical, dense.encoder if dense is not None else None)


def _loader(settings: RetrieverSettings, log: ChangeLog | None
            ) -> Callable[[Generation, Encoder | None], Base] | None:
    if log is None:
        return None
    folder = log.folder
    return lambda generation, encoder: load_generation(settings, folder, generation, encoder=encoder)


def _report(live: LiveIndex) -> None:
    state = live.state
    if state.seq:
        logger.info("changes since the build: %d applied (documents added %d, replaced %d, deleted %d; generation %d)",
                    state.seq, state.changed["added"], state.changed["replaced"], state.changed["deleted"],
                    live.generation)
    if live.error is not None:
        logger.error("documents cannot change: %s", live.error)
