"""The search loops (s3, QAgent, naive): one implementation, served by the searcher and imported by the trainer.

No FastAPI here. `run_search(question, params, policy=..., retriever=...)` drives any
`services.common.llm.LLMBackend` against any `RetrieverBackend` and returns a `SearchOutcome` whose
`messages` are the exact chat transcript: the policy's outputs are the `assistant` messages (never
rewritten afterwards), everything the environment inserted is a `system`/`user` message, and every
policy call was `policy.chat(messages[:i], ...)` for the i-th message when it is an assistant one.

s3 (pat-jj/s3): naive top-k of the question first, shown with the question; then up to `max_turns`
policy steps, each either a search (`<query>`), a stop (`<search_complete>True`) or an invalid action
(re-prompted, like s3's own feedback, at most `max_invalid` times in a row, then the loop falls back
to what it has). After the last search the policy gets one more step to mark the last block (s3's
final rollout without search). Documents: s3's extraction rules (see `select_documents`).

QAgent: plan -> search (one or more queries) -> information -> reflection, up to `max_turns` rounds;
the documents are the union of everything retrieved, deduplicated, in retrieval order. A run that
retrieved nothing falls back to the naive top-k.

Degradation: a policy failure or timeout ends the loop with the documents gathered so far (at least
the naive top-k) and `degraded=True`; a retriever failure on the first retrieval raises (the service
answers 503), later ones degrade.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from typing import Any, Literal, Protocol

from pydantic import BaseModel, Field, model_validator

from services.common.clients import RetrieverClient
from services.common.errors import BadRequest, ServiceError, UpstreamError
from services.common.llm import ChatMessage, ChatResult, LLMBackend
from services.common.schemas.base import Document
from services.searcher import parsing
from services.searcher.grammar import ConstraintStyle, grammar_request, qagent_grammar, s3_grammar
from services.searcher.prompts import PROMPT_VERSION, render

logger = logging.getLogger(__name__)

Mode = Literal["s3", "qagent", "naive"]
RetrievalMethod = Literal["bm25", "dense", "hybrid"]
StopReason = Literal["complete", "max_turns", "invalid_actions", "policy_error", "policy_timeout",
                     "retriever_error", "deadline", "naive"]


class SearchParams(BaseModel):
    """Everything that shapes one search (part of the cache key). Defaults: the s3 paper's best setting."""

    mode: Mode = "s3"
    max_turns: int = Field(3, ge=0, le=10, description="s3: search turns T; qagent: rounds B")
    retrieve_k: int = Field(8, ge=1, le=50, description="documents retrieved per query")
    select_k: int = Field(3, ge=1, le=50, description="s3: at most this many documents marked per block")
    method: RetrievalMethod | None = None
    temperature: float = Field(0.0, ge=0.0, le=2.0)
    max_new_tokens: int = Field(160, ge=8, le=4096)
    constrained: bool = Field(False, description="force valid actions with a grammar (structured output)")
    constraint_style: ConstraintStyle = "llama"
    max_invalid: int = Field(2, ge=0, le=10, description="invalid actions in a row before falling back")
    max_queries_per_round: int = Field(3, ge=1, le=10, description="qagent: queries per search round")
    doc_chars: int | None = Field(None, ge=50, le=20_000,
                                  description="cut each document to this many characters in the policy's prompt")
    timeout_s: float | None = Field(None, gt=0, description="budget for the whole loop; past it: degrade")

    @model_validator(mode="after")
    def _check(self) -> SearchParams:
        if self.mode == "s3" and self.select_k > self.retrieve_k:
            raise ValueError("select_k cannot exceed retrieve_k")
        return self


class RetrieverBackend(Protocol):
    async def retrieve(self, queries: list[str], k: int, method: str | None) -> list[list[Document]]: ...


_Waiter = tuple[list[str], "asyncio.Future[list[list[Document]]]"]


class RetrieverRefused(UpstreamError):
    """The retriever answered a request we built with a 4xx: an upstream problem (502) for our caller."""


