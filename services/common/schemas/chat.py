"""OpenAI-compatible chat completions (`POST /v1/chat/completions` on the searcher, opt-in).

The request is OpenAI's: fields this proxy does not use (`top_p`, `seed`, `response_format`, ...) are
kept and forwarded to the answer LLM as they came. One extension, `search`, tunes the search run on the
last user message (with the `openai` client: `extra_body={"search": {"mode": "naive"}}`).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, StringConstraints, field_validator

from services.common.schemas.base import StrictModel, no_nul
from services.common.schemas.searcher import MAX_RETRIEVE_K, MAX_TURNS, Method, SearchMode

MAX_MESSAGES = 256
MAX_CONTENT_CHARS = 200_000
MAX_ANSWER_TOKENS = 1_000_000
"""The schema's outer bound on `max_tokens`; the proxy's own, far lower, is `SEARCHER_CHAT__MAX_TOKENS_LIMIT`."""

Text = Annotated[str, StringConstraints(max_length=MAX_CONTENT_CHARS), AfterValidator(no_nul)]


class ContentPart(BaseModel):
    """One part of a message's content list (`{"type": "text", "text": ...}`; others pass through)."""

    model_config = ConfigDict(extra="allow")

    type: str = Field(..., max_length=64)
    text: Text | None = None


class ChatMessageIn(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)

    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: Text | list[ContentPart] | None = Field(None, max_length=MAX_CONTENT_CHARS)

    def text(self) -> str:
        """The message's text (the text parts of a content list, joined)."""
        if isinstance(self.content, str):
            return self.content
        return "\n".join(p.text for p in self.content or [] if p.type == "text" and p.text)


class ChatSearchOptions(StrictModel):
    """plugsearch's extension: how to search (unset: the service's defaults)."""

    mode: SearchMode | None = None
    max_turns: int | None = Field(None, ge=0, le=MAX_TURNS)
    retrieve_k: int | None = Field(None, ge=1, le=MAX_RETRIEVE_K)
    select_k: int | None = Field(None, ge=1, le=MAX_RETRIEVE_K)
    method: Method | None = None


class ChatCompletionRequest(BaseModel):
    """OpenAI's request. The fields below are checked here, in JSON's own types, before anything is
    forwarded (so a bad value is this caller's 422, never an upstream failure that counts against the
    answer LLM's breaker); other fields pass through as they came."""

    model_config = ConfigDict(extra="allow", strict=True)

    model: str | None = Field(None, max_length=256, description="ignored: the configured answer LLM answers")
    messages: list[ChatMessageIn] = Field(..., min_length=1, max_length=MAX_MESSAGES)
    stream: bool = False
    max_tokens: int | None = Field(None, ge=1, le=MAX_ANSWER_TOKENS, description=(
        "answer tokens at most (default and limit: the proxy's settings); charged to the caller up front"))
    max_completion_tokens: int | None = Field(None, ge=1, le=MAX_ANSWER_TOKENS,
                                              description="OpenAI's newer name of max_tokens")
    min_tokens: int | None = Field(None, ge=0, le=MAX_ANSWER_TOKENS,
                                   description="vLLM / llama.cpp extension: at most the request's max_tokens")
    n: Literal[1] | None = Field(None, description="one answer per request")
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, ge=0, le=1)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    seed: int | None = Field(None, ge=-(2**63), lt=2**63)
    stop: Annotated[str, StringConstraints(max_length=256), AfterValidator(no_nul)] | list[
        Annotated[str, StringConstraints(max_length=256), AfterValidator(no_nul)]] | None = Field(None, max_length=4)
    logit_bias: dict[str, float] | None = Field(None, max_length=300, description=(
        "token id (a decimal string) -> bias in [-100, 100]"))
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)
    search: ChatSearchOptions | None = Field(None, description="plugsearch extension: search options")

    @field_validator("logit_bias")
    @classmethod
    def _check_logit_bias(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        for token, bias in (value or {}).items():
            if not token.isascii() or not token.isdigit() or len(token) > 9:
                raise ValueError("logit_bias keys must be token ids (decimal strings)")
            if not -100 <= bias <= 100:
                raise ValueError("logit_bias values must be between -100 and 100")
        return value


class SearchSummary(BaseModel):
    """What the search found (added to the completion as `search`)."""

    mode: SearchMode
    queries: list[str]
    document_ids: list[str]
    titles: list[str]
    cached: bool
    degraded: bool


class ChatCompletionResponse(BaseModel):
    """The answer LLM's completion as it came (OpenAI's shape), plus `search`."""

    model_config = ConfigDict(extra="allow")

    id: str = ""
    object: str = "chat.completion"
    created: int = 0
    model: str = ""
    choices: list[dict[str, Any]]
    usage: dict[str, Any] | None = None
    search: SearchSummary | None = None


class ModelCard(BaseModel):
    id: str
    object: str = "model"
    created: int = 0
    owned_by: str = "plugsearch"


class ModelList(BaseModel):
    object: str = "list"
    data: list[ModelCard]
