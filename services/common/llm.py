"""One async client for OpenAI-compatible chat completions (vLLM, llama.cpp server, hosted APIs).

Timeouts, bounded retries with backoff, a concurrency limit, a circuit breaker, request-id propagation
and token usage in metrics. LLMs are never embedded in a service; everything talks to this.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Protocol

import httpx
from pydantic import BaseModel, Field, SecretStr

from services.common.errors import ServiceError, UpstreamError, UpstreamTimeout
from services.common.http import CircuitBreaker, backoff_delay, decode_error
from services.common.logging import REQUEST_ID_HEADER, get_request_id
from services.common.metrics import ServiceMetrics
from services.common.transport import HttpTransport, WireResponse, make_wire

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
        headers = {}
        rid = get_request_id()
        if rid:
            headers[REQUEST_ID_HEADER] = rid
        last: ServiceError | None = None
        async with self._sem:
            for attempt in range(self.settings.max_retries + 1):
                if not self.breaker.allow():
                    raise UpstreamError(f"{self.name} is unavailable (circuit open after repeated failures)",
                                        retry_after=self.breaker.retry_after())
                t0 = time.perf_counter()
                try:
                    response = await self._wire.send("POST", "/chat/completions", json=body, headers=headers)
                except httpx.TimeoutException:
                    self.breaker.record_failure()
                    last = UpstreamTimeout(f"{self.name} timed out after {self.settings.timeout_s:g} s")
                except httpx.TransportError as exc:
                    self.breaker.record_failure()
                    last = UpstreamError(f"{self.name} unreachable: {type(exc).__name__}")
                else:
                    if response.status_code < 400:
                        self.breaker.record_success()
                        if self.metrics is not None:
                            self.metrics.upstream_seconds.labels(self.name).observe(time.perf_counter() - t0)
                        return self._parse(response)
                    err = decode_error(self.name, response)
                    if response.status_code >= 500 or response.status_code == 429:
                        self.breaker.record_failure()
                        last = UpstreamTimeout(err.message) if response.status_code == 504 else \
                            UpstreamError(err.message)
                    else:
                        self.breaker.record_success()
                        raise UpstreamError(f"{self.name} refused the request: {err.message}")
                if self.metrics is not None:
                    self.metrics.upstream_errors.labels(self.name, last.type).inc()
                if attempt < self.settings.max_retries:
                    await asyncio.sleep(backoff_delay(attempt, self.settings.backoff_s))
        assert last is not None
        raise last

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
