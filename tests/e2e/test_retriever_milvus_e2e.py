"""The real retriever process with its dense index on a real Milvus server (milvus-lite's gRPC server in a
process of its own, reached at http://127.0.0.1:P as a cluster would be): `POST /retrieve` answers the
same top-10 as the in-process exact FAISS search (dense) and its RRF fusion with bm25s (hybrid); once the
Milvus process is gone, dense and hybrid are 503 + Retry-After in the error envelope, BM25 still 200,
and readiness 503.
"""

from __future__ import annotations

import shutil
import socket
import sys
from pathlib import Path

import httpx
import pytest

from plugsearch.common.procgroup import ProcessGroup, ProcessSpec
from plugsearch.common.workers import free_port
from plugsearch.retriever.backends.bm25s_index import Bm25sRetriever
from plugsearch.retriever.backends.dense import DenseRetriever
from plugsearch.retriever.backends.faiss_index import FaissIndex, dense_folder
from plugsearch.retriever.backends.fusion import HybridRetriever
from plugsearch.retriever.encoders.encoder import Encoder
from plugsearch.retriever.settings import RetrieverSettings
from plugsearch.retriever.store.corpus import Corpus
from tests.api.test_retriever_milvus import tiny  # noqa: F401 - the fixture: tiny corpus, its collection built
from tests.e2e.test_retriever_e2e import Served, questions, served_ids  # noqa: F401 - `questions` is a fixture

pytestmark = pytest.mark.e2e


def listening(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
    except OSError:
        return False
    return True


def start_milvus(data_dir: Path, port: int) -> ProcessGroup:
    """milvus-lite's server, ready when it listens."""
    return ProcessGroup().up(ProcessSpec("milvus", [sys.executable, "-m", "milvus_lite", "server", "--data-dir",
                                                    str(data_dir), "--host", "127.0.0.1", "--port", str(port)],
                                         ready=lambda: listening(port)), timeout_s=60)


def test_served_on_a_milvus_server_equals_exact_faiss_then_503_when_it_is_gone(
        tiny: RetrieverSettings, questions: list[str], tmp_path: Path) -> None:  # noqa: F811
    questions = questions[::3]  # 40 questions, from the three sets
    shutil.copytree(Path(tiny.milvus.uri), tmp_path / "served.db")
    port = free_port()
    engine = start_milvus(tmp_path / "served.db", port)
    served = Served(tiny, RETRIEVER_DENSE_BACKEND="milvus", RETRIEVER_MILVUS__URI=f"http://127.0.0.1:{port}",
                    RETRIEVER_MILVUS__TIMEOUT_S="1", RETRIEVER_MILVUS__RETRIES="1",
                    RETRIEVER_MILVUS__RETRY_AFTER_S="7")
    try:
        served.wait_ready(timeout=300)
        got = {m: served_ids(served.url, questions, 10, m) for m in ("dense", "hybrid")}
        details = httpx.get(f"{served.url}/version", timeout=10).json()["details"]
        assert details["dense_backend"] == "milvus" and details["dense_index"] == "flat"
        engine.stop("milvus")
        with httpx.Client(base_url=served.url, timeout=60) as client:
            for method in ("dense", "hybrid"):
                response = client.post("/retrieve", json={"queries": ["film director"], "method": method})
                assert response.status_code == 503, response.text
                assert response.headers["retry-after"] == "7"
                error = response.json()["error"]
                assert error["type"] == "not_ready" and error["request_id"] == response.headers["x-request-id"]
            assert client.post("/retrieve", json={"queries": ["film director"], "method": "bm25"}).status_code == 200
            assert client.get("/health/ready").status_code == 503
            assert client.get("/health/live").status_code == 200
    finally:
        served.stop()
        engine.close()
    corpus = Corpus.load(tiny.corpus)
    dense = DenseRetriever(Encoder(tiny.encoder), FaissIndex(dense_folder(tiny.index_dir, "flat"), tiny.faiss))
    hybrid = HybridRetriever(Bm25sRetriever(tiny.index_dir / "bm25s"), dense, depth=tiny.fusion_depth,
                             rrf_k=tiny.rrf_k)
    for method, retriever in (("dense", dense), ("hybrid", hybrid)):
        hits = retriever.batch_search(questions, 10)
        assert got[method] == [[corpus.ids[d] for d, _ in hits.per_query(i)] for i in range(len(questions))], method
