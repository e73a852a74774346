"""The retriever service's own indexes and backends in-process: what the compact trainer, the evaluation and
the benches search with (the same documents the service returns, without HTTP in the training loop).

The indexes are the stack's (`index_dir`, by default `var/indexes/<corpus>-<sha256>`, as `plugsearch-stack`
names it: keyed by the corpus's content): bm25s, and with `dense` the encoder's flat FAISS index
(`RETRIEVER_ENCODER__*`, default MiniLM), built by `plugsearch-index build`'s code when missing.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from plugsearch.common.schemas.base import Document


class IndexRetriever:
    """bm25, and with `dense` dense and hybrid (RRF), over one corpus's indexes (built when missing); results
    memoised per (query, k, method)."""

    def __init__(self, corpus_path: Path, index_dir: Path, *, dense: bool = False, progress: bool = True) -> None:
        from plugsearch.retriever.backends.fusion import HybridRetriever
        from plugsearch.retriever.indexing.build import build
        from plugsearch.retriever.serving import RetrieverService, check_indexes
        from plugsearch.retriever.settings import RetrieverSettings

        settings = RetrieverSettings(corpus=corpus_path, index_dir=index_dir, bm25=True, bm25_backend="bm25s",
                                     dense=dense, dense_backend="faiss")
        settings.faiss.index_type = "flat"
        build(settings, bm25=["bm25s"], dense=dense, force=False, show_progress=progress)
        self.service = RetrieverService.load(settings, check_indexes(settings))
        self.methods = dict(self.service.retrievers)
        if dense:
            self.methods["hybrid"] = HybridRetriever(self.methods["bm25"], self.methods["dense"],
                                                     depth=settings.fusion_depth, rrf_k=settings.rrf_k)
        self.encoder: str | None = settings.encoder.name if dense else None
        """The dense encoder (what a policy's dense scorer is trained with), None without dense."""
        self._memo: dict[tuple[str, int, str], list[Document]] = {}

    def identity(self) -> dict[str, Any]:
        """What a policy trained here records of its corpus and indexes (`corpus` in its manifest): the
        corpus's sha256 and size, the BM25 backend, the dense encoder and index type; the searcher refuses to
        serve it over another corpus or encoder (`plugsearch.searcher.policy_corpus`)."""
        return {"sha256": self.service.corpus.checksum.split(":", 1)[-1], "documents": len(self.service.corpus),
                "bm25": "bm25s", "encoder": self.encoder, "dense_index": "flat" if self.encoder else None}

    async def retrieve(self, queries: list[str], k: int, method: str | None) -> list[list[Document]]:
        name = method or "bm25"
        backend = self.methods.get(name)
        if backend is None:
            raise ValueError(f"method {name!r} is not loaded here (have {sorted(self.methods)})")
        missing = [q for q in dict.fromkeys(queries) if (q, k, name) not in self._memo]
        if missing:
            found = self.service.documents(backend.batch_search(missing, k))
            for q, docs in zip(missing, found, strict=True):
                self._memo[(q, k, name)] = [Document.model_construct(**d) for d in docs]
        return [self._memo[(q, k, name)] for q in queries]
