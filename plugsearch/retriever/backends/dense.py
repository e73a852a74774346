"""Dense retrieval: the queries of a batch encoded together, then one search of a vector index (a dense store's:
FAISS in `faiss_index.py`, Milvus in `milvus_index.py`, both behind `base.VectorIndex`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from plugsearch.retriever.backends.base import Hits, Retriever, VectorIndex
from plugsearch.retriever.encoders.encoder import Encoder


class DenseRetriever(Retriever):
    """Encode the queries of a batch together, then one vector search (FAISS or Milvus)."""

    name = "dense"

    def __init__(self, encoder: Encoder, index: VectorIndex) -> None:
        if encoder.dims != index.dims:
            raise ValueError(f"encoder gives {encoder.dims}-d vectors, index holds {index.dims}-d")
        self.encoder = encoder
        self.index = index

    @property
    def doc_count(self) -> int:
        return self.index.ntotal

    def batch_search(self, queries: Sequence[str], k: int) -> Hits:
        return self.index.search(self.encoder.encode_queries(queries), k)

    def describe(self) -> dict[str, Any]:
        """Which encoder backend serves the queries (auto: onnx, or torch and why)."""
        return self.encoder.describe()

    def ping(self) -> bool:
        return self.index.ping()

    def close(self) -> None:
        self.index.close()
        if self.encoder.onnx is not None:
            self.encoder.onnx.close()
