"""How many real questions a user needs: the compact searcher trained on n of a development set's labelled
questions, judged on the set's held-back evaluation part against naive BM25, dense and hybrid top-3 and the
shipped policy.

On each set in `<data>/domain/` (tatqa, realtimeqa, policyqa; see that folder's README for their caveats):
- the evaluation part is FIXED: the trainer's seeded split of the set's questions (`split_items`, seed 0, 20% at
  most 500: what `plugsearch-train compact --qa` evaluates on and `bench/domain_quality.py` reports), yes/no
  questions left out; it is never trained or tuned on;
- the training questions are the rest; a run trains on the first n of a seeded permutation of them (seed s:
  the draws are nested, 25 of seed s are in its 50), for n in 25, 50, 100, 200, 400 and all, with `--seeds` seeds
  up to 100 questions and one above;
- each (n, seed) trains a learner of `plugsearch-train compact` on a user's questions (`--variants`): `naive`
  (the default, `--start naive`: naive BM25's order plus a linear correction whose penalty is chosen on the
  training questions alone, one search, no RL, `plugsearch.trainer.compact.rerank`), `shipped` (the first
  round's: the shipped policy fine-tuned with a pull back toward it, `plugsearch.trainer.compact.finetune`, then
  RL with the steps scaled to n) or `scratch` (random weights then RL, at 100 and all), with and without `--mix`
  shipped Wikipedia training questions (`--shipped`);
- answer recall at 3 documents of the warm start and of the final policy (+ RL) on the evaluation part, the
  paired difference with naive BM25 top-3 with its 95% bootstrap interval (the project's one bootstrap,
  `plugsearch.common.stats.bootstrap_interval`), and the smallest n at which every seed's final policy is above naive
  BM25 with the interval above 0.

In-process over the stack's indexes (`var/indexes/<corpus>-<sha256>`, built when missing). Resumable: every
finished run is a line of `<out>/runs.jsonl`, the demonstrations and first pools are kept per set and an RL run continues from
its saved state; a rerun of the same command does only what is missing. Writes the figures (`--figures`, default
docs/learning_curve.json) and the plot (`--plot`, docs/learning_curve.png).

    python bench/learning_curve.py [--sets tatqa,realtimeqa,policyqa] [--seeds 3] [--mix 200] [--variants naive]
    python bench/learning_curve.py --sets tatqa --sizes 25,50 --seeds 1 --mix 0   # a short run

Final line: {"sets": {set: {"n_eval", "n_train_pool", "baselines": {...}, "runs": [...], "smallest_n": {...},
"per_size": {learner: [{"n", "draws", "mean_recall", "mean_minus_bm25", "above_naive", "at_naive"}]}}},
"settings": {...}}
"""

from __future__ import annotations

import argparse
import asyncio
import json
import pickle
import random
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import DATA, REPO, log  # noqa: E402

SETS = ("tatqa", "realtimeqa", "policyqa")
SIZES = (25, 50, 100, 200, 400, 0)
"""Training questions per run (0: all of the training part)."""
SCRATCH_SIZES = (100, 0)
"""Where the learner from scratch is run beside the default one."""
BASELINES = ("naive_bm25", "naive_dense", "naive_hybrid", "shipped")
START_ORDER = ("naive", "shipped", "scratch")
"""The learners (`--start`): the default first."""
STAGES = ("warm", "final")
"""The warm start (the learner's fit) and the served policy (+ RL)."""


def split_of(name: str) -> tuple[Path, list[Any], list[Any]]:
    """The set's corpus, its evaluation part (the trainer's seeded split, as `bench/domain_quality.py`) and the
    training pool (every other question, in the split's seeded order)."""
    from plugsearch.common.answers import is_yes_no
    from plugsearch.common.qa import read_qa_file, split_items, split_sizes

    corpus = DATA / "domain" / f"{name}_corpus.jsonl"
    items = [q for q in read_qa_file(DATA / "domain" / f"{name}_qa.jsonl") if not is_yes_no(q.golden_answers)]
    n_eval, n_dev = split_sizes(len(items))
    split = split_items(items, seed=0, n_eval=n_eval, n_dev=n_dev)
    return corpus, list(split.eval), [*split.train, *split.dev]


