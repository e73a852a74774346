"""Retriever logic: fusion, manifests and atomic folders, corpus loaders, settings, micro-batching."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest
from pydantic import ValidationError

from plugsearch.common.errors import Overloaded
from plugsearch.retriever.backends.base import Hits
from plugsearch.retriever.backends.fusion import HybridRetriever, rrf_fuse
from plugsearch.retriever.batching import MicroBatcher
from plugsearch.retriever.settings import RetrieverSettings
from plugsearch.retriever.store.corpus import (
    Corpus,
    CorpusError,
    file_checksum,
    join_contents,
    split_contents,
)
from plugsearch.retriever.store.manifest import IndexMismatch, IndexMissing, Manifest, index_folder


def hits(rows: list[list[int]], scores: list[list[float]] | None = None) -> Hits:
    ids = np.array(rows, dtype=np.int64)
    sc = np.array(scores, dtype=np.float32) if scores else np.ones(ids.shape, dtype=np.float32)
    return Hits(ids, sc)


# --------------------------------------------------------------------------- fusion


def test_rrf_scores_and_order() -> None:
    sparse = hits([[1, 2, 3]])
    dense = hits([[3, 1, 4]])
    fused = rrf_fuse([sparse, dense], k=4, rrf_k=60)
    # doc 1: 1/61 + 1/62; doc 3: 1/63 + 1/61; doc 2: 1/62; doc 4: 1/63
    assert fused.ids.tolist() == [[1, 3, 2, 4]]
    assert fused.scores[0, 0] == pytest.approx(1 / 61 + 1 / 62)
    assert fused.scores[0, 1] == pytest.approx(1 / 61 + 1 / 63)
    assert fused.scores[0, 3] == pytest.approx(1 / 63)


def test_rrf_ignores_padding_breaks_ties_and_pads() -> None:
    sparse = hits([[5, -1, -1], [-1, -1, -1]])
    dense = hits([[7, -1, -1], [-1, -1, -1]])
    fused = rrf_fuse([sparse, dense], k=3)
    # 5 and 7 tie on score and best rank: lower document number first; missing ranks padded with -1
    assert fused.ids.tolist() == [[5, 7, -1], [-1, -1, -1]]
    assert fused.scores[1].tolist() == [0.0, 0.0, 0.0]


def test_rrf_refuses_mismatched_runs() -> None:
    with pytest.raises(ValueError):
        rrf_fuse([hits([[1]]), hits([[1], [2]])], k=1)
    with pytest.raises(ValueError):
        rrf_fuse([], k=1)


class FakeRetriever:
    def __init__(self, name: str, table: dict[str, list[int]]) -> None:
        self.name = name
        self.table = table
        self.asked: list[int] = []

    @property
    def doc_count(self) -> int:
        return 100

    def batch_search(self, queries: Sequence[str], k: int) -> Hits:
        self.asked.append(k)
        rows = [(self.table[q] + [-1] * k)[:k] for q in queries]
        return hits(rows)

    def search(self, query: str, k: int) -> Hits:
        return self.batch_search([query], k)

    def close(self) -> None:
        pass


def test_hybrid_searches_each_method_fusion_depth_deep() -> None:
    sparse = FakeRetriever("bm25", {"q": [1, 2, 3]})
    dense = FakeRetriever("dense", {"q": [2, 9]})
    hybrid = HybridRetriever(sparse, dense, depth=50)
    result = hybrid.batch_search(["q"], 2)
    assert sparse.asked == [50] and dense.asked == [50]
    assert result.ids.tolist() == [[2, 1]]


# --------------------------------------------------------------------------- manifests, atomic folders


def test_manifest_roundtrip_and_mismatch_message(tmp_path: Path) -> None:
    m = Manifest(kind="dense", backend="faiss", corpus_path="c.jsonl", corpus_checksum="sha256:aa", doc_count=3,
                 encoder="e", dims=4, index_type="flat")
    m.write(tmp_path)
    back = Manifest.read(tmp_path)
    assert back == m
    back.check(corpus_checksum="sha256:aa", doc_count=3, encoder="e", index_type="flat")
    with pytest.raises(IndexMismatch) as err:
        back.check(corpus_checksum="sha256:bb", doc_count=4, encoder="other", index_type="hnsw", where=tmp_path)
    text = str(err.value)
    for part in ("corpus checksum", "document count", "encoder", "index type", "plugsearch-index build"):
        assert part in text


def test_manifest_missing_or_corrupt(tmp_path: Path) -> None:
    with pytest.raises(IndexMissing, match="plugsearch-index build"):
        Manifest.read(tmp_path)
    (tmp_path / "manifest.json").write_text("{not json")
    with pytest.raises(IndexMissing, match="unreadable"):
        Manifest.read(tmp_path)


def _manifest(n: int) -> Manifest:
    return Manifest(kind="bm25", backend="bm25s", corpus_path="x", corpus_checksum="sha256:x", doc_count=n)


def test_index_folder_crash_keeps_old_index_and_leaves_nothing_loadable(tmp_path: Path) -> None:
    final = tmp_path / "idx"
    with index_folder(final) as tmp:
        (tmp / "data").write_text("v1")
        _manifest(1).write(tmp)
    with pytest.raises(RuntimeError, match="boom"), index_folder(final) as tmp:
        (tmp / "data").write_text("v2-partial")
        raise RuntimeError("boom")
    assert (final / "data").read_text() == "v1"
    assert Manifest.read(final).doc_count == 1
    assert [p.name for p in tmp_path.iterdir()] == ["idx"]  # the partial build was removed


def test_index_folder_requires_manifest_and_replaces(tmp_path: Path) -> None:
    final = tmp_path / "idx"
    with pytest.raises(RuntimeError, match="without writing a manifest"), index_folder(final):
        pass
    assert not final.exists()
    for n in (1, 2):
        with index_folder(final) as tmp:
            _manifest(n).write(tmp)
    assert Manifest.read(final).doc_count == 2
    assert [p.name for p in tmp_path.iterdir()] == ["idx"]


# --------------------------------------------------------------------------- corpus loaders


def test_contents_split_and_join() -> None:
    assert split_contents('"Paris"\nCapital of France.') == ("Paris", "Capital of France.")
    assert split_contents("no title line") == ("", "no title line")
    assert split_contents('"Multi"\nline\ntext') == ("Multi", "line\ntext")
    assert split_contents(join_contents("A \"quoted\" title", "body")) == ('A "quoted" title', "body")


def test_both_corpus_shapes_load_the_same(data_dir: Path, tmp_path: Path) -> None:
    src = data_dir / "corpus" / "flashrag_wiki_sample.jsonl"
    rows = [json.loads(line) for line in src.read_text().splitlines()[:50]]
    plain = tmp_path / "plain.jsonl"
    flash = tmp_path / "flash.jsonl"
    plain.write_text("".join(json.dumps(r) + "\n" for r in rows))
    flash.write_text("".join(json.dumps({"id": r["id"], "contents": join_contents(r["title"], r["text"])}) + "\n"
                             for r in rows))
    a, b = Corpus.load(plain), Corpus.load(flash)
    assert a.ids == b.ids == [r["id"] for r in rows]
    assert a.titles == b.titles and a.texts == b.texts
    assert a.checksum == file_checksum(plain) != b.checksum


def test_every_shared_corpus_file_loads(data_dir: Path) -> None:
    for path in sorted((data_dir / "corpus").glob("*.jsonl")):
        corpus = Corpus.load(path, limit=200)
        assert len(corpus) == 200 and all(corpus.texts)


@pytest.mark.parametrize(("body", "message"), [
    ('{"id": "a", "text": "x"}\n{bad json\n', ":2: not valid JSON"),
    ('{"text": "x"}\n', "missing 'id'"),
    ('{"id": "a", "body": "x"}\n', "needs 'title'+'text' or 'contents'"),
    ('{"id": "a", "text": "x"}\n{"id": "a", "text": "y"}\n', "duplicate id"),
    ('[1, 2]\n', "expected a JSON object"),
    ("\n", "no documents"),
])
def test_malformed_corpus_names_file_and_line(tmp_path: Path, body: str, message: str) -> None:
    path = tmp_path / "c.jsonl"
    path.write_text(body)
    with pytest.raises(CorpusError, match=message.replace("(", r"\(").replace("+", r"\+")):
        Corpus.load(path)


def test_missing_corpus_is_a_corpus_error(tmp_path: Path) -> None:
    with pytest.raises(CorpusError, match="cannot read"):
        file_checksum(tmp_path / "nope.jsonl")


def test_rendered_response_equals_plain_json_of_the_documents(tmp_path: Path) -> None:
    import orjson

    from plugsearch.retriever.serving import RetrieverService

    path = tmp_path / "c.jsonl"
    rows = [{"id": "a", "title": 'Quote "and" \\ slash', "text": "caf\u00e9 \u2603 line\nbreak"},
            {"id": "b", "title": "", "text": "plain"}, {"id": "c", "title": "T", "text": "x" * 3000}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    corpus = Corpus.load(path)

    class Fixed:
        name = "bm25"
        doc_count = 3

        def batch_search(self, queries: Sequence[str], k: int) -> Hits:
            raise AssertionError("not searched here")

        def close(self) -> None:
            pass

    svc = RetrieverService(corpus, {"bm25": Fixed()}, RetrieverSettings(),  # type: ignore[dict-item]
                           index_id="idx-test")
    result = Hits(np.array([[2, 0, -1], [1, -1, -1], [-1, -1, -1]], dtype=np.int64),
                  np.array([[12.3456789, 1e-7, 0], [0.1, 0, 0], [0, 0, 0]], dtype=np.float32))
    body = orjson.loads(svc.render("bm25", result, 1.23456))
    expected = [[{"id": corpus.ids[d], "title": corpus.titles[d], "text": corpus.texts[d], "score": s}
                 for d, s in zip(i, sc, strict=True) if d >= 0]
                for i, sc in zip(result.ids.tolist(), result.scores.tolist(), strict=True)]
    assert body == {"method": "bm25", "took_ms": 1.235, "results": expected}
    nan = Hits(np.array([[0]], dtype=np.int64), np.array([[np.nan]], dtype=np.float32))
    assert orjson.loads(svc.render("bm25", nan, 0))["results"] == [[{**rows[0], "score": None}]]


# --------------------------------------------------------------------------- settings


def test_settings_env_and_refusals(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RETRIEVER_DENSE", "true")
    monkeypatch.setenv("RETRIEVER_FAISS__INDEX_TYPE", "hnsw")
    monkeypatch.setenv("RETRIEVER_ENCODER__QUERY_PREFIX", "query: ")
    s = RetrieverSettings()  # type: ignore[call-arg]
    assert s.port == 8001 and s.faiss.index_type == "hnsw" and s.encoder.query_prefix == "query: "
    assert s.methods() == ["bm25", "dense", "hybrid"]
    monkeypatch.delenv("RETRIEVER_DENSE")
    bad = [{"bm25": False, "dense": False}, {"default_method": "hybrid"}, {"default_method": "dense"},
           {"dense": True, "faiss": {"index_type": "hnsw", "gpu": True}}, {"fusion_depth": 500, "max_k": 100},
           {"bm25_backend": "lucene"}, {"faiss": {"index_type": "pq"}}]
    for overrides in bad:
        with pytest.raises(ValidationError):
            RetrieverSettings(**overrides)  # type: ignore[arg-type]
    # faiss clones no 8-bit scalar quantizer to a GPU: refused at start-up, saying what to do instead
    with pytest.raises(ValidationError, match=r"flat indexes only .* sq8.*RETRIEVER_FAISS__GPU=false"):
        RetrieverSettings(dense=True, faiss={"index_type": "sq8", "gpu": True})  # type: ignore[arg-type]
    assert RetrieverSettings(dense=True, faiss={"index_type": "flat", "gpu": True}).faiss.gpu  # type: ignore[arg-type]
    # the retriever caches nothing: a Redis URL for it would silently do nothing, so it is refused
    monkeypatch.setenv("RETRIEVER_REDIS_URL", "redis://redis:6379/0")
    with pytest.raises(ValidationError, match="RETRIEVER_REDIS_URL is not used"):
        RetrieverSettings()  # type: ignore[call-arg]


def test_the_default_corpus_follows_plugsearch_data(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The data folder is found as the stack and the trainer find it (plugsearch/common/paths.py), whatever the
    current directory; RETRIEVER_CORPUS still wins."""
    from plugsearch.common.paths import REPOSITORY

    monkeypatch.delenv("RETRIEVER_CORPUS", raising=False)
    monkeypatch.delenv("PLUGSEARCH_DATA", raising=False)
    monkeypatch.chdir(tmp_path)
    assert RetrieverSettings().corpus == REPOSITORY.parent / "shared" / "data" / "corpus" / "combined.jsonl"
    monkeypatch.setenv("PLUGSEARCH_DATA", str(tmp_path / "data"))
    assert RetrieverSettings().corpus == tmp_path / "data" / "corpus" / "combined.jsonl"
    monkeypatch.setenv("RETRIEVER_CORPUS", str(tmp_path / "mine.jsonl"))
    assert RetrieverSettings().corpus == tmp_path / "mine.jsonl"


