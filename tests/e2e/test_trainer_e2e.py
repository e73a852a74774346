"""The trainer end to end on real local services: Redis, the BM25 retriever service, the generator and
judge services on the real llama.cpp SmolLM2 server (`llama_url`), SmolLM2-135M in PyTorch as policy.

- smoke: 2 questions x 2 rollouts, 2 GRPO steps through TRL with the searcher loop as rollout: the
  loss is finite, the weights change, the checkpoint reloads to the trained weights, and the gradient
  on every environment-inserted position is exactly zero (asserted on the tensors of the last step).
- SIGKILL: the baseline job and a training run are killed mid-way and restarted: no finished baseline
  is lost or recomputed, training resumes from the last checkpoint with the same data order.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from plugsearch.common.procgroup import ProcessGroup, ProcessSpec
from plugsearch.trainer.common.localstack import LocalServices
from tests.conftest import REPO

pytestmark = [pytest.mark.e2e, pytest.mark.slow,
              pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning"),
              pytest.mark.filterwarnings("ignore::FutureWarning:transformers.*"),
              pytest.mark.filterwarnings("ignore:You are using 'rollout_func':UserWarning")]


@pytest.fixture(scope="module")
def stack(llama_url: str, data_dir: Path, var_dir: Path) -> Iterator[LocalServices]:
    with LocalServices(var_dir, corpus=data_dir / "corpus" / "combined.jsonl", llm_url=llama_url,
                       log_dir=var_dir / "logs" / "trainer-e2e") as services:
        yield services


@pytest.fixture(scope="module")
def policy_path(var_dir: Path) -> Path:
    from plugsearch.trainer.llm.model import default_policy_path

    return default_policy_path(var_dir)


def _env(stack: LocalServices, var: Path) -> dict[str, str]:
    settings = stack.settings()
    return {**os.environ, "OMP_NUM_THREADS": "1", "TRAINER_VAR_DIR": str(var),
            "TRAINER_RETRIEVER__URL": settings.retriever.url, "TRAINER_GENERATOR__URL": settings.generator.url,
            "TRAINER_JUDGE__URL": settings.judge.url, "TRAINER_REDIS_URL": settings.redis_url or "",
            "TRAINER_LOG_LEVEL": "WARNING", "HF_HUB_OFFLINE": "1", "TRL_EXPERIMENTAL_SILENCE": "1"}


def _kill_once(argv: list[str], env: dict[str, str], log: Path, predicate: Callable[[], bool],
               timeout_s: float) -> None:
    """Run `argv` until `predicate` holds (it fails the test if the job ends or times out first), then SIGKILL it."""
    with ProcessGroup(cwd=REPO).up(ProcessSpec("job", argv, env=env, ready=predicate, log=log),
                                   timeout_s=timeout_s) as group:
        group.stop("job", signal.SIGKILL)


def _last_json(stdout: str) -> dict[str, Any]:
    return json.loads([line for line in stdout.splitlines() if line.startswith("{")][-1])


def test_grpo_smoke_run_through_real_services(stack: LocalServices, policy_path: Path, tmp_path: Path,
                                              data_dir: Path) -> None:
    import torch

    from plugsearch.common.aio import AsyncRunner
    from plugsearch.common.qa import train_split
    from plugsearch.common.schemas.searcher import SearchParams
    from plugsearch.trainer.common.baseline import BaselineConfig, BaselineStore
    from plugsearch.trainer.common.upstreams import ServiceStack
    from plugsearch.trainer.llm.grpo import TrainConfig, build_trainer, read_reward_log, train
    from plugsearch.trainer.llm.probe import GradientProbe

    items = train_split(data_dir, ("nq",), per_dataset=2)
    config = TrainConfig(output_dir=tmp_path / "run", model_path=policy_path, max_steps=2, questions_per_step=2,
                         num_generations=2, learning_rate=1e-4, save_steps=2, threads=1, max_completion_tokens=512,
                         search=SearchParams(mode="s3", max_turns=1, retrieve_k=2, select_k=1, max_new_tokens=16,
                                             doc_chars=150))

    def length_bonus(prompts: list[Any], completions: list[Any], **_: Any) -> list[float]:
        # A test-only term that differs between samples, so every group has a non-zero advantage and the
        # update really moves the weights (GBR of an untrained 135M model is usually 0 for every sample).
        return [len(c) / 100.0 for c in completions]

    settings = stack.settings()
    with AsyncRunner() as runner:
        services = ServiceStack(settings)
        store = BaselineStore(tmp_path / "baselines", BaselineConfig(k=3), redis_url=settings.redis_url)
        trainer = build_trainer(config, items, runner=runner, services=services, retriever=services, baselines=store,
                                extra_reward_funcs=[length_bonus], extra_reward_weights=[1.0])
        before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
        probe = GradientProbe(trainer)
        try:
            summary = train(trainer, config.output_dir, resume=False)
        finally:
            probe.close()
            runner.run(services.aclose())
            runner.run(store.aclose())

    assert summary["global_step"] == 2
    losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
    assert len(losses) == 2 and all(math.isfinite(float(x)) for x in losses)
    changed = sum(float((p.detach() - before[n]).abs().sum()) for n, p in trainer.model.named_parameters())
    assert changed > 0, "the GRPO update did not change the weights"

    # the hidden state at position t predicts token t+1: a completion token the environment inserted (tool
    # mask 0) or padding must send back exactly zero gradient, the policy's own tokens must not
    assert probe.masked_grad_max() == 0.0
    assert probe.unmasked_grad_max() > 0.0
    # the ids the last step trained on are the ids SmolLM2 sampled in its rollouts
    assert probe.trained_vs_sampled(trainer.rollout_func.last)

    # the checkpoint reloads to exactly the trained weights
    from transformers import AutoModelForCausalLM

    reloaded = AutoModelForCausalLM.from_pretrained(str(config.output_dir / "checkpoint-2"), dtype=torch.float32)
    trained = dict(trainer.model.named_parameters())
    assert all(torch.equal(p, trained[n].detach()) for n, p in reloaded.named_parameters())
    log = read_reward_log(config.output_dir / "rewards.jsonl")
    assert [e["step"] for e in log] == [1, 2] and all(len(e["qids"]) == 4 for e in log)
    assert all(e["baseline_genacc"][0] is not None for e in log)  # GBR used a real naive-RAG baseline


def test_baseline_job_survives_sigkill(stack: LocalServices, tmp_path: Path) -> None:
    env = _env(stack, tmp_path)
    argv = [sys.executable, "-m", "plugsearch.trainer.cli", "baseline", "--datasets", "nq", "--per-dataset", "8",
            "--batch", "1", "--quiet"]
    files = lambda: list((tmp_path / "baselines").glob("baseline-*.jsonl"))  # noqa: E731

    def lines() -> list[dict[str, Any]]:
        found = files()
        if not found:
            return []
        out = []
        for raw in found[0].read_text().splitlines():
            try:
                out.append(json.loads(raw))
            except ValueError:
                pass
        return out

    _kill_once(argv, env, tmp_path / "baseline.log", lambda: len(lines()) >= 2, 900)  # two finished baselines
    before = {r["id"]: r for r in lines()}
    assert 2 <= len(before) < 8, "the job should have been killed mid-way"

    done = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=1800, check=False)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    result = _last_json(done.stdout)
    after = lines()
    assert len(after) == len({r["id"] for r in after}) == 8  # no duplicates, nothing missing
    assert result["done_before"] == len(before) and result["computed"] == 8 - len(before)
    by_id = {r["id"]: r for r in after}
    assert all(by_id[k] == v for k, v in before.items())  # finished baselines kept as they were


def test_training_resumes_from_last_checkpoint_after_sigkill(stack: LocalServices, policy_path: Path,
                                                             tmp_path: Path) -> None:
    env = _env(stack, tmp_path)
    out = tmp_path / "run"
    argv = [sys.executable, "-m", "plugsearch.trainer.cli", "train", "--datasets", "nq", "--per-dataset", "12",
            "--questions", "3", "--questions-per-step", "1", "--num-generations", "2", "--steps", "3",
            "--save-steps", "1", "--max-turns", "1", "--retrieve-k", "2", "--select-k", "1", "--doc-chars", "150",
            "--max-new-tokens", "16", "--max-completion-tokens", "256", "--threads", "1", "--model", str(policy_path),
            "--out", str(out), "--quiet", "--seed", "3"]

    def steps_logged() -> list[int]:
        path = out / "rewards.jsonl"
        if not path.exists():
            return []
        return [json.loads(line)["step"] for line in path.read_text().splitlines() if line.strip()]

    # kill while step 2 is in flight: its rewards are logged, its checkpoint is not written yet
    _kill_once(argv, env, tmp_path / "train.log",
               lambda: (out / "checkpoint-1" / "trainer_state.json").exists() and 2 in steps_logged(), 1800)
    complete = sorted(int(p.name.split("-")[1]) for p in out.glob("checkpoint-*") if (p / "trainer_state.json").exists())
    log_before = [json.loads(line) for line in (out / "rewards.jsonl").read_text().splitlines() if line.strip()]

    done = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=1800, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = _last_json(done.stdout)
    assert result["resumed_from"].endswith(f"checkpoint-{complete[-1]}")
    assert result["global_step"] == 3
    state = json.loads((out / "checkpoint-3" / "trainer_state.json").read_text())
    assert state["global_step"] == 3

    entries = [json.loads(line) for line in (out / "rewards.jsonl").read_text().splitlines() if line.strip()]
    resumed = entries[len(log_before):]
    # the resumed run starts at the step after the checkpoint, and redoes the killed step on the same questions
    assert [e["step"] for e in resumed] == list(range(complete[-1] + 1, 4))
    first_try = {e["step"]: e["qids"] for e in log_before}
    for e in resumed:
        if e["step"] in first_try:
            assert e["qids"] == first_try[e["step"]], "data order changed after the resume"
    # each step trained on one question's two rollouts, and the three steps saw three different questions
    final = {e["step"]: e["qids"] for e in entries}
    assert all(len(set(final[s])) == 1 and len(final[s]) == 2 for s in (1, 2, 3))
    assert len({final[s][0] for s in (1, 2, 3)}) == 3
