"""Compaction: the changes folded into new indexes, so that the overlay searched beside the built ones (held in
every worker's memory, replayed at every start) stays small. One job: building the next generation.

`plugsearch-index compact` (run by hand, or by the retriever itself in a child process once its overlay holds
RETRIEVER_COMPACT_AFTER passages) takes the newest generation (the built indexes at first), applies the logged
changes up to the last one, and writes a new generation folder beside the log (built under a temporary name,
renamed into place whole: `plugsearch.retriever.live.generations`): the served passages as a corpus file, its
document store, and each configured index built through the backends' registry, exactly as `plugsearch-index build`
builds them; the dense vectors are the ones already made (the previous generation's, or the build's embedding
chunks, and the vectors logged with the changes), so nothing is encoded twice. Then one transaction of the log
records the generation (the changes it folds, the counts of changes since the built corpus, where it is) and each
document's net change. Every worker sees the new generation at its next poll, loads it beside the one it serves and
swaps it in; searches never wait. Changes acknowledged while compaction ran stay in the log and are replayed over
the new generation.

The built corpus's identity is kept: a generation is that corpus with changes, so the retriever still reports its
checksum (a policy trained on it keeps serving it) and counts the changes since it (`corpus_drift`). Index ids move:
the new indexes are part of the identity (`plugsearch.retriever.serving.index_identity`).
"""

from __future__ import annotations

import logging
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import numpy.typing as npt
import orjson

from plugsearch.common.files import atomic_folder, atomic_write_json
from plugsearch.common.progress import ProgressLog
from plugsearch.retriever.backends import registry
from plugsearch.retriever.encoders.encoder import Encoder, encoder_identity
from plugsearch.retriever.ingest.passages import Passage
from plugsearch.retriever.live.changelog import FILE_MODE, FOLDER_MODE, ChangeLog, Generation, private_folder
from plugsearch.retriever.live.generations import (
    CORPUS_FILE,
    EMBEDDINGS,
    GENERATIONS,
    generation_folder,
    generation_settings,
)
from plugsearch.retriever.live.state import LiveState, Overlay
from plugsearch.retriever.live.vectors import VectorRows, try_lock
from plugsearch.retriever.store.chunks import chunk_path, iter_chunks
from plugsearch.retriever.store.docstore import (
    DiskStore,
    DocumentStore,
    build_docstore,
    check_store,
    corpus_checksum,
    open_store,
    store_folder,
)
from plugsearch.retriever.store.manifest import Manifest

if TYPE_CHECKING:
    from plugsearch.retriever.settings import RetrieverSettings

logger = logging.getLogger(__name__)

COMPACT_LOCK = "compact.lock"
CHUNK = 4096
"""Passages per embedding chunk of a generation (and per step of writing its corpus)."""


class CompactionRefused(RuntimeError):
    """The changes cannot be folded here (the message says why and what to do)."""


def generation_store(settings: RetrieverSettings, log_folder: Path, generation: Generation,
                     built_checksum: str) -> DocumentStore:
    """The documents of `generation` (the built corpus for generation 0)."""
    if generation.gen == 0:
        return open_store(settings.corpus, settings.index_dir, built_checksum, mode="disk")
    folder = log_folder / str(generation.body["folder"])
    checksum = str(generation.body["corpus_checksum"])
    check_store(store_folder(folder), checksum)
    return DiskStore(store_folder(folder), folder / CORPUS_FILE, checksum)