def draw(pool: Sequence[Any], n: int, seed: int, name: str) -> list[Any]:
    """The first `n` (0: all) of the training pool in the order of `seed` (nested: a smaller draw of a seed is a
    prefix of a larger one)."""
    order = sorted(pool, key=lambda q: q.id)
    random.Random(f"{name}:{seed}").shuffle(order)
    return order if n == 0 else order[:n]


def plan(sizes: Sequence[int], pool: int, seeds: int, variants: Sequence[str], mix: int, *, mix_seeds: int = 1,
         all_up_to: int = 2000) -> list[dict[str, Any]]:
    """The runs of one set, smallest first: (n, seed, start, mix) for every size up to the pool (0: all, where
    the pool has at most `all_up_to` questions), `seeds` seeds up to 100 questions (`mix_seeds` with the shipped
    mix); scratch at `SCRATCH_SIZES`."""
    runs = []
    for n in sizes:
        if (n and n >= pool) or (not n and pool > all_up_to):
            continue
        for seed in range(seeds if n and n <= 100 else 1):
            for start in variants:
                if start == "scratch" and n not in SCRATCH_SIZES:
                    continue
                for shipped in ((0, mix) if mix else (0,)):
                    if shipped and seed >= mix_seeds:
                        continue
                    runs.append({"n": n, "seed": seed, "start": start, "mix": shipped})
    return sorted(runs, key=lambda r: (r["n"] or 10**9, START_ORDER.index(r["start"]), r["mix"], r["seed"]))


def read_cache(path: Path) -> dict[str, Any]:
    """A cache this bench keeps between runs (demonstrations, first pools: id -> value); empty when none yet."""
    return pickle.loads(path.read_bytes()) if path.is_file() else {}


def write_cache(path: Path, cache: dict[str, Any]) -> None:
    """`cache` into `path`, whole or not at all (a run stopped mid-write keeps the previous file)."""
    from plugsearch.common.files import atomic_write_bytes

    atomic_write_bytes(path, pickle.dumps(cache), durable=False)


def run_key(name: str, run: dict[str, Any]) -> str:
    return f"{name}/n{run['n'] or 'all'}/s{run['seed']}/{run['start']}/mix{run['mix']}"


def paired(hits: Sequence[float], reference: Sequence[float]) -> dict[str, Any]:
    """Mean answer recall, the paired difference with the reference and its 95% bootstrap interval."""
    from plugsearch.common.stats import bootstrap_interval

    diff = [a - b for a, b in zip(hits, reference, strict=True)]
    return {"recall": round(statistics.fmean(hits), 4), "minus_bm25": round(statistics.fmean(diff), 4),
            "minus_bm25_ci95": bootstrap_interval(diff)}


def smallest_n(rows: Sequence[dict[str, Any]], *, start: str, mix: int, stage: str = "final") -> int | None:
    """The smallest n at which every seed's policy (`start`, `mix`, `stage`) is above naive BM25 with the paired
    interval above 0 (None: at no n measured)."""
    by_n: dict[int, list[dict[str, Any]]] = {}
    for r in rows:
        if r["start"] == start and r["mix"] == mix:
            by_n.setdefault(r["n_train"], []).append(r)
    for n in sorted(by_n):
        if all(r[stage]["minus_bm25_ci95"][0] > 0 for r in by_n[n]):
            return n
    return None


