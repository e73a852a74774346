"""`plugsearch-train`: the trainer's console script, one module per subcommand.

    plugsearch-train compact                      # the compact CPU searcher (the default one): warm start + RL
    plugsearch-train compact --corpus my.jsonl --qa my_questions.jsonl --out var/runs/mine
                                                  # ... on your data: split, train, evaluate, report, export
    plugsearch-train compact-export RUN/final OUT --evaluation FILE   # a compact policy as the stack serves it
    plugsearch-train baseline --per-dataset 200   # naive-RAG GenAcc per training question (resumable)
    plugsearch-train warmstart --local            # the LLM policy's supervised LoRA warm start
    plugsearch-train train --steps 20 --out var/runs/s3   # GRPO on TRL, resumes from the last checkpoint
    plugsearch-train export ADAPTER OUT           # a trained LoRA as the LLM searcher the stack serves
    plugsearch-train eval --n 50                  # direct / naive / s3 / qagent table + bar chart
    plugsearch-train plot var/runs/s3             # reward curve PNG of a run

Services come from `TRAINER_*` settings (`TRAINER_RETRIEVER__URL`, `TRAINER_GENERATOR__URL`,
`TRAINER_JUDGE__URL`, `TRAINER_SEARCHER__URL`, `TRAINER_REDIS_URL`). Each command prints one JSON line
with its result last.
"""

from __future__ import annotations

import argparse
import json
import sys

from plugsearch.common import tracing
from plugsearch.common.logging import configure_logging
from plugsearch.trainer.cli import baseline, compact, evaluate, export, plot, train
from plugsearch.trainer.common.settings import TrainerSettings


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="plugsearch-train", description=__doc__.splitlines()[0] if __doc__ else None)
    sub = parser.add_subparsers(dest="command", required=True)
    baseline.add_parser(sub)
    train.add_parsers(sub)
    export.add_parser(sub)
    evaluate.add_parser(sub)
    compact.add_parsers(sub)
    plot.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    configure_logging(TrainerSettings().log_level, service="trainer")
    tracing.setup_tracing("trainer")  # off unless OTEL_* variables switch it on
    result = args.func(args)
    print(json.dumps(result, default=str))
    sys.stdout.flush()