# --------------------------------------------------------------------------- micro-batching


class BlockingSearch:
    """Blocks the first call until released, so that later submits queue up behind it."""

    def __init__(self) -> None:
        self.calls: list[tuple[list[str], int]] = []
        self.release = threading.Event()
        self.started = threading.Event()

    def __call__(self, queries: Sequence[str], k: int) -> Hits:
        self.calls.append((list(queries), k))
        self.started.set()
        if len(self.calls) == 1:
            self.release.wait(10)
        ids = [[int(q) * 10 + r for r in range(k)] for q in queries]
        return hits(ids, [[float(k - r) for r in range(k)] for _ in queries])


async def test_concurrent_requests_are_merged_and_split_back() -> None:
    fn = BlockingSearch()
    batcher = MicroBatcher("t", fn, max_batch=100)
    first = asyncio.ensure_future(batcher.submit(["1"], 2))
    assert await asyncio.to_thread(fn.started.wait, 10)
    rest = [asyncio.ensure_future(batcher.submit([str(i), str(i + 1)], k)) for i, k in ((2, 3), (4, 1), (6, 2))]
    await asyncio.sleep(0)
    fn.release.set()
    results = await asyncio.gather(first, *rest)
    assert [len(c[0]) for c in fn.calls] == [1, 6]  # the three queued requests went in one call
    assert fn.calls[1][1] == 3  # searched at the largest k asked
    assert results[0].ids.tolist() == [[10, 11]]
    assert results[1].ids.tolist() == [[20, 21, 22], [30, 31, 32]]
    assert results[2].ids.tolist() == [[40], [50]]
    assert results[3].ids.tolist() == [[60, 61], [70, 71]]
    await batcher.aclose()


