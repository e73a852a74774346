"""The wire under `ServiceClient` (`plugsearch.common.http`): one request out, status + headers + body back.

`AiohttpWire` (default): aiohttp's pool, used directly: a search makes several upstream calls, and aiohttp
does less work per request than httpx over httpcore. `HttpxWire`: for an injected transport (tests) or
`http_transport="httpx"`. Both raise httpx's exception types, so callers handle one family whatever the wire.
"""

from __future__ import annotations

import json as stdjson
from collections.abc import AsyncIterator, Iterator, Mapping
from contextlib import AbstractAsyncContextManager, asynccontextmanager, contextmanager
from dataclasses import dataclass
from typing import Any, Literal, Protocol

import httpx
import orjson

HttpTransport = Literal["aiohttp", "httpx"]


@dataclass(slots=True, eq=False)
class Response:
    """A response read to the end (what `ServiceClient.request` returns), whatever the wire; it can be read as
    a `StreamResponse` too."""

    status_code: int
    headers: Mapping[str, str]
    content: bytes
    reason_phrase: str

    @property
    def text(self) -> str:
        return self.content.decode("utf-8", errors="replace")

    def json(self) -> Any:
        try:
            return orjson.loads(self.content)
        except orjson.JSONDecodeError as exc:
            raise ValueError(str(exc)) from exc

    async def aread(self) -> bytes:
        return self.content

    async def aiter_lines(self) -> AsyncIterator[str]:
        for line in self.text.splitlines():
            yield line


class StreamResponse(Protocol):
    """A response whose body is read as it arrives (`httpx.Response` in a `stream()` block has all of it)."""

    @property
    def status_code(self) -> int: ...

    @property
    def headers(self) -> Mapping[str, str]: ...

    @property
    def reason_phrase(self) -> str: ...

    async def aread(self) -> bytes: ...

    def aiter_lines(self) -> AsyncIterator[str]: ...


class Wire(Protocol):
    async def send(self, method: str, path: str, *, json: Any = None, headers: Mapping[str, str] | None = None,
                   timeout: float | None = None) -> Response:
        """The response read whole (the cheaper path for a body read at once)."""
        ...

    def stream(self, method: str, path: str, *, json: Any = None, headers: Mapping[str, str] | None = None,
               timeout: float | None = None) -> AbstractAsyncContextManager[StreamResponse]:
        """The response as soon as its headers arrive; the body is read inside the block (server-sent
        events). `timeout` bounds connecting and each wait between reads, not the whole body."""
        ...

    async def aclose(self) -> None: ...


def dumps(body: Any) -> bytes:
    """Request JSON with orjson (NaN and infinities become null); the standard library for what orjson
    refuses (integers over 64 bits)."""
    try:
        return orjson.dumps(body)
    except orjson.JSONEncodeError:
        return stdjson.dumps(body, ensure_ascii=False, separators=(",", ":"), allow_nan=False).encode()


class HttpxWire:
    def __init__(self, base_url: str, *, timeout_s: float, connect_timeout_s: float, max_connections: int,
                 headers: Mapping[str, str], transport: httpx.AsyncBaseTransport | None = None) -> None:
        self.client = httpx.AsyncClient(
            base_url=base_url, timeout=httpx.Timeout(timeout_s, connect=connect_timeout_s),
            limits=httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections),
            headers=dict(headers), transport=transport)

    def _request(self, method: str, path: str, json: Any, headers: Mapping[str, str] | None,
                 timeout: float | None) -> httpx.Request:
        if json is not None:
            headers = {"content-type": "application/json", **(headers or {})}
        return self.client.build_request(method, path, headers=headers,
                                         content=None if json is None else dumps(json),
                                         timeout=httpx.USE_CLIENT_DEFAULT if timeout is None else timeout)

    async def send(self, method: str, path: str, *, json: Any = None, headers: Mapping[str, str] | None = None,
                   timeout: float | None = None) -> Response:
        r = await self.client.send(self._request(method, path, json, headers, timeout))
        return Response(r.status_code, r.headers, r.content, r.reason_phrase)

    @asynccontextmanager
    async def stream(self, method: str, path: str, *, json: Any = None, headers: Mapping[str, str] | None = None,
                     timeout: float | None = None) -> AsyncIterator[StreamResponse]:
        response = await self.client.send(self._request(method, path, json, headers, timeout), stream=True)
        try:
            yield response
        finally:
            await response.aclose()

    async def aclose(self) -> None:
        await self.client.aclose()


class _AiohttpStream:
    """aiohttp's response; errors while reading the body are httpx's too (they surface in the caller's frame)."""

    __slots__ = ("_method", "_response", "_url", "headers", "reason_phrase", "status_code")

    def __init__(self, response: Any, method: str, url: str) -> None:
        self._response = response
        self._method = method
        self._url = url
        self.status_code: int = response.status
        self.headers: Mapping[str, str] = response.headers
        self.reason_phrase: str = response.reason or ""

    async def aread(self) -> bytes:
        with _as_httpx_errors(self._method, self._url):
            content: bytes = await self._response.read()
        return content

    async def aiter_lines(self) -> AsyncIterator[str]:
        with _as_httpx_errors(self._method, self._url):
            async for line in self._response.content:  # aiohttp's StreamReader yields one line at a time
                yield line.decode("utf-8", errors="replace").rstrip("\r\n")


