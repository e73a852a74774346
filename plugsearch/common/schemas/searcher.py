"""`POST /search` and `POST /search/batch`: the searcher's public contract (with the server-sent events of
`"stream": true`), and `SearchParams`, the parameters of one search, declared once here: the request
overrides some, the service's settings give the defaults, the environment and the trainer take them."""

from __future__ import annotations

import math
from typing import Literal, NamedTuple

from pydantic import BaseModel, Field, model_validator

from plugsearch.common.schemas.base import Document, StrictModel, bounded_text

SearchMode = Literal["s3", "qagent", "naive"]
Method = Literal["bm25", "dense", "hybrid"]
StopReason = Literal["complete", "max_turns", "invalid_actions", "policy_error", "policy_timeout",
                     "retriever_error", "deadline", "naive"]

ConstraintStyle = Literal["llama", "vllm", "vllm_legacy"]
"""Where a grammar goes in the policy request: llama.cpp's `grammar`, vLLM's `structured_outputs`
(or `guided_grammar` in older releases)."""

MAX_QUESTION_CHARS = 4096
MAX_TURNS = 10
MAX_RETRIEVE_K = 50
MAX_BATCH = 64


def check_select_k(mode: str | None, select_k: int | None, retrieve_k: int | None) -> None:
    """The one rule between the budget parameters: s3 marks at most `select_k` of the `retrieve_k`
    documents of a block, so it cannot exceed it (unset values are not checked)."""
    if mode in (None, "s3") and select_k is not None and retrieve_k is not None and select_k > retrieve_k:
        raise ValueError("select_k cannot exceed retrieve_k")


class SearchParams(BaseModel):
    """Everything that shapes one search (part of the cache key). Defaults: the s3 paper's best setting."""

    mode: SearchMode = "s3"
    max_turns: int = Field(3, ge=0, le=MAX_TURNS, description="s3: search turns T; qagent: rounds B")
    retrieve_k: int = Field(8, ge=1, le=MAX_RETRIEVE_K, description="documents retrieved per query")
    select_k: int = Field(3, ge=1, le=MAX_RETRIEVE_K, description="s3: at most this many documents marked per block")
    method: Method | None = None
    pool_methods: list[Method] | None = Field(
        None, min_length=1, max_length=3,
        description="s3: the methods of the first retrieval of the question, one block each in this order (a "
                    "pool from several retrievers); None = `method` alone. The searcher sets it for a policy that "
                    "asks for it (the compact policy: bm25, plus dense when the retriever serves its encoder)")
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
        check_select_k(self.mode, self.select_k, self.retrieve_k)
        return self


# ----------------------------------------------------------------------------------------------- prices
RETRIEVAL_UNITS = 0.6
"""What one query's retrieval costs before what it returns and encodes..."""
DOCUMENTS_PER_UNIT = 20
"""... plus one unit per 20 documents it returns (k; the default naive search, k 8 and BM25, is 1.0) ..."""
ENCODED_TOKENS_PER_UNIT = 32
"""... plus, for dense and hybrid retrieval, one unit per 32 query tokens the encoder reads."""
CHARS_PER_TOKEN = 4
MAX_ENCODED_QUERY_CHARS = 2048
"""A query is cut to the retriever's limit (`plugsearch.common.schemas.retriever.MAX_QUERY_CHARS`) before it is
sent: what is encoded is at most that."""
FOLLOW_UP_QUERY_CHARS = 64
"""A follow-up query (written by a policy, unknown before the search) is priced as the question plus this."""


class Retrieval(NamedTuple):
    """One retrieval a search makes: its method (None: the retriever's default, priced as BM25), the length of
    its queries, its k, and how many queries it sends."""

    method: Method | None
    query_chars: int
    k: int
    queries: int = 1


def encoded_tokens(query_chars: int) -> int:
    """The query tokens a dense encoder reads for a query of this many characters (an estimate: 4 a token)."""
    return math.ceil(min(query_chars, MAX_ENCODED_QUERY_CHARS) / CHARS_PER_TOKEN)


