"""GRPO steps on CPU with the local stack: the reward curve of s3 training (GBR through real services).

Starts the local services (Redis, BM25 retriever over ../shared/data/corpus/combined.jsonl, generator and
judge on a llama.cpp SmolLM2 server), computes naive-RAG baselines until `--questions` training
questions survive the s3 filter (naive GenAcc = 0, no yes/no), then runs `--steps` GRPO steps of
SmolLM2-135M in PyTorch (TRL) with the s3 loop as rollout. The baseline of the ratio is in the reward
itself: GBR = GenAcc(searched) - GenAcc(naive RAG) on the same questions, same generator, same run.

Final JSON line: {"steps", "gbr_first5", "gbr_last5", "seconds_per_step", ...}; PNG: <out>/reward_curve.png.

    python bench/train_step.py            # 20 steps, 64 questions, 4 questions x 2 rollouts per step
    python bench/train_step.py --quick    # 1 step, 2 questions: checks the path end to end
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from services.common.logging import configure_logging  # noqa: E402
from services.common.schemas.searcher import SearchParams  # noqa: E402
from trainer.cli import _baseline_store, select_training_questions  # noqa: E402
from trainer.data import default_data_dir, train_split  # noqa: E402
from trainer.grpo import TrainConfig, build_trainer, read_reward_log, train  # noqa: E402
from trainer.localstack import LocalServices  # noqa: E402
from trainer.model import default_policy_path  # noqa: E402
from trainer.plotting import plot_reward_curve  # noqa: E402
from trainer.runner import AsyncRunner  # noqa: E402
from trainer.upstreams import ServiceStack  # noqa: E402


def mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--questions", type=int, default=64)
    parser.add_argument("--questions-per-step", type=int, default=4)
    parser.add_argument("--num-generations", type=int, default=2)
    parser.add_argument("--max-turns", type=int, default=2)
    parser.add_argument("--retrieve-k", type=int, default=3)
    parser.add_argument("--doc-chars", type=int, default=300)
    parser.add_argument("--max-new-tokens", type=int, default=80,
                        help="per policy action; an s3 search action is ~55 SmolLM2 tokens (48 made every "
                             "search action invalid: no GRPO signal)")
    parser.add_argument("--lr", type=float, default=1e-5)
    parser.add_argument("--format-lambda", type=float, default=0.5,
                        help="weight of the format reward (an untrained 135M policy rarely emits a valid action, so "
                             "GBR alone gives every rollout of a question the same reward: no GRPO signal)")
    parser.add_argument("--llm-url", default=None, help="OpenAI-compatible URL for generator/judge (else llama.cpp)")
    parser.add_argument("--out", default=str(REPO / "var" / "bench" / "train_step"))
    parser.add_argument("--keep", action="store_true", help="resume the previous run in --out instead of restarting")
    parser.add_argument("--save-steps", type=int, default=2,
                        help="checkpoint every N steps: what a killed run resumes from with --keep (each ~4 min here)")
    args = parser.parse_args()
    if args.quick:
        args.steps, args.questions, args.questions_per_step = 1, 2, 2
        args.max_turns, args.retrieve_k, args.doc_chars, args.max_new_tokens = 1, 2, 200, 64
    configure_logging("INFO", service="bench")
    logging.getLogger("trainer").setLevel(logging.INFO)
    out = Path(args.out) / ("quick" if args.quick else "full")
    if not args.keep:
        shutil.rmtree(out, ignore_errors=True)
    data = default_data_dir()
    var = REPO / "var"
    t_start = time.perf_counter()
    with LocalServices(var, corpus=data / "corpus" / "combined.jsonl", llm_url=args.llm_url) as services:
        settings = services.settings(var_dir=var, reward="gbr")
        candidates = train_split(data, ("nq", "hotpotqa"), per_dataset=4 * args.questions)
        t0 = time.perf_counter()
        items = select_training_questions(settings, candidates, args.questions, batch=8, progress=False)
        baseline_s = time.perf_counter() - t0
        genacc = _baseline_store(settings).genacc_by_id()
        tried = [c for c in candidates if c.id in genacc]
        config = TrainConfig(
            output_dir=out, model_path=default_policy_path(var), max_steps=args.steps,
            questions_per_step=args.questions_per_step, num_generations=args.num_generations,
            learning_rate=args.lr, save_steps=args.save_steps, seed=0, threads=1,
            max_completion_tokens=768, format_lambda=args.format_lambda,
            search=SearchParams(mode="s3", max_turns=args.max_turns, retrieve_k=args.retrieve_k,
                                select_k=min(3, args.retrieve_k), max_new_tokens=args.max_new_tokens,
                                doc_chars=args.doc_chars))
        with AsyncRunner() as runner:
            stack = ServiceStack(settings)
            store = _baseline_store(settings)
            trainer = build_trainer(config, items, runner=runner, services=stack, retriever=stack, baselines=store)
            summary = train(trainer, out, resume=args.keep)
            runner.run(stack.aclose())
            runner.run(store.aclose())
    entries = read_reward_log(out / "rewards.jsonl")
    png = plot_reward_curve(entries, out / "reward_curve.png", title="s3 GRPO on CPU: mean GBR per step")
    steps_done = summary["global_step"] - (int(summary["resumed_from"].rsplit("-", 1)[-1])
                                          if summary["resumed_from"] else 0)
    result = {
        "steps": len(entries),
        "gbr_first5": mean([e["mean_reward"] for e in entries[:5]]),
        "gbr_last5": mean([e["mean_reward"] for e in entries[-5:]]),
        "seconds_per_step": summary["seconds"] / max(1, steps_done),
        "genacc_first5": mean([e["mean_genacc"] for e in entries[:5]]),
        "genacc_last5": mean([e["mean_genacc"] for e in entries[-5:]]),
        "questions": len(items), "baseline_questions": len(tried),
        "naive_genacc_of_candidates": mean([genacc[c.id] for c in tried]),
        "format_first5": mean([e["mean_format"] for e in entries[:5]]),
        "format_last5": mean([e["mean_format"] for e in entries[-5:]]),
        # steps where at least one question's rollouts got different optimised rewards (GBR + lambda x
        # format): only those move the GRPO policy
        "steps_with_reward_variance": sum(
            len({(q, r + args.format_lambda * f) for q, r, f in zip(e["qids"], e["reward"], e["format"], strict=True)})
            > len(set(e["qids"])) for e in entries),
        "rollouts_per_step": args.questions_per_step * args.num_generations,
        "baseline_seconds": round(baseline_s, 1), "total_seconds": round(time.perf_counter() - t_start, 1),
        "png": str(png),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
