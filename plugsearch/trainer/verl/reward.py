"""veRL reward: GBR (or another `TRAINER_REWARD` kind) of a searcher episode through the plugsearch services.

veRL config (0.9.1): `reward.custom_reward_function.path=pkg://plugsearch.trainer.verl.reward`, `name=compute_score`,
with the default `naive` reward manager, which calls it once per trajectory with the agent loop's
`extra_fields` merged into `extra_info`. The documents scored are the episode's `SearchOutcome`'s, never
parsed back out of `solution_str`; a trajectory without it is an error. Concurrent calls of one worker are
scored as one batch, with clients kept per worker.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Mapping
from typing import Any

from plugsearch.common.qa import QAItem
from plugsearch.searcher.env import SearchOutcome
from plugsearch.trainer.common.baseline import BaselineConfig, BaselineStore
from plugsearch.trainer.common.rewards import RewardBreakdown, RewardComputer, Trajectory
from plugsearch.trainer.common.settings import TrainerSettings
from plugsearch.trainer.common.upstreams import ServiceStack
from plugsearch.trainer.llm.grpo import outcome_trajectory
from plugsearch.trainer.verl.agent_loop import OUTCOME_FIELD
from plugsearch.trainer.verl.shared import per_loop

GATHER_S = 0.05
"""How long a worker waits for company before scoring a batch of trajectories."""


def gold_answers(ground_truth: Any) -> list[str]:
    """`reward_model.ground_truth`: a list of gold answers (or Search-R1's `{"target": [...]}`)."""
    if isinstance(ground_truth, Mapping):
        ground_truth = ground_truth.get("target", ground_truth.get("golden_answers", []))
    if isinstance(ground_truth, str):
        return [ground_truth]
    return [str(g) for g in list(ground_truth)]


def trajectory(data_source: str, ground_truth: Any, extra_info: Mapping[str, Any]) -> Trajectory:
    """The trajectory to score, from the episode's outcome in `extra_info` (never from the text)."""
    payload = extra_info.get(OUTCOME_FIELD)
    if not isinstance(payload, Mapping):
        raise ValueError(f"extra_info has no {OUTCOME_FIELD!r} outcome: the rollout must use the plugsearch agent "
                         "loop (agent_name plugsearch_s3 / plugsearch_qagent, plugsearch/trainer/verl/agent_loop.yaml)")
    outcome = SearchOutcome.model_validate(dict(payload))
    item_id = extra_info.get("id")
    if not item_id:
        raise ValueError("extra_info.id is missing: build the parquet with `python -m plugsearch.trainer.verl.data`")
    golden = gold_answers(ground_truth)
    if not golden:
        raise ValueError(f"question {item_id} has no gold answers")
    item = QAItem(id=str(item_id), question=str(extra_info.get("question") or outcome.question),
                  golden_answers=golden, dataset=str(data_source or ""))
    return outcome_trajectory(item, outcome)


def _number(value: float | None) -> float:
    return math.nan if value is None else float(value)


def result(breakdown: RewardBreakdown, scored: Trajectory) -> dict[str, float]:
    """veRL's reward result: `score` (what GRPO optimises) and the parts, as `reward_extra_info`."""
    return {"score": breakdown.total, "reward": breakdown.reward, "format": breakdown.format_score,
            "genacc": breakdown.genacc, "em": breakdown.em, "f1": breakdown.f1,
            "baseline_genacc": _number(breakdown.baseline_genacc), "hit": _number(breakdown.hit),
            "documents": float(len(scored.documents))}


class BatchScorer:
    """`RewardComputer` over the services, with the trajectories that arrive within `gather_s` scored as
    one batch (veRL calls the reward function once per trajectory)."""

    def __init__(self, computer: RewardComputer, *, gather_s: float = GATHER_S) -> None:
        self.computer = computer
        self.gather_s = gather_s
        self.batches = 0
        self._pending: list[tuple[Trajectory, asyncio.Future[RewardBreakdown]]] = []
        self._tasks: set[asyncio.Task[None]] = set()

    async def score(self, scored: Trajectory) -> RewardBreakdown:
        loop = asyncio.get_running_loop()
        future: asyncio.Future[RewardBreakdown] = loop.create_future()
        self._pending.append((scored, future))
        if len(self._pending) == 1:
            loop.call_later(self.gather_s, self._flush)
        return await future

    def _flush(self) -> None:
        batch, self._pending = self._pending, []
        if batch:
            task = asyncio.get_running_loop().create_task(self._run(batch))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _run(self, batch: list[tuple[Trajectory, asyncio.Future[RewardBreakdown]]]) -> None:
        live = [(t, f) for t, f in batch if not f.done()]
        try:
            results = await self.computer.score([t for t, _ in live])
        except Exception as exc:  # every trajectory of the batch gets the failure
            for _, future in live:
                if not future.done():
                    future.set_exception(exc)
            return
        self.batches += 1
        for (_, future), breakdown in zip(live, results, strict=True):
            if not future.done():
                future.set_result(breakdown)


def _service_scorer() -> BatchScorer:
    settings = TrainerSettings()
    store = BaselineStore(settings.var_dir / "baselines", BaselineConfig(k=settings.baseline_k, method=settings.method),
                          redis_url=settings.redis_url)
    computer = RewardComputer(ServiceStack(settings), kind=settings.reward_kind("cuda"), baselines=store,
                              format_lambda=settings.format_lambda, method=settings.method)
    return BatchScorer(computer)


async def compute_score(data_source: str, solution_str: str, ground_truth: Any,
                        extra_info: Mapping[str, Any] | None = None, *, scorer: BatchScorer | None = None,
                        **kwargs: Any) -> dict[str, float]:
    """veRL reward function (async; `solution_str` is not read). Services, reward kind and baseline store
    come from the `TRAINER_*` settings; `scorer` is for tests."""
    item = trajectory(data_source, ground_truth, extra_info or {})
    scorer = scorer or per_loop("reward", _service_scorer)
    return result(await scorer.score(item), item)
