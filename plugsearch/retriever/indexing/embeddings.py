"""Building the dense index: the corpus encoded into on-disk chunks, then FAISS (flat, HNSW, SQ8, IVF-PQ,
IVF-SQ8) built from them.

Builds stream: each chunk of passage vectors goes to disk once encoded (`embeddings-<key>.partial/`), so
the full matrix is never in RAM and an interrupted build resumes from the last chunk; the FAISS index is
built from the chunks read back one at a time. Flat indexes are stored in shards (plugsearch.retriever.backends.faiss_index
loads them, onto the GPUs as fp16 with faiss-gpu). IVF indexes are trained on a sample, filled part by part
(one part's codes in memory at a time) and merged into one on-disk file of inverted lists (`lists.ivfdata`);
the trained index and the filled parts are kept (`.<index>.build/`) until then, so a stopped IVF build goes on
from its last part. The chunks also feed the Milvus build (plugsearch.retriever.backends.milvus_index).
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import shutil
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from plugsearch.common.progress import ProgressLog
from plugsearch.retriever.encoders.encoder import Encoder, encoder_identity
from plugsearch.retriever.settings import IVF_TYPES, EncoderSettings, FaissSettings
from plugsearch.retriever.store.docstore import DocumentStore
from plugsearch.retriever.store.manifest import Manifest, atomic_file, atomic_folder, write_json_atomically

logger = logging.getLogger(__name__)


def embeddings_key(corpus_checksum: str, settings: EncoderSettings) -> str:
    payload = json.dumps({"corpus": corpus_checksum, "encoder": settings.name, **encoder_identity(settings)},
                         sort_keys=True)
    return hashlib.sha256(payload.encode()).hexdigest()[:16]


PROGRESS_PART = 512
"""Passages encoded per call while building (sorted by length within a chunk first): progress between calls."""


def embed_corpus(corpus: DocumentStore, index_dir: Path, settings: EncoderSettings, *, encoder: Encoder | None = None,
                 chunk_size: int = 2048, show_progress: bool = True) -> Path:
    """Encode every passage into on-disk chunks; resume a partial run; return the finished folder."""
    key = embeddings_key(corpus.checksum, settings)
    done = index_dir / f"embeddings-{key}"
    if (done / "manifest.json").is_file():
        return done
    work = index_dir / f"embeddings-{key}.partial"
    work.mkdir(parents=True, exist_ok=True)
    meta_path = work / "build.json"
    if meta_path.is_file():
        previous = json.loads(meta_path.read_text())
        if previous.get("chunk_size") != chunk_size or previous.get("doc_count") != len(corpus):
            logger.warning("partial embeddings in %s used another chunking; starting over", work)
            shutil.rmtree(work)
            work.mkdir(parents=True)
    meta_path.write_text(json.dumps({"chunk_size": chunk_size, "doc_count": len(corpus)}))
    n_chunks = math.ceil(len(corpus) / chunk_size)
    finished = {i for i in range(n_chunks) if (work / f"chunk-{i:06d}.npy").is_file()}
    t0 = time.perf_counter()
    from tqdm import tqdm

    already = sum(min(chunk_size, len(corpus) - i * chunk_size) for i in finished)
    # a bar on a terminal; lines in a log (the stack's, a container's: a bar's carriage returns never reach it)
    as_bar = show_progress and sys.stderr.isatty()
    bar = tqdm(total=len(corpus), unit="passage", desc="encoding", disable=not as_bar, initial=already)
    progress = ProgressLog(f"encoding the corpus with {settings.name}", len(corpus), "passages", log=logger,
                           initial=already) if not as_bar and n_chunks > len(finished) else None
    if finished:
        logger.info("resuming embeddings: %s of %s chunks already on disk", len(finished), n_chunks)
    for i in sorted(set(range(n_chunks)) - finished):
        if encoder is None:
            encoder = Encoder(settings)
            logger.info("encoding %s passages with %s (%s) into %s", f"{len(corpus):,}", settings.name,
                        encoder.backend, work)
        lo, hi = i * chunk_size, min(len(corpus), (i + 1) * chunk_size)
        texts = [corpus.passage(j) for j in range(lo, hi)]
        # by length, in parts: similar lengths batch together (less padding), and progress shows between parts
        order = sorted(range(len(texts)), key=lambda j: len(texts[j]))
        vectors: npt.NDArray[np.float32] | None = None
        for start in range(0, len(order), PROGRESS_PART):
            part = order[start:start + PROGRESS_PART]
            encoded = encoder.encode_passages([texts[j] for j in part])
            if vectors is None:
                vectors = np.empty((len(texts), encoded.shape[1]), dtype=np.float32)
            vectors[part] = encoded
            bar.update(len(part))
            if progress is not None:
                progress.update(len(part))
        assert vectors is not None  # a chunk holds at least one passage
        with atomic_file(work / f"chunk-{i:06d}.npy") as tmp, tmp.open("wb") as fh:
            np.save(fh, vectors)
    bar.close()
    if progress is not None:
        progress.close()
    dims = int(np.load(work / "chunk-000000.npy", mmap_mode="r").shape[1])
    Manifest(kind="embeddings", backend="sentence-transformers", corpus_path=str(corpus.path),
             corpus_checksum=corpus.checksum, doc_count=len(corpus), encoder=settings.name,
             encoder_config=encoder_identity(settings), dims=dims,
             params={"chunk_size": chunk_size, "chunks": n_chunks},
             build_seconds=round(time.perf_counter() - t0, 3)).write(work)
    if done.exists():
        shutil.rmtree(done)
    os.replace(work, done)
    return done


def iter_chunks(folder: Path) -> Iterator[npt.NDArray[np.float32]]:
    for path in sorted(folder.glob("chunk-*.npy")):
        yield np.load(path, mmap_mode="r")


def ivf_nlist(n: int, settings: FaissSettings) -> int:
    """The configured number of IVF lists, or about 4*sqrt(n) (at most n/39: faiss wants 39 training
    vectors per list)."""
    return settings.ivf_nlist or max(1, min(int(4 * math.sqrt(n)), n // 39))


def new_faiss_index(dims: int, n: int, settings: FaissSettings) -> Any:
    """An empty index of the configured type for n vectors (inner product on normalised vectors)."""
    import faiss

    kind = settings.index_type
    if kind == "flat":
        return faiss.IndexFlatIP(dims)
    if kind == "hnsw":
        index = faiss.IndexHNSWFlat(dims, settings.hnsw_m, faiss.METRIC_INNER_PRODUCT)
        index.hnsw.efConstruction = settings.hnsw_ef_construction
        return index
    if kind == "sq8":
        return faiss.IndexScalarQuantizer(dims, faiss.ScalarQuantizer.QT_8bit, faiss.METRIC_INNER_PRODUCT)
    nlist = ivf_nlist(n, settings)
    if kind == "ivfsq8":
        return faiss.index_factory(dims, f"IVF{nlist},SQ8", faiss.METRIC_INNER_PRODUCT)
    pq_m = next(m for m in range(settings.pq_m or max(1, dims // 4), 0, -1) if dims % m == 0)  # divides dims
    return faiss.index_factory(dims, f"IVF{nlist},PQ{pq_m}", faiss.METRIC_INNER_PRODUCT)


Chunks = Callable[[], Iterable[npt.NDArray[np.float32]]]


def _training_sample(chunks: Chunks, n: int, size: int) -> npt.NDArray[np.float32]:
    """About `size` vectors spread evenly over the n (one chunk in memory at a time)."""
    step = max(1, int(round(1 / min(1.0, size / max(1, n)))))
    parts: list[npt.NDArray[np.float32]] = []
    seen = 0
    for chunk in chunks():
        first = (-seen) % step  # every step-th vector of the whole sequence, across chunk boundaries
        parts.append(np.array(chunk[first::step], dtype=np.float32))
        seen += len(chunk)
    return np.ascontiguousarray(np.concatenate(parts)[:size])


def build_faiss(embeddings: Path, out: Path, settings: FaissSettings, *, chunks: Chunks | None = None,
                show_progress: bool = True) -> Manifest:
    """Build the FAISS index from on-disk chunks (one chunk in RAM at a time) into an atomic folder.

    `chunks`: where the vectors come from when not from the chunk files of `embeddings` (whose manifest
    still describes them): a function returning a fresh iterator of arrays, in document order, at each call
    (an IVF build reads them twice: the training sample, then the fill)."""
    import faiss
    from tqdm import tqdm

    source = Manifest.read(embeddings)
    n, dims = source.doc_count, int(source.dims or 0)
    read = chunks if chunks is not None else lambda: iter_chunks(embeddings)
    if settings.threads:
        faiss.omp_set_num_threads(settings.threads)
    t0 = time.perf_counter()
    params: dict[str, Any] = settings.model_dump(exclude={"gpu", "threads", "one_thread_below", "nprobe",
                                                          "hnsw_ef_search", "blas_threshold",
                                                          "mmap"})
    with atomic_folder(out) as tmp:
        bar = tqdm(total=n, unit="vector", desc=f"faiss {settings.index_type}", disable=not show_progress)
        if settings.index_type in IVF_TYPES:
            work = out.parent / f".{out.name}.build"
            key = {"embeddings": embeddings.name, "corpus_checksum": source.corpus_checksum, "n": n, "dims": dims,
                   "params": params}
            files, added, nlist = _build_ivf(read, tmp, dims, n, settings, bar, work=work, key=key)
            params["ivf_nlist"] = nlist
        else:
            files, added = _build_shards(read, tmp, dims, n, settings, bar)
        bar.close()
        if added != n:
            raise RuntimeError(f"embedding chunks hold {added} vectors, manifest says {n}")
        manifest = Manifest(kind="dense", backend="faiss", corpus_path=source.corpus_path,
                            corpus_checksum=source.corpus_checksum, doc_count=n, encoder=source.encoder,
                            encoder_config=source.encoder_config, dims=dims, index_type=settings.index_type,
                            params=params, files=files, build_seconds=round(time.perf_counter() - t0, 3))
        manifest.write(tmp)
    logger.info("built FAISS %s index %s (%s vectors, files %s) in %.1f s", settings.index_type, out, n,
                ", ".join(files), manifest.build_seconds)
    return manifest


def _build_shards(read: Chunks, tmp: Path, dims: int, n: int, settings: FaissSettings, bar: Any) -> tuple[list[str], int]:
    """Flat (in shards of `shard_size`), HNSW and SQ8 (one file): added chunk by chunk."""
    index = new_faiss_index(dims, n, settings)
    if not index.is_trained:
        index.train(_training_sample(read, n, settings.train_size))
    shard_limit = settings.shard_size if settings.index_type == "flat" else n + 1
    shards: list[str] = []
    added = 0
    for chunk in read():
        start = 0
        while start < len(chunk):
            room = shard_limit - index.ntotal
            part = np.ascontiguousarray(chunk[start:start + room], dtype=np.float32)
            index.add(part)
            start += len(part)
            added += len(part)
            bar.update(len(part))
            if index.ntotal >= shard_limit:
                shards.append(_write_shard(index, tmp, len(shards)))
                index = new_faiss_index(dims, n, settings)
    if index.ntotal or not shards:
        shards.append(_write_shard(index, tmp, len(shards)))
    return shards, added


IVF_INDEX = "index.faiss"
IVF_LISTS = "lists.ivfdata"


def _build_ivf(read: Chunks, tmp: Path, dims: int, n: int, settings: FaissSettings, bar: Any, *,
               work: Path, key: dict[str, Any]) -> tuple[list[str], int, int]:
    """Train on a sample; fill parts of `shard_size` vectors (each written once full: one part's codes in
    memory at a time); merge the parts' lists into one on-disk file; remove the parts.

    Resumable: the trained index and every finished part are kept in `work` (with `key`, what they were built
    from), so a build stopped at any point goes on from its last finished part (at 21M: 11 parts of 2M, after
    a training of minutes) instead of starting again; `work` is removed once the index is written."""
    import faiss
    from faiss.contrib.ondisk import merge_ondisk

    state_path = work / "state.json"
    state: dict[str, Any] = json.loads(state_path.read_text()) if state_path.is_file() else {}
    if state.get("key") != key or not (work / "trained.faiss").is_file() or \
            not all((work / name).is_file() for name in state.get("parts", [])):
        shutil.rmtree(work, ignore_errors=True)
        state = {}
    work.mkdir(parents=True, exist_ok=True)
    if state:
        trained = faiss.read_index(str(work / "trained.faiss"))
        logger.info("resuming the IVF build: trained, %d parts (%s vectors) already filled", len(state["parts"]),
                    state["added"])
    else:
        trained = new_faiss_index(dims, n, settings)
        sample = _training_sample(read, n, settings.train_size)
        logger.info("training %s lists on %s vectors", faiss.extract_index_ivf(trained).nlist, len(sample))
        trained.train(sample)
        del sample
        with atomic_file(work / "trained.faiss") as written:
            faiss.write_index(trained, str(written))
        state = {"key": key, "parts": [], "added": 0}
        write_json_atomically(state_path, state)
    assigner = _assigner(trained, settings)
    parts = [work / name for name in state["parts"]]
    done = int(state["added"])
    part = faiss.clone_index(trained)
    added = done
    bar.update(done)

    def flush() -> None:
        nonlocal part
        name = f"part-{len(parts):05d}.faiss"
        with atomic_file(work / name) as written:
            faiss.write_index(part, str(written))
        parts.append(work / name)
        state["parts"].append(name)
        state["added"] = added
        write_json_atomically(state_path, state)  # the part is there before the state names it
        part = faiss.clone_index(trained)

    seen = 0
    for chunk in read():
        if seen + len(chunk) <= done:  # in a part filled before the stop
            seen += len(chunk)
            continue
        start = max(0, done - seen)
        seen += len(chunk)
        while start < len(chunk):
            room = settings.shard_size - part.ntotal
            vectors = np.ascontiguousarray(chunk[start:start + room], dtype=np.float32)
            ids = np.arange(added, added + len(vectors), dtype=np.int64)
            if assigner is None:
                part.add_with_ids(vectors, ids)
            else:  # the lists found by the graph, then the index encodes the vectors into them
                lists = np.ascontiguousarray(assigner.search(vectors, 1)[1].ravel(), dtype=np.int64)
                faiss.extract_index_ivf(part).add_core(len(vectors), faiss.swig_ptr(vectors), faiss.swig_ptr(ids),
                                                       faiss.swig_ptr(lists))
            start += len(vectors)
            added += len(vectors)
            bar.update(len(vectors))
            if part.ntotal >= settings.shard_size:
                flush()
    if part.ntotal or not parts:
        flush()
    del part
    merged = faiss.clone_index(trained)
    merge_ondisk(merged, [str(p) for p in parts], str(tmp / IVF_LISTS))
    faiss.write_index(merged, str(tmp / IVF_INDEX))
    shutil.rmtree(work, ignore_errors=True)
    return [IVF_INDEX, IVF_LISTS], added, int(faiss.extract_index_ivf(merged).nlist)


HNSW_ASSIGN_FROM = 8192
"""From this many IVF lists on, `ivf_assign=auto` assigns the vectors through an HNSW graph over the centroids."""


def _assigner(trained: Any, settings: FaissSettings) -> Any:
    """An HNSW graph over the trained centroids that finds each vector's list (None: the index's own exact
    quantizer does). At 21M vectors and 18,337 lists the exact assignment is 1.5e14 multiply-adds, most of the
    build on a small CPU node."""
    import faiss

    ivf = faiss.extract_index_ivf(trained)
    if settings.ivf_assign == "exact" or (settings.ivf_assign == "auto" and ivf.nlist < HNSW_ASSIGN_FROM):
        return None
    graph = faiss.IndexHNSWFlat(ivf.d, 32, ivf.metric_type)
    graph.hnsw.efConstruction = 80
    graph.add(ivf.quantizer.reconstruct_n(0, ivf.nlist))
    # 18,337 random unit centroids in 384-d (a hard case: no structure) and vectors near them: efSearch 32 finds
    # the exact list for 99.7% of them, 2.9x faster than against every centroid (16: 96.1%, 4.8x); a vector put
    # in its second-nearest list is still found by a search that probes it among its nprobe
    graph.hnsw.efSearch = 32
    logger.info("assigning the vectors to %s lists through an HNSW graph over the centroids", ivf.nlist)
    return graph


def _write_shard(index: Any, folder: Path, number: int) -> str:
    import faiss

    name = f"shard-{number:05d}.faiss"
    faiss.write_index(index, str(folder / name))
    return name


def dense_folder(index_dir: Path, index_type: str) -> Path:
    return index_dir / f"dense-{index_type}"
