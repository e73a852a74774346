"""The FAISS dense store (registry name `faiss`): in-process index files under `<index_dir>/dense-<type>/`, loaded and
searched (`FaissIndex`), and built from the encoded passages (flat, HNSW, SQ8, IVF-PQ, IVF-SQ8).

Searching: flat indexes stored in shards are combined into one; with faiss-gpu they load shard by shard onto the
GPUs as fp16 (the fp32 index is never staged in host RAM). Served on CPUs, index files are memory-mapped
(`RETRIEVER_FAISS__MMAP`): the workers of a retriever share the codes and lists through the page cache. Passages
put while serving are searched beside it, in memory (the live overlay).

Building: from the chunks of passage vectors (`plugsearch.retriever.indexing.embeddings`) read back one at a time.
Flat indexes are stored in shards. IVF indexes are trained on a sample, filled part by part (one part's codes in
memory at a time) and merged into one on-disk file of inverted lists (`lists.ivfdata`); the trained index and the
filled parts are kept (`.<index>.build/`) until then, so a stopped IVF build goes on from its last part.
"""

from __future__ import annotations

import json
import logging
import math
import shutil
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from plugsearch.common.files import atomic_path, atomic_write_json
from plugsearch.retriever.backends.base import Chunks, DenseStore, Hits, VectorIndex
from plugsearch.retriever.settings import IVF_TYPES, FaissSettings
from plugsearch.retriever.store.chunks import iter_chunks
from plugsearch.retriever.store.manifest import (
    IndexMissing,
    Manifest,
    index_folder,
)

if TYPE_CHECKING:
    from plugsearch.retriever.settings import RetrieverSettings

logger = logging.getLogger(__name__)


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


def configure_search(index: Any, settings: FaissSettings) -> None:
    """Query-time knobs (efSearch / nprobe); harmless on other index types."""
    import faiss

    inner = faiss.downcast_index(index)
    if hasattr(inner, "hnsw"):
        inner.hnsw.efSearch = settings.hnsw_ef_search
    if hasattr(inner, "nprobe"):
        inner.nprobe = settings.nprobe


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


class FaissIndex(VectorIndex):
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


# ----------------------------------------------------------------------------------------------- building

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
    with index_folder(out) as tmp:
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
        with atomic_path(work / "trained.faiss") as written:
            faiss.write_index(trained, str(written))
        state = {"key": key, "parts": [], "added": 0}
        atomic_write_json(state_path, state)
    assigner = _assigner(trained, settings)
    parts = [work / name for name in state["parts"]]
    done = int(state["added"])
    part = faiss.clone_index(trained)
    added = done
    bar.update(done)

    def flush() -> None:
        nonlocal part
        name = f"part-{len(parts):05d}.faiss"
        with atomic_path(work / name) as written:
            faiss.write_index(part, str(written))
        parts.append(work / name)
        state["parts"].append(name)
        state["added"] = added
        atomic_write_json(state_path, state)  # the part is there before the state names it
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


class Faiss(DenseStore):
    """The registry entry: `RETRIEVER_DENSE_BACKEND=faiss` (RETRIEVER_FAISS__*), index folder
    `<index_dir>/dense-<type>` (built here, or a FAISS file adopted by `plugsearch-index import faiss`)."""

    name = "faiss"

    def folder(self, settings: RetrieverSettings) -> Path:
        return dense_folder(settings.index_dir, settings.faiss.index_type)

    def index_type(self, settings: RetrieverSettings) -> str:
        return settings.faiss.index_type

    def set_index_type(self, settings: RetrieverSettings, index_type: str) -> None:
        settings.faiss.index_type = index_type  # type: ignore[assignment]  # the command line offers the types

    def open(self, settings: RetrieverSettings) -> VectorIndex:
        return FaissIndex(self.folder(settings), settings.faiss)

    def build(self, settings: RetrieverSettings, embeddings: Path, chunks: Chunks, *, force: bool,
              show_progress: bool) -> Manifest:
        return build_faiss(embeddings, self.folder(settings), settings.faiss, chunks=chunks,
                           show_progress=show_progress)

    def identity(self, settings: RetrieverSettings, index_type: str | None) -> dict[str, Any]:
        """The query-time knobs of approximate search: lists probed (IVF), the graph's search breadth (HNSW)."""
        if index_type in IVF_TYPES:
            return {"nprobe": settings.faiss.nprobe}
        if index_type == "hnsw":
            return {"hnsw_ef_search": settings.faiss.hnsw_ef_search}
        return {}
