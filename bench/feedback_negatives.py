"""Do the passages users marked as not helpful help the warm start as hard negatives? Simulated marks on a
development set's TRAINING part only (its evaluation part is never read here): the shipped policy searches each
question as a user would, the returned passages that hold a gold answer (or are its gold passages) are marked
helpful, the others not helpful, and searches with nothing helpful are dropped, as `plugsearch-feedback export
--min-helpful 1` does. The learner (`plugsearch.trainer.compact.finetune.learn`, from the shipped policy, pull
chosen on its training questions) trains on n such rows with `--negative-weight` 1 (a marked passage counts as
any other passage without the answer) and W, and each warm start is judged on a dev part carved from the
training part (answer recall at 3, the user's gold answers: not the marks), paired, with 95% intervals.

    python bench/feedback_negatives.py [--set tatqa] [--sizes 25,100] [--seeds 2] [--weights 3]

Final line: {"set", "dev": n, "runs": [{"n", "seed", "rows", "marked_negatives", "recall": {weight: ..},
"difference": {weight: [mean, ci95]}}], "settings": {...}}
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import REPO, log  # noqa: E402
from bench.learning_curve import split_of  # noqa: E402

DEV = 250
"""Training-part questions held out to judge on (the rest are drawn from)."""


def simulated_marks(items: list[Any], retriever: Any, policy: Any, params: Any) -> list[Any]:
    """What a user would export after searching `items` with `policy`: per search with a helpful passage, the
    question labelled by the passages holding its answer (`passage_ids`) and the rest marked not helpful."""
    from plugsearch.common.qa import QAItem, found
    from plugsearch.searcher.loop import run_search
    from plugsearch.trainer.compact.finetune import served_params

    async def go() -> list[Any]:
        rows = []
        for q in items:
            outcome = await run_search(q.question, served_params(policy, retriever, params), policy=policy,
                                       retriever=retriever)
            helpful = [d.id for d in outcome.documents if found([d], q)]
            if helpful:
                rows.append(QAItem(id=f"marks-{q.id}", question=q.question, passage_ids=helpful, source="feedback",
                                   negative_ids=[d.id for d in outcome.documents if d.id not in helpful]))
        return rows

    return asyncio.run(go())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--set", default="tatqa")
    parser.add_argument("--sizes", default="25,100")
    parser.add_argument("--seeds", type=int, default=2)
    parser.add_argument("--weights", default="3", help="negative weights compared with 1")
    args = parser.parse_args()
    from plugsearch.searcher.compact import CompactPolicy, TextCache
    from plugsearch.searcher.trained import COMPACT_DIR
    from plugsearch.stack.corpus import index_dir_for
    from plugsearch.trainer.common.evaluation import bootstrap
    from plugsearch.trainer.common.retrieval import IndexRetriever
    from plugsearch.trainer.compact.config import CompactConfig
    from plugsearch.trainer.compact.data import labeled
    from plugsearch.trainer.compact.finetune import greedy_hits, learn

    t0 = time.perf_counter()
    corpus, _, pool = split_of(args.set)  # the evaluation part is not used
    pool = sorted(pool, key=lambda q: q.id)
    random.Random(f"{args.set}:feedback-dev").shuffle(pool)
    dev, draws = labeled(pool[:DEV]), pool[DEV:]
    corpus = corpus.resolve()
    retriever = IndexRetriever(corpus, index_dir_for(corpus, REPO / "var"), dense=True, progress=False)
    shipped = CompactPolicy.load(COMPACT_DIR)
    config = CompactConfig()
    texts = TextCache(40_000)
    weights = [1.0, *(float(w) for w in args.weights.split(","))]
    runs = []
    for n in (int(s) for s in args.sizes.split(",")):
        for seed in range(args.seeds):
            order = list(draws)
            random.Random(f"{args.set}:{seed}").shuffle(order)
            rows = simulated_marks(order[:n], retriever, shipped, config.search_params())
            cache: dict[str, Any] = {}
            hits = {}
            for w in weights:
                warm, info = learn(labeled(rows), retriever, replace_seed(config, seed), start=shipped,
                                   negative_weight=w, cache=cache)
                hits[w] = greedy_hits(warm, dev, retriever, config.search_params(), texts)
                log(f"n {n} seed {seed} weight {w:g}: pull {info['learner']['pull']}, recall "
                    f"{statistics.fmean(hits[w]):.3f}")
            runs.append({"n": n, "seed": seed, "rows": len(rows),
                         "marked_negatives": sum(len(r.negative_ids) for r in rows),
                         "recall": {f"{w:g}": round(statistics.fmean(h), 4) for w, h in hits.items()},
                         "difference": {f"{w:g}": [round(statistics.fmean(a - b for a, b in zip(hits[w], hits[1.0],
                                                                                              strict=True)), 4),
                                                   bootstrap([a - b for a, b in zip(hits[w], hits[1.0], strict=True)])]
                                        for w in weights[1:]}})
    print(json.dumps({"set": args.set, "dev": len(dev), "runs": runs, "settings": {
        "marks": "the shipped policy's 3 documents per question: helpful = holds a gold answer or is a gold passage",
        "judged": f"{DEV} questions of the training part held out (answer recall at 3 of the warm start)",
        "seconds": round(time.perf_counter() - t0, 1)}}))


def replace_seed(config: Any, seed: int) -> Any:
    from dataclasses import replace

    return replace(config, seed=seed)


if __name__ == "__main__":
    main()
