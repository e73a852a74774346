"""One async client for OpenAI-compatible chat completions (vLLM, llama.cpp server, hosted APIs).

Timeouts, bounded retries with backoff, a concurrency limit, a circuit breaker, request-id propagation
and token usage in metrics. LLMs are never embedded in a service; everything talks to this.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncGenerator
from typing import Any, Protocol

import httpx
import orjson
from pydantic import BaseModel, Field, SecretStr

from services.common.errors import BadRequest, ServiceError, UpstreamError, UpstreamTimeout
from services.common.http import CircuitBreaker, backoff_delay, decode_error
from services.common.logging import REQUEST_ID_HEADER, get_request_id
from services.common.metrics import ServiceMetrics
from services.common.transport import HttpTransport, WireResponse, as_response, make_wire

logger = logging.getLogger(__name__)


class LLMSettings(BaseModel):
    """Where an LLM lives. Nested in service settings: e.g. `GENERATOR_LLM__BASE_URL`."""

    base_url: str = "http://127.0.0.1:8080/v1"
    model: str = "smollm2-135m-instruct"
    api_key: SecretStr | None = None
    timeout_s: float = Field(60.0, gt=0)
    connect_timeout_s: float = Field(2.0, gt=0)
    max_retries: int = Field(2, ge=0, le=10)
    backoff_s: float = Field(0.25, ge=0)
    max_concurrency: int = Field(16, ge=1, le=4096)
    breaker_failures: int = Field(5, ge=1)
    breaker_reset_s: float = Field(5.0, gt=0)
    tokenizer: str | None = Field(None, description="HF tokenizer name/path for token budgets; None = estimate")
    http_transport: HttpTransport = Field("aiohttp", description="wire: aiohttp's pool (default) or httpx")


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
        self.breaker = CircuitBreaker(settings.breaker_failures, settings.breaker_reset_s)
        self._sem = asyncio.Semaphore(settings.max_concurrency)
        headers = {}
        if settings.api_key is not None:
            headers["Authorization"] = f"Bearer {settings.api_key.get_secret_value()}"
        self._wire = make_wire(settings.base_url.rstrip("/"), timeout_s=settings.timeout_s,
                               connect_timeout_s=settings.connect_timeout_s, max_connections=settings.max_concurrency,
                               headers=headers, kind=settings.http_transport, transport=transport)

    async def aclose(self) -> None:
        await self._wire.aclose()

    def _count(self, kind: str, value: float = 1.0) -> None:
        if self.metrics is not None:
            self.metrics.llm_tokens.labels(self.name, kind).inc(value)

    async def chat(self, messages: list[ChatMessage], *, temperature: float = 0.0, max_tokens: int = 256,
                   stop: list[str] | None = None, extra: dict[str, Any] | None = None) -> ChatResult:
        body: dict[str, Any] = {
            "model": self.model,
            "messages": [m.model_dump() for m in messages],
            "temperature": temperature,
            "max_tokens": max_tokens,
        }
        if stop:
            body["stop"] = stop
        if extra:
            body.update(extra)
        return self._parse(await self._post(body))

    def _headers(self) -> dict[str, str]:
        rid = get_request_id()
        return {REQUEST_ID_HEADER: rid} if rid else {}

    def _check_breaker(self) -> None:
        if not self.breaker.allow():
            raise UpstreamError(f"{self.name} is unavailable (circuit open after repeated failures)",
                                retry_after=self.breaker.retry_after())

    def _transport_failure(self, exc: httpx.HTTPError) -> ServiceError:
        self.breaker.record_failure()
        if isinstance(exc, httpx.TimeoutException):
            return UpstreamTimeout(f"{self.name} timed out after {self.settings.timeout_s:g} s")
        return UpstreamError(f"{self.name} unreachable: {type(exc).__name__}")

    def _refused(self, response: WireResponse, *, caller_error: bool) -> ServiceError:
        """The error to retry for a 429 / 5xx answer; raises at once for any other 4xx (`caller_error`:
        as the caller's BadRequest, when the request carried the caller's own fields)."""
        err = decode_error(self.name, response)
        status = response.status_code
        if status >= 500 or status == 429:
            self.breaker.record_failure()
            return UpstreamTimeout(err.message) if status == 504 else UpstreamError(err.message)
        self.breaker.record_success()
        if caller_error:
            raise BadRequest(f"{self.name} refused the request: {err.message}", param=err.param)
        raise UpstreamError(f"{self.name} refused the request: {err.message}")

    async def _retry_pause(self, attempt: int, last: ServiceError) -> None:
        if self.metrics is not None:
            self.metrics.upstream_errors.labels(self.name, last.type).inc()
        if attempt < self.settings.max_retries:
            await asyncio.sleep(backoff_delay(attempt, self.settings.backoff_s))

    async def _post(self, body: dict[str, Any], *, caller_error: bool = False) -> WireResponse:
        """POST /chat/completions with retries (connection errors, timeouts, 429, 5xx) and the breaker."""
        headers = self._headers()
        last: ServiceError | None = None
        async with self._sem:
            for attempt in range(self.settings.max_retries + 1):
                self._check_breaker()
                t0 = time.perf_counter()
                try:
                    response = await self._wire.send("POST", "/chat/completions", json=body, headers=headers)
                except httpx.TransportError as exc:
                    last = self._transport_failure(exc)
                else:
                    if response.status_code < 400:
                        self.breaker.record_success()
                        if self.metrics is not None:
                            self.metrics.upstream_seconds.labels(self.name).observe(time.perf_counter() - t0)
                        return response
                    last = self._refused(response, caller_error=caller_error)
                await self._retry_pause(attempt, last)
        assert last is not None
        raise last

    async def complete(self, body: dict[str, Any]) -> dict[str, Any]:
        """A whole chat-completions request (the caller's own fields, e.g. a proxied request) -> the
        response body as it came. A 4xx answer is the caller's BadRequest."""
        response = await self._post({**body, "stream": False}, caller_error=True)
        try:
            data = response.json()
            data["choices"][0]["message"]  # noqa: B018 - the shape every caller reads
        except (ValueError, KeyError, IndexError, TypeError) as exc:
            raise UpstreamError(f"{self.name} returned an unexpected response shape") from exc
        self._count_usage(data.get("usage"))
        return data  # type: ignore[no-any-return]

    async def stream(self, body: dict[str, Any]) -> AsyncGenerator[dict[str, Any], None]:
        """A chat-completions request with `stream: true`: yields each chunk (the `data:` JSON of the
        server-sent events) until `[DONE]`. Retried like `complete` until the first chunk; a failure after
        it raises (what was yielded cannot be taken back)."""
        body = {**body, "stream": True}
        headers = self._headers()
        last: ServiceError | None = None
        async with self._sem:
            for attempt in range(self.settings.max_retries + 1):
                self._check_breaker()
                started = False
                try:
                    async with self._wire.stream("POST", "/chat/completions", json=body, headers=headers) as response:
                        if response.status_code >= 400:
                            last = self._refused(as_response(response, await response.aread()), caller_error=True)
                        else:
                            self.breaker.record_success()
                            async for line in response.aiter_lines():
                                if not line.startswith("data:"):
                                    continue  # blank separators, comments, `event:` lines
                                data = line[5:].strip()
                                if data == "[DONE]":
                                    return
                                try:
                                    chunk = orjson.loads(data)
                                except orjson.JSONDecodeError as exc:
                                    raise UpstreamError(f"{self.name} streamed an unexpected event") from exc
                                if isinstance(chunk, dict) and isinstance(chunk.get("error"), dict):
                                    raise UpstreamError(f"{self.name} failed mid-stream: "
                                                        f"{str(chunk['error'].get('message', 'error'))[:500]}")
                                self._count_usage(chunk.get("usage") if isinstance(chunk, dict) else None)
                                started = True
                                yield chunk
                            return
                except httpx.TransportError as exc:
                    if started:
                        raise UpstreamError(f"{self.name} stream broke off: {type(exc).__name__}") from exc
                    last = self._transport_failure(exc)
                assert last is not None
                await self._retry_pause(attempt, last)
        assert last is not None
        raise last

    def _count_usage(self, usage: Any) -> None:
        if isinstance(usage, dict):
            self._count("prompt", int(usage.get("prompt_tokens") or 0))
            self._count("completion", int(usage.get("completion_tokens") or 0))

    def _parse(self, response: WireResponse) -> ChatResult:
        try:
            data = response.json()
            choice = data["choices"][0]
            text = choice["message"].get("content") or ""
        except (ValueError, KeyError, IndexError, TypeError) as exc:
            raise UpstreamError(f"{self.name} returned an unexpected response shape") from exc
        usage = data.get("usage") or {}
        prompt_tokens = int(usage.get("prompt_tokens") or 0)
        completion_tokens = int(usage.get("completion_tokens") or 0)
        self._count("prompt", prompt_tokens)
        self._count("completion", completion_tokens)
        return ChatResult(text=text, finish_reason=choice.get("finish_reason"), prompt_tokens=prompt_tokens,
                          completion_tokens=completion_tokens, model=str(data.get("model", self.model)))

    async def check_health(self) -> str:
        try:
            response = await self._wire.send("GET", "/models", timeout=2.0)
        except httpx.HTTPError as exc:
            return f"{self.name} unreachable: {type(exc).__name__}"
        return "ok" if response.status_code == 200 else f"{self.name} answered {response.status_code}"
