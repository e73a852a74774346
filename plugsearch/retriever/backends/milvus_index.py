"""Dense retrieval on Milvus: the same encoder and vectors as the FAISS backend, searched by Milvus.

The engine is milvus-lite locally and in tests (a `.db` folder opened inside this process through pymilvus'
`MilvusClient`), a Milvus server or cluster in production (`http(s)://host:19530` + token). One collection
holds `id` (INT64, the passage's corpus position, as FAISS ids are) and `vector` (FLOAT_VECTOR), indexed
FLAT (exact) or HNSW, inner-product metric like the FAISS indexes.

Builds stream the chunks of `indexing.embeddings.embed_corpus` in batches of `insert_batch` rows and record the rows
loaded after each batch, so a killed build resumes there (upserting the first batch: it may have landed
before the kill). A SHA-256 over every id and vector (int64 / float32 bytes in id order) and the row count
are kept in the manifest (`<index_dir>/milvus-<collection>/`) and in the collection's properties; start-up
refuses a collection that differs. Every call has a deadline (`timeout_s`) and retries (`retries`, doubling
backoff); a Milvus that does not answer is a `NotReady` (503 + Retry-After), never a 500.

Registry name `milvus`. Documents changed while serving (`plugsearch.retriever.live.overlay`) change the collection through Milvus's own upserts and
deletes (`MilvusChanges`): a passage put is upserted at its position (past the built ones) before its change is
logged, the positions a change removes are deleted after, and the last change carried into the collection is
kept in its properties (`plugsearch.changes_seq`). Searches ask only for the positions their state knows (`id <
end`) and leave out the removed ones, so a search never sees half of a change, whatever Milvus has done yet.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np
import numpy.typing as npt

from plugsearch.common.errors import NotReady
from plugsearch.common.files import atomic_write_json
from plugsearch.retriever.backends.base import Chunks, DenseMirror, DenseStore, Hits, VectorIndex
from plugsearch.retriever.settings import MilvusSettings
from plugsearch.retriever.store.chunks import iter_chunks

if TYPE_CHECKING:
    from plugsearch.retriever.settings import RetrieverSettings
from plugsearch.retriever.store.manifest import (
    IndexMismatch,
    IndexMissing,
    Manifest,
    index_folder,
)

logger = logging.getLogger(__name__)

ID_FIELD = "id"
VECTOR_FIELD = "vector"
METRIC = "IP"
CHECKSUM_PROPERTY = "plugsearch.checksum"
ROWS_PROPERTY = "plugsearch.rows"
CHANGES_PROPERTY = "plugsearch.changes_seq"
"""The last change of the change log carried into the collection (0 or absent: none)."""
T = TypeVar("T")


class MilvusUnavailable(IndexMissing):
    """Milvus did not answer at start-up (the service refuses to start, like a missing index)."""


def milvus_folder(index_dir: Path, collection: str) -> Path:
    """The index folder of a Milvus collection: its manifest only (the vectors live in Milvus)."""
    return index_dir / f"milvus-{collection}"


def display_uri(settings: MilvusSettings) -> str:
    """The URI as logged and recorded: no credentials (a user:password@ part is dropped)."""
    uri = settings.uri
    if "@" in uri and "://" in uri:
        scheme, rest = uri.split("://", 1)
        uri = f"{scheme}://{rest.split('@', 1)[1]}"
    return uri


def _local_path(settings: MilvusSettings) -> str:
    return str(Path(settings.uri).expanduser().resolve())


def connect(settings: MilvusSettings) -> Any:
    """A MilvusClient (milvus-lite starts inside this process for a local `.db` URI)."""
    try:
        from pymilvus import MilvusClient
    except ImportError as exc:  # the `milvus` extra
        raise MilvusUnavailable("RETRIEVER_DENSE_BACKEND=milvus needs pymilvus (pip install 'plugsearch[milvus]')") \
            from exc
    uri = _local_path(settings) if settings.is_local else settings.uri
    if settings.is_local:
        Path(uri).parent.mkdir(parents=True, exist_ok=True)
    token = settings.token.get_secret_value() if settings.token is not None else ""
    try:
        return MilvusClient(uri=uri, token=token, db_name=settings.db_name, timeout=settings.timeout_s)
    except Exception as exc:  # pymilvus raises MilvusException or grpc errors; both mean "not reachable"
        raise MilvusUnavailable(f"cannot reach Milvus at {display_uri(settings)}: {type(exc).__name__}: "
                                f"{_reason(exc)}") from exc


def release_local(settings: MilvusSettings) -> None:
    """Stop this process's milvus-lite server for the URI (frees its folder for another process)."""
    if not settings.is_local:
        return
    try:
        from milvus_lite.server_manager import server_manager_instance
    except ImportError:
        return
    server_manager_instance.release_server(_local_path(settings))


