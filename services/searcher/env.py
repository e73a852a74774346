"""One search as an environment: s3, QAgent and naive top-k behind `reset()` / `step(output)`.

Every driver uses this one object: the searcher service (`services.searcher.loop.run_search`, a chat
policy over HTTP), TRL rollouts and veRL's agent loop (`trainer.llm.episode`, a token-level policy). The
environment never calls the policy: the driver samples as `next_call()` says and hands the raw output to
`step`; the documents come from the state (`documents()`), never parsed back out of a transcript.

s3 (pat-jj/s3): naive top-k of the question first; then up to `max_turns` steps, each a search, a stop or
an invalid action (re-prompted, at most `max_invalid` in a row); after the last search one more step to
mark the last block; documents by s3's extraction rule (`select_documents`). QAgent: plan -> search ->
information -> reflection, up to `max_turns` rounds; the documents are the union of every block, and a run
that retrieved nothing falls back to the naive top-k. A policy failure (`fail()`) or a retriever failure
after the first retrieval ends the search degraded; a failed first retrieval raises.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from pydantic import BaseModel, Field

from services.common import tracing
from services.common.errors import ServiceError
from services.common.llm import ChatMessage
from services.common.schemas.base import Document
from services.common.schemas.searcher import (
    SearchedDocument,
    SearchMode,
    SearchParams,
    StageTimings,
    StopReason,
)
from services.searcher import parsing
from services.searcher.grammar import grammar_request, qagent_grammar, s3_grammar
from services.searcher.prompts import PROMPT_VERSION, PromptSet


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
    """A structured policy's step (`SearchEnv.act`): `search` issues `query`; `complete` ends the search with
    `selected`, the chosen documents as (block index, 1-based position) pairs, in order. `prefetch` (with a
    search): queries the policy may search next; the environment retrieves them with `query`, in one request,
    and a later search of one of them takes its documents from there (the same documents, one round trip
    fewer; a guess that is never searched costs a retrieval)."""

    kind: Literal["search", "complete"]
    query: str | None = None
    selected: tuple[tuple[int, int], ...] = ()
    prefetch: tuple[str, ...] = ()


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
    """One search: `await reset()`, then while not `done`: sample with `next_call()`, `await step(...)`;
    finally `await finish()` for the `SearchOutcome`."""

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
        """Policy outputs taken (`step` calls)."""
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

    async def step(self, output: str, *, stopped: bool) -> list[ChatMessage]:
        """Take one raw policy output (`stopped`: the backend ended it at a stop string or end of turn).
        Returns the messages the environment appended after the policy's (empty when the search ended)."""
        if self.done:
            raise RuntimeError("step() on a finished search")
        self.turns += 1
        before = len(self.messages)
        if self.params.mode == "s3":
            await self._step_s3(output, stopped=stopped)
        else:
            await self._step_qagent(output, stopped=stopped)
        return self.messages[before + 1:]

    async def act(self, action: Action) -> None:
        """Take one structured action (s3 mode; the compact policy's steps): the same search, selection and
        end as a parsed chat output, without the text. The transcript gets the action in s3's tags."""
        if self.done:
            raise RuntimeError("act() on a finished search")
        if self.params.mode != "s3":
            raise ValueError("structured actions drive s3 mode")
        self.turns += 1
        self.valid += 1
        if action.kind == "search" and action.query and self.can_search \
                and parsing.normalize_query(action.query) not in self.seen_queries:
            query = _as_query(action.query)
            self.messages.append(ChatMessage(role="assistant", content=f"<query>{json.dumps({'query': query})}</query>"))
            self._emit("action", kind="search", query=query)
            await self._s3_search(query, action.prefetch if self.searches_left > 1 else ())
            return
        if action.kind == "search":  # no search left, or a repeat: ends on what it has (s3's rule: every block)
            self.valid -= 1
            self.invalid += 1
            self._emit("action", kind="invalid")
            self._end("invalid_actions")
            return
        picks: dict[int, list[int]] = {b: [] for b in range(len(self.blocks))}
        for b, position in action.selected:
            if 0 <= b < len(self.blocks) and 1 <= position <= len(self.blocks[b].documents) \
                    and position not in picks[b]:
                picks[b].append(position)
        for b, ids in picks.items():
            self.blocks[b].selected = ids
            if ids:
                self._emit("action", kind="select", selected=ids, block=b)
        self.messages.append(ChatMessage(role="assistant", content="".join(
            f"<important_info>{ids}</important_info>" for ids in picks.values()) +
            "<search_complete>True</search_complete>"))
        self._emit("action", kind="complete")
        self._end("complete")

    def keep_naive(self) -> None:
        """What a structured policy's search returns when it cannot finish (its own error, the deadline, the
        retriever failing mid-search): naive top-k of the first retrieval at the search's document budget,
        the first block's first `select_k` documents, and nothing else."""
        for b, block in enumerate(self.blocks):
            block.selected = list(range(1, min(self.params.select_k, len(block.documents)) + 1)) if b == 0 else []

    def fail(self, reason: StopReason, message: str) -> None:
        """The driver could not get a policy output (error, timeout, deadline): end, degraded."""
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
            self.degraded_reason = f"retriever failed mid-search: {exc.message}"
            self._end("retriever_error")
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

    async def _step_s3(self, output: str, *, stopped: bool) -> None:
        p = self.params
        allow_search = self.can_search
        current = self.blocks[-1]
        text = parsing.postprocess(output, "query", stopped=stopped)
        self.messages.append(ChatMessage(role="assistant", content=text))
        action = parsing.parse_s3(text, n_docs=len(current.documents), select_k=p.select_k)
        if action.selection is not None and current.selected is None:
            if action.selection.ids or action.selection.explicit_empty:
                current.selected = action.selection.ids  # the tag applies to the most recent block
        selected = current.selected
        if action.kind == "complete":
            self.valid += 1
            self._emit("action", kind="complete", selected=selected)
            self._end("complete")
            return
        if not allow_search:
            # s3's final step: only the selection counts; anything else ends the loop all the same.
            ok = action.selection is not None and not action.selection.out_of_range
            self.valid += ok
            self.invalid += not ok
            self._emit("action", kind="select" if ok else "invalid", selected=selected)
            self._end("max_turns")
            return
        query = action.query
        if query is not None and parsing.normalize_query(query) in self.seen_queries:
            self._invalid("duplicate", self.prompts.render("s3", "duplicate", query=query))
            return
        if query is None:
            self._invalid("invalid", self.prompts.render("s3", "invalid"))
            return
        self.valid += 1
        self._in_a_row = 0
        self._emit("action", kind="search", query=query, selected=selected)
        block = await self._s3_search(query)
        if block is None:
            return
        part = "information" if self._steps < p.max_turns else "last_information"
        self.messages.append(ChatMessage(role="user", content=self.prompts.render(
            "s3", part, information=parsing.format_documents(block.documents, max_chars=p.doc_chars))))

    async def _step_qagent(self, output: str, *, stopped: bool) -> None:
        p = self.params
        text = parsing.postprocess(output, "search", stopped=stopped)
        self.messages.append(ChatMessage(role="assistant", content=text))
        action = parsing.parse_qagent(text, max_queries=p.max_queries_per_round)
        if action.kind == "complete":
            self.valid += 1
            self._emit("action", kind="complete")
            self._end("complete")
            return
        new = [q for q in action.queries if parsing.normalize_query(q) not in self.seen_queries]
        if not new:
            part = "duplicate" if action.queries else "invalid"
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
