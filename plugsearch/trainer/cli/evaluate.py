"""`plugsearch-train eval`: direct / naive / s3 / qagent through the services, GenAcc, EM and F1 per set
(`plugsearch.trainer.common.evaluation`'s GenAcc scoring; its answer-recall-at-equal-budget side is what
`plugsearch-train compact --qa` and `bench/search_quality.py` report)."""

from __future__ import annotations

import argparse
import asyncio
from pathlib import Path
from typing import TYPE_CHECKING, Any

from plugsearch.common.qa import DATASETS, QAItem, eval_split
from plugsearch.trainer.cli.common import LLM_THREADS_DEFAULT, add_common, positive, settings_from
from plugsearch.trainer.common.localstack import services_for
from plugsearch.trainer.common.settings import TrainerSettings
from plugsearch.trainer.common.upstreams import ServiceStack

if TYPE_CHECKING:
    from plugsearch.trainer.common.evaluation import EvalRecord


def cmd_eval(args: argparse.Namespace) -> dict[str, Any]:
    from plugsearch.trainer.common.evaluation import load_results, write_report

    settings = settings_from(args)
    out = Path(args.out)
    if args.report:  # runs nothing: the table of the questions every method finished so far
        records = load_results(out, _eval_items(settings, args), args.methods)
        if not records:
            raise SystemExit(f"no question finished by every method in {out / 'results.jsonl'}")
    else:
        options = {"searcher": True, "llm_url": args.llm_url, "llm_threads": args.llm_threads}
        with services_for(settings, args.local, **options) as settings:
            records = _eval(args, settings, out)
    report = write_report(records, args.datasets, out)
    print(report["markdown"])
    return {"records": len(records), "questions": len(records) // len(args.methods), "table": str(out / "table.md"),
            "png": report["png"], "average": {m: report["table"][m]["average"] for m in report["table"]}}


def _eval_items(settings: TrainerSettings, args: argparse.Namespace) -> dict[str, list[QAItem]]:
    return {ds: eval_split(settings.data_dir, ds, args.n) for ds in args.datasets}


def _eval(args: argparse.Namespace, settings: TrainerSettings, out: Path) -> list[EvalRecord]:
    from plugsearch.common.clients import SearcherClient
    from plugsearch.trainer.common.evaluation import EvalConfig, run_eval

    config = EvalConfig(naive_k=settings.baseline_k, max_turns=args.max_turns, retrieve_k=args.retrieve_k,
                        select_k=args.select_k, method=settings.method, batch=args.batch)

    async def go() -> list[EvalRecord]:
        async with ServiceStack(settings) as stack:
            searcher = SearcherClient(settings.searcher) if {"s3", "qagent"} & set(args.methods) else None
            try:
                return await run_eval(_eval_items(settings, args), args.methods, out, services=stack,
                                      searcher=searcher, config=config, progress=not args.quiet)
            finally:
                if searcher is not None:
                    await searcher.aclose()

    return asyncio.run(go())


def add_parser(sub: Any) -> None:
    from plugsearch.trainer.common.evaluation import EvalConfig

    def default(name: str) -> Any:
        return EvalConfig.model_fields[name].default

    e = sub.add_parser("eval", help="direct / naive / s3 / qagent: GenAcc, EM, F1 per dataset + average")
    add_common(e)
    e.add_argument("--datasets", nargs="+", default=list(DATASETS))
    e.add_argument("--methods", nargs="+", choices=["direct", "naive", "s3", "qagent"],
                   default=["direct", "naive", "s3", "qagent"])
    e.add_argument("--n", type=int, default=50, help="first n questions of every set")
    e.add_argument("--out", default="var/eval")
    e.add_argument("--max-turns", type=int, default=default("max_turns"))
    e.add_argument("--retrieve-k", type=int, default=default("retrieve_k"))
    e.add_argument("--select-k", type=int, default=default("select_k"))
    e.add_argument("--local", action="store_true",
                   help="start the local services here (BM25 retriever, generator, judge, searcher, Redis)")
    e.add_argument("--llm-url", help="with --local: LLM endpoint (else llama.cpp)")
    e.add_argument("--llm-threads", type=positive, default=LLM_THREADS_DEFAULT,
                   help="with --local and no --llm-url: llama.cpp threads for generation (prompts use every core; "
                        "default %(default)s, as plugsearch-stack)")
    e.add_argument("--report", action="store_true",
                   help="run nothing: the table of the questions every method has finished in --out so far")
    e.set_defaults(func=cmd_eval)
