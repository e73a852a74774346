"""The default searcher off Wikipedia: what the start-up corpus check decides on each corpus, how long it takes,
and answer recall at 3 documents on each set's real evaluation questions, against naive BM25, dense and hybrid
top-3, with paired 95% bootstrap intervals.

Corpora: `combined` (the shared Wikipedia corpus; its questions: rows 0-99 of nq, hotpotqa, 2wikimultihopqa,
popqa) and the development sets in `<data>/domain/` (tatqa, policyqa, realtimeqa). A development set's
evaluation part is the trainer's seeded split of its questions (`plugsearch.common.qa.split_items`, seed 0,
20% at most 500: what `plugsearch-train compact --qa` evaluates on), yes/no questions left out; the rest is
never looked at here.

For each corpus, in-process over the stack's indexes (bm25s + the MiniLM flat index, `var/indexes/`, built when
missing): the check exactly as the searcher runs it at start-up (`plugsearch.searcher.corpus_check`: pseudo-
questions from `--pseudo` sampled passages), then the evaluation: `policy` is the compact policy as trained,
`served` what the searcher returns after the check (the policy where it passed, naive BM25 top-3 where not).

    python bench/domain_quality.py [--sets combined,tatqa,policyqa,realtimeqa] [--policy DIR]

Final line: {"sets": {name: {"check": {...}, "n": .., "summary": {system: mean, system_ci95, system_minus_naive,
system_minus_naive_ci95}, "examples": [...]}}, "settings": {...}}
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import CORPUS, DATA, REPO, load_questions, log  # noqa: E402
from plugsearch.common.answers import is_yes_no  # noqa: E402
from plugsearch.common.schemas.searcher import SearchParams  # noqa: E402

VAR = REPO / "var"
SHARED_SETS = ("hotpotqa", "2wikimultihopqa", "nq", "popqa")
DOMAIN_SETS = ("tatqa", "policyqa", "realtimeqa")


def corpus_and_questions(name: str, part: str = "eval") -> tuple[Path, list[Any]]:
    """The corpus and its questions: the evaluation part, or (`part` tune) questions of the training part, for
    developing the check without looking at the evaluation part."""
    from plugsearch.common.qa import load_qa, read_qa_file, split_items, split_sizes

    if name == "combined":
        if part == "tune":
            items = [q for s in SHARED_SETS for q in load_qa(DATA / "qa" / f"{s}.jsonl", 100, offset=200)]
        else:
            items = load_questions_all()
        return CORPUS, [q for q in items if not is_yes_no(q.golden_answers)]
    corpus = DATA / "domain" / f"{name}_corpus.jsonl"
    items = [q for q in read_qa_file(DATA / "domain" / f"{name}_qa.jsonl") if not is_yes_no(q.golden_answers)]
    n_eval, n_dev = split_sizes(len(items))
    split = split_items(items, seed=0, n_eval=n_eval, n_dev=n_dev)
    return corpus, split.train[:n_eval] if part == "tune" else split.eval


def load_questions_all() -> list[Any]:
    return [q for s in SHARED_SETS for q in load_questions(s, 100)]


def read_passages(corpus: Path, positions: list[int]) -> list[tuple[str, str, str]]:
    wanted = set(positions)
    found: dict[int, tuple[str, str, str]] = {}
    with corpus.open(encoding="utf-8") as fh:
        for i, line in enumerate(fh):
            if i in wanted:
                row = json.loads(line)
                found[i] = (str(row["id"]), str(row.get("title", "")), str(row.get("text", row.get("contents", ""))))
    return [found[i] for i in positions if i in found]


def count_lines(path: Path) -> int:
    with path.open("rb") as fh:
        return sum(1 for line in fh if line.strip())


def run_set(name: str, args: argparse.Namespace, policy: Any) -> dict[str, Any]:
    from plugsearch.searcher.corpus_check import CheckResult, check_policy, evaluated_here
    from plugsearch.searcher.pseudo_questions import check_questions, sample_positions
    from plugsearch.stack.corpus import index_dir_for
    from plugsearch.trainer.common.evaluation import BudgetEval, PolicyRun, budget_summary
    from plugsearch.trainer.common.retrieval import IndexRetriever

    corpus, items = corpus_and_questions(name, args.part)
    if args.limit:
        items = items[:args.limit]
    retriever = IndexRetriever(corpus, index_dir_for(corpus, VAR), dense=True, progress=not args.quiet)
    pool = policy.pool_methods(list(retriever.methods), retriever.encoder)
    params = SearchParams(mode="s3", pool_methods=pool, **policy.search_setting(), method="bm25")
    positions = sample_positions(count_lines(corpus), args.pseudo * 2, seed=args.seed)
    t0 = time.perf_counter()
    questions = asyncio.run(check_questions(read_passages(corpus, positions), retriever, args.pseudo, seed=args.seed))
    made_s = time.perf_counter() - t0
    evaluated = evaluated_here(policy.manifest, retriever.identity()["sha256"])
    if evaluated is not None:  # as the service: a policy evaluated on this corpus keeps its own verdict
        check = CheckResult("policy" if evaluated else "naive", "the policy's own evaluation on this corpus")
    else:
        check = asyncio.run(check_policy(policy, params, retriever, questions, margin=args.margin))
    result: dict[str, Any] = {"check": {**check.as_dict(), "make_seconds": round(made_s, 3)},
                              "examples": [f"{q.question} -> {q.answer}" for q in questions[:5]]}
    log(f"{name}: check {check.decision}: {check.reason} ({check.seconds:.1f} s)")
    runs = {"policy": PolicyRun(policy, params, per_budget=False)}
    evaluation = BudgetEval(retriever, naive=["bm25", "dense", "hybrid"], policies=runs, budgets=(3,))
    rows = asyncio.run(evaluation.rows(items))
    for row in rows:
        cell = row["scores"]["3"]
        cell["served"] = cell["policy"] if check.decision == "policy" else cell["naive_bm25"]
    systems = [*evaluation.systems, "served"]
    summary = budget_summary(rows, systems, (3,), sets=[])["all"]["budget3"]["answer_recall"]
    result.update(n=len(items), summary=summary)
    log(f"{name}: {json.dumps(summary)}")
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sets", default="combined," + ",".join(DOMAIN_SETS))
    parser.add_argument("--policy", default=None, help="compact policy folder (default: the packaged one)")
    parser.add_argument("--pseudo", type=int, default=None, help="pseudo-questions of the check (default: the service's)")
    parser.add_argument("--margin", type=float, default=None, help="the check's margin (default: the service's)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--part", choices=["eval", "tune"], default="eval", help="eval: the evaluation part (what "
                        "is reported); tune: as many questions of the training part (rows 200-299 of the shared sets), "
                        "to develop on")
    parser.add_argument("--limit", type=int, default=0, help="at most this many evaluation questions per set")
    parser.add_argument("--quiet", action="store_true")
    args = parser.parse_args()
    from plugsearch.searcher.compact import CompactPolicy
    from plugsearch.searcher.settings import SearcherSettings
    from plugsearch.searcher.trained import COMPACT_DIR

    if args.margin is None:
        args.margin = SearcherSettings.model_fields["corpus_check_margin"].default
    if args.pseudo is None:
        args.pseudo = SearcherSettings.model_fields["corpus_check_questions"].default
    policy = CompactPolicy.load(Path(args.policy) if args.policy else COMPACT_DIR)
    t0 = time.perf_counter()
    out: dict[str, Any] = {"sets": {}}
    for name in args.sets.split(","):
        out["sets"][name] = run_set(name, args, policy)
    out["settings"] = {"policy": policy.model, "part": args.part, "pseudo": args.pseudo, "margin": args.margin, "seed": args.seed,
                       "seconds": round(time.perf_counter() - t0, 1)}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
