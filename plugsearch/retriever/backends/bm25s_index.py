"""BM25 on bm25s (its numba scorer): tokenised with English stopwords and the Snowball stemmer, the score matrix
memory-mapped; documents can change while it serves (the live overlay scores the passages put with its
statistics). Registry name `bm25s`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from plugsearch.retriever.backends.base import Hits, LexicalBackend, LexicalOverlay, LexicalStats, Retriever
from plugsearch.retriever.store.corpus import indexed_text
from plugsearch.retriever.store.docstore import DocumentStore
from plugsearch.retriever.store.manifest import Manifest, index_folder

if TYPE_CHECKING:
    from plugsearch.retriever.settings import RetrieverSettings

logger = logging.getLogger(__name__)

BM25S_DEFAULTS = {"k1": 1.5, "b": 0.75}
_STOPWORDS = "en"


def _stemmer() -> Any:
    import Stemmer

    return Stemmer.Stemmer("english")


def build_bm25s(corpus: DocumentStore, out: Path, *, k1: float | None = None, b: float | None = None,
                show_progress: bool = True) -> Manifest:
    """Tokenise (English stopwords, Snowball stemmer) and index with bm25s; atomic write. bm25s holds every
    passage and its whole token matrix while it builds (~4.3 KB per 100-word passage: 5M passages fill
    24 GB); the Lucene build streams."""
    import bm25s

    params = {"k1": k1 if k1 is not None else BM25S_DEFAULTS["k1"],
              "b": b if b is not None else BM25S_DEFAULTS["b"]}
    t0 = time.perf_counter()
    with index_folder(out) as tmp:
        texts = [indexed_text(title, text) for _, title, text in corpus.iter_documents()]
        tokens = bm25s.tokenize(texts, stopwords=_STOPWORDS, stemmer=_stemmer(), show_progress=show_progress)
        model = bm25s.BM25(k1=params["k1"], b=params["b"], backend="numba")
        model.index(tokens, show_progress=show_progress)
        model.save(str(tmp), show_progress=False)
        manifest = Manifest(kind="bm25", backend="bm25s", corpus_path=str(corpus.path),
                            corpus_checksum=corpus.checksum, doc_count=len(corpus),
                            params={**params, "stopwords": _STOPWORDS, "stemmer": "snowball-english"},
                            build_seconds=round(time.perf_counter() - t0, 3),
                            files=sorted(p.name for p in tmp.iterdir()))
        manifest.write(tmp)
    logger.info("built bm25s index %s in %.1f s", out, manifest.build_seconds)
    return manifest


def _cache_numba_scorer() -> None:
    """Compile bm25s's numba scorer with `cache=True`: the JIT compile (5 s on a quiet machine, minutes
    on a busy one) then happens once per machine instead of once per process."""
    from bm25s.numba import retrieve_utils as ru
    from numba import njit

    if getattr(ru, "_plugsearch_cached", False):
        return
    # the parallel scorer keeps the GIL: numba's workqueue threading layer must not be entered from two threads
    # at once, and the GIL serialises such calls. The service runs single-threaded calls instead (nogil).
    ru._retrieve_internal_jitted_parallel = njit(parallel=True, cache=True)(ru._retrieve_internal_jitted)
    ru._retrieve_internal_jitted_serial = njit(nogil=True, cache=True)(ru._retrieve_internal_jitted)
    ru._plugsearch_cached = True


class Bm25sRetriever(Retriever):
    """bm25s with its numba backend (compiled and warmed up at load, so the first request is fast).

    `threads=1`: the serial scorer, which releases the GIL and may be called from several threads at once
    (the service's micro-batcher does). `threads>1`: one call uses that many scorer threads.
    """

    name = "bm25s"

    def __init__(self, folder: Path, *, threads: int = 2, mmap: bool = False) -> None:
        import bm25s

        self.manifest = Manifest.read(folder)
        self.threads = threads
        _cache_numba_scorer()
        self._model = bm25s.BM25.load(str(folder), mmap=mmap, load_vocab=True, show_progress=False,
                                      override_params={"backend": "numba"})
        self._stemmer = _stemmer()
        self._n = int(self._model.scores["num_docs"])
        self.batch_search(["warm up the numba scorer"], 1)

    @property
    def doc_count(self) -> int:
        return self._n

    def batch_search(self, queries: Sequence[str], k: int) -> Hits:
        import bm25s

        n = len(queries)
        kk = min(k, self._n)
        vocab = self._model.vocab_dict
        n_terms = len(self._model.scores["indptr"]) - 1  # ids past this have no column in the index
        tokens: list[list[str]] = bm25s.tokenize(list(queries), stopwords=_STOPWORDS, stemmer=self._stemmer,
                                                 return_ids=False, show_progress=False)
        token_ids = [[vocab[t] for t in q if t in vocab and vocab[t] < n_terms] for q in tokens]
        # A query with no known term matches nothing. It must never reach bm25s: the "" token bm25s adds
        # to the vocabulary at load has no column in the score matrix, and numba reads out of bounds
        # (a segfault that takes the whole service down).
        rows = [i for i, ids in enumerate(token_ids) if ids]
        ids = np.full((n, k), -1, dtype=np.int64)  # ranks past the document count stay empty
        sc = np.zeros((n, k), dtype=np.float32)
        if rows:
            threads = self.threads if len(rows) >= 16 else 1  # a parallel launch costs more than it saves
            docs, scores = self._model.retrieve([token_ids[i] for i in rows], k=kk, show_progress=False,
                                                n_threads=threads, backend_selection="numba")
            ids[rows, :kk] = np.asarray(docs, dtype=np.int64).reshape(len(rows), kk)
            sc[rows, :kk] = np.asarray(scores, dtype=np.float32).reshape(len(rows), kk)
        ids = np.where(sc > 0, ids, -1)  # no matching term: bm25s returns arbitrary zero-score documents
        return Hits(ids, np.where(ids >= 0, sc, 0).astype(np.float32))

    def tokenize(self, texts: list[str]) -> list[list[str]]:
        """Texts as the index tokenised its passages (stopwords, stemmer): what the live overlay scores with."""
        import bm25s

        if not texts:
            return []
        tokens: list[list[str]] = bm25s.tokenize(texts, stopwords=_STOPWORDS, stemmer=self._stemmer,
                                                 return_ids=False, show_progress=False)
        return tokens

    def lexical_stats(self, store: DocumentStore, *, sample: int = 2000, seed: int = 0) -> LexicalStats:
        """The index's BM25 statistics for the live overlay (`LexicalStats`): k1, b,
        the passage count, each term's document frequency (read off the score matrix: a term's column holds one
        entry per passage that has it) and the average passage length, estimated on a seeded sample."""
        import random

        vocab, indptr = self._model.vocab_dict, np.asarray(self._model.scores["indptr"])
        n_terms = len(indptr) - 1

        def df(term: str) -> int:
            t = vocab.get(term)
            return int(indptr[t + 1] - indptr[t]) if t is not None and t < n_terms else 0

        positions = sorted(random.Random(seed).sample(range(len(store)), min(sample, len(store))))
        lengths = [len(t) for t in self.tokenize([store.passage(p) for p in positions])]
        avgdl = max(1.0, sum(lengths) / max(1, len(lengths)))
        return LexicalStats(k1=float(self._model.k1), b=float(self._model.b), n=self._n, avgdl=avgdl, df=df)

    def close(self) -> None:
        self._model = None


class Bm25s(LexicalBackend):
    """The registry entry: `RETRIEVER_BM25_BACKEND=bm25s`, index folder `<index_dir>/bm25s`."""

    name = "bm25s"
    live_changes = True

    def stale(self, settings: RetrieverSettings, manifest: Manifest) -> str | None:
        """k1 and b are fixed when the index is built: one set otherwise is a rebuild."""
        for name in ("k1", "b"):
            wanted = getattr(settings, f"bm25_{name}")
            if wanted is not None and abs(float(manifest.params.get(name, -1)) - wanted) > 1e-9:
                return (f"was built with {name}={manifest.params.get(name)}, RETRIEVER_BM25_{name.upper()}={wanted}; "
                        "rebuild the index")
        return None

    def load(self, settings: RetrieverSettings, store: DocumentStore) -> Retriever:
        # single-threaded scorer calls, several at once (search_workers): they release the GIL
        return Bm25sRetriever(self.folder(settings), threads=1, mmap=settings.bm25_mmap)

    def build(self, settings: RetrieverSettings, store: DocumentStore, *, show_progress: bool) -> Manifest:
        return build_bm25s(store, self.folder(settings), k1=settings.bm25_k1, b=settings.bm25_b,
                           show_progress=show_progress)

    def search_workers(self, settings: RetrieverSettings) -> int:
        """Several single-threaded scorer calls at once rather than one multi-threaded call: they are thread-safe
        and release the GIL, so one batch is scored while the previous one's response is written."""
        return settings.bm25_threads

    def overlay(self, retriever: Retriever) -> LexicalOverlay | None:
        if not isinstance(retriever, Bm25sRetriever):
            raise TypeError(f"a bm25s index was expected, not {type(retriever).__name__}")
        return retriever
