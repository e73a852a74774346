"""veRL's multi-turn rollout = the search environment the searcher service runs.

`PlugsearchAgentLoop` (a veRL 0.9.1 agent loop, registered as `plugsearch_s3` / `plugsearch_qagent` by
`agent_loop.yaml`) runs `plugsearch.trainer.llm.episode.run_episode`, the same `SearchEnv` and prompts as `POST /search`,
sampled through veRL's rollout servers by `ServerSampler`: sampled ids mask 1, the environment's turns
mask 0, so retrieved text carries no loss and no KL. The reward never reads the transcript: the episode's
`SearchOutcome` travels in `extra_fields[OUTCOME_FIELD]` to `plugsearch.trainer.verl.reward.compute_score`. The
question comes from `extra_info.question`; the first observation is rebuilt by `SearchEnv.reset()`.
Importable without veRL (tests, the CPU trainer): stand-ins with the same fields then.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from typing import Any
from uuid import uuid4

from pydantic import BaseModel

from plugsearch.common.clients import RetrieverClient
from plugsearch.common.schemas.searcher import SearchParams
from plugsearch.searcher.env import PolicyCall, RetrieverBackend
from plugsearch.searcher.prompts import PromptSet
from plugsearch.searcher.retrieval import ServiceRetriever
from plugsearch.trainer.common.settings import TrainerSettings
from plugsearch.trainer.llm.episode import ChatTokens, Episode, Sampled, run_episode
from plugsearch.trainer.llm.samplers import engine_output
from plugsearch.trainer.verl.shared import per_loop

logger = logging.getLogger(__name__)

OUTCOME_FIELD = "plugsearch"
"""Key of the episode's outcome in `AgentLoopOutput.extra_fields` (and so in the reward's `extra_info`)."""

try:  # pragma: no cover - exercised where veRL is installed (the trainer-verl image, the check venv)
    from verl.experimental.agent_loop.agent_loop import (
        AgentLoopBase,
        AgentLoopMetrics,
        AgentLoopOutput,
        register,
    )
except ImportError:  # stand-ins: the fields and __init__ of veRL 0.9.1's classes that this loop uses
    class AgentLoopMetrics(BaseModel):  # type: ignore[no-redef]
        generate_sequences: float = 0.0
        tool_calls: float = 0.0
        compute_score: float = 0.0
        num_preempted: int = -1

    class AgentLoopOutput(BaseModel):  # type: ignore[no-redef]
        prompt_ids: list[int]
        response_ids: list[int]
        response_mask: list[int]
        response_logprobs: list[float] | None = None
        reward_score: float | None = None
        num_turns: int = 0
        metrics: AgentLoopMetrics
        extra_fields: dict[str, Any] = {}

    class AgentLoopBase:  # type: ignore[no-redef]
        def __init__(self, trainer_config: Any, server_manager: Any, tokenizer: Any, *args: Any,
                     **kwargs: Any) -> None:
            self.config = trainer_config.config
            self.rollout_config = self.config.actor_rollout_ref.rollout
            self.server_manager = server_manager
            self.tokenizer = tokenizer

    def register(agent_name: str) -> Any:  # type: ignore[no-redef]
        return lambda cls: cls


class RolloutAborted(RuntimeError):
    """The rollout server aborted a request and returned nothing to continue from."""


class ServerSampler:
    """`TokenSampler` over veRL's LLM server manager. veRL's sampling settings are kept; the environment's
    call adds its stop strings and token budget, cut to what is left of `max_model_len`. With no room left
    the output is empty, which the environment counts as an invalid action, so an over-long episode ends
    with the documents it has instead of failing the step."""

    def __init__(self, server_manager: Any, tokenizer: Any, sampling_params: Mapping[str, Any], *,
                 request_id: str | None = None, max_model_len: int | None = None, engine: str = "vllm") -> None:
        self.server_manager = server_manager
        self.tokenizer = tokenizer
        self.sampling_params = {k: v for k, v in sampling_params.items()
                                if k not in ("max_tokens", "max_new_tokens", "stop")}
        self.request_id = request_id or uuid4().hex  # one id per episode: sticky to one server (prefix cache)
        self.max_model_len = max_model_len
        self.engine = engine
        self.calls = 0

    def request(self, ids: list[int], call: PolicyCall) -> dict[str, Any] | None:
        """The sampling parameters of one call, or None when the context has no room left."""
        if call.grammar is not None:
            raise ValueError("constrained decoding is not supported in veRL rollouts (set constrained: false)")
        budget = call.max_tokens
        if self.max_model_len is not None:
            budget = min(budget, self.max_model_len - len(ids))
        if budget < 1:
            return None
        params = dict(self.sampling_params)
        params["stop"] = list(call.stop)
        if self.engine == "sglang":
            params.update(max_new_tokens=budget, no_stop_trim=True)
        else:
            params.update(max_tokens=budget, include_stop_str_in_output=True)
        return params

    async def sample(self, ids: list[int], call: PolicyCall) -> Sampled:
        params = self.request(ids, call)
        if params is None:
            logger.warning("episode %s: context full at %s tokens, no policy output", self.request_id, len(ids))
            return Sampled(ids=[], text="", stopped=False, logprobs=[])
        self.calls += 1
        out = await self.server_manager.generate(request_id=self.request_id, prompt_ids=list(ids),
                                                 sampling_params=params)
        token_ids = [int(t) for t in out.token_ids]
        if out.stop_reason == "aborted" and not token_ids:
            raise RolloutAborted(f"rollout server aborted request {self.request_id}")
        logprobs = [float(x) for x in out.log_probs] if out.log_probs else None
        return engine_output(self.tokenizer, token_ids, logprobs, stop=list(call.stop))


def _plain(value: Any) -> Any:
    """Hydra hands nested config as DictConfig; plain dicts for pydantic."""
    if isinstance(value, Mapping) or hasattr(value, "items"):
        return {str(k): _plain(v) for k, v in value.items()}
    return value


def episode_output(episode: Episode, *, prompt_length: int, logprobs: bool) -> AgentLoopOutput:
    """veRL's output for one episode: prompt, response (policy ids mask 1, environment ids mask 0), the
    sampling logprobs when veRL asked for them, and the outcome for the reward."""
    if len(episode.prompt_ids) > prompt_length:
        raise ValueError(f"the first observation has {len(episode.prompt_ids)} tokens, more than "
                         f"rollout.prompt_length {prompt_length}: raise data.max_prompt_length or cut documents "
                         "with the agent loop's search.doc_chars")
    outcome = episode.outcome
    metrics = AgentLoopMetrics(generate_sequences=outcome.timings.policy_ms / 1000,
                               tool_calls=outcome.timings.retrieval_ms / 1000)
    return AgentLoopOutput(
        prompt_ids=list(episode.prompt_ids), response_ids=list(episode.completion_ids),
        response_mask=list(episode.env_mask),
        response_logprobs=list(episode.logprobs) if logprobs and episode.logprobs is not None else None,
        num_turns=len(outcome.messages), metrics=metrics,
        # the outcome travels to the reward as plain JSON types; the transcript stays behind
        extra_fields={OUTCOME_FIELD: outcome.model_dump(mode="json", exclude={"messages"}), "turn_scores": [],
                      "tool_rewards": []})


def service_retriever() -> RetrieverBackend:
    """The retriever service (`TRAINER_RETRIEVER__URL` / `__TOKEN`), one client per worker event loop;
    concurrent episodes' retrievals are merged into batched requests."""
    return per_loop("retriever", lambda: ServiceRetriever(RetrieverClient(TrainerSettings().retriever)))


