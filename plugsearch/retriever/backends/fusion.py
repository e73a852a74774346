"""Hybrid search: reciprocal-rank fusion (RRF) of BM25 and dense results.

RRF score of a document = sum over the fused lists of 1 / (rrf_k + rank), rank starting at 1
(Cormack et al. 2009; pyserini's `reciprocal_rank_fusion` uses the same form with k = 60).
Ties are broken by the best single rank, then by document number, so the order is deterministic.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import KW_ONLY, dataclass

import numpy as np

from plugsearch.retriever.backends.base import Hits, Retriever


def rrf_fuse(runs: Sequence[Hits], k: int, rrf_k: int = 60) -> Hits:
    """Fuse several ranked runs over the same queries into the top k by RRF score."""
    if not runs:
        raise ValueError("nothing to fuse")
    n = len(runs[0])
    if any(len(r) != n for r in runs):
        raise ValueError("runs cover different numbers of queries")
    ids = np.full((n, k), -1, dtype=np.int64)
    scores = np.zeros((n, k), dtype=np.float32)
    run_ids = [r.ids.tolist() for r in runs]
    for q in range(n):
        fused: dict[int, float] = {}
        best: dict[int, int] = {}
        for ranked in run_ids:
            for rank, doc in enumerate((d for d in ranked[q] if d >= 0), start=1):
                fused[doc] = fused.get(doc, 0.0) + 1.0 / (rrf_k + rank)
                best[doc] = min(rank, best.get(doc, rank))
        order = sorted(fused, key=lambda d: (-fused[d], best[d], d))[:k]
        ids[q, :len(order)] = order
        scores[q, :len(order)] = [fused[d] for d in order]
    return Hits(ids, scores)


@dataclass(eq=False)
class HybridRetriever(Retriever):
    """Composition of two retrievers: each searched `depth` deep, fused with RRF."""

    sparse: Retriever
    dense: Retriever
    _: KW_ONLY
    depth: int = 100
    rrf_k: int = 60
    name = "hybrid"

    @property
    def doc_count(self) -> int:
        return self.sparse.doc_count

    def batch_search(self, queries: Sequence[str], k: int) -> Hits:
        depth = max(k, self.depth)
        return rrf_fuse([self.sparse.batch_search(queries, depth), self.dense.batch_search(queries, depth)],
                        k, self.rrf_k)

    def close(self) -> None:
        self.sparse.close()
        self.dense.close()