def _reason(exc: BaseException) -> str:
    message = getattr(exc, "message", None) or str(exc)
    return str(message).splitlines()[0][:300] if message else type(exc).__name__


def call(settings: MilvusSettings, what: str, fn: Callable[..., T], *args: Any, long: bool = False,
         **kwargs: Any) -> T:
    """`fn(*args, timeout=..., **kwargs)`, retried with backoff; NotReady (503) once every try failed. `long`:
    an operation whose time grows with the collection (building an index, loading it), given
    `build_timeout_s` instead of the per-call `timeout_s`."""
    delay = settings.retry_backoff_s
    timeout = settings.build_timeout_s if long else settings.timeout_s
    last: BaseException | None = None
    for attempt in range(settings.retries + 1):
        try:
            return fn(*args, timeout=timeout, **kwargs)
        except Exception as exc:  # MilvusException, grpc.RpcError, connection errors: all upstream failures
            last = exc
            logger.warning("Milvus %s failed (try %s of %s): %s", what, attempt + 1, settings.retries + 1,
                           _reason(exc))
            if attempt < settings.retries:
                time.sleep(delay)
                delay *= 2
    code = getattr(last, "code", None)
    raise NotReady(f"the dense index (Milvus) did not answer {what}"
                   + (f" (code {code})" if isinstance(code, int) else "") + "; retry later",
                   retry_after=float(settings.retry_after_s))


def count_rows(client: Any, settings: MilvusSettings) -> int:
    rows = call(settings, "count", client.query, settings.collection, output_fields=["count(*)"],
                consistency_level="Strong", long=True)  # reads every segment: grows with the collection
    return int(rows[0]["count(*)"])


def index_params(client: Any, settings: MilvusSettings) -> Any:
    params = client.prepare_index_params()
    if settings.index_type == "hnsw":
        params.add_index(field_name=VECTOR_FIELD, index_type="HNSW", metric_type=METRIC,
                         params={"M": settings.hnsw_m, "efConstruction": settings.hnsw_ef_construction})
    else:
        params.add_index(field_name=VECTOR_FIELD, index_type="FLAT", metric_type=METRIC)
    return params


def _described(client: Any, settings: MilvusSettings) -> tuple[dict[str, str], int | None]:
    """The collection's properties, and the dimension of its vectors."""
    described = call(settings, "describe_collection", client.describe_collection, settings.collection)
    dims = [int(f.get("params", {}).get("dim", 0)) or None for f in described.get("fields", [])
            if f.get("name") == VECTOR_FIELD]
    return {str(k): str(v) for k, v in (described.get("properties") or {}).items()}, (dims or [None])[0]


def create_index(client: Any, settings: MilvusSettings) -> None:
    """Index the vector field. A try that ran out of time may have left the index building in Milvus: the
    next try then finds it and does not ask again (which Milvus refuses: "index already exists")."""

    def once(timeout: float) -> None:
        if not client.list_indexes(settings.collection, timeout=timeout):
            client.create_index(settings.collection, index_params(client, settings), timeout=timeout)

    call(settings, "create_index", once, long=True)


def _create_collection(client: Any, settings: MilvusSettings, dims: int) -> None:
    from pymilvus import DataType, MilvusClient

    schema = MilvusClient.create_schema(auto_id=False, enable_dynamic_field=False,
                                        description="plugsearch dense passages (id = corpus position)")
    schema.add_field(ID_FIELD, DataType.INT64, is_primary=True)
    schema.add_field(VECTOR_FIELD, DataType.FLOAT_VECTOR, dim=dims)
    call(settings, "create_collection", client.create_collection, settings.collection, schema=schema)