async def test_two_workers_search_a_second_batch_while_the_first_one_runs() -> None:
    fn = BlockingSearch()  # the first call blocks until released
    batcher = MicroBatcher("t", fn, max_batch=100, workers=2)
    first = asyncio.ensure_future(batcher.submit(["1"], 1))
    assert await asyncio.to_thread(fn.started.wait, 10)
    # with one worker these would wait for the first call; the second worker searches them now, merged
    second = [asyncio.ensure_future(batcher.submit([str(i)], 1)) for i in (2, 3)]
    done, _ = await asyncio.wait(second, timeout=10)
    assert len(done) == 2 and not first.done()
    assert [r.result().ids.tolist() for r in second] == [[[20]], [[30]]]
    assert [c[0] for c in fn.calls] == [["1"], ["2", "3"]]
    fn.release.set()
    assert (await first).ids.tolist() == [[10]]
    await batcher.aclose()


async def test_back_to_back_requests_do_not_wait_on_a_finished_worker() -> None:
    def search(queries: Sequence[str], k: int) -> Hits:
        return hits([[int(q)] for q in queries])

    for workers in (1, 2):
        batcher = MicroBatcher("t", search, workers=workers)
        async with asyncio.timeout(5):  # (not wait_for: its extra task would hide the race)
            for i in range(20):  # each submit right after the previous result: the worker has just finished
                result = await batcher.submit([str(i)], 1)
                assert result.ids.tolist() == [[i]]
        await batcher.aclose()


