"""The HTTP/1.1 protocol every service serves with: uvicorn's httptools protocol plus what the application
cannot do itself (issue 21): complete headers within `header_timeout_s` from the connection or the request's
first byte, else closed (408 envelope when some bytes came: slowloris); request line + headers over
`max_header_bytes` refused with 431 (httptools buffers any size); parser refusals in the JSON error envelope.
The limits come from the served app's `app.state.settings`, so uvicorn's options (and spawned workers) can
name the class itself.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

from plugsearch.common.errors import ErrorDetail, ErrorEnvelope
from plugsearch.common.logging import new_request_id

logger = logging.getLogger(__name__)

DEFAULT_HEADER_TIMEOUT_S = 10.0
DEFAULT_MAX_HEADER_BYTES = 32 * 1024


def _limits(config: Any) -> tuple[float, int]:
    """(header timeout, max header bytes) of the app behind uvicorn's wrappers, cached on its config."""
    cached = getattr(config, "_plugsearch_limits", None)
    if cached is None:
        app = config.loaded_app
        for _ in range(8):  # uvicorn's middlewares (proxy headers, message logger) keep the app as `.app`
            if getattr(getattr(app, "state", None), "settings", None) is not None or not hasattr(app, "app"):
                break
            app = app.app
        settings = getattr(getattr(app, "state", None), "settings", None)
        cached = (float(getattr(settings, "header_timeout_s", DEFAULT_HEADER_TIMEOUT_S)),
                  int(getattr(settings, "max_header_bytes", DEFAULT_MAX_HEADER_BYTES)))
        config._plugsearch_limits = cached
    return cached  # type: ignore[no-any-return]


def error_response(status: int, type_: str, message: str) -> bytes:
    """A complete `Connection: close` HTTP response carrying the error envelope."""
    body = json.dumps(ErrorEnvelope(error=ErrorDetail(type=type_, message=message,
                                                      request_id=new_request_id())).model_dump()).encode()
    return b"".join([STATUS_LINE[status], b"content-type: application/json\r\n",
                     b"content-length: ", str(len(body)).encode(), b"\r\n", b"connection: close\r\n\r\n", body])


class GuardedHttpToolsProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with header timeouts, a header size limit and enveloped parse errors."""

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._header_timeout_s, self._max_header_bytes = _limits(self.config)
        self._in_headers = True
        self._refused = False
        self._raw_header_bytes = 0  # bytes received while a request's headers are incomplete
        self._header_bytes = 0  # request line + headers parsed so far
        self._header_timer: asyncio.TimerHandle | None = None
        self._arm_header_timer()

    def _arm_header_timer(self) -> None:
        if self._header_timer is None:
            self._header_timer = self.loop.call_later(self._header_timeout_s, self._headers_too_slow)

    def _disarm_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _refuse(self, status: int, type_: str, message: str) -> None:
        self._refused = True
        self._disarm_header_timer()
        if not self.transport.is_closing():
            self.transport.write(error_response(status, type_, message))
            self.transport.close()

    def _headers_too_slow(self) -> None:
        self._header_timer = None
        if self.transport.is_closing():
            return
        if not self._raw_header_bytes:
            self.transport.close()  # it never said anything: nothing to answer
            return
        self._refuse(408, "request_timeout", f"request headers not received within {self._header_timeout_s:g} s")

    def _headers_too_large(self) -> None:
        self._refuse(431, "headers_too_large", f"request headers over {self._max_header_bytes} bytes")

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_header_timer()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return
        if self._in_headers:
            self._raw_header_bytes += len(data)
            self._arm_header_timer()
        super().data_received(data)
        if self._in_headers and not self._refused and self._raw_header_bytes > self._max_header_bytes:
            self._headers_too_large()  # still incomplete past the limit: stop buffering it

    def on_message_begin(self) -> None:
        self._header_bytes = 0
        super().on_message_begin()

    def on_url(self, url: bytes) -> None:
        self._header_bytes += len(url)
        super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        self._header_bytes += len(name) + len(value) + 4
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        self._in_headers = False
        self._disarm_header_timer()
        if self._header_bytes > self._max_header_bytes:
            self._headers_too_large()
            return
        super().on_headers_complete()

    def on_body(self, body: bytes) -> None:
        if not self._refused:
            super().on_body(body)

    def on_message_complete(self) -> None:
        if self._refused:
            return
        super().on_message_complete()
        self._in_headers = True  # what comes next is the next request's headers
        self._raw_header_bytes = 0

    def send_400_response(self, msg: str) -> None:
        logger.info("refused a malformed HTTP request: %s", msg)
        self._refuse(400, "invalid_http", "malformed HTTP request")