def build_milvus(embeddings: Path, index_dir: Path, settings: MilvusSettings, *, force: bool = False,
                 show_progress: bool = True,
                 chunks: Callable[[], Iterable[npt.NDArray[np.float32]]] | None = None) -> Manifest:
    """Load the embedding chunks into the collection, index it, and write the manifest folder.

    Resumes a killed build of the same embeddings (same collection, same batch size); `force` starts over.
    `chunks`: where the vectors come from when not from the chunk files (see `faiss_index.build_faiss`).
    """
    from tqdm import tqdm

    source = Manifest.read(embeddings)
    n, dims = source.doc_count, int(source.dims or 0)
    batch = settings.insert_batch
    state_path = index_dir / f".milvus-{settings.collection}.build.json"
    want = {"embeddings": embeddings.name, "collection": settings.collection, "uri": display_uri(settings),
            "batch": batch, "doc_count": n, "dims": dims}
    loaded = 0
    t0 = time.perf_counter()
    client = connect(settings)
    try:
        exists = call(settings, "has_collection", client.has_collection, settings.collection)
        state: dict[str, Any] = json.loads(state_path.read_text()) if state_path.is_file() else {}
        if not force and exists and state and {k: state.get(k) for k in want} == want:
            loaded = int(state["loaded"])
            logger.info("resuming the Milvus load of %s: %s of %s rows already in %s", embeddings.name, loaded,
                        n, settings.collection)
        else:
            if exists:
                logger.info("dropping the Milvus collection %s (rebuilt from %s)", settings.collection,
                            embeddings.name)
                call(settings, "drop_collection", client.drop_collection, settings.collection)
            _create_collection(client, settings, dims)
            index_dir.mkdir(parents=True, exist_ok=True)
            atomic_write_json(state_path, {**want, "loaded": 0})
        id_digest, vector_digest = hashlib.sha256(), hashlib.sha256()  # streamed: batch sizes do not matter
        bar = tqdm(total=n, unit="vector", desc=f"milvus {settings.collection}", disable=not show_progress,
                   initial=loaded)
        position = 0
        first_after_resume = loaded > 0
        for chunk in (chunks() if chunks is not None else iter_chunks(embeddings)):
            for start in range(0, len(chunk), batch):
                vectors = np.ascontiguousarray(chunk[start:start + batch], dtype=np.float32)
                ids = np.arange(position, position + len(vectors), dtype=np.int64)
                id_digest.update(ids.tobytes())
                vector_digest.update(vectors.tobytes())
                position += len(vectors)
                if position <= loaded:
                    continue
                entities = [{ID_FIELD: int(i), VECTOR_FIELD: v} for i, v in zip(ids, vectors, strict=True)]
                # the batch after a resume may have landed before the kill: upsert keeps ids unique
                op = client.upsert if first_after_resume else client.insert
                call(settings, "insert", op, settings.collection, entities)
                first_after_resume = False
                loaded = position
                atomic_write_json(state_path, {**want, "loaded": loaded})
                bar.update(len(vectors))
        bar.close()
        if position != n:
            raise RuntimeError(f"embedding chunks hold {position} vectors, manifest says {n}")
        checksum = hashlib.sha256(id_digest.digest() + vector_digest.digest()).hexdigest()
        call(settings, "flush", client.flush, settings.collection)
        if call(settings, "list_indexes", client.list_indexes, settings.collection):
            call(settings, "release_collection", client.release_collection, settings.collection)
            call(settings, "drop_index", client.drop_index, settings.collection, VECTOR_FIELD)
        create_index(client, settings)
        call(settings, "load_collection", client.load_collection, settings.collection, long=True)
        rows = count_rows(client, settings)
        if rows != n:
            raise IndexMismatch(f"Milvus collection {settings.collection} holds {rows} rows after the load, "
                                f"expected {n}; rebuild it with `plugsearch-index build --force`")
        call(settings, "alter_collection_properties", client.alter_collection_properties, settings.collection,
             properties={CHECKSUM_PROPERTY: checksum, ROWS_PROPERTY: str(n)})
        params: dict[str, Any] = {"uri": display_uri(settings), "collection": settings.collection,
                                  "metric": METRIC, "row_count": n, "checksum": checksum,
                                  "embeddings": embeddings.name}
        if settings.index_type == "hnsw":
            params.update(hnsw_m=settings.hnsw_m, hnsw_ef_construction=settings.hnsw_ef_construction)
        manifest = Manifest(kind="dense", backend="milvus", corpus_path=source.corpus_path,
                            corpus_checksum=source.corpus_checksum, doc_count=n, encoder=source.encoder,
                            encoder_config=source.encoder_config, dims=dims, index_type=settings.index_type,
                            params=params, build_seconds=round(time.perf_counter() - t0, 3))
        with index_folder(milvus_folder(index_dir, settings.collection)) as tmp:
            manifest.write(tmp)
        state_path.unlink(missing_ok=True)
    finally:
        client.close()
        release_local(settings)
    logger.info("loaded %s vectors into Milvus collection %s (%s) in %.1f s", n, settings.collection,
                settings.index_type, manifest.build_seconds)
    return manifest


