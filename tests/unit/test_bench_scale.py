"""bench/scale.py's building blocks: the synthetic corpus, the synthetic vectors, exact truth and the growth fits."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import orjson
import pytest

from bench import scale


@pytest.fixture(scope="module")
def real_model(data_dir: Path) -> tuple[list[str], np.ndarray, np.ndarray, list[str]]:
    return scale.corpus_model()


def test_synthetic_passages_follow_the_real_corpus(tmp_path: Path, real_model: tuple) -> None:
    vocab, _, lengths, titles = real_model
    out = scale.write_corpus(3000, tmp_path / "corpus.jsonl")
    rows = [orjson.loads(line) for line in out.read_bytes().splitlines()]
    assert [r["id"] for r in rows] == [f"s{i}" for i in range(3000)]
    words = [w for r in rows for w in r["text"].split()]
    assert set(words) <= set(vocab)
    assert set(r["title"] for r in rows) <= set(titles)
    mean_len = np.mean([len(r["text"].split()) for r in rows])
    assert abs(mean_len - lengths.mean()) / lengths.mean() < 0.1
    assert lengths.mean() == pytest.approx(100, rel=0.05)  # wiki-18's 100-word passages (FlashRAG's sample)
    # the most frequent real word is also the most frequent synthetic one
    assert Counter(words).most_common(1)[0][0] == vocab[0]


def test_the_corpus_is_cached_and_deterministic(tmp_path: Path, data_dir: Path) -> None:
    a = scale.write_corpus(200, tmp_path / "a" / "corpus.jsonl")
    first = a.stat().st_mtime_ns
    assert scale.write_corpus(200, a).stat().st_mtime_ns == first  # reused, not rewritten
    b = scale.write_corpus(200, tmp_path / "b" / "corpus.jsonl")
    assert a.read_bytes() == b.read_bytes()
    c = scale.write_corpus(200, tmp_path / "c" / "corpus.jsonl", seed=5)
    assert a.read_bytes() != c.read_bytes()


def test_a_corpus_write_stopped_part_way_resumes_to_the_same_bytes(tmp_path: Path, data_dir: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Each chunk is drawn from its own seed, synced and recorded: a stop goes on from the last chunk recorded, and
    the file is byte for byte the one an uninterrupted writer (of one process or two) makes."""
    import json

    monkeypatch.setattr(scale, "CHUNK", 100)
    whole = scale.write_corpus(450, tmp_path / "whole" / "corpus.jsonl", processes=1)
    assert scale.write_corpus(450, tmp_path / "two" / "corpus.jsonl", processes=2).read_bytes() == whole.read_bytes()
    real, calls = scale._corpus_chunk, []

    def stopping(job: tuple[int, int, int, int]) -> bytes:
        calls.append(job[0])
        if len(calls) == 3:
            raise KeyboardInterrupt  # as a run stopped while the third chunk was drawn
        return real(job)

    monkeypatch.setattr(scale, "_corpus_chunk", stopping)
    out = tmp_path / "stopped" / "corpus.jsonl"
    with pytest.raises(KeyboardInterrupt):
        scale.write_corpus(450, out, processes=1)
    record = json.loads((out.parent / ".corpus.jsonl.partial.json").read_text())
    assert not out.exists() and record["next"] == 200
    with (out.parent / ".corpus.jsonl.partial").open("ab") as fh:
        fh.write(b'{"id": "s200", "ti')  # half a chunk written after the last record: cut off on resume
    calls.clear()
    monkeypatch.setattr(scale, "_corpus_chunk", lambda job: calls.append(job[0]) or real(job))
    assert scale.write_corpus(450, out, processes=1).read_bytes() == whole.read_bytes()
    assert calls == [200, 300, 400] and not (out.parent / ".corpus.jsonl.partial.json").exists()


def test_synthetic_vectors_are_that_corpus_embeddings_regenerated_and_truth_is_exact(
        tmp_path: Path, data_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import faiss

    from plugsearch.retriever.store.corpus import file_checksum
    from plugsearch.retriever.store.manifest import Manifest

    rng = np.random.default_rng(3)
    centres = rng.standard_normal((50, scale.DIMS)).astype(np.float32)
    np.save(tmp_path / "centres.npy", centres)
    monkeypatch.setattr(scale, "CHUNK", 700)  # several chunks, so the merge across chunks is exercised
    corpus = scale.write_corpus(2000, tmp_path / "corpus.jsonl")
    folder = scale.write_embeddings(corpus, tmp_path / "index", 2000, tmp_path / "centres.npy")
    manifest = Manifest.read(folder)
    assert manifest.corpus_checksum == file_checksum(corpus) and manifest.doc_count == 2000
    assert not list(folder.glob("chunk-*"))  # never stored: regenerated from the seed by every step
    chunks = scale.synthetic_chunks(folder)
    vectors = np.concatenate(list(chunks()))
    assert vectors.shape == (2000, scale.DIMS) and [len(c) for c in chunks()] == [700, 700, 600]
    assert np.array_equal(vectors, np.concatenate(list(chunks())))  # the same vectors at every pass
    assert np.allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-5)
    other = scale.write_embeddings(corpus, tmp_path / "other", 2000, tmp_path / "centres.npy", seed=2)
    assert not np.array_equal(vectors, np.concatenate(list(scale.synthetic_chunks(other)())))
    queries = rng.standard_normal((20, scale.DIMS)).astype(np.float32)
    flat = faiss.IndexFlatIP(scale.DIMS)
    flat.add(vectors)
    _, want = flat.search(queries, scale.K)
    assert (scale.exact_top10(chunks, queries) == want).all()
    assert np.array_equal(np.concatenate(list(chunks(1))), vectors[700:])  # any chunk on, as from the start
    checkpoint, seen = tmp_path / "truth.partial.npz", []

    def stopping(start: int = 0) -> Any:  # a pass stopped after its second chunk (checkpointed every chunk)
        for c in chunks(start):
            seen.append(start)
            if len(seen) == 3:
                raise KeyboardInterrupt
            yield c

    with pytest.raises(KeyboardInterrupt):
        scale.exact_top10(stopping, queries, checkpoint=checkpoint, every=1)
    assert int(np.load(checkpoint)["done"]) == 2
    resumed: list[int] = []
    assert (scale.exact_top10(lambda start=0: resumed.append(start) or chunks(start), queries,
                              checkpoint=checkpoint, every=1) == want).all()
    assert resumed == [2] and not checkpoint.exists()  # went on from chunk 2, and the checkpoint is gone
    np.save(tmp_path / "centres.npy", centres + 1)  # the recipe's centres changed under it: refused
    with pytest.raises(RuntimeError, match="changed"):
        scale.synthetic_chunks(folder)