def compact(settings: RetrieverSettings, log_folder: Path, built_checksum: str, *,
            show_progress: bool = False) -> Generation | None:
    """Fold every logged change into a new generation; None when there was nothing to fold, or another compaction
    of this log is running. CompactionRefused where it cannot be done."""
    dense_store = registry.dense(settings.dense_backend) if settings.dense else None
    if settings.bm25 and not registry.lexical(settings.bm25_backend).live_changes:
        raise CompactionRefused(registry.live_changes_refusal())
    with try_lock(log_folder / COMPACT_LOCK) as mine:
        if not mine:
            logger.info("another compaction of %s is running", log_folder)
            return None
        log = ChangeLog(log_folder)
        try:
            current = log.generation()
            if current.gen == 0 and dense_store is not None:
                try:
                    dense_store.check(settings, built_checksum)
                except Exception as exc:
                    raise CompactionRefused(f"the dense index is not there yet ({exc}): compaction folds the "
                                            "changes into it once it is built") from exc
                probe = dense_store.open(settings)
                try:
                    if probe.mirror() is not None:
                        raise CompactionRefused(f"the {dense_store.name} collection takes the changes itself: "
                                                "nothing to compact")
                finally:
                    probe.close()
            return _compact(settings, log, current, built_checksum, show_progress=show_progress)
        finally:
            log.close()


def _compact(settings: RetrieverSettings, log: ChangeLog, current: Generation, built_checksum: str, *,
             show_progress: bool) -> Generation | None:
    t0 = time.perf_counter()
    last = log.last_seq
    if last <= current.folded:
        logger.info("nothing to compact: every change up to %d is in generation %d", last, current.gen)
        return None
    store = generation_store(settings, log.folder, current, built_checksum)
    try:
        vectors = VectorRows()
        overlay = Overlay(store, seq=current.folded, changed=current.body.get("changed"),
                          on_put=lambda first, passages: vectors.grow(first + len(passages)))
        for change in log.iter_after(current.folded):
            if change.seq > last:
                break
            overlay.state, _ = overlay.apply(change)
        state = overlay.state
        _logged_vectors(log, overlay, vectors, state)
        gen = current.gen + 1
        final = generation_folder(log.folder, gen)
        private_folder(final.parent)
        logger.info("compacting: generation %d from generation %d and changes %d to %d (%s passages put, %s left "
                    "out)", gen, current.gen, current.folded + 1, state.seq, f"{state.size:,}", f"{state.removed:,}")
        with atomic_folder(final, clean_stale=True) as tmp:
            body = _build(settings, log.folder, tmp, store, overlay, vectors, state, current,
                          show_progress=show_progress)
            body.update({"folder": f"{GENERATIONS}/{final.name}", "built_checksum": built_checksum,
                         "changed": dict(state.changed), "seconds": round(time.perf_counter() - t0, 1)})
            atomic_write_json(tmp / "generation.json", {"gen": gen, "folded": state.seq, **body}, indent=2)
            private_tree(tmp)
        generation = Generation(gen, state.seq, body)
        log.add_generation(generation, _net(overlay, state))
    finally:
        store.close()
    for old in (log.folder / GENERATIONS).glob("g*"):
        if old.is_dir() and old.name < f"g{gen - 1:06d}":
            shutil.rmtree(old, ignore_errors=True)
    log.checkpoint()
    logger.info("generation %d ready in %.1f s: %s passages, changes up to %d folded in", gen,
                time.perf_counter() - t0, f"{body['passages']:,}", state.seq)
    return generation


def private_tree(folder: Path) -> None:
    """Every folder under `folder` 0700 and every file 0600, whatever the umask of the process that built them."""
    for path in [folder, *folder.rglob("*")]:
        if path.is_symlink():
            continue
        path.chmod(FOLDER_MODE if path.is_dir() else FILE_MODE)


def _logged_vectors(log: ChangeLog, overlay: Overlay, vectors: VectorRows, state: LiveState) -> None:
    vector_id = 0
    while True:
        parts = log.vectors_after(vector_id)
        for part in parts:
            first = overlay.first_row.get(part.seq)
            if first is not None and part.seq <= state.seq:
                vectors.set(first + part.first, part.array)
            vector_id = part.id
        if len(parts) < 4096:
            return