def retrieval_cost(retrieval: Retrieval) -> float:
    """Cost units of one retrieval: per query, `RETRIEVAL_UNITS` + k / `DOCUMENTS_PER_UNIT` + (dense and hybrid)
    encoded tokens / `ENCODED_TOKENS_PER_UNIT`. BM25 k 8: 1.0; hybrid, a 4,096-character question, k 50: 19.1."""
    per_query = RETRIEVAL_UNITS + retrieval.k / DOCUMENTS_PER_UNIT
    if retrieval.method in ("dense", "hybrid"):
        per_query += encoded_tokens(retrieval.query_chars) / ENCODED_TOKENS_PER_UNIT
    return retrieval.queries * per_query


def retrievals(params: SearchParams, question_chars: int) -> list[Retrieval]:
    """Every retrieval a search with these parameters may make: the question (one per method of s3's pool),
    then each turn's follow-up queries (s3: one; QAgent: up to `max_queries_per_round`)."""
    first = params.pool_methods if params.mode == "s3" and params.pool_methods else [params.method]
    out = [Retrieval(method, question_chars, params.retrieve_k) for method in first]
    if params.mode != "naive":
        per_turn = params.max_queries_per_round if params.mode == "qagent" else 1
        out += [Retrieval(params.method, question_chars + FOLLOW_UP_QUERY_CHARS, params.retrieve_k, per_turn)
                ] * params.max_turns
    return out


def search_cost(params: SearchParams, question_chars: int = 0, *, llm_policy: bool = True) -> float:
    """Work units of one search, for the per-request bound, per-key budgets and admission: the one price of a
    search, whatever its policy. Its retrievals (`retrieval_cost` of each of `retrievals`), plus, for an
    LLM policy (`llm_policy`; a policy acting in-process, the compact one, calls none), one unit per policy
    call (turns + 1) times what its prompt adds: 1 + a quarter unit per document retrieved for it
    (`retrieve_k`, times the queries of a QAgent round). Naive top-k of a short question (k 8, BM25) is 1.0;
    the default s3 search (3 turns, 8 documents) 12 + 4.0 = 16; s3 with `retrieve_k` 50 and 10 turns
    148.5 + 34.1."""
    cost = sum(retrieval_cost(r) for r in retrievals(params, question_chars))
    if params.mode != "naive" and llm_policy:
        documents = params.retrieve_k * (params.max_queries_per_round if params.mode == "qagent" else 1)
        cost += (params.max_turns + 1) * (1 + documents / 4)
    return cost


class SearchRequest(StrictModel):
    question: bounded_text(MAX_QUESTION_CHARS)  # type: ignore[valid-type]
    mode: SearchMode = "s3"
    max_turns: int | None = Field(None, ge=0, le=MAX_TURNS, description="s3 turns T / qagent rounds; default 3")
    retrieve_k: int | None = Field(None, ge=1, le=MAX_RETRIEVE_K, description="documents per query; default 8")
    select_k: int | None = Field(None, ge=1, le=MAX_RETRIEVE_K, description="s3: marked per block; default 3")
    method: Method | None = Field(None, description="retrieval method; default: the retriever's")
    constrained: bool | None = Field(None, description="constrained decoding; default: the service's setting")
    return_trace: bool = Field(False, description="include the policy transcript and retrieved blocks")
    stream: bool = Field(False, description=(
        "answer with server-sent events as the search goes (retrieval, action, end), the last one `result` "
        "with this same response body; not in a batch"))

    @model_validator(mode="after")
    def _check(self) -> SearchRequest:
        check_select_k(self.mode, self.select_k, self.retrieve_k)
        return self


class SearchedDocument(Document):
    """A returned document with where the search found it."""

    turn: int = Field(..., description="0 = the initial naive retrieval, t = the t-th search")
    query: str = Field(..., description="the query that retrieved it")


class StageTimings(BaseModel):
    total_ms: float = 0.0
    retrieval_ms: float = 0.0
    policy_ms: float = 0.0
    overhead_ms: float = Field(0.0, description="total minus retrieval and policy time")
    policy_calls: int = 0
    retrieval_calls: int = 0


