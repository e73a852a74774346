"""RL on TRL's `GRPOTrainer` with the searcher's own loop as a custom multi-turn rollout.

A step = `questions_per_step` questions x `num_generations` rollouts, rewarded through the services as one
concurrent batch; the loss mask excludes every token the environment inserted. `train` resumes from the
newest complete checkpoint and the Trainer skips the batches already consumed, so the data order is the
same as without the crash. Every step appends a line to `rewards.jsonl` (with question ids for auditing).
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, Field, model_validator

from plugsearch.common.aio import AsyncRunner
from plugsearch.common.qa import QAItem, append_durable, read_jsonl
from plugsearch.common.schemas.searcher import SearchParams
from plugsearch.searcher.env import SearchOutcome
from plugsearch.searcher.prompts import PromptSet
from plugsearch.trainer.common.baseline import BaselineStore
from plugsearch.trainer.common.rewards import Baseline, RewardComputer, Trajectory, format_score
from plugsearch.trainer.common.upstreams import QAServices
from plugsearch.trainer.llm.rollout import SearchRollout

logger = logging.getLogger(__name__)

REWARD_LOG = "rewards.jsonl"


Device = Literal["auto", "cpu", "cuda"]
Precision = Literal["auto", "fp32", "bf16", "fp16"]
VLLMMode = Literal["off", "colocate", "server"]

LORA_MODULES = ("v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""Adapted by default: every projection llama.cpp stores unpermuted, so the adapter exports to GGUF."""


class LoraSettings(BaseModel):
    rank: int = Field(16, ge=1, le=256)
    alpha: int = Field(32, gt=0)
    modules: tuple[str, ...] = LORA_MODULES
    top_layers: int | None = Field(None, ge=1, description=(
        "adapt only the last N layers: backpropagation stops below them, which cuts a step's backward "
        "pass when the lower layers stay frozen (None = every layer)"))

    def wrap(self, model: Any) -> Any:
        """`model` (a causal LM) with a new adapter of these settings."""
        from peft import LoraConfig, get_peft_model

        n = int(model.config.num_hidden_layers)
        layers = None if self.top_layers is None else list(range(max(0, n - self.top_layers), n))
        return get_peft_model(model, LoraConfig(r=self.rank, lora_alpha=self.alpha, lora_dropout=0.0,
                                                target_modules=list(self.modules), layers_to_transform=layers,
                                                task_type="CAUSAL_LM"))


S3_SEARCH = SearchParams(mode="s3", max_turns=3, retrieve_k=8, select_k=3, max_new_tokens=80)
"""The s3 paper's search setting (`--recipe s3`); an s3 search action is ~55 SmolLM2 tokens."""


class RunConfig(BaseModel):
    """What every training run of the policy (GRPO, the warm start) is given."""

    output_dir: Path
    model_path: Path
    seed: int = 0
    threads: int | None = None
    device: Device = "auto"
    precision: Precision = "auto"


class TrainConfig(RunConfig):
    max_steps: int = Field(20, ge=1)
    questions_per_step: int = Field(4, ge=1)
    num_generations: int = Field(2, ge=2)
    learning_rate: float = Field(1e-5, gt=0)
    save_steps: int = Field(5, ge=1)
    save_total_limit: int = Field(2, ge=1)
    beta: float = Field(0.0, ge=0.0, description="KL coefficient (0 = no reference model)")
    temperature: float = Field(1.0, gt=0.0, le=2.0, description="rollout sampling temperature")
    max_completion_tokens: int = Field(1024, ge=16)
    search: SearchParams = Field(default_factory=S3_SEARCH.model_copy)
    prompts_dir: Path | None = Field(None, description="prompt templates of the environment (None = packaged)")
    format_lambda: float = Field(0.0, ge=0.0)
    vllm: VLLMMode = "off"
    vllm_server_url: str | None = None
    lora: LoraSettings | None = Field(None, description="train a LoRA adapter instead of every weight")
    init_adapter: Path | None = Field(None, description="start from this saved LoRA adapter (e.g. a warm start)")

    @model_validator(mode="after")
    def _check(self) -> TrainConfig:
        if self.vllm != "off" and self.device == "cpu":
            raise ValueError("vLLM rollouts need a GPU: use --device cuda (or auto on a GPU machine)")
        if self.vllm == "server" and not self.vllm_server_url:
            raise ValueError("--vllm server needs --vllm-server-url")
        if self.init_adapter is not None and self.lora is not None:
            raise ValueError("init_adapter carries its own LoRA settings; do not give lora as well")
        return self