async def test_batch_limit_errors_and_overload() -> None:
    fn = BlockingSearch()
    batcher = MicroBatcher("t", fn, max_batch=3, max_queue=4)
    first = asyncio.ensure_future(batcher.submit(["1"], 1))
    assert await asyncio.to_thread(fn.started.wait, 10)
    queued = [asyncio.ensure_future(batcher.submit([str(i), str(i)], 1)) for i in (2, 3)]
    await asyncio.sleep(0)
    with pytest.raises(Overloaded):
        await batcher.submit(["9"], 1)  # 4 queued + 1 > max_queue
    fn.release.set()
    await asyncio.gather(first, *queued)
    assert [len(c[0]) for c in fn.calls] == [1, 2, 2]  # 2 + 2 > max_batch: two calls

    def broken(queries: Sequence[str], k: int) -> Hits:
        raise RuntimeError("library failed")

    failing = MicroBatcher("f", broken)
    with pytest.raises(RuntimeError, match="library failed"):
        await failing.submit(["x"], 1)
    await failing.aclose()
    await batcher.aclose()


async def test_a_long_request_goes_in_parts_after_the_short_ones_waiting() -> None:
    fn = BlockingSearch()
    batcher = MicroBatcher("t", fn, max_chars=16)  # a call: 16 characters at most; short: 2 at most
    first = asyncio.ensure_future(batcher.submit(["1"], 1))
    assert await asyncio.to_thread(fn.started.wait, 10)
    long = asyncio.ensure_future(batcher.submit([f"{i:08d}" for i in (2, 3, 4, 5)], 2))  # 32 characters
    for _ in range(3):  # the request's task, then its parts' tasks, queue them
        await asyncio.sleep(0)
    assert batcher.queued == 4
    short = [asyncio.ensure_future(batcher.submit([str(i)], 1)) for i in (6, 7)]
    await asyncio.sleep(0)
    fn.release.set()
    results = await asyncio.gather(first, long, *short)
    assert [c[0] for c in fn.calls] == [["1"], ["6", "7"], ["00000002", "00000003"], ["00000004", "00000005"]]
    assert results[1].ids.tolist() == [[20, 21], [30, 31], [40, 41], [50, 51]]  # the parts joined in order
    assert [r.ids.tolist() for r in results[2:]] == [[[60]], [[70]]]
    await batcher.aclose()


