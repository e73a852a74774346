"""One async client for OpenAI-compatible chat completions (vLLM, llama.cpp server, hosted APIs). LLMs are
never embedded in a service; everything talks to this. Calls go through a `ServiceClient` (the upstream
policy of every service call); on top of it: a concurrency limit, the chat shapes, token usage in metrics.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncGenerator
from typing import Any, Protocol

import httpx
import orjson
from opentelemetry.trace import INVALID_SPAN, Span, SpanKind
from pydantic import BaseModel, Field, SecretStr

from plugsearch.common import tracing
from plugsearch.common.errors import ServiceError, UpstreamError, ValidationFailed
from plugsearch.common.http import CallSettings, ClientSettings, Refusal, ServiceClient
from plugsearch.common.metrics import ServiceMetrics
from plugsearch.common.settings import ServiceSettings
from plugsearch.common.transport import Response

logger = logging.getLogger(__name__)


def _merge_tool_call(into: dict[str, Any], delta: dict[str, Any]) -> None:
    """One streamed tool-call delta into the call it continues (ids and names set once, arguments joined)."""
    for key in ("id", "type"):
        if delta.get(key):
            into[key] = delta[key]
    function = delta.get("function")
    if isinstance(function, dict):
        target = into.setdefault("function", {"name": "", "arguments": ""})
        if function.get("name"):
            target["name"] = function["name"]
        if isinstance(function.get("arguments"), str):
            target["arguments"] += function["arguments"]


class LLMSettings(CallSettings):
    """Where an LLM lives. Nested in service settings: e.g. `GENERATOR_LLM__BASE_URL`; timeouts, retries,
    breaker and wire are `CallSettings`' (`GENERATOR_LLM__MAX_RETRIES` ...), with a longer read timeout."""

    base_url: str = "http://127.0.0.1:8080/v1"
    model: str = "smollm2-135m-instruct"
    api_key: SecretStr | None = None
    timeout_s: float = Field(60.0, gt=0)  # a completion takes longer than a service call
    max_concurrency: int = Field(16, ge=1, le=4096)
    tokenizer: str | None = Field(None, description="HF tokenizer name/path for token budgets; None = estimate")

    def client_settings(self) -> ClientSettings:
        """The `ServiceClient` settings of this LLM: its URL, key and connection limit, the same policy."""
        policy = {name: getattr(self, name) for name in CallSettings.model_fields}
        return ClientSettings(url=self.base_url, token=self.api_key, max_connections=self.max_concurrency, **policy)


class LLMServiceSettings(ServiceSettings):
    """Settings of a service built on one LLM (the generator, the judge): `<SVC>_LLM__*`."""

    llm: LLMSettings = Field(default_factory=LLMSettings)


class ChatMessage(BaseModel):
    role: str
    content: str


class ChatResult(BaseModel):
    text: str
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    model: str = ""


class LLMBackend(Protocol):
    """Anything that can chat: the real client, or a scripted fake in unit tests."""

    model: str

    async def chat(self, messages: list[ChatMessage], *, temperature: float = 0.0, max_tokens: int = 256,
                   stop: list[str] | None = None, extra: dict[str, Any] | None = None) -> ChatResult: ...

    async def check_health(self) -> str: ...

    async def aclose(self) -> None: ...


