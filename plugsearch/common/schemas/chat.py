"""OpenAI-compatible chat completions (`POST /v1/chat/completions` on the searcher, opt-in).

An explicit allow-list: the request may carry OpenAI's chat-completions fields below, each checked in JSON's
own types and ranges before any search or generation; any other field is a 422 naming it. What the proxy
forwards to the answer LLM is exactly these fields (`model` replaced by the configured one), never a field it
did not check: an unchecked backend field can take the backend down (llama.cpp's server dies on a malformed
`grammar`).

Backend extensions (llama.cpp / vLLM sampling fields, image parts) are declared here with their ranges too,
and refused unless the operator names them in `SEARCHER_CHAT__EXTENSIONS` (`EXTENSIONS` lists the names).
`grammar` is not among them: a malformed grammar crashes llama.cpp's server, and nothing short of running
its parser can tell a safe one. One plugsearch extension, `search`, tunes the search run on the last user
message (with the `openai` client: `extra_body={"search": {"mode": "naive"}}`).
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    StringConstraints,
    ValidationInfo,
    field_validator,
    model_validator,
)

from plugsearch.common.schemas.base import StrictModel, no_nul
from plugsearch.common.schemas.searcher import MAX_RETRIEVE_K, MAX_TURNS, Method, SearchMode

MAX_MESSAGES = 256
MAX_CONTENT_CHARS = 200_000
MAX_ANSWER_TOKENS = 1_000_000
"""The schema's outer bound on `max_tokens`; the proxy's own, far lower, is `SEARCHER_CHAT__MAX_TOKENS_LIMIT`."""
MAX_TOOLS = 64
MAX_CONTENT_PARTS = 64

Text = Annotated[str, StringConstraints(max_length=MAX_CONTENT_CHARS), AfterValidator(no_nul)]
Name = Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9_-]{1,64}$")]
"""A function's or a participant's name, as OpenAI constrains it."""
ShortText = Annotated[str, StringConstraints(max_length=256), AfterValidator(no_nul)]

Extension = Literal["top_k", "min_p", "typical_p", "repeat_penalty", "repetition_penalty", "mirostat", "image_url"]
EXTENSIONS: dict[str, tuple[str, ...]] = {
    "top_k": ("top_k",), "min_p": ("min_p",), "typical_p": ("typical_p",), "repeat_penalty": ("repeat_penalty",),
    "repetition_penalty": ("repetition_penalty",), "mirostat": ("mirostat_mode", "mirostat_tau", "mirostat_eta"),
    "image_url": ()}
"""Backend extensions an operator may allow (`SEARCHER_CHAT__EXTENSIONS`) -> the request fields each allows
(`image_url`: content parts of that type)."""
EXTENSION_FIELDS = frozenset(f for fields in EXTENSIONS.values() for f in fields)


class TextPart(StrictModel):
    type: Literal["text"]
    text: Text


class ImageUrl(StrictModel):
    url: Annotated[str, StringConstraints(max_length=MAX_CONTENT_CHARS, pattern=r"^(https?://|data:image/)")]
    detail: Literal["auto", "low", "high"] | None = None


class ImagePart(StrictModel):
    """An image (only with the `image_url` extension: the answer LLM must read images)."""

    type: Literal["image_url"]
    image_url: ImageUrl


ContentPart = Annotated[TextPart | ImagePart, Field(discriminator="type")]


class FunctionCall(StrictModel):
    name: Name
    arguments: Text


class ToolCall(StrictModel):
    """A tool call an earlier assistant message made."""

    id: Annotated[str, StringConstraints(min_length=1, max_length=256)]
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessageIn(StrictModel):
    """One message. `tool_calls` only on an assistant message, `tool_call_id` only (and always) on a tool one."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Text | Annotated[list[ContentPart], Field(max_length=MAX_CONTENT_PARTS)] | None = None
    name: Name | None = None
    tool_calls: list[ToolCall] | None = Field(None, max_length=MAX_TOOLS)
    tool_call_id: Annotated[str, StringConstraints(min_length=1, max_length=256)] | None = None

    @model_validator(mode="after")
    def _check_role_fields(self) -> ChatMessageIn:
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError("tool_calls is only for assistant messages")
        if (self.tool_call_id is not None) != (self.role == "tool"):
            raise ValueError("a tool message needs tool_call_id, and only a tool message may have one")
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError("content is required (an assistant message may have tool_calls instead)")
        return self

    def text(self) -> str:
        """The message's text (the text parts of a content list, joined)."""
        if isinstance(self.content, str):
            return self.content
        return "\n".join(p.text for p in self.content or [] if isinstance(p, TextPart) and p.text)

    def has_images(self) -> bool:
        return isinstance(self.content, list) and any(isinstance(p, ImagePart) for p in self.content)


