"""Scaling curves of the retriever backends: build time, memory, disk and served throughput against corpus size,
up to wiki-18's 21,015,324 passages.

For each size and backend (bm25s, Lucene via pyserini, FAISS flat / HNSW / SQ8 / IVF-SQ8 / IVF-PQ, Milvus flat /
HNSW on milvus-lite, and `hybrid`: Lucene + FAISS IVF-SQ8 in one retriever): the index is built in a child
process (`build_s`, `build_rss_mb`: its peak RSS, or its Lucene indexer's), then served by the real retriever
(`python -m plugsearch.retriever`, RETRIEVER_WORKERS=2, one thread per worker for each library, adaptive admission
off so that capacity is measured) and measured:

- memory per worker, sampled through the whole serving: `rss_anon_mb` (private memory, RssAnon: what grows
  per worker), `vmhwm_mb` (peak RSS, file pages included); beside them `file_pss_mb`, the page-cache pages the
  workers map (document store, corpus, memory-mapped index files), counted once however many workers share them;
- `qps`: `POST /retrieve` queries/s at batch 1 and 32 (k=10, 8 keep-alive clients), per method served (hybrid:
  bm25, dense and hybrid). Dense queries are sent as text: query encoding is included (`--encoder-backend`);
- `recall_at_10` (dense): the served top-10 against exact inner-product search over the same vectors, and for
  IVF indexes `nprobe_sweep` (in-process recall@10 and search-only queries/s at several nprobe);
- `docs_identical`: every document the service returned for the recall questions equals its corpus line
  (read by a separate streamed pass);
- `disk_mb`: the index and the document store on disk (`corpus_mb` beside it);
- `held` (sizes up to `--held-max`): the same backend served as before the document store (RETRIEVER_DOCSTORE=
  memory, index files read into each worker), its memory, throughput and whether its results are the same.

Corpora are synthetic and streamed to disk in chunks: wiki-18's passage lengths (FlashRAG's sample of it:
100 words), words drawn from the unigram distribution of ../shared/data/corpus/combined.jsonl, its titles
(posting lists follow the real Zipf curve, co-occurrence does not). Vectors: a real MiniLM passage vector
(the combined corpus's embeddings when built under var/indexes, else 1,000 passages encoded here) plus gaussian
noise (sigma 0.04), normalised, 384-d; they are never stored: each chunk is generated again from its seed
whenever a step needs it (training sample, fill, exact truth). No step holds the corpus or its vectors.
Growth is fitted (build_s, disk_mb: a*n^b; memory: base + per-passage) and extrapolated to 21,015,324.

    python bench/scale.py                                  # 100k, 1M, 2M; corpora kept in var/scale
    python bench/scale.py --sizes 100000,1000000 --backends pyserini,faiss-ivfsq8,hybrid
    python bench/scale.py --quick                          # 2k and 10k passages, 1 s windows: the pipeline only
    python bench/scale.py --plot-only                      # redraw docs/scale.png from var/scale/result.json
    python bench/scale.py --sizes 21015324 --backends hybrid --encoder-backend onnx \\
        --clean --resume --update --plot                   # wiki-18 (hours; ~40 GB of disk at its peak)

Writes <work>/result.json after every point (`--update` merges into it; `--resume` keeps finished points and
built indexes) and docs/scale.png (with --plot). The last line printed is the JSON result.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import hashlib
import json
import os
import resource
import shutil
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import orjson

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import CORPUS, DATA, REPO, log  # noqa: E402
from bench.retriever_common import ServedRetriever, peak_rss_mb  # noqa: E402
from bench.retriever_throughput import _service_rate, recall_questions  # noqa: E402

BACKENDS = ("bm25s", "pyserini", "faiss-flat", "faiss-hnsw", "faiss-sq8", "faiss-ivfsq8", "faiss-ivfpq",
            "milvus-flat", "milvus-hnsw", "hybrid")
HYBRID = ("pyserini", "faiss-ivfsq8")  # what `hybrid` serves together
WIKI18 = 21_015_324
DEFAULT_MAX = {"bm25s": 1_000_000, "pyserini": WIKI18, "faiss-flat": 5_000_000,
               "faiss-hnsw": 1_000_000, "faiss-sq8": 5_000_000, "faiss-ivfsq8": WIKI18, "faiss-ivfpq": WIKI18,
               "milvus-flat": 1_000_000, "milvus-hnsw": 1_000_000, "hybrid": WIKI18}
WIKI_SAMPLE = DATA / "corpus" / "flashrag_wiki_sample.jsonl"  # FlashRAG's sample of wiki-18 (its lengths)
DIMS = 384
NOISE = 0.04
K = 10
CHUNK = 50_000
WORKERS = 2
SWEEP = (16, 32, 64, 128, 256)
WORK = REPO / "var" / "scale"
PLOT = REPO / "docs" / "scale.png"


# ------------------------------------------------------------------------------------------------ corpora
def corpus_model(source: Path = CORPUS, lengths_from: Path = WIKI_SAMPLE
                 ) -> tuple[list[str], np.ndarray, np.ndarray, list[str]]:
    """Vocabulary and its cumulative unigram probabilities, titles (of `source`), passage lengths in words (of
    `lengths_from`, wiki-18's when that sample is there, else of `source`)."""
    counts: Counter[str] = Counter()
    titles: list[str] = []
    own: list[int] = []
    with source.open("rb") as fh:
        for line in fh:
            row = orjson.loads(line)
            words = row["text"].split()
            own.append(max(1, len(words)))
            titles.append(row.get("title") or "")
            counts.update(words)
    lengths = own
    if lengths_from.is_file():
        from plugsearch.retriever.store.corpus import iter_corpus

        lengths = [max(1, len(text.split())) for _, _, text in iter_corpus(lengths_from)]
    vocab = [w for w, _ in counts.most_common()]
    freq = np.array([counts[w] for w in vocab], dtype=np.float64)
    return vocab, np.cumsum(freq / freq.sum()), np.array(lengths, dtype=np.int64), titles


_MODEL: tuple[Any, ...] | None = None
"""(words, cdf, lengths, titles, vocabulary size) in a corpus-writing process (`_init_writer`)."""


def _init_writer(model: tuple[list[str], np.ndarray, np.ndarray, list[str]]) -> None:
    global _MODEL
    vocab, cdf, lengths, titles = model
    _MODEL = (np.array(vocab, dtype=object), cdf, lengths, np.array(titles, dtype=object), len(vocab))


def _corpus_chunk(job: tuple[int, int, int, int]) -> bytes:
    """Passages `lo` .. `lo + m - 1` (JSONL), drawn from the chunk's own seed: any chunk is the same bytes whichever
    process writes it, in whatever run."""
    lo, m, seed, chunk = job
    assert _MODEL is not None
    words, cdf, lengths, titles, nvocab = _MODEL
    rng = np.random.default_rng([seed, lo // chunk])
    sizes = rng.choice(lengths, m)
    ids = np.minimum(np.searchsorted(cdf, rng.random(int(sizes.sum()))), nvocab - 1)
    picked = rng.integers(0, len(titles), m)
    ends = np.cumsum(sizes)
    lines = [orjson.dumps({"id": f"s{lo + j}", "title": titles[picked[j]],
                           "text": " ".join(words[ids[ends[j] - sizes[j]:ends[j]]])}) for j in range(m)]
    return b"\n".join(lines) + b"\n"


def write_corpus(n: int, out: Path, *, seed: int = 0, processes: int = WORKERS) -> Path:
    """n synthetic passages (ids s0..s{n-1}), streamed to `out` in chunks by `processes` processes; cached by size
    and seed. Resumable: each chunk is synced and recorded as it is written (`.<name>.partial.json`), and a run
    stopped part-way goes on from the last chunk recorded (chunks are drawn from their own seeds)."""
    from plugsearch.common.files import atomic_write_json, fsync_folder

    meta = out.with_suffix(".json")
    want = {"n": n, "seed": seed, "source": CORPUS.name, "source_bytes": CORPUS.stat().st_size,
            "lengths": WIKI_SAMPLE.name if WIKI_SAMPLE.is_file() else CORPUS.name, "chunk": CHUNK,
            "rng": "per-chunk"}
    if out.is_file() and meta.is_file() and json.loads(meta.read_text()) == want:
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    partial, record = out.with_name(f".{out.name}.partial"), out.with_name(f".{out.name}.partial.json")
    start, size = 0, 0
    if partial.is_file() and record.is_file():
        done = json.loads(record.read_text())
        if done.get("want") == want and partial.stat().st_size >= done["bytes"]:
            start, size = int(done["next"]), int(done["bytes"])
            log(f"corpus: resuming at passage {start:,} of {n:,} ({size / 1e9:.1f} GB written before)")
    for stale in out.parent.glob(f".{out.name}.[0-9]*"):  # an older writer's temporary file
        stale.unlink()
    jobs = [(lo, min(CHUNK, n - lo), seed, CHUNK) for lo in range(start, n, CHUNK)]
    model = corpus_model()
    t0 = time.perf_counter()
    with partial.open("r+b" if start else "wb") as fh:
        fh.truncate(size)  # what a stop left after the last chunk recorded
        fh.seek(size)
        if processes > 1 and len(jobs) > 1:
            import multiprocessing

            # spawned, not forked: a fork of a process whose other threads hold locks can hang the child
            pool = multiprocessing.get_context("spawn").Pool(processes, _init_writer, (model,))
            chunks: Iterator[bytes] = pool.imap(_corpus_chunk, jobs)  # in order, `processes` at work
        else:
            pool = None
            _init_writer(model)
            chunks = map(_corpus_chunk, jobs)
        try:
            for (lo, m, _, _), data in zip(jobs, chunks, strict=True):
                fh.write(data)
                fh.flush()
                os.fsync(fh.fileno())
                size += len(data)
                atomic_write_json(record, {"want": want, "next": lo + m, "bytes": size})
                if (lo // CHUNK) % 20 == 19:
                    rate = (lo + m - start) / max(time.perf_counter() - t0, 1e-9)
                    log(f"corpus: {lo + m:,} of {n:,} passages, {rate:,.0f}/s, about "
                        f"{(n - lo - m) / max(rate, 1e-9) / 60:.0f} min left")
        finally:
            if pool is not None:
                pool.terminate()
    os.replace(partial, out)  # synced chunk by chunk as it was written
    fsync_folder(out.parent)
    atomic_write_json(meta, want)
    record.unlink(missing_ok=True)
    log(f"corpus: {n} synthetic passages in {time.perf_counter() - t0:.0f} s -> {out}")
    return out




# ------------------------------------------------------------------------------------------------ vectors
def _embeddings_folders() -> list[Path]:
    return sorted(p.parent for p in (REPO / "var" / "indexes").glob("*/embeddings-*/manifest.json"))


@functools.cache
def real_vectors() -> np.ndarray:
    """The real corpus's MiniLM passage vectors (its embeddings under var/indexes when built, else 1,000
    passages encoded here), normalised: the centres of the synthetic vectors."""
    from plugsearch.retriever.store.chunks import iter_chunks
    from plugsearch.retriever.store.corpus import Corpus, file_checksum
    from plugsearch.retriever.store.manifest import Manifest

    checksum = file_checksum(CORPUS)
    for folder in _embeddings_folders():
        manifest = Manifest.read(folder)
        if manifest.corpus_checksum == checksum and manifest.dims == DIMS and manifest.encoder_config.get(
                "passage_prefix") == "":
            x = np.concatenate([np.asarray(c, dtype=np.float32) for c in iter_chunks(folder)])
            return x / np.linalg.norm(x, axis=1, keepdims=True)
    from plugsearch.retriever.encoders.encoder import Encoder
    from plugsearch.retriever.settings import EncoderSettings

    log("no full-corpus embeddings under var/indexes: encoding 1,000 real passages as centres")
    corpus = Corpus.load(CORPUS, limit=1_000)
    x = Encoder(EncoderSettings()).encode_passages([corpus.passage(i) for i in range(len(corpus))])
    return x / np.linalg.norm(x, axis=1, keepdims=True)


def projection(dims: int) -> np.ndarray:
    """(dims, 384) with orthonormal columns, fixed: MiniLM's geometry carried into `dims` dimensions (E5-base's
    768), where the vectors' angles, and so their neighbours, are the 384-d ones'."""
    if dims == DIMS:
        return np.eye(DIMS, dtype=np.float32)
    q, _ = np.linalg.qr(np.random.default_rng(7).standard_normal((dims, DIMS)))
    return q.astype(np.float32)


def noise_for(dims: int) -> float:
    """Per-dimension noise giving the same noise norm as NOISE in 384 dimensions."""
    return NOISE * float(np.sqrt(DIMS / dims))


def centres_file(work: Path, dims: int = DIMS) -> Path:
    """The centres, saved once per work folder: every process regenerates the same vectors from them."""
    path = work / ("centres.npy" if dims == DIMS else f"centres-{dims}.npy")
    if not path.is_file():
        work.mkdir(parents=True, exist_ok=True)
        from plugsearch.common.files import atomic_writer

        with atomic_writer(path) as fh:
            np.save(fh, (real_vectors() @ projection(dims).T).astype(np.float32))
    return path


def vector_chunks(centres: np.ndarray, n: int, seed: int, chunk: int = CHUNK, noise: float = NOISE,
                  start: int = 0) -> Iterator[np.ndarray]:
    """The n synthetic vectors, chunk by chunk from chunk `start`; chunk i depends on (seed, i) only, so any step
    regenerates exactly the same vectors without storing them, and goes on from any chunk."""
    for i, lo in enumerate(range(0, n, chunk)):
        if i < start:
            continue
        m = min(chunk, n - lo)
        rng = np.random.default_rng([seed, i])
        x = centres[rng.integers(0, len(centres), m)] + rng.standard_normal((m, centres.shape[1]),
                                                                            dtype=np.float32) * noise
        yield (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32)


def write_embeddings(corpus: Path, index_dir: Path, n: int, centres: Path, *, seed: int = 1,
                     encoder: Any = None) -> Path:
    """The manifest of `corpus`'s synthetic embeddings, as `embed_corpus` leaves it (for the corpus's checksum
    and `encoder`'s settings, default MiniLM's, so the builders and the service take them as that corpus's),
    without chunk files: the vectors come from `vector_chunks` (`synthetic_chunks` reads the recipe back)."""
    from plugsearch.retriever.encoders.encoder import encoder_identity
    from plugsearch.retriever.indexing.embeddings import embeddings_key
    from plugsearch.retriever.settings import EncoderSettings
    from plugsearch.retriever.store.docstore import corpus_checksum
    from plugsearch.retriever.store.manifest import Manifest, index_folder

    enc = encoder or EncoderSettings()
    checksum = corpus_checksum(corpus, index_dir)
    done = index_dir / f"embeddings-{embeddings_key(checksum, enc)}"
    digest = "sha256:" + hashlib.sha256(centres.read_bytes()).hexdigest()
    dims = int(np.load(centres, mmap_mode="r").shape[1])
    recipe = {"synthetic": True, "seed": seed, "noise": noise_for(dims), "chunk_size": CHUNK,
              "centres": str(centres), "centres_sha256": digest}
    if (done / "manifest.json").is_file() and Manifest.read(done).params == recipe:
        return done
    with index_folder(done) as tmp:
        Manifest(kind="embeddings", backend="synthetic", corpus_path=str(corpus), corpus_checksum=checksum,
                 doc_count=n, encoder=enc.name, encoder_config=encoder_identity(enc), dims=dims,
                 params=recipe).write(tmp)
    return done


def base_shaped_encoder(work: Path) -> Path:
    """A BERT-base-shaped model (E5-base's shape: 12 layers, 768 wide, mean pooling) with seeded random weights
    and MiniLM's tokenizer (bert-base-uncased's vocabulary, as E5's): it costs what E5-base costs to encode a
    query, and gives 768-d vectors, but means nothing. Written once into <work>/base-shaped-encoder."""
    out = work / "base-shaped-encoder"
    if (out / "config.json").is_file():
        return out
    import torch
    from transformers import BertConfig, BertModel

    from plugsearch.common.files import atomic_folder
    from plugsearch.retriever.encoders.encoder import resolve_encoder_path
    from plugsearch.retriever.settings import DEFAULT_ENCODER

    torch.manual_seed(0)
    with atomic_folder(out) as tmp:
        BertModel(BertConfig()).save_pretrained(tmp)
        minilm = Path(resolve_encoder_path(DEFAULT_ENCODER))
        for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.txt"):
            shutil.copy2(minilm / name, tmp / name)
    return out


def synthetic_chunks(embeddings: Path) -> Any:
    """A `chunks` function for `build_faiss` / `build_milvus` from a synthetic embeddings manifest."""
    from plugsearch.retriever.store.manifest import Manifest

    manifest = Manifest.read(embeddings)
    p = manifest.params
    centres = np.load(p["centres"])
    if "sha256:" + hashlib.sha256(Path(p["centres"]).read_bytes()).hexdigest() != p["centres_sha256"]:
        raise RuntimeError(f"{p['centres']} changed since {embeddings} was written")
    return lambda start=0: vector_chunks(centres, manifest.doc_count, int(p["seed"]), int(p["chunk_size"]),
                                         float(p["noise"]), start)


def exact_top10(chunks: Any, queries: np.ndarray, checkpoint: Path | None = None, every: int = 20) -> np.ndarray:
    """Exact inner-product top-10 over every chunk (one chunk in memory at a time): a streamed brute force.
    `checkpoint`: the running top-10 saved there every `every` chunks, and a stopped pass goes on from it
    (`chunks(start)` regenerates the chunks from chunk `start`)."""
    import faiss

    from plugsearch.common.files import atomic_writer
    from plugsearch.retriever.backends.faiss_index import blas_threshold_for
    from plugsearch.retriever.settings import FaissSettings

    # as the service sets it
    faiss.cvar.distance_compute_blas_threshold = blas_threshold_for(FaissSettings().blas_threshold, queries.shape[1])
    best_s = np.full((len(queries), K), -np.inf, dtype=np.float32)
    best_i = np.full((len(queries), K), -1, dtype=np.int64)
    offset, done = 0, 0
    key = hashlib.sha256(queries.tobytes()).hexdigest()
    if checkpoint is not None and checkpoint.is_file():
        saved = np.load(checkpoint)
        if str(saved["key"]) == key:
            best_s, best_i, offset, done = saved["best_s"], saved["best_i"], int(saved["offset"]), int(saved["done"])
            log(f"exact top-10: going on from chunk {done} ({offset:,} vectors searched before)")
    t0, resumed_at = time.perf_counter(), offset
    for j, chunk in enumerate(chunks(done) if done else chunks(), start=done):
        index = faiss.IndexFlatIP(queries.shape[1])
        index.add(np.ascontiguousarray(chunk))
        s, i = index.search(queries, K)
        merged_s = np.concatenate([best_s, s], axis=1)
        merged_i = np.concatenate([best_i, i + offset], axis=1)
        order = np.argsort(-merged_s, axis=1, kind="stable")[:, :K]
        best_s = np.take_along_axis(merged_s, order, axis=1)
        best_i = np.take_along_axis(merged_i, order, axis=1)
        offset += len(chunk)
        if checkpoint is not None and (j + 1) % every == 0:
            with atomic_writer(checkpoint) as fh:
                np.savez(fh, best_s=best_s, best_i=best_i, offset=offset, done=j + 1, key=key)
            rate = (offset - resumed_at) / max(time.perf_counter() - t0, 1e-9)
            log(f"exact top-10: {offset:,} vectors searched, {rate:,.0f}/s")
    if checkpoint is not None:
        checkpoint.unlink(missing_ok=True)
    return best_i


def truth_for(size_dir: Path, embeddings: Path, queries: np.ndarray, tag: str) -> np.ndarray:
    """Exact top-10 of the query sample, cached beside the corpus (a pass over every vector at 21M)."""
    path = size_dir / f"truth-{tag}.npy"
    manifest_bytes = (embeddings / "manifest.json").read_bytes()
    key = hashlib.sha256(manifest_bytes + queries.tobytes()).hexdigest()[:16]
    if path.is_file() and (size_dir / f"truth-{tag}.key").read_text() == key:
        return np.load(path)
    t0 = time.perf_counter()
    truth = exact_top10(synthetic_chunks(embeddings), queries, checkpoint=size_dir / f"truth-{tag}.partial.npz")
    np.save(path, truth)
    (size_dir / f"truth-{tag}.key").write_text(key)
    log(f"exact top-10 of {len(queries)} questions: {time.perf_counter() - t0:.0f} s")
    return truth


# ------------------------------------------------------------------------------------------------ backends
def _parts(backend: str) -> tuple[str, ...]:
    return HYBRID if backend == "hybrid" else (backend,)


def is_dense(backend: str) -> bool:
    return any(not p.startswith(("bm25s", "pyserini")) for p in _parts(backend))


def methods(backend: str) -> list[str]:
    if backend == "hybrid":
        return ["bm25", "dense", "hybrid"]
    return ["dense"] if is_dense(backend) else ["bm25"]


def backend_env(backend: str, size_dir: Path, *, nprobe: int | None = None, nlist: int | None = None) -> dict[str, str]:
    """The retriever's environment serving `backend` (and building it: the same settings)."""
    if backend == "hybrid":
        env = {**backend_env(HYBRID[1], size_dir, nprobe=nprobe, nlist=nlist), **backend_env(HYBRID[0], size_dir)}
        return {**env, "RETRIEVER_BM25": "true", "RETRIEVER_DENSE": "true", "RETRIEVER_DEFAULT_METHOD": "hybrid"}
    if backend in ("bm25s", "pyserini"):
        return {"RETRIEVER_BM25": "true", "RETRIEVER_DENSE": "false", "RETRIEVER_BM25_BACKEND": backend,
                "RETRIEVER_DEFAULT_METHOD": "bm25"}
    env = {"RETRIEVER_BM25": "false", "RETRIEVER_DENSE": "true", "RETRIEVER_DEFAULT_METHOD": "dense"}
    family, kind = backend.split("-")
    if family == "faiss":
        env = {**env, "RETRIEVER_FAISS__INDEX_TYPE": kind}
        if nprobe:
            env["RETRIEVER_FAISS__NPROBE"] = str(nprobe)
        if nlist:
            env["RETRIEVER_FAISS__IVF_NLIST"] = str(nlist)
        return env
    return {**env, "RETRIEVER_DENSE_BACKEND": "milvus", "RETRIEVER_MILVUS__INDEX_TYPE": kind,
            "RETRIEVER_MILVUS__URI": str(size_dir / f"milvus-{kind}.db"),
            "RETRIEVER_MILVUS__COLLECTION": f"scale_{kind}"}


def index_paths(backend: str, size_dir: Path) -> list[Path]:
    """What the backend keeps on disk (the disk_mb figure, with the document store)."""
    index_dir = size_dir / "index"
    out: list[Path] = []
    for part in _parts(backend):
        if part in ("bm25s", "pyserini"):
            out.append(index_dir / part)
            continue
        family, kind = part.split("-")
        out += [index_dir / f"dense-{kind}"] if family == "faiss" else \
            [size_dir / f"milvus-{kind}.db", index_dir / f"milvus-scale_{kind}"]
    return out


def _settings(backend: str, size_dir: Path, env: dict[str, str]) -> Any:
    from plugsearch.retriever.settings import RetrieverSettings

    for key, value in env.items():
        os.environ[key] = value
    return RetrieverSettings(corpus=size_dir / "corpus.jsonl", index_dir=size_dir / "index")


def _part_record(size_dir: Path, part: str) -> Path:
    return size_dir / f"built-{part}.json"


def build_child(backend: str, size_dir: Path, env: dict[str, str], resume: bool = False) -> None:
    """Runs in the child: build `backend`'s indexes (and the document store) for the corpus in size_dir.
    `resume`: a part whose index is complete (built by a run that stopped later) is kept, its seconds counted."""
    from plugsearch.retriever.indexing.build import build
    from plugsearch.retriever.store.manifest import Manifest

    settings = _settings(backend, size_dir, env)
    t0 = time.perf_counter()
    build(settings, bm25=[], dense=False, force=False, show_progress=False)  # the document store
    store_s = time.perf_counter() - t0
    earlier = 0.0
    for part in _parts(backend):
        record = _part_record(size_dir, part)
        if resume and record.is_file() and all((p / "manifest.json").is_file()
                                               for p in index_paths(part, size_dir) if p.suffix != ".db"):
            earlier += float(json.loads(record.read_text())["build_s"])
            continue
        t_part = time.perf_counter()
        _build_part(part, settings)
        record.write_text(json.dumps({"build_s": round(time.perf_counter() - t_part, 2),
                                      "manifests": [Manifest.read(p).created_at for p in index_paths(part, size_dir)
                                                    if p.suffix != ".db"]}))
    build_s = round(time.perf_counter() - t0 + earlier, 2)
    # this process's peak since exec (wait4's ru_maxrss would count the parent's), or a helper process it ran
    # and waited for (Lucene's indexer JVM) if that one's was larger
    peak = max(peak_rss_mb(), resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024)
    print(json.dumps({"build_s": build_s, "build_rss_mb": round(peak, 1), "store_s": round(store_s, 2),
                      "resumed_parts_s": round(earlier, 2)}))


def _build_part(part: str, settings: Any) -> None:
    from plugsearch.retriever.backends.faiss_index import build_faiss, dense_folder
    from plugsearch.retriever.indexing.build import build

    if part in ("bm25s", "pyserini"):
        build(settings, bm25=[part], dense=False, force=True, show_progress=False)
        return
    embeddings = next(p.parent for p in settings.index_dir.glob("embeddings-*/manifest.json")
                      if not p.parent.name.endswith(".partial"))
    if part.startswith("faiss"):
        build_faiss(embeddings, dense_folder(settings.index_dir, part.split("-")[1]), settings.faiss,
                    chunks=synthetic_chunks(embeddings), show_progress=False)
    else:
        from plugsearch.retriever.backends.milvus_index import build_milvus

        settings.milvus.index_type = part.split("-")[1]
        build_milvus(embeddings, settings.index_dir, settings.milvus, force=True, show_progress=False,
                     chunks=synthetic_chunks(embeddings))


def built_already(backend: str, size_dir: Path) -> dict[str, Any] | None:
    """The recorded build of `backend` when every index it needs is complete on disk (`--resume`)."""
    from plugsearch.retriever.store.manifest import Manifest

    record = size_dir / f"build-{backend}.json"
    try:
        for path in index_paths(backend, size_dir):
            if path.suffix != ".db":
                Manifest.read(path)
        return dict(json.loads(record.read_text()))
    except Exception:  # noqa: BLE001 - anything missing: build again
        return None


def run_build(backend: str, size_dir: Path, env: dict[str, str], *, resume: bool) -> dict[str, Any]:
    if resume and (done := built_already(backend, size_dir)) is not None:
        log(f"  {backend}: reusing the built index ({done})")
        return done
    if not resume:
        for path in index_paths(backend, size_dir):
            shutil.rmtree(path, ignore_errors=True)
    proc = subprocess.Popen([sys.executable, __file__, "--build-child", backend, str(size_dir), json.dumps(env),
                             "resume" if resume else "new"], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    out, err = (b.decode(errors="replace") for b in proc.communicate())
    if proc.returncode != 0:
        raise RuntimeError(f"{backend} build failed ({proc.returncode}): {err[-2000:]}")
    result = dict(json.loads(out.strip().splitlines()[-1]))
    (size_dir / f"build-{backend}.json").write_text(json.dumps(result))
    return result


def disk_mb(paths: list[Path]) -> float:
    files = [p for root in paths if root.exists() for p in ([root] if root.is_file() else root.rglob("*"))
             if p.is_file()]
    return round(sum(p.stat().st_size for p in files) / 2**20, 1)


# ------------------------------------------------------------------------------------------------ measuring
def _status(pid: int) -> dict[str, int]:
    out: dict[str, int] = {}
    try:
        with open(f"/proc/{pid}/status") as fh:
            for line in fh:
                key, _, value = line.partition(":")
                if key in ("VmHWM", "VmRSS", "RssAnon", "RssFile", "RssShmem"):
                    out[key] = int(value.split()[0])
    except OSError:
        pass
    return out


def _rollup(pid: int) -> dict[str, int]:
    out: dict[str, int] = {}
    try:
        with open(f"/proc/{pid}/smaps_rollup") as fh:
            for line in fh:
                key, _, value = line.partition(":")
                if value.strip().endswith("kB"):
                    out[key] = int(value.split()[0])
    except OSError:
        pass
    return out


def worker_pids(pid: int) -> list[int]:
    """The service's worker processes (spawned children; not multiprocessing's resource tracker)."""
    from tests.support.procs import children

    workers = []
    for child in children(pid):
        try:
            cmdline = Path(f"/proc/{child}/cmdline").read_bytes()
        except OSError:
            continue
        if b"resource_tracker" not in cmdline:
            workers.append(child)
    return workers or [pid]


class MemorySampler:
    """Peak RssAnon / VmHWM of each worker, sampled every `every` seconds while the service runs."""

    def __init__(self, pid: int, every: float = 0.25) -> None:
        self.pid = pid
        self.every = every
        self.peak_anon: dict[int, int] = {}
        self.hwm: dict[int, int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def sample(self) -> None:
        for w in worker_pids(self.pid):
            status = _status(w)
            if status:
                self.peak_anon[w] = max(self.peak_anon.get(w, 0), status.get("RssAnon", 0))
                self.hwm[w] = max(self.hwm.get(w, 0), status.get("VmHWM", 0))

    def _run(self) -> None:
        while not self._stop.wait(self.every):
            self.sample()

    def at_rest(self) -> dict[str, Any]:
        """Each worker's private memory (RssAnon) and the page-cache pages they map, now (before any search)."""
        workers = worker_pids(self.pid)
        rollups = [_rollup(w) for w in workers]
        return {"rss_anon_mb": [round(_status(w).get("RssAnon", 0) / 1024, 1) for w in workers],
                "file_pss_mb": round(sum(r.get("Pss_File", 0) + r.get("Pss_Shmem", 0) for r in rollups) / 1024, 1)}

    def report(self) -> dict[str, Any]:
        self._stop.set()
        self._thread.join()
        self.sample()
        workers = sorted(self.peak_anon)
        rollups = [_rollup(w) for w in workers]
        mb = lambda kb: round(kb / 1024, 1)  # noqa: E731
        return {"workers": len(workers),
                "rss_anon_mb": [mb(self.peak_anon[w]) for w in workers],
                "rss_anon_total_mb": mb(sum(self.peak_anon.values())),
                "vmhwm_mb": [mb(self.hwm[w]) for w in workers],
                "rss_file_mb": [mb(r.get("Rss", 0) - r.get("Anonymous", 0)) for r in rollups],
                "file_pss_mb": mb(sum(r.get("Pss_File", 0) + r.get("Pss_Shmem", 0) for r in rollups)),
                "supervisor_rss_mb": mb(_status(self.pid).get("VmRSS", 0)) if workers != [self.pid] else 0.0}


def served_hits(port: int, questions: list[str], method: str) -> list[list[dict[str, Any]]]:
    import httpx

    out: list[list[dict[str, Any]]] = []
    with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=3600) as client:
        for i in range(0, len(questions), 32):
            r = client.post("/retrieve", json={"queries": questions[i:i + 32], "k": K, "method": method})
            r.raise_for_status()
            out += r.json()["results"]
    return out


def corpus_rows(corpus: Path, positions: set[int]) -> dict[int, dict[str, Any]]:
    """The rows at `positions` (document numbers), by a streamed pass over the file (not the store)."""
    rows: dict[int, dict[str, Any]] = {}
    n = 0
    with corpus.open("rb") as fh:
        for line in fh:
            if not line.strip():
                continue
            if n in positions:
                rows[n] = orjson.loads(line)
                if len(rows) == len(positions):
                    break
            n += 1
    return rows


def check_documents(corpus: Path, served: list[list[dict[str, Any]]]) -> dict[str, Any]:
    """Each returned document's id, title and text against its corpus line (synthetic ids: s<position>)."""
    docs = [d for hits in served for d in hits]
    rows = corpus_rows(corpus, {int(d["id"][1:]) for d in docs})
    wrong = [d["id"] for d in docs if rows.get(int(d["id"][1:])) != {k: d[k] for k in ("id", "title", "text")}]
    return {"docs_checked": len(docs), "docs_identical": not wrong, "docs_different": wrong[:5]}


def recall(served: list[list[dict[str, Any]]], truth: np.ndarray) -> float:
    want = [{f"s{i}" for i in row} for row in truth]
    return round(float(np.mean([len({h["id"] for h in hits} & w) / K
                                for hits, w in zip(served, want, strict=True)])), 4)


def nprobe_sweep(folder: Path, queries: np.ndarray, truth: np.ndarray, values: tuple[int, ...]) -> dict[str, Any]:
    """In-process recall@10 and search-only queries/s (batch 32, one thread) of an IVF index per nprobe."""
    import faiss

    from plugsearch.retriever.backends.faiss_index import FaissIndex
    from plugsearch.retriever.settings import FaissSettings

    out: dict[str, Any] = {}
    index = FaissIndex(folder, FaissSettings(threads=1))
    for nprobe in values:
        faiss.extract_index_ivf(index.index).nprobe = nprobe
        t0 = time.perf_counter()
        ids = np.concatenate([index.search(queries[i:i + 32], K).ids for i in range(0, len(queries), 32)])
        seconds = time.perf_counter() - t0
        r = float(np.mean([len(set(a) & set(b)) / K for a, b in zip(ids.tolist(), truth.tolist(), strict=True)]))
        out[str(nprobe)] = {"recall_at_10": round(r, 4), "search_qps_b32": round(len(queries) / seconds, 1)}
    index.close()
    return out


def serve_and_measure(backend: str, size_dir: Path, env: dict[str, str], *, pool: list[str], seconds: float,
                      truth: np.ndarray | None, recall_qs: list[str], batches: tuple[int, ...],
                      check_docs: bool, served_recall: bool = True, searcher: bool = False) -> dict[str, Any]:
    # capacity, not admission: the adaptive limit would shed some of the 8 closed-loop clients; nor the request
    # deadline (a slow point's queued batches wait past the default 120 s). One thread per library per worker:
    # WORKERS processes on as many cores
    full = {**env, "RETRIEVER_WORKERS": str(WORKERS), "RETRIEVER_ADAPTIVE_CONCURRENCY": "false",
            "RETRIEVER_REQUEST_TIMEOUT_S": "3600", "RETRIEVER_FAISS__THREADS": "1", "RETRIEVER_BM25_THREADS": "1",
            "RETRIEVER_ENCODER__THREADS": "1", "OMP_NUM_THREADS": "1"}
    point: dict[str, Any] = {}
    t0 = time.perf_counter()
    with ServedRetriever(full, timeout=7200, corpus=size_dir / "corpus.jsonl", index_dir=size_dir / "index") as srv:
        sampler = MemorySampler(srv.procs["retriever"].pid)
        point["load_s"] = round(time.perf_counter() - t0, 1)
        point["at_rest"] = sampler.at_rest()
        served: dict[str, list[list[dict[str, Any]]]] = {}
        for method in methods(backend):  # first: warms the caches for the timed windows
            served[method] = served_hits(srv.port, recall_qs, method)
        if truth is not None and served_recall:
            point["recall_at_10"] = recall(served["dense"], truth)
        if check_docs:
            point.update(check_documents(size_dir / "corpus.jsonl",
                                         [hits for m in served for hits in served[m][:100]]))
        point["qps"] = {m: {str(b): round(asyncio.run(_service_rate([srv.port], m, b, pool, seconds)), 1)
                            for b in batches} for m in methods(backend)}
        if searcher:
            point["searcher"] = measure_searcher(srv, recall_qs, seconds)
        point.update(sampler.report())
    point["served_ids"] = {m: [[h["id"] for h in hits] for hits in served[m]] for m in served}
    return point


SEARCHER_CLIENTS = 16


def measure_searcher(srv: ServedRetriever, questions: list[str], seconds: float) -> dict[str, Any]:
    """The compact searcher on top of the served retriever (its pool from the retriever's BM25 and dense
    methods): s3 `POST /search` p50 / p95 with 1 client and searches/s with 16, result cache off, the corpus
    check off (the policy searches whatever the corpus; what is measured is its cost)."""
    import httpx

    from bench.load import percentile, run_phase
    from plugsearch.common.procgroup import ProcessSpec
    from plugsearch.common.workers import free_port

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = {"SEARCHER_PORT": str(port), "SEARCHER_RETRIEVER__URL": srv.url, "SEARCHER_POLICY_KIND": "compact",
           "SEARCHER_CORPUS_CHECK": "off", "SEARCHER_CACHE_ENABLED": "false", "SEARCHER_LOG_LEVEL": "INFO"}
    t0 = time.perf_counter()
    srv.up(ProcessSpec("searcher", [sys.executable, "-m", "plugsearch.searcher"], env=env,
                       ready_url=f"{url}/health/ready"), timeout_s=600)
    ready_s = time.perf_counter() - t0
    version = httpx.get(f"{url}/version", timeout=30).json().get("details", {})

    def body(i: int) -> dict[str, Any]:
        return {"question": questions[i % len(questions)], "mode": "s3"}

    asyncio.run(run_phase(url, questions, clients=1, seconds=2.0, timeout_s=300, body=body))  # warm
    one = asyncio.run(run_phase(url, questions, clients=1, seconds=seconds, timeout_s=300, offset=50, body=body))
    many = asyncio.run(run_phase(url, questions, clients=SEARCHER_CLIENTS, seconds=seconds, timeout_s=300,
                                 offset=50 + one.answered, body=body))
    errors = sum(r.answered - r.statuses.get(200, 0) + r.lost for r in (one, many))
    return {"policy": version.get("policy_model"), "defaults": version.get("defaults", {}).get("s3"),
            "ready_s": round(ready_s, 1), "p50_ms": round(percentile(one.latencies_ms, 0.5), 1),
            "p95_ms": round(percentile(one.latencies_ms, 0.95), 1),
            f"rps_{SEARCHER_CLIENTS}": round(many.ok_in_window / many.seconds, 2),
            f"p50_ms_{SEARCHER_CLIENTS}": round(percentile(many.latencies_ms, 0.5), 1),
            "degraded": one.bodies.get("degraded", 0) + many.bodies.get("degraded", 0), "errors": errors}


def measure(backend: str, size_dir: Path, args: argparse.Namespace, *, pool: list[str], truth: np.ndarray | None,
            recall_qs: list[str], query_vectors: np.ndarray | None, held: bool) -> dict[str, Any]:
    env = {**backend_env(backend, size_dir, nprobe=args.nprobe, nlist=args.nlist), **args.encoder_env}
    built = run_build(backend, size_dir, env, resume=args.resume)
    log(f"  {backend}: built in {built['build_s']} s (child peak RSS {built['build_rss_mb']} MB)")
    from plugsearch.retriever.store.docstore import store_folder

    point: dict[str, Any] = {**built, "disk_mb": disk_mb(index_paths(backend, size_dir)),
                             "store_mb": disk_mb([store_folder(size_dir / "index")]),
                             "corpus_mb": disk_mb([size_dir / "corpus.jsonl"])}
    measured = serve_and_measure(backend, size_dir, env, pool=pool, seconds=args.seconds, truth=truth,
                                 recall_qs=recall_qs, batches=args.batches, check_docs=True,
                                 served_recall=args.dims == DIMS, searcher=args.searcher and backend == "hybrid")
    ids = measured.pop("served_ids")
    point.update(measured)
    main = methods(backend)[0] if backend != "hybrid" else "hybrid"
    point["qps_b32"] = point["qps"][main].get("32")
    if held:  # as before the document store: every document in each worker, index files read into memory
        old = {**env, "RETRIEVER_DOCSTORE": "memory", "RETRIEVER_FAISS__MMAP": "false", "RETRIEVER_BM25_MMAP": "false"}
        before = serve_and_measure(backend, size_dir, old, pool=pool, seconds=args.seconds, truth=truth,
                                   recall_qs=recall_qs, batches=(32,), check_docs=False,
                                   served_recall=args.dims == DIMS)
        before["same_results"] = before.pop("served_ids") == ids
        point["held"] = before
    if query_vectors is not None and truth is not None:
        for part in _parts(backend):
            if part in ("faiss-ivfsq8", "faiss-ivfpq"):
                point["nprobe_sweep"] = nprobe_sweep(size_dir / "index" / f"dense-{part.split('-')[1]}",
                                                     query_vectors, truth, args.sweep)
    return point


# ------------------------------------------------------------------------------------------------ growth
def fit(sizes: list[int], values: list[float], kind: str) -> dict[str, float] | None:
    """power: value = a * n^b (least squares in log-log); linear: value = base + per_item * n."""
    pts = [(n, v) for n, v in zip(sizes, values, strict=True) if v is not None and v > 0]
    if len(pts) < 2:
        return None
    x = np.array([p[0] for p in pts], dtype=np.float64)
    y = np.array([p[1] for p in pts], dtype=np.float64)
    if kind == "power":
        b, log_a = np.polyfit(np.log(x), np.log(y), 1)
        return {"a": float(np.exp(log_a)), "b": float(b)}
    per_item, base = np.polyfit(x, y, 1)
    return {"base": float(base), "per_item": float(per_item)}


def predict(model: dict[str, float], n: float) -> float:
    if "b" in model:
        return model["a"] * n ** model["b"]
    return model["base"] + model["per_item"] * n


GROWTH = (("build_s", "power"), ("rss_anon_total_mb", "linear"), ("file_pss_mb", "linear"), ("disk_mb", "power"),
          ("rss_mb", "linear"))


def extrapolate(backends: dict[str, dict[str, dict[str, Any]]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, points in backends.items():
        sizes = sorted(int(s) for s in points if int(s) < WIKI18)
        row: dict[str, Any] = {}
        for metric, kind in GROWTH:
            values = [points[str(s)].get(metric) for s in sizes]
            model = fit(sizes, values, kind)
            if model is not None and kind == "linear" and model["per_item"] <= 0:  # no growth measured: the
                row[metric] = max(v for v in values if v is not None)  # largest measured value, not a decline
                row[f"{metric}_fit"] = {"no_growth_measured": 1}
            elif model is not None:
                row[metric] = round(predict(model, WIKI18), 1)
                row[f"{metric}_fit"] = {k: round(v, 8) for k, v in model.items()}
        if row:
            row["from_sizes"] = sizes
            out[name] = row
    return out


def plot(result: dict[str, Any], path: Path = PLOT) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    metrics = (("build_s", "build (s)", "power"),
               ("rss_anon_total_mb", "served private memory, 2 workers (RssAnon, MB)", "linear"),
               ("disk_mb", "index + document store on disk (MB)", "power"),
               ("qps_b32", "served queries/s, batch 32", None))
    fig, axes = plt.subplots(2, 2, figsize=(12, 9))
    sizes_all = [int(s) for points in result["backends"].values() for s in points]
    grid = np.logspace(np.log10(min(sizes_all)), np.log10(WIKI18), 50)
    for ax, (metric, label, kind) in zip(axes.flat, metrics, strict=True):
        for i, (name, points) in enumerate(result["backends"].items()):
            sizes = sorted(int(s) for s in points)
            values = [points[str(s)].get(metric) for s in sizes]
            if not any(v for v in values):
                continue
            colour = f"C{i}"
            ax.plot(sizes, values, "o-", color=colour, label=name)
            model = fit([s for s in sizes if s < WIKI18], [v for s, v in zip(sizes, values, strict=True)
                                                           if s < WIKI18], kind) if kind else None
            if model is not None and model.get("per_item", 1) > 0 and predict(model, grid[0]) > 0:
                ax.plot(grid, [predict(model, n) for n in grid], "--", color=colour, alpha=0.5)
            held = [(s, points[str(s)]["held"].get(metric)) for s in sizes if "held" in points[str(s)]]
            if metric == "rss_anon_total_mb" and held:
                ax.plot(*zip(*held, strict=True), "x:", color=colour, alpha=0.8)
        ax.axvline(WIKI18, color="grey", lw=0.8)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("passages (grey line: wiki-18, 21M; dashed: fitted growth)")
        ax.set_ylabel(label)
        ax.grid(True, which="both", alpha=0.3)
    axes.flat[1].set_title("x: the same backend holding the documents in each worker (before)", fontsize=9)
    axes.flat[0].legend(fontsize=8)
    fig.suptitle("Retriever backends against corpus size (2 CPU cores, 2 workers; synthetic corpora with wiki-18's "
                 "lengths)")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    log(f"plot: {path}")


def parse_max(values: list[str]) -> dict[str, int]:
    out = dict(DEFAULT_MAX)
    for item in values:
        name, _, size = item.partition("=")
        if name not in BACKENDS or not size.isdigit():
            raise SystemExit(f"--max wants BACKEND=SIZE with BACKEND in {', '.join(BACKENDS)}, got {item!r}")
        out[name] = int(size)
    return out


# ------------------------------------------------------------------------------------------------ main
def main() -> None:
    if len(sys.argv) in (5, 6) and sys.argv[1] == "--build-child":
        build_child(sys.argv[2], Path(sys.argv[3]), json.loads(sys.argv[4]), resume=sys.argv[5:] == ["resume"])
        return
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default=None, help="comma-separated passage counts (default 100000,1000000,"
                        "2000000; --quick 2000,10000)")
    parser.add_argument("--backends", default="bm25s,pyserini,faiss-flat,faiss-ivfsq8,hybrid",
                        help=f"comma-separated, of {', '.join(BACKENDS)}")
    parser.add_argument("--max", action="append", default=[], metavar="BACKEND=SIZE",
                        help="largest size a backend runs at (repeatable); defaults: "
                        + ", ".join(f"{k}={v}" for k, v in DEFAULT_MAX.items()))
    parser.add_argument("--seconds", type=float, default=None, help="measured window per point (default 10)")
    parser.add_argument("--recall-questions", type=int, default=500)
    parser.add_argument("--encoder-backend", default=None, help="query encoder of the served dense methods "
                        "(RETRIEVER_ENCODER__BACKEND: auto, torch, onnx, onnx-int8; default: the setting's default, auto)")
    parser.add_argument("--dims", type=int, choices=(384, 768), default=DIMS, help="768: E5-base's width (the "
                        "vectors MiniLM's carried into 768-d, queries encoded by a BERT-base-shaped model with random "
                        "weights: E5-base's cost; served recall is not measured, the nprobe sweep gives it)")
    parser.add_argument("--lucene-search", choices=("anserini", "topk"), default="anserini",
                        help="RETRIEVER_LUCENE_SEARCH of the Lucene backends (topk: results under <backend>-topk)")
    parser.add_argument("--nprobe", type=int, default=None, help="RETRIEVER_FAISS__NPROBE of the IVF backends")
    parser.add_argument("--nlist", type=int, default=None, help="RETRIEVER_FAISS__IVF_NLIST (default ~4*sqrt(n))")
    parser.add_argument("--sweep", default=",".join(map(str, SWEEP)), help="nprobe values of the in-process "
                        "recall sweep of IVF backends (empty: none)")
    parser.add_argument("--held-max", type=int, default=1_000_000, help="largest size at which each backend is "
                        "also served holding the documents in every worker (the comparison); 0: never")
    parser.add_argument("--searcher", action="store_true", help="hybrid: also serve the compact searcher on top of "
                        "the retriever and measure its s3 searches (p50 / p95 at 1 client, searches/s at 16)")
    parser.add_argument("--quick", action="store_true", help="tiny sizes and windows: checks the pipeline only")
    parser.add_argument("--work", type=Path, default=WORK, help="where corpora and indexes go")
    parser.add_argument("--clean", action="store_true", help="delete a size's corpus, document store and indexes "
                        "once its points are measured (wiki-18's take ~40 GB)")
    parser.add_argument("--resume", action="store_true", help="skip points already in <work>/result.json and "
                        "reuse indexes already built (a run stopped part-way goes on)")
    parser.add_argument("--remeasure", action="store_true", help="with --resume: serve and measure the points "
                        "already in result.json again, on their built indexes (e.g. another --nprobe)")
    parser.add_argument("--plot", action="store_true", help=f"draw {PLOT.relative_to(REPO)} from the result")
    parser.add_argument("--plot-only", action="store_true", help="redraw the plot from <work>/result.json and print it "
                        "(with the extrapolation) as the final line")
    parser.add_argument("--update", action="store_true", help="merge these points into <work>/result.json "
                        "(re-measure some backends or sizes without repeating the others)")
    args = parser.parse_args()
    result_path = args.work / "result.json"
    if args.plot_only:  # e.g. after a run stopped part-way: its points are in result.json after each one
        saved = json.loads(result_path.read_text())
        saved["extrapolated_21m"] = extrapolate(saved["backends"])
        result_path.write_text(json.dumps(saved, indent=1))
        plot(saved)
        print(json.dumps(saved))
        return
    sizes = [int(s) for s in (args.sizes or ("2000,10000" if args.quick else "100000,1000000,2000000")).split(",")]
    backends = [b for b in args.backends.split(",") if b]
    unknown = [b for b in backends if b not in BACKENDS]
    if unknown:
        raise SystemExit(f"unknown backends {unknown}; choose from {', '.join(BACKENDS)}")
    largest = parse_max(args.max)
    args.seconds = args.seconds or (1.0 if args.quick else 10.0)
    args.batches = (1, 32)
    args.sweep = tuple(int(v) for v in args.sweep.split(",") if v)

    from plugsearch.retriever.encoders.encoder import Encoder
    from plugsearch.retriever.settings import EncoderSettings

    args.encoder_backend = args.encoder_backend or EncoderSettings().backend
    pool = recall_questions(4000)
    recall_qs = recall_questions(args.recall_questions)
    query_vectors = Encoder(EncoderSettings(backend=args.encoder_backend)).encode_queries(recall_qs)
    encoder = EncoderSettings(backend=args.encoder_backend)
    args.encoder_env = {"RETRIEVER_ENCODER__BACKEND": args.encoder_backend}
    if args.dims != DIMS:  # E5-base's width and encoding cost; the questions' MiniLM vectors carried along
        query_vectors = np.ascontiguousarray(query_vectors @ projection(args.dims).T)
        encoder = EncoderSettings(name=str(base_shaped_encoder(args.work)), pooling="mean",
                                  backend=args.encoder_backend)
        args.encoder_env.update({"RETRIEVER_ENCODER__NAME": encoder.name, "RETRIEVER_ENCODER__POOLING": "mean"})
    suffix = "" if args.dims == DIMS else f"-d{args.dims}"
    args.encoder_env["RETRIEVER_LUCENE_SEARCH"] = args.lucene_search
    label = suffix + ("-topk" if args.lucene_search == "topk" else "")
    results: dict[str, dict[str, dict[str, Any]]] = {}
    skipped: list[dict[str, Any]] = []
    run_sizes = sizes
    if (args.update or args.resume) and result_path.is_file():
        previous = json.loads(result_path.read_text())
        for name, points in previous["backends"].items():
            results.setdefault(name, {}).update(points)
        skipped = [row for row in previous.get("skipped", [])
                   if not (row["backend"] in backends and row["size"] in sizes)]
        sizes = sorted(set(sizes) | set(previous["sizes"]))
    t_all = time.perf_counter()
    for n in run_sizes:
        todo = [b for b in backends if n <= largest[b] and not (
            args.resume and not args.remeasure and str(n) in results.get(b + label, {}))]
        skipped += [{"backend": b, "size": n, "why": f"above its --max ({largest[b]}): its build at this size takes "
                     "too long on 2 cores or does not fit in memory; see the extrapolation"}
                    for b in backends if n > largest[b]]
        if not todo:
            continue
        size_dir = args.work / f"n{n}{suffix}"
        corpus = write_corpus(n, size_dir / "corpus.jsonl")
        truth = None
        if any(is_dense(b) for b in todo):
            embeddings = write_embeddings(corpus, size_dir / "index", n, centres_file(args.work, args.dims),
                                          encoder=encoder)
            truth = truth_for(size_dir, embeddings, query_vectors, args.encoder_backend)
        for backend in todo:
            log(f"size {n}: {backend}{label}")
            try:
                point = measure(backend, size_dir, args, pool=pool, truth=truth if is_dense(backend) else None,
                                recall_qs=recall_qs, query_vectors=query_vectors, held=n <= args.held_max)
                point["dims"] = args.dims
            except (RuntimeError, OSError, MemoryError) as exc:
                log(f"  {backend} at {n} failed: {exc}")
                skipped.append({"backend": backend, "size": n, "why": f"failed: {str(exc)[-300:]}"})
            else:
                point["encoder_backend"] = args.encoder_backend
                results.setdefault(backend + label, {})[str(n)] = point
                log(f"  {backend} at {n}: { {k: v for k, v in point.items() if k != 'nprobe_sweep'} }")
                if "nprobe_sweep" in point:
                    log(f"  nprobe sweep: {point['nprobe_sweep']}")
            # after every point, failed ones too: a run stopped part-way keeps what it found (--plot-only, --resume)
            partial = {"sizes": sizes, "backends": results, "skipped": skipped}
            args.work.mkdir(parents=True, exist_ok=True)
            result_path.write_text(json.dumps(partial, indent=1))
            if not args.resume:  # free the disk before the next backend (the corpus and its store stay)
                for path in index_paths(backend, size_dir):
                    shutil.rmtree(path, ignore_errors=True)
        if args.clean:  # the whole size: corpus, store, indexes, truth
            shutil.rmtree(size_dir, ignore_errors=True)
    result: dict[str, Any] = {
        "sizes": sizes, "backends": {b: v for b, v in results.items() if v},
        "extrapolated_21m": extrapolate({b: v for b, v in results.items() if v}),
        "skipped": skipped, "seconds_per_point": args.seconds, "quick": args.quick, "cpu_cores": os.cpu_count(),
        "workers": WORKERS, "encoder_backend": args.encoder_backend,
        "corpus": "synthetic: wiki-18 lengths, unigram words and titles of ../shared/data/corpus/combined.jsonl",
        "vectors": f"real MiniLM passage vectors + N(0, {NOISE}^2) noise, normalised, {DIMS}-d (--dims 768: "
                   "carried into 768-d by a fixed orthonormal map, noise of the same norm)",
        "wall_s": round(time.perf_counter() - t_all, 1)}
    result_path.write_text(json.dumps(result, indent=1))
    if args.plot:
        plot(result)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
