"""OpenAI-compatible chat completions (`POST /v1/chat/completions` on the searcher, opt-in).

The request is OpenAI's: fields this proxy does not use (`top_p`, `seed`, `response_format`, ...) are
kept and forwarded to the answer LLM as they came. One extension, `search`, tunes the search run on the
last user message (with the `openai` client: `extra_body={"search": {"mode": "naive"}}`).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from services.common.schemas.base import StrictModel
from services.common.schemas.searcher import MAX_RETRIEVE_K, MAX_TURNS, Method, SearchMode

MAX_MESSAGES = 256
MAX_CONTENT_CHARS = 200_000


class ContentPart(BaseModel):
    """One part of a message's content list (`{"type": "text", "text": ...}`; others pass through)."""

    model_config = ConfigDict(extra="allow")

    type: str = Field(..., max_length=64)
    text: str | None = Field(None, max_length=MAX_CONTENT_CHARS)


class ChatMessageIn(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[ContentPart] | None = Field(None, max_length=MAX_CONTENT_CHARS)

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
    model_config = ConfigDict(extra="allow")

    model: str | None = Field(None, max_length=256, description="ignored: the configured answer LLM answers")
    messages: list[ChatMessageIn] = Field(..., min_length=1, max_length=MAX_MESSAGES)
    stream: bool = False
    max_tokens: int | None = Field(None, ge=1, le=1_000_000)
    temperature: float | None = Field(None, ge=0, le=2)
    search: ChatSearchOptions | None = Field(None, description="plugsearch extension: search options")


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
