"""The one way to call an upstream, another service or an LLM: `ServiceClient`, one policy over a `Wire`
(`plugsearch.common.transport`); `OpenAIChatClient` calls its LLM through one.

- retries: up to `max_retries` after no answer or a 429/502/503/504 answer, each after a full-jitter
  backoff of at least the answer's `Retry-After` (clamped to `MAX_RETRY_PAUSE_S`); with
  `retry_timeouts=False` (LLM generations) a request that timed out waiting for its answer is not sent
  again (the upstream may still be working on it: a retry would double its load);
- one breaker: no answer or a 5xx is a failure; any other answer (429 included: the upstream is alive and
  says when to come back) is a success; a 500 to a body the caller shaped (`caller_body`: a proxied
  request) counts neither way, since it may be that caller's parameters, not the upstream's fault;
- `upstream_text=False` (LLMs, which may answer with tracebacks and paths): an error's text is logged,
  never passed on; the exception says only the upstream and the status;
- one status mapping (`decode_error`, `_no_answer`): no connection or an open circuit 503
  `UpstreamUnavailable` + Retry-After, no answer in time 504, an upstream 503 / 504 as such, another 5xx
  502, a 4xx its own class (or what the caller's `refusal` makes of it);
- metrics: `upstream_seconds{upstream}` per attempt (a success: until the caller has read it),
  `upstream_errors{upstream, kind}`, kind `connect`, `timeout` or the status.
Tests inject an `httpx` transport (`httpx.ASGITransport(app)`) and need no server.
"""

from __future__ import annotations

import asyncio
import logging
import math
import random
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AbstractAsyncContextManager, AsyncExitStack, asynccontextmanager
from typing import TYPE_CHECKING, Any, TypeVar

import httpx
import orjson
from pydantic import BaseModel, Field, SecretStr

from plugsearch.common import tracing
from plugsearch.common.errors import (
    ERROR_CLASSES,
    BadRequest,
    ServiceError,
    UpstreamError,
    UpstreamTimeout,
)
from plugsearch.common.logging import REQUEST_ID_HEADER, get_request_id
from plugsearch.common.transport import HttpTransport, Response, StreamResponse, make_wire

if TYPE_CHECKING:  # the services pass their metrics in; the public client has none (no prometheus-client)
    from plugsearch.common.metrics import ServiceMetrics

M = TypeVar("M", bound=BaseModel)
logger = logging.getLogger(__name__)

RETRY_STATUSES = frozenset({429, 502, 503, 504})
MAX_RETRY_AFTER_S = 3600.0  # a Retry-After we pass on is clamped to this
MAX_RETRY_PAUSE_S = 5.0  # a pause between our own attempts is at most this, whatever the Retry-After
NO_CONNECTION_RETRY_AFTER_S = 2.0


class UpstreamUnavailable(UpstreamError):
    """The upstream could not be reached (refused, breaker open, not ready): the caller should retry later."""

    status = 503
    type = "upstream_unavailable"


class CallSettings(BaseModel):
    """How to call one upstream: the base of `ClientSettings` (our services) and `LLMSettings` (an
    OpenAI-compatible API), so both read the same env names (`..._TIMEOUT_S`, `..._MAX_RETRIES` ...)."""

    timeout_s: float = Field(30.0, gt=0)
    connect_timeout_s: float = Field(2.0, gt=0)
    max_retries: int = Field(2, ge=0, le=10)
    backoff_s: float = Field(0.2, ge=0)
    breaker_failures: int = Field(5, ge=1, description="consecutive failures that open the breaker")
    breaker_reset_s: float = Field(5.0, gt=0, description="open time before one trial call")
    http_transport: HttpTransport = Field("aiohttp", description="wire: aiohttp's pool (default) or httpx")


class ClientSettings(CallSettings):
    """How to reach one upstream service. Nested in each service's settings (env `..._RETRIEVER__URL`)."""

    url: str = "http://127.0.0.1:8001"
    max_connections: int = Field(100, ge=1)
    token: SecretStr | None = None