def check_collection(client: Any, settings: MilvusSettings, manifest: Manifest) -> int:
    """Raise IndexMissing / IndexMismatch unless the collection is the one the manifest describes."""
    where = f"Milvus collection {settings.collection} at {display_uri(settings)}"
    rebuild = "; rebuild it with `plugsearch-index build --force`"
    if not call(settings, "has_collection", client.has_collection, settings.collection):
        raise IndexMissing(f"{where} does not exist, though its index manifest says it was built" + rebuild)
    problems = []
    if manifest.params.get("collection") != settings.collection:
        problems.append(f"manifest is of collection {manifest.params.get('collection')!r}")
    properties, dims = _described(client, settings)
    if properties.get(CHECKSUM_PROPERTY) != manifest.params.get("checksum"):
        problems.append(f"checksum {properties.get(CHECKSUM_PROPERTY)} != manifest {manifest.params.get('checksum')}")
    if dims != manifest.dims:
        problems.append(f"{dims}-d vectors != manifest {manifest.dims}-d")
    rows = count_rows(client, settings)
    if rows != manifest.doc_count and not changes_seq(properties):  # changes add and delete rows: the change
        problems.append(f"row count {rows} != manifest {manifest.doc_count}")  # log is checked against them
    if problems:
        raise IndexMismatch(f"{where} is not the collection the index manifest describes: "
                            + "; ".join(problems) + rebuild)
    return rows


def changes_seq(properties: dict[str, str]) -> int:
    """The last change carried into the collection, from its properties."""
    try:
        return int(properties.get(CHANGES_PROPERTY, "0"))
    except ValueError:
        return 0


def open_checked(settings: MilvusSettings, manifest: Manifest) -> tuple[Any, int]:
    """Connect and check the collection; start-up failures are MilvusUnavailable / IndexMismatch."""
    client = connect(settings)
    try:
        return client, check_collection(client, settings, manifest)
    except NotReady as exc:
        client.close()
        raise MilvusUnavailable(f"Milvus at {display_uri(settings)} did not answer: {exc.message}") from exc
    except BaseException:
        client.close()
        raise


class MilvusIndex(VectorIndex):
    """A loaded Milvus collection behind the same `search(vectors, k) -> Hits` as `FaissIndex`."""

    def __init__(self, folder: Path, settings: MilvusSettings) -> None:
        self.settings = settings
        self.manifest = Manifest.read(folder)
        self.dims = int(self.manifest.dims or 0)
        self.client, rows = open_checked(settings, self.manifest)
        if rows != self.ntotal:
            logger.info("Milvus collection %s holds %d rows: %d built, the rest changes while serving",
                        settings.collection, rows, self.ntotal)
        try:
            call(settings, "load_collection", self.client.load_collection, settings.collection, long=True)
        except NotReady as exc:
            self.close()
            raise MilvusUnavailable(exc.message) from exc

    @property
    def ntotal(self) -> int:
        """The built rows (a collection that carries changes holds more or fewer: the live state counts those)."""
        return self.manifest.doc_count

    def search(self, vectors: npt.NDArray[np.float32], k: int, *, below: int | None = None,
               strong: bool = False) -> Hits:
        """The `k` nearest rows; `below`: only ids under it (the positions a live state knows); `strong`: see every
        write Milvus acknowledged (after changes: the upserts a change was logged after)."""
        params: dict[str, Any] = {"metric_type": METRIC}
        if self.settings.index_type == "hnsw":
            params["params"] = {"ef": max(self.settings.hnsw_ef_search, k)}
        extra: dict[str, Any] = {"consistency_level": "Strong"} if strong else {}
        if below is not None:
            extra["filter"] = f"{ID_FIELD} < {int(below)}"
        found = call(self.settings, "search", self.client.search, self.settings.collection,
                     data=list(vectors), limit=k, anns_field=VECTOR_FIELD, search_params=params,
                     output_fields=[ID_FIELD], **extra)
        hits = Hits.empty(len(vectors), k)
        for row, ranked in enumerate(found):
            for rank, hit in enumerate(ranked[:k]):
                hits.ids[row, rank] = int(hit["id"])
                hits.scores[row, rank] = float(hit["distance"])
        return hits

    def mirror(self) -> DenseMirror:
        """The collection takes the changes itself (`MilvusChanges`)."""
        return MilvusChanges(self)

    def ping(self) -> bool:
        """Cheap reachability check for readiness (one try, short deadline)."""
        try:
            self.client.has_collection(self.settings.collection, timeout=min(2.0, self.settings.timeout_s))
        except Exception:  # readiness reports it; searches raise the 503
            return False
        return True

    def close(self) -> None:
        try:
            self.client.close()
        finally:
            release_local(self.settings)


