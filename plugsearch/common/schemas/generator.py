from __future__ import annotations

from pydantic import BaseModel, Field

from plugsearch.common.schemas.base import StrictModel, bounded_text

MAX_QUESTION_CHARS = 4096
MAX_DOC_CHARS = 20_000
MAX_DOCS = 64
MAX_BATCH = 256


class GenDocument(StrictModel):
    id: str | None = Field(None, max_length=256, description="used in the cache key when given")
    title: str = Field("", max_length=1024)
    text: str = Field(..., max_length=MAX_DOC_CHARS)


class GenerateRequest(StrictModel):
    question: bounded_text(MAX_QUESTION_CHARS)  # type: ignore[valid-type]
    documents: list[GenDocument] = Field(default_factory=list, max_length=MAX_DOCS,
                                         description="empty = answer without retrieval")
    max_tokens: int | None = Field(None, ge=1, le=1024)


class GenerateResponse(BaseModel):
    answer: str
    cached: bool = False
    model: str
    prompt_version: str
    documents_used: int
    prompt_tokens: int = 0
    completion_tokens: int = 0


class GenerateBatchRequest(StrictModel):
    items: list[GenerateRequest] = Field(..., min_length=1, max_length=MAX_BATCH)


class GenerateBatchResponse(BaseModel):
    results: list[GenerateResponse]
