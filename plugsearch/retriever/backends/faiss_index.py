"""Dense retrieval, searching: a built FAISS index loaded and searched, and the retriever that encodes
queries and searches a vector index (FAISS here, Milvus in plugsearch.retriever.backends.milvus_index).

Indexes are built by plugsearch.retriever.indexing.embeddings and queries encoded by plugsearch.retriever.encoders.encoder. Flat
indexes stored in shards are combined into one; with faiss-gpu they load shard by shard onto the GPUs as
fp16 (the fp32 index is never staged in host RAM). Served on CPUs, index files are memory-mapped
(`RETRIEVER_FAISS__MMAP`): the workers of a retriever share the codes and lists through the page cache.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt

from plugsearch.retriever.backends.base import Hits, Retriever
from plugsearch.retriever.encoders.encoder import Encoder
from plugsearch.retriever.settings import FaissSettings
from plugsearch.retriever.store.manifest import IndexMissing, Manifest

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
    """What DenseRetriever needs of an index: FaissIndex here, MilvusIndex in plugsearch.retriever.backends.milvus_index."""

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
