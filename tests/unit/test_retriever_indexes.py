"""Index builds: streamed + resumable embeddings, every FAISS index type, shards, bm25s build and manifest."""

from __future__ import annotations

import shutil
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import numpy.typing as npt
import pytest

from plugsearch.retriever.backends.bm25s_index import Bm25sRetriever, build_bm25s
from plugsearch.retriever.backends.faiss_index import FaissIndex, build_faiss, device_groups
from plugsearch.retriever.indexing.embeddings import embed_corpus, embeddings_key
from plugsearch.retriever.settings import EncoderSettings, FaissSettings
from plugsearch.retriever.store.corpus import Corpus
from plugsearch.retriever.store.manifest import IndexMissing, Manifest
from tests.support.retriever import write_tiny_corpus


class HashEncoder:
    """Deterministic stand-in for the MiniLM encoder: a unit vector per passage (bag of hashed words)."""

    dims = 32

    def __init__(self, fail_after: int | None = None) -> None:
        self.calls = 0
        self.fail_after = fail_after

    def encode_passages(self, passages: Sequence[str]) -> npt.NDArray[np.float32]:
        if self.fail_after is not None and self.calls >= self.fail_after:
            raise KeyboardInterrupt("simulated interruption")
        self.calls += 1
        out = np.zeros((len(passages), self.dims), dtype=np.float32)
        for i, text in enumerate(passages):
            for word in text.lower().split():
                out[i, sum(word.encode()) % self.dims] += 1.0
        out += 1e-3
        return out / np.linalg.norm(out, axis=1, keepdims=True)


