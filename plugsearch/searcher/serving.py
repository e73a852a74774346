"""The searcher's logic behind the API: request -> prepared search (checked, its parameters, its price, its cache
key: `SearchService.prepare`, once) -> admission (`plugsearch.searcher.admission`) -> cached search -> response +
metrics, and the response's `search_id` for marks (`plugsearch.searcher.feedback`).

Knows nothing of FastAPI. The loop itself lives in `plugsearch.searcher.loop` (shared with the trainer).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncGenerator, Sequence
from typing import Any, NamedTuple

from prometheus_client import CollectorRegistry, Counter, Histogram
from pydantic import ValidationError

from plugsearch.common import sse, tracing
from plugsearch.common.admission import Caller, RateLimiter
from plugsearch.common.cache import ResultCache, cache_key
from plugsearch.common.errors import BadRequest, ErrorDetail, ErrorEnvelope, NotReady, ServiceError
from plugsearch.common.logging import get_request_id
from plugsearch.common.metrics import LATENCY_BUCKETS
from plugsearch.common.schemas.searcher import (
    ActionEvent,
    EndEvent,
    RetrievalEvent,
    SearchedDocument,
    SearchParams,
    SearchRequest,
    SearchResponse,
    SearchTrace,
    TraceBlock,
    TraceMessage,
    search_cost,
)
from plugsearch.searcher import parsing
from plugsearch.searcher.admission import SearchAdmission
from plugsearch.searcher.corpus_check import CorpusGate
from plugsearch.searcher.env import EventSink, RetrieverBackend, SearchEvent, SearchOutcome
from plugsearch.searcher.feedback.service import Feedback
from plugsearch.searcher.feedback.store import FeedbackStore
from plugsearch.searcher.index_identity import IndexIdentity
from plugsearch.searcher.loop import run_search
from plugsearch.searcher.policy import PolicyRefusal, SearcherPolicy
from plugsearch.searcher.policy_corpus import CorpusMismatch, bound_corpus, check_corpus, corpus_drift
from plugsearch.searcher.prompts import PromptSet
from plugsearch.searcher.settings import SearcherSettings

logger = logging.getLogger(__name__)

CACHE_NAMESPACE = "search"
REQUEST_PARAMS = {"max_turns", "retrieve_k", "select_k", "constrained"}
"""Search parameters a request may set; where it does not, the service's setting of the same name (for s3, the
served policy's trained setting first: `SearchService.defaults`)."""
SETTINGS_PARAMS = REQUEST_PARAMS | {"temperature", "max_new_tokens", "constraint_style", "max_invalid",
                                    "max_queries_per_round", "doc_chars"}
SETTING_FIELDS = ("retrieve_k", "select_k", "max_turns")
"""The service settings a policy's trained setting replaces as the defaults of its s3 searches, unless the
operator set them explicitly (SEARCHER_RETRIEVE_K, ...)."""