def _served(overlay: Overlay, state: LiveState) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]:
    """The served base positions and rows put, in order: the new generation's passages."""
    base = np.ones(overlay.base_n, dtype=bool)
    gone = [p for p, at in overlay.base_gone.items() if at <= state.seq]
    base[gone] = False
    return np.flatnonzero(base), np.flatnonzero(overlay.alive(state))


def _build(settings: RetrieverSettings, log_folder: Path, tmp: Path, store: DocumentStore, overlay: Overlay,
           vectors: VectorRows, state: LiveState, current: Generation, *, show_progress: bool) -> dict[str, object]:
    base_rows, put_rows = _served(overlay, state)
    corpus = tmp / CORPUS_FILE
    with corpus.open("wb") as fh:
        for start in range(0, len(base_rows), CHUNK):
            for doc_id, title, text in store.documents(base_rows[start:start + CHUNK].tolist()):
                fh.write(orjson.dumps({"id": doc_id, "title": title, "text": text}) + b"\n")
        for row in put_rows.tolist():
            p = overlay.passages[row]
            fh.write(orjson.dumps({"id": p.id, "title": p.title, "text": p.text}) + b"\n")
    n = len(base_rows) + len(put_rows)
    if n == 0:
        raise CompactionRefused("every passage is deleted: nothing to build indexes of")
    build_docstore(corpus, store_folder(tmp), show_progress=show_progress)
    checksum = corpus_checksum(corpus)
    gs = generation_settings(settings, tmp)
    new_store = DiskStore(store_folder(tmp), corpus, checksum)
    indexes: list[str] = []
    try:
        if settings.bm25:
            registry.lexical(settings.bm25_backend).build(gs, new_store, show_progress=show_progress)
            indexes.append("bm25")
        if settings.dense:
            embeddings = _embeddings(settings, log_folder, tmp, store, overlay, vectors, current, base_rows,
                                     put_rows, checksum, corpus)
            registry.dense(settings.dense_backend).build(gs, embeddings, lambda: iter_chunks(embeddings), force=True,
                                                         show_progress=show_progress)
            indexes.append("dense")
    finally:
        new_store.close()
    return {"corpus_checksum": checksum, "passages": n, "indexes": indexes}


class BaseVectors:
    """The vectors of the previous generation's passages by position: its embedding chunks (a generation's own,
    or the build's `embeddings-<key>` folder for the built indexes); None where none are on disk."""

    def __init__(self, folder: Path | None) -> None:
        self.folder = folder
        self.chunk_size = 0
        if folder is not None:
            manifest = Manifest.read(folder)
            self.chunk_size = int(manifest.params.get("chunk_size", 0))
            self.count = manifest.doc_count

    def take(self, positions: npt.NDArray[np.int64]) -> npt.NDArray[np.float32] | None:
        if self.folder is None or not self.chunk_size:
            return None
        parts = []
        chunks = positions // self.chunk_size
        for number in np.unique(chunks).tolist():
            rows = positions[chunks == number] - number * self.chunk_size
            parts.append(np.asarray(np.load(chunk_path(self.folder, number), mmap_mode="r")[rows]))
        return np.concatenate(parts).astype(np.float32, copy=False)


def _base_vectors(settings: RetrieverSettings, log_folder: Path, current: Generation, count: int) -> BaseVectors:
    from plugsearch.retriever.indexing.embeddings import embeddings_key

    if current.gen:
        folder = log_folder / str(current.body["folder"]) / EMBEDDINGS
    else:
        folder = settings.index_dir / f"embeddings-{embeddings_key(str(current.body.get('corpus_checksum') or ''), settings.encoder)}"
    if (folder / "manifest.json").is_file() and Manifest.read(folder).doc_count == count:
        return BaseVectors(folder)
    return BaseVectors(None)