class MilvusChanges:
    """A changing corpus's passages in the collection itself, through Milvus's upserts and deletes (called under the
    change log's lock, so one writer at a time, in the log's order; see `plugsearch.retriever.live.mirror`)."""

    def __init__(self, index: MilvusIndex) -> None:
        self.index = index
        self.settings = index.settings

    def seq(self) -> int:
        """The last change carried into the collection."""
        properties, _ = _described(self.index.client, self.settings)
        return changes_seq(properties)

    def upsert(self, start: int, vectors: npt.NDArray[np.float32]) -> None:
        """Rows `start`, `start + 1`, ... with these vectors (replaced where a crash left some before)."""
        for at in range(0, len(vectors), self.settings.insert_batch):
            chunk = np.ascontiguousarray(vectors[at:at + self.settings.insert_batch], dtype=np.float32)
            rows = [{ID_FIELD: start + at + i, VECTOR_FIELD: v} for i, v in enumerate(chunk)]
            call(self.settings, "upsert", self.index.client.upsert, self.settings.collection, rows)

    def delete(self, positions: list[int]) -> None:
        for at in range(0, len(positions), self.settings.insert_batch):
            call(self.settings, "delete", self.index.client.delete, self.settings.collection,
                 ids=[int(p) for p in positions[at:at + self.settings.insert_batch]])

    def mark(self, seq: int) -> None:
        """Record that every change up to `seq` is in the collection."""
        call(self.settings, "alter_collection_properties", self.index.client.alter_collection_properties,
             self.settings.collection, properties={CHANGES_PROPERTY: str(seq)})

    def search(self, vectors: npt.NDArray[np.float32], k: int, *, below: int, strong: bool) -> Hits:
        """The collection's nearest rows under `below` (the positions a live state knows)."""
        return self.index.search(vectors, k, below=below, strong=strong)


class Milvus(DenseStore):
    """The registry entry: `RETRIEVER_DENSE_BACKEND=milvus` (RETRIEVER_MILVUS__*), index folder
    `<index_dir>/milvus-<collection>` (the manifest of what the collection holds)."""

    name = "milvus"

    def folder(self, settings: RetrieverSettings) -> Path:
        return milvus_folder(settings.index_dir, settings.milvus.collection)

    def index_type(self, settings: RetrieverSettings) -> str:
        return settings.milvus.index_type

    def set_index_type(self, settings: RetrieverSettings, index_type: str) -> None:
        if index_type not in ("flat", "hnsw"):
            raise ValueError(f"--index-type {index_type}: Milvus indexes here are flat or hnsw")
        settings.milvus.index_type = index_type  # type: ignore[assignment]

    def check(self, settings: RetrieverSettings, checksum: str) -> Manifest:
        """The manifest, then the collection itself: rows and checksum as recorded."""
        manifest = super().check(settings, checksum)
        client, _ = open_checked(settings.milvus, manifest)
        client.close()
        return manifest

    def matches(self, settings: RetrieverSettings, folder: Path) -> bool:
        """The collection holds what the manifest recorded (a Milvus that does not answer: MilvusUnavailable)."""
        try:
            client, _ = open_checked(settings.milvus, Manifest.read(folder))
            client.close()
        except MilvusUnavailable:
            raise
        except (IndexMissing, IndexMismatch) as exc:
            logger.info("%s needs a build: %s", folder, exc)
            return False
        finally:
            release_local(settings.milvus)
        return True

    def open(self, settings: RetrieverSettings) -> VectorIndex:
        return MilvusIndex(self.folder(settings), settings.milvus)

    def build(self, settings: RetrieverSettings, embeddings: Path, chunks: Chunks, *, force: bool,
              show_progress: bool) -> Manifest:
        return build_milvus(embeddings, settings.index_dir, settings.milvus, force=force, show_progress=show_progress,
                            chunks=chunks)