class ServiceRetriever:
    """`RetrieverBackend` over the retriever service's typed client.

    Concurrent calls with the same `k` and method that arrive in the same event-loop turn go out as one
    `POST /retrieve` (up to `max_batch` queries): the retriever is built for batches, and under load each
    search's retrievals otherwise cost the searcher, and the retriever, one HTTP exchange apiece. Nothing
    waits for company: a lone call is sent on the next loop turn. If the retriever refuses a merged
    request as a whole (a 4xx), each caller's queries are sent again on their own, so one caller's bad
    query never fails another caller's search.
    """

    def __init__(self, client: RetrieverClient, *, max_batch: int = 64) -> None:
        self.client = client
        self.max_batch = max_batch
        self._pending: dict[tuple[int, str | None], list[_Waiter]] = {}
        self._sending: set[asyncio.Task[None]] = set()

    async def retrieve(self, queries: list[str], k: int, method: str | None) -> list[list[Document]]:
        if self.max_batch <= 1 or len(queries) >= self.max_batch:
            return await self._retrieve(queries, k, method)
        key = (k, method)
        loop = asyncio.get_running_loop()
        group = self._pending.get(key)
        if group is not None and sum(len(q) for q, _ in group) + len(queries) > self.max_batch:
            self._flush(key)
            group = None
        if group is None:
            group = self._pending[key] = []
            loop.call_soon(self._flush, key, group)
        future: asyncio.Future[list[list[Document]]] = loop.create_future()
        group.append((queries, future))
        return await future

    def _flush(self, key: tuple[int, str | None], group: list[_Waiter] | None = None) -> None:
        if group is not None and self._pending.get(key) is not group:
            return  # already sent (it filled up before this scheduled flush ran)
        pending = self._pending.pop(key, None)
        if pending:
            task = asyncio.create_task(self._send(key, pending))
            self._sending.add(task)
            task.add_done_callback(self._sending.discard)

    async def _send(self, key: tuple[int, str | None], group: list[_Waiter]) -> None:
        k, method = key
        live = [(queries, future) for queries, future in group if not future.done()]  # callers cancelled: skip
        if not live:
            return
        try:
            results = await self._retrieve([q for queries, _ in live for q in queries], k, method)
        except RetrieverRefused as exc:
            if len(live) == 1:
                _fail(live, exc)
                return
            # Whose query was refused is unknown: each caller's queries go again on their own.
            await asyncio.gather(*(self._send(key, [waiter]) for waiter in live))
            return
        except BaseException as exc:  # noqa: BLE001 - handed to every waiting caller, who raises it
            _fail(live, exc)
            if isinstance(exc, asyncio.CancelledError):
                raise
            return
        start = 0
        for queries, future in live:
            if not future.done():
                future.set_result(results[start:start + len(queries)])
            start += len(queries)

    async def _retrieve(self, queries: list[str], k: int, method: str | None) -> list[list[Document]]:
        try:
            response = await self.client.retrieve(queries, k=k, method=method)  # type: ignore[arg-type]
        except ServiceError as exc:
            if exc.status == 404 and exc.param == "method":
                # The caller picked a retrieval method this retriever does not serve: the caller's 4xx.
                raise BadRequest(exc.message, param="method") from exc
            if exc.status < 500 and exc.status != 429:
                # The retriever refused what we built: our caller's input was already valid, so this is
                # an upstream problem (502), not the caller's 4xx.
                raise RetrieverRefused(f"retriever refused the request: {exc.message}") from exc
            raise
        if len(response.results) != len(queries):
            raise UpstreamError(f"retriever answered {len(response.results)} result lists for {len(queries)} queries")
        return response.results


def _fail(group: list[_Waiter], exc: BaseException) -> None:
    for _, future in group:
        if future.done():
            continue
        if isinstance(exc, asyncio.CancelledError):
            future.cancel()
        else:
            future.set_exception(exc)


class FoundDocument(Document):
    """A selected document with where it came from."""

    turn: int = Field(..., description="0 = the initial naive retrieval; t = the t-th search")
    query: str = Field(..., description="the query that retrieved it")


class InfoBlock(BaseModel):
    """One `<information>` block the policy saw."""

    turn: int
    queries: list[str]
    documents: list[FoundDocument]
    selected: list[int] | None = Field(None, description="1-based ids marked by <important_info>; None = no tag")