def resolve_device(device: Device) -> str:
    """`auto`: cuda when torch sees a GPU, else cpu. `cuda` without a GPU is refused, not run on the CPU."""
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("--device cuda: torch sees no GPU (CUDA_VISIBLE_DEVICES, drivers, a CPU build of torch?)")
    return device


def resolve_precision(precision: Precision, device: str) -> str:
    """`auto`: bf16 on a GPU that supports it (fp16 on older ones), fp32 on the CPU."""
    import torch

    if precision != "auto":
        if precision in ("bf16", "fp16") and device == "cpu":
            raise ValueError(f"{precision} training on the CPU is not supported here: use fp32")
        return precision
    if device == "cuda":
        return "bf16" if torch.cuda.is_bf16_supported() else "fp16"
    return "fp32"


TORCH_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def outcome_trajectory(item: QAItem, outcome: SearchOutcome) -> Trajectory:
    return Trajectory(item=item, documents=list(outcome.documents), valid_actions=outcome.valid_actions,
                      invalid_actions=outcome.invalid_actions,
                      retrieved=[doc for block in outcome.blocks for doc in block.documents])


class ServiceReward:
    """TRL reward function: the selected reward (GBR by default) through the services, whole batch at once."""

    def __init__(self, runner: AsyncRunner, computer: RewardComputer, log_path: Path | None = None) -> None:
        self.__name__ = computer.kind
        self.runner = runner
        self.computer = computer
        self.log_path = log_path

    def __call__(self, prompts: list[Any], completions: list[Any], *, qid: list[str],
                 golden_answers: list[list[str]], search: list[SearchOutcome], trainer_state: Any = None,
                 dataset: list[str] | None = None, **_: Any) -> list[float]:
        trajectories = [outcome_trajectory(QAItem(id=q, question=o.question, golden_answers=list(g),
                                                  dataset=(dataset or [""] * len(qid))[i]), o)
                        for i, (q, g, o) in enumerate(zip(qid, golden_answers, search, strict=True))]
        t0 = time.perf_counter()
        results = self.runner.run(self.computer.score(trajectories))
        if self.log_path is not None:
            step = (trainer_state.global_step + 1) if trainer_state is not None else None
            n = len(results)
            line = {
                "step": step, "time": time.time(), "reward_seconds": round(time.perf_counter() - t0, 3),
                "kind": self.computer.kind, "qids": list(qid),
                "reward": [r.reward for r in results], "genacc": [r.genacc for r in results],
                "baseline_genacc": [r.baseline_genacc for r in results],
                "format": [r.format_score for r in results],
                "mean_reward": sum(r.reward for r in results) / n,
                "mean_genacc": sum(r.genacc for r in results) / n,
                "mean_format": sum(r.format_score for r in results) / n,
                "queries": [len(o.queries) for o in search], "documents": [len(o.documents) for o in search],
                "stop": [o.stop_reason for o in search],
            }
            append_durable(self.log_path, json.dumps(line) + "\n")
        return [r.reward for r in results]


class FormatReward:
    """Share of well-formed policy actions (the format reward; weighted by lambda in TRL's reward_weights)."""

    __name__ = "format"

    def __call__(self, prompts: list[Any], completions: list[Any], *, search: list[SearchOutcome],
                 **_: Any) -> list[float]:
        return [format_score(o.valid_actions, o.invalid_actions) for o in search]


def last_checkpoint(output_dir: Path) -> str | None:
    """The newest *complete* checkpoint: the Trainer writes `trainer_state.json` last, so a folder without it
    was cut by a crash mid-save and is skipped (transformers' `get_last_checkpoint` would pick it)."""
    if not output_dir.is_dir():
        return None
    complete = []
    for folder in output_dir.glob("checkpoint-*"):
        suffix = folder.name.rsplit("-", 1)[-1]
        if not suffix.isdigit():
            continue
        if (folder / "trainer_state.json").is_file():
            complete.append((int(suffix), folder))
        else:
            logger.warning("ignoring incomplete checkpoint %s", folder)
    return str(max(complete)[1]) if complete else None


def load_model(config: TrainConfig, device: str, precision: str) -> tuple[Any, Any]:
    """The policy in the run's precision (moved to the device by the Trainer), with its LoRA if any."""
    import torch

    from plugsearch.trainer.llm.model import load_policy

    model, tokenizer = load_policy(config.model_path, threads=config.threads,
                                   dtype=getattr(torch, TORCH_DTYPES[precision]))
    if config.init_adapter is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, str(config.init_adapter), is_trainable=True)
    elif config.lora is not None:
        model = config.lora.wrap(model)
    return model, tokenizer


