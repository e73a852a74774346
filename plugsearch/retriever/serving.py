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
from plugsearch.retriever.live.overlay import LiveCorpus, LiveIndex, LiveRetriever
from plugsearch.retriever.settings import RetrieverSettings
from plugsearch.retriever.store.docstore import DocumentStore, corpus_checksum, open_store
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


def load_dense(settings: RetrieverSettings) -> DenseRetriever:
    """The dense retriever of the configured index, its encoder loaded and warmed up (blocking)."""
    dense = DenseRetriever(Encoder(settings.encoder), registry.dense(settings.dense_backend).open(settings))
    dense.batch_search(["warm up"], 1)
    return dense


def index_identity(settings: RetrieverSettings, corpus_checksum: str, manifests: dict[str, Manifest]) -> str:
    """What the served results depend on: the corpus, every loaded index (its manifest, build time included)
    and the settings that change rankings. Callers put it in their cache keys (`/version` -> `index_id`),
    so a re-index never serves results cached from the old one."""
    payload: dict[str, Any] = {
        "corpus": corpus_checksum,
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
        for name, retriever in retrievers.items():
            self._check_count(name, retriever, corpus)
        self.live = live
        """The changes made while serving (None: RETRIEVER_CHANGES off, or not servable here)."""
        self.changes_off: str | None = None
        """Why documents cannot be changed here (None: they can)."""
        if live is not None:
            corpus = LiveCorpus(live)  # type: ignore[assignment]
        self.corpus = corpus
        self.retrievers = retrievers
        self.settings = settings
        self.metrics = metrics
        self.base_index_id = index_id
        self.check = check
        self.dense_status: str | None = None
        """While the dense index is pending: `waiting` for it, `building` it, or why its build failed."""
        self.batchers = {name: self._batcher(name, r) for name, r in retrievers.items()}
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

    @staticmethod
    def _check_count(name: str, retriever: Retriever, corpus: DocumentStore) -> None:
        if retriever.doc_count != len(corpus):
            raise IndexMismatch(f"{name} index holds {retriever.doc_count} documents, corpus "
                                f"{corpus.path} has {len(corpus)}")

    def _batcher(self, name: str, retriever: Retriever) -> MicroBatcher:
        metrics = self.metrics
        search = retriever.batch_search if self.live is None else \
            LiveRetriever(retriever, self.live, "dense" if name == "dense" else "lexical").batch_search
        return MicroBatcher(name, search, max_batch=self.settings.max_batch_queries,
                            max_chars=self.settings.max_batch_chars,
                            max_queue=self.settings.max_queue, workers=self._workers(name),
                            observe=metrics.observer(name) if metrics is not None else None)

    def add_dense(self, dense: DenseRetriever, manifest: Manifest) -> None:
        """Serve the dense index that was pending (built while BM25 served): `dense` and `hybrid` join
        `methods`, and `index_id` changes (callers' cache keys of the BM25-only time are left behind)."""
        self._check_count("dense", dense, self.corpus)
        if self.live is not None:
            self.live.serve_dense(dense.encoder.encode_passages, dense.index.mirror())
        self.batchers["dense"] = self._batcher("dense", dense)
        self.retrievers["dense"] = dense
        if self.check is not None:
            self.check = IndexCheck(self.check.corpus_checksum, {**self.check.manifests, "dense": manifest})
            self.base_index_id = index_identity(self.settings, self.check.corpus_checksum, self.check.manifests)
        self.dense_status = None

    @property
    def index_id(self) -> str:
        """The built indexes' identity, and the last change applied (a cache keyed on it never serves a result
        from before a change)."""
        seq = self.live.seq if self.live is not None else 0
        return f"{self.base_index_id}-c{seq}" if seq else self.base_index_id

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
        retrievers: dict[str, Retriever] = {}
        bm25: Retriever | None = None
        dense: DenseRetriever | None = None
        if settings.bm25:
            retrievers["bm25"] = bm25 = registry.lexical(settings.bm25_backend).load(settings, corpus)
            opened(f"BM25 ({settings.bm25_backend})")
        if settings.dense and "dense" in check.manifests:
            retrievers["dense"] = dense = load_dense(settings)
            opened(f"dense index ({settings.dense_backend} {settings.dense_index_type()}) and its encoder")
        live, off = open_live(settings, corpus, bm25, dense)
        logger.info("retriever ready in %.1f s: %s over %s documents%s", time.perf_counter() - t0,
                    ", ".join(retrievers), len(corpus),
                    " (the dense index is not ready: BM25 serves until it is)" if check.dense_pending else "")
        service = cls(corpus, retrievers, settings, metrics=metrics, check=check, live=live,
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
            sparse, dense = await asyncio.gather(self.batchers["bm25"].submit(queries, depth),
                                                 self.batchers["dense"].submit(queries, depth))
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
            state = self.live.state
            positions, total = self.live.sample(state, n, seed), state.served
        else:
            total = len(self.corpus)
            positions = random.Random(seed).sample(range(total), min(n, total))
        docs = self.corpus.documents(positions)
        return orjson.dumps({"passages": [{"id": i, "title": t, "text": x} for i, t, x in docs],
                             "total": total, "index_id": self.index_id})

    def describe(self) -> dict[str, Any]:
        state = self.live.state if self.live is not None else None
        return {"methods": self.methods, "default_method": self.settings.default_method,
                "documents": state.served if state is not None else len(self.corpus),
                "corpus_checksum": self.corpus.checksum, "index_id": self.index_id,
                "changes": None if state is None else {"seq": state.seq, **state.changed},
                "changes_off": self.changes_off,
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
        """Readiness of the loaded indexes: "ok", or why not (a dense store that does not answer)."""
        dense = self.retrievers.get("dense")
        if dense is not None and not await asyncio.to_thread(dense.ping):
            return f"the dense index's {self.settings.dense_backend.capitalize()} does not answer"
        return "ok"

    async def aclose(self) -> None:
        for batcher in self.batchers.values():
            await batcher.aclose()
        for retriever in self.retrievers.values():
            retriever.close()
        self.corpus.close()


CHANGES_DIR = "changes"


def open_live(settings: RetrieverSettings, corpus: DocumentStore, bm25: Retriever | None,
              dense: DenseRetriever | None) -> tuple[LiveIndex | None, str | None]:
    """The changes made while serving, replayed over the built indexes (`plugsearch.retriever.live.overlay`), or
    why documents cannot change here."""
    if settings.changes == "off":
        return None, "RETRIEVER_CHANGES=off"
    overlay = registry.lexical(settings.bm25_backend).overlay(bm25) if bm25 is not None else None
    if bm25 is not None and overlay is None:
        return None, registry.live_changes_refusal()
    folder = (settings.changes_dir or settings.index_dir / CHANGES_DIR) / corpus.checksum.split(":")[-1][:16]
    try:
        live = LiveIndex(folder, corpus,
                         stats=(lambda: overlay.lexical_stats(corpus)) if overlay is not None else None,
                         tokenize=overlay.tokenize if overlay is not None else None,
                         encode=dense.encoder.encode_passages if dense is not None else None,
                         mirror=dense.index.mirror() if dense is not None else None)
    except OSError as exc:
        logger.warning("documents cannot change while serving: %s", exc)
        return None, f"the change log cannot be opened in {folder}: {exc}"
    if live.seq:
        state = live.state
        logger.info("changes since the build: %d applied (documents added %d, replaced %d, deleted %d)",
                    live.seq, state.changed["added"], state.changed["replaced"], state.changed["deleted"])
    return live, None
