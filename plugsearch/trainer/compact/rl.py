"""The compact policy's reinforcement learning in the search environment: groups of sampled searches per
question, driven by the searcher's own driver (`plugsearch.searcher.loop.drive`) with the policy sampling its
actions (queries from the candidates' softmax, the selection by Plackett-Luce); the reward from the one reward
computer (`plugsearch.trainer.common.rewards.RewardComputer`: `recall`, GBR with the span check and no LLM, or `gbr`,
GenAcc of the frozen generator and the judge through the services); the advantage is the reward minus its
group's mean (REINFORCE with a group baseline). Resumable: the state is saved every `save_every` steps and a
rerun of the same command continues."""

from __future__ import annotations

import asyncio
import json
import logging
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from plugsearch.common.qa import append_durable, read_jsonl
from plugsearch.common.schemas.base import Document
from plugsearch.common.schemas.searcher import SearchParams
from plugsearch.searcher.compact import LEXICAL_SCORER, CompactPolicy, Decision
from plugsearch.searcher.env import Action, RetrieverBackend, SearchEnv
from plugsearch.searcher.loop import drive
from plugsearch.trainer.common.rewards import RewardComputer, Trajectory
from plugsearch.trainer.compact.config import CompactConfig
from plugsearch.trainer.compact.data import LabeledItem
from plugsearch.trainer.compact.model import export, log_prob, norms_of, torch_model

logger = logging.getLogger(__name__)


@dataclass
class Step:
    doc_x: np.ndarray
    cand_x: np.ndarray | None
    choice: int | None
    selected: list[int]
    scorer: str = LEXICAL_SCORER


@dataclass
class Episode:
    item: LabeledItem
    steps: list[Step]
    documents: list[Document]
    valid_actions: int = 0
    invalid_actions: int = 0


class Sampling:
    """The policy as an `ActingPolicy` that samples (greedy without `rng`) and records each decision's
    features and choices (what `log_prob` needs)."""

    def __init__(self, policy: CompactPolicy, rng: np.random.Generator | None, temperature: float = 1.0) -> None:
        self.policy = policy
        self.rng = rng
        self.temperature = temperature
        self.steps: list[Step] = []

    @property
    def model(self) -> str:
        return self.policy.model

    async def act(self, env: SearchEnv) -> Action:
        d: Decision = self.policy.decide(env, rng=self.rng, temperature=self.temperature)
        self.steps.append(Step(d.doc_x, d.cand_x, d.choice, d.selected, d.scorer))
        return d.action


async def run_episode(policy: CompactPolicy, item: LabeledItem, retriever: RetrieverBackend, params: SearchParams,
                      rng: np.random.Generator | None, temperature: float = 1.0) -> Episode:
    """One search in the environment with the policy (sampled when `rng` is given), by the searcher's driver."""
    sampling = Sampling(policy, rng, temperature)
    outcome = await drive(SearchEnv(item.item.question, params, retriever), sampling)
    return Episode(item, sampling.steps, list(outcome.documents), outcome.valid_actions, outcome.invalid_actions)


def trajectory(ep: Episode) -> Trajectory:
    return Trajectory(item=ep.item.item, documents=ep.documents, valid_actions=ep.valid_actions,
                      invalid_actions=ep.invalid_actions, retriever=ep.item.retriever)


def reinforce(policy: CompactPolicy, train: Sequence[LabeledItem], retriever: RetrieverBackend,
              config: CompactConfig, out: Path, make_reward: Callable[[], RewardComputer], progress: bool = True, *,
              anchor: CompactPolicy | None = None, pull: float = 0.0) -> tuple[CompactPolicy, list[dict[str, Any]]]:
    """GRPO-style REINFORCE on both heads; `rewards.jsonl` + `state.pt` in `out` make it resumable. The reward
    computer is made (and closed) in the training loop's event loop, which its service clients belong to. With
    `anchor` (the policy the learner started from), `pull` * the squared distance to its weights joins the loss
    (L2-SP, as in the warm start's fit)."""

    async def go() -> tuple[CompactPolicy, list[dict[str, Any]]]:
        reward = make_reward()
        try:
            return await _reinforce(policy, train, retriever, config, out, progress, reward, anchor, pull)
        finally:
            await reward.aclose()

    return asyncio.run(go())