def build_trainer(config: TrainConfig, items: Sequence[QAItem], *, runner: AsyncRunner, services: QAServices,
                  retriever: Any, baselines: BaselineStore | None, reward_kind: str = "gbr",
                  baseline: Baseline | None = None, extra_reward_funcs: Sequence[Any] = (), extra_reward_weights: Sequence[float] = ()) -> Any:
    """A ready `GRPOTrainer`: the model from `config.model_path` on `config.device` in `config.precision`
    (a LoRA when asked), rollouts through the search environment (vLLM ones when `config.vllm` is on), the
    log-probability pass reading each group's shared prompt once (`plugsearch.trainer.llm.shared_prefix`)."""
    from datasets import Dataset
    from trl import GRPOConfig

    from plugsearch.trainer.llm.shared_prefix import trainer_class

    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    device = resolve_device(config.device)
    precision = resolve_precision(config.precision, device)
    model, tokenizer = load_model(config, device, precision)
    params = config.search.model_copy(update={"temperature": config.temperature})
    prompts = PromptSet.load(config.prompts_dir)
    rollout = SearchRollout(runner, retriever, params, prompts=prompts,
                            max_completion_tokens=config.max_completion_tokens)
    config.output_dir.mkdir(parents=True, exist_ok=True)
    computer = RewardComputer(services, kind=reward_kind, baseline=baseline,  # type: ignore[arg-type]
                              baselines=baselines, method=params.method)
    reward_funcs: list[Any] = [ServiceReward(runner, computer, config.output_dir / REWARD_LOG)]
    weights = [1.0]
    if config.format_lambda > 0:
        reward_funcs.append(FormatReward())
        weights.append(config.format_lambda)
    reward_funcs += list(extra_reward_funcs)
    weights += list(extra_reward_weights)
    vllm: dict[str, Any] = {}
    if config.vllm != "off":
        vllm = {"use_vllm": True, "vllm_mode": config.vllm}
        if config.vllm == "server":
            vllm["vllm_server_base_url"] = config.vllm_server_url
    args = GRPOConfig(
        output_dir=str(config.output_dir),
        per_device_train_batch_size=config.questions_per_step * config.num_generations,
        num_generations=config.num_generations,
        gradient_accumulation_steps=1,
        max_steps=config.max_steps,
        learning_rate=config.learning_rate,
        lr_scheduler_type="constant",
        warmup_steps=0,
        beta=config.beta,
        temperature=config.temperature,
        max_completion_length=config.max_completion_tokens,
        save_strategy="steps",
        save_steps=config.save_steps,
        save_total_limit=config.save_total_limit,
        logging_steps=1,
        report_to="none",
        use_cpu=device == "cpu",
        bf16=precision == "bf16",
        fp16=precision == "fp16",
        activation_checkpointing=False,
        seed=config.seed,
        data_seed=config.seed,
        dataloader_num_workers=0,
        remove_unused_columns=False,
        reward_weights=weights,
        disable_tqdm=True,
        **vllm,
    )
    dataset = Dataset.from_list([{"prompt": it.question, "qid": it.id, "golden_answers": it.golden_answers,
                                  "dataset": it.dataset} for it in items])
    return trainer_class()(model=model, reward_funcs=reward_funcs, args=args, train_dataset=dataset,
                           processing_class=tokenizer, rollout_func=rollout)


def train(trainer: Any, output_dir: Path, *, resume: bool = True) -> dict[str, Any]:
    checkpoint = last_checkpoint(output_dir) if resume else None
    if checkpoint:
        logger.info("resuming from %s", checkpoint)
    t0 = time.perf_counter()
    result = trainer.train(resume_from_checkpoint=checkpoint)
    trainer.save_model(str(output_dir / "final"))
    return {"global_step": trainer.state.global_step, "resumed_from": checkpoint,
            "train_loss": float(result.training_loss), "seconds": time.perf_counter() - t0}


def read_reward_log(path: Path) -> list[dict[str, Any]]:
    """One entry per step; a step redone after a crash keeps its last entry."""
    by_step = {int(e["step"]): e for e in read_jsonl(path, json.loads)[0] if e.get("step") is not None}
    return [by_step[s] for s in sorted(by_step)]
