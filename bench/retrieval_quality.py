"""Answer recall@1/3/5/10 of BM25 (bm25s, pyserini), dense and hybrid over the combined corpus.

A question is a hit at k when a gold answer occurs in one of the top-k passages (title + text) under the
GenAcc span check (`plugsearch.common.answers.span_match`); yes/no questions are left out. Every question set in
../shared/data/qa that has a corpus, against ../shared/data/corpus/combined.jsonl, with the in-process library
calls the service uses. Missing indexes are built under var/indexes/combined (the MiniLM dense one takes 10-20
min on 2 cores: `RETRIEVER_DENSE=true plugsearch-index build` or `--build-dense`).

    python bench/retrieval_quality.py            # all questions; dense/hybrid need the dense index
    python bench/retrieval_quality.py --quick    # 150 questions per set, BM25 backends (+ dense if built)

The last line printed is the JSON result.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import CORPUS, load_questions, log  # noqa: E402
from bench.retriever_common import DATASETS, INDEX_DIR, dense_available, ensure_indexes  # noqa: E402

KS = (1, 3, 5, 10)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="150 questions per set (< 1 minute)")
    parser.add_argument("--limit", type=int, default=None, help="questions per set")
    parser.add_argument("--build-dense", action="store_true", help="build the dense index if missing (slow)")
    args = parser.parse_args()
    limit = args.limit or (150 if args.quick else None)

    from plugsearch.common.answers import is_yes_no, normalize_answer, span_match
    from plugsearch.retriever.backends.bm25s_index import Bm25sRetriever
    from plugsearch.retriever.backends.dense import DenseRetriever
    from plugsearch.retriever.backends.faiss_index import FaissIndex
    from plugsearch.retriever.backends.fusion import HybridRetriever
    from plugsearch.retriever.backends.pyserini_index import PyseriniRetriever
    from plugsearch.retriever.encoders.encoder import Encoder
    from plugsearch.retriever.settings import EncoderSettings, FaissSettings
    from plugsearch.retriever.store.corpus import Corpus

    t_start = time.perf_counter()
    ensure_indexes(bm25=["bm25s", "pyserini"], dense=args.build_dense)
    corpus = Corpus.load(CORPUS)
    lookup = {d: i for i, d in enumerate(corpus.ids)}
    retrievers: dict[str, object] = {
        "bm25_bm25s": Bm25sRetriever(INDEX_DIR / "bm25s", threads=2),
        "bm25_pyserini": PyseriniRetriever(INDEX_DIR / "pyserini", lookup, threads=2),
    }
    notes = []
    if dense_available():
        dense = DenseRetriever(Encoder(EncoderSettings()), FaissIndex(INDEX_DIR / "dense-flat", FaissSettings()))
        retrievers["dense"] = dense
        retrievers["hybrid"] = HybridRetriever(retrievers["bm25_bm25s"], dense)  # type: ignore[arg-type]
    else:
        notes.append(f"dense/hybrid skipped: no dense-flat index in {INDEX_DIR} (run with --build-dense)")
        log(notes[-1])

    @functools.cache
    def passage(i: int) -> str:
        return normalize_answer(f"{corpus.titles[i]} {corpus.texts[i]}")

    recall: dict[str, dict[str, dict[str, float]]] = {m: {} for m in retrievers}
    counts: dict[str, int] = {}
    for name in DATASETS:
        rows = [r for r in load_questions(name, limit) if not is_yes_no(r.golden_answers)]
        counts[name] = len(rows)
        questions = [r.question for r in rows]
        golds = [[normalize_answer(a) for a in r.golden_answers] for r in rows]
        for method, retriever in retrievers.items():
            t0 = time.perf_counter()
            hits = retriever.batch_search(questions, max(KS))  # type: ignore[attr-defined]
            first_hit = [next((r for r, d in enumerate(ids) if d >= 0 and span_match(passage(int(d)), gold)),
                              None) for ids, gold in zip(hits.ids, golds, strict=True)]
            recall[method][name] = {str(k): round(100 * sum(r is not None and r < k for r in first_hit) / len(rows), 1)
                                    for k in KS}
            log(f"{method:14s} {name:16s} n={len(rows):4d} {recall[method][name]} ({time.perf_counter() - t0:.1f} s)")
    for r in retrievers.values():
        r.close()  # type: ignore[attr-defined]
    print(json.dumps({"recall": recall, "questions": counts, "quick": bool(args.quick or args.limit),
                      "corpus": str(CORPUS), "notes": notes, "seconds": round(time.perf_counter() - t_start, 1)}))


if __name__ == "__main__":
    main()