class CircuitBreaker:
    """Consecutive-failure breaker: open after N failures, one trial call after `reset_s`.

    A trial whose outcome is never recorded (the caller was cancelled by a deadline, a client went
    away) expires after `trial_timeout_s` (default: `reset_s`, at least 1 s), so the breaker cannot stay
    open forever after the upstream recovers. `clock` (seconds, monotonic) is replaceable for tests.
    """

    def __init__(self, failures: int, reset_s: float, trial_timeout_s: float | None = None) -> None:
        self.threshold = failures
        self.reset_s = reset_s
        self.trial_timeout_s = max(reset_s, 1.0) if trial_timeout_s is None else trial_timeout_s
        self.clock: Callable[[], float] = time.monotonic
        self.failures = 0
        self.opened_at: float | None = None
        self._trial_started: float | None = None

    @property
    def state(self) -> str:
        if self.opened_at is None:
            return "closed"
        return "half_open" if self.clock() - self.opened_at >= self.reset_s else "open"

    @property
    def _trial_in_flight(self) -> bool:
        return self._trial_started is not None and self.clock() - self._trial_started < self.trial_timeout_s

    def allow(self) -> bool:
        state = self.state
        if state == "closed":
            return True
        if state == "half_open" and not self._trial_in_flight:
            self._trial_started = self.clock()
            return True
        return False

    def retry_after(self) -> float:
        if self.opened_at is None:
            return 0.0
        return max(0.5, self.reset_s - (self.clock() - self.opened_at))

    def record_success(self) -> None:
        self.failures = 0
        self.opened_at = None
        self._trial_started = None

    def record_neutral(self) -> None:
        """An answer that says nothing about the upstream's health: a trial it was is over, nothing else."""
        self._trial_started = None

    def record_failure(self) -> None:
        self.failures += 1
        self._trial_started = None
        if self.failures >= self.threshold:
            self.opened_at = self.clock()


def backoff_delay(attempt: int, base: float, cap: float = MAX_RETRY_PAUSE_S) -> float:
    """Full-jitter exponential backoff."""
    return random.uniform(0, min(cap, base * (2**attempt)))  # noqa: S311 - jitter, not crypto


def parse_retry_after(value: str | None) -> float | None:
    """Seconds from a Retry-After header; None when absent or not a finite number (HTTP dates, "nan"),
    clamped to [0, 1 h] so a hostile upstream cannot make us sleep forever or answer with garbage."""
    if value is None:
        return None
    try:
        seconds = float(value)
    except ValueError:
        return None
    return min(max(seconds, 0.0), MAX_RETRY_AFTER_S) if math.isfinite(seconds) else None


def _envelope(body: Any) -> tuple[str | None, str | None, str | None]:
    """(type, message, param) of an error envelope, or of FastAPI's `{"detail"}`; Nones where absent."""
    if isinstance(body, dict) and isinstance(body.get("error"), dict):
        error = body["error"]
        param = error.get("param")
        return (str(error["type"]) if "type" in error else None,
                str(error["message"]) if "message" in error else None,
                param[:200] if isinstance(param, str) else None)
    if isinstance(body, dict) and "detail" in body:
        return None, str(body["detail"]), None
    return None, None, None


def error_class(status: int) -> type[ServiceError]:
    """The exception of an upstream's error answer: 503 unavailable, 504 timed out, any other 5xx failed,
    a 4xx its own class (400, 401, 403, 404, 409, 413, 415, 422, 429; any other 4xx is a 400)."""
    if status == 503:
        return UpstreamUnavailable
    if status >= 500:
        return UpstreamTimeout if status == 504 else UpstreamError
    return next((cls for cls in ERROR_CLASSES if cls.status == status), BadRequest)


def decode_error(name: str, response: Response) -> ServiceError:
    """Turn an upstream error response (envelope or not) into our exception hierarchy."""
    message = response.reason_phrase or "error"
    param: str | None = None
    try:
        _, found, param = _envelope(response.json())
        message = found or message
    except ValueError:
        if response.text:
            message = response.text[:200]
    retry_after = parse_retry_after(response.headers.get("retry-after"))
    error = error_class(response.status_code)(f"{name}: {message[:1000]}", param=param, retry_after=retry_after)
    error.upstream_status = response.status_code
    return error


def decode_error_event(name: str, data: str) -> ServiceError:
    """An `error` event of a stream (the error envelope, no status) as the exception its type names."""
    try:
        type_, message, param = _envelope(orjson.loads(data))
    except orjson.JSONDecodeError:
        type_, message, param = None, None, None
    classes: list[type[ServiceError]] = [*ERROR_CLASSES, UpstreamUnavailable]
    cls = next((c for c in classes if c.type == type_), UpstreamError)
    return cls(f"{name}: {(message or 'the stream failed')[:1000]}", param=param)


Refusal = Callable[[ServiceError], ServiceError]
"""What a caller makes of an upstream's 4xx answer that is not worth a retry (decoded by `decode_error`)."""


