"""GRPO steps on the CPU, two settings in the same run: where the seconds of a step go, and the reward curve.

Both train SmolLM2-135M with TRL's GRPO through `plugsearch.trainer.llm.rollout.SearchRollout`, `--questions-per-step` x
`--num-generations` rollouts per step, on the local services (Redis, the BM25 retriever; for the old setting
also the generator and judge on llama.cpp):
- before (the first CPU runs, `--before-steps` steps): every weight in fp32, the packaged s3 prompts
  (391-token system prompt), T=2, 3 documents of 300 characters, 80 tokens per action, GBR through the
  generator and judge (s3-filtered questions: naive-RAG GenAcc 0), format weight 0.5;
- new (`plugsearch/trainer/llm/recipe.py`, the shipped searcher's, `--steps` steps, from `--init-adapter` when given): a LoRA
  on the last 12 layers, the trained searcher's prompts (88-token system prompt), T=1, 5 documents of 200
  characters, 64 tokens per action, the LLM-free recall GBR; KV-cached batched sampling.

Per step: rollout (sampling + retrieval), reward and update seconds (the rest: TRL's forward/backward and
optimizer). Final JSON line: {"seconds_per_step", "seconds_per_step_before", "speedup", "reward_first5",
"reward_last5", "steps", ...}; PNG: <out>/new/reward_curve.png.

    python bench/train_step.py --init-adapter var/runs/warmstart/adapter      # 20 new steps, 2 before
    python bench/train_step.py --quick                                        # 1 + 1 steps: the path works
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from plugsearch.common.aio import AsyncRunner  # noqa: E402
from plugsearch.common.answers import is_yes_no  # noqa: E402
from plugsearch.common.logging import configure_logging  # noqa: E402
from plugsearch.common.qa import default_data_dir, train_split  # noqa: E402
from plugsearch.common.schemas.searcher import SearchParams  # noqa: E402
from plugsearch.trainer.cli.baseline import select_training_questions  # noqa: E402
from plugsearch.trainer.cli.common import baseline_store  # noqa: E402
from plugsearch.trainer.common.localstack import LocalServices  # noqa: E402
from plugsearch.trainer.common.plotting import plot_reward_curve  # noqa: E402
from plugsearch.trainer.common.upstreams import ServiceStack  # noqa: E402
from plugsearch.trainer.llm import recipe  # noqa: E402
from plugsearch.trainer.llm.grpo import LoraSettings, TrainConfig, build_trainer, read_reward_log, train  # noqa: E402
from plugsearch.trainer.llm.model import default_policy_path  # noqa: E402

BEFORE = SearchParams(mode="s3", max_turns=2, retrieve_k=3, select_k=3, doc_chars=300, max_new_tokens=80)


def mean(values: list[float]) -> float | None:
    return round(statistics.mean(values), 4) if values else None


def run(name: str, config: TrainConfig, items: list[Any], settings: Any, *, reward: str, resume: bool
        ) -> dict[str, Any]:
    """Train `config` and break each step's seconds down (first step excluded from the means: warm-up)."""
    with AsyncRunner() as runner:
        stack = ServiceStack(settings)
        store = baseline_store(settings)
        try:
            trainer = build_trainer(config, items, runner=runner, services=stack, retriever=stack, baselines=store,
                                    reward_kind=reward)
            summary = train(trainer, config.output_dir, resume=resume)
        finally:
            runner.run(stack.aclose())
            runner.run(store.aclose())
    entries = read_reward_log(config.output_dir / "rewards.jsonl")
    steps = [float(e["step_time"]) for e in trainer.state.log_history if "step_time" in e]
    rollout = list(trainer.rollout_func.seconds)
    rewards = [float(e["reward_seconds"]) for e in entries][-len(steps):] if steps else []
    timed = slice(1, None) if len(steps) > 1 else slice(None)
    per_step = mean(steps[timed])
    roll = mean(rollout[timed])
    rew = mean(rewards[timed])
    logging.getLogger("bench").info("%s: %s", name, summary)
    return {"entries": entries, "seconds_per_step": per_step, "rollout_s": roll, "reward_s": rew,
            "update_s": round(per_step - (roll or 0) - (rew or 0), 3) if per_step is not None else None,
            "steps_timed": len(steps[timed]), "summary": summary}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="1 step before, 1 step new")
    parser.add_argument("--steps", type=int, default=20, help="steps of the new setting")
    parser.add_argument("--before-steps", type=int, default=2, help="steps of the old setting (each ~4 min here)")
    parser.add_argument("--questions-per-step", type=int, default=4)
    parser.add_argument("--num-generations", type=int, default=2)
    parser.add_argument("--init-adapter", default=None, help="the new setting starts from this LoRA adapter")
    parser.add_argument("--lr", type=float, default=1e-5)
    parser.add_argument("--new-lr", type=float, default=5e-5, help="the LoRA's learning rate")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--out", default=str(REPO / "var" / "bench" / "train_step"))
    parser.add_argument("--keep", action="store_true", help="resume the new setting's run in --out")
    parser.add_argument("--save-steps", type=int, default=5)
    args = parser.parse_args()
    if args.quick:
        args.steps, args.before_steps = 1, 1
    configure_logging("INFO", service="bench")
    out = Path(args.out) / ("quick" if args.quick else "full")
    if not args.keep:
        shutil.rmtree(out, ignore_errors=True)
    data = default_data_dir()
    var = REPO / "var"
    model = default_policy_path(var)
    t_start = time.perf_counter()
    with LocalServices(var, corpus=data / "corpus" / "combined.jsonl") as services:
        base_settings = services.settings(var_dir=var)
        n_before = args.before_steps * args.questions_per_step
        before: dict[str, Any] = {}
        if n_before and not (args.keep and (out / "before").exists()):
            candidates = train_split(data, ("nq", "hotpotqa"), per_dataset=4 * n_before)
            items = select_training_questions(base_settings.model_copy(update={"reward": "gbr"}), candidates,
                                              n_before, batch=8, progress=False)
            config = TrainConfig(output_dir=out / "before", model_path=model, max_steps=args.before_steps,
                                 questions_per_step=args.questions_per_step, num_generations=args.num_generations,
                                 learning_rate=args.lr, save_steps=10_000, seed=0, threads=2,
                                 max_completion_tokens=768, format_lambda=0.5, device="cpu", search=BEFORE)
            before = run("before", config, items, base_settings.model_copy(update={"format_lambda": 0.5}),
                         reward="gbr", resume=False)
        items_new = [it for it in train_split(data, recipe.TRAIN_DATASETS, per_dataset=200)
                     if not is_yes_no(it.golden_answers)]
        config = TrainConfig(
            output_dir=out / "new", model_path=model, max_steps=args.steps,
            questions_per_step=args.questions_per_step, num_generations=args.num_generations,
            learning_rate=args.new_lr, save_steps=args.save_steps, seed=0, threads=2, max_completion_tokens=768,
            temperature=args.temperature, device="cpu", search=recipe.SEARCH, prompts_dir=recipe.PROMPTS_DIR,
            lora=None if args.init_adapter else LoraSettings(rank=recipe.LORA_RANK, alpha=recipe.LORA_ALPHA,
                                                             top_layers=recipe.LORA_TOP_LAYERS),
            init_adapter=Path(args.init_adapter) if args.init_adapter else None)
        new = run("new", config, items_new, base_settings, reward="recall", resume=args.keep)
    entries = new["entries"]
    png = plot_reward_curve(entries, out / "new" / "reward_curve.png",
                            title="GRPO on 2 CPU cores: recall gain beyond naive top-n, per step")
    result = {
        "seconds_per_step": new["seconds_per_step"],
        "seconds_per_step_before": before.get("seconds_per_step"),
        "speedup": round(before["seconds_per_step"] / new["seconds_per_step"], 2)
        if before.get("seconds_per_step") and new["seconds_per_step"] else None,
        "reward_first5": mean([e["mean_reward"] for e in entries[:5]]),
        "reward_last5": mean([e["mean_reward"] for e in entries[-5:]]),
        "steps": len(entries),
        "breakdown_s": {"new": {k: new[k] for k in ("rollout_s", "reward_s", "update_s")},
                        "before": {k: before.get(k) for k in ("rollout_s", "reward_s", "update_s")}},
        "steps_timed": {"new": new["steps_timed"], "before": before.get("steps_timed")},
        "rollouts_per_step": args.questions_per_step * args.num_generations,
        "hit_first5": mean([e["mean_genacc"] for e in entries[:5]]),
        "hit_last5": mean([e["mean_genacc"] for e in entries[-5:]]),
        "steps_with_reward_variance": sum(
            len({(q, r) for q, r in zip(e["qids"], e["reward"], strict=True)}) > len(set(e["qids"])) for e in entries),
        "init_adapter": args.init_adapter, "total_seconds": round(time.perf_counter() - t_start, 1),
        "png": str(png) if png else None,
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