class Timings(BaseModel):
    total_ms: float = 0.0
    retrieval_ms: float = 0.0
    policy_ms: float = 0.0
    overhead_ms: float = 0.0
    policy_calls: int = 0
    retrieval_calls: int = 0


class SearchOutcome(BaseModel):
    question: str
    mode: Mode
    documents: list[FoundDocument]
    queries: list[str] = Field(default_factory=list, description="queries issued by the policy, in order")
    turns: int = Field(0, description="policy steps taken")
    stop_reason: StopReason
    degraded: bool = False
    degraded_reason: str | None = None
    timings: Timings = Field(default_factory=Timings)
    valid_actions: int = 0
    invalid_actions: int = 0
    messages: list[ChatMessage] = Field(default_factory=list)
    blocks: list[InfoBlock] = Field(default_factory=list)
    prompt_version: str = PROMPT_VERSION
    policy_model: str | None = None


class _PolicyFailed(Exception):
    def __init__(self, reason: StopReason, message: str) -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message


class _Run:
    """State of one search: transcript, blocks, counters, timings, deadline."""

    def __init__(self, question: str, params: SearchParams, policy: LLMBackend | None,
                 retriever: RetrieverBackend) -> None:
        self.question = question
        self.params = params
        self.policy = policy
        self.retriever = retriever
        self.messages: list[ChatMessage] = []
        self.blocks: list[InfoBlock] = []
        self.queries: list[str] = []
        self.seen_queries: set[str] = set()
        self.timings = Timings()
        self.valid = 0
        self.invalid = 0
        self.turns = 0
        self.started = time.perf_counter()
        self.deadline = None if params.timeout_s is None else self.started + params.timeout_s

    def remaining(self) -> float | None:
        return None if self.deadline is None else max(0.0, self.deadline - time.perf_counter())

    async def retrieve(self, queries: list[str]) -> list[list[Document]]:
        t0 = time.perf_counter()
        try:
            results = await self.retriever.retrieve(queries, self.params.retrieve_k, self.params.method)
        finally:
            self.timings.retrieval_ms += (time.perf_counter() - t0) * 1000
            self.timings.retrieval_calls += 1
        if len(results) != len(queries):
            raise ServiceError(f"retriever answered {len(results)} result lists for {len(queries)} queries")
        return results

    def add_block(self, turn: int, queries: Sequence[str], results: Sequence[Sequence[Document]]) -> InfoBlock:
        # validated once already (the retriever's response model); copying without validating again
        # was ~1 ms of CPU per search at 32 documents
        docs = [FoundDocument.model_construct(id=doc.id, title=doc.title, text=doc.text, score=doc.score,
                                              turn=turn, query=query)
                for query, hits in zip(queries, results, strict=True) for doc in hits]
        block = InfoBlock.model_construct(turn=turn, queries=list(queries), documents=docs, selected=None)
        self.blocks.append(block)
        return block

    async def step(self, *, stop: list[str], grammar: str | None) -> ChatResult:
        """One policy call on the transcript so far; raises _PolicyFailed on error or deadline."""
        assert self.policy is not None
        extra: dict[str, Any] | None = None
        if grammar is not None:
            extra = grammar_request(grammar, self.params.constraint_style)
        remaining = self.remaining()
        if remaining is not None and remaining <= 0:
            raise _PolicyFailed("deadline", "search time budget spent")
        t0 = time.perf_counter()
        try:
            async with asyncio.timeout(remaining):
                result = await self.policy.chat(list(self.messages), temperature=self.params.temperature,
                                                max_tokens=self.params.max_new_tokens, stop=stop, extra=extra)
        except TimeoutError as exc:
            raise _PolicyFailed("deadline", "policy did not answer within the search time budget") from exc
        except ServiceError as exc:
            reason: StopReason = "policy_timeout" if exc.status == 504 else "policy_error"
            raise _PolicyFailed(reason, f"policy failed: {exc.message}") from exc
        finally:
            self.timings.policy_ms += (time.perf_counter() - t0) * 1000
            self.timings.policy_calls += 1
        self.turns += 1
        return result

    def outcome(self, mode: Mode, documents: list[FoundDocument], stop_reason: StopReason, *,
                degraded_reason: str | None = None) -> SearchOutcome:
        total = (time.perf_counter() - self.started) * 1000
        self.timings.total_ms = total
        self.timings.overhead_ms = max(0.0, total - self.timings.retrieval_ms - self.timings.policy_ms)
        return SearchOutcome(
            question=self.question, mode=mode, documents=documents, queries=list(self.queries),
            turns=self.turns, stop_reason=stop_reason, degraded=degraded_reason is not None,
            degraded_reason=degraded_reason, timings=self.timings, valid_actions=self.valid,
            invalid_actions=self.invalid, messages=list(self.messages), blocks=list(self.blocks),
            policy_model=getattr(self.policy, "model", None) if self.policy is not None else None)


