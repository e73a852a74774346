"""The retriever's backend registry: every backend the settings accept has one entry, each entry says where its
index is, what it supports and refuses what it cannot build, and the code that serves never branches on a backend's
name or type (it asks the registry)."""

from __future__ import annotations

import ast
import re
from pathlib import Path
from typing import get_args

import numpy as np
import pytest

from plugsearch.retriever.backends import registry
from plugsearch.retriever.backends.base import Hits, VectorIndex
from plugsearch.retriever.backends.dense import DenseRetriever
from plugsearch.retriever.settings import Bm25Backend, DenseBackend, RetrieverSettings
from plugsearch.retriever.store.manifest import Manifest

REPO = Path(__file__).resolve().parents[2]
RETRIEVER = REPO / "plugsearch" / "retriever"


def test_every_backend_the_settings_accept_has_one_registry_entry() -> None:
    assert list(registry.LEXICAL) == list(get_args(Bm25Backend))
    assert list(registry.DENSE) == list(get_args(DenseBackend))
    with pytest.raises(ValueError, match="no dense store 'annoy'"):
        registry.dense("annoy")


def test_entries_say_where_their_indexes_are(tmp_path: Path) -> None:
    settings = RetrieverSettings(index_dir=tmp_path, milvus={"collection": "docs"})  # type: ignore[arg-type]
    assert registry.lexical("bm25s").folder(settings) == tmp_path / "bm25s"
    assert registry.lexical("pyserini").folder(settings) == tmp_path / "pyserini"
    assert registry.dense("faiss").folder(settings) == tmp_path / "dense-flat"
    assert registry.dense("milvus").folder(settings) == tmp_path / "milvus-docs"
    registry.dense("faiss").set_index_type(settings, "ivfpq")
    assert registry.dense("faiss").folder(settings) == tmp_path / "dense-ivfpq"
    assert settings.dense_index_type() == "ivfpq"
    with pytest.raises(ValueError, match="Milvus indexes here are flat or hnsw"):
        registry.dense("milvus").set_index_type(settings, "ivfpq")


def test_what_each_backend_supports() -> None:
    """Live changes need a BM25 index whose statistics score the passages put (bm25s); the refusal names the ones
    that can. Query-time settings that change rankings are part of the index identity, per backend."""
    assert {name for name, entry in registry.LEXICAL.items() if entry.live_changes} == {"bm25s"}
    assert registry.live_changes_refusal() == ("changes while serving need the bm25s BM25 backend "
                                               "(RETRIEVER_BM25_BACKEND=bm25s)")
    assert registry.lexical("pyserini").overlay(object()) is None  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="a bm25s index was expected"):
        registry.lexical("bm25s").overlay(object())  # type: ignore[arg-type]
    topk = RetrieverSettings(lucene_search="topk")  # type: ignore[call-arg]
    assert registry.lexical("pyserini").identity(topk) == {"lucene_search": "topk"}
    assert registry.lexical("bm25s").identity(topk) == {}
    faiss = registry.dense("faiss")
    assert faiss.identity(topk, "ivfsq8") == {"nprobe": 32} and faiss.identity(topk, "hnsw") == {"hnsw_ef_search": 128}
    assert faiss.identity(topk, "flat") == {} and registry.dense("milvus").identity(topk, "hnsw") == {}
    built = Manifest(kind="bm25", backend="bm25s", corpus_path="c", corpus_checksum="x", doc_count=1,
                     params={"k1": 1.5, "b": 0.75})
    assert registry.lexical("bm25s").stale(RetrieverSettings(bm25_k1=1.5), built) is None  # type: ignore[call-arg]
    assert "was built with k1=1.5, RETRIEVER_BM25_K1=1.2" in str(
        registry.lexical("bm25s").stale(RetrieverSettings(bm25_k1=1.2), built))  # type: ignore[call-arg]


class _Store(VectorIndex):
    """A vector index held in memory: what the interface asks of a dense store, no more."""

    def __init__(self, vectors: np.ndarray) -> None:
        self.vectors = vectors
        self.dims = vectors.shape[1]

    @property
    def ntotal(self) -> int:
        return len(self.vectors)

    def search(self, vectors: np.ndarray, k: int) -> Hits:
        scores = vectors @ self.vectors.T
        order = np.argsort(-scores, axis=1)[:, :k]
        return Hits(order.astype(np.int64), np.take_along_axis(scores, order, axis=1).astype(np.float32))

    def close(self) -> None:
        self.vectors = np.zeros((0, self.dims))


class _Encoder:
    dims = 2
    onnx = None

    def encode_queries(self, queries: list[str]) -> np.ndarray:
        return np.array([[1.0, 0.0] if "first" in q else [0.0, 1.0] for q in queries], dtype=np.float32)

    def describe(self) -> dict[str, str]:
        return {"encoder_backend": "fake"}


def test_a_new_vector_store_serves_through_the_typed_interface() -> None:
    """A store that implements `VectorIndex` is searched by the dense retriever as FAISS and Milvus are: it takes
    no live changes itself (they are searched beside it) and answers readiness."""
    store = _Store(np.array([[1.0, 0.0], [0.0, 1.0], [0.7, 0.7]], dtype=np.float32))
    dense = DenseRetriever(_Encoder(), store)  # type: ignore[arg-type]
    assert dense.doc_count == 3 and dense.ping() and store.mirror() is None
    assert dense.batch_search(["the first", "the second"], 2).ids.tolist() == [[0, 2], [1, 2]]
    assert dense.describe() == {"encoder_backend": "fake"}
    with pytest.raises(TypeError):
        VectorIndex()  # type: ignore[abstract]


def test_serving_never_branches_on_a_backend_name_or_type() -> None:
    """The acceptance of the registry: no isinstance on a retriever backend's type in the service or its API, and
    the dense backend's name compared only where it is defined (the registry) or validated (the settings)."""
    backend_types = {node.name for path in (RETRIEVER / "backends").glob("*.py")
                     for node in ast.walk(ast.parse(path.read_text())) if isinstance(node, ast.ClassDef)}
    for name in ("serving.py", "api.py"):
        for node in ast.walk(ast.parse((RETRIEVER / name).read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "isinstance":
                assert not set(re.findall(r"\w+", ast.unparse(node.args[1]))) & backend_types, (name, ast.unparse(node))
    compares = [str(p.relative_to(RETRIEVER)) for p in RETRIEVER.rglob("*.py") if "dense_backend ==" in p.read_text()]
    assert set(compares) <= {"settings.py", "backends/registry.py"}, compares
