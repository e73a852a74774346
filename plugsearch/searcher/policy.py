"""The policy a searcher serves, as the service sees it: one interface, two implementations.

`SearcherPolicy` is everything the serving code needs to know about a policy besides driving it: its name
(`model`, part of the cache key), the modes it searches in, the setting it was trained in (`setting`: the
defaults of its mode-s3 searches, read from its manifest), whether its searches call an LLM (LLM slots),
the methods of its first retrieval given what the retriever serves (`first_retrieval`), what a search costs
(`cost`), and which requests it refuses (`check_request`); and, as every policy, its next action in a search
(`act`, what `loop.run_search` drives: one road for every policy).

- `ChatPolicy`: a chat LLM behind any OpenAI-compatible endpoint (`SEARCHER_POLICY_KIND=llm`): s3 and QAgent;
  its `act` samples an output as the environment's `next_call()` says and parses it into an action (the
  environment re-prompts an invalid one); the setting of its manifest where it has one (the LoRA searcher),
  else the service's own defaults; `search_cost` per search.
- `plugsearch.searcher.compact.CompactPolicy`: the compact learned policy, in the searcher's process (the
  default): s3 only, the setting of its manifest, one cost unit per retrieval.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from pydantic import BaseModel, Field, model_validator

from plugsearch.common.llm import LLMBackend
from plugsearch.common.schemas.searcher import (
    MAX_RETRIEVE_K,
    MAX_TURNS,
    Method,
    SearchMode,
    SearchParams,
    check_select_k,
    search_cost,
)
from plugsearch.searcher import parsing
from plugsearch.searcher.env import Action, SearchEnv


class PolicyRefusal(ValueError):
    """A request this policy cannot serve as asked (a 400 for the caller): `param` names the field."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


class PolicySetting(BaseModel):
    """The search setting a policy was trained in (its manifest's `search`, plus the dense encoder its pool's
    dense block needs): the defaults of its mode-s3 searches wherever the service runs."""

    retrieve_k: int = Field(..., ge=1, le=MAX_RETRIEVE_K, description="documents per retrieval (the pool size)")
    select_k: int = Field(..., ge=1, le=MAX_RETRIEVE_K, description="documents returned")
    max_turns: int = Field(..., ge=0, le=MAX_TURNS, description="follow-up searches at most")
    method: Method | None = Field(None, description="the method of its follow-up searches; None: the retriever's")
    pool_methods: list[Method] | None = Field(None, min_length=1, max_length=3, description=(
        "the methods of its first retrieval, one block each (the pool it was trained on)"))
    encoder: str | None = Field(None, description="the dense encoder the pool's dense block must come from")

    @model_validator(mode="after")
    def _check(self) -> PolicySetting:
        check_select_k(None, self.select_k, self.retrieve_k)
        return self

    def defaults(self) -> dict[str, Any]:
        """The `SearchParams` fields it sets (`pool_methods` is decided per search: `first_retrieval`)."""
        return {"retrieve_k": self.retrieve_k, "select_k": self.select_k, "max_turns": self.max_turns,
                "method": self.method}


class SearcherPolicy(Protocol):
    """What `plugsearch.searcher.serving.SearchService` asks of the policy it serves."""

    @property
    def model(self) -> str:
        """`policy_model` of its responses (part of the cache key)."""
        ...

    @property
    def modes(self) -> tuple[SearchMode, ...]:
        """The loop modes it can drive (naive needs no policy and is always served)."""
        ...

    @property
    def setting(self) -> PolicySetting | None:
        """The setting it was trained in (the defaults of its s3 searches); None: the service's defaults."""
        ...

    @property
    def manifest(self) -> Mapping[str, Any]:
        """How it was trained (empty when unknown): the corpus it is bound to, if any, is checked against the
        retriever's (`plugsearch.searcher.policy_corpus`)."""
        ...

    async def act(self, env: SearchEnv) -> Action:
        """Its next action in `env` (what `plugsearch.searcher.loop.run_search` drives)."""
        ...

    def uses_llm(self, mode: SearchMode) -> bool:
        """Whether a search in `mode` calls an LLM (and so holds one of the LLM's slots)."""
        ...

    def first_retrieval(self, served: Sequence[str] | None, encoder: str | None) -> list[Method] | None:
        """The methods of an s3 search's first retrieval on a retriever that serves `served` with dense
        `encoder` (None: `SearchParams.method` alone)."""
        ...

    def cost(self, params: SearchParams, question_chars: int) -> float:
        """Cost units of one search in a loop mode (admission, per-request bound, budgets: `search_cost` of the
        retrievals it makes and its LLM calls); the same whatever the retriever serves at the moment, so the
        guess before a search is what it is charged."""
        ...

    def check_request(self, params: SearchParams, *, method_asked: Method | None) -> None:
        """Raise `PolicyRefusal` for a search it cannot run as asked (`method_asked`: the request's own
        `method`, None when it set none)."""
        ...

    async def check_health(self) -> Any: ...

    async def aclose(self) -> None: ...


