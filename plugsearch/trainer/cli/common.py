"""What the subcommands of `plugsearch-train` share: settings from flags, the stored baselines, the run record,
argument groups. Defaults of a training run live in its config class (`plugsearch.trainer.llm.grpo.TrainConfig`,
`plugsearch.trainer.llm.warmstart.WarmStartConfig`, `plugsearch.trainer.compact.config.CompactConfig`); flags read them from there."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

from plugsearch.common.qa import TRAIN_DATASETS
from plugsearch.stack.specs import default_llm_threads
from plugsearch.trainer.common.baseline import BaselineConfig, BaselineStore
from plugsearch.trainer.common.settings import TrainerSettings

RUN_RECORD = "run.json"

# eval --local: plugsearch-stack's default for the embedded llama.cpp server's generation threads (1 on a
# 2-core machine, else half the cores up to 4): the searcher, the retriever and the eval itself need cores
# of their own, and a generation thread they preempt slows every other one down.
LLM_THREADS_DEFAULT = default_llm_threads()


def model_default(model: Any, name: str) -> Any:
    """A pydantic config class's default of field `name` (what its flag defaults to)."""
    return model.model_fields[name].default


def settings_from(args: argparse.Namespace) -> TrainerSettings:
    """`TRAINER_*` settings, with the flags that name a setting in their place."""
    names = ("reward", "format_lambda", "baseline_k", "method")
    return TrainerSettings().model_copy(update={n: getattr(args, n) for n in names
                                                if getattr(args, n, None) is not None})


def baseline_store(settings: TrainerSettings) -> BaselineStore:
    config = BaselineConfig(k=settings.baseline_k, method=settings.method, tag=os.environ.get("TRAINER_BASELINE_TAG", ""))
    return BaselineStore(settings.var_dir / "baselines", config, redis_url=settings.redis_url)


def portable(value: Any) -> Any:
    """`value` with every path under the working directory written relative to it: records that travel
    (run.json, a shipped manifest) name no folder of the machine they were made on."""
    if isinstance(value, dict):
        return {k: portable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [portable(v) for v in value]
    if isinstance(value, Path):
        value = str(value)
    if isinstance(value, str) and value.startswith("/") and Path(value).is_relative_to(Path.cwd()):
        return str(Path(value).relative_to(Path.cwd()))
    return value


def record_run(out: Path, args: argparse.Namespace, result: dict[str, Any], **details: Any) -> None:
    """`<out>/run.json`: the command, its result and its setting (what `export` puts in the manifest)."""
    out.mkdir(parents=True, exist_ok=True)
    record = {"command": command_line(args), "result": result, **details,
              "seed": args.seed, "datasets": args.datasets, "per_dataset": args.per_dataset,
              "eval_holdout": args.eval_holdout}
    (out / RUN_RECORD).write_text(json.dumps(portable(record), indent=2, default=str) + "\n")


def command_line(args: argparse.Namespace) -> str:
    return "plugsearch-train " + " ".join(getattr(args, "argv", []))


def positive(text: str) -> int:
    return _at_least(text, 1)


def count(text: str) -> int:
    """A number of things: 0 or more."""
    return _at_least(text, 0)


def _at_least(text: str, low: int) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < low:
        raise argparse.ArgumentTypeError(f"must be >= {low}, got {value}")
    return value


def add_common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    p.add_argument("--baseline-k", type=int, help="naive-RAG top-k of the GBR baseline (TRAINER_BASELINE_K, default 3)")
    p.add_argument("--method", choices=["bm25", "dense", "hybrid"])
    p.add_argument("--batch", type=int, default=8, help="questions per service round")


def add_train_set(p: argparse.ArgumentParser) -> None:
    p.add_argument("--datasets", nargs="+", default=list(TRAIN_DATASETS))
    p.add_argument("--per-dataset", type=int,
                   help="training candidates per dataset (after the eval hold-out)")
    p.add_argument("--eval-holdout", type=int, default=200,
                   help="first rows of each set kept out of training (0-99 evaluate, 100-199 are reserved)")