class SearcherMetrics:
    """Search-level metrics, registered in the app's registry next to the HTTP ones."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.turns = Histogram("searcher_turns", "policy steps per search", ["mode"],
                               buckets=(0, 1, 2, 3, 4, 5, 6, 8, 11), registry=registry)
        self.queries = Histogram("searcher_queries", "queries issued per search", ["mode"],
                                 buckets=(0, 1, 2, 3, 4, 6, 9, 12, 20, 30), registry=registry)
        self.documents = Histogram("searcher_documents_returned", "documents returned per search", ["mode"],
                                   buckets=(0, 1, 2, 3, 5, 8, 12, 16, 24, 32, 64), registry=registry)
        self.stops = Counter("searcher_stop_total", "searches by stop reason", ["mode", "reason"],
                             registry=registry)
        self.degraded = Counter("searcher_degraded_total", "degraded searches", ["mode", "reason"],
                                registry=registry)
        self.actions = Counter("searcher_actions_total", "policy actions by validity", ["mode", "validity"],
                               registry=registry)
        self.stage_seconds = Histogram("searcher_stage_seconds", "time per stage of one search", ["stage"],
                                       buckets=LATENCY_BUCKETS, registry=registry)
        self.feedback_searches = Counter("searcher_feedback_searches_total", "answers given a search_id and queued "
                                         "for the feedback store (queued), or not (dropped: the writer is behind)",
                                         ["outcome"], registry=registry)
        self.feedback_marks = Counter("searcher_feedback_marks_total", "marks stored, replacing an earlier one, or "
                                      "refused", ["outcome"], registry=registry)

    def observe(self, outcome: SearchOutcome) -> None:
        mode = outcome.mode
        self.turns.labels(mode).observe(outcome.turns)
        self.queries.labels(mode).observe(len(outcome.queries))
        self.documents.labels(mode).observe(len(outcome.documents))
        self.stops.labels(mode, outcome.stop_reason).inc()
        if outcome.degraded:
            self.degraded.labels(mode, outcome.stop_reason).inc()
        self.actions.labels(mode, "valid").inc(outcome.valid_actions)
        self.actions.labels(mode, "invalid").inc(outcome.invalid_actions)
        t = outcome.timings
        for stage, ms in (("total", t.total_ms), ("retrieval", t.retrieval_ms), ("policy", t.policy_ms),
                          ("overhead", t.overhead_ms)):
            self.stage_seconds.labels(stage).observe(ms / 1000)


def to_response(outcome: SearchOutcome, *, return_trace: bool) -> SearchResponse:
    trace = None
    if return_trace:
        trace = SearchTrace(
            messages=[TraceMessage(role=m.role, content=m.content) for m in outcome.messages],
            blocks=[TraceBlock(turn=b.turn, queries=b.queries, method=b.method,
                               document_ids=[d.id for d in b.documents], selected=b.selected)
                    for b in outcome.blocks])
    return SearchResponse(
        question=outcome.question, mode=outcome.mode, documents=outcome.documents,
        context=parsing.format_documents(outcome.documents), queries=outcome.queries, turns=outcome.turns,
        stop_reason=outcome.stop_reason, degraded=outcome.degraded, degraded_reason=outcome.degraded_reason,
        timings=outcome.timings, valid_actions=outcome.valid_actions,
        invalid_actions=outcome.invalid_actions, policy_model=outcome.policy_model,
        prompt_version=outcome.prompt_version, trace=trace)


class PreparedSearch(NamedTuple):
    """A search request prepared once (`SearchService.prepare`), then admitted, looked up and run as it is."""

    request: SearchRequest
    params: SearchParams
    """What it runs with: its mode's defaults (s3: the policy's trained setting), what it asked, the methods of
    its first retrieval; naive BM25 top-k where the corpus check serves an s3 search so (`fallback`)."""
    cost: float
    """Its price, from its parameters before the corpus check (a fallback costs what was asked)."""
    key: str
    cache: ResultCache | None
    """Where its result is looked up and kept (None: not cached, e.g. while the served index is unknown)."""
    fallback: str | None
    """Why naive BM25 top-k serves this s3 search instead of the policy (the corpus check), None when it does not."""
    uses_llm: bool
    """Whether it calls an LLM, so holds one of the LLM's slots."""


