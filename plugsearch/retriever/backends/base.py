"""What every backend is: the one retriever signature (as pyserini gives BM25, FAISS and hybrid searchers one), the
vector index a dense store offers, what live changes need of each, and the registry entry that names a backend
and wires it (`plugsearch.retriever.backends.registry`).

A retriever answers a *batch* of queries with two arrays of shape (n_queries, k): internal document numbers
(positions in the `Corpus`, -1 where fewer than k hits exist) and scores (higher is better). Backends are
synchronous and may block; the service runs them off the event loop.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, runtime_checkable

import numpy as np
import numpy.typing as npt

from plugsearch.retriever.encoders.encoder import encoder_identity
from plugsearch.retriever.store.manifest import IndexMismatch, Manifest, checked_manifest

if TYPE_CHECKING:
    from plugsearch.retriever.settings import RetrieverSettings
    from plugsearch.retriever.store.docstore import DocumentStore


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
    """Anything with a name, a document count and a batch search (backends subclass it for `search`, `describe`
    and `ping`)."""

    name: str

    @property
    def doc_count(self) -> int: ...

    def batch_search(self, queries: Sequence[str], k: int) -> Hits: ...

    def search(self, query: str, k: int) -> Hits:
        return self.batch_search([query], k)

    def describe(self) -> dict[str, Any]:
        """What `/version` says of this backend beyond its name (the dense retriever: which encoder serves)."""
        return {}

    def ping(self) -> bool:
        """Whether the backend answers now (a remote store); readiness asks it."""
        return True

    def close(self) -> None: ...


# ------------------------------------------------------------------------------------------- what live changes need

@dataclass
class LexicalStats:
    """What BM25 needs of the base to score the passages put alike: its parameters, passage count, average
    passage length (tokens) and each term's document frequency (`df`)."""

    k1: float
    b: float
    n: int
    avgdl: float
    df: Callable[[str], int]


class LexicalOverlay(Protocol):
    """What the live overlay (`plugsearch.retriever.live.overlay`) needs of a BM25 index to score the passages put
    while serving beside it: texts tokenised as it tokenised its passages, and its statistics."""

    def tokenize(self, texts: list[str]) -> list[list[str]]: ...

    def lexical_stats(self, store: DocumentStore) -> LexicalStats: ...


class DenseMirror(Protocol):
    """A vector store that takes the changes itself (Milvus: `plugsearch.retriever.backends.milvus_index.MilvusChanges`)."""

    def seq(self) -> int: ...

    def upsert(self, start: int, vectors: npt.NDArray[np.float32]) -> None: ...

    def delete(self, positions: list[int]) -> None: ...

    def mark(self, seq: int) -> None: ...

    def search(self, vectors: npt.NDArray[np.float32], k: int, *, below: int, strong: bool) -> Hits:
        """The `k` nearest rows under position `below` (what a live state knows); `strong`: after every write the
        store acknowledged."""
        ...


class VectorIndex(ABC):
    """A dense store's loaded index, what `DenseRetriever` searches: the passages' vectors, row i = document number
    i (`FaissIndex`, `MilvusIndex`). Searches by inner product; higher is better."""

    dims: int

    @property
    @abstractmethod
    def ntotal(self) -> int:
        """The vectors built (document numbers 0 .. ntotal - 1)."""

    @abstractmethod
    def search(self, vectors: npt.NDArray[np.float32], k: int) -> Hits:
        """The `k` nearest rows of each query vector."""

    def mirror(self) -> DenseMirror | None:
        """Where the vectors of passages put while serving go: None, searched in memory beside this index (the
        live overlay); a store that holds them itself returns its change operations."""
        return None

    def ping(self) -> bool:
        """Whether the store answers now (a remote one); readiness asks it."""
        return True

    @abstractmethod
    def close(self) -> None: ...


# ------------------------------------------------------------------------------------------------- registry entries

