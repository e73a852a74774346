"""The retriever with its dense index on Milvus (milvus-lite in a local `.db` folder, in-process).

- the FAISS API tests of test_retriever_api.py, run again here against a Milvus-backed app (same fixtures
  names: `tiny`, `client`), so both backends answer the same API the same way;
- a FLAT collection ranks exactly as FAISS flat does (same top-10 ids for real questions); HNSW is an option;
- a build killed part-way resumes where it stopped, with the same checksum as an uninterrupted one;
- start-up refuses a collection that differs from its manifest (rows, checksum, missing);
- a Milvus that stops answering is a 503 with Retry-After in the error envelope, BM25 keeps serving.

The collection is built once from the tiny corpus's cached embeddings (no re-encoding) and cached with them.
"""

from __future__ import annotations

import asyncio
import json
import shutil
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
from pydantic import SecretStr

from plugsearch.common.errors import NotReady
from plugsearch.retriever.api import create_app
from plugsearch.retriever.backends import milvus_index
from plugsearch.retriever.backends.faiss_index import FaissIndex, dense_folder
from plugsearch.retriever.encoders.encoder import Encoder
from plugsearch.retriever.indexing.embeddings import embed_corpus
from plugsearch.retriever.serving import check_indexes
from plugsearch.retriever.settings import RetrieverSettings
from plugsearch.retriever.store.chunks import iter_chunks
from plugsearch.retriever.store.corpus import Corpus
from plugsearch.retriever.store.manifest import IndexMismatch, IndexMissing, Manifest
from tests.api.test_retriever_api import (  # noqa: F401 - collected here again, against this module's fixtures
    assert_envelope,
    test_concurrent_requests_all_answered_correctly,
    test_default_method_and_k_larger_than_corpus,
    test_every_method_returns_ranked_documents,
    test_ops_endpoints,
    test_searchr1_compatible_shapes,
    wait_ready,
)
from tests.asgi import app_client
from tests.conftest import first_questions
from tests.support.retriever import cached_index_dir, ensure_tiny_indexes, tiny_settings, write_tiny_corpus

pytest.importorskip("pymilvus")
pytest.importorskip("milvus_lite")


def milvus_settings(corpus: Path, index_dir: Path, uri: Path, **milvus_overrides: object) -> RetrieverSettings:
    return tiny_settings(corpus, index_dir, dense_backend="milvus",
                         milvus={"uri": str(uri), "insert_batch": 100, "retries": 1, "retry_backoff_s": 0.05,
                                 **milvus_overrides})