class AiohttpWire:
    """aiohttp's pool (created on first use, inside the running loop). Timeouts follow httpx's meaning:
    `timeout_s` for waiting on a pooled connection and between reads, `connect_timeout_s` to connect."""

    def __init__(self, base_url: str, *, timeout_s: float, connect_timeout_s: float, max_connections: int,
                 headers: Mapping[str, str]) -> None:
        self.base_url = base_url.rstrip("/")
        self.timeout_s = timeout_s
        self.connect_timeout_s = connect_timeout_s
        self.max_connections = max_connections
        self.headers = dict(headers)
        self._session: Any = None
        self._timeouts: dict[float | None, Any] = {}

    def _timeout(self, timeout: float | None) -> Any:
        import aiohttp

        found = self._timeouts.get(timeout)
        if found is None:
            t = self.timeout_s if timeout is None else timeout
            found = aiohttp.ClientTimeout(total=None, connect=t, sock_connect=min(self.connect_timeout_s, t),
                                          sock_read=t)
            self._timeouts[timeout] = found
        return found

    def _get_session(self) -> Any:
        import aiohttp

        if self._session is None or self._session.closed:
            # idle connections are dropped after 4 s, before uvicorn's default 5 s keep-alive (vLLM, llama.cpp's
            # server) closes them under us; names are resolved again after 10 s, since a container recreated by
            # compose may come back on another address
            connector = aiohttp.TCPConnector(limit=self.max_connections, limit_per_host=0, ttl_dns_cache=10,
                                             keepalive_timeout=4.0)
            self._session = aiohttp.ClientSession(connector=connector, headers=self.headers,
                                                  cookie_jar=aiohttp.DummyCookieJar(), timeout=self._timeout(None),
                                                  auto_decompress=True)
        return self._session

    def _request(self, method: str, path: str, json: Any, headers: Mapping[str, str] | None,
                 timeout: float | None) -> tuple[str, Any]:
        """(url, aiohttp's request context manager) for one call."""
        url = self.base_url + path
        data = None
        if json is not None:
            data = dumps(json)
            headers = {"Content-Type": "application/json", **(headers or {})}
        return url, self._get_session().request(method, url, data=data, headers=headers,
                                                timeout=self._timeout(timeout), allow_redirects=False)

    async def send(self, method: str, path: str, *, json: Any = None, headers: Mapping[str, str] | None = None,
                   timeout: float | None = None) -> Response:
        url, request = self._request(method, path, json, headers, timeout)
        with _as_httpx_errors(method, url):
            async with request as resp:
                return Response(resp.status, resp.headers, await resp.read(), resp.reason or "")

    @asynccontextmanager
    async def stream(self, method: str, path: str, *, json: Any = None, headers: Mapping[str, str] | None = None,
                     timeout: float | None = None) -> AsyncIterator[StreamResponse]:
        url, request = self._request(method, path, json, headers, timeout)
        with _as_httpx_errors(method, url):
            async with request as resp:
                yield _AiohttpStream(resp, method, url)

    async def aclose(self) -> None:
        if self._session is not None and not self._session.closed:
            await self._session.close()
        self._session = None


@contextmanager
def _as_httpx_errors(method: str, url: str) -> Iterator[None]:
    """aiohttp's exceptions as httpx's, so callers handle one family whatever the wire."""
    import aiohttp

    try:
        yield
    except aiohttp.ConnectionTimeoutError as exc:  # no connection within the connect / pool timeout
        raise httpx.ConnectTimeout(str(exc) or "connect timeout", request=httpx.Request(method, url)) from exc
    except (TimeoutError, aiohttp.ServerTimeoutError) as exc:
        raise httpx.ReadTimeout(str(exc) or "read timeout", request=httpx.Request(method, url)) from exc
    except aiohttp.ClientConnectorError as exc:  # refused, unreachable, DNS
        raise httpx.ConnectError(str(exc) or type(exc).__name__, request=httpx.Request(method, url)) from exc
    except aiohttp.ClientError as exc:  # reset, disconnected mid-response, malformed HTTP
        raise httpx.RemoteProtocolError(str(exc) or type(exc).__name__,
                                        request=httpx.Request(method, url)) from exc


def make_wire(base_url: str, *, timeout_s: float, connect_timeout_s: float, max_connections: int,
              headers: Mapping[str, str], kind: HttpTransport = "aiohttp",
              transport: httpx.AsyncBaseTransport | None = None) -> Wire:
    """`HttpxWire` for an injected transport or `kind="httpx"`, else `AiohttpWire`."""
    if transport is not None or kind == "httpx":
        return HttpxWire(base_url, timeout_s=timeout_s, connect_timeout_s=connect_timeout_s,
                         max_connections=max_connections, headers=headers, transport=transport)
    return AiohttpWire(base_url, timeout_s=timeout_s, connect_timeout_s=connect_timeout_s,
                       max_connections=max_connections, headers=headers)