def _dedupe(docs: Sequence[FoundDocument]) -> list[FoundDocument]:
    seen: set[str] = set()
    out = []
    for doc in docs:
        key = " ".join(doc.text.split())
        if key not in seen:
            seen.add(key)
            out.append(doc)
    return out


def select_documents(blocks: Sequence[InfoBlock]) -> list[FoundDocument]:
    """s3's extraction (`rag_2.extract_titles_and_texts`): first the marked documents of every block that
    has an `<important_info>` tag (in the order the tags were written), then every document of the
    blocks without one; deduplicated by content, first occurrence kept."""
    ordered: list[FoundDocument] = []
    for block in blocks:
        if block.selected is not None:
            ordered.extend(block.documents[i - 1] for i in block.selected if 1 <= i <= len(block.documents))
    for block in blocks:
        if block.selected is None:
            ordered.extend(block.documents)
    return _dedupe(ordered)


async def run_naive(question: str, params: SearchParams, retriever: RetrieverBackend) -> SearchOutcome:
    run = _Run(question, params, None, retriever)
    results = await run.retrieve([question])
    block = run.add_block(0, [question], results)
    return run.outcome("naive", _dedupe(block.documents), "naive")


async def _run_s3(run: _Run) -> SearchOutcome:
    p = run.params
    results = await run.retrieve([run.question])  # raises: no documents at all without the retriever
    run.add_block(0, [run.question], results)
    run.seen_queries.add(parsing.normalize_query(run.question))  # searching the question again is a repeat
    run.messages = [
        ChatMessage(role="system", content=render("s3", "system", select_k=p.select_k)),
        ChatMessage(role="user", content=render("s3", "initial", question=run.question,
                                                information=parsing.format_documents(
                                                    run.blocks[0].documents, max_chars=p.doc_chars))),
    ]
    steps = 0
    in_a_row = 0
    stop_reason: StopReason = "max_turns"
    degraded: str | None = None
    while True:
        allow_search = steps < p.max_turns
        current = run.blocks[-1]
        grammar = None
        if p.constrained:
            grammar = s3_grammar(n_docs=len(current.documents), select_k=p.select_k, allow_search=allow_search)
        try:
            result = await run.step(stop=["</query>"], grammar=grammar)
        except _PolicyFailed as exc:
            stop_reason, degraded = exc.reason, exc.message
            break
        text = parsing.postprocess_s3(result.text, stopped=result.finish_reason == "stop")
        run.messages.append(ChatMessage(role="assistant", content=text))
        action = parsing.parse_s3(text, n_docs=len(current.documents), select_k=p.select_k)
        if action.selection is not None and current.selected is None:
            if action.selection.ids or action.selection.explicit_empty:
                current.selected = action.selection.ids  # the tag applies to the most recent block
        if action.kind == "complete":
            run.valid += 1
            stop_reason = "complete"
            break
        if not allow_search:
            # s3's final step: only the selection counts; anything else ends the loop all the same.
            if action.selection is not None and not action.selection.out_of_range:
                run.valid += 1
            else:
                run.invalid += 1
            stop_reason = "max_turns"
            break
        query = action.query
        if query is not None and parsing.normalize_query(query) in run.seen_queries:
            run.invalid += 1
            in_a_row += 1
            if in_a_row > p.max_invalid:
                stop_reason = "invalid_actions"
                break
            run.messages.append(ChatMessage(role="user", content=render("s3", "duplicate", query=query)))
            steps += 1  # a wasted turn, as in s3 where every step counts
            continue
        if query is None:
            run.invalid += 1
            in_a_row += 1
            logger.debug("invalid s3 action: %s", "; ".join(action.problems))
            if in_a_row > p.max_invalid:
                stop_reason = "invalid_actions"
                break
            run.messages.append(ChatMessage(role="user", content=render("s3", "invalid")))
            steps += 1
            continue
        run.valid += 1
        in_a_row = 0
        try:
            hits = await run.retrieve([query])
        except ServiceError as exc:
            stop_reason, degraded = "retriever_error", f"retriever failed mid-search: {exc.message}"
            break
        steps += 1
        run.queries.append(query)
        run.seen_queries.add(parsing.normalize_query(query))
        block = run.add_block(len(run.queries), [query], hits)
        part = "information" if steps < p.max_turns else "last_information"
        run.messages.append(ChatMessage(role="user", content=render(
            "s3", part, information=parsing.format_documents(block.documents, max_chars=p.doc_chars))))
    return run.outcome("s3", select_documents(run.blocks), stop_reason, degraded_reason=degraded)