def _embeddings(settings: RetrieverSettings, log_folder: Path, tmp: Path, store: DocumentStore, overlay: Overlay,
                vectors: VectorRows, current: Generation, base_rows: npt.NDArray[np.int64],
                put_rows: npt.NDArray[np.int64], checksum: str, corpus: Path) -> Path:
    """The new generation's vectors as embedding chunks (`tmp/embeddings`), in its passages' order: the ones already
    made, and the ones missing encoded here."""
    built = Generation(current.gen, current.folded, {**current.body, "corpus_checksum": store.checksum})
    source = _base_vectors(settings, log_folder, built, len(store))
    encoder: Encoder | None = None
    missing = (0 if source.folder is not None else len(base_rows)) + \
        int((~vectors.has.data[put_rows]).sum() if len(put_rows) else 0)
    if missing:
        logger.warning("compaction encodes %s passages whose vectors are not on disk (%s)", f"{missing:,}",
                       "the built index's embedding chunks are gone" if source.folder is None else "put before the "
                       "dense index was there, not yet encoded by the catch-up")
    progress = ProgressLog("compaction: encoding", missing, "passages", log=logger) if missing else None

    def encode(texts: list[str]) -> npt.NDArray[np.float32]:
        nonlocal encoder
        if encoder is None:
            encoder = Encoder(settings.encoder)
        out = encoder.encode_passages(texts)
        if progress is not None:
            progress.update(len(texts))
        return out

    def blocks() -> Iterator[npt.NDArray[np.float32]]:
        for start in range(0, len(base_rows), CHUNK):
            positions = base_rows[start:start + CHUNK]
            found = source.take(positions)
            yield found if found is not None else encode([store.passage(int(p)) for p in positions])
        matrix = vectors.matrix
        for start in range(0, len(put_rows), CHUNK):
            rows = put_rows[start:start + CHUNK]
            has = vectors.has.data[rows]
            if matrix is None or not has.any():
                yield encode([overlay.passages[int(r)].indexed for r in rows])
                continue
            block = np.empty((len(rows), matrix.data.shape[1]), dtype=np.float32)
            block[has] = matrix.data[rows[has]]
            if not has.all():
                block[~has] = encode([overlay.passages[int(r)].indexed for r in rows[~has]])
            yield block

    out = tmp / EMBEDDINGS
    out.mkdir()
    dims, count = 0, 0
    for number, block in enumerate(_rechunk(blocks())):
        dims = int(block.shape[1])
        with chunk_path(out, number).open("wb") as fh:
            np.save(fh, np.ascontiguousarray(block, dtype=np.float32))
        count += len(block)
    if progress is not None:
        progress.close()
    Manifest(kind="embeddings", backend="sentence-transformers", corpus_path=str(corpus), corpus_checksum=checksum,
             doc_count=count, encoder=settings.encoder.name, encoder_config=encoder_identity(settings.encoder),
             dims=dims, params={"chunk_size": CHUNK, "chunks": -(-count // CHUNK)}).write(out)
    return out


def _rechunk(blocks: Iterator[npt.NDArray[np.float32]]) -> Iterator[npt.NDArray[np.float32]]:
    """Blocks of any size as chunks of exactly CHUNK rows (the last one shorter)."""
    pending: list[npt.NDArray[np.float32]] = []
    held = 0
    for block in blocks:
        pending.append(block)
        held += len(block)
        while held >= CHUNK:
            joined = np.concatenate(pending)
            yield joined[:CHUNK]
            rest = joined[CHUNK:]
            pending, held = ([rest] if len(rest) else []), len(rest)
    if held:
        yield np.concatenate(pending)


def _net(overlay: Overlay, state: LiveState) -> dict[str, list[Passage] | None]:
    """Each document the folded changes touched: its passages now, or None (deleted)."""
    out: dict[str, list[Passage] | None] = {}
    for doc_id in overlay.touched():
        positions = [p for p in overlay.positions_of(doc_id) if overlay.serves(state, p)]
        if not positions:
            out[doc_id] = None
            continue
        out[doc_id] = [Passage(id=i, doc_id=doc_id, title=t, text=x)
                       for i, t, x in overlay.documents(state, positions)]
    return out