class FunctionDefinition(StrictModel):
    name: Name
    description: Annotated[str, StringConstraints(max_length=4096), AfterValidator(no_nul)] | None = None
    parameters: dict[str, Any] | None = Field(None, description="a JSON Schema of `type: object`")
    strict: bool | None = None

    @field_validator("parameters")
    @classmethod
    def _check_parameters(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        if value is not None and value.get("type", "object") != "object":
            raise ValueError("a function's parameters must be a JSON Schema of type object")
        return value


class Tool(StrictModel):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(StrictModel):
    name: Name


class NamedToolChoice(StrictModel):
    type: Literal["function"]
    function: NamedFunction


class ResponseFormat(StrictModel):
    """Plain text or any JSON object (a JSON Schema is not taken: llama.cpp compiles it into a grammar)."""

    type: Literal["text", "json_object"]


class StreamOptions(StrictModel):
    include_usage: bool | None = None


class ChatSearchOptions(StrictModel):
    """plugsearch's extension: how to search (unset: the service's defaults)."""

    mode: SearchMode | None = None
    max_turns: int | None = Field(None, ge=0, le=MAX_TURNS)
    retrieve_k: int | None = Field(None, ge=1, le=MAX_RETRIEVE_K)
    select_k: int | None = Field(None, ge=1, le=MAX_RETRIEVE_K)
    method: Method | None = None


Stop = Annotated[str, StringConstraints(min_length=1, max_length=256), AfterValidator(no_nul)]

_TOKEN_ID = re.compile(r"^[0-9]{1,9}$")


class ChatCompletionRequest(StrictModel):
    """OpenAI's request, allow-listed: every field is checked here, in JSON's own types, before anything is
    forwarded (so a bad value is this caller's 422, never an upstream failure that counts against the
    answer LLM's breaker, nor a backend crash); a field not declared here is a 422."""

    model: str | None = Field(None, max_length=256, description="ignored: the configured answer LLM answers")
    messages: list[ChatMessageIn] = Field(..., min_length=1, max_length=MAX_MESSAGES)
    stream: bool = False
    stream_options: StreamOptions | None = Field(None, description="with stream: include_usage")
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
    stop: Stop | list[Stop] | None = Field(None, max_length=4)
    logit_bias: dict[str, float] | None = Field(None, max_length=300, description=(
        "token id (a decimal string) -> bias in [-100, 100]"))
    logprobs: bool | None = Field(None, description=(
        "false only: the proxy assembles answers from the LLM's stream and returns no log probabilities"))
    top_logprobs: int | None = Field(None, ge=0, le=20, description="refused (see logprobs)")
    response_format: ResponseFormat | None = None
    tools: list[Tool] | None = Field(None, min_length=1, max_length=MAX_TOOLS)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = Field(None, description=(
        "none / auto / required, or a function named in tools"))
    parallel_tool_calls: bool | None = None
    user: ShortText | None = None
    search: ChatSearchOptions | None = Field(None, description="plugsearch extension: search options")
    # backend extensions, refused unless SEARCHER_CHAT__EXTENSIONS names them
    top_k: int | None = Field(None, ge=1, le=1000, description="extension top_k (llama.cpp, vLLM)")
    min_p: float | None = Field(None, ge=0, le=1, description="extension min_p (llama.cpp, vLLM)")
    typical_p: float | None = Field(None, gt=0, le=1, description="extension typical_p (llama.cpp)")
    repeat_penalty: float | None = Field(None, ge=0, le=2, description="extension repeat_penalty (llama.cpp)")
    repetition_penalty: float | None = Field(None, gt=0, le=2, description="extension repetition_penalty (vLLM)")
    mirostat_mode: Literal[0, 1, 2] | None = Field(None, description="extension mirostat (llama.cpp)")
    mirostat_tau: float | None = Field(None, ge=0, le=10, description="extension mirostat (llama.cpp)")
    mirostat_eta: float | None = Field(None, ge=0, le=1, description="extension mirostat (llama.cpp)")

    @field_validator("logit_bias")
    @classmethod
    def _check_logit_bias(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        for token, bias in (value or {}).items():
            if not _TOKEN_ID.match(token):
                raise ValueError("logit_bias keys must be token ids (decimal strings)")
            if not -100 <= bias <= 100:
                raise ValueError("logit_bias values must be between -100 and 100")
        return value

    @field_validator("logprobs", "top_logprobs")
    @classmethod
    def _no_logprobs(cls, value: bool | int | None) -> bool | int | None:
        if value is not None and value is not False:
            raise ValueError("log probabilities are not served by this proxy (it assembles the answer from the "
                             "answer LLM's stream)")
        return value

    @field_validator("tools")
    @classmethod
    def _distinct_tools(cls, value: list[Tool] | None) -> list[Tool] | None:
        names = [t.function.name for t in value or []]
        if len(set(names)) != len(names):
            raise ValueError("function names must be distinct")
        return value

    @field_validator("tool_choice", "parallel_tool_calls")
    @classmethod
    def _check_tool_choice(cls, value: Any, info: ValidationInfo) -> Any:
        names = [t.function.name for t in info.data.get("tools") or []]
        if isinstance(value, NamedToolChoice) and value.function.name not in names:
            raise ValueError(f"names the function {value.function.name!r}, which tools does not define")
        if value is not None and value != "none" and not names:
            raise ValueError("needs tools")
        return value

    @field_validator("stream_options")
    @classmethod
    def _only_streaming(cls, value: StreamOptions | None, info: ValidationInfo) -> StreamOptions | None:
        if value is not None and not info.data.get("stream"):
            raise ValueError("only with stream: true")
        return value

    def extensions_used(self) -> list[str]:
        """The backend extensions this request uses (`EXTENSIONS`' names)."""
        used = [name for name, fields in EXTENSIONS.items()
                if any(getattr(self, f) is not None for f in fields)]
        if any(m.has_images() for m in self.messages):
            used.append("image_url")
        return used


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