async def _reinforce(policy: CompactPolicy, train: Sequence[LabeledItem], retriever: RetrieverBackend,
                     config: CompactConfig, out: Path, progress: bool, reward: RewardComputer,
                     anchor: CompactPolicy | None = None, pull: float = 0.0
                     ) -> tuple[CompactPolicy, list[dict[str, Any]]]:
    import torch
    from tqdm import tqdm

    from plugsearch.trainer.compact.warmstart import hidden_of

    params = config.search_params()
    norms = norms_of(policy.weights)
    hidden = hidden_of(policy.weights)
    model = torch_model(hidden, list(norms), policy.weights)
    reference: dict[str, Any] = {}
    if anchor is not None and pull:
        anchored = [s for s in norms if s in norms_of(anchor.weights)]
        reference = dict(torch_model(hidden_of(anchor.weights), anchored, anchor.weights).named_parameters())
        reference = {k: v.detach() for k, v in reference.items() if k == "qv" or k.split(".", 1)[0] in anchored}
    opt = torch.optim.Adam(model.parameters(), lr=config.rl_lr)
    state_path, log_path = out / "state.pt", out / "rewards.jsonl"
    entries, _ = read_jsonl(log_path, json.loads)
    start = 0
    if state_path.is_file():
        state = torch.load(state_path, weights_only=False)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        start = int(state["step"])
        logger.info("resuming RL from its saved state at step %d of %d (%s)", start, config.rl_steps, state_path)
    entries = [e for e in entries if e["step"] < start]  # steps after the last save are redone
    log_path.write_text("".join(json.dumps(e) + "\n" for e in entries))

    bar = tqdm(range(start, config.rl_steps), desc=f"RL ({reward.kind})", disable=not progress, initial=start,
               total=config.rl_steps)
    for step in bar:
        batch = random.Random(config.seed * 100_003 + step).sample(list(train), min(config.questions_per_step,
                                                                                    len(train)))
        current = CompactPolicy(export(model, norms), name="compact")
        rng = np.random.default_rng(config.seed * 7919 + step)
        t0 = time.perf_counter()
        episodes = [await run_episode(current, item, item.retriever or retriever, params, rng, config.temperature)
                    for item in batch for _ in range(config.group)]
        t_search = time.perf_counter()
        in_services = reward.service_seconds
        scored = await reward.score([trajectory(ep) for ep in episodes])
        t_reward = time.perf_counter()
        rewards = np.array([s.reward for s in scored]).reshape(len(batch), config.group)
        adv = (rewards - rewards.mean(1, keepdims=True)).reshape(-1)
        loss = torch.zeros(())
        for ep, a in zip(episodes, adv, strict=True):
            if a != 0:
                loss = loss - float(a) * log_prob(model, ep, norms, config.temperature)
        loss = loss / len(episodes)
        if reference:
            loss = loss + pull * sum(((p - reference[k]) ** 2).sum() for k, p in model.named_parameters()
                                     if k in reference)
        opt.zero_grad()
        if loss.requires_grad:
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
        seconds = time.perf_counter() - t0
        services = reward.service_seconds - in_services
        searches = float(np.mean([sum(1 for st in ep.steps if not st.selected) for ep in episodes]))
        entry = {"step": step, "kind": reward.kind, "mean_reward": round(float(rewards.mean()), 4),
                 "mean_genacc": round(float(np.mean([s.genacc for s in scored])), 4),
                 "searches": round(searches, 3), "seconds": round(seconds, 2),
                 "search_seconds": round(t_search - t0, 2), "reward_seconds": round(t_reward - t_search, 2),
                 "service_seconds": round(services, 2), "service_share": round(services / seconds, 3) if seconds else 0.0}
        entries.append(entry)
        append_durable(log_path, json.dumps(entry) + "\n")
        bar.set_postfix(reward=entry["mean_reward"], hit=entry["mean_genacc"])
        if (step + 1) % config.save_every == 0 or step + 1 == config.rl_steps:
            torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": step + 1}, state_path)
    final = CompactPolicy(export(model, norms), name="compact-gbr")
    final.check()
    return final, entries


def timing(entries: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Seconds per step (mean) and the share of them spent in the generator and judge services."""
    if not entries:
        return {}
    seconds = sum(e.get("seconds", 0.0) for e in entries)
    services = sum(e.get("service_seconds", 0.0) for e in entries)
    return {"steps": len(entries), "seconds_per_step": round(seconds / len(entries), 2),
            "search_seconds_per_step": round(sum(e.get("search_seconds", 0.0) for e in entries) / len(entries), 2),
            "reward_seconds_per_step": round(sum(e.get("reward_seconds", 0.0) for e in entries) / len(entries), 2),
            "service_share": round(services / seconds, 3) if seconds else 0.0}
