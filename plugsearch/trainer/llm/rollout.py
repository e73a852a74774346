"""TRL `rollout_func`: the searcher's own environment (`plugsearch.searcher.env.SearchEnv`) driven at the
token level by the model being trained (`plugsearch.trainer.llm.episode.run_episode`).

All episodes of a batch run concurrently on one event loop; the sampler batches their policy calls
(`HFSampler`, or `VLLMSampler` over TRL's own vLLM when `use_vllm` is on); retrievals go to the retriever
service. TRL gets `prompt_ids`, `completion_ids` (the environment's turns appended as ids), `logprobs` (the
sampler's, or None), `env_mask` (0 on every inserted token: retrieved text carries no loss and no KL) and
`search` (the `SearchOutcome`s), which it forwards to the reward functions.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from dataclasses import KW_ONLY, dataclass, field
from typing import Any

from plugsearch.common.aio import AsyncRunner
from plugsearch.common.schemas.searcher import SearchParams
from plugsearch.searcher.env import RetrieverBackend
from plugsearch.searcher.prompts import PromptSet
from plugsearch.trainer.llm.episode import ChatTokens, Episode, TokenSampler, run_episode
from plugsearch.trainer.llm.samplers import BatchingSampler, HFSampler, VLLMSampler

logger = logging.getLogger(__name__)


def prompt_text(prompt: Any) -> str:
    """The question of a TRL prompt: a plain string, or the last user message of a conversation."""
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[-1], dict):
        return str(prompt[-1].get("content", ""))
    raise TypeError(f"unsupported prompt type {type(prompt).__name__}")


def sampler_for(trainer: Any, model: Any, tokenizer: Any, max_batch: int) -> BatchingSampler:
    """TRL's vLLM when the trainer runs one (colocate: its `LLM`; server: its client), else HF sampling."""
    generation = getattr(trainer, "vllm_generation", None) if getattr(trainer, "use_vllm", False) else None
    if generation is not None:
        if getattr(generation, "mode", None) == "colocate":
            return VLLMSampler(tokenizer, llm=generation.llm)
        return VLLMSampler(tokenizer, client=generation.vllm_client)
    return HFSampler(model, tokenizer, max_batch=max_batch)


@dataclass(eq=False)
class SearchRollout:
    """Callable `rollout_func(prompts, trainer)` for `trl.GRPOTrainer`."""

    runner: AsyncRunner
    retriever: RetrieverBackend
    params: SearchParams
    _: KW_ONLY
    prompts: PromptSet | None = None
    max_completion_tokens: int = 1024
    max_batch: int = 32
    last: list[Episode] = field(default_factory=list, init=False)
    seconds: list[float] = field(default_factory=list, init=False)
    """Wall seconds of every rollout batch (the `train_step` bench reads them)."""
    __name__ = "search_rollout"

    async def run_batch(self, questions: Sequence[str], sampler: TokenSampler, chat: ChatTokens) -> list[Episode]:
        try:
            return list(await asyncio.gather(*(
                run_episode(q, self.params, sampler=sampler, chat=chat, retriever=self.retriever,
                            prompts=self.prompts, max_completion_tokens=self.max_completion_tokens)
                for q in questions)))
        finally:
            if isinstance(sampler, BatchingSampler):
                await sampler.aclose()

    def episodes(self, questions: Sequence[str], sampler: TokenSampler, tokenizer: Any) -> list[Episode]:
        episodes = self.runner.run(self.run_batch(questions, sampler, ChatTokens(tokenizer)))
        eos = int(tokenizer.eos_token_id)
        for episode in episodes:
            if not episode.completion_ids:  # TRL needs one completion token: a masked end of turn
                episode.completion_ids, episode.env_mask = [eos], [0]
                episode.logprobs = [0.0] if episode.logprobs is not None else None
        return episodes

    def __call__(self, prompts: list[Any], trainer: Any) -> dict[str, Any]:
        from trl.models import unwrap_model_for_generation

        questions = [prompt_text(p) for p in prompts]
        tokenizer = trainer.processing_class
        t0 = time.perf_counter()
        with unwrap_model_for_generation(trainer.model_wrapped, trainer.accelerator) as model:
            episodes = self.episodes(questions, sampler_for(trainer, model, tokenizer, self.max_batch), tokenizer)
        self.seconds.append(time.perf_counter() - t0)
        self.last = episodes
        logger.info("rollouts: %s episodes, %s policy tokens, %s inserted tokens, %.1f s", len(episodes),
                    sum(e.policy_tokens for e in episodes),
                    sum(len(e.completion_ids) - e.policy_tokens for e in episodes), self.seconds[-1])
        logprobs = [e.logprobs for e in episodes] if all(e.logprobs is not None for e in episodes) else None
        return {
            "prompt_ids": [e.prompt_ids for e in episodes],
            "completion_ids": [e.completion_ids for e in episodes],
            "logprobs": logprobs,
            "env_mask": [e.env_mask for e in episodes],
            "search": [e.outcome for e in episodes],
        }
