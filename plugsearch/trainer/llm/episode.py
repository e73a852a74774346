"""The search environment driven at the token level: what TRL rollouts and veRL's agent loop train on.

The policy continues the exact token sequence so far and its sampled ids are kept as they are (mask 1);
what the environment answers is rendered with the policy's chat template and appended as ids (mask 0).
Nothing is re-tokenised after the fact, so the ids trained on are the ids that were sampled, and the
reward reads the documents from the environment's state, exactly what the searcher service returns. The
episode is driven by the searcher's own driver (`plugsearch.searcher.loop.drive`): the policy being trained is
a chat backend to it (`TokenPolicy`) that keeps the token sequence.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from plugsearch.common.llm import ChatMessage, ChatResult
from plugsearch.common.schemas.searcher import SearchParams
from plugsearch.searcher.env import PolicyCall, RetrieverBackend, SearchEnv, SearchOutcome
from plugsearch.searcher.loop import drive
from plugsearch.searcher.policy import ChatPolicy
from plugsearch.searcher.prompts import PromptSet

_MARK = "\u2063PLUGSEARCH\u2063"  # an assistant content no template rewrites, to find where content ends


class TemplateError(ValueError):
    """The chat template does not render a conversation as a prefix of its extension."""


@dataclass
class Sampled:
    """One policy output: the sampled ids (with the stop string or end-of-turn token when sampled), the
    text the environment parses, whether it ended at a stop string or end of turn, per-token logprobs."""

    ids: list[int]
    text: str
    stopped: bool
    logprobs: list[float] | None = None


class TokenSampler(Protocol):
    async def sample(self, ids: list[int], call: PolicyCall) -> Sampled: ...


class ChatTokens:
    """Renders the environment's messages as ids with the policy's chat template."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.eos_id: int | None = tokenizer.eos_token_id

    def _render(self, messages: Sequence[ChatMessage], generation_prompt: bool) -> str:
        return str(self.tokenizer.apply_chat_template([m.model_dump() for m in messages], tokenize=False,
                                                      add_generation_prompt=generation_prompt))

    def ids(self, text: str) -> list[int]:
        return [int(t) for t in self.tokenizer(text, add_special_tokens=False)["input_ids"]] if text else []

    def prompt(self, messages: Sequence[ChatMessage]) -> list[int]:
        """The first observation, up to and including the assistant header."""
        return self.ids(self._render(messages, True))

    def after_turn(self, history: Sequence[ChatMessage], added: Sequence[ChatMessage], *,
                   sampled_eos: bool) -> list[int]:
        """Ids the template puts after the policy's turn (its end-of-turn marker, unless the policy sampled
        it), then the environment's `added` messages and the next assistant header. `history` is the
        conversation before the policy's turn."""
        with_turn = [*history, ChatMessage(role="assistant", content=_MARK)]
        closed = self._render(with_turn, False)
        at = closed.rfind(_MARK)
        if at < 0:
            raise TemplateError("the chat template dropped the assistant content")
        tail = closed[at + len(_MARK):]
        nxt = self._render([*with_turn, *added], True)
        if not nxt.startswith(closed):
            raise TemplateError("chat template is not prefix-stable; cannot append the environment's turn")
        ids = self.ids(tail + nxt[len(closed):])
        if sampled_eos and ids and ids[0] == self.eos_id:
            ids = ids[1:]
        return ids


@dataclass
class Episode:
    outcome: SearchOutcome
    prompt_ids: list[int]
    completion_ids: list[int] = field(default_factory=list)
    env_mask: list[int] = field(default_factory=list)
    """1 = a token the policy sampled, 0 = a token the environment inserted."""
    logprobs: list[float] | None = None
    """Sampling logprobs aligned with `completion_ids` (0.0 on inserted tokens), when the sampler gives them."""
    sampled: list[list[int]] = field(default_factory=list)
    """Each policy output's sampled ids, in order (what `completion_ids` must contain at mask 1)."""
    truncated: bool = False

    @property
    def policy_tokens(self) -> int:
        return sum(self.env_mask)

    def masked_ids(self) -> list[int]:
        """The completion ids at mask 1: equal to the concatenated sampled ids unless truncated."""
        return [t for t, m in zip(self.completion_ids, self.env_mask, strict=True) if m]


