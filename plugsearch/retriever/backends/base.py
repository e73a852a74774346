"""The one retriever signature every backend shares (as pyserini gives BM25, FAISS and hybrid searchers).

A backend answers a *batch* of queries with two arrays of shape (n_queries, k): internal document
numbers (positions in the `Corpus`, -1 where fewer than k hits exist) and scores (higher is better).
Backends are synchronous and may block; the service runs them off the event loop.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import numpy as np
import numpy.typing as npt


@dataclass(frozen=True)
class Hits:
    """Ranked results of a batch: `ids[i, r]` is the document number at rank r of query i (-1 = none)."""

    ids: npt.NDArray[np.int64]
    scores: npt.NDArray[np.float32]

    def __post_init__(self) -> None:
        if self.ids.shape != self.scores.shape or self.ids.ndim != 2:
            raise ValueError(f"hits arrays disagree: ids {self.ids.shape}, scores {self.scores.shape}")

    def __len__(self) -> int:
        return int(self.ids.shape[0])

    @property
    def k(self) -> int:
        return int(self.ids.shape[1])

    def rows(self, start: int, stop: int, k: int) -> Hits:
        """Queries [start, stop), first k ranks (micro-batches are searched at the largest k asked)."""
        return Hits(self.ids[start:stop, :k], self.scores[start:stop, :k])

    @classmethod
    def empty(cls, n: int, k: int) -> Hits:
        return cls(np.full((n, k), -1, dtype=np.int64), np.zeros((n, k), dtype=np.float32))

    def per_query(self, i: int) -> list[tuple[int, float]]:
        """(doc number, score) pairs of query i, without padding."""
        return [(int(d), float(s)) for d, s in zip(self.ids[i], self.scores[i], strict=True) if d >= 0]


@runtime_checkable
class Retriever(Protocol):
    """Anything with a name, a document count and a batch search (backends subclass it for `search`)."""

    name: str

    @property
    def doc_count(self) -> int: ...

    def batch_search(self, queries: Sequence[str], k: int) -> Hits: ...

    def search(self, query: str, k: int) -> Hits:
        return self.batch_search([query], k)

    def close(self) -> None: ...