class GatedSearch:
    """Each call waits until the test lets it end (`go(n)`)."""

    def __init__(self) -> None:
        self.calls: list[list[str]] = []
        self.entered = [threading.Event() for _ in range(8)]
        self.gates = [threading.Event() for _ in range(8)]

    def __call__(self, queries: Sequence[str], k: int) -> Hits:
        n = len(self.calls)
        self.calls.append(list(queries))
        self.entered[n].set()
        self.gates[n].wait(10)
        return hits([[int(q) * 10 + r for r in range(k)] for q in queries])

    async def go(self, n: int) -> None:
        self.gates[n].set()
        assert await asyncio.to_thread(self.entered[n + 1].wait, 10)


async def test_a_long_request_waits_for_one_call_of_short_ones_at_most() -> None:
    fn = GatedSearch()
    batcher = MicroBatcher("t", fn, max_chars=16)
    tasks = [asyncio.ensure_future(batcher.submit(["1"], 1))]
    assert await asyncio.to_thread(fn.entered[0].wait, 10)
    tasks += [asyncio.ensure_future(batcher.submit(["00000002"], 1)), asyncio.ensure_future(batcher.submit(["3"], 1))]
    await asyncio.sleep(0)
    await fn.go(0)  # the short one goes before the long one
    tasks.append(asyncio.ensure_future(batcher.submit(["4"], 1)))
    await asyncio.sleep(0)
    await fn.go(1)  # then the long one, though a short one is waiting again
    fn.gates[2].set()
    fn.gates[3].set()
    await asyncio.gather(*tasks)
    assert fn.calls == [["1"], ["3"], ["00000002"], ["4"]]
    await batcher.aclose()


def test_hits_helpers() -> None:
    h = hits([[3, 4, -1]], [[2.0, 1.0, 0.0]])
    assert h.per_query(0) == [(3, 2.0), (4, 1.0)]
    assert h.rows(0, 1, 1).ids.tolist() == [[3]]
    assert Hits.empty(1, 4).ids.tolist() == [[-1, -1, -1, -1]]
    with pytest.raises(ValueError):
        Hits(np.zeros((1, 2), dtype=np.int64), np.zeros((1, 3), dtype=np.float32))


# --------------------------------------------------------------------------- query vectors
def test_query_vector_cache_is_a_bounded_lru_keyed_by_encoder_and_text() -> None:
    from plugsearch.retriever.encoders.encoder import QueryVectorCache

    cache = QueryVectorCache(2)
    vec = np.eye(3, dtype=np.float32)
    cache.put("minilm", ["a", "b"], vec[:2])
    assert [v is not None for v in cache.get("minilm", ["a", "b", "c"])] == [True, True, False]
    assert cache.get("e5", ["a"]) == [None]  # another encoder's vector is not this one's
    found = cache.get("minilm", ["a"])[0]  # "a" is now the most recent: "b" goes first
    assert found is not None and np.array_equal(found, vec[0])
    cache.put("minilm", ["c"], vec[2:])
    assert [v is not None for v in cache.get("minilm", ["a", "b", "c"])] == [True, False, True]
    assert len(cache) == 2 and (cache.hits, cache.misses) == (5, 3)