class SetRunner:
    """One development set: its retriever, evaluation part, baselines and demonstrations (kept across runs)."""

    def __init__(self, name: str, out: Path, args: argparse.Namespace) -> None:
        from plugsearch.searcher.compact import TextCache
        from plugsearch.stack.corpus import index_dir_for
        from plugsearch.trainer.common.retrieval import IndexRetriever
        from plugsearch.trainer.compact.data import labeled

        self.name, self.out, self.args = name, out / name, args
        self.out.mkdir(parents=True, exist_ok=True)
        corpus, evaluation, self.pool = split_of(name)
        self.corpus = corpus.resolve()
        self.eval = labeled(evaluation)
        self.retriever = IndexRetriever(self.corpus, index_dir_for(self.corpus, REPO / "var"), dense=True,
                                        progress=not args.quiet)
        self.texts = TextCache(40_000)
        self.demo_path = self.out / "demonstrations.pkl"
        self.demos = read_cache(self.demo_path)
        self._demos_saved = len(self.demos)
        self.pools_path = self.out / "first_pools.pkl"
        self.pools = read_cache(self.pools_path)
        self._pools_saved = len(self.pools)

    def save_demos(self) -> None:
        """The demonstrations and first pools collected so far, each file rewritten only when it grew."""
        if len(self.demos) != self._demos_saved:
            write_cache(self.demo_path, self.demos)
            self._demos_saved = len(self.demos)
        if len(self.pools) != self._pools_saved:
            write_cache(self.pools_path, self.pools)
            self._pools_saved = len(self.pools)

    def baselines(self) -> dict[str, list[float]]:
        """Per evaluation question: naive BM25 / dense / hybrid top-3 and the shipped policy found it (cached)."""
        from plugsearch.common.qa import found
        from plugsearch.searcher.compact import CompactPolicy
        from plugsearch.searcher.trained import COMPACT_DIR
        from plugsearch.trainer.compact.config import CompactConfig
        from plugsearch.trainer.compact.finetune import greedy_hits

        path = self.out / "baselines.json"
        if path.is_file():
            cached = json.loads(path.read_text())
            if cached.get("ids") == [it.item.id for it in self.eval]:
                return dict(cached["hits"])

        async def naive(method: str) -> list[float]:
            docs = await self.retriever.retrieve([it.item.question for it in self.eval], 3, method)
            return [float(found(d, it.item)) for d, it in zip(docs, self.eval, strict=True)]

        hits = {f"naive_{m}": asyncio.run(naive(m)) for m in ("bm25", "dense", "hybrid")}
        shipped = CompactPolicy.load(COMPACT_DIR)
        hits["shipped"] = greedy_hits(shipped, self.eval, self.retriever, CompactConfig().search_params(), self.texts)
        path.write_text(json.dumps({"ids": [it.item.id for it in self.eval], "hits": hits}) + "\n")
        return hits

    def train_and_judge(self, run: dict[str, Any], shipped_items: list[Any], shipped_demos: dict[str, Any],
                        shipped_pools: dict[str, Any]) -> dict[str, Any]:
        """One run: the learner on the drawn questions (and the shipped mix), RL, both judged on the evaluation
        part (answer recall at 3, per question)."""
        from plugsearch.searcher.compact import CompactPolicy
        from plugsearch.searcher.trained import COMPACT_DIR
        from plugsearch.trainer.common.rewards import RewardComputer
        from plugsearch.trainer.compact.config import CompactConfig
        from plugsearch.trainer.compact.data import labeled, source_counts
        from plugsearch.trainer.compact.finetune import (
            cached_demonstrations,
            greedy_hits,
            learn,
            with_setting,
        )
        from plugsearch.trainer.compact.rl import reinforce
        from plugsearch.trainer.compact.run import rl_steps_for

        t0 = time.perf_counter()
        folder = self.out / run_key(self.name, run).split("/", 1)[1].replace("/", "-")
        folder.mkdir(parents=True, exist_ok=True)
        train = labeled(draw(self.pool, run["n"], run["seed"], self.name))
        config = CompactConfig(seed=run["seed"])
        params = config.search_params()
        mixed = shipped_items[:run["mix"]]
        if run["start"] == "naive":  # the naive-start learner: first pools, a penalty chosen on folds, no RL
            from plugsearch.trainer.compact.rerank import learn_naive

            everything = train + mixed
            cache = {**self.pools, **shipped_pools}
            warm, info = learn_naive(everything, self.retriever, config, cache=cache, progress=not self.args.quiet)
            mixed_ids = {it.item.id for it in mixed}
            for key, pool in cache.items():  # the mix's first pools are kept once for every set
                (shipped_pools if key in mixed_ids else self.pools).setdefault(key, pool)
            self.save_demos()
            t_warm = time.perf_counter() - t0
            hits = {"warm": greedy_hits(warm, self.eval, self.retriever, params, self.texts)}
            hits["final"] = hits["warm"]
            return {"set": self.name, **run, "n_train": len(train), "trained_on": source_counts(everything),
                    "learner": info["learner"], "rl_steps": 0, "hits": hits,
                    "correction": info.get("largest_weights"), "pool_recall": info.get("pool_recall"),
                    "seconds": {"warm_start": round(t_warm, 1), "rl": 0.0,
                                "evaluation": round(time.perf_counter() - t0 - t_warm, 1)}}
        cached_demonstrations(train, self.retriever, params, self.demos, progress=not self.args.quiet)
        self.save_demos()
        cache = {**self.demos, **shipped_demos}
        start = CompactPolicy.load(COMPACT_DIR) if run["start"] == "shipped" else None
        everything = train + mixed
        warm_dir = folder / "warmstart"
        if (warm_dir / "manifest.json").is_file():
            warm = CompactPolicy.load(warm_dir)
            info = warm.manifest["warm_start"]
        else:
            warm, info = learn(everything, self.retriever, config, start=start, cache=cache)
            warm.save(warm_dir, {"warm_start": info, "search": config.search_setting(),
                                 "dense": {"encoder": self.retriever.encoder}})
        t_warm = time.perf_counter() - t0
        learner = info.get("learner", {})
        steps = rl_steps_for(len(everything), config)
        if start is not None and learner.get("pull") == "keep":
            final, steps = warm, 0
        else:
            pull = float(learner["pull"]) if start is not None else 0.0
            (folder / "rl").mkdir(exist_ok=True)
            final, _ = reinforce(warm, everything, self.retriever, replace(config, rl_steps=steps), folder / "rl",
                                 lambda: RewardComputer(None, kind="recall", baseline=config.baseline, method="bm25",
                                                        retriever=self.retriever),
                                 progress=not self.args.quiet, anchor=warm if start is not None else None,
                                 pull=pull)
        final = with_setting(final, config, self.retriever)
        t_rl = time.perf_counter() - t0 - t_warm
        hits = {"warm": greedy_hits(warm, self.eval, self.retriever, params, self.texts),
                "final": greedy_hits(final, self.eval, self.retriever, params, self.texts)}
        return {"set": self.name, **run, "n_train": len(train), "trained_on": source_counts(everything),
                "learner": learner, "rl_steps": steps, "hits": hits,
                "seconds": {"warm_start": round(t_warm, 1), "rl": round(t_rl, 1),
                            "evaluation": round(time.perf_counter() - t0 - t_warm - t_rl, 1)}}