class SearchService:
    """`policy`: the served policy (`plugsearch.searcher.policy.SearcherPolicy`; a bare chat LLM is served as a
    `ChatPolicy`). Its trained setting gives the defaults of s3 searches (`defaults`); naive and QAgent
    searches keep the service's own. `admission` (`SearchAdmission`): the bound, budgets and LLM slots."""

    def __init__(self, settings: SearcherSettings, *, policy: SearcherPolicy,
                 retriever: RetrieverBackend, cache: ResultCache | None = None,
                 metrics: SearcherMetrics | None = None, index_identity: IndexIdentity | None = None,
                 rate_limiter: RateLimiter | None = None, corpus_gate: CorpusGate | None = None,
                 feedback_store: FeedbackStore | None = None, feedback_reason: str | None = None) -> None:
        self.settings = settings
        self.admission = SearchAdmission(settings, rate_limiter)
        self.feedback = Feedback(feedback_store, admission=self.admission, admin_ids=settings.admin_ids(),
                                 reason=feedback_reason or "this searcher keeps no marks",
                                 off=feedback_store is None and settings.feedback == "off", counters=metrics,
                                 workers=settings.workers)
        """Marks from use: a `search_id` for every answer (`search`, `open_stream`, `search_batch`), and the marks."""
        self.index_identity = index_identity
        self.drift: dict[str, Any] | None = None
        """How far the served corpus has moved from the one a bound policy was trained on (`corpus_drift`)."""
        self.policy = policy
        self.retriever = retriever
        self.corpus_gate = corpus_gate
        self._background: set[asyncio.Task[None]] = set()
        self.cache = cache if settings.cache_enabled else None
        self.metrics = metrics
        self.prompts = PromptSet.load(settings.prompts_dir)
        self._defaults = {mode: self._mode_defaults(mode) for mode in ("s3", "qagent", "naive")}
        evaluation = self.policy.manifest.get("evaluation")
        if isinstance(evaluation, dict) and evaluation.get("questions") == "pseudo":
            logger.warning("%s was trained and evaluated on questions made from its corpus only: its gain on real "
                           "questions is not known, so naive BM25 answers s3 searches on that corpus "
                           "(SEARCHER_CORPUS_CHECK=off serves it anyway)", self.policy.model)
        overridden = self.overridden()
        if overridden:
            logger.warning("%s set explicitly: s3 searches of %s run outside the setting it was trained in (%s)",
                           ", ".join(f"SEARCHER_{k.upper()}={getattr(settings, k)}" for k in overridden),
                           self.policy.model, ", ".join(f"{k} {v}" for k, v in self.trained_setting().items()))

    def trained_setting(self) -> dict[str, Any]:
        setting = self.policy.setting
        return setting.defaults() if setting is not None else {}

    def overridden(self) -> list[str]:
        """The service settings set explicitly (environment, arguments) that differ from the policy's trained
        setting: they win over it, for every mode."""
        trained = self.trained_setting()
        return [k for k in SETTING_FIELDS if k in trained and k in self.settings.model_fields_set
                and getattr(self.settings, k) != trained[k]]

    def _mode_defaults(self, mode: str) -> dict[str, Any]:
        """A search's parameters where its request sets none: the service's settings, and for s3 the policy's
        trained setting (pool size, documents, follow-up searches, the follow-up method) in place of the
        settings the operator left at their defaults."""
        defaults: dict[str, Any] = {**self.settings.model_dump(include=SETTINGS_PARAMS), "method": None}
        if mode == "s3":
            explicit = self.settings.model_fields_set
            defaults.update({k: v for k, v in self.trained_setting().items()
                             if k not in SETTING_FIELDS or k not in explicit})
        return defaults

    def defaults(self, mode: str) -> dict[str, Any]:
        """The parameters of a search in `mode` whose request sets none (also shown by `/version`)."""
        return dict(self._defaults[mode])

    def params_for(self, request: SearchRequest) -> SearchParams:
        asked = request.model_dump(include=REQUEST_PARAMS | {"method"}, exclude_none=True)
        return SearchParams(**{**self._defaults[request.mode], **asked}, mode=request.mode,
                            timeout_s=self.settings.search_timeout_s)

    def key(self, question: str, params: SearchParams, index_id: str | None = None, *,
            fallback: str | None = None) -> str:
        payload: dict[str, Any] = {
            "question": question,
            "index": index_id,
            "params": params.model_dump(exclude={"timeout_s"}),
            "policy_model": self.policy.model if params.mode != "naive" else None,
            "prompt_version": self.prompts.version,
        }
        if fallback:  # an s3 search served by naive top-k: its own entry (its response says why)
            payload["fallback"] = fallback
        return cache_key(CACHE_NAMESPACE, payload)

    def _params(self, request: SearchRequest) -> SearchParams:
        try:
            params = self.params_for(request)
        except ValidationError as exc:  # e.g. select_k over the service's default retrieve_k
            errors = exc.errors()
            raise BadRequest(str(errors[0].get("msg", "invalid parameters")) if errors else "invalid parameters",
                             param="select_k") from exc
        try:
            self.policy.check_request(params, method_asked=request.method)
        except PolicyRefusal as exc:
            raise BadRequest(exc.message, param=exc.param) from exc
        return params

    def _cost(self, params: SearchParams, question: str) -> float:
        """The search's price (`search_cost`, the one pricing of every policy: its retrievals, and an LLM
        policy's calls): naive top-k as such; in a loop mode, as the policy prices it (whatever the retriever
        serves at the moment: the compact policy prices its trained pool)."""
        if params.mode == "naive":
            return search_cost(params, len(question))
        return self.policy.cost(params, len(question))

    async def _pool(self, params: SearchParams) -> SearchParams:
        """The methods of an s3 search's first retrieval, as the policy asks for them given what the retriever
        serves (`SEARCHER_COMPACT_DENSE`: auto reads the retriever's `/version`; on: the policy's whole trained
        pool; off: its pool without the dense block)."""
        if params.mode != "s3":
            return params
        await self._check_corpus()
        setting = self.settings.compact_dense
        trained = self.policy.setting
        served: list[str] | None
        encoder: str | None
        if setting == "off":
            served, encoder = ["bm25"], None
        elif setting == "on":
            served = list(trained.pool_methods or ["bm25"]) if trained is not None else ["bm25", "dense"]
            encoder = trained.encoder if trained is not None else None
        elif self.index_identity is not None:
            served, encoder = await self.index_identity.served()
        else:
            return params
        pool = self.policy.first_retrieval(served, encoder)
        return params if pool is None else params.model_copy(update={"pool_methods": pool})

    async def _check_corpus(self) -> None:
        """A policy bound to the corpus it was trained on (its manifest: `plugsearch.searcher.policy_corpus`)
        refuses to search another one: 503 with what differs, read from the retriever's `/version`."""
        policy = self.policy
        if self.index_identity is None or bound_corpus(policy.manifest) is None:
            return
        details = await self.index_identity.details()
        if not details:
            return  # not known yet: the next search asks again
        methods = details.get("methods")
        dense = isinstance(methods, list) and "dense" in methods
        encoder, index, checksum = details.get("encoder"), details.get("dense_index"), details.get("corpus_checksum")
        try:
            check_corpus(policy.manifest, corpus_sha256=checksum if isinstance(checksum, str) else None,
                         encoder=encoder if dense and isinstance(encoder, str) else None,
                         dense_index=index if dense and isinstance(index, str) else None,
                         name=f"the policy {policy.model}")
        except CorpusMismatch as exc:
            raise NotReady(str(exc)) from exc
        changes = details.get("changes")
        drift = corpus_drift(policy.manifest, changes if isinstance(changes, dict) else None)
        if drift is not None and drift["advice"] and drift["advice"] != (self.drift or {}).get("advice"):
            logger.warning("the policy %s: %s", policy.model, drift["advice"])
        self.drift = drift

    async def prepare(self, request: SearchRequest) -> PreparedSearch:
        """The one preparation of a search, before any admission or work (the route's, once per request or
        batch item): its parameters checked (400: `_params`, the policy's `check_request`), made effective
        (defaults, the methods of its first retrieval: `_pool`, which refuses with 503 to search another corpus
        than the one a bound policy was trained on), priced (`_cost`), then the corpus check's decision and its
        cache key."""
        params = await self._pool(self._params(request))
        cost = self._cost(params, request.question)
        cache, index_id = self.cache, None
        if self.index_identity is not None and cache is not None:  # the identity now: no answer from before a change
            index_id = await self.index_identity.fresh()
        elif self.index_identity is not None and self.corpus_gate is not None:
            index_id = await self.index_identity.current()
        if cache is not None and self.index_identity is not None and index_id is None:
            cache = None  # which index would answer is unknown: no cache
        params, fallback = await self._gated(params, index_id)
        key = self.key(request.question, params, index_id, fallback=fallback)
        uses_llm = params.mode != "naive" and self.policy.uses_llm(params.mode)
        return PreparedSearch(request, params, cost, key, cache, fallback, uses_llm)

    async def _gated(self, params: SearchParams, index_id: str | None) -> tuple[SearchParams, str | None]:
        """An s3 search's parameters after the corpus check (`plugsearch.searcher.corpus_check`): the policy's
        where it passed on the served index, else naive BM25 top-`select_k` and the reason."""
        gate = self.corpus_gate
        if gate is None or params.mode != "s3":
            return params, None
        if index_id is None:  # the retriever has not said what it serves: the last verdict, else naive
            result = gate.last
            pending = "the retriever has not said which index it serves yet; naive BM25 top-k serves meanwhile"
        else:
            details = await self.index_identity.details() if self.index_identity is not None else {}
            result = gate.verdict(index_id, params, details)
            pending = gate.pending_reason(index_id, params, details)
        if result is not None and result.decision == "policy":
            return params, None
        reason = result.reason if result is not None else pending
        naive = SearchParams(mode="naive", retrieve_k=params.select_k, select_k=params.select_k, max_turns=0,
                             method="bm25", timeout_s=params.timeout_s)
        return naive, reason

    def start_corpus_check(self) -> None:
        """Start the corpus check of the served index now (the lifespan calls it, so the verdict is there before
        the first search asks); a no-op without a gate or before the retriever says what it serves."""
        if self.corpus_gate is None:
            return

        async def warm() -> None:
            with contextlib.suppress(ServiceError, ValidationError):
                await self.prepare(SearchRequest(question="corpus check"))

        task = asyncio.get_running_loop().create_task(warm())
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def aclose(self) -> None:
        """Cancel the background work it started (the corpus check's first search), before its clients close."""
        for task in list(self._background):
            task.cancel()
        await asyncio.gather(*self._background, return_exceptions=True)

    async def corpus_checked(self) -> None:
        """Wait until the corpus check started by `start_corpus_check` (or a search) has ended (tests, tools)."""
        await asyncio.gather(*self._background, return_exceptions=True)
        if self.corpus_gate is not None:
            await self.corpus_gate.settled()

    async def _cached(self, prepared: PreparedSearch) -> SearchResponse | None:
        if prepared.cache is None:
            return None
        response = await prepared.cache.get_model(prepared.key, SearchResponse)
        if response is None:
            return None
        trace = response.trace if prepared.request.return_trace else None
        return response.model_copy(update={"cached": True, "trace": trace})

    async def _run(self, prepared: PreparedSearch, on_event: EventSink | None = None) -> SearchResponse:
        request = prepared.request
        outcome = await run_search(request.question, prepared.params, policy=self.policy,
                                   retriever=self.retriever,
                                   prompts=self.prompts, on_event=on_event)
        if prepared.fallback is not None:
            outcome = outcome.model_copy(update={"mode": request.mode})
        if self.metrics is not None:
            self.metrics.observe(outcome)
        if outcome.degraded:
            logger.warning("search degraded (%s): %s", outcome.stop_reason, outcome.degraded_reason)
        logger.info("search mode=%s turns=%d queries=%d docs=%d stop=%s valid=%d invalid=%d total_ms=%.0f "
                    "policy_ms=%.0f retrieval_ms=%.0f", outcome.mode, outcome.turns, len(outcome.queries),
                    len(outcome.documents), outcome.stop_reason, outcome.valid_actions, outcome.invalid_actions,
                    outcome.timings.total_ms, outcome.timings.policy_ms, outcome.timings.retrieval_ms)
        store = None if outcome.degraded else prepared.cache
        # the cached entry keeps the trace (a later request may ask for it); build it only when needed
        full = to_response(outcome, return_trace=store is not None or request.return_trace)
        if prepared.fallback is not None:
            full = full.model_copy(update={"fallback": prepared.fallback})
        if store is not None:
            await store.set_json(prepared.key, full.model_dump(mode="json"))
        return full if request.return_trace or full.trace is None else full.model_copy(update={"trace": None})

    async def search(self, prepared: PreparedSearch, caller: Caller | None = None, *, extra_cost: float = 0.0,
                     hold_llm: bool = True, record: bool = True) -> SearchResponse:
        """One search (`prepare`d), its answer with a fresh `search_id` (`record` False: none, nothing kept for
        marks: the chat proxy, whose answer does not show it). See `answer`."""
        response = await self.answer(prepared, caller, extra_cost=extra_cost, hold_llm=hold_llm)
        return self.feedback.issue(response, caller) if record else response

    async def answer(self, prepared: PreparedSearch, caller: Caller | None = None, *, extra_cost: float = 0.0,
                     hold_llm: bool = True) -> SearchResponse:
        """One search (`prepare`d), without a `search_id`. Raises (-> 503) only when the retriever cannot give
        even the naive top-k.
        A cost over the bound is refused (422) before the cache is read; a cache hit is free; a miss spends the
        caller's budget first (`caller` None: no bound, no budget), and an LLM-bound one holds one of the LLM's
        slots while it runs. `extra_cost`: work the caller's request does besides (the chat proxy's answer),
        bounded and charged with the search, hit or miss; `hold_llm` False: the caller holds the LLM slot
        itself (the chat proxy, for search and answer)."""
        await self.admission.check_cost(caller, prepared.cost + extra_cost)
        hit = await self._cached(prepared)
        tracing.annotate({"plugsearch.cached": hit is not None})
        if hit is not None:
            await self.admission.charge(caller, extra_cost)
            return hit
        release = await self.admission.admit(caller, prepared.cost + extra_cost, int(hold_llm and prepared.uses_llm))
        try:
            return await self._run(prepared)
        finally:
            release()

    async def open_stream(self, prepared: PreparedSearch, caller: Caller | None = None
                          ) -> AsyncGenerator[bytes, None]:
        """One search as server-sent events (`plugsearch.common.schemas.searcher`: retrieval, action, end,
        then result). Its cost over the bound, and failures before the first event (the retriever down),
        raise here, so they answer with their status; a failure after it becomes an `error` event. A cache
        hit is the `result` event alone. Closing the returned generator (the client went away) cancels the
        search."""
        await self.admission.check_cost(caller, prepared.cost)
        hit = await self._cached(prepared)
        tracing.annotate({"plugsearch.cached": hit is not None})
        if hit is not None:
            return _single(sse.encode(self.feedback.issue(hit, caller).model_dump_json().encode(), "result"))
        release = await self.admission.admit(caller, prepared.cost, int(prepared.uses_llm))
        queue: asyncio.Queue[bytes | None] = asyncio.Queue()
        events = _StreamEvents(queue)

        async def run() -> SearchResponse:
            return self.feedback.issue(await self._run(prepared, on_event=events.on_event), caller)

        task = asyncio.create_task(run())

        def done(_: asyncio.Task[SearchResponse]) -> None:
            release()
            queue.put_nowait(None)

        task.add_done_callback(done)
        try:
            first = await queue.get()
        except BaseException:
            await _cancel(task)
            raise
        if first is None:  # done before any event: a failure answers with its status
            failure = task.exception()
            if failure is not None:
                raise failure
            return _single(_result_event(task))
        return _stream(first, queue, task)

    async def search_batch(self, items: Sequence[PreparedSearch], caller: Caller | None = None
                           ) -> list[SearchResponse]:
        """Many searches (each `prepare`d) at once (bounded concurrency), each answer with its own `search_id`;
        fails as a whole only if the retriever is down. The bound and the budget apply to the batch's total cost,
        spent up front."""
        cost = sum(item.cost for item in items)
        await self.admission.check_cost(caller, cost)
        await self.admission.charge(caller, cost)
        sem = asyncio.Semaphore(self.settings.batch_concurrency)

        async def one(i: int, item: PreparedSearch) -> SearchResponse:
            async with sem:
                with tracing.span("searcher.batch_item", {"plugsearch.item": i}):  # (its own `cached`)
                    return await self.answer(item)  # bound and budget: the whole batch's, above

        # LLM slots: as many as the batch runs LLM searches at once (at most all of them)
        llm_items = sum(item.uses_llm for item in items)
        release = await self.admission.take_llm_slots(caller, min(llm_items, self.settings.batch_concurrency))
        try:
            results = await asyncio.gather(*(one(i, item) for i, item in enumerate(items)), return_exceptions=True)
        finally:
            release()
        for result in results:
            if isinstance(result, BaseException):
                raise result
        return [self.feedback.issue(r, caller) for r in results if isinstance(r, SearchResponse)]


