"""Chat LLM fakes (a scripted `chat`) driven as the policy they stand for: `ChatPolicy(llm)`, the one road every
policy takes (`act`)."""

from __future__ import annotations

from typing import Any

from plugsearch.common.schemas.searcher import SearchParams
from plugsearch.searcher.env import SearchOutcome
from plugsearch.searcher.loop import run_search as _run_search
from plugsearch.searcher.policy import ChatPolicy


def chat(llm: Any) -> ChatPolicy:
    """A fake chat LLM (any object with `model` and `chat`) as the searcher's policy."""
    return ChatPolicy(llm)


async def run_search(question: str, params: SearchParams, *, policy: Any, **kwargs: Any) -> SearchOutcome:
    """`plugsearch.searcher.loop.run_search` with a fake chat LLM as its policy (None: no policy, naive)."""
    return await _run_search(question, params, policy=None if policy is None else ChatPolicy(policy), **kwargs)


class NoPolicy:
    """A chat LLM for tests that only search naive: any call to it fails the test."""

    model = "unused"

    async def chat(self, *args: object, **kwargs: object) -> None:
        raise AssertionError("naive searches call no policy")

    async def check_health(self) -> str:
        return "ok"

    async def aclose(self) -> None:
        return None