class ServiceClient:
    """One upstream behind the one call policy (module docstring); the typed clients subclass it. `sleep`
    (the pause between attempts) and `breaker` are attributes, so tests can replace them."""

    name = "service"

    def __init__(self, settings: ClientSettings, *, transport: httpx.AsyncBaseTransport | None = None,
                 metrics: ServiceMetrics | None = None, name: str | None = None, retry_timeouts: bool = True,
                 upstream_text: bool = True) -> None:
        self.settings = settings
        self.retry_timeouts = retry_timeouts
        self.upstream_text = upstream_text
        self.name = name or self.name
        self.metrics = metrics
        self.breaker = CircuitBreaker(settings.breaker_failures, settings.breaker_reset_s)
        self.sleep: Callable[[float], Awaitable[None]] | None = None  # None: asyncio.sleep
        headers = {}
        if settings.token is not None:
            headers["Authorization"] = f"Bearer {settings.token.get_secret_value()}"
        self._wire = make_wire(settings.url.rstrip("/"), timeout_s=settings.timeout_s,
                               connect_timeout_s=settings.connect_timeout_s, max_connections=settings.max_connections,
                               headers=headers, kind=settings.http_transport, transport=transport)

    async def aclose(self) -> None:
        await self._wire.aclose()

    def _observe(self, seconds: float, error: str | None) -> None:
        if self.metrics is None:
            return
        self.metrics.upstream_seconds.labels(self.name).observe(seconds)
        if error:
            self.metrics.upstream_errors.labels(self.name, error).inc()

    def _allow(self) -> None:
        if not self.breaker.allow():
            raise UpstreamUnavailable(f"{self.name} is unavailable (circuit open after repeated failures)",
                                      retry_after=self.breaker.retry_after())

    def _no_answer(self, exc: httpx.RequestError, seconds: float, timeout: float | None) -> ServiceError:
        """A request that got no response (timeout, refused, reset): counted, and what to raise."""
        self.breaker.record_failure()
        if isinstance(exc, httpx.ConnectTimeout):
            # nothing accepted the connection (e.g. a stopped container whose address is still cached): the
            # upstream is unreachable, not slow, so 503 + Retry-After rather than 504
            self._observe(seconds, "connect")
            return UpstreamUnavailable(f"{self.name} unreachable: no connection within "
                                       f"{self.settings.connect_timeout_s:g} s",
                                       retry_after=NO_CONNECTION_RETRY_AFTER_S)
        if isinstance(exc, httpx.TimeoutException):
            self._observe(seconds, "timeout")
            return UpstreamTimeout(f"{self.name} timed out after {timeout or self.settings.timeout_s:g} s")
        self._observe(seconds, "connect")  # refused, reset, protocol or decoding error
        return UpstreamUnavailable(f"{self.name} unreachable: {type(exc).__name__}",
                                   retry_after=NO_CONNECTION_RETRY_AFTER_S)

    def _error_answer(self, response: Response, seconds: float, caller_body: bool = False) -> ServiceError:
        """An error answer (status >= 400): counted (a 5xx is a breaker failure, except a 500 to a body the
        caller shaped; the upstream that sent a 4xx is alive), and decoded into what to raise."""
        if caller_body and response.status_code == 500:
            self.breaker.record_neutral()
        elif response.status_code >= 500:
            self.breaker.record_failure()
        else:
            self.breaker.record_success()
        self._observe(seconds, str(response.status_code))
        error = decode_error(self.name, response)
        if self.upstream_text:
            return error
        logger.warning("%s answered %d: %s", self.name, response.status_code, error.message)
        plain = type(error)(f"{self.name} answered HTTP {response.status_code}", param=error.param,
                            retry_after=error.retry_after)
        plain.upstream_status = response.status_code
        return plain

    def _span_attributes(self, method: str, path: str, attempt: int) -> tracing.Attributes | None:
        """A call's span: the upstream, method, URL and, for a retry, its number (None while not tracing)."""
        if not tracing.enabled():
            return None
        attributes: dict[str, str | int] = {"peer.service": self.name, "http.request.method": method,
                                            "url.full": f"{self.settings.url.rstrip('/')}{path}"}
        if attempt:
            attributes["http.request.resend_count"] = attempt
        return attributes

    async def _pause(self, attempt: int, retry_after: float | None) -> None:
        """The backoff before the next attempt; at least the upstream's own Retry-After, where it sent one."""
        delay = backoff_delay(attempt, self.settings.backoff_s)
        if retry_after:
            delay = max(delay, min(retry_after, MAX_RETRY_PAUSE_S))
        await (asyncio.sleep if self.sleep is None else self.sleep)(delay)

    @asynccontextmanager
    async def _call(self, method: str, path: str, *, json: Any, timeout: float | None, retries: int | None,
                    refusal: Refusal | None, read: bool, caller_body: bool = False
                    ) -> AsyncIterator[StreamResponse]:
        """The retry loop of `request` and `stream`: yields the first successful response (read whole when
        `read`); raises the last failure, or a 4xx or 500 answer at once (a 4xx through `refusal` where given)."""
        max_retries = self.settings.max_retries if retries is None else retries
        rid = get_request_id()
        headers = {REQUEST_ID_HEADER: rid} if rid else {}
        last: ServiceError | None = None
        for attempt in range(max_retries + 1):
            self._allow()
            t0 = time.perf_counter()
            retry_after = None  # the upstream's; the one we give our caller after no answer is not its
            async with AsyncExitStack() as stack:
                sent = dict(headers)  # + this attempt's traceparent, when tracing
                attempt_span = stack.enter_context(tracing.client_span(
                    f"{method} {path}", sent, self._span_attributes(method, path, attempt)))
                try:
                    if read:  # the wire's cheaper path for a body read at once
                        response: StreamResponse = await self._wire.send(method, path, json=json, headers=sent,
                                                                         timeout=timeout)
                    else:
                        response = await stack.enter_async_context(
                            self._wire.stream(method, path, json=json, headers=sent, timeout=timeout))
                    failed = response.status_code >= 400
                    if failed and not read:
                        response = Response(response.status_code, response.headers, await response.aread(),
                                            response.reason_phrase)
                except httpx.RequestError as exc:
                    last = self._no_answer(exc, time.perf_counter() - t0, timeout)
                    tracing.failed(attempt_span, type(exc).__name__)
                    if isinstance(last, UpstreamTimeout) and not self.retry_timeouts:
                        raise last from exc
                else:
                    tracing.answered(attempt_span, response.status_code)
                    if not failed:
                        self.breaker.record_success()
                        yield response  # outside the try: the caller's own errors are not ours to retry
                        self._observe(time.perf_counter() - t0, None)
                        return
                    assert isinstance(response, Response)
                    last = self._error_answer(response, time.perf_counter() - t0, caller_body)
                    if response.status_code not in RETRY_STATUSES:
                        raise last if refusal is None or response.status_code >= 500 else refusal(last)
                    retry_after = last.retry_after
            if attempt < max_retries:
                await self._pause(attempt, retry_after)
        assert last is not None
        raise last

    async def request(self, method: str, path: str, *, json: Any = None, timeout: float | None = None,
                      retries: int | None = None, refusal: Refusal | None = None, caller_body: bool = False
                      ) -> Response:
        """Send with the policy's retries and breaker; the response read whole. Raises ServiceError."""
        async with self._call(method, path, json=json, timeout=timeout, retries=retries, refusal=refusal,
                              read=True, caller_body=caller_body) as response:
            assert isinstance(response, Response)
            return response

    def stream(self, method: str, path: str, *, json: Any = None, timeout: float | None = None,
               retries: int | None = None, refusal: Refusal | None = None, caller_body: bool = False
               ) -> AbstractAsyncContextManager[StreamResponse]:
        """Like `request`, for a response read as it arrives (server-sent events): retried the same way
        until a successful status; the body is read inside the block (`timeout`: between reads)."""
        return self._call(method, path, json=json, timeout=timeout, retries=retries, refusal=refusal, read=False,
                          caller_body=caller_body)

    async def post_model(self, path: str, body: BaseModel, response_model: type[M], *,
                         timeout: float | None = None, retries: int | None = None) -> M:
        response = await self.request("POST", path, json=body.model_dump(mode="json", exclude_none=True),
                                      timeout=timeout, retries=retries)
        try:
            return response_model.model_validate_json(response.content)
        except ValueError as exc:
            raise UpstreamError(f"{self.name} returned an unexpected response shape") from exc

    async def ready(self, path: str = "/health/ready") -> str:
        """"ok" or the reason this upstream is not ready (for the caller's own readiness check): one GET of
        `path`, outside the retries and the breaker."""
        try:
            async with self._wire.stream("GET", path, timeout=2.0) as response:
                status = response.status_code
        except httpx.HTTPError as exc:
            return f"{self.name} unreachable: {type(exc).__name__}"
        return "ok" if status == 200 else f"{self.name} not ready ({status})"