# ------------------------------------------------------------------------------------------ streaming
STREAM_KEEP_ALIVE_S = 15.0
"""A comment line after this long without events: proxies keep the connection, and a client that went
away is noticed even while the policy thinks."""


class _StreamEvents:
    """Turns the search environment's events into the wire events of `"stream": true` (block positions,
    ids of the marked documents, time since the start)."""

    def __init__(self, queue: asyncio.Queue[bytes | None]) -> None:
        self.queue = queue
        self.blocks: list[list[SearchedDocument]] = []
        self.started = time.perf_counter()

    def on_event(self, event: SearchEvent) -> None:
        elapsed_ms = (time.perf_counter() - self.started) * 1000
        data = event.data
        payload: RetrievalEvent | ActionEvent | EndEvent
        if event.type == "retrieval":
            self.blocks.append(list(data["documents"]))
            payload = RetrievalEvent.model_construct(
                block=len(self.blocks) - 1, turn=data["block_turn"], queries=data["queries"],
                method=data.get("method"), documents=data["documents"], step=event.turn, elapsed_ms=elapsed_ms)
        elif event.type == "action":
            selected: list[int] | None = data.get("selected")
            block, ids = None, None
            if selected is not None and self.blocks:  # a selection applies to the newest block, or the one named
                block = data.get("block", len(self.blocks) - 1)
                ids = [self.blocks[block][i - 1].id for i in selected if 1 <= i <= len(self.blocks[block])]
            query = data.get("query")
            payload = ActionEvent(step=event.turn, kind=data["kind"],
                                  queries=[query] if query is not None else list(data.get("queries", [])),
                                  block=block, selected=selected, selected_ids=ids, elapsed_ms=elapsed_ms)
        elif event.type == "end":
            payload = EndEvent(step=event.turn, stop_reason=data["stop_reason"], degraded=data["degraded"],
                               elapsed_ms=elapsed_ms)
        else:
            return
        self.queue.put_nowait(sse.encode(payload.model_dump_json().encode(), event.type))