@pytest.fixture(scope="module")
def tiny(data_dir: Path, var_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> RetrieverSettings:
    corpus = write_tiny_corpus(data_dir, tmp_path_factory.mktemp("retriever-milvus") / "tiny.jsonl")
    index_dir = cached_index_dir(var_dir, corpus)
    faiss = tiny_settings(corpus, index_dir)
    ensure_tiny_indexes(faiss, bm25=["bm25s"], dense=True)  # the FAISS flat index and the embeddings
    settings = milvus_settings(corpus, index_dir, index_dir / "milvus.db")
    ensure_tiny_indexes(settings, bm25=[], dense=True)  # loads the cached embeddings into the collection
    return settings


@pytest.fixture()
async def client(tiny: RetrieverSettings) -> AsyncIterator[httpx.AsyncClient]:
    async with app_client(create_app(tiny)) as c:
        await wait_ready(c)
        yield c


@pytest.fixture(scope="module")
def questions(data_dir: Path) -> list[str]:
    return first_questions(data_dir, ("nq", "hotpotqa", "popqa"), 40)


@pytest.fixture()
def scratch(tiny: RetrieverSettings, tmp_path: Path) -> Iterator[RetrieverSettings]:
    """A copy of the built collection and its manifest, free to damage; its milvus-lite released after."""
    index_dir = tmp_path / "indexes"
    for name in ("bm25s", milvus_index.milvus_folder(Path(), tiny.milvus.collection).name):
        shutil.copytree(tiny.index_dir / name, index_dir / name, symlinks=True)
    shutil.copytree(Path(tiny.milvus.uri), tmp_path / "copy.db")
    settings = milvus_settings(tiny.corpus, index_dir, tmp_path / "copy.db")
    yield settings
    milvus_index.release_local(settings.milvus)


def test_flat_collection_ranks_as_exact_faiss(tiny: RetrieverSettings, questions: list[str]) -> None:
    encoder = Encoder(tiny.encoder)
    vectors = encoder.encode_queries(questions)
    exact = FaissIndex(dense_folder(tiny.index_dir, "flat"), tiny.faiss).search(vectors, 10)
    index = milvus_index.MilvusIndex(milvus_index.milvus_folder(tiny.index_dir, tiny.milvus.collection), tiny.milvus)
    try:
        assert index.ntotal == 300 and index.manifest.index_type == "flat"
        got = index.search(vectors, 10)
        over = index.search(vectors[:2], 500)  # k over the collection: every row once, padded with -1
    finally:
        index.close()
    assert got.ids.tolist() == exact.ids.tolist()
    np.testing.assert_allclose(got.scores, exact.scores, atol=1e-4)
    assert (over.ids[:, :300] >= 0).all() and (over.ids[:, 300:] == -1).all()
    assert len(set(over.ids[0, :300].tolist())) == 300


def test_hnsw_collection_is_an_option(tiny: RetrieverSettings, tmp_path: Path) -> None:
    settings = milvus_settings(tiny.corpus, tmp_path, tmp_path / "hnsw.db", index_type="hnsw",
                               collection="plugsearch_hnsw", hnsw_ef_search=16)
    embeddings = embed_corpus(Corpus.load(tiny.corpus), tiny.index_dir, tiny.encoder, chunk_size=128,
                              show_progress=False)  # cached: nothing is encoded
    manifest = milvus_index.build_milvus(embeddings, tmp_path, settings.milvus, show_progress=False)
    assert manifest.index_type == "hnsw" and manifest.params["hnsw_m"] == 32
    flat = milvus_index.MilvusIndex(milvus_index.milvus_folder(tiny.index_dir, tiny.milvus.collection), tiny.milvus)
    passages = np.concatenate(list(iter_chunks(embeddings)))[::5]  # passages as queries, moved a little
    noisy = passages + np.random.default_rng(0).normal(0, 0.02, passages.shape).astype(np.float32)
    vectors = np.ascontiguousarray(noisy / np.linalg.norm(noisy, axis=1, keepdims=True), dtype=np.float32)
    try:
        exact = flat.search(vectors, 10)
    finally:
        flat.close()
    hnsw = milvus_index.MilvusIndex(milvus_index.milvus_folder(tmp_path, "plugsearch_hnsw"), settings.milvus)
    try:
        approx = hnsw.search(vectors, 50)  # ef is raised to k
    finally:
        hnsw.close()
    recall = np.mean([len(set(a[:10]) & set(e)) / 10 for a, e in zip(approx.ids.tolist(), exact.ids.tolist(),
                                                                     strict=True)])
    assert recall >= 0.95 and (approx.ids >= 0).all()


def test_a_killed_build_resumes_with_the_same_checksum(tiny: RetrieverSettings, tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    settings = milvus_settings(tiny.corpus, tmp_path, tmp_path / "resume.db", insert_batch=50)
    embeddings = embed_corpus(Corpus.load(tiny.corpus), tiny.index_dir, tiny.encoder, chunk_size=128, show_progress=False)
    real_call = milvus_index.call
    inserts = 0

    def dying_call(settings: object, what: str, fn: object, *args: object, **kwargs: object) -> object:
        nonlocal inserts
        if what == "insert":
            inserts += 1
            if inserts == 4:
                raise KeyboardInterrupt  # as a killed build: nothing after this batch runs
        return real_call(settings, what, fn, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(milvus_index, "call", dying_call)
    with pytest.raises(KeyboardInterrupt):
        milvus_index.build_milvus(embeddings, tmp_path, settings.milvus, show_progress=False)
    state = json.loads((tmp_path / ".milvus-plugsearch_dense.build.json").read_text())
    assert state["loaded"] == 128 and not (tmp_path / "milvus-plugsearch_dense").exists()  # 50+50+28: chunk end
    monkeypatch.setattr(milvus_index, "call", real_call)
    created: list[str] = []
    create = milvus_index._create_collection
    monkeypatch.setattr(milvus_index, "_create_collection", lambda *a: created.append("again") or create(*a))
    manifest = milvus_index.build_milvus(embeddings, tmp_path, settings.milvus, show_progress=False)
    assert created == []  # resumed: the collection was not dropped and created again
    expected = Manifest.read(milvus_index.milvus_folder(tiny.index_dir, tiny.milvus.collection))
    assert manifest.params["checksum"] == expected.params["checksum"] and manifest.doc_count == 300
    assert not (tmp_path / ".milvus-plugsearch_dense.build.json").exists()
    client, rows = milvus_index.open_checked(settings.milvus, manifest)  # ids unique: no row twice after the resume
    client.close()
    milvus_index.release_local(settings.milvus)
    assert rows == 300


async def test_startup_refuses_a_collection_that_differs_from_its_manifest(scratch: RetrieverSettings) -> None:
    check_indexes(scratch)  # the copy as built is accepted
    client = milvus_index.connect(scratch.milvus)
    client.delete(scratch.milvus.collection, ids=[7])
    client.close()
    with pytest.raises(IndexMismatch, match=r"row count 299 != manifest 300.*plugsearch-index build"):
        async with app_client(create_app(scratch)):
            pass
    client = milvus_index.connect(scratch.milvus)
    client.alter_collection_properties(scratch.milvus.collection, properties={milvus_index.CHECKSUM_PROPERTY: "other"})
    client.close()
    with pytest.raises(IndexMismatch, match="checksum other != manifest"):
        check_indexes(scratch)
    with pytest.raises(IndexMismatch, match="index type 'flat' != configured 'hnsw'"):
        check_indexes(scratch.model_copy(update={"milvus": scratch.milvus.model_copy(update={"index_type": "hnsw"})}))
    client = milvus_index.connect(scratch.milvus)
    client.drop_collection(scratch.milvus.collection)
    client.close()
    with pytest.raises(IndexMissing, match="does not exist"):
        check_indexes(scratch)


async def test_milvus_down_is_a_503_with_retry_after(client: httpx.AsyncClient, tiny: RetrieverSettings) -> None:
    assert (await client.post("/retrieve", json={"queries": ["film"], "method": "dense"})).status_code == 200
    milvus_index.release_local(tiny.milvus)  # the engine stops answering (as a cluster that went down)
    for method in ("dense", "hybrid"):
        response = await client.post("/retrieve", json={"queries": ["film", "physics"], "method": method})
        error = assert_envelope(response, 503)
        assert error["type"] == "not_ready" and "Milvus" in error["message"]
        assert response.headers["retry-after"] == str(tiny.milvus.retry_after_s)
    assert (await client.post("/retrieve", json={"queries": ["film"], "method": "bm25"})).status_code == 200
    ready = await client.get("/health/ready")
    assert ready.status_code == 503 and "Milvus does not answer" in ready.json()["checks"]["indexes"]
    assert (await client.get("/health/live")).status_code == 200


def test_a_search_that_keeps_failing_raises_not_ready(tiny: RetrieverSettings) -> None:
    calls = 0

    def broken(*args: object, timeout: float) -> None:
        nonlocal calls
        calls += 1
        assert timeout == tiny.milvus.timeout_s
        raise ConnectionError("down")

    with pytest.raises(NotReady) as caught:
        milvus_index.call(tiny.milvus, "search", broken)
    assert calls == tiny.milvus.retries + 1 and caught.value.retry_after == tiny.milvus.retry_after_s


def test_index_builds_and_loads_get_the_long_deadline(tiny: RetrieverSettings) -> None:
    """Building an index over a large collection, or loading it, outlasts a search's deadline (an HNSW index
    over 100k vectors took longer than 10 s on milvus-lite): those calls get `build_timeout_s`."""
    seen: list[float] = []

    def record(*args: object, timeout: float) -> str:
        seen.append(timeout)
        return "done"

    assert milvus_index.call(tiny.milvus, "create_index", record, long=True) == "done"
    assert milvus_index.call(tiny.milvus, "search", record) == "done"
    assert seen == [tiny.milvus.build_timeout_s, tiny.milvus.timeout_s]
    assert tiny.milvus.build_timeout_s > tiny.milvus.timeout_s


def test_a_retried_index_build_does_not_ask_twice(tiny: RetrieverSettings) -> None:
    """The first create_index runs out of time while Milvus goes on building; the retry finds the index and
    does not ask again (Milvus would refuse: index already exists)."""

    class Client:
        def __init__(self) -> None:
            self.indexes: list[str] = []
            self.asked = 0

        def list_indexes(self, collection: str, timeout: float) -> list[str]:
            return self.indexes

        def prepare_index_params(self) -> object:
            return _Params()

        def create_index(self, collection: str, params: object, timeout: float) -> None:
            self.asked += 1
            self.indexes.append("vector")  # Milvus goes on building it
            raise TimeoutError("deadline exceeded")

    class _Params:
        def add_index(self, **kwargs: object) -> None:
            pass

    client = Client()
    milvus_index.create_index(client, tiny.milvus)
    assert client.asked == 1 and client.indexes == ["vector"]


def _rows(settings: RetrieverSettings) -> tuple[set[int], str]:
    """The collection's ids, and its record of the last change carried into it."""
    client = milvus_index.connect(settings.milvus)
    try:
        client.load_collection(settings.milvus.collection)
        ids = {int(r["id"]) for r in client.query(settings.milvus.collection, filter="id >= 0", output_fields=["id"],
                                                   consistency_level="Strong")}
        properties = client.describe_collection(settings.milvus.collection).get("properties") or {}
        return ids, str(properties.get(milvus_index.CHANGES_PROPERTY, "0"))
    finally:
        client.close()


async def test_changes_go_into_the_collection_through_milvus_upserts_and_deletes(scratch: RetrieverSettings) -> None:
    """A put passage is upserted at its position, a replaced document's old rows and a deleted document's rows
    are deleted from the collection itself; dense search (Milvus alone) finds the new text and never the removed
    one; the collection records the last change carried."""
    token = "internal-token-123"
    settings = scratch.model_copy(update={"internal_token": SecretStr(token)})
    headers = {"Authorization": f"Bearer {token}"}
    base = Corpus.load(scratch.corpus)
    victim = base.ids[0]
    async with app_client(create_app(settings)) as client:
        await wait_ready(client)

        async def dense_top(query: str) -> list[str]:
            body = (await client.post("/retrieve", json={"queries": [query], "method": "dense", "k": 5},
                                  headers=headers)).json()
            return [d["id"] for d in body["results"][0]]

        put = {"documents": [{"id": "orchid-note", "title": "Greenhouse orchids",
                              "text": "Orchids bloom in humid greenhouses every spring."}]}
        assert (await client.put("/documents", json=put, headers=headers)).status_code == 200
        assert (await dense_top("when do greenhouse orchids flower"))[0] == "orchid-note#0"
        ids, carried = _rows(scratch)
        assert 300 in ids and len(ids) == 301 and carried == "1"
        put["documents"][0]["text"] = "Cacti store water in thick stems through the dry desert summer."
        assert (await client.put("/documents", json=put, headers=headers)).status_code == 200  # replaced whole
        assert (await dense_top("how do desert cacti keep water"))[0] == "orchid-note#0"
        gone = base.documents([0])[0][2]
        assert victim in await dense_top(gone[:300])
        deleted = await client.post("/documents/delete", json={"ids": [victim]}, headers=headers)
        assert deleted.status_code == 200
        assert victim not in await dense_top(gone[:300])
        ids, carried = _rows(scratch)
    assert 300 not in ids and 301 in ids and 0 not in ids and len(ids) == 300 and carried == "3"


async def test_a_change_logged_but_not_carried_is_carried_at_start_up(scratch: RetrieverSettings) -> None:
    """A writer killed between its log line and Milvus (or a Milvus that did not answer) leaves the change in the log
    only: the next start-up carries it into the collection before serving; a collection carrying changes its log
    does not hold is refused."""
    from plugsearch.retriever.ingest.passages import Passage
    from plugsearch.retriever.live.changelog import CHANGES_DIR, ChangeLog

    encoder = Encoder(scratch.encoder)
    text = "Lighthouse keepers trimmed the lamp wicks every night on the rocky coast."
    folder = scratch.index_dir / CHANGES_DIR / Corpus.load(scratch.corpus).checksum.split(":")[-1][:16]
    log = ChangeLog(folder)
    log.append([Passage(id="keeper#0", doc_id="keeper", title="Lighthouse keepers", text=text)], [],
               encoder.encode_passages(["Lighthouse keepers\n" + text]))
    log.append([], ["keeper"])
    log.append([Passage(id="keeper#0", doc_id="keeper", title="Lighthouse keepers", text=text)], [])  # logged without vectors
    assert _rows(scratch)[1] == "0"
    async with app_client(create_app(scratch)) as client:
        await wait_ready(client)
        body = (await client.post("/retrieve", json={"queries": ["who trimmed the lighthouse lamp wicks"],
                                                      "method": "dense", "k": 1})).json()
        assert body["results"][0][0]["id"] == "keeper#0"
    ids, carried = _rows(scratch)
    assert carried == "3" and 300 not in ids and 301 in ids and len(ids) == 301
    for lost in folder.glob("changes.sqlite3*"):  # the log lost: the collection carries changes it does not hold
        lost.unlink()
    async with app_client(create_app(scratch)) as client:  # loading fails: readiness says why
        for _ in range(600):
            ready = await client.get("/health/ready")
            if ready.json()["checks"]["indexes"] != "loading":
                break
            await asyncio.sleep(0.05)
    assert ready.status_code == 503 and "carries changes up to 3" in ready.json()["checks"]["indexes"]
