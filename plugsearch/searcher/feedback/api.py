"""`POST /feedback` (mark which documents of a search helped) and `GET /feedback` (pages of marks): thin, the
rules are `plugsearch.searcher.feedback.service.Feedback`'s."""

from __future__ import annotations

from typing import Annotated

from fastapi import Query, Request

from plugsearch.common.admission import CALLER_STATE, COST_STATE, Caller
from plugsearch.common.app import from_state, service_router
from plugsearch.common.errors import error_responses
from plugsearch.common.schemas.feedback import FeedbackPage, FeedbackQuery, FeedbackRequest, FeedbackResponse
from plugsearch.searcher.feedback.service import FEEDBACK_COST, Feedback
from plugsearch.searcher.serving import SearchService

router = service_router("feedback")

COMMON = {409: "this searcher keeps no marks (SEARCHER_FEEDBACK=off)",
          429: "the key's rate limit spent (rate_limited), or overloaded; retry after Retry-After",
          503: "the feedback store cannot be used right now (busy, or it could not be opened); retry after Retry-After"}


def _feedback(request: Request) -> tuple[Feedback, Caller | None]:
    service = from_state(request, "service", SearchService, starting="searcher is still starting")
    setattr(request.state, COST_STATE, FEEDBACK_COST)
    caller = getattr(request.state, CALLER_STATE, None)
    return service.feedback, caller if isinstance(caller, Caller) else None


@router.post("/feedback", response_model=FeedbackResponse, responses=error_responses({
    **COMMON, 403: "the search belongs to another key (a key marks its own searches; an admin key or the internal "
                   "token any)",
    404: "unknown search_id, or the search is older than its marking window",
    422: "invalid mark: document ids the search did not return (named), none marked, one both helpful and not, "
         "or over a size limit"}))
async def mark(body: FeedbackRequest, request: Request) -> FeedbackResponse:
    """Mark which documents of a search helped (`helpful`) and, optionally, which did not, with the answer your LLM
    gave and a comment. Idempotent: a second mark on the same search replaces the first (`replaced`). Once this
    answers 200 the mark is on disk."""
    feedback, caller = _feedback(request)
    return await feedback.mark(body, caller)


@router.get("/feedback", response_model=FeedbackPage, responses=error_responses({
    **COMMON, 422: "invalid paging parameters"}))
async def marks(query: Annotated[FeedbackQuery, Query()], request: Request) -> FeedbackPage:
    """The marks, oldest first, a page at a time (`after` = the last page's `next_after`): every key's for an admin
    key or the internal token, else the caller's own."""
    feedback, caller = _feedback(request)
    return await feedback.page(query, caller)
