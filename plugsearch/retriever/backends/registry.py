"""The one place a backend is named and wired: each BM25 backend and each dense store is one file of this folder
and one entry here (its name -> how its manifest is checked, how it is loaded and built, what it supports). The
service, `plugsearch-index` and the index identity ask these entries; none of them branches on a backend's name
or type.

A new dense store: a file beside `faiss_index.py` with its `VectorIndex` and its `DenseStore` entry, the entry
added to `DENSE`, its name added to `settings.DenseBackend` (with its own settings block, as `MilvusSettings`).
"""

from __future__ import annotations

from plugsearch.retriever.backends.base import DenseStore, LexicalBackend
from plugsearch.retriever.backends.bm25s_index import Bm25s
from plugsearch.retriever.backends.faiss_index import Faiss
from plugsearch.retriever.backends.milvus_index import Milvus
from plugsearch.retriever.backends.pyserini_index import Pyserini

LEXICAL: dict[str, LexicalBackend] = {entry.name: entry for entry in (Bm25s(), Pyserini())}
"""BM25 backends by `RETRIEVER_BM25_BACKEND` name."""

DENSE: dict[str, DenseStore] = {entry.name: entry for entry in (Faiss(), Milvus())}
"""Dense stores by `RETRIEVER_DENSE_BACKEND` name."""


def lexical(name: str) -> LexicalBackend:
    try:
        return LEXICAL[name]
    except KeyError:
        raise ValueError(f"no BM25 backend {name!r} (known: {', '.join(LEXICAL)})") from None


def dense(name: str) -> DenseStore:
    try:
        return DENSE[name]
    except KeyError:
        raise ValueError(f"no dense store {name!r} (known: {', '.join(DENSE)})") from None


def live_changes_refusal() -> str:
    """Why documents cannot change on a BM25 backend that does not support it."""
    names = [name for name, entry in LEXICAL.items() if entry.live_changes]
    return (f"changes while serving need the {' or '.join(names)} BM25 backend "
            f"(RETRIEVER_BM25_BACKEND={'|'.join(names)})")
