"""TRL `rollout_func`: multi-turn rollouts of the searcher's own loop (`services.searcher.loop.run_search`)
with the model being trained as the policy, tokenised with the environment mask.

TRL calls `rollout(prompts, trainer)` with the batch's prompts (each question repeated
`num_generations` times). All rollouts of the batch run concurrently on one event loop; their policy
calls are batched by `HFPolicy`, their retrievals go to the retriever service. The return value holds
`prompt_ids`, `completion_ids`, `logprobs=None` (TRL recomputes them), `env_mask` (TRL's tool mask:
0 on every token the environment inserted, so retrieved text carries no loss and no KL) and `search`
(the `SearchOutcome`s), which TRL forwards to the reward functions.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from typing import Any

from services.common.schemas.searcher import SearchParams
from services.searcher.env import RetrieverBackend, SearchOutcome
from services.searcher.loop import run_search
from trainer.policy import HFPolicy
from trainer.runner import AsyncRunner
from trainer.transcript import TokenizedTrajectory, tokenize_transcript

logger = logging.getLogger(__name__)


def prompt_text(prompt: Any) -> str:
    """The question of a TRL prompt: a plain string, or the last user message of a conversation."""
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[-1], dict):
        return str(prompt[-1].get("content", ""))
    raise TypeError(f"unsupported prompt type {type(prompt).__name__}")


def fill_empty(tokenized: TokenizedTrajectory, eos_id: int) -> TokenizedTrajectory:
    """TRL needs at least one completion token; a trajectory where the policy never spoke gets one
    masked end-of-turn token (no loss)."""
    if tokenized.completion_ids:
        return tokenized
    return TokenizedTrajectory(tokenized.prompt_ids, [eos_id], [0], tokenized.truncated)


class SearchRollout:
    """Callable `rollout_func(prompts, trainer)` for `trl.GRPOTrainer`."""

    __name__ = "search_rollout"

    def __init__(self, runner: AsyncRunner, retriever: RetrieverBackend, params: SearchParams, *,
                 max_completion_tokens: int = 1024, max_batch: int = 16) -> None:
        self.runner = runner
        self.retriever = retriever
        self.params = params
        self.max_completion_tokens = max_completion_tokens
        self.max_batch = max_batch
        self.last: list[tuple[SearchOutcome, TokenizedTrajectory]] = []

    async def run_batch(self, questions: Sequence[str], policy: HFPolicy) -> list[SearchOutcome]:
        try:
            return list(await asyncio.gather(*(run_search(q, self.params, policy=policy, retriever=self.retriever)
                                               for q in questions)))
        finally:
            await policy.aclose()

    def rollouts(self, questions: Sequence[str], model: Any, tokenizer: Any
                 ) -> list[tuple[SearchOutcome, TokenizedTrajectory]]:
        policy = HFPolicy(model, tokenizer, max_batch=self.max_batch)
        outcomes = self.runner.run(self.run_batch(questions, policy))
        out = []
        for outcome in outcomes:
            tokenized = tokenize_transcript(tokenizer, outcome.messages,
                                            max_completion_tokens=self.max_completion_tokens)
            out.append((outcome, fill_empty(tokenized, int(tokenizer.eos_token_id))))
        return out

    def __call__(self, prompts: list[Any], trainer: Any) -> dict[str, Any]:
        from trl.models import unwrap_model_for_generation

        questions = [prompt_text(p) for p in prompts]
        with unwrap_model_for_generation(trainer.model_wrapped, trainer.accelerator) as model:
            results = self.rollouts(questions, model, trainer.processing_class)
        self.last = results
        logger.info("rollouts: %s trajectories, %s policy tokens, %s inserted tokens", len(results),
                    sum(t.policy_tokens for _, t in results),
                    sum(len(t.completion_ids) - t.policy_tokens for _, t in results))
        return {
            "prompt_ids": [t.prompt_ids for _, t in results],
            "completion_ids": [t.completion_ids for _, t in results],
            "logprobs": None,
            "env_mask": [t.env_mask for _, t in results],
            "search": [o for o, _ in results],
        }