class OpenAIChatClient:
    def __init__(self, settings: LLMSettings, *, name: str = "llm", metrics: ServiceMetrics | None = None,
                 transport: httpx.AsyncBaseTransport | None = None) -> None:
        self.settings = settings
        self.model = settings.model
        self.name = name
        self.metrics = metrics
        # A generation that timed out may still be running upstream: never sent twice. An LLM's error text
        # (tracebacks, paths) is logged, never passed on.
        self.upstream = ServiceClient(settings.client_settings(), name=name, metrics=metrics, transport=transport,
                                      retry_timeouts=False, upstream_text=False)
        self._sem = asyncio.Semaphore(settings.max_concurrency)

    async def aclose(self) -> None:
        await self.upstream.aclose()

    async def chat(self, messages: list[ChatMessage], *, temperature: float = 0.0, max_tokens: int = 256,
                   stop: list[str] | None = None, extra: dict[str, Any] | None = None) -> ChatResult:
        body: dict[str, Any] = {"model": self.model, "messages": [m.model_dump() for m in messages],
                                "temperature": temperature, "max_tokens": max_tokens,
                                **({"stop": stop} if stop else {}), **(extra or {})}
        with tracing.span(f"chat {self.model}", self._span_attributes(temperature, max_tokens),
                          kind=SpanKind.CLIENT) as span:
            data = self._body(await self._post(body, span))
            choice = data["choices"][0]
            prompt_tokens, completion_tokens = self._count_usage(data.get("usage"))
            if span.is_recording():
                span.set_attributes({"gen_ai.response.model": str(data.get("model", self.model)),
                                     "gen_ai.response.finish_reasons": [str(choice.get("finish_reason"))],
                                     "gen_ai.usage.input_tokens": prompt_tokens,
                                     "gen_ai.usage.output_tokens": completion_tokens})
        return ChatResult(text=choice["message"].get("content") or "", finish_reason=choice.get("finish_reason"),
                          prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                          model=str(data.get("model", self.model)))

    def _span_attributes(self, temperature: float, max_tokens: int) -> tracing.Attributes | None:
        """A chat call's span, in OpenTelemetry's GenAI conventions (None while not tracing)."""
        if not tracing.enabled():
            return None
        return {"gen_ai.operation.name": "chat", "gen_ai.provider.name": "openai", "gen_ai.request.model": self.model,
                "gen_ai.request.temperature": temperature, "gen_ai.request.max_tokens": max_tokens,
                "peer.service": self.name}

    def _refusal(self, caller_error: bool) -> Refusal:
        """A 4xx answer (not 429) to a request we built is our failure (502); to the caller's own fields
        (`caller_error`: a proxied request), the caller's 422 (`ValidationFailed`: its parameters were refused),
        except a refusal of this service's own credentials or configuration (401, 403, 404: the key, the model,
        the URL), which is ours (502)."""
        def refuse(err: ServiceError) -> ServiceError:
            status = err.upstream_status or err.status
            if status in (401, 403):
                return UpstreamError(f"{self.name} LLM refused this service's credentials (HTTP {status}): "
                                     "its API key is missing or wrong in the service's settings")
            if status == 404:
                return UpstreamError(f"{self.name} LLM answered 404: its base URL or model is misconfigured")
            message = f"{self.name} LLM refused the request (HTTP {status})"
            return ValidationFailed(f"{message}: check the request's parameters", param=err.param) \
                if caller_error else UpstreamError(message)

        return refuse

    async def _post(self, body: dict[str, Any], span: Span = INVALID_SPAN, *, caller_error: bool = False
                    ) -> Response:
        """POST /chat/completions under the concurrency limit, with the upstream policy; the wait for a
        slot of that limit goes on the call's `span`."""
        t0 = time.perf_counter()
        async with self._sem:
            if span.is_recording():
                span.set_attribute("plugsearch.llm.slot_wait_ms", round((time.perf_counter() - t0) * 1000, 3))
            return await self.upstream.request("POST", "/chat/completions", json=body,
                                               refusal=self._refusal(caller_error), caller_body=caller_error)

    async def complete(self, body: dict[str, Any]) -> dict[str, Any]:
        """A whole chat-completions request (the caller's own fields, e.g. a proxied request) -> the
        response body in OpenAI's non-streaming shape. Asked of the LLM as a stream and assembled here: a
        caller that leaves closes the stream, and the LLM (vLLM, llama.cpp's server) stops generating,
        which it does not for a plain request. A 4xx answer is the caller's 422 (see `_refusal`)."""
        first: dict[str, Any] | None = None
        content: list[str] = []
        tool_calls: dict[int, dict[str, Any]] = {}
        finish_reason: str | None = None
        usage: Any = None
        async for chunk in self.stream(body):
            first = first or chunk
            usage = chunk.get("usage") or usage
            for choice in chunk.get("choices") or []:
                if not isinstance(choice, dict):
                    continue
                delta: dict[str, Any] = choice["delta"] if isinstance(choice.get("delta"), dict) else {}
                if isinstance(delta.get("content"), str):
                    content.append(delta["content"])
                for call in delta.get("tool_calls") or []:
                    if isinstance(call, dict):
                        index = call.get("index")
                        _merge_tool_call(tool_calls.setdefault(index if isinstance(index, int) else 0, {}), call)
                finish_reason = choice.get("finish_reason") or finish_reason
        if first is None:
            raise UpstreamError(f"{self.name} LLM answered no completion")
        message: dict[str, Any] = {"role": "assistant", "content": "".join(content)}
        if tool_calls:
            message["tool_calls"] = [tool_calls[i] for i in sorted(tool_calls)]
        return {"id": first.get("id", ""), "object": "chat.completion", "created": first.get("created", 0),
                "model": first.get("model", self.model), "system_fingerprint": first.get("system_fingerprint"),
                "choices": [{"index": 0, "message": message, "finish_reason": finish_reason}], "usage": usage}

    async def stream(self, body: dict[str, Any]) -> AsyncGenerator[dict[str, Any], None]:
        """A chat-completions request with `stream: true`: yields each chunk (the `data:` JSON of the
        server-sent events) until `[DONE]`. Retried like `complete` until a successful status; a failure
        after it raises (what was yielded cannot be taken back): an error event, a broken connection, and a
        stream that ends without finishing (no `[DONE]`, or `[DONE]` before any choice had a finish reason:
        llama.cpp's server ends so when the prompt overflows its context) are `UpstreamError`."""
        finished = False
        async with self._sem, self.upstream.stream("POST", "/chat/completions", json={**body, "stream": True},
                                                   refusal=self._refusal(True), caller_body=True) as response:
            try:
                async for line in response.aiter_lines():
                    if not line.startswith("data:"):
                        continue  # blank separators, comments, `event:` lines
                    data = line[5:].strip()
                    if data == "[DONE]":
                        if not finished:
                            raise UpstreamError(f"{self.name} LLM ended its stream before the answer finished "
                                                "(cut short, or the prompt did not fit its context window)")
                        return
                    try:
                        chunk = orjson.loads(data)
                    except orjson.JSONDecodeError as exc:
                        raise UpstreamError(f"{self.name} streamed an unexpected event") from exc
                    if isinstance(chunk, dict) and isinstance(chunk.get("error"), dict):
                        logger.warning("%s failed mid-stream: %s", self.name,
                                       str(chunk["error"].get("message", "error"))[:500])
                        raise UpstreamError(f"{self.name} LLM failed mid-stream")
                    if not isinstance(chunk, dict):
                        raise UpstreamError(f"{self.name} streamed an unexpected event")
                    self._count_usage(chunk.get("usage"))
                    finished = finished or any(isinstance(choice, dict) and choice.get("finish_reason")
                                               for choice in chunk.get("choices") or [])
                    yield chunk
            except httpx.TransportError as exc:
                raise UpstreamError(f"{self.name} stream broke off: {type(exc).__name__}") from exc
        raise UpstreamError(f"{self.name} LLM stream ended without [DONE]")

    def _count_usage(self, usage: Any) -> tuple[int, int]:
        """(prompt, completion) tokens of a `usage` object, counted in the metrics."""
        if not isinstance(usage, dict):
            return 0, 0
        prompt, completion = int(usage.get("prompt_tokens") or 0), int(usage.get("completion_tokens") or 0)
        if self.metrics is not None:
            self.metrics.llm_tokens.labels(self.name, "prompt").inc(prompt)
            self.metrics.llm_tokens.labels(self.name, "completion").inc(completion)
        return prompt, completion

    def _body(self, response: Response) -> dict[str, Any]:
        """The response's JSON; UpstreamError unless it has `choices[0].message`."""
        try:
            data = response.json()
            data["choices"][0]["message"]  # noqa: B018 - the shape every caller reads
        except (ValueError, KeyError, IndexError, TypeError) as exc:
            raise UpstreamError(f"{self.name} returned an unexpected response shape") from exc
        return data  # type: ignore[no-any-return]

    async def check_health(self) -> str:
        return await self.upstream.ready("/models")