def shipped_mix(n: int, progress: bool) -> list[Any]:
    """`n` shipped Wikipedia training questions as `plugsearch-train compact --shipped n` draws them (split seed 0),
    each with the shared corpus's retriever."""
    from plugsearch.trainer.compact.config import CompactConfig
    from plugsearch.trainer.compact.run import CompactRun, shipped_items

    job = CompactRun(config=CompactConfig(), out=Path(), command="", shipped=n, var_dir=REPO / "var", progress=progress)
    return shipped_items(DATA, job)


def summarise(name: str, rows: Sequence[dict[str, Any]], base: dict[str, list[float]], pool: int
              ) -> dict[str, Any]:
    """A set's figures: the baselines, every run's (per stage: recall, minus naive BM25 with its interval), the
    smallest n per learner and mix."""
    bm25 = base["naive_bm25"]
    baselines = {k: paired(v, bm25) for k, v in base.items()}
    runs = []
    for r in sorted(rows, key=lambda r: (r["start"], r["mix"], r["n_train"], r["seed"])):
        runs.append({k: r[k] for k in ("n", "n_train", "seed", "start", "mix", "trained_on", "rl_steps", "seconds")}
                    | {"pull": r["learner"].get("pull"), "pull_how": r["learner"].get("how"),
                       "dev_recall": r["learner"].get("dev_recall")}
                    | ({"correction": r["correction"]} if r.get("correction") is not None else {})
                    | {stage: paired(r["hits"][stage], bm25) for stage in STAGES})
    variants = sorted({(r["start"], r["mix"]) for r in runs})
    smallest = {f"{start}{'+mix' if mix else ''}": {stage: smallest_n(runs, start=start, mix=mix, stage=stage)
                                                    for stage in STAGES} for start, mix in variants}
    return {"n_eval": len(bm25), "n_train_pool": pool, "baselines": baselines, "runs": runs, "smallest_n": smallest,
            "per_size": per_size(runs)}


