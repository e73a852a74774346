"""The driver of the search environment: `run_search` drives a `SearchEnv` (`plugsearch.searcher.env`) with any
policy, the one way: the policy's `act(env)` gives an `Action`, the environment takes it (`env.act`), until
the search ends. It is the one driver: the trainers drive their episodes through `drive` too (the LLM trainer
with a chat policy over a backend that samples token ids, `plugsearch.trainer.llm.episode`; the compact trainer with its
sampling policy and its demonstrator, `plugsearch.trainer.compact`), so what they reward and evaluate is what the service
returns.

`SearchOutcome.messages` is the exact transcript: with an LLM policy (`plugsearch.searcher.policy.ChatPolicy`),
the i-th message, when an assistant one, came from `chat(messages[:i], ...)`. Every policy is held to the
search's time budget (`params.timeout_s`); its error (an upstream's error or timeout, or any fault of its own)
or the budget spent ends the search degraded by the environment's one rule (`SearchEnv.degrade`: what the
policy committed to at the document budget, else naive top-k); only a failed first retrieval raises.
With tracing on (`plugsearch.common.tracing`), the search and each policy step are spans (each retrieval is
one too: `SearchEnv`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Protocol

from plugsearch.common import tracing
from plugsearch.common.errors import ServiceError
from plugsearch.common.schemas.searcher import SearchParams, StopReason
from plugsearch.searcher.env import Action, EventSink, RetrieverBackend, SearchEnv, SearchOutcome
from plugsearch.searcher.prompts import PromptSet

logger = logging.getLogger(__name__)


class ActingPolicy(Protocol):
    """What the driver asks of a policy: its name and its next action in the environment."""

    @property
    def model(self) -> str: ...

    async def act(self, env: SearchEnv) -> Action: ...


class _PolicyFailed(Exception):
    def __init__(self, reason: StopReason, message: str) -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message


def _time_left(deadline: float | None) -> float | None:
    """Seconds left before the search's deadline (None: no deadline); raises `_PolicyFailed` once it has passed."""
    remaining = None if deadline is None else max(0.0, deadline - time.perf_counter())
    if remaining is not None and remaining <= 0:
        raise _PolicyFailed("deadline", "search time budget spent")
    return remaining


async def _act(env: SearchEnv, policy: ActingPolicy, deadline: float | None) -> Action:
    """The policy's next action; raises `_PolicyFailed` on its error (an upstream's error or timeout, or a fault
    of its own, logged with its trace) or past the deadline."""
    remaining = _time_left(deadline)
    t0 = time.perf_counter()
    try:
        async with asyncio.timeout(remaining):
            return await policy.act(env)
    except TimeoutError as exc:
        raise _PolicyFailed("deadline", "policy did not act within the search time budget") from exc
    except ServiceError as exc:  # the policy's upstream (its LLM) failed
        reason: StopReason = "policy_timeout" if exc.status == 504 else "policy_error"
        raise _PolicyFailed(reason, f"policy failed: {exc.message}") from exc
    except Exception as exc:  # a fault of the policy itself: the search degrades, the log keeps the trace
        logger.exception("policy %s failed", policy.model)
        raise _PolicyFailed("policy_error", f"policy failed ({type(exc).__name__})") from exc
    finally:
        env.record_policy_call(time.perf_counter() - t0)


async def run_search(question: str, params: SearchParams, *, policy: ActingPolicy | None,
                     retriever: RetrieverBackend, prompts: PromptSet | None = None,
                     on_event: EventSink | None = None) -> SearchOutcome:
    """Run one search in `params.mode` (naive needs no policy). Raises only when no document at all
    could be retrieved. `on_event` sees every retrieval, action and the end as they happen."""
    with tracing.span("searcher.search", _search_attributes(params, policy)) as span:
        outcome = await _drive(SearchEnv(question, params, retriever, prompts=prompts, on_event=on_event),
                               params, policy)
        if span.is_recording():
            span.set_attributes({"plugsearch.stop_reason": outcome.stop_reason, "plugsearch.turns": outcome.turns,
                                 "plugsearch.queries": len(outcome.queries),
                                 "plugsearch.documents": len(outcome.documents), "plugsearch.degraded": outcome.degraded})
    return outcome


async def drive(env: SearchEnv, policy: ActingPolicy | None) -> SearchOutcome:
    """Drive a fresh environment (`env.params`) to its end with `policy`: `run_search` without its span, for
    callers that hold the environment (the trainers' episodes, whose policies read its state)."""
    return await _drive(env, env.params, policy)


async def _drive(env: SearchEnv, params: SearchParams, policy: ActingPolicy | None) -> SearchOutcome:
    deadline = None if params.timeout_s is None else time.perf_counter() + params.timeout_s
    await env.reset()
    while not env.done:
        if policy is None:
            raise ValueError(f"mode {params.mode} needs a policy")
        with tracing.span("searcher.policy_step", {"plugsearch.step": env.turns + 1}) as span:
            try:
                action = await _act(env, policy, deadline)
            except _PolicyFailed as exc:
                span.set_attribute("plugsearch.policy_failed", exc.reason)
                env.degrade(exc.reason, exc.message)
                break
            await env.act(action)
            if span.is_recording():
                span.set_attributes({"plugsearch.action": action.kind, "plugsearch.valid_actions": env.valid,
                                     "plugsearch.invalid_actions": env.invalid, "plugsearch.done": env.done})
    outcome = await env.finish()
    if policy is not None and params.mode != "naive":
        outcome.policy_model = policy.model
    return outcome


def _search_attributes(params: SearchParams, policy: object) -> tracing.Attributes | None:
    """The search's span: its mode, budget and policy (None while not tracing)."""
    if not tracing.enabled():
        return None
    return {"plugsearch.mode": params.mode, "plugsearch.max_turns": params.max_turns,
            "plugsearch.retrieve_k": params.retrieve_k, "plugsearch.select_k": params.select_k,
            "plugsearch.policy": str(getattr(policy, "model", "none")) if params.mode != "naive" else "none"}
