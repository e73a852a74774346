from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field

from plugsearch.common.schemas.base import StrictModel, bounded_text

JudgeMode = Literal["genacc", "span", "llm", "em", "f1"]
DecidedBy = Literal["span", "llm", "em", "f1", "undecided"]

MAX_PREDICTION_CHARS = 8192
MAX_ANSWER_CHARS = 1024
MAX_ANSWERS = 100
MAX_BATCH = 1024

Answer = bounded_text(MAX_ANSWER_CHARS)


class JudgeRequest(StrictModel):
    prediction: bounded_text(MAX_PREDICTION_CHARS)  # type: ignore[valid-type]
    golden_answers: list[Answer] = Field(..., min_length=1, max_length=MAX_ANSWERS)  # type: ignore[valid-type]
    question: bounded_text(4096) | None = None  # type: ignore[valid-type]
    mode: JudgeMode = "genacc"


class JudgeResult(BaseModel):
    score: float | None = Field(..., description="the mode's score; null when undecided")
    genacc: float | None = None
    em: float
    f1: float
    decided_by: DecidedBy
    reason: str | None = Field(None, description="why undecided, or why an LLM verdict is doubtful")
    cached: bool = Field(False, description="the LLM verdict came from the cache")


class JudgeBatchRequest(StrictModel):
    items: list[JudgeRequest] = Field(..., min_length=1, max_length=MAX_BATCH)


class JudgeBatchResponse(BaseModel):
    results: list[JudgeResult]