class TraceMessage(BaseModel):
    role: str
    content: str


class TraceBlock(BaseModel):
    turn: int
    queries: list[str]
    method: Method | None = Field(None, description="the retrieval method of this block; null = the retriever's "
                                                    "default")
    document_ids: list[str]
    selected: list[int] | None = Field(None, description="1-based ids the policy marked; null = no tag")


class SearchTrace(BaseModel):
    messages: list[TraceMessage] = Field(..., description="the exact chat transcript with the policy")
    blocks: list[TraceBlock] = Field(..., description="every information block the policy saw")


class SearchResponse(BaseModel):
    search_id: str | None = Field(None, description=(
        "this answer's id (fresh for every answer, a cached one too): mark which documents helped with "
        "`POST /feedback`; null when the searcher keeps no marks (SEARCHER_FEEDBACK=off)"))
    question: str
    mode: SearchMode
    documents: list[SearchedDocument]
    context: str = Field(..., description="ready to paste into any LLM's prompt")
    queries: list[str]
    turns: int
    stop_reason: StopReason
    degraded: bool = False
    degraded_reason: str | None = None
    timings: StageTimings
    valid_actions: int
    invalid_actions: int
    cached: bool = False
    policy_model: str | None = None
    prompt_version: str
    fallback: str | None = Field(None, description=(
        "set when naive BM25 top-k answered this s3 search instead of the policy, and why: the policy did not "
        "beat naive top-k on the served corpus at the searcher's corpus check (or the check is still running)"))
    trace: SearchTrace | None = None


class SearchBatchRequest(StrictModel):
    items: list[SearchRequest] = Field(..., min_length=1, max_length=MAX_BATCH)

    @model_validator(mode="after")
    def _check(self) -> SearchBatchRequest:
        if any(item.stream for item in self.items):
            raise ValueError("stream is not supported in a batch: stream single searches")
        return self


class SearchBatchResponse(BaseModel):
    results: list[SearchResponse]


# ------------------------------------------------------------------ server-sent events of `"stream": true`
ActionKind = Literal["search", "complete", "select", "invalid", "duplicate"]
StreamEventType = Literal["retrieval", "action", "end", "result", "error"]


class RetrievalEvent(BaseModel):
    """`event: retrieval`: a block of documents arrived (the policy sees it next)."""

    block: int = Field(..., description="0-based position of this block in the search (= in `trace.blocks`)")
    turn: int = Field(..., description="0 = the initial naive retrieval, t = the t-th search (as in documents)")
    queries: list[str]
    method: Method | None = Field(None, description="the retrieval method of this block; null = the retriever's "
                                                    "default")
    documents: list[SearchedDocument]
    step: int = Field(..., description="policy outputs taken so far")
    elapsed_ms: float = Field(..., description="since the search started")


class ActionEvent(BaseModel):
    """`event: action`: the policy acted. `search`: new `queries` (retrieved next); `complete`: it stopped;
    `select`: its last output marked documents only; `invalid` / `duplicate`: re-prompted (or the end)."""

    step: int = Field(..., description="1-based policy output this action came from")
    kind: ActionKind
    queries: list[str] = Field(default_factory=list, description="the queries it issued (search)")
    block: int | None = Field(None, description="the block `selected` refers to (s3)")
    selected: list[int] | None = Field(None, description="1-based positions marked in that block; null = none")
    selected_ids: list[str] | None = Field(None, description="the ids of the marked documents")
    elapsed_ms: float


class EndEvent(BaseModel):
    """`event: end`: the loop stopped (a `result` event follows)."""

    step: int
    stop_reason: StopReason
    degraded: bool
    elapsed_ms: float


SearchStreamEvent = RetrievalEvent | ActionEvent | EndEvent | SearchResponse
"""What a streamed search yields, in order; the last one is the `SearchResponse` (`event: result`)."""

STREAM_EVENT_MODELS: dict[str, type[BaseModel]] = {
    "retrieval": RetrievalEvent, "action": ActionEvent, "end": EndEvent, "result": SearchResponse}
"""Event name -> payload model (`error` carries the error envelope instead)."""
