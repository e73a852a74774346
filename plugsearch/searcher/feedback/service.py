"""Marks from use, the searcher's side (knows nothing of FastAPI): an id for every answer (`Feedback.issue`, the
answer recorded for the writer thread to store), marks on them (`Feedback.mark`) and pages of marks
(`Feedback.page`).

Who may do what: a key marks and reads its own searches; an admin key (`SEARCHER_ADMIN_KEYS`) and the internal
token mark and read every key's; where no keys are configured the service is open and so are its marks. A mark or a
page costs `FEEDBACK_COST` units of the key's budget (the searcher's rate limit, `SEARCHER_RATE_LIMIT_PER_S`).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import secrets
import sqlite3
import time
from typing import Any

from plugsearch.common.admission import Caller
from plugsearch.common.errors import Conflict, NotFound, NotReady
from plugsearch.common.schemas.feedback import (
    FeedbackPage,
    FeedbackQuery,
    FeedbackRecord,
    FeedbackRequest,
    FeedbackResponse,
)
from plugsearch.common.schemas.searcher import SearchResponse
from plugsearch.searcher.admission import SearchAdmission
from plugsearch.searcher.feedback.store import (
    FeedbackStore,
    FeedbackStoreError,
    SearchExpired,
    SearchRecord,
    StoreLimits,
)
from plugsearch.searcher.settings import SearcherSettings

logger = logging.getLogger(__name__)

FEEDBACK_COST = 1.0
"""Cost units of one mark or one page of marks (a naive search costs 1.0)."""
PENDING_WAIT_S = 1.0
"""How long a mark on an id this searcher does not know yet waits for it: another worker's writer may not have
written that search yet (it writes within milliseconds unless the file is busy)."""
POLL_S = 0.05


def owner_of(caller: Caller | None) -> str:
    """Who a search or a mark belongs to: `key:<key id>` (a digest prefix, never the key), `internal`,
    `anonymous:<address id>`."""
    if caller is None:
        return "unknown"
    return "internal" if caller.kind == "internal" else f"{caller.kind}:{caller.id}"


def open_store(settings: SearcherSettings) -> tuple[FeedbackStore | None, str | None]:
    """The store `settings` ask for: (store, None), or (None, why there is none): off, or the file cannot be used
    (logged as an error: searches go on, without ids; `/feedback` answers 503 with the reason)."""
    if settings.feedback == "off":
        return None, "this searcher keeps no marks (SEARCHER_FEEDBACK=off)"
    limits = StoreLimits(max_searches=settings.feedback_max_searches, search_ttl_s=settings.feedback_search_ttl_s,
                         max_marks=settings.feedback_max_marks, mark_ttl_s=settings.feedback_mark_ttl_s,
                         text_chars=settings.feedback_text_chars)
    try:
        return FeedbackStore(settings.feedback_db, limits), None
    except (OSError, sqlite3.Error, FeedbackStoreError) as exc:
        logger.error("the feedback store %s cannot be used, so searches carry no search_id and POST /feedback "
                     "answers 503: %s", settings.feedback_db, exc)
        return None, "the feedback store could not be opened at start-up (the searcher's log says why)"


class Feedback:
    """`store` None: no marks kept (`reason` says why: off answers 409, a store that could not open 503)."""

    def __init__(self, store: FeedbackStore | None, *, admission: SearchAdmission, admin_ids: frozenset[str],
                 reason: str | None = None, off: bool = False, counters: Any = None, workers: int = 1) -> None:
        self.store = store
        self.workers = workers
        """Worker processes sharing the file: with more than one, a search another worker answered may still be
        on its way to the file when its mark arrives here (`_pending`)."""
        self.admission = admission
        self.admin_ids = admin_ids
        self.reason = reason
        self.off = off
        self.counters = counters
        """`SearcherMetrics`' feedback counters (`feedback_searches`, `feedback_marks`), or None."""

    def describe(self) -> dict[str, Any]:
        """For `/version`: on, off or unavailable (and why), the limits."""
        if self.store is None:
            return {"state": "off" if self.off else "unavailable", "reason": self.reason}
        limits = self.store.limits
        return {"state": "on", "file": self.store.path.name, "max_searches": limits.max_searches,
                "search_ttl_s": limits.search_ttl_s, "max_marks": limits.max_marks, "mark_ttl_s": limits.mark_ttl_s}

    # --------------------------------------------------------------------------------------------- ids
    def issue(self, response: SearchResponse, caller: Caller | None) -> SearchResponse:
        """`response` with a fresh `search_id`, recorded for marking (queued: the writer thread stores it); as it
        is (no id) when no marks are kept or the writer is too far behind."""
        store = self.store
        if store is None or store.writer is None:
            return response
        search_id = secrets.token_urlsafe(16)
        record = SearchRecord(search_id, owner_of(caller), response.question, response.mode, response.policy_model,
                              [(d.id, d.title, d.text) for d in response.documents], time.time())
        recorded = store.writer.record(record)
        if self.counters is not None:
            self.counters.feedback_searches.labels("queued" if recorded else "dropped").inc()
        return response.model_copy(update={"search_id": search_id}) if recorded else response

    # ------------------------------------------------------------------------------------------- marks
    def sees_all(self, caller: Caller | None) -> bool:
        """Whether `caller` may mark and read every key's searches: the internal token, an admin key, and anyone
        where no keys are configured (anonymous callers)."""
        return caller is None or caller.kind in ("internal", "anonymous") or (
            caller.kind == "key" and caller.id in self.admin_ids)

    def _store(self) -> FeedbackStore:
        if self.store is None:
            if self.off:
                raise Conflict(self.reason or "this searcher keeps no marks")
            raise NotReady(self.reason or "the feedback store cannot be used", retry_after=30)
        return self.store

    async def mark(self, request: FeedbackRequest, caller: Caller | None) -> FeedbackResponse:
        """Store the mark (replacing an earlier one on the same search), synced to disk before it returns. 404 for
        an unknown or expired id, 403 for another key's search, 422 for ids the search did not return, 429 past the
        key's budget, 503 when the store cannot write."""
        store = self._store()
        await self.admission.charge(caller, FEEDBACK_COST)
        call = functools.partial(store.mark, request.search_id, marker=owner_of(caller),
                                 may_mark_any=self.sees_all(caller), helpful=request.helpful,
                                 not_helpful=request.not_helpful, answer=request.answer, comment=request.comment)
        try:
            try:
                stored = await asyncio.to_thread(call)
            except SearchExpired:
                raise
            except NotFound:
                await self._pending(store, request.search_id)
                stored = await asyncio.to_thread(call)
        except Exception:
            if self.counters is not None:
                self.counters.feedback_marks.labels("refused").inc()
            raise
        if self.counters is not None:
            self.counters.feedback_marks.labels("replaced" if stored.replaced else "stored").inc()
        return FeedbackResponse(search_id=stored.search_id, helpful=stored.helpful, not_helpful=stored.not_helpful,
                                replaced=stored.replaced, marked_at=stored.marked_at)

    async def _pending(self, store: FeedbackStore, search_id: str) -> None:
        """Give a search answered a moment ago the time to be written: this process's writer flushed, then, with
        several workers, up to `PENDING_WAIT_S` for another worker's (the next try answers 404 if it still is not
        there)."""
        if store.writer is not None:
            await asyncio.to_thread(store.writer.flush, PENDING_WAIT_S)
        if self.workers <= 1:
            return  # this process's writer was the only one
        deadline = time.monotonic() + PENDING_WAIT_S
        while time.monotonic() < deadline:  # another process's write: nothing here to wait on but the file
            if await asyncio.to_thread(store.has_search, search_id):
                return
            await asyncio.sleep(POLL_S)

    async def page(self, query: FeedbackQuery, caller: Caller | None) -> FeedbackPage:
        """Marks after `query.after`, oldest first: every key's for the internal token and admin keys (and on an
        open service), else the caller's own."""
        store = self._store()
        await self.admission.charge(caller, FEEDBACK_COST)
        owner = None if self.sees_all(caller) else owner_of(caller)
        rows = await asyncio.to_thread(store.marks, owner=owner, after=query.after, limit=query.limit,
                                       since=query.since)
        return FeedbackPage(marks=[FeedbackRecord(**row) for row in rows],
                            next_after=rows[-1]["seq"] if len(rows) == query.limit else None)

    async def aclose(self) -> None:
        """Write what is queued and close the file."""
        if self.store is not None:
            await asyncio.to_thread(self.store.close)