class TokenPolicy:
    """The policy being trained as the chat backend the searcher's driver (`plugsearch.searcher.loop.drive`)
    asks: each call continues the exact token sequence so far with `sampler`, after appending as ids (mask 0)
    what the environment added since the last call (its turn rendered with the chat template). The ids
    sampled are kept as they are (mask 1); `episode` returns them with the outcome."""

    model = "trainee"

    def __init__(self, env: SearchEnv, sampler: TokenSampler, chat: ChatTokens) -> None:
        self.env = env
        self.sampler = sampler
        self.tokens = chat
        self.prompt_ids: list[int] | None = None
        self.completion: list[int] = []
        self.mask: list[int] = []
        self.logprobs: list[float] = []
        self.have_logprobs = True
        self.sampled: list[list[int]] = []
        self._history: list[ChatMessage] = []
        self._sampled_eos = False

    async def chat(self, messages: list[ChatMessage], *, temperature: float = 0.0, max_tokens: int = 256,
                   stop: list[str] | None = None, extra: dict[str, Any] | None = None) -> ChatResult:
        call = self.env.next_call()  # the sampler reads the environment's call (its grammar too), not `extra`
        if self.prompt_ids is None:
            self.prompt_ids = self.tokens.prompt(messages)
        else:  # the environment's turn since our last output: the messages after it
            added = messages[len(self._history) + 1:]
            inserted = self.tokens.after_turn(self._history, added, sampled_eos=self._sampled_eos)
            self.completion += inserted
            self.mask += [0] * len(inserted)
            self.logprobs += [0.0] * len(inserted)
        self._history = list(messages)
        out = await self.sampler.sample(self.prompt_ids + self.completion, call)
        self.sampled.append(list(out.ids))
        self.completion += out.ids
        self.mask += [1] * len(out.ids)
        if out.logprobs is None or len(out.logprobs) != len(out.ids):
            self.have_logprobs = False
        else:
            self.logprobs += out.logprobs
        self._sampled_eos = bool(out.ids) and out.ids[-1] == self.tokens.eos_id
        return ChatResult(text=out.text, finish_reason="stop" if out.stopped else "length", model=self.model)

    async def check_health(self) -> str:
        return "ok"

    async def aclose(self) -> None:
        return None

    def episode(self, outcome: SearchOutcome, max_completion_tokens: int | None = None) -> Episode:
        truncated = max_completion_tokens is not None and len(self.completion) > max_completion_tokens
        cut = max_completion_tokens if truncated else None
        return Episode(outcome=outcome, prompt_ids=self.prompt_ids or [], completion_ids=self.completion[:cut],
                       env_mask=self.mask[:cut],
                       logprobs=self.logprobs[:cut] if self.have_logprobs and self.sampled else None,
                       sampled=self.sampled, truncated=truncated)


async def run_episode(question: str, params: SearchParams, *, sampler: TokenSampler, chat: ChatTokens,
                      retriever: RetrieverBackend, prompts: PromptSet | None = None,
                      max_completion_tokens: int | None = None) -> Episode:
    """One search, token level. The completion is cut at `max_completion_tokens` (`truncated`); the search
    itself always runs to its end, so the reward sees the documents the service would return."""
    env = SearchEnv(question, params, retriever, prompts=prompts)
    return await episode_in(env, sampler, chat, max_completion_tokens=max_completion_tokens)


async def episode_in(env: SearchEnv, sampler: TokenSampler, chat: ChatTokens, *,
                     max_completion_tokens: int | None = None) -> Episode:
    """`run_episode` on a given (fresh) environment, driven by the searcher's own driver."""
    policy = TokenPolicy(env, sampler, chat)
    outcome = await drive(env, ChatPolicy(policy))
    return policy.episode(outcome, max_completion_tokens)