@register("plugsearch_s3")
class PlugsearchAgentLoop(AgentLoopBase):  # type: ignore[misc]
    """One search episode per trajectory. Keyword arguments (from `agent_loop.yaml`): `search` (fields of
    `SearchParams`: mode, max_turns, retrieve_k, select_k, max_new_tokens, doc_chars, ...), `prompts_dir`
    (a prompt set folder, as `SEARCHER_PROMPTS_DIR`; default: the packaged prompts)."""

    def __init__(self, *args: Any, search: Mapping[str, Any] | None = None, prompts_dir: str | None = None,
                 retriever: RetrieverBackend | None = None, **kwargs: Any) -> None:
        kwargs.pop("name", None)  # the registry entry's own name
        kwargs.pop("_target_", None)
        super().__init__(*args, **kwargs)
        self.params = SearchParams.model_validate(_plain(search or {}))
        if self.params.constrained:
            raise ValueError("constrained decoding is not supported in veRL rollouts (set search.constrained: false)")
        self.prompts = PromptSet.load(prompts_dir)
        self.retriever = retriever
        self.chat = ChatTokens(self.tokenizer)
        rollout = self.rollout_config
        self.prompt_length = int(rollout.prompt_length)
        self.response_length = int(rollout.response_length)
        self.max_model_len = int(rollout.get("max_model_len") or self.prompt_length + self.response_length)
        self.engine = str(rollout.get("name") or "vllm")

    async def run(self, sampling_params: dict[str, Any], **kwargs: Any) -> AgentLoopOutput:
        extra = _plain(kwargs.get("extra_info") or {})
        question = str(extra.get("question") or "").strip()
        if not question:
            raise ValueError("extra_info.question is missing: build the parquet with `python -m plugsearch.trainer.verl.data`")
        version = extra.get("prompt_version")
        if version is not None and version != self.prompts.version:
            raise ValueError(f"the parquet was built with prompt set {version}, the rollout uses {self.prompts.version}:"
                             " rebuild it with the same prompts")
        sampler = ServerSampler(self.server_manager, self.tokenizer, sampling_params,
                                max_model_len=self.max_model_len, engine=self.engine)
        t0 = time.perf_counter()
        episode = await run_episode(question, self.params, sampler=sampler, chat=self.chat,
                                    retriever=self.retriever or service_retriever(), prompts=self.prompts,
                                    max_completion_tokens=self.response_length)
        logger.debug("episode %s: %s policy calls, %s response tokens, %.2f s", sampler.request_id, sampler.calls,
                     len(episode.completion_ids), time.perf_counter() - t0)
        return episode_output(episode, prompt_length=self.prompt_length,
                              logprobs=bool(sampling_params.get("logprobs")))
