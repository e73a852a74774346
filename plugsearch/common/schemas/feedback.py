"""`POST /feedback` and `GET /feedback`: marks from use. Every search the searcher answers carries a `search_id`
(`SearchResponse.search_id`); the key that searched (or an admin key, or the internal token) marks which of its
returned documents helped, and those marks become labelled questions for training (`plugsearch-feedback export`).

The limits live here, so a mark that is too large is refused before any work (422)."""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, model_validator

from plugsearch.common.schemas.base import StrictModel, bounded_text

SEARCH_ID_PATTERN = r"^[A-Za-z0-9_-]{16,64}$"
"""What a search id looks like (the searcher mints 22 URL-safe characters: 128 random bits)."""
MAX_MARKED_IDS = 256
"""At most this many document ids in `helpful`, and as many in `not_helpful`."""
MAX_DOC_ID_CHARS = 512
MAX_ANSWER_CHARS = 8_000
MAX_COMMENT_CHARS = 2_000
MAX_PAGE = 500
"""The most marks one `GET /feedback` page holds."""

DocumentId = Annotated[str, StringConstraints(min_length=1, max_length=MAX_DOC_ID_CHARS)]


def _unique(ids: list[str]) -> list[str]:
    return list(dict.fromkeys(ids))


class FeedbackRequest(StrictModel):
    """A mark on one search: which of its returned documents helped (and, optionally, which did not, the answer
    the user's LLM gave from them, a comment). A second mark on the same search replaces the first."""

    search_id: str = Field(..., pattern=SEARCH_ID_PATTERN, description="the `search_id` of the search's response")
    helpful: list[DocumentId] = Field(default_factory=list, max_length=MAX_MARKED_IDS, description=(
        "ids of returned documents that helped answer the question"))
    not_helpful: list[DocumentId] = Field(default_factory=list, max_length=MAX_MARKED_IDS, description=(
        "ids of returned documents that did not help"))
    answer: bounded_text(MAX_ANSWER_CHARS) | None = Field(  # type: ignore[valid-type]
        None, description="the answer the user's LLM gave from these documents (kept with the mark)")
    comment: bounded_text(MAX_COMMENT_CHARS) | None = Field(None, description="a free-text note")  # type: ignore[valid-type]

    @model_validator(mode="after")
    def _check(self) -> FeedbackRequest:
        self.helpful = _unique(self.helpful)
        self.not_helpful = _unique(self.not_helpful)
        if not self.helpful and not self.not_helpful:
            raise ValueError("mark at least one document: helpful and/or not_helpful")
        both = sorted(set(self.helpful) & set(self.not_helpful))
        if both:
            raise ValueError(f"a document cannot be both helpful and not helpful: {', '.join(both[:10])}")
        return self


class FeedbackResponse(BaseModel):
    """The mark as stored (durably: it survives a crash of the searcher once this is answered)."""

    search_id: str
    helpful: list[str]
    not_helpful: list[str]
    replaced: bool = Field(..., description="true when it replaced an earlier mark on the same search")
    marked_at: float = Field(..., description="when it was stored (Unix seconds)")


class MarkedDocument(BaseModel):
    """A document the search returned, as the mark keeps it."""

    id: str
    title: str = ""


class FeedbackRecord(BaseModel):
    """One marked search: the question, what it returned, and the mark."""

    seq: int = Field(..., description="the mark's position (a newer mark, or a replaced one, has a higher one): "
                                      "page on with `after`")
    search_id: str
    owner: str = Field(..., description="who searched: `key:<key id>` (a digest prefix, never the key), `internal` "
                                        "or `anonymous:<address id>`")
    question: str
    mode: str
    policy_model: str | None = None
    documents: list[MarkedDocument] = Field(..., description="the documents the search returned, in order")
    helpful: list[str]
    not_helpful: list[str]
    answer: str | None = None
    comment: str | None = None
    searched_at: float = Field(..., description="Unix seconds")
    marked_at: float = Field(..., description="Unix seconds")


class FeedbackQuery(BaseModel):
    """The query of `GET /feedback` (query parameters, read as such: not strict)."""

    model_config = ConfigDict(extra="forbid")

    after: int = Field(0, ge=0, le=2**62, description="marks after this `seq` (the previous page's `next_after`)")
    limit: int = Field(100, ge=1, le=MAX_PAGE, description="marks per page")
    since: float | None = Field(None, ge=0, le=1e11, description="only marks stored at or after this time "
                                                                  "(Unix seconds)")


class FeedbackPage(BaseModel):
    """A page of marks, oldest first (by `seq`)."""

    marks: list[FeedbackRecord]
    next_after: int | None = Field(None, description="pass as `after` for the next page; null: this was the last")