async def _run_qagent(run: _Run) -> SearchOutcome:
    p = run.params
    run.messages = [
        ChatMessage(role="system", content=render("qagent", "system", max_turns=p.max_turns,
                                                  max_queries=p.max_queries_per_round)),
        ChatMessage(role="user", content=render("qagent", "question", question=run.question)),
    ]
    rounds = 0
    in_a_row = 0
    stop_reason: StopReason = "max_turns"
    degraded: str | None = None
    while rounds < p.max_turns:
        grammar = None
        if p.constrained:
            grammar = qagent_grammar(max_queries=p.max_queries_per_round, first_round=not run.blocks)
        try:
            result = await run.step(stop=["</search>"], grammar=grammar)
        except _PolicyFailed as exc:
            stop_reason, degraded = exc.reason, exc.message
            break
        text = parsing.postprocess_qagent(result.text, stopped=result.finish_reason == "stop")
        run.messages.append(ChatMessage(role="assistant", content=text))
        action = parsing.parse_qagent(text, max_queries=p.max_queries_per_round)
        if action.kind == "complete":
            run.valid += 1
            stop_reason = "complete"
            break
        new = [q for q in action.queries if parsing.normalize_query(q) not in run.seen_queries]
        if not new:
            run.invalid += 1
            in_a_row += 1
            rounds += 1
            if in_a_row > p.max_invalid:
                stop_reason = "invalid_actions"
                break
            part = "duplicate" if action.queries else "invalid"
            run.messages.append(ChatMessage(role="user", content=render("qagent", part)))
            continue
        run.valid += 1
        in_a_row = 0
        try:
            hits = await run.retrieve(new)
        except ServiceError as exc:
            stop_reason, degraded = "retriever_error", f"retriever failed mid-search: {exc.message}"
            break
        rounds += 1
        run.queries.extend(new)
        run.seen_queries.update(parsing.normalize_query(q) for q in new)
        run.add_block(rounds, new, hits)
        run.messages.append(ChatMessage(role="user", content=render("qagent", "information", information=(
            parsing.format_query_blocks(list(zip(new, hits, strict=True)), max_chars=p.doc_chars)))))
    documents = _dedupe([doc for block in run.blocks for doc in block.documents])
    if not documents:
        # Nothing retrieved (no valid search, or the policy failed at once): fall back to naive top-k.
        # Raises when the retriever is down too: there is nothing to return.
        results = await run.retrieve([run.question])
        documents = _dedupe(run.add_block(0, [run.question], results).documents)
    return run.outcome("qagent", documents, stop_reason, degraded_reason=degraded)


async def run_search(question: str, params: SearchParams, *, policy: LLMBackend,
                     retriever: RetrieverBackend) -> SearchOutcome:
    """Run one search in `params.mode`. Raises only when no document at all could be retrieved."""
    if params.mode == "naive":
        return await run_naive(question, params, retriever)
    run = _Run(question, params, policy, retriever)
    if params.mode == "s3":
        return await _run_s3(run)
    return await _run_qagent(run)