class LexicalBackend(ABC):
    """A BM25 backend as the registry knows it (`RETRIEVER_BM25_BACKEND=<name>`): where its index folder is, how its
    manifest is checked, how it is loaded and built, and what it supports."""

    name: ClassVar[str]
    live_changes: ClassVar[bool] = False
    """whether documents can change while it serves (its `overlay` scores the passages put)"""

    def folder(self, settings: RetrieverSettings) -> Path:
        return settings.index_dir / self.name

    def stale(self, settings: RetrieverSettings, manifest: Manifest) -> str | None:
        """Why a built index does not match the settings (a parameter fixed at build time), None when it does."""
        return None

    def check(self, settings: RetrieverSettings, checksum: str) -> Manifest:
        """The index's manifest, checked against the corpus, its files and the settings (IndexMissing /
        IndexMismatch)."""
        folder = self.folder(settings)
        manifest = checked_manifest(folder, "RETRIEVER_BM25_BACKEND", self.name, checksum)
        why = self.stale(settings, manifest)
        if why is not None:
            raise IndexMismatch(f"{folder} {why}")
        return manifest

    @abstractmethod
    def load(self, settings: RetrieverSettings, store: DocumentStore) -> Retriever:
        """The index opened for searching (blocking)."""

    @abstractmethod
    def build(self, settings: RetrieverSettings, store: DocumentStore, *, show_progress: bool) -> Manifest:
        """Build the index of `store`'s documents into its folder (atomic)."""

    def search_workers(self, settings: RetrieverSettings) -> int:
        """Library calls the service runs at once (one thread each)."""
        return 1

    def identity(self, settings: RetrieverSettings) -> dict[str, Any]:
        """The query-time settings that change its rankings (part of the index identity)."""
        return {}

    def overlay(self, retriever: Retriever) -> LexicalOverlay | None:
        """What live changes need of the loaded index; None where documents cannot change (`live_changes`)."""
        return None


Chunks = Callable[[], Iterable[npt.NDArray[np.float32]]]
"""A function that returns a fresh iterator over the embedding chunks (arrays of passage vectors, in document
order) at each call."""


class DenseStore(ABC):
    """A dense vector store as the registry knows it (`RETRIEVER_DENSE_BACKEND=<name>`): where its index folder
    is, how its manifest is checked, how it is opened and built from the encoded passages."""

    name: ClassVar[str]

    @abstractmethod
    def folder(self, settings: RetrieverSettings) -> Path:
        """The index folder (its files, or the manifest of what the store holds elsewhere)."""

    @abstractmethod
    def index_type(self, settings: RetrieverSettings) -> str:
        """The configured kind of index (flat, hnsw, ...)."""

    @abstractmethod
    def set_index_type(self, settings: RetrieverSettings, index_type: str) -> None:
        """`plugsearch-index build --index-type`: ValueError for a type this store does not build."""

    def check(self, settings: RetrieverSettings, checksum: str) -> Manifest:
        """The index's manifest, checked against the corpus, the encoder, its files (IndexMissing /
        IndexMismatch)."""
        return checked_manifest(self.folder(settings), "RETRIEVER_DENSE_BACKEND", self.name, checksum,
                                encoder=settings.encoder.name, index_type=self.index_type(settings),
                                encoder_config=encoder_identity(settings.encoder))

    def matches(self, settings: RetrieverSettings, folder: Path) -> bool:
        """Whether what the store holds is what its manifest recorded (a build is needed when not)."""
        return True

    @abstractmethod
    def open(self, settings: RetrieverSettings) -> VectorIndex:
        """The index opened for searching (blocking)."""

    @abstractmethod
    def build(self, settings: RetrieverSettings, embeddings: Path, chunks: Chunks, *, force: bool,
              show_progress: bool) -> Manifest:
        """Build the index from the encoded passages (`embeddings`: their manifest; `chunks`: the vectors)."""

    def identity(self, settings: RetrieverSettings, index_type: str | None) -> dict[str, Any]:
        """The query-time settings that change its rankings for an index of `index_type`."""
        return {}
