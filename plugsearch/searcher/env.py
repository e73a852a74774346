"""One search as an environment: s3, QAgent and naive top-k behind `reset()` / `act(action)`.

Every driver uses this one object: the searcher service (`plugsearch.searcher.loop.run_search`), TRL rollouts and
veRL's agent loop (`plugsearch.trainer.llm.episode`, a token-level LLM policy) and the compact trainer's episodes. The
environment never calls the policy: the driver asks the policy for its next `Action` (`policy.act(env)`: the
compact policy decides from the state; an LLM policy samples as `next_call()` says from `messages` and parses
its output into an action, `plugsearch.searcher.policy.ChatPolicy`) and hands it to `act`, the one path every
action takes, under one set of rules for every policy; the documents come from the state (`documents()`),
never parsed back out of a transcript.

The rules. s3 (pat-jj/s3): naive top-k of the question first (one block per method of `pool_methods`); then up
to `max_turns` steps, each a search, a stop with a selection, or an invalid action (no query, or a query
already searched: a turn spent, re-prompted, at most `max_invalid` in a row, then the end); after the last
search one more step to mark the last block (only the selection counts); documents by s3's extraction rule
(`select_documents`). QAgent: plan -> search -> information -> reflection, up to `max_turns` rounds; the
documents are the union of every block, and a run that retrieved nothing falls back to the naive top-k.

Degradation, one rule for every policy (`degrade`): when a search cannot finish (the policy's error or
timeout, the search's deadline, the retriever failing after the first retrieval) it returns what the policy
committed to at the document budget: s3, the documents it marked, else naive top-`select_k` of the first
retrieval; QAgent, what its rounds retrieved, else the naive top-k. A failed first retrieval raises.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from pydantic import BaseModel, Field

from plugsearch.common import tracing
from plugsearch.common.errors import ServiceError
from plugsearch.common.llm import ChatMessage
from plugsearch.common.schemas.base import Document
from plugsearch.common.schemas.searcher import (
    SearchedDocument,
    SearchMode,
    SearchParams,
    StageTimings,
    StopReason,
)
from plugsearch.searcher import parsing
from plugsearch.searcher.grammar import grammar_request, qagent_grammar, s3_grammar
from plugsearch.searcher.prompts import PROMPT_VERSION, PromptSet


class RetrieverBackend(Protocol):
    async def retrieve(self, queries: list[str], k: int, method: str | None) -> list[list[Document]]: ...


class InfoBlock(BaseModel):
    """One `<information>` block the policy saw."""

    turn: int
    queries: list[str]
    documents: list[SearchedDocument]
    selected: list[int] | None = Field(None, description="1-based ids marked by <important_info>; None = no tag")
    method: str | None = Field(None, description="the retrieval method (None: the retriever's default)")


class SearchOutcome(BaseModel):
    question: str
    mode: SearchMode
    documents: list[SearchedDocument]
    queries: list[str] = Field(default_factory=list, description="queries issued by the policy, in order")
    turns: int = Field(0, description="policy steps taken")
    stop_reason: StopReason
    degraded: bool = False
    degraded_reason: str | None = None
    timings: StageTimings = Field(default_factory=StageTimings)
    valid_actions: int = 0
    invalid_actions: int = 0
    messages: list[ChatMessage] = Field(default_factory=list)
    blocks: list[InfoBlock] = Field(default_factory=list)
    prompt_version: str = PROMPT_VERSION
    policy_model: str | None = None


@dataclass(frozen=True)
class PolicyCall:
    """How to sample the next policy output: stop strings, token budget, temperature and, with
    constrained decoding, the grammar (`extra` is that grammar in the backend's request field)."""

    stop: list[str]
    max_tokens: int
    temperature: float
    grammar: str | None = None
    extra: dict[str, Any] | None = None


@dataclass(frozen=True)
class Action:
    """A policy's step, the one thing `SearchEnv.act` takes from any policy.

    `search`: s3 searches `query`; QAgent a round of `queries` (or `query`). `complete`: the end. `selected`:
    the documents it marks, as (block index, 1-based position) pairs, in order; `marked`: the blocks whose marks
    it sets (a block keeps the first marks it gets), None: a final selection, every block (a block it names no
    document of is marked empty) with `complete`, the blocks `selected` names otherwise. `prefetch` (with an s3
    search): queries the policy may search next; the environment retrieves them with `query`, in one request,
    and a later search of one of them takes its documents from there (the same documents, one round trip
    fewer; a guess that is never searched costs a retrieval). `text`: what the policy wrote (the transcript's
    assistant message; None: the action written in s3's tags). `selection_ok`: whether it wrote a usable
    selection (at s3's last step only the selection counts)."""

    kind: Literal["search", "complete"]
    query: str | None = None
    selected: tuple[tuple[int, int], ...] = ()
    prefetch: tuple[str, ...] = ()
    queries: tuple[str, ...] = ()
    marked: tuple[int, ...] | None = None
    text: str | None = None
    selection_ok: bool = True


@dataclass(frozen=True)
class SearchEvent:
    """Something the search did, for progress streams: `retrieval` (a block of documents arrived),
    `action` (the policy acted: its kind, query, marked ids) or `end` (the stop reason)."""

    type: str
    turn: int
    data: dict[str, Any] = field(default_factory=dict)


EventSink = Callable[[SearchEvent], None]


def _dedupe(docs: Sequence[SearchedDocument]) -> list[SearchedDocument]:
    kept: dict[str, SearchedDocument] = {}
    for doc in docs:
        kept.setdefault(" ".join(doc.text.split()), doc)  # the first of equal texts
    return list(kept.values())


def select_documents(blocks: Sequence[InfoBlock]) -> list[SearchedDocument]:
    """s3's extraction (`rag_2.extract_titles_and_texts`): first the marked documents of every block that
    has an `<important_info>` tag (in the order the tags were written), then every document of the
    blocks without one; deduplicated by content, first occurrence kept."""
    ordered: list[SearchedDocument] = []
    for block in blocks:
        if block.selected is not None:
            ordered.extend(block.documents[i - 1] for i in block.selected if 1 <= i <= len(block.documents))
    for block in blocks:
        if block.selected is None:
            ordered.extend(block.documents)
    return _dedupe(ordered)


_SEARCHED_FIELDS = set(SearchedDocument.model_fields)
"""Every field of a `SearchedDocument` (given to `model_construct`, which then need not work them out)."""


def _as_query(text: str) -> str:
    """A structured action's query as searched: whitespace collapsed, cut to `parsing.MAX_QUERY_CHARS`."""
    return " ".join(text.split())[:parsing.MAX_QUERY_CHARS]


class SearchEnv:
    """One search: `await reset()`, then while not `done`: `await act(policy's action)`; finally
    `await finish()` for the `SearchOutcome`."""

    def __init__(self, question: str, params: SearchParams, retriever: RetrieverBackend, *,
                 prompts: PromptSet | None = None, on_event: EventSink | None = None) -> None:
        self.question = question
        self.params = params
        self.retriever = retriever
        self.prompts = prompts or PromptSet.packaged()
        self.on_event = on_event
        self.messages: list[ChatMessage] = []
        self.blocks: list[InfoBlock] = []
        self.queries: list[str] = []
        self.seen_queries: set[str] = set()
        self.timings = StageTimings()
        self.valid = 0
        self.invalid = 0
        self.turns = 0
        """Policy actions taken (`act` calls)."""
        self.done = False
        self.stop_reason: StopReason = "max_turns"
        self.degraded_reason: str | None = None
        self._steps = 0  # s3: search turns spent (invalid ones count); qagent: rounds
        self._prefetched: dict[str, list[Document]] = {}
        """documents of queries retrieved ahead (`Action.prefetch`), by query"""
        self._in_a_row = 0
        self._started = time.perf_counter()

    # ----------------------------------------------------------------------------------- lifecycle
    async def reset(self) -> list[ChatMessage]:
        """The first observation (the messages the policy's first call sees). Raises when the first
        retrieval fails: without it there is nothing to return."""
        p = self.params
        if p.mode == "naive":
            await self._add_block(0, [self.question])
            self._end("naive")
            return []
        if p.mode == "s3":
            block = await self._add_pool()
            self.seen_queries.add(parsing.normalize_query(self.question))  # searching the question is a repeat
            self.messages = [
                ChatMessage(role="system", content=self.prompts.render("s3", "system", select_k=p.select_k)),
                ChatMessage(role="user", content=self.prompts.render("s3", "initial", question=self.question,
                                                        information=parsing.format_documents(
                                                            block.documents, max_chars=p.doc_chars))),
            ]
        else:
            self.messages = [
                ChatMessage(role="system", content=self.prompts.render("qagent", "system", max_turns=p.max_turns,
                                                          max_queries=p.max_queries_per_round)),
                ChatMessage(role="user", content=self.prompts.render("qagent", "question", question=self.question)),
            ]
            if p.max_turns <= 0:
                self._end("max_turns")
        return list(self.messages)

    @property
    def can_search(self) -> bool:
        """Whether the next policy output may search (s3: turns left; QAgent: every round searches)."""
        return self._steps < self.params.max_turns

    @property
    def searches_left(self) -> int:
        """Search turns left (s3: a search now and this many - 1 after it)."""
        return max(0, self.params.max_turns - self._steps)

    def next_call(self) -> PolicyCall:
        """Sampling settings of the next policy output (stop strings, grammar for the current block)."""
        p = self.params
        grammar = None
        if p.mode == "s3":
            stop = ["</query>"]
            if p.constrained:
                grammar = s3_grammar(n_docs=len(self.blocks[-1].documents), select_k=p.select_k,
                                     allow_search=self.can_search)
        else:
            stop = ["</search>"]
            if p.constrained:
                grammar = qagent_grammar(max_queries=p.max_queries_per_round, first_round=not self.blocks)
        extra = grammar_request(grammar, p.constraint_style) if grammar is not None else None
        return PolicyCall(stop=stop, max_tokens=p.max_new_tokens, temperature=p.temperature, grammar=grammar,
                          extra=extra)

    async def act(self, action: Action) -> list[ChatMessage]:
        """Take one action of the policy, whatever the policy: the one path, with one set of rules (the module's
        docstring). Returns the messages the environment appended after the policy's (empty when it ended)."""
        if self.done:
            raise RuntimeError("act() on a finished search")
        self.turns += 1
        before = len(self.messages)
        picks = self._picks(action)
        self.messages.append(ChatMessage(role="assistant", content=action.text if action.text is not None
                                         else self._written(action, picks)))
        if self.params.mode == "s3":
            await self._act_s3(action, picks)
        else:
            await self._act_qagent(action)
        return self.messages[before + 1:]

    def degrade(self, reason: StopReason, message: str) -> None:
        """End a search that cannot finish (the policy's error or timeout, the deadline, the retriever failing
        mid-search) with what the policy committed to at the document budget, one rule for every policy: s3,
        the documents it marked, else naive top-`select_k` of the first retrieval (a block it did not mark adds
        nothing); QAgent, what its rounds retrieved (`finish` falls back to the naive top-k when nothing)."""
        if self.params.mode == "s3":
            marked = any(block.selected for block in self.blocks)
            for b, block in enumerate(self.blocks):
                if not marked and b == 0:
                    block.selected = list(range(1, min(self.params.select_k, len(block.documents)) + 1))
                elif block.selected is None:
                    block.selected = []
        self.degraded_reason = message
        self._end(reason)

    async def finish(self) -> SearchOutcome:
        """The outcome: documents from the state; QAgent with nothing retrieved falls back to naive top-k
        (raises when the retriever is down too: there is nothing to return)."""
        if not self.done:
            raise RuntimeError("finish() before the search ended")
        if self.params.mode == "qagent" and not self.documents():
            await self._add_block(0, [self.question])
        return self.outcome()

    # -------------------------------------------------------------------------------------- state
    def documents(self) -> list[SearchedDocument]:
        """What the search returns now: s3's selection; QAgent's (and naive's) union of every block."""
        if self.params.mode == "s3":
            return select_documents(self.blocks)
        return _dedupe([doc for block in self.blocks for doc in block.documents])

    def record_policy_call(self, seconds: float) -> None:
        self.timings.policy_ms += seconds * 1000
        self.timings.policy_calls += 1

    def outcome(self, *, policy_model: str | None = None) -> SearchOutcome:
        total = (time.perf_counter() - self._started) * 1000
        self.timings.total_ms = total
        self.timings.overhead_ms = max(0.0, total - self.timings.retrieval_ms - self.timings.policy_ms)
        return SearchOutcome(
            question=self.question, mode=self.params.mode, documents=self.documents(), queries=list(self.queries),
            turns=self.turns, stop_reason=self.stop_reason, degraded=self.degraded_reason is not None,
            degraded_reason=self.degraded_reason, timings=self.timings.model_copy(), valid_actions=self.valid,
            invalid_actions=self.invalid, messages=list(self.messages), blocks=list(self.blocks),
            prompt_version=self.prompts.version, policy_model=policy_model)

    # ----------------------------------------------------------------------------------- internals
    def _emit(self, type_: str, **data: Any) -> None:
        if self.on_event is not None:
            self.on_event(SearchEvent(type=type_, turn=self.turns, data=data))

    def _end(self, reason: StopReason) -> None:
        self.done = True
        self.stop_reason = reason
        self._emit("end", stop_reason=reason, degraded=self.degraded_reason is not None)

    async def _add_pool(self) -> InfoBlock:
        """s3's first retrieval of the question: one block per method of `pool_methods` (retrieved together,
        added in that order), else one block with `method`. Returns the first block."""
        methods = self.params.pool_methods
        if not methods or len(methods) == 1:
            return await self._add_block(0, [self.question], methods[0] if methods else self.params.method)
        fetched = await asyncio.gather(*(self._retrieve([self.question], m) for m in methods))
        blocks = [self._block(0, [self.question], m, results) for m, results in zip(methods, fetched, strict=True)]
        return blocks[0]

    async def _add_block(self, turn: int, queries: list[str], method: str | None = None) -> InfoBlock:
        method = method if method is not None else self.params.method
        return self._block(turn, queries, method, await self._retrieve(queries, method, turn))

    async def _retrieve(self, queries: list[str], method: str | None, turn: int = 0) -> list[list[Document]]:
        t0 = time.perf_counter()
        with tracing.span("searcher.retrieve", {"plugsearch.turn": turn, "plugsearch.queries": len(queries),
                                                "plugsearch.k": self.params.retrieve_k,
                                                "plugsearch.method": method or "default"}) as span:
            try:
                results = await self.retriever.retrieve(queries, self.params.retrieve_k, method)
            finally:
                self.timings.retrieval_ms += (time.perf_counter() - t0) * 1000
                self.timings.retrieval_calls += 1
            span.set_attribute("plugsearch.documents", sum(len(hits) for hits in results))
        if len(results) != len(queries):
            raise ServiceError(f"retriever answered {len(results)} result lists for {len(queries)} queries")
        return results

    def _block(self, turn: int, queries: list[str], method: str | None, results: list[list[Document]]) -> InfoBlock:
        # validated once already (the retriever's response model); copying without validating again
        # was ~1 ms of CPU per search at 32 documents, and naming the fields set saves a third of the rest
        docs = [SearchedDocument.model_construct(_SEARCHED_FIELDS, id=doc.id, title=doc.title, text=doc.text,
                                                 score=doc.score, turn=turn, query=query)
                for query, hits in zip(queries, results, strict=True) for doc in hits]
        block = InfoBlock.model_construct(turn=turn, queries=list(queries), documents=docs, selected=None,
                                          method=method)
        self.blocks.append(block)
        self._emit("retrieval", block_turn=turn, queries=list(queries), documents=docs, method=method)
        return block

    async def _search(self, queries: list[str], turn: int, ahead: Sequence[str] = ()) -> InfoBlock | None:
        """A retrieval after the first: a failure ends the search degraded (None). `ahead`: queries retrieved
        in the same request for later (`Action.prefetch`), kept aside."""
        try:
            if not ahead:
                return await self._add_block(turn, queries)
            method = self.params.method
            results = await self._retrieve([*queries, *ahead], method, turn)
            self._prefetched.update(zip(ahead, results[len(queries):], strict=True))
            return self._block(turn, queries, method, results[:len(queries)])
        except ServiceError as exc:
            self.degrade("retriever_error", f"retriever failed mid-search: {exc.message}")
            return None

    async def _s3_search(self, query: str, prefetch: Sequence[str] = ()) -> InfoBlock | None:
        """An s3 search turn: the retrieval (or the documents retrieved ahead for the query), then the turn and
        the query recorded (None: it failed, ended). `prefetch`: see `Action.prefetch`."""
        turn = len(self.queries) + 1
        ready = self._prefetched.pop(query, None)
        if ready is not None:
            block: InfoBlock | None = self._block(turn, [query], self.params.method, [ready])
        else:
            seen = {*self.seen_queries, parsing.normalize_query(query)}
            ahead = list(dict.fromkeys(q for q in map(_as_query, prefetch)
                                       if q and q not in self._prefetched and parsing.normalize_query(q) not in seen))
            block = await self._search([query], turn, ahead)
        if block is not None:
            self._steps += 1
            self.queries.append(query)
            self.seen_queries.add(parsing.normalize_query(query))
        return block

    def _invalid(self, kind: str, reprompt: str) -> None:
        """An invalid (or repeated) action: a turn spent (as in s3); re-prompt, or end after `max_invalid`."""
        self._steps += 1
        self.invalid += 1
        self._in_a_row += 1
        self._emit("action", kind=kind)
        if self._in_a_row > self.params.max_invalid:
            self._end("invalid_actions")
            return
        self.messages.append(ChatMessage(role="user", content=reprompt))

    @staticmethod
    def _written(action: Action, picks: dict[int, list[int]]) -> str:
        """An action the policy did not write as text (the compact policy's), in s3's tags for the transcript;
        `picks`: its marks (`_picks`)."""
        if action.kind == "search":
            query = action.query if action.query is not None else "; ".join(action.queries)
            return f"<query>{json.dumps({'query': _as_query(query)})}</query>"
        return "".join(f"<important_info>{ids}</important_info>" for ids in picks.values()) + \
            "<search_complete>True</search_complete>"

    def _picks(self, action: Action) -> dict[int, list[int]]:
        """The marks `action` sets, per block it marks: its positions in range, each once, in order."""
        blocks = range(len(self.blocks))
        if action.marked is not None:
            marked = [b for b in action.marked if 0 <= b < len(self.blocks)]
        elif action.kind == "complete":
            marked = list(blocks)
        else:
            marked = list(dict.fromkeys(b for b, _ in action.selected if 0 <= b < len(self.blocks)))
        picks: dict[int, list[int]] = {b: [] for b in marked}
        for b, position in action.selected:
            if b in picks and 1 <= position <= len(self.blocks[b].documents) and position not in picks[b]:
                picks[b].append(position)
        return picks

    def _mark(self, picks: dict[int, list[int]]) -> dict[int, list[int]]:
        """Set the marks an action gives (`picks`) to the blocks without marks yet; the marks set, per block."""
        applied = {}
        for b, ids in picks.items():
            if self.blocks[b].selected is None:
                self.blocks[b].selected = applied[b] = ids
        return applied

    async def _act_s3(self, action: Action, picks: dict[int, list[int]]) -> None:
        p = self.params
        current = self.blocks[-1]
        applied = self._mark(picks)
        final = action.marked is None and action.kind == "complete"  # a selection over every block
        if action.kind == "complete":
            self.valid += 1
            if final:
                for b, ids in applied.items():
                    if ids:
                        self._emit("action", kind="select", selected=ids, block=b)
                self._emit("action", kind="complete")
            else:
                self._emit("action", kind="complete", selected=current.selected)
            self._end("complete")
            return
        if not self.can_search:  # s3's final step: only the selection counts; anything else ends all the same
            ok = action.selection_ok
            self.valid += ok
            self.invalid += not ok
            self._emit("action", kind="select" if ok else "invalid", selected=current.selected)
            self._end("max_turns")
            return
        query = _as_query(action.query) if action.query else None
        if query is not None and parsing.normalize_query(query) in self.seen_queries:
            self._invalid("duplicate", self.prompts.render("s3", "duplicate", query=query))
            return
        if query is None:
            self._invalid("invalid", self.prompts.render("s3", "invalid"))
            return
        self.valid += 1
        self._in_a_row = 0
        self._emit("action", kind="search", query=query, selected=current.selected)
        block = await self._s3_search(query, action.prefetch if self.searches_left > 1 else ())
        if block is None:
            return
        part = "information" if self._steps < p.max_turns else "last_information"
        self.messages.append(ChatMessage(role="user", content=self.prompts.render(
            "s3", part, information=parsing.format_documents(block.documents, max_chars=p.doc_chars))))

    async def _act_qagent(self, action: Action) -> None:
        p = self.params
        if action.kind == "complete":
            self.valid += 1
            self._emit("action", kind="complete")
            self._end("complete")
            return
        queries = list(action.queries) or ([action.query] if action.query else [])
        new = [q for q in queries if parsing.normalize_query(q) not in self.seen_queries]
        if not new:
            part = "duplicate" if queries else "invalid"
            self._invalid(part, self.prompts.render("qagent", part))
        else:
            self.valid += 1
            self._in_a_row = 0
            self._emit("action", kind="search", queries=new)
            hits = await self._search(new, self._steps + 1)
            if hits is None:
                return
            self._steps += 1
            self.queries.extend(new)
            self.seen_queries.update(parsing.normalize_query(q) for q in new)
            results = [[d for d in hits.documents if d.query == q] for q in new]
            self.messages.append(ChatMessage(role="user", content=self.prompts.render("qagent", "information", information=(
                parsing.format_query_blocks(list(zip(new, results, strict=True)), max_chars=p.doc_chars)))))
        if not self.done and self._steps >= p.max_turns:
            self._end("max_turns")