@pytest.fixture(scope="module")
def corpus(data_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Corpus:
    return Corpus.load(write_tiny_corpus(data_dir, tmp_path_factory.mktemp("idx") / "tiny.jsonl"))


def test_embeddings_stream_to_chunks_and_resume(corpus: Corpus, tmp_path: Path) -> None:
    settings = EncoderSettings()
    with pytest.raises(KeyboardInterrupt):
        embed_corpus(corpus, tmp_path, settings, encoder=HashEncoder(fail_after=2), chunk_size=64,  # type: ignore[arg-type]
                     show_progress=False)
    partial = tmp_path / f"embeddings-{embeddings_key(corpus.checksum, settings)}.partial"
    assert sorted(p.name for p in partial.glob("chunk-*.npy")) == ["chunk-000000.npy", "chunk-000001.npy"]
    resumed = HashEncoder()
    done = embed_corpus(corpus, tmp_path, settings, encoder=resumed, chunk_size=64,  # type: ignore[arg-type]
                        show_progress=False)
    n_chunks = -(-len(corpus) // 64)
    assert resumed.calls == n_chunks - 2  # only the chunks missing after the interruption
    assert not partial.exists()
    manifest = Manifest.read(done)
    assert manifest.doc_count == len(corpus) and manifest.dims == 32 and manifest.params["chunks"] == n_chunks
    vectors = np.concatenate([np.load(p) for p in sorted(done.glob("chunk-*.npy"))])
    expected = HashEncoder().encode_passages([corpus.passage(i) for i in range(len(corpus))])
    np.testing.assert_allclose(vectors, expected, rtol=1e-6)
    again = HashEncoder()
    assert embed_corpus(corpus, tmp_path, settings, encoder=again, show_progress=False) == done  # type: ignore[arg-type]
    assert again.calls == 0


@pytest.fixture(scope="module")
def embeddings(corpus: Corpus, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return embed_corpus(corpus, tmp_path_factory.mktemp("emb"), EncoderSettings(), encoder=HashEncoder(),  # type: ignore[arg-type]
                        chunk_size=128, show_progress=False)


@pytest.mark.parametrize("index_type", ["flat", "hnsw", "sq8", "ivfpq", "ivfsq8"])
def test_every_faiss_type_builds_loads_and_finds_itself(embeddings: Path, tmp_path: Path, index_type: str) -> None:
    settings = FaissSettings(index_type=index_type, train_size=1000, ivf_nlist=4, pq_m=8, nprobe=4)  # type: ignore[arg-type]
    manifest = build_faiss(embeddings, tmp_path / index_type, settings, show_progress=False)
    assert manifest.index_type == index_type and manifest.dims == 32
    index = FaissIndex(tmp_path / index_type, settings)
    queries = np.concatenate([np.load(p) for p in sorted(embeddings.glob("chunk-*.npy"))])[:40]
    hits = index.search(queries, 5)
    found_self = np.mean([i in hits.ids[i] for i in range(40)])
    assert found_self >= (1.0 if index_type == "flat" else 0.6), found_self
    assert (hits.scores[:, :-1] >= hits.scores[:, 1:] - 1e-5).all()


def test_flat_shards_give_the_same_results_as_one_index(embeddings: Path, tmp_path: Path) -> None:
    one = build_faiss(embeddings, tmp_path / "one", FaissSettings(), show_progress=False)
    sharded = build_faiss(embeddings, tmp_path / "sharded", FaissSettings(shard_size=1000), show_progress=False)
    assert one.files == ["shard-00000.faiss"] and len(sharded.files) == 1  # 300 vectors < 1000
    queries = np.load(sorted(embeddings.glob("chunk-*.npy"))[0])[:20]
    a = FaissIndex(tmp_path / "one", FaissSettings()).search(queries, 10)
    b = FaissIndex(tmp_path / "sharded", FaissSettings()).search(queries, 10)
    assert (a.ids == b.ids).all()


def test_flat_index_split_into_shards(corpus: Corpus, tmp_path: Path) -> None:
    big = Corpus(path=corpus.path, checksum=corpus.checksum)
    for rep in range(8):  # 2,400 passages -> three shards of at most 1,000 vectors
        big.ids += [f"{rep}-{i}" for i in corpus.ids]
        big.titles += corpus.titles
        big.texts += [f"{t} copy{rep}" for t in corpus.texts]
    emb = embed_corpus(big, tmp_path, EncoderSettings(), encoder=HashEncoder(), chunk_size=700,  # type: ignore[arg-type]
                       show_progress=False)
    manifest = build_faiss(emb, tmp_path / "sharded", FaissSettings(shard_size=1000), show_progress=False)
    assert manifest.files == ["shard-00000.faiss", "shard-00001.faiss", "shard-00002.faiss"]
    index = FaissIndex(tmp_path / "sharded", FaissSettings())
    assert index.index.ntotal == len(big)
    queries = np.load(emb / "chunk-000002.npy")[:50]  # vectors 1400..1449 live in the second shard
    hits = index.search(queries, 1)
    scores = (queries * np.load(emb / "chunk-000002.npy")[:50]).sum(axis=1)
    np.testing.assert_allclose(hits.scores[:, 0], scores, rtol=1e-5)  # best match = itself (or a tie)


@pytest.fixture(scope="module")
def three_shards(corpus: Corpus, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, npt.NDArray[np.float32]]:
    """A flat index of 2,400 vectors in three shards (1,000 + 1,000 + 400), and the vectors."""
    tmp = tmp_path_factory.mktemp("three")
    big = Corpus(path=corpus.path, checksum=corpus.checksum)
    for rep in range(8):
        big.ids += [f"{rep}-{i}" for i in corpus.ids]
        big.titles += corpus.titles
        big.texts += [f"{t} copy{rep}" for t in corpus.texts]
    emb = embed_corpus(big, tmp, EncoderSettings(), encoder=HashEncoder(), chunk_size=700,  # type: ignore[arg-type]
                       show_progress=False)
    build_faiss(emb, tmp / "flat", FaissSettings(shard_size=1000), show_progress=False)
    return tmp / "flat", np.concatenate([np.load(p) for p in sorted(emb.glob("chunk-*.npy"))])


def test_device_groups_are_contiguous_even_runs() -> None:
    assert device_groups(3, 2) == [range(0, 1), range(1, 3)]
    assert device_groups(11, 4) == [range(0, 2), range(2, 5), range(5, 8), range(8, 11)]
    assert device_groups(2, 8) == [range(0, 1), range(1, 2)]  # never a device without a shard
    assert device_groups(5, 1) == [range(0, 5)]
    for n_shards, n_devices in [(1, 1), (7, 3), (21, 8), (3, 3)]:
        groups = device_groups(n_shards, n_devices)
        assert [i for g in groups for i in g] == list(range(n_shards))
        assert max(map(len, groups)) - min(map(len, groups)) <= 1


class FakeGpus:
    """faiss-gpu's API on faiss-cpu: a 'GPU index' is the CPU shard, and every clone is recorded."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, n: int) -> None:
        import faiss

        self.resources: list[object] = []
        self.clones: list[tuple[int, int, bool]] = []  # (resources number, device, fp16)
        fake = self

        class Resources:
            def __init__(self) -> None:
                fake.resources.append(self)

        class Options:
            useFloat16 = False

        def to_gpu(resources: object, device: int, index: object, options: Options) -> object:
            fake.clones.append((fake.resources.index(resources), device, options.useFloat16))
            return index

        self.shard_groups: list[tuple[bool, object]] = []  # (threaded, the IndexShards)
        self.successive: list[bool] = []
        real_shards = faiss.IndexShards

        def shards(dims: int, threaded: bool, successive_ids: bool) -> object:
            made = real_shards(dims, threaded, successive_ids)
            fake.shard_groups.append((threaded, made))
            fake.successive.append(successive_ids)
            return made

        monkeypatch.setattr(faiss, "IndexShards", shards)
        monkeypatch.setattr(faiss, "get_num_gpus", lambda: n, raising=False)
        monkeypatch.setattr(faiss, "StandardGpuResources", Resources, raising=False)
        monkeypatch.setattr(faiss, "GpuClonerOptions", Options, raising=False)
        monkeypatch.setattr(faiss, "index_cpu_to_gpu", to_gpu, raising=False)


@pytest.mark.parametrize("n_gpus", [1, 2, 3, 8])
def test_gpu_shards_one_resources_per_gpu_and_one_thread_per_gpu(
        three_shards: tuple[Path, npt.NDArray[np.float32]], monkeypatch: pytest.MonkeyPatch, n_gpus: int) -> None:
    import faiss

    folder, vectors = three_shards
    gpus = FakeGpus(monkeypatch, n_gpus)
    index = FaissIndex(folder, FaissSettings(gpu=True))
    groups = device_groups(3, n_gpus)
    # one resources object per GPU in use; every shard cloned as fp16 with its own GPU's resources
    assert len(gpus.resources) == len(groups)
    assert gpus.clones == [(device, device, True) for device, shards in enumerate(groups) for _ in shards]
    # a GPU with several shards searches them in one thread; only the GPUs are searched in parallel
    threaded = {id(shards): flag for flag, shards in gpus.shard_groups}
    assert all(successive for successive in gpus.successive)
    top = index.index
    if len(groups) == 1:
        assert threaded[id(top)] is False and top.count() == 3
    else:
        assert threaded[id(top)] is True and top.count() == len(groups)
        subs = [s for s in index._keep if id(s) in threaded and s is not top]
        assert [s.count() for s in subs] == [len(g) for g in groups if len(g) > 1]
        assert all(threaded[id(s)] is False for s in subs)
    # the same answers as exact search over every vector, ids in corpus order
    queries = vectors[[5, 1200, 2300, 999, 1000]]
    hits = index.search(queries, 5)
    exact = faiss.IndexFlatIP(vectors.shape[1])
    exact.add(vectors)
    scores, _ = exact.search(queries, 5)
    np.testing.assert_allclose(hits.scores, scores, rtol=1e-5)
    np.testing.assert_allclose((vectors[hits.ids[:, 0]] * queries).sum(axis=1), scores[:, 0], rtol=1e-5)


def test_gpu_refuses_an_index_that_is_not_flat(embeddings: Path, tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    build_faiss(embeddings, tmp_path / "sq8", FaissSettings(index_type="sq8", train_size=1000), show_progress=False)
    FakeGpus(monkeypatch, 1)
    with pytest.raises(IndexMissing, match="only flat"):
        FaissIndex(tmp_path / "sq8", FaissSettings(gpu=True))


def test_bm25s_build_manifest_and_search(corpus: Corpus, tmp_path: Path) -> None:
    manifest = build_bm25s(corpus, tmp_path / "bm25s", show_progress=False)
    assert manifest.doc_count == len(corpus) and manifest.params["k1"] == 1.5 and manifest.params["b"] == 0.75
    retriever = Bm25sRetriever(tmp_path / "bm25s")
    target = 7
    hits = retriever.batch_search([corpus.texts[target][:150], "¿Quién dirigió zzzq?"], 4)
    assert hits.ids[0, 0] == target
    assert hits.ids[1].tolist() == [-1, -1, -1, -1]  # no known term: no hits (and no crash)
    assert retriever.batch_search(["film"], 10_000).ids.shape == (1, 10_000)


@pytest.mark.parametrize("index_type", ["ivfsq8", "ivfpq"])
def test_ivf_parts_merge_into_on_disk_lists_that_follow_their_folder(embeddings: Path, tmp_path: Path,
                                                                     index_type: str) -> None:
    import faiss

    queries = np.concatenate([np.load(p) for p in sorted(embeddings.glob("chunk-*.npy"))])[:40]
    one = FaissSettings(index_type=index_type, train_size=1000, ivf_nlist=4, pq_m=8, nprobe=4)  # type: ignore[arg-type]
    parts = one.model_copy(update={"shard_size": 70})  # five parts of at most 70 vectors
    a = build_faiss(embeddings, tmp_path / "one", one, show_progress=False)
    b = build_faiss(embeddings, tmp_path / "built" / "parts", parts, show_progress=False)
    assert a.files == b.files == ["index.faiss", "lists.ivfdata"] and a.params["ivf_nlist"] == 4
    assert sorted(p.name for p in (tmp_path / "built" / "parts").iterdir()) == [*b.files, "manifest.json"]
    (tmp_path / "built").rename(tmp_path / "moved")  # the lists file is found beside its index, wherever
    loaded = FaissIndex(tmp_path / "moved" / "parts", parts)
    lists = faiss.extract_index_ivf(loaded.index).invlists
    assert type(faiss.downcast_InvertedLists(lists)).__name__ == "OnDiskInvertedLists"
    assert loaded.ntotal == 300 and faiss.extract_index_ivf(loaded.index).nprobe == 4
    same = FaissIndex(tmp_path / "one", one).search(queries, 5)
    got = loaded.search(queries, 5)
    assert (got.ids == same.ids).all()  # the same trained quantizer on the same sample: the same lists
    held = FaissIndex(tmp_path / "one", one.model_copy(update={"mmap": False})).search(queries, 5)
    assert (held.ids == same.ids).all()


def test_an_ivf_build_stopped_part_way_goes_on_from_its_last_part(embeddings: Path, tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """The trained index and each filled part are kept beside the index folder: a build stopped after its second
    part trains nothing again, fills only the parts after it, and answers as an uninterrupted build does."""
    import faiss

    from plugsearch.retriever.backends import faiss_index

    queries = np.concatenate([np.load(p) for p in sorted(embeddings.glob("chunk-*.npy"))])[:40]
    settings = FaissSettings(index_type="ivfsq8", train_size=1000, ivf_nlist=4, nprobe=4  # type: ignore[arg-type]
                             ).model_copy(update={"shard_size": 70})  # five parts of at most 70 vectors
    whole = build_faiss(embeddings, tmp_path / "whole", settings, show_progress=False)
    real_write, writes = faiss.write_index, []

    def stopping_write(index: object, path: str) -> None:
        writes.append(Path(path).name)
        if sum(".part-" in w for w in writes) == 3:
            raise KeyboardInterrupt  # stopped while the third part was written
        real_write(index, path)

    monkeypatch.setattr(faiss, "write_index", stopping_write)
    with pytest.raises(KeyboardInterrupt):
        build_faiss(embeddings, tmp_path / "stopped", settings, show_progress=False)
    work = tmp_path / ".stopped.build"
    assert sorted(p.name for p in work.glob("part-*")) == ["part-00000.faiss", "part-00001.faiss"]
    monkeypatch.setattr(faiss, "write_index", real_write)
    shutil.copytree(work, tmp_path / ".other.build")  # the parts, as if left by a build of other settings
    trained: list[int] = []
    monkeypatch.setattr(faiss_index, "_training_sample", lambda *a: trained.append(1) or None)
    resumed = build_faiss(embeddings, tmp_path / "stopped", settings, show_progress=False)
    assert trained == [] and not work.exists() and resumed.doc_count == whole.doc_count == 300
    got = FaissIndex(tmp_path / "stopped", settings).search(queries, 5)
    want = FaissIndex(tmp_path / "whole", settings).search(queries, 5)
    assert (got.ids == want.ids).all() and np.allclose(got.scores, want.scores)
    monkeypatch.undo()
    other = settings.model_copy(update={"ivf_nlist": 8})  # another build's parts are never taken
    real_sample, trained = faiss_index._training_sample, []
    monkeypatch.setattr(faiss_index, "_training_sample", lambda *a: trained.append(1) or real_sample(*a))
    build_faiss(embeddings, tmp_path / "other", other, show_progress=False)
    index = FaissIndex(tmp_path / "other", other)
    assert trained == [1] and index.ntotal == 300 and faiss.extract_index_ivf(index.index).nlist == 8


def test_an_ivf_build_may_assign_its_vectors_through_a_graph_over_the_centroids(embeddings: Path,
                                                                                tmp_path: Path) -> None:
    """ivf_assign=hnsw: each vector's list found by an HNSW graph over the centroids instead of against every one
    (what makes a 21M build affordable); the lists it finds are the exact ones, and the index answers as the
    exactly assigned one does."""
    import faiss

    from plugsearch.retriever.backends import faiss_index

    vectors = np.concatenate([np.load(p) for p in sorted(embeddings.glob("chunk-*.npy"))])
    exact = FaissSettings(index_type="ivfsq8", train_size=1000, ivf_nlist=16, nprobe=16, ivf_assign="exact")  # type: ignore[arg-type]
    graph = exact.model_copy(update={"ivf_assign": "hnsw"})
    trained = faiss_index.new_faiss_index(vectors.shape[1], len(vectors), exact)
    trained.train(vectors)
    assert faiss_index._assigner(trained, exact) is None
    assert faiss_index._assigner(trained, exact.model_copy(update={"ivf_assign": "auto"})) is None  # 16 lists
    _, want = faiss.extract_index_ivf(trained).quantizer.search(vectors, 1)
    _, got = faiss_index._assigner(trained, graph).search(vectors, 1)
    assert (got == want).mean() >= 0.98
    build_faiss(embeddings, tmp_path / "exact", exact, show_progress=False)
    build_faiss(embeddings, tmp_path / "graph", graph, show_progress=False)
    a = FaissIndex(tmp_path / "exact", exact).search(vectors[:40], 5)
    b = FaissIndex(tmp_path / "graph", graph).search(vectors[:40], 5)
    assert FaissIndex(tmp_path / "graph", graph).ntotal == 300 and (a.ids == b.ids).mean() >= 0.95


_MAPPED_VS_HELD = """
import sys
import numpy as np
from plugsearch.retriever.backends.faiss_index import read_index

def rss_anon_kb():
    with open("/proc/self/status") as fh:
        return next(int(line.split()[1]) for line in fh if line.startswith("RssAnon:"))

path = sys.argv[1]
before = rss_anon_kb()
mapped = read_index(path, mmap=True)
mapped_anon = rss_anon_kb() - before
held = read_index(path, mmap=False)
held_anon = rss_anon_kb() - before - mapped_anon
q = np.random.default_rng(0).standard_normal((8, 256), dtype=np.float32)
same = bool((mapped.search(q, 5)[1] == held.search(q, 5)[1]).all())
print(held_anon, mapped_anon, same)
"""


def test_mapped_flat_index_is_shared_page_cache_not_private_memory(tmp_path: Path) -> None:
    """RETRIEVER_FAISS__MMAP: the codes are file pages of the index (shared by the workers), not a private
    copy; the results are the same. Measured in a fresh interpreter: in this one, memory freed by earlier
    tests is reused without growing RssAnon."""
    import subprocess
    import sys

    import faiss

    rng = np.random.default_rng(0)
    vectors = rng.standard_normal((60_000, 256), dtype=np.float32)  # 61 MB of codes
    flat = faiss.IndexFlatIP(256)
    flat.add(vectors)
    faiss.write_index(flat, str(tmp_path / "flat.faiss"))
    del flat
    out = subprocess.run([sys.executable, "-c", _MAPPED_VS_HELD, str(tmp_path / "flat.faiss")], check=True,
                         capture_output=True, text=True, timeout=300, cwd=Path(__file__).resolve().parents[2])
    held_anon, mapped_anon, same = out.stdout.split()
    assert int(held_anon) > 50_000 and int(mapped_anon) < 10_000, (held_anon, mapped_anon)
    assert same == "True"


def test_an_ivf_index_of_the_former_layout_still_loads(embeddings: Path, tmp_path: Path) -> None:
    """IVF-PQ was stored as one shard file with its lists inside: served as it is (its lists mapped)."""
    import faiss

    from plugsearch.retriever.store.manifest import Manifest

    settings = FaissSettings(index_type="ivfpq", train_size=1000, ivf_nlist=4, pq_m=8, nprobe=4)
    vectors = np.concatenate([np.load(p) for p in sorted(embeddings.glob("chunk-*.npy"))])
    index = faiss.index_factory(32, "IVF4,PQ8", faiss.METRIC_INNER_PRODUCT)
    index.train(vectors)
    index.add(vectors)
    folder = tmp_path / "dense-ivfpq"
    folder.mkdir()
    faiss.write_index(index, str(folder / "shard-00000.faiss"))
    source = Manifest.read(embeddings)
    Manifest(kind="dense", backend="faiss", corpus_path=source.corpus_path, corpus_checksum=source.corpus_checksum,
             doc_count=len(vectors), dims=32, index_type="ivfpq", files=["shard-00000.faiss"]).write(folder)
    index.nprobe = 4
    want = index.search(vectors[:20], 5)[1]
    assert (FaissIndex(folder, settings).search(vectors[:20], 5).ids == want).all()
