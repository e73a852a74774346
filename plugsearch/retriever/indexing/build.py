"""`plugsearch-index build`: the document store, then each requested index that is missing or stale, through
the backends' registry entries (`plugsearch.retriever.backends.registry`). The corpus is streamed (documents read
from the store), never held; a dense build encodes the corpus into resumable chunks
(`plugsearch.retriever.indexing.embeddings`), then the configured dense store builds its index from them.
"""

from __future__ import annotations

import fcntl
import functools
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from plugsearch.retriever.backends import registry
from plugsearch.retriever.encoders.encoder import encoder_identity
from plugsearch.retriever.indexing.embeddings import embed_corpus
from plugsearch.retriever.settings import RetrieverSettings
from plugsearch.retriever.store.chunks import iter_chunks
from plugsearch.retriever.store.docstore import DiskStore, corpus_checksum, ensure_docstore, store_folder
from plugsearch.retriever.store.manifest import IndexMismatch, IndexMissing, Manifest

logger = logging.getLogger("plugsearch.retriever.cli")


@contextmanager
def build_lock(index_dir: Path, what: str) -> Iterator[None]:
    """One build of `what` per index folder at a time (a second one waits, then finds it up to date)."""
    index_dir.mkdir(parents=True, exist_ok=True)
    with open(index_dir / f".{what}-build.lock", "a+b") as fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            logger.info("another process is building the %s index in %s: waiting for it", what, index_dir)
            fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _up_to_date(folder: Path, checksum: str, **expect: object) -> bool:
    try:
        manifest = Manifest.read(folder)
        manifest.check(corpus_checksum=checksum, **expect)  # type: ignore[arg-type]
    except (IndexMissing, IndexMismatch) as exc:
        logger.info("%s needs a build: %s", folder, exc)
        return False
    return True


def build(settings: RetrieverSettings, *, bm25: list[str], dense: bool, force: bool,
          chunk_size: int = 2048, show_progress: bool = True) -> list[str]:
    """Build the document store and the requested indexes (`bm25`: BM25 backends by name; `dense`: the configured
    dense store) that are missing or stale; return the folders (re)built."""
    checksum = corpus_checksum(settings.corpus, settings.index_dir)
    built: list[str] = []
    if ensure_docstore(settings.corpus, settings.index_dir, checksum, show_progress=show_progress):
        built.append(str(store_folder(settings.index_dir)))

    @functools.cache
    def load_corpus() -> DiskStore:  # documents read from the store: the corpus is never held
        return DiskStore(store_folder(settings.index_dir), settings.corpus, checksum)

    try:
        for name in bm25:
            lexical = registry.lexical(name)
            folder = lexical.folder(settings)
            stale = not force and (folder / "manifest.json").is_file() and \
                lexical.stale(settings, Manifest.read(folder)) is not None
            if force or stale or not _up_to_date(folder, checksum):
                lexical.build(settings, load_corpus(), show_progress=show_progress)
                built.append(str(folder))
            else:
                logger.info("%s is up to date", folder)
        if dense:
            store = registry.dense(settings.dense_backend)
            folder = store.folder(settings)
            with build_lock(settings.index_dir, "dense"):  # a retriever building it in the background, and this
                if force or not _up_to_date(folder, checksum, encoder=settings.encoder.name,
                                            encoder_config=encoder_identity(settings.encoder),
                                            index_type=store.index_type(settings)) \
                        or not store.matches(settings, folder):
                    embeddings = embed_corpus(load_corpus(), settings.index_dir, settings.encoder,
                                              chunk_size=chunk_size, show_progress=show_progress)
                    store.build(settings, embeddings, lambda: iter_chunks(embeddings), force=force,
                                show_progress=show_progress)
                    built.append(str(folder))
                else:
                    logger.info("%s is up to date", folder)
    finally:
        if load_corpus.cache_info().currsize:
            load_corpus().close()
    return built