def per_size(runs: Sequence[dict[str, Any]], stage: str = "final") -> dict[str, list[dict[str, Any]]]:
    """Per learner (and mix) and n: the draws, the mean over them of the policy's recall and of its difference
    with naive BM25, and how many draws are above naive BM25 with the paired interval above 0."""
    out: dict[str, list[dict[str, Any]]] = {}
    for start, mix in sorted({(r["start"], r["mix"]) for r in runs}):
        rows = [r for r in runs if r["start"] == start and r["mix"] == mix]
        out[f"{start}{'+mix' if mix else ''}"] = [
            {"n": n, "draws": len(these), "mean_recall": round(statistics.fmean(r[stage]["recall"] for r in these), 4),
             "mean_minus_bm25": round(statistics.fmean(r[stage]["minus_bm25"] for r in these), 4),
             "above_naive": sum(1 for r in these if r[stage]["minus_bm25_ci95"][0] > 0),
             "at_naive": sum(1 for r in these if r.get("pull") == "keep" and start == "naive")}
            for n in sorted({r["n_train"] for r in rows}) for these in [[r for r in rows if r["n_train"] == n]]]
    return out


def plot(figures: dict[str, Any], path: Path, compare: dict[str, Any] | None = None) -> Path | None:
    """Answer recall at 3 against the number of training questions, one panel per set: the learner from the
    shipped policy with and without the mix (final and warm start; the mean over seeds), scratch, and the
    baselines as lines."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log("matplotlib is not installed: no plot")
        return None
    sets = list(figures["sets"])
    fig, axes = plt.subplots(1, len(sets), figsize=(5.2 * len(sets), 5.0), squeeze=False)
    styles = {("naive", False): ("C5", "D", "from naive BM25"), ("naive", True): ("C6", "P", "from naive BM25 + mix"),
              ("shipped", False): ("C0", "o", "from shipped"), ("shipped", True): ("C1", "s", "from shipped + Wikipedia mix"),
              ("scratch", False): ("C2", "^", "from scratch"), ("scratch", True): ("C4", "v", "from scratch + mix")}
    lines = {"naive_bm25": ("k", "-", "naive BM25 top-3"), "naive_dense": ("0.5", ":", "naive dense top-3"),
             "naive_hybrid": ("0.3", "--", "naive hybrid top-3"), "shipped": ("C3", "-.", "shipped policy")}
    for ax, name in zip(axes[0], sets, strict=True):
        data = figures["sets"][name]
        for key, (color, style, label) in lines.items():
            ax.axhline(data["baselines"][key]["recall"], color=color, linestyle=style, linewidth=1, label=label)
        for (start, mixed), (color, marker, label) in styles.items():
            runs = [r for r in data["runs"] if r["start"] == start and bool(r["mix"]) == mixed]
            if not runs:
                continue
            ns = sorted({r["n_train"] for r in runs})
            mean = [statistics.fmean(r["final"]["recall"] for r in runs if r["n_train"] == n) for n in ns]
            low = [statistics.fmean(r["final"]["recall"] - r["final"]["minus_bm25"] + r["final"]["minus_bm25_ci95"][0]
                                    for r in runs if r["n_train"] == n) for n in ns]
            high = [statistics.fmean(r["final"]["recall"] - r["final"]["minus_bm25"] + r["final"]["minus_bm25_ci95"][1]
                                     for r in runs if r["n_train"] == n) for n in ns]
            ax.errorbar(ns, mean, yerr=[[m - lo for m, lo in zip(mean, low, strict=True)],
                                        [hi - m for m, hi in zip(mean, high, strict=True)]],
                        color=color, marker=marker, capsize=3, linewidth=1.5,
                        label=label + ("" if start == "naive" else " (+ RL)"))
            if start == "naive":  # no RL: the warm start is the policy
                continue
            warm = [statistics.fmean(r["warm"]["recall"] for r in runs if r["n_train"] == n) for n in ns]
            ax.plot(ns, warm, color=color, marker=marker, linestyle=":", alpha=0.5, markersize=4,
                    label=label + ", warm start")
        earlier = (compare or {}).get("sets", {}).get(name)
        if earlier:  # an earlier round's default learner (from shipped, no mix): the mean over its draws
            runs = [r for r in earlier["runs"] if r["start"] == "shipped" and not r["mix"]]
            ns = sorted({r["n_train"] for r in runs})
            ax.plot(ns, [statistics.fmean(r["final"]["recall"] for r in runs if r["n_train"] == n) for n in ns],
                    color="0.4", marker="o", linestyle="--", linewidth=1, markersize=4,
                    label="first round: from shipped (+ RL)")
        ax.set_xscale("log")
        sizes = sorted({r["n_train"] for r in data["runs"]})
        ax.set_xticks(sizes, [str(n) for n in sizes], fontsize=8)
        ax.minorticks_off()
        ax.set_title(f"{name} ({data['n_eval']} held-back questions)")
        ax.set_xlabel("training questions (real, labelled)")
        ax.set_ylabel("answer recall at 3 documents")
        ax.grid(alpha=0.3)
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=5, fontsize=7.5, frameon=False)
    fig.suptitle("The compact searcher trained on n real questions of a set, judged on its held-back part (the mean "
                 "over draws; bars: the paired 95% interval against naive BM25, carried onto the policy)", fontsize=9)
    fig.tight_layout(rect=(0, 0.13, 1, 1))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sets", default=",".join(SETS))
    parser.add_argument("--sizes", default=",".join(str(n) if n else "all" for n in SIZES),
                        help="training questions per run (all: the whole training part)")
    parser.add_argument("--seeds", type=int, default=3, help="draws per size up to 100 questions (one above)")
    parser.add_argument("--variants", default="naive", help="learners (--start): naive (the default learner: naive "
                        "BM25's order plus a linear correction), shipped (the first round's default: the shipped policy "
                        "fine-tuned, then RL) and scratch (at 100 and all)")
    parser.add_argument("--mix", type=int, default=200, help="shipped Wikipedia training questions mixed in (each run "
                        "also without them; 0: never)")
    parser.add_argument("--mix-seeds", type=int, default=3, help="draws per size up to 100 questions with the mix")
    parser.add_argument("--all-up-to", type=int, default=2000, help="run `all` only on sets whose training part has at "
                        "most this many questions (policyqa's 7,271 would take hours here)")
    parser.add_argument("--out", default=str(REPO / "var" / "bench" / "learning_curve"))
    parser.add_argument("--figures", default=str(REPO / "docs" / "learning_curve.json"))
    parser.add_argument("--plot", default=str(REPO / "docs" / "learning_curve.png"))
    parser.add_argument("--compare", default=str(REPO / "docs" / "learning_curve_round1.json"), help="an earlier "
                        "round's figures whose default learner (from shipped) the plot shows beside ('': none)")
    parser.add_argument("--quiet", action="store_true")
    args = parser.parse_args()
    from plugsearch.common.qa import append_durable, read_jsonl
    from plugsearch.trainer.compact.config import CompactConfig
    from plugsearch.trainer.compact.finetune import cached_demonstrations

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    log_path = out / "runs.jsonl"
    done = {run_key(r["set"], r): r for r in read_jsonl(log_path, json.loads)[0]}
    sizes = [0 if s == "all" else int(s) for s in args.sizes.split(",")]
    variants = args.variants.split(",")
    t0 = time.perf_counter()
    shipped_items: list[Any] = []
    shipped_demos: dict[str, Any] = {}
    pools_path = out / "shipped_first_pools.pkl"
    shipped_pools = read_cache(pools_path)
    if args.mix:
        shipped_items = shipped_mix(args.mix, not args.quiet)
    if args.mix and set(variants) - {"naive"}:  # the learners with demonstrations (the naive one reads first pools)
        demo_path = out / "shipped_demonstrations.pkl"
        shipped_demos = read_cache(demo_path)
        if len(shipped_demos) < len(shipped_items):
            cached_demonstrations(shipped_items, shipped_items[0].retriever, CompactConfig().search_params(),
                                  shipped_demos, progress=not args.quiet)
            write_cache(demo_path, shipped_demos)
    runners = {name: SetRunner(name, out, args) for name in args.sets.split(",")}
    todo = [(name, run) for name, runner in runners.items()
            for run in plan(sizes, len(runner.pool), args.seeds, variants, args.mix, mix_seeds=args.mix_seeds,
                            all_up_to=args.all_up_to)]
    todo.sort(key=lambda nr: (nr[1]["n"] or 10**9, START_ORDER.index(nr[1]["start"]), nr[1]["mix"], nr[1]["seed"],
                              SETS.index(nr[0]) if nr[0] in SETS else 9))
    bases = {name: runner.baselines() for name, runner in runners.items()}
    for name, base in bases.items():
        log(f"{name}: {len(base['naive_bm25'])} evaluation questions, training pool {len(runners[name].pool)}; "
            + ", ".join(f"{k} {statistics.fmean(v):.3f}" for k, v in base.items()))
    for i, (name, run) in enumerate(todo, start=1):
        key = run_key(name, run)
        if key in done:
            continue
        log(f"[{i}/{len(todo)}] {key} ...")
        known = len(shipped_pools)
        row = runners[name].train_and_judge(run, shipped_items, shipped_demos, shipped_pools)
        if len(shipped_pools) != known:
            write_cache(pools_path, shipped_pools)
        append_durable(log_path, json.dumps(row) + "\n")
        done[key] = row
        bm25 = bases[name]["naive_bm25"]
        log(f"[{i}/{len(todo)}] {key}: pull {row['learner'].get('pull')}, "
            + ", ".join(f"{s} {paired(row['hits'][s], bm25)}" for s in STAGES) + f", {row['seconds']}")
    figures: dict[str, Any] = {"sets": {}}
    for name, runner in runners.items():
        rows = [r for r in done.values() if r["set"] == name]
        figures["sets"][name] = summarise(name, rows, bases[name], len(runner.pool))
    figures["settings"] = {
        "evaluation": "the trainer's seeded split (seed 0, 20% at most 500), never trained or tuned on",
        "draws": "first n of a seeded permutation of the training part (nested), seeds 0.. up to 100 questions",
        "learner": {"naive": "plugsearch.trainer.compact.rerank.learn_naive (naive BM25's order plus a linear "
                             "correction, penalty 5 / n; no RL): plugsearch-train compact --qa ... --eval-qa ...'s default",
                    "shipped": "plugsearch.trainer.compact.finetune.learn (start shipped, pull auto) then RL (steps "
                               "scaled: rl_steps_for): --start shipped",
                    "scratch": "random weights then RL: --start scratch"},
        "variants": variants,
        "mix": args.mix, "mix_seeds": args.mix_seeds, "all_up_to": args.all_up_to, "budget": 3, "bootstrap": "plugsearch.common.stats.bootstrap_interval (paired per question)", "seconds": round(time.perf_counter() - t0, 1),
        "command": "python bench/learning_curve.py " + " ".join(sys.argv[1:])}
    Path(args.figures).parent.mkdir(parents=True, exist_ok=True)
    Path(args.figures).write_text(json.dumps(figures, indent=1) + "\n", encoding="utf-8")
    compare = Path(args.compare) if args.compare else None
    png = plot(figures, Path(args.plot), json.loads(compare.read_text()) if compare and compare.is_file() else None)
    figures["settings"]["plot"] = (str(png.relative_to(REPO)) if png.is_relative_to(REPO) else str(png)) if png else None
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