def _result_event(task: asyncio.Task[SearchResponse]) -> bytes:
    """The finished search's last event: `result`, or `error` with the envelope; raises when the search
    failed and nothing was sent yet (the caller answers with the error's status)."""
    exc = task.exception()
    if exc is None:
        return sse.encode(task.result().model_dump_json().encode(), "result")
    if isinstance(exc, ServiceError):
        logger.warning("streamed search failed: %s %s", exc.type, exc.message)
        detail = ErrorDetail(type=exc.type, message=exc.message, param=exc.param, request_id=get_request_id())
    else:  # a bug: the trace to the log, a generic message to the client
        logger.error("streamed search failed", exc_info=exc)
        detail = ErrorDetail(type="internal_error", message="internal server error", request_id=get_request_id())
    return sse.encode(ErrorEnvelope(error=detail).model_dump_json().encode(), "error")


async def _single(event: bytes) -> AsyncGenerator[bytes, None]:
    yield event


async def _stream(first: bytes, queue: asyncio.Queue[bytes | None], task: asyncio.Task[SearchResponse]
                  ) -> AsyncGenerator[bytes, None]:
    try:
        yield first
        while True:
            try:
                item = await asyncio.wait_for(queue.get(), STREAM_KEEP_ALIVE_S)
            except TimeoutError:
                yield sse.KEEP_ALIVE
                continue
            if item is None:
                break
            yield item
        yield _result_event(task)
    finally:
        await _cancel(task)


async def _cancel(task: asyncio.Task[SearchResponse]) -> None:
    """Stop the search (no-op when it finished) and wait until it has."""
    if not task.done():
        task.cancel()
    await asyncio.gather(task, return_exceptions=True)