class ChatPolicy:
    """A chat LLM as the searcher's policy (s3 and QAgent): each action one sampled output, parsed. Its setting
    is its manifest's `search` (the LoRA searcher's, `manifest`), else the service's own defaults; `search_cost`
    per search."""

    modes: tuple[SearchMode, ...] = ("s3", "qagent")

    def __init__(self, llm: LLMBackend, manifest: Mapping[str, Any] | None = None) -> None:
        self.llm = llm
        self.manifest: Mapping[str, Any] = manifest or {}
        self.setting: PolicySetting | None = read_chat_setting(self.manifest)

    @property
    def model(self) -> str:
        return self.llm.model

    async def act(self, env: SearchEnv) -> Action:
        """One output sampled as `env.next_call()` says from the transcript, parsed into an action against the
        newest block (`parse_output`)."""
        call = env.next_call()
        result = await self.llm.chat(list(env.messages), temperature=call.temperature, max_tokens=call.max_tokens,
                                     stop=call.stop, extra=call.extra)
        return parse_output(env, result.text, stopped=result.finish_reason == "stop")

    def uses_llm(self, mode: SearchMode) -> bool:
        return mode != "naive"

    def first_retrieval(self, served: Sequence[str] | None, encoder: str | None) -> list[Method] | None:
        return None

    def cost(self, params: SearchParams, question_chars: int) -> float:
        return search_cost(params, question_chars)

    def check_request(self, params: SearchParams, *, method_asked: Method | None) -> None:
        if params.mode != "naive" and params.mode not in self.modes:
            raise PolicyRefusal(f"this searcher's policy ({self.model}) does not search in mode {params.mode}",
                                param="mode")

    async def check_health(self) -> Any:
        return await self.llm.check_health()

    async def aclose(self) -> None:
        await self.llm.aclose()


def read_chat_setting(manifest: Mapping[str, Any]) -> PolicySetting | None:
    """The setting an LLM policy's manifest records (`search`: retrieve_k, select_k, max_turns, optionally method),
    None when it records none (the service's own defaults). Raises `ValueError` saying what is wrong."""
    recorded = manifest.get("search")
    if recorded is None:
        return None
    if not isinstance(recorded, Mapping):
        raise ValueError(f"the manifest's `search` must be an object, not {type(recorded).__name__}")
    fields = {k: recorded[k] for k in ("retrieve_k", "select_k", "max_turns", "method") if k in recorded}
    missing = [k for k in ("retrieve_k", "select_k", "max_turns") if k not in fields]
    if missing:
        raise ValueError(f"the manifest's `search` lacks {', '.join(missing)}")
    return PolicySetting(**fields)


def parse_output(env: SearchEnv, output: str, *, stopped: bool) -> Action:
    """An LLM's raw output (`stopped`: it ended at a stop string or the end of its turn) as the action it asks
    for in `env`'s mode: s3, a search of its query or the stop, with the `<important_info>` marks of the newest
    block (a tag whose ids are all out of range marks nothing; `[]` marks it empty); QAgent, a round of its
    queries or the answer. An output that asks for nothing is a search without a query: the environment
    counts it invalid and re-prompts."""
    p = env.params
    if p.mode == "s3":
        text = parsing.postprocess(output, "query", stopped=stopped)
        current = len(env.blocks) - 1
        parsed = parsing.parse_s3(text, n_docs=len(env.blocks[current].documents), select_k=p.select_k)
        selection = parsed.selection
        marks = selection is not None and bool(selection.ids or selection.explicit_empty)
        return Action("complete" if parsed.kind == "complete" else "search", query=parsed.query,
                      selected=tuple((current, i) for i in selection.ids) if marks and selection else (),
                      marked=(current,) if marks else (), text=text,
                      selection_ok=selection is not None and not selection.out_of_range)
    text = parsing.postprocess(output, "search", stopped=stopped)
    parsed_q = parsing.parse_qagent(text, max_queries=p.max_queries_per_round)
    return Action("complete" if parsed_q.kind == "complete" else "search", queries=tuple(parsed_q.queries),
                  marked=(), text=text)
