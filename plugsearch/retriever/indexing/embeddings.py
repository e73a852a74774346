"""Building a dense index, its first half: the corpus encoded into on-disk chunks (`plugsearch.retriever.store.chunks`),
from which the configured dense store then builds its index (FAISS: `backends/faiss_index.py`; Milvus:
`backends/milvus_index.py`).

Builds stream: each chunk of passage vectors goes to disk once encoded (`embeddings-<key>.partial/`), so
the full matrix is never in RAM and an interrupted build resumes from the last chunk; the stores read the chunks
back one at a time.
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
from pathlib import Path

import numpy as np
import numpy.typing as npt

from plugsearch.common.files import atomic_write_json, atomic_writer, fsync_folder
from plugsearch.common.progress import ProgressLog
from plugsearch.retriever.encoders.encoder import Encoder, encoder_identity
from plugsearch.retriever.settings import EncoderSettings
from plugsearch.retriever.store.chunks import chunk_path
from plugsearch.retriever.store.docstore import DocumentStore
from plugsearch.retriever.store.manifest import Manifest

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
    atomic_write_json(meta_path, {"chunk_size": chunk_size, "doc_count": len(corpus)})
    n_chunks = math.ceil(len(corpus) / chunk_size)
    finished = {i for i in range(n_chunks) if chunk_path(work, i).is_file()}
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
        with atomic_writer(chunk_path(work, i)) as fh:
            np.save(fh, vectors)
    bar.close()
    if progress is not None:
        progress.close()
    dims = int(np.load(chunk_path(work, 0), mmap_mode="r").shape[1])
    Manifest(kind="embeddings", backend="sentence-transformers", corpus_path=str(corpus.path),
             corpus_checksum=corpus.checksum, doc_count=len(corpus), encoder=settings.name,
             encoder_config=encoder_identity(settings), dims=dims,
             params={"chunk_size": chunk_size, "chunks": n_chunks},
             build_seconds=round(time.perf_counter() - t0, 3)).write(work)
    if done.exists():
        shutil.rmtree(done)
    os.replace(work, done)
    fsync_folder(index_dir)
    return done