def test_growth_fits_recover_known_curves_and_extrapolate() -> None:
    sizes = [100_000, 1_000_000, 5_000_000]
    power = scale.fit(sizes, [3.0 * n ** 0.9 for n in sizes], "power")
    assert power is not None and power["b"] == pytest.approx(0.9) and power["a"] == pytest.approx(3.0)
    line = scale.fit(sizes, [200 + 0.001 * n for n in sizes], "linear")
    assert line is not None and line["base"] == pytest.approx(200) and line["per_item"] == pytest.approx(0.001)
    assert scale.fit([100_000], [5.0], "power") is None  # one point is no curve
    points = {str(n): {"build_s": 0.0001 * n, "rss_anon_total_mb": 100 + 0.0005 * n, "disk_mb": 0.0002 * n}
              for n in sizes}
    points[str(scale.WIKI18)] = {"build_s": 1.0}  # a measured wiki-18 point is no input to its own extrapolation
    out = scale.extrapolate({"faiss-flat": points})["faiss-flat"]
    assert out["build_s"] == pytest.approx(0.0001 * scale.WIKI18, rel=1e-3)
    assert out["rss_anon_total_mb"] == pytest.approx(100 + 0.0005 * scale.WIKI18, rel=1e-3)
    assert out["from_sizes"] == sizes
    flat = {str(n): {"rss_anon_total_mb": v} for n, v in zip(sizes, [900.0, 760.0, 780.0], strict=True)}
    assert scale.extrapolate({"hybrid": flat})["hybrid"]["rss_anon_total_mb"] == 900.0  # no growth: no decline


def test_each_backend_is_served_from_where_it_was_built(tmp_path: Path) -> None:
    for backend in scale.BACKENDS:
        env = scale.backend_env(backend, tmp_path, nprobe=48)
        paths = scale.index_paths(backend, tmp_path)
        if backend == "hybrid":  # Lucene and IVF-SQ8 in one retriever, every method measured
            assert env["RETRIEVER_BM25_BACKEND"] == "pyserini" and env["RETRIEVER_FAISS__INDEX_TYPE"] == "ivfsq8"
            assert env["RETRIEVER_DEFAULT_METHOD"] == "hybrid" and env["RETRIEVER_FAISS__NPROBE"] == "48"
            assert paths == [tmp_path / "index" / "pyserini", tmp_path / "index" / "dense-ivfsq8"]
            assert scale.methods(backend) == ["bm25", "dense", "hybrid"] and scale.is_dense(backend)
        elif backend.startswith("milvus"):
            assert Path(env["RETRIEVER_MILVUS__URI"]) in paths
            assert tmp_path / "index" / f"milvus-{env['RETRIEVER_MILVUS__COLLECTION']}" in paths
        elif backend.startswith("faiss"):
            assert paths == [tmp_path / "index" / f"dense-{env['RETRIEVER_FAISS__INDEX_TYPE']}"]
        else:
            assert env["RETRIEVER_BM25_BACKEND"] == backend and paths == [tmp_path / "index" / backend]
    with pytest.raises(SystemExit):
        scale.parse_max(["faiss-flat=lots"])
    assert scale.parse_max(["bm25s=5000000"])["bm25s"] == 5_000_000


def test_returned_documents_are_checked_against_the_corpus_lines(tmp_path: Path, data_dir: Path) -> None:
    corpus = scale.write_corpus(300, tmp_path / "corpus.jsonl")
    rows = [orjson.loads(line) for line in corpus.read_bytes().splitlines()]
    served = [[{**rows[i], "score": 1.0} for i in (5, 17, 299)], [{**rows[0], "score": 0.5}]]
    assert scale.check_documents(corpus, served) == {"docs_checked": 4, "docs_identical": True, "docs_different": []}
    served[0][1] = {**served[0][1], "text": served[0][1]["text"] + " "}
    out = scale.check_documents(corpus, served)
    assert not out["docs_identical"] and out["docs_different"] == ["s17"]
    truth = np.array([[5, 17, 299, 1, 2, 3, 4, 6, 7, 8]])
    assert scale.recall([[{"id": f"s{i}"} for i in (5, 299, 11)]], truth) == pytest.approx(0.2)
