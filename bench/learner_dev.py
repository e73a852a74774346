"""Which few-question learner to make the default, decided on the TRAINING part of each development set only.

On each set in `<data>/domain/` (tatqa, realtimeqa, policyqa) the evaluation part of `bench/learning_curve.py`
(the trainer's seeded split, seed 0) is left out entirely: this bench never reads its questions. The training
part is cut once, by a seeded permutation, into a **judge part** (`--judge`, default 300; realtimeqa's 302
training questions give 100) and the rest, from which each run draws its n training questions (the first n of
a seeded permutation, as `bench/learning_curve.py` draws). Every learner is trained on the same draw and judged
on the same judge part by the answer recall at 3 documents of the search it would serve, against naive BM25
top-3 on the same questions (paired, with the project's bootstrap interval per draw):

- `naive`: naive BM25's order (the learner's start, one search) -- checked equal to naive BM25 top-3;
- `auto`: the naive-start learner as `plugsearch-train compact` runs it (`rerank.learn_naive`: the penalty on the
  correction chosen by 5-fold on the draw, ties to the stronger), `auto-m1` the same with a gain of one dev
  question over naive not enough to move, `auto-bag` the chosen penalty's fold fits averaged instead of refitted;
- `fixed:P`: the correction at each penalty P (not a learner: where the gain is, with hindsight);
- `shipped` (`--shipped-draws` draws, tatqa and realtimeqa): the first round's learner (the shipped policy
  fine-tuned with its pull chosen by 5-fold, `finetune.learn`), its warm start (RL left out: measured to move
  either way below 200 questions), searched as served; `auto-start` the start chosen on the same folds (the
  shipped learner where its best pull found more dev answers than the naive start's best penalty, else `auto`).

    python bench/learner_dev.py [--sets tatqa,realtimeqa,policyqa] [--sizes 25,50,100] [--draws 5]

Final line: {"sets": {set: {"judge": n, "pool_recall": ..., "naive_bm25": ..., "sizes": {n: {learner:
{"mean_minus_naive", "draws": [...], "above": k}}}}}, "settings": {...}}
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import DATA, REPO, log  # noqa: E402
from bench.learning_curve import draw, read_cache, split_of, write_cache  # noqa: E402

if TYPE_CHECKING:
    from collections.abc import Iterable

    from plugsearch.trainer.compact.rerank import LinearScorer, PenaltyChoice

SCALES = (5.0, 10.0, 20.0, 40.0)
"""Penalties c / n (n training questions) of the `sum:c` rows."""
JUDGE = {"realtimeqa": 100}
"""Judge-part sizes other than `--judge` (realtimeqa's training part has 302 questions)."""


def at(penalty: float) -> str:
    """The learner row of a fixed penalty (`naive` for none)."""
    return "naive" if math.isinf(penalty) else f"fixed:{penalty:g}"


def dev_hits(choice: PenaltyChoice, penalties: Iterable[float]) -> dict[float, float]:
    """Per penalty, the dev questions its fits answered in `choice` (a `rerank.PenaltyChoice`: recall x questions)."""
    from plugsearch.trainer.compact import rerank

    return {p: round((choice.recall or {})[rerank.penalty_text(p)] * choice.dev_questions) for p in penalties}


def bagged(scorers: list[LinearScorer]) -> LinearScorer:
    """The `rerank.LinearScorer` whose score is the mean of `scorers`' (same standardisation): bagging, still
    linear (the `auto-bag` row; tried, not the learner's rule)."""
    import numpy as np

    from plugsearch.trainer.compact.rerank import LinearScorer

    first = scorers[0]
    return LinearScorer(first.mean, first.std, np.mean([s.prior for s in scorers], axis=0),
                        np.mean([s.weights for s in scorers], axis=0))


def one_set(name: str, args: argparse.Namespace, sizes: list[int], out: Path) -> dict[str, Any]:
    """The learners on one set's training part: draws from the rest, judged on its judge part."""
    import asyncio

    import numpy as np

    from plugsearch.common.qa import found
    from plugsearch.common.stats import bootstrap_interval
    from plugsearch.searcher.compact import CompactPolicy, TextCache
    from plugsearch.searcher.trained import COMPACT_DIR
    from plugsearch.stack.corpus import index_dir_for
    from plugsearch.trainer.common.retrieval import IndexRetriever
    from plugsearch.trainer.compact import rerank
    from plugsearch.trainer.compact.config import CompactConfig
    from plugsearch.trainer.compact.data import labeled
    from plugsearch.trainer.compact.finetune import dev_parts, greedy_hits, learn

    corpus, _, pool = split_of(name)  # the evaluation part is not read below
    order = draw(pool, 0, 0, f"judge:{name}")
    n_judge = JUDGE.get(name, args.judge)
    judge, rest = labeled(order[:n_judge]), order[n_judge:]
    retriever = IndexRetriever(corpus.resolve(), index_dir_for(corpus.resolve(), REPO / "var"), dense=True,
                               progress=not args.quiet)
    cache_path = out / f"{name}-first_pools.pkl"
    cache = read_cache(cache_path)
    config = CompactConfig()
    params = config.search_params()
    judge_pools = rerank.first_pools(judge, retriever, params, cache, progress=not args.quiet)

    async def naive_hits() -> list[float]:
        docs = await retriever.retrieve([it.item.question for it in judge], 3, "bm25")
        return [float(found(d, it.item)) for d, it in zip(docs, judge, strict=True)]

    bm25 = asyncio.run(naive_hits())
    start_naive = rerank.naive_scorer(rerank.served_scorer(judge_pools))
    naive_pool_hits = [p.hit(start_naive.scores(p.pools[p.served][0]), 3) for p in judge_pools]
    agree = statistics.fmean(float(a == b) for a, b in zip(naive_pool_hits, bm25, strict=True))
    log(f"{name}: judge {len(judge)}, draw pool {len(rest)}; naive BM25 top-3 {statistics.fmean(bm25):.3f}, "
        f"the naive start {statistics.fmean(naive_pool_hits):.3f} (same hit on {agree:.3f} of the questions), "
        f"pool recall {statistics.fmean(float(p.pools[p.served][2].any()) for p in judge_pools):.3f}")

    def judged(scorer: rerank.LinearScorer) -> list[float]:
        s = rerank.served_scorer(judge_pools)
        return [p.hit(scorer.scores(p.pools[s][0]), 3, s) for p in judge_pools]

    def row(hits: list[float]) -> dict[str, Any]:
        diff = [a - b for a, b in zip(hits, bm25, strict=True)]
        return {"recall": round(statistics.fmean(hits), 4), "minus_naive": round(statistics.fmean(diff), 4),
                "ci95": bootstrap_interval(diff)}

    per_size: dict[str, Any] = {}
    for n in sizes:
        results: dict[str, list[dict[str, Any]]] = {}
        for d in range(args.draws):
            train = labeled(draw(rest, n, d, name))
            config = CompactConfig(seed=d)
            pools = rerank.first_pools(train, retriever, params, cache, progress=False)
            scorer = rerank.served_scorer(pools)
            norms = rerank.norms_of_pools(pools, scorer)
            assert norms is not None
            found_runs: dict[str, list[float]] = {"naive": judged(rerank.naive_scorer(scorer, norms))}
            for penalty in rerank.PENALTIES[1:]:
                found_runs[at(penalty)] = judged(rerank.fit_linear(pools, scorer, penalty, norms))
            choice = rerank.choose_penalty(train, pools, config)
            found_runs["auto"] = found_runs[at(choice.penalty)]
            m1 = rerank.select(dev_hits(choice, rerank.PENALTIES), margin=1)
            found_runs["auto-m1"] = found_runs[at(m1)]
            # other rules on the same folds and fits: the CV without naive among the candidates; a penalty that
            # weakens as questions grow (c / n: the loss summed over questions instead of averaged); the CV among
            # those; the CV repeated over three fold draws
            finite = [p for p in rerank.PENALTIES if not math.isinf(p)]
            no_keep = rerank.select(dev_hits(choice, finite))
            found_runs["cv-nokeep"] = found_runs[at(no_keep)]
            scaled = [c / n for c in SCALES]
            for c, penalty in zip(SCALES, scaled, strict=True):
                found_runs[f"sum:{c:g}"] = judged(rerank.fit_linear(pools, scorer, penalty, norms))
            by_sum = rerank.choose_penalty(train, pools, config, penalties=[rerank.NAIVE, *scaled])
            found_runs["cv-sum"] = found_runs["naive" if math.isinf(by_sum.penalty) else
                                              f"sum:{by_sum.penalty * n:g}"]
            repeated: dict[float, float] = dict.fromkeys(rerank.PENALTIES, 0.0)
            for again in (config.seed, config.seed + 100, config.seed + 200):
                rep = rerank.choose_penalty(train, pools, CompactConfig(seed=again))
                for p, answered in dev_hits(rep, rerank.PENALTIES).items():
                    repeated[p] += answered
            found_runs["cv-rep3"] = found_runs[at(rerank.select(repeated))]
            if name == "policyqa":  # its rows name supporting titles: the warm start's labels as the target
                pos = rerank.choose_penalty(train, pools, config, target="positive")
                found_runs["auto-positive"] = judged(rerank.fit_linear(pools, scorer, pos.penalty, norms,
                                                                       target="positive"))
            by_id = {it.item.id: p for it, p in zip(train, pools, strict=True)}
            folds = [rerank.fit_linear([by_id[it.item.id] for it in train if it.item.id not in
                                        {x.item.id for x in part}], scorer, choice.penalty, norms)
                     for part in dev_parts(train, config.seed)]
            found_runs["auto-bag"] = judged(bagged(folds)) if folds else found_runs["naive"]
            if d < args.shipped_draws and name in args.shipped_sets.split(","):
                warm, info = learn(train, retriever, config, start=CompactPolicy.load(COMPACT_DIR))
                found_runs["shipped"] = greedy_hits(warm, judge, retriever, params, TextCache(40_000))
                # the start chosen on the same folds: the shipped learner where its best pull found more
                shipped_best = max(info["learner"]["dev_recall"].values())
                naive_best = max((choice.recall or {}).values())
                found_runs["auto-start"] = found_runs["shipped"] if shipped_best > naive_best else found_runs["auto"]
            for key, hits in found_runs.items():
                results.setdefault(key, []).append({"draw": d, **row(hits)} | (
                    {"penalty": rerank.penalty_text(choice.penalty)} if key == "auto" else {}))
            log(f"{name} n={n} draw {d}: chose {rerank.penalty_text(choice.penalty)} "
                f"(m1 {rerank.penalty_text(m1)}); "
                + ", ".join(f"{k} {statistics.fmean(h) - statistics.fmean(bm25):+.3f}"
                            for k, h in found_runs.items()))
            write_cache(cache_path, cache)
        per_size[str(n)] = {k: {"mean_minus_naive": round(statistics.fmean(r["minus_naive"] for r in v), 4),
                                "worst": min(r["minus_naive"] for r in v),
                                "above": sum(1 for r in v if r["ci95"][0] > 0),
                                "below": sum(1 for r in v if r["ci95"][1] < 0), "draws": v}
                            for k, v in results.items()}
    return {
        "judge": len(judge), "draw_pool": len(rest), "naive_bm25": round(statistics.fmean(bm25), 4),
        "naive_start_same_hit": round(agree, 4),
        "pool_recall": round(float(np.mean([p.pools[p.served][2].any() for p in judge_pools])), 4),
        "sizes": per_size}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sets", default="tatqa,realtimeqa,policyqa")
    parser.add_argument("--sizes", default="25,50,100")
    parser.add_argument("--draws", type=int, default=5)
    parser.add_argument("--judge", type=int, default=300)
    parser.add_argument("--shipped-draws", type=int, default=2, help="draws of the shipped-start learner (slow: "
                        "every fold's fit is judged by full searches); 0: none")
    parser.add_argument("--shipped-sets", default="tatqa,realtimeqa")
    parser.add_argument("--out", default=str(REPO / "var" / "bench" / "learner_dev"))
    parser.add_argument("--quiet", action="store_true")
    args = parser.parse_args()

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    sizes = [int(s) for s in args.sizes.split(",")]
    t0 = time.perf_counter()
    figures: dict[str, Any] = {"sets": {name: one_set(name, args, sizes, out) for name in args.sets.split(",")}}
    figures["settings"] = {"judge": "a seeded part of each set's TRAINING part; the evaluation part is never read",
                           "draws": args.draws, "sizes": sizes, "data": str(DATA.name),
                           "seconds": round(time.perf_counter() - t0, 1),
                           "command": "python bench/learner_dev.py " + " ".join(sys.argv[1:])}
    (out / "figures.json").write_text(json.dumps(figures, indent=1) + "\n")
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
